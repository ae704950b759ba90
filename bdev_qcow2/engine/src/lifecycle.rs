//! The disk's life-cycle operations on a chain: resize, snapshot apply (both change the
//! disk's size). They run on the metadata owner's core; the image's own
//! part is an owner operation (`image::owner`), the chain's part keeps what the chain
//! knows (its size, its backing layers) in step.

use crate::chain::{Chain, Layer};
use crate::error::{Error, Result};
use crate::io::BlockDevice;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// Resizes the top image's virtual disk to `new_size` bytes, as `qemu-img resize`
    /// does: growing always works (within the format's limits); shrinking needs `shrink`
    /// and is refused ([`Error::Refused`]) when the range cut off holds data. When the disk
    /// grows over a range a backing image covers, that range is zeroed so that the
    /// backing image's bytes do not show through, as QEMU does. Returns the old size.
    ///
    /// On the owner's core; on a shared image the cores take the new size the next time a
    /// request reaches past the size they know.
    pub async fn resize(self: &Rc<Self>, new_size: u64, shrink: bool) -> Result<u64> {
        let Some(Layer::Qcow2(q)) = self.layers().first() else {
            return Err(Error::ReadOnly);
        };
        let old = q.resize(new_size, shrink).await?;
        self.disk.set_size(q.size());
        if new_size > old {
            if let Some(backing) = self.layers().get(1) {
                let end = backing.size().min(new_size);
                if end > old {
                    self.write_zeroes(old, end - old, false).await?;
                }
            }
        }
        Ok(old)
    }

    /// Makes internal snapshot `which` (id or name) the active disk and takes its size.
    /// Offline only: refused on an image shared with other cores.
    pub async fn snapshot_apply(self: &Rc<Self>, which: &str) -> Result<()> {
        let Some(Layer::Qcow2(q)) = self.layers().first() else {
            return Err(Error::ReadOnly);
        };
        q.snapshot_apply(which).await?;
        self.disk.set_size(q.size());
        Ok(())
    }
}
