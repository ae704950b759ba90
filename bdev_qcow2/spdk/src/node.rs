//! A qcow2 bdev ("node"): creation (open and claim the base bdev, read and validate the
//! image on the creating thread — the metadata owner — then register), the function table
//! SPDK calls, and teardown in a fixed order.
//!
//! A writable bdev (`read_only: false`, the default) keeps the image it opened on the
//! creating thread as its one writable instance ([`Owner`]); a read-only bdev drops it and
//! lets every channel open its own replica.

use crate::device::SpdkDevice;
use crate::ffi::bdev::{self, Desc};
use crate::ffi::node::{self as handle, NodeKey, Nodes};
use crate::ffi::sys;
use crate::ffi::thread::{self, Poll, Polled, PollerSlot, Thread};
use crate::ffi::types::Switching;
use crate::owner::Owner;
use crate::params::CreateParams;
use crate::registry;
use crate::stats::ChannelStats;
use crate::types::{MdNode, OwnerBox, OwnerPtr, Qcow2Bdev, Unregistered};
use qcow2_engine::io::{BlockDevice, SECTOR};
use qcow2_engine::ring::{RingConfig, WriteGens};
use qcow2_engine::{Chain, CoreSeed, DevId, Exec, Layer, OpenOptions, Qcow2};
use serde::Serialize;
use serde_json::json;
use std::cell::RefCell;
use std::ffi::CString;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Block size of our bdevs (the engine's sector).
pub const BLOCK_SIZE: u32 = crate::ffi::bdev_io::BLOCK_SIZE;
const _: () = assert!(BLOCK_SIZE as u64 == SECTOR);

/// What `dump_info_json` says about the image (read when the bdev was created).
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    /// Virtual disk size in bytes.
    pub virtual_size: u64,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// qcow2 version (2 or 3).
    pub version: u32,
    /// `0.10` (v2) or `1.1` (v3), as qemu-img calls them.
    pub compat: &'static str,
    /// Backing file name recorded in the image (informational: never opened).
    pub backing_file: Option<String>,
    /// Backing format recorded in the image.
    pub backing_format: Option<String>,
    /// Compression type of compressed clusters.
    pub compression_type: &'static str,
    /// Extended L2 entries (subclusters).
    pub extended_l2: bool,
    /// Refcount width in bits.
    pub refcount_bits: u32,
    /// Lazy refcounts enabled.
    pub lazy_refcounts: bool,
    /// The corrupt bit is set.
    pub corrupt: bool,
    /// The dirty bit is set.
    pub dirty: bool,
    /// Number of internal snapshots.
    pub snapshots: usize,
    /// Raw feature bitmaps.
    pub incompatible_features: u64,
    /// Raw feature bitmaps.
    pub compatible_features: u64,
    /// Raw feature bitmaps.
    pub autoclear_features: u64,
    /// The bdev holding the image.
    pub base_bdev: String,
    /// The bdev holding the backing image, if any.
    pub backing_bdev: Option<String>,
    /// Whether the bdev refuses writes (`read_only` of the create call).
    pub read_only: bool,
    /// Whether partial first writes leave their zeros to the base's WRITE_ZEROES (the
    /// `zero_offload` of the create call, or its default for this base).
    pub zero_offload: bool,
    /// Whether the base is zeroed ahead of the allocator (the `zero_ahead` of the create
    /// call, or its default for this base; only where the image records no zeroed tail).
    pub zero_ahead: bool,
    /// The persistent dirty bitmaps the bdev keeps (QEMU's incremental backup): `in_use`
    /// while the bdev is open, stored at its deletion.
    pub persistent_bitmaps: Vec<PersistentBitmap>,
}

/// A persistent bitmap of [`ImageInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct PersistentBitmap {
    /// Its name.
    pub name: String,
    /// Whether it records the bdev's writes (QEMU's `auto` flag).
    pub enabled: bool,
}

impl ImageInfo {
    pub(crate) fn of<D: BlockDevice>(
        q: &Qcow2<D>,
        p: &CreateParams,
        z: crate::device::Zeroing,
    ) -> ImageInfo {
        let h = q.header();
        ImageInfo {
            virtual_size: q.size(),
            cluster_size: h.cluster_size(),
            version: h.header.version,
            compat: if h.header.version >= 3 { "1.1" } else { "0.10" },
            backing_file: h.backing_file.clone(),
            backing_format: h.extensions.backing_format.clone(),
            compression_type: h.header.compression_type.name(),
            extended_l2: h.extended_l2(),
            refcount_bits: h.refcount_bits(),
            lazy_refcounts: h.lazy_refcounts(),
            corrupt: h.is_corrupt(),
            dirty: h.is_dirty(),
            snapshots: q.snapshots().len(),
            incompatible_features: h.header.incompatible_features,
            compatible_features: h.header.compatible_features,
            autoclear_features: h.header.autoclear_features,
            base_bdev: p.base_bdev.clone(),
            backing_bdev: p.backing_bdev.clone(),
            read_only: p.read_only,
            zero_offload: z.offload && !p.read_only,
            zero_ahead: z.ahead && q.zeroing_ahead(),
            persistent_bitmaps: q
                .kept_bitmaps()
                .into_iter()
                .map(|(name, enabled)| PersistentBitmap { name, enabled })
                .collect(),
        }
    }
}

/// One qcow2 bdev. Boxed and leaked while registered (`ffi/node.rs`, next to the bdev SPDK
/// knows): its address is the io_device and the bdev's `ctxt`. Immutable after
/// registration, except the descriptors and the owner, which teardown takes on the md thread
/// after every channel is gone, and what an external snapshot switches
/// ([`Nodes::swap_image`]).
pub struct Node {
    /// The create call, written back by `write_config_json`.
    pub params: CreateParams,
    /// What the image header said.
    pub info: ImageInfo,
    /// Engine options of each channel's replica.
    pub opts: OpenOptions,
    /// The base bdev (holding the image).
    pub base: Option<Desc>,
    /// The backing bdev.
    pub backing: Option<Desc>,
    /// The metadata owner: the thread that created the bdev (and opened the descriptors).
    pub md_thread: Option<Thread>,
    /// Writable bdev: the image's one writable instance, on `md_thread` (null: read-only).
    /// Set before registration, freed by teardown after the last channel.
    pub owner: OwnerPtr,
    /// Writable bdev: what other threads' channels build their replica from (the owner's
    /// shared epochs, L1 and geometry).
    pub seed: Option<CoreSeed>,
    /// The prefetch ring each channel allocates, and the image's write generations all
    /// rings check (`None`: `prefetch` is off).
    pub ring: Option<(RingConfig, Arc<WriteGens>)>,
    /// Channel states not yet freed. SPDK may destroy a channel while its state still has
    /// base I/O in flight (a replica being opened); that state is freed later by its poller,
    /// and the descriptors must stay open until then.
    pub live_channels: Arc<AtomicUsize>,
    /// Counters of the channels already gone (added when each is freed), so
    /// `bdev_qcow2_get_stats` totals cover the bdev's whole life, not only live channels.
    pub retired: Arc<Mutex<ChannelStats>>,
    /// Held while a channel state is built from the fields above, and while an external
    /// snapshot puts a new image under the node ([`Nodes::swap_image`]).
    pub switching: Mutex<()>,
    /// A stream dropped the backing reference (`bdev_qcow2_stream`): channels created from
    /// now on read no backing layer, and `save_config` leaves `backing_bdev` out. The
    /// descriptor stays open until the bdev goes (channels may hold its I/O channel).
    pub backing_dropped: AtomicBool,
}

/// The image under a node, as [`Registered::switch_image`](handle::Registered::switch_image)
/// swaps it.
pub struct Image {
    /// The base descriptor (holding the image).
    pub base: Option<Desc>,
    /// The backing descriptor.
    pub backing: Option<Desc>,
    /// The image's metadata owner.
    pub owner: Option<OwnerBox>,
    /// What other threads' replicas are built from.
    pub seed: Option<CoreSeed>,
    /// The create call `save_config` writes.
    pub params: CreateParams,
    /// What the header said.
    pub info: ImageInfo,
    /// Channel states built from this image that are not freed yet.
    pub live_channels: Arc<AtomicUsize>,
}

impl Node {
    /// Puts `new` under the node in place of its image (see [`Nodes::swap_image`]):
    /// descriptors, owner, replica seed, parameters, header information, and the count of
    /// channel states built from them. `Err`: `new` has no owner.
    fn swap_image(&mut self, mut new: Box<Image>, t: &Switching) -> Result<Box<Image>, Box<Image>> {
        let Some(owner) = new.owner.take() else {
            return Err(new);
        };
        let _g = self.switching.lock().unwrap_or_else(|e| e.into_inner());
        let old_owner = std::mem::replace(&mut self.owner, owner.into_node());
        // The new image names its backing (the old one): nothing was dropped from it.
        self.backing_dropped.store(false, Ordering::Release);
        Ok(Box::new(Image {
            base: std::mem::replace(&mut self.base, new.base),
            backing: std::mem::replace(&mut self.backing, new.backing),
            owner: old_owner.into_box(t),
            seed: std::mem::replace(&mut self.seed, new.seed),
            params: std::mem::replace(&mut self.params, new.params),
            info: std::mem::replace(&mut self.info, new.info),
            live_channels: std::mem::replace(&mut self.live_channels, new.live_channels),
        }))
    }
}

/// SPDK's calls on our bdevs, and the image switch.
impl Nodes for Qcow2Bdev {
    type Image = Image;

    fn destruct(key: NodeKey) {
        destruct(key)
    }

    fn channels_gone(node: Unregistered) {
        channels_gone(node)
    }

    fn never_registered(node: Node, owner: Option<OwnerBox>) {
        never_registered(node, owner)
    }

    fn io_type_supported(node: &Node, ty: sys::spdk_bdev_io_type) -> bool {
        io_type_supported(node, ty)
    }

    fn info_json(node: &Node) -> serde_json::Value {
        info_json(node)
    }

    fn config_json(node: &Node) -> Vec<serde_json::Value> {
        config_json(node)
    }

    fn swap_image(
        node: &mut Node,
        new: Box<Image>,
        token: &Switching,
    ) -> Result<Box<Image>, Box<Image>> {
        node.swap_image(new, token)
    }
}

/// How a creation ends: the bdev name, or an errno and a message.
pub type Outcome = Result<String, (i32, String)>;
/// Who hears about it (an RPC response, or the examine that started a deferred creation).
pub type Done = Box<dyn FnOnce(Outcome)>;

type Opened = qcow2_engine::Result<(ImageInfo, Qcow2<SpdkDevice>)>;

/// A creation in progress: the image is being read on the md thread.
struct Job {
    params: CreateParams,
    base: Option<Desc>,
    backing: Option<Desc>,
    exec: Exec<SpdkDevice>,
    /// The backing bdev on `exec` (writable bdevs: the owner's chain reads through it).
    backing_dev: Option<DevId>,
    result: Rc<RefCell<Option<Opened>>>,
    poller: PollerSlot,
    done: Option<Done>,
}

fn fail(name: &str, descs: [Option<Desc>; 2], done: Done, errno: i32, msg: String) {
    for d in descs.into_iter().flatten() {
        d.close();
    }
    registry::lock().creating.retain(|n| n != name);
    tracing::error!("bdev_qcow2_create {name}: {msg}");
    done(Err((errno, msg)));
}

fn strerror(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Opens and claims `name` for our module: shared read-only, or (`write`) as its only writer.
pub(crate) fn open_claimed(name: &str, role: &str, write: bool) -> Result<Desc, (i32, String)> {
    let d = Desc::open::<BaseEvents>(name, write).map_err(|e| {
        (
            e,
            format!(
                "cannot open {role} bdev {name}{}: {}",
                if write { " for writing" } else { "" },
                strerror(e)
            ),
        )
    })?;
    let kind = if write {
        sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_ONE
    } else {
        sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_NONE
    };
    if let Err(e) = d.claim(kind) {
        d.close();
        return Err((
            e,
            format!(
                "cannot claim {role} bdev {name} (claimed by another module?): {}",
                strerror(e)
            ),
        ));
    }
    if d.block_size() != BLOCK_SIZE {
        let bs = d.block_size();
        d.close();
        return Err((
            libc::EINVAL,
            format!("{role} bdev {name} has {bs}-byte blocks; only {BLOCK_SIZE}-byte blocks are supported"),
        ));
    }
    Ok(d)
}

/// Creates the bdev of `params` (whose base and backing bdevs exist) on the calling thread,
/// which becomes its metadata owner. `done` hears the outcome, possibly before this returns.
pub fn create(params: CreateParams, done: Done) {
    create_claiming(params, true, done);
}

/// [`create`] for a read-only bdev whose base bdev is opened without a claim yet: an
/// external snapshot's old image, whose base the bdev it leaves still claims as its writer
/// until its last request is done; the claim follows (`external_snapshot.rs`).
pub(crate) fn create_unclaimed(params: CreateParams, done: Done) {
    debug_assert!(params.read_only);
    create_claiming(params, false, done);
}

/// Opens `name` (our `role` bdev) read-only without claiming it (the claim follows).
pub(crate) fn open_unclaimed(name: &str, role: &str) -> Result<Desc, (i32, String)> {
    let d = Desc::open::<BaseEvents>(name, false).map_err(|e| {
        (
            e,
            format!("cannot open {role} bdev {name}: {}", strerror(e)),
        )
    })?;
    if d.block_size() != BLOCK_SIZE {
        d.close();
        return Err((
            libc::EINVAL,
            format!("{role} bdev {name}: only {BLOCK_SIZE}-byte blocks are supported"),
        ));
    }
    Ok(d)
}

fn create_claiming(params: CreateParams, claim_base: bool, done: Done) {
    let name = params.name.clone();
    {
        let mut reg = registry::lock();
        if reg.knows(&name) || bdev::exists(&name) {
            drop(reg);
            return done(Err((libc::EEXIST, format!("bdev {name} already exists"))));
        }
        reg.creating.push(name.clone());
    }
    let base = if claim_base {
        open_claimed(&params.base_bdev, "base", !params.read_only)
    } else {
        open_unclaimed(&params.base_bdev, "base")
    };
    let base = match base {
        Ok(d) => d,
        Err((e, m)) => return fail(&name, [None, None], done, e, m),
    };
    let backing = match params
        .backing_bdev
        .as_deref()
        .map(|b| open_claimed(b, "backing", false))
    {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err((e, m))) => return fail(&name, [Some(base), None], done, e, m),
    };
    let exec: Exec<SpdkDevice> = Exec::new();
    let Some(mut dev) = SpdkDevice::new(&base) else {
        let m = format!("no I/O channel for base bdev {}", params.base_bdev);
        return fail(&name, [Some(base), backing], done, libc::ENOMEM, m);
    };
    let zeroing = crate::device::Zeroing::of(&base, params.zero_offload, params.zero_ahead);
    dev.set_zero_offload(zeroing.offload);
    let dev = exec.add_device(dev);
    let mut backing_dev = None;
    if let (Some(b), false) = (&backing, params.read_only) {
        let Some(bd) = SpdkDevice::new(b) else {
            drop(exec);
            let m = format!("no I/O channel for backing bdev {}", b.name());
            return fail(&name, [Some(base), backing], done, libc::ENOMEM, m);
        };
        backing_dev = Some(exec.add_device(bd));
    }
    let result = Rc::new(RefCell::new(None));
    {
        let (exec2, result2, p2) = (exec.clone(), result.clone(), params.clone());
        let opts = OpenOptions {
            writable: !params.read_only,
            zero_ahead: zeroing.ahead,
            ..params.open_options()
        };
        exec.spawn(async move {
            let r = Qcow2::open(&exec2, dev, opts)
                .await
                .map(|q| (ImageInfo::of(&q, &p2, zeroing), q));
            *result2.borrow_mut() = Some(r);
        });
    }
    let job = Box::new(Job {
        params,
        base: Some(base),
        backing,
        exec,
        backing_dev,
        result,
        poller: PollerSlot::default(),
        done: Some(done),
    });
    if let Err(mut job) = thread::start_task(job, c"qcow2_create") {
        let done = job.done.take();
        let descs = [job.base.take(), job.backing.take()];
        let name = job.params.name.clone();
        drop(job);
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
        Poll::of_task(n, self.result.borrow().is_some(), self.exec.busy())
    }

    fn finish(self: Box<Self>) {
        finish(*self);
    }
}

fn finish(mut job: Job) {
    let name = job.params.name.clone();
    let Some(done) = job.done.take() else { return };
    let descs = [job.base.take(), job.backing.take()];
    let opened = job.result.borrow_mut().take();
    let (info, image) = match opened {
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
            let m = format!(
                "backing_bdev {b} given, but the image on bdev {} has no backing file",
                job.params.base_bdev
            );
            return fail(&name, descs, done, libc::EINVAL, m);
        }
        _ => {}
    }
    // Every channel's prefetch ring (and the owner's) checks the same write generations.
    let ring = job
        .params
        .ring_config()
        .map(|c| (c, Arc::new(WriteGens::new())));
    if job.params.read_only {
        // Every channel opens its own replica: release this one and its base channel.
        drop(image);
        drop(job.exec);
        let [base, backing] = descs;
        return register(job.params, info, base, backing, None, ring, done);
    }
    let started = start_owner(job.exec, image, job.backing_dev, &job.params, ring.as_ref());
    let owner = match started {
        Ok(o) => o,
        Err((e, m)) => return fail(&name, descs, done, e, m),
    };
    let [base, backing] = descs;
    register(job.params, info, base, backing, Some(owner), ring, done);
}

/// Starts the metadata owner of the writable `image` on `exec` (on this thread, the md
/// thread), read over the backing bdev `backing_dev` of `exec` if any, with the prefetch
/// settings of `params`: the owner, and the seed the other threads' replicas are built
/// from. The base device was added to `exec` first (`DevId(0)`). Fails with an errno and a
/// message.
pub(crate) fn start_owner(
    exec: Exec<SpdkDevice>,
    mut image: Qcow2<SpdkDevice>,
    backing_dev: Option<DevId>,
    params: &CreateParams,
    ring: Option<&(RingConfig, Arc<WriteGens>)>,
) -> Result<(OwnerBox, Option<CoreSeed>), (i32, String)> {
    let name = &params.name;
    // Publish the metadata to the other threads' channels (ARCHITECTURE.md §6): they serve cache
    // hits and in-place writes on their own replica and send the rest here.
    image.share();
    let seed = image.core_seed().ok();
    let mut layers = vec![Layer::Qcow2(Box::new(image))];
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
    chain.set_prefetch(params.prefetch_on());
    if let Some((cfg, gens)) = ring {
        if let Err(e) = chain.enable_ring(*cfg, gens.clone()) {
            tracing::warn!("owner of {name}: no prefetch ring ({e})");
        }
    }
    // The base device was added first (`create`), so it is `DevId(0)`.
    let devs = [Some(DevId(0)), backing_dev].into_iter().flatten();
    let owner = Owner::start(exec, chain, devs)
        .ok_or_else(|| (libc::ENOMEM, "cannot register a poller".to_string()))?;
    Ok((owner, seed))
}

fn register(
    params: CreateParams,
    info: ImageInfo,
    base: Option<Desc>,
    backing: Option<Desc>,
    owner: Option<(OwnerBox, Option<CoreSeed>)>,
    ring: Option<(RingConfig, Arc<WriteGens>)>,
    done: Done,
) {
    let name = params.name.clone();
    let (owner, seed) = match owner {
        Some((o, s)) => (Some(o), s),
        None => (None, None),
    };
    let Ok(cname) = CString::new(name.clone()) else {
        if let Some(o) = owner {
            // Just started on this thread; nothing was submitted to it.
            o.close(|_| {});
        }
        return fail(
            &name,
            [base, backing],
            done,
            libc::EINVAL,
            "name contains NUL".into(),
        );
    };
    let align = [&base, &backing]
        .into_iter()
        .flatten()
        .map(|d| d.buf_align())
        .max()
        .unwrap_or(1)
        .max(1);
    let props = bdev::Props {
        blockcnt: info.virtual_size / u64::from(BLOCK_SIZE),
        // Writes are acknowledged before their metadata is stable: only a FLUSH makes them
        // durable (ARCHITECTURE.md §7), which is what a volatile write cache means to SPDK.
        write_cache: owner.is_some(),
        // The hot path hands the guest's buffers to the base: ask for what the base needs.
        required_alignment: if align > 1 { align.ilog2() as u8 } else { 0 },
    };
    let cluster_size = info.cluster_size;
    let node = Node {
        opts: params.open_options(),
        params,
        info,
        base,
        backing,
        md_thread: Thread::current(),
        owner: owner.map_or(OwnerPtr::null(), OwnerBox::into_node),
        seed,
        ring,
        live_channels: Arc::new(AtomicUsize::new(0)),
        retired: Arc::new(Mutex::new(Default::default())),
        switching: Mutex::new(()),
        backing_dropped: AtomicBool::new(false),
    };
    let node = match handle::register::<Qcow2Bdev>(node, cname, &props, |max| {
        cluster_cut(max, cluster_size)
    }) {
        Ok(r) => r,
        Err(e) => {
            // The node comes back to `never_registered` once its io_device is gone.
            registry::lock().creating.retain(|n| n != &name);
            let m = format!("spdk_bdev_register failed: {}", strerror(e));
            tracing::error!("bdev_qcow2_create {name}: {m}");
            return done(Err((e, m)));
        }
    };
    let i = &node.node().info;
    let created = format!(
        "created qcow2 bdev {name} on {} ({} bytes, cluster {}, v{}{}{}{})",
        i.base_bdev,
        i.virtual_size,
        i.cluster_size,
        i.version,
        i.backing_bdev
            .as_ref()
            .map(|b| format!(", backing {b}"))
            .unwrap_or_default(),
        if i.zero_offload { ", zero offload" } else { "" },
        if i.zero_ahead { ", zeroing ahead" } else { "" }
    );
    {
        let mut reg = registry::lock();
        reg.creating.retain(|n| n != &name);
        reg.nodes.push((name.clone(), node));
    }
    tracing::info!("{created}");
    done(Ok(name));
}

/// Events of base and backing bdevs.
struct BaseEvents;

impl bdev::BdevEvents for BaseEvents {
    /// Hot remove of a base or backing bdev: unregister every node using it (its I/O
    /// completes, then destruct closes the descriptors, which lets the base go).
    fn event(ty: sys::spdk_bdev_event_type, name: &str) {
        if ty != sys::SPDK_BDEV_EVENT_REMOVE {
            tracing::info!("bdev {name}: event {ty} ignored");
            return;
        }
        let victims: Vec<String> = registry::lock()
            .nodes
            .iter()
            .filter(|(_, r)| {
                let params = &r.node().params;
                params.base_bdev == name || params.backing_bdev.as_deref() == Some(name)
            })
            .map(|(n, _)| n.clone())
            .collect();
        for v in victims {
            tracing::warn!("bdev {name} is going away: unregistering the qcow2 bdev on it");
            // A second unregistration (a delete already under way) is refused by SPDK.
            let _ = bdev::unregister_by_name(&v, |_| {});
        }
    }
}

// Teardown, in this order (as SPDK's passthru does it):
// 1. SPDK's destruct (the bdev is unregistered and unused): the node leaves the registry,
//    then its io_device is unregistered.
// 2. Once the last channel is destroyed, on the md thread (where the owner lives and the
//    descriptors were opened), after every channel state is freed (so every request has
//    completed): a writable bdev's owner flushes the metadata (`Chain::close`) and is freed.
// 3. The backing then the base descriptor close (releasing the claims), SPDK hears that
//    destruct is done, and the node is freed.

/// Teardown, step 1 (SPDK's `destruct`).
pub fn destruct(key: NodeKey) {
    let node = registry::lock().take(key);
    match node {
        Some(node) => node.unregister_device(),
        None => tracing::error!("destruct of a qcow2 bdev that is not registered"),
    }
}

/// Teardown, between steps 1 and 2: the node's last channel is gone; go to the md thread.
pub fn channels_gone(node: Unregistered) {
    if let Err(e) = node.on_md_thread(close_when_unused) {
        tracing::error!("cannot reach the md thread ({e}): leaking the descriptors");
    }
}

/// Teardown, step 2, once no channel state is left (a channel destroyed while its state
/// still had base I/O in flight is freed later, by its poller).
fn close_when_unused(n: MdNode) {
    if n.node().live_channels.load(Ordering::Acquire) > 0 {
        // A channel state still drains its I/O on some thread: look again shortly.
        let _ = n.again(close_when_unused);
        return;
    }
    n.close_owner(|n, counters| {
        // Every channel retired its counters, and the owner's are final (its tasks are
        // done).
        log_summary(n.node(), counters);
        close_descs(n)
    });
}

/// Logs what the bdev's read-ahead and slice caches did over its life (at delete or
/// shutdown), from the retired channels' counters and the closed owner's. Only once no
/// channel is left (their counters are all in `retired`).
fn log_summary(n: &Node, owner: Option<crate::owner::OwnerCounters>) {
    let mut t = n.retired.lock().map(|r| r.clone()).unwrap_or_default();
    if let Some((p, c, r)) = owner {
        t.add_ring(&r);
        t.l2_cache_hits += c.hits;
        t.l2_cache_misses += c.misses;
        t.prefetch_streams += p.streams;
        t.prefetch_issued += p.issued;
        t.prefetch_loaded += p.loaded;
        t.prefetch_hits += p.hits;
    }
    tracing::info!(
        "qcow2 bdev {}: {} requests; slice caches {} hits, {} misses; read-ahead {} \
         sequential streams, {} slices loaded ahead of {} started, {} reached by their stream; \
         prefetch ring {} streams, {} read-ahead I/Os, {} bytes read ahead, {} bytes served \
         in {} reads ({} of them in part, {} of those with the rest waited for; {} waited for their read-ahead, {} of those then \
         sent to the base), \
         {} bytes evicted unread, {} chunks invalidated by writes, {} compressed fills, \
         {} read-aheads run as tasks",
        n.params.name,
        t.completed,
        t.l2_cache_hits,
        t.l2_cache_misses,
        t.prefetch_streams,
        t.prefetch_loaded,
        t.prefetch_issued,
        t.prefetch_hits,
        t.ring_streams,
        t.ring_readahead_ios,
        t.ring_bytes_read_ahead,
        t.ring_bytes_served,
        t.ring_reads_served,
        t.ring_reads_partial,
        t.ring_partial_waited,
        t.ring_reads_waited,
        t.ring_waited_to_base,
        t.ring_bytes_evicted_unread,
        t.ring_invalidated,
        t.ring_compressed_fills,
        t.ring_readahead_tasks
    );
}

/// Teardown, step 3.
fn close_descs(mut n: MdNode) {
    if let Some(d) = n.node_mut().backing.take() {
        d.close();
    }
    if let Some(d) = n.node_mut().base.take() {
        d.close();
    }
    let n = n.destruct_done();
    tracing::info!("qcow2 bdev {} deleted", n.params.name);
}

/// A node whose bdev never registered, back once its io_device is gone (on the md thread,
/// the one that registered it): its owner closes, then its descriptors.
pub fn never_registered(mut n: Node, owner: Option<OwnerBox>) {
    let descs = [n.backing.take(), n.base.take()];
    let close = move || {
        for d in descs.into_iter().flatten() {
            d.close();
        }
    };
    match owner {
        None => close(),
        // Never used (the bdev never registered).
        Some(o) => o.close(move |_| close()),
    }
}

/// The I/O types `node` serves (SPDK's `io_type_supported`).
pub fn io_type_supported(node: &Node, ty: sys::spdk_bdev_io_type) -> bool {
    let writable = !node.owner.is_null();
    // Claim only what works: reads and resets (which wait for outstanding I/O) always; the
    // rest through the owner of a writable bdev.
    match ty {
        sys::SPDK_BDEV_IO_TYPE_READ | sys::SPDK_BDEV_IO_TYPE_RESET => true,
        sys::SPDK_BDEV_IO_TYPE_WRITE
        | sys::SPDK_BDEV_IO_TYPE_FLUSH
        | sys::SPDK_BDEV_IO_TYPE_UNMAP
        | sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES => writable,
        _ => false,
    }
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
/// SPDK's `max_rw_size` (`None`: SPDK set no limit).
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

/// What `dump_info_json` says about `node` (under `"qcow2"`).
pub fn info_json(node: &Node) -> serde_json::Value {
    serde_json::to_value(&node.info).unwrap_or_default()
}

/// The create calls that `write_config_json` saves for `node`. SPDK saves bdevs in the
/// order they registered, each followed by its own settings (histogram, QoS). An external
/// snapshot registers the old image's read-only bdev after the bdev that now reads through
/// it, so each bdev here also saves, before its own create, those of the qcow2 bdevs its
/// backing chain reaches that registered after it (deepest first), and such a bdev saves
/// nothing at its own place: a reload then creates the backing bdev first.
pub fn config_json(node: &Node) -> Vec<serde_json::Value> {
    let reg = registry::lock();
    // Each bdev's create as it would be saved: without `backing_bdev` once a stream dropped
    // the backing reference (the image no longer names a backing file).
    let order: Vec<(&str, CreateParams)> = reg
        .nodes
        .iter()
        .map(|(n, r)| (n.as_str(), saved_params(r.node())))
        .collect();
    let me = &node.params.name;
    let mine = saved_params(node);
    if carrier(&order, me).is_some() {
        return Vec::new();
    }
    let mut calls = Vec::new();
    let mut next = mine.backing_bdev.clone();
    // Bounded by the number of bdevs (a chain never loops, but a hostile config could).
    for _ in 0..order.len() {
        let Some(b) = next else { break };
        let Some((_, p)) = order.iter().find(|(n, _)| *n == b) else {
            break;
        };
        if carrier(&order, &b) == Some(me.as_str()) {
            calls.push(json!({ "method": "bdev_qcow2_create", "params": p }));
        }
        next = p.backing_bdev.clone();
    }
    calls.reverse();
    calls.push(json!({ "method": "bdev_qcow2_create", "params": mine }));
    calls
}

/// The create call's parameters `save_config` writes for `node`.
fn saved_params(node: &Node) -> CreateParams {
    let mut p = node.params.clone();
    if node.backing_dropped.load(Ordering::Acquire) {
        p.backing_bdev = None;
    }
    p
}

/// The bdev that saves the create of `name` with its own (see [`config_json`]): the topmost
/// of the bdevs reading through it that registered before it, if any.
fn carrier<'a>(order: &[(&'a str, CreateParams)], name: &str) -> Option<&'a str> {
    let pos = |n: &str| order.iter().position(|(x, _)| *x == n);
    let mine = pos(name)?;
    let mut found = None;
    let mut cur = name.to_owned();
    for _ in 0..order.len() {
        let Some((user, _)) = order
            .iter()
            .find(|(_, p)| p.backing_bdev.as_deref() == Some(cur.as_str()))
        else {
            break;
        };
        if pos(user).is_some_and(|u| u < mine) {
            found = Some(*user);
        }
        cur = (*user).to_owned();
    }
    found
}
