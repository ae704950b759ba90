//! A writable image on an in-memory device as one chain, driven to completion request by
//! request: what the zeroed-tail tests (`zeroed_tail.rs`, `zero_ahead.rs`) write and read
//! with; and where a compressed cluster's stream lies (`ring.rs`, `read_path.rs`,
//! `coherency.rs`); the persistent bitmaps an image holds (`crash_lifecycle.rs`,
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

/// Each bitmap of image `img`: its name, whether it is `in_use`, and its bits (one `bool`
/// per granule over `size` bytes).
pub fn bitmaps_of(img: &[u8], size: u64) -> Vec<(String, bool, Vec<bool>)> {
    use qcow2_engine::format::bitmaps::{parse_directory, TABLE_ALL_ONES, TABLE_OFFSET_MASK};
    let cs = 1usize << qcow2_engine::format::header::peek_cluster_bits(img).unwrap();
    let h = qcow2_engine::format::ImageHeader::decode(&img[..cs], img.len() as u64).unwrap();
    let ext = h.extensions.bitmaps.expect("the bitmaps extension");
    let at = |off: u64, len: usize| -> Vec<u8> {
        let mut b = vec![0u8; len];
        let from = (off as usize).min(img.len());
        let to = (off as usize + len).min(img.len());
        b[..to - from].copy_from_slice(&img[from..to]);
        b
    };
    let dir = at(ext.directory_offset, ext.directory_size as usize);
    let entries = parse_directory(&dir, ext.nb_bitmaps, cs as u64, size).unwrap();
    entries
        .iter()
        .map(|e| {
            let table = at(e.table_offset, e.table_size as usize * 8);
            let mut data = Vec::new();
            for t in table.chunks(8) {
                let t = u64::from_be_bytes(t.try_into().unwrap());
                match t & TABLE_OFFSET_MASK {
                    0 if t & TABLE_ALL_ONES != 0 => data.extend(vec![0xffu8; cs]),
                    0 => data.extend(vec![0u8; cs]),
                    off => data.extend(at(off, cs)),
                }
            }
            let granules = size.div_ceil(1 << e.granularity_bits) as usize;
            let bits = (0..granules)
                .map(|i| data[i / 8] >> (i % 8) & 1 == 1)
                .collect();
            (e.name.clone(), e.in_use(), bits)
        })
        .collect()
}
