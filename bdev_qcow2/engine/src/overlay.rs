//! External snapshots (QEMU's `blockdev-snapshot-sync`): a new, empty image (the overlay)
//! whose backing file is the image it replaces as the top of a chain. The old image is
//! left as it is (flushed by its owner, `Chain::close`); this module only describes and
//! writes the overlay.

use crate::create::{create, CreateOptions};
use crate::error::Result;
use crate::exec::{DevId, Exec};
use crate::image::Qcow2;
use crate::io::{BlockDevice, BufSlice, IoBuffer};

/// The overlay's options for the image `top`: its virtual size and cluster size, compat
/// 1.1, backing file `backing_file` of format qcow2 (the name the host opens the old image
/// by again: in SPDK, the bdev that serves it), every other option at its default (as
/// QEMU makes the overlay of a snapshot).
pub fn overlay_options<D: BlockDevice>(top: &Qcow2<D>, backing_file: &str) -> CreateOptions {
    CreateOptions {
        size: top.size(),
        cluster_bits: top.header().header.cluster_bits,
        backing_file: Some(backing_file.to_owned()),
        backing_format: Some("qcow2".to_owned()),
        ..CreateOptions::default()
    }
}

/// Writes the overlay `opts` describes onto `dev` and flushes it. The device's first
/// cluster is zeroed and flushed first, so that until the new header lands (last, as
/// `create` writes it) the device holds no image at all — never an older image whose
/// tables the new ones half overwrote. A crash leaves either no image or the whole overlay.
pub async fn format_overlay<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    opts: &CreateOptions,
) -> Result<()> {
    opts.validate()?;
    let cs = 1usize << opts.cluster_bits;
    let buf = exec.alloc_buf(dev, cs);
    buf.copy_in(0, &vec![0u8; cs]);
    exec.write(dev, 0, BufSlice::whole(buf)).await?;
    exec.flush(dev).await?;
    create(exec, dev, opts).await
}
