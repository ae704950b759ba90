//! The owner's quiet write-back of dirty metadata, started from its poll loop.

use super::top;
use crate::chain::Chain;
use crate::io::BlockDevice;
use std::rc::Rc;

impl<D: BlockDevice> Chain<D> {
    /// On the metadata owner, called from its poll loop: when dirty metadata has waited
    /// [`BACKGROUND_WRITEBACK_INTERVAL`](crate::meta::BACKGROUND_WRITEBACK_INTERVAL) without
    /// a flush, starts writing it back (a task; no device flush). Returns whether it
    /// started one. A failure leaves the metadata dirty for the next flush, which reports it.
    pub fn tick_background_writeback(self: &Rc<Self>) -> bool {
        let Ok(q) = top(self) else {
            return false;
        };
        if !q.background_writeback_due() {
            return false;
        }
        let chain = self.clone();
        self.exec().spawn(async move {
            if let Ok(q) = top(&chain) {
                if let Err(e) = q.background_writeback().await {
                    tracing::warn!("background metadata write-back failed: {e}");
                }
            }
        });
        true
    }

    /// Whether dirty metadata waits for [`tick_background_writeback`](Self::tick_background_writeback)
    /// to start its write-back: a poll loop that stops polling while idle must not stop
    /// while this holds (the quiet write-back bounds how long a slice stays dirty).
    pub fn background_writeback_pending(&self) -> bool {
        top(self).is_ok_and(|q| q.background_writeback_pending())
    }
}
