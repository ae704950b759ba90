//! A read-only image copied to other threads without reading it again
//! ([`ReadOnlySeed`]): what [`Qcow2::replica`] copies on one thread, made `Send`. A deep
//! chain's layers are opened once, where their bdev is created, and every other channel
//! builds its copy of each layer from the seed: a layer it never reads costs it no I/O and
//! no channel of its bdev (ARCHITECTURE.md §15, "Chains of qcow2 bdevs").

use super::role::ImageRole;
use super::{Luks, OpenOptions, Qcow2};
use crate::error::Result;
use crate::exec::{DevId, Exec};
use crate::format::{ImageHeader, L1Entry, L2Context, Snapshot};
use crate::io::BlockDevice;
use crate::types::Geometry;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// The validated header and tables of an image opened read-only, copied (`Send`).
#[derive(Debug, Clone)]
pub struct ReadOnlySeed {
    header: ImageHeader,
    geo: Geometry,
    ctx: L2Context,
    l1: Vec<L1Entry>,
    refcount_table: Vec<u64>,
    snapshots: Vec<Snapshot>,
    device_size: u64,
    luks: Option<Arc<Luks>>,
}

impl ReadOnlySeed {
    /// Bytes its tables hold (what each copy of the image holds of them too).
    pub fn table_bytes(&self) -> usize {
        (self.l1.len() + self.refcount_table.len()) * 8
    }
}

impl<D: BlockDevice> Qcow2<D> {
    /// What another thread builds a read-only copy of this image from
    /// ([`from_ro_seed`](Self::from_ro_seed)). Only for an image nobody writes while the
    /// copies live (a read-only bdev's, claimed read-only).
    pub fn ro_seed(&self) -> ReadOnlySeed {
        ReadOnlySeed {
            header: self.header.borrow().clone(),
            geo: self.geo,
            ctx: self.ctx.get(),
            l1: self.l1.borrow().clone(),
            refcount_table: self.refcount_table.borrow().clone(),
            snapshots: self.snapshots.borrow().clone(),
            device_size: self.device_size.get(),
            luks: self.luks.clone(),
        }
    }

    /// A read-only copy of the image `seed` was taken from, with empty caches sized by
    /// `opts`, doing I/O on `dev` through `exec`: nothing is read now. An encrypted image
    /// is unlocked afterwards ([`unlock_with`](Self::unlock_with)).
    pub fn from_ro_seed(
        seed: &ReadOnlySeed,
        exec: &Exec<D>,
        dev: DevId,
        opts: OpenOptions,
    ) -> Result<Self> {
        let caches = Self::new_caches(&seed.geo, seed.l1.len(), seed.refcount_table.len(), &opts)?;
        let data_dev = super::encryption::data_view(exec, dev, seed.luks.as_ref());
        Ok(Qcow2 {
            exec: exec.clone(),
            dev,
            data_dev,
            luks: seed.luks.clone(),
            decompressor: RefCell::default(),
            last_compressed: RefCell::default(),
            reuse_local: Cell::new(0),
            device_size: Cell::new(seed.device_size),
            header: RefCell::new(seed.header.clone()),
            geo: seed.geo,
            ctx: Cell::new(seed.ctx),
            l1: RefCell::new(seed.l1.clone()),
            refcount_table: RefCell::new(seed.refcount_table.clone()),
            snapshots: RefCell::new(seed.snapshots.clone()),
            memo: caches.memo,
            l2_cache: RefCell::new(caches.l2),
            rc_cache: RefCell::new(caches.rc),
            role: ImageRole::ReadOnly { shared: None },
            dirty_bitmaps: None,
        })
    }
}
