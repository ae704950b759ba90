//! What routing a guest request decides, as values a host matches on: the checked guest
//! range ([`GuestRange`]), the direct grant ([`Grant`]: one extent the host submits itself,
//! holding the request's grace-period entry) and where a read or a write goes
//! ([`ReadRoute`], [`WriteRoute`]).
//!
//! Below the chain: the chain, its write path and the hosts use these types; this module
//! uses none of theirs.

use crate::error::{Error, Result};
use crate::exec::{DevId, Exec, GraceEntry};
use crate::io::{BlockDevice, SECTOR};
use crate::types::{GuestOffset, HostOffset};

/// A guest request's byte range, checked: offset and length are multiples of 512 and the
/// range lies inside the disk. Made only by [`GuestRange::new`], so every entry that takes
/// one checks the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRange {
    offset: GuestOffset,
    len: u64,
}

impl GuestRange {
    /// `len` bytes at guest byte `offset` of a disk of `disk_size` bytes;
    /// [`Error::InvalidRequest`] when not 512-byte aligned or not inside the disk.
    #[inline(always)]
    pub fn new(offset: u64, len: u64, disk_size: u64) -> Result<Self> {
        if (offset | len) & (SECTOR - 1) != 0 {
            return Err(Error::InvalidRequest("request not aligned to 512 bytes"));
        }
        if offset.checked_add(len).is_none_or(|e| e > disk_size) {
            return Err(Error::InvalidRequest("request past the end of the disk"));
        }
        Ok(GuestRange {
            offset: GuestOffset(offset),
            len,
        })
    }

    /// The first guest byte.
    #[inline(always)]
    pub fn offset(&self) -> GuestOffset {
        self.offset
    }

    /// Its length in bytes.
    #[inline(always)]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no byte.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The guest byte after the last (no overflow: checked by [`new`](Self::new)).
    #[inline(always)]
    pub fn end(&self) -> GuestOffset {
        GuestOffset(self.offset.0 + self.len)
    }
}

/// A request granted the direct path: its bytes are one extent of one device, which the
/// host reads or writes itself with the guest's own buffers (one base I/O, no task).
///
/// The grant holds the request's grace-period entry (a freed cluster is not reused while
/// a request that may have seen its old mapping is in flight: see `coherency::Grace`).
/// It is neither `Copy` nor `Clone`, and its entry ends in exactly one of three ways:
/// - [`Chain::submit_direct`](crate::Chain::submit_direct) (hosts that submit
///   through the engine's executor): the entry ends when the operation completes;
/// - [`submitted`](Self::submitted) (hosts that submit to the device themselves): the
///   host keeps the returned [`GraceEntry`] with the request and passes it to
///   [`Exec::guest_exit`] once the operation completed;
/// - [`finish`](Self::finish) or [`Chain::not_submitted`](crate::Chain::not_submitted):
///   the host did not submit it (another device, device busy) and the request takes the
///   engine path instead.
///
/// Dropping a grant otherwise is a bug (a debug assertion).
#[must_use = "a grant holds a grace-period entry: submit it or finish it"]
#[derive(Debug)]
pub struct Grant {
    dev: DevId,
    host: HostOffset,
    range: GuestRange,
    /// Handed over only by the grant's one exit ([`submitted`](Self::submitted), which
    /// forgets the grant: its `Drop` never sees an entry handed over).
    entry: GraceEntry,
    found: FoundBy,
    access: Access,
}

/// What a grant lets the host do with its extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// Where the route found a grant's mapping: the memo of slices (the request's slice cached
/// under the current epoch) or a look-up past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FoundBy {
    Memo,
    Lookup,
}

impl Grant {
    /// A grant for `access` to `range` at `host` on `dev`, entered into the grace period as
    /// `entry`, its mapping `found` by the memo or a look-up.
    #[inline(always)]
    pub(crate) fn new(
        dev: DevId,
        host: HostOffset,
        range: GuestRange,
        entry: GraceEntry,
        found: FoundBy,
        access: Access,
    ) -> Self {
        Grant {
            dev,
            host,
            range,
            entry,
            found,
            access,
        }
    }

    /// Whether this is a write's grant (else a read's).
    #[inline(always)]
    pub fn is_write(&self) -> bool {
        matches!(self.access, Access::Write)
    }

    /// The device holding the extent.
    #[inline(always)]
    pub fn dev(&self) -> DevId {
        self.dev
    }

    /// Where the extent starts on the device.
    #[inline(always)]
    pub fn host(&self) -> HostOffset {
        self.host
    }

    /// The guest bytes granted (the extent's length is theirs).
    #[inline(always)]
    pub fn range(&self) -> GuestRange {
        self.range
    }

    /// Whether the memo of slices found it: the request's slice was cached under the
    /// current epoch, so read-ahead need only watch it in the slice's tail
    /// ([`Chain::read_ahead_memo`](crate::Chain::read_ahead_memo)).
    #[inline(always)]
    pub fn from_memo(&self) -> bool {
        matches!(self.found, FoundBy::Memo)
    }

    /// The host submitted the operation to the device itself: returns the grace entry it
    /// passes to [`Exec::guest_exit`] once the operation completed (whatever its result).
    #[inline(always)]
    pub fn submitted(mut self) -> GraceEntry {
        // (Swapped out rather than an `Option` taken: no test of a case that cannot be.)
        let entry = std::mem::replace(&mut self.entry, GraceEntry::unshared());
        std::mem::forget(self);
        entry
    }

    /// The host did not submit the operation (the grant is for another device than its
    /// direct target, or the device is busy): leaves the grace period. The request then
    /// takes the engine path, which enters again.
    #[inline(always)]
    pub fn finish<D: BlockDevice>(self, exec: &Exec<D>) {
        exec.guest_exit(self.submitted());
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        // Reached only by a grant neither submitted nor finished (those forget it): its
        // grace-period entry would never end, and the owner would stop reusing clusters.
        debug_assert!(
            std::thread::panicking(),
            "a direct grant was dropped without its exit"
        );
    }
}

/// Where a guest read goes ([`Chain::route_read`](crate::Chain::route_read)).
#[must_use = "a direct route holds a grace-period entry"]
#[derive(Debug)]
pub enum ReadRoute {
    /// One extent of one device: the host submits it with the guest's buffers.
    Direct(Grant),
    /// The engine path on this core (a task, [`Chain::start`](crate::Chain::start)),
    /// which also reports an invalid request.
    Engine,
}

/// Where a guest write goes ([`Chain::route_write`](crate::Chain::route_write)).
#[must_use = "a direct route holds a grace-period entry"]
#[derive(Debug)]
pub enum WriteRoute {
    /// An overwrite of one extent of one device: the host submits it with the guest's
    /// buffers.
    Direct(Grant),
    /// The engine path on this core (a task, [`Chain::start`](crate::Chain::start)): on
    /// the metadata owner (or an image not shared) its write path; on a core replica its
    /// in-place path, which may still hand the write to the owner ([`Outcome::ToOwner`](crate::exec::Outcome::ToOwner)).
    /// Invalid requests are reported there too.
    Engine,
    /// The metadata owner (an allocation, or a slice the owner holds dirty).
    Owner {
        /// This replica's metadata for the write is current, and it is not in place there
        /// (an allocation, COW, zero clusters, no L2 table): the owner holds the same
        /// metadata, so it can start its slow path at once
        /// ([`Op::WriteNotInPlace`](crate::Op::WriteNotInPlace)) instead of
        /// planning a direct write first. Without it (a slice the owner holds dirty) the
        /// owner may find the write in place. Either way the owner's slow path handles any
        /// write.
        slow: bool,
    },
}

/// What the route of a write decided, as the chain's plan takes it: a [`WriteRoute`], and
/// on a chain that runs its own writes, whether the route found the write not in place
/// (made by `Chain::decide_write`; [`Chain::route_write`](crate::Chain::route_write) is its
/// public face).
#[derive(Debug)]
pub(crate) enum WriteDecision {
    /// As [`WriteRoute::Direct`].
    Direct(Grant),
    /// As [`WriteRoute::Engine`].
    Engine,
    /// [`WriteRoute::Engine`] on a chain that runs its own writes (the owner, an image one
    /// core serves), for a write its current metadata shows not in place (an allocation,
    /// COW, zero clusters): its slow path starts at once, without planning the write in
    /// place a second time.
    EngineNotInPlace,
    /// As [`WriteRoute::Owner`].
    Owner {
        /// As in [`WriteRoute::Owner`].
        slow: bool,
    },
}

impl From<WriteDecision> for WriteRoute {
    #[inline(always)]
    fn from(d: WriteDecision) -> WriteRoute {
        match d {
            WriteDecision::Direct(grant) => WriteRoute::Direct(grant),
            WriteDecision::Engine | WriteDecision::EngineNotInPlace => WriteRoute::Engine,
            WriteDecision::Owner { slow } => WriteRoute::Owner { slow },
        }
    }
}

/// The role the top image of a chain plays, which decides where requests that change
/// metadata run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The metadata owner, or an image only one core serves (or a raw top layer): every
    /// request runs here.
    Owner,
    /// A core replica of a writable image: reads and overwrites in place run here,
    /// anything that changes metadata runs on the owner.
    Replica,
    /// A read-only image (or a replica of one): writes fail.
    ReadOnly,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coherency::Parity;

    #[test]
    fn a_range_is_aligned_and_inside_the_disk() {
        let r = GuestRange::new(4096, 512, 8192).expect("valid");
        assert_eq!(
            (r.offset(), r.len(), r.end()),
            (GuestOffset(4096), 512, GuestOffset(4608))
        );
        assert!(GuestRange::new(0, 0, 0).is_ok_and(|r| r.is_empty()));
        for (off, len) in [
            (1, 512),
            (512, 511),
            (8192, 512),
            (7680, 1024),
            (u64::MAX - 511, 1024),
        ] {
            assert!(
                matches!(
                    GuestRange::new(off, len, 8192),
                    Err(Error::InvalidRequest(_))
                ),
                "{off} + {len}"
            );
        }
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without its exit")]
    fn a_grant_dropped_without_its_exit_is_a_bug() {
        let range = GuestRange::new(0, 512, 512).expect("valid");
        let _ = Grant::new(
            DevId(0),
            HostOffset(0),
            range,
            GraceEntry::of_parity(Parity::of(0)),
            FoundBy::Lookup,
            Access::Read,
        );
    }

    #[test]
    fn a_submitted_grant_hands_over_its_parity() {
        let range = GuestRange::new(0, 512, 512).expect("valid");
        let entry = GraceEntry::of_parity(Parity::of(1));
        assert_eq!(
            Grant::new(
                DevId(0),
                HostOffset(0),
                range,
                entry,
                FoundBy::Lookup,
                Access::Read
            )
            .submitted(),
            GraceEntry::of_parity(Parity::of(1))
        );
    }
}
