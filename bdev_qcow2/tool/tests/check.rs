//! `qcow2 check` against the QEMU oracle: on clean images made by qemu-img/qemu-io both tools
//! exit 0 and agree on the counts; on images damaged on purpose (bytes patched here, after
//! reading the layout from the header and tables) both report the same leaks and corruptions
//! with the same exit code, and after `qcow2 check -r …` qemu-img finds the image clean and
//! the guest data unchanged. Several cases follow qemu-iotests 060 and 108.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{qemu_img, qemu_io_clean, s};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

fn qemu_io(img: &Path, cmds: &[&str]) {
    qemu_io_clean(img, "qcow2", cmds);
}

/// Runs a check command; returns its exit code and the JSON it printed (Null if none).
fn json_check(cmd: &mut Command) -> (i32, Value) {
    let out = cmd.output().expect("run check");
    let code = out.status.code().unwrap_or(-1);
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (code, v)
}

fn ours(img: &Path, repair: Option<&str>) -> (i32, Value) {
    let mut c = Command::new(QCOW2);
    c.args(["check", "--output=json"]);
    if let Some(r) = repair {
        c.args(["-r", r]);
    }
    json_check(c.arg(img))
}

fn qemu(img: &Path) -> (i32, Value) {
    json_check(Command::new("qemu-img").args(["check", "--output=json", "-f", "qcow2", s(img)]))
}

const KEYS: [&str; 8] = [
    "check-errors",
    "leaks",
    "corruptions",
    "image-end-offset",
    "total-clusters",
    "allocated-clusters",
    "fragmented-clusters",
    "compressed-clusters",
];

fn n(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// Both tools' exit codes and counts must agree; returns (code, our report).
fn agree(img: &Path, what: &str) -> (i32, Value) {
    let (qc, qv) = qemu(img);
    let (oc, ov) = ours(img, None);
    assert_eq!(oc, qc, "{what}: exit codes differ; ours {ov}, qemu {qv}");
    if qv != Value::Null {
        for k in KEYS {
            assert_eq!(
                n(&ov, k),
                n(&qv, k),
                "{what}: '{k}' differs; ours {ov}, qemu {qv}"
            );
        }
    }
    (oc, ov)
}

/// Repairs `img` with ours and a copy of it with qemu-img (same mode); both must end with
/// the same exit code and the same fixed counts. Returns our report.
fn repair_agrees(img: &Path, mode: &str, what: &str) -> (i32, Value) {
    let copy = img.with_extension("qemu-repair");
    std::fs::copy(img, &copy).expect("copy image");
    let (qc, qv) = json_check(Command::new("qemu-img").args([
        "check",
        "--output=json",
        "-f",
        "qcow2",
        "-r",
        mode,
        s(&copy),
    ]));
    let (oc, ov) = ours(img, Some(mode));
    std::fs::remove_file(&copy).ok();
    assert_eq!(
        oc, qc,
        "{what}: -r {mode} exit codes differ; ours {ov}, qemu {qv}"
    );
    if qv != Value::Null {
        for k in [
            "leaks-fixed",
            "corruptions-fixed",
            "leaks",
            "corruptions",
            "check-errors",
        ] {
            assert_eq!(
                n(&ov, k),
                n(&qv, k),
                "{what}: -r {mode} '{k}' differs; ours {ov}, qemu {qv}"
            );
        }
    }
    (oc, ov)
}

fn raw_copy(img: &Path, out: &Path) -> Vec<u8> {
    qemu_img(&["convert", "-f", "qcow2", "-O", "raw", s(img), s(out)]);
    std::fs::read(out).expect("read raw")
}

/// The image layout read from the header, and helpers to patch it.
struct Img {
    path: PathBuf,
    cluster_bits: u32,
    l1_offset: u64,
    rt_offset: u64,
    refcount_order: u32,
    extended_l2: bool,
}

impl Img {
    fn open(path: &Path) -> Img {
        let b = std::fs::read(path).expect("read image");
        let u32_at = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap());
        Img {
            path: path.to_path_buf(),
            cluster_bits: u32_at(20),
            l1_offset: u64_at(40),
            rt_offset: u64_at(48),
            refcount_order: u32_at(96),
            extended_l2: u64_at(72) & (1 << 4) != 0,
        }
    }
    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }
    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&self.path).unwrap();
        f.seek(SeekFrom::Start(off)).unwrap();
        let mut v = vec![0; len];
        f.read_exact(&mut v).unwrap();
        v
    }
    fn poke(&self, off: u64, bytes: &[u8]) {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap();
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(bytes).unwrap();
    }
    fn u64_at(&self, off: u64) -> u64 {
        u64::from_be_bytes(self.read(off, 8).try_into().unwrap())
    }
    fn put_u64(&self, off: u64, v: u64) {
        self.poke(off, &v.to_be_bytes());
    }
    fn len(&self) -> u64 {
        std::fs::metadata(&self.path).unwrap().len()
    }
    fn per_block(&self) -> u64 {
        (self.cs() * 8) >> self.refcount_order
    }
    /// File offset of refcount table entry `i`.
    fn rt_entry(&self, i: u64) -> u64 {
        self.rt_offset + i * 8
    }
    /// Sets the stored refcount of host cluster `c` (its block must exist).
    fn set_refcount(&self, c: u64, v: u64) {
        let block = self.u64_at(self.rt_entry(c / self.per_block())) & !0x1ff;
        assert_ne!(block, 0, "no refcount block for cluster {c}");
        let i = c % self.per_block();
        let bits = 1u64 << self.refcount_order;
        if bits < 8 {
            let at = block + i * bits / 8;
            let mut byte = self.read(at, 1)[0];
            let shift = (i * bits) % 8;
            let mask = (((1u16 << bits) - 1) as u8) << shift;
            byte = (byte & !mask) | (((v as u8) << shift) & mask);
            self.poke(at, &[byte]);
        } else {
            let nb = (bits / 8) as usize;
            self.poke(block + i * nb as u64, &v.to_be_bytes()[8 - nb..]);
        }
    }
    /// File offset of the L2 entry of guest cluster `g` (its L2 table must exist).
    fn l2_entry(&self, g: u64) -> u64 {
        let entry_bytes = if self.extended_l2 { 16 } else { 8 };
        let per_l2 = self.cs() / entry_bytes;
        let l2 = self.u64_at(self.l1_offset + g / per_l2 * 8) & 0x00ff_ffff_ffff_fe00;
        assert_ne!(l2, 0, "no L2 table for guest cluster {g}");
        l2 + g % per_l2 * entry_bytes
    }
    fn host_cluster(&self, g: u64) -> u64 {
        (self.u64_at(self.l2_entry(g)) & 0x00ff_ffff_ffff_fe00) >> self.cluster_bits
    }
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir().expect("tempdir"))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
    fn create(&self, name: &str, opts: &str, size: &str) -> PathBuf {
        let p = self.path(name);
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if !opts.is_empty() {
            args.extend(["-o", opts]);
        }
        args.extend([s(&p), size]);
        qemu_img(&args);
        p
    }
}

/// Clean images: both tools exit 0 with equal counts, and `-r all` changes nothing.
fn clean_case(dir: &Dir, name: &str, opts: &str, size: &str, io: &[&str]) -> PathBuf {
    let img = dir.create(name, opts, size);
    if !io.is_empty() {
        qemu_io(&img, io);
    }
    let (code, _) = agree(&img, name);
    assert_eq!(code, 0, "{name}: clean image reported problems");
    let before = std::fs::read(&img).unwrap();
    let (code, v) = ours(&img, Some("all"));
    assert_eq!(code, 0, "{name}: -r all on a clean image: {v}");
    assert_eq!(n(&v, "leaks-fixed") + n(&v, "corruptions-fixed"), 0);
    assert!(
        before == std::fs::read(&img).unwrap(),
        "{name}: -r all changed a clean image"
    );
    img
}

const WORKLOAD: [&str; 6] = [
    "write -P 1 0 300k",
    "write -P 2 1M 64k",
    "write -P 3 3M 5k",
    "write -z 4M 128k",
    "discard 64k 64k",
    "write -P 4 7M 1M",
];

#[test]
fn clean_images_agree() {
    let d = Dir::new();
    for cs in ["512", "4k", "64k", "2M"] {
        clean_case(
            &d,
            &format!("cs{cs}.qcow2"),
            &format!("cluster_size={cs}"),
            "16M",
            &WORKLOAD,
        );
    }
    for rb in ["1", "16", "64"] {
        clean_case(
            &d,
            &format!("rb{rb}.qcow2"),
            &format!("refcount_bits={rb},cluster_size=4k"),
            "16M",
            &WORKLOAD,
        );
    }
    clean_case(&d, "empty.qcow2", "", "1G", &[]);
    clean_case(&d, "v2.qcow2", "compat=0.10", "16M", &WORKLOAD);
    clean_case(
        &d,
        "xl2.qcow2",
        "extended_l2=on,cluster_size=64k",
        "16M",
        &WORKLOAD,
    );
    clean_case(
        &d,
        "compressed.qcow2",
        "",
        "16M",
        &[
            "write -c -P 5 0 64k",
            "write -c -P 6 128k 64k",
            "write -P 7 64k 64k",
            "write -c -P 8 1M 64k",
        ],
    );
    // Compressed images from convert -c (many small compressed clusters).
    let src = d.path("src.raw");
    std::fs::write(
        &src,
        (0..4u32 << 20)
            .map(|i| (i / 3000) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let conv = d.path("conv.qcow2");
    qemu_img(&[
        "convert",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4k",
        s(&src),
        s(&conv),
    ]);
    assert_eq!(agree(&conv, "convert -c").0, 0);

    // Internal snapshots, with writes before and after.
    let snap = d.create("snap.qcow2", "", "16M");
    qemu_io(&snap, &WORKLOAD);
    qemu_img(&["snapshot", "-c", "s1", s(&snap)]);
    qemu_io(&snap, &["write -P 9 0 128k", "discard 1M 64k"]);
    qemu_img(&["snapshot", "-c", "s2", s(&snap)]);
    qemu_io(&snap, &["write -P 10 32k 1M"]);
    assert_eq!(agree(&snap, "snapshots").0, 0);

    // A persistent bitmap, dirtied by writes (bitmap tables and data clusters).
    let bm = d.create("bitmap.qcow2", "", "64M");
    qemu_img(&["bitmap", "--add", s(&bm), "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "4k", s(&bm), "b1"]);
    qemu_io(&bm, &["write -P 1 0 1M", "write -P 2 40M 3M"]);
    let (code, _) = agree(&bm, "bitmaps");
    assert_eq!(code, 0);
    let before = std::fs::read(&bm).unwrap();
    assert_eq!(ours(&bm, Some("all")).0, 0);
    assert!(
        before == std::fs::read(&bm).unwrap(),
        "-r all changed the bitmap image"
    );
}

/// After our repair: our check and qemu-img's are clean, and the guest data is `raw`.
fn repaired_clean(d: &Dir, img: &Path, raw: &[u8], what: &str) {
    let (qc, qv) = qemu(img);
    assert_eq!(qc, 0, "{what}: qemu-img check after our repair: {qv}");
    let (oc, ov) = ours(img, None);
    assert_eq!(oc, 0, "{what}: our check after repair: {ov}");
    let after = raw_copy(img, &d.path("after.raw"));
    assert!(after == raw, "{what}: guest data changed by the repair");
}

fn fresh(d: &Dir, name: &str, opts: &str) -> (Img, Vec<u8>) {
    let p = d.create(name, opts, "64M");
    qemu_io(
        &p,
        &[
            "write -P 1 0 256k",
            "write -P 2 1M 64k",
            "write -P 3 10M 128k",
        ],
    );
    let raw = raw_copy(&p, &d.path(&format!("{name}.raw")));
    (Img::open(&p), raw)
}

#[test]
fn leaks_agree_and_repair() {
    let d = Dir::new();
    for opts in ["", "refcount_bits=1", "refcount_bits=64,cluster_size=4k"] {
        let (img, raw) = fresh(&d, "leak.qcow2", opts);
        // Two clusters past the end with refcount 1 and no reference, and (where the width
        // allows) the header cluster's refcount raised to 2.
        let end = img.len().div_ceil(img.cs());
        img.set_refcount(end, 1);
        img.set_refcount(end + 1, 1);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img.path)
            .unwrap()
            .set_len((end + 2) * img.cs())
            .unwrap();
        let expect = if img.refcount_order > 0 {
            img.set_refcount(0, 2);
            3
        } else {
            2
        };
        let (code, v) = agree(&img.path, &format!("leaks {opts}"));
        assert_eq!((code, n(&v, "leaks"), n(&v, "corruptions")), (3, expect, 0));
        let (code, v) = repair_agrees(&img.path, "leaks", "leaks");
        assert_eq!((code, n(&v, "leaks-fixed")), (0, expect), "{v}");
        repaired_clean(&d, &img.path, &raw, "leaks");
        std::fs::remove_file(&img.path).unwrap();
    }
}

#[test]
fn refcount_too_low_agree_and_repair() {
    let d = Dir::new();
    for opts in ["", "refcount_bits=1", "refcount_bits=64", "extended_l2=on"] {
        let (img, raw) = fresh(&d, "low.qcow2", opts);
        // A data cluster's refcount 0: "ERROR cluster" plus the COPIED flag now wrong.
        img.set_refcount(img.host_cluster(1), 0);
        let (code, v) = agree(&img.path, &format!("refcount 0 {opts}"));
        assert_eq!((code, n(&v, "corruptions")), (2, 2), "{v}");
        // -r leaks cannot fix it (QEMU would need to rebuild): check fails.
        assert_eq!(repair_agrees(&img.path, "leaks", "refcount 0").0, 1);
        let (code, v) = repair_agrees(&img.path, "all", "refcount 0");
        assert_eq!((code, n(&v, "corruptions-fixed")), (0, 1), "{v}");
        repaired_clean(&d, &img.path, &raw, &format!("refcount 0 {opts}"));
        std::fs::remove_file(&img.path).unwrap();
    }
}

#[test]
fn missing_refcount_block_is_recreated() {
    // qemu-iotests 108 style: a refcount table entry cleared, so every cluster it covers has
    // refcount 0. Small clusters make several blocks.
    let d = Dir::new();
    let (img, raw) = fresh(&d, "noblock.qcow2", "cluster_size=512,refcount_bits=16");
    let per = img.per_block();
    let last = (img.len() / img.cs() - 1) / per;
    assert!(last >= 2, "need several refcount blocks");
    img.put_u64(img.rt_entry(1), 0);
    let (code, v) = agree(&img.path, "refcount block 1 cleared");
    assert_eq!(code, 2, "{v}");
    let (code, v) = repair_agrees(&img.path, "all", "refcount block 1 cleared");
    assert_eq!(code, 0, "{v}");
    repaired_clean(&d, &img.path, &raw, "refcount block recreated");
}

#[test]
fn refcount_table_grows_on_repair() {
    // The file is extended with zeros up to the end of what the refcount table covers, and a
    // used block's entry is cleared: the new block lies past the table, so the repair writes
    // a larger table elsewhere, switches the header and frees the old table.
    let d = Dir::new();
    let (img, raw) = fresh(&d, "grow.qcow2", "cluster_size=512,refcount_bits=64");
    let rt_clusters = u32::from_be_bytes(img.read(56, 4).try_into().unwrap()) as u64;
    let entries = rt_clusters * img.cs() / 8;
    let covered = entries * img.per_block() * img.cs();
    assert!(covered > img.len());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img.path)
        .unwrap()
        .set_len(covered)
        .unwrap();
    assert_eq!(agree(&img.path, "extended file").0, 0);
    img.put_u64(img.rt_entry(2), 0);
    let (code, v) = agree(&img.path, "block 2 cleared, table full");
    assert_eq!(code, 2, "{v}");
    let (code, v) = repair_agrees(&img.path, "all", "table growth");
    assert_eq!(code, 0, "{v}");
    let moved = Img::open(&img.path);
    assert_ne!(moved.rt_offset, img.rt_offset, "refcount table not moved");
    repaired_clean(&d, &img.path, &raw, "refcount table grown");
}

#[test]
fn overlapping_references_agree() {
    let d = Dir::new();
    for opts in ["", "refcount_bits=1", "cluster_size=4k,refcount_bits=8"] {
        let (img, raw) = fresh(&d, "dup.qcow2", opts);
        // Guest cluster 100 (unallocated, same L2 table) points at guest cluster 1's data.
        let e = img.u64_at(img.l2_entry(1));
        img.put_u64(img.l2_entry(100 % (img.cs() / 8)), e);
        let (code, v) = agree(&img.path, &format!("two L2 entries, one cluster {opts}"));
        assert_eq!((code, n(&v, "corruptions")), (2, 1), "{v}");
        if img.refcount_order > 0 {
            // Refcount 2 and COPIED cleared on both: consistent (qemu-img agrees).
            let (code, v) = repair_agrees(&img.path, "all", "two L2 entries, one cluster");
            assert_eq!(code, 0, "{v}");
            assert_eq!(n(&v, "corruptions-fixed"), 3, "{v}");
            let (qc, qv) = qemu(&img.path);
            assert_eq!(qc, 0, "{qv}");
            let _ = raw;
        }
        std::fs::remove_file(&img.path).unwrap();
    }
}

#[test]
fn references_into_metadata_agree() {
    let d = Dir::new();
    // An unallocated L2 entry (COPIED) pointing at the refcount table, at the L1 table.
    for target in ["refcount table", "L1 table"] {
        let (img, _) = fresh(&d, "meta.qcow2", "");
        let off = if target == "L1 table" {
            img.l1_offset
        } else {
            img.rt_offset
        };
        img.put_u64(img.l2_entry(200), (1 << 63) | off);
        let (code, v) = agree(&img.path, &format!("L2 entry into the {target}"));
        assert_eq!((code, n(&v, "corruptions")), (2, 1), "{v}");
        std::fs::remove_file(&img.path).unwrap();
    }
    // qemu-iotests 060 "L2 reference into L1": the first L1 entry points at the L1 table.
    let p = d.create("l1self.qcow2", "", "64M");
    let img = Img::open(&p);
    img.put_u64(img.l1_offset, (1 << 63) | img.l1_offset);
    let (code, v) = agree(&p, "L1 entry onto the L1 table");
    assert_eq!((code, n(&v, "corruptions")), (2, 1), "{v}");

    // qemu-iotests 060 "cluster data reference into refcount block", then repaired.
    let p = d.create("intorb.qcow2", "", "64M");
    qemu_io(&p, &["write -P 7 0 64k"]);
    let img = Img::open(&p);
    let block = img.u64_at(img.rt_entry(0));
    img.put_u64(img.l2_entry(5), (1 << 63) | block);
    let (code, v) = agree(&p, "L2 entry into a refcount block");
    assert_eq!(code, 2, "{v}");
    assert_eq!(n(&v, "corruptions"), 2, "{v}");
    let raw = raw_copy(&p, &d.path("intorb.raw"));
    let (code, v) = repair_agrees(&p, "all", "L2 entry into a refcount block");
    assert_eq!(code, 0, "{v}");
    repaired_clean(&d, &p, &raw, "refcount block relocated");

    // qemu-iotests 060 "cluster data reference into inactive L2 table".
    let p = d.create("inactive.qcow2", "", "64M");
    qemu_io(&p, &["write -P 1 0 512"]);
    qemu_img(&["snapshot", "-c", "foo", s(&p)]);
    qemu_io(&p, &["write -P 2 0 512"]);
    let img = Img::open(&p);
    // The snapshot's L2 table: where the active L1 pointed before the COW, i.e. the
    // snapshot L1's first entry.
    let sn_off = img.u64_at(64);
    let sn_l1 = img.u64_at(sn_off);
    let sn_l2 = img.u64_at(sn_l1) & 0x00ff_ffff_ffff_fe00;
    img.put_u64(img.l2_entry(0), (1 << 63) | sn_l2);
    agree(&p, "L2 entry into an inactive L2 table");
}

#[test]
fn copied_flag_agree_and_repair() {
    let d = Dir::new();
    let (img, raw) = fresh(&d, "copied.qcow2", "");
    let e = img.l2_entry(2);
    img.put_u64(e, img.u64_at(e) & !(1 << 63));
    let l1 = img.u64_at(img.l1_offset);
    img.put_u64(img.l1_offset, l1 & !(1 << 63));
    let (code, v) = agree(&img.path, "COPIED cleared on an L1 and an L2 entry");
    assert_eq!((code, n(&v, "corruptions")), (2, 2), "{v}");
    let (code, v) = repair_agrees(&img.path, "all", "COPIED");
    assert_eq!((code, n(&v, "corruptions-fixed")), (0, 2), "{v}");
    repaired_clean(&d, &img.path, &raw, "COPIED");
    // With -r leaks, COPIED is repaired when the refcounts are right.
    let e = img.l2_entry(3);
    img.put_u64(e, img.u64_at(e) & !(1 << 63));
    let (code, v) = repair_agrees(&img.path, "leaks", "COPIED with -r leaks");
    assert_eq!((code, n(&v, "corruptions-fixed")), (0, 1), "{v}");
}

#[test]
fn refcount_table_entry_damage_agrees() {
    let d = Dir::new();
    // Reserved bits in a refcount table entry (the block stays readable): one corruption,
    // and the block is no longer counted, so its own cluster leaks.
    let (img, raw) = fresh(&d, "rtres.qcow2", "");
    let e = img.u64_at(img.rt_entry(0));
    img.put_u64(img.rt_entry(0), e | 1);
    let (code, v) = agree(&img.path, "refcount table entry with reserved bits");
    assert_eq!(
        (code, n(&v, "corruptions"), n(&v, "leaks")),
        (2, 1, 1),
        "{v}"
    );
    // qemu-img -r all fails here (exit 1): its rebuild allocates the old block's cluster,
    // which its overlap check still counts as a refcount block, and the image is marked
    // corrupt. Ours relocates the block; qemu-img then finds the image clean.
    let copy = img.path.with_extension("qemu-repair");
    std::fs::copy(&img.path, &copy).unwrap();
    let q = Command::new("qemu-img")
        .args(["check", "-r", "all", "-f", "qcow2", s(&copy)])
        .output()
        .unwrap();
    assert_eq!(
        q.status.code(),
        Some(1),
        "qemu-img learnt to repair this: compare counts"
    );
    let (code, v) = ours(&img.path, Some("all"));
    assert_eq!(code, 0, "{v}");
    assert_eq!(
        (n(&v, "leaks-fixed"), n(&v, "corruptions-fixed")),
        (1, 1),
        "{v}"
    );
    repaired_clean(
        &d,
        &img.path,
        &raw,
        "refcount table entry with reserved bits",
    );
    // An unaligned refcount block: its refcounts cannot be read (check errors, exit 1).
    let (img, _) = fresh(&d, "rtunal.qcow2", "");
    let e = img.u64_at(img.rt_entry(0));
    img.put_u64(img.rt_entry(0), e + 512);
    let (code, _) = agree(&img.path, "unaligned refcount block");
    assert_eq!(code, 1);
}

#[test]
fn l2_entry_damage_agrees() {
    let d = Dir::new();
    let (img, _) = fresh(&d, "l2bad.qcow2", "");
    // Reserved bits, an unaligned data offset, an offset far past the end of the file.
    let e1 = img.l2_entry(1);
    img.put_u64(e1, img.u64_at(e1) | (1 << 57));
    let e2 = img.l2_entry(2);
    img.put_u64(e2, img.u64_at(e2) + 512);
    img.put_u64(img.l2_entry(300), (1 << 63) | (1 << 40));
    agree(&img.path, "bad L2 entries");
    // Compressed entry with COPIED.
    let p = d.create("ccopied.qcow2", "", "16M");
    qemu_io(&p, &["write -c -P 4 0 64k"]);
    let img = Img::open(&p);
    let e = img.l2_entry(0);
    img.put_u64(e, img.u64_at(e) | (1 << 63));
    let (code, v) = agree(&p, "compressed entry with COPIED");
    assert_eq!(code, 2, "{v}");
}

#[test]
fn human_output_and_exit_codes() {
    let d = Dir::new();
    let (img, _) = fresh(&d, "human.qcow2", "");
    let out = Command::new(QCOW2)
        .args(["check", s(&img.path)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let q = qemu_img(&["check", "-f", "qcow2", s(&img.path)]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&q.stdout)
    );
    let end = img.len().div_ceil(img.cs());
    img.set_refcount(end, 1);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img.path)
        .unwrap()
        .set_len((end + 1) * img.cs())
        .unwrap();
    let out = Command::new(QCOW2)
        .args(["check", s(&img.path)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1 leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data."), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains(&format!("Leaked cluster {end} refcount=1 reference=0")));
    let out = Command::new(QCOW2)
        .args(["check", "-r", "leaks", s(&img.path)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("The following inconsistencies were found and repaired:\n\n    1 leaked clusters\n    0 corruptions\n\nDouble checking the fixed image now...\nNo errors were found on the image."), "{text}");
    // Not a qcow2 image: check failed.
    let junk = d.path("junk.img");
    std::fs::write(&junk, vec![0u8; 4096]).unwrap();
    let out = Command::new(QCOW2)
        .args(["check", s(&junk)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let out = Command::new(QCOW2)
        .args(["check", "-f", "raw", s(&junk)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(63));
}

/// Broken snapshot tables, as in qemu-iotests 080: `qcow2 check` gives qemu-img's exit code
/// and, where qemu-img can check the image at all, the same counts.
#[test]
fn broken_snapshot_tables_like_iotests_080() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("sn.qcow2");
    let b = base.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", b, "4M"]);
    qemu_io(&base, &["write -P 1 0 64k"]);
    qemu_img(&["snapshot", "-c", "s1", b]);
    let img = std::fs::read(&base).unwrap();
    let be64 = |o: usize| u64::from_be_bytes(img[o..o + 8].try_into().unwrap());
    let snap = be64(64) as usize;
    let snap_l1 = be64(snap);
    let cases: [(&str, usize, Vec<u8>); 5] = [
        (
            "snapshots_offset unaligned",
            64,
            (snap as u64 + 8).to_be_bytes().to_vec(),
        ),
        ("nb_snapshots huge", 60, 100_000u32.to_be_bytes().to_vec()),
        (
            "snapshot L1 unaligned",
            snap,
            (snap_l1 + 512).to_be_bytes().to_vec(),
        ),
        (
            "snapshot L1 too large",
            snap + 8,
            0x7fff_ffffu32.to_be_bytes().to_vec(),
        ),
        (
            "extra_data_size huge",
            snap + 36,
            100_000u32.to_be_bytes().to_vec(),
        ),
    ];
    for (name, off, bytes) in cases {
        let mut m = img.clone();
        m[off..off + bytes.len()].copy_from_slice(&bytes);
        let p = dir.path().join("broken.qcow2");
        std::fs::write(&p, &m).unwrap();
        let theirs = Command::new("qemu-img")
            .args(["check", "--output=json"])
            .arg(&p)
            .output()
            .unwrap();
        let ours = Command::new(QCOW2)
            .args(["check", "--output=json"])
            .arg(&p)
            .output()
            .unwrap();
        assert_eq!(
            ours.status.code(),
            theirs.status.code(),
            "{name}: exit codes differ"
        );
        if theirs.status.code() != Some(1) {
            let t: Value = serde_json::from_slice(&theirs.stdout).unwrap();
            let o: Value = serde_json::from_slice(&ours.stdout).unwrap();
            for k in ["corruptions", "leaks", "check-errors"] {
                assert_eq!(o[k], t[k], "{name}: {k}");
            }
        }
    }
}

/// A loop device over a file, detached when dropped.
struct Loop(String);

impl Loop {
    /// Attaches `file`; `None` when loop devices are not available here (not root, no
    /// `losetup`, no free device).
    fn attach(file: &Path) -> Option<Loop> {
        let out = Command::new("losetup")
            .args(["-f", "--show", s(file)])
            .output()
            .ok()?;
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !dev.is_empty()).then_some(Loop(dev))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn repair_on_a_block_device_stays_inside_it() {
    // A block device cannot grow: a refcount block lost from a qemu-img image is rebuilt in
    // a cluster nothing uses, inside the device (appending it would fail with EIO).
    let d = Dir::new();
    for (opts, entry) in [
        ("cluster_size=512,refcount_bits=16", 1),
        ("cluster_size=4k,refcount_bits=64", 0),
        ("", 0),
    ] {
        let (img, raw) = fresh(&d, "blockdev.qcow2", opts);
        // The device is the image, rounded up to whole sectors.
        let size = img.len().next_multiple_of(512);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img.path)
            .unwrap()
            .set_len(size)
            .unwrap();
        img.put_u64(img.rt_entry(entry), 0);
        let (code, v) = agree(&img.path, &format!("refcount block {entry} cleared {opts}"));
        assert_eq!(code, 2, "{v}");
        let Some(dev) = Loop::attach(&img.path) else {
            println!("SKIPPED: no loop device (needs root and losetup)");
            return;
        };
        let (code, v) = ours(Path::new(&dev.0), Some("all"));
        assert_eq!(code, 0, "{opts}: -r all on {}: {v}", dev.0);
        assert!(n(&v, "corruptions-fixed") > 0, "{v}");
        drop(dev);
        assert_eq!(img.len(), size, "{opts}: the device grew");
        repaired_clean(&d, &img.path, &raw, &format!("block device {opts}"));
        std::fs::remove_file(&img.path).unwrap();
    }
}
