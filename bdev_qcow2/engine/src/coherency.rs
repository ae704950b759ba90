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
    /// removal more).
    epochs: Box<[AtomicU64]>,
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
    pub grace: Grace,
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

/// Most cores (executors) that can take part in one image's grace periods.
pub const MAX_GRACE_MEMBERS: usize = 256;

/// Grace periods for reusing freed clusters (epoch-based reclamation, two parities).
///
/// A guest request resolves a mapping and then uses the host offset (a device read or an
/// in-place write) some time later. If the owner removed that mapping meanwhile (discard,
/// write-zeroes with unmap, COW) and freed and reallocated the cluster, the late request
/// would read or overwrite another offset's data. So every guest request *enters* before
/// it resolves anything (counted in its core's counter of the current parity) and *exits*
/// when it completes; a cluster freed when the global generation was `g` is reused only
/// once the generation reached `g + 2`, and the owner advances from `g` to `g + 1` only
/// when no request of parity `g - 1` is left: every request that may have seen the old
/// mapping has completed by then.
pub struct Grace {
    global: AtomicU64,
    /// Bitmap of member slots in use.
    used: Box<[AtomicU64]>,
    /// Per member slot (a fixed length: the request path indexes it without a bounds check).
    counts: Box<[Counters; MAX_GRACE_MEMBERS]>,
    /// [`fences::asymmetric`], read once: the mode is fixed before the first `Grace` exists
    /// and never changes, and a field next to the generation is one load closer on every
    /// request than the static behind the library's global offset table.
    asymmetric: bool,
}

/// One member's in-flight counts per parity, alone on its cache lines (cores write their
/// own on every request: sharing a line would bounce it between cores).
#[repr(align(128))]
struct Counters([AtomicU64; 2]);

impl std::fmt::Debug for Grace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grace")
            .field("generation", &self.now())
            .finish()
    }
}

impl Default for Grace {
    fn default() -> Self {
        fences::init();
        Grace {
            global: AtomicU64::new(0),
            used: (0..MAX_GRACE_MEMBERS / 64)
                .map(|_| AtomicU64::new(0))
                .collect(),
            counts: (0..MAX_GRACE_MEMBERS)
                .map(|_| Counters([AtomicU64::new(0), AtomicU64::new(0)]))
                .collect::<Box<[Counters]>>()
                .try_into()
                .unwrap_or_else(|_| unreachable!("MAX_GRACE_MEMBERS counters")),
            asymmetric: fences::asymmetric(),
        }
    }
}

impl Grace {
    /// Takes a member slot for one core (`None` when all are taken: that core's requests
    /// then cannot be tracked and it must send them to the owner).
    pub fn register(&self) -> Option<usize> {
        for (i, word) in self.used.iter().enumerate() {
            let mut cur = word.load(Ordering::Acquire);
            loop {
                let free = (!cur).trailing_zeros() as usize;
                if free >= 64 {
                    break;
                }
                match word.compare_exchange(
                    cur,
                    cur | (1 << free),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return Some(i * 64 + free),
                    Err(now) => cur = now,
                }
            }
        }
        None
    }

    /// Gives a slot back (its core has no request in flight).
    pub fn unregister(&self, slot: usize) {
        for c in &self.counts[slot].0 {
            c.store(0, Ordering::Release);
        }
        self.used[slot / 64].fetch_and(!(1 << (slot % 64)), Ordering::AcqRel);
    }

    /// A guest request of core `slot` starts; returns its parity for [`exit`](Self::exit).
    #[inline(always)]
    pub fn enter(&self, slot: usize) -> u8 {
        self.enter_as(slot, self.asymmetric)
    }

    /// [`enter`](Self::enter) (`light`: [`light_entries`](Self::light_entries)) or
    /// [`enter_owner`](Self::enter_owner) (`light`: true), for a member that decided
    /// which once: one path for both, with the fence chosen by a flag it holds.
    #[inline(always)]
    pub fn enter_as(&self, slot: usize, light: bool) -> u8 {
        let g = self.global.load(Ordering::Acquire);
        // Only this member's core writes its counters: a plain increment, then the light
        // half of an asymmetric fence pair orders it before whatever the request reads next
        // (epochs, L1 entries, slices); `try_advance` runs the heavy half before it reads
        // the counters (see `fences`). The owner needs no fence (see `enter_owner`): the
        // light half costs it no instruction.
        let c = &self.counts[slot % MAX_GRACE_MEMBERS].0[(g & 1) as usize];
        c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        fences::light(light);
        (g & 1) as u8
    }

    /// Whether a core's entries take the light half of the asymmetric pair (else a full
    /// fence): what [`enter_as`](Self::enter_as) is told for a core.
    pub fn light_entries(&self) -> bool {
        self.asymmetric
    }

    /// [`enter`](Self::enter) for the owner's own requests, on the thread that runs
    /// [`try_advance`](Self::try_advance) and is the only writer of the generation: program
    /// order already puts this entry before the owner's later advances and the loads that
    /// follow it, so no fence is needed. (Without the asymmetric pair, `enter`'s full fence
    /// waits for the store buffer to drain: 12 % of the owner's time in a first-write-heavy
    /// run.)
    #[inline(always)]
    pub fn enter_owner(&self, slot: usize) -> u8 {
        self.enter_as(slot, true)
    }

    /// The guest request that entered with `parity` completed (on the core that entered).
    #[inline(always)]
    pub fn exit(&self, slot: usize, parity: u8) {
        // Only this member's core writes its counters: no read-modify-write needed.
        let c = &self.counts[slot % MAX_GRACE_MEMBERS].0[parity as usize & 1];
        c.store(c.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Release);
    }

    /// The current generation.
    pub fn now(&self) -> u64 {
        self.global.load(Ordering::SeqCst)
    }

    /// Owner: advances the generation if no request of the previous parity is left;
    /// returns the generation now.
    pub fn try_advance(&self) -> u64 {
        // Pairs with the light fence of every `enter`: a request whose entry this scan
        // misses reads the owner's changes made before this point.
        fences::heavy();
        let g = self.global.load(Ordering::SeqCst);
        let old = ((g + 1) & 1) as usize;
        // Only slots in use can hold requests (unregistered ones are zeroed).
        let drained = self.used.iter().enumerate().all(|(i, word)| {
            let mut bits = word.load(Ordering::SeqCst);
            while bits != 0 {
                let slot = i * 64 + bits.trailing_zeros() as usize;
                if self.counts[slot].0[old].load(Ordering::SeqCst) != 0 {
                    return false;
                }
                bits &= bits - 1;
            }
            true
        });
        if drained {
            self.global.store(g + 1, Ordering::SeqCst);
            return g + 1;
        }
        g
    }
}

/// The asymmetric fence pair of [`Grace`]: a core's entry is a plain store followed by
/// [`light`] (a compiler fence: nothing on the CPU), and the owner's
/// [`try_advance`](Grace::try_advance) starts with [`heavy`], which makes every thread of
/// the process run a full memory barrier before it returns (Linux's
/// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, through rustix's safe wrapper), once the
/// host asked for it with [`install_membarrier`] (or supplied another barrier through
/// [`install`]). Together they order like a
/// `fence(SeqCst)` on both sides: either the owner's scan sees a request's entry, or that
/// request's later loads see what the owner stored before the scan (the store-buffering
/// case). A core thus pays no locked instruction per request, and the owner pays a system
/// call per advance attempt, which happens only while freed clusters wait for their grace
/// period (rate-limited by `reclaim_graced`). Without an installed barrier (or where it
/// fails its first call) both halves are `fence(SeqCst)`.
///
/// The mode is fixed when the first [`Grace`] is made, before any core can enter, and never
/// changes: a core and the owner must agree on it.
///
/// Under `--cfg loom` both halves are no-ops: the model places `fence(SeqCst)` at these two
/// points itself (and refutes the protocol without them), since loom cannot model a
/// process-wide barrier.
pub mod fences {
    #[cfg(not(loom))]
    use std::sync::atomic::{AtomicU8, Ordering};
    #[cfg(not(loom))]
    use std::sync::OnceLock;

    #[cfg(not(loom))]
    static HEAVY: OnceLock<fn() -> bool> = OnceLock::new();
    /// Not yet decided / asymmetric / symmetric.
    #[cfg(not(loom))]
    static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);
    #[cfg(not(loom))]
    const UNDECIDED: u8 = 0;
    #[cfg(not(loom))]
    const ASYMMETRIC: u8 = 1;
    #[cfg(not(loom))]
    const SYMMETRIC: u8 = 2;

    /// Hosts: offers a process-wide memory barrier (true when it ran) for the owner's half.
    /// Takes effect only if called before the first image is shared between cores; returns
    /// whether it will be used.
    pub fn install(heavy: fn() -> bool) -> bool {
        #[cfg(not(loom))]
        {
            let _ = HEAVY.set(heavy);
            init();
            asymmetric()
        }
        #[cfg(loom)]
        {
            let _ = heavy;
            false
        }
    }

    /// Hosts: [`install`]s Linux's `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (the
    /// process registers for it on first use); false where the kernel refuses it, on other
    /// systems, or once the mode is fixed without it.
    pub fn install_membarrier() -> bool {
        #[cfg(all(target_os = "linux", not(loom)))]
        return install(membarrier);
        #[cfg(not(all(target_os = "linux", not(loom))))]
        false
    }

    #[cfg(all(target_os = "linux", not(loom)))]
    fn membarrier() -> bool {
        use rustix::thread::{membarrier, MembarrierCommand};
        static REGISTERED: OnceLock<bool> = OnceLock::new();
        *REGISTERED.get_or_init(|| membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok())
            && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
    }

    /// Fixes the mode (idempotent): called when a [`Grace`](super::Grace) is made.
    pub(crate) fn init() {
        #[cfg(not(loom))]
        if MODE.load(Ordering::Acquire) == UNDECIDED {
            // The barrier must work once before the cores rely on it.
            let m = match HEAVY.get() {
                Some(f) if f() => ASYMMETRIC,
                _ => SYMMETRIC,
            };
            // Racing initialisers: the first decision stands.
            let _ = MODE.compare_exchange(UNDECIDED, m, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether the asymmetric pair is in use (false: both halves are full fences).
    #[inline]
    pub fn asymmetric() -> bool {
        #[cfg(not(loom))]
        return MODE.load(Ordering::Relaxed) == ASYMMETRIC;
        #[cfg(loom)]
        false
    }

    /// The core's half: orders its preceding store before its following loads, in the mode
    /// [`asymmetric`] returned (read once by the caller: the mode never changes).
    #[inline(always)]
    pub fn light(asymmetric: bool) {
        #[cfg(not(loom))]
        if asymmetric {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        #[cfg(loom)]
        let _ = asymmetric;
    }

    /// The owner's half: a full barrier on every thread of the process.
    pub fn heavy() {
        #[cfg(not(loom))]
        match HEAVY.get() {
            Some(f) if asymmetric() => {
                if !f() {
                    // It worked when the mode was fixed; the kernel does not take it back.
                    // Going on would silently weaken every core's ordering.
                    std::process::abort();
                }
            }
            _ => std::sync::atomic::fence(Ordering::SeqCst),
        }
    }
}

/// The owner's bookkeeping of dirty slices per slot (not shared: only the owner runs it).
#[derive(Debug, Default)]
pub struct OwnerEpochs {
    counts: std::collections::HashMap<usize, u32>,
}

impl OwnerEpochs {
    /// A slice of `key` became dirty (or another copy of it is being written back), its
    /// content changed as `change` says ([`SliceChange::Adds`] when it did not change).
    pub fn dirtied(&mut self, shared: &Shared, key: u64, change: SliceChange) {
        let slot = shared.slot(key);
        let n = self.counts.entry(slot).or_insert(0);
        if *n == 0 {
            shared.owner_open(slot, change);
        } else {
            shared.owner_changed(slot, change);
        }
        *n += 1;
    }

    /// A dirty slice of `key` changed as `change` says.
    pub fn changed(&mut self, shared: &Shared, key: u64, change: SliceChange) {
        let slot = shared.slot(key);
        debug_assert!(self.counts.get(&slot).copied().unwrap_or(0) > 0);
        shared.owner_changed(slot, change);
    }

    /// One dirty instance of `key` is gone (written back, or merged away).
    pub fn cleaned(&mut self, shared: &Shared, key: u64) {
        let slot = shared.slot(key);
        let Some(n) = self.counts.get_mut(&slot) else {
            debug_assert!(false, "cleaned a slice that was not dirty");
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.counts.remove(&slot);
            shared.owner_close(slot);
        }
    }

    /// Number of slots currently odd.
    pub fn open_slots(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn epochs_follow_dirty_instances() {
        let s = Shared::new(16, &[0; 2], 1 << 20, 64);
        let mut o = OwnerEpochs::default();
        assert_eq!(s.epoch(3), 0);
        o.dirtied(&s, 3, SliceChange::Adds);
        assert_eq!(s.epoch(3), 1);
        o.changed(&s, 3, SliceChange::Adds);
        assert_eq!(s.epoch(3), 3);
        // Re-dirtied while the first copy is written back.
        o.dirtied(&s, 3, SliceChange::Adds);
        assert_eq!(s.epoch(3), 5);
        o.cleaned(&s, 3);
        assert_eq!(s.epoch(3) & 1, 1, "still dirty");
        o.cleaned(&s, 3);
        assert_eq!(s.epoch(3), 6);
        assert_eq!(o.open_slots(), 0);
        assert_eq!(s.stamp(3).removals(), 0, "additions count no removal");
    }

    #[test]
    fn removals_are_counted_apart_from_additions() {
        let s = Shared::new(16, &[0; 2], 1 << 20, 64);
        let mut o = OwnerEpochs::default();
        o.dirtied(&s, 5, SliceChange::Removes);
        assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (1, 1));
        o.changed(&s, 5, SliceChange::Adds);
        assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (3, 1));
        o.changed(&s, 5, SliceChange::Removes);
        assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (5, 2));
        o.cleaned(&s, 5);
        assert_eq!((s.stamp(5).epoch(), s.stamp(5).removals()), (6, 2));
        assert_eq!(s.stamp(4), SliceStamp::default(), "other slots untouched");
    }

    #[test]
    fn the_metadata_log_gives_the_lowest_mark_while_it_holds_them_all() {
        let s = Shared::new(1, &[], 0, 1 << 20);
        let g0 = s.meta_gen();
        s.set_meta_cluster(500);
        s.set_meta_cluster(300);
        s.set_meta_cluster(900);
        let g3 = s.meta_gen();
        assert_eq!(s.meta_marked_min(g0, g3), Some(300));
        assert_eq!(s.meta_marked_min(g0 + 2, g3), Some(900));
        assert_eq!(
            s.meta_marked_min(g3, g3),
            Some(u64::MAX),
            "nothing marked since"
        );
        for c in 0..META_LOG as u64 {
            s.set_meta_cluster(1000 + c);
        }
        assert_eq!(
            s.meta_marked_min(g0, g3),
            None,
            "the log moved past g0's marks"
        );
        let g = s.meta_gen();
        assert_eq!(
            s.meta_marked_min(g - 2, g),
            Some(1000 + META_LOG as u64 - 2)
        );
    }

    #[test]
    fn metadata_ranges_and_their_generation() {
        // 200 clusters of bitmap (4 words).
        let s = Shared::new(1, &[], 0, 200);
        assert!(s.meta_range_clear(0, 256), "nothing marked yet");
        let g0 = s.meta_gen();
        s.set_meta_cluster(70);
        assert_ne!(s.meta_gen(), g0, "a mark moves the generation");
        // Ranges around cluster 70, inside one word and across words.
        assert!(s.meta_range_clear(0, 70));
        assert!(!s.meta_range_clear(0, 71));
        assert!(!s.meta_range_clear(70, 1));
        assert!(s.meta_range_clear(71, 100));
        assert!(!s.meta_range_clear(60, 11));
        assert!(!s.meta_range_clear(64, 64));
        assert!(s.meta_range_clear(128, 64));
        assert!(s.meta_range_clear(5, 0), "an empty range");
        // Past the bitmap counts as metadata, as for one cluster.
        assert!(!s.meta_range_clear(250, 10));
        assert!(!s.meta_range_clear(u64::MAX - 1, 5));
    }

    #[test]
    fn hashed_slots_stay_in_range() {
        let s = Shared::new(u64::MAX, &[], 0, u64::MAX);
        assert_eq!(s.slots() as u64, MAX_EPOCH_SLOTS);
        for k in [0, 1, MAX_EPOCH_SLOTS, u64::MAX, 1 << 40] {
            assert!(s.slot(k) < s.slots());
        }
        assert!(
            s.is_meta_cluster(u64::MAX),
            "past the bitmap counts as metadata"
        );
    }

    #[test]
    fn grace_waits_for_the_previous_parity() {
        let g = Grace::default();
        let a = g.register().unwrap_or(0);
        let b = g.register().unwrap_or(1);
        assert_ne!(a, b);
        let p = g.enter(a); // a request at generation 0
        assert_eq!(g.try_advance(), 1, "parity of -1 is empty");
        assert_eq!(g.try_advance(), 1, "the request of generation 0 holds it");
        let q = g.enter(b); // generation 1
        g.exit(a, p);
        assert_eq!(g.try_advance(), 2);
        assert_eq!(g.try_advance(), 2, "the request of generation 1 holds it");
        g.exit(b, q);
        assert_eq!(g.try_advance(), 3);
        g.unregister(a);
        assert_eq!(g.register(), Some(a));
    }

    #[test]
    fn owner_entries_hold_advances_like_cores() {
        // The owner's fence-free entry counts exactly like a core's: a request it entered
        // holds the generation two advances away until it exits.
        let g = Grace::default();
        let (owner, core) = (g.register().unwrap(), g.register().unwrap());
        let p = g.enter_owner(owner); // generation 0
        assert_eq!(g.try_advance(), 1);
        assert_eq!(
            g.try_advance(),
            1,
            "the owner's request of generation 0 holds it"
        );
        let q = g.enter(core); // generation 1
        g.exit(owner, p);
        assert_eq!(g.try_advance(), 2);
        let r = g.enter_owner(owner); // generation 2
        g.exit(core, q);
        assert_eq!(g.try_advance(), 3);
        assert_eq!(
            g.try_advance(),
            3,
            "the owner's request of generation 2 holds it"
        );
        g.exit(owner, r);
        assert_eq!(g.try_advance(), 4);
    }

    #[test]
    fn grace_has_room_for_many_cores() {
        let g = Grace::default();
        let slots: Vec<usize> = (0..MAX_GRACE_MEMBERS)
            .filter_map(|_| g.register())
            .collect();
        assert_eq!(slots.len(), MAX_GRACE_MEMBERS);
        assert_eq!(g.register(), None, "all taken");
        let last = MAX_GRACE_MEMBERS - 1;
        let p = g.enter(last);
        assert_eq!(g.try_advance(), 1);
        assert_eq!(g.try_advance(), 1, "the member in the last word holds it");
        g.exit(last, p);
        assert_eq!(g.try_advance(), 2);
        g.unregister(200);
        assert_eq!(g.register(), Some(200));
    }

    #[test]
    fn meta_bitmap() {
        let s = Shared::new(1, &[], 0, 1000);
        assert!(!s.is_meta_cluster(700));
        s.set_meta_cluster(700);
        assert!(s.is_meta_cluster(700));
        assert!(!s.is_meta_cluster(701));
        assert!(s.is_meta_cluster(64 * 16 + 1), "beyond the bitmap");
    }
}
