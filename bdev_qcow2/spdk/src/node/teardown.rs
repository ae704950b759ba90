//! A node's teardown, in this order (as SPDK's passthru does it):
//! 1. SPDK's destruct (the bdev is unregistered and unused): the node leaves the registry,
//!    then its io_device is unregistered.
//! 2. Once the last channel is destroyed, on the md thread (where the owner lives and the
//!    descriptors were opened), after every channel state is freed (so every request has
//!    completed): a writable bdev's owner flushes the metadata (`Chain::close`) and is freed.
//! 3. The backing then the base descriptor close (releasing the claims), SPDK hears that
//!    destruct is done, and the node is freed.

use super::Node;
use crate::ffi::node::NodeKey;
use crate::registry;
use crate::types::{MdNode, OwnerBox, Unregistered};

/// Teardown, step 1 (SPDK's `destruct`).
pub fn destruct(key: NodeKey) {
    let node = {
        let mut reg = registry::lock();
        let Some(node) = reg.take(key) else {
            return tracing::error!("destruct of a qcow2 bdev that is not registered");
        };
        // Its own channel goes first: the io_device waits for every channel.
        node.node().release_kept();
        // (Under the registry's lock: a pass over its channels either started or never
        // will.)
        super::passes::unless_passing(key, node)
    };
    if let Some(node) = node {
        node.unregister_device();
    }
}

/// Teardown, between steps 1 and 2: the node's last channel is gone; go to the md thread.
pub fn channels_gone(node: Unregistered) {
    if let Err(e) = node.on_md_thread(close_when_unused) {
        tracing::error!("cannot reach the md thread ({e}): leaking the descriptors");
    }
}

/// Teardown, step 2, once no channel state is left (a channel destroyed while its state
/// still had base I/O in flight is freed later, by its poller).
fn close_when_unused(n: MdNode) {
    if n.node().live_channels() > 0 {
        // A channel state still drains its I/O on some thread: look again shortly.
        let _ = n.again(close_when_unused);
        return;
    }
    n.close_owner(|n, counters| {
        // Every channel retired its counters, and the owner's are final (its tasks are
        // done).
        log_summary(n.node(), counters);
        close_descs(n)
    });
}

/// Logs what the bdev's read-ahead and slice caches did over its life (at delete or
/// shutdown), from the retired channels' counters and the closed owner's. Only once no
/// channel is left (their counters are all in `retired`).
fn log_summary(n: &Node, owner: Option<crate::owner::OwnerCounters>) {
    let mut t = n.retired();
    if let Some((p, c, r)) = owner {
        t.add_ring(&r);
        t.l2_cache_hits += c.hits;
        t.l2_cache_misses += c.misses;
        t.prefetch_streams += p.streams;
        t.prefetch_issued += p.issued;
        t.prefetch_loaded += p.loaded;
        t.prefetch_hits += p.hits;
    }
    tracing::info!(
        "qcow2 bdev {}: {} requests; slice caches {} hits, {} misses; read-ahead {} \
         sequential streams, {} slices loaded ahead of {} started, {} reached by their stream; \
         prefetch ring {} streams, {} read-ahead I/Os, {} bytes read ahead, {} bytes served \
         in {} reads ({} of them in part, {} of those with the rest waited for; {} waited for their read-ahead, {} of those then \
         sent to the base), \
         {} bytes evicted unread, {} chunks invalidated by writes, {} compressed fills, \
         {} read-aheads run as tasks, {} rings stopped on a synchronous base",
        n.name(),
        t.completed,
        t.l2_cache_hits,
        t.l2_cache_misses,
        t.prefetch_streams,
        t.prefetch_loaded,
        t.prefetch_issued,
        t.prefetch_hits,
        t.ring_streams,
        t.ring_readahead_ios,
        t.ring_bytes_read_ahead,
        t.ring_bytes_served,
        t.ring_reads_served,
        t.ring_reads_partial,
        t.ring_partial_waited,
        t.ring_reads_waited,
        t.ring_waited_to_base,
        t.ring_bytes_evicted_unread,
        t.ring_invalidated,
        t.ring_compressed_fills,
        t.ring_readahead_tasks,
        t.ring_synchronous_base
    );
}

/// Teardown, step 3.
fn close_descs(n: MdNode) {
    for d in n.node().take_descs().into_iter().flatten() {
        d.close();
    }
    if let Some(b) = n.node().take_below() {
        b.close();
    }
    let n = n.destruct_done();
    tracing::info!("qcow2 bdev {} deleted", n.name());
}

/// A node whose bdev never registered, back once its io_device is gone (on the md thread,
/// the one that registered it): its owner closes, then its descriptors.
pub fn never_registered(n: Node, owner: Option<OwnerBox>) {
    let descs = n.take_descs();
    let below = n.take_below();
    let close = move || {
        for d in descs.into_iter().flatten() {
            d.close();
        }
        if let Some(b) = below {
            b.close();
        }
    };
    match owner {
        None => close(),
        // Never used (the bdev never registered).
        Some(o) => o.close(move |_| close()),
    }
}
