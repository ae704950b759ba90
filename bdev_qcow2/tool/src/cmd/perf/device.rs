//! The device under every run: the image's file through io_uring, with an optional added
//! latency per completion.

use super::args::PerfArgs;
use crate::host::{ToolError, ToolResult};
use crate::uring::{OpenMode, UringDevice};
use qcow2_engine::io::{BlockDevice, Busy, DeviceError, DeviceOp};
use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};

/// A device that adds a fixed latency to every completion (test double for slow media).
pub struct DelayDevice<D: BlockDevice> {
    pub(super) inner: D,
    delay: Duration,
    held: VecDeque<(Instant, u64, Result<(), DeviceError>)>,
}

impl<D: BlockDevice> BlockDevice for DelayDevice<D> {
    type Buf = D::Buf;
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn alloc_buf(&mut self, len: usize) -> Self::Buf {
        self.inner.alloc_buf(len)
    }
    fn submit(&mut self, op: DeviceOp<Self::Buf>, tag: u64) -> Result<(), Busy<Self::Buf>> {
        self.inner.submit(op, tag)
    }
    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }
    fn completes_only_submitted(&self) -> bool {
        // Held completions count as outstanding until delivered.
        self.inner.completes_only_submitted()
    }
    fn zeroes_cheaply(&self) -> bool {
        self.inner.zeroes_cheaply()
    }
    fn discards(&self) -> bool {
        self.inner.discards()
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        self.inner.ensure_size(size)
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        if self.delay.is_zero() && self.held.is_empty() {
            return self.inner.poll(done);
        }
        let now = Instant::now();
        let due = now + self.delay;
        self.inner
            .poll(&mut |tag, r| self.held.push_back((due, tag, r)));
        let mut n = 0;
        while let Some(&(t, tag, r)) = self.held.front() {
            if t > now {
                break;
            }
            self.held.pop_front();
            done(tag, r);
            n += 1;
        }
        n
    }
}

pub(super) type Dev = DelayDevice<UringDevice>;

impl<D: BlockDevice> DelayDevice<D> {
    /// `inner` with `delay` added to every completion.
    pub(super) fn new(inner: D, delay: Duration) -> Self {
        DelayDevice {
            inner,
            delay,
            held: VecDeque::new(),
        }
    }
}

pub(super) fn open_dev(path: &Path, writable: bool, a: &PerfArgs) -> ToolResult<Dev> {
    let inner = UringDevice::open(
        path,
        OpenMode {
            writable,
            direct: !a.buffered,
        },
        (a.depth * 2).max(8) as u32,
    )
    .map_err(|source| ToolError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(DelayDevice::new(
        inner,
        Duration::from_micros(a.base_latency_us),
    ))
}
