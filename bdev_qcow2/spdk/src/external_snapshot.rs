//! `bdev_qcow2_snapshot_external {name, base_bdev, snapshot_name?, snapshot_uuid?}` (QEMU's
//! `blockdev-snapshot-sync`): formats a new overlay on `base_bdev` whose backing is the
//! bdev's current image, and switches the bdev to it while it serves I/O. The old image
//! becomes a read-only qcow2 bdev of its own, `snapshot_name` (default `<name>_snap<N>`,
//! the lowest N no bdev has), which the overlay names as its backing bdev and backing
//! file, so that `save_config` writes the chain and reloads it.
//!
//! On the md thread, in this order (ARCHITECTURE.md §13):
//! 1. claim `base_bdev` as its writer, flush the old image, format the overlay and open it
//!    (the old image serves meanwhile; any failure leaves it as it was);
//! 2. quiesce the bdev (requests in flight complete, new ones wait), close the old image
//!    (everything written back: it is clean and final on its bdev);
//! 3. register the old image's read-only bdev, open it as the overlay's backing, start the
//!    overlay's owner, put the overlay under the bdev and a new state under every channel;
//! 4. unquiesce; once the old channel states are gone, close the old owner and its
//!    descriptors, and claim the old base for the read-only bdev.

use crate::backing_state::Phase;
use crate::device::SpdkDevice;
use crate::ffi::bdev::{self, Desc, OpenMode};
use crate::ffi::node::NodeKey;
use crate::ffi::rpc::{Params, Request, INVALID_PARAMS};
use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use crate::lifecycle_busy::Busy;
use crate::node::{self, Image, ImageInfo};
use crate::params::CreateParams;
use crate::registry::{self, Registry};
use crate::rpc::decode;
use crate::types::ChannelIter;
use qcow2_engine::crypto::LuksParams;
use qcow2_engine::overlay::overlay_options;
use qcow2_engine::{Chain, OpenOptions};
use serde::Deserialize;
use serde_json::json;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

mod claim;
mod held;
mod prepare;

use held::{Held, NewBase, Overlay, Pause, ToFormat};

const METHOD: &str = "bdev_qcow2_snapshot_external";

crate::rpc_entry!(bdev_qcow2_rpc_snapshot_external => snapshot_external);

/// `bdev_qcow2_snapshot_external` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalSnapshotParams {
    /// The (writable) qcow2 bdev.
    pub name: String,
    /// The bdev the new overlay is formatted on (unclaimed; everything on it is lost).
    pub base_bdev: String,
    /// The name of the read-only bdev the old image becomes (default `<name>_snap<N>`).
    #[serde(default)]
    pub snapshot_name: Option<String>,
    /// The UUID of that read-only bdev (default: derived from its base's UUID and its name,
    /// as `bdev_qcow2_create` derives one). The bdev keeps its own UUID over the overlay.
    #[serde(default)]
    pub snapshot_uuid: Option<String>,
    /// For an encrypted bdev: the milliseconds of PBKDF2 the overlay's key slot is
    /// calibrated to (as `bdev_qcow2_format`'s; default QEMU's 2000).
    #[serde(default)]
    pub encrypt_iter_time_ms: Option<u32>,
}

/// How the overlay of a bdev encrypted with the keyring key `key` (`None`: plain) is
/// encrypted: QEMU's default LUKS choices (aes-256-xts-plain64, sha256), as
/// `qemu-img create -o encrypt.format=luks` makes an overlay, with the same passphrase.
fn encryption(
    key: Option<&str>,
    iter_time_ms: Option<u32>,
) -> Result<Option<prepare::Encrypt>, (i32, String)> {
    let Some(key) = key else {
        return match iter_time_ms {
            Some(_) => Err((
                libc::EINVAL,
                "encrypt_iter_time_ms is for an encrypted bdev".into(),
            )),
            None => Ok(None),
        };
    };
    let mut params = LuksParams::default();
    if let Some(ms) = iter_time_ms {
        params
            .set("iter-time", &ms.to_string())
            .map_err(|e| (libc::EINVAL, format!("encrypt_iter_time_ms {ms}: {e}")))?;
    }
    let secret = crate::ffi::keyring::key_bytes(key)?;
    Ok(Some(prepare::Encrypt { params, secret }))
}

/// `<name>_snap<N>` for the lowest N that names no bdev.
fn default_snapshot_name(reg: &Registry, name: &str) -> String {
    (0u32..)
        .map(|n| format!("{name}_snap{n}"))
        .find(|s| !reg.knows(s) && !bdev::exists(s))
        .unwrap_or_default()
}

/// Bytes a fully allocated overlay of `size` bytes in clusters of `cluster` bytes takes
/// (16-bit refcounts, standard L2; the count `qemu-img measure` makes): an overlay on a
/// fixed-size bdev must have room for every cluster the guest may write.
fn fully_allocated(size: u64, cluster: u64) -> u64 {
    qcow2_engine::format::measure::prealloc_size(size, cluster, 4, false)
}

/// A switch in progress: what every step reads. What a step hands the next that only
/// some steps hold (the new base, the open overlay, the old image) travels in the
/// [`State`] it names.
struct Switch {
    req: Request,
    _busy: Busy,
    key: NodeKey,
    name: String,
    snapshot: String,
    zeroing: crate::device::Zeroing,
    /// The bdev's parameters over the overlay, and the old image's bdev's.
    params: CreateParams,
    snap_params: CreateParams,
    /// Where the bdev's I/O pause stands.
    pause: Pause,
}

/// Where a switch is, with what that step holds. [`advance`] runs each state's action; the
/// action (or the SPDK callback it waits for) names the next state. Forward, in order
/// (ARCHITECTURE.md §13):
///
/// | state | what happens | next |
/// | --- | --- | --- |
/// | `Flush` | the old image is flushed on its owner | `Format`, or `Fail` |
/// | `Format` | the overlay is formatted on the new base and opened (its own poller) | `Quiesce`, or `Fail` |
/// | `Quiesce` | the bdev is quiesced (requests in flight complete) | `CloseOld`, or `Fail` |
/// | `CloseOld` | the old image is written back and closed on its owner | `RegisterSnapshot`, or `Fail` |
/// | `RegisterSnapshot` | the old image's read-only bdev registers | `Switch`, or `Fail` |
/// | `Switch` | the overlay's owner starts, goes under the node, then under every channel | `Resume`, or `Unregister` / `Fail` |
/// | `Resume` | the bdev is unquiesced | `WaitOld` |
/// | `WaitOld` | the old channel states are freed (a poller waits) | `CloseOldOwner`, or `Answer` |
/// | `CloseOldOwner` | the old owner closes, then its descriptors | `Claim`, or `Answer` |
/// | `Claim` | the old base and the read-only bdev are claimed read-only (a poller retries) | `Answer` |
/// | `Answer` | the RPC answers | — |
///
/// Errors unwind through `Unregister` (the read-only bdev goes again) and `Fail` (what the
/// switch holds is released, the bdev unquiesced if it was), to `Refuse` (the RPC answers
/// the error), the bdev serving its old image as before.
enum State {
    Flush(NewBase),
    Format(Box<ToFormat>),
    Quiesce(Box<Overlay>),
    CloseOld(Box<Overlay>),
    RegisterSnapshot(Box<Overlay>),
    Switch(Box<Overlay>),
    /// With the number of channels that kept the old image, and the node's former image.
    Resume(u32, Box<Image>),
    WaitOld(Box<Image>),
    CloseOldOwner(Box<Image>),
    Claim,
    Answer,
    Unregister(i32, String, Held),
    Fail(i32, String, Held),
    Refuse(i32, String),
}

/// The error state of a step holding `held` that found the bdev gone.
fn went_away(held: Held) -> State {
    State::Fail(libc::ENODEV, "the bdev went away".into(), held)
}

/// Runs the action of `state` on switch `sw`.
fn advance(sw: Box<Switch>, state: State) {
    match state {
        // Step 1: most of what the close in the pause would write goes now.
        State::Flush(base) => flush(sw, base),
        State::Format(f) => format(sw, *f),
        // Step 2: no request in flight from here, then the old image is final.
        State::Quiesce(ov) => quiesce(sw, ov),
        State::CloseOld(ov) => close_old(sw, ov),
        // Step 3.
        State::RegisterSnapshot(ov) => register_snapshot(sw, ov),
        State::Switch(ov) => switch(sw, ov),
        // Step 4: requests go on; the old image goes once nothing uses it.
        State::Resume(kept, old) => resume(sw, kept, old),
        State::WaitOld(old) => wait_old(sw, old),
        State::CloseOldOwner(old) => close_old_owner(sw, old),
        State::Claim => {
            claim::claim_snapshot(&sw.name, &sw.snapshot);
            advance(sw, State::Answer)
        }
        State::Answer => answer(*sw),
        // Unwinding.
        State::Unregister(errno, msg, held) => {
            drop_snapshot(&sw.snapshot);
            advance(sw, State::Fail(errno, msg, held))
        }
        State::Fail(errno, msg, held) => fail(sw, errno, msg, held),
        State::Refuse(errno, msg) => refuse(*sw, errno, &msg),
    }
}

/// `Fail`: the bdev serves as before. Releases what the switch holds (the overlay, the new
/// base), and lets the requests go if they were held; then `Refuse`.
fn fail(sw: Box<Switch>, errno: i32, msg: String, held: Held) {
    tracing::error!("{METHOD} {}: {msg}", sw.name);
    held.release();
    if matches!(sw.pause, Pause::Held(_)) {
        let reg = registry::lock();
        if let Some(n) = reg.by_key(sw.key) {
            n.unquiesce(move |_| advance(sw, State::Refuse(errno, msg)));
            return;
        }
    }
    advance(sw, State::Refuse(errno, msg))
}

/// `Refuse`: the RPC answers the error.
fn refuse(sw: Switch, errno: i32, msg: &str) {
    sw.req.errno(errno, &format!("{METHOD}: {msg}"));
}

/// Runs `job` with the switch and what it holds on the owner's executor, as a life-cycle
/// job (requests keep flowing); `Fail` when the bdev went away.
fn owner_job<H, F>(
    sw: Box<Switch>,
    held: H,
    into_held: fn(H) -> Held,
    job: impl FnOnce(Box<Switch>, H, Rc<Chain<SpdkDevice>>) -> F,
) where
    H: 'static,
    F: std::future::Future<Output = ()> + 'static,
{
    let reg = registry::lock();
    let Some(owner) = reg.by_key(sw.key).and_then(|n| n.owner_here()) else {
        drop(reg);
        return advance(sw, went_away(into_held(held)));
    };
    owner.run_job(move |chain| job(sw, held, chain));
}

/// What a failure before the format releases.
fn base_held(base: NewBase) -> Held {
    Held::Base(base.desc)
}

/// `Flush`: the overlay's options (and the key) from the old image, which is flushed;
/// then `Format`.
fn flush(sw: Box<Switch>, base: NewBase) {
    owner_job(sw, base, base_held, |sw, base, chain| async move {
        let (opts, old_key) = match chain.layers().first() {
            Some(qcow2_engine::Layer::Qcow2(q)) => {
                (overlay_options(q, &sw.snapshot), q.unlocked_key())
            }
            _ => {
                let m = "no writable image".into();
                return advance(sw, State::Fail(libc::EROFS, m, base_held(base)));
            }
        };
        match chain.flush().await {
            Ok(()) => {
                let f = ToFormat {
                    opts,
                    base,
                    old_key,
                };
                advance(sw, State::Format(Box::new(f)))
            }
            Err(e) => {
                let m = format!("flushing the image: {e}");
                advance(sw, State::Fail(e.errno(), m, base_held(base)))
            }
        }
    });
}

/// `bdev_qcow2_snapshot_external`: answers the bdev's name, the read-only bdev the old
/// image became, and how long I/O paused (`pause_us`), once the old image is closed.
pub fn snapshot_external(req: Request, params: Params) {
    let Some((req, mut p)) = decode::<ExternalSnapshotParams>(req, params, METHOD) else {
        return;
    };
    if let Err(m) = node::check_uuid(&mut p.snapshot_uuid, "snapshot_uuid") {
        return req.error(INVALID_PARAMS, &format!("{METHOD}: {m}"));
    }
    let names = [Some(&p.name), Some(&p.base_bdev), p.snapshot_name.as_ref()];
    if names
        .iter()
        .flatten()
        .any(|n| n.is_empty() || n.contains('\0'))
    {
        return req.error(INVALID_PARAMS, &format!("{METHOD}: empty name"));
    }
    let reg = registry::lock();
    let (node, owner) = match reg.writable(&p.name) {
        Ok(found) => found,
        Err((errno, msg)) => {
            drop(reg);
            return req.errno(errno, &msg);
        }
    };
    let n = node.node();
    if let Some(ph) = n.backing_phase().filter(|&ph| ph != Phase::Present) {
        drop(reg);
        let m = format!("{METHOD}: the backing bdev of {} is {}", p.name, ph.name());
        return req.errno(libc::EBUSY, &m);
    }
    let current = n.params();
    let snapshot = p
        .snapshot_name
        .clone()
        .unwrap_or_else(|| default_snapshot_name(&reg, &p.name));
    let in_chain = p.base_bdev == p.name
        || p.base_bdev == current.base_bdev
        || Some(&p.base_bdev) == current.backing_bdev.as_ref()
        || p.base_bdev == snapshot;
    // The overlay of an encrypted image is encrypted with its key: checked now, before
    // anything is claimed or written.
    let encrypt = match encryption(current.key.as_deref(), p.encrypt_iter_time_ms) {
        Ok(e) => e,
        Err((errno, m)) => {
            drop(reg);
            return req.errno(errno, &format!("{METHOD}: {m}"));
        }
    };
    if in_chain {
        drop(reg);
        return req.error(
            INVALID_PARAMS,
            &format!(
                "{METHOD}: base_bdev {} is a bdev of the chain (or the snapshot's name)",
                p.base_bdev
            ),
        );
    }
    if reg.knows(&snapshot) || bdev::exists(&snapshot) {
        drop(reg);
        return req.errno(libc::EEXIST, &format!("bdev {snapshot} already exists"));
    }
    // Refused now rather than when the read-only bdev registers, with I/O paused.
    if let Some(u) = p.snapshot_uuid.as_ref().filter(|u| bdev::exists(u)) {
        let m = format!("{METHOD}: UUID {u} is already a bdev's UUID (or name)");
        drop(reg);
        return req.errno(libc::EEXIST, &m);
    }
    let Some(busy) = Busy::begin(&p.name) else {
        drop(reg);
        return req.errno(
            libc::EBUSY,
            &format!("{}: another life-cycle operation is running on it", p.name),
        );
    };
    // A stream's job lives on the owner this switch closes.
    if crate::stream_rpc::running(owner) {
        drop(reg);
        return req.errno(libc::EBUSY, &format!("{}: a stream is under way", p.name));
    }
    // The bdev's alignment was fixed at registration from its base and backing: the
    // overlay's base must not need more (its direct path hands it the guest's buffers).
    let align = n.buf_align();
    let (size, cluster) = (owner.size(), n.cluster_size());
    let old = current;
    let key = node.key();
    drop(reg);
    let new_base = match node::open_claimed(&p.base_bdev, "base", OpenMode::ReadWrite) {
        Ok(d) => d,
        Err((e, m)) => return req.errno(e, &format!("{METHOD}: {m}")),
    };
    let refuse = |req: Request, d: Desc, e: i32, m: String| {
        d.close();
        req.errno(e, &format!("{METHOD}: {m}"));
    };
    if new_base.buf_align() > align {
        let a = new_base.buf_align();
        return refuse(
            req,
            new_base,
            libc::EINVAL,
            format!(
                "base_bdev {} needs {a}-byte aligned buffers; the bdev was registered with {align}",
                p.base_bdev
            ),
        );
    }
    let need = fully_allocated(size, cluster);
    if new_base.size() < need {
        let have = new_base.size();
        return refuse(
            req,
            new_base,
            libc::ENOSPC,
            format!(
                "base_bdev {} ({have} bytes) is too small for the overlay of a {size}-byte \
                 disk ({need} bytes when every cluster is written)",
                p.base_bdev
            ),
        );
    }
    let zeroing = crate::device::Zeroing::of(&new_base, old.zero_offload, old.zero_ahead);
    let params = CreateParams {
        base_bdev: p.base_bdev.clone(),
        backing_bdev: Some(snapshot.clone()),
        ..old.clone()
    };
    let snap_params = CreateParams {
        name: snapshot.clone(),
        read_only: true,
        zero_offload: None,
        zero_ahead: None,
        // Not the bdev's own, which it keeps over the overlay (`params`).
        uuid: p.snapshot_uuid.clone(),
        ..old
    };
    let sw = Box::new(Switch {
        req,
        _busy: busy,
        key,
        name: p.name.clone(),
        snapshot,
        zeroing,
        params,
        snap_params,
        pause: Pause::NotAsked,
    });
    let base = NewBase {
        desc: new_base,
        encrypt,
    };
    advance(sw, State::Flush(base));
}

/// `Format`: formats the overlay `opts` on the new base (encrypted if the image is) and
/// opens it writable, on a poller of its own ([`prepare`]); then `Quiesce`, or `Fail`.
fn format(sw: Box<Switch>, f: ToFormat) {
    let ToFormat {
        opts,
        base: NewBase { desc, encrypt },
        old_key,
    } = f;
    let Some(dev) = crate::device::open(&desc) else {
        let m = crate::device::no_channel(&format!("the new base {}", desc.name()));
        return advance(sw, State::Fail(libc::ENOMEM, m, Held::Base(desc)));
    };
    let open = OpenOptions {
        writable: true,
        zero_ahead: sw.zeroing.ahead,
        ..sw.params.open_options()
    };
    prepare::start(
        dev,
        sw.zeroing,
        opts,
        open,
        encrypt,
        Box::new(move |r| match r {
            Ok(p) => {
                let ov = Box::new(Overlay {
                    image: p.image,
                    exec: p.exec,
                    new_base: desc,
                    key: p.key,
                    old_key,
                });
                advance(sw, State::Quiesce(ov))
            }
            Err((e, m)) => {
                let base = &sw.params.base_bdev;
                let m = format!("formatting the overlay on {base}: {m}");
                advance(sw, State::Fail(e, m, Held::Base(desc)))
            }
        }),
    );
}

/// `Quiesce`: once no request is in flight, `CloseOld`; `Fail` if SPDK refuses.
fn quiesce(mut sw: Box<Switch>, ov: Box<Overlay>) {
    let t0 = Instant::now();
    sw.pause = Pause::Asked(t0);
    let reg = registry::lock();
    let Some(n) = reg.by_key(sw.key) else {
        drop(reg);
        return advance(sw, went_away(Held::Overlay(ov)));
    };
    n.quiesce(move |status| {
        if status != 0 {
            let m = "SPDK could not quiesce the bdev".into();
            return advance(sw, State::Fail(-status, m, Held::Overlay(ov)));
        }
        sw.pause = Pause::Held(t0);
        advance(sw, State::CloseOld(ov))
    });
}

/// `CloseOld`: the old image written back and closed (no request is in flight); then
/// `RegisterSnapshot`.
fn close_old(sw: Box<Switch>, ov: Box<Overlay>) {
    owner_job(sw, ov, Held::Overlay, |sw, ov, chain| async move {
        match chain.close().await {
            Ok(()) => advance(sw, State::RegisterSnapshot(ov)),
            Err(e) => {
                let m = format!("closing the old image: {e}");
                advance(sw, State::Fail(e.errno(), m, Held::Overlay(ov)))
            }
        }
    });
}

/// `RegisterSnapshot`: the old image's read-only bdev, on a descriptor of the old base
/// opened without a claim (the bdev still holds its writer's claim until its old states
/// are gone); then `Switch`.
fn register_snapshot(sw: Box<Switch>, ov: Box<Overlay>) {
    let p = sw.snap_params.clone();
    node::create_unclaimed(
        p,
        ov.old_key.clone(),
        Box::new(move |r| match r {
            Ok(_) => advance(sw, State::Switch(ov)),
            Err((e, m)) => {
                let m = format!("the old image's bdev: {m}");
                advance(sw, State::Fail(e, m, Held::Overlay(ov)))
            }
        }),
    );
}

/// Undoes `RegisterSnapshot` after a later failure (nothing uses the bdev yet).
fn drop_snapshot(name: &str) {
    if let Err(e) = bdev::unregister_by_name(name, |_| {}) {
        tracing::error!("{METHOD}: cannot unregister {name} again: errno {e}");
    }
}

/// `Switch`: the overlay's owner over the old image's bdev, put under the node and then
/// under every channel; `Resume` once every channel has its new state. Before the node
/// switched, a failure unregisters the read-only bdev (`Unregister`).
fn switch(sw: Box<Switch>, ov: Box<Overlay>) {
    let snap = sw.snapshot.clone();
    // Claimed later (`Claim`): other modules examine the new bdev now, some with a
    // descriptor open for writing, which a read-only claim cannot coexist with.
    let backing = match node::open_unclaimed(&snap, "backing") {
        Ok(d) => d,
        Err((e, m)) => return advance(sw, State::Unregister(e, m, Held::Overlay(ov))),
    };
    let Some(bdev) = crate::device::open(&backing) else {
        backing.close();
        let m = crate::device::no_channel(&snap);
        return advance(sw, State::Unregister(libc::ENOMEM, m, Held::Overlay(ov)));
    };
    let reg = registry::lock();
    let Some(node) = reg.by_key(sw.key) else {
        drop(reg);
        drop(bdev);
        backing.close();
        let m = "the bdev went away".into();
        return advance(sw, State::Unregister(libc::ENODEV, m, Held::Overlay(ov)));
    };
    let Overlay {
        image,
        exec,
        new_base,
        key,
        ..
    } = *ov;
    let backing_dev = exec.add_device(bdev);
    let info = ImageInfo::of(&image, &sw.params, sw.zeroing);
    let ring = node.node().ring().cloned();
    let owner = match node::start_owner(
        exec,
        image,
        node::OwnerBacking::Dev(Some(backing_dev)),
        &sw.params,
        ring.as_ref(),
    ) {
        Ok(o) => o,
        Err((e, m)) => {
            drop(reg);
            backing.close();
            return advance(sw, State::Unregister(e, m, Held::Base(new_base)));
        }
    };
    let new = Box::new(Image::new(
        [Some(new_base), Some(backing)],
        owner,
        sw.params.clone(),
        info,
        key,
    ));
    let old = match node.switch_image(new) {
        Ok(old) => old,
        Err(_) => {
            // Not reached: the node was found writable on this thread above.
            drop(reg);
            let m = "the switch was refused".into();
            return advance(sw, State::Fail(libc::EIO, m, Held::Nothing));
        }
    };
    tracing::info!(
        "qcow2 bdev {} now serves the overlay on {} over {snap}",
        sw.name,
        sw.params.base_bdev
    );
    // A channel whose new state cannot be built (its replica falls back to forwarding
    // first, `create_channel`) is counted; the others still move.
    node.for_each_channel(
        (sw, old, 0u32),
        |it: ChannelIter, (_, _, kept)| it.renew_state(|_| *kept += 1),
        |(sw, old, kept), _| advance(sw, State::Resume(kept, old)),
    );
}

/// `Resume`: every channel has its new state (or, `kept` of them, the old one); the
/// requests go on. Then `WaitOld`.
fn resume(sw: Box<Switch>, kept: u32, old: Box<Image>) {
    if kept != 0 {
        tracing::error!(
            "{METHOD} {}: {kept} channel(s) could not be moved to the overlay (no memory for \
             a channel state): until they close, their writes in place reach the old image, \
             now the snapshot, and the answer waits for them",
            sw.name,
        );
    }
    let reg = registry::lock();
    let Some(n) = reg.by_key(sw.key) else {
        drop(reg);
        return advance(sw, State::WaitOld(old));
    };
    n.unquiesce(move |_| advance(sw, State::WaitOld(old)));
}

/// Waits for the old channel states to be freed (an idle one at once, one finishing its
/// read-ahead soon after), then `CloseOldOwner`.
struct WaitOld {
    live: Arc<AtomicUsize>,
    poller: PollerSlot,
    switch: Option<(Box<Switch>, Box<Image>)>,
}

impl Polled for WaitOld {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        if self.live.load(Ordering::Acquire) == 0 {
            Poll::Done
        } else {
            Poll::Idle
        }
    }

    fn finish(mut self: Box<Self>) {
        if let Some((sw, old)) = self.switch.take() {
            advance(sw, State::CloseOldOwner(old));
        }
    }
}

/// `WaitOld`: records the pause, then waits for the old channel states ([`WaitOld`]);
/// `Answer` at once with no poller to wait (the old image stays open).
fn wait_old(mut sw: Box<Switch>, old: Box<Image>) {
    sw.pause = match sw.pause {
        Pause::Held(t0) | Pause::Asked(t0) => Pause::Over(t0.elapsed().as_micros() as u64),
        p => p,
    };
    tracing::info!("{METHOD} {}: I/O paused {} us", sw.name, sw.pause.us());
    let job = Box::new(WaitOld {
        live: old.live_channels(),
        poller: PollerSlot::default(),
        switch: Some((sw, old)),
    });
    if let Err(mut j) = thread::start_task(job, c"qcow2_switch_wait") {
        tracing::error!("{METHOD}: no poller to retire the old image; it stays open");
        if let Some((sw, old)) = j.switch.take() {
            drop(old);
            advance(sw, State::Answer);
        }
    }
}

/// `CloseOldOwner`: the old owner closes (nothing left to write), then its descriptors,
/// which releases the old base; then `Claim`. Without an old owner, `Answer`.
fn close_old_owner(sw: Box<Switch>, mut old: Box<Image>) {
    let Some(owner) = old.take_owner() else {
        return advance(sw, State::Answer);
    };
    owner.close(move |_| {
        for d in old.take_descs().into_iter().flatten() {
            d.close();
        }
        advance(sw, State::Claim);
    });
}

/// `Answer`: the RPC answers the bdev's name, the read-only bdev and the pause.
fn answer(sw: Switch) {
    tracing::info!(
        "{METHOD}: {} switched to the overlay on {}; the old image is read-only bdev {}",
        sw.name,
        sw.params.base_bdev,
        sw.snapshot
    );
    sw.req.result(&json!({
        "name": sw.name,
        "snapshot": sw.snapshot,
        "base_bdev": sw.params.base_bdev,
        "pause_us": sw.pause.us(),
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fully_allocated_covers_data_and_metadata() {
        let gib = 1u64 << 30;
        let need = fully_allocated(gib, 65536);
        // 16384 data clusters, 2 L2 tables, 1 L1, header, refcounts.
        assert!(need > gib && need < gib + (1 << 20), "{need}");
        assert_eq!(fully_allocated(0, 65536) % 65536, 0);
    }

    #[test]
    fn params_refuse_unknown_fields() {
        let p: ExternalSnapshotParams =
            serde_json::from_str(r#"{"name":"q0","base_bdev":"m1"}"#).unwrap();
        assert_eq!(p.snapshot_name, None);
        assert!(serde_json::from_str::<ExternalSnapshotParams>(
            r#"{"name":"q0","base_bdev":"m1","size":1}"#
        )
        .is_err());
    }
}
