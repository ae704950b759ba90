//! Cross-core coherency of the real engine (ARCHITECTURE.md §6), deterministic and
//! single-threaded: one metadata owner and two core replicas, each on its own [`Exec`] with
//! its own channel to one shared in-memory disk, driven by a seeded random interleaving of
//! guest requests, executor polls and owner↔core messages.
//!
//! Every read is checked per sector: it must return the data of the newest write completed
//! before the read was submitted, or of a write that overlapped the read in time. Writes
//! never overlap other writes in flight (so "newest" is well defined). The test device
//! completes operations out of order after a random latency, and applies reads and writes
//! at submission, at completion, or (writes) half at each, so a slice being written back
//! is torn on the device for a while.
//!
//! At the end the owner closes the image; `qemu-img check` must pass and `qemu-img compare`
//! must find it equal to the reference.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use qcow2_engine::coherency::SliceReply;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::exec::Outcome;
use qcow2_engine::format::ClusterMapping;
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, HeapBuf, IoBuffer};
use qcow2_engine::rng::Rng;
use qcow2_engine::testing::host;
use qcow2_engine::types::GuestOffset;
use qcow2_engine::{
    Chain, CoreSeed, Exec, Layer, OpenOptions, OwnerLink, Qcow2, ReadRoute, Reserved, Ticket,
    WriteRoute,
};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::process::Command;
use std::rc::Rc;

mod mem_chain;

const SECTOR: u64 = 512;
/// Tag bit of a core's data write into clusters the owner reserved (`Chain::reserve_write`).
const RESERVED: u64 = 1 << 40;

/// Device completions one channel reports per poll. More than one lets two completions of
/// one task's concurrent operations (a `join_all`) wake it twice in one `Exec::poll`: the
/// spurious wake-up that once made `AsyncLock` lose a wake-up (fixed in exec/wait.rs; this
/// test hung with 2 before the fix).
const COMPLETIONS_PER_POLL: usize = 4;

// ----- a disk shared by per-core channels ------------------------------------------------

/// What an operation still has to do to the disk when it completes.
enum Deferred {
    None,
    Read { offset: u64, buf: BufSlice<HeapBuf> },
    Write { offset: u64, bytes: Vec<u8> },
}

/// One core's channel to the shared disk: its own queue of operations in flight.
struct Channel {
    disk: Rc<RefCell<Vec<u8>>>,
    rng: Rc<RefCell<Rng>>,
    max_latency: u64,
    polls: u64,
    inflight: Vec<(u64, u64, Deferred)>,
}

fn disk_read(disk: &[u8], offset: u64, buf: &BufSlice<HeapBuf>) {
    let mut tmp = vec![0u8; buf.len];
    let size = disk.len() as u64;
    if offset < size {
        let n = (size - offset).min(buf.len as u64) as usize;
        tmp[..n].copy_from_slice(&disk[offset as usize..offset as usize + n]);
    }
    buf.copy_in(0, &tmp);
}

fn disk_write(disk: &mut Vec<u8>, offset: u64, bytes: &[u8]) {
    let end = offset as usize + bytes.len();
    if disk.len() < end {
        disk.resize(end, 0);
    }
    disk[offset as usize..end].copy_from_slice(bytes);
}

impl BlockDevice for Channel {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        self.disk.borrow().len() as u64
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        let mut rng = self.rng.borrow_mut();
        let mut disk = self.disk.borrow_mut();
        let deferred = match op {
            DeviceOp::Read { offset, buf } => {
                if rng.below(2) == 0 {
                    disk_read(&disk, offset, &buf);
                    Deferred::None
                } else {
                    Deferred::Read { offset, buf }
                }
            }
            DeviceOp::Write { offset, buf } => {
                let mut bytes = vec![0u8; buf.len];
                buf.copy_out(0, &mut bytes);
                match rng.below(3) {
                    0 => {
                        disk_write(&mut disk, offset, &bytes);
                        Deferred::None
                    }
                    1 => Deferred::Write { offset, bytes },
                    _ => {
                        // Torn while in flight: the first sectors now, the rest at completion.
                        let sectors = bytes.len() as u64 / SECTOR;
                        let cut = (rng.below(sectors + 1) * SECTOR) as usize;
                        disk_write(&mut disk, offset, &bytes[..cut]);
                        Deferred::Write {
                            offset: offset + cut as u64,
                            bytes: bytes[cut..].to_vec(),
                        }
                    }
                }
            }
            DeviceOp::WriteZeroes { offset, len } => Deferred::Write {
                offset,
                bytes: vec![0u8; len as usize],
            },
            // Discarded bytes read as anything: garbage (within the disk) at completion,
            // which a request still reading them through an old mapping would return.
            DeviceOp::Discard { offset, len } => {
                let end = (offset + len).min(disk.len() as u64);
                Deferred::Write {
                    offset,
                    bytes: vec![0xd5; end.saturating_sub(offset) as usize],
                }
            }
            DeviceOp::Flush => Deferred::None,
        };
        let due = self.polls + 1 + rng.below(self.max_latency + 1);
        self.inflight.push((due, tag, deferred));
        Ok(())
    }
    fn can_grow(&self) -> bool {
        true
    }
    fn discards(&self) -> bool {
        true
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        let mut d = self.disk.borrow_mut();
        if (d.len() as u64) < size {
            d.resize(size as usize, 0);
        }
        Ok(())
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        self.polls += 1;
        let now = self.polls;
        let mut n = 0;
        let mut i = 0;
        while i < self.inflight.len() {
            if self.inflight[i].0 > now {
                i += 1;
                continue;
            }
            let (_, tag, d) = self.inflight.remove(i);
            match d {
                Deferred::None => {}
                Deferred::Read { offset, buf } => disk_read(&self.disk.borrow(), offset, &buf),
                Deferred::Write { offset, bytes } => {
                    disk_write(&mut self.disk.borrow_mut(), offset, &bytes)
                }
            }
            n += 1;
            done(tag, Ok(()));
            if n == COMPLETIONS_PER_POLL {
                break;
            }
        }
        n
    }
}

// ----- owner + cores ------------------------------------------------------------------

type Asks = Rc<RefCell<VecDeque<(u64, u64, usize)>>>;

/// A core's link to the owner: requests queue up until the test loop delivers them.
struct Link {
    core: usize,
    asks: Asks,
}

impl OwnerLink for Link {
    fn ask_slice(&self, key: u64, ticket: u64) {
        self.asks.borrow_mut().push_back((key, ticket, self.core));
    }
}

struct Rig {
    disk: Rc<RefCell<Vec<u8>>>,
    /// Executor 0 is the owner's, 1.. the cores'.
    execs: Vec<Exec<Channel>>,
    chains: Vec<Rc<Chain<Channel>>>,
    asks: Asks,
    /// Owner answers on their way to each core (index = executor index).
    inbox: Vec<VecDeque<(u64, SliceReply)>>,
    /// Guest completions reported by the polls: (tag, ok).
    done: Vec<(u64, Result<(), String>)>,
    size: u64,
    /// The devices' latency draws (a core added later shares them).
    rng: Rc<RefCell<Rng>>,
}

fn image(q: &Chain<Channel>) -> &Qcow2<Channel> {
    match &q.layers()[0] {
        Layer::Qcow2(q) => q,
        Layer::Raw { .. } => unreachable!(),
    }
}

impl Rig {
    fn new(seed: u64, cores: usize, lazy: bool, max_latency: u64) -> Rig {
        Rig::with_granule(
            seed,
            cores,
            lazy,
            max_latency,
            OpenOptions::default().alloc_granule,
        )
    }

    /// A rig whose owner takes `alloc_granule` bytes per first write
    /// (`OpenOptions::alloc_granule`; 0: one cluster, for a layout a test lays out itself).
    fn with_granule(
        seed: u64,
        cores: usize,
        lazy: bool,
        max_latency: u64,
        alloc_granule: u64,
    ) -> Rig {
        Rig::build(seed, cores, lazy, max_latency, alloc_granule, None)
    }

    /// A rig on image bytes `image` (4 KiB clusters, 4 MiB) instead of a new image.
    fn with_image(seed: u64, cores: usize, image: Vec<u8>) -> Rig {
        let granule = OpenOptions::default().alloc_granule;
        Rig::build(seed, cores, false, 2, granule, Some(image))
    }

    fn build(
        seed: u64,
        cores: usize,
        lazy: bool,
        max_latency: u64,
        alloc_granule: u64,
        image: Option<Vec<u8>>,
    ) -> Rig {
        let made = image.is_some();
        let disk = Rc::new(RefCell::new(image.unwrap_or_default()));
        let dev_rng = Rc::new(RefCell::new(Rng::new(seed ^ 0x5eed)));
        let channel = |lat: u64| Channel {
            disk: disk.clone(),
            rng: dev_rng.clone(),
            max_latency: lat,
            polls: 0,
            inflight: Vec::new(),
        };
        let size = 4 << 20;
        let owner_exec: Exec<Channel> = Exec::new();
        let id = owner_exec.add_device(channel(0));
        let e2 = owner_exec.clone();
        let copts = CreateOptions {
            size,
            cluster_bits: 12,
            lazy_refcounts: lazy,
            ..Default::default()
        };
        if !made {
            owner_exec
                .block_on(async move { create(&e2, id, &copts).await })
                .unwrap();
        }
        // Latency from now on (the owner's channel was idle-free during create).
        owner_exec.with_device(id, |d| d.max_latency = max_latency);
        let e2 = owner_exec.clone();
        let oopts = OpenOptions {
            writable: true,
            l2_slice_bytes: 512,
            l2_cache_bytes: Some(4 << 10),
            alloc_granule,
            ..Default::default()
        };
        let mut owner = owner_exec
            .block_on(async move { Qcow2::open(&e2, id, oopts).await })
            .unwrap();
        owner.share();
        let chain = Chain::new(&owner_exec, vec![Layer::Qcow2(Box::new(owner))]).unwrap();
        let mut rig = Rig {
            disk,
            inbox: vec![VecDeque::new()],
            execs: vec![owner_exec],
            chains: vec![chain],
            asks: Rc::new(RefCell::new(VecDeque::new())),
            done: Vec::new(),
            size,
            rng: dev_rng,
        };
        for _ in 0..cores {
            let seed = rig.owner().core_seed().unwrap();
            rig.add_core(seed, max_latency);
        }
        rig
    }

    /// Adds a core made from `seed` (taken from the owner at any time before) whose
    /// device answers within `max_latency` polls; returns its index.
    fn add_core(&mut self, seed: CoreSeed, max_latency: u64) -> usize {
        let c = self.execs.len();
        let exec: Exec<Channel> = Exec::new();
        let dev = exec.add_device(Channel {
            disk: self.disk.clone(),
            rng: self.rng.clone(),
            max_latency,
            polls: 0,
            inflight: Vec::new(),
        });
        let link = Link {
            core: c,
            asks: self.asks.clone(),
        };
        let opts = OpenOptions {
            l2_slice_bytes: 512,
            // Four slices of sixteen: replicas get evicted and reloaded.
            l2_cache_bytes: Some(2 << 10),
            cache_ways: 2,
            ..Default::default()
        };
        let q = Qcow2::from_seed(seed, &exec, dev, opts, Box::new(link)).unwrap();
        assert!(q.is_core_replica());
        self.chains
            .push(Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap());
        self.execs.push(exec);
        self.inbox.push(VecDeque::new());
        c
    }

    fn owner(&self) -> &Qcow2<Channel> {
        image(&self.chains[0])
    }

    fn poll(&mut self, e: usize) {
        let mut got = Vec::new();
        self.execs[e].poll_outcomes(&mut |tag, o| {
            got.push((
                tag,
                match o {
                    Outcome::Done(r) => r.map_err(|e| e.to_string()),
                    Outcome::ToOwner => Err("handed to the owner".to_string()),
                },
            ))
        });
        self.done.extend(got);
    }

    /// The owner handles one pending request (the oldest, or a random one).
    fn answer(&mut self, pick: Option<usize>) -> bool {
        let req = {
            let mut a = self.asks.borrow_mut();
            match pick {
                Some(i) if !a.is_empty() => {
                    let i = i % a.len();
                    a.remove(i)
                }
                _ => a.pop_front(),
            }
        };
        let Some((key, ticket, core)) = req else {
            return false;
        };
        let reply = self.owner().slice_for_core(key);
        self.inbox[core].push_back((ticket, reply));
        true
    }

    /// Core `c` receives the owner's next answer.
    fn deliver(&mut self, c: usize) -> bool {
        let Some((ticket, reply)) = self.inbox[c].pop_front() else {
            return false;
        };
        image(&self.chains[c]).deliver_slice(ticket, reply);
        true
    }

    /// Runs everything (polls, messages) until `tag` completes; returns its result.
    fn run(&mut self, tag: u64) -> Result<(), String> {
        for _ in 0..100_000 {
            if let Some(i) = self.done.iter().position(|d| d.0 == tag) {
                return self.done.remove(i).1;
            }
            for e in 0..self.execs.len() {
                self.poll(e);
            }
            while self.answer(None) {}
            for c in 1..self.execs.len() {
                while self.deliver(c) {}
            }
        }
        panic!("request {tag} never completed");
    }

    /// Runs only core `c` (and the owner's answers, which need no owner poll) until `tag`.
    fn run_core(&mut self, c: usize, tag: u64) -> Result<(), String> {
        for _ in 0..100_000 {
            if let Some(i) = self.done.iter().position(|d| d.0 == tag) {
                return self.done.remove(i).1;
            }
            self.poll(c);
            while self.answer(None) {}
            while self.deliver(c) {}
        }
        panic!("core request {tag} never completed");
    }

    fn close(&mut self) {
        let c = self.chains[0].clone();
        self.execs[0]
            .block_on(async move { image(&c).close().await })
            .unwrap();
    }
}

// ----- data patterns and the reference -------------------------------------------------

/// Sector `s` as written by write `id` (id 0: zeros).
fn pattern(id: u64, s: u64) -> Vec<u8> {
    let mut v = vec![0u8; SECTOR as usize];
    if id != 0 {
        v[..8].copy_from_slice(&id.to_le_bytes());
        v[8..16].copy_from_slice(&s.to_le_bytes());
        let fill = (id.wrapping_mul(31) ^ s.wrapping_mul(7)) as u8 | 1;
        v[16..].fill(fill);
    }
    v
}

/// Which write's data a read sector holds (`Err` if it is no write's data at all).
fn decode(s: u64, bytes: &[u8]) -> Result<u64, String> {
    let id = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    if bytes == pattern(id, s).as_slice() {
        Ok(id)
    } else {
        Err(format!(
            "sector {s} holds no write's data ({:02x?}..)",
            &bytes[..24]
        ))
    }
}

/// One write to a sector: data id (0: zeros), submission and completion times.
#[derive(Clone, Copy)]
struct Rec {
    id: u64,
    submit: u64,
    complete: Option<u64>,
}

#[derive(Default)]
struct Model {
    /// Per sector, its writes in order (writes to a sector never overlap in time).
    hist: Vec<Vec<Rec>>,
    /// Sectors with a write in flight.
    busy: Vec<bool>,
    clock: u64,
}

impl Model {
    fn new(sectors: u64) -> Self {
        Model {
            hist: vec![Vec::new(); sectors as usize],
            busy: vec![false; sectors as usize],
            clock: 0,
        }
    }
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
    fn free(&self, first: u64, n: u64) -> bool {
        (first..first + n).all(|s| !self.busy[s as usize])
    }
    fn begin_write(&mut self, sectors: &[(u64, u64)], now: u64) {
        for &(s, id) in sectors {
            self.busy[s as usize] = true;
            self.hist[s as usize].push(Rec {
                id,
                submit: now,
                complete: None,
            });
        }
    }
    fn end_write(&mut self, sectors: &[(u64, u64)], now: u64) {
        for &(s, _) in sectors {
            self.busy[s as usize] = false;
            let r = self.hist[s as usize].last_mut().unwrap();
            r.complete = Some(now);
        }
    }
    /// Checks sector `s` of a read submitted at `sub` and completed at `done`.
    fn check(&self, s: u64, got: u64, sub: u64, done: u64) -> Result<(), String> {
        let h = &self.hist[s as usize];
        let base = h
            .iter()
            .rev()
            .find(|r| r.complete.is_some_and(|c| c < sub))
            .map_or(0, |r| r.id);
        if got == base {
            return Ok(());
        }
        let overlapping = |r: &&Rec| r.submit < done && r.complete.is_none_or(|c| c > sub);
        if h.iter().filter(overlapping).any(|r| r.id == got) {
            return Ok(());
        }
        Err(format!(
            "sector {s}: read [{sub}, {done}] returned write {got}, expected {base} or an overlapping write; history {:?}",
            h.iter().map(|r| (r.id, r.submit, r.complete)).collect::<Vec<_>>()
        ))
    }
    fn final_id(&self, s: u64) -> u64 {
        self.hist[s as usize].last().map_or(0, |r| r.id)
    }
}

enum Op {
    Read {
        off: u64,
        buf: HeapBuf,
        submit: u64,
        exec: usize,
    },
    Write {
        sectors: Vec<(u64, u64)>,
    },
    Flush,
}

fn fill(id_base: u64, off: u64, len: u64) -> (HeapBuf, Vec<(u64, u64)>) {
    let buf = HeapBuf::new(len as usize);
    let mut sectors = Vec::new();
    for i in 0..len / SECTOR {
        let s = off / SECTOR + i;
        buf.copy_in((i * SECTOR) as usize, &pattern(id_base, s));
        sectors.push((s, id_base));
    }
    (buf, sectors)
}

fn qemu_img(args: &[&str]) -> std::process::Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img")
}

/// Returns how many writes the cores kept through an older copy of their slice.
/// Returns the cores' writes kept through an older copy of a slice, and the first writes
/// whose data a core wrote.
fn random_run(seed: u64, steps: usize) -> (u64, u64) {
    let lazy = seed.is_multiple_of(3);
    let mut rig = Rig::new(seed, 2, lazy, 1 + seed % 4);
    let mut rng = Rng::new(seed);
    let size = rig.size;
    let sectors = size / SECTOR;
    let mut model = Model::new(sectors);
    let mut ops: HashMap<u64, Op> = HashMap::new();
    let mut next_tag = 1u64;
    let mut next_id = 1u64;
    let (mut core_fast, mut core_fallback, mut reads) = (0u64, 0u64, 0u64);
    // A core's first writes sent without their data: tag → the owner's ticket, while the
    // core writes the data.
    let mut reserved: HashMap<u64, Ticket> = HashMap::new();
    let mut by_core = 0u64;
    // Hot region: most requests land in the first 512 KiB (two slices per core cache set).
    let pick = |rng: &mut Rng| -> (u64, u64) {
        let n = 1 + rng.below(24);
        let span = if rng.below(4) == 0 { sectors } else { 1024 };
        let first = rng.below(span - n + 1);
        (first * SECTOR, n * SECTOR)
    };
    let handle = |rig: &mut Rig,
                  model: &mut Model,
                  ops: &mut HashMap<u64, Op>,
                  reserved: &mut HashMap<u64, Ticket>| {
        let done = std::mem::take(&mut rig.done);
        for (tag, r) in done {
            if tag & RESERVED != 0 {
                // The core's data write: the owner commits it (the write completes then).
                let ticket = reserved.remove(&(tag & !RESERVED)).expect("unknown ticket");
                let written = r.map_err(|_| qcow2_engine::Error::InvalidRequest("write failed"));
                rig.chains[0].commit_reserved(ticket, tag & !RESERVED, written);
                continue;
            }
            if let Err(e) = &r {
                panic!("seed {seed}: request {tag} failed: {e}");
            }
            let now = model.tick();
            match ops.remove(&tag).expect("unknown tag") {
                Op::Read {
                    off,
                    buf,
                    submit,
                    exec,
                } => {
                    let bytes = buf.to_vec();
                    for (i, chunk) in bytes.chunks(SECTOR as usize).enumerate() {
                        let s = off / SECTOR + i as u64;
                        let got = decode(s, chunk)
                            .unwrap_or_else(|e| panic!("seed {seed}: exec {exec}: {e}"));
                        if let Err(e) = model.check(s, got, submit, now) {
                            panic!("seed {seed}: read on exec {exec}: {e}");
                        }
                    }
                }
                Op::Write { sectors } => model.end_write(&sectors, now),
                Op::Flush => {}
            }
        }
    };
    for _ in 0..steps {
        match rng.below(16) {
            // Submit a request.
            0..=5 if ops.len() < 12 => {
                let tag = next_tag;
                next_tag += 1;
                let (off, len) = pick(&mut rng);
                let now = model.tick();
                match rng.below(16) {
                    0..=6 => {
                        let exec = rng.below(3) as usize;
                        let buf = HeapBuf::new(len as usize);
                        // Routed as the hosts route a read: direct when one extent.
                        let chain = &rig.chains[exec];
                        let guest = BufSlice::whole(buf.clone());
                        match chain.route_read(off, len) {
                            ReadRoute::Direct(g) => chain.submit_direct(tag, g, guest),
                            ReadRoute::Engine => host::engine_read(chain, tag, off, guest),
                        }
                        ops.insert(
                            tag,
                            Op::Read {
                                off,
                                buf,
                                submit: now,
                                exec,
                            },
                        );
                        reads += 1;
                    }
                    7..=12 if model.free(off / SECTOR, len / SECTOR) => {
                        let id = next_id;
                        next_id += 1;
                        let (buf, secs) = fill(id, off, len);
                        model.begin_write(&secs, now);
                        ops.insert(tag, Op::Write { sectors: secs });
                        let c = 1 + rng.below(3) as usize;
                        // On a core: routed as the hosts route a write (direct when one
                        // extent), else the core's in-place path, else the owner.
                        let guest = BufSlice::whole(buf.clone());
                        let granted = match (c < 3).then(|| rig.chains[c].route_write(off, len)) {
                            Some(WriteRoute::Direct(g)) => {
                                rig.chains[c].submit_direct(tag, g, guest.clone());
                                true
                            }
                            _ => false,
                        };
                        if granted || (c < 3 && rig.chains[c].try_submit_write(tag, off, &guest)) {
                            core_fast += 1;
                        } else {
                            if c < 3 {
                                core_fallback += 1;
                            }
                            // The owner's copy of the data.
                            let obuf = HeapBuf::new(len as usize);
                            obuf.copy_in(0, &buf.to_vec());
                            let obuf = BufSlice::whole(obuf);
                            // Half a core's writes go as the hosts send a first write:
                            // without data, the core writing it where the owner says.
                            let (answer, entry) = match c < 3 && rng.below(2) == 0 {
                                true => {
                                    let entry = rig.chains[c].exec().guest_enter();
                                    (rig.chains[0].reserve_write(off, len), Some(entry))
                                }
                                false => (Reserved::Send, None),
                            };
                            let core_exec = rig.chains[c.min(2)].exec().clone();
                            match (answer, entry) {
                                (Reserved::InPlace { host }, Some(entry)) => {
                                    rig.chains[c].write_reserved(tag, host, guest, entry);
                                }
                                (Reserved::Write { ticket, host }, Some(entry)) => {
                                    by_core += 1;
                                    reserved.insert(tag, ticket);
                                    let t = tag | RESERVED;
                                    rig.chains[c].write_reserved(t, host, guest, entry);
                                }
                                (answer, entry) => {
                                    if let Some(entry) = entry {
                                        core_exec.guest_exit(entry);
                                    }
                                    match answer {
                                        Reserved::Data(ticket) => {
                                            rig.chains[0].run_reserved(ticket, tag, obuf)
                                        }
                                        _ => host::write(&rig.chains[0], tag, off, obuf),
                                    }
                                }
                            }
                        }
                    }
                    13 if model.free(off / SECTOR, len / SECTOR) => {
                        let secs: Vec<(u64, u64)> = (off / SECTOR..(off + len) / SECTOR)
                            .map(|s| (s, 0))
                            .collect();
                        model.begin_write(&secs, now);
                        ops.insert(tag, Op::Write { sectors: secs });
                        host::write_zeroes(&rig.chains[0], tag, off, len, rng.below(2) == 0);
                    }
                    14 if model.free(off / SECTOR, len / SECTOR) => {
                        // Whole clusters read as zeros after a discard; partial ones keep
                        // their data (no write for them).
                        let cs = 4096;
                        let (a, b) = (off.div_ceil(cs) * cs, (off + len) / cs * cs);
                        let secs: Vec<(u64, u64)> = if a < b {
                            (a / SECTOR..b / SECTOR).map(|s| (s, 0)).collect()
                        } else {
                            Vec::new()
                        };
                        model.begin_write(&secs, now);
                        ops.insert(tag, Op::Write { sectors: secs });
                        host::discard(&rig.chains[0], tag, off, len);
                    }
                    _ => {
                        ops.insert(tag, Op::Flush);
                        host::flush(&rig.chains[0], tag);
                    }
                }
            }
            // Poll an executor.
            0..=10 => {
                let e = rng.below(3) as usize;
                rig.poll(e);
                handle(&mut rig, &mut model, &mut ops, &mut reserved);
            }
            // The owner handles a core's request.
            11..=12 => {
                let pick = rng.below(4) as usize;
                rig.answer(Some(pick));
            }
            // A core receives the answer.
            _ => {
                let c = 1 + rng.below(2) as usize;
                rig.deliver(c);
            }
        }
    }
    // Drain.
    let mut spins = 0;
    while !ops.is_empty() {
        spins += 1;
        if spins == 100_000 {
            let left: Vec<String> = ops
                .iter()
                .map(|(t, o)| match o {
                    Op::Read { off, exec, .. } => format!("{t}: read {off:#x} on {exec}"),
                    Op::Write { sectors } => format!(
                        "{t}: write/zero {:?}",
                        sectors.first().map(|s| s.0 * SECTOR)
                    ),
                    Op::Flush => format!("{t}: flush"),
                })
                .collect();
            let busy: Vec<bool> = rig.execs.iter().map(|e| e.busy()).collect();
            panic!("seed {seed}: requests never completed: {left:?}; executors busy {busy:?}");
        }
        for e in 0..3 {
            rig.poll(e);
            handle(&mut rig, &mut model, &mut ops, &mut reserved);
        }
        while rig.answer(None) {}
        for c in 1..3 {
            while rig.deliver(c) {}
        }
    }
    assert!(core_fast > 0, "seed {seed}: no in-place write on a core");
    assert!(reads > 0);
    let kept: u64 = rig.chains[1..].iter().map(|c| c.kept_overwrites()).sum();
    eprintln!(
        "seed {seed}: {reads} reads, {core_fast} in-place core writes ({kept} through an \
         older copy of the slice), {core_fallback} sent to the owner ({by_core} of them \
         written by the core)"
    );
    assert_eq!(rig.chains[0].reservations_held(), 0);
    rig.close();

    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    let reference = dir.path().join("ref.raw");
    std::fs::write(&img, rig.disk.borrow().as_slice()).unwrap();
    let mut raw = Vec::with_capacity(size as usize);
    for s in 0..sectors {
        raw.extend_from_slice(&pattern(model.final_id(s), s));
    }
    std::fs::write(&reference, raw).unwrap();
    let img_s = img.to_str().unwrap();
    let out = qemu_img(&["check", "-f", "qcow2", img_s]);
    assert!(
        out.status.success(),
        "seed {seed}: qemu-img check: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = qemu_img(&[
        "compare",
        "-f",
        "qcow2",
        "-F",
        "raw",
        img_s,
        reference.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "seed {seed}: qemu-img compare: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (kept, by_core)
}

/// Owner and two cores on a fresh image with 4 KiB clusters: allocations, overwrites,
/// discards, write-zeroes and the reallocations that follow, interleaved at random; the
/// cores overwrite through older copies of slices the owner only added to since (§6).
#[test]
fn random_interleavings_owner_and_two_cores() {
    let (mut kept, mut by_core) = (0, 0);
    for seed in 1..=16u64 {
        let (k, b) = random_run(seed * 0x9E37_79B9, 20_000);
        kept += k;
        by_core += b;
    }
    assert!(kept > 0, "no core kept an overwrite through an older copy");
    assert!(by_core > 0, "no core wrote a first write's data");
}

// ----- targeted ------------------------------------------------------------------------

fn write_sync(rig: &mut Rig, tag: u64, off: u64, id: u64, len: u64) {
    let (buf, _) = fill(id, off, len);
    host::write(&rig.chains[0], tag, off, BufSlice::whole(buf));
    rig.run(tag).unwrap();
}

fn flush_sync(rig: &mut Rig, tag: u64) {
    host::flush(&rig.chains[0], tag);
    rig.run(tag).unwrap();
}

/// Reads `[off, off+len)` on core `c`, running only that core: returns the write ids.
fn core_read(rig: &mut Rig, c: usize, tag: u64, off: u64, len: u64) -> Vec<u64> {
    let buf = HeapBuf::new(len as usize);
    host::read(&rig.chains[c], tag, off, BufSlice::whole(buf.clone()));
    rig.run_core(c, tag).unwrap();
    buf.to_vec()
        .chunks(SECTOR as usize)
        .enumerate()
        .map(|(i, b)| decode(off / SECTOR + i as u64, b).unwrap())
        .collect()
}

#[test]
fn core_sees_owner_allocation_in_cached_slice() {
    let mut rig = Rig::new(7, 1, false, 2);
    let cs = 4096;
    // Cluster 0 allocated and written back: the slice is clean, its epoch even.
    write_sync(&mut rig, 1, 0, 11, cs);
    flush_sync(&mut rig, 2);
    // The core caches the slice (cluster 1 unallocated: zeros).
    assert_eq!(core_read(&mut rig, 1, 3, cs, cs), vec![0; 8]);
    assert_eq!(core_read(&mut rig, 1, 4, 0, cs), vec![11; 8]);
    let hits = image(&rig.chains[1]).l2_cache_stats();
    // The owner allocates cluster 1 (same slice): the core's next read must see it.
    write_sync(&mut rig, 5, cs, 12, cs);
    assert_eq!(core_read(&mut rig, 1, 6, cs, cs), vec![12; 8]);
    assert!(
        image(&rig.chains[1]).l2_cache_stats() != hits,
        "the core went through its cache"
    );
    // And after the write-back, from the device (epoch even again).
    flush_sync(&mut rig, 7);
    assert_eq!(
        core_read(&mut rig, 1, 8, 0, 2 * cs),
        [vec![11; 8], vec![12; 8]].concat()
    );
    // An in-place write on the core to an allocated cluster, then the owner reads it.
    let (buf, _) = fill(13, 0, cs);
    assert!(rig.chains[1].try_submit_write(9, 0, &BufSlice::whole(buf)));
    rig.run(9).unwrap();
    let obuf = HeapBuf::new(cs as usize);
    host::read(&rig.chains[0], 10, 0, BufSlice::whole(obuf.clone()));
    rig.run(10).unwrap();
    assert_eq!(decode(0, &obuf.to_vec()[..512]).unwrap(), 13);
    rig.close();
}

/// Two cores race first writes into one cluster (#48): the first is reserved and written
/// by its core; the second finds the cluster in flight, goes to the owner with its data and
/// waits there until the first is committed, then lands in the cluster the first took.
/// Neither completes before its mapping is in place, and neither loses the other's data.
#[test]
fn two_cores_race_first_writes_into_one_cluster() {
    for second_first in [false, true] {
        let mut rig = Rig::with_granule(9, 2, false, 2, 0);
        // Cluster 0 gives the slice its L2 table: cluster 2's first writes are planned on
        // the spot.
        write_sync(&mut rig, 90, 0, 5, 4096);
        let (a, b) = (2 * 4096, 2 * 4096 + 2048);
        for c in 1..=2 {
            let r = route(&rig.chains[c], a + 1024 * (c as u64 - 1), 1024);
            assert!(r.starts_with("owner") || r == "local", "{r}");
        }
        let (buf_a, _) = fill(21, a, 1024);
        let (buf_b, _) = fill(22, b, 1024);
        if second_first {
            // Core 2's write reaches the owner (with its data) first.
            host::write(&rig.chains[0], 2, b, BufSlice::whole(buf_b.clone()));
        }
        let Reserved::Write { ticket, host } = rig.chains[0].reserve_write(a, 1024) else {
            // The cluster is in flight; once core 2's write is in, core 1's is an
            // overwrite, which it writes itself where the owner says.
            assert!(
                second_first,
                "the first write into the cluster is not reserved"
            );
            rig.run(2).unwrap();
            let entry = rig.chains[1].exec().guest_enter();
            let Reserved::InPlace { host } = rig.chains[0].reserve_write(a, 1024) else {
                panic!("an overwrite not answered in place");
            };
            rig.chains[1].write_reserved(1, host, BufSlice::whole(buf_a), entry);
            rig.run_core(1, 1).unwrap();
            for c in 1..=2 {
                let ids = core_read(&mut rig, c, 10 + c as u64, 2 * 4096, 4096);
                assert_eq!(ids, [vec![21, 21, 0, 0], vec![22, 22, 0, 0]].concat());
            }
            rig.close();
            continue;
        };
        assert!(!second_first);
        // Core 2's write into the same cluster: in flight, so not reserved.
        assert_eq!(rig.chains[0].reserve_write(b, 1024), Reserved::Send);
        host::write(&rig.chains[0], 2, b, BufSlice::whole(buf_b));
        // Core 1 writes its data; until the owner commits, nobody sees it mapped and
        // core 2's write waits.
        let entry = rig.chains[1].exec().guest_enter();
        rig.chains[1].write_reserved(1 | RESERVED, host, BufSlice::whole(buf_a), entry);
        rig.run_core(1, 1 | RESERVED).unwrap();
        for _ in 0..50 {
            rig.poll(0);
        }
        assert!(
            rig.done.iter().all(|d| d.0 != 2),
            "core 2's write did not wait"
        );
        assert_eq!(core_read(&mut rig, 2, 3, a, 1024), vec![0; 2]);
        rig.chains[0].commit_reserved(ticket, 1, Ok(()));
        rig.run(1).unwrap();
        rig.run(2).unwrap();
        for c in 1..=2 {
            let ids = core_read(&mut rig, c, 10 + c as u64, 2 * 4096, 4096);
            assert_eq!(ids, [vec![21, 21, 0, 0], vec![22, 22, 0, 0]].concat());
        }
        assert_eq!(rig.chains[0].reservations_held(), 0);
        rig.close();
        let ids = qemu_ids(&rig, None, 3 * 4096);
        assert_eq!(ids[16..24], [21, 21, 0, 0, 22, 22, 0, 0]);
    }
}

#[test]
fn core_reads_during_owner_writeback() {
    for seed in 1..=6u64 {
        let mut rig = Rig::new(seed, 1, seed.is_multiple_of(2), 3);
        let cs = 4096u64;
        let mut tag = 100;
        // Dirty several slices (and a new L2 table: cluster 600 is past the first table).
        let targets = [0u64, 1, 70, 130, 600];
        let mut expect: HashMap<u64, u64> = HashMap::new();
        for (i, c) in targets.iter().enumerate() {
            write_sync(&mut rig, tag, c * cs, 20 + i as u64, cs);
            expect.insert(*c, 20 + i as u64);
            tag += 1;
        }
        // Warm the core's cache.
        for c in targets {
            assert_eq!(core_read(&mut rig, 1, tag, c * cs, cs), vec![expect[&c]; 8]);
            tag += 1;
        }
        // A write-back in progress: after every single poll of the owner, the core reads
        // every target (running only itself; the owner answers without polling).
        host::flush(&rig.chains[0], tag);
        let flush_tag = tag;
        tag += 1;
        let mut steps = 0;
        // A write submitted meanwhile waits for the write-back (metadata lock); while in
        // flight its cluster may read either way.
        let (buf, _) = fill(99, 3 * cs, cs);
        host::write(&rig.chains[0], tag, 3 * cs, BufSlice::whole(buf));
        let mut pending = Some(tag);
        tag += 1;
        loop {
            if let Some(i) = rig.done.iter().position(|d| d.0 == flush_tag) {
                rig.done.remove(i).1.unwrap();
                break;
            }
            if let Some(i) = rig.done.iter().position(|d| Some(d.0) == pending) {
                rig.done.remove(i).1.unwrap();
                pending = None;
                expect.insert(3, 99);
            }
            steps += 1;
            assert!(steps < 10_000, "flush never completed");
            rig.poll(0);
            for (&c, &id) in expect.clone().iter() {
                assert_eq!(
                    core_read(&mut rig, 1, tag, c * cs, cs),
                    vec![id; 8],
                    "seed {seed}: cluster {c} after {steps} owner polls"
                );
                tag += 1;
            }
        }
        if let Some(t) = pending {
            rig.run(t).unwrap();
        }
        assert_eq!(core_read(&mut rig, 1, tag, 3 * cs, cs), vec![99; 8]);
        rig.close();
    }
}

/// Makes guest cluster 0's L2 entry on the device (hostile) point at the image's own L1
/// table, COPIED; returns the L1 table's offset and its cluster's bytes as they are.
fn point_cluster_0_at_the_l1_table(rig: &Rig) -> (u64, Vec<u8>) {
    let cs = 4096u64;
    let l1_off = rig.owner().header().header.l1_table_offset;
    let be =
        |d: &[u8], at: u64| u64::from_be_bytes(d[at as usize..at as usize + 8].try_into().unwrap());
    let mut disk = rig.disk.borrow_mut();
    let l2_off = be(&disk, l1_off) & 0x00ff_ffff_ffff_fe00;
    let hostile = (l1_off | (1 << 63)).to_be_bytes();
    disk[l2_off as usize..l2_off as usize + 8].copy_from_slice(&hostile);
    (
        l1_off,
        disk[l1_off as usize..(l1_off + cs) as usize].to_vec(),
    )
}

/// Runs an owner request submitted by `submit` with `tag` to completion.
fn owner_sync(rig: &mut Rig, tag: u64, submit: impl FnOnce(&Rc<Chain<Channel>>, u64)) {
    let owner = rig.chains[0].clone();
    submit(&owner, tag);
    rig.run(tag).unwrap();
}

#[test]
fn core_keeps_overwrites_through_older_copies_until_a_removal() {
    // ARCHITECTURE.md §6: a core overwrites in place through a copy of its slice older than
    // the epoch while the owner only added mappings since; a removal anywhere in the slot
    // (discard, write-zeroes) ends that, also for clusters it did not touch; a copy many
    // changes behind is fetched again rather than sending the write to the owner. (One
    // cluster per first write, so that the allocations below are the test's own.)
    let mut rig = Rig::with_granule(11, 1, false, 1, 0);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 41, 4 * cs);
    flush_sync(&mut rig, 2);
    assert_eq!(core_read(&mut rig, 1, 3, 0, 4 * cs), vec![41; 32]);
    let core = rig.chains[1].clone();

    // An allocation in the slice (the owner holds it dirty): cluster 0 stays on the core.
    write_sync(&mut rig, 4, 5 * cs, 42, cs);
    assert!(
        kept_host(&rig, 1, 0, cs).is_some(),
        "only an addition since"
    );
    let (buf, _) = fill(43, 0, cs);
    match core.route_write(0, cs) {
        WriteRoute::Direct(g) => core.submit_direct(5, g, BufSlice::whole(buf)),
        other => panic!("an overwrite the older copy shows in place, not {other:?}"),
    }
    rig.run_core(1, 5).unwrap();
    let obuf = HeapBuf::new(cs as usize);
    host::read(&rig.chains[0], 6, 0, BufSlice::whole(obuf.clone()));
    rig.run(6).unwrap();
    assert_eq!(
        decode(0, &obuf.to_vec()[..512]).unwrap(),
        43,
        "landed where the owner maps"
    );
    assert_eq!(
        route(&core, 5 * cs, cs),
        "owner, may be in place",
        "allocated after the copy"
    );

    // A discard of cluster 1 removes a mapping: the copy answers no overwrite any more,
    // not even of cluster 0, which kept its own.
    owner_sync(&mut rig, 7, |o, t| host::discard(o, t, cs, cs));
    assert_eq!(kept_host(&rig, 1, 0, cs), None, "a removal since the copy");
    assert_eq!(route(&core, cs, cs), "owner, may be in place");
    // Reallocated: the core, with a new copy, overwrites it where the owner put it.
    write_sync(&mut rig, 8, cs, 44, cs);
    assert_eq!(
        core_read(&mut rig, 1, 9, 0, 2 * cs),
        [vec![43; 8], vec![44; 8]].concat()
    );
    write_sync(&mut rig, 10, 6 * cs, 45, cs);
    assert!(
        kept_host(&rig, 1, cs, cs).is_some(),
        "the new mapping, kept"
    );

    // Write-zeroes without unmap sets a zero flag: a removal too.
    owner_sync(&mut rig, 11, |o, t| {
        host::write_zeroes(o, t, 2 * cs, cs, false)
    });
    assert_eq!(kept_host(&rig, 1, 3 * cs, cs), None);
    assert_eq!(
        core_read(&mut rig, 1, 12, 2 * cs, 2 * cs),
        [vec![0; 8], vec![41; 8]].concat()
    );

    // Many allocations behind: a write the copy shows unallocated is loaded on the core
    // (a new copy from the owner) instead of going to the owner, and written in place.
    // (Each allocation and write-back moves the epoch two changes; the last leaves it odd.)
    for (i, c) in (10..45u64).enumerate() {
        write_sync(&mut rig, 100 + 2 * i as u64, c * cs, 46, cs);
        flush_sync(&mut rig, 101 + 2 * i as u64);
    }
    write_sync(&mut rig, 200, 45 * cs, 46, cs);
    assert!(kept_host(&rig, 1, 3 * cs, cs).is_some());
    assert_eq!(
        route(&core, 10 * cs, cs),
        "local",
        "the copy is many changes behind"
    );
    let (buf, _) = fill(47, 10 * cs, cs);
    host::engine_write(&core, 13, 10 * cs, BufSlice::whole(buf));
    rig.run_core(1, 13).unwrap();
    assert_eq!(
        route(&core, 11 * cs, cs),
        "direct",
        "the new copy is current"
    );
    assert_eq!(
        core_read(&mut rig, 1, 14, 10 * cs, 2 * cs),
        [vec![47; 8], vec![46; 8]].concat()
    );
    assert!(core.kept_overwrites() >= 4);
    rig.close();
}

#[test]
fn core_refuses_in_place_write_into_metadata() {
    // ARCHITECTURE.md §7 rule 6 / §9 on a core: a (hostile) L2 entry that points at the image's
    // own L1 table must not be written through by a core's in-place fast path.
    let mut rig = Rig::new(3, 1, false, 1);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 21, cs);
    flush_sync(&mut rig, 2);
    let (l1_off, l1_before) = point_cluster_0_at_the_l1_table(&rig);
    // The core loads the (clean) slice from the device and sees guest cluster 0 → L1.
    let _ = core_read(&mut rig, 1, 3, cs, cs);
    let (buf, _) = fill(22, 0, cs);
    let buf = BufSlice::whole(buf);
    assert!(
        !rig.chains[1].try_submit_write(4, 0, &buf),
        "a core wrote in place through an entry into metadata"
    );
    host::engine_write(&rig.chains[1], 5, 0, buf);
    let r = rig.run(5);
    assert!(
        r.as_ref().is_err_and(|e| e.contains("owner")),
        "expected the write handed to the owner, got {r:?}"
    );
    assert_eq!(
        rig.disk.borrow()[l1_off as usize..(l1_off + cs) as usize],
        l1_before[..],
        "the L1 table was overwritten"
    );
}

/// `Chain::route_write` as a word; a direct grant is finished at once, where the general
/// look-up ([`general`]) maps the write in place too.
fn route(chain: &Chain<Channel>, off: u64, len: u64) -> &'static str {
    let kept = chain.kept_overwrites();
    match chain.route_write(off, len) {
        WriteRoute::Direct(g) => {
            let host = g.host().0;
            g.finish(chain.exec());
            if chain.kept_overwrites() != kept {
                // Through a copy older than the epoch: `kept_host` compares with the owner.
                return "direct, older copy";
            }
            assert_eq!(
                general(chain, off, len, true),
                Some(host),
                "the route and the general look-up differ"
            );
            "direct"
        }
        WriteRoute::Engine => "local",
        WriteRoute::Owner { slow: true } => "owner",
        WriteRoute::Owner { slow: false } => "owner, may be in place",
    }
}

/// Where core `c` routes an overwrite of `[off, off + len)` through a copy of its slice
/// older than the epoch (§6): the host offset, which must be where the owner maps it now;
/// `None` when the route is anything else (a grant is finished at once).
fn kept_host(rig: &Rig, c: usize, off: u64, len: u64) -> Option<u64> {
    let core = &rig.chains[c];
    let kept = core.kept_overwrites();
    let WriteRoute::Direct(g) = core.route_write(off, len) else {
        return None;
    };
    let host = g.host().0;
    g.finish(core.exec());
    if core.kept_overwrites() == kept {
        return None;
    }
    assert_eq!(
        general(&rig.chains[0], off, len, true),
        Some(host),
        "an older copy routed where the owner does not map in place"
    );
    Some(host)
}

/// Where the direct path maps `[off, off + len)`, asked as the SPDK module asks: one
/// `Chain::route_read` / `Chain::route_write` (the memo of slices first, then the
/// slice cache), checked against the general look-up ([`general`]); a grant is finished at
/// once. Also says whether the memo answered (its answer must be the general one).
fn direct(chain: &Chain<Channel>, off: u64, len: u64, write: bool) -> (Option<u64>, bool) {
    let grant = match write {
        true => match chain.route_write(off, len) {
            WriteRoute::Direct(g) => Some(g),
            _ => None,
        },
        false => match chain.route_read(off, len) {
            ReadRoute::Direct(g) => Some(g),
            ReadRoute::Engine => None,
        },
    };
    let routed = grant.map(|g| {
        let r = (g.host().0, g.from_memo());
        g.finish(chain.exec());
        r
    });
    let general = general(chain, off, len, write);
    match routed {
        Some((h, true)) => {
            assert_eq!(general, Some(h), "the memo and the general look-up differ");
            (Some(h), true)
        }
        _ => {
            let routed = routed.map(|(h, _)| h);
            assert_eq!(routed, general, "the route and the general look-up differ");
            (routed, false)
        }
    }
}

/// The general look-up of `[off, off + len)` on `chain`'s top image: cluster by cluster
/// from its cached slices (`Qcow2::resolve_cached`: no memo, current slices only), the
/// host offset when every (sub)cluster is data — for a `write`, COPIED and none of the
/// image's metadata — and they follow each other on the device.
fn general(chain: &Chain<Channel>, off: u64, len: u64, write: bool) -> Option<u64> {
    if len == 0 || chain.disk().check_range(off, len).is_err() {
        return None;
    }
    let q = image(chain);
    let geo = q.geometry();
    let meta = |h: u64| {
        q.shared()
            .is_some_and(|sh| sh.is_meta_cluster(h / geo.cluster_size()))
    };
    let (end, mut pos) = (off + len, off);
    let (mut start, mut next) = (None, 0);
    while pos < end {
        let Ok(Some((ClusterMapping::Data { host, copied }, m_end))) =
            q.resolve_cached(GuestOffset(pos))
        else {
            return None;
        };
        let h = host.0 + (pos & (geo.subcluster_size() - 1));
        if write && (!copied || meta(h)) {
            return None;
        }
        match start {
            None => start = Some(h),
            Some(_) if h == next => {}
            Some(_) => return None,
        }
        let n = m_end.min(end) - pos;
        next = h + n;
        pos += n;
    }
    start
}

/// The direct path's memo of slices (`SliceMemo`) answers only under the epoch it
/// remembered: once the owner discards a cluster of a linear slice the core mapped, the
/// core's direct path no longer maps that cluster (it reads zeros), and still maps the
/// others where they are.
#[test]
fn core_direct_path_drops_a_remembered_linear_slice_the_owner_changed() {
    let mut rig = Rig::new(9, 1, false, 1);
    let cs = 4096u64;
    // 512-byte slices: 64 entries, 256 KiB. One write allocates them in order.
    let cov = 64 * cs;
    write_sync(&mut rig, 1, 0, 41, cov);
    flush_sync(&mut rig, 2);
    let core = rig.chains[1].clone();
    assert_eq!(core_read(&mut rig, 1, 3, 0, cs), vec![41; 8]);
    let map = |off: u64| direct(&core, off, cs, false);
    let h0 = direct(&core, 0, cov, false)
        .0
        .expect("a linear slice maps whole");
    // Remembered: these hit the memo.
    let hits = image(&core).l2_cache_stats().hits;
    assert_eq!(map(0), (Some(h0), true));
    assert_eq!(map(7 * cs), (Some(h0 + 7 * cs), true));
    // Each asked twice (the memo, then the general look-up's slice cache).
    assert_eq!(image(&core).l2_cache_stats().hits, hits + 4);
    // The owner discards cluster 0 (the slice's epoch moves).
    host::discard(&rig.chains[0], 4, 0, cs);
    rig.run(4).unwrap();
    assert_eq!(map(0), (None, false), "a discarded cluster is not mapped");
    assert_eq!(core_read(&mut rig, 1, 5, 0, cs), vec![0; 8]);
    assert_eq!(
        map(0),
        (None, false),
        "nor after the core fetched the changed slice"
    );
    assert_eq!(map(7 * cs).0, Some(h0 + 7 * cs));
    assert_eq!(core_read(&mut rig, 1, 6, 7 * cs, cs), vec![41; 8]);
    rig.close();
}

/// The memo answers for a slice that is not linear (mapped: one host cluster per entry)
/// as it does for a linear one: only under the epoch it remembered and, for a core's
/// in-place write, only while none of the clusters it answers for is metadata; a request
/// across two clusters, or into one without a host cluster, is the slice cache's.
#[test]
fn core_direct_path_maps_non_linear_slices_from_the_memo_until_they_change() {
    let mut rig = Rig::with_granule(12, 1, false, 1, 0);
    let cs = 4096u64;
    // 512-byte slices: 64 entries. Written last to first: every cluster of slice 0 lies
    // before the one it follows in the guest, so the slice is not linear.
    for c in (0..64u64).rev() {
        write_sync(&mut rig, 1000 + c, c * cs, 60 + c, cs);
    }
    flush_sync(&mut rig, 2);
    let core = rig.chains[1].clone();
    assert_eq!(core_read(&mut rig, 1, 3, 0, cs), vec![60; 8]);
    let read = |off: u64, len: u64| direct(&core, off, len, false);
    let h = |c: u64| read(c * cs, cs).0.expect("allocated data");
    let h5 = h(5);
    assert_ne!(h(6), h5 + cs, "the slice is not linear");
    // Remembered by the first look-ups: a range inside one cluster comes from the memo.
    assert_eq!(read(5 * cs + 512, 1024), (Some(h5 + 512), true));
    assert_eq!(read(9 * cs, cs), (Some(h(9)), true));
    assert_eq!(
        read(5 * cs + 512, cs).0,
        None,
        "two clusters apart on the device"
    );
    // The owner discards cluster 5 (the slice's epoch moves).
    host::discard(&rig.chains[0], 4, 5 * cs, cs);
    rig.run(4).unwrap();
    assert_eq!(
        read(5 * cs, cs),
        (None, false),
        "a discarded cluster is not mapped"
    );
    assert_eq!(core_read(&mut rig, 1, 5, 5 * cs, cs), vec![0; 8]);
    assert_eq!(
        read(5 * cs, 512),
        (None, false),
        "nor after the core fetched the slice"
    );
    let h9 = h(9);
    assert_eq!(read(9 * cs, 512), (Some(h9), true), "the others are, again");
    // In-place writes on the core, from the memo, until a cluster becomes metadata.
    let in_place = |off: u64| direct(&core, off, 512, true);
    assert_eq!(in_place(9 * cs).0, Some(h9));
    assert_eq!(in_place(9 * cs), (Some(h9), true));
    let sh = rig.owner().shared().expect("shared").clone();
    let h7 = h(7);
    sh.set_meta_cluster(h7 / cs);
    assert_eq!(
        in_place(7 * cs),
        (None, false),
        "an overwrite of new metadata"
    );
    assert_eq!(in_place(7 * cs), (None, false), "nor once remembered again");
    assert_eq!(in_place(9 * cs).0, Some(h9));
    assert_eq!(in_place(9 * cs), (Some(h9), true), "the others still");
    assert_eq!(read(7 * cs, 512).0, Some(h7), "a read is no overwrite");
    rig.close();
}

/// A core's in-place writes planned from its memo of slices stop at metadata
/// (ARCHITECTURE.md §9): a host cluster of the slice that is metadata when the core remembers the
/// slice, or that becomes metadata later (as a hostile refcount lets the allocator do), is
/// never planned in place; the slice's other clusters still are.
#[test]
fn core_memo_overwrites_stop_at_metadata() {
    let mut rig = Rig::new(11, 1, false, 1);
    let cs = 4096u64;
    // 512-byte slices: 64 entries, 256 KiB. One write allocates two slices in order.
    let cov = 64 * cs;
    write_sync(&mut rig, 1, 0, 51, 2 * cov);
    flush_sync(&mut rig, 2);
    let owner = rig.chains[0].clone();
    let linear_at = |off: u64| direct(&owner, off, cov, false).0.expect("a linear slice");
    let (h0, h1) = (linear_at(0), linear_at(cov));
    let sh = rig.owner().shared().expect("shared").clone();
    // Slice 0's fourth cluster is metadata before the core looks.
    sh.set_meta_cluster(h0 / cs + 3);
    let core = rig.chains[1].clone();
    assert_eq!(core_read(&mut rig, 1, 3, 0, cs), vec![51; 8]);
    assert_eq!(core_read(&mut rig, 1, 4, cov, cs), vec![51; 8]);
    let in_place = |off: u64| direct(&core, off, cs, true);
    assert_eq!(in_place(5 * cs).0, Some(h0 + 5 * cs));
    assert_eq!(in_place(3 * cs), (None, false), "an overwrite of metadata");
    assert_eq!(
        in_place(3 * cs),
        (None, false),
        "nor once the slice is remembered"
    );
    // Slice 1 is clear: remembered, its overwrites come from the memo.
    assert_eq!(in_place(cov + 2 * cs).0, Some(h1 + 2 * cs));
    assert_eq!(in_place(cov + 7 * cs), (Some(h1 + 7 * cs), true));
    // Then one of its clusters becomes metadata.
    sh.set_meta_cluster(h1 / cs + 7);
    assert_eq!(
        in_place(cov + 7 * cs),
        (None, false),
        "an overwrite of new metadata"
    );
    // The slice's other clusters: by the general look-up, which tests the cluster itself
    // (the memo no longer answers for a slice that holds metadata).
    assert_eq!(in_place(cov + 2 * cs), (Some(h1 + 2 * cs), false));
    rig.close();
}

#[test]
fn core_routes_writes_by_its_cached_slice() {
    // `Chain::route_write` on a core: an uncached slice is loaded here first (local); a
    // current slice sends first writes to the owner and keeps overwrites here (direct); a
    // slice the owner changed and holds dirty sends the write to the owner without a fetch.
    // (One cluster per first write: the test names which clusters are unallocated.)
    let mut rig = Rig::with_granule(5, 1, false, 1, 0);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 31, cs);
    flush_sync(&mut rig, 2);
    let core = rig.chains[1].clone();
    assert_eq!(
        route(&core, 0, cs),
        "local",
        "uncached: load it on the core"
    );
    // 4 KiB clusters: one L2 table covers 2 MiB; the second has no L2 table yet.
    assert_eq!(
        route(&core, 2 << 20, cs),
        "owner",
        "no L2 table: only the owner can allocate one"
    );
    assert_eq!(direct(&core, 0, cs, true).0, None, "nothing cached yet");
    // The core caches the (clean) slice.
    assert_eq!(core_read(&mut rig, 1, 3, 0, cs), vec![31; 8]);
    let h = general(&core, 0, cs, true).expect("in place on the core");
    match core.route_write(0, cs) {
        WriteRoute::Direct(g) => {
            assert_eq!(
                (g.dev(), g.host().0),
                (image(&core).dev(), h),
                "routed where the general look-up maps"
            );
            g.finish(core.exec());
        }
        other => panic!("an overwrite of an allocated, cached cluster is direct, not {other:?}"),
    }
    let before = image(&core).l2_cache_stats();
    assert_eq!(
        route(&core, cs, cs),
        "owner",
        "first write: the owner allocates"
    );
    assert_eq!(
        image(&core).l2_cache_stats(),
        before,
        "routing looks the slice up without counting a hit"
    );
    assert_eq!(route(&core, 0, 2 * cs), "owner", "partly a first write");
    // The owner allocates cluster 1 in the same slice and keeps it dirty: the core's copy
    // is outdated, but the change only added a mapping, so the overwrite of cluster 0 stays
    // on the core; one of cluster 1, which the copy shows unallocated, goes to the owner
    // rather than fetching the owner's copy.
    write_sync(&mut rig, 4, cs, 32, cs);
    assert_eq!(
        route(&core, 0, cs),
        "direct, older copy",
        "only an addition since the copy"
    );
    assert!(kept_host(&rig, 1, 0, cs).is_some());
    assert_eq!(
        route(&core, cs, cs),
        "owner, may be in place",
        "allocated after the copy, dirty on the owner"
    );
    // Once written back (clean, even epoch) the core reloads it itself.
    flush_sync(&mut rig, 5);
    assert_eq!(
        route(&core, cs, cs),
        "local",
        "clean again: the core reads it"
    );
    assert_eq!(
        core_read(&mut rig, 1, 6, 0, 2 * cs),
        [vec![31; 8], vec![32; 8]].concat()
    );
    assert_eq!(
        route(&core, cs, cs),
        "direct",
        "now allocated and current on the core"
    );
    assert_eq!(
        route(&core, 1, cs),
        "local",
        "unaligned: the engine path says why"
    );
    // The owner never defers to itself.
    assert_eq!(route(&rig.chains[0], 2 * cs, cs), "local");
    assert_eq!(core_read(&mut rig, 1, 7, cs, cs), vec![32; 8]);
    // The owner runs a write routed `slow` on its slow path: a first write (cluster 2, in
    // the cached slice) and, as when the owner allocated a cluster after the core routed a
    // write to it, one already in place (cluster 0).
    assert_eq!(route(&core, 2 * cs, cs), "owner");
    let slow_tasks = rig.chains[0].exec().stats().tasks_spawned;
    for (tag, off, id) in [(20, 2 * cs, 33), (21, 0, 34)] {
        let (buf, _) = fill(id, off, cs);
        host::write_not_in_place(&rig.chains[0], tag, off, BufSlice::whole(buf));
        rig.run(tag).unwrap();
    }
    assert_eq!(
        rig.chains[0].exec().stats().tasks_spawned,
        slow_tasks + 2,
        "both ran as slow-path tasks"
    );
    flush_sync(&mut rig, 22);
    assert_eq!(
        core_read(&mut rig, 1, 23, 0, 3 * cs),
        [vec![34; 8], vec![32; 8], vec![33; 8]].concat()
    );
    // Every route left the grace period it entered: with nothing in flight, the generation
    // advances twice (a request still counted in either parity would hold it).
    let grace = image(&rig.chains[0])
        .shared()
        .expect("shared image")
        .grace();
    let g = grace.now();
    assert_eq!(grace.try_advance(), g + 1);
    assert_eq!(
        grace.try_advance(),
        g + 2,
        "a route left a grace entry behind"
    );
    rig.close();
}

#[test]
fn owner_of_a_shared_image_refuses_a_write_through_an_entry_into_metadata() {
    // ARCHITECTURE.md §7 rule 6 on the owner of a shared image: a (hostile) L2 entry that points
    // at the image's own L1 table, in a slice the owner loads from the device, is not
    // written through: the write fails and the L1 table stays as it was.
    let mut rig = Rig::new(5, 1, false, 1);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 21, cs);
    // Nine more slices (64 clusters each) through the owner's cache of eight: slice 0
    // leaves it, and everything reaches the device.
    for i in 1..=9u64 {
        write_sync(&mut rig, 1 + i, i * 64 * cs, 30 + i, cs);
    }
    flush_sync(&mut rig, 20);
    let (l1_off, l1_before) = point_cluster_0_at_the_l1_table(&rig);
    let (buf, _) = fill(22, 0, cs);
    host::write(&rig.chains[0], 21, 0, BufSlice::whole(buf));
    let r = rig.run(21);
    assert!(
        r.is_err(),
        "a write through an entry into the L1 table succeeded"
    );
    assert_eq!(
        rig.disk.borrow()[l1_off as usize..(l1_off + cs) as usize],
        l1_before[..],
        "the L1 table was overwritten"
    );
}

#[test]
fn a_core_takes_the_size_the_owner_grew_the_disk_to() {
    let mut rig = Rig::new(9, 1, false, 2);
    let cs = 4096u64;
    let old = rig.size;
    write_sync(&mut rig, 1, 0, 21, cs);
    // Past the end: refused on the core.
    let buf = HeapBuf::new(cs as usize);
    host::read(&rig.chains[1], 2, old, BufSlice::whole(buf));
    assert!(rig.run(2).is_err(), "a read past the end was accepted");
    // The owner grows the disk sixteen times (4 KiB clusters: its L1 table moves).
    let c = rig.chains[0].clone();
    let new = old * 16;
    rig.execs[0]
        .block_on(async move { c.resize(new, false).await })
        .unwrap();
    assert_eq!(rig.chains[0].size(), new);
    // The core takes the new size with its first request past the old end, and sees the
    // owner's writes there and before.
    write_sync(&mut rig, 3, new - cs, 22, cs);
    assert_eq!(core_read(&mut rig, 1, 4, new - cs, cs), vec![22; 8]);
    assert_eq!(rig.chains[1].size(), new);
    assert_eq!(core_read(&mut rig, 1, 5, 0, cs), vec![21; 8]);
    assert_eq!(core_read(&mut rig, 1, 6, old, cs), vec![0; 8]);
    rig.close();
}

/// A core made from a seed taken before the owner grew the device (a reactor core made
/// while the owner allocates into a file that grows) reads what the owner wrote past the
/// old end: it once kept the
/// seed's device size for its checks while believing itself up to date, and called the
/// owner's new clusters corrupt ("data cluster past the end of the device").
#[test]
fn a_core_made_from_an_older_seed_reads_clusters_allocated_since() {
    let mut rig = Rig::new(11, 1, false, 2);
    let cs = 4096u64;
    let seed = rig.owner().core_seed().unwrap();
    // Allocations grow the device (4 KiB clusters, the image ends after its metadata).
    for i in 0..8 {
        write_sync(&mut rig, 100 + i, i * cs, 40 + i, cs);
    }
    let c = rig.add_core(seed, 0);
    for i in 0..8 {
        assert_eq!(core_read(&mut rig, c, 200 + i, i * cs, cs), vec![40 + i; 8]);
    }
    // And after a write-back, from the device.
    flush_sync(&mut rig, 300);
    let seed = rig.owner().core_seed().unwrap();
    let c = rig.add_core(seed, 0);
    assert_eq!(core_read(&mut rig, c, 301, 7 * cs, cs), vec![47; 8]);
    rig.close();
}

/// Runs `op` on the owner's image (its executor only; the cores are idle, as under SPDK's
/// quiesce).
fn owner_op<T: 'static>(
    rig: &mut Rig,
    op: impl AsyncFnOnce(&Qcow2<Channel>) -> qcow2_engine::Result<T> + 'static,
) -> T {
    let c = rig.chains[0].clone();
    rig.execs[0]
        .block_on(async move { op(image(&c)).await })
        .unwrap()
}

/// Sector ids of guest bytes `[0, len)` of snapshot `name` (or the active disk) of the
/// rig's closed image, read by `qemu-img`.
fn qemu_ids(rig: &Rig, name: Option<&str>, len: u64) -> Vec<u64> {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.qcow2");
    let raw = dir.path().join("out.raw");
    std::fs::write(&img, rig.disk.borrow().as_slice()).unwrap();
    let (img_s, raw_s) = (img.to_str().unwrap(), raw.to_str().unwrap());
    let out = qemu_img(&["check", "-f", "qcow2", img_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let mut args = vec!["convert", "-f", "qcow2", "-O", "raw"];
    if let Some(n) = name {
        args.extend(["-l", n]);
    }
    args.extend([img_s, raw_s]);
    let out = qemu_img(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&raw).unwrap();
    bytes[..len as usize]
        .chunks(SECTOR as usize)
        .enumerate()
        .map(|(i, b)| decode(i as u64, b).unwrap())
        .collect()
}

#[test]
fn core_stops_writing_in_place_after_a_snapshot_and_again_after_its_deletion() {
    // A snapshot's shadow commit gives the active disk new L2 tables (COPIED cleared): a
    // core that cached the old slice (COPIED set) must not write in place into the cluster
    // the snapshot now shares; after the snapshot is deleted, the core must see COPIED set
    // again (ARCHITECTURE.md §13, cores).
    let mut rig = Rig::new(5, 1, false, 2);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 31, cs);
    write_sync(&mut rig, 2, 2 * cs, 41, cs);
    flush_sync(&mut rig, 3);
    assert_eq!(core_read(&mut rig, 1, 4, 0, cs), vec![31; 8]);
    assert_eq!(core_read(&mut rig, 1, 5, 2 * cs, cs), vec![41; 8]);
    owner_op(&mut rig, async |q| {
        q.snapshot_create("s", Default::default()).await
    });
    let (buf, _) = fill(32, 0, cs);
    let buf = BufSlice::whole(buf);
    assert!(
        !rig.chains[1].try_submit_write(6, 0, &buf),
        "the core wrote in place into a cluster the snapshot shares"
    );
    host::write(&rig.chains[0], 6, 0, buf);
    rig.run(6).unwrap();
    flush_sync(&mut rig, 7);
    // The core sees the copy the owner made. (Its write may still go to the owner: the
    // copy may reuse a cluster the commit freed, which the cores' bitmap still marks as
    // metadata.)
    assert_eq!(core_read(&mut rig, 1, 8, 0, cs), vec![32; 8]);
    let (buf, _) = fill(33, 0, cs);
    let buf = BufSlice::whole(buf);
    if !rig.chains[1].try_submit_write(9, 0, &buf) {
        host::write(&rig.chains[0], 9, 0, buf);
    }
    rig.run(9).unwrap();
    flush_sync(&mut rig, 10);
    let three = 3 * cs;
    assert_eq!(
        qemu_ids(&rig, Some("s"), three),
        [vec![31; 8], vec![0; 8], vec![41; 8]].concat()
    );
    // Cluster 2 is shared with the snapshot: no in-place write until it is deleted.
    let (buf, _) = fill(42, 2 * cs, cs);
    assert!(!rig.chains[1].try_submit_write(11, 2 * cs, &BufSlice::whole(buf)));
    owner_op(&mut rig, async |q| q.snapshot_delete("s").await);
    assert_eq!(core_read(&mut rig, 1, 12, 2 * cs, cs), vec![41; 8]);
    let (buf, _) = fill(42, 2 * cs, cs);
    assert!(
        rig.chains[1].try_submit_write(13, 2 * cs, &BufSlice::whole(buf)),
        "the core did not see COPIED set again after the delete"
    );
    rig.run(13).unwrap();
    rig.close();
    assert_eq!(
        qemu_ids(&rig, None, three),
        [vec![33; 8], vec![0; 8], vec![42; 8]].concat()
    );
}

#[test]
fn a_group_taken_ahead_is_never_freed_clusters_brought_back_in_its_allocation() {
    // A first write takes its aligned group of clusters ahead only when the next host run
    // is fresh (reads zeros without a write). Clusters a discard freed come back when
    // their grace period is over, at an allocation, and lower where the next run starts:
    // the look at freshness must see that, or the group's other clusters land in the
    // freed clusters (and the write path asked the guest buffer for their bytes, which
    // it does not hold).
    let mut rig = Rig::with_granule(5, 1, false, 0, 64 << 10);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 51, 16 * cs);
    write_sync(&mut rig, 2, 64 * cs, 52, cs);
    // A request in flight on the core holds the grace period back over the discard and
    // the write-back after which its clusters are free (entries that no longer map them
    // on the disk): they come back at an allocation after it is over.
    let parity = rig.execs[1].guest_enter();
    owner_sync(&mut rig, 3, |o, t| host::discard(o, t, 0, 16 * cs));
    flush_sync(&mut rig, 4);
    write_sync(&mut rig, 5, 96 * cs, 53, cs);
    rig.execs[1].guest_exit(parity);
    // First writes, each at the start of a new group, each after the interval between two
    // advances of the grace period: the freed clusters come back at one of them.
    let groups = 8u64;
    for i in 0..groups {
        std::thread::sleep(std::time::Duration::from_millis(2));
        write_sync(&mut rig, 10 + i, (128 + 16 * i) * cs, 60 + i, cs);
    }
    flush_sync(&mut rig, 30);
    let ids = qemu_ids(&rig, None, (128 + 16 * groups) * cs);
    let per = cs / SECTOR;
    let expect = |s: u64| match s / per {
        c if c < 16 => 0,
        64 => 52,
        96 => 53,
        c if c >= 128 && (c - 128) % 16 == 0 => 60 + (c - 128) / 16,
        _ => 0,
    };
    for (s, id) in ids.iter().enumerate() {
        assert_eq!(*id, expect(s as u64), "sector {s}");
    }
    assert!(
        rig.owner().owner_stats().unwrap().clusters_taken_ahead > 0,
        "groups were taken ahead before the reclaim"
    );
    rig.close();
}

/// Discarded clusters' bytes on the test disk: 512-byte sectors the device filled with its
/// discard garbage.
fn discarded_sectors(rig: &Rig) -> usize {
    rig.disk
        .borrow()
        .chunks_exact(SECTOR as usize)
        .filter(|s| s.iter().all(|b| *b == 0xd5))
        .count()
}

#[test]
fn freed_clusters_are_discarded_only_after_the_cores_grace_period() {
    // A request in flight on a core may still read a cluster through the mapping it
    // resolved before the owner freed it: the device discards the cluster only once the
    // grace period is over, like its reuse, however many write-backs come meanwhile.
    let mut rig = Rig::new(7, 1, false, 0);
    let cs = 4096u64;
    write_sync(&mut rig, 1, 0, 51, 16 * cs);
    let parity = rig.execs[1].guest_enter();
    owner_sync(&mut rig, 2, |o, t| host::discard(o, t, 0, 16 * cs));
    for tag in 3..6 {
        flush_sync(&mut rig, tag);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        discarded_sectors(&rig),
        0,
        "discarded under a request in flight"
    );
    rig.execs[1].guest_exit(parity);
    for tag in 6..9 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        flush_sync(&mut rig, tag);
    }
    assert_eq!(
        discarded_sectors(&rig) as u64,
        16 * cs / SECTOR,
        "the freed clusters are discarded once the grace period is over"
    );
    rig.close();
}

/// ARCHITECTURE.md §10: a core's kept compressed cluster (the one it decompressed last) is
/// named by the reuse generation the owner moves before freed clusters go back to its
/// allocator. A stream the owner writes where a freed one was, at the same place and of the
/// same length, is read by the core, not served from the cluster it kept of the old one.
#[test]
fn a_core_reads_a_new_stream_written_where_the_one_it_kept_was_freed() {
    let mut rig = Rig::new(11, 1, false, 2);
    let cs = 4096u64;
    let compressed = |rig: &mut Rig, off: u64, byte: u8| {
        let c = rig.chains[0].clone();
        rig.execs[0]
            .block_on(async move { c.write_compressed(off, &vec![byte; cs as usize]).await })
            .unwrap();
    };
    let core_bytes = |rig: &mut Rig, tag: u64, off: u64| {
        let buf = HeapBuf::new(512);
        host::read(&rig.chains[1], tag, off, BufSlice::whole(buf.clone()));
        rig.run_core(1, tag).unwrap();
        buf.to_vec()
    };
    compressed(&mut rig, 0, 0x11);
    flush_sync(&mut rig, 1);
    let old = mem_chain::compressed_at(&rig.execs[0], &rig.chains[0], 0);
    assert!(core_bytes(&mut rig, 2, 512) == [0x11; 512]);
    // Cluster 0 moves out of its stream; the stream's cluster is free once the metadata
    // is stable and the cores' grace period over (flushes a while apart advance it).
    write_sync(&mut rig, 3, 0, 21, cs);
    for t in 0..8 {
        flush_sync(&mut rig, 4 + t);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    compressed(&mut rig, cs, 0x22);
    let new = mem_chain::compressed_at(&rig.execs[0], &rig.chains[0], cs);
    assert_eq!(
        (new.offset, new.len),
        (old.offset, old.len),
        "the test needs the new stream where the old one was"
    );
    assert!(core_bytes(&mut rig, 20, cs + 512) == [0x22; 512]);
    rig.close();
}

/// A rig (`seed`) on a 4 MiB image of 4 KiB clusters made by QEMU, filled by qemu-io first
/// when `written`, with one enabled persistent bitmap "b0" of `granularity`-byte granules.
fn rig_with_bitmap(seed: u64, granularity: u64, written: bool) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.qcow2");
    let p = path.to_str().unwrap();
    let ok = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ok(qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=4096",
        p,
        "4M",
    ]));
    if written {
        let write = ["-f", "qcow2", "-c", "write -P 1 0 4M", p];
        ok(Command::new("qemu-io")
            .args(write)
            .output()
            .expect("qemu-io"));
    }
    ok(qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        &granularity.to_string(),
        p,
        "b0",
    ]));
    Rig::with_image(seed, 1, std::fs::read(&path).unwrap())
}

/// Writes a core makes in place (never seen by the owner) reach the persistent bitmap the
/// owner stores at close: every core marks the bitmap the owner loaded.
#[test]
fn in_place_writes_on_a_core_reach_the_owners_persistent_bitmap() {
    let mut rig = rig_with_bitmap(3, 4096, true);
    let cs = 4096u64;
    // Core 1 overwrites clusters 100 and 300 + 512 bytes through its in-place path (loading
    // their slices), then cluster 101 through a direct grant; the owner zeroes cluster 700.
    for (tag, off, len) in [(1, 100 * cs, cs), (2, 300 * cs + 512, 1024)] {
        let (buf, _) = fill(4 + tag, off, len);
        host::engine_write(&rig.chains[1], tag, off, BufSlice::whole(buf));
        rig.run_core(1, tag).unwrap();
    }
    let (buf, _) = fill(7, 101 * cs, cs);
    match rig.chains[1].route_write(101 * cs, cs) {
        WriteRoute::Direct(g) => rig.chains[1].submit_direct(4, g, BufSlice::whole(buf)),
        _ => panic!("not a direct write on the core"),
    }
    rig.run_core(1, 4).unwrap();
    host::write_zeroes(&rig.chains[0], 3, 700 * cs, cs, false);
    rig.run(3).unwrap();
    rig.close();
    let img = rig.disk.borrow().clone();
    let maps = mem_chain::bitmaps_of(&img, rig.size);
    let (name, in_use, bits) = &maps[0];
    assert_eq!((name.as_str(), *in_use), ("b0", false));
    let set: Vec<usize> = (0..bits.len()).filter(|&g| bits[g]).collect();
    assert_eq!(set, vec![100, 101, 300, 700]);
}

/// A shared disk grown online past one segment of a bitmap's words (2^20 granules: 512 MiB
/// at 512-byte granules) gets the words for its new range before any core may write
/// there: a write past the old end, routed by a core, is in the stored bitmap.
#[test]
fn writes_past_the_end_a_shared_disk_grew_to_reach_its_persistent_bitmap() {
    let mut rig = rig_with_bitmap(5, 512, false);
    let (size, off, len) = (1u64 << 30, 600u64 << 20, 4096u64);
    let c = rig.chains[0].clone();
    rig.execs[0]
        .block_on(async move { c.resize(size, false).await })
        .unwrap();
    // The core takes the new size and routes the write (an allocation: the owner's).
    assert!(!matches!(
        rig.chains[1].route_write(off, len),
        WriteRoute::Direct(_)
    ));
    let (buf, _) = fill(9, off, len);
    host::write(&rig.chains[0], 1, off, BufSlice::whole(buf));
    rig.run(1).unwrap();
    rig.close();
    let img = rig.disk.borrow().clone();
    let (_, in_use, bits) = &mem_chain::bitmaps_of(&img, size)[0];
    assert!(!in_use);
    let set: Vec<u64> = (0..bits.len() as u64)
        .filter(|&g| bits[g as usize])
        .collect();
    assert_eq!(set, (off / 512..(off + len) / 512).collect::<Vec<_>>());
}

/// A bitmap the owner adds while cores share the image records their writes from then on
/// (it takes a slot every core already marks); one it removes records nothing more.
#[test]
fn a_bitmap_added_while_cores_share_the_image_records_their_writes() {
    let mut rig = rig_with_bitmap(7, 4096, true);
    let cs = 4096u64;
    let c = rig.chains[0].clone();
    rig.execs[0]
        .block_on(async move {
            let Some(Layer::Qcow2(q)) = c.layers().first() else {
                panic!("a qcow2 layer")
            };
            q.add_bitmap("added", Some(4096), true).await?;
            q.remove_bitmap("b0").await
        })
        .unwrap();
    let (buf, _) = fill(5, 200 * cs, cs);
    host::engine_write(&rig.chains[1], 1, 200 * cs, BufSlice::whole(buf));
    rig.run_core(1, 1).unwrap();
    rig.close();
    let img = rig.disk.borrow().clone();
    let maps = mem_chain::bitmaps_of(&img, rig.size);
    assert_eq!(maps.len(), 1);
    let (name, in_use, bits) = &maps[0];
    assert_eq!((name.as_str(), *in_use), ("added", false));
    let set: Vec<usize> = (0..bits.len()).filter(|&g| bits[g]).collect();
    assert_eq!(set, vec![200]);
}

/// #48: a first write needing a new L2 table is planned on the spot (reserved, not sent
/// with its data); a core that holds no copy of a slice the owner holds dirty sends a
/// write there at once, the owner answers the overwrite in place, and once told so the
/// core loads the owner's copy and decides the next overwrite itself. Every core reads
/// what was written.
#[test]
fn a_core_sends_writes_into_a_dirty_slice_it_lacks_and_loads_it_after_an_overwrite() {
    let mut rig = Rig::with_granule(5, 2, false, 2, 0);
    // The first L2 table (and the refcounts in memory), by the owner's task.
    write_sync(&mut rig, 90, 0, 5, 4096);
    const T: u64 = 2 << 20;
    let Reserved::Write { ticket, host } = rig.chains[0].reserve_write(T, 4096) else {
        panic!("a first write needing a new L2 table was not reserved");
    };
    let (buf, _) = fill(31, T, 4096);
    let entry = rig.chains[1].exec().guest_enter();
    rig.chains[1].write_reserved(1 | RESERVED, host, BufSlice::whole(buf), entry);
    rig.run_core(1, 1 | RESERVED).unwrap();
    rig.chains[0].commit_reserved(ticket, 1, Ok(()));
    rig.run(1).unwrap();
    // Dirty on the owner, no copy here: to the owner without asking for one.
    assert_eq!(
        route(&rig.chains[1], T + 1024, 512),
        "owner, may be in place"
    );
    let entry = rig.chains[1].exec().guest_enter();
    let Reserved::InPlace { host } = rig.chains[0].reserve_write(T + 1024, 512) else {
        panic!("an overwrite not answered in place");
    };
    let (buf, _) = fill(32, T + 1024, 512);
    rig.chains[1].write_reserved(2, host, BufSlice::whole(buf), entry);
    rig.run_core(1, 2).unwrap();
    rig.chains[1].answered_in_place(T + 1024);
    for _ in 0..1000 {
        rig.poll(1);
        while rig.answer(None) {}
        while rig.deliver(1) {}
    }
    let r = route(&rig.chains[1], T + 2048, 512);
    assert!(r.starts_with("direct"), "{r}");
    // The owner has not changed the slice since: the core's copy is current.
    assert_eq!(
        route(&rig.chains[2], T + 2048, 512),
        "owner, may be in place"
    );
    for c in 1..=2 {
        let ids = core_read(&mut rig, c, 10 + c as u64, T, 4096);
        assert_eq!(ids, vec![31, 31, 32, 31, 31, 31, 31, 31], "core {c}");
    }
    rig.close();
    let ids = qemu_ids(&rig, None, T + 4096);
    assert_eq!(
        ids[(T / SECTOR) as usize..],
        [31, 31, 32, 31, 31, 31, 31, 31]
    );
}
