//! `bdev_qcow2_format`: writes a fresh, empty image onto a base bdev with the engine's
//! `create` (then preallocates it if asked), asynchronously on the calling thread. The base
//! is opened for writing and claimed as its only writer for the duration (released when the
//! descriptor closes).

use crate::device::SpdkDevice;
use crate::ffi::bdev::{Desc, OpenMode};
use crate::ffi::sys;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use crate::params::FormatParams;
use qcow2_engine::create::{create, preallocate, CreateOptions, Preallocation};
use qcow2_engine::crypto::build_luks_area;
use qcow2_engine::{Chain, DevId, Error, Exec, Layer, OpenOptions, Qcow2};
use std::cell::RefCell;
use std::rc::Rc;

/// How a format ends: `Ok`, or an errno and a message.
pub type Done = Box<dyn FnOnce(Result<(), (i32, String)>)>;

struct Job {
    base: String,
    /// Preallocation was asked for (for the error message).
    preallocated: bool,
    base_size: u64,
    desc: Option<Desc>,
    exec: Option<Exec<SpdkDevice>>,
    result: Rc<RefCell<Option<qcow2_engine::Result<()>>>>,
    poller: PollerSlot,
    done: Option<Done>,
}

/// A base removed mid-format fails the format's writes; our descriptor closes when the
/// format ends, which is what the removal waits for.
struct IgnoreEvents;

impl crate::ffi::bdev::BdevEvents for IgnoreEvents {
    fn event(_ty: sys::spdk_bdev_event_type, _bdev_name: &str) {}
}

fn errno_msg(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Formats `p.base_bdev` (which must exist and be unclaimed); `done` hears the outcome,
/// possibly before this returns.
pub fn format(mut p: FormatParams, done: Done) {
    // An encrypted image's LUKS choices and passphrase, before anything is opened.
    let encrypt = match p.luks_params() {
        Ok(None) => None,
        Ok(Some(luks)) => match crate::ffi::keyring::key_bytes(p.key.as_deref().unwrap_or("")) {
            Ok(secret) => Some((luks, secret)),
            Err(e) => return done(Err(e)),
        },
        Err(m) => return done(Err((libc::EINVAL, m))),
    };
    let backing = match p.backing_bdev.clone().map(|b| backing_of(&b)).transpose() {
        Ok(b) => b,
        Err(e) => return done(Err(e)),
    };
    if let (None, Some(b)) = (p.size, &backing) {
        p.size = Some(b.size);
    }
    let mut opts: CreateOptions = match p.create_options() {
        Ok(o) => o,
        Err(m) => return done(Err((libc::EINVAL, m))),
    };
    if let Some(b) = backing {
        opts.backing_file = Some(b.name);
        opts.backing_format = Some(b.format.into());
    }
    let prealloc = match p.preallocation() {
        Ok(Some(Preallocation::Metadata { .. })) if opts.version < 3 => {
            return done(Err((
                libc::EINVAL,
                "preallocation metadata needs compat 1.1 (the zero flag hides the bdev's old \
                 contents); use preallocation full"
                    .into(),
            )))
        }
        Ok(m) => m,
        Err(m) => return done(Err((libc::EINVAL, m))),
    };
    let base = p.base_bdev.clone();
    let desc = match Desc::open::<IgnoreEvents>(&base, OpenMode::ReadWrite) {
        Ok(d) => d,
        Err(e) => {
            let m = format!("cannot open bdev {base} for writing: {}", errno_msg(e));
            return done(Err((e, m)));
        }
    };
    if let Err(e) = desc.claim(sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_ONE) {
        desc.close();
        let m = format!("cannot claim bdev {base} (in use?): {}", errno_msg(e));
        return done(Err((e, m)));
    }
    if desc.block_size() != crate::node::BLOCK_SIZE {
        let bs = desc.block_size();
        desc.close();
        let m = format!("bdev {base} has {bs}-byte blocks; only 512-byte blocks are supported");
        return done(Err((libc::EINVAL, m)));
    }
    let base_size = desc.size();
    // By default where zeroing the whole base is cheap and allocates nothing: a malloc
    // (a fill) or an NVMe namespace (Write Zeroes). Not AIO (an `fallocate` that would
    // allocate the whole sparse file), not a thin lvol (it would allocate every cluster).
    // Never under an encrypted image: zeros on the base are not the cipher text of zeros.
    let zero = encrypt.is_none()
        && p.zero_base.unwrap_or_else(|| {
            opts.version >= 3
                && desc.supports_natively(sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES)
                && matches!(desc.module_name().as_str(), "malloc" | "nvme")
        });
    opts.zeroed_tail = zero;
    let prealloc = match prealloc {
        Some(Preallocation::Metadata { .. }) => Some(Preallocation::Metadata {
            device_reads_zeros: zero,
        }),
        m => m,
    };
    let Some(dev) = crate::device::open(&desc) else {
        desc.close();
        return done(Err((
            libc::ENOMEM,
            crate::device::no_channel(&format!("bdev {base}")),
        )));
    };
    let exec: Exec<SpdkDevice> = Exec::new();
    let dev = exec.add_device(dev);
    let result = Rc::new(RefCell::new(None));
    {
        let (e2, r2) = (exec.clone(), result.clone());
        exec.spawn(async move {
            let mut opts = opts;
            if let Some((luks, secret)) = encrypt {
                // Built (PBKDF2 calibrated to the iteration time) before anything is
                // written; the passphrase is zeroized on that thread.
                let built = crate::offthread::on_thread(&e2, "qcow2_luks", move || {
                    build_luks_area(&luks, &secret)
                })
                .await;
                match built {
                    Ok(area) => opts.encryption = Some(area),
                    Err(e) => {
                        *r2.borrow_mut() = Some(Err(e));
                        return;
                    }
                }
            }
            let mut r = if zero {
                zero_base(&e2, dev, base_size).await
            } else {
                Ok(())
            };
            if r.is_ok() {
                r = create(&e2, dev, &opts).await;
            }
            if let (Ok(()), Some(mode)) = (&r, prealloc) {
                r = preallocate_on(&e2, dev, mode).await;
            }
            *r2.borrow_mut() = Some(r);
        });
    }
    let job = Box::new(Job {
        base,
        preallocated: prealloc.is_some(),
        base_size,
        desc: Some(desc),
        exec: Some(exec),
        result,
        poller: PollerSlot::default(),
        done: Some(done),
    });
    if let Err(mut j) = thread::start_task(job, c"qcow2_format") {
        j.exec = None;
        if let Some(d) = j.desc.take() {
            d.close();
        }
        if let Some(done) = j.done.take() {
            done(Err((libc::ENOMEM, "cannot register a poller".into())));
        }
    }
}

/// The backing bdev of an overlay, as the image records it.
struct Backing {
    name: String,
    /// `qcow2` for a qcow2 bdev (the format of the image it serves), else `raw`.
    format: &'static str,
    size: u64,
}

/// Looks the backing bdev `name` up (opened read-only for the moment, claimed by nothing).
fn backing_of(name: &str) -> Result<Backing, (i32, String)> {
    let desc = Desc::open::<IgnoreEvents>(name, OpenMode::ReadOnly).map_err(|e| {
        let m = format!("cannot open backing bdev {name}: {}", errno_msg(e));
        (e, m)
    })?;
    let format = if desc.module_name() == "qcow2" {
        "qcow2"
    } else {
        "raw"
    };
    let size = desc.size();
    desc.close();
    Ok(Backing {
        name: name.to_owned(),
        format,
        size,
    })
}

/// Bytes one Write Zeroes of [`zero_base`] covers.
const ZERO_BASE_CHUNK: u64 = 1 << 30;

/// Zeroes the whole base (before `create` writes the image's metadata on it) and flushes.
async fn zero_base(exec: &Exec<SpdkDevice>, dev: DevId, size: u64) -> qcow2_engine::Result<()> {
    let mut off = 0;
    while off < size {
        let len = (size - off).min(ZERO_BASE_CHUNK);
        exec.write_zeroes(dev, off, len).await?;
        off += len;
    }
    exec.flush(dev).await
}

/// Opens the image just formatted on `dev` and preallocates it (closing it when done).
async fn preallocate_on(
    exec: &Exec<SpdkDevice>,
    dev: DevId,
    mode: Preallocation,
) -> qcow2_engine::Result<()> {
    let opts = OpenOptions {
        writable: true,
        ..Default::default()
    };
    let q = Qcow2::open(exec, dev, opts).await?;
    let chain = Chain::new(exec, vec![Layer::Qcow2(Box::new(q))])?;
    preallocate(&chain, mode).await
}

impl Polled for Job {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        let Some(exec) = self.exec.as_ref() else {
            return Poll::Idle;
        };
        let n = exec.poll(&mut |_, _| {});
        Poll::of_task(n, self.result.borrow().is_some() && !exec.busy())
    }

    fn finish(self: Box<Self>) {
        let mut j = *self;
        // Put the base channel back before closing the descriptor (releasing the claim).
        j.exec = None;
        if let Some(d) = j.desc.take() {
            d.close();
        }
        let r = j.result.borrow_mut().take();
        let out = match r {
            Some(Ok(())) => {
                tracing::info!("formatted bdev {} as a qcow2 image", j.base);
                Ok(())
            }
            Some(Err(Error::Io(e))) if e == libc::EINVAL || e == libc::ENOSPC => Err((
                libc::ENOSPC,
                format!(
                    "bdev {} ({} bytes) is too small for the image's {}",
                    j.base,
                    j.base_size,
                    if j.preallocated {
                        "preallocated clusters"
                    } else {
                        "metadata"
                    }
                ),
            )),
            Some(Err(e)) => Err((e.errno(), format!("formatting bdev {}: {e}", j.base))),
            None => Err((libc::EIO, "format did not finish".into())),
        };
        if let Some(done) = j.done.take() {
            done(out);
        }
    }
}
