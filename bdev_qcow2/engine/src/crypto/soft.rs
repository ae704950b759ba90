//! The sector cipher in Rust (RustCrypto's block ciphers, our XTS, the `cbc` crate): what
//! OpenSSL does not serve (XTS over AES-192; Twofish, Serpent and CAST5, which QEMU's
//! LUKS also offers), and the reference the EVP path is checked against. Its key schedules
//! are zeroized when dropped (the cipher crates' `zeroize` feature).

use super::spec::{CipherAlg, Mode};
use super::xts::Xts;
use super::CryptoError;
use aes::cipher::{BlockCipher, BlockDecrypt, BlockEncrypt, InnerIvInit, KeyInit};
use aes::{Aes128, Aes192, Aes256};
use cast5::Cast5;
use serpent::Serpent;
use twofish::Twofish;

/// A block cipher keyed for one mode. One variant per cipher type: no dynamic dispatch
/// (AES's variants are those it always had; Twofish and Serpent take any of their key
/// sizes in one type).
pub(super) enum Soft {
    Xts128(Box<Xts<Aes128>>),
    Xts192(Box<Xts<Aes192>>),
    Xts256(Box<Xts<Aes256>>),
    Cbc128(Box<Aes128>),
    Cbc192(Box<Aes192>),
    Cbc256(Box<Aes256>),
    XtsTwofish(Box<Xts<Twofish>>),
    XtsSerpent(Box<Xts<Serpent>>),
    CbcTwofish(Box<Twofish>),
    CbcSerpent(Box<Serpent>),
    CbcCast5(Box<Cast5>),
}

fn xts<C>(key: &[u8]) -> Result<Box<Xts<C>>, CryptoError>
where
    C: KeyInit
        + BlockEncrypt
        + BlockDecrypt
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    let half = key.len() / 2;
    let a = C::new_from_slice(&key[..half]).map_err(|_| CryptoError::Key)?;
    let b = C::new_from_slice(&key[half..]).map_err(|_| CryptoError::Key)?;
    Ok(Box::new(Xts::new(a, b)))
}

/// A block cipher keyed with `key` (its length picks the key size).
pub(super) fn keyed<C: KeyInit>(key: &[u8]) -> Result<Box<C>, CryptoError> {
    C::new_from_slice(key)
        .map(Box::new)
        .map_err(|_| CryptoError::Key)
}

impl Soft {
    /// Keys `mode` over `alg` with `key` (the whole key: both halves for XTS).
    pub(super) fn new(mode: Mode, alg: CipherAlg, key: &[u8]) -> Result<Self, CryptoError> {
        use CipherAlg as A;
        Ok(match (mode, alg) {
            (Mode::Xts, A::Aes128) => Soft::Xts128(xts(key)?),
            (Mode::Xts, A::Aes192) => Soft::Xts192(xts(key)?),
            (Mode::Xts, A::Aes256) => Soft::Xts256(xts(key)?),
            (Mode::Cbc, A::Aes128) => Soft::Cbc128(keyed(key)?),
            (Mode::Cbc, A::Aes192) => Soft::Cbc192(keyed(key)?),
            (Mode::Cbc, A::Aes256) => Soft::Cbc256(keyed(key)?),
            (Mode::Xts, A::Twofish128 | A::Twofish192 | A::Twofish256) => {
                Soft::XtsTwofish(xts(key)?)
            }
            (Mode::Xts, A::Serpent128 | A::Serpent192 | A::Serpent256) => {
                Soft::XtsSerpent(xts(key)?)
            }
            (Mode::Cbc, A::Twofish128 | A::Twofish192 | A::Twofish256) => {
                Soft::CbcTwofish(keyed(key)?)
            }
            (Mode::Cbc, A::Serpent128 | A::Serpent192 | A::Serpent256) => {
                Soft::CbcSerpent(keyed(key)?)
            }
            (Mode::Cbc, A::Cast5) => Soft::CbcCast5(keyed(key)?),
            // XTS needs 16-byte blocks (the spec refuses it before).
            (Mode::Xts, A::Cast5) => return Err(CryptoError::Key),
        })
    }

    /// Encrypts (`enc`) or decrypts one 512-byte sector in place with IV `iv` (of an
    /// 8-byte block cipher, its first 8 bytes).
    pub(super) fn sector(&self, s: &mut [u8], iv: [u8; 16], enc: bool) {
        match self {
            Soft::Xts128(x) => x.sector(s, iv, enc),
            Soft::Xts192(x) => x.sector(s, iv, enc),
            Soft::Xts256(x) => x.sector(s, iv, enc),
            Soft::Cbc128(c) => cbc_run(c.as_ref(), s, &iv, enc),
            Soft::Cbc192(c) => cbc_run(c.as_ref(), s, &iv, enc),
            Soft::Cbc256(c) => cbc_run(c.as_ref(), s, &iv, enc),
            Soft::XtsTwofish(x) => x.sector(s, iv, enc),
            Soft::XtsSerpent(x) => x.sector(s, iv, enc),
            Soft::CbcTwofish(c) => cbc_run(c.as_ref(), s, &iv, enc),
            Soft::CbcSerpent(c) => cbc_run(c.as_ref(), s, &iv, enc),
            Soft::CbcCast5(c) => cbc_run(c.as_ref(), s, &iv, enc),
        }
    }
}

/// CBC over one sector with the first block's worth of `iv`; the cipher is borrowed, not
/// copied (its key schedule stays where it is).
fn cbc_run<C>(c: &C, s: &mut [u8], iv: &[u8; 16], enc: bool)
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher,
{
    use aes::cipher::block_padding::NoPadding;
    use aes::cipher::generic_array::GenericArray;
    use aes::cipher::{BlockDecryptMut, BlockEncryptMut};
    let iv = GenericArray::from_slice(&iv[..C::block_size()]);
    let n = s.len();
    // Whole sectors are whole blocks: NoPadding cannot fail on them.
    if enc {
        let _ = cbc::Encryptor::<&C>::inner_iv_init(c, iv).encrypt_padded_mut::<NoPadding>(s, n);
    } else {
        let _ = cbc::Decryptor::<&C>::inner_iv_init(c, iv).decrypt_padded_mut::<NoPadding>(s);
    }
}
