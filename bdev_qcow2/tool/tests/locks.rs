//! Image locks against QEMU (issue #49): the `qcow2` tool and qemu-io / qemu-img keep each
//! other out of an image the other is writing, readers coexist, `-U` readers get in, and
//! everything is free again once the holder exits. Every holder is a real process (or an
//! open in this one) whose lock bytes are seen in /proc/locks before anything is asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers may panic

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "common/holder.rs"]
mod holder;
use common::{output, qemu_img, qemu_io, s};
use holder::{byte_locked, wait_locked, QemuHolder, READER_BYTE, WRITER_BYTE};

const QCOW2: &str = env!("CARGO_BIN_EXE_qcow2");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A 1 MiB qcow2 image `name` in `dir` whose first 64 KiB read 0xaa.
fn image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    qemu_img(&["create", "-q", "-f", "qcow2", s(&p), "1M"]);
    qemu_io(&p, &["write -P 0xaa 0 64k"]);
    p
}

/// `qcow2 io ARGS -c CMD... -c 'sleep 60000' IMG`, running with the image open (its lock
/// bytes seen) when this returns; [`stop`] ends it.
fn our_holder(img: &Path, args: &[&str], cmds: &[&str], byte: u64) -> Child {
    our_holder_for(img, args, cmds, byte, 60_000)
}

/// [`our_holder`] sleeping `ms` milliseconds after its commands.
fn our_holder_for(img: &Path, args: &[&str], cmds: &[&str], byte: u64, ms: u64) -> Child {
    let sleep = format!("sleep {ms}");
    let mut c = Command::new(QCOW2);
    c.arg("io").args(args);
    for x in cmds.iter().chain(&[sleep.as_str()]) {
        c.arg("-c").arg(x);
    }
    let mut child = c
        .arg(img)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn qcow2 io");
    wait_locked(img, byte, &mut child);
    child
}

/// Kills a holder from [`our_holder`] (still running, else what it held proves nothing)
/// and waits until its locks on `img` are gone: a killed process's files are closed by
/// the kernel, io_uring's references to them possibly after the process is reaped.
fn stop(mut child: Child, img: &Path) {
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the qcow2 holder exited early"
    );
    child.kill().expect("kill our holder");
    child.wait().expect("wait our holder");
    wait_unlocked(img);
}

/// Waits (at most 10 s) until no lock is left on `img`'s reader byte.
fn wait_unlocked(img: &Path) {
    let t0 = Instant::now();
    while byte_locked(img, READER_BYTE) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{} still locked 10 s after the holder was killed",
            img.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn qcow2(args: &[&str]) -> Output {
    output(Command::new(QCOW2).args(args))
}

/// The command failed with exit status 1 and `msg` (and QEMU's hint naming `img`).
fn assert_refused(what: &str, out: &Output, msg: &str, img: &Path) {
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what}: {err}{}",
        text(&out.stdout)
    );
    assert!(err.contains(msg), "{what}: expected {msg:?} in: {err}");
    let hint = format!("Is another process using the image [{}]?", img.display());
    assert!(err.contains(&hint), "{what}: expected {hint:?} in: {err}");
}

fn assert_ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        text(&out.stderr),
        text(&out.stdout)
    );
}

const WRITE_LOCK: &str = "Failed to get \"write\" lock";
const SHARED_WRITE_LOCK: &str = "Failed to get shared \"write\" lock";

/// qemu-io holds the image for writing: our writer is refused and the file stays as it
/// was; our readers are refused unless `-U`; once qemu-io exits we write again.
#[test]
fn qemu_writer_keeps_the_tool_out() {
    let d = tempfile::tempdir().unwrap();
    let img = image(d.path(), "a.qcow2");
    let before = std::fs::read(&img).unwrap();
    let holder = QemuHolder::open(&img, false);

    let out = qcow2(&["io", "-c", "write -P 0x55 0 4k", s(&img)]);
    assert_refused("qcow2 io write", &out, WRITE_LOCK, &img);
    let want = format!("qcow2: Could not open '{}': {WRITE_LOCK}", img.display());
    assert!(
        text(&out.stderr).starts_with(&want),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&img).unwrap(), before, "the image changed");

    let raw = d.path().join("out.raw");
    let readers: [(&str, Vec<&str>); 6] = [
        ("info", vec!["info"]),
        ("map", vec!["map"]),
        ("check", vec!["check"]),
        ("convert", vec!["convert", "-O", "raw"]),
        ("io -r", vec!["io", "-r", "-c", "read -P 0xaa 0 4k"]),
        ("snapshot -l", vec!["snapshot", "-l"]),
    ];
    for (what, args) in &readers {
        let mut a = args.clone();
        a.push(s(&img));
        if *what == "convert" {
            a.push(s(&raw));
        }
        assert_refused(what, &qcow2(&a), SHARED_WRITE_LOCK, &img);
        assert!(!raw.exists(), "{what}: convert created its output");
        // -U, as qemu-img: no lock that keeps the writer out, so it gets in.
        a.insert(1, "-U");
        assert_ok(&format!("{what} -U"), &qcow2(&a));
        let _ = std::fs::remove_file(&raw);
    }
    let out = qcow2(&["check", "-U", "-r", "all", s(&img)]);
    assert_eq!(out.status.code(), Some(1), "check -U -r: {out:?}");
    let out = qcow2(&["io", "-U", "-c", "write 0 4k", s(&img)]);
    assert_eq!(out.status.code(), Some(1), "io -U write: {out:?}");
    assert!(
        text(&out.stderr).contains("force-share=on can only be used with read-only images"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&img).unwrap(), before, "the image changed");

    holder.close();
    assert_ok(
        "qcow2 io write after qemu-io exited",
        &qcow2(&["io", "-c", "write -P 0x55 0 4k", s(&img)]),
    );
    qemu_io(&img, &["read -P 0x55 0 4k", "read -P 0xaa 4k 60k"]);
    qemu_img(&["check", s(&img)]);
}

/// `qcow2 io` holds the image for writing: qemu-io's writer and qemu-img's readers are
/// refused (qemu-img create too), `-U` readers get in; once it exits QEMU writes again.
#[test]
fn tool_writer_keeps_qemu_out() {
    let d = tempfile::tempdir().unwrap();
    let img = image(d.path(), "a.qcow2");
    // (Written first as well: the holder is seen locking at its open, maybe before its own
    // write of the same bytes ran.)
    assert_ok(
        "qcow2 io write",
        &qcow2(&["io", "-c", "write -P 0x55 0 4k", s(&img)]),
    );
    let holder = our_holder(&img, &[], &["write -P 0x55 0 4k", "flush"], WRITER_BYTE);

    let out = output(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write 0 4k", s(&img)]));
    assert_refused("qemu-io write", &out, WRITE_LOCK, &img);
    let out = output(Command::new("qemu-img").args(["info", s(&img)]));
    assert_refused("qemu-img info", &out, SHARED_WRITE_LOCK, &img);
    let out = output(Command::new("qemu-img").args(["create", "-f", "qcow2", s(&img), "1M"]));
    assert_refused("qemu-img create", &out, WRITE_LOCK, &img);
    // Our second writer is refused as QEMU's is.
    let out = qcow2(&["io", "-c", "write 0 4k", s(&img)]);
    assert_refused("second qcow2 io", &out, WRITE_LOCK, &img);
    qemu_img(&["info", "-U", s(&img)]);
    let out = output(Command::new("qemu-io").args([
        "-U",
        "-r",
        "-f",
        "qcow2",
        "-c",
        "read -P 0x55 0 4k",
        s(&img),
    ]));
    assert_ok("qemu-io -U -r", &out);

    stop(holder, &img);
    qemu_io(&img, &["write -P 0x66 0 4k", "read -P 0xaa 4k 60k"]);
    qemu_img(&["check", s(&img)]);

    // A normal exit releases the locks before the process is gone: QEMU gets in at once.
    let mut holder = our_holder_for(&img, &[], &["write -P 0x77 0 4k"], WRITER_BYTE, 300);
    let st = holder.wait().expect("wait our holder");
    assert!(st.success(), "qcow2 io: {st}");
    qemu_io(&img, &["read -P 0x77 0 4k", "write -P 0x66 0 4k"]);
}

/// Readers coexist both ways; a reader keeps writers out both ways.
#[test]
fn readers_coexist_and_keep_writers_out() {
    let d = tempfile::tempdir().unwrap();
    let img = image(d.path(), "a.qcow2");

    let holder = QemuHolder::open(&img, true);
    assert_ok("qcow2 info beside qemu-io -r", &qcow2(&["info", s(&img)]));
    assert_ok(
        "qcow2 io read beside qemu-io -r",
        &qcow2(&["io", "-c", "read -P 0xaa 0 4k", s(&img)]),
    );
    let out = qcow2(&["io", "-c", "write 0 4k", s(&img)]);
    assert_refused("qcow2 io write beside qemu-io -r", &out, WRITE_LOCK, &img);
    holder.close();

    // Reads only: `qcow2 io` opens read-only.
    let holder = our_holder(&img, &[], &["read -P 0xaa 0 4k"], READER_BYTE);
    qemu_img(&["info", s(&img)]);
    let out = output(Command::new("qemu-io").args([
        "-r",
        "-f",
        "qcow2",
        "-c",
        "read -P 0xaa 0 4k",
        s(&img),
    ]));
    assert_ok("qemu-io -r beside qcow2 io read", &out);
    let out = output(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write 0 4k", s(&img)]));
    assert_refused("qemu-io write beside qcow2 io read", &out, WRITE_LOCK, &img);
    stop(holder, &img);
}

/// Backing files are opened read-only and shared: QEMU may read them but not write them
/// while our writer has the overlay open, and a backing file QEMU writes keeps us out.
#[test]
fn backing_files_are_locked_as_shared_readers() {
    let d = tempfile::tempdir().unwrap();
    let base = image(d.path(), "base.qcow2");
    let top = d.path().join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        s(&base),
        "-F",
        "qcow2",
        s(&top),
    ]);

    // Written before the holder starts too: the holder is seen locking at its open, maybe
    // before its own write ran, and may be killed then. (Its write, of the same bytes in
    // place, is what makes it a writer.)
    assert_ok(
        "qcow2 io write into the overlay",
        &qcow2(&["io", "--allow-backing", "-c", "write -P 0x55 0 4k", s(&top)]),
    );
    let mut holder = our_holder(
        &top,
        &["--allow-backing"],
        &["write -P 0x55 0 4k", "flush"],
        WRITER_BYTE,
    );
    // The backing file is opened after the overlay's locks are seen.
    wait_locked(&base, READER_BYTE, &mut holder);
    assert!(
        !byte_locked(&base, WRITER_BYTE),
        "backing file locked for writing"
    );
    qemu_img(&["info", s(&base)]);
    let out = output(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write 0 4k", s(&base)]));
    assert_refused("qemu-io write to the backing file", &out, WRITE_LOCK, &base);
    stop(holder, &top);
    wait_unlocked(&base);

    let holder = QemuHolder::open(&base, false);
    let out = qcow2(&["io", "--allow-backing", "-c", "write 0 4k", s(&top)]);
    assert_refused(
        "qcow2 io over a backing file in use",
        &out,
        SHARED_WRITE_LOCK,
        &base,
    );
    let out = qcow2(&[
        "io",
        "-U",
        "--allow-backing",
        "-c",
        "read -P 0x55 0 4k",
        "-c",
        "read -P 0xaa 4k 60k",
        s(&top),
    ]);
    assert_ok("qcow2 io -U over a backing file in use", &out);
    holder.close();
}

/// Creating over (or converting into) an image QEMU has open is refused before the file
/// is truncated, as qemu-img create is.
#[test]
fn create_and_convert_leave_an_image_in_use_alone() {
    let d = tempfile::tempdir().unwrap();
    let img = image(d.path(), "a.qcow2");
    let src = image(d.path(), "src.qcow2");
    let before = std::fs::read(&img).unwrap();
    let holder = QemuHolder::open(&img, true);

    let out = qcow2(&["create", "-f", "qcow2", s(&img), "1M"]);
    assert_refused("qcow2 create", &out, WRITE_LOCK, &img);
    let want = format!("qcow2: {}: {WRITE_LOCK}", img.display());
    assert!(text(&out.stderr).contains(&want), "{}", text(&out.stderr));
    for fmt in ["raw", "qcow2"] {
        let out = qcow2(&["convert", "-O", fmt, s(&src), s(&img)]);
        assert_refused(&format!("qcow2 convert -O {fmt}"), &out, WRITE_LOCK, &img);
    }
    assert_eq!(std::fs::read(&img).unwrap(), before, "the image changed");
    holder.close();
    assert_ok(
        "qcow2 create once qemu-io exited",
        &qcow2(&["create", "-f", "qcow2", s(&img), "1M"]),
    );
}

/// The library API: an image opened writable holds its locks until the `Opened` is
/// dropped (a normal close), then QEMU writes again.
#[test]
fn library_open_holds_locks_until_dropped() {
    use qcow2_tool::host::{open_chain, Format, OpenSpec};
    let d = tempfile::tempdir().unwrap();
    let img = image(d.path(), "a.qcow2");
    let spec = OpenSpec {
        keys: Default::default(),
        path: img.clone(),
        format: Format::Qcow2,
        allow_backing: false,
        writable: true,
        opts: qcow2_engine::OpenOptions::default(),
        queue_depth: 8,
        direct: false,
        force_share: false,
    };
    let opened = open_chain(&spec).expect("open writable");
    let qemu_write = || {
        output(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0x77 0 4k", s(&img)]))
    };
    assert_refused(
        "qemu-io write beside open_chain",
        &qemu_write(),
        WRITE_LOCK,
        &img,
    );
    // A second open in this process is another open file description: refused too.
    match open_chain(&spec) {
        Err(e) => assert!(e.to_string().contains(WRITE_LOCK), "{e}"),
        Ok(_) => panic!("a second writable open got in"),
    }
    drop(opened);
    assert_ok("qemu-io write after drop", &qemu_write());
    qemu_io(&img, &["read -P 0x77 0 4k"]);
}
