//! Tasks waiting for something other than a device operation: [`WaitQueue`], and the
//! executor's lock built on it ([`AsyncLock`]).

use super::Exec;
use crate::io::BlockDevice;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::task::Poll;

/// Tasks waiting for something other than a device operation (a lock, an in-flight
/// allocation). `wait` parks the current task until the next `notify_all`.
pub struct WaitQueue<D: BlockDevice> {
    exec: Exec<D>,
    waiters: RefCell<Vec<usize>>,
}

impl<D: BlockDevice> WaitQueue<D> {
    /// An empty queue.
    pub fn new(exec: &Exec<D>) -> Self {
        WaitQueue {
            exec: exec.clone(),
            waiters: RefCell::new(Vec::new()),
        }
    }

    /// Resolves after the next [`notify_all`](Self::notify_all) (callers re-check their
    /// condition in a loop).
    pub fn wait(&self) -> impl Future<Output = ()> + '_ {
        let mut registered = false;
        std::future::poll_fn(move |_| {
            if registered {
                return Poll::Ready(());
            }
            if let Some(t) = self.exec.current_task() {
                // A task polled again for another reason (two device completions in one
                // poll) must not leave a second, stale entry behind.
                let mut w = self.waiters.borrow_mut();
                if !w.contains(&t) {
                    w.push(t);
                }
            }
            registered = true;
            Poll::Pending
        })
    }

    /// Wakes the longest-waiting task, if any.
    pub fn notify_one(&self) {
        let t = {
            let mut w = self.waiters.borrow_mut();
            (!w.is_empty()).then(|| w.remove(0))
        };
        if let Some(t) = t {
            self.exec.wake(t);
        }
    }

    /// Wakes every waiting task.
    pub fn notify_all(&self) {
        for t in self.waiters.borrow_mut().drain(..) {
            self.exec.wake(t);
        }
    }
}

/// A lock for one executor's tasks (serialises metadata updates across awaits).
pub struct AsyncLock<D: BlockDevice> {
    locked: Cell<bool>,
    queue: WaitQueue<D>,
}

/// Holds an [`AsyncLock`]; unlocks on drop.
pub struct LockGuard<'a, D: BlockDevice> {
    lock: &'a AsyncLock<D>,
}

impl<D: BlockDevice> AsyncLock<D> {
    /// An unlocked lock.
    pub fn new(exec: &Exec<D>) -> Self {
        AsyncLock {
            locked: Cell::new(false),
            queue: WaitQueue::new(exec),
        }
    }

    /// Waits until the lock is free and takes it.
    pub async fn lock(&self) -> LockGuard<'_, D> {
        while self.locked.get() {
            self.queue.wait().await;
        }
        self.locked.set(true);
        LockGuard { lock: self }
    }

    /// Whether someone holds the lock.
    pub fn is_locked(&self) -> bool {
        self.locked.get()
    }
}

impl<D: BlockDevice> Drop for LockGuard<'_, D> {
    fn drop(&mut self) {
        self.lock.locked.set(false);
        // Wake every waiter: they re-check and all but one wait again. Handing over to one
        // waiter (notify_one) lost wake-ups: a waiter woken spuriously (polled for another
        // reason) consumed its registration without taking the lock, and the release woke
        // no one who still wanted it (found by tests/coherency.rs; writers hung).
        self.lock.queue.notify_all();
    }
}
