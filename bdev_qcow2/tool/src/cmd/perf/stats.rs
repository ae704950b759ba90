//! One run on every core and its statistics: rates, latencies and the engine's counters,
//! and two runs merged into one.

use super::args::{PerfArgs, Switch, Workload};
use super::device::{open_dev, Dev};
use super::workload::{drive, warm, Lanes, RawTarget};
use crate::host::{ToolError, ToolResult};
use crate::lock::Access;
use crate::reactor::run_reactors_keyed;
use crate::uring::DeviceStats;
use qcow2_engine::ring::RingStats;
use qcow2_engine::{Exec, OpenOptions};
use std::path::Path;

/// One run's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunResult {
    /// "qcow2" or "raw".
    pub target: &'static str,
    /// Workload.
    pub workload: Workload,
    /// I/O size in bytes.
    pub io_size: u64,
    /// Queue depth per core.
    pub depth: usize,
    /// Cores.
    pub cores: usize,
    /// Operations per second.
    pub iops: f64,
    /// Operations completed.
    pub ops: u64,
    /// MiB per second.
    pub mibps: f64,
    /// Mean latency in microseconds.
    pub lat_avg_us: f64,
    /// 99th percentile latency in microseconds.
    pub lat_p99_us: f64,
    /// L2 slice cache hits (qcow2 runs).
    pub cache_hits: u64,
    /// L2 slice cache misses.
    pub cache_misses: u64,
    /// L2 slice cache evictions.
    pub cache_evictions: u64,
    /// L2 slices read ahead of a sequential stream.
    pub prefetch_loaded: u64,
    /// ... that the stream reached after they were loaded.
    pub prefetch_hits: u64,
    /// Whether the prefetch ring was on.
    pub prefetch: Switch,
    /// Prefetch ring: sequential streams detected.
    pub ring_streams: u64,
    /// Prefetch ring: read-ahead I/Os issued.
    pub ring_readahead_ios: u64,
    /// Prefetch ring: bytes read ahead.
    pub ring_bytes_read_ahead: u64,
    /// Prefetch ring: bytes of reads served from it.
    pub ring_bytes_served: u64,
    /// Prefetch ring: reads it served a first part of (the rest read or waited for).
    pub ring_reads_partial: u64,
    /// Prefetch ring: of those, reads whose rest waited for read-aheads in flight (the
    /// others' rest was read from the base at once).
    pub ring_partial_waited: u64,
    /// Prefetch ring: reads that waited for a read-ahead in flight.
    pub ring_reads_waited: u64,
    /// Prefetch ring: of those, reads sent to the base (read-ahead failed or written).
    pub ring_waited_to_base: u64,
    /// Prefetch ring: bytes read ahead and dropped unread.
    pub ring_bytes_evicted_unread: u64,
    /// Prefetch ring: chunks a write made unusable.
    pub ring_invalidated: u64,
    /// Prefetch ring: read-aheads of chunks holding compressed clusters, without a task.
    pub ring_compressed_fills: u64,
    /// Prefetch ring: read-aheads that ran as a task.
    pub ring_readahead_tasks: u64,
    /// Verify mismatches (must be 0).
    pub verify_failures: u64,
    /// Writes the device was given during the run (data and metadata; every core's).
    pub device_writes: u64,
    /// Bytes of those writes.
    pub device_bytes_written: u64,
    /// Of `device_writes`, those core 0 (the metadata owner) gave its device.
    pub owner_device_writes: u64,
    /// Messages between reactors during the run (requests, answers, slices; qcow2 runs on
    /// more than one core).
    pub messages: u64,
}

/// Per-core outcome: ops, latencies, verify failures, (cache counters, slices read ahead,
/// of which reached in time, prefetch ring counters), the device's counters over the run.
type CoreRun = (
    u64,
    Vec<u32>,
    u64,
    (qcow2_engine::cache::CacheStats, u64, u64, RingStats),
    DeviceStats,
    Traffic,
);

/// What one core's run sent across reactors and where its device writes went.
#[derive(Debug, Clone, Copy, Default)]
struct Traffic {
    /// Messages the core took from its queue during the run.
    received: u64,
    /// Whether the core is the metadata owner (core 0).
    owner: bool,
}

/// What the device of `dev` counted between `before` and now.
fn device_since<E: std::ops::Deref<Target = Exec<Dev>>>(
    exec: E,
    dev: qcow2_engine::DevId,
    before: DeviceStats,
) -> DeviceStats {
    let now = exec.with_device(dev, |d| d.inner.stats());
    DeviceStats {
        writes: now.writes - before.writes,
        bytes_written: now.bytes_written - before.bytes_written,
        ..now
    }
}

/// One run (qcow2 or raw) on `a.cores` cores.
pub fn run_one(path: &Path, raw: bool, w: Workload, a: &PerfArgs) -> ToolResult<RunResult> {
    let cores = a.cores.max(1);
    let runs: Vec<CoreRun> = if raw {
        let mut handles = Vec::new();
        for core in 0..cores {
            let (p, a2) = (path.to_path_buf(), a.clone());
            handles.push(std::thread::spawn(move || -> ToolResult<CoreRun> {
                let exec: Exec<Dev> = Exec::new();
                let dev = exec.add_device(open_dev(&p, w.writes(), &a2)?);
                let size = exec.device_size(dev) / 512 * 512;
                let mut t = RawTarget { exec, dev, size };
                let before = t.exec.with_device(dev, |d| d.inner.stats());
                let (o, l, f) = drive(&mut t, &a2, w, Lanes { core, cores })?;
                let ds = device_since(&t.exec, dev, before);
                Ok((o, l, f, Default::default(), ds, Traffic::default()))
            }));
        }
        let mut v = Vec::new();
        for h in handles {
            v.push(
                h.join()
                    .map_err(|_| ToolError::Usage("a perf thread panicked".into()))??,
            );
        }
        v
    } else {
        let opts = OpenOptions {
            l2_cache_bytes: a.l2_cache_size,
            l2_slice_bytes: a.l2_slice_size,
            cache_ways: a.cache_ways,
            alloc_granule: a.alloc_granule,
            ..OpenOptions::default()
        };
        let open = |id: usize, writable: bool| {
            let mut d = open_dev(path, writable, a)?;
            if id > 0 {
                d.inner = d.inner.into_channel();
            } else {
                // The owner's open holds the image's locks for the process; the other
                // cores' channels are further opens of it and take none (they would
                // conflict with the owner's).
                let access = if writable {
                    Access::Write
                } else {
                    Access::Read
                };
                crate::host::lock_device(&mut d.inner, path, access)?;
            }
            Ok(d)
        };
        let ring = a.ring()?;
        let key = a.key()?;
        let out = run_reactors_keyed(cores, &open, opts, w.writes(), ring, key, |r| {
            r.chain().prefetch().set_on(ring.is_some());
            if !a.cold {
                warm(r)?;
            }
            let before = r.cache_stats();
            let pf_before = r.chain().prefetch().stats();
            let ring_before = r.chain().ring().stats().unwrap_or_default();
            let core = r.id();
            let dev_before = r.exec().with_device(r.dev(), |d| d.inner.stats());
            let received = r.stats().received;
            let (o, l, f) = drive(r, a, w, Lanes { core, cores })?;
            let ds = device_since(r.exec(), r.dev(), dev_before);
            let traffic = Traffic {
                received: r.stats().received - received,
                owner: r.is_owner(),
            };
            let after = r.cache_stats();
            let stats = qcow2_engine::cache::CacheStats {
                hits: after.hits - before.hits,
                misses: after.misses - before.misses,
                evictions: after.evictions - before.evictions,
                ..after
            };
            let pf = r.chain().prefetch().stats();
            let ring_after = r.chain().ring().stats().unwrap_or_default();
            Ok((
                o,
                l,
                f,
                (
                    stats,
                    pf.loaded - pf_before.loaded,
                    pf.hits - pf_before.hits,
                    ring_after.since(&ring_before),
                ),
                ds,
                traffic,
            ))
        })?;
        out.into_iter().map(|(r, _)| r).collect()
    };
    let mut ops = 0;
    let mut lat = Vec::new();
    let mut fails = 0;
    let mut stats = qcow2_engine::cache::CacheStats::default();
    let (mut pf_loaded, mut pf_hits) = (0, 0);
    let mut ring = RingStats::default();
    let mut dev = DeviceStats::default();
    let (mut owner_writes, mut messages) = (0, 0);
    for (o, l, f, (s, loaded, hits, rs), ds, t) in runs {
        ring.add(&rs);
        messages += t.received;
        if t.owner {
            owner_writes += ds.writes;
        }
        dev.writes += ds.writes;
        dev.bytes_written += ds.bytes_written;
        ops += o;
        lat.extend(l);
        fails += f;
        stats.hits += s.hits;
        stats.misses += s.misses;
        stats.evictions += s.evictions;
        pf_loaded += loaded;
        pf_hits += hits;
    }
    lat.sort_unstable();
    let avg = lat.iter().map(|&x| x as f64).sum::<f64>() / lat.len().max(1) as f64;
    let p99 = lat
        .get(lat.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or(0) as f64;
    let iops = ops as f64 / a.seconds;
    Ok(RunResult {
        target: if raw { "raw" } else { "qcow2" },
        workload: w,
        io_size: a.io_size,
        depth: a.depth,
        cores,
        iops,
        ops,
        mibps: iops * a.io_size as f64 / (1 << 20) as f64,
        lat_avg_us: avg,
        lat_p99_us: p99,
        cache_hits: stats.hits,
        cache_misses: stats.misses,
        cache_evictions: stats.evictions,
        prefetch_loaded: pf_loaded,
        prefetch_hits: pf_hits,
        prefetch: if raw { Switch::Off } else { a.prefetch },
        ring_streams: ring.streams,
        ring_readahead_ios: ring.readahead_ios,
        ring_bytes_read_ahead: ring.bytes_read_ahead,
        ring_bytes_served: ring.bytes_served,
        ring_reads_partial: ring.reads_partial,
        ring_partial_waited: ring.partial_waited,
        ring_reads_waited: ring.reads_waited,
        ring_waited_to_base: ring.waited_to_base,
        ring_bytes_evicted_unread: ring.bytes_evicted_unread,
        ring_invalidated: ring.invalidated,
        ring_compressed_fills: ring.compressed_fills,
        ring_readahead_tasks: ring.readahead_tasks,
        verify_failures: fails,
        device_writes: dev.writes,
        device_bytes_written: dev.bytes_written,
        owner_device_writes: owner_writes,
        messages,
    })
}

/// Two runs of the same target and workload as one: mean rates and latency, the worse
/// p99, summed counters.
pub(super) fn merge(a: RunResult, b: RunResult) -> RunResult {
    RunResult {
        iops: (a.iops + b.iops) / 2.0,
        ops: a.ops + b.ops,
        mibps: (a.mibps + b.mibps) / 2.0,
        lat_avg_us: (a.lat_avg_us + b.lat_avg_us) / 2.0,
        lat_p99_us: a.lat_p99_us.max(b.lat_p99_us),
        cache_hits: a.cache_hits + b.cache_hits,
        cache_misses: a.cache_misses + b.cache_misses,
        cache_evictions: a.cache_evictions + b.cache_evictions,
        prefetch_loaded: a.prefetch_loaded + b.prefetch_loaded,
        prefetch_hits: a.prefetch_hits + b.prefetch_hits,
        ring_streams: a.ring_streams + b.ring_streams,
        ring_readahead_ios: a.ring_readahead_ios + b.ring_readahead_ios,
        ring_bytes_read_ahead: a.ring_bytes_read_ahead + b.ring_bytes_read_ahead,
        ring_bytes_served: a.ring_bytes_served + b.ring_bytes_served,
        ring_reads_partial: a.ring_reads_partial + b.ring_reads_partial,
        ring_partial_waited: a.ring_partial_waited + b.ring_partial_waited,
        ring_reads_waited: a.ring_reads_waited + b.ring_reads_waited,
        ring_waited_to_base: a.ring_waited_to_base + b.ring_waited_to_base,
        ring_bytes_evicted_unread: a.ring_bytes_evicted_unread + b.ring_bytes_evicted_unread,
        ring_invalidated: a.ring_invalidated + b.ring_invalidated,
        ring_compressed_fills: a.ring_compressed_fills + b.ring_compressed_fills,
        ring_readahead_tasks: a.ring_readahead_tasks + b.ring_readahead_tasks,
        verify_failures: a.verify_failures + b.verify_failures,
        device_writes: a.device_writes + b.device_writes,
        device_bytes_written: a.device_bytes_written + b.device_bytes_written,
        owner_device_writes: a.owner_device_writes + b.owner_device_writes,
        messages: a.messages + b.messages,
        ..a
    }
}
