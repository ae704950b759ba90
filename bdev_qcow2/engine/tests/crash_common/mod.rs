//! What the crash tests (`crash.rs`, `crash_lifecycle.rs`) build their images with.

#![allow(clippy::unwrap_used)] // test helpers may panic

use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::testing::MemDevice;
use qcow2_engine::{Chain, Error, Exec, Layer, OpenOptions, Qcow2};
use std::rc::Rc;

pub mod states;

/// The bytes of a new image made with `opts`.
pub fn new_image(opts: &CreateOptions) -> Vec<u8> {
    let exec = Exec::new();
    let dev = MemDevice::new(Vec::new());
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let o = opts.clone();
    exec.block_on(async move { create(&e2, id, &o).await })
        .unwrap();
    dev.contents()
}

/// The image on `dev` as a chain of one layer, with a small slice cache (so that slices
/// are evicted and re-read).
pub fn open(
    exec: &Exec<MemDevice>,
    dev: &MemDevice,
    writable: bool,
) -> Result<Rc<Chain<MemDevice>>, Error> {
    open_with(exec, dev, writable, false)
}

/// [`open`], zeroing the device ahead of the allocator (`OpenOptions::zero_ahead`) with
/// `zero_ahead`, clusters then appended as first written (no data regions).
pub fn open_with(
    exec: &Exec<MemDevice>,
    dev: &MemDevice,
    writable: bool,
    zero_ahead: bool,
) -> Result<Rc<Chain<MemDevice>>, Error> {
    let opts = OpenOptions {
        writable,
        l2_cache_bytes: Some(8 << 10),
        // On a fixed-size device: data in per-slice regions.
        ordered_layout: dev.0.borrow().fixed && !zero_ahead,
        zero_ahead,
        // Every freed cluster discarded, on a device that discards.
        pass_discard_other: true,
        ..Default::default()
    };
    open_opts(exec, dev, opts)
}

/// The image on `dev` as a chain of one layer, opened with `opts`.
pub fn open_opts(
    exec: &Exec<MemDevice>,
    dev: &MemDevice,
    opts: OpenOptions,
) -> Result<Rc<Chain<MemDevice>>, Error> {
    let id = exec.add_device(dev.clone());
    let e2 = exec.clone();
    let q = exec.block_on(async move { Qcow2::open(&e2, id, opts).await })?;
    Chain::new(exec, vec![Layer::Qcow2(Box::new(q))])
}
