//! `qcow2 snapshot`: lists, creates, deletes and applies internal snapshots, like
//! `qemu-img snapshot -l|-c|-d|-a`, in the snapshot table format QEMU reads and writes.

use super::info::{human_size, utc_date};
use super::ImageArgs;
use crate::host::{open_chain, open_single, Format, ToolError, ToolResult};
use qcow2_engine::format::Snapshot;
use qcow2_engine::{Layer, SnapshotTime};
use std::fmt::Write;

/// Arguments of `qcow2 snapshot`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("op").required(true)))]
pub struct SnapshotArgs {
    /// List the snapshots.
    #[arg(short = 'l', group = "op")]
    pub list: bool,
    /// Create a snapshot of this name.
    #[arg(short = 'c', group = "op", value_name = "SNAPSHOT")]
    pub create: Option<String>,
    /// Delete the snapshot of this id or name.
    #[arg(short = 'd', group = "op", value_name = "SNAPSHOT")]
    pub delete: Option<String>,
    /// Make the snapshot of this id or name the disk (its later changes are dropped).
    #[arg(short = 'a', group = "op", value_name = "SNAPSHOT")]
    pub apply: Option<String>,
    /// Quiet (accepted for qemu-img compatibility; nothing is printed but the list).
    #[arg(short = 'q')]
    pub quiet: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// The snapshot list as `qemu-img snapshot -l` prints it.
pub fn list_text(snaps: &[Snapshot]) -> String {
    let mut s = String::from("Snapshot list:\n");
    let _ = writeln!(
        s,
        "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}",
        "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"
    );
    for sn in snaps {
        let ns = sn.vm_clock_nsec;
        let secs = ns / 1_000_000_000;
        let clock = format!(
            "{:04}:{:02}:{:02}.{:03}",
            secs / 3600,
            secs / 60 % 60,
            secs % 60,
            ns / 1_000_000 % 1000
        );
        let icount = sn
            .icount()
            .map_or_else(|| "--".to_string(), |i| i.to_string());
        let _ = writeln!(
            s,
            "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}",
            sn.id,
            sn.name,
            human_size(sn.vm_state_size_large()),
            utc_date(u64::from(sn.date_sec)),
            clock,
            icount
        );
    }
    s
}

/// Runs `qcow2 snapshot`; returns the text to print.
pub fn run(args: &SnapshotArgs) -> ToolResult<String> {
    let mut spec = args.image.spec()?;
    if spec.format == Format::Raw {
        return Err(ToolError::Usage(
            "raw images have no snapshots (use -f qcow2)".into(),
        ));
    }
    if args.list {
        let (_exec, q) = open_single(&spec)?;
        let snaps = q.snapshots();
        return Ok(if snaps.is_empty() {
            String::new()
        } else {
            list_text(&snaps)
        });
    }
    spec.writable = true;
    let path = spec.path.display().to_string();
    let o = open_chain(&spec)?;
    let chain = o.chain.clone();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let when = SnapshotTime {
        sec: now.as_secs() as u32,
        nsec: now.subsec_nanos(),
    };
    let (create, delete, apply) = (args.create.clone(), args.delete.clone(), args.apply.clone());
    let r = o.exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = chain.layers().first() else {
            return Err(qcow2_engine::Error::ReadOnly);
        };
        let done = if let Some(name) = create {
            q.snapshot_create(&name, when).await.map(|_| ())
        } else if let Some(which) = delete {
            q.snapshot_delete(&which).await.map(|_| ())
        } else if let Some(which) = apply {
            chain.snapshot_apply(&which).await
        } else {
            Ok(())
        };
        let closed = chain.close().await;
        done.and(closed)
    });
    r.map_err(|source| match source {
        qcow2_engine::Error::Refused(msg) => ToolError::Usage(msg),
        source => ToolError::Engine { path, source },
    })?;
    Ok(String::new())
}
