//! The sector cipher of a LUKS payload: AES in XTS or CBC mode, keyed by the master key,
//! with the IV of each 512-byte sector from its number (`plain`, `plain64`, `essiv`), as
//! QEMU's `crypto/block-luks.c` and its IV generators compute them.

use super::hash::HashAlg;
use super::xts::Xts as Xts128;
use super::CryptoError;
use aes::cipher::{
    BlockDecrypt, BlockDecryptMut, BlockEncrypt, BlockEncryptMut, InnerIvInit, KeyInit,
};
use aes::{Aes128, Aes192, Aes256, Block};

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
    fn from_key_len(n: usize) -> Option<Self> {
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

enum Keyed {
    Xts128(Box<Xts128<Aes128>>),
    Xts192(Box<Xts128<Aes192>>),
    Xts256(Box<Xts128<Aes256>>),
    Cbc128(Box<Aes128>),
    Cbc192(Box<Aes192>),
    Cbc256(Box<Aes256>),
}

enum Iv {
    Plain,
    Plain64,
    Essiv128(Box<Aes128>),
    Essiv192(Box<Aes192>),
    Essiv256(Box<Aes256>),
}

/// A keyed sector cipher. Its key schedules are zeroized when it is dropped (the `aes`
/// crate's `zeroize` feature).
pub struct SectorCipher {
    keyed: Keyed,
    iv: Iv,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SectorCipher(..)")
    }
}

fn xts<C>(key: &[u8]) -> Result<Box<Xts128<C>>, CryptoError>
where
    C: KeyInit
        + BlockEncrypt
        + BlockDecrypt
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    let half = key.len() / 2;
    let a = C::new_from_slice(&key[..half]).map_err(|_| CryptoError::Key)?;
    let b = C::new_from_slice(&key[half..]).map_err(|_| CryptoError::Key)?;
    Ok(Box::new(Xts128::new(a, b)))
}

fn aes<C: KeyInit>(key: &[u8]) -> Result<Box<C>, CryptoError> {
    C::new_from_slice(key)
        .map(Box::new)
        .map_err(|_| CryptoError::Key)
}

impl SectorCipher {
    /// Keys `spec` with `key` (its [`CipherSpec::key_bytes`] long).
    pub fn new(spec: &CipherSpec, key: &[u8]) -> Result<Self, CryptoError> {
        if key.len() != spec.key_bytes() {
            return Err(CryptoError::Key);
        }
        let keyed = match (spec.mode, spec.bits) {
            (Mode::Xts, AesBits::B128) => Keyed::Xts128(xts(key)?),
            (Mode::Xts, AesBits::B192) => Keyed::Xts192(xts(key)?),
            (Mode::Xts, AesBits::B256) => Keyed::Xts256(xts(key)?),
            (Mode::Cbc, AesBits::B128) => Keyed::Cbc128(aes(key)?),
            (Mode::Cbc, AesBits::B192) => Keyed::Cbc192(aes(key)?),
            (Mode::Cbc, AesBits::B256) => Keyed::Cbc256(aes(key)?),
        };
        let iv = match spec.ivgen {
            IvGen::Plain => Iv::Plain,
            IvGen::Plain64 => Iv::Plain64,
            IvGen::Essiv(h) => {
                // QEMU hashes the whole key (both halves for XTS).
                let mut salt = h.digest(key);
                let iv = match AesBits::from_key_len(salt.len()) {
                    Some(AesBits::B128) => Iv::Essiv128(aes(&salt)?),
                    Some(AesBits::B192) => Iv::Essiv192(aes(&salt)?),
                    Some(AesBits::B256) => Iv::Essiv256(aes(&salt)?),
                    None => return Err(CryptoError::Key),
                };
                zeroize::Zeroize::zeroize(&mut salt);
                iv
            }
        };
        Ok(SectorCipher { keyed, iv })
    }

    fn iv(&self, sector: u64) -> [u8; 16] {
        let mut b = [0u8; 16];
        match &self.iv {
            Iv::Plain => b[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            Iv::Plain64 => b[..8].copy_from_slice(&sector.to_le_bytes()),
            Iv::Essiv128(c) => essiv(c.as_ref(), sector, &mut b),
            Iv::Essiv192(c) => essiv(c.as_ref(), sector, &mut b),
            Iv::Essiv256(c) => essiv(c.as_ref(), sector, &mut b),
        }
        b
    }

    /// Encrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn encrypt(&self, sector: u64, data: &mut [u8]) {
        self.run(sector, data, true)
    }

    /// Decrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn decrypt(&self, sector: u64, data: &mut [u8]) {
        self.run(sector, data, false)
    }

    fn run(&self, first: u64, data: &mut [u8], enc: bool) {
        debug_assert!(data.len().is_multiple_of(SECTOR_BYTES));
        for (i, s) in data.chunks_exact_mut(SECTOR_BYTES).enumerate() {
            let iv = self.iv(first.wrapping_add(i as u64));
            match &self.keyed {
                Keyed::Xts128(x) => xts_run(x, s, iv, enc),
                Keyed::Xts192(x) => xts_run(x, s, iv, enc),
                Keyed::Xts256(x) => xts_run(x, s, iv, enc),
                Keyed::Cbc128(c) => cbc_run(c.as_ref(), s, iv, enc),
                Keyed::Cbc192(c) => cbc_run(c.as_ref(), s, iv, enc),
                Keyed::Cbc256(c) => cbc_run(c.as_ref(), s, iv, enc),
            }
        }
    }
}

fn essiv<C>(c: &C, sector: u64, out: &mut [u8; 16])
where
    C: BlockEncrypt + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    let mut b = Block::default();
    b[..8].copy_from_slice(&sector.to_le_bytes());
    c.encrypt_block(&mut b);
    out.copy_from_slice(&b);
}

fn xts_run<C>(x: &Xts128<C>, s: &mut [u8], iv: [u8; 16], enc: bool)
where
    C: BlockEncrypt
        + BlockDecrypt
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    x.sector(s, iv, enc)
}

fn cbc_run<C>(c: &C, s: &mut [u8], iv: [u8; 16], enc: bool)
where
    C: BlockEncrypt + BlockDecrypt + aes::cipher::BlockCipher + Clone,
    C: aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    use aes::cipher::block_padding::NoPadding;
    let n = s.len();
    // Whole sectors are whole blocks: NoPadding cannot fail on them.
    if enc {
        let _ = cbc::Encryptor::<C>::inner_iv_init(c.clone(), &iv.into())
            .encrypt_padded_mut::<NoPadding>(s, n);
    } else {
        let _ = cbc::Decryptor::<C>::inner_iv_init(c.clone(), &iv.into())
            .decrypt_padded_mut::<NoPadding>(s);
    }
}
