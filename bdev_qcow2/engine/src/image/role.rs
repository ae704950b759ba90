//! The role an open image plays among the cores that serve it (ARCHITECTURE.md §6): opened
//! read-only, the metadata owner, or a core replica of a shared image. One enum rather than
//! a field per role, so that what cannot happen cannot be built: a replica always has the
//! published state, a read-only image has no owner state. What only one role does goes
//! through its view ([`Owner`](super::owner::Owner), [`Replica`]), obtained here by one
//! match.

use super::{owner, CoreSide, Qcow2, Replica};
use crate::coherency::Shared;
use crate::io::BlockDevice;
use crate::route::Role;
use std::sync::Arc;

/// The image's role and the state only that role has.
// One per image, the owner's state inline: its checks on the write path reach it without
// a pointer, as when it was a field of the image.
#[allow(clippy::large_enum_variant)]
pub(super) enum ImageRole<D: BlockDevice> {
    /// Opened read-only, or a [`Qcow2::replica`] copy: writes fail.
    ReadOnly {
        /// The state published to the cores' read-only replicas, once
        /// [`share`](Qcow2::share)d.
        shared: Option<Arc<Shared>>,
    },
    /// Open for writing: the metadata owner.
    Owner {
        /// The owner's state, reached by its operations through [`Qcow2::owner`].
        meta: owner::Meta<D>,
        /// The state published to the core replicas, once [`share`](Qcow2::share)d.
        shared: Option<Arc<Shared>>,
    },
    /// A core replica of a shared image, reached through [`Qcow2::replica_side`] by what
    /// only a replica does.
    Replica(CoreSide<D>),
}

impl<D: BlockDevice> ImageRole<D> {
    /// Records `sh`, the state [`Qcow2::share`] published (a replica has its own from
    /// the start).
    pub(super) fn publish(&mut self, sh: Arc<Shared>) {
        match self {
            ImageRole::ReadOnly { shared } | ImageRole::Owner { shared, .. } => *shared = Some(sh),
            ImageRole::Replica(_) => {}
        }
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// The shared state, if [`share`](Self::share)d (owner, read-only image) or a core
    /// replica.
    #[inline]
    pub fn shared(&self) -> Option<&Arc<Shared>> {
        match &self.role {
            ImageRole::ReadOnly { shared } | ImageRole::Owner { shared, .. } => shared.as_ref(),
            ImageRole::Replica(c) => Some(&c.shared),
        }
    }

    /// Whether this is a core replica of a shared image.
    #[inline]
    pub fn is_core_replica(&self) -> bool {
        matches!(self.role, ImageRole::Replica(_))
    }

    /// Whether the image is open for writing (the metadata owner: a core replica's writes
    /// that change metadata go to the owner).
    #[inline]
    pub fn is_writable(&self) -> bool {
        matches!(self.role, ImageRole::Owner { .. })
    }

    /// The metadata owner's state, when this image is the owner (see
    /// [`owner`](Self::owner) for its operations).
    #[inline(always)]
    pub(crate) fn meta_state(&self) -> Option<&owner::Meta<D>> {
        match &self.role {
            ImageRole::Owner { meta, .. } => Some(meta),
            _ => None,
        }
    }

    /// The owner's state and the state it published, when this image is the owner.
    #[inline]
    pub(super) fn owner_parts(&self) -> Option<(&owner::Meta<D>, Option<&Shared>)> {
        match &self.role {
            ImageRole::Owner { meta, shared } => Some((meta, shared.as_deref())),
            _ => None,
        }
    }

    /// This image as a core replica (`None` on the owner and on a read-only image).
    #[inline]
    pub(crate) fn replica_side(&self) -> Option<Replica<'_, D>> {
        match &self.role {
            ImageRole::Replica(side) => Some(Replica { q: self, side }),
            _ => None,
        }
    }

    /// The shared state of a core replica (`None` on the owner).
    #[inline(always)]
    pub(super) fn core_shared(&self) -> Option<&Shared> {
        match &self.role {
            ImageRole::Replica(c) => Some(&c.shared),
            _ => None,
        }
    }

    /// The shared state of a writable core replica (`None` on the owner and on read-only
    /// images): what its in-place writes are checked against.
    #[inline(always)]
    pub(crate) fn writable_core_shared(&self) -> Option<&Shared> {
        match &self.role {
            ImageRole::Replica(c) if c.writable => Some(&c.shared),
            _ => None,
        }
    }

    /// The role a chain over this image as its top layer plays ([`Role`]): where its
    /// requests that change metadata run. A replica of a read-only image is read-only.
    pub(crate) fn plan_role(&self) -> Role {
        match &self.role {
            ImageRole::Owner { .. } => Role::Owner,
            ImageRole::Replica(c) if c.writable => Role::Replica,
            ImageRole::Replica(_) | ImageRole::ReadOnly { .. } => Role::ReadOnly,
        }
    }
}
