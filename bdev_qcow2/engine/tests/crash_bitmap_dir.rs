//! Crash tests of adding and removing persistent bitmaps (`image::owner::bitmap_dir`): in
//! every crash state of a session that adds bitmaps, writes, and removes bitmaps (QEMU's
//! and its own, down to none), `qemu-img check` finds no corruption (leaks allowed), the
//! header names a directory that parses (or none), and a bitmap not `in_use` is one of
//! those QEMU made, as it made it. After the close: clean, no leak.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

#[allow(dead_code)] // new_image is for the other crash tests
mod crash_common;
use crash_common::open;
use crash_common::states::{for_each_crash_state, qemu_accepts, qemu_clean, say_states};
mod mem_chain;
use mem_chain::bitmaps_of;

use qcow2_engine::format::ImageHeader;
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer};
use std::process::Command;
use std::rc::Rc;

type Step = Box<dyn Fn(&Exec<MemDevice>, &Rc<Chain<MemDevice>>)>;

fn add(name: &'static str, g: Option<u32>, enabled: bool) -> Step {
    Box::new(move |exec, chain| {
        let c = chain.clone();
        exec.block_on(async move {
            let Some(Layer::Qcow2(q)) = c.layers().first() else {
                panic!("a qcow2 layer")
            };
            q.add_bitmap(name, g, enabled).await
        })
        .unwrap();
    })
}

fn remove(name: &'static str) -> Step {
    Box::new(move |exec, chain| {
        let c = chain.clone();
        exec.block_on(async move {
            let Some(Layer::Qcow2(q)) = c.layers().first() else {
                panic!("a qcow2 layer")
            };
            q.remove_bitmap(name).await
        })
        .unwrap();
    })
}

fn write(off: u64, len: usize) -> Step {
    Box::new(move |exec, chain| {
        let buf = HeapBuf::new(len);
        buf.copy_in(0, &vec![0x5a; len]);
        let c = chain.clone();
        exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })
            .unwrap();
    })
}

/// The bitmaps the header of `img` names: `None` without the extension.
fn bitmaps(img: &[u8], size: u64) -> Option<Vec<(String, bool, Vec<bool>)>> {
    let h = ImageHeader::decode(&img[..65536], img.len() as u64).unwrap();
    h.extensions.bitmaps.as_ref()?;
    Some(bitmaps_of(img, size))
}

/// Runs `steps` on `initial` under the recorder, closes, and checks every crash state;
/// returns the image after the close.
fn session(what: &str, initial: &[u8], size: u64, steps: Vec<Step>) -> Vec<u8> {
    let before = bitmaps(initial, size).unwrap_or_default();
    let exec = Exec::new();
    let dev = MemDevice::new(initial.to_vec());
    dev.0.borrow_mut().record = true;
    let chain = open(&exec, &dev, true).unwrap();
    for s in &steps {
        s(&exec, &chain);
    }
    let c = chain.clone();
    exec.block_on(async move { c.close().await }).unwrap();
    let log = dev.0.borrow().log.clone();
    let n = for_each_crash_state(initial, &log, 3, 0xad0, |label, img| {
        qemu_accepts(label, &img);
        for (name, in_use, bits) in bitmaps(&img, size).into_iter().flatten() {
            if in_use {
                continue;
            }
            // Consistent: only one QEMU made, unchanged (the session's own are in use
            // until the close, which is not in these states for the bits they hold).
            let was = before.iter().find(|b| b.0 == name);
            if let Some((_, _, old)) = was {
                assert!(
                    bits.iter().zip(old).all(|(a, b)| *a || !*b),
                    "crash state {label}: bitmap {name} lost bits"
                );
            }
        }
    });
    say_states(what, n);
    let out = dev.contents();
    qemu_clean(&format!("{what}: after the close"), &out);
    out
}

#[test]
fn adding_and_removing_bitmaps_survives_any_crash() {
    let size = 8u64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bitmaps.qcow2");
    let p = path.to_str().unwrap();
    let sh = |prog: &str, args: &[&str]| {
        let out = Command::new(prog).args(args).output().unwrap();
        assert!(out.status.success(), "{prog} {args:?}: {out:?}");
    };
    sh("qemu-img", &["create", "-q", "-f", "qcow2", p, "8M"]);
    sh("qemu-img", &["bitmap", "--add", "-g", "512", p, "old"]);
    sh("qemu-io", &["-f", "qcow2", "-c", "write -P 3 1M 3M", p]);
    sh("qemu-img", &["bitmap", "--add", p, "keep"]);
    let initial = std::fs::read(&path).unwrap();
    let after = session(
        "bitmaps added and removed",
        &initial,
        size,
        vec![
            add("new", None, true),
            write(5 << 20, 70_144),
            add("off", Some(4096), false),
            remove("old"),
            write(0, 4096),
            remove("off"),
        ],
    );
    let names: Vec<String> = bitmaps(&after, size)
        .unwrap()
        .into_iter()
        .map(|b| {
            assert!(!b.1, "{} in use after the close", b.0);
            b.0
        })
        .collect();
    assert_eq!(names, ["keep", "new"]);
    // Down to none: the extension and the autoclear bit go.
    let none = session(
        "the last bitmaps removed",
        &after,
        size,
        vec![remove("keep"), remove("new")],
    );
    let h = ImageHeader::decode(&none[..65536], none.len() as u64).unwrap();
    assert!(h.extensions.bitmaps.is_none());
    assert_eq!(h.header.autoclear_features & 1, 0);
}
