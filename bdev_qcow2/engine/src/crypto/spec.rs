//! A cipher as a LUKS header names it (`aes`, `xts-plain64`, key bytes): the block
//! cipher's key size, the mode and the IV generator. The types the cipher's backends share.

use super::hash::HashAlg;

/// Bytes of one encrypted sector (LUKS1 and QEMU's qcow2 LUKS use 512).
pub const SECTOR_BYTES: usize = 512;

/// The block cipher and its key size, as QEMU names them (`aes-256`, `twofish-128`): the
/// ciphers QEMU's LUKS creates and opens (`sm4` is not built into the QEMU we match).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CipherAlg {
    /// aes-128
    Aes128,
    /// aes-192
    Aes192,
    /// aes-256
    Aes256,
    /// twofish-128
    Twofish128,
    /// twofish-192
    Twofish192,
    /// twofish-256
    Twofish256,
    /// serpent-128
    Serpent128,
    /// serpent-192
    Serpent192,
    /// serpent-256
    Serpent256,
    /// cast5-128 (8-byte blocks: CBC only)
    Cast5,
}

impl CipherAlg {
    /// Every cipher, in QEMU's order of names.
    pub const ALL: [Self; 10] = [
        Self::Aes128,
        Self::Aes192,
        Self::Aes256,
        Self::Cast5,
        Self::Serpent128,
        Self::Serpent192,
        Self::Serpent256,
        Self::Twofish128,
        Self::Twofish192,
        Self::Twofish256,
    ];

    /// The cipher a LUKS header's `cipher_name` (`twofish`) names with a key of `key_len`
    /// bytes (one key, for XTS).
    pub fn from_name(name: &str, key_len: usize) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.family() == name && a.key_len() == key_len)
    }

    /// From QEMU's name (`twofish-256`), as `encrypt.cipher-alg` takes it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// QEMU's name (`aes-256`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Aes128 => "aes-128",
            Self::Aes192 => "aes-192",
            Self::Aes256 => "aes-256",
            Self::Twofish128 => "twofish-128",
            Self::Twofish192 => "twofish-192",
            Self::Twofish256 => "twofish-256",
            Self::Serpent128 => "serpent-128",
            Self::Serpent192 => "serpent-192",
            Self::Serpent256 => "serpent-256",
            Self::Cast5 => "cast5-128",
        }
    }

    /// The LUKS header's `cipher_name` (`aes`).
    pub fn family(self) -> &'static str {
        match self {
            Self::Aes128 | Self::Aes192 | Self::Aes256 => "aes",
            Self::Twofish128 | Self::Twofish192 | Self::Twofish256 => "twofish",
            Self::Serpent128 | Self::Serpent192 | Self::Serpent256 => "serpent",
            Self::Cast5 => "cast5",
        }
    }

    /// Bytes of its key.
    pub fn key_len(self) -> usize {
        match self {
            Self::Aes128 | Self::Twofish128 | Self::Serpent128 | Self::Cast5 => 16,
            Self::Aes192 | Self::Twofish192 | Self::Serpent192 => 24,
            Self::Aes256 | Self::Twofish256 | Self::Serpent256 => 32,
        }
    }

    /// Bytes of its block (and of a CBC IV).
    pub fn block_len(self) -> usize {
        match self {
            Self::Cast5 => 8,
            _ => 16,
        }
    }

    /// Whether it is AES (OpenSSL's EVP may run it).
    pub fn is_aes(self) -> bool {
        matches!(self, Self::Aes128 | Self::Aes192 | Self::Aes256)
    }

    /// The cipher of ESSIV over this one with a `digest_len`-byte hash, as QEMU picks it
    /// (`qcrypto_block_luks_essiv_cipher`): the same cipher keyed by the whole digest, so
    /// the variant of the same family whose key is as long as the digest; none when the
    /// family has no such key size (CAST5 has only 16 bytes).
    pub fn essiv(self, digest_len: usize) -> Option<Self> {
        Self::from_name(self.family(), digest_len)
    }
}

/// Block cipher mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// XTS: the key is two keys of the block cipher (16-byte blocks only).
    Xts,
    /// CBC.
    Cbc,
}

/// How a sector's IV is made from its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGen {
    /// The low 32 bits, little endian.
    Plain,
    /// The 64-bit number, little endian.
    Plain64,
    /// plain64 encrypted with the block cipher keyed by the hash of the key.
    Essiv(HashAlg),
}

impl IvGen {
    /// QEMU's name (`plain64`).
    pub fn name(self) -> &'static str {
        match self {
            IvGen::Plain => "plain",
            IvGen::Plain64 => "plain64",
            IvGen::Essiv(_) => "essiv",
        }
    }
}

/// A cipher as a LUKS header names it: name, mode and IV generator, key length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CipherSpec {
    /// The block cipher (the size of one key, for XTS).
    pub alg: CipherAlg,
    /// Mode.
    pub mode: Mode,
    /// IV generator.
    pub ivgen: IvGen,
}

impl CipherSpec {
    /// From the header's `cipher_name`, `cipher_mode` (`xts-plain64`, `cbc-essiv:sha256`)
    /// and `key_bytes`; `None` for anything we do not implement.
    pub fn parse(name: &str, mode: &str, key_bytes: usize) -> Option<Self> {
        let (m, iv) = mode.split_once('-')?;
        let mode = match m {
            "xts" => Mode::Xts,
            "cbc" => Mode::Cbc,
            _ => return None,
        };
        let ivgen = match iv.split_once(':') {
            None if iv == "plain" => IvGen::Plain,
            None if iv == "plain64" => IvGen::Plain64,
            Some(("essiv", h)) => IvGen::Essiv(HashAlg::parse(h)?),
            // QEMU (as dm-crypt) records and then ignores a hash named with plain(64).
            Some(("plain", h)) if HashAlg::parse(h).is_some() => IvGen::Plain,
            Some(("plain64", h)) if HashAlg::parse(h).is_some() => IvGen::Plain64,
            _ => return None,
        };
        let one = match mode {
            Mode::Xts if key_bytes.is_multiple_of(2) => key_bytes / 2,
            Mode::Xts => return None,
            Mode::Cbc => key_bytes,
        };
        let alg = CipherAlg::from_name(name, one)?;
        if mode == Mode::Xts && alg.block_len() != 16 {
            // XTS is defined over 16-byte blocks (QEMU: "Unsupported cipher mode xts").
            return None;
        }
        let spec = CipherSpec { alg, mode, ivgen };
        // ESSIV's cipher is keyed by the digest: some key size of the family must fit it.
        if let IvGen::Essiv(_) = ivgen {
            spec.essiv_alg()?;
        }
        Some(spec)
    }

    /// The cipher ESSIV encrypts sector numbers with (`None` without ESSIV, or where
    /// QEMU has none for the hash).
    pub fn essiv_alg(&self) -> Option<CipherAlg> {
        match self.ivgen {
            IvGen::Essiv(h) => self.alg.essiv(h.digest_len()),
            _ => None,
        }
    }

    /// Bytes of key the cipher takes.
    pub fn key_bytes(&self) -> usize {
        let one = self.alg.key_len();
        match self.mode {
            Mode::Xts => 2 * one,
            Mode::Cbc => one,
        }
    }

    /// QEMU's name of the mode (`xts`).
    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            Mode::Xts => "xts",
            Mode::Cbc => "cbc",
        }
    }
}
