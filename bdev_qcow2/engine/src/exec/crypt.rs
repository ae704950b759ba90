//! Encrypted views of devices: a [`DevId`] through which the data clusters of an encrypted
//! image are read and written. A write is encrypted into a bounce buffer (the caller's
//! buffer is never changed); a read is decrypted in the caller's buffer when the device
//! completes it. The sector number of each 512 bytes is its device offset / 512, as QEMU
//! computes the IV for qcow2's LUKS. A view without a cipher (an image opened without its
//! key) fails every data operation with EACCES and writes nothing. Plain devices never
//! come here: `submit_raw` tests one bit of the id.

use super::{DevId, Exec};
use crate::crypto::cipher::SECTOR_BYTES;
use crate::crypto::{SectorCipher, SectorWorker};
use crate::io::{BlockDevice, BufSlice, DeviceError, DeviceOp, IoBuffer, LentBuf};
use std::sync::Arc;

/// Ids from this bit up are views ([`Exec::add_crypt_view`]), not devices.
pub(super) const VIEW_BIT: usize = 1 << 30;
/// Tags from this bit up are reads through a view, to decrypt before they complete.
pub(super) const CRYPT_TAG: u64 = 1 << 62;
const EACCES: i32 = 13;

/// A view: the device under it and its cipher (none until the image is unlocked), as a
/// worker of this executor's own: its EVP contexts serve this core only, without a lock.
pub(super) struct View {
    dev: DevId,
    cipher: Option<SectorWorker>,
}

/// A read in flight through a view: (caller's tag, caller's buffer, device offset, view).
pub(super) type CryptRead<B> = (u64, BufSlice<B>, u64, usize);

impl<D: BlockDevice> Exec<D> {
    /// A view of `dev` for an encrypted image's data, locked until
    /// [`set_view_cipher`](Self::set_view_cipher).
    pub fn add_crypt_view(&self, dev: DevId) -> DevId {
        let mut v = self.inner.views.borrow_mut();
        v.push(View { dev, cipher: None });
        DevId(VIEW_BIT | (v.len() - 1))
    }

    /// Unlocks a view with the image's payload cipher.
    pub fn set_view_cipher(&self, view: DevId, cipher: Arc<SectorCipher>) {
        if let Some(v) = self.inner.views.borrow_mut().get_mut(view.0 & !VIEW_BIT) {
            v.cipher = Some(cipher.worker());
        }
    }

    /// The device under view `view` when it is an unlocked view: a host may then read it
    /// there itself with the guest's buffer and [`decrypt_view`](Self::decrypt_view) it
    /// when it completes (what a read through the view does, without the executor).
    /// `None` for a device, or a view still locked.
    #[inline]
    pub fn unlocked_view_base(&self, view: DevId) -> Option<DevId> {
        if view.0 & VIEW_BIT == 0 {
            return None;
        }
        let views = self.inner.views.borrow();
        let v = views.get(view.0 & !VIEW_BIT)?;
        v.cipher.as_ref().map(|_| v.dev)
    }

    /// Decrypts `buf` (lent for the call), read from device offset `offset` under view
    /// `view`, in place with the view's cipher (nothing when the view is locked or not a
    /// view).
    #[inline]
    pub fn decrypt_view(&self, view: DevId, offset: u64, buf: &impl LentBuf<D::Buf>) {
        self.decrypt_at(view.0 & !VIEW_BIT, offset, buf)
    }

    fn decrypt_at(&self, view: usize, offset: u64, buf: &impl LentBuf<D::Buf>) {
        // The cipher runs on the buffer alone: nothing in it re-enters the executor.
        if let Some(w) = self
            .inner
            .views
            .borrow_mut()
            .get_mut(view)
            .and_then(|v| v.cipher.as_mut())
        {
            buf.with_bytes_mut(&mut |b| w.decrypt(offset / SECTOR_BYTES as u64, b));
        }
    }

    /// The device under `dev` (itself when it is not a view).
    pub(super) fn real_dev(&self, dev: DevId) -> DevId {
        if dev.0 & VIEW_BIT == 0 {
            return dev;
        }
        self.inner.views.borrow()[dev.0 & !VIEW_BIT].dev
    }

    /// Submits `op` through view `view` (out of line: a plain image's submissions only
    /// test the view bit).
    #[inline(never)]
    pub(super) fn submit_crypt(&self, view: DevId, op: DeviceOp<D::Buf>, tag: u64) {
        let (dev, unlocked) = {
            let views = self.inner.views.borrow();
            let v = &views[view.0 & !VIEW_BIT];
            (v.dev, v.cipher.is_some())
        };
        let data = matches!(
            op,
            DeviceOp::Read { .. } | DeviceOp::Write { .. } | DeviceOp::WriteZeroes { .. }
        );
        if !(unlocked && data) {
            if data {
                self.inner
                    .failed
                    .borrow_mut()
                    .push((tag, Err(DeviceError(EACCES))));
                return;
            }
            // Flush and discard carry no data.
            return self.submit_raw(dev, op, tag);
        }
        match op {
            DeviceOp::Read { offset, buf } => {
                let key = self.inner.crypt_reads.borrow_mut().insert((
                    tag,
                    buf.clone(),
                    offset,
                    view.0 & !VIEW_BIT,
                ));
                self.submit_raw(dev, DeviceOp::Read { offset, buf }, CRYPT_TAG | key as u64);
            }
            DeviceOp::Write { offset, buf } => {
                let bounce = self.alloc_buf(dev, buf.len);
                buf.buf.copy_to(buf.off, &bounce, 0, buf.len);
                self.encrypt(view, &bounce, offset);
                let buf = BufSlice::whole(bounce);
                self.submit_raw(dev, DeviceOp::Write { offset, buf }, tag);
            }
            DeviceOp::WriteZeroes { offset, len } => {
                // Zeros of an encrypted image are the cipher's zeros, not the device's.
                let bounce = self.alloc_buf(dev, len as usize);
                self.encrypt(view, &bounce, offset);
                let buf = BufSlice::whole(bounce);
                self.submit_raw(dev, DeviceOp::Write { offset, buf }, tag);
            }
            op => self.submit_raw(dev, op, tag),
        }
    }

    /// A read through a view completed: decrypts it in place, then completes the caller's
    /// operation (out of line: a plain image's completions only test the tag bit).
    #[inline(never)]
    pub(super) fn crypt_read_done(&self, tag: u64, res: Result<(), DeviceError>) {
        let key = (tag & !CRYPT_TAG) as usize;
        let Some((orig, buf, offset, view)) = self.inner.crypt_reads.borrow_mut().try_remove(key)
        else {
            return;
        };
        if res.is_ok() {
            self.decrypt_at(view, offset, &buf);
        }
        self.device_completed(orig, res);
    }

    /// Encrypts the whole of `buf`, which goes to device offset `offset`, with `view`'s
    /// cipher.
    fn encrypt(&self, view: DevId, buf: &D::Buf, offset: u64) {
        if let Some(w) = self.inner.views.borrow_mut()[view.0 & !VIEW_BIT]
            .cipher
            .as_mut()
        {
            let len = buf.len();
            buf.with_bytes_mut(0, len, &mut |b| w.encrypt(offset / SECTOR_BYTES as u64, b));
        }
    }
}
