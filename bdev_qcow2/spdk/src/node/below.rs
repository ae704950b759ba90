//! A deep chain of qcow2 bdevs read as one engine chain (ARCHITECTURE.md §15, "Chains of
//! qcow2 bdevs"). An overlay whose backing bdev is a read-only qcow2 bdev of ours, itself
//! over another one, would otherwise read a cluster only a deep layer holds with one bdev
//! I/O per layer (each bdev looks it up in its own image and asks its backing bdev). Here
//! the overlay opens the base bdev of every read-only qcow2 bdev below it, down to the first
//! backing bdev that is not one (the raw bottom), and each of its channels reads them as
//! layers of its own chain: the engine's layer index (§5) sends a read straight to the layer
//! that holds it.
//!
//! Each layer's base bdev is claimed `READ_MANY_WRITE_NONE` (the claim the read-only bdev
//! over it holds too), so no writer appears under the overlay even if that bdev is deleted.

use super::hotplug::BaseEvents;
use super::open;
use crate::device::SpdkDevice;
use crate::ffi::bdev::OpenMode;
use crate::registry::Registry;
use qcow2_engine::image::UnlockedKey;
use qcow2_engine::limits::MAX_BACKING_DEPTH;
use qcow2_engine::{DevId, Exec, Layer, OpenOptions, Qcow2, ReadOnlySeed};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// The layers under the top once their images are open (`None`: still opening).
pub type OpenedBelow = Rc<RefCell<Option<qcow2_engine::Result<Vec<Layer<SpdkDevice>>>>>>;

/// Where the layers' opens put their images, and how many are still opening.
struct Opening {
    images: Vec<Option<Qcow2<SpdkDevice>>>,
    left: usize,
    failed: Option<qcow2_engine::Error>,
    bottom: Option<(DevId, u64)>,
}

impl Opening {
    /// The layers, top first, the raw bottom last; or the first error.
    fn finish(&mut self) -> qcow2_engine::Result<Vec<Layer<SpdkDevice>>> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let mut layers: Vec<_> = self
            .images
            .drain(..)
            .flatten()
            .map(|q| Layer::Qcow2(Box::new(q)))
            .collect();
        if let Some((dev, size)) = self.bottom {
            layers.push(Layer::Raw { dev, size });
        }
        Ok(layers)
    }
}

/// One qcow2 layer below the top: its base bdev, opened here, and how to open its image.
pub struct LayerSrc {
    /// The base bdev of the read-only qcow2 bdev (holding its image).
    pub desc: crate::ffi::bdev::Desc,
    /// The engine options that bdev opens its image with.
    pub opts: OpenOptions,
    /// The key its image was unlocked with, if it is encrypted.
    pub key: Option<UnlockedKey>,
    /// Its image as that bdev's creation opened it: copied, not read again, and the layer's
    /// bdev channel taken only when a read reaches the layer (`None`: opened by reading).
    pub seed: Option<Arc<ReadOnlySeed>>,
}

/// The layers below an overlay, top first, and the raw bottom, if any.
pub struct Below {
    layers: Vec<LayerSrc>,
    bottom: Option<crate::ffi::bdev::Desc>,
    /// The names of every bdev opened here (for their removal events).
    names: Vec<String>,
}

/// One qcow2 bdev of the chain as the registry has it.
struct Link {
    base: String,
    opts: OpenOptions,
    key: Option<UnlockedKey>,
    seed: Option<Arc<ReadOnlySeed>>,
    /// Its backing bdev (`None`: its image has none, or a stream dropped it).
    backing: Option<String>,
}

/// The read-only qcow2 bdev `name` whose backing bdev is present (`None`: not one).
fn link(reg: &Registry, name: &str) -> Option<Link> {
    let n = reg.node(name)?.node();
    if n.writable()
        || n.backing_phase()
            .is_some_and(|p| !matches!(p, crate::backing_state::Phase::Present))
    {
        return None;
    }
    let p = n.saved_params();
    Some(Link {
        base: p.base_bdev.clone(),
        opts: OpenOptions {
            writable: false,
            ..p.open_options()
        },
        key: n.key(),
        seed: n.ro_seed(),
        backing: p.backing_bdev,
    })
}

/// Whether bdev `name` is a read-only qcow2 bdev whose backing bdev is present.
pub fn is_link(reg: &Registry, name: &str) -> bool {
    link(reg, name).is_some()
}

impl Below {
    /// The chain under backing bdev `backing`, opened and claimed on this thread (the
    /// node's md thread), when it is a read-only qcow2 bdev over another one; `Ok(None)`
    /// when it is not (one hop costs what a raw backing bdev does: it keeps its shared
    /// read cache, §15). Refuses loops and chains deeper than the engine's bound.
    pub fn resolve(reg: &Registry, backing: &str) -> Result<Option<Below>, (i32, String)> {
        let Some(first) = link(reg, backing) else {
            return Ok(None);
        };
        match first.backing.as_deref() {
            Some(b) if link(reg, b).is_some() => {}
            _ => return Ok(None),
        }
        let mut chain = vec![first];
        let mut seen = vec![backing.to_string()];
        let mut bottom = None;
        while let Some(next) = chain.last().and_then(|l| l.backing.clone()) {
            if seen.contains(&next) {
                return Err((libc::ELOOP, format!("backing chain loops at bdev {next}")));
            }
            // The top and every layer below it count.
            if chain.len() + 2 > MAX_BACKING_DEPTH {
                let m = format!(
                    "backing chain under {backing} is deeper than {MAX_BACKING_DEPTH} images"
                );
                return Err((libc::E2BIG, m));
            }
            match link(reg, &next) {
                Some(l) => {
                    seen.push(next);
                    chain.push(l);
                }
                None => {
                    bottom = Some(next);
                    break;
                }
            }
        }
        let mut below = Below {
            layers: Vec::with_capacity(chain.len()),
            bottom: None,
            names: Vec::with_capacity(chain.len() + 1),
        };
        for l in chain {
            match open::open_claimed::<BaseEvents>(&l.base, "layer", OpenMode::ReadOnly) {
                Ok(desc) => below.layers.push(LayerSrc {
                    desc,
                    opts: l.opts,
                    key: l.key,
                    seed: l.seed,
                }),
                Err(e) => return Err(e),
            }
            below.names.push(l.base);
        }
        if let Some(b) = bottom {
            match open::open_claimed::<BaseEvents>(&b, "backing", OpenMode::ReadOnly) {
                Ok(d) => below.bottom = Some(d),
                Err(e) => return Err(e),
            }
            below.names.push(b);
        }
        Ok(Some(below))
    }

    /// The qcow2 layers, top first.
    pub fn layers(&self) -> &[LayerSrc] {
        &self.layers
    }

    /// The raw bottom, if any.
    pub fn bottom(&self) -> Option<&crate::ffi::bdev::Desc> {
        self.bottom.as_ref()
    }

    /// Whether bdev `name` is one of those opened here.
    pub fn reads(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Layers in all (the qcow2 ones and the bottom).
    pub fn depth(&self) -> usize {
        self.layers.len() + usize::from(self.bottom.is_some())
    }

    /// Adds a device of each layer (and of the bottom) to `exec`, this thread's, and starts
    /// opening the layers' images there, all at once; `out` gets them once all are open.
    /// A layer with a seed is copied from it, and its device takes the bdev's channel on
    /// first use: a layer nothing reads here holds no channel on this thread (an AIO bdev's
    /// channel is a kernel AIO context, which SPDK polls on every pass of the thread, and
    /// whose `io_destroy` stalls the thread for an RCU grace period). Returns the devices
    /// (they leave with the backing bdev); `None`: SPDK gave no I/O channel.
    pub fn open(&self, exec: &Exec<SpdkDevice>, out: &OpenedBelow) -> Option<Vec<DevId>> {
        let mut devs = Vec::with_capacity(self.depth());
        for l in &self.layers {
            let d = match l.seed {
                Some(_) => crate::device::open_layer_lazy(&l.desc),
                None => crate::device::open_layer(&l.desc)?,
            };
            devs.push(exec.add_device(d));
        }
        if let Some(b) = self.bottom() {
            devs.push(exec.add_device(crate::device::open_layer(b)?));
        }
        let n = self.layers.len();
        let bottom = self
            .bottom
            .as_ref()
            .map(|_| (devs[n], exec.device_size(devs[n])));
        let state = Rc::new(RefCell::new(Opening {
            images: (0..n).map(|_| None).collect(),
            left: n,
            failed: None,
            bottom,
        }));
        if n == 0 {
            *out.borrow_mut() = Some(state.borrow_mut().finish());
        }
        for (i, l) in self.layers.iter().enumerate() {
            let (e2, st, out) = (exec.clone(), state.clone(), out.clone());
            let (dev, opts, key, seed) = (devs[i], l.opts, l.key.clone(), l.seed.clone());
            exec.spawn(async move {
                let q = match seed {
                    Some(s) => Qcow2::from_ro_seed(&s, &e2, dev, opts),
                    None => Qcow2::open(&e2, dev, opts).await,
                };
                let r = q.and_then(|q| {
                    if let Some(k) = &key {
                        q.unlock_with(k)?;
                    }
                    Ok(q)
                });
                let mut s = st.borrow_mut();
                match r {
                    Ok(q) => s.images[i] = Some(q),
                    Err(e) => {
                        s.failed.get_or_insert(e);
                    }
                }
                s.left -= 1;
                if s.left == 0 {
                    *out.borrow_mut() = Some(s.finish());
                }
            });
        }
        Some(devs)
    }

    /// Closes every descriptor (on the thread that opened them, once nothing reads them).
    pub fn close(self) {
        drop(self);
    }
}

/// Dropped where it was opened, the md thread, once nothing reads the layers (teardown,
/// a backing bdev that left, a creation that failed): the descriptors close.
impl Drop for Below {
    fn drop(&mut self) {
        for l in std::mem::take(&mut self.layers) {
            l.desc.close();
        }
        if let Some(b) = self.bottom.take() {
            b.close();
        }
    }
}

impl super::Node {
    /// The key the image was unlocked with, if it is encrypted (a deep chain above opens
    /// the image as one of its layers with it).
    pub fn key(&self) -> Option<UnlockedKey> {
        self.current().key.clone()
    }

    /// Read-only bdev: its image as its creation opened it, to copy (`Image::ro_seed`).
    pub fn ro_seed(&self) -> Option<Arc<ReadOnlySeed>> {
        self.current().ro_seed.clone()
    }

    /// Whether channels read a deep chain's layers under the backing bdev, and how many.
    pub fn below_depth(&self) -> Option<usize> {
        self.below
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Below::depth)
    }

    /// Whether bdev `name` is one of the layers (or the bottom) read under the backing
    /// bdev: its removal makes the node leave the backing bdev as a whole.
    pub fn below_reads(&self, name: &str) -> bool {
        self.below
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|b| b.reads(name))
    }

    /// The node was made to read a deep chain's layers: a removed backing bdev is not read
    /// again when a bdev of its name returns (the layers under it may be others).
    pub fn flattened(&self) -> bool {
        self.flattened
    }

    /// Takes the layers' descriptors out, to be closed on the md thread once no channel
    /// reads them; channels built from now on read none.
    pub fn take_below(&self) -> Option<Below> {
        self.below_on
            .store(false, std::sync::atomic::Ordering::Release);
        self.below.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}
