//! Where the engine hears of its own fast-path requests' ends (a read-ahead into a chain's
//! prefetch ring, a slice loaded ahead): the executor's table of internal sinks, and the
//! tokens that name a sink and a payload.

use super::Exec;
use crate::io::BlockDevice;
use std::rc::Rc;

/// Where the engine hears of its own fast-path requests' ends ([`Exec::add_internal_sink`]):
/// called with (the payload of the request's token, success).
pub type InternalSink = Rc<dyn Fn(u32, bool)>;

/// Bits of an internal request's token below the sink's number ([`SinkId::token`]).
pub const SINK_SHIFT: u32 = 48;

/// Bits of an internal request's token below the sink's generation: the payload's.
const SINK_GEN_SHIFT: u32 = 32;

/// A sink added to an executor ([`Exec::add_internal_sink`]): its number and the
/// generation of that number, so that a request still in flight for a sink removed since
/// is dropped when it ends rather than reaching a later sink of the same number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkId {
    index: u16,
    gen: u16,
}

impl SinkId {
    /// The token of an internal request whose end this sink hears of with `payload`.
    #[inline(always)]
    pub fn token(self, payload: u32) -> u64 {
        (self.index as u64) << SINK_SHIFT | (self.gen as u64) << SINK_GEN_SHIFT | payload as u64
    }

    fn of(token: u64) -> (SinkId, u32) {
        let id = SinkId {
            index: (token >> SINK_SHIFT) as u16,
            gen: (token >> SINK_GEN_SHIFT) as u16,
        };
        (id, token as u32)
    }
}

/// A sink that leaves its executor's table when dropped: held by what it reports to (a
/// chain), so that a chain rebuilt on the same core leaves no dead sink behind.
pub(crate) struct OwnedSink<D: BlockDevice> {
    exec: Exec<D>,
    id: SinkId,
}

impl<D: BlockDevice> OwnedSink<D> {
    /// Adds `sink` to `exec` ([`Exec::add_internal_sink`]).
    pub(crate) fn add(exec: &Exec<D>, sink: InternalSink) -> Self {
        OwnedSink {
            exec: exec.clone(),
            id: exec.add_internal_sink(sink),
        }
    }

    /// Its id.
    pub(crate) fn id(&self) -> SinkId {
        self.id
    }
}

impl<D: BlockDevice> Drop for OwnedSink<D> {
    fn drop(&mut self) {
        self.exec.remove_internal_sink(self.id);
    }
}

/// One entry of the executor's sink table: a number free while `sink` is `None`, reused
/// under the next generation.
pub(super) struct SinkEntry {
    sink: Option<InternalSink>,
    gen: u16,
}

impl<D: BlockDevice> Exec<D> {
    /// Adds a place where the engine hears of its own fast-path requests' ends (those
    /// started with `internal` set: a read-ahead into a chain's prefetch ring, a slice
    /// loaded ahead) and returns its id: internal requests whose token it made
    /// ([`SinkId::token`]) end there. Allocated once, here: an internal request allocates
    /// nothing. Takes the number of a removed sink if there is one (a rebuilt chain leaves
    /// nothing behind), under a new generation.
    pub fn add_internal_sink(&self, sink: InternalSink) -> SinkId {
        let mut sinks = self.inner.sinks.borrow_mut();
        if let Some(index) = sinks.iter().position(|e| e.sink.is_none()) {
            sinks[index].sink = Some(sink);
            return SinkId {
                index: index as u16,
                gen: sinks[index].gen,
            };
        }
        assert!(
            sinks.len() < 1 << 16,
            "more than 65536 internal sinks at once"
        );
        sinks.push(SinkEntry {
            sink: Some(sink),
            gen: 0,
        });
        SinkId {
            index: (sinks.len() - 1) as u16,
            gen: 0,
        }
    }

    /// Removes sink `id` (its owner is gone): the ends of its requests still in flight are
    /// dropped, and its number is free for the next [`add_internal_sink`](Self::add_internal_sink).
    pub fn remove_internal_sink(&self, id: SinkId) {
        let mut sinks = self.inner.sinks.borrow_mut();
        if let Some(e) = sinks.get_mut(id.index as usize) {
            if e.gen == id.gen && e.sink.is_some() {
                e.sink = None;
                e.gen = e.gen.wrapping_add(1);
            }
        }
    }

    /// Internal sinks added and not removed.
    pub fn internal_sinks(&self) -> usize {
        self.inner
            .sinks
            .borrow()
            .iter()
            .filter(|e| e.sink.is_some())
            .count()
    }

    /// An internal request of token `token` ended (`ok`): queues it for the sink. Also how
    /// the sink puts back one it cannot take now (it is re-offered at the next
    /// [`take_outcomes`](Self::take_outcomes)).
    pub(crate) fn internal_done(&self, token: u64, ok: bool) {
        self.inner.internal.borrow_mut().push_back((token, ok));
    }

    /// Hands the internal requests that ended so far to the sink; returns how many.
    pub(super) fn take_internal(&self) -> usize {
        let k = self.inner.internal.borrow().len();
        for _ in 0..k {
            let Some((token, ok)) = self.inner.internal.borrow_mut().pop_front() else {
                return k;
            };
            // A handle of its own: the sink may add or remove one.
            let (id, payload) = SinkId::of(token);
            let sink = self
                .inner
                .sinks
                .borrow()
                .get(id.index as usize)
                .filter(|e| e.gen == id.gen)
                .and_then(|e| e.sink.clone());
            if let Some(sink) = sink {
                sink(payload, ok);
            }
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MemDevice;
    use std::cell::RefCell;

    #[test]
    fn a_removed_sinks_number_is_reused_and_its_late_ends_reach_nothing() {
        let exec: Exec<MemDevice> = Exec::new();
        let heard: Rc<RefCell<Vec<(char, u32)>>> = Rc::default();
        let sink = |name: char| -> InternalSink {
            let heard = heard.clone();
            Rc::new(move |payload, _| heard.borrow_mut().push((name, payload)))
        };
        let a = exec.add_internal_sink(sink('a'));
        // A request of `a` ends after `a` is gone.
        exec.internal_done(a.token(5), true);
        exec.remove_internal_sink(a);
        assert_eq!(exec.internal_sinks(), 0);
        let b = exec.add_internal_sink(sink('b'));
        assert_eq!(b.index, a.index, "the number is reused");
        assert_ne!(b.token(5), a.token(5));
        exec.internal_done(b.token(6), true);
        exec.poll(&mut |_, _| {});
        assert_eq!(*heard.borrow(), vec![('b', 6)]);
        // Removing `a` again (stale id) leaves `b` in place.
        exec.remove_internal_sink(a);
        assert_eq!(exec.internal_sinks(), 1);
    }
}
