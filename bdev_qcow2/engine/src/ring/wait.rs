//! The reads waiting for a chunk's read-ahead ([`Lookup::Wait`](super::Lookup::Wait)): a
//! fixed table of [`MAX_WAITERS`] entries allocated with the ring, and per slot a FIFO
//! list through it (intrusive links), so that queueing a read and handing it on take no
//! lock and allocate nothing.

use super::MAX_WAITERS;
use crate::io::BufSlice;

/// No entry (end of a list).
const NONE: u16 = u16::MAX;
const _: () = assert!(MAX_WAITERS < NONE);

/// A read waiting for the rest of its bytes: the host's tag, and where they go.
pub(crate) struct Waiter<B> {
    /// The host's tag, completed when the read is done.
    pub tag: u64,
    /// Guest offset of the bytes still to read.
    pub offset: u64,
    /// Where they go (its length is theirs).
    pub buf: BufSlice<B>,
    /// Its first part was served from the ring before it waited.
    pub prefix: bool,
}

/// The waiter table of one core's ring.
pub(crate) struct Waiters<B> {
    entries: Box<[Option<Waiter<B>>]>,
    /// Next entry in the same list.
    link: Box<[u16]>,
    /// Per slot: its first and last waiter.
    head: Box<[u16]>,
    tail: Box<[u16]>,
    free: Vec<u16>,
}

impl<B> Waiters<B> {
    /// A table for a ring of `slots` slots.
    pub fn new(slots: usize) -> Self {
        let n = MAX_WAITERS as usize;
        Waiters {
            entries: (0..n).map(|_| None).collect(),
            link: vec![NONE; n].into_boxed_slice(),
            head: vec![NONE; slots].into_boxed_slice(),
            tail: vec![NONE; slots].into_boxed_slice(),
            free: (0..MAX_WAITERS).rev().collect(),
        }
    }

    /// Queues `w` on `slot`. The ring counted it ([`Ring::lookup`](super::Ring::lookup)
    /// returned `Wait` only with room left), so there is room.
    pub fn push(&mut self, slot: u16, w: Waiter<B>) {
        let Some(e) = self.free.pop() else {
            unreachable!("the ring counts waiters against MAX_WAITERS");
        };
        self.entries[e as usize] = Some(w);
        self.link[e as usize] = NONE;
        let s = slot as usize;
        match self.tail[s] {
            NONE => self.head[s] = e,
            t => self.link[t as usize] = e,
        }
        self.tail[s] = e;
    }

    /// Takes the first read waiting on `slot`.
    pub fn pop(&mut self, slot: u16) -> Option<Waiter<B>> {
        let s = slot as usize;
        let e = self.head[s];
        if e == NONE {
            return None;
        }
        self.head[s] = self.link[e as usize];
        if self.head[s] == NONE {
            self.tail[s] = NONE;
        }
        self.free.push(e);
        self.entries[e as usize].take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::HeapBuf;

    fn w(tag: u64) -> Waiter<HeapBuf> {
        Waiter {
            tag,
            offset: 0,
            buf: BufSlice::whole(HeapBuf::new(1)),
            prefix: false,
        }
    }

    #[test]
    fn lists_are_fifo_per_slot_and_entries_are_reused() {
        let mut t = Waiters::new(3);
        for round in 0..3 {
            for k in 0..MAX_WAITERS as u64 / 2 {
                t.push(0, w(k));
                t.push(2, w(1000 + k));
            }
            assert!(t.pop(1).is_none(), "round {round}");
            for k in 0..MAX_WAITERS as u64 / 2 {
                assert_eq!(t.pop(2).unwrap().tag, 1000 + k);
                assert_eq!(t.pop(0).unwrap().tag, k);
            }
            assert!(t.pop(0).is_none() && t.pop(2).is_none());
        }
    }
}
