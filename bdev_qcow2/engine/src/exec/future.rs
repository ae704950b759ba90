//! Device operations as futures a task awaits ([`IoFuture`]), awaiting several at once
//! ([`join_all`]), and byte-granular reads through a bounce buffer ([`read_bytes`]).

use super::request::Waiter;
use super::{DevId, Exec};
use crate::error::{Error, Result};
use crate::io::{BlockDevice, BufSlice, DeviceOp, IoBuffer, SECTOR};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

impl<D: BlockDevice> Exec<D> {
    /// A future that performs one device operation and yields its result.
    pub fn io(&self, dev: DevId, op: DeviceOp<D::Buf>) -> IoFuture<D> {
        IoFuture {
            exec: self.clone(),
            state: IoState::Init(dev, op),
        }
    }

    /// Reads `buf.len` bytes at `offset` of `dev` into `buf`.
    pub fn read(&self, dev: DevId, offset: u64, buf: BufSlice<D::Buf>) -> IoFuture<D> {
        self.io(dev, DeviceOp::Read { offset, buf })
    }

    /// Writes `buf` at `offset` of `dev`.
    pub fn write(&self, dev: DevId, offset: u64, buf: BufSlice<D::Buf>) -> IoFuture<D> {
        self.io(dev, DeviceOp::Write { offset, buf })
    }

    /// Makes `len` bytes of `dev` at `offset` read as zeros ([`DeviceOp::WriteZeroes`]).
    pub fn write_zeroes(&self, dev: DevId, offset: u64, len: u64) -> IoFuture<D> {
        self.io(dev, DeviceOp::WriteZeroes { offset, len })
    }

    /// Tells `dev` that `len` bytes at `offset` are no longer needed ([`DeviceOp::Discard`]).
    pub fn discard(&self, dev: DevId, offset: u64, len: u64) -> IoFuture<D> {
        self.io(dev, DeviceOp::Discard { offset, len })
    }

    /// Flushes `dev` (every completed write becomes stable).
    pub fn flush(&self, dev: DevId) -> IoFuture<D> {
        self.io(dev, DeviceOp::Flush)
    }
}

enum IoState<D: BlockDevice> {
    Init(DevId, DeviceOp<D::Buf>),
    Waiting(usize),
    Done,
}

/// Future of one device operation (see [`Exec::io`]).
pub struct IoFuture<D: BlockDevice> {
    exec: Exec<D>,
    state: IoState<D>,
}

impl<D: BlockDevice> Unpin for IoFuture<D> {}

impl<D: BlockDevice> Future for IoFuture<D> {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        match std::mem::replace(&mut this.state, IoState::Done) {
            IoState::Init(dev, op) => {
                let Some(task) = this.exec.inner.current.get() else {
                    return Poll::Ready(Err(Error::InvalidRequest(
                        "device future polled outside a task",
                    )));
                };
                let w = this
                    .exec
                    .inner
                    .waiters
                    .borrow_mut()
                    .insert(Waiter::Task { task, result: None });
                this.exec.submit_raw(dev, op, w as u64);
                this.state = IoState::Waiting(w);
                Poll::Pending
            }
            IoState::Waiting(w) => {
                let mut waiters = this.exec.inner.waiters.borrow_mut();
                let ready = matches!(
                    waiters.get(w),
                    Some(Waiter::Task {
                        result: Some(_),
                        ..
                    })
                );
                if !ready {
                    drop(waiters);
                    this.state = IoState::Waiting(w);
                    return Poll::Pending;
                }
                match waiters.remove(w) {
                    Waiter::Task {
                        result: Some(r), ..
                    } => Poll::Ready(r.map_err(|e| Error::Io(e.0))),
                    _ => Poll::Ready(Err(Error::Io(5))),
                }
            }
            IoState::Done => Poll::Ready(Err(Error::InvalidRequest(
                "device future polled after completion",
            ))),
        }
    }
}

/// Awaits every future of `futs` concurrently; returns the first error, after all finished.
pub async fn join_all<F: Future<Output = Result<()>>>(futs: Vec<F>) -> Result<()> {
    let mut futs: Vec<Option<Pin<Box<F>>>> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut first_err = None;
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        if let Err(e) = r {
                            first_err.get_or_insert(e);
                        }
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(first_err.take().map_or(Ok(()), Err))
        }
    })
    .await
}

/// Reads `len` bytes at `off` (any alignment) through a sector-aligned bounce buffer.
pub async fn read_bytes<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    off: u64,
    len: u64,
) -> Result<Vec<u8>> {
    let start = off / SECTOR * SECTOR;
    let end = off
        .checked_add(len)
        .and_then(|e| e.div_ceil(SECTOR).checked_mul(SECTOR))
        .ok_or(Error::InvalidRequest("read range overflows"))?;
    let n = (end - start) as usize;
    let buf = exec.alloc_buf(dev, n);
    exec.read(dev, start, BufSlice::whole(buf.clone())).await?;
    let mut out = vec![0u8; len as usize];
    buf.copy_out((off - start) as usize, &mut out);
    Ok(out)
}
