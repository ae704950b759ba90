//! The owner's part of a stream (ARCHITECTURE.md §13): dropping the backing file reference
//! once every cluster the backing chain showed is in the image.
//!
//! Crash safety: everything the stream wrote (data, then its mappings, in the order of §7)
//! is written back and flushed first; then one write of the header's first sector drops the
//! reference (offset and size 0, and the backing format extension when the list without it
//! fits in that sector). Before that write the image still names its backing file and reads
//! the same through it; after it, it reads the same on its own.

use super::Owner;
use crate::error::Result;
use crate::io::BlockDevice;

impl<D: BlockDevice> Owner<'_, D> {
    /// Drops the backing file reference from the header (see the module doc). Returns
    /// whether the backing format extension went too (it stays, unread, when the extension
    /// list without it would not fit in the first sector). Takes the metadata lock.
    pub(crate) async fn drop_backing(&self) -> Result<bool> {
        let m = self.meta();
        let _g = m.lock().lock().await;
        self.writeback_locked().await?;
        self.exec.flush(self.dev).await?;
        // The extension list may run past the first sector, which the header copy holds.
        let rest = self.header_rest().await?;
        let gone = m.st_mut().header.clear_backing(&rest);
        self.write_header().await?;
        self.exec.flush(self.dev).await?;
        let mut h = self.header.borrow_mut();
        h.header.backing_file_offset = 0;
        h.header.backing_file_size = 0;
        h.backing_file = None;
        if gone {
            h.extensions.backing_format = None;
        }
        Ok(gone)
    }
}
