//! Cross-core coherency of metadata replicas (ARCHITECTURE.md §6): the state the metadata owner
//! publishes to the cores, lock-free.
//!
//! - **Slice epochs**: one atomic word per L2 slice of the image (hashed into at most
//!   [`MAX_EPOCH_SLOTS`] slots) holding the slot's epoch and its count of removals
//!   ([`SliceStamp`]). The owner makes a slot odd before a slice in it changes and keeps it
//!   odd while any slice of the slot is dirty or being written back; every further change
//!   adds 2 (stays odd); when the last one is written back it becomes even again. A change
//!   that removes or moves a mapping (anything but [`SliceChange::Adds`]) also counts a
//!   removal, in the same atomic add. All of this happens **before** the owner acknowledges
//!   the operation that changed the slice, so a request submitted after that
//!   acknowledgement sees a new epoch (and, after a removal, a new count).
//! - A core uses a cached slice for anything while the slot's epoch equals the epoch it was
//!   read under. For an in-place overwrite it may also use an older copy while the slot's
//!   count of removals equals the copy's: the owner only added mappings since, so every
//!   cluster the copy shows as COPIED data still is, at the same host offset. On a miss
//!   with an even epoch it reads the slice from the device itself and keeps it only if the
//!   epoch did not move during the read (a seqlock over the device); with an odd epoch it
//!   asks the owner, who answers with a copy of its dirty slice ([`SliceReply::Copy`]) or,
//!   when this slice is clean and only shares the slot with a dirty one, with
//!   [`SliceReply::Clean`] and the stamp under which a device read is valid.
//! - **L1 entries** and the **device size** are published as atomics: a core locates L2
//!   tables through them (the owner changes an L1 entry only after making the slices of
//!   the new table odd, so a core that sees the new entry also fails its seqlock check).
//! - **Metadata clusters**: a bitmap of the host clusters that hold metadata (header,
//!   tables, refcount blocks, L2 tables), for the cores' overlap check before an in-place
//!   write. Bits are only ever set while the image is open (a stale bit only sends a write
//!   to the owner, who checks with its exact index); clusters past the bitmap count as
//!   metadata for the same reason.
//!
//! The atomics come from `loom` under `--cfg loom`, so `tests/loom_epochs.rs` model-checks
//! this very code.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod epochs;
pub mod fences;
mod grace;
#[cfg(all(test, not(loom)))]
mod tests;

pub use epochs::OwnerEpochs;
pub use grace::{Counters, Parity, MAX_GRACE_MEMBERS};
// The raw grace period: hosts enter and leave it through `GraceEntry` only; the fence and
// model tests drive it directly.
#[cfg(not(feature = "testing"))]
pub(crate) use grace::Grace;
#[cfg(feature = "testing")]
pub use grace::Grace;

/// Upper bound on epoch slots (4 MiB of epochs): larger images hash several slices into
/// one slot, which only costs false invalidations.
pub const MAX_EPOCH_SLOTS: u64 = 1 << 20;

/// Upper bound on the metadata-cluster bitmap (8 MiB: 64 Mi clusters). Clusters past it
/// are treated as metadata by the cores (their writes go to the owner).
pub const MAX_META_BITMAP_WORDS: u64 = 1 << 20;

/// An epoch slot's word as read at one instant: the slot's epoch (odd while a slice of the
/// slot is dirty) and its count of removals (changes that removed or moved a mapping,
/// cleared COPIED or set a zero flag). A copy of a slice is recorded with the stamp it was
/// taken under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceStamp(u64);

impl SliceStamp {
    /// The stamp the owner's own cache records (its copies are kept in step with its
    /// changes and never validated).
    pub const OWNER: SliceStamp = SliceStamp(0);

    /// The stamp of `epoch` and count `removals`, as a slot's word packs them.
    #[inline(always)]
    pub(crate) const fn of(epoch: u32, removals: u32) -> SliceStamp {
        SliceStamp(epoch as u64 | (removals as u64) << 32)
    }

    /// The slot's epoch.
    #[inline(always)]
    pub fn epoch(self) -> u32 {
        self.0 as u32
    }

    /// The slot's count of removals (wraps).
    #[inline(always)]
    pub fn removals(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// The stamp of slice `key` in `words` (a [`Shared::epoch_words`]) when the key is its own
/// slot there (`None`: ask [`Shared::stamp`], which hashes it); as `Shared::stamp` loads it.
#[inline(always)]
pub(crate) fn stamp_of(words: &[AtomicU64], key: u64) -> Option<SliceStamp> {
    let e = usize::try_from(key).ok().and_then(|k| words.get(k))?;
    Some(SliceStamp(e.load(Ordering::SeqCst)))
}

/// How the owner changed a slice, for the slot's count of removals (ARCHITECTURE.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceChange {
    /// Only additions: every cluster (subcluster) that an older copy of the slice shows as
    /// COPIED data is still COPIED data at the same host offset (an allocation, a bitmap
    /// gaining allocated subclusters, COPIED set again, a slice made dirty unchanged).
    Adds,
    /// Anything else: a mapping removed or moved (discard, write-zeroes, COW), COPIED
    /// cleared, a zero flag set, a table copied or replaced.
    Removes,
}

/// What the owner answers a core that asks for a slice whose epoch is odd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SliceReply {
    /// The owner's current (dirty) copy of the slice, valid while the epoch stays the
    /// stamp's (and, for overwrites, while the count of removals stays the stamp's).
    Copy {
        /// The slice's entries (host order words, as in the cache).
        words: Vec<u64>,
        /// The slot's stamp when the copy was taken.
        stamp: SliceStamp,
    },
    /// The slice is clean: the device holds it; a device read is valid if the slot's epoch
    /// is still the stamp's after it.
    Clean {
        /// The slot's stamp when the owner answered.
        stamp: SliceStamp,
    },
    /// The L2 table is gone or the owner failed: retry through the normal path.
    Retry,
}

/// L1 entries published beyond a table of `len` entries, so that the image can grow
/// online without the cores' L1 moving: three times the table, at least 1,024 entries
/// (8 KiB; 512 GiB more disk with 64 KiB clusters), at most 65,536 (512 KiB), and never
/// past the largest L1 table an image may have.
fn l1_headroom(len: usize) -> usize {
    let extra = (len.saturating_mul(3)).clamp(1024, 65536);
    extra.min((crate::limits::MAX_L1_ENTRIES as usize).saturating_sub(len))
}

/// State the owner publishes to every core (shared with `Arc`).
pub struct Shared {
    /// Per slot: the epoch in the low half, the count of removals in the high half (one
    /// word, so that a core reads both at one instant; an epoch's carry only counts a
    /// removal more). An `Arc` of its own: a core's memo view holds the words themselves
    /// (`memo::MemoView`), one load closer on every request than through this state.
    epochs: Arc<[AtomicU64]>,
    epoch_mask: u64,
    /// The L1 table, with room to grow online (entries past the table read 0).
    l1: Box<[AtomicU64]>,
    device_size: AtomicU64,
    /// The virtual disk size as the owner last changed it (0: not published). Cores read it
    /// only when a request falls outside the size they know.
    virtual_size: AtomicU64,
    meta_bits: Box<[AtomicU64]>,
    /// Bumped after every bit set in `meta_bits`: a core that found a range of clusters
    /// clear under one value knows it is still clear while the value holds.
    meta_gen: AtomicU64,
    /// The cluster marked at each of the last [`META_LOG`] generations (generation `g` in
    /// slot `g % META_LOG`), written before the generation moves past it.
    meta_log: [AtomicU64; META_LOG],
    /// Grace periods before freed clusters are reused.
    pub(crate) grace: Grace,
    /// Moved by the owner whenever freed clusters become its allocator's again, before it
    /// hands any out: bytes in use at one value are unchanged while it holds.
    reuse: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("epoch_slots", &self.epochs.len())
            .field("l1_entries", &self.l1.len())
            .field("meta_bitmap_words", &self.meta_bits.len())
            .finish()
    }
}

impl Shared {
    /// The raw grace period, for the fence and model tests (hosts enter it through
    /// `GraceEntry` only).
    #[cfg(feature = "testing")]
    pub fn grace(&self) -> &Grace {
        &self.grace
    }

    /// The reuse generation (see the field): a core reads it after resolving a mapping,
    /// so it sees any move made before the owner published that mapping.
    pub fn reuse_gen(&self) -> u64 {
        self.reuse.load(Ordering::Acquire)
    }

    /// Owner: freed clusters are about to be handed out again.
    pub(crate) fn bump_reuse(&self) {
        self.reuse.fetch_add(1, Ordering::Release);
    }

    /// Shared state for an image with `total_slices` L2 slices, L1 table `l1` (raw
    /// entries), on a device of `device_size` bytes whose metadata may reach
    /// `max_clusters` host clusters.
    pub fn new(total_slices: u64, l1: &[u64], device_size: u64, max_clusters: u64) -> Self {
        let slots = total_slices
            .clamp(1, MAX_EPOCH_SLOTS)
            .next_power_of_two()
            .min(MAX_EPOCH_SLOTS);
        let words = max_clusters.div_ceil(64).clamp(1, MAX_META_BITMAP_WORDS);
        Shared {
            epochs: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            epoch_mask: slots - 1,
            l1: l1
                .iter()
                .map(|&e| AtomicU64::new(e))
                .chain((0..l1_headroom(l1.len())).map(|_| AtomicU64::new(0)))
                .collect(),
            device_size: AtomicU64::new(device_size),
            virtual_size: AtomicU64::new(0),
            meta_bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
            meta_gen: AtomicU64::new(0),
            meta_log: std::array::from_fn(|_| AtomicU64::new(0)),
            grace: Grace::default(),
            reuse: AtomicU64::new(0),
        }
    }

    /// The epoch slot of slice `key`.
    #[inline]
    pub fn slot(&self, key: u64) -> usize {
        // Fibonacci hashing spreads strided keys; identity when every slice has a slot.
        if self.epochs.len() as u64 > key {
            key as usize
        } else {
            ((key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) & self.epoch_mask) as usize
        }
    }

    /// Number of epoch slots.
    pub fn slots(&self) -> usize {
        self.epochs.len()
    }

    /// Current epoch of slice `key` (acquire: a core then reads L1 and the device).
    #[inline(always)]
    pub fn epoch(&self, key: u64) -> u32 {
        self.stamp(key).epoch()
    }

    /// Current stamp (epoch and count of removals) of slice `key`, in one load.
    #[inline(always)]
    pub fn stamp(&self, key: u64) -> SliceStamp {
        // SeqCst (a plain load on x86) to order after a grace-period entry. A key below the
        // slot count is its own slot (see `slot`): one bounds check on the hit path.
        SliceStamp(
            match usize::try_from(key).ok().and_then(|k| self.epochs.get(k)) {
                Some(e) => e.load(Ordering::SeqCst),
                None => self.epochs[self.slot(key)].load(Ordering::SeqCst),
            },
        )
    }

    /// The epoch words themselves, for a view that reads a slice's stamp without this
    /// state ([`stamp_of`]: a key below their count is its own slot; others go through
    /// [`stamp`](Self::stamp)).
    pub(crate) fn epoch_words(&self) -> Arc<[AtomicU64]> {
        self.epochs.clone()
    }

    /// Current epoch of slot `slot`.
    pub fn slot_epoch(&self, slot: usize) -> u32 {
        self.epochs[slot].load(Ordering::Acquire) as u32
    }

    /// Raw L1 entry `idx` (0 past the table).
    #[inline]
    pub fn l1(&self, idx: usize) -> u64 {
        self.l1.get(idx).map_or(0, |e| e.load(Ordering::SeqCst))
    }

    /// Number of L1 entries cores can see: the table's, and room for it to grow online
    /// (those read 0 until the owner publishes them).
    #[inline]
    pub fn l1_len(&self) -> usize {
        self.l1.len()
    }

    /// The virtual disk size the owner published last (0: none yet).
    pub fn virtual_size(&self) -> u64 {
        self.virtual_size.load(Ordering::Acquire)
    }

    /// Owner: publishes the virtual disk size, once the metadata behind it is in place.
    pub fn set_virtual_size(&self, size: u64) {
        self.virtual_size.store(size, Ordering::Release);
    }

    /// Device size entries may point at.
    #[inline]
    pub fn device_size(&self) -> u64 {
        self.device_size.load(Ordering::Acquire)
    }

    /// The metadata bitmap's generation (see [`meta_range_clear`](Self::meta_range_clear)).
    #[inline(always)]
    pub fn meta_gen(&self) -> u64 {
        self.meta_gen.load(Ordering::Acquire)
    }

    /// Whether none of host clusters `first..first + n` is metadata (a cluster past the
    /// bitmap counts as metadata). Read [`meta_gen`](Self::meta_gen) first: while it is
    /// unchanged, the answer holds.
    pub fn meta_range_clear(&self, first: u64, n: u64) -> bool {
        let Some(end) = first.checked_add(n) else {
            return false;
        };
        let mut c = first;
        while c < end {
            let Some(w) = self.meta_bits.get((c / 64) as usize) else {
                return false;
            };
            let lo = c % 64;
            let hi = (end - (c - lo)).min(64);
            let mask = (u64::MAX >> (64 - (hi - lo))) << lo;
            if w.load(Ordering::Acquire) & mask != 0 {
                return false;
            }
            c += hi - lo;
        }
        true
    }

    /// Whether host cluster `c` may hold metadata (true past the bitmap).
    #[inline]
    pub fn is_meta_cluster(&self, c: u64) -> bool {
        match self.meta_bits.get((c / 64) as usize) {
            Some(w) => w.load(Ordering::Acquire) & (1 << (c % 64)) != 0,
            None => true,
        }
    }

    // ----- owner side --------------------------------------------------------------

    /// Owner: slot `slot` gets its first dirty slice (even → odd), changed as `change`
    /// says (a removal also moves the slot's count of removals).
    pub fn owner_open(&self, slot: usize, change: SliceChange) {
        let e = &self.epochs[slot];
        debug_assert!(e.load(Ordering::Relaxed) & 1 == 0);
        e.fetch_add(1 + removal(change), Ordering::SeqCst);
    }

    /// Owner: a slice of odd slot `slot` changes (odd → next odd), as `change` says.
    pub fn owner_changed(&self, slot: usize, change: SliceChange) {
        let e = &self.epochs[slot];
        debug_assert!(e.load(Ordering::Relaxed) & 1 == 1);
        e.fetch_add(2 + removal(change), Ordering::SeqCst);
    }

    /// Owner: the last dirty slice of slot `slot` reached the device (odd → even).
    pub fn owner_close(&self, slot: usize) {
        let e = &self.epochs[slot];
        debug_assert!(e.load(Ordering::Relaxed) & 1 == 1);
        e.fetch_add(1, Ordering::SeqCst);
    }

    /// Owner: publishes L1 entry `idx`.
    pub fn set_l1(&self, idx: usize, raw: u64) {
        if let Some(e) = self.l1.get(idx) {
            e.store(raw, Ordering::SeqCst);
        }
    }

    /// Owner: publishes a larger device size.
    pub fn set_device_size(&self, size: u64) {
        self.device_size.fetch_max(size, Ordering::AcqRel);
    }

    /// Owner: host cluster `c` holds metadata from now on.
    pub fn set_meta_cluster(&self, c: u64) {
        if let Some(w) = self.meta_bits.get((c / 64) as usize) {
            w.fetch_or(1 << (c % 64), Ordering::AcqRel);
        }
        // The owner alone moves the generation: `g` is the one this mark ends.
        let g = self.meta_gen.load(Ordering::Relaxed);
        self.meta_log[(g % META_LOG as u64) as usize].store(c, Ordering::Release);
        self.meta_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// The lowest host cluster marked as metadata while the generation went from `since`
    /// to `now` (read with [`meta_gen`](Self::meta_gen)), or `None` when the log no longer
    /// holds every one of those marks (more than [`META_LOG`] generations). Lets a core
    /// keep what it found clear below that cluster without looking at the bitmap again.
    pub fn meta_marked_min(&self, since: u64, now: u64) -> Option<u64> {
        if now.wrapping_sub(since) > META_LOG as u64 {
            return None;
        }
        let mut min = u64::MAX;
        for g in since..now {
            min = min.min(self.meta_log[(g % META_LOG as u64) as usize].load(Ordering::Acquire));
        }
        // A slot is written again META_LOG generations later: if the generation has not
        // come that far since `since`, none of the slots read was.
        (self.meta_gen.load(Ordering::Acquire).wrapping_sub(since) < META_LOG as u64).then_some(min)
    }
}

/// Metadata marks [`Shared::meta_marked_min`] remembers.
pub const META_LOG: usize = 64;

/// What `change` adds to an epoch word besides the epoch's step: one removal (high half).
#[inline(always)]
fn removal(change: SliceChange) -> u64 {
    match change {
        SliceChange::Adds => 0,
        SliceChange::Removes => 1 << 32,
    }
}
