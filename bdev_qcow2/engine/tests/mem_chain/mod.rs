//! A writable image on an in-memory device as one chain, driven to completion request by
//! request: what the zeroed-tail tests (`zeroed_tail.rs`, `zero_ahead.rs`) write and read
//! with; and where a compressed cluster's stream lies (`ring.rs`, `read_path.rs`,
//! `coherency.rs`).

#![allow(clippy::unwrap_used, dead_code)] // test helpers may panic; not every test uses each

use qcow2_engine::io::{BufSlice, HeapBuf, IoBuffer};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::rc::Rc;

/// Opens the image on `dev` writable, with `zero_ahead` as given.
pub fn open(exec: &Exec<MemDevice>, dev: &MemDevice, zero_ahead: bool) -> Rc<Chain<MemDevice>> {
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let opts = OpenOptions {
        writable: true,
        zero_ahead,
        ..Default::default()
    };
    let q = exec
        .block_on(async move { Qcow2::open(&e2, id, opts).await })
        .unwrap();
    Chain::new(exec, vec![Layer::Qcow2(Box::new(q))]).unwrap()
}

/// The chain's image.
pub fn image(chain: &Chain<MemDevice>) -> &Qcow2<MemDevice> {
    match &chain.layers()[0] {
        Layer::Qcow2(q) => q,
        _ => unreachable!("a qcow2 chain"),
    }
}

pub fn write(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, data: &[u8]) {
    let (c, buf) = (chain.clone(), HeapBuf::new(data.len()));
    buf.copy_in(0, data);
    exec.block_on(async move { c.write(off, BufSlice::whole(buf)).await })
        .unwrap();
}

pub fn read(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>, off: u64, len: usize) -> Vec<u8> {
    let (c, buf) = (chain.clone(), HeapBuf::new(len));
    let b2 = buf.clone();
    exec.block_on(async move { c.read(off, BufSlice::whole(b2)).await })
        .unwrap();
    buf.to_vec()
}

pub fn flush(exec: &Exec<MemDevice>, chain: &Rc<Chain<MemDevice>>) {
    let c = chain.clone();
    exec.block_on(async move { c.flush().await }).unwrap();
}

pub fn close(exec: &Exec<MemDevice>, chain: Rc<Chain<MemDevice>>) {
    exec.block_on(async move { chain.close().await }).unwrap();
}

/// The compressed stream of the cluster at guest `off` in the chain's top image (any
/// device: the coherency rig's too).
pub fn compressed_at<D: qcow2_engine::io::BlockDevice>(
    exec: &Exec<D>,
    chain: &Rc<Chain<D>>,
    off: u64,
) -> qcow2_engine::format::CompressedDescriptor {
    let c = chain.clone();
    let (m, _) = exec
        .block_on(async move { c.block_status(0, off, off + 512).await })
        .unwrap();
    match m {
        qcow2_engine::format::ClusterMapping::Compressed(d) => d,
        m => panic!("cluster at {off} not compressed: {m:?}"),
    }
}
