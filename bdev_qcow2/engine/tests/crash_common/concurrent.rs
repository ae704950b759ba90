//! Crash tests' concurrent host: a workload's ops submitted as a host does, several in
//! flight at once (`Setup::concurrent_bound` in crash.rs), so that write-backs at the dirty
//! bound run while other ops allocate.

use super::{reference_apply, Op};
use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::host;
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer};
use std::rc::Rc;

/// Ops of a concurrent workload in flight at once.
pub const CONCURRENT_OPS: usize = 8;

/// Flushes completed: (device log length at completion, reference then, op index).
pub type Flushes = Vec<(usize, Vec<u8>, usize)>;

/// Runs `work` as a host submits it, [`CONCURRENT_OPS`] at a time (see
/// [`Setup::concurrent_bound`]), keeping `reference`, `flushes` and `touched_after` as the
/// sequential run does. A flush is submitted once every op before it completed, so what it
/// covers is known; the ops after it run alongside.
#[allow(clippy::too_many_arguments)]
pub fn run_concurrent(
    exec: &Exec<MemDevice>,
    chain: &Rc<Chain<MemDevice>>,
    dev: &MemDevice,
    work: &[Op],
    gran: u64,
    reference: &mut [u8],
    flushes: &mut Flushes,
    touched_after: &mut Vec<Vec<(u64, u64)>>,
) {
    // Ops in flight: tag → (range, or None for a flush: its index in `flushes`).
    let mut in_flight: std::collections::HashMap<u64, Result<(u64, u64), usize>> =
        Default::default();
    let drain = |in_flight: &mut std::collections::HashMap<u64, Result<(u64, u64), usize>>,
                 flushes: &mut Flushes,
                 until_empty: bool| {
        while !in_flight.is_empty() {
            let mut done = Vec::new();
            exec.poll(&mut |tag, r| done.push((tag, r)));
            for (tag, r) in done {
                r.unwrap_or_else(|e| panic!("op {tag} failed: {e:?}"));
                if let Some(Err(f)) = in_flight.remove(&tag) {
                    flushes[f].0 = dev.0.borrow().log.len();
                }
            }
            if !until_empty && in_flight.len() < CONCURRENT_OPS {
                return;
            }
        }
    };
    for (i, op) in work.iter().enumerate() {
        let tag = i as u64 + 1;
        let range = match op {
            Op::Write(o, d) => Some((*o, d.len() as u64)),
            Op::Zero(o, l, _) | Op::Discard(o, l) => Some((*o, *l)),
            Op::Flush => None,
            Op::DeleteSnapshot => unreachable!("not in a concurrent workload"),
        };
        match range {
            // A flush covers what completed before it: the ops before it first.
            None => drain(&mut in_flight, flushes, true),
            Some((o, l)) => {
                // Ops in flight together touch distinct clusters (their order is unknown).
                let (a, b) = (o / gran, (o + l - 1) / gran);
                let clash = in_flight.values().any(|r| match r {
                    Ok((o2, l2)) => a <= (o2 + l2 - 1) / gran && o2 / gran <= b,
                    Err(_) => false,
                });
                if clash {
                    drain(&mut in_flight, flushes, true);
                }
            }
        }
        match op.clone() {
            Op::Write(off, data) => {
                let buf = HeapBuf::new(data.len());
                buf.copy_in(0, &data);
                host::write(chain, tag, off, BufSlice::whole(buf));
            }
            Op::Zero(off, len, unmap) => host::write_zeroes(chain, tag, off, len, unmap),
            Op::Discard(off, len) => host::discard(chain, tag, off, len),
            Op::Flush => host::flush(chain, tag),
            Op::DeleteSnapshot => unreachable!(),
        }
        match range {
            Some(r) => {
                reference_apply(reference, op, gran);
                for t in touched_after.iter_mut() {
                    t.push(r);
                }
                in_flight.insert(tag, Ok(r));
            }
            None => {
                // Its log position is set when it completes.
                flushes.push((usize::MAX, reference.to_vec(), i));
                touched_after.push(Vec::new());
                in_flight.insert(tag, Err(flushes.len() - 1));
            }
        }
        if in_flight.len() >= CONCURRENT_OPS {
            drain(&mut in_flight, flushes, false);
        }
    }
    drain(&mut in_flight, flushes, true);
    let Some(Layer::Qcow2(q)) = chain.layers().first() else {
        unreachable!("a chain of one qcow2 layer")
    };
    let st = q.owner_stats().unwrap();
    eprintln!("owner counters: {st:?}");
    assert!(st.writebacks_at_bound > 0, "{st:?}");
    assert!(st.clusters_allocated_during_writeback > 0, "{st:?}");
}
