//! One core's workload: the request loop over the engine or the raw file, and the
//! metadata warm-up before it.

use super::args::{PerfArgs, Workload};
use super::device::Dev;
use crate::host::{ToolError, ToolResult};
use crate::reactor::Reactor;
use crate::rng::Rng;
use crate::uring::AlignedBuf;
use qcow2_engine::io::{BufSlice, DeviceOp, IoBuffer};
use qcow2_engine::{DevId, Exec, Layer};
use std::time::{Duration, Instant};

/// What a run drives: the engine (a reactor over the shared image), or the raw file.
pub(super) trait PerfTarget {
    fn size(&self) -> u64;
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>);
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>));
    /// A request at `off` (a write if `write`) is about to be submitted: fetch what it
    /// will look up.
    fn prefetch(&self, _off: u64, _write: bool) {}
}

impl PerfTarget for Reactor<Dev> {
    fn size(&self) -> u64 {
        self.chain().size()
    }
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>) {
        if write {
            self.submit_write(tag, off, buf)
        } else {
            self.submit_read(tag, off, buf)
        }
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) {
        Reactor::poll(self, done);
    }
    fn prefetch(&self, off: u64, write: bool) {
        let disk = self.chain().disk();
        if let Some(p) = disk.entry_hint(off) {
            crate::uring::prefetch_line(p.cast());
        }
        // A write into a dirty slice reads and changes the owner's dirty copy of the
        // entry, not the cached one: as the SPDK host does, fetch that line too (#48: the
        // miss on it was a sixth of our thread's work per first write).
        if write {
            if let Some(p) = disk.dirty_entry_hint(off) {
                crate::uring::prefetch_line(p.cast());
            }
        }
    }
}

/// The raw file on one core.
pub(super) struct RawTarget {
    pub(super) exec: Exec<Dev>,
    pub(super) dev: DevId,
    pub(super) size: u64,
}

impl PerfTarget for RawTarget {
    fn size(&self) -> u64 {
        self.size
    }
    fn submit(&mut self, tag: u64, write: bool, off: u64, buf: BufSlice<AlignedBuf>) {
        let op = if write {
            DeviceOp::Write { offset: off, buf }
        } else {
            DeviceOp::Read { offset: off, buf }
        };
        // The leanest path the executor has: the baseline pays no more than it must.
        self.exec
            .request_single(tag, qcow2_engine::GraceEntry::unshared(), self.dev, op);
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, qcow2_engine::Result<()>)) {
        self.exec.poll(done);
    }
}

/// Where one core's requests go: `lane` of `lanes` (verify: each slot of each core owns
/// its own blocks, so no two requests in flight overlap).
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    pub(super) core: usize,
    pub(super) cores: usize,
}

/// Runs one workload on one core; returns (ops, latencies in µs, verify failures).
pub(super) fn drive(
    target: &mut dyn PerfTarget,
    a: &PerfArgs,
    w: Workload,
    lanes: Lanes,
) -> ToolResult<(u64, Vec<u32>, u64)> {
    let seed = lanes.core as u64 * 7919 + 1;
    let len = a.io_size as usize;
    let blocks = target.size() / a.io_size;
    if blocks == 0 {
        return Err(ToolError::Usage("I/O size larger than the disk".into()));
    }
    let qd = a.depth.max(1);
    let stride = (qd * lanes.cores) as u64;
    let bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(len)).collect();
    let check: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(len)).collect();
    let mut rng = Rng(seed | 1);
    // Sequential streams of different cores start at different places.
    let mut seq = (seed * 7919) % blocks;
    // Per slot: (start time, offset, phase: 0 = read/write, 1 = verify read-back).
    let mut slots: Vec<Option<(Instant, u64, bool, u8)>> = vec![None; qd];
    let mut lat: Vec<u32> = Vec::with_capacity(1 << 20);
    let (mut ops, mut failures) = (0u64, 0u64);
    let end = Instant::now() + Duration::from_secs_f64(a.seconds);
    let mut done: Vec<(u64, qcow2_engine::Result<()>)> = Vec::with_capacity(qd);
    let mut batch: Vec<(usize, u64, bool)> = Vec::with_capacity(qd);
    let mut stopping = false;
    let mut polls = 0u64;
    loop {
        if !stopping {
            for (i, slot) in slots.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let block = if w.random() {
                    let b = rng.next() % blocks;
                    if w == Workload::Verify {
                        b - b % stride + (lanes.core * qd + i) as u64
                    } else {
                        b
                    }
                } else {
                    seq = (seq + 1) % blocks;
                    seq
                };
                if block >= blocks {
                    continue;
                }
                let write = match w {
                    Workload::Rw | Workload::Randrw => (rng.next() % 100) as u32 >= a.rwmix,
                    other => other.writes(),
                };
                if write {
                    let tag = rng.next();
                    bufs[i].fill(0, len, tag as u8);
                    bufs[i].copy_in(0, &block.to_le_bytes());
                }
                let off = block * a.io_size;
                *slot = Some((Instant::now(), off, write, 0));
                batch.push((i, off, write));
            }
            // The whole batch's metadata is fetched into the CPU cache first, in parallel,
            // then the requests go in (as a host does with a batch it received).
            for &(_, off, write) in &batch {
                target.prefetch(off, write);
            }
            for (i, off, write) in batch.drain(..) {
                target.submit(
                    i as u64,
                    write,
                    off,
                    BufSlice {
                        buf: bufs[i].clone(),
                        off: 0,
                        len,
                    },
                );
            }
        }
        target.poll(&mut |tag, r| done.push((tag, r)));
        for (tag, r) in done.drain(..) {
            let i = tag as usize;
            let Some((t0, off, write, phase)) = slots[i] else {
                continue;
            };
            r.map_err(|source| ToolError::Engine {
                path: "perf".into(),
                source,
            })?;
            if w == Workload::Verify && write && phase == 0 {
                slots[i] = Some((t0, off, write, 1));
                target.submit(
                    i as u64,
                    false,
                    off,
                    BufSlice {
                        buf: check[i].clone(),
                        off: 0,
                        len,
                    },
                );
                continue;
            }
            if phase == 1 && bufs[i].to_vec(0, len) != check[i].to_vec(0, len) {
                failures += 1;
            }
            lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
            ops += 1;
            slots[i] = None;
        }
        polls += 1;
        if polls.is_multiple_of(32) && Instant::now() >= end {
            stopping = true;
        }
        if stopping && slots.iter().all(Option::is_none) {
            break;
        }
    }
    Ok((ops, lat, failures))
}

/// Loads every L2 slice into this reactor's cache outside the timed run, like a
/// long-running target: one sector per slice.
pub(super) fn warm(r: &mut Reactor<Dev>) -> ToolResult<()> {
    let size = r.chain().size();
    let step = match &r.chain().layers()[0] {
        Layer::Qcow2(q) => q.geometry().slice_coverage(),
        Layer::Raw { .. } => size.max(1),
    };
    let b = AlignedBuf::new(512);
    let mut off = 0;
    while off < size {
        r.read_now(
            off,
            BufSlice {
                buf: b.clone(),
                off: 0,
                len: 512,
            },
        )
        .map_err(|source| ToolError::Engine {
            path: "perf warm-up".into(),
            source,
        })?;
        off += step;
    }
    Ok(())
}
