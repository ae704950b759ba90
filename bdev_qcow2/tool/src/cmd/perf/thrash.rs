//! `--thrash`: random reads with a slice cache smaller than the image's L2, side by side
//! with a cache holding all of it.

use super::args::{PerfArgs, Workload};
use super::device::{open_dev, Dev};
use super::stats::{merge, run_one, RunResult};
use crate::host::{ToolError, ToolResult};
use qcow2_engine::{Exec, OpenOptions, Qcow2};
use std::path::Path;

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
    let mut dev = open_dev(path, false, a)?;
    crate::host::lock_device(&mut dev.inner, path, crate::lock::Access::Read)?;
    let dev = exec.add_device(dev);
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
pub(super) fn thrash(path: &Path, a: &PerfArgs) -> ToolResult<Vec<ThrashResult>> {
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
