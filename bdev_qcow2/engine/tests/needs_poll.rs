//! When a host must poll its executor (`Exec::needs_poll`): a host pauses its poller while
//! its requests wait only on devices whose completions come by callback (SPDK's bdevs), and
//! polls whenever something is runnable, waits to be reported, or is outstanding on a
//! device that completes only in its poll.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::exec::{read_bytes, DevId, Exec};
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, HeapBuf};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// A device whose operations complete only when the test says so: by "callback" (the test
/// hands the completion to the executor, as SPDK's callback does) when `announced`, else in
/// its poll.
struct Held {
    announced: bool,
    /// Tags submitted and not completed yet.
    held: Rc<RefCell<Vec<u64>>>,
    /// Completions released for the next poll (a device that does not announce).
    released: Rc<RefCell<Vec<u64>>>,
    /// Refuse the next submission as busy.
    busy_once: Rc<Cell<bool>>,
}

impl BlockDevice for Held {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        1 << 20
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        if self.busy_once.replace(false) {
            return Err(Busy(op, tag));
        }
        self.held.borrow_mut().push(tag);
        Ok(())
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let r: Vec<u64> = self.released.borrow_mut().drain(..).collect();
        for &t in &r {
            done(t, Ok(()));
        }
        r.len()
    }
    fn completions_announced(&self) -> bool {
        self.announced && self.released.borrow().is_empty()
    }
}

struct Setup {
    exec: Exec<Held>,
    dev: DevId,
    held: Rc<RefCell<Vec<u64>>>,
    released: Rc<RefCell<Vec<u64>>>,
    busy_once: Rc<Cell<bool>>,
}

fn setup(announced: bool) -> Setup {
    let exec = Exec::new();
    let (held, released, busy_once) = (Rc::default(), Rc::default(), Rc::default());
    let dev = exec.add_device(Held {
        announced,
        held: Rc::clone(&held),
        released: Rc::clone(&released),
        busy_once: Rc::clone(&busy_once),
    });
    Setup {
        exec,
        dev,
        held,
        released,
        busy_once,
    }
}

/// A guest read of one device operation, as a host's fast path submits it.
fn read(s: &Setup, tag: u64) {
    let req = s.exec.request_begin(tag);
    let buf = BufSlice::whole(HeapBuf::new(4096));
    s.exec
        .request_op(req, s.dev, DeviceOp::Read { offset: 0, buf });
    s.exec.request_arm(req);
}

fn reported(exec: &Exec<Held>) -> Vec<u64> {
    let mut out = vec![];
    exec.poll(&mut |tag, r| {
        r.expect("the read succeeds");
        out.push(tag);
    });
    out
}

#[test]
fn a_read_waiting_on_a_callback_needs_no_poll_until_it_completes() {
    let s = setup(true);
    assert!(!s.exec.needs_poll() && !s.exec.busy());
    read(&s, 7);
    assert!(s.exec.busy(), "a read is in flight");
    assert!(!s.exec.needs_poll(), "its completion comes by callback");
    // The callback hands the completion in: the request waits to be reported.
    let op = s.held.borrow_mut().pop().expect("one operation submitted");
    s.exec.device_completed(op, Ok(()));
    assert!(
        s.exec.needs_poll(),
        "a finished request waits to be reported"
    );
    assert_eq!(reported(&s.exec), vec![7]);
    assert!(!s.exec.needs_poll() && !s.exec.busy());
}

#[test]
fn a_read_on_a_device_that_completes_in_its_poll_needs_polls() {
    let s = setup(false);
    read(&s, 9);
    assert!(
        s.exec.needs_poll(),
        "only a poll of the device finds its completion"
    );
    assert_eq!(reported(&s.exec), Vec::<u64>::new());
    assert!(s.exec.needs_poll());
    let op = s.held.borrow_mut().pop().expect("one operation submitted");
    s.released.borrow_mut().push(op);
    assert_eq!(reported(&s.exec), vec![9]);
    assert!(!s.exec.needs_poll() && !s.exec.busy());
}

#[test]
fn a_completion_queued_for_the_poll_of_an_announcing_device_needs_a_poll() {
    // SPDK's callback declines a completion inside the engine: it queues it for the poll.
    let s = setup(true);
    read(&s, 3);
    assert!(!s.exec.needs_poll());
    let op = s.held.borrow_mut().pop().expect("one operation submitted");
    s.released.borrow_mut().push(op);
    assert!(s.exec.needs_poll());
    assert_eq!(reported(&s.exec), vec![3]);
}

#[test]
fn a_refused_submission_and_a_spawned_task_need_polls() {
    let s = setup(true);
    s.busy_once.set(true);
    read(&s, 5);
    assert!(
        s.exec.needs_poll(),
        "the refused operation is retried by a poll"
    );
    assert_eq!(reported(&s.exec), Vec::<u64>::new());
    assert!(
        !s.exec.needs_poll(),
        "retried: now it waits on the callback"
    );
    let op = s.held.borrow_mut().pop().expect("the retried operation");
    s.exec.device_completed(op, Ok(()));
    assert_eq!(reported(&s.exec), vec![5]);

    // A task runs at the next poll; once it waits on the device, no poll is needed until
    // the callback makes it runnable again.
    let done = Rc::new(Cell::new(false));
    let (exec, dev, d) = (s.exec.clone(), s.dev, Rc::clone(&done));
    s.exec.spawn(async move {
        read_bytes(&exec, dev, 0, 512).await.expect("read");
        d.set(true);
    });
    assert!(s.exec.needs_poll(), "a spawned task is runnable");
    reported(&s.exec);
    assert!(s.exec.busy() && !s.exec.needs_poll());
    let op = s.held.borrow_mut().pop().expect("the task's read");
    s.exec.device_completed(op, Ok(()));
    assert!(s.exec.needs_poll(), "the task is runnable again");
    reported(&s.exec);
    assert!(done.get());
    assert!(!s.exec.needs_poll() && !s.exec.busy());
}
