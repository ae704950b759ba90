//! The bdev_io SPDK hands to our `submit_request`: an owned handle completed once, the
//! module's area in it, queues of them, and submitting one straight to a base bdev.

use super::channel_ref::ChannelRef;
use super::io_channel::{self, ChannelIter, Channels};
use super::iov::{IovRef, IovView, Iovecs, Lease};
use super::rw::Blocks;
use super::sys;
use super::thread::Thread;
use super::types::BdevTypes;
use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::rc::Rc;

/// Block size of every bdev this module registers (`node.rs` registers with it).
pub const BLOCK_SIZE: u32 = 512;

/// The area SPDK reserves in each of our bdev_ios (`get_ctx_size`): the link of the
/// [`IoQueue`] it may travel in, the channel state the request was submitted on, then the
/// module's per-I/O context. The channel and the context are written when a request
/// arrives ([`submit_request`]); the link by the path that reads it ([`IoQueue::push`]),
/// not on every request.
#[repr(C)]
struct DriverArea<M: BdevTypes> {
    /// Written by [`IoQueue::push`].
    next: MaybeUninit<*mut sys::spdk_bdev_io>,
    /// The state of the channel the request arrived on (read back by
    /// [`BdevIo::with_recorded_channel`] without asking SPDK).
    chan: *const M::Channel,
    ctx: M::Ctx,
}

/// Bytes of the driver area of module `M`'s bdev_ios, for `get_ctx_size`.
pub const fn driver_ctx_size<M: BdevTypes>() -> usize {
    std::mem::size_of::<DriverArea<M>>()
}

/// `fn_table.submit_request` of module `M` continues here.
pub trait Requests: Channels {
    /// A new request `io` of type `kind` (`SPDK_BDEV_IO_TYPE_*`, read with the request) on
    /// channel `c`, on the channel's thread.
    fn submit_request(c: &Self::Channel, io: BdevIo<Self>, kind: sys::spdk_bdev_io_type);
}

/// A bdev_io submitted to one of our bdevs and not completed yet. There is one handle per
/// such bdev_io: it is neither `Copy` nor `Clone`, and [`BdevIo::complete`] consumes it, so
/// a bdev_io cannot be completed twice. While SPDK or the engine holds the bdev_io for us
/// (a child I/O, a buffer wait, an engine request, a message), it travels as a raw pointer
/// or tag ([`BdevIo::into_raw`], [`BdevIo::into_tag`]) and comes back as a handle.
pub struct BdevIo<M: BdevTypes>(NonNull<sys::spdk_bdev_io>, PhantomData<M>);

impl<M: BdevTypes> std::fmt::Debug for BdevIo<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BdevIo").field(&self.0).finish()
    }
}

impl<M: BdevTypes> BdevIo<M> {
    /// Takes a bdev_io SPDK just submitted to one of our bdevs on the channel whose state
    /// is `chan`, and initializes the module's area in it to `ctx` and `chan` (SPDK leaves
    /// it as the last user did).
    ///
    /// # Safety
    /// `p` is a bdev_io submitted to a bdev of this module (driver area of
    /// [`driver_ctx_size`] bytes, blocks of [`BLOCK_SIZE`]) that is not completed and has no
    /// other handle (never null: SPDK's bdev layer submits only bdev_ios it allocated);
    /// `chan` is the state of the channel it was submitted on.
    #[inline(always)]
    unsafe fn submitted(
        p: *mut sys::spdk_bdev_io,
        ctx: M::Ctx,
        chan: *const M::Channel,
    ) -> BdevIo<M> {
        // SAFETY: not null, per the contract (no test on every request).
        let io = BdevIo::<M>(unsafe { NonNull::new_unchecked(p) }, PhantomData);
        // SAFETY: the driver area follows the struct and is at least `driver_ctx_size`
        // bytes, aligned for pointers (per the contract); nothing reads the context or the
        // channel before this (the link is `MaybeUninit`, written before it is read).
        unsafe {
            std::ptr::addr_of_mut!((*io.area()).chan).write(chan);
            std::ptr::addr_of_mut!((*io.area()).ctx).write(ctx);
        }
        io
    }

    /// Back from a pointer made by [`BdevIo::into_raw`].
    ///
    /// # Safety
    /// `p` is null or comes from `into_raw` of a handle, and is turned back once.
    #[inline(always)]
    pub unsafe fn from_raw(p: *mut sys::spdk_bdev_io) -> Option<BdevIo<M>> {
        NonNull::new(p).map(|p| BdevIo(p, PhantomData))
    }

    /// Gives up the handle for a raw pointer (to cross a C callback).
    #[inline(always)]
    pub fn into_raw(self) -> *mut sys::spdk_bdev_io {
        self.0.as_ptr()
    }

    /// The request's data iovecs, lent while this handle is borrowed (a read the prefetch
    /// ring serves is copied into them before the request completes).
    #[inline(always)]
    pub fn data(&self) -> IovRef<'_> {
        // SAFETY: the request is outstanding while its handle is borrowed.
        unsafe { IovRef::new(self.iovecs()) }
    }

    /// The request's data iovec array.
    #[inline(always)]
    fn iovecs(&self) -> Iovecs {
        let (iovs, cnt) = self.iovs();
        Iovecs {
            iovs,
            cnt,
            len: self.len_bytes() as usize,
        }
    }

    #[inline(always)]
    fn area(&self) -> *mut DriverArea<M> {
        // SAFETY: live bdev_io (type contract); the area follows the struct.
        unsafe { (*self.0.as_ptr()).driver_ctx.as_mut_ptr().cast() }
    }

    /// The module's per-I/O context.
    #[inline(always)]
    pub fn ctx(&self) -> &M::Ctx {
        // SAFETY: initialized by `submitted`; only this handle reaches it.
        unsafe { &(*self.area()).ctx }
    }

    /// The module's per-I/O context, to change.
    #[inline(always)]
    pub fn ctx_mut(&mut self) -> &mut M::Ctx {
        // SAFETY: as in `ctx`; `&mut self` makes this the only reference.
        unsafe { &mut (*self.area()).ctx }
    }

    /// `SPDK_BDEV_IO_TYPE_*`.
    #[inline(always)]
    pub fn io_type(&self) -> sys::spdk_bdev_io_type {
        // SAFETY: the bdev_io is live (type contract).
        sys::spdk_bdev_io_type::from(unsafe { (*self.0.as_ptr()).type_ })
    }

    /// First block.
    #[inline(always)]
    pub fn offset_blocks(&self) -> u64 {
        // SAFETY: live bdev_io; for block I/O types `u.bdev` is the active union member.
        unsafe { (*self.0.as_ptr()).u.bdev.offset_blocks }
    }

    /// Number of blocks.
    #[inline(always)]
    pub fn num_blocks(&self) -> u64 {
        // SAFETY: as in `offset_blocks`.
        unsafe { (*self.0.as_ptr()).u.bdev.num_blocks }
    }

    /// First byte and length in bytes, read together: what every request's plan starts
    /// from (one function on the request path rather than four accessors).
    #[inline(always)]
    pub fn extent(&self) -> (u64, u64) {
        // SAFETY: as in `offset_blocks`.
        let b = unsafe { &(*self.0.as_ptr()).u.bdev };
        let bs = u64::from(BLOCK_SIZE);
        (b.offset_blocks * bs, b.num_blocks * bs)
    }

    /// First byte.
    #[inline(always)]
    pub fn offset_bytes(&self) -> u64 {
        self.extent().0
    }

    /// Length in bytes.
    #[inline(always)]
    pub fn len_bytes(&self) -> u64 {
        self.extent().1
    }

    #[inline(always)]
    fn raw_iovs(&self) -> (*mut sys::iovec, c_int) {
        // SAFETY: as in `offset_blocks`.
        unsafe {
            let b = &(*self.0.as_ptr()).u.bdev;
            (b.iovs, b.iovcnt)
        }
    }

    fn iovs(&self) -> (*mut sys::iovec, usize) {
        let (iovs, cnt) = self.raw_iovs();
        (iovs, usize::try_from(cnt).unwrap_or(0))
    }

    /// First byte and length in bytes of a read, when it carries its data buffers (reads
    /// may arrive without: `None`, see `get_buf`): the buffer check and [`extent`](Self::extent)
    /// in one, a read's one accessor on the request path.
    #[inline(always)]
    pub fn buffered_extent(&self) -> Option<(u64, u64)> {
        // SAFETY: as in `offset_blocks`; `iovs` points at `iovcnt` iovecs when `iovcnt > 0`
        // (SPDK's bdev layer sets both together, from the caller's array or its own
        // one-element one: no null test of the array on every read).
        let (b, has) = unsafe {
            let b = &(*self.0.as_ptr()).u.bdev;
            (b, b.iovcnt > 0 && !(*b.iovs).iov_base.is_null())
        };
        let bs = u64::from(BLOCK_SIZE);
        has.then(|| (b.offset_blocks * bs, b.num_blocks * bs))
    }

    /// Asks SPDK to attach a data buffer for the whole request, then calls
    /// `D::buf_done(io, success)` on this thread.
    pub fn get_buf<D: BufDone<M>>(self) {
        let len = self.len_bytes();
        // SAFETY: live bdev_io of a block I/O type; `buf_done` turns the pointer back.
        unsafe { sys::spdk_bdev_io_get_buf(self.into_raw(), Some(buf_done::<M, D>), len) }
    }

    /// The SPDK thread the bdev_io was submitted on (where it must be completed).
    pub fn thread(&self) -> Thread {
        // SAFETY: live bdev_io.
        let t = unsafe { sys::spdk_bdev_io_get_thread(self.0.as_ptr()) };
        // SAFETY: a bdev_io is submitted on a live SPDK thread, never null; that thread holds
        // the channel the request is outstanding on, so it lives at least as long (and, as
        // every SPDK thread, until the application stops).
        unsafe { Thread::from_raw_unchecked(t) }
    }

    /// Calls `f` with the metadata owner of the request's (writable) bdev and the request,
    /// on the md thread.
    #[inline(always)]
    pub fn with_owner<R>(self, f: impl FnOnce(&M::Owner, BdevIo<M>) -> R) -> R {
        // SAFETY: bdev_ios reaching us belong to our registered bdevs, whose `ctxt` is the
        // node (`node::register`); a writable bdev's owner is set before registration,
        // changed only while no request is in flight, and lives while the bdev has I/O
        // (this request) and channels.
        let o = M::owner(unsafe { &*self.bdev_ctxt().cast::<M::Node>() }).raw();
        debug_assert!(
            !o.is_null(),
            "a request of a read-only bdev reached the owner"
        );
        // SAFETY: as above.
        let o = unsafe { &*o };
        M::wake(o);
        f(o, self)
    }

    /// As [`with_channel`](Self::with_channel), without asking SPDK: the channel state the
    /// request arrived on, as [`submit_request`] recorded it (a state replaced under its
    /// channel since, `ChannelIter::renew_state`, is still the one the request belongs to).
    #[inline(always)]
    pub fn with_recorded_channel<R>(self, f: impl FnOnce(&M::Channel, BdevIo<M>) -> R) -> R {
        // SAFETY: written by `submit_request` when the request arrived (every handle comes
        // from `submitted`), and only read since; that channel state lives while the
        // request is outstanding (as in `with_channel`: states are freed only once
        // released and idle), which the handle proves it is.
        f(unsafe { &*(*self.area()).chan }, self)
    }

    /// Calls `f` with the state of the channel the request was submitted on (on its
    /// thread) and the request.
    pub fn with_channel<R>(self, f: impl FnOnce(&M::Channel, BdevIo<M>) -> R) -> R {
        // SAFETY: live bdev_io; its channel is one of our bdev's, whose state lives while the
        // request is outstanding and, once `f` completes it, until SPDK's deferred release
        // of the channel, after `f` returned.
        let c = unsafe {
            io_channel::state_of::<M>(io_channel::ctx_of(sys::spdk_bdev_io_get_io_channel(
                self.0.as_ptr(),
            )))
        };
        f(c, self)
    }

    /// The `ctxt` of the bdev it was submitted to (our node).
    pub fn bdev_ctxt(&self) -> *mut c_void {
        // SAFETY: live bdev_io of a registered bdev.
        unsafe { (*(*self.0.as_ptr()).bdev).ctxt }
    }

    /// Visits every channel of the request's bdev on its own thread with `each`, then calls
    /// `done` with the request and the status on this thread (a reset).
    pub fn for_each_channel(
        self,
        each: fn(ChannelIter<M>, &mut BdevIo<M>),
        done: fn(BdevIo<M>, c_int),
    ) {
        let node = self.bdev_ctxt();
        // SAFETY: `bdev.ctxt` is our node, which is the io_device, registered while the bdev
        // has I/O (this one).
        unsafe { io_channel::for_each_channel::<M, _>(node, self, each, done) };
    }

    /// Completes the bdev_io with `status` (`SPDK_BDEV_IO_STATUS_*`). Consumes the handle.
    #[inline(always)]
    pub fn complete(self, status: sys::spdk_bdev_io_status) {
        // SAFETY: live bdev_io, completed exactly once (the handle is consumed).
        unsafe { sys::spdk_bdev_io_complete(self.0.as_ptr(), status) }
    }

    /// Completes the bdev_io with an NVMe status (`sct`, `sc`): what an NVMe-oF host sees,
    /// and what SPDK translates for other front ends. Consumes the handle.
    pub fn complete_nvme(
        self,
        sct: sys::spdk_nvme_status_code_type,
        sc: sys::spdk_nvme_generic_command_status_code,
    ) {
        // (Both enums' values fit an int: SPDK's own signature takes them as such.)
        let (sct, sc) = (sct as i32, sc as i32);
        // SAFETY: live bdev_io, completed exactly once (the handle is consumed).
        unsafe { sys::spdk_bdev_io_complete_nvme_status(self.0.as_ptr(), 0, sct, sc) }
    }
}

/// Guest requests handed to an engine executor, each under the tag the engine knows it by
/// (an index here, not an address: a tag the engine reports comes back as its request at
/// most once, and a tag that was never handed comes back as none).
pub struct EngineTags<M: BdevTypes> {
    slots: RefCell<TagSlots<M>>,
}

struct TagSlots<M: BdevTypes> {
    /// Requests by tag less one (`None`: free).
    held: Vec<Option<BdevIo<M>>>,
    /// Each slot's lease count: the views of its request end when it is taken back.
    leases: Vec<Rc<Cell<u32>>>,
    /// Free indices of `held`.
    free: Vec<u32>,
}

impl<M: BdevTypes> Default for EngineTags<M> {
    fn default() -> Self {
        EngineTags {
            slots: RefCell::new(TagSlots {
                held: Vec::new(),
                leases: Vec::new(),
                free: Vec::new(),
            }),
        }
    }
}

impl<M: BdevTypes> EngineTags<M> {
    /// Keeps request `io` for the engine: its tag (never 0), and a view of its data iovecs
    /// (`num_blocks` blocks) for the engine to use until it reports the tag done: the
    /// view's lease ends when the request is [`take`](Self::take)n back.
    #[inline(always)]
    pub fn hand(&self, io: BdevIo<M>) -> (u64, IovView) {
        let iovs = io.iovecs();
        let mut s = self.slots.borrow_mut();
        let i = match s.free.pop() {
            Some(i) => {
                s.held[i as usize] = Some(io);
                i as usize
            }
            None => {
                s.held.push(Some(io));
                s.leases.push(Rc::new(Cell::new(0)));
                s.held.len() - 1
            }
        };
        let lease = Lease::on(&s.leases[i]);
        // SAFETY: the request stays outstanding while it is held here, and `take` ends the
        // lease before it gives the request back.
        (i as u64 + 1, unsafe { IovView::new(iovs, lease) })
    }

    /// The request handed under `tag`, taken back (`None`: no request is held under it).
    #[inline(always)]
    pub fn take(&self, tag: u64) -> Option<BdevIo<M>> {
        let mut s = self.slots.borrow_mut();
        let i = usize::try_from(tag.checked_sub(1)?).ok()?;
        let io = s.held.get_mut(i)?.take()?;
        Lease::end_all(&s.leases[i]);
        s.free.push(i as u32);
        Some(io)
    }
}

/// `fn_table.submit_request`: hands a new request and its channel to
/// [`Requests::submit_request`].
pub(super) unsafe extern "C" fn submit_request<M: Requests>(
    ch: *mut sys::spdk_io_channel,
    bdev_io: *mut sys::spdk_bdev_io,
) {
    // SAFETY: SPDK passes a channel of our bdev (its state lives while the channel does) and
    // a live bdev_io submitted to it (never null: `bdev_io_do_submit` calls us with the
    // bdev_io it submits), seen here first.
    // (The channel's state read here, as `io_channel::state_of` does: its context area
    // holds the state's pointer. No accessor on the request path.)
    let (c, io) = unsafe {
        let c = *sys::io_channel_get_ctx(ch).cast::<*const M::Channel>();
        (&*c, BdevIo::<M>::submitted(bdev_io, M::new_ctx(), c))
    };
    // SAFETY: as above (its type, read here: no accessor on the request path).
    let kind = sys::spdk_bdev_io_type::from(unsafe { (*bdev_io).type_ });
    M::submit_request(c, io, kind);
}

/// Where [`BdevIo::get_buf`] continues.
pub trait BufDone<M: BdevTypes> {
    /// The buffer is attached (`success`), or SPDK could not attach one.
    fn buf_done(io: BdevIo<M>, success: bool);
}

unsafe extern "C" fn buf_done<M: BdevTypes, D: BufDone<M>>(
    _ch: *mut sys::spdk_io_channel,
    bdev_io: *mut sys::spdk_bdev_io,
    success: bool,
) {
    // SAFETY: SPDK hands back the bdev_io `get_buf` gave up.
    if let Some(io) = unsafe { BdevIo::<M>::from_raw(bdev_io) } {
        D::buf_done(io, success);
    }
}

/// bdev_ios linked through their driver areas, first in first out, without allocating.
/// Holds its requests as handles do: each is taken out exactly once. Changed through `&self`
/// (a channel or the owner keeps it in place), like a `Cell`.
pub struct IoQueue<M: BdevTypes> {
    head: Cell<*mut sys::spdk_bdev_io>,
    tail: Cell<*mut sys::spdk_bdev_io>,
    _types: PhantomData<M>,
}

impl<M: BdevTypes> std::fmt::Debug for IoQueue<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueue")
            .field("head", &self.head)
            .field("tail", &self.tail)
            .finish()
    }
}

impl<M: BdevTypes> Default for IoQueue<M> {
    fn default() -> IoQueue<M> {
        IoQueue::new()
    }
}

impl<M: BdevTypes> IoQueue<M> {
    /// An empty queue.
    pub const fn new() -> IoQueue<M> {
        IoQueue {
            head: Cell::new(std::ptr::null_mut()),
            tail: Cell::new(std::ptr::null_mut()),
            _types: PhantomData,
        }
    }

    /// Whether it holds no request.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.head.get().is_null()
    }

    /// Appends `io`.
    pub fn push(&self, io: BdevIo<M>) {
        // SAFETY: the area of a live bdev_io we hold.
        unsafe { (*io.area()).next = MaybeUninit::new(std::ptr::null_mut()) };
        let p = io.into_raw();
        let tail = self.tail.get();
        if tail.is_null() {
            self.head.set(p);
        } else {
            // SAFETY: the tail is a live bdev_io of this queue.
            unsafe {
                (*BdevIo::<M>(NonNull::new_unchecked(tail), PhantomData).area()).next =
                    MaybeUninit::new(p)
            };
        }
        self.tail.set(p);
    }

    /// Sends the whole queue to `thread` as one message, where `R::receive` gets it; empties
    /// `self` unless SPDK's message pool is empty (then it stays, to be sent again). Whether
    /// it went.
    ///
    #[inline(always)]
    pub fn send<R: QueueReceiver<M>>(&self, thread: Thread) -> bool {
        if self.is_empty() {
            return false;
        }
        self.send_now::<R>(thread)
    }

    /// As [`send`](Self::send), for a queue that is not empty.
    fn send_now<R: QueueReceiver<M>>(&self, thread: Thread) -> bool {
        let head = self.head.get();
        // SAFETY: `thread` is live (the invariant of `Thread`); `receive` takes the queue
        // over, and the bdev_ios in it may move threads (SPDK completes them on theirs).
        let rc =
            unsafe { sys::spdk_thread_send_msg(thread.raw(), Some(receive::<M, R>), head.cast()) };
        if rc != 0 {
            return false;
        }
        self.head.set(std::ptr::null_mut());
        self.tail.set(std::ptr::null_mut());
        true
    }
}

/// The end of an [`IoQueue::send`].
pub trait QueueReceiver<M: BdevTypes> {
    /// Takes the queue's requests over, on the thread they were sent to.
    fn receive(q: Arrived<M>);
}

/// The requests of a queue that arrived with a message, in order.
pub struct Arrived<M: BdevTypes>(*mut sys::spdk_bdev_io, PhantomData<M>);

impl<M: BdevTypes> Iterator for Arrived<M> {
    type Item = BdevIo<M>;

    /// The next request (its successor is read first, so it may be completed at once).
    fn next(&mut self) -> Option<BdevIo<M>> {
        // SAFETY: the head, if any, is a live bdev_io of the queue `send` gave up; each is
        // taken out once.
        let io = unsafe { BdevIo::from_raw(self.0) }?;
        // SAFETY: as in `IoQueue::push`, which wrote the link of every request it queued.
        self.0 = unsafe { (*io.area()).next.assume_init() };
        Some(io)
    }
}

unsafe extern "C" fn receive<M: BdevTypes, R: QueueReceiver<M>>(head: *mut c_void) {
    R::receive(Arrived(head.cast(), PhantomData));
}

/// A base bdev as the direct path sees it: its descriptor and this thread's channel of it,
/// shared with the device that took the channel, so a request reaches the base without
/// borrowing the executor. The channel is held here (put back once the device and this
/// are gone); the descriptor is the node's, open while the node lives (which outlives
/// the channel states and owners that hold targets).
#[derive(Debug)]
pub struct DirectTarget {
    /// Not null (as `_held` is): an `Option<Target>` of the direct path needs no tag of its
    /// own.
    desc: NonNull<sys::spdk_bdev_desc>,
    /// `_held`'s channel, read on every request.
    ch: *mut sys::spdk_io_channel,
    _held: Rc<ChannelRef>,
    /// log2 of the block size.
    block_shift: u32,
    /// The block size minus 1; all ones when the block size is not a power of two.
    align_mask: u64,
}

impl DirectTarget {
    /// The target of `desc` through `ch`, this thread's channel of it (blocks of
    /// `block_size` bytes).
    ///
    /// # Safety
    /// `desc` is open (not null) for as long as the target is used.
    pub(super) unsafe fn new(
        desc: *mut sys::spdk_bdev_desc,
        ch: Rc<ChannelRef>,
        block_size: u64,
    ) -> DirectTarget {
        let pow2 = block_size.is_power_of_two();
        DirectTarget {
            // SAFETY: an open descriptor is not null (the contract).
            desc: unsafe { NonNull::new_unchecked(desc) },
            ch: ch.raw(),
            _held: ch,
            block_shift: block_size.trailing_zeros(),
            // Any other block size: every extent is refused (the engine path serves it).
            align_mask: if pow2 { block_size - 1 } else { u64::MAX },
        }
    }

    /// Submits guest request `io` (a read, or a write if `write`) to the base at byte
    /// `host` with its own iovecs, as SPDK's passthru does: one child bdev_io, freed when it
    /// completes, after which `D::child_done(io, success)` runs on this thread. On `Err` nothing
    /// was submitted and the handle comes back: the extent is not whole blocks (`EINVAL`;
    /// SPDK's bdev layer checks the device's bounds, as for every request), or SPDK refused
    /// (`ENOMEM`: its bdev_io pool is empty).
    #[inline(always)]
    pub fn submit<M: BdevTypes, D: ChildDone<M>>(
        &self,
        io: BdevIo<M>,
        write: bool,
        host: u64,
    ) -> Result<(), (BdevIo<M>, i32)> {
        // The request's fields read here, with the child's submission.
        // SAFETY: live bdev_io of a block I/O type (`u.bdev` is the active union member).
        let b = unsafe { &(*io.0.as_ptr()).u.bdev };
        let (len, iovs, iovcnt) = (b.num_blocks * u64::from(BLOCK_SIZE), b.iovs, b.iovcnt);
        // Shifts and one mask (this runs on every direct request); a block size not a power
        // of two fails the mask.
        if (host | len) & self.align_mask != 0 {
            return Err((io, libc::EINVAL));
        }
        let (offset_blocks, len_blocks) = (host >> self.block_shift, len >> self.block_shift);
        let to = Blocks {
            desc: self.desc.as_ptr(),
            ch: self.ch,
        };
        // SAFETY: `desc` is open and `ch` is this thread's channel of it (constructor); the
        // request's iovecs (at least one) hold its `len` bytes and stay valid until it is
        // completed, which only `child_done` can do, after the child completed.
        let rc = unsafe {
            to.submit(
                write,
                iovs,
                iovcnt,
                offset_blocks,
                len_blocks,
                child_done::<M, D>,
                io.0.as_ptr().cast(),
            )
        };
        if rc == 0 {
            let _ = io.into_raw();
            Ok(())
        } else {
            Err((io, -rc))
        }
    }
}

/// Where a [`DirectTarget::submit`] continues.
pub trait ChildDone<M: BdevTypes> {
    /// The child I/O completed (`success`); `io` is the guest request.
    fn child_done(io: BdevIo<M>, success: bool);
}

unsafe extern "C" fn child_done<M: BdevTypes, D: ChildDone<M>>(
    child: *mut sys::spdk_bdev_io,
    success: bool,
    arg: *mut c_void,
) {
    // SAFETY: SPDK hands back the child bdev_io of `submit`; freed once, here.
    unsafe { sys::spdk_bdev_free_io(child) };
    // SAFETY: `arg` is the guest bdev_io `submit` gave up (a handle's: not null, so no
    // test on every completion).
    let io = BdevIo::<M>(unsafe { NonNull::new_unchecked(arg.cast()) }, PhantomData);
    D::child_done(io, success);
}
