//! The owner's table of first writes it planned for cores ([`super::reserve`]): each plan
//! kept under a ticket until the core hands it back. Apart from the protocol so the chain
//! can hold the table without importing the protocol's calls.

use super::parts::{Allocs, Parts};
use crate::exec::GraceEntry;
use crate::types::GuestOffset;
use std::cell::RefCell;

/// A first write the owner planned for a core ([`Chain::reserve_write`]): the owner's
/// handle on it, handed back once ([`Chain::commit_reserved`], [`Chain::run_reserved`]).
#[must_use = "a reservation holds clusters in flight until it is handed back"]
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket(u64);

impl Ticket {
    /// The ticket as a word, for a host's message (SPDK: a bdev_io's driver area).
    pub fn into_raw(self) -> u64 {
        self.0
    }

    /// The ticket [`into_raw`](Self::into_raw) gave. A word no reservation holds is
    /// refused by the owner's calls.
    pub fn from_raw(raw: u64) -> Ticket {
        Ticket(raw)
    }
}

/// A plan kept for a core between [`Chain::reserve_write`] and its hand-back.
pub(super) struct Plan {
    pub(super) entry: GraceEntry,
    pub(super) start: GuestOffset,
    pub(super) parts: Parts,
    pub(super) allocs: Allocs,
}

/// The owner's plans held for cores, by ticket.
#[derive(Default)]
pub(crate) struct Reservations(RefCell<slab::Slab<Plan>>);

impl Reservations {
    pub(super) fn insert(&self, plan: Plan) -> Ticket {
        Ticket(self.0.borrow_mut().insert(plan) as u64)
    }

    pub(super) fn take(&self, t: Ticket) -> Option<Plan> {
        self.0.borrow_mut().try_remove(t.0 as usize)
    }

    /// How many are held (their clusters are in flight).
    pub(crate) fn len(&self) -> usize {
        self.0.borrow().len()
    }
}
