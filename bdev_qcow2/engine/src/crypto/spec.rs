//! A cipher as a LUKS header names it (`aes`, `xts-plain64`, key bytes): the block
//! cipher's key size, the mode and the IV generator. The types the cipher's backends share.

use super::hash::HashAlg;

/// Bytes of one encrypted sector (LUKS1 and QEMU's qcow2 LUKS use 512).
pub const SECTOR_BYTES: usize = 512;

/// The block cipher's key size (only AES is offered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AesBits {
    /// aes-128
    B128,
    /// aes-192
    B192,
    /// aes-256
    B256,
}

impl AesBits {
    pub(super) fn from_key_len(n: usize) -> Option<Self> {
        match n {
            16 => Some(Self::B128),
            24 => Some(Self::B192),
            32 => Some(Self::B256),
            _ => None,
        }
    }
    /// QEMU's name (`aes-256`).
    pub fn name(self) -> &'static str {
        match self {
            Self::B128 => "aes-128",
            Self::B192 => "aes-192",
            Self::B256 => "aes-256",
        }
    }
}

/// Block cipher mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// XTS: the key is two AES keys.
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
    /// plain64 encrypted with AES keyed by the hash of the key.
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
    /// AES key size (of one key, for XTS).
    pub bits: AesBits,
    /// Mode.
    pub mode: Mode,
    /// IV generator.
    pub ivgen: IvGen,
}

impl CipherSpec {
    /// From the header's `cipher_name`, `cipher_mode` (`xts-plain64`, `cbc-essiv:sha256`)
    /// and `key_bytes`; `None` for anything we do not implement.
    pub fn parse(name: &str, mode: &str, key_bytes: usize) -> Option<Self> {
        if name != "aes" {
            return None;
        }
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
        let bits = AesBits::from_key_len(one)?;
        if let IvGen::Essiv(h) = ivgen {
            // ESSIV's AES is keyed by the digest: its length must be an AES key length.
            AesBits::from_key_len(h.digest_len())?;
        }
        Some(CipherSpec { bits, mode, ivgen })
    }

    /// Bytes of key the cipher takes.
    pub fn key_bytes(&self) -> usize {
        let one = match self.bits {
            AesBits::B128 => 16,
            AesBits::B192 => 24,
            AesBits::B256 => 32,
        };
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
