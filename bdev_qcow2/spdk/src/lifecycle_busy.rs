//! Which qcow2 bdevs are in a life-cycle operation (resize, snapshot create or delete,
//! external snapshot): one at a time per bdev, the others refused with `EBUSY`.

use std::sync::Mutex;

static BUSY: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The bdev `name` is in a life-cycle operation until this is dropped (on any path the
/// operation ends by).
pub struct Busy(String);

impl Busy {
    /// Marks `name` busy; `None` if it already is.
    pub fn begin(name: &str) -> Option<Busy> {
        let mut b = BUSY.lock().unwrap_or_else(|e| e.into_inner());
        if b.iter().any(|n| n == name) {
            return None;
        }
        b.push(name.to_owned());
        Some(Busy(name.to_owned()))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|n| *n != self.0);
    }
}
