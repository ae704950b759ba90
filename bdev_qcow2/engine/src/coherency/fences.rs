//! The asymmetric fence pair of [`Grace`](super::Grace): a core's entry is a plain store followed by
//! [`light`] (a compiler fence: nothing on the CPU), and the owner's
//! [`try_advance`](super::Grace::try_advance) starts with [`heavy`], which makes every thread of
//! the process run a full memory barrier before it returns (Linux's
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, through rustix's safe wrapper), once the
//! host asked for it with [`install_membarrier`] (or supplied another barrier through
//! [`install`]). Together they order like a
//! `fence(SeqCst)` on both sides: either the owner's scan sees a request's entry, or that
//! request's later loads see what the owner stored before the scan (the store-buffering
//! case). A core thus pays no locked instruction per request, and the owner pays a system
//! call per advance attempt, which happens only while freed clusters wait for their grace
//! period (rate-limited by `reclaim_graced`). Without an installed barrier (or where it
//! fails its first call) both halves are `fence(SeqCst)`.
//!
//! The mode is fixed when the first [`Grace`](super::Grace) is made, before any core can enter, and never
//! changes: a core and the owner must agree on it.
//!
//! Under `--cfg loom` both halves are no-ops: the model places `fence(SeqCst)` at these two
//! points itself (and refutes the protocol without them), since loom cannot model a
//! process-wide barrier.

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
