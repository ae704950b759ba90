#![forbid(unsafe_code)]
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark: abort on setup failure

//! Direct-path look-up benchmark: the CPU cost of `Chain::route_read` (what the SPDK module
//! runs before it hands a guest read straight to the base bdev), per request, with every
//! slice cached, against the loop alone. No I/O is timed: the figure is the module's own
//! per-request look-up, which decides how close to the base a 512 B random read gets.
//!
//! Two images made by `qemu-img` (`preallocation=metadata`, 64 KiB clusters): as made, every
//! slice is linear (consecutive data clusters) and a look-up computes the host offset from
//! the slice's summary; with the first cluster of every slice discarded, no slice is
//! linear and a look-up loads the L2 entry. Reads of 512 B and 4 KiB at random aligned
//! offsets. Each figure is the fastest of `--rounds` rounds.

use clap::Parser;
use qcow2_engine::io::BufSlice;
use qcow2_engine::{Chain, Exec, Layer, Op, OpenOptions, ReadRoute, Request};
use qcow2_tool::host::{open_chain, submit, Format, OpenSpec, Opened};
use qcow2_tool::rng::Rng;
use qcow2_tool::uring::{AlignedBuf, UringDevice};
use std::hint::black_box;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "qcow2 direct-path look-up benchmark (ns per route_read, slices cached)")]
struct Args {
    /// Virtual size of the images.
    #[arg(long, value_parser = qcow2_tool::parse_size, default_value = "1G")]
    size: u64,
    /// Look-ups per round.
    #[arg(long, default_value_t = 5_000_000)]
    ops: u64,
    /// Rounds per figure (the fastest is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn qemu(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("run qemu-img/qemu-io");
    assert!(out.status.success(), "{args:?}: {out:?}");
}

/// Opens `path` writable (like the SPDK module's bdevs) and loads every slice.
fn open(path: &Path, size: u64) -> (Exec<UringDevice>, Rc<Chain<UringDevice>>) {
    let Opened { exec, chain, .. } = open_chain(&OpenSpec {
        keys: Default::default(),
        path: path.to_path_buf(),
        format: Format::Qcow2,
        allow_backing: false,
        writable: true,
        opts: OpenOptions::default(),
        queue_depth: 32,
        direct: false,
        force_share: false,
    })
    .expect("open image");
    let Layer::Qcow2(q) = &chain.layers()[0] else {
        unreachable!("a qcow2 image")
    };
    let cov = q.geometry().slice_coverage();
    let buf = AlignedBuf::new(512);
    for s in 0..size.div_ceil(cov) {
        // The second cluster of each slice: allocated in both images.
        let slice = BufSlice {
            buf: buf.clone(),
            off: 0,
            len: 512,
        };
        submit(
            &chain,
            0,
            Request::new(Op::Read, s * cov + 65536, 512),
            slice,
        );
        let mut done = false;
        while !done {
            exec.poll(&mut |_, r| {
                r.expect("warm-up read");
                done = true;
            });
        }
    }
    (exec, chain)
}

/// A `len`-aligned offset in 64 KiB cluster `cluster`, from random bits of `x`.
fn offset(cluster: u64, x: u64, len: u64) -> u64 {
    (cluster << 16) + ((x >> 40) & (65536 / len - 1)) * len
}

/// Nanoseconds per call of `op` (fastest round).
fn measure(a: &Args, mut op: impl FnMut(&mut Rng) -> u64) -> f64 {
    let mut rng = Rng::new(0x1005_b00c);
    let mut acc = 0u64;
    let best = (0..a.rounds.max(1))
        .map(|_| {
            let t = Instant::now();
            for _ in 0..a.ops {
                acc = acc.wrapping_add(op(&mut rng));
            }
            t.elapsed().as_nanos() as f64 / a.ops as f64
        })
        .fold(f64::MAX, f64::min);
    black_box(acc);
    best
}

fn main() {
    let a = Args::parse();
    let dir = qcow2_tool::TempDir::new("qcow2-lookup-bench").expect("scratch directory");
    let size = a.size.next_multiple_of(1 << 25);
    let size_arg = size.to_string();
    let mut rows = Vec::new();
    for (name, discard) in [("linear slices", false), ("entry per request", true)] {
        let p = dir.path().join(format!("{}.qcow2", u8::from(discard)));
        let ps = p.to_str().expect("utf-8 path");
        qemu(&[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=65536,preallocation=metadata",
            ps,
            &size_arg,
        ]);
        if discard {
            // 4 KiB slices of 64 KiB clusters cover 32 MiB each.
            let mut args = vec!["qemu-io".to_string()];
            for s in 0..size >> 25 {
                args.push("-c".into());
                args.push(format!("discard {} 64k", s << 25));
            }
            args.push(ps.into());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            qemu(&args);
        }
        let (exec, chain) = open(&p, size);
        let clusters = size >> 16;
        for len in [512u64, 4096] {
            let loop_only = measure(&a, |r| {
                let x = r.next();
                offset(x % clusters, x, len)
            });
            let ns = measure(&a, |r| {
                let x = r.next();
                let mut c = x % clusters;
                if discard && c.is_multiple_of(512) {
                    c += 1;
                }
                let off = offset(c, x, len);
                let grant = match chain.route_read(off, len) {
                    ReadRoute::Direct(g) => Some(g),
                    ReadRoute::Engine => None,
                }
                .expect("cached data maps");
                let host = grant.host();
                grant.finish(&exec);
                host.0
            });
            rows.push((name, len, ns, loop_only));
        }
    }
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|(name, len, ns, lp)| {
                serde_json::json!({"image": name, "io_size": len, "ns": ns, "loop_ns": lp})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!(
        "{:<20} {:>8} {:>14} {:>10} {:>14}",
        "image", "size", "ns/look-up", "loop ns", "look-up - loop"
    );
    for (name, len, ns, lp) in rows {
        println!(
            "{name:<20} {len:>8} {ns:>14.1} {lp:>10.1} {:>14.1}",
            ns - lp
        );
    }
    println!(
        "(route_read + the grant's exit per random read, every slice cached; fastest of {} rounds of {} look-ups)",
        a.rounds, a.ops
    );
}
