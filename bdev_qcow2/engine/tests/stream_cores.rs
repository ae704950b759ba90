//! A stream seen from a core replica (ARCHITECTURE.md §13, §6): before the drop a core
//! reads the same bytes whether it still goes to the backing layer or to the streamed
//! clusters; after it, the core's chain must stop reading the backing layer before the
//! owner's does. The broken order is shown to expose the golden image through a discard.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::exec::Outcome;
use qcow2_engine::io::{BlockDevice, BufSlice, Busy, DeviceError, DeviceOp, HeapBuf};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, OwnerLink, Qcow2};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

/// One core's channel to a disk shared by every core: operations complete on the next poll.
struct Disk {
    data: Rc<RefCell<Vec<u8>>>,
    done: VecDeque<u64>,
}

impl BlockDevice for Disk {
    type Buf = HeapBuf;
    fn size(&self) -> u64 {
        self.data.borrow().len() as u64
    }
    fn alloc_buf(&mut self, len: usize) -> HeapBuf {
        HeapBuf::new(len)
    }
    fn submit(&mut self, op: DeviceOp<HeapBuf>, tag: u64) -> Result<(), Busy<HeapBuf>> {
        let mut d = self.data.borrow_mut();
        match op {
            DeviceOp::Read { offset, buf } => {
                let mut tmp = vec![0u8; buf.len];
                let o = offset as usize;
                if o < d.len() {
                    let n = (d.len() - o).min(buf.len);
                    tmp[..n].copy_from_slice(&d[o..o + n]);
                }
                buf.copy_in(0, &tmp);
            }
            DeviceOp::Write { offset, buf } => {
                let end = offset as usize + buf.len;
                if d.len() < end {
                    d.resize(end, 0);
                }
                buf.copy_out(0, &mut d[offset as usize..end]);
            }
            DeviceOp::WriteZeroes { offset, len } => {
                let end = (offset + len) as usize;
                if d.len() < end {
                    d.resize(end, 0);
                }
                d[offset as usize..end].fill(0);
            }
            DeviceOp::Flush => {}
        }
        self.done.push_back(tag);
        Ok(())
    }
    fn can_grow(&self) -> bool {
        true
    }
    fn ensure_size(&mut self, size: u64) -> Result<(), DeviceError> {
        let mut d = self.data.borrow_mut();
        if (d.len() as u64) < size {
            d.resize(size as usize, 0);
        }
        Ok(())
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, Result<(), DeviceError>)) -> usize {
        let n = self.done.len();
        while let Some(t) = self.done.pop_front() {
            done(t, Ok(()));
        }
        n
    }
}

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
    owner: Rc<Chain<Disk>>,
    core: Rc<Chain<Disk>>,
    owner_exec: Exec<Disk>,
    core_exec: Exec<Disk>,
    asks: Asks,
}

fn disk(data: &Rc<RefCell<Vec<u8>>>) -> Disk {
    Disk {
        data: data.clone(),
        done: VecDeque::new(),
    }
}

fn image(c: &Chain<Disk>) -> &Qcow2<Disk> {
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
        let owner_exec: Exec<Disk> = Exec::new();
        let id = owner_exec.add_device(disk(&img));
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
        let core_exec: Exec<Disk> = Exec::new();
        let cid = core_exec.add_device(disk(&img));
        let replica = Qcow2::from_seed(
            q.core_seed().unwrap(),
            &core_exec,
            cid,
            OpenOptions::default(),
            Box::new(Link(asks.clone())),
        )
        .unwrap();
        let raw = |e: &Exec<Disk>| Layer::Raw {
            dev: e.add_device(disk(&golden)),
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
        self.core.submit_read(1, off, BufSlice::whole(buf.clone()));
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
        f: impl FnOnce(Rc<Chain<Disk>>) -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>>,
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
        rig.core.detach_backing();
        rig.owner.detach_backing();
    } else {
        rig.owner.detach_backing();
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
