//! A Linux guest on our module: Debian's kernel under `qemu-system-x86_64`, its disks
//! `vhost-user-blk-pci` devices served by `spdk_tgt` with `libbdev_qcow2.so` preloaded, one
//! qcow2 bdev per disk. The guest (`init.sh`, in an initramfs built at test time) writes what
//! the host generated and reads it back; the host then holds the images to qemu-img, a model
//! of every byte, and e2fsck; a second boot on a new target reads everything again.
//!
//! Without SPDK, QEMU's system emulator, the kernel package, busybox-static or cpio, each
//! test prints `SKIPPED:` with the reason and passes. KVM is used when a probe boot shows it
//! works, else TCG. The tests take turns (one SPDK application at a time).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

#[path = "../../bdev_qcow2/tool/tests/common/dirty_ranges.rs"]
mod dirty_ranges;
mod initramfs;
mod plan;
mod quickstart;
mod target;
mod vm;

use initramfs::Kernel;
use plan::{FileSpec, Rng, BLOB_LEN, FS_DISK, RAW_DISK};
use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use target::{aio, qcow2, Target};
use vm::{Spec, Vm};

/// Prints a line that test capture does not swallow.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// One SPDK application (and one guest) at a time.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The kernel, or `None` after printing why the guest tests cannot run here.
fn ready() -> Option<Kernel> {
    if let Some(why) = target::missing().or_else(initramfs::missing) {
        say(&format!("SKIPPED: {why}"));
        return None;
    }
    Some(Kernel::find().unwrap())
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(cmd: &mut Command) -> (i32, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn run_ok(cmd: &mut Command) -> String {
    let (code, text) = run(cmd);
    assert_eq!(code, 0, "{cmd:?} failed:\n{text}");
    text
}

/// `qemu-img check`: clean, or (with `leaks_allowed`) no corruption.
fn check_image(img: &Path, leaks_allowed: bool) {
    let (code, text) = run(Command::new("qemu-img").args(["check", "-f", "qcow2", s(img)]));
    let ok = code == 0 || (leaks_allowed && code == 3 && !text.contains("corruption"));
    assert!(
        ok,
        "qemu-img check {} (exit {code}):\n{text}",
        img.display()
    );
}

/// Granules of a persistent bitmap the tests add (QEMU's default).
const GRANULE: u64 = 64 << 10;

/// Adds an enabled persistent bitmap `backup` to `img` (QEMU's incremental backup).
fn add_bitmap(img: &Path) {
    run_ok(Command::new("qemu-img").args([
        "bitmap",
        "--add",
        "-g",
        &GRANULE.to_string(),
        s(img),
        "backup",
    ]));
}

/// Whether `img`'s bitmap `backup` is `in_use` (not saved by its last writer).
fn bitmap_in_use(img: &Path) -> bool {
    run_ok(Command::new("qemu-img").args(["info", "-U", s(img)])).contains("in-use")
}

/// The granules `backup` marks dirty.
fn dirty_granules(img: &Path) -> BTreeSet<u64> {
    dirty_ranges::dirty_ranges(img, "backup")
        .into_iter()
        .flat_map(|(start, len)| start / GRANULE..(start + len).div_ceil(GRANULE))
        .collect()
}

fn md5(file: &Path) -> String {
    let out = run_ok(Command::new("md5sum").arg(file));
    out.split_whitespace().next().unwrap().to_string()
}

/// The guest's lines hold no failure and every line of `want`.
fn expect_lines(what: &str, lines: &[String], want: &[String], serial: &dyn Fn() -> String) {
    let bad: Vec<_> = lines
        .iter()
        .filter(|l| l.starts_with("BAD") || l.starts_with("FAIL"))
        .collect();
    let have: BTreeSet<&str> = lines.iter().map(String::as_str).collect();
    let absent: Vec<_> = want.iter().filter(|w| !have.contains(w.as_str())).collect();
    assert!(
        bad.is_empty() && absent.is_empty(),
        "{what}: failures {bad:?}, missing {absent:?}\nserial:\n{}",
        serial()
    );
}

/// The ext4 image: `e2fsck -fn` clean and every file's bytes what the guest wrote.
fn check_fs(dir: &Path, img: &Path, blob: &[u8], files: &[FileSpec]) {
    let raw = dir.join("fs.raw");
    run_ok(Command::new("qemu-img").args(["convert", "-f", "qcow2", "-O", "raw", s(img), s(&raw)]));
    let (code, text) = run(Command::new("e2fsck").args(["-fn", s(&raw)]));
    assert_eq!(code, 0, "e2fsck -fn:\n{text}");
    let out = dir.join("dumped");
    for f in files {
        let _ = fs::remove_file(&out);
        run_ok(Command::new("debugfs").args([
            "-R",
            &format!("dump /d/{} {}", f.name, s(&out)),
            s(&raw),
        ]));
        let got = fs::read(&out).unwrap_or_default();
        let want = &blob[f.src as usize..(f.src + f.len) as usize];
        assert!(
            got == want,
            "file {} differs from what the guest wrote",
            f.name
        );
    }
    fs::remove_file(&raw).unwrap();
}

/// Extends `file` (sparse) to `len` bytes: zeros past a qcow2 file's end change nothing.
fn room(file: &Path, len: u64) {
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    f.set_len(len).unwrap();
}

/// How a variant lays out the target and the guest.
struct Variant {
    name: &'static str,
    /// spdk_tgt's cores; the bdevs (and their owners) live on the first.
    mask: &'static str,
    /// The cores polling the vhost controllers.
    vhost_mask: &'static str,
    queues: u32,
    cpus: u32,
    /// The raw disk is an overlay over a backing qcow2 bdev holding data.
    overlay: bool,
}

/// Creates the images; returns the bdev calls, the raw disk's model before the guest and
/// the image files (raw disk, ext4 disk).
fn images(
    d: &Path,
    v: &Variant,
    rng: &mut Rng,
) -> (Vec<serde_json::Value>, Vec<u8>, PathBuf, PathBuf) {
    let raw_img = d.join("raw.qcow2");
    let fs_img = d.join("fs.qcow2");
    let mut model = vec![0u8; RAW_DISK as usize];
    let mut calls = Vec::new();
    if v.overlay {
        // Every other MiB of the backing image holds data the overlay shows through.
        for mib in (0..RAW_DISK >> 20).step_by(2) {
            let at = (mib << 20) as usize;
            model[at..at + (1 << 20)].copy_from_slice(&rng.bytes(1 << 20));
        }
        let base_raw = d.join("base.raw");
        let base = d.join("base.qcow2");
        fs::write(&base_raw, &model).unwrap();
        run_ok(Command::new("qemu-img").args([
            "convert",
            "-f",
            "raw",
            "-O",
            "qcow2",
            s(&base_raw),
            s(&base),
        ]));
        fs::remove_file(&base_raw).unwrap();
        run_ok(Command::new("qemu-img").args([
            "create",
            "-f",
            "qcow2",
            "-b",
            s(&base),
            "-F",
            "qcow2",
            s(&raw_img),
        ]));
        calls.push(aio(&base, "ab"));
        calls.push(qcow2("qb", "ab", None));
        calls.push(aio(&raw_img, "a0"));
        calls.push(qcow2("q0", "a0", Some("qb")));
    } else {
        run_ok(Command::new("qemu-img").args([
            "create",
            "-f",
            "qcow2",
            s(&raw_img),
            &RAW_DISK.to_string(),
        ]));
        calls.push(aio(&raw_img, "a0"));
        calls.push(qcow2("q0", "a0", None));
    }
    run_ok(Command::new("qemu-img").args([
        "create",
        "-f",
        "qcow2",
        s(&fs_img),
        &FS_DISK.to_string(),
    ]));
    // An AIO bdev does not grow: the files get (sparse) room for every cluster and metadata.
    room(&raw_img, RAW_DISK + (16 << 20));
    room(&fs_img, FS_DISK + (16 << 20));
    calls.push(aio(&fs_img, "a1"));
    calls.push(qcow2("q1", "a1", None));
    (calls, model, raw_img, fs_img)
}

/// Starts a target for `v` and exports q0 and q1; returns it with the two sockets.
fn serve(d: &Path, tag: &str, v: &Variant, calls: &[serde_json::Value]) -> (Target, Vec<PathBuf>) {
    let t = Target::start(d, tag, v.mask, calls.to_vec());
    let disks = vec![
        t.vhost_blk("vq0", "q0", v.vhost_mask),
        t.vhost_blk("vq1", "q1", v.vhost_mask),
    ];
    (t, disks)
}

fn scenario(v: &Variant) {
    let Some(kernel) = ready() else { return };
    let _turn = turn();
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let seed = v
        .name
        .bytes()
        .fold(0x5eed_u64, |h, b| h.rotate_left(7) ^ u64::from(b));
    let mut rng = Rng::new(seed);
    let blob = rng.bytes(BLOB_LEN);
    let ops = plan::raw_ops(&mut rng);
    let files = plan::files(&mut rng, "f", 40, 6 << 20);
    let (calls, mut model, raw_img, fs_img) = images(d, v, &mut rng);
    let before = model.clone();
    add_bitmap(&raw_img);
    plan::apply(&mut model, &blob, &ops);
    let model_file = d.join("model.raw");
    fs::write(&model_file, &model).unwrap();
    let want_md5 = format!("MD5 vda {}", md5(&model_file));
    let ops_text = plan::ops_text(&ops);
    let files_text = plan::files_text(&files);
    let payload: [(&str, &[u8]); 3] = [
        ("blob", &blob),
        ("ops", ops_text.as_bytes()),
        ("files", files_text.as_bytes()),
    ];
    let initrd = initramfs::build(d, "initrd", &kernel, &payload);
    let spec = |mode, disks| Spec {
        kernel: &kernel,
        initrd: &initrd,
        mode,
        disks,
        queues: v.queues,
        cpus: v.cpus,
    };

    // Boot 1: the writes, each read back; the ext4 made and filled.
    let (t, disks) = serve(d, "boot1", v, &calls);
    let vm = Vm::boot(d, "boot1", &spec("write", &disks));
    let serial = vm.serial_reader();
    let lines = vm.run_to_end(600);
    let mut want: Vec<String> = (1..=ops.len()).map(|i| format!("OK {i}")).collect();
    want.push(format!("QUEUES {}", v.queues));
    want.push(want_md5.clone());
    want.extend(files.iter().map(|f| format!("OK {}", f.name)));
    expect_lines(&format!("{}: boot 1", v.name), &lines, &want, &serial);
    t.stop();
    check_image(&raw_img, false);
    check_image(&fs_img, false);
    run_ok(Command::new("qemu-img").args([
        "compare",
        "-f",
        "qcow2",
        "-F",
        "raw",
        s(&raw_img),
        s(&model_file),
    ]));
    check_fs(d, &fs_img, &blob, &files);
    // The raw disk's bitmap marks every granule whose bytes changed, and none the guest
    // did not write or discard (reads do not mark), and is consistent after the stop.
    assert!(
        !bitmap_in_use(&raw_img),
        "{}: the bitmap is still in use",
        v.name
    );
    let dirty = dirty_granules(&raw_img);
    let touched: BTreeSet<u64> = ops
        .iter()
        .flat_map(|op| {
            let (dst, len) = match *op {
                plan::Op::Write { dst, len, .. } | plan::Op::Discard { dst, len } => (dst, len),
            };
            dst / GRANULE..(dst + len).div_ceil(GRANULE)
        })
        .collect();
    let changed: BTreeSet<u64> = (0..RAW_DISK / GRANULE)
        .filter(|g| {
            let r = (g * GRANULE) as usize..((g + 1) * GRANULE) as usize;
            model[r.clone()] != before[r]
        })
        .collect();
    assert!(
        changed.is_subset(&dirty) && dirty.is_subset(&touched),
        "{}: bitmap {dirty:?}, changed {changed:?}, touched {touched:?}",
        v.name
    );

    // Boot 2, on a new target: everything boot 1 wrote reads back.
    let (t, disks) = serve(d, "boot2", v, &calls);
    let vm = Vm::boot(d, "boot2", &spec("verify", &disks));
    let serial = vm.serial_reader();
    let lines = vm.run_to_end(600);
    let mut want = vec![want_md5];
    want.extend(files.iter().map(|f| format!("OK {}", f.name)));
    expect_lines(&format!("{}: boot 2", v.name), &lines, &want, &serial);
    t.stop();
    check_image(&raw_img, false);
    check_image(&fs_img, false);
    assert_eq!(
        dirty_granules(&raw_img),
        dirty,
        "{}: boot 2 marked the bitmap",
        v.name
    );
    say(&format!(
        "guest {}: {} raw writes and discards ({} of {} granules marked in its bitmap), {} \
         ext4 files, verified over 2 boots in {:.0} s",
        v.name,
        ops.len(),
        dirty.len(),
        RAW_DISK / GRANULE,
        files.len(),
        started.elapsed().as_secs_f64()
    ));
}

#[test]
fn guest_writes_and_a_second_boot_verifies() {
    scenario(&Variant {
        name: "plain",
        mask: "0x1",
        vhost_mask: "0x1",
        queues: 1,
        cpus: 1,
        overlay: false,
    });
}

#[test]
fn guest_on_an_overlay_over_a_backing_bdev() {
    scenario(&Variant {
        name: "overlay",
        mask: "0x1",
        vhost_mask: "0x1",
        queues: 1,
        cpus: 1,
        overlay: true,
    });
}

#[test]
fn guest_with_the_owner_and_vhost_on_two_cores() {
    scenario(&Variant {
        name: "two-cores",
        mask: "0x3",
        vhost_mask: "0x2",
        queues: 1,
        cpus: 1,
        overlay: false,
    });
}

#[test]
fn guest_with_two_queues() {
    scenario(&Variant {
        name: "two-queues",
        mask: "0x1",
        vhost_mask: "0x1",
        queues: 2,
        cpus: 2,
        overlay: false,
    });
}

/// The guest writes and fsyncs files one by one; spdk_tgt gets SIGKILL at a random moment.
/// A new target and a new boot read back every file whose fsync completed, and the image
/// has no corruption (leaked clusters are allowed).
#[test]
fn guest_fsynced_files_survive_a_killed_target() {
    let Some(kernel) = ready() else { return };
    let _turn = turn();
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    say(&format!("guest crash: seed {seed}"));
    let mut rng = Rng::new(seed);
    let blob = rng.bytes(BLOB_LEN);
    let files = plan::files(&mut rng, "c", 400, 1 << 20);
    let v = Variant {
        name: "crash",
        mask: "0x1",
        vhost_mask: "0x1",
        queues: 1,
        cpus: 1,
        overlay: false,
    };
    let (calls, _, _, fs_img) = images(d, &v, &mut rng);
    add_bitmap(&fs_img);
    let files_text = plan::files_text(&files);
    let payload: [(&str, &[u8]); 2] = [("blob", &blob), ("files", files_text.as_bytes())];
    let initrd = initramfs::build(d, "crash", &kernel, &payload);

    let (t, disks) = serve(d, "crash", &v, &calls);
    let spec = Spec {
        kernel: &kernel,
        initrd: &initrd,
        mode: "crash",
        disks: &disks,
        queues: 1,
        cpus: 1,
    };
    let vm = Vm::boot(d, "crash", &spec);
    let kill_after = rng.range(3, 40) as usize;
    let pause = Duration::from_millis(rng.range(0, 300));
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut synced = BTreeSet::new();
    while synced.len() < kill_after {
        match vm.next_line(deadline) {
            Some(l) if l.starts_with("FSYNCED ") => {
                synced.insert(l["FSYNCED ".len()..].to_string());
            }
            Some(l) if l.starts_with("FAIL") || l.starts_with("BAD") || l == "LOOP-END" => {
                panic!("guest: {l}\n{}", vm.serial())
            }
            Some(_) => {}
            None => panic!("guest stopped before the kill:\n{}", vm.serial()),
        }
    }
    std::thread::sleep(pause);
    t.kill();
    // A line printed after the kill still names an fsync the target had completed.
    let drain = Instant::now() + Duration::from_secs(2);
    while let Some(l) = vm.next_line(drain) {
        if let Some(name) = l.strip_prefix("FSYNCED ") {
            synced.insert(name.to_string());
        }
    }
    vm.kill();
    say(&format!(
        "guest crash: spdk_tgt killed {} ms after fsync {kill_after}; {} files fsynced",
        pause.as_millis(),
        synced.len()
    ));
    check_image(&fs_img, true);
    // Killed, the target did not store the bitmap: it says so (a backup refuses it).
    assert!(
        bitmap_in_use(&fs_img),
        "the bitmap of a killed target is not in use"
    );

    let kept: Vec<FileSpec> = files
        .into_iter()
        .filter(|f| synced.contains(&f.name))
        .collect();
    let kept_text = plan::files_text(&kept);
    let payload: [(&str, &[u8]); 2] = [("blob", &blob), ("files", kept_text.as_bytes())];
    let initrd = initramfs::build(d, "after", &kernel, &payload);
    let (t, disks) = serve(d, "after", &v, &calls);
    let spec = Spec {
        initrd: &initrd,
        mode: "crash-check",
        disks: &disks,
        ..spec
    };
    let vm = Vm::boot(d, "after", &spec);
    let serial = vm.serial_reader();
    let lines = vm.run_to_end(600);
    let want: Vec<String> = kept.iter().map(|f| format!("OK {}", f.name)).collect();
    expect_lines("crash: after the kill", &lines, &want, &serial);
    t.stop();
    check_image(&fs_img, true);
    check_fs(d, &fs_img, &blob, &kept);
    say(&format!(
        "guest crash: every fsynced file intact after the kill ({:.0} s)",
        started.elapsed().as_secs_f64()
    ));
}
