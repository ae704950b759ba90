//! The RPC methods of the disk's life cycle, run while the bdev serves I/O:
//! `bdev_qcow2_resize`, `bdev_qcow2_snapshot_create`, `_delete`, `_list`. Each runs on the md thread, where the metadata owner does the
//! engine's part; the cores learn what changed through the state the owner publishes.

use crate::ffi::node::NodeKey;
use crate::ffi::rpc::{Params, Request, INVALID_PARAMS};
use crate::lifecycle_busy::Busy;
use crate::node::BLOCK_SIZE;
use crate::owner::Owner;
use crate::params::{ResizeParams, SnapshotListParams, SnapshotParams};
use crate::registry;
use crate::rpc::decode;
use crate::types::Registered;
use serde_json::json;

crate::rpc_entry!(bdev_qcow2_rpc_resize => resize);
crate::rpc_entry!(bdev_qcow2_rpc_snapshot_create => snapshot_create);
crate::rpc_entry!(bdev_qcow2_rpc_snapshot_delete => snapshot_delete);
crate::rpc_entry!(bdev_qcow2_rpc_snapshot_list => snapshot_list);

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
    let (node, owner) = match reg.writable(&p.name) {
        Ok(found) => found,
        Err((errno, msg)) => {
            drop(reg);
            return req.errno(errno, &msg);
        }
    };
    let Some(busy) = Busy::begin(&p.name) else {
        drop(reg);
        return req.errno(libc::EBUSY, &busy_msg(&p.name));
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
    let done = move |r: Result<u64, qcow2_engine::Error>| {
        let _busy = busy;
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
    };
    owner.run_job(move |chain| async move { done(chain.resize(size, true).await) });
}

/// Why a life-cycle RPC is refused while another runs on bdev `name`.
fn busy_msg(name: &str) -> String {
    format!("{name}: another life-cycle operation is running on it")
}

/// Runs `f` with the owner of the writable bdev `name` (on the md thread, the registry
/// locked), or answers `req` with why not.
fn with_owner(req: Request, name: &str, f: impl FnOnce(Request, NodeKey, &Owner)) {
    let reg = registry::lock();
    let (node, owner) = match reg.writable(name) {
        Ok(found) => found,
        Err((errno, msg)) => {
            drop(reg);
            return req.errno(errno, &msg);
        }
    };
    f(req, node.key(), owner);
}

/// Runs `f` with the owner of node `key` if it is still registered; `Err(req)` otherwise.
fn again(key: NodeKey, f: impl FnOnce(&Registered, &Owner)) -> bool {
    let reg = registry::lock();
    match reg.by_key(key).and_then(|n| n.owner_here().map(|o| (n, o))) {
        Some((n, o)) => {
            f(n, o);
            true
        }
        None => false,
    }
}

/// `bdev_qcow2_snapshot_create {name, snapshot}`: an internal snapshot of the disk while it
/// serves I/O. The dirty metadata is flushed first; then SPDK holds new requests back
/// until those in flight have completed (so no overwrite granted before the snapshot can
/// land in a cluster it shares), the snapshot is taken (one header switch; the new active
/// L1 entries reach the cores with their slices' epochs moved), and the requests go on. Answers the snapshot's id,
/// name and how long I/O paused (`pause_us`).
pub fn snapshot_create(req: Request, params: Params) {
    const METHOD: &str = "bdev_qcow2_snapshot_create";
    let Some((req, p)) = decode::<SnapshotParams>(req, params, METHOD) else {
        return;
    };
    let snapshot = p.snapshot.clone();
    let Some(busy) = Busy::begin(&p.name) else {
        return req.errno(libc::EBUSY, &busy_msg(&p.name));
    };
    with_owner(req, &p.name, move |req, key, owner| {
        let fail = |req: Request, e: i32, m: String| req.errno(e, &format!("{METHOD}: {m}"));
        owner.run_job(move |chain| async move {
            let _busy = busy;
            // Flushed outside the pause: the write-back inside it has little left to do.
            if let Err(e) = chain.flush().await {
                return fail(req, e.errno(), e.to_string());
            }
            let slot = std::rc::Rc::new(std::cell::Cell::new(Some(req)));
            let s2 = slot.clone();
            let found = again(key, move |node, _| {
                let t0 = std::time::Instant::now();
                node.quiesce(move |status| {
                    let Some(req) = s2.take() else { return };
                    if status != 0 {
                        return fail(req, -status, "SPDK could not quiesce the bdev".into());
                    }
                    let s3 = std::rc::Rc::new(std::cell::Cell::new(Some(req)));
                    let s4 = s3.clone();
                    let found = again(key, move |_, owner| {
                        owner.run_job(move |chain| async move {
                            let now = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .unwrap_or_default();
                            let when = qcow2_engine::SnapshotTime {
                                sec: now.as_secs() as u32,
                                nsec: now.subsec_nanos(),
                            };
                            let r = match chain.layers().first() {
                                Some(qcow2_engine::Layer::Qcow2(q)) => {
                                    q.snapshot_create(&snapshot, when).await
                                }
                                _ => Err(qcow2_engine::Error::ReadOnly),
                            };
                            let resumed = again(key, move |node, _| {
                                node.unquiesce(move |_| {
                                    let pause = t0.elapsed().as_micros() as u64;
                                    let Some(req) = s4.take() else { return };
                                    match r {
                                        Ok(sn) => {
                                            tracing::info!(
                                                "qcow2 snapshot {} ({}) taken; I/O paused {pause} us",
                                                sn.name,
                                                sn.id
                                            );
                                            req.result(&json!({
                                                "id": sn.id,
                                                "name": sn.name,
                                                "pause_us": pause,
                                            }))
                                        }
                                        Err(e) => fail(req, e.errno(), e.to_string()),
                                    }
                                });
                            });
                            if !resumed {
                                tracing::error!("{METHOD}: the bdev went away while quiesced");
                            }
                        });
                    });
                    if !found {
                        if let Some(req) = s3.take() {
                            fail(req, libc::ENODEV, "the bdev went away".into());
                        }
                    }
                });
            });
            if !found {
                if let Some(req) = slot.take() {
                    fail(req, libc::ENODEV, "the bdev went away".into());
                }
            }
        });
    });
}

/// `bdev_qcow2_snapshot_delete {name, snapshot}`: deletes the internal snapshot with that
/// id or name while the bdev serves I/O (no pause: cores holding a cluster as shared only
/// send their writes to the owner until they see its COPIED flag again). Answers `true`.
pub fn snapshot_delete(req: Request, params: Params) {
    const METHOD: &str = "bdev_qcow2_snapshot_delete";
    let Some((req, p)) = decode::<SnapshotParams>(req, params, METHOD) else {
        return;
    };
    let snapshot = p.snapshot.clone();
    let Some(busy) = Busy::begin(&p.name) else {
        return req.errno(libc::EBUSY, &busy_msg(&p.name));
    };
    with_owner(req, &p.name, move |req, _, owner| {
        owner.run_job(move |chain| async move {
            let _busy = busy;
            let r = match chain.layers().first() {
                Some(qcow2_engine::Layer::Qcow2(q)) => q.snapshot_delete(&snapshot).await,
                _ => Err(qcow2_engine::Error::ReadOnly),
            };
            match r {
                Ok(sn) => {
                    tracing::info!("qcow2 snapshot {} ({}) deleted", sn.name, sn.id);
                    req.result(&json!(true))
                }
                Err(e) => req.errno(e.errno(), &format!("{METHOD}: {e}")),
            }
        });
    });
}

/// `bdev_qcow2_snapshot_list {name}`: the internal snapshots, as `qemu-img snapshot -l`
/// knows them.
pub fn snapshot_list(req: Request, params: Params) {
    const METHOD: &str = "bdev_qcow2_snapshot_list";
    let Some((req, p)) = decode::<SnapshotListParams>(req, params, METHOD) else {
        return;
    };
    with_owner(req, &p.name, |req, _, owner| {
        let list: Vec<serde_json::Value> = owner
            .snapshots()
            .iter()
            .map(|s| {
                json!({
                    "id": s.id,
                    "name": s.name,
                    "date_sec": s.date_sec,
                    "date_nsec": s.date_nsec,
                    "vm_clock_nsec": s.vm_clock_nsec,
                    "vm_state_size": s.vm_state_size_large(),
                    "disk_size": s.disk_size(),
                })
            })
            .collect();
        req.result(&serde_json::Value::Array(list));
    });
}
