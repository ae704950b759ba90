//! An encrypted image's state: its LUKS header (read at open, shown by `info` without a
//! key), the payload cipher once a key unlocks it, and the executor view through which its
//! data clusters are read and written (`exec/crypt.rs`). Metadata goes to the device
//! itself; only data takes the view, so a plain image's path has nothing more to do.

use super::Qcow2;
use crate::crypto::{LuksHeader, SectorCipher};
use crate::error::Result;
use crate::exec::{read_bytes, DevId, Exec};
use crate::format::ImageHeader;
use crate::io::BlockDevice;
use std::sync::{Arc, OnceLock};

/// An encrypted image's LUKS header and, once unlocked, its payload cipher (shared by every
/// core's replica).
#[derive(Debug)]
pub struct Luks {
    header: LuksHeader,
    /// The LUKS area in the image: (offset, length).
    area: (u64, u64),
    cipher: OnceLock<Arc<SectorCipher>>,
}

impl Luks {
    /// The decoded header.
    pub fn header(&self) -> &LuksHeader {
        &self.header
    }
    /// Where the header lies in the image: (offset, length).
    pub fn area(&self) -> (u64, u64) {
        self.area
    }
    /// Whether a key unlocked it.
    pub fn unlocked(&self) -> bool {
        self.cipher.get().is_some()
    }
}

/// Reads and decodes the LUKS header of an image whose header names one.
pub(super) async fn read_luks<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    header: &ImageHeader,
) -> Result<Option<Arc<Luks>>> {
    let Some((off, len)) = header.extensions.encryption else {
        return Ok(None);
    };
    // The header validated the area: inside the device, at most MAX_LUKS_HEADER_BYTES.
    let bytes = read_bytes(exec, dev, off, len).await?;
    Ok(Some(Arc::new(Luks {
        header: LuksHeader::parse(&bytes)?,
        area: (off, len),
        cipher: OnceLock::new(),
    })))
}

/// The view data takes: the device itself for a plain image, an encrypted view (unlocked
/// when `luks` is) for an encrypted one.
pub(super) fn data_view<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    luks: Option<&Arc<Luks>>,
) -> DevId {
    let Some(l) = luks else { return dev };
    let view = exec.add_crypt_view(dev);
    if let Some(c) = l.cipher.get() {
        exec.set_view_cipher(view, c.clone());
    }
    view
}

impl<D: BlockDevice> Qcow2<D> {
    /// The LUKS header of an encrypted image (`None`: not encrypted).
    pub fn luks(&self) -> Option<&Luks> {
        self.luks.as_deref()
    }

    /// Whether the image's data is encrypted.
    pub fn encrypted(&self) -> bool {
        self.luks.is_some()
    }

    /// The device (or encrypted view) guest data clusters are read from and written to.
    pub(crate) fn data_dev(&self) -> DevId {
        self.data_dev
    }

    /// Unlocks an encrypted image with `secret` (the bytes of QEMU's secret object): its
    /// data becomes readable and writable. [`Error::WrongKey`](crate::Error::WrongKey) when
    /// the secret opens no key slot; nothing changes then. A plain image ignores it.
    pub async fn unlock(&self, secret: &[u8]) -> Result<()> {
        let Some(l) = &self.luks else { return Ok(()) };
        if let Some(c) = l.cipher.get() {
            self.exec.set_view_cipher(self.data_dev, c.clone());
            return Ok(());
        }
        let (off, len) = l.area;
        let bytes = read_bytes(&self.exec, self.dev, off, len).await?;
        let cipher = Arc::new(l.header.unlock(&bytes, secret)?);
        let c = l.cipher.get_or_init(|| cipher).clone();
        self.exec.set_view_cipher(self.data_dev, c);
        Ok(())
    }
}
