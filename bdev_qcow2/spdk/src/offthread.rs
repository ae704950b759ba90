//! Work too long for a reactor (PBKDF2: as long as an image's creator asked, seconds with
//! QEMU's default `iter-time`) run on a thread of its own while the engine task that
//! wants it yields, so the SPDK thread keeps polling everything else meanwhile.

use crate::device::SpdkDevice;
use qcow2_engine::{Error, Exec, Result};
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::{self, TryRecvError};
use std::task::{Context, Poll};

/// Runs `f` on a new thread named `name`; the calling task of `exec` yields until it is
/// done and gets its result.
pub async fn on_thread<T: Send + 'static>(
    exec: &Exec<SpdkDevice>,
    name: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error::Io(e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
    loop {
        match rx.try_recv() {
            Ok(r) => return r,
            Err(TryRecvError::Empty) => YieldOnce(exec, false).await,
            Err(TryRecvError::Disconnected) => return Err(Error::Io(libc::EIO)),
        }
    }
}

/// Pending once, having made its task runnable again: the executor runs it at its next
/// poll (its tasks are otherwise woken by device completions only).
struct YieldOnce<'a>(&'a Exec<SpdkDevice>, bool);

impl Future for YieldOnce<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.1 {
            return Poll::Ready(());
        }
        self.1 = true;
        if let Some(id) = self.0.current_task() {
            self.0.wake(id);
        }
        Poll::Pending
    }
}
