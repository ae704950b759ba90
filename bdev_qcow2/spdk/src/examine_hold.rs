//! An `examine_config` of a new bdev kept open until what it started has finished: the
//! creations deferred until that bdev appeared, and the overlays taking it as their
//! backing bdev (created degraded without it, or left by one hot-removed). Then
//! `bdev_wait_for_examine`, and an app starting I/O once its config is loaded, see them
//! done: an overlay listed before its golden bdev in a config reads through it.

use crate::ffi::module;
use crate::ffi::thread::Thread;
use std::sync::Arc;

/// A share in one examine, on any thread: the examine is over when the last share is
/// dropped.
#[derive(Clone)]
pub struct ExamineHold {
    _examine: Arc<Examine>,
}

/// The examine, told done (on its own thread) when dropped.
struct Examine {
    thread: Option<Thread>,
}

impl ExamineHold {
    /// Holds the examine that runs on the calling thread.
    pub fn here() -> ExamineHold {
        ExamineHold {
            _examine: Arc::new(Examine {
                thread: Thread::current(),
            }),
        }
    }
}

impl Drop for Examine {
    fn drop(&mut self) {
        let Some(t) = self.thread.filter(|t| !t.is_current()) else {
            return module::examine_done();
        };
        if let Err(e) = t.send(module::examine_done) {
            tracing::error!("cannot reach the examining thread ({e}): examine done here");
            module::examine_done();
        }
    }
}
