//! `qcow2 perf --chain D`: reads through a chain of D images whose data is all in the
//! bottom one (the sample image, under D - 1 empty overlays), side by side with the same
//! reads through a chain of 2 — what depth costs on the data path once the chain has been
//! read. Each run opens its chain (timed), reads the whole disk once (the first touch,
//! timed), then runs the workload.

use super::args::{PerfArgs, Workload};
use super::device::{open_dev, DelayDevice, Dev};
use super::workload::{drive, Lanes, PerfTarget};
use crate::host::{open_chain_with, Format, OpenSpec, ToolError, ToolResult};
use crate::uring::AlignedBuf;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::BufSlice;
use qcow2_engine::{Chain, Exec, Op, OpenOptions, Request};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// One run through a chain.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChainRun {
    /// Images in the chain, the top one included.
    pub depth: usize,
    /// Milliseconds to open the chain.
    pub open_ms: f64,
    /// Milliseconds to read the whole disk once after opening it.
    pub first_touch_ms: f64,
    /// Operations per second of the workload after that.
    pub iops: f64,
    /// Mean latency in microseconds.
    pub lat_avg_us: f64,
    /// 99th percentile latency in microseconds.
    pub lat_p99_us: f64,
}

/// The chain's reads on one core, as the standalone host submits them.
struct ChainTarget(Rc<Chain<Dev>>);

impl PerfTarget for ChainTarget {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>) {
        let op = if write { Op::Write } else { Op::Read };
        let req = Request::new(op, off, buf.len as u64);
        crate::host::submit(&self.0, tag, req, buf);
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) {
        self.0.exec().poll(done);
    }
    fn prefetch(&self, off: u64, _write: bool) {
        if let Some(p) = self.0.disk().entry_hint(off) {
            crate::uring::prefetch_line(p.cast());
        }
    }
}

/// Runs the chain mode over the sample image `bottom` (of `size` bytes): returns the
/// table (or JSON lines).
pub(super) fn chain_runs(
    bottom: &Path,
    size: u64,
    depth: usize,
    a: &PerfArgs,
) -> ToolResult<String> {
    let w = a.workload.unwrap_or(Workload::Randread);
    if depth < 2 || w.writes() {
        return Err(ToolError::Usage(
            "--chain takes a depth of 2 or more and a read workload".into(),
        ));
    }
    let tops = overlays(bottom, size, depth - 1, a)?;
    let (deep, shallow) = (&tops[depth - 2], &tops[0]);
    let half = PerfArgs {
        seconds: a.seconds / 2.0,
        workload: Some(w),
        ..a.clone()
    };
    // In the order deep, 2, 2, deep (half the time each), as the other side-by-side runs.
    let d1 = run_chain(deep, depth, &half)?;
    let s1 = run_chain(shallow, 2, &half)?;
    let s2 = run_chain(shallow, 2, &half)?;
    let d2 = run_chain(deep, depth, &half)?;
    let rows = [merge(d1, d2), merge(s1, s2)];
    if a.json {
        return Ok(rows
            .iter()
            .map(|r| serde_json::to_string(r).unwrap_or_default() + "\n")
            .collect());
    }
    let mut s = format!(
        "chain mode: {w:?} {} QD{} on 1 core, all data in the bottom image\n",
        crate::cmd::info::human_size(a.io_size).replace(' ', ""),
        a.depth
    )
    .to_lowercase();
    s += &format!(
        "{:>6} {:>9} {:>15} {:>11} {:>9} {:>9} {:>7}\n",
        "depth", "open ms", "first touch ms", "IOPS", "avg us", "p99 us", "ratio"
    );
    for r in &rows {
        s += &format!(
            "{:>6} {:>9.1} {:>15.1} {:>11.0} {:>9.1} {:>9.0} {:>7.3}\n",
            r.depth,
            r.open_ms,
            r.first_touch_ms,
            r.iops,
            r.lat_avg_us,
            r.lat_p99_us,
            r.iops / rows[1].iops.max(1e-9)
        );
    }
    s += "ratio = IOPS / IOPS through the chain of 2; first touch = one read of the whole disk\n";
    Ok(s)
}

/// Creates `n` empty overlays above `bottom`, each backed by the one below (by its file
/// name, beside it): the tops of chains of 2 ..= n + 1 images, shallowest first.
fn overlays(bottom: &Path, size: u64, n: usize, a: &PerfArgs) -> ToolResult<Vec<PathBuf>> {
    let dir = bottom.parent().unwrap_or(Path::new("."));
    let mut below = bottom.to_path_buf();
    let mut tops = Vec::with_capacity(n);
    for i in 1..=n {
        let p = dir.join(format!("layer-{i:05}.qcow2"));
        std::fs::File::create(&p).map_err(io_err(&p))?;
        let exec: Exec<Dev> = Exec::new();
        let dev = exec.add_device(open_dev(&p, true, a)?);
        let opts = CreateOptions {
            size,
            backing_file: below.file_name().map(|f| f.to_string_lossy().into_owned()),
            backing_format: Some("qcow2".into()),
            ..CreateOptions::default()
        };
        let e2 = exec.clone();
        exec.block_on(async move { create(&e2, dev, &opts).await })
            .map_err(|source| ToolError::Engine {
                path: p.display().to_string(),
                source,
            })?;
        below = p.clone();
        tops.push(p);
    }
    Ok(tops)
}

/// Opens the chain under `top` read-only, reads its whole disk once, then runs the workload.
fn run_chain(top: &Path, depth: usize, a: &PerfArgs) -> ToolResult<ChainRun> {
    let spec = OpenSpec {
        path: top.to_path_buf(),
        format: Format::Qcow2,
        allow_backing: true,
        writable: false,
        opts: OpenOptions {
            l2_cache_bytes: a.l2_cache_size,
            l2_slice_bytes: a.l2_slice_size,
            cache_ways: a.cache_ways,
            ..OpenOptions::default()
        },
        queue_depth: (a.depth * 2).max(8) as u32,
        direct: !a.buffered,
        force_share: false,
        // (The chain's images are made here, unencrypted.)
        keys: Default::default(),
    };
    let delay = Duration::from_micros(a.base_latency_us);
    let t0 = Instant::now();
    let opened = open_chain_with(&spec, |d, _| DelayDevice::new(d, delay))?;
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    if opened.chain.layers().len() != depth {
        return Err(ToolError::Usage(format!(
            "{}: a chain of {} images, not {depth}",
            top.display(),
            opened.chain.layers().len()
        )));
    }
    let chain = opened.chain.clone();
    let t1 = Instant::now();
    let c2 = chain.clone();
    opened
        .exec
        .block_on(async move {
            let b = AlignedBuf::new(1 << 20);
            let size = c2.size();
            let mut off = 0;
            while off < size {
                let len = (size - off).min(1 << 20) as usize;
                c2.read(
                    off,
                    BufSlice {
                        buf: b.clone(),
                        off: 0,
                        len,
                    },
                )
                .await?;
                off += len as u64;
            }
            Ok::<_, qcow2_engine::Error>(())
        })
        .map_err(|source| ToolError::Engine {
            path: top.display().to_string(),
            source,
        })?;
    let first_touch_ms = t1.elapsed().as_secs_f64() * 1e3;
    let w = a.workload.unwrap_or(Workload::Randread);
    let (ops, mut lat, _) = drive(&mut ChainTarget(chain), a, w, Lanes { core: 0, cores: 1 })?;
    lat.sort_unstable();
    let avg = lat.iter().map(|&x| x as f64).sum::<f64>() / lat.len().max(1) as f64;
    let p99 = lat
        .get(lat.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or(0) as f64;
    Ok(ChainRun {
        depth,
        open_ms,
        first_touch_ms,
        iops: ops as f64 / a.seconds,
        lat_avg_us: avg,
        lat_p99_us: p99,
    })
}

/// Two runs through the same chain as one: mean times and rates, the worse p99.
fn merge(a: ChainRun, b: ChainRun) -> ChainRun {
    ChainRun {
        open_ms: (a.open_ms + b.open_ms) / 2.0,
        first_touch_ms: (a.first_touch_ms + b.first_touch_ms) / 2.0,
        iops: (a.iops + b.iops) / 2.0,
        lat_avg_us: (a.lat_avg_us + b.lat_avg_us) / 2.0,
        lat_p99_us: a.lat_p99_us.max(b.lat_p99_us),
        ..a
    }
}

fn io_err(p: &Path) -> impl FnOnce(std::io::Error) -> ToolError {
    let path = p.display().to_string();
    move |source| ToolError::Io { path, source }
}
