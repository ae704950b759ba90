//! The hashes a LUKS header may name (`hash_spec`, ESSIV's hash): PBKDF2's PRF, the
//! anti-forensic splitter's diffusion and ESSIV's key, as QEMU offers them (`md5`, `sha1`,
//! `sha224`, `sha256`, `sha384`, `sha512`, `ripemd160`).

use hmac::Hmac;
use md5::Md5;
use ripemd::Ripemd160;
use sha1::Sha1;
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};

/// A hash algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    /// md5 (weak; QEMU still offers it)
    Md5,
    /// sha1
    Sha1,
    /// sha224
    Sha224,
    /// sha256
    Sha256,
    /// sha384
    Sha384,
    /// sha512
    Sha512,
    /// ripemd160
    Ripemd160,
}

impl HashAlg {
    /// From its LUKS/QEMU name; `None` for one QEMU does not offer.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "md5" => Self::Md5,
            "sha1" => Self::Sha1,
            "sha224" => Self::Sha224,
            "sha256" => Self::Sha256,
            "sha384" => Self::Sha384,
            "sha512" => Self::Sha512,
            "ripemd160" => Self::Ripemd160,
            _ => return None,
        })
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Md5 => "md5",
            Self::Sha1 => "sha1",
            Self::Sha224 => "sha224",
            Self::Sha256 => "sha256",
            Self::Sha384 => "sha384",
            Self::Sha512 => "sha512",
            Self::Ripemd160 => "ripemd160",
        }
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Self::Md5 => 16,
            Self::Sha1 => 20,
            Self::Sha224 => 28,
            Self::Sha256 => 32,
            Self::Sha384 => 48,
            Self::Sha512 => 64,
            Self::Ripemd160 => 20,
        }
    }

    /// The digest of `data`.
    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        self.digest_parts(&[data])
    }

    /// The digest of the concatenation of `parts`.
    pub fn digest_parts(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<H: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut h = H::new();
            for p in parts {
                h.update(p);
            }
            h.finalize().to_vec()
        }
        match self {
            Self::Md5 => run::<Md5>(parts),
            Self::Sha1 => run::<Sha1>(parts),
            Self::Sha224 => run::<Sha224>(parts),
            Self::Sha256 => run::<Sha256>(parts),
            Self::Sha384 => run::<Sha384>(parts),
            Self::Sha512 => run::<Sha512>(parts),
            Self::Ripemd160 => run::<Ripemd160>(parts),
        }
    }

    /// PBKDF2 with HMAC of this hash: fills `out`.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2;
        // HMAC takes a key of any length: the error case cannot happen.
        let _ = match self {
            Self::Md5 => pbkdf2::<Hmac<Md5>>(password, salt, iterations, out),
            Self::Sha1 => pbkdf2::<Hmac<Sha1>>(password, salt, iterations, out),
            Self::Sha224 => pbkdf2::<Hmac<Sha224>>(password, salt, iterations, out),
            Self::Sha256 => pbkdf2::<Hmac<Sha256>>(password, salt, iterations, out),
            Self::Sha384 => pbkdf2::<Hmac<Sha384>>(password, salt, iterations, out),
            Self::Sha512 => pbkdf2::<Hmac<Sha512>>(password, salt, iterations, out),
            Self::Ripemd160 => pbkdf2::<Hmac<Ripemd160>>(password, salt, iterations, out),
        };
    }
}
