//! Fuzzing harnesses, shared by the cargo-fuzz targets in `fuzz/` and by the regression
//! tests that replay what they found (`tests/fuzz_regressions.rs`).
//!
//! Each harness takes arbitrary bytes and must return normally: every engine call ends in
//! `Ok` or `Err`, never a panic, a hang or an unbounded allocation (ARCHITECTURE.md §9). Sizes are
//! bounded here so the fuzzer explores the engine, not the allocator.

use crate::check::{check, Repair};
use crate::exec::Exec;
use crate::format::bitmaps;
use crate::format::entries::{L1Entry, L2Context, L2Entry, SubclusterBitmap};
use crate::format::refcount::{
    entries_per_block, get_refcount, max_refcount, refcount_block_offset, set_refcount,
};
use crate::format::snapshot::decode_snapshots;
use crate::format::ImageHeader;
use crate::io::{BufSlice, HeapBuf};
use crate::limits::{MAX_CLUSTER_BITS, MIN_CLUSTER_BITS, MIN_CLUSTER_BITS_EXTENDED_L2};
use crate::testing::MemDevice;
use crate::{Chain, Layer, OpenOptions, Qcow2};
use std::rc::Rc;

/// Largest image the [`image_ops`] harness accepts (the rest of the input is ignored).
pub const MAX_IMAGE_BYTES: usize = 4 << 20;
/// Most operations in one [`image_ops`] script.
pub const MAX_OPS: usize = 15;
/// Bytes of one encoded operation.
pub const OP_BYTES: usize = 6;
/// Largest guest request of one operation.
pub const MAX_IO_BYTES: u64 = 256 << 10;

/// One operation of an [`image_ops`] script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Close whatever is open and open read-only.
    OpenRo,
    /// Close whatever is open and open writable.
    OpenRw,
    /// Guest read.
    Read {
        /// Position selector (see [`image_ops`]).
        at: u16,
        /// Length selector.
        len: u16,
    },
    /// Guest write of `pattern` bytes.
    Write {
        /// Position selector.
        at: u16,
        /// Length selector.
        len: u16,
        /// Byte written.
        pattern: u8,
    },
    /// Discard.
    Discard {
        /// Position selector.
        at: u16,
        /// Length selector.
        len: u16,
    },
    /// Write zeroes.
    WriteZeroes {
        /// Position selector.
        at: u16,
        /// Length selector.
        len: u16,
        /// May deallocate.
        unmap: bool,
    },
    /// Guest flush.
    Flush,
    /// Close (flushing a writable image) and open again the same way.
    Reopen,
    /// Close, run `check` with a repair mode, open again the same way.
    Check(Repair),
    /// Close.
    Close,
}

impl Op {
    /// Decodes one operation from [`OP_BYTES`] bytes: kind, two big-endian `u16`
    /// selectors and a parameter byte.
    pub fn decode(b: &[u8; OP_BYTES]) -> Op {
        let at = u16::from_be_bytes([b[1], b[2]]);
        let len = u16::from_be_bytes([b[3], b[4]]);
        let p = b[5];
        match b[0] % 10 {
            0 => Op::OpenRo,
            1 => Op::OpenRw,
            2 => Op::Read { at, len },
            3 => Op::Write {
                at,
                len,
                pattern: p,
            },
            4 => Op::Discard { at, len },
            5 => Op::WriteZeroes {
                at,
                len,
                unmap: p & 1 != 0,
            },
            6 => Op::Flush,
            7 => Op::Reopen,
            8 => Op::Check(match p % 3 {
                0 => Repair::None,
                1 => Repair::Leaks,
                _ => Repair::All,
            }),
            _ => Op::Close,
        }
    }

    /// The inverse of [`decode`](Self::decode) (for building seeds and regression inputs).
    pub fn encode(&self) -> [u8; OP_BYTES] {
        let (kind, at, len, p) = match *self {
            Op::OpenRo => (0, 0, 0, 0),
            Op::OpenRw => (1, 0, 0, 0),
            Op::Read { at, len } => (2, at, len, 0),
            Op::Write { at, len, pattern } => (3, at, len, pattern),
            Op::Discard { at, len } => (4, at, len, 0),
            Op::WriteZeroes { at, len, unmap } => (5, at, len, u8::from(unmap)),
            Op::Flush => (6, 0, 0, 0),
            Op::Reopen => (7, 0, 0, 0),
            Op::Check(r) => (
                8,
                0,
                0,
                match r {
                    Repair::None => 0,
                    Repair::Leaks => 1,
                    Repair::All => 2,
                },
            ),
            Op::Close => (9, 0, 0, 0),
        };
        let [a0, a1] = u16::to_be_bytes(at);
        let [l0, l1] = u16::to_be_bytes(len);
        [kind, a0, a1, l0, l1, p]
    }
}

/// Builds an [`image_ops`] input: configuration byte, whether to start writable, the
/// script and the image.
pub fn image_ops_input(config: u8, writable: bool, ops: &[Op], image: &[u8]) -> Vec<u8> {
    let n = ops.len().min(MAX_OPS);
    let mut out = vec![config, n as u8 | if writable { 0x80 } else { 0 }];
    for op in &ops[..n] {
        out.extend_from_slice(&op.encode());
    }
    out.extend_from_slice(image);
    out
}

/// The open image, as a one- or two-layer chain on its own executor.
struct Open {
    exec: Exec<MemDevice>,
    chain: Rc<Chain<MemDevice>>,
    writable: bool,
}

/// Opens the image on `mem` like a host does. When the image names a backing file, the
/// backing layer is the original input opened read-only (or raw bytes if that is refused):
/// hostile metadata on both layers at once.
fn open(mem: &MemDevice, orig: &[u8], opts: OpenOptions, backing: bool) -> Option<Open> {
    let exec: Exec<MemDevice> = Exec::new();
    let dev = exec.add_device(mem.clone());
    let e = exec.clone();
    let q = exec
        .block_on(async move { Qcow2::open(&e, dev, opts).await })
        .ok()?;
    let mut layers = Vec::with_capacity(2);
    let wants_backing = backing && q.header().backing_file.is_some();
    layers.push(Layer::Qcow2(Box::new(q)));
    if wants_backing {
        let bdev = exec.add_device(MemDevice::new(orig.to_vec()));
        let e = exec.clone();
        let ro = OpenOptions {
            writable: false,
            ..opts
        };
        match exec.block_on(async move { Qcow2::open(&e, bdev, ro).await }) {
            Ok(b) => layers.push(Layer::Qcow2(Box::new(b))),
            Err(_) => layers.push(Layer::Raw {
                dev: bdev,
                size: orig.len() as u64,
            }),
        }
    }
    let chain = Chain::new(&exec, layers).ok()?;
    Some(Open {
        exec,
        chain,
        writable: opts.writable,
    })
}

/// Closes `o` (a writable chain is flushed and its dirty bit cleared; errors ignored).
fn close(o: Open) {
    if o.writable {
        let c = o.chain.clone();
        let _ = o.exec.block_on(async move { c.close().await });
    }
}

/// Guest range selected by `at` and `len` on a disk of `size` bytes: sector-aligned (unless
/// the top bit of `len` asks for a misaligned request) and at most [`MAX_IO_BYTES`]. Small
/// disks are addressed sector by sector, big ones proportionally.
fn range(size: u64, at: u16, len: u16) -> (u64, u64) {
    let sectors = size / 512;
    let off = if sectors == 0 {
        0
    } else if sectors <= 1 << 16 {
        (u64::from(at) % sectors) * 512
    } else {
        (((u128::from(at) * u128::from(sectors)) >> 16) as u64) * 512
    };
    let want = u64::from(len & 0x7fff) % (MAX_IO_BYTES / 512 + 1) * 512;
    let n = want.min(size.saturating_sub(off) / 512 * 512);
    if len & 0x8000 != 0 {
        (off + 1, n)
    } else {
        (off, n)
    }
}

/// Runs an image plus a script of operations through the engine on an in-memory device.
///
/// Input: a configuration byte (bits 0–1 the L2 cache size: default, 4 KiB, 64 KiB,
/// 1 MiB; bits 2–3 the L2 slice size: 512 B, 4 KiB, 64 KiB, 2 MiB; bits 4–5 the cache ways:
/// 1, 2, 4, 8; bit 6 a small refcount cache; bit 7 a backing layer when the image names
/// one), a byte whose low four bits count the operations (at most [`MAX_OPS`]), whose bit 6
/// puts the image on a fixed-size device (4 MiB of room past it, like a bdev) with the
/// ordered layout (`OpenOptions::ordered_layout`), whose bit 5 turns off taking clusters
/// ahead (`OpenOptions::alloc_granule`), and whose top bit opens writable, the
/// operations ([`OP_BYTES`] each, see [`Op::decode`]), then the image (at most
/// [`MAX_IMAGE_BYTES`]). The image is opened first; operations that need an open image are
/// skipped while none is.
pub fn image_ops(data: &[u8]) {
    let [config, count, rest @ ..] = data else {
        return;
    };
    let n = usize::from(count & 0x0f).min(MAX_OPS);
    if rest.len() < n * OP_BYTES {
        return;
    }
    let (script, image) = rest.split_at(n * OP_BYTES);
    let image = &image[..image.len().min(MAX_IMAGE_BYTES)];
    let mut opts = OpenOptions {
        l2_cache_bytes: [None, Some(4 << 10), Some(64 << 10), Some(1 << 20)]
            [usize::from(config & 3)],
        l2_slice_bytes: [512, 4 << 10, 64 << 10, 2 << 20][usize::from((config >> 2) & 3)],
        cache_ways: 1 << ((config >> 4) & 3),
        refcount_cache_bytes: if config & 0x40 != 0 { 512 } else { 256 << 10 },
        writable: count & 0x80 != 0,
        ordered_layout: count & 0x40 != 0,
        alloc_granule: if count & 0x20 != 0 {
            0
        } else {
            crate::image::DEFAULT_ALLOC_GRANULE
        },
        zero_ahead: count & 0x10 != 0,
        ..OpenOptions::default()
    };
    let backing = config & 0x80 != 0;
    let mem = if opts.ordered_layout {
        MemDevice::fixed(image.to_vec(), image.len() + (4 << 20))
    } else {
        MemDevice::new(image.to_vec())
    };
    let mut cur = open(&mem, image, opts, backing);
    for chunk in script.chunks_exact(OP_BYTES) {
        let mut b = [0u8; OP_BYTES];
        b.copy_from_slice(chunk);
        let op = Op::decode(&b);
        match op {
            Op::OpenRo | Op::OpenRw | Op::Reopen => {
                if let Some(o) = cur.take() {
                    close(o);
                }
                match op {
                    Op::OpenRo => opts.writable = false,
                    Op::OpenRw => opts.writable = true,
                    _ => {}
                }
                cur = open(&mem, image, opts, backing);
            }
            Op::Close => {
                if let Some(o) = cur.take() {
                    close(o);
                }
            }
            Op::Check(repair) => {
                if let Some(o) = cur.take() {
                    close(o);
                }
                let exec: Exec<MemDevice> = Exec::new();
                let dev = exec.add_device(mem.clone());
                let e = exec.clone();
                let _ = exec.block_on(async move { check(&e, dev, repair).await });
                cur = open(&mem, image, opts, backing);
            }
            Op::Flush => {
                if let Some(o) = &cur {
                    let c = o.chain.clone();
                    let _ = o.exec.block_on(async move { c.flush().await });
                }
            }
            Op::Read { at, len }
            | Op::Write { at, len, .. }
            | Op::Discard { at, len }
            | Op::WriteZeroes { at, len, .. } => {
                let Some(o) = &cur else { continue };
                let (off, n) = range(o.chain.size(), at, len);
                let c = o.chain.clone();
                let _ = match op {
                    Op::Read { .. } => {
                        let buf = HeapBuf::new(n as usize);
                        o.exec
                            .block_on(async move { c.read(off, BufSlice::whole(buf)).await })
                    }
                    Op::Write { pattern, .. } => {
                        let buf = HeapBuf::new(n as usize);
                        buf.0.borrow_mut().fill(pattern);
                        o.exec
                            .block_on(async move { c.write(off, BufSlice::whole(buf)).await })
                    }
                    Op::Discard { .. } => o.exec.block_on(async move { c.discard(off, n).await }),
                    Op::WriteZeroes { unmap, .. } => o
                        .exec
                        .block_on(async move { c.write_zeroes(off, n, unmap).await }),
                    _ => Ok(()),
                };
            }
        }
    }
    if let Some(o) = cur.take() {
        close(o);
    }
}

/// Reads a big-endian `u64` at `off`, zero-padded past the end of `data`.
fn word(data: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in b.iter_mut().enumerate() {
        *x = data.get(off + i).copied().unwrap_or(0);
    }
    u64::from_be_bytes(b)
}

/// Runs the on-disk decoders alone on arbitrary bytes: header (and, when it decodes, its
/// encoding and geometry), snapshot table, L1/L2/refcount-table entries, refcount blocks
/// of every width (a stored value must read back; one too wide must be refused), bitmap
/// directories and table entries.
///
/// Input: a selector byte, 16 bytes of parameters, then the bytes to decode.
pub fn parse(data: &[u8]) {
    let [sel, rest @ ..] = data else {
        return;
    };
    let p0 = word(rest, 0);
    let p1 = word(rest, 8);
    let body = rest.get(16..).unwrap_or(&[]);
    let cluster_bits =
        MIN_CLUSTER_BITS + (p0 as u32 & 0x1f) % (MAX_CLUSTER_BITS - MIN_CLUSTER_BITS + 1);
    let cs = 1u64 << cluster_bits;
    // Device sizes near the buffer, near a cluster multiple, or anything.
    let device_size = match (p0 >> 8) & 3 {
        0 => body.len() as u64,
        1 => (body.len() as u64).saturating_add(p1 & 0xff_ffff),
        2 => (p1 & 0xffff) << cluster_bits,
        _ => p1,
    };
    match sel % 5 {
        0 => {
            if let Ok(h) = ImageHeader::decode(body, device_size) {
                let _ = h.geometry(9 + (p0 >> 16) as u32 % 13);
                let _ = h.cluster_size();
                let _ = h.refcount_bits();
                if let Ok(enc) = h.encode() {
                    let _ = ImageHeader::decode(&enc, device_size);
                }
            }
        }
        1 => {
            let nb = (p0 >> 32) as u32;
            let _ = decode_snapshots(body, nb, cs, device_size);
        }
        2 => {
            let extended_l2 = p0 & 0x400 != 0 && cluster_bits >= MIN_CLUSTER_BITS_EXTENDED_L2;
            let ctx = L2Context {
                cluster_bits,
                v3: p0 & 0x800 != 0,
                extended_l2,
                device_size,
            };
            // Extended L2 entries are 16 bytes (entry, subcluster bitmap); others 8.
            let stride = if extended_l2 { 16 } else { 8 };
            for (i, c) in body.chunks(stride).take(8192).enumerate() {
                let e = word(c, 0);
                let bitmap = word(c, 8);
                let _ = L1Entry(e).l2_table(cs, device_size);
                let _ = refcount_block_offset(e, cs, device_size);
                let l2 = L2Entry(e);
                let _ = l2.compressed(cluster_bits, device_size);
                if extended_l2 {
                    let _ = l2.subcluster_mapping(SubclusterBitmap(bitmap), i as u64 % 32, &ctx);
                } else {
                    let _ = l2.mapping(&ctx);
                }
            }
        }
        4 => {
            // A bitmap directory of `nb` entries for a disk of `device_size` bytes: what
            // parses takes its `in_use` flag and a new table and still parses (the flag
            // only relaxes the constraints); every table word is judged.
            let nb = (p0 >> 32) as u32;
            if let Ok(entries) = bitmaps::parse_directory(body, nb, cs, device_size) {
                let mut dir = body.to_vec();
                for e in &entries {
                    bitmaps::set_flags(&mut dir, e, e.flags | bitmaps::FLAG_IN_USE);
                    bitmaps::set_table(&mut dir, e, e.table_offset, e.table_size);
                }
                let again = bitmaps::parse_directory(&dir, nb, cs, device_size);
                assert!(again.is_ok(), "a directory marked in use no longer parses");
            }
            for w in body.chunks(8) {
                let _ = bitmaps::table_entry_ok(word(w, 0), cs);
            }
        }
        _ => {
            // Refcount blocks of small clusters keep each input cheap.
            let bits = MIN_CLUSTER_BITS + (p0 as u32 & 3);
            let order = (p0 >> 2) as u32 % 7;
            let mut block = vec![0u8; 1 << bits];
            let n = body.len().min(block.len());
            block[..n].copy_from_slice(&body[..n]);
            let per_block = entries_per_block(bits, order);
            let max = max_refcount(order);
            for (i, c) in body.chunks(10).take(1024).enumerate() {
                let index = u64::from(u16::from_be_bytes([
                    c.first().copied().unwrap_or(0),
                    c.get(1).copied().unwrap_or(i as u8),
                ])) % per_block;
                let value = word(c, 2);
                let _ = get_refcount(&block, order, index);
                let r = set_refcount(&mut block, order, index, value);
                if value > max {
                    assert!(r.is_err(), "a refcount wider than the entry was stored");
                } else {
                    assert!(r.is_ok(), "a refcount that fits was refused");
                    assert_eq!(get_refcount(&block, order, index), value, "refcount lost");
                }
            }
        }
    }
}

/// Most PBKDF2 iterations the `luks` harness spends on one input's unlock (the decoder's
/// own limits allow minutes: a fuzzer must not wait for them).
pub const LUKS_FUZZ_ITERATIONS: u64 = 1 << 12;

/// Runs the LUKS header decoder on arbitrary bytes (a LUKS area: header and key material);
/// what decodes with few PBKDF2 iterations is also unlocked with a fixed secret, which must
/// end in a cipher or `WrongKey`, never a panic.
///
/// Input: the area's bytes.
pub fn luks(data: &[u8]) {
    let Ok(h) = crate::crypto::LuksHeader::parse(data) else {
        return;
    };
    let cost: u64 = u64::from(h.mk_iterations)
        + h.slots
            .iter()
            .filter(|s| s.active)
            .map(|s| u64::from(s.iterations))
            .sum::<u64>();
    if cost <= LUKS_FUZZ_ITERATIONS {
        let _ = h.unlock(data, b"fuzz");
    }
}
