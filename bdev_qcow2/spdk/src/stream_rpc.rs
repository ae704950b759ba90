//! `bdev_qcow2_stream {name, rate_limit}`: copies into the image everything it reads from
//! its backing bdev, in the background, then drops the backing reference
//! (ARCHITECTURE.md §13). The job lives with the owner, on the md thread: the owner's
//! poller drives it one step at a time (the engine's `StreamJob`), so the reactor never
//! blocks. Once the header no longer names the backing file, every channel's chain stops
//! reading the backing bdev (one `for_each_channel`), and only then the owner's: until
//! every core has stopped, the owner keeps treating the range as backed (a discard leaves
//! zero flags, never a hole a core could still read through to the backing bdev).
//! Progress is in `bdev_qcow2_get_stats` (`owner.stream`).

use crate::ffi::node::NodeKey;
use crate::ffi::rpc::{Params, Request};
use crate::lifecycle_busy::Busy;
use crate::owner::{Owner, StreamSide};
use crate::params::StreamParams;
use crate::registry;
use crate::rpc::decode;
use crate::types::{ChannelIter, Qcow2Bdev};
use qcow2_engine::stream::{StreamJob, StreamState};
use serde_json::{json, Value};
use std::cell::Cell;
use std::os::raw::c_int;

/// A stream job of one bdev, kept by its owner.
pub struct Stream {
    job: StreamJob,
    key: NodeKey,
    /// The channels were asked to detach the backing bdev.
    detaching: Cell<bool>,
}

crate::rpc_entry!(bdev_qcow2_rpc_stream => stream);

/// The owner keeps the stream job and its poller drives it ([`poll`]).
impl StreamSide for Qcow2Bdev {
    type Stream = Stream;

    fn poll_stream(owner: &Owner) -> usize {
        poll(owner)
    }

    fn stream_json(owner: &Owner) -> Value {
        stats_json(owner)
    }
}

/// `bdev_qcow2_stream`: starts the job and answers `true` at once (the job reports through
/// `bdev_qcow2_get_stats`). Refused on a read-only bdev, one with no backing bdev (or one
/// already dropped), and while a stream, a resize or a snapshot runs. (A resize or a
/// snapshot started during a stream is safe: a step commits only over the L2 words and
/// the writable table it planned from, and plans again otherwise.)
pub fn stream(req: Request, params: Params) {
    const METHOD: &str = "bdev_qcow2_stream";
    let Some((req, p)) = decode::<StreamParams>(req, params, METHOD) else {
        return;
    };
    let reg = registry::lock();
    let (node, owner) = match reg.writable(&p.name) {
        Ok(found) => found,
        Err((errno, msg)) => {
            drop(reg);
            return req.errno(errno, &msg);
        }
    };
    if !node.node().reads_backing() {
        drop(reg);
        return req.errno(
            libc::EINVAL,
            &format!("{METHOD}: {} has no backing bdev to stream from", p.name),
        );
    }
    if owner.job_running() {
        drop(reg);
        return req.errno(
            libc::EBUSY,
            &format!("{METHOD}: a resize or snapshot of {} is under way", p.name),
        );
    }
    // Only while no other life-cycle RPC runs: an external snapshot would close the owner
    // the job lives on (it refuses to start during a stream in turn).
    let Some(_busy) = Busy::begin(&p.name) else {
        drop(reg);
        return req.errno(
            libc::EBUSY,
            &format!(
                "{METHOD}: another life-cycle operation is running on {}",
                p.name
            ),
        );
    };
    let slot = owner.stream();
    if running(owner) {
        drop(reg);
        return req.errno(
            libc::EBUSY,
            &format!("{METHOD}: a stream of {} is under way", p.name),
        );
    }
    match StreamJob::new(owner.chain(), p.rate_limit) {
        Ok(job) => {
            tracing::info!(
                "qcow2 bdev {}: streaming {} bytes from its backing bdev (rate limit {} B/s)",
                p.name,
                job.progress().bytes_total,
                p.rate_limit
            );
            *slot.borrow_mut() = Some(Stream {
                job,
                key: node.key(),
                detaching: Cell::new(false),
            });
            drop(reg);
            req.result(&json!(true));
        }
        Err(e) => {
            drop(reg);
            req.errno(e.errno(), &format!("{METHOD}: {e}"));
        }
    }
}

/// Whether a stream job is under way on `owner`.
pub fn running(owner: &Owner) -> bool {
    owner
        .stream()
        .borrow()
        .as_ref()
        .is_some_and(|s| s.job.progress().state.running())
}

/// Drives the stream job from the owner's poller; returns the work done (0 or 1).
pub fn poll(owner: &Owner) -> usize {
    let slot = owner.stream().borrow();
    let Some(s) = slot.as_ref() else {
        return 0;
    };
    let before = s.job.progress().bytes_done;
    let state = owner.run(|| s.job.poll(owner.chain()));
    if state == StreamState::Detaching && !s.detaching.replace(true) {
        let key = s.key;
        drop(slot);
        detach_channels(key);
        return 1;
    }
    usize::from(s.job.progress().bytes_done != before)
}

/// The header no longer names the backing file: new channels will not read it, and every
/// existing channel stops; then the owner ([`detached`]).
fn detach_channels(key: NodeKey) {
    let reg = registry::lock();
    let Some(node) = reg.by_key(key) else {
        return;
    };
    node.node().drop_backing();
    node.for_each_channel(key, detach_step, detached);
}

fn detach_step(it: ChannelIter, _: &mut NodeKey) {
    it.with_channel(|ch, it| {
        ch.detach_backing();
        it.next(0);
    });
}

fn detached(key: NodeKey, status: c_int) {
    let reg = registry::lock();
    let Some(owner) = reg.by_key(key).and_then(|n| n.owner_here()) else {
        return;
    };
    if status != 0 {
        // Cannot happen (the steps continue with 0); the job stays detaching.
        tracing::error!("bdev_qcow2_stream: detaching the backing bdev failed ({status})");
        return;
    }
    if let Some(n) = reg.by_key(key) {
        n.node().stream_left_backing();
    }
    let slot = owner.stream().borrow();
    if let Some(s) = slot.as_ref() {
        s.job.cores_detached(owner.chain());
        tracing::info!(
            "qcow2 bdev {}: stream done, the backing bdev is no longer read",
            reg.by_key(key).map(|n| n.node().name()).unwrap_or_default()
        );
    }
}

/// The stream's state for `bdev_qcow2_get_stats` (`null` before any stream).
pub fn stats_json(owner: &Owner) -> Value {
    let slot = owner.stream().borrow();
    let Some(s) = slot.as_ref() else {
        return Value::Null;
    };
    let p = s.job.progress();
    let mut v = json!({
        "state": p.state.name(),
        "bytes_done": p.bytes_done,
        "bytes_total": p.bytes_total,
        "bytes_filled": p.bytes_filled,
        "clusters_done": p.clusters_done,
        "clusters_total": p.clusters_total,
        "rate_limit": p.rate_limit,
    });
    if let StreamState::Failed(e) = &p.state {
        v["error"] = json!(e);
    }
    v
}
