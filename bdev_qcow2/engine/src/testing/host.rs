//! A host double for tests: guest requests go in as a host puts them in, planned by
//! [`Chain::plan`] with the step taken through the chain's executor (a direct grant
//! submitted by [`Chain::submit_direct`], a task started by [`Chain::start`], a result
//! reported under the request's tag). Completions come out of [`Exec::poll`](crate::Exec)
//! as they do for a host.

use crate::chain::Chain;
use crate::io::{BlockDevice, BufSlice};
use crate::plan::{Op, Request, Step};
use std::rc::Rc;

/// Plans `req` on `chain` and takes the step under `tag`. `Some(op)`: the plan sends the
/// request to the metadata owner as `op` (a core replica's), and nothing ran here.
pub fn submit<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    req: Request,
    buf: Option<BufSlice<D::Buf>>,
) -> Option<Op> {
    let step = match &buf {
        Some(b) => chain.plan(req, || b.clone()),
        None => chain.plan(req, || -> BufSlice<D::Buf> {
            unreachable!("a request without data")
        }),
    };
    match step {
        Step::Complete(r) => chain.exec().complete(tag, r),
        Step::Direct(grant) => match buf {
            Some(b) => chain.submit_direct(tag, grant, b),
            None => chain.start(chain.not_submitted(grant), tag, None),
        },
        Step::Task(task) => chain.start(task, tag, buf),
        Step::Owner(op) => return Some(op),
    }
    None
}

/// [`submit`] on a chain that runs `req` itself (the owner, an image one core serves, a
/// read-only image): a plan that sends it to an owner fails the test.
fn here<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    req: Request,
    buf: Option<BufSlice<D::Buf>>,
) {
    if let Some(op) = submit(chain, tag, req, buf) {
        panic!("{req:?} went to the metadata owner as {op:?}");
    }
}

/// Reads `buf.len` bytes at `offset` into `buf`.
pub fn read<D: BlockDevice>(chain: &Rc<Chain<D>>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
    let req = Request::new(Op::Read, offset, buf.len as u64);
    here(chain, tag, req, Some(buf));
}

/// Writes `buf` at `offset`.
pub fn write<D: BlockDevice>(chain: &Rc<Chain<D>>, tag: u64, offset: u64, buf: BufSlice<D::Buf>) {
    let req = Request::new(Op::Write, offset, buf.len as u64);
    here(chain, tag, req, Some(buf));
}

/// Writes `buf` at `offset` on the owner as a write a core replica found not in place
/// ([`Op::WriteNotInPlace`]): the slow path at once.
pub fn write_not_in_place<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    offset: u64,
    buf: BufSlice<D::Buf>,
) {
    let req = Request::new(Op::WriteNotInPlace, offset, buf.len as u64);
    here(chain, tag, req, Some(buf));
}

/// Writes zeroes over `len` bytes at `offset` (`unmap`: whole clusters may go).
pub fn write_zeroes<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    offset: u64,
    len: u64,
    unmap: bool,
) {
    let op = match unmap {
        true => Op::WriteZeroesUnmap,
        false => Op::WriteZeroes,
    };
    here(chain, tag, Request::new(op, offset, len), None);
}

/// Discards `len` bytes at `offset`.
pub fn discard<D: BlockDevice>(chain: &Rc<Chain<D>>, tag: u64, offset: u64, len: u64) {
    here(chain, tag, Request::new(Op::Discard, offset, len), None);
}

/// Flushes.
pub fn flush<D: BlockDevice>(chain: &Rc<Chain<D>>, tag: u64) {
    here(chain, tag, Request::new(Op::Flush, 0, 0), None);
}

/// Reads `buf.len` bytes at `offset` on the engine's path, without a direct grant: the task
/// a host starts when its device refused the grant's I/O ([`Chain::refused`]), or after it
/// routed the read itself.
pub fn engine_read<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    offset: u64,
    buf: BufSlice<D::Buf>,
) {
    let req = Request::new(Op::Read, offset, buf.len as u64);
    chain.start(chain.refused(req), tag, Some(buf));
}

/// Writes `buf` at `offset` on the engine's path, without a direct grant (as
/// [`engine_read`]). On a core replica that is its in-place path, which loads the slices it
/// needs and may still end as [`Outcome::ToOwner`](crate::exec::Outcome::ToOwner).
pub fn engine_write<D: BlockDevice>(
    chain: &Rc<Chain<D>>,
    tag: u64,
    offset: u64,
    buf: BufSlice<D::Buf>,
) {
    let req = Request::new(Op::Write, offset, buf.len as u64);
    chain.start(chain.refused(req), tag, Some(buf));
}
