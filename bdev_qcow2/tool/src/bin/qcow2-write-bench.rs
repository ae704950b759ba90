#![forbid(unsafe_code)]
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark: abort on setup failure

//! Write-path benchmark: allocating writes vs writes into allocated clusters, side by side
//! in one run on the same file system, plus write amplification of sequential first writes.
//!
//! Reports ratios (issue 3's figures): 4 KiB random writes into an empty image / into a
//! fully allocated one (standard and extended L2), 128 KiB sequential writes empty /
//! allocated, and device bytes written per guest byte for a sequential first write.

use clap::Parser;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::BufSlice;
use qcow2_engine::{Chain, Exec, Layer, Op, OpenOptions, Qcow2, Request};
use qcow2_tool::rng::Rng;
use qcow2_tool::uring::{AlignedBuf, OpenMode, UringDevice};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "qcow2 write-path benchmark (ratios side by side)")]
struct Args {
    /// Directory for the test images (default: a temporary directory under /var/tmp).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Virtual size of each image.
    #[arg(long, value_parser = qcow2_tool::parse_size, default_value = "2G")]
    size: u64,
    /// 4 KiB random writes per run.
    #[arg(long, default_value_t = 20000)]
    ops: u64,
    /// Queue depth.
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Use the page cache instead of O_DIRECT.
    #[arg(long)]
    buffered: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

struct Img {
    exec: Exec<UringDevice>,
    chain: Rc<Chain<UringDevice>>,
    dev: qcow2_engine::DevId,
}

/// `path` opened for writing, O_DIRECT when `direct` (and the file system allows it).
fn open_rw(path: &Path, direct: bool) -> UringDevice {
    let mode = OpenMode {
        writable: true,
        direct,
    };
    UringDevice::open(path, mode, 128).expect("open")
}

fn make(path: &Path, size: u64, extended_l2: bool, direct: bool) -> Img {
    std::fs::File::create(path).expect("create image file");
    let exec = Exec::new();
    let dev = exec.add_device(open_rw(path, direct));
    let e2 = exec.clone();
    let opts = CreateOptions {
        size,
        extended_l2,
        ..Default::default()
    };
    exec.block_on(async move { create(&e2, dev, &opts).await })
        .expect("create");
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
        .expect("open");
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).expect("chain");
    Img { exec, chain, dev }
}

/// Runs `n` writes of `len` bytes at offsets from `next_off` with `qd` in flight; returns
/// seconds elapsed.
fn run(img: &Img, qd: usize, n: u64, len: usize, mut next_off: impl FnMut(u64) -> u64) -> f64 {
    let bufs: Vec<AlignedBuf> = (0..qd)
        .map(|i| {
            let b = AlignedBuf::new(len);
            qcow2_engine::io::IoBuffer::fill(&b, 0, len, 0x5a ^ i as u8);
            b
        })
        .collect();
    let t = Instant::now();
    let mut issued = 0;
    let mut done = 0;
    let mut free: Vec<usize> = (0..qd).collect();
    while done < n {
        while issued < n {
            let Some(slot) = free.pop() else { break };
            let off = next_off(issued);
            let buf = BufSlice {
                buf: bufs[slot].clone(),
                off: 0,
                len,
            };
            let req = Request::new(Op::Write, off, len as u64);
            qcow2_tool::host::submit(&img.chain, slot as u64, req, buf);
            issued += 1;
        }
        img.exec.poll(&mut |tag, r| {
            if let Err(e) = r {
                panic!("write failed: {e}");
            }
            free.push(tag as usize);
            done += 1;
        });
    }
    let before_flush = t.elapsed().as_secs_f64();
    let c = img.chain.clone();
    img.exec
        .block_on(async move { c.flush().await })
        .expect("flush");
    if std::env::var_os("BENCH_DEBUG").is_some() {
        eprintln!(
            "{n} writes of {len}: {before_flush:.3}s + flush {:.3}s",
            t.elapsed().as_secs_f64() - before_flush
        );
    }
    t.elapsed().as_secs_f64()
}

/// The same sequential writes straight to a raw file on the same device type (baseline).
fn run_raw(path: &Path, direct: bool, qd: usize, n: u64, len: usize) -> f64 {
    let exec: Exec<UringDevice> = Exec::new();
    let dev = exec.add_device(open_rw(path, direct));
    let bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(len)).collect();
    let t = Instant::now();
    let (mut issued, mut done) = (0, 0);
    let mut free: Vec<usize> = (0..qd).collect();
    while done < n {
        while issued < n {
            let Some(slot) = free.pop() else { break };
            let req = exec.request_begin(slot as u64);
            let buf = BufSlice {
                buf: bufs[slot].clone(),
                off: 0,
                len,
            };
            exec.request_op(
                req,
                dev,
                qcow2_engine::io::DeviceOp::Write {
                    offset: issued * len as u64,
                    buf,
                },
            );
            exec.request_arm(req);
            issued += 1;
        }
        exec.poll(&mut |tag, r| {
            if let Err(e) = r {
                panic!("raw write failed: {e}");
            }
            free.push(tag as usize);
            done += 1;
        });
    }
    let req = exec.request_begin(u64::MAX);
    exec.request_op(req, dev, qcow2_engine::io::DeviceOp::Flush);
    exec.request_arm(req);
    let mut flushed = false;
    while !flushed {
        exec.poll(&mut |_, _| flushed = true);
    }
    t.elapsed().as_secs_f64()
}

fn fill(img: &Img, size: u64, qd: usize) {
    let chunk = 1 << 20;
    run(img, qd.min(8), size / chunk, chunk as usize, |i| i * chunk);
}

fn main() {
    let a = Args::parse();
    let tmp = tempfile_dir(a.dir.clone());
    let direct = !a.buffered;
    let mut rows = Vec::new();
    // Baseline: the file system's own cost of first writes, on a raw file.
    {
        let p = tmp.join("raw.img");
        std::fs::File::create(&p).expect("raw file");
        let n = a.size / (128 << 10);
        let t_first = run_raw(&p, direct, a.qd, n, 128 << 10);
        let t_over = run_raw(&p, direct, a.qd, n, 128 << 10);
        let mib = a.size as f64 / (1 << 20) as f64;
        rows.push((
            "128k seqwrite, raw file (baseline)".to_string(),
            mib / t_first,
            mib / t_over,
            "MiB/s",
        ));
        let _ = std::fs::remove_file(&p);
    }
    for ext in [false, true] {
        let label = if ext { "extended L2" } else { "standard L2" };
        let blocks = a.size / 4096;
        // Random 4 KiB: empty image vs the same image once fully allocated.
        let empty = make(&tmp.join("empty.qcow2"), a.size, ext, direct);
        let mut r = Rng(7);
        let t_empty = run(&empty, a.qd, a.ops, 4096, |_| r.next() % blocks * 4096);
        let full = make(&tmp.join("full.qcow2"), a.size, ext, direct);
        fill(&full, a.size, a.qd);
        let mut r = Rng(7);
        let t_full = run(&full, a.qd, a.ops, 4096, |_| r.next() % blocks * 4096);
        let (iops_e, iops_f) = (a.ops as f64 / t_empty, a.ops as f64 / t_full);
        rows.push((format!("4k randwrite, {label}"), iops_e, iops_f, "IOPS"));
        drop((empty, full));
        // Sequential 128 KiB over the whole image: first write vs overwrite.
        let seq = make(&tmp.join("seq.qcow2"), a.size, ext, direct);
        let before = seq.exec.with_device(seq.dev, |d| d.stats());
        let n = a.size / (128 << 10);
        let t_first = run(&seq, a.qd, n, 128 << 10, |i| i * (128 << 10));
        let c = seq.chain.clone();
        seq.exec
            .block_on(async move { c.close().await })
            .expect("close");
        let after = seq.exec.with_device(seq.dev, |d| d.stats());
        if std::env::var_os("BENCH_DEBUG").is_some() {
            eprintln!("seq first write: {after:?} exec {:?}", seq.exec.stats());
        }
        let amp = (after.bytes_written - before.bytes_written) as f64 / a.size as f64;
        let t_over = run(&seq, a.qd, n, 128 << 10, |i| i * (128 << 10));
        let mib = a.size as f64 / (1 << 20) as f64;
        rows.push((
            format!("128k seqwrite, {label}"),
            mib / t_first,
            mib / t_over,
            "MiB/s",
        ));
        rows.push((
            format!("bytes written per guest byte, first seq write, {label}"),
            amp,
            1.0,
            "x",
        ));
        let _ = std::fs::remove_file(tmp.join("empty.qcow2"));
        let _ = std::fs::remove_file(tmp.join("full.qcow2"));
        let _ = std::fs::remove_file(tmp.join("seq.qcow2"));
    }
    if a.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|(n, e, f, u)| serde_json::json!({"workload": n, "empty": e, "allocated": f, "unit": u, "ratio": e / f}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!(
            "{:<58} {:>12} {:>12} {:>7}",
            "workload", "empty", "allocated", "ratio"
        );
        for (n, e, f, u) in &rows {
            if u == &"x" {
                println!("{n:<58} {e:>12.4} {:>12} {:>7}", "", "");
            } else {
                println!("{n:<58} {e:>8.0} {u:<3} {f:>8.0} {u:<3} {:>7.3}", e / f);
            }
        }
        println!(
            "(O_DIRECT: {direct}; {} ops per random run, qd {}, image {} bytes)",
            a.ops, a.qd, a.size
        );
    }
}

fn tempfile_dir(d: Option<PathBuf>) -> PathBuf {
    let p = d.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("qcow2-bench-{}", std::process::id()))
    });
    std::fs::create_dir_all(&p).expect("bench dir");
    p
}
