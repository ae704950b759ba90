//! Grace periods for reusing freed clusters: every guest request enters before it resolves
//! a mapping and exits when it completes; the owner reuses a freed cluster only once every
//! request that may have seen its old mapping is over.

use super::fences;
#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
    /// Each its own allocation, made once: a member keeps a handle on its own
    /// ([`counters`](Self::counters)), so that its requests reach them in one load, without
    /// the slot's index arithmetic.
    counts: Box<[Arc<Counters>; MAX_GRACE_MEMBERS]>,
    /// [`fences::asymmetric`], read once: the mode is fixed before the first `Grace` exists
    /// and never changes, and a field next to the generation is one load closer on every
    /// request than the static behind the library's global offset table.
    asymmetric: bool,
}

/// Which of its member's two counters a request entered under ([`Grace::enter`]): handed
/// back once to [`Grace::exit`], neither `Copy` nor `Clone`, so that an entry is counted
/// out exactly where it was counted in.
#[must_use = "an entered request exits with its parity"]
#[derive(Debug, PartialEq, Eq)]
pub struct Parity(u8);

impl Parity {
    /// The parity of a request entered under counter `bit` (0 or 1: the low bit).
    #[inline(always)]
    pub(crate) fn of(bit: u8) -> Parity {
        Parity(bit & 1)
    }

    /// Its counter: 0 or 1.
    #[inline(always)]
    pub fn bit(&self) -> u8 {
        self.0
    }
}

/// One member's in-flight counts per parity and the generation its next entries count
/// under, alone on their cache lines (cores write their own on every request: sharing a
/// line would bounce it between cores). Only the member's core writes the counts; the owner
/// reads them in [`Grace::try_advance`] and raises the generation when it advances.
#[repr(align(128))]
pub struct Counters {
    counts: [AtomicU64; 2],
    /// The generation this member enters under: raised by the owner after every advance
    /// (and to the current one when the member registers), read by the member on every
    /// entry. Any parity is safe for an entry, only a stale one forever would stall the
    /// owner (see [`Grace::try_advance`]); keeping it here puts an entry on one cache line,
    /// the member's own.
    gen: AtomicU64,
}

impl Counters {
    fn new() -> Self {
        Counters {
            counts: [AtomicU64::new(0), AtomicU64::new(0)],
            gen: AtomicU64::new(0),
        }
    }

    /// A guest request of this member starts; returns its parity for
    /// [`exit`](Self::exit). `light`: the light half of the fence pair suffices (the
    /// owner's own requests, or a core's under the asymmetric pair).
    #[inline(always)]
    pub fn enter(&self, light: bool) -> Parity {
        let p = (self.gen.load(Ordering::Relaxed) & 1) as usize;
        // Only this member's core writes its counts: a plain increment, then the light
        // half of an asymmetric fence pair orders it before whatever the request reads next
        // (epochs, L1 entries, slices); `try_advance` runs the heavy half before it reads
        // the counts (see `fences`). The owner needs no fence (see `Grace::enter_owner`).
        let c = &self.counts[p];
        c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        // (`fences::light`, written out: a call would be one more function on every
        // request. The full fence is out of line, so the light half, a compiler fence, is
        // one test and no jump.)
        #[cfg(not(loom))]
        {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
            if !light {
                full_fence();
            }
        }
        #[cfg(loom)]
        let _ = light;
        Parity(p as u8)
    }

    /// The guest request that entered with `parity` completed (on the member's core).
    #[inline(always)]
    pub fn exit(&self, parity: Parity) {
        // Only this member's core writes its counts: no read-modify-write needed.
        let c = &self.counts[parity.0 as usize & 1];
        c.store(c.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Release);
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Counters")
    }
}

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
                .map(|_| Arc::new(Counters::new()))
                .collect::<Box<[Arc<Counters>]>>()
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
                    Ordering::SeqCst,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        // After the bit (SeqCst both, as the owner's store of the
                        // generation and its scan of the bits): either this load sees an
                        // advance, or that advance's scan sees the bit and raises `gen`.
                        // Both raise it to a maximum, so neither undoes the other.
                        let slot = i * 64 + free;
                        let now = self.global.load(Ordering::SeqCst);
                        self.counts[slot].gen.fetch_max(now, Ordering::Relaxed);
                        return Some(slot);
                    }
                    Err(now) => cur = now,
                }
            }
        }
        None
    }

    /// The counters of member `slot` (from [`register`](Self::register)), for
    /// [`Counters::enter`] and [`Counters::exit`].
    pub fn counters(&self, slot: usize) -> Arc<Counters> {
        self.counts[slot % MAX_GRACE_MEMBERS].clone()
    }

    /// Gives a slot back (its core has no request in flight).
    pub fn unregister(&self, slot: usize) {
        for c in &self.counts[slot].counts {
            c.store(0, Ordering::Release);
        }
        self.used[slot / 64].fetch_and(!(1 << (slot % 64)), Ordering::AcqRel);
    }

    /// A guest request of core `slot` starts; returns its parity for [`exit`](Self::exit).
    // (The tests' way in; hosts enter through their member's `Counters`.)
    #[cfg(any(test, feature = "testing"))]
    #[inline(always)]
    pub fn enter(&self, slot: usize) -> Parity {
        self.enter_as(slot, self.asymmetric)
    }

    /// [`enter`](Self::enter) (`light`: [`light_entries`](Self::light_entries)) or
    /// [`enter_owner`](Self::enter_owner) (`light`: true), for a member that decided
    /// which once: one path for both, with the fence chosen by a flag it holds.
    // (The tests' way in; hosts enter through their member's `Counters`.)
    #[cfg(any(test, feature = "testing"))]
    #[inline(always)]
    pub fn enter_as(&self, slot: usize, light: bool) -> Parity {
        self.counts[slot % MAX_GRACE_MEMBERS].enter(light)
    }

    /// Whether a core's entries take the light half of the asymmetric pair (else a full
    /// fence): what a core's member is told when it joins.
    pub fn light_entries(&self) -> bool {
        self.asymmetric
    }

    /// [`enter`](Self::enter) for the owner's own requests, on the thread that runs
    /// [`try_advance`](Self::try_advance) and is the only writer of the generation: program
    /// order already puts this entry before the owner's later advances and the loads that
    /// follow it, so no fence is needed. (Without the asymmetric pair, `enter`'s full fence
    /// waits for the store buffer to drain: 12 % of the owner's time in a first-write-heavy
    /// run.)
    // (The tests' way in; hosts enter through their member's `Counters`.)
    #[cfg(any(test, feature = "testing"))]
    #[inline(always)]
    pub fn enter_owner(&self, slot: usize) -> Parity {
        self.enter_as(slot, true)
    }

    /// The guest request that entered with `parity` completed (on the core that entered).
    // (The tests' way in; hosts enter through their member's `Counters`.)
    #[cfg(any(test, feature = "testing"))]
    #[inline(always)]
    pub fn exit(&self, slot: usize, parity: Parity) {
        self.counts[slot % MAX_GRACE_MEMBERS].exit(parity)
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
        let drained = self
            .members()
            .all(|slot| self.counts[slot].counts[old].load(Ordering::SeqCst) == 0);
        if !drained {
            return g;
        }
        self.global.store(g + 1, Ordering::SeqCst);
        // Members enter under the new generation from now on: the parity just drained
        // is the one the next advance waits for. (A member that still enters under the old
        // one for a while only delays that advance: whichever parity a request counts in,
        // one of the two scans between a free and its reuse waits for it.)
        for slot in self.members() {
            self.counts[slot].gen.fetch_max(g + 1, Ordering::Relaxed);
        }
        g + 1
    }

    /// The member slots in use, each word of the bitmap loaded once (SeqCst), as it is
    /// reached.
    fn members(&self) -> impl Iterator<Item = usize> + '_ {
        self.used.iter().enumerate().flat_map(|(i, word)| {
            let mut bits = word.load(Ordering::SeqCst);
            std::iter::from_fn(move || {
                let b = (bits != 0).then(|| bits.trailing_zeros() as usize)?;
                bits &= bits - 1;
                Some(i * 64 + b)
            })
        })
    }
}

/// The full fence of an entry without the asymmetric pair (cold: see `Counters::enter`).
#[cfg(not(loom))]
#[cold]
#[inline(never)]
fn full_fence() {
    std::sync::atomic::fence(Ordering::SeqCst);
}
