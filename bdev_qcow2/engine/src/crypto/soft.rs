//! The sector cipher in Rust (RustCrypto's `aes`, our XTS): what OpenSSL does not serve
//! (XTS over AES-192), and the reference the EVP path is checked against. Its key schedules are
//! zeroized when dropped (the `aes` crate's `zeroize` feature).

use super::spec::{AesBits, Mode};
use super::xts::Xts as Xts128;
use super::CryptoError;
use aes::cipher::{BlockDecrypt, BlockEncrypt, InnerIvInit, KeyInit};
use aes::{Aes128, Aes192, Aes256};

/// AES keyed for one mode.
pub(super) enum Soft {
    Xts128(Box<Xts128<Aes128>>),
    Xts192(Box<Xts128<Aes192>>),
    Xts256(Box<Xts128<Aes256>>),
    Cbc128(Box<Aes128>),
    Cbc192(Box<Aes192>),
    Cbc256(Box<Aes256>),
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

/// AES keyed with `key` (its length picks the variant).
pub(super) fn aes<C: KeyInit>(key: &[u8]) -> Result<Box<C>, CryptoError> {
    C::new_from_slice(key)
        .map(Box::new)
        .map_err(|_| CryptoError::Key)
}

impl Soft {
    /// Keys `mode` over AES-`bits` with `key` (the whole key: both halves for XTS).
    pub(super) fn new(mode: Mode, bits: AesBits, key: &[u8]) -> Result<Self, CryptoError> {
        Ok(match (mode, bits) {
            (Mode::Xts, AesBits::B128) => Soft::Xts128(xts(key)?),
            (Mode::Xts, AesBits::B192) => Soft::Xts192(xts(key)?),
            (Mode::Xts, AesBits::B256) => Soft::Xts256(xts(key)?),
            (Mode::Cbc, AesBits::B128) => Soft::Cbc128(aes(key)?),
            (Mode::Cbc, AesBits::B192) => Soft::Cbc192(aes(key)?),
            (Mode::Cbc, AesBits::B256) => Soft::Cbc256(aes(key)?),
        })
    }

    /// Encrypts (`enc`) or decrypts one 512-byte sector in place with IV `iv`.
    pub(super) fn sector(&self, s: &mut [u8], iv: [u8; 16], enc: bool) {
        match self {
            Soft::Xts128(x) => x.sector(s, iv, enc),
            Soft::Xts192(x) => x.sector(s, iv, enc),
            Soft::Xts256(x) => x.sector(s, iv, enc),
            Soft::Cbc128(c) => cbc_run(c.as_ref(), s, iv, enc),
            Soft::Cbc192(c) => cbc_run(c.as_ref(), s, iv, enc),
            Soft::Cbc256(c) => cbc_run(c.as_ref(), s, iv, enc),
        }
    }
}

fn cbc_run<C>(c: &C, s: &mut [u8], iv: [u8; 16], enc: bool)
where
    C: BlockEncrypt + BlockDecrypt + aes::cipher::BlockCipher + Clone,
    C: aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    use aes::cipher::block_padding::NoPadding;
    use aes::cipher::{BlockDecryptMut, BlockEncryptMut};
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
