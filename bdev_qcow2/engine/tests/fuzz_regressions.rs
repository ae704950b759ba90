//! What the fuzzers (`fuzz/`, `fuzz/run.sh`) found, one test per finding, named after it,
//! with the (minimized) input embedded; plus the harnesses run on small inputs so a broken
//! harness shows up in `cargo test`, not only in a fuzzing session.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::check::Repair;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::format::{L2Context, L2Entry};
use qcow2_engine::fuzzing::{image_ops, image_ops_input, parse, Op};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::Exec;

/// A fresh image made by our own `create`.
fn created(opts: CreateOptions) -> Vec<u8> {
    let exec: Exec<MemDevice> = Exec::new();
    let mem = MemDevice::new(Vec::new());
    let dev = exec.add_device(mem.clone());
    let e = exec.clone();
    exec.block_on(async move { create(&e, dev, &opts).await })
        .expect("create");
    mem.contents()
}

/// Big-endian `u64`s.
fn be(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

// ---------------------------------------------------------------------------------------
// The harnesses themselves
// ---------------------------------------------------------------------------------------

#[test]
fn image_ops_harness_runs_every_operation_on_a_created_image() {
    let img = created(CreateOptions {
        size: 1 << 20,
        cluster_bits: 12,
        ..Default::default()
    });
    let ops = [
        Op::Write {
            at: 3,
            len: 17,
            pattern: 0xab,
        },
        Op::Discard { at: 0, len: 64 },
        Op::WriteZeroes {
            at: 40,
            len: 9,
            unmap: true,
        },
        Op::Flush,
        Op::Read { at: 0, len: 256 },
        Op::Reopen,
        Op::Check(Repair::All),
        Op::Close,
        Op::OpenRo,
        Op::Read {
            at: 0x8000,
            len: 0x8001,
        },
        Op::OpenRw,
        Op::Write {
            at: 0xffff,
            len: 0x7fff,
            pattern: 1,
        },
    ];
    for config in [0x00, 0x05, 0x7a, 0xff] {
        image_ops(&image_ops_input(config, true, &ops, &img));
    }
    for op in ops {
        let enc = op.encode();
        assert_eq!(Op::decode(&enc), op);
    }
}

#[test]
fn parse_harness_runs_every_decoder() {
    let img = created(CreateOptions {
        size: 1 << 20,
        cluster_bits: 12,
        ..Default::default()
    });
    let dev = img.len() as u64;
    for sel in 0..4u8 {
        let mut input = vec![sel];
        input.extend(be(&[(3 << 8) | 3, dev]));
        input.extend_from_slice(&img);
        parse(&input);
    }
}

// ---------------------------------------------------------------------------------------
// Findings
// ---------------------------------------------------------------------------------------

/// parse: a compressed L2 entry checked against a device of nearly 2^64 bytes overflowed
/// rounding the device size up to a sector (`attempt to multiply with overflow`; in release
/// builds every compressed cluster of such a device would have been refused).
#[test]
fn compressed_entry_on_a_device_near_u64_max_does_not_overflow() {
    // Selector 2 (entries), p0: cluster_bits 9, device size taken from p1; p1 = u64::MAX;
    // one L2 entry: compressed, data at offset 512, one sector.
    let entry = (1u64 << 62) | 0x200;
    let mut input = vec![2u8];
    input.extend(be(&[0x300, u64::MAX, entry]));
    parse(&input);

    let ctx = L2Context {
        cluster_bits: 9,
        v3: true,
        extended_l2: false,
        device_size: u64::MAX,
    };
    let d = L2Entry(entry)
        .compressed(9, u64::MAX)
        .expect("inside the device");
    assert_eq!((d.offset.0, d.len), (512, 512));
    assert!(L2Entry(entry).mapping(&ctx).is_ok());
}
