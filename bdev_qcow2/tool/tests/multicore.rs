//! Multi-core stress (issue #5): several reactors issue mixed random reads, in-place and
//! allocating writes, discards, write-zeroes and flushes against one image at once. A
//! checker asserts, sector by sector, that every read returned data at least as new as
//! every write that completed before the read was submitted (real-time order recorded with
//! one global clock across cores); then `qemu-img check` must pass and the image must hold,
//! sector by sector, a value the history allows — read both by QEMU and by our engine.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::qemu_img;
use qcow2_engine::io::{BufSlice, IoBuffer};
use qcow2_engine::ring::{RingConfig, RingStats};
use qcow2_engine::rng::Rng;
use qcow2_engine::OpenOptions;
use qcow2_tool::reactor::{run_reactors_with_ring, Reactor};
use qcow2_tool::uring::{AlignedBuf, OpenMode, UringDevice};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

const SECTOR: u64 = 512;
/// Stamp of the content qemu-io wrote before the run.
const INITIAL: u64 = u64::MAX;
/// Stamp of zeros (never written, discarded or zeroed).
const ZERO: u64 = 0;
/// A sector whose head and body come from different writes: a read that overlapped
/// writes of that sector in time (buffered I/O copies pages without sector atomicity).
const TORN: u64 = u64::MAX - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Read,
    Write,
    /// write-zeroes: reads zeros afterwards.
    Zero,
    /// discard: reads zeros or the old data afterwards (QEMU leaves partial clusters).
    Discard,
    Flush,
}

/// One operation of the history: what, where, and when (global clock) it was submitted and
/// completed. `id` stamps a write's sectors.
#[derive(Debug, Clone)]
struct Op {
    kind: Kind,
    core: usize,
    id: u64,
    off: u64,
    len: u64,
    submit: u64,
    complete: u64,
    /// Reads: the stamp found in each sector.
    seen: Vec<u64>,
}

/// Stamps `buf` with write `id`: every sector starts with (id, absolute sector).
fn stamp(buf: &AlignedBuf, id: u64, off: u64, len: u64) {
    for s in 0..len / SECTOR {
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&id.to_le_bytes());
        head[8..].copy_from_slice(&(off / SECTOR + s).to_le_bytes());
        buf.fill((s * SECTOR) as usize, SECTOR as usize, (id % 251) as u8 + 1);
        buf.copy_in((s * SECTOR) as usize, &head);
    }
}

/// The stamp a sector carries (checking the sector is whole and in its place).
fn stamp_of(bytes: &[u8], sector: u64) -> Result<u64, String> {
    if bytes.iter().all(|&b| b == 0) {
        return Ok(ZERO);
    }
    if bytes.iter().all(|&b| b == 0xab) {
        return Ok(INITIAL);
    }
    let head = &bytes[..16];
    if head.iter().all(|&b| b == 0) || head.iter().all(|&b| b == 0xab) {
        // The stamp still holds zeros or the initial fill and the rest of the sector does
        // not: half old, half new, like the torn case below (write ids are never 0, and no
        // write stamps 0xab…), so `allowed` accepts it only while a write overlapped.
        return Ok(TORN);
    }
    let id = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    let at = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
    let fill = (id % 251) as u8 + 1;
    if at != sector {
        // Data of another offset: never acceptable.
        return Err(format!(
            "sector {sector}: misplaced data (stamp id {id} for sector {at})"
        ));
    }
    if bytes[16..].iter().any(|&b| b != fill) {
        return Ok(TORN);
    }
    Ok(id)
}

struct Config {
    cluster: &'static str,
    extended_l2: bool,
    l2_slice: u64,
    l2_cache: u64,
    cores: usize,
    ops_per_core: usize,
    /// The prefetch ring on every core: sequential bands then mostly read, and their writes
    /// land just ahead of the reader, in what its ring holds.
    ring: bool,
    /// A fresh image (nothing written before the run) and mostly one-cluster requests: the
    /// image fills while cores overwrite what was allocated, discard it and write it again,
    /// and a core overwrites through copies of slices the owner keeps changing (§6).
    fresh: bool,
}

/// Runs one core's share of the workload on reactor `r`; returns its history.
fn workload(
    r: &mut Reactor<UringDevice>,
    clock: &AtomicU64,
    size: u64,
    ops: usize,
    ring: bool,
    fresh: bool,
) -> Vec<Op> {
    // STRESS_QD overrides the queue depth per core (default 16).
    let qd_env = std::env::var("STRESS_QD").ok().and_then(|v| v.parse().ok());
    let qd: usize = qd_env.unwrap_or(16);
    let mut rng = Rng(0x9e37_79b9 ^ ((r.id() as u64 + 1) * 0x1000_0001));
    let bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(64 << 10)).collect();
    let mut slots: Vec<Option<Op>> = vec![None; qd];
    let mut history = Vec::new();
    let mut issued = 0;
    let mut next_id = (r.id() as u64 + 1) << 40;
    let mut done = Vec::new();
    let mut last_progress = std::time::Instant::now();
    // Every other band of 200 requests runs sequentially (each request starts where the
    // previous one of this core ended, whatever its kind), so read-ahead loads slices into
    // this core's cache while the owner changes them.
    let mut cursor = ((r.id() as u64 * 5) << 20) % size;
    loop {
        if last_progress.elapsed() > std::time::Duration::from_secs(20) {
            let pending: Vec<_> = slots
                .iter()
                .flatten()
                .map(|o| (o.kind, o.off, o.len))
                .collect();
            panic!(
                "reactor {} stalled: pending {pending:?}, stats {:?}, exec {:?}",
                r.id(),
                r.stats(),
                r.exec().stats()
            );
        }
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_some() || issued >= ops {
                continue;
            }
            issued += 1;
            let blocks = size / 4096;
            let nblk = match fresh && !rng.next().is_multiple_of(4) {
                true => 1,
                false => 1 + rng.next() % 16,
            };
            let random = rng.next() % (blocks - nblk);
            let sequential = (issued / 200) % 2 == 1;
            let start = if sequential {
                if cursor / 4096 + nblk > blocks {
                    cursor = 0;
                }
                cursor / 4096
            } else {
                random
            };
            let mut dice = rng.next() % 100;
            let mut start = start;
            if ring && sequential {
                // Four reads in five; the rest write within 1 MiB ahead of the reader,
                // where its ring holds data, without moving the stream.
                if dice < 80 {
                    dice = 0;
                } else {
                    let ahead = 1 + rng.next() % 256;
                    start = (start + ahead).min(blocks - nblk);
                    dice = 50 + dice % 46;
                }
            }
            if !(ring && sequential && dice >= 50) {
                cursor = (start + nblk) * 4096;
            }
            let (off, len) = (start * 4096, nblk * 4096);
            let tag = i as u64;
            let mut op = Op {
                kind: Kind::Read,
                core: r.id(),
                id: 0,
                off,
                len,
                submit: 0,
                complete: 0,
                seen: Vec::new(),
            };
            let buf = BufSlice {
                buf: bufs[i].clone(),
                off: 0,
                len: len as usize,
            };
            op.submit = clock.fetch_add(1, Ordering::SeqCst);
            match dice {
                0..=49 => r.submit_read(tag, off, buf),
                50..=79 => {
                    next_id += 1;
                    op.kind = Kind::Write;
                    op.id = next_id;
                    stamp(&bufs[i], next_id, off, len);
                    // Stamp before taking the time: the write starts at submission.
                    op.submit = clock.fetch_add(1, Ordering::SeqCst);
                    r.submit_write(tag, off, buf);
                }
                80..=87 => {
                    op.kind = Kind::Discard;
                    r.submit_discard(tag, off, len);
                }
                88..=95 => {
                    op.kind = Kind::Zero;
                    r.submit_write_zeroes(tag, off, len, dice.is_multiple_of(2));
                }
                _ => {
                    op.kind = Kind::Flush;
                    r.submit_flush(tag);
                }
            }
            *slot = Some(op);
        }
        r.poll(&mut |tag, res| done.push((tag, res)));
        for (tag, res) in done.drain(..) {
            last_progress = std::time::Instant::now();
            let t = clock.fetch_add(1, Ordering::SeqCst);
            let i = tag as usize;
            let Some(mut op) = slots[i].take() else {
                panic!("completion for an idle slot {i}");
            };
            if let Err(e) = res {
                panic!("reactor {}: {:?} failed: {e}", r.id(), op.kind);
            }
            op.complete = t;
            if op.kind == Kind::Read {
                let mut bytes = vec![0u8; op.len as usize];
                bufs[i].copy_out(0, &mut bytes);
                for (s, chunk) in bytes.chunks(SECTOR as usize).enumerate() {
                    let sector = op.off / SECTOR + s as u64;
                    match stamp_of(chunk, sector) {
                        Ok(id) => op.seen.push(id),
                        Err(e) => panic!("reactor {}: read at {:#x}: {e}", r.id(), op.off),
                    }
                }
            }
            history.push(op);
        }
        if issued >= ops && slots.iter().all(Option::is_none) {
            return history;
        }
    }
}

/// Whether stamp `seen` is allowed for `sector` by a reader that started at `start` and
/// ended at `end` (u64::MAX for the final image).
fn allowed(
    by_sector: &[&Op],
    seen: u64,
    start: u64,
    end: u64,
    initial: bool,
) -> Result<(), String> {
    let stamp_of = |o: &Op| match o.kind {
        Kind::Zero | Kind::Discard => ZERO,
        _ => o.id,
    };
    // Ops that define the content (a discard may leave the old data: it replaces nothing).
    let completed: Vec<&&Op> = by_sector
        .iter()
        .filter(|o| o.complete < start && o.kind != Kind::Discard)
        .collect();
    // x is superseded if a defining op started after x completed and completed before the
    // read started.
    let superseded = |x: &Op| completed.iter().any(|y| y.submit > x.complete);
    if seen == TORN {
        // Only while a write of the sector overlapped the read.
        return if by_sector
            .iter()
            .any(|x| x.submit < end && x.complete > start)
        {
            Ok(())
        } else {
            Err("torn sector with no write overlapping the read".into())
        };
    }
    let ok = by_sector
        .iter()
        .filter(|x| x.submit < end && !superseded(x))
        .any(|x| stamp_of(x) == seen)
        || (completed.is_empty() && seen == if initial { INITIAL } else { ZERO });
    if ok {
        Ok(())
    } else {
        let newest = completed.iter().max_by_key(|o| o.complete);
        Err(format!(
            "saw stamp {seen:#x}; newest write completed before the read: {:?}",
            newest.map(|o| (o.kind, o.id, o.submit, o.complete))
        ))
    }
}

fn run_stress(cfg: &Config) {
    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("stress.qcow2");
    let img_s = img.to_str().expect("utf-8 path");
    let size: u64 = 16 << 20;
    let opts = format!(
        "cluster_size={},extended_l2={}",
        cfg.cluster,
        if cfg.extended_l2 { "on" } else { "off" }
    );
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", &opts, img_s, "16M"]);
    // The first half starts allocated (in-place writes), the second half empty (allocations);
    // a fresh image starts empty.
    if !cfg.fresh {
        common::run(std::process::Command::new("qemu-io").args([
            "-f",
            "qcow2",
            "-c",
            "write -P 0xab 0 8M",
            img_s,
        ]));
    }
    let initial = |sector: u64| !cfg.fresh && sector * SECTOR < (8 << 20);

    let clock = AtomicU64::new(1);
    let open = |id: usize, writable: bool| {
        let d = UringDevice::open(
            &img,
            OpenMode {
                writable,
                direct: false,
            },
            64,
        )
        .map_err(|source| qcow2_tool::host::ToolError::Io {
            path: img.display().to_string(),
            source,
        })?;
        Ok(if id > 0 { d.into_channel() } else { d })
    };
    let eopts = OpenOptions {
        l2_slice_bytes: cfg.l2_slice,
        l2_cache_bytes: Some(cfg.l2_cache),
        ..OpenOptions::default()
    };
    // A small ring, so that chunks are reused while writes reach them.
    let ring = cfg.ring.then_some(RingConfig {
        ring_bytes: 1 << 20,
        max_window: 512 << 10,
    });
    let out = run_reactors_with_ring(cfg.cores, &open, eopts, true, ring, |r| {
        // The owner sweeps the zones the rings left (writes there then skip their bump)
        // many times a run, racing the rings' watches.
        r.chain()
            .ring()
            .set_sweep_every(std::time::Duration::from_micros(200));
        let history = workload(r, &clock, size, cfg.ops_per_core, cfg.ring, cfg.fresh);
        let ring = r.chain().ring().stats().unwrap_or_default();
        let kept = r.chain().kept_overwrites();
        let swept = r
            .chain()
            .ring()
            .write_gens()
            .map_or(0, |g| g.zones().swept());
        Ok((history, r.chain().prefetch().stats(), (ring, swept), kept))
    })
    .expect("reactors");
    let stats: Vec<_> = out.iter().map(|(_, s)| *s).collect();
    let read_ahead: Vec<_> = out.iter().map(|((_, p, _, _), _)| *p).collect();
    let rings: Vec<RingStats> = out.iter().map(|((_, _, (g, _), _), _)| *g).collect();
    let swept = out.first().map_or(0, |((_, _, (_, s), _), _)| *s);
    let kept: Vec<u64> = out.iter().map(|((_, _, _, k), _)| *k).collect();
    let all: Vec<Op> = out.into_iter().flat_map(|((h, _, _, _), _)| h).collect();
    eprintln!(
        "stress {}{}: {} ops on {} cores; per reactor {:?}",
        cfg.cluster,
        if cfg.extended_l2 { " extended_l2" } else { "" },
        all.len(),
        cfg.cores,
        stats
    );
    // Every core sent something to the owner and served something itself.
    assert!(stats[1..].iter().all(|s| s.forwarded > 0), "{stats:?}");
    // Overwrites a core kept through an older copy of a slice the owner only added to
    // since; the checker below holds what they wrote to the same freshness as the rest.
    eprintln!("overwrites kept through older copies per reactor: {kept:?}");
    assert!(!cfg.fresh || kept[1..].iter().all(|&k| k > 0), "{kept:?}");
    // The sequential bands made every core (not only the owner) load slices ahead into its
    // replica; what those requests read is checked below like the rest.
    eprintln!("read-ahead per reactor: {read_ahead:?}");
    assert!(read_ahead.iter().all(|p| p.streams > 0), "{read_ahead:?}");
    // (With the ring on, its read-aheads load most slices before the stream asks.) Which
    // core's bands cross a slice's tail depends on scheduling: under load one replica may
    // see none (CI: `[0, 0, 5]` loaded, streams on all three), so the replicas as a whole.
    assert!(
        cfg.ring || cfg.cores == 1 || read_ahead[1..].iter().any(|p| p.loaded > 0),
        "{read_ahead:?}"
    );
    if cfg.ring {
        // Every core served reads from its ring; the checker below holds those reads to
        // the same freshness as the rest.
        eprintln!("prefetch ring per reactor: {rings:?}");
        assert!(rings.iter().all(|g| g.bytes_served > 0), "{rings:?}");
        // (Only while no core holds data in the zone: a few times a run, or none.)
        eprintln!("zones swept: {swept}");
    }

    // Index writes by sector once.
    let mut by_sector: HashMap<u64, Vec<&Op>> = HashMap::new();
    for o in all
        .iter()
        .filter(|o| matches!(o.kind, Kind::Write | Kind::Zero | Kind::Discard))
    {
        for s in o.off / SECTOR..(o.off + o.len) / SECTOR {
            by_sector.entry(s).or_default().push(o);
        }
    }
    let none: Vec<&Op> = Vec::new();
    let mut checked = 0u64;
    for r in all.iter().filter(|o| o.kind == Kind::Read) {
        for (k, &seen) in r.seen.iter().enumerate() {
            let sector = r.off / SECTOR + k as u64;
            let ws = by_sector.get(&sector).unwrap_or(&none);
            if let Err(e) = allowed(ws, seen, r.submit, r.complete, initial(sector)) {
                let mut touching: Vec<_> = all
                    .iter()
                    .filter(|o| o.off / SECTOR <= sector && sector < (o.off + o.len) / SECTOR)
                    .map(|o| (o.submit, o.complete, o.core, o.kind, o.id, o.off, o.len))
                    .collect();
                touching.sort();
                panic!(
                    "read [{}, {}] of sector {sector} on reactor {}: {e}\nops on it: {touching:#?}",
                    r.submit, r.complete, r.core
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 10_000, "only {checked} sectors checked");
    // Writes reached chunks the rings held, and no read was served them afterwards.
    assert!(
        !cfg.ring || rings.iter().map(|g| g.invalidated).sum::<u64>() > 0,
        "{rings:?}"
    );

    // The image QEMU sees: consistent, and every sector holds an allowed final value.
    qemu_img(&["check", "-q", img_s]);
    let raw = dir.path().join("final.raw");
    qemu_img(&["convert", "-O", "raw", img_s, raw.to_str().expect("utf-8")]);
    let bytes = std::fs::read(&raw).expect("read raw");
    for (i, chunk) in bytes.chunks(SECTOR as usize).enumerate() {
        let sector = i as u64;
        let seen = stamp_of(chunk, sector).unwrap_or_else(|e| panic!("final image: {e}"));
        let ws = by_sector.get(&sector).unwrap_or(&none);
        if let Err(e) = allowed(ws, seen, u64::MAX, u64::MAX, initial(sector)) {
            // Everything on the 64 KiB around the sector (its cluster at most clusters).
            let lo = sector * SECTOR / 65536 * 65536;
            let mut touching: Vec<_> = all
                .iter()
                .filter(|o| o.kind != Kind::Read && o.off < lo + 65536 && lo < o.off + o.len)
                .map(|o| (o.submit, o.complete, o.core, o.kind, o.id, o.off, o.len))
                .collect();
            touching.sort();
            let map = common::output(std::process::Command::new("qemu-img").args([
                "map",
                "--output=json",
                img_s,
            ]));
            let map = String::from_utf8_lossy(&map.stdout).to_string();
            let near: Vec<&str> = map
                .lines()
                .filter(|l| {
                    l.split("\"start\": ")
                        .nth(1)
                        .and_then(|v| v.split(',').next())
                        .and_then(|v| v.parse::<u64>().ok())
                        .is_some_and(|st| st <= sector * SECTOR && sector * SECTOR < st + 4 * 65536)
                })
                .collect();
            panic!(
                "final image, sector {sector}: {e}\nmap near: {near:#?}\nops on it: {touching:#?}"
            );
        }
    }
    // Our engine reads the same bytes as QEMU.
    let ours = dir.path().join("ours.raw");
    common::run(
        std::process::Command::new(env!("CARGO_BIN_EXE_qcow2"))
            .args(["convert", "-f", "qcow2", "-O", "raw", img_s])
            .arg(&ours),
    );
    assert!(
        std::fs::read(&ours).expect("read ours") == bytes,
        "engine and QEMU differ"
    );
}

#[test]
fn stress_three_cores_64k_clusters() {
    // 512-byte slices and a 2-slice cache: slices miss, get evicted and change under cores.
    run_stress(&Config {
        cluster: "64k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 1024,
        cores: 3,
        ops_per_core: 3000,
        ring: false,
        fresh: false,
    });
}

#[test]
fn stress_two_cores_4k_clusters() {
    // 4 KiB clusters: many L2 tables allocated while cores read them.
    run_stress(&Config {
        cluster: "4k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 8192,
        cores: 2,
        ops_per_core: 4000,
        ring: false,
        fresh: false,
    });
}

#[test]
fn stress_two_cores_4k_clusters_fresh() {
    // A fresh image with 4 KiB clusters filled by mostly 4 KiB requests: fills, overwrites,
    // discards, write-zeroes and the reallocations after them race on two cores; every
    // slice of the image fits the cores' caches, so a core keeps its copies while the
    // owner holds the slices dirty, and overwrites through them (§6).
    run_stress(&Config {
        cluster: "4k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 64 << 10,
        cores: 2,
        ops_per_core: 6000,
        ring: false,
        fresh: true,
    });
}

#[test]
fn stress_three_cores_extended_l2_fresh() {
    // The same with extended L2: a write into an unallocated subcluster of an allocated
    // cluster adds to its bitmap, which the owner does; cores keep overwrites of the
    // subclusters their copies show allocated.
    run_stress(&Config {
        cluster: "64k",
        extended_l2: true,
        l2_slice: 1024,
        l2_cache: 16 << 10,
        cores: 3,
        ops_per_core: 3000,
        ring: false,
        fresh: true,
    });
}

#[test]
fn stress_three_cores_extended_l2() {
    run_stress(&Config {
        cluster: "64k",
        extended_l2: true,
        l2_slice: 1024,
        l2_cache: 4096,
        cores: 3,
        ops_per_core: 2000,
        ring: false,
        fresh: false,
    });
}

#[test]
fn checker_catches_stale_reads() {
    // The checker itself: a read that returns the value a completed write replaced fails.
    let w1 = Op {
        kind: Kind::Write,
        core: 0,
        id: 1,
        off: 0,
        len: 512,
        submit: 1,
        complete: 2,
        seen: vec![],
    };
    let w2 = Op {
        id: 2,
        submit: 3,
        complete: 4,
        ..w1.clone()
    };
    let ws = vec![&w1, &w2];
    assert!(allowed(&ws, 2, 5, 6, false).is_ok());
    assert!(
        allowed(&ws, 1, 5, 6, false).is_err(),
        "stale value accepted"
    );
    assert!(allowed(&ws, 1, 3, 6, false).is_ok(), "overlapping: either");
    assert!(
        allowed(&ws, ZERO, 5, 6, false).is_err(),
        "lost write accepted"
    );
    assert!(allowed(&[], INITIAL, 5, 6, true).is_ok());
}

#[test]
fn stress_one_core_4k_clusters() {
    run_stress(&Config {
        cluster: "4k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 8192,
        cores: 1,
        ops_per_core: 8000,
        ring: false,
        fresh: false,
    });
}

#[test]
fn stress_three_cores_64k_clusters_with_the_prefetch_ring() {
    run_stress(&Config {
        cluster: "64k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 1024,
        cores: 3,
        ops_per_core: 4000,
        ring: true,
        fresh: false,
    });
}

#[test]
fn stress_two_cores_4k_clusters_with_the_prefetch_ring() {
    // Allocations (4 KiB clusters, an empty half) change mappings under the rings.
    run_stress(&Config {
        cluster: "4k",
        extended_l2: false,
        l2_slice: 512,
        l2_cache: 8192,
        cores: 2,
        ops_per_core: 4000,
        ring: true,
        fresh: false,
    });
}
