//! A stream seen from a core replica (ARCHITECTURE.md §13, §6): before the drop a core
//! reads the same bytes whether it still goes to the backing layer or to the streamed
//! clusters; after it, the core's chain must stop reading the backing layer before the
//! owner's does. The broken order is shown to expose the golden image through a discard.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::exec::Outcome;
use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::testing::host;
use qcow2_engine::testing::SharedDisk;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, OwnerLink, Qcow2};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

type Asks = Rc<RefCell<VecDeque<(u64, u64)>>>;

struct Link(Asks);

impl OwnerLink for Link {
    fn ask_slice(&self, key: u64, ticket: u64) {
        self.0.borrow_mut().push_back((key, ticket));
    }
}

const CS: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

struct Rig {
    owner: Rc<Chain<SharedDisk>>,
    core: Rc<Chain<SharedDisk>>,
    owner_exec: Exec<SharedDisk>,
    core_exec: Exec<SharedDisk>,
    asks: Asks,
}

fn image(c: &Chain<SharedDisk>) -> &Qcow2<SharedDisk> {
    match &c.layers()[0] {
        Layer::Qcow2(q) => q,
        Layer::Raw { .. } => unreachable!(),
    }
}

impl Rig {
    /// An overlay over a golden image of 0x5a bytes, open on the owner and on one core,
    /// each chain with the golden image as its raw backing layer.
    fn new() -> Rig {
        let img = Rc::new(RefCell::new(Vec::new()));
        let golden = Rc::new(RefCell::new(vec![0x5au8; SIZE as usize]));
        let owner_exec: Exec<SharedDisk> = Exec::new();
        let id = owner_exec.add_device(SharedDisk::new(&img));
        let e2 = owner_exec.clone();
        let opts = CreateOptions {
            size: SIZE,
            cluster_bits: 16,
            backing_file: Some("golden".into()),
            backing_format: Some("raw".into()),
            ..Default::default()
        };
        owner_exec
            .block_on(async move { create(&e2, id, &opts).await })
            .unwrap();
        let e2 = owner_exec.clone();
        let mut q = owner_exec
            .block_on(async move {
                Qcow2::open(
                    &e2,
                    id,
                    OpenOptions {
                        writable: true,
                        ..Default::default()
                    },
                )
                .await
            })
            .unwrap();
        q.share();
        let asks: Asks = Rc::new(RefCell::new(VecDeque::new()));
        let core_exec: Exec<SharedDisk> = Exec::new();
        let cid = core_exec.add_device(SharedDisk::new(&img));
        let replica = Qcow2::from_seed(
            q.core_seed().unwrap(),
            &core_exec,
            cid,
            OpenOptions::default(),
            Box::new(Link(asks.clone())),
        )
        .unwrap();
        let raw = |e: &Exec<SharedDisk>| Layer::Raw {
            dev: e.add_device(SharedDisk::new(&golden)),
            size: SIZE,
        };
        let core = Chain::new(
            &core_exec,
            vec![Layer::Qcow2(Box::new(replica)), raw(&core_exec)],
        )
        .unwrap();
        let owner = Chain::new(
            &owner_exec,
            vec![Layer::Qcow2(Box::new(q)), raw(&owner_exec)],
        )
        .unwrap();
        Rig {
            owner,
            core,
            owner_exec,
            core_exec,
            asks,
        }
    }

    /// Reads one cluster at `off` on the core (the owner answers its slice requests).
    fn core_read(&self, off: u64) -> Vec<u8> {
        let buf = HeapBuf::new(CS as usize);
        host::read(&self.core, 1, off, BufSlice::whole(buf.clone()));
        let mut done = None;
        for _ in 0..100_000 {
            self.core_exec.poll_outcomes(&mut |_, o| {
                done = Some(match o {
                    Outcome::Done(r) => r.is_ok(),
                    Outcome::ToOwner => false,
                })
            });
            if let Some(ok) = done {
                assert!(ok, "core read failed");
                return buf.to_vec();
            }
            while let Some((key, ticket)) = self.asks.borrow_mut().pop_front() {
                let reply = image(&self.owner).slice_for_core(key);
                image(&self.core).deliver_slice(ticket, reply);
            }
        }
        panic!("core read never completed");
    }

    fn on_owner<T: 'static>(
        &self,
        f: impl FnOnce(Rc<Chain<SharedDisk>>) -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>>,
    ) -> T {
        self.owner_exec.block_on(f(self.owner.clone()))
    }
}

/// Streams, drops the reference, detaches in `core_first` order or the other, then the
/// owner discards cluster 3. Returns what the core reads there.
fn discard_after_drop(core_first: bool) -> Vec<u8> {
    let rig = Rig::new();
    // The core reads cluster 3 through to the golden image and caches its slice.
    assert!(rig.core_read(3 * CS).iter().all(|&b| b == 0x5a));
    rig.on_owner(|c| Box::pin(async move { c.stream_range(0, SIZE).await.unwrap() }));
    // Streamed, not dropped: the core reads the copy (or the golden image): the same bytes.
    assert!(rig.core_read(3 * CS).iter().all(|&b| b == 0x5a));
    rig.on_owner(|c| Box::pin(async move { c.finish_stream().await.unwrap() }));
    assert!(rig.core_read(3 * CS).iter().all(|&b| b == 0x5a));
    if core_first {
        rig.core.disk().detach_backing();
        rig.owner.disk().detach_backing();
    } else {
        rig.owner.disk().detach_backing();
    }
    // With no backing layer on the owner's chain, a discard leaves the cluster unallocated.
    rig.on_owner(|c| Box::pin(async move { c.discard(3 * CS, CS).await.unwrap() }));
    rig.core_read(3 * CS)
}

#[test]
fn cores_detach_before_the_owner_and_a_later_discard_reads_zeros() {
    let got = discard_after_drop(true);
    assert!(got.iter().all(|&b| b == 0), "the core did not read zeros");
}

#[test]
fn broken_owner_detaching_first_exposes_the_golden_image() {
    // The order §13 forbids: the owner drops its backing layer while a core still has one.
    let got = discard_after_drop(false);
    assert!(
        got.iter().all(|&b| b == 0x5a),
        "expected the hazard the order prevents"
    );
}
