//! Crash states of first writes whose data a core replica writes itself (#48,
//! `write/reserve.rs`): the owner reserves the clusters, the core writes the data through its
//! own channel, the owner commits the L2 entries after that write completed.
//!
//! One device log records the writes of both channels. Some owner flushes (a full
//! write-back) run while a core's data write is on the device but not yet handed back: the
//! crash right after such a flush is the point between the replica's data write and the
//! owner's commit, where the image must pass `qemu-img check` (a leak allowed) and the
//! range must still read what it held before. Every other crash state (flush boundaries and
//! random subsets of the writes after them) must pass `qemu-img check`, and the final image
//! must read as the reference.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

#[allow(dead_code)] // the image openers of the one-chain crash tests
mod crash_common;
use crash_common::new_image;
use crash_common::states::{for_each_crash_state, qemu_accepts, replay_op, say_states};

use qcow2_engine::create::CreateOptions;
use qcow2_engine::exec::Outcome;
use qcow2_engine::format::ClusterMapping;
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, HeapBuf, IoBuffer};
use qcow2_engine::testing::{host, MemDevice, Rng};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, OwnerLink, Qcow2, Reserved};
use std::collections::VecDeque;
use std::rc::Rc;

/// One executor's channel to the logged device: its operations complete on its own polls.
struct Channel {
    dev: MemDevice,
    done: VecDeque<(u64, Result<(), DeviceError>)>,
}

impl Channel {
    fn new(dev: &MemDevice) -> Channel {
        Channel {
            dev: dev.clone(),
            done: VecDeque::new(),
        }
    }
}

impl BlockDevice for Channel {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        self.dev.submit(op, tag)?;
        // The device applied it at submission; its completion is this channel's alone.
        let done = &mut self.done;
        self.dev.poll(&mut |t, r| done.push_back((t, r)));
        Ok(())
    }
    fn can_grow(&self) -> bool {
        true
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        self.dev.ensure_size(size)
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let n = self.done.len();
        while let Some((t, r)) = self.done.pop_front() {
            done(t, r);
        }
        n
    }
}

/// The core asks for no slice here: it only writes reserved clusters.
struct NoLink;
impl OwnerLink for NoLink {
    fn ask_slice(&self, _key: u64, _ticket: u64) {
        panic!("the core asked for a slice");
    }
}

fn image(c: &Chain<Channel>) -> &Qcow2<Channel> {
    match &c.layers()[0] {
        Layer::Qcow2(q) => q,
        Layer::Raw { .. } => unreachable!(),
    }
}

/// Polls `exec` until `tag` is reported; its result.
fn wait(exec: &Exec<Channel>, tag: u64) -> qcow2_engine::Result<()> {
    for _ in 0..100_000 {
        let mut got = None;
        exec.poll_outcomes(&mut |t, o| {
            if t == tag {
                got = Some(match o {
                    Outcome::Done(r) => r,
                    Outcome::ToOwner => panic!("handed to the owner"),
                });
            }
        });
        if let Some(r) = got {
            return r;
        }
    }
    panic!("request {tag} never completed");
}

fn pattern(id: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (id as u8).wrapping_mul(31) ^ (i as u8) | 1)
        .collect()
}

/// Image bytes `img` opened read-only, as a chain of one layer.
fn open_ro(img: &[u8]) -> (Exec<MemDevice>, Rc<Chain<MemDevice>>) {
    let exec: Exec<MemDevice> = Exec::new();
    let id = exec.add_device(MemDevice::new(img.to_vec()));
    let e2 = exec.clone();
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
    (exec, chain)
}

/// Whether image bytes `img` map guest offset `off` to data.
fn maps_data(img: &[u8], off: u64) -> bool {
    let (exec, chain) = open_ro(img);
    let (m, _) = exec
        .block_on(async move { chain.block_status(0, off, off + 512).await })
        .unwrap();
    matches!(m, ClusterMapping::Data { .. })
}

/// Reads `len` bytes at `off` of image bytes `img`.
fn read_image(img: &[u8], off: u64, len: usize) -> Vec<u8> {
    let (exec, chain) = open_ro(img);
    let buf = HeapBuf::new(len);
    let b2 = buf.clone();
    exec.block_on(async move { chain.read(off, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

/// `ops` writes of a core (most of them first writes) into an empty image with
/// 2^`cluster_bits`-byte clusters, each handed to the owner without its data and written
/// by the core where the owner says; every third reserved one with a full write-back of
/// the owner between the core's data write and the commit. Returns the crash states
/// checked.
fn run(seed: u64, cluster_bits: u32, extended_l2: bool, ops: usize) -> usize {
    let size = 8u64 << 20;
    let copts = CreateOptions {
        size,
        cluster_bits,
        extended_l2,
        ..Default::default()
    };
    let initial = new_image(&copts);
    let dev = MemDevice::new(initial.clone());
    dev.0.borrow_mut().record = true;

    let owner_exec: Exec<Channel> = Exec::new();
    let oid = owner_exec.add_device(Channel::new(&dev));
    let e2 = owner_exec.clone();
    let oopts = OpenOptions {
        writable: true,
        l2_cache_bytes: Some(8 << 10),
        ..Default::default()
    };
    let mut q = owner_exec
        .block_on(async move { Qcow2::open(&e2, oid, oopts).await })
        .unwrap();
    q.share();
    let seed_core = q.core_seed().unwrap();
    let owner = Chain::new(&owner_exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
    let core_exec: Exec<Channel> = Exec::new();
    let cid = core_exec.add_device(Channel::new(&dev));
    let rq = Qcow2::from_seed(
        seed_core,
        &core_exec,
        cid,
        OpenOptions::default(),
        Box::new(NoLink),
    )
    .unwrap();
    let core = Chain::new(&core_exec, vec![Layer::Qcow2(Box::new(rq))]).unwrap();

    let mut rng = Rng(seed | 1);
    let mut reference = vec![0u8; size as usize];
    // Crash points between a core's data write and its commit: (log length, offset,
    // what the range read before the write).
    let mut between = Vec::new();
    let (mut by_core, mut tag) = (0, 0u64);
    for i in 0..ops {
        // With extended L2, whole subclusters (2 KiB): the guest's bytes alone.
        let unit = if extended_l2 { 4 } else { 1 };
        let sectors = unit * (1 + rng.below(8 / unit));
        let off = rng.below((size / 512 - sectors) / unit) * unit * 512;
        let len = (sectors * 512) as usize;
        let data = pattern(i as u64 + 1, len);
        let buf = HeapBuf::new(len);
        buf.copy_in(0, &data);
        tag += 1;
        match owner.reserve_write(off, len as u64) {
            Reserved::Write { ticket, host } => {
                by_core += 1;
                let entry = core_exec.guest_enter();
                core.write_reserved(tag, host, BufSlice::whole(buf), entry);
                if i % 3 == 0 {
                    // The crash point: the data is on the device, the entry not committed.
                    let c = owner.clone();
                    owner_exec.block_on(async move { c.flush().await }).unwrap();
                    let before = reference[off as usize..off as usize + len].to_vec();
                    between.push((dev.0.borrow().log.len(), off, before));
                }
                let written = wait(&core_exec, tag);
                tag += 1;
                owner.commit_reserved(ticket, tag, written);
                wait(&owner_exec, tag).unwrap();
            }
            Reserved::Data(ticket) => {
                owner.run_reserved(ticket, tag, BufSlice::whole(buf));
                wait(&owner_exec, tag).unwrap();
            }
            Reserved::InPlace { host } => {
                // An overwrite of a cluster an earlier write took.
                let entry = core_exec.guest_enter();
                core.write_reserved(tag, host, BufSlice::whole(buf), entry);
                wait(&core_exec, tag).unwrap();
            }
            Reserved::Send => {
                host::write(&owner, tag, off, BufSlice::whole(buf));
                wait(&owner_exec, tag).unwrap();
            }
        }
        reference[off as usize..off as usize + len].copy_from_slice(&data);
        if rng.below(8) == 0 {
            let c = owner.clone();
            owner_exec.block_on(async move { c.flush().await }).unwrap();
        }
    }
    assert!(
        by_core > ops / 4,
        "only {by_core} of {ops} first writes by the core"
    );
    assert_eq!(owner.reservations_held(), 0);
    let stats = image(&owner).owner_stats().unwrap();
    assert_eq!(stats.first_writes_by_cores, by_core as u64, "{stats:?}");
    let c = owner.clone();
    owner_exec.block_on(async move { c.close().await }).unwrap();
    let log = dev.0.borrow().log.clone();
    let fin = dev.contents();
    assert_eq!(
        read_image(&fin, 0, size as usize),
        reference,
        "the final image"
    );

    let replay = |upto: usize| {
        let mut img = initial.clone();
        log[..upto].iter().for_each(|e| replay_op(&mut img, e));
        img
    };
    assert!(!between.is_empty());
    for (p, off, before) in &between {
        let img = replay(*p);
        let label = format!("after the core's data write at {off:#x}, before its commit");
        qemu_accepts(&label, &img);
        assert_eq!(
            &read_image(&img, *off, before.len()),
            before,
            "{label}: the range reads something else than before the write"
        );
        // Reserved for a first write: nothing maps it before the commit.
        assert!(!maps_data(&img, *off), "{label}: mapped before the commit");
    }
    between.len() + for_each_crash_state(&initial, &log, 4, seed, |l, img| qemu_accepts(l, &img))
}

#[test]
fn crash_states_first_writes_written_by_a_core() {
    let mut n = 0;
    for seed in 1..=3u64 {
        n += run(seed * 0x9E37_79B9, 16, false, 60);
    }
    say_states("first writes written by a core, 64 KiB clusters", n);
}

#[test]
fn crash_states_first_writes_written_by_a_core_small_clusters() {
    let n = run(7, 12, false, 80);
    say_states("first writes written by a core, 4 KiB clusters", n);
}

#[test]
fn crash_states_first_writes_written_by_a_core_extended_l2() {
    let n = run(11, 16, true, 60);
    say_states("first writes written by a core, extended L2", n);
}
