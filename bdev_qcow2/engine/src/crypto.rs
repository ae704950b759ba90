//! Encrypted images: qcow2 with LUKS as QEMU makes them (`encrypt.format=luks`). The header
//! extension points at a LUKS1 header inside the image's clusters (`luks`); a secret
//! unlocks its master key, which keys the payload's sector cipher (`cipher`). Data clusters
//! are encrypted sector by sector with the IV of the HOST offset / 512, as QEMU does for
//! LUKS (`crypt_physical_offset`); metadata, zero and unallocated clusters are not.

#[cfg(any(test, feature = "testing"))]
pub mod build;
pub mod cipher;
mod evp;
mod evp_xts;
pub mod hash;
pub mod luks;
pub mod luks_build;
mod soft;
mod spec;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ciphers;
mod xts;
#[cfg(target_arch = "x86_64")]
mod xts_avx2;
mod xts_vaes;

pub use cipher::{Backend, CipherSpec, SectorCipher, SectorWorker};
pub use luks::LuksHeader;
pub use luks_build::{build_luks_area, LuksArea, LuksParams};

use crate::error::{invalid, Error, Field};

/// A failure of the cipher layer itself (a key of the wrong size for its cipher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CryptoError {
    /// The key does not fit the cipher.
    Key,
}

impl CryptoError {
    pub(crate) fn into_error(self) -> Error {
        invalid(Field::LuksHeader, 0, "key length does not fit the cipher")
    }
}
