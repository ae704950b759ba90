//! `qcow2 perf`: a bdevperf-shaped workload generator on the standalone host, reporting our
//! engine side by side with the same workload on the same file read as a raw disk.
//!
//! With no image it creates a sample image (fully allocated, in a temporary directory) and
//! runs a short default set. `--cores N` runs N reactors on the one image (see
//! [`crate::reactor`]): each with its own executor, io_uring and slice-cache replica; core 0
//! owns the metadata.

mod args;
mod chain;
mod device;
mod files;
mod report;
mod stats;
mod thrash;
mod workload;

pub use args::{PerfArgs, Switch, Workload};
pub use chain::ChainRun;
pub use device::DelayDevice;
pub use stats::{run_one, RunResult};
pub use thrash::ThrashResult;

use crate::host::ToolResult;
use files::{
    empty_image, raw_scratch, raw_sparse, sample_image, sparse_file, tempdir, warm_page_cache,
    TempFile,
};
use report::{table, thrash_table};
use stats::merge;
use thrash::thrash;

/// Runs `qcow2 perf`.
pub fn run(a: &PerfArgs) -> ToolResult<String> {
    let tmp;
    let sample = a.sample_options()?;
    if a.chain.is_some() && a.image.is_some() {
        return Err(crate::host::ToolError::Usage(
            "--chain builds its chain over the sample image: it takes no IMG".into(),
        ));
    }
    let path = match &a.image {
        Some(p) => p.clone(),
        None => {
            tmp = tempdir()?;
            let p = tmp.path().join("sample.qcow2");
            match a.fresh {
                true => empty_image(&p, &sample, a)?,
                false => sample_image(&p, &sample, a)?,
            }
            p
        }
    };
    if let Some(depth) = a.chain {
        return chain::chain_runs(&path, sample.size, depth, a);
    }
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
        // An empty image is for allocating writes.
        (None, _) if a.fresh => vec![(Workload::Randwrite, a.io_size)],
        (None, _) => vec![
            (Workload::Randread, 4096),
            (Workload::Randread, 512),
            (Workload::Read, 131072),
            (Workload::Randwrite, 4096),
            (Workload::Verify, 4096),
        ],
    };
    // Raw baselines of write workloads must not write over the image: they use a raw file
    // of the same size beside it, written in full the way the sample image was (with
    // --fresh: as large as the disk and empty, like the image).
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
                let t = match a.fresh {
                    // As large as the disk, empty: a raw disk's first writes.
                    true => raw_sparse(&path, sample.size)?,
                    false => raw_scratch(&path, a)?,
                };
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
        // With --fresh, each of our runs starts from an empty image.
        let ours = |half: &PerfArgs| {
            if a.fresh {
                empty_image(&path, &sample, a)?;
            }
            run_one(&path, false, w, half)
        };
        let q1 = ours(&half)?;
        // With --fresh, each raw run starts from an empty (sparse) file as well.
        let raw = |half: &PerfArgs| {
            if a.fresh {
                sparse_file(&raw_path, sample.size)?;
            }
            run_one(&raw_path, true, w, half)
        };
        let r1 = raw(&half)?;
        let r2 = raw(&half)?;
        let q2 = ours(&half)?;
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
