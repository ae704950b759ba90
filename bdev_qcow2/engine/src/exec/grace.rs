//! A guest request's entry into its core's grace period: the [`GraceEntry`] token, and the
//! executor's membership in a shared image's grace periods (`coherency::Grace`).

use super::Exec;
use crate::coherency::{Counters, Parity, Shared};
use crate::io::BlockDevice;
use std::sync::Arc;

/// A guest request's entry into its core's grace period ([`Exec::guest_enter`]): neither
/// `Copy` nor `Clone`, and ended by passing it to [`Exec::guest_exit`] (or to what exits
/// for it: a request record, [`Exec::complete_entered`], [`Exec::hand_to_owner`]) once the
/// request can no longer use a mapping it resolved. A freed cluster is not reused while
/// an entry of its generation is open (`coherency::Grace`).
#[must_use = "a grace entry ends only in Exec::guest_exit"]
#[derive(Debug, PartialEq, Eq)]
pub struct GraceEntry(Entered);

/// Which of its core's two counters a request entered under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Entered {
    Even = 0,
    Odd = 1,
    /// The image is not shared: no grace period to enter.
    Unshared = 2,
}

impl GraceEntry {
    /// The entry of a request on an image no other core shares: its exit does nothing.
    #[inline(always)]
    pub fn unshared() -> GraceEntry {
        GraceEntry(Entered::Unshared)
    }

    /// The entry into a shared image's grace period under `parity`.
    #[inline(always)]
    pub(crate) fn of_parity(parity: Parity) -> GraceEntry {
        GraceEntry(if parity.bit() == 0 {
            Entered::Even
        } else {
            Entered::Odd
        })
    }
}

/// An executor's membership in one shared image's grace periods: the image's shared state,
/// this member's own counters (their own allocation, one load away: no slot index to
/// scale on every request), its slot, and whether its entries need no full fence (the
/// owner's, or a core's with the asymmetric pair; see [`Grace::enter_as`](crate::coherency::Grace::enter_as)).
pub(crate) struct Member {
    shared: Arc<Shared>,
    mine: Arc<Counters>,
    slot: usize,
    light: bool,
}

impl Member {
    /// Gives the member's slot back (its executor is dropped: no request in flight).
    pub(crate) fn leave(self) {
        self.shared.grace.unregister(self.slot);
    }
}

impl<D: BlockDevice> Exec<D> {
    /// Makes this core a member of `shared`'s grace periods (see
    /// [`Grace`](crate::coherency::Grace)), as `who`; joining the same image again does
    /// nothing. Once a member, every guest request must enter
    /// ([`guest_enter`](Self::guest_enter)) before it resolves a mapping and exit when it
    /// completes.
    pub fn join_grace(
        &self,
        shared: std::sync::Arc<crate::coherency::Shared>,
        who: Joiner,
    ) -> Result<(), JoinRefused> {
        if let Some(m) = self.inner.grace.get() {
            return match Arc::ptr_eq(&m.shared, &shared) {
                true => Ok(()),
                false => Err(JoinRefused::OtherImage),
            };
        }
        let slot = shared.grace.register().ok_or(JoinRefused::SlotsTaken)?;
        // Not set before (checked above; one thread): `set` succeeds.
        let light = who == Joiner::Owner || shared.grace.light_entries();
        let mine = shared.grace.counters(slot);
        let _ = self.inner.grace.set(Member {
            shared,
            mine,
            slot,
            light,
        });
        Ok(())
    }

    /// A guest request starts (before it resolves any mapping): its grace entry.
    #[inline(always)]
    pub fn guest_enter(&self) -> GraceEntry {
        // One test for the common case, a member with the light fence: a member that
        // needs the full one enters out of line.
        match self.inner.grace.get() {
            Some(m) if m.light => GraceEntry::of_parity(m.mine.enter(true)),
            Some(m) => enter_fenced(m),
            None => GraceEntry::unshared(),
        }
    }

    /// [`guest_enter`](Self::guest_enter) where it needs no call: `None` for a member
    /// whose entries take the full fence (nothing entered).
    #[inline(always)]
    pub fn guest_enter_light(&self) -> Option<GraceEntry> {
        match self.inner.grace.get() {
            Some(m) if m.light => Some(GraceEntry::of_parity(m.mine.enter(true))),
            Some(_) => None,
            None => Some(GraceEntry::unshared()),
        }
    }

    /// The guest request that entered with `entry` is over. (Inline: a call on the
    /// write's fast half, `Chain::plan_write_fast`, would keep registers saved on all of it.)
    #[inline(always)]
    pub fn guest_exit(&self, entry: GraceEntry) {
        let parity = match entry.0 {
            Entered::Unshared => return,
            p => Parity::of(p as u8),
        };
        if let Some(m) = self.inner.grace.get() {
            m.mine.exit(parity);
        }
    }
}

/// Who joins an image's grace periods ([`Exec::join_grace`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joiner {
    /// The metadata owner's executor, on the thread that advances the grace periods: its
    /// entries need no fence (see [`Grace::enter_owner`](crate::coherency::Grace::enter_owner)).
    Owner,
    /// A core's executor.
    Core,
}

/// Why an executor could not join an image's grace periods ([`Exec::join_grace`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinRefused {
    /// Every member slot of the image is taken.
    SlotsTaken,
    /// The executor takes part in another image's grace periods already: it has one
    /// membership, and entering that one would not hold this image's frees back.
    OtherImage,
}

/// A chain's own handle on its executor's grace counters when the executor is a member
/// whose entries take the light fence (`None` otherwise: the executor's own entry then):
/// taken when the chain is built, after its image joined (a core's replica joins as it is
/// built, the owner when it shares the image, which takes it by `&mut`). An entry through
/// it is one load and one test before the count, where the executor's reads its membership
/// and then its mode.
pub struct GraceLane(Option<Arc<Counters>>);

impl<D: BlockDevice> Exec<D> {
    /// The lane of this executor's membership as it is now ([`GraceLane`]).
    pub(crate) fn grace_lane(&self) -> GraceLane {
        GraceLane(
            self.inner
                .grace
                .get()
                .filter(|m| m.light)
                .map(|m| m.mine.clone()),
        )
    }

    /// [`guest_enter`](Self::guest_enter) through `lane`, a lane of this executor.
    #[inline(always)]
    pub(crate) fn guest_enter_on(&self, lane: &GraceLane) -> GraceEntry {
        match &lane.0 {
            Some(c) => GraceEntry::of_parity(c.enter(true)),
            None => self.guest_enter(),
        }
    }

    /// [`guest_enter_light`](Self::guest_enter_light) through `lane`, a lane of this
    /// executor.
    #[inline(always)]
    pub(crate) fn guest_enter_light_on(&self, lane: &GraceLane) -> Option<GraceEntry> {
        match &lane.0 {
            Some(c) => Some(GraceEntry::of_parity(c.enter(true))),
            None => self.guest_enter_light(),
        }
    }
}

/// [`Exec::guest_enter`] of a member whose entries need the full fence (no asymmetric pair).
#[cold]
#[inline(never)]
fn enter_fenced(m: &Member) -> GraceEntry {
    GraceEntry::of_parity(m.mine.enter(false))
}

#[cfg(test)]
mod tests {
    use crate::coherency::Shared;
    use crate::exec::{Exec, JoinRefused, Joiner};
    use crate::testing::MemDevice;
    use std::sync::Arc;

    #[test]
    fn an_executor_joins_one_images_grace_periods_and_refuses_another() {
        let exec: Exec<MemDevice> = Exec::new();
        let a = Arc::new(Shared::new(4, &[0; 4], 1 << 20, 16));
        let b = Arc::new(Shared::new(4, &[0; 4], 1 << 20, 16));
        assert_eq!(exec.join_grace(a.clone(), Joiner::Core), Ok(()));
        // Joining the same image again is a no-op that succeeds.
        assert_eq!(exec.join_grace(a.clone(), Joiner::Core), Ok(()));
        // Another image: its frees would not wait for this executor's requests.
        assert_eq!(
            exec.join_grace(b.clone(), Joiner::Core),
            Err(JoinRefused::OtherImage)
        );
        // The entry counts in `a`'s grace periods: `a` cannot advance past it, `b` can.
        let entry = exec.guest_enter();
        let g = a.grace.try_advance();
        assert_eq!(
            a.grace.try_advance(),
            g,
            "a's open entry holds its grace period"
        );
        let h = b.grace.try_advance();
        assert_eq!(
            b.grace.try_advance(),
            h + 1,
            "b has no member with an open entry"
        );
        exec.guest_exit(entry);
        assert_eq!(a.grace.try_advance(), g + 1);
    }
}
