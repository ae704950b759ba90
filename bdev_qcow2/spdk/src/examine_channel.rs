//! A new bdev's channel on the app thread, held from its `examine_config` until a qcow2
//! creation over it has read its image (or [`HOLD`] has passed, or the bdev leaves).
//!
//! Why: an AIO bdev's channel is a kernel AIO context, and its `io_destroy` waits for an RCU
//! grace period (35 ms each on the shared 2-core machine). SPDK's examine of a new bdev
//! (raid, lvol, gpt: `examine_disk`, after every module's `examine_config`) takes a channel,
//! reads and puts it; a qcow2 creation over the bdev then took a channel of its own to read
//! the image and put it: two contexts made and destroyed per base bdev, one after the
//! other, on the app thread. A chain of 1,000 qcow2 bdevs opened in 81 s, nearly all of it
//! waiting in `io_destroy` (PERFORMANCE.md §14). Held here, both take this channel: one
//! context per base bdev.

use crate::ffi::bdev::{BdevEvents, Desc, DescChannel, OpenMode};
use crate::ffi::sys;
use std::cell::RefCell;
use std::time::Duration;

/// How long a channel is held when no qcow2 creation comes to read it: long enough for a
/// script's next RPC (`rpc.py` starts in about 100 ms), short enough that an AIO context
/// nothing reads leaves the thread's polls soon.
pub const HOLD: Duration = Duration::from_secs(1);

/// One held channel of bdev `name` (put back before its descriptor closes).
struct Held {
    name: String,
    _ch: DescChannel,
}

thread_local! {
    /// The channels held on this thread (the app thread: examine runs there).
    static HELD: RefCell<Vec<Held>> = const { RefCell::new(Vec::new()) };
}

/// Our descriptor's events: a bdev that leaves is let go at once.
struct Events;

impl BdevEvents for Events {
    fn event(ty: sys::spdk_bdev_event_type, bdev_name: &str) {
        if ty == sys::SPDK_BDEV_EVENT_REMOVE {
            release(bdev_name);
        }
    }
}

/// `examine_config` of bdev `name`: holds a channel of it on this thread for [`HOLD`],
/// unless it is one of ours (nothing creates a qcow2 bdev over those at once, and our
/// bdevs' channels cost no kernel context of their own). Best effort: nothing is held when
/// SPDK refuses the descriptor, the channel or the timer.
pub fn hold(name: &str) {
    let Ok(desc) = Desc::open::<Events>(name, OpenMode::ReadOnly) else {
        return;
    };
    if desc.module_name() == "qcow2" {
        return desc.close();
    }
    let held = match DescChannel::of(desc) {
        Ok(ch) => Held {
            name: name.to_string(),
            _ch: ch,
        },
        Err(desc) => return desc.close(),
    };
    let hold_ends = |name: String| release(&name);
    if crate::node::later::after(HOLD, c"qcow2_hold", name.to_string(), hold_ends).is_err() {
        return;
    }
    HELD.with(|h| h.borrow_mut().push(held));
}

/// Puts back the channel of bdev `name` held on this thread, if any (a creation over it
/// has read its image; or the hold's time is up; or the bdev leaves).
pub fn release(name: &str) {
    let gone: Vec<Held> = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let (gone, kept) = std::mem::take(&mut *h)
            .into_iter()
            .partition(|x| x.name == name);
        *h = kept;
        gone
    });
    // Dropped outside the borrow: the put may run SPDK callbacks.
    drop(gone);
}
