//! `qcow2 perf`: a bdevperf-shaped workload generator on the standalone host, reporting our
//! engine side by side with the same workload on the same file read as a raw disk.
//!
//! With no image it creates a sample image (fully allocated, in a temporary directory) and
//! runs a short default set. `--cores N` runs N reactors on the one image (see
//! [`crate::reactor`]): each with its own executor, io_uring and slice-cache replica; core 0
//! owns the metadata.

use crate::host::{ToolError, ToolResult};
use crate::reactor::{run_reactors_with_ring, Reactor};
use crate::rng::Rng;
use crate::uring::{AlignedBuf, UringDevice};
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, IoBuffer};
use qcow2_engine::ring::{RingConfig, RingStats};
use qcow2_engine::{Chain, DevId, Exec, Layer, OpenOptions, Qcow2};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Workload kinds (bdevperf's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential mix (-M % reads).
    Rw,
    /// Random mix (-M % reads).
    Randrw,
    /// Write, read back and compare.
    Verify,
}

impl Workload {
    fn writes(self) -> bool {
        !matches!(self, Workload::Read | Workload::Randread)
    }
    fn random(self) -> bool {
        matches!(
            self,
            Workload::Randread | Workload::Randwrite | Workload::Randrw | Workload::Verify
        )
    }
}

/// Arguments of `qcow2 perf`.
#[derive(Debug, Clone, clap::Args)]
pub struct PerfArgs {
    /// Queue depth per core.
    #[arg(short = 'q', default_value_t = 32)]
    pub depth: usize,
    /// I/O size (e.g. 4k, 128k).
    #[arg(short = 'o', value_parser = crate::parse_size, default_value = "4k")]
    pub io_size: u64,
    /// Workload. Without -w (and without an image), a default set runs.
    #[arg(short = 'w', value_enum)]
    pub workload: Option<Workload>,
    /// Percentage of reads for rw/randrw.
    #[arg(short = 'M', default_value_t = 50)]
    pub rwmix: u32,
    /// Seconds per run.
    #[arg(short = 't', default_value_t = 3.0)]
    pub seconds: f64,
    /// Polling cores (reactors) on one image: core 0 owns the metadata; the others serve
    /// cache hits and in-place writes themselves and send the rest to core 0.
    #[arg(long, default_value_t = 1)]
    pub cores: usize,
    /// L2 slice cache size per core.
    #[arg(long, value_parser = crate::parse_size)]
    pub l2_cache_size: Option<u64>,
    /// L2 slice size.
    #[arg(long, value_parser = crate::parse_size, default_value = "4096")]
    pub l2_slice_size: u64,
    /// Ways per set of the slice cache.
    #[arg(long, default_value_t = 8)]
    pub cache_ways: usize,
    /// Added device latency in microseconds (like SPDK's delay bdev).
    #[arg(long, default_value_t = 0)]
    pub base_latency_us: u64,
    /// Cold metadata: no warm-up, every L2 slice is read when first needed (read-ahead
    /// shows here).
    #[arg(long)]
    pub cold: bool,
    /// Read-ahead on sequential streams: guest data into each core's prefetch ring, and
    /// L2 slices into its cache.
    #[arg(long, value_enum, default_value = "on")]
    pub prefetch: Switch,
    /// Bytes of prefetch ring per core (a multiple of 128 KiB).
    #[arg(long, value_parser = crate::parse_size, default_value = "5M")]
    pub ring_size: u64,
    /// Most bytes one stream reads ahead (a multiple of 128 KiB, at most 8M).
    #[arg(long, value_parser = crate::parse_size, default_value = "1M")]
    pub max_window: u64,
    /// Run only the raw baseline (the same workload on the same file as a raw disk).
    #[arg(long)]
    pub raw: bool,
    /// Buffered I/O instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// One JSON object per run instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Thrash runs: random reads (-w randread unless -w says otherwise) with the slice cache
    /// covering these percentages of the image's L2 slices (e.g. 25,50), each side by side
    /// with the same workload on a cache covering all of them, reporting the miss rate and
    /// IOPS against the bound IOPS(whole cache) / (1 + miss rate): one slice read per miss.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=100))]
    pub thrash: Vec<u32>,
    /// Size of the sample image when no image is given.
    #[arg(long, value_parser = crate::parse_size, default_value = "1G")]
    pub sample_size: u64,
    /// The image (qcow2, no backing file; write workloads overwrite its data, like bdevperf).
    /// Default: a sample image in a temporary directory.
    pub image: Option<PathBuf>,
}

/// A feature turned on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

impl PerfArgs {
    /// The prefetch ring these arguments ask for (`None`: off).
    fn ring(&self) -> ToolResult<Option<RingConfig>> {
        if self.prefetch == Switch::Off {
            return Ok(None);
        }
        let cfg = RingConfig {
            ring_bytes: self.ring_size,
            max_window: self.max_window,
        };
        cfg.validate().map_err(|e| ToolError::Usage(e.into()))?;
        Ok(Some(cfg))
    }
}

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
}

/// A device that adds a fixed latency to every completion (test double for slow media).
pub struct DelayDevice<D: BlockDevice> {
    inner: D,
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
    fn zeroes_cheaply(&self) -> bool {
        self.inner.zeroes_cheaply()
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

type Dev = DelayDevice<UringDevice>;

fn open_dev(path: &Path, writable: bool, a: &PerfArgs) -> ToolResult<Dev> {
    let inner = UringDevice::open(path, writable, !a.buffered, (a.depth * 2).max(8) as u32)
        .map_err(|source| ToolError::Io {
            path: path.display().to_string(),
            source,
        })?;
    Ok(DelayDevice {
        inner,
        delay: Duration::from_micros(a.base_latency_us),
        held: VecDeque::new(),
    })
}

/// What a run drives: the engine (a reactor over the shared image), or the raw file.
trait PerfTarget {
    fn size(&self) -> u64;
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>);
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>));
    /// A request at `off` is about to be submitted: fetch what it will look up.
    fn prefetch(&self, _off: u64) {}
}

impl PerfTarget for Reactor<Dev> {
    fn size(&self) -> u64 {
        self.chain.size()
    }
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>) {
        if write {
            self.submit_write(tag, off, buf)
        } else {
            self.submit_read(tag, off, buf)
        }
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) {
        Reactor::poll(self, done);
    }
    fn prefetch(&self, off: u64) {
        if let Some(p) = self.chain.entry_hint(off) {
            crate::uring::prefetch_line(p.cast());
        }
    }
}

/// The raw file on one core.
struct RawTarget {
    exec: Exec<Dev>,
    dev: DevId,
    size: u64,
}

impl PerfTarget for RawTarget {
    fn size(&self) -> u64 {
        self.size
    }
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>) {
        let op = if write {
            DeviceOp::Write { offset: off, buf }
        } else {
            DeviceOp::Read { offset: off, buf }
        };
        // The leanest path the executor has: the baseline pays no more than it must.
        self.exec
            .request_single(tag, qcow2_engine::exec::NO_GRACE, self.dev, op);
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) {
        self.exec.poll(done);
    }
}

/// Where one core's requests go: `lane` of `lanes` (verify: each slot of each core owns
/// its own blocks, so no two requests in flight overlap).
#[derive(Clone, Copy)]
struct Lanes {
    core: usize,
    cores: usize,
}

/// Runs one workload on one core; returns (ops, latencies in µs, verify failures).
fn drive(
    target: &mut dyn PerfTarget,
    a: &PerfArgs,
    w: Workload,
    lanes: Lanes,
) -> ToolResult<(u64, Vec<u32>, u64)> {
    let seed = lanes.core as u64 * 7919 + 1;
    let len = a.io_size as usize;
    let blocks = target.size() / a.io_size;
    if blocks == 0 {
        return Err(ToolError::Usage("I/O size larger than the disk".into()));
    }
    let qd = a.depth.max(1);
    let stride = (qd * lanes.cores) as u64;
    let bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(len)).collect();
    let check: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(len)).collect();
    let mut rng = Rng(seed | 1);
    // Sequential streams of different cores start at different places.
    let mut seq = (seed * 7919) % blocks;
    // Per slot: (start time, offset, phase: 0 = read/write, 1 = verify read-back).
    let mut slots: Vec<Option<(Instant, u64, bool, u8)>> = vec![None; qd];
    let mut lat: Vec<u32> = Vec::with_capacity(1 << 20);
    let (mut ops, mut failures) = (0u64, 0u64);
    let end = Instant::now() + Duration::from_secs_f64(a.seconds);
    let mut done: Vec<(u64, qcow2_engine::Result<()>)> = Vec::with_capacity(qd);
    let mut batch: Vec<(usize, u64, bool)> = Vec::with_capacity(qd);
    let mut stopping = false;
    let mut polls = 0u64;
    loop {
        if !stopping {
            for (i, slot) in slots.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let block = if w.random() {
                    let b = rng.next() % blocks;
                    if w == Workload::Verify {
                        b - b % stride + (lanes.core * qd + i) as u64
                    } else {
                        b
                    }
                } else {
                    seq = (seq + 1) % blocks;
                    seq
                };
                if block >= blocks {
                    continue;
                }
                let write = match w {
                    Workload::Rw | Workload::Randrw => (rng.next() % 100) as u32 >= a.rwmix,
                    other => other.writes(),
                };
                if write {
                    let tag = rng.next();
                    bufs[i].fill(0, len, tag as u8);
                    bufs[i].copy_in(0, &block.to_le_bytes());
                }
                let off = block * a.io_size;
                *slot = Some((Instant::now(), off, write, 0));
                batch.push((i, off, write));
            }
            // The whole batch's metadata is fetched into the CPU cache first, in parallel,
            // then the requests go in (as a host does with a batch it received).
            for &(_, off, _) in &batch {
                target.prefetch(off);
            }
            for (i, off, write) in batch.drain(..) {
                target.submit(
                    i as u64,
                    write,
                    off,
                    BufSlice {
                        buf: bufs[i].clone(),
                        off: 0,
                        len,
                    },
                );
            }
        }
        target.poll(&mut |tag, r| done.push((tag, r)));
        for (tag, r) in done.drain(..) {
            let i = tag as usize;
            let Some((t0, off, write, phase)) = slots[i] else {
                continue;
            };
            r.map_err(|source| ToolError::Engine {
                path: "perf".into(),
                source,
            })?;
            if w == Workload::Verify && write && phase == 0 {
                slots[i] = Some((t0, off, write, 1));
                target.submit(
                    i as u64,
                    false,
                    off,
                    BufSlice {
                        buf: check[i].clone(),
                        off: 0,
                        len,
                    },
                );
                continue;
            }
            if phase == 1 && bufs[i].to_vec(0, len) != check[i].to_vec(0, len) {
                failures += 1;
            }
            lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
            ops += 1;
            slots[i] = None;
        }
        polls += 1;
        if polls.is_multiple_of(32) && Instant::now() >= end {
            stopping = true;
        }
        if stopping && slots.iter().all(Option::is_none) {
            break;
        }
    }
    Ok((ops, lat, failures))
}

/// Loads every L2 slice into this reactor's cache outside the timed run, like a
/// long-running target: one sector per slice.
fn warm(r: &mut Reactor<Dev>) -> ToolResult<()> {
    let size = r.chain.size();
    let step = match &r.chain.layers()[0] {
        Layer::Qcow2(q) => q.geometry().slice_coverage(),
        Layer::Raw { .. } => size.max(1),
    };
    let b = AlignedBuf::new(512);
    let mut off = 0;
    while off < size {
        r.read_now(
            off,
            BufSlice {
                buf: b.clone(),
                off: 0,
                len: 512,
            },
        )
        .map_err(|source| ToolError::Engine {
            path: "perf warm-up".into(),
            source,
        })?;
        off += step;
    }
    Ok(())
}

/// Per-core outcome: ops, latencies, verify failures, (cache counters, slices read ahead,
/// of which reached in time, prefetch ring counters).
type CoreRun = (
    u64,
    Vec<u32>,
    u64,
    (qcow2_engine::cache::CacheStats, u64, u64, RingStats),
);

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
                let (o, l, f) = drive(&mut t, &a2, w, Lanes { core, cores })?;
                Ok((o, l, f, Default::default()))
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
            ..OpenOptions::default()
        };
        let open = |id: usize, writable: bool| {
            let mut d = open_dev(path, writable, a)?;
            if id > 0 {
                d.inner = d.inner.into_channel();
            }
            Ok(d)
        };
        let ring = a.ring()?;
        let out = run_reactors_with_ring(cores, &open, opts, w.writes(), ring, |r| {
            r.chain.set_prefetch(ring.is_some());
            if !a.cold {
                warm(r)?;
            }
            let before = r.cache_stats();
            let pf_before = r.chain.prefetch_stats();
            let ring_before = r.chain.ring_stats().unwrap_or_default();
            let core = r.id;
            let (o, l, f) = drive(r, a, w, Lanes { core, cores })?;
            let after = r.cache_stats();
            let stats = qcow2_engine::cache::CacheStats {
                hits: after.hits - before.hits,
                misses: after.misses - before.misses,
                evictions: after.evictions - before.evictions,
                ..after
            };
            let pf = r.chain.prefetch_stats();
            let ring_after = r.chain.ring_stats().unwrap_or_default();
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
    for (o, l, f, (s, loaded, hits, rs)) in runs {
        ring.add(&rs);
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
    })
}

/// Creates a fully allocated sample image of `size` bytes at `path`.
fn sample_image(path: &Path, size: u64, a: &PerfArgs) -> ToolResult<()> {
    std::fs::File::create(path).map_err(|source| ToolError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let exec: Exec<Dev> = Exec::new();
    let dev = exec.add_device(open_dev(path, true, a)?);
    let e2 = exec.clone();
    let err = |source| ToolError::Engine {
        path: path.display().to_string(),
        source,
    };
    exec.block_on(async move {
        create(
            &e2,
            dev,
            &CreateOptions {
                size,
                ..Default::default()
            },
        )
        .await
    })
    .map_err(err)?;
    let e2 = exec.clone();
    let q = exec
        .block_on(async move {
            Qcow2::open(
                &e2,
                dev,
                OpenOptions {
                    writable: true,
                    ..Default::default()
                },
            )
            .await
        })
        .map_err(err)?;
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).map_err(err)?;
    exec.block_on(async move {
        let b = AlignedBuf::new(1 << 20);
        b.fill(0, 1 << 20, 0xa5);
        let mut off = 0;
        while off < size {
            let n = (size - off).min(1 << 20) as usize;
            chain
                .write(
                    off,
                    BufSlice {
                        buf: b.clone(),
                        off: 0,
                        len: n,
                    },
                )
                .await?;
            off += n as u64;
        }
        chain.close().await
    })
    .map_err(err)
}

fn table(rows: &[(RunResult, Option<RunResult>)]) -> String {
    let mut s = format!(
        "{:<10} {:>6} {:>3} {:>5} {:>11} {:>9} {:>9} {:>9} {:>11} {:>7}\n",
        "workload", "size", "qd", "cores", "IOPS", "MiB/s", "avg us", "p99 us", "raw IOPS", "ratio"
    );
    for (q, r) in rows {
        let (raw_iops, ratio) = match r {
            Some(r) => (
                format!("{:.0}", r.iops),
                format!("{:.3}", q.iops / r.iops.max(1e-9)),
            ),
            None => ("-".into(), "-".into()),
        };
        s += &format!(
            "{:<10} {:>6} {:>3} {:>5} {:>11.0} {:>9.1} {:>9.1} {:>9.0} {:>11} {:>7}\n",
            format!("{:?}", q.workload).to_lowercase(),
            crate::cmd::info::human_size(q.io_size).replace(' ', ""),
            q.depth,
            q.cores,
            q.iops,
            q.mibps,
            q.lat_avg_us,
            q.lat_p99_us,
            raw_iops,
            ratio
        );
        if q.verify_failures > 0 {
            s += &format!("  VERIFY FAILURES: {}\n", q.verify_failures);
        }
    }
    s
}

/// Two runs of the same target and workload as one: mean rates and latency, the worse
/// p99, summed counters.
fn merge(a: RunResult, b: RunResult) -> RunResult {
    RunResult {
        iops: (a.iops + b.iops) / 2.0,
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
        ..a
    }
}

/// One thrash figure: the workload with the cache covering `percent` of the image's L2
/// slices, against the same workload with all of them cached.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ThrashResult {
    /// Requested share of the image's L2 slices, in percent.
    pub percent: u32,
    /// The slice cache size asked for, in bytes.
    pub l2_cache_size: u64,
    /// The slices that cache holds (rounded down to a power-of-two number of sets, at
    /// least one set).
    pub cache_slices: u64,
    /// The image's L2 slices.
    pub image_slices: u64,
    /// Look-ups that missed / all look-ups, in the small-cache run.
    pub miss_rate: f64,
    /// IOPS with the small cache.
    pub iops: f64,
    /// IOPS with every slice cached, side by side.
    pub iops_hit: f64,
    /// `iops_hit / (1 + miss_rate)`: each miss costs one slice read, no more.
    pub bound: f64,
    /// `iops / bound` (the goal is at least 0.9).
    pub ratio: f64,
    /// The small-cache run.
    pub run: RunResult,
    /// The whole-cache run.
    pub run_hit: RunResult,
}

/// The image's L2 slices (of `a.l2_slice_size` bytes), their bytes, and how many of them
/// a slice cache of `cache` bytes holds.
fn cache_shape(path: &Path, a: &PerfArgs, cache: Option<u64>) -> ToolResult<(u64, u64, u64)> {
    let exec: Exec<Dev> = Exec::new();
    let dev = exec.add_device(open_dev(path, false, a)?);
    let e2 = exec.clone();
    let opts = OpenOptions {
        l2_slice_bytes: a.l2_slice_size,
        l2_cache_bytes: cache,
        cache_ways: a.cache_ways,
        ..OpenOptions::default()
    };
    let q = exec
        .block_on(async move { Qcow2::open(&e2, dev, opts).await })
        .map_err(|source| ToolError::Engine {
            path: path.display().to_string(),
            source,
        })?;
    let geo = q.geometry();
    let slices = q.size().div_ceil(geo.slice_coverage()).max(1);
    Ok((slices, slices << geo.slice_bits, q.l2_cache_slices() as u64))
}

/// `--thrash`: for each percentage, the small-cache and whole-cache runs side by side in
/// the order whole, small, small, whole (half the time each).
fn thrash(path: &Path, a: &PerfArgs) -> ToolResult<Vec<ThrashResult>> {
    let w = a.workload.unwrap_or(Workload::Randread);
    let (slices, bytes, _) = cache_shape(path, a, None)?;
    let half = |cache: Option<u64>| PerfArgs {
        seconds: a.seconds / 2.0,
        l2_cache_size: cache,
        ..a.clone()
    };
    let mut out = Vec::new();
    for &pct in &a.thrash {
        let size = (bytes * u64::from(pct) / 100).max(a.l2_slice_size);
        let (_, _, cache_slices) = cache_shape(path, a, Some(size))?;
        let (whole, small) = (half(None), half(Some(size)));
        let h1 = run_one(path, false, w, &whole)?;
        let s1 = run_one(path, false, w, &small)?;
        let s2 = run_one(path, false, w, &small)?;
        let h2 = run_one(path, false, w, &whole)?;
        let (run, run_hit) = (merge(s1, s2), merge(h1, h2));
        let lookups = (run.cache_hits + run.cache_misses).max(1);
        let miss_rate = run.cache_misses as f64 / lookups as f64;
        let bound = run_hit.iops / (1.0 + miss_rate);
        out.push(ThrashResult {
            percent: pct,
            l2_cache_size: size,
            cache_slices,
            image_slices: slices,
            miss_rate,
            iops: run.iops,
            iops_hit: run_hit.iops,
            bound,
            ratio: run.iops / bound.max(1e-9),
            run,
            run_hit,
        });
    }
    Ok(out)
}

fn thrash_table(rows: &[ThrashResult]) -> String {
    let mut s = format!(
        "{:>6} {:>7} {:>9} {:>11} {:>11} {:>11} {:>7}\n",
        "cache", "slices", "miss rate", "IOPS", "IOPS hit", "bound", "ratio"
    );
    for t in rows {
        s += &format!(
            "{:>5}% {:>7} {:>9.3} {:>11.0} {:>11.0} {:>11.0} {:>7.3}\n",
            t.percent, t.cache_slices, t.miss_rate, t.iops, t.iops_hit, t.bound, t.ratio
        );
    }
    s += &format!(
        "cache = share of the image's {} L2 slices asked for (slices: what the cache holds); \
         bound = IOPS hit / (1 + miss rate), one slice read per miss; ratio = IOPS / bound\n",
        rows.first().map_or(0, |t| t.image_slices)
    );
    s
}

/// Runs `qcow2 perf`.
pub fn run(a: &PerfArgs) -> ToolResult<String> {
    let tmp;
    let path = match &a.image {
        Some(p) => p.clone(),
        None => {
            tmp = tempdir()?;
            let p = tmp.path().join("sample.qcow2");
            sample_image(&p, a.sample_size, a)?;
            p
        }
    };
    if !a.thrash.is_empty() {
        let rows = thrash(&path, a)?;
        if a.json {
            return Ok(rows
                .iter()
                .map(|t| serde_json::to_string(t).unwrap_or_default() + "\n")
                .collect());
        }
        return Ok(thrash_table(&rows));
    }
    let set: Vec<(Workload, u64)> = match (a.workload, &a.image) {
        (Some(w), _) => vec![(w, a.io_size)],
        (None, _) => vec![
            (Workload::Randread, 4096),
            (Workload::Randread, 512),
            (Workload::Read, 131072),
            (Workload::Randwrite, 4096),
            (Workload::Verify, 4096),
        ],
    };
    // Raw baselines of write workloads must not write over the image: they use a raw file
    // of the same size beside it, fully written first.
    let mut scratch: Option<TempFile> = None;
    if a.buffered {
        // Page-cache runs compare CPU paths: start both from a warm cache.
        warm_page_cache(&path)?;
    }
    let mut rows = Vec::new();
    for (w, size) in set {
        let a2 = PerfArgs {
            io_size: size,
            ..a.clone()
        };
        let raw_path = if w.writes() {
            if scratch.is_none() {
                let t = raw_scratch(&path)?;
                if a.buffered {
                    warm_page_cache(&t.0)?;
                }
                scratch = Some(t);
            }
            scratch
                .as_ref()
                .map(|t| t.0.clone())
                .unwrap_or_else(|| path.clone())
        } else {
            path.clone()
        };
        if a.raw {
            rows.push((run_one(&raw_path, true, w, &a2)?, None));
            continue;
        }
        if w == Workload::Verify {
            rows.push((run_one(&path, false, w, &a2)?, None));
            continue;
        }
        // Side by side in one run, in the order ours, raw, raw, ours (half the time each),
        // so neither side gains from going first or last on a shared, drifting machine.
        let half = PerfArgs {
            seconds: a2.seconds / 2.0,
            ..a2.clone()
        };
        let q1 = run_one(&path, false, w, &half)?;
        let r1 = run_one(&raw_path, true, w, &half)?;
        let r2 = run_one(&raw_path, true, w, &half)?;
        let q2 = run_one(&path, false, w, &half)?;
        rows.push((merge(q1, q2), Some(merge(r1, r2))));
    }
    if a.json {
        let mut s = String::new();
        for (q, r) in &rows {
            s += &serde_json::to_string(q).unwrap_or_default();
            s.push('\n');
            if let Some(r) = r {
                s += &serde_json::to_string(r).unwrap_or_default();
                s.push('\n');
            }
        }
        return Ok(s);
    }
    let mut s = table(&rows);
    s += &format!(
        "ratio = qcow2 IOPS / raw IOPS on the same file and device ({}; base latency {} us)\n",
        if a.buffered { "buffered" } else { "O_DIRECT" },
        a.base_latency_us
    );
    Ok(s)
}

/// Reads a file once so a buffered run starts with it in the page cache.
fn warm_page_cache(p: &Path) -> ToolResult<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(p).map_err(|source| ToolError::Io {
        path: p.display().to_string(),
        source,
    })?;
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf).map_err(|source| ToolError::Io {
        path: p.display().to_string(),
        source,
    })? > 0
    {}
    Ok(())
}

/// A temporary file removed on drop.
struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A raw file as large as the image's file, beside it (same file system), fully written.
fn raw_scratch(image: &Path) -> ToolResult<TempFile> {
    use std::io::Write;
    let io_err = |p: &Path| {
        let p = p.display().to_string();
        move |source| ToolError::Io { path: p, source }
    };
    let len = std::fs::metadata(image)
        .map_err(io_err(image))?
        .len()
        .div_ceil(1 << 20)
        << 20;
    let p = image.with_extension(format!("perf-raw-{}", std::process::id()));
    let t = TempFile(p.clone());
    let mut f = std::fs::File::create(&p).map_err(io_err(&p))?;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..(len >> 20) {
        f.write_all(&chunk).map_err(io_err(&p))?;
    }
    f.sync_all().map_err(io_err(&p))?;
    Ok(t)
}

fn tempdir() -> ToolResult<crate::TempDir> {
    crate::TempDir::new("qcow2-perf").map_err(|(path, source)| ToolError::Io {
        path: path.display().to_string(),
        source,
    })
}
