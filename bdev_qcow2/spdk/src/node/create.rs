//! Creating a node: open and claim the base (and backing) bdev, read and validate the
//! image on the creating thread — the metadata owner — start the owner, then register.

use super::hotplug::BaseEvents;
use super::later;
use super::open::{self, strerror};
use super::unlock::Unlock;
use super::{identity, Below, Image, ImageInfo, Node, OpenedBelow, Ring, Serving, BLOCK_SIZE};
use crate::device::{BaseDevice, SpdkDevice};
use crate::ffi::bdev::{self, Desc, OpenMode};
use crate::ffi::node as handle;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot};
use crate::ffi::uuid::Uuid;
use crate::owner::Owner;
use crate::params::CreateParams;
use crate::registry;
use crate::types::Qcow2Bdev;
use qcow2_engine::golden::CachedDevice;
use qcow2_engine::image::UnlockedKey;
use qcow2_engine::ring::WriteGens;
use qcow2_engine::{Chain, DevId, Exec, Layer, OpenOptions, Qcow2};
use std::cell::RefCell;
use std::ffi::CString;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

/// How a creation ends: the bdev name, or an errno and a message.
pub type Outcome = Result<String, (i32, String)>;
/// Who hears about it (an RPC response, or the examine that started a deferred creation).
pub type Done = Box<dyn FnOnce(Outcome)>;

type Opened = qcow2_engine::Result<(ImageInfo, Qcow2<SpdkDevice>, Option<UnlockedKey>)>;

/// A creation in progress: the image is being read on the md thread.
struct Job {
    params: CreateParams,
    /// The bdev's UUID (`params.uuid` says it too).
    uuid: Uuid,
    base: Option<Desc>,
    backing: Option<Desc>,
    exec: Exec<SpdkDevice>,
    result: Rc<RefCell<Option<Opened>>>,
    poller: PollerSlot,
    done: Option<Done>,
    /// A writable overlay over a deep chain of qcow2 bdevs: its layers, their devices in
    /// `exec` and their images once open (`below.rs`). Last: dropped (closed) after `exec`.
    below: Option<(Below, Vec<DevId>, OpenedBelow)>,
}

fn fail(name: &str, descs: [Option<Desc>; 2], done: Done, errno: i32, msg: String) {
    for d in descs.into_iter().flatten() {
        d.close();
    }
    registry::lock().creating.retain(|n| n != name);
    tracing::error!("bdev_qcow2_create {name}: {msg}");
    done(Err((errno, msg)));
}

/// Opens and claims `name` for our module: shared read-only, or (`ReadWrite`) as its only
/// writer.
pub(crate) fn open_claimed(name: &str, role: &str, mode: OpenMode) -> Result<Desc, (i32, String)> {
    open::open_claimed::<BaseEvents>(name, role, mode)
}

/// Opens `name` (our `role` bdev) read-only without claiming it (the claim follows).
pub(crate) fn open_unclaimed(name: &str, role: &str) -> Result<Desc, (i32, String)> {
    open::open_unclaimed::<BaseEvents>(name, role)
}

/// Creates the bdev of `params` (whose base and backing bdevs exist) on the calling thread,
/// which becomes its metadata owner. `done` hears the outcome, possibly before this returns.
pub fn create(params: CreateParams, done: Done) {
    create_opening(params, Opening::Claimed, done);
}

/// How a creation opens its base bdev.
#[derive(Clone)]
enum Opening {
    /// Claimed (read-only, or as its one writer), the image unlocked with the key
    /// `params.key` names.
    Claimed,
    /// Without a claim yet, an encrypted image unlocked with the key of the open it was
    /// switched from (an external snapshot's old image, with I/O paused: no second key
    /// derivation).
    Unclaimed(Option<UnlockedKey>),
}

/// [`create`] for a read-only bdev whose base bdev is opened without a claim yet: an
/// external snapshot's old image, whose base the bdev it leaves still claims as its writer
/// until its last request is done; the claim follows (`external_snapshot.rs`).
/// `key`: the key the image was unlocked with there, if it is encrypted.
pub(crate) fn create_unclaimed(params: CreateParams, key: Option<UnlockedKey>, done: Done) {
    debug_assert!(params.read_only);
    create_opening(params, Opening::Unclaimed(key), done);
}

fn create_opening(params: CreateParams, opening: Opening, done: Done) {
    let name = params.name.clone();
    {
        let mut reg = registry::lock();
        if reg.knows(&name) || bdev::exists(&name) {
            drop(reg);
            return done(Err((libc::EEXIST, format!("bdev {name} already exists"))));
        }
        reg.creating.push(name.clone());
    }
    open_and_read(params, opening, done, Instant::now() + later::CLAIM_WAIT, 0);
}

/// A creation waiting to try its claims again ([`later::CLAIM_RETRY`]).
struct Retry {
    params: CreateParams,
    opening: Opening,
    done: Done,
    until: Instant,
    /// Claims tried so far.
    tries: u32,
}

/// Tries the creation's claims again shortly, or fails with `errno` and `msg` once `until`
/// has passed.
fn retry_or_fail(r: Retry, errno: i32, msg: String) {
    let name = r.params.name.clone();
    if errno != libc::EPERM || Instant::now() >= r.until {
        return fail(&name, [None, None], r.done, errno, msg);
    }
    if r.tries == 1 {
        tracing::info!("bdev_qcow2_create {name}: {msg}; trying again");
    }
    let again = |r: Retry| open_and_read(r.params, r.opening, r.done, r.until, r.tries);
    if let Err(r) = later::retry_claim(c"qcow2_create", r, again) {
        fail(&name, [None, None], r.done, errno, msg);
    }
}

/// Opens (and claims) the base and backing bdevs of a creation whose name is taken
/// (`creating`), then reads the image on a poller; claims refused for a moment are tried
/// again until `until`.
fn open_and_read(
    mut params: CreateParams,
    opening: Opening,
    done: Done,
    until: Instant,
    tries: u32,
) {
    let name = params.name.clone();
    let mode = if params.read_only {
        OpenMode::ReadOnly
    } else {
        OpenMode::ReadWrite
    };
    let base = match opening {
        Opening::Claimed => open_claimed(&params.base_bdev, "base", mode),
        Opening::Unclaimed(_) => open_unclaimed(&params.base_bdev, "base"),
    };
    let again = |params, done| Retry {
        params,
        opening: opening.clone(),
        done,
        until,
        tries: tries + 1,
    };
    let base = match base {
        Ok(d) => d,
        Err((e, m)) => return retry_or_fail(again(params, done), e, m),
    };
    // A backing bdev that does not exist (yet): the bdev is created degraded, as SPDK's
    // lvol esnap clones are, and reads through it once it is registered (`hotplug.rs`).
    let backing = match params
        .backing_bdev
        .as_deref()
        .filter(|b| bdev::exists(b))
        .map(|b| open_claimed(b, "backing", OpenMode::ReadOnly))
    {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err((e, m))) => {
            base.close();
            return retry_or_fail(again(params, done), e, m);
        }
    };
    if let (None, Some(b)) = (&backing, &params.backing_bdev) {
        tracing::warn!(
            "bdev_qcow2_create {name}: backing bdev {b} does not exist: created degraded \
             (reads that need it fail until it is registered)"
        );
    }
    let uuid = match identity::resolve(&params, &base) {
        Ok(u) => u,
        Err((e, m)) => return fail(&name, [Some(base), backing], done, e, m),
    };
    // Written back by `save_config`, so a restart keeps it whatever the base's UUID then.
    params.uuid = Some(uuid.to_string());
    // The key's bytes, read now and zeroized once the key is derived from them; or the key
    // the image was unlocked with before.
    let unlock = match (opening, params.key.as_deref()) {
        (Opening::Unclaimed(Some(k)), _) => Unlock::Key(k),
        (_, None) => Unlock::Plain,
        (_, Some(key)) => match crate::ffi::keyring::key_bytes(key) {
            Ok(s) => Unlock::Secret(s),
            Err((e, m)) => return fail(&name, [Some(base), backing], done, e, m),
        },
    };
    // A deep chain of read-only qcow2 bdevs below: the owner and the channels read its
    // layers directly (`below.rs`). Only a writable overlay: each read-only bdev of a
    // chain doing so would open the layers under it again, descriptors square in the depth.
    let below = match (&backing, params.read_only) {
        (Some(b), false) => {
            let reg = registry::lock();
            Below::resolve(&reg, &b.name())
        }
        _ => Ok(None),
    };
    let below = match below {
        Ok(b) => b,
        Err((e, m)) => return fail(&name, [Some(base), backing], done, e, m),
    };
    let exec: Exec<SpdkDevice> = Exec::new();
    let Some(mut dev) = crate::device::open(&base) else {
        let m = crate::device::no_channel(&format!("base bdev {}", params.base_bdev));
        return fail(&name, [Some(base), backing], done, libc::ENOMEM, m);
    };
    let zeroing = crate::device::Zeroing::of(&base, params.zero_offload, params.zero_ahead);
    dev.inner_mut().set_zero_offload(zeroing.offload);
    let dev = exec.add_device(dev);
    let result = Rc::new(RefCell::new(None));
    {
        let (exec2, result2, p2) = (exec.clone(), result.clone(), params.clone());
        let opts = OpenOptions {
            writable: !params.read_only,
            zero_ahead: zeroing.ahead,
            ..params.open_options()
        };
        exec.spawn(async move {
            let r = super::unlock::open_image(&exec2, dev, opts, unlock)
                .await
                .map(|(q, key)| (ImageInfo::of(&q, &p2, zeroing), q, key));
            *result2.borrow_mut() = Some(r);
        });
    }
    let below = match below {
        Some(b) => {
            let out = Rc::new(RefCell::new(None));
            let Some(devs) = b.open(&exec, &out) else {
                drop(exec);
                let m = "no I/O channel of a layer of the backing chain".to_string();
                return fail(&name, [Some(base), backing], done, libc::ENOMEM, m);
            };
            Some((b, devs, out))
        }
        None => None,
    };
    let job = Box::new(Job {
        params,
        uuid,
        base: Some(base),
        backing,
        exec,
        result,
        poller: PollerSlot::default(),
        done: Some(done),
        below,
    });
    if let Err(mut job) = thread::start_task(job, c"qcow2_create") {
        let done = job.done.take();
        let descs = [job.base.take(), job.backing.take()];
        let name = job.params.name.clone();
        let below = job.below.take();
        drop(job);
        drop(below);
        if let Some(done) = done {
            fail(
                &name,
                descs,
                done,
                libc::ENOMEM,
                "cannot register a poller".into(),
            );
        }
    }
}

impl Polled for Job {
    fn slot(&self) -> &PollerSlot {
        &self.poller
    }

    fn poll(&self) -> Poll {
        let n = self.exec.poll(&mut |_, _| {});
        Poll::of_task(n, self.result.borrow().is_some() && !self.exec.busy())
    }

    fn finish(self: Box<Self>) {
        finish(*self);
    }
}

fn finish(mut job: Job) {
    let name = job.params.name.clone();
    let Some(done) = job.done.take() else { return };
    let mut descs = [job.base.take(), job.backing.take()];
    let opened = job.result.borrow_mut().take();
    // The image is read: the base's channel held since its examine can go (with ours, once
    // `exec` lets it go: one kernel AIO context for both).
    crate::examine_channel::release(&job.params.base_bdev);
    let (mut info, image, key) = match opened {
        Some(Ok(i)) => i,
        Some(Err(e)) => {
            // Releases the md thread's channel of the base before the descriptors close.
            drop(job.exec);
            let m = format!("image on bdev {}: {e}", job.params.base_bdev);
            return fail(&name, descs, done, libc::EINVAL, m);
        }
        None => {
            drop(job.exec);
            return fail(&name, descs, done, libc::EIO, "image not read".into());
        }
    };
    match (&info.backing_file, &job.params.backing_bdev) {
        (Some(f), None) => {
            let m = format!(
                "the image on bdev {} names backing file '{f}': give backing_bdev, the bdev that \
                 holds it (paths inside images are never opened)",
                job.params.base_bdev
            );
            return fail(&name, descs, done, libc::EINVAL, m);
        }
        (None, Some(b)) => {
            // A stream dropped the backing file after the config naming it was saved (a
            // crash in between): the image holds all it read from there. Let it go.
            tracing::info!(
                "bdev_qcow2_create {name}: the image on bdev {} has no backing file (a stream \
                 finished): backing_bdev {b} released and no longer saved",
                job.params.base_bdev
            );
            if let Some(d) = descs[1].take() {
                d.close();
            }
            job.params.backing_bdev = None;
            info.backing_bdev = None;
        }
        _ => {}
    }
    // Every channel's prefetch ring (and the owner's) checks the same write generations.
    let ring = job
        .params
        .ring_config()
        .map(|c| (c, Arc::new(WriteGens::new())));
    if job.params.read_only {
        // Every channel copies this image (and an overlay's channels as one of their
        // layers): release it and its base channel.
        let seed = Arc::new(image.ro_seed());
        drop(image);
        drop(job.exec);
        let parts = Parts {
            descs,
            serving: Serving::ReadOnly(seed),
            key,
        };
        return register(job.params, job.uuid, info, parts, ring, None, done);
    }
    // The owner's chain reads through the backing bdev: added to `exec` only now that the
    // image is known to name a backing file (after the base, `DevId(0)`).
    let mut backing_dev = None;
    let mut below = None;
    if let Some((b, devs, out)) = job.below.take() {
        // The layers in place of the backing bdev.
        let layers = out.borrow_mut().take();
        match layers {
            Some(Ok(layers)) => below = Some((b, devs, layers)),
            r => {
                drop(image);
                drop(job.exec);
                drop(b);
                let m = match r {
                    Some(Err(e)) => format!("a layer of the backing chain: {e}"),
                    _ => "the backing chain's layers not read".to_string(),
                };
                return fail(&name, descs, done, libc::EINVAL, m);
            }
        }
    } else if let Some(b) = &descs[1] {
        let cache = crate::golden::cache_for(b, job.params.backing_cache_bytes());
        let Some(bd) = crate::device::open_cached(b, cache.as_ref()) else {
            drop(image);
            drop(job.exec);
            let m = crate::device::no_channel(&format!("backing bdev {}", b.name()));
            return fail(&name, descs, done, libc::ENOMEM, m);
        };
        backing_dev = Some(job.exec.add_device(bd));
    } else if job.params.backing_bdev.is_some() {
        // Missing: a device that fails what needs it until the bdev appears, of the
        // image's virtual size (the size of the backing layer, whatever the bdev's).
        let align = super::needed_align(descs[0].as_ref(), None, true);
        let may_cache = job.params.backing_cache_bytes() > 0;
        let gone = BaseDevice::missing(info.virtual_size, align, may_cache);
        backing_dev = Some(job.exec.add_device(CachedDevice::plain(gone)));
    }
    let (below, layers) = match below {
        Some((b, devs, layers)) => (Some(b), Some((devs, layers))),
        None => (None, None),
    };
    let backing = match layers {
        Some(l) => OwnerBacking::Layers(l.0, l.1),
        None => OwnerBacking::Dev(backing_dev),
    };
    let started = start_owner(job.exec, image, backing, &job.params, ring.as_ref());
    let owner = match started {
        Ok(o) => o,
        Err((e, m)) => {
            drop(below);
            return fail(&name, descs, done, e, m);
        }
    };
    let parts = Parts {
        descs,
        serving: owner,
        key,
    };
    register(job.params, job.uuid, info, parts, ring, below, done);
}

/// Starts the metadata owner of the writable `image` on `exec` (on this thread, the md
/// thread), read over the backing bdev `backing_dev` of `exec` if any, with the prefetch
/// settings of `params`: the owner, and the seed the other threads' replicas are built
/// from. The base device was added to `exec` first (`DevId(0)`). Fails with an errno and a
/// message.
pub(crate) fn start_owner(
    exec: Exec<SpdkDevice>,
    mut image: Qcow2<SpdkDevice>,
    backing: OwnerBacking,
    params: &CreateParams,
    ring: Option<&Ring>,
) -> Result<Serving, (i32, String)> {
    let name = &params.name;
    // Publish the metadata to the other threads' channels (ARCHITECTURE.md §6): they serve cache
    // hits and in-place writes on their own replica and send the rest here.
    image.share();
    let seed = image.core_seed().ok();
    let mut layers = vec![Layer::Qcow2(Box::new(image))];
    let (backing_dev, below_devs) = match backing {
        OwnerBacking::Dev(d) => (d, Vec::new()),
        OwnerBacking::Layers(devs, below) => {
            layers.extend(below);
            (None, devs)
        }
    };
    if let Some(d) = backing_dev {
        layers.push(Layer::Raw {
            dev: d,
            size: exec.device_size(d),
        });
    }
    let chain = Chain::new(&exec, layers).map_err(|e| {
        (
            libc::EINVAL,
            format!("image on bdev {}: {e}", params.base_bdev),
        )
    })?;
    chain.prefetch().set_on(params.prefetch_on());
    if let Some((cfg, gens)) = ring {
        match chain.enable_ring(*cfg, gens.clone()) {
            // Read-ahead stops where the base proves synchronous (a file in the page
            // cache): there it only adds a copy.
            Ok(()) => chain.ring().probe_base(),
            Err(e) => tracing::warn!("owner of {name}: no prefetch ring ({e})"),
        }
    }
    // The base device was added first (`create`), so it is `DevId(0)`.
    let devs = [Some(DevId(0)), backing_dev].into_iter().flatten();
    let owner = Owner::start(exec, chain, devs, below_devs, params.space_warn_percent())
        .ok_or_else(|| (libc::ENOMEM, "cannot register a poller".to_string()))?;
    Ok(Serving::Writable { owner, seed })
}

/// What the owner's chain reads under the top image.
pub(crate) enum OwnerBacking {
    /// The backing bdev as one raw layer (its device in the executor), if any.
    Dev(Option<DevId>),
    /// A deep chain's layers (`below.rs`): their devices and opened images.
    Layers(Vec<DevId>, Vec<Layer<SpdkDevice>>),
}

/// What a node is made of.
struct Parts {
    /// Its base and backing descriptors.
    descs: [Option<Desc>; 2],
    /// The owner of a writable image and its replicas' seed, or a read-only image's seed.
    serving: Serving,
    /// The key an encrypted image was unlocked with.
    key: Option<UnlockedKey>,
}

/// Registers the bdev of `params` over its base and backing descriptors.
fn register(
    params: CreateParams,
    uuid: Uuid,
    info: ImageInfo,
    Parts {
        descs,
        serving,
        key,
    }: Parts,
    ring: Option<Ring>,
    below: Option<Below>,
    done: Done,
) {
    let name = params.name.clone();
    let [base, backing] = descs;
    let writable = matches!(serving, Serving::Writable { .. });
    let Ok(cname) = CString::new(name.clone()) else {
        if let Serving::Writable { owner: o, .. } = serving {
            // Just started on this thread; nothing was submitted to it.
            o.close(|_| {});
        }
        if let Some(b) = below {
            b.close();
        }
        return fail(
            &name,
            [base, backing],
            done,
            libc::EINVAL,
            "name contains NUL".into(),
        );
    };
    let missing = backing.is_none() && params.backing_bdev.is_some();
    let align = super::needed_align(base.as_ref(), backing.as_ref(), missing);
    let props = bdev::Props {
        blockcnt: info.virtual_size / u64::from(BLOCK_SIZE),
        // Writes are acknowledged before their metadata is stable: only a FLUSH makes them
        // durable (ARCHITECTURE.md §7), which is what a volatile write cache means to SPDK.
        write_cache: writable,
        // The hot path hands the guest's buffers to the base: ask for what the base needs.
        required_alignment: if align > 1 { align.ilog2() as u8 } else { 0 },
        uuid,
    };
    let keeps = super::keep::keeps(
        &registry::lock(),
        params.read_only,
        params.backing_bdev.as_deref(),
    );
    // Its kept channel would hold a prefetch ring (5 MiB by default) for life, one per
    // bdev of the chain (5 GiB at 1,000); the overlay on top reads the layers itself.
    let ring = if keeps { None } else { ring };
    let cluster_size = info.cluster_size;
    let i = &info;
    let created = format!(
        "created qcow2 bdev {name} on {} ({} bytes, cluster {}, v{}{}{}{}{})",
        i.base_bdev,
        i.virtual_size,
        i.cluster_size,
        i.version,
        i.backing_bdev
            .as_ref()
            .map(|b| format!(", backing {b}{}", if missing { " (missing)" } else { "" }))
            .unwrap_or_default(),
        if i.zero_offload { ", zero offload" } else { "" },
        if i.zero_ahead { ", zeroing ahead" } else { "" },
        below
            .as_ref()
            .map(|b| format!(", {} layers below read directly", b.depth()))
            .unwrap_or_default()
    );
    let image = Image::new([base, backing], serving, params, info, key);
    let node = match handle::register::<Qcow2Bdev>(
        Node::new(image, ring, below).with_link(keeps),
        cname,
        &props,
        |max| {
            cluster_cut(max, cluster_size).map(|blocks| handle::Cut {
                blocks,
                // Only writes allocate; a read-only bdev is cut by size alone.
                at_boundaries: writable,
            })
        },
    ) {
        Ok(r) => r,
        Err(e) => {
            // The node comes back to `never_registered` once its io_device is gone.
            registry::lock().creating.retain(|n| n != &name);
            let m = format!("spdk_bdev_register failed: {}", strerror(e));
            tracing::error!("bdev_qcow2_create {name}: {m}");
            return done(Err((e, m)));
        }
    };
    if keeps {
        node.node().set_kept(node.keep_channel());
    }
    {
        let mut reg = registry::lock();
        reg.creating.retain(|n| n != &name);
        reg.nodes.push((name.clone(), node));
    }
    tracing::info!("{created}");
    done(Ok(name));
}

/// Where SPDK cuts requests longer than a bdev takes. A bdev that asks for aligned buffers
/// (ours asks for the base's alignment) gets `max_rw_size` set at registration to one large
/// iobuf (263 blocks with the default 132 KiB buffers, so SPDK can bounce any request), and
/// longer requests are split into children of that many blocks: children that begin and
/// end inside clusters. Each then allocates a partial cluster (filling the rest with
/// zeros), waits for its neighbours' clusters, and a sequential stream lays the image out
/// out of order (3 + 1 clusters per 256 KiB seen with 1 MiB writes). Cut at cluster
/// boundaries instead — at a multiple of the cluster not above that size, or at a power of
/// two inside the cluster when one cluster is larger — and say so as the optimal I/O
/// boundary (an NVMe-oF namespace reports it to the guest as NOIOB). Returns the cut for
/// SPDK's `max_rw_size` (`None`: SPDK set no limit). A read-only bdev is cut by size only:
/// its reads allocate nothing, and a boundary makes SPDK test every request against it
/// (PERFORMANCE.md §4).
fn cluster_cut(max_rw_size: u32, cluster_size: u64) -> Option<u32> {
    let max = u64::from(max_rw_size);
    if max == 0 {
        return None;
    }
    let cluster = (cluster_size / u64::from(BLOCK_SIZE)).max(1);
    let cut = if max >= cluster {
        max - max % cluster
    } else {
        1 << max.ilog2()
    };
    Some(u32::try_from(cut).unwrap_or(max_rw_size))
}
