//! The request plan's policy, through a host double: what `Chain::plan` decides for each
//! kind of request on the metadata owner, a core replica and a read-only image, and that a
//! host which only takes those steps (as the SPDK module's channels and metadata thread
//! and the tool's reactors do) serves every byte right. Runs on every machine: this is
//! what the SPDK host does, without SPDK.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::exec::Outcome;
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::SharedDisk as Disk;
use qcow2_engine::{
    Chain, Error, Exec, Layer, Op, OpenOptions, OwnerLink, Qcow2, Request, Role, Step,
};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

const CLUSTER: u64 = 4096;
const SIZE: u64 = 4 << 20;

/// What a step was, for assertions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Took {
    Complete,
    Direct,
    Task,
    Owner(Op),
}

/// A core's requests for slices, answered by the test between polls.
type Asks = Rc<RefCell<VecDeque<(u64, u64)>>>;

struct Link(Asks);

impl OwnerLink for Link {
    fn ask_slice(&self, key: u64, ticket: u64) {
        self.0.borrow_mut().push_back((key, ticket));
    }
}

/// One host: a chain and its executor, taking the steps its plans return. Requests for
/// the owner wait in `outbox` with their data.
struct Host {
    exec: Exec<Disk>,
    chain: Rc<Chain<Disk>>,
    outbox: Vec<(u64, Request, Option<BufSlice<HeapBuf>>)>,
    /// Writes running as tasks here (they may end as `Outcome::ToOwner`).
    tasks: Vec<(u64, Request, Option<BufSlice<HeapBuf>>)>,
    done: Vec<(u64, Result<(), String>)>,
}

impl Host {
    /// Plans `req` and takes the step, as the hosts do. Returns what the step was.
    fn submit(&mut self, tag: u64, req: Request, buf: Option<BufSlice<HeapBuf>>) -> Took {
        let step = match &buf {
            Some(b) => self.chain.plan(req, || b.clone()),
            None => self
                .chain
                .plan(req, || -> BufSlice<HeapBuf> { unreachable!("no data") }),
        };
        match step {
            Step::Complete(r) => {
                self.done.push((tag, r.map_err(|e| e.to_string())));
                Took::Complete
            }
            Step::Direct(grant) => {
                self.chain
                    .submit_direct(tag, grant, buf.expect("direct: data"));
                Took::Direct
            }
            Step::Task(task) => {
                // A core's write in place may still be handed to the owner: kept for that.
                if req.op == Op::Write {
                    self.tasks.push((tag, req, buf.clone()));
                }
                self.chain.start(task, tag, buf);
                Took::Task
            }
            Step::Owner(op) => {
                self.outbox.push((tag, Request { op, ..req }, buf));
                Took::Owner(op)
            }
        }
    }

    /// Polls the executor: a write handed over (not in place here after all) goes to the
    /// owner's outbox, as the hosts send it.
    fn poll(&mut self) {
        let mut handed = Vec::new();
        let done = &mut self.done;
        self.exec.poll_outcomes(&mut |tag, o| match o {
            Outcome::Done(r) => done.push((tag, r.map_err(|e| e.to_string()))),
            Outcome::ToOwner => handed.push(tag),
        });
        for tag in handed {
            let i = self.tasks.iter().position(|(t, _, _)| *t == tag);
            let w = self.tasks.swap_remove(i.expect("a handed-over write"));
            self.outbox.push(w);
        }
    }

    fn result(&self, tag: u64) -> Option<&Result<(), String>> {
        self.done.iter().find(|(t, _)| *t == tag).map(|(_, r)| r)
    }
}

/// An owner and one core replica on one in-memory disk, with 4 KiB clusters.
struct Rig {
    owner: Host,
    core: Host,
    asks: Asks,
}

impl Rig {
    fn new() -> Rig {
        Rig::with_core(OpenOptions::default())
    }

    /// A rig whose core replica opens with `core` (writable: its memo answers overwrites,
    /// as the SPDK module's replicas do).
    fn with_core(core: OpenOptions) -> Rig {
        // The cores' light grace entries, as both hosts run them (decided before the first
        // image is shared, for every test of this binary alike).
        qcow2_engine::coherency::fences::install_membarrier();
        let disk = Disk::new(&Rc::default());
        let oexec: Exec<Disk> = Exec::new();
        let id = oexec.add_device(disk.channel());
        let e2 = oexec.clone();
        let copts = CreateOptions {
            size: SIZE,
            cluster_bits: 12,
            ..Default::default()
        };
        oexec
            .block_on(async move { create(&e2, id, &copts).await })
            .unwrap();
        let e2 = oexec.clone();
        let opts = OpenOptions {
            writable: true,
            ..Default::default()
        };
        let mut q = oexec
            .block_on(async move { Qcow2::open(&e2, id, opts).await })
            .unwrap();
        q.share();
        let seed = q.core_seed().unwrap();
        let owner = Chain::new(&oexec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
        let cexec: Exec<Disk> = Exec::new();
        let cdev = cexec.add_device(disk);
        let asks: Asks = Rc::default();
        let link = Box::new(Link(asks.clone()));
        let r = Qcow2::from_seed(seed, &cexec, cdev, core, link).unwrap();
        let core = Chain::new(&cexec, vec![Layer::Qcow2(Box::new(r))]).unwrap();
        let host = |exec, chain| Host {
            exec,
            chain,
            outbox: Vec::new(),
            tasks: Vec::new(),
            done: Vec::new(),
        };
        Rig {
            owner: host(oexec, owner),
            core: host(cexec, core),
            asks,
        }
    }

    /// Runs both hosts until nothing moves: the core's requests for the owner go there
    /// (and their completions come back), slice requests are answered.
    fn settle(&mut self) {
        let mut idle = 0;
        for _ in 0..10_000 {
            let mut moved = false;
            self.core.poll();
            for (tag, req, buf) in std::mem::take(&mut self.core.outbox) {
                moved = true;
                let took = self.owner.submit(tag, req, buf);
                assert!(!matches!(took, Took::Owner(_)), "the owner sent {req:?} on");
            }
            loop {
                let next = self.asks.borrow_mut().pop_front();
                let Some((key, ticket)) = next else {
                    break;
                };
                moved = true;
                let reply = match &self.owner.chain.layers()[0] {
                    Layer::Qcow2(q) => q.slice_for_core(key),
                    Layer::Raw { .. } => unreachable!(),
                };
                if let Layer::Qcow2(q) = &self.core.chain.layers()[0] {
                    q.deliver_slice(ticket, reply);
                }
            }
            let done = &mut self.owner.done;
            moved |= self
                .owner
                .exec
                .poll(&mut |tag, r| done.push((tag, r.map_err(|e| e.to_string()))))
                > 0;
            // (The owner may keep a task waiting on its own, e.g. for a grace period.)
            idle = if moved || self.core.exec.busy() {
                0
            } else {
                idle + 1
            };
            if idle > 100 {
                return;
            }
        }
        panic!("the hosts did not settle");
    }

    /// Whether request `tag` completed successfully on either host.
    fn ok(&self, tag: u64) -> bool {
        let r = self.core.result(tag).or_else(|| self.owner.result(tag));
        matches!(r, Some(Ok(())))
    }
}

fn data(byte: u8, len: u64) -> BufSlice<HeapBuf> {
    let b = HeapBuf::new(len as usize);
    b.fill(0, len as usize, byte);
    BufSlice::whole(b)
}

fn bytes(b: &BufSlice<HeapBuf>) -> Vec<u8> {
    let mut v = vec![0u8; b.len];
    b.copy_out(0, &mut v);
    v
}

#[test]
fn roles_follow_the_image() {
    let rig = Rig::new();
    assert_eq!(rig.owner.chain.role(), Role::Owner);
    assert_eq!(rig.core.chain.role(), Role::Replica);
}

#[test]
fn a_core_sends_what_changes_metadata_to_the_owner_and_keeps_overwrites() {
    let mut rig = Rig::new();
    let w = |off| Request::new(Op::Write, off, CLUSTER);
    // A first write: not in place on the core, whose metadata is current (an empty
    // slice): the owner's slow path at once.
    let took = rig.core.submit(1, w(0), Some(data(0xa1, CLUSTER)));
    assert!(
        matches!(took, Took::Owner(Op::WriteNotInPlace) | Took::Task),
        "{took:?}"
    );
    rig.settle();
    assert!(rig.ok(1));
    // Write zeroes, discard, flush: always the owner's.
    for (tag, op) in [(2, Op::WriteZeroes), (3, Op::Discard), (4, Op::Flush)] {
        let off = 8 * CLUSTER;
        let took = rig.core.submit(tag, Request::new(op, off, CLUSTER), None);
        assert_eq!(took, Took::Owner(op));
    }
    rig.settle();
    assert!((2..=4).all(|t| rig.ok(t)));
    // Overwrites of the allocated cluster stay on the core: once its slice is here, the
    // direct path.
    let mut direct = false;
    for tags in 10..14 {
        let took = rig.core.submit(tags, w(0), Some(data(0xb2, CLUSTER)));
        assert!(
            !matches!(took, Took::Owner(Op::WriteNotInPlace)),
            "{took:?}"
        );
        direct |= took == Took::Direct;
        rig.settle();
        assert!(rig.ok(tags));
    }
    assert!(
        direct,
        "an overwrite of a cluster the core has mapped goes direct"
    );
    let s = rig.core.chain.counters().requests();
    assert!(s.to_owner >= 3, "{s:?}");
    assert!(s.writes_here >= 1, "{s:?}");
    // The owner sends nothing on.
    assert_eq!(rig.owner.chain.counters().requests().to_owner, 0);
    // Every byte reads back on both hosts.
    for host in [&mut rig.core, &mut rig.owner] {
        let back = data(0, CLUSTER);
        let took = host.submit(100, Request::new(Op::Read, 0, CLUSTER), Some(back.clone()));
        assert_ne!(took, Took::Owner(Op::Read));
        for _ in 0..100 {
            host.exec.poll(&mut |_, r| r.unwrap());
        }
        assert_eq!(bytes(&back), vec![0xb2; CLUSTER as usize]);
    }
}

#[test]
fn the_write_plans_fast_half_grants_what_the_plan_grants() {
    let mut rig = Rig::with_core(OpenOptions {
        writable: true,
        ..Default::default()
    });
    let w = |off| Request::new(Op::Write, off, CLUSTER);
    // Cluster 0 allocated by the owner and its slice written back (a core sends writes
    // to a slice the owner holds dirty), then overwritten on the core until its slice is
    // there and the memo answers.
    rig.core.submit(1, w(0), Some(data(0xa1, CLUSTER)));
    rig.settle();
    rig.core.submit(7, Request::new(Op::Flush, 0, 0), None);
    rig.settle();
    for tag in 2..6 {
        rig.core.submit(tag, w(0), Some(data(0xa2, CLUSTER)));
        rig.settle();
        assert!(rig.ok(tag));
    }
    // Not on the owner (its writes take the plan), nor for a cluster not allocated, which
    // leaves no count behind.
    assert!(rig.owner.chain.plan_write_fast(0, CLUSTER).is_none());
    let here = rig.core.chain.counters().requests().writes_here;
    assert!(rig
        .core
        .chain
        .plan_write_fast(8 * CLUSTER, CLUSTER)
        .is_none());
    assert!(rig.core.chain.plan_write_fast(SIZE, CLUSTER).is_none());
    assert_eq!(rig.core.chain.counters().requests().writes_here, here);
    // The allocated cluster: the grant the plan gives, counted once each. (Without the
    // process-wide barrier a core's entries take the full fence, out of line: the fast
    // half declines them all, and the plan grants alone.)
    let chain = rig.core.chain.clone();
    if !qcow2_engine::coherency::fences::asymmetric() {
        assert!(chain.plan_write_fast(0, CLUSTER).is_none());
        grace_drains(&rig.owner.chain);
        return;
    }
    let fast = chain
        .plan_write_fast(0, CLUSTER)
        .expect("an overwrite the memo answers: the fast half grants it");
    let Step::Direct(planned) = chain.plan(w(0), || data(0, CLUSTER)) else {
        panic!("the plan grants the same overwrite");
    };
    assert_eq!(fast.grant.host().0, planned.host().0);
    assert_eq!(fast.grant.dev().0, planned.dev().0);
    assert_eq!(chain.counters().requests().writes_here, here + 2);
    // Both grants end in their submission: the data is there, on both hosts.
    chain.submit_direct(20, fast.grant, data(0xc3, CLUSTER));
    chain.submit_direct(21, planned, data(0xc3, CLUSTER));
    rig.settle();
    assert!(rig.ok(20) && rig.ok(21));
    for host in [&mut rig.core, &mut rig.owner] {
        let back = data(0, CLUSTER);
        host.submit(100, Request::new(Op::Read, 0, CLUSTER), Some(back.clone()));
        for _ in 0..100 {
            host.exec.poll(&mut |_, r| r.unwrap());
        }
        assert_eq!(bytes(&back), vec![0xc3; CLUSTER as usize]);
    }
    grace_drains(&rig.owner.chain);
}

/// Every request on the image left the grace period it entered (a declined fast half
/// too): with nothing in flight, the owner advances the generation twice. An entry left
/// open in either parity would hold it, and freed clusters would never be reused.
fn grace_drains(owner: &Chain<Disk>) {
    let Layer::Qcow2(q) = &owner.layers()[0] else {
        unreachable!("a qcow2 chain")
    };
    let grace = q.shared().expect("a shared image").grace();
    let g = grace.now();
    assert_eq!(grace.try_advance(), g + 1, "an entry left open");
    assert_eq!(grace.try_advance(), g + 2, "an entry left open");
}

#[test]
fn the_owner_runs_every_request_itself() {
    let mut rig = Rig::new();
    let owner = &mut rig.owner;
    let took = owner.submit(
        1,
        Request::new(Op::Write, 0, CLUSTER),
        Some(data(7, CLUSTER)),
    );
    assert_eq!(took, Took::Task, "a first write is the owner's write path");
    for op in [Op::WriteZeroesUnmap, Op::Discard, Op::Flush] {
        let took = owner.submit(2, Request::new(op, 4 * CLUSTER, CLUSTER), None);
        assert_eq!(took, Took::Task);
    }
    rig.settle();
    // An overwrite of a cluster the owner holds: direct.
    let took = rig.owner.submit(
        3,
        Request::new(Op::Write, 0, CLUSTER),
        Some(data(8, CLUSTER)),
    );
    assert_eq!(took, Took::Direct);
    // So is a read of it; a read of an unallocated cluster is engine work (zeros).
    let took = rig.owner.submit(
        4,
        Request::new(Op::Read, 0, CLUSTER),
        Some(data(0, CLUSTER)),
    );
    assert_eq!(took, Took::Direct);
    let took = rig.owner.submit(
        5,
        Request::new(Op::Read, 64 * CLUSTER, CLUSTER),
        Some(data(0xff, CLUSTER)),
    );
    assert_eq!(took, Took::Task);
    rig.settle();
    assert!((3..=5).all(|t| rig.ok(t)));
}

#[test]
fn a_direct_step_the_device_refused_continues_as_a_task() {
    let mut rig = Rig::new();
    rig.owner.submit(
        1,
        Request::new(Op::Write, 0, CLUSTER),
        Some(data(5, CLUSTER)),
    );
    rig.settle();
    let chain = rig.owner.chain.clone();
    let back = data(0, CLUSTER);
    let Step::Direct(grant) = chain.plan(Request::new(Op::Read, 0, CLUSTER), || back.clone())
    else {
        panic!("an allocated cluster reads direct");
    };
    let task = chain.not_submitted(grant);
    chain.start(task, 2, Some(back.clone()));
    rig.settle();
    assert!(rig.ok(2));
    assert_eq!(bytes(&back), vec![5; CLUSTER as usize]);
}

#[test]
fn a_read_only_image_refuses_writes_in_its_plan() {
    let rig = Rig::new();
    // A read-only open of the same bytes.
    let disk = match &rig.owner.chain.layers()[0] {
        Layer::Qcow2(q) => q.exec().with_device(q.dev(), |d| d.channel()),
        Layer::Raw { .. } => unreachable!(),
    };
    let exec: Exec<Disk> = Exec::new();
    let id = exec.add_device(disk);
    let e2 = exec.clone();
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, OpenOptions::default()).await })
        .unwrap();
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).unwrap();
    assert_eq!(chain.role(), Role::ReadOnly);
    for op in [Op::Write, Op::WriteZeroes, Op::Discard] {
        let buf = data(1, CLUSTER);
        match chain.plan(Request::new(op, 0, CLUSTER), || buf.clone()) {
            Step::Complete(Err(Error::ReadOnly)) => {}
            other => panic!("{op:?}: {other:?}"),
        }
    }
}
