//! An overlay whose golden (backing) device went away (ARCHITECTURE.md §15, degraded
//! mode): what the overlay holds reads and writes as before; a read that needs the golden
//! image fails; a write that would copy the rest of its cluster from the golden image fails
//! and maps nothing (never zeros where golden data belongs); a write of whole clusters
//! succeeds. Once the device is back, the golden image reads through again. The device
//! fails every operation while gone, as the SPDK module's device of a hot-removed bdev
//! does.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::golden::{CachedDevice, SharedReadCache, DEFAULT_GRANULE};
use qcow2_engine::io::{BufSlice, HeapBuf};
use qcow2_engine::testing::{MemDevice, Rng};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::rc::Rc;
use std::sync::Arc;

const CLUSTER: usize = 64 << 10;
const SIZE: usize = 16 * CLUSTER;
const EIO: i32 = 5;

type Dev = CachedDevice<MemDevice>;

struct Rig {
    exec: Exec<Dev>,
    chain: Rc<Chain<Dev>>,
    golden: MemDevice,
    bytes: Vec<u8>,
}

fn rig(cache: Option<Arc<SharedReadCache>>, extended_l2: bool) -> Rig {
    let mut r = Rng(46);
    let bytes: Vec<u8> = (0..SIZE).map(|_| (r.next() | 1) as u8).collect();
    let exec: Exec<Dev> = Exec::new();
    let img = exec.add_device(CachedDevice::plain(MemDevice::new(Vec::new())));
    let e = exec.clone();
    let opts = CreateOptions {
        size: SIZE as u64,
        cluster_bits: CLUSTER.trailing_zeros(),
        extended_l2,
        backing_file: Some("golden".into()),
        backing_format: Some("raw".into()),
        ..Default::default()
    };
    exec.block_on(async move { create(&e, img, &opts).await })
        .unwrap();
    let e = exec.clone();
    let q = exec
        .block_on(async move {
            Qcow2::open(
                &e,
                img,
                OpenOptions {
                    writable: true,
                    ..Default::default()
                },
            )
            .await
        })
        .unwrap();
    let golden = MemDevice::new(bytes.clone());
    let gid = exec.add_device(CachedDevice::new(golden.clone(), cache));
    let layers = vec![
        Layer::Qcow2(Box::new(q)),
        Layer::Raw {
            dev: gid,
            size: SIZE as u64,
        },
    ];
    let chain = Chain::new(&exec, layers).unwrap();
    Rig {
        exec,
        chain,
        golden,
        bytes,
    }
}

impl Rig {
    fn read(&self, off: usize, len: usize) -> qcow2_engine::Result<Vec<u8>> {
        let buf = HeapBuf::new(len);
        let (c, b) = (self.chain.clone(), BufSlice::whole(buf.clone()));
        self.exec
            .block_on(async move { c.read(off as u64, b).await })
            .map(|()| buf.to_vec())
    }

    fn write(&self, off: usize, data: &[u8]) -> qcow2_engine::Result<()> {
        let buf = HeapBuf::new(data.len());
        BufSlice::whole(buf.clone()).copy_in(0, data);
        let c = self.chain.clone();
        self.exec
            .block_on(async move { c.write(off as u64, BufSlice::whole(buf)).await })
    }

    fn flush(&self) -> qcow2_engine::Result<()> {
        let c = self.chain.clone();
        self.exec.block_on(async move { c.flush().await })
    }

    fn set_gone(&self, gone: bool) {
        self.golden.0.borrow_mut().gone = gone.then_some(EIO);
    }

    fn golden(&self, off: usize, len: usize) -> &[u8] {
        &self.bytes[off..off + len]
    }
}

fn degraded_overlay_serves_what_it_holds(cache: Option<Arc<SharedReadCache>>, extended_l2: bool) {
    let r = rig(cache, extended_l2);
    let c = CLUSTER;
    // The overlay's own data: a whole cluster, and a partial write (COW from the golden
    // image while it is there).
    let own = vec![0xa5u8; c];
    r.write(0, &own).unwrap();
    r.write(2 * c + 512, &[0x5a; 4096]).unwrap();
    r.flush().unwrap();

    r.set_gone(true);
    assert_eq!(
        r.read(0, c).unwrap(),
        own,
        "an owned cluster reads while degraded"
    );
    let mut cow = r.golden(2 * c, c).to_vec();
    cow[512..512 + 4096].fill(0x5a);
    if extended_l2 {
        // Only the subclusters written (2 KiB each) were allocated; the rest of the
        // cluster still reads from the golden image.
        assert_eq!(
            r.read(2 * c, 6144).unwrap(),
            cow[..6144],
            "written subclusters read"
        );
        assert!(r.read(2 * c + 8192, 4096).is_err());
    } else {
        assert_eq!(
            r.read(2 * c, c).unwrap(),
            cow,
            "a COW'd cluster reads while degraded"
        );
    }
    assert!(r.read(c, 4096).is_err(), "a golden-backed read fails");
    assert!(
        r.read(c - 4096, 8192).is_err(),
        "a read spanning owned and golden-backed data fails"
    );
    // Overwrites of owned clusters, flushes.
    r.write(4096, &[0x11; 4096]).unwrap();
    r.flush().unwrap();
    // A partial write into an unallocated cluster (and subcluster) needs the rest from the
    // golden image.
    assert!(r.write(5 * c + 4608, &[0x22; 4096]).is_err());
    // A whole-cluster write needs nothing from it.
    r.write(6 * c, &[0x33; CLUSTER]).unwrap();
    r.flush().unwrap();
    assert_eq!(r.read(6 * c, c).unwrap(), vec![0x33; c]);

    r.set_gone(false);
    // The failed write mapped nothing: the golden image shows through, not zeros.
    assert_eq!(r.read(5 * c, c).unwrap(), r.golden(5 * c, c));
    assert_eq!(r.read(c, c).unwrap(), r.golden(c, c));
    let mut first = own.clone();
    first[4096..8192].fill(0x11);
    assert_eq!(r.read(0, c).unwrap(), first);
    // And a partial write COWs again.
    r.write(5 * c + 4608, &[0x22; 4096]).unwrap();
    let mut five = r.golden(5 * c, c).to_vec();
    five[4608..8704].fill(0x22);
    assert_eq!(r.read(5 * c, c).unwrap(), five);
}

#[test]
fn a_degraded_overlay_serves_what_it_holds_and_fails_what_needs_the_golden_image() {
    degraded_overlay_serves_what_it_holds(None, false);
}

#[test]
fn degraded_with_extended_l2() {
    degraded_overlay_serves_what_it_holds(None, true);
}

#[test]
fn degraded_through_a_shared_cache_that_is_then_dropped() {
    let cache = SharedReadCache::new(4 << 20, DEFAULT_GRANULE);
    // Two overlays hold each cache (one alone would read past it).
    let _held = cache.as_ref().map(|c| (c.share(), c.share()));
    let r = rig(cache.clone(), false);
    // Warm the cache, then the golden device goes and the host drops the cache (as the
    // SPDK module does): golden-backed reads fail rather than hang or read zeros.
    assert_eq!(
        r.read(CLUSTER, CLUSTER).unwrap(),
        r.golden(CLUSTER, CLUSTER)
    );
    r.set_gone(true);
    r.exec
        .with_device(qcow2_engine::DevId(1), |d| d.set_cache(None));
    assert!(r.read(CLUSTER, 4096).is_err());
    assert!(r.read(8 * CLUSTER, 4096).is_err());
    // Back, with a new cache (another bdev of the same name would bring another).
    r.set_gone(false);
    let fresh = SharedReadCache::new(4 << 20, DEFAULT_GRANULE);
    let _held_fresh = fresh.as_ref().map(|c| (c.share(), c.share()));
    r.exec
        .with_device(qcow2_engine::DevId(1), |d| d.set_cache(fresh.clone()));
    assert_eq!(
        r.read(8 * CLUSTER, 4096).unwrap(),
        r.golden(8 * CLUSTER, 4096)
    );
    assert!(fresh.unwrap().stats().fills > 0);
}
