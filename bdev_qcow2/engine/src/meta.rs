//! The metadata owner's public types, where callers have always found them. The owner's
//! state and operations live together, one module per concern, in `image::owner`.

pub use crate::image::owner::{Inflight, Meta, OwnerStats, BACKGROUND_WRITEBACK_INTERVAL};
