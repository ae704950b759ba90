//! The reads waiting for chunks' read-aheads ([`Lookup::Wait`](super::Lookup::Wait)): a
//! fixed table of [`MAX_WAITERS`] reads and [`MAX_WAIT_LINKS`] links allocated with the
//! ring. A read waits for one or more chunks: one link per chunk, on that slot's FIFO list
//! (intrusive), each naming the read; the read counts the chunks it still waits for. So
//! queueing a read and handing it on take no lock and allocate nothing.

use super::{MAX_WAITERS, MAX_WAIT_LINKS};
use crate::io::BufSlice;

/// No entry (end of a list).
const NONE: u16 = u16::MAX;
const _: () = assert!(MAX_WAITERS < NONE && MAX_WAIT_LINKS < NONE);

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
    /// Chunks it still waits for.
    pub pending: u32,
    /// A chunk it waited for came in unusable (written while it filled, or its read
    /// failed): the whole rest goes to the base once every chunk came in.
    pub dead: bool,
}

/// The waiter table of one core's ring.
pub(crate) struct Waiters<B> {
    reads: Box<[Option<Waiter<B>>]>,
    free_reads: Vec<u16>,
    /// Per link: the read it names and the next link on the same slot.
    link_read: Box<[u16]>,
    link_next: Box<[u16]>,
    free_links: Vec<u16>,
    /// Per slot: its first and last link.
    head: Box<[u16]>,
    tail: Box<[u16]>,
}

impl<B> Waiters<B> {
    /// A table for a ring of `slots` slots.
    pub fn new(slots: usize) -> Self {
        let (n, l) = (MAX_WAITERS as usize, MAX_WAIT_LINKS as usize);
        Waiters {
            reads: (0..n).map(|_| None).collect(),
            free_reads: (0..MAX_WAITERS).rev().collect(),
            link_read: vec![NONE; l].into_boxed_slice(),
            link_next: vec![NONE; l].into_boxed_slice(),
            free_links: (0..MAX_WAIT_LINKS).rev().collect(),
            head: vec![NONE; slots].into_boxed_slice(),
            tail: vec![NONE; slots].into_boxed_slice(),
        }
    }

    /// Enters read `w` (not yet on any slot: [`link`](Self::link) it on each slot it
    /// waits for); returns its entry. The ring counted it ([`Ring::lookup`](super::Ring::lookup)
    /// returned `Wait` only with room left), so there is room.
    pub fn add(&mut self, w: Waiter<B>) -> u16 {
        let Some(e) = self.free_reads.pop() else {
            unreachable!("the ring counts waiting reads against MAX_WAITERS");
        };
        self.reads[e as usize] = Some(w);
        e
    }

    /// Queues read `read` on `slot`.
    pub fn link(&mut self, slot: u16, read: u16) {
        let Some(e) = self.free_links.pop() else {
            unreachable!("the ring counts waited chunks against MAX_WAIT_LINKS");
        };
        self.link_read[e as usize] = read;
        self.link_next[e as usize] = NONE;
        let s = slot as usize;
        match self.tail[s] {
            NONE => self.head[s] = e,
            t => self.link_next[t as usize] = e,
        }
        self.tail[s] = e;
    }

    /// Takes the first read waiting on `slot` off it: its entry.
    pub fn pop(&mut self, slot: u16) -> Option<u16> {
        let s = slot as usize;
        let e = self.head[s];
        if e == NONE {
            return None;
        }
        self.head[s] = self.link_next[e as usize];
        if self.head[s] == NONE {
            self.tail[s] = NONE;
        }
        self.free_links.push(e);
        Some(self.link_read[e as usize])
    }

    /// The read in entry `read`.
    pub fn get_mut(&mut self, read: u16) -> Option<&mut Waiter<B>> {
        self.reads.get_mut(read as usize)?.as_mut()
    }

    /// Removes the read in entry `read` (it waits for nothing more).
    pub fn take(&mut self, read: u16) -> Option<Waiter<B>> {
        let w = self.reads.get_mut(read as usize)?.take()?;
        self.free_reads.push(read);
        Some(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::HeapBuf;

    fn w(tag: u64, pending: u32) -> Waiter<HeapBuf> {
        Waiter {
            tag,
            offset: 0,
            buf: BufSlice::whole(HeapBuf::new(1)),
            prefix: false,
            pending,
            dead: false,
        }
    }

    #[test]
    fn lists_are_fifo_per_slot_and_entries_are_reused() {
        let mut t = Waiters::new(3);
        for round in 0..3 {
            for k in 0..MAX_WAITERS as u64 / 2 {
                let a = t.add(w(k, 1));
                t.link(0, a);
                let b = t.add(w(1000 + k, 1));
                t.link(2, b);
            }
            assert!(t.pop(1).is_none(), "round {round}");
            for k in 0..MAX_WAITERS as u64 / 2 {
                let b = t.pop(2).unwrap();
                assert_eq!(t.take(b).unwrap().tag, 1000 + k);
                let a = t.pop(0).unwrap();
                assert_eq!(t.take(a).unwrap().tag, k);
            }
            assert!(t.pop(0).is_none() && t.pop(2).is_none());
        }
    }

    #[test]
    fn a_read_waiting_on_several_slots_is_on_each_list_until_taken() {
        let mut t = Waiters::new(4);
        let r = t.add(w(9, 3));
        for s in [1, 2, 3] {
            t.link(s, r);
        }
        let other = t.add(w(10, 1));
        t.link(2, other);
        assert_eq!(t.pop(3), Some(r));
        t.get_mut(r).unwrap().pending -= 1;
        assert_eq!(t.pop(2), Some(r));
        assert_eq!(t.pop(2), Some(other));
        assert_eq!(t.pop(1), Some(r));
        assert_eq!(t.take(r).unwrap().tag, 9);
        assert!(t.get_mut(r).is_none() && t.take(r).is_none());
        // Every link is back: the whole table can be linked again.
        for k in 0..MAX_WAIT_LINKS {
            t.link(k % 4, other);
        }
    }
}
