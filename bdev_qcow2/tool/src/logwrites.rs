//! Recording every write and flush a device completes, in the dm-log-writes on-disk format
//! (the one Linux's `dm-log-writes` target and QEMU's `blklogwrites` driver write), so crash
//! states can be replayed with any tool that reads that format.
//!
//! Layout (all fields little-endian, log sector size 512):
//! - sector 0: the super block — magic, version (1), number of entries, sector size;
//! - from sector 1 on, one entry after another: a sector holding the entry header (target
//!   sector and sector count, both in 512-byte units, flags, data length), followed by the
//!   written data (`nr_sectors` sectors) for a write. A flush has no data. A mark carries its
//!   text inline, right after the header in the entry's own sector (`data_len` bytes).
//!
//! Writes are logged when they complete successfully, flushes when they complete, so the
//! log order is the completion order: replaying the entries up to a flush gives a state in
//! which every write the device acknowledged before that flush is present. Failed
//! operations are not logged. The super block is rewritten after every flush and at the end
//! (as QEMU's driver does on flush); the log file itself is not fsync()ed — it is for
//! replaying after the tool exits, not for surviving a host crash.

use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::rc::Rc;

/// Entry flag: a flush (all previously logged writes are stable).
pub const LOG_FLUSH_FLAG: u64 = 1 << 0;
/// Entry flag: forced unit access (not issued by the engine).
pub const LOG_FUA_FLAG: u64 = 1 << 1;
/// Entry flag: a discard (no data follows).
pub const LOG_DISCARD_FLAG: u64 = 1 << 2;
/// Entry flag: a mark; its text is stored inline after the entry header.
pub const LOG_MARK_FLAG: u64 = 1 << 3;
/// Magic number of the super block.
pub const WRITE_LOG_MAGIC: u64 = 0x006a_7366_7773_6872;
/// Format version.
pub const WRITE_LOG_VERSION: u64 = 1;
/// Log sector size (and the unit of `sector`/`nr_sectors`).
pub const LOG_SECTOR: u64 = 512;
/// Size of an entry header.
pub const ENTRY_HEADER_LEN: usize = 32;

/// Pending output is written to the log file once it exceeds this many bytes.
const BUFFER_BYTES: usize = 4 << 20;

/// The log file being written.
pub struct WriteLog {
    file: File,
    /// Sector where `buf` starts.
    buf_sector: u64,
    /// Entries not yet written to the file.
    buf: Vec<u8>,
    nr_entries: u64,
    /// The first error writing the log (reported by [`WriteLog::finish`]).
    error: Option<std::io::Error>,
}

impl WriteLog {
    /// Creates (or truncates) the log at `path` with an empty super block.
    pub fn create(path: &Path) -> std::io::Result<Rc<RefCell<WriteLog>>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        let log = WriteLog {
            file,
            buf_sector: 1,
            buf: Vec::with_capacity(BUFFER_BYTES),
            nr_entries: 0,
            error: None,
        };
        log.write_super()?;
        Ok(Rc::new(RefCell::new(log)))
    }

    /// Number of entries logged so far.
    pub fn entries(&self) -> u64 {
        self.nr_entries
    }

    fn write_super(&self) -> std::io::Result<()> {
        let mut s = [0u8; LOG_SECTOR as usize];
        s[0..8].copy_from_slice(&WRITE_LOG_MAGIC.to_le_bytes());
        s[8..16].copy_from_slice(&WRITE_LOG_VERSION.to_le_bytes());
        s[16..24].copy_from_slice(&self.nr_entries.to_le_bytes());
        s[24..28].copy_from_slice(&(LOG_SECTOR as u32).to_le_bytes());
        self.file.write_all_at(&s, 0)
    }

    fn note(&mut self, r: std::io::Result<()>) {
        if let Err(e) = r {
            self.error.get_or_insert(e);
        }
    }

    /// Writes buffered entries to the file.
    fn drain(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let r = self
            .file
            .write_all_at(&self.buf, self.buf_sector * LOG_SECTOR);
        self.buf_sector += self.buf.len() as u64 / LOG_SECTOR;
        self.buf.clear();
        self.note(r);
    }

    /// Appends one entry: header sector (with `inline` bytes after the header), then `data`
    /// padded to whole sectors.
    fn append(&mut self, sector: u64, nr_sectors: u64, flags: u64, inline: &[u8], data: &[u8]) {
        let mut head = [0u8; LOG_SECTOR as usize];
        head[0..8].copy_from_slice(&sector.to_le_bytes());
        head[8..16].copy_from_slice(&nr_sectors.to_le_bytes());
        head[16..24].copy_from_slice(&flags.to_le_bytes());
        head[24..32].copy_from_slice(&(inline.len() as u64).to_le_bytes());
        let n = inline.len().min(head.len() - ENTRY_HEADER_LEN);
        head[ENTRY_HEADER_LEN..ENTRY_HEADER_LEN + n].copy_from_slice(&inline[..n]);
        self.buf.extend_from_slice(&head);
        self.buf.extend_from_slice(data);
        let pad = (LOG_SECTOR as usize - data.len() % LOG_SECTOR as usize) % LOG_SECTOR as usize;
        self.buf.resize(self.buf.len() + pad, 0);
        self.nr_entries += 1;
        if self.buf.len() >= BUFFER_BYTES {
            self.drain();
        }
    }

    /// Logs a completed write of `data` at byte `offset` of the device.
    pub fn log_write(&mut self, offset: u64, data: &[u8]) {
        let nr = (data.len() as u64).div_ceil(LOG_SECTOR);
        self.append(offset / LOG_SECTOR, nr, 0, &[], data);
    }

    /// Logs a completed discard of `len` bytes at `offset` (no data).
    pub fn log_discard(&mut self, offset: u64, len: u64) {
        self.append(
            offset / LOG_SECTOR,
            len.div_ceil(LOG_SECTOR),
            LOG_DISCARD_FLAG,
            &[],
            &[],
        );
    }

    /// Logs a completed flush and updates the super block.
    pub fn log_flush(&mut self) {
        self.append(0, 0, LOG_FLUSH_FLAG, &[], &[]);
        self.drain();
        let r = self.write_super();
        self.note(r);
    }

    /// Logs a mark named `text` (at most 480 bytes).
    pub fn mark(&mut self, text: &str) {
        self.append(0, 0, LOG_MARK_FLAG, text.as_bytes(), &[]);
    }

    /// Writes everything out with the final entry count; returns the first error met.
    pub fn finish(&mut self) -> std::io::Result<()> {
        self.drain();
        let r = self.write_super();
        self.note(r);
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// What a logged operation in flight will record when it completes.
enum Pending<B> {
    Write { offset: u64, buf: BufSlice<B> },
    Zeroes { offset: u64, len: u64 },
    Discard { offset: u64, len: u64 },
    Flush,
}

/// A block device that records the writes and flushes it completes into a [`WriteLog`]
/// (or passes everything through when it has none).
pub struct LogWrites<D: BlockDevice> {
    inner: D,
    log: Option<Rc<RefCell<WriteLog>>>,
    pending: HashMap<u64, Pending<D::Buf>>,
}

impl<D: BlockDevice> LogWrites<D> {
    /// Wraps `inner`, logging into `log` if given.
    pub fn new(inner: D, log: Option<Rc<RefCell<WriteLog>>>) -> Self {
        LogWrites {
            inner,
            log,
            pending: HashMap::new(),
        }
    }
}

impl<D: BlockDevice> BlockDevice for LogWrites<D> {
    type Buf = D::Buf;

    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn alloc_buf(&mut self, len: usize) -> Self::Buf {
        self.inner.alloc_buf(len)
    }

    fn submit(&mut self, op: DeviceOp<Self::Buf>, tag: u64) -> Result<(), Busy<Self::Buf>> {
        if self.log.is_some() {
            // The buffer handle is kept: its bytes are copied into the log on completion
            // (the engine does not touch a buffer while its I/O is in flight).
            match &op {
                DeviceOp::Write { offset, buf } => {
                    self.pending.insert(
                        tag,
                        Pending::Write {
                            offset: *offset,
                            buf: buf.clone(),
                        },
                    );
                }
                DeviceOp::WriteZeroes { offset, len } => {
                    self.pending.insert(
                        tag,
                        Pending::Zeroes {
                            offset: *offset,
                            len: *len,
                        },
                    );
                }
                DeviceOp::Discard { offset, len } => {
                    self.pending.insert(
                        tag,
                        Pending::Discard {
                            offset: *offset,
                            len: *len,
                        },
                    );
                }
                DeviceOp::Flush => {
                    self.pending.insert(tag, Pending::Flush);
                }
                DeviceOp::Read { .. } => {}
            }
        }
        let r = self.inner.submit(op, tag);
        if r.is_err() {
            self.pending.remove(&tag);
        }
        r
    }

    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }

    fn zeroes_cheaply(&self) -> bool {
        self.inner.zeroes_cheaply()
    }

    fn discards(&self) -> bool {
        self.inner.discards()
    }

    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        self.inner.ensure_size(size)
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let LogWrites {
            inner,
            log,
            pending,
        } = self;
        inner.poll(&mut |tag, res| {
            if let (Some(p), Some(log)) = (pending.remove(&tag), log.as_ref()) {
                if res.is_ok() {
                    match p {
                        Pending::Write { offset, buf } => {
                            let mut data = vec![0u8; buf.len];
                            buf.copy_out(0, &mut data);
                            log.borrow_mut().log_write(offset, &data);
                        }
                        Pending::Zeroes { offset, len } => {
                            log.borrow_mut().log_write(offset, &vec![0u8; len as usize]);
                        }
                        Pending::Discard { offset, len } => {
                            log.borrow_mut().log_discard(offset, len)
                        }
                        Pending::Flush => log.borrow_mut().log_flush(),
                    }
                }
            }
            done(tag, res)
        })
    }
}
