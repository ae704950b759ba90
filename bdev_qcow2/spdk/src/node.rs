//! A qcow2 bdev ("node"): what it holds and how the rest of the crate reaches it. Creation
//! (`create.rs`: open and claim the base bdev, read and validate the image on the creating
//! thread — the metadata owner — then register), teardown in a fixed order
//! (`teardown.rs`), what `dump_info_json` and `save_config` write (`info.rs`, `config.rs`).
//!
//! A writable bdev (`read_only: false`, the default) keeps the image it opened on the
//! creating thread as its one writable instance ([`Owner`]); a read-only bdev drops it and
//! lets every channel open its own replica.

mod backing;
mod below;
mod config;
mod create;
pub mod hotplug;
mod identity;
mod info;
mod keep;
pub(crate) mod later;
mod open;
mod passes;
mod teardown;
mod unlock;

use config::config_json;
pub(crate) use create::{
    create, create_unclaimed, open_claimed, open_unclaimed, start_owner, OwnerBacking,
};

pub use below::{Below, OpenedBelow};
pub use identity::check as check_uuid;
pub use info::ImageInfo;

use crate::backing_state::{Link, Shape};
use crate::ffi::bdev::Desc;
use crate::ffi::node::{NodeKey, Nodes};
use crate::ffi::sys;
use crate::ffi::thread::{Homed, Thread};
use crate::ffi::types::Switching;
use crate::owner::Owner;
use crate::params::CreateParams;
use crate::stats::ChannelStats;
use crate::types::{OwnerBox, OwnerPtr, Qcow2Bdev, Unregistered};
use qcow2_engine::golden::{SharedReadCache, Sharer};
use qcow2_engine::image::UnlockedKey;
use qcow2_engine::io::SECTOR;
use qcow2_engine::ring::{RingConfig, WriteGens};
use qcow2_engine::{CoreSeed, OpenOptions, ReadOnlySeed};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Block size of our bdevs (the engine's sector).
pub const BLOCK_SIZE: u32 = crate::ffi::bdev_io::BLOCK_SIZE;
const _: () = assert!(BLOCK_SIZE as u64 == SECTOR);

/// The prefetch ring each channel allocates, and the image's write generations all rings
/// check.
pub type Ring = (RingConfig, Arc<WriteGens>);

/// One qcow2 bdev. Boxed and leaked while registered (`ffi/node.rs`, next to the bdev SPDK
/// knows): its address is the io_device and the bdev's `ctxt`. What never changes after
/// registration is plain; the image under it (descriptors, owner, replica seed, parameters,
/// header information) changes only by an external snapshot's switch
/// ([`switch_image`](Self::switch_image)) and teardown, and is read under the node's lock
/// off the md thread.
pub struct Node {
    /// The metadata owner: the thread that created the bdev (and opened the descriptors).
    md_thread: Option<Thread>,
    /// The CPU the md thread runs on (its reactor's core), as seen at creation.
    md_cpu: Option<u32>,
    /// Engine options of each channel's replica.
    opts: OpenOptions,
    /// The prefetch ring (`None`: `prefetch` is off).
    ring: Option<Ring>,
    /// Counters of the channels already gone (added when each is freed), so
    /// `bdev_qcow2_get_stats` totals cover the bdev's whole life, not only live channels.
    retired: Arc<Mutex<ChannelStats>>,
    /// Writable bdev: the image's one writable instance, on `md_thread` (null: read-only).
    /// Set before registration, replaced by a switch, taken by teardown after the last
    /// channel.
    owner: OwnerPtr,
    /// The image under the node; held while a channel state is built from it, and while a
    /// switch puts another image in.
    image: Mutex<Current>,
    /// A stream dropped the backing reference (`bdev_qcow2_stream`): channels created from
    /// now on read no backing layer, and `save_config` leaves `backing_bdev` out. The
    /// descriptor stays open until the bdev goes (channels may hold its I/O channel).
    backing_dropped: AtomicBool,
    /// Channels still draining operations to a backing bdev that left (its descriptor
    /// closes once none is: `hotplug.rs`).
    backing_pending: Arc<AtomicUsize>,
    /// A deep chain's qcow2 layers under the backing bdev, which channels read as layers of
    /// their own chain (`below.rs`; `None`: the backing bdev is read as one raw layer).
    /// Closed at teardown, or once every core left a removed backing bdev.
    below: Mutex<Option<Below>>,
    /// Channels built from now on read `below` (cleared when the backing bdev leaves or an
    /// external snapshot switches the image).
    below_on: AtomicBool,
    /// `below` was set at creation: a removed backing bdev is not read again.
    flattened: bool,
    /// A read-only bdev in a chain: its own channel on the md thread (`keep.rs`).
    kept: Mutex<Option<crate::ffi::io_channel::Kept>>,
    /// A read-only bdev over another one of a chain (it keeps a channel): its channels on
    /// the md thread take its base's channel on first use (`keep.rs`).
    link: bool,
}

/// The image under a node, as the node keeps it (its owner aside).
struct Current {
    /// The base bdev (holding the image).
    base: Option<Desc>,
    /// The backing bdev.
    backing: Option<Desc>,
    /// Writable bdev: what other threads' channels build their replica from (the owner's
    /// shared epochs, L1 and geometry).
    seed: Option<CoreSeed>,
    /// The create call, written back by `write_config_json`.
    params: CreateParams,
    /// What the image header said.
    info: ImageInfo,
    /// Channel states built from this image not yet freed. SPDK may destroy a channel
    /// while its state still has base I/O in flight (a replica being opened); that state is
    /// freed later by its poller, and the descriptors must stay open until then.
    live_channels: Arc<AtomicUsize>,
    /// The read cache of the backing bdev, shared with every bdev over the same one.
    backing_cache: Option<Sharer>,
    /// The key an encrypted image was unlocked with.
    key: Option<UnlockedKey>,
    /// Read-only bdev: what its channels copy their image from ([`Image::ro_seed`]).
    ro_seed: Option<Arc<ReadOnlySeed>>,
    /// Where the backing bdev is in a hot-removal and return (`None`: no backing bdev).
    link: Option<Link>,
}

impl Current {
    fn of(i: Image) -> Current {
        let backing_cache = i
            .backing
            .as_ref()
            .and_then(|b| crate::golden::cache_for(b, i.params.backing_cache_bytes()))
            .map(|c| c.share());
        // A returning bdev must fit what the bdev was registered with.
        let missing = i.backing.is_none() && i.params.backing_bdev.is_some();
        let align = needed_align(i.base.as_ref(), i.backing.as_ref(), missing);
        let link = match &i.backing {
            Some(b) => Some(Link::present(Shape {
                size: b.size(),
                align,
            })),
            // Missing at creation: created degraded, read once it appears.
            None if missing => Some(Link::missing(Shape {
                size: i.info.virtual_size,
                align,
            })),
            None => None,
        };
        Current {
            link,
            base: i.base,
            backing: i.backing,
            seed: i.seed,
            params: i.params,
            info: i.info,
            live_channels: i.live_channels,
            backing_cache,
            key: i.key,
            ro_seed: i.ro_seed,
        }
    }
}

/// How a node serves its image.
// Built once per bdev (or switch) and moved into its `Image` at once: the replica seed
// stays inline rather than boxed.
#[allow(clippy::large_enum_variant)]
pub enum Serving {
    /// Writable: the image's one writable instance, on the md thread.
    Writable {
        /// The metadata owner.
        owner: OwnerBox,
        /// What other threads' replicas are built from.
        seed: Option<CoreSeed>,
    },
    /// Read-only: the image as its creation opened it, which every channel (and a deep
    /// chain's overlay above, as one of its layers) copies instead of reading it again.
    ReadOnly(Arc<ReadOnlySeed>),
}

/// The image under a node, as [`Node::new`] takes it and
/// [`Registered::switch_image`](crate::ffi::node::Registered::switch_image) swaps it: a
/// value handed over whole.
pub struct Image {
    /// The base descriptor (holding the image).
    base: Option<Desc>,
    /// The backing descriptor.
    backing: Option<Desc>,
    /// The image's metadata owner (`None`: a read-only bdev, or taken out).
    owner: Option<OwnerBox>,
    /// What other threads' replicas are built from.
    seed: Option<CoreSeed>,
    /// The create call `save_config` writes.
    params: CreateParams,
    /// What the header said.
    info: ImageInfo,
    /// Channel states built from this image that are not freed yet.
    live_channels: Arc<AtomicUsize>,
    /// The key an encrypted image was unlocked with (a read-only bdev's channels unlock
    /// their replicas with it).
    key: Option<UnlockedKey>,
    /// Read-only bdev: what its channels copy (see [`Serving::ReadOnly`]).
    ro_seed: Option<Arc<ReadOnlySeed>>,
}

impl Image {
    /// The image of the create call `params`, over its `base` and `backing` descriptors,
    /// served as `serving` says; `info` is what its header said, `key` what an encrypted
    /// image was unlocked with. No channel state is built from it yet.
    pub fn new(
        [base, backing]: [Option<Desc>; 2],
        serving: Serving,
        params: CreateParams,
        info: ImageInfo,
        key: Option<UnlockedKey>,
    ) -> Image {
        let (owner, seed, ro_seed) = match serving {
            Serving::Writable { owner, seed } => (Some(owner), seed, None),
            Serving::ReadOnly(s) => (None, None, Some(s)),
        };
        Image {
            base,
            backing,
            owner,
            seed,
            params,
            info,
            live_channels: Arc::new(AtomicUsize::new(0)),
            key,
            ro_seed,
        }
    }

    /// The count of channel states built from this image and not freed yet.
    pub fn live_channels(&self) -> Arc<AtomicUsize> {
        self.live_channels.clone()
    }

    /// Takes the metadata owner out (`None`: read-only, or already taken).
    pub fn take_owner(&mut self) -> Option<OwnerBox> {
        self.owner.take()
    }

    /// Takes the descriptors out, backing first (the order they are closed in).
    pub fn take_descs(&mut self) -> [Option<Desc>; 2] {
        [self.backing.take(), self.base.take()]
    }
}

/// One of the bdevs under a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Under {
    /// The base bdev (holding the image).
    Base,
    /// The backing bdev.
    Backing,
}

/// Whether a node takes writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAccess {
    /// It has a metadata owner; its channels forward what needs it there.
    Writable,
    /// It serves reads only.
    ReadOnly,
}

/// Whether a channel reads ahead on sequential streams (the `prefetch` parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// Read-ahead on.
    On,
    /// Read-ahead off.
    Off,
}

/// When a channel takes its base bdev's I/O channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseChannel {
    /// At once, with the direct path.
    AtCreation,
    /// On first use, and no direct path: a link of a chain on its md thread (`keep.rs`),
    /// where taking it at once would build every channel below, nested.
    OnFirstUse,
}

/// What a channel state is built from: one consistent view of the node, taken under its
/// lock ([`Node::new_channel`]), so no switch changes it halfway.
pub struct ChannelSource<'a> {
    base: Option<&'a Desc>,
    backing: Option<&'a Desc>,
    access: NodeAccess,
    md_thread: Option<Thread>,
    md_cpu: Option<u32>,
    owner: Option<Homed<Owner>>,
    seed: Option<&'a CoreSeed>,
    opts: OpenOptions,
    prefetch: Prefetch,
    ring: Option<&'a Ring>,
    live: &'a Arc<AtomicUsize>,
    retired: &'a Arc<Mutex<ChannelStats>>,
    backing_cache: Option<&'a Arc<SharedReadCache>>,
    key: Option<&'a UnlockedKey>,
    backing_gone: Option<Gone>,
    backing_generation: u64,
    backing_pending: &'a Arc<AtomicUsize>,
    below: Option<&'a Below>,
    ro_seed: Option<&'a Arc<ReadOnlySeed>>,
    base_channel: BaseChannel,
}

impl<'a> ChannelSource<'a> {
    /// The base descriptor (`None`: the node is being torn down).
    pub fn base(&self) -> Option<&'a Desc> {
        self.base
    }
    /// The backing descriptor, unless a stream dropped the backing reference or the
    /// backing bdev is gone.
    pub fn backing(&self) -> Option<&'a Desc> {
        self.backing
    }
    /// Whether the bdev takes writes (its requests may go to the owner).
    pub fn access(&self) -> NodeAccess {
        self.access
    }
    /// The md thread.
    pub fn md_thread(&self) -> Option<Thread> {
        self.md_thread
    }
    /// Whether the caller runs on the md thread's core (a channel there gains nothing by
    /// writing first writes' data itself: the owner's thread shares its core).
    pub fn on_md_core(&self) -> bool {
        self.md_cpu.is_some() && self.md_cpu == crate::ffi::thread::current_cpu()
    }
    /// Writable bdev: the owner, reached from the channel's thread by message (taken out:
    /// `None` the second time).
    pub fn take_owner(&mut self) -> Option<Homed<Owner>> {
        self.owner.take()
    }
    /// Writable bdev: what a replica is built from.
    pub fn seed(&self) -> Option<&'a CoreSeed> {
        self.seed
    }
    /// The same source without a replica's seed: a writable bdev's channel built from it
    /// forwards every request to the owner.
    pub fn forward_only(self) -> Self {
        ChannelSource { seed: None, ..self }
    }
    /// Engine options of the replica.
    pub fn opts(&self) -> OpenOptions {
        self.opts
    }
    /// Read-ahead on sequential streams.
    pub fn prefetch(&self) -> Prefetch {
        self.prefetch
    }
    /// The prefetch ring (`None`: `prefetch` is off).
    pub fn ring(&self) -> Option<&'a Ring> {
        self.ring
    }
    /// The count of live channel states of this image (the channel adds itself).
    pub fn live(&self) -> &'a Arc<AtomicUsize> {
        self.live
    }
    /// Where the channel's counters go when it is freed.
    pub fn retired(&self) -> &'a Arc<Mutex<ChannelStats>> {
        self.retired
    }
    /// The backing bdev's shared read cache.
    pub fn backing_cache(&self) -> Option<&'a Arc<SharedReadCache>> {
        self.backing_cache
    }
    /// The key an encrypted image was unlocked with.
    pub fn key(&self) -> Option<&'a UnlockedKey> {
        self.key
    }
    /// The backing bdev is gone (hot-removed): the channel reads it through a device
    /// that fails every operation until the bdev returns.
    pub fn backing_gone(&self) -> Option<Gone> {
        self.backing_gone
    }
    /// The generation of the backing descriptor (0 while gone).
    pub fn backing_generation(&self) -> u64 {
        self.backing_generation
    }
    /// The node's count of channels draining a backing bdev that left.
    pub fn backing_pending(&self) -> &'a Arc<AtomicUsize> {
        self.backing_pending
    }
    /// A deep chain's layers under the backing bdev, read in place of it (`below.rs`).
    pub fn below(&self) -> Option<&'a Below> {
        self.below
    }
    /// Read-only bdev: the image to copy (its channels read nothing to open it).
    pub fn ro_seed(&self) -> Option<&'a Arc<ReadOnlySeed>> {
        self.ro_seed
    }
    /// When the channel takes its base bdev's I/O channel.
    pub fn base_channel(&self) -> BaseChannel {
        self.base_channel
    }
}

/// The buffer alignment a node over `base` and `backing` asks for (at least 1): what they
/// need, and with a backing bdev `missing` at creation at least
/// [`MISSING_BACKING_ALIGN`] (it must fit what the bdev registered with when it appears).
pub fn needed_align(base: Option<&Desc>, backing: Option<&Desc>, missing: bool) -> usize {
    let floor = if missing { MISSING_BACKING_ALIGN } else { 1 };
    [base, backing]
        .into_iter()
        .flatten()
        .map(|d| d.buf_align())
        .fold(floor, usize::max)
}

/// The alignment a node asks for when its backing bdev is missing at creation: a
/// 4096-byte-sector AIO file needs this much; a bdev that needs more is refused when it
/// appears (logged), as a returning one is.
pub const MISSING_BACKING_ALIGN: usize = 4096;

/// A backing bdev that is gone, as a channel's device stands in for it.
#[derive(Debug, Clone, Copy)]
pub struct Gone {
    /// Its size when it left.
    size: u64,
    /// The buffer alignment the node asks for.
    align: usize,
    /// Its reads may go through a shared cache once it is back.
    may_cache: bool,
}

impl Gone {
    /// Its size in bytes when it left.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The buffer alignment the node asks for.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Whether its reads may go through a shared cache once it is back.
    pub fn may_cache(&self) -> bool {
        self.may_cache
    }
}

impl Node {
    /// A node over `image`, created on this thread (its md thread), with the prefetch ring
    /// `ring`.
    pub fn new(mut image: Image, ring: Option<Ring>, below: Option<Below>) -> Node {
        let owner = image.owner.take();
        let below_on = AtomicBool::new(below.is_some());
        Node {
            md_thread: Thread::current(),
            md_cpu: crate::ffi::thread::current_cpu(),
            opts: image.params.open_options(),
            ring,
            retired: Arc::new(Mutex::new(Default::default())),
            owner: owner.map_or(OwnerPtr::null(), OwnerBox::into_node),
            image: Mutex::new(Current::of(image)),
            backing_dropped: AtomicBool::new(false),
            backing_pending: Arc::new(AtomicUsize::new(0)),
            flattened: below.is_some(),
            below: Mutex::new(below),
            below_on,
            kept: Mutex::new(None),
            link: false,
        }
    }

    /// The image, locked (a poisoned lock is recovered: every update is one swap).
    fn current(&self) -> MutexGuard<'_, Current> {
        self.image.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The thread that created the node: its metadata owner's.
    pub fn md_thread(&self) -> Option<Thread> {
        self.md_thread
    }

    /// The metadata owner (null: a read-only node), for `ffi`'s accesses.
    #[inline(always)]
    pub fn owner(&self) -> &OwnerPtr {
        &self.owner
    }

    /// Whether the bdev takes writes (it has a metadata owner).
    pub fn writable(&self) -> bool {
        !self.owner.is_null()
    }

    /// The bdev's name.
    pub fn name(&self) -> String {
        self.current().params.name.clone()
    }

    /// The create call of the image the bdev serves now.
    pub fn params(&self) -> CreateParams {
        self.current().params.clone()
    }

    /// The create call's parameters `save_config` writes: without `backing_bdev` once a
    /// stream dropped the backing reference (the image no longer names a backing file).
    pub fn saved_params(&self) -> CreateParams {
        let mut p = self.params();
        if self.backing_dropped.load(Ordering::Acquire) {
            p.backing_bdev = None;
        }
        p
    }

    /// The image's cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        self.current().info.cluster_size
    }

    /// What `dump_info_json` says about the image (under `"qcow2"`): as `owner` (the
    /// metadata owner, when asked on the md thread) has it now, else as read when the
    /// image was opened (a read-only image never changes).
    pub fn info_json(&self, owner: Option<&Owner>) -> serde_json::Value {
        let info = match owner {
            Some(o) => {
                let saved = self.saved_params();
                self.current().info.now(o, &saved)
            }
            None => self.current().info.clone(),
        };
        let mut v = serde_json::to_value(&info).unwrap_or_default();
        if let Some(c) = self.backing_cache_json() {
            v["backing_cache"] = c;
        }
        if let Some(p) = self.backing_phase() {
            v["backing_state"] = p.name().into();
        }
        if let Some(d) = self.below_depth() {
            // A deep chain's layers read directly under the top (`below.rs`).
            v["backing_layers"] = d.into();
        }
        v
    }

    /// The backing bdev's shared read cache as the stats show it (`None`: no cache).
    pub fn backing_cache_json(&self) -> Option<serde_json::Value> {
        self.current()
            .backing_cache
            .as_ref()
            .map(|s| crate::golden::stats_json(s.cache()))
    }

    /// The prefetch ring's settings and write generations (`None`: `prefetch` is off).
    pub fn ring(&self) -> Option<&Ring> {
        self.ring.as_ref()
    }

    /// The buffer alignment the base and backing bdevs need (at least 1).
    pub fn buf_align(&self) -> usize {
        let c = self.current();
        match &c.link {
            // What the node registered with (a returning bdev must fit it).
            Some(l) => l.shape().align.max(1),
            None => needed_align(c.base.as_ref(), None, false),
        }
    }

    /// Whether the chain still reads a backing bdev (one is open and no stream dropped it).
    pub fn reads_backing(&self) -> bool {
        self.current().link.is_some() && !self.backing_dropped.load(Ordering::Acquire)
    }

    /// A stream dropped the backing reference: channels created from now on read no
    /// backing layer, and `save_config` leaves `backing_bdev` out.
    pub fn drop_backing(&self) {
        self.backing_dropped.store(true, Ordering::Release);
    }

    /// Claims the node's bdev `which` for reading only (as `bdev_qcow2_create` claims a
    /// backing bdev). `None`: it has no such descriptor; `Err`: SPDK's errno and the
    /// bdev's name.
    pub fn claim_read_only(&self, which: Under) -> Option<Result<(), (i32, String)>> {
        let c = self.current();
        let d = match which {
            Under::Base => &c.base,
            Under::Backing => &c.backing,
        };
        let d = d.as_ref()?;
        Some(
            d.claim(sys::SPDK_BDEV_CLAIM_READ_MANY_WRITE_NONE)
                .map_err(|e| (e, d.name())),
        )
    }

    /// The counters of the channels already gone.
    pub fn retired(&self) -> ChannelStats {
        self.retired.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Channel states of the current image not freed yet.
    pub fn live_channels(&self) -> usize {
        self.current().live_channels.load(Ordering::Acquire)
    }

    /// Builds a channel state with `build` from one consistent view of the node (under its
    /// lock, so no switch changes the image meanwhile).
    pub fn new_channel<R>(&self, build: impl FnOnce(ChannelSource<'_>) -> R) -> R {
        let c = self.current();
        let writable = self.writable();
        let md = self.md_thread;
        // After a stream's drop a new channel never reads the backing bdev.
        let dropped = self.backing_dropped.load(Ordering::Acquire);
        let (backing, backing_gone, backing_generation) = match &c.link {
            Some(l) if !dropped && l.readable() => (c.backing.as_ref(), None, l.generation()),
            Some(l) if !dropped => {
                let gone = Gone {
                    size: l.shape().size,
                    align: l.shape().align,
                    may_cache: c.params.backing_cache_bytes() > 0,
                };
                (None, Some(gone), 0)
            }
            _ => (None, None, 0),
        };
        let below = self.below.lock().unwrap_or_else(|e| e.into_inner());
        let below = below
            .as_ref()
            .filter(|_| backing.is_some() && self.below_on.load(Ordering::Acquire));
        let lazy = self.link && c.ro_seed.is_some() && md.is_some_and(Thread::is_current);
        build(ChannelSource {
            below,
            ro_seed: c.ro_seed.as_ref(),
            base_channel: if lazy {
                BaseChannel::OnFirstUse
            } else {
                BaseChannel::AtCreation
            },
            base: c.base.as_ref(),
            backing,
            backing_gone,
            backing_generation,
            backing_pending: &self.backing_pending,
            access: if writable {
                NodeAccess::Writable
            } else {
                NodeAccess::ReadOnly
            },
            md_thread: md,
            md_cpu: self.md_cpu,
            owner: self.owner.homed(md),
            seed: c.seed.as_ref(),
            opts: self.opts,
            prefetch: if c.params.prefetch_on() {
                Prefetch::On
            } else {
                Prefetch::Off
            },
            ring: self.ring.as_ref(),
            live: &c.live_channels,
            retired: &self.retired,
            backing_cache: c.backing_cache.as_ref().map(Sharer::cache),
            key: c.key.as_ref(),
        })
    }

    /// Takes the descriptors out, backing first, to be closed where they were opened (on
    /// the md thread, once no channel is left).
    pub fn take_descs(&self) -> [Option<Desc>; 2] {
        let mut c = self.current();
        [c.backing.take(), c.base.take()]
    }

    /// Puts `new` under the node in place of its image: descriptors, owner, replica seed,
    /// parameters, header information, and the count of channel states built from them.
    /// Returns the former image, its owner back in its box; `Err`: `new` has no owner. The
    /// token ([`Switching`]) says the caller is on the md thread of a writable node with no
    /// request in flight.
    pub fn switch_image(
        &self,
        mut new: Box<Image>,
        t: &Switching,
    ) -> Result<Box<Image>, Box<Image>> {
        let Some(owner) = new.owner.take() else {
            return Err(new);
        };
        let new = *new;
        let mut c = self.current();
        let old_owner = self.owner.replace(owner, t);
        // The new image names its backing (the old one): nothing was dropped from it.
        self.backing_dropped.store(false, Ordering::Release);
        // Its backing is the old image's bdev: new channels read it as one layer (the old
        // channels keep their layers until they are gone; teardown closes them).
        self.below_on.store(false, Ordering::Release);
        let old = std::mem::replace(&mut *c, Current::of(new));
        Ok(Box::new(Image {
            base: old.base,
            backing: old.backing,
            owner: old_owner,
            seed: old.seed,
            params: old.params,
            info: old.info,
            live_channels: old.live_channels,
            key: old.key,
            ro_seed: old.ro_seed,
        }))
    }

    /// The I/O types the node serves (SPDK's `io_type_supported`).
    pub fn io_type_supported(&self, ty: sys::spdk_bdev_io_type) -> bool {
        let writable = self.writable();
        // Claim only what works: reads and resets (which wait for outstanding I/O) always;
        // the rest through the owner of a writable bdev.
        match ty {
            sys::SPDK_BDEV_IO_TYPE_READ | sys::SPDK_BDEV_IO_TYPE_RESET => true,
            sys::SPDK_BDEV_IO_TYPE_WRITE
            | sys::SPDK_BDEV_IO_TYPE_FLUSH
            | sys::SPDK_BDEV_IO_TYPE_UNMAP
            | sys::SPDK_BDEV_IO_TYPE_WRITE_ZEROES => writable,
            _ => false,
        }
    }
}

/// SPDK's calls on our bdevs, and the image switch.
impl Nodes for Qcow2Bdev {
    type Image = Image;

    fn destruct(key: NodeKey) {
        teardown::destruct(key)
    }

    fn channels_gone(node: Unregistered) {
        teardown::channels_gone(node)
    }

    fn never_registered(node: Node, owner: Option<OwnerBox>) {
        teardown::never_registered(node, owner)
    }

    fn io_type_supported(node: &Node, ty: sys::spdk_bdev_io_type) -> bool {
        node.io_type_supported(ty)
    }

    fn info_json(node: &Node, owner: Option<&Owner>) -> serde_json::Value {
        node.info_json(owner)
    }

    fn config_json(node: &Node) -> Vec<serde_json::Value> {
        config_json(node)
    }

    fn swap_image(
        node: &Node,
        new: Box<Image>,
        token: &Switching,
    ) -> Result<Box<Image>, Box<Image>> {
        node.switch_image(new, token)
    }
}
