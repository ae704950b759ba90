//! Base bdevs: open descriptors, claims, geometry.

use super::channel_ref::ChannelRef;
use super::sys;
use super::uuid::Uuid;
use std::ffi::{c_int, c_void, CStr, CString};

/// What happens on events of a bdev we opened (hot remove, resize, media).
pub trait BdevEvents {
    /// Event `ty` (`SPDK_BDEV_EVENT_*`) on the bdev called `bdev_name`.
    fn event(ty: sys::spdk_bdev_event_type, bdev_name: &str);
}

unsafe extern "C" fn on_event<E: BdevEvents>(
    ty: sys::spdk_bdev_event_type,
    bdev: *mut sys::spdk_bdev,
    _ctx: *mut c_void,
) {
    // SAFETY: SPDK passes the bdev the event is about, still registered during the callback.
    let name = unsafe { name_of(bdev) };
    E::event(ty, &name);
}

/// Whether a bdev named `name` is registered.
pub fn exists(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid C string for the duration of the call.
    !unsafe { sys::spdk_bdev_get_by_name(c.as_ptr()) }.is_null()
}

/// Name of a bdev.
///
/// # Safety
/// `bdev` must be a registered bdev.
pub unsafe fn name_of(bdev: *const sys::spdk_bdev) -> String {
    // SAFETY: per the contract `bdev` is registered; its name is a valid C string.
    unsafe { CStr::from_ptr(sys::spdk_bdev_get_name(bdev)) }
        .to_string_lossy()
        .into_owned()
}

/// How a bdev is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Reads only.
    ReadOnly,
    /// Reads and writes.
    ReadWrite,
}

/// An open descriptor of a bdev, closed by [`Desc::close`] on the thread that opened it.
pub struct Desc {
    desc: *mut sys::spdk_bdev_desc,
    /// The thread that opened it (SPDK requires closing there).
    pub thread: *mut sys::spdk_thread,
}

impl Desc {
    /// Opens bdev `name` in `mode`; `E` hears of its events. Returns SPDK's errno on
    /// failure (`ENODEV`: no such bdev).
    pub fn open<E: BdevEvents>(name: &str, mode: OpenMode) -> Result<Desc, i32> {
        let write = mode == OpenMode::ReadWrite;
        let ctx = std::ptr::null_mut();
        let c = CString::new(name).map_err(|_| libc::EINVAL)?;
        let mut desc = std::ptr::null_mut();
        // SAFETY: `c` outlives the call; `desc` receives the descriptor; `on_event::<E>` is a
        // valid function for the descriptor's lifetime (a plain fn).
        let rc = unsafe {
            sys::spdk_bdev_open_ext(c.as_ptr(), write, Some(on_event::<E>), ctx, &mut desc)
        };
        if rc != 0 {
            return Err(-rc);
        }
        Ok(Desc {
            desc,
            thread: super::thread::current(),
        })
    }

    /// Claims the bdev for our module with claim type `kind` (released when closed).
    pub fn claim(&self, kind: sys::spdk_bdev_claim_type) -> Result<(), i32> {
        // SAFETY: `self.desc` is open; a null options pointer means defaults; our module is
        // registered (at load time).
        let rc = unsafe {
            sys::spdk_bdev_module_claim_bdev_desc(
                self.desc,
                kind,
                std::ptr::null_mut(),
                super::module::module_ptr(),
            )
        };
        if rc != 0 {
            return Err(-rc);
        }
        Ok(())
    }

    /// The raw descriptor (for I/O submission).
    pub fn raw(&self) -> *mut sys::spdk_bdev_desc {
        self.desc
    }

    /// The bdev behind the descriptor.
    pub fn bdev(&self) -> *mut sys::spdk_bdev {
        // SAFETY: `self.desc` is open.
        unsafe { sys::spdk_bdev_desc_get_bdev(self.desc) }
    }

    /// Its name.
    pub fn name(&self) -> String {
        // SAFETY: the bdev of an open descriptor is registered.
        unsafe { name_of(self.bdev()) }
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        // SAFETY: the bdev of an open descriptor is registered.
        unsafe { sys::spdk_bdev_get_block_size(self.bdev()) }
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> u64 {
        // SAFETY: as above.
        unsafe { sys::spdk_bdev_get_num_blocks(self.bdev()) }
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.num_blocks() * u64::from(self.block_size())
    }

    /// The bdev's UUID (SPDK gave it a random one at registration unless its module or
    /// create call set one).
    pub fn uuid(&self) -> Uuid {
        // SAFETY: the bdev of an open descriptor is registered; SPDK returns the address of
        // its UUID, read here at once.
        Uuid::of(unsafe { &*sys::spdk_bdev_get_uuid(self.bdev()) })
    }

    /// Buffer alignment the bdev requires, in bytes.
    pub fn buf_align(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::spdk_bdev_get_buf_align(self.bdev()) }
    }

    /// Whether the bdev's module handles I/O type `ty` itself. (`spdk_bdev_io_type_supported`
    /// also says yes to WRITE_ZEROES where SPDK emulates it with writes of a zeroed buffer.)
    pub fn supports_natively(&self, ty: sys::spdk_bdev_io_type) -> bool {
        let bdev = self.bdev();
        // SAFETY: a registered bdev's function table and context stay valid while it is
        // open; `io_type_supported` may be called from any thread.
        unsafe {
            let table = (*bdev).fn_table;
            !table.is_null()
                && (*table)
                    .io_type_supported
                    .is_some_and(|f| f((*bdev).ctxt, ty))
        }
    }

    /// The name of the bdev's module (`malloc`, `nvme`, `lvol`, `aio`, ...).
    pub fn module_name(&self) -> String {
        // SAFETY: as above; SPDK returns a static NUL-terminated name (or null).
        unsafe {
            let p = sys::spdk_bdev_get_module_name(self.bdev());
            if p.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    /// Closes the descriptor (releasing its claim). Must run on `self.thread`.
    pub fn close(self) {
        // SAFETY: `self.desc` is open and closed exactly once (`self` is consumed).
        unsafe { sys::spdk_bdev_close(self.desc) }
    }
}

unsafe extern "C" fn unregistered(ctx: *mut c_void, bdeverrno: c_int) {
    // SAFETY: `ctx` is the callback boxed by `unregister_by_name`, delivered once.
    let done = unsafe { Box::from_raw(ctx.cast::<Box<dyn FnOnce(i32)>>()) };
    done(bdeverrno);
}

/// Unregisters our bdev `name`; `done(bdeverrno)` runs once it is gone. On `Err` (SPDK's
/// errno: no such bdev of ours) nothing happens and `done` is dropped.
pub fn unregister_by_name(name: &str, done: impl FnOnce(i32) + 'static) -> Result<(), i32> {
    let name = CString::new(name).map_err(|_| libc::EINVAL)?;
    let ctx = Box::into_raw(Box::new(Box::new(done) as Box<dyn FnOnce(i32)>));
    // SAFETY: `name` is a valid C string; our module is registered; `unregistered` takes
    // `ctx` back exactly once when the call succeeds.
    let rc = unsafe {
        sys::spdk_bdev_unregister_by_name(
            name.as_ptr(),
            super::module::module_ptr(),
            Some(unregistered),
            ctx.cast(),
        )
    };
    if rc != 0 {
        // SAFETY: SPDK refused, so `unregistered` will not run: `ctx` is still ours.
        drop(unsafe { Box::from_raw(ctx) });
        return Err(-rc);
    }
    Ok(())
}

/// A blank bdev struct for one of our nodes, filled in at registration
/// ([`register`](super::node::register)).
pub fn blank() -> sys::spdk_bdev {
    // SAFETY: `spdk_bdev` is a C struct for which all-zero is the documented initial state
    // before the module fills in its fields.
    unsafe { std::mem::zeroed() }
}

/// What SPDK is told about one of our bdevs (besides its name).
pub struct Props {
    /// Number of blocks of [`BLOCK_SIZE`](super::bdev_io::BLOCK_SIZE) bytes.
    pub blockcnt: u64,
    /// Writes are acknowledged before they are durable; a FLUSH makes them so.
    pub write_cache: bool,
    /// log2 of the buffer alignment requests must come with.
    pub required_alignment: u8,
    /// The bdev's UUID (an NVMe-oF namespace takes its NGUID and UUID from it).
    pub uuid: Uuid,
}

/// Makes SPDK split requests at `bdev.optimal_io_boundary`.
pub fn set_split_on_optimal_io_boundary(bdev: &mut sys::spdk_bdev) {
    // SAFETY: a plain store into a bdev struct the caller holds exclusively.
    unsafe { sys::spdk_sys_bdev_set_split_on_optimal_io_boundary(bdev, true) };
}

/// A descriptor and this thread's channel of its bdev, owned together: the channel is put
/// back before the descriptor closes (on drop), so it cannot outlive what it came from.
/// Must be dropped on the thread that made it.
pub struct DescChannel {
    // (Both `Some` until dropped.)
    ch: Option<ChannelRef>,
    desc: Option<Desc>,
}

impl DescChannel {
    /// Takes this thread's channel of the bdev open as `desc`; the descriptor back if SPDK
    /// refused one.
    pub fn of(desc: Desc) -> Result<DescChannel, Desc> {
        // SAFETY: `desc` is open, and this keeps it open while the channel lives.
        match unsafe { ChannelRef::of_raw(desc.raw()) } {
            Some(ch) => Ok(DescChannel {
                ch: Some(ch),
                desc: Some(desc),
            }),
            None => Err(desc),
        }
    }
}

impl Drop for DescChannel {
    fn drop(&mut self) {
        drop(self.ch.take());
        if let Some(d) = self.desc.take() {
            d.close();
        }
    }
}
