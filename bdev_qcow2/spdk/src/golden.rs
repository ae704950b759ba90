//! One shared read cache per golden image: every qcow2 bdev whose backing bdev is the same
//! bdev (by name, UUID and size) reads it through the same
//! [`SharedReadCache`], on every core. The backing bdev is claimed read-only by each of
//! them (`READ_MANY_WRITE_NONE`), so nothing writes it while a cache of it lives.

use crate::ffi::bdev::Desc;
use crate::ffi::granule::DmaGranule;
use qcow2_engine::golden::{CacheStats, SharedReadCache, DEFAULT_GRANULE};
use std::sync::{Arc, Mutex, Weak};

/// Who a cache is for: the same name could later be another bdev.
type Key = (String, String, u64);

static CACHES: Mutex<Vec<(Key, Weak<SharedReadCache>)>> = Mutex::new(Vec::new());

/// The cache of golden bdev `desc`, made with `bytes` of capacity by the first bdev that
/// reads it (later ones share it whatever they ask); `None` when `bytes` is 0 (off) or
/// less than one set of slots.
pub fn cache_for(desc: &Desc, bytes: u64) -> Option<Arc<SharedReadCache>> {
    if bytes == 0 {
        return None;
    }
    let key = (desc.name(), desc.uuid().to_string(), desc.size());
    // Only creations and teardowns take it: never on the data path.
    let mut caches = CACHES.lock().unwrap_or_else(|e| e.into_inner());
    caches.retain(|(_, w)| w.strong_count() > 0);
    if let Some(c) = caches
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Some(c);
    }
    // Its granules in DMA memory: a hit is one memcpy into the request.
    let c = SharedReadCache::with_memory(bytes, DEFAULT_GRANULE, DmaGranule::alloc)?;
    tracing::info!(
        "golden bdev {}: a shared read cache of up to {} MiB",
        key.0,
        c.stats().capacity_bytes >> 20
    );
    caches.push((key, Arc::downgrade(&c)));
    Some(c)
}

/// The cache's counters, with the count of bdevs sharing it, as `bdev_qcow2_get_stats`
/// and `bdev_get_bdevs` show them.
pub fn stats_json(c: &Arc<SharedReadCache>) -> serde_json::Value {
    let CacheStats {
        hits,
        fills,
        fill_bytes,
        fills_in_place,
        waits,
        bypasses,
        memory_bytes,
        capacity_bytes,
        sharers,
    } = c.stats();
    serde_json::json!({
        "granule_bytes": c.granule(),
        "hits": hits,
        "fills": fills,
        "fill_bytes": fill_bytes,
        // Fills read straight into their slot's DMA memory (the rest were copied in).
        "fills_in_place": fills_in_place,
        "waits": waits,
        "bypasses": bypasses,
        "memory_bytes": memory_bytes,
        "capacity_bytes": capacity_bytes,
        // Bdevs over the golden bdev: reads go through the cache while two or more do.
        "sharers": sharers,
        // Bdevs hold it once each, and every core's device of it once more.
        "references": Arc::strong_count(c),
    })
}
