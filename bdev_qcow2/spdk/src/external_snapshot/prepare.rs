//! Step 1 of an external snapshot: the overlay formatted on the new base and opened
//! writable, on a poller of its own, while the bdev serves its old image. The overlay of an
//! encrypted image is encrypted too, with the same keyring key (as
//! `bdev_qcow2_overlay_create`'s `key`) and a master key of its own: what the guest writes
//! after the switch is never stored in the clear.

use crate::device::{SpdkDevice, Zeroing};
use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use qcow2_engine::create::CreateOptions;
use qcow2_engine::crypto::LuksParams;
use qcow2_engine::image::UnlockedKey;
use qcow2_engine::overlay::format_overlay;
use qcow2_engine::{Exec, OpenOptions, Qcow2, Result};
use std::cell::RefCell;
use std::rc::Rc;
use zeroize::Zeroizing;

/// How the overlay is encrypted: its LUKS choices and the passphrase of the keyring key
/// (zeroized once its key slot is built).
pub(super) struct Encrypt {
    pub params: LuksParams,
    pub secret: Zeroizing<Vec<u8>>,
}

/// The open overlay, with the key it was unlocked with if encrypted.
pub(super) struct Prepared {
    pub exec: Exec<SpdkDevice>,
    pub image: Qcow2<SpdkDevice>,
    pub key: Option<UnlockedKey>,
}

/// Who hears how the format ended: the overlay, or an errno and a message.
pub(super) type Then = Box<dyn FnOnce(std::result::Result<Prepared, (i32, String)>)>;

type Opened = Result<(Qcow2<SpdkDevice>, Option<UnlockedKey>)>;

struct Prepare {
    exec: Exec<SpdkDevice>,
    result: Rc<RefCell<Option<Opened>>>,
    poller: PollerSlot,
    then: Option<Then>,
}

impl Polled for Prepare {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        let n = self.exec.poll(&mut |_, _| {});
        Poll::of_task(n, self.result.borrow().is_some() && !self.exec.busy())
    }

    fn finish(self: Box<Self>) {
        let p = *self;
        let Some(then) = p.then else { return };
        let r = p.result.borrow_mut().take();
        match r {
            Some(Ok((image, key))) => then(Ok(Prepared {
                exec: p.exec,
                image,
                key,
            })),
            Some(Err(e)) => {
                drop(p.exec);
                then(Err((e.errno(), e.to_string())))
            }
            None => {
                drop(p.exec);
                then(Err((libc::EIO, "the format did not finish".into())))
            }
        }
    }
}

/// Formats the overlay `opts` on `dev`, a channel of the new base (encrypted as `encrypt`
/// says), and opens it as `open` says; `then` hears the outcome on this thread, possibly
/// before this returns.
pub(super) fn start(
    mut dev: SpdkDevice,
    zeroing: Zeroing,
    mut opts: CreateOptions,
    open: OpenOptions,
    encrypt: Option<Encrypt>,
    then: Then,
) {
    dev.inner_mut().set_zero_offload(zeroing.offload);
    let exec: Exec<SpdkDevice> = Exec::new();
    let id = exec.add_device(dev);
    let result = Rc::new(RefCell::new(None));
    let (e2, r2) = (exec.clone(), result.clone());
    exec.spawn(async move {
        let r = async {
            // The key slot's PBKDF2 runs on a thread of its own; the key it protects comes
            // back with the area, so the overlay opens without deriving it again.
            let key = match encrypt {
                None => None,
                Some(Encrypt { params, secret }) => {
                    let built = crate::offthread::on_thread(&e2, "qcow2_luks", move || {
                        UnlockedKey::build(&params, &secret)
                    })
                    .await?;
                    opts.encryption = Some(built.0);
                    Some(built.1)
                }
            };
            format_overlay(&e2, id, &opts).await?;
            let q = Qcow2::open(&e2, id, open).await?;
            if let Some(k) = &key {
                q.unlock_with(k)?;
            }
            Ok((q, key))
        }
        .await;
        *r2.borrow_mut() = Some(r);
    });
    let job = Box::new(Prepare {
        exec,
        result,
        poller: PollerSlot::default(),
        then: Some(then),
    });
    if let Err(mut j) = thread::start_task(job, c"qcow2_overlay") {
        if let Some(then) = j.then.take() {
            drop(j);
            then(Err((libc::ENOMEM, "cannot register a poller".into())));
        }
    }
}
