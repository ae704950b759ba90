//! The RPC methods of the disk's life cycle, run while the bdev serves I/O:
//! `bdev_qcow2_resize`. Each runs on the md thread, where the metadata owner does the
//! engine's part; the cores learn what changed through the state the owner publishes.

use crate::ffi::rpc::{Params, Request, INVALID_PARAMS};
use crate::node::BLOCK_SIZE;
use crate::params::ResizeParams;
use crate::registry;
use crate::rpc::decode;
use serde_json::json;

/// `bdev_qcow2_resize {name, size}`: grows the image (and tells SPDK, which tells every
/// descriptor), or shrinks it when the range cut off holds no data and nobody has the bdev
/// open (SPDK refuses to shrink an open bdev). Answers `true`.
pub fn resize(req: Request, params: Params) {
    const METHOD: &str = "bdev_qcow2_resize";
    let Some((req, p)) = decode::<ResizeParams>(req, params, METHOD) else {
        return;
    };
    let block = u64::from(BLOCK_SIZE);
    if p.size == 0 || !p.size.is_multiple_of(block) {
        return req.error(
            INVALID_PARAMS,
            &format!("{METHOD}: size must be a positive multiple of {block}"),
        );
    }
    let reg = registry::lock();
    let Some(node) = reg.node(&p.name) else {
        drop(reg);
        return req.errno(libc::ENODEV, &format!("no qcow2 bdev named {}", p.name));
    };
    let Some(owner) = node.owner_here() else {
        drop(reg);
        return req.errno(
            libc::EROFS,
            &format!(
                "{}: read-only, or this RPC does not run on its md thread",
                p.name
            ),
        );
    };
    let old = owner.size();
    let key = node.key();
    if p.size < old {
        // SPDK first, so that nothing reaches the range once the engine gives it up.
        if let Err(e) = node.notify_blockcnt_change(p.size / block) {
            drop(reg);
            return req.errno(
                e,
                &format!(
                    "{}: SPDK refused to shrink the bdev ({}): it is open",
                    p.name,
                    std::io::Error::from_raw_os_error(e)
                ),
            );
        }
    }
    let (name, size) = (p.name, p.size);
    owner.resize(size, true, move |r| {
        let reg = registry::lock();
        let node = reg.by_key(key);
        match r {
            Ok(_) => {
                if size > old {
                    // The cores take the new size from the owner when a request reaches
                    // past the one they know, so SPDK may send such requests from now on.
                    if let Some(Err(e)) = node.map(|n| n.notify_blockcnt_change(size / block)) {
                        drop(reg);
                        return req.errno(
                            e,
                            &format!("{name}: resized, but SPDK refused the new size"),
                        );
                    }
                }
                drop(reg);
                tracing::info!("qcow2 bdev {name} resized from {old} to {size} bytes");
                req.result(&json!(true));
            }
            Err(e) => {
                if size < old {
                    if let Some(n) = node {
                        let _ = n.notify_blockcnt_change(old / block);
                    }
                }
                drop(reg);
                req.errno(e.errno(), &format!("{METHOD} {name}: {e}"));
            }
        }
    });
}
