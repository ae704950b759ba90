//! The files a run reads and writes besides a given image: the sample image, the raw
//! baseline's scratch file, and the page cache they start from.

use super::args::PerfArgs;
use super::device::{open_dev, Dev};
use crate::host::{ToolError, ToolResult};
use crate::uring::AlignedBuf;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, DeviceOp, IoBuffer};
use qcow2_engine::{Chain, DevId, Exec, Layer, OpenOptions, Qcow2};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Creates an empty image at `path` (replacing what is there), formatted with `opts` (its
/// size included); returns the executor and device it is open on.
fn format_image(path: &Path, opts: &CreateOptions, a: &PerfArgs) -> ToolResult<(Exec<Dev>, DevId)> {
    std::fs::File::create(path).map_err(io_err(path))?;
    let exec: Exec<Dev> = Exec::new();
    let dev = exec.add_device(open_dev(path, true, a)?);
    let e2 = exec.clone();
    let o2 = opts.clone();
    exec.block_on(async move { create(&e2, dev, &o2).await })
        .map_err(engine_err(path))?;
    Ok((exec, dev))
}

/// Creates an empty image at `path` (`--fresh`): nothing written past its metadata.
pub(super) fn empty_image(path: &Path, opts: &CreateOptions, a: &PerfArgs) -> ToolResult<()> {
    format_image(path, opts, a).map(|_| ())
}

/// Creates a fully allocated sample image at `path`, formatted with `opts` (its size
/// included) and written in full by [`fill`].
pub(super) fn sample_image(path: &Path, opts: &CreateOptions, a: &PerfArgs) -> ToolResult<()> {
    let (exec, dev) = format_image(path, opts, a)?;
    let e2 = exec.clone();
    let q = exec
        .block_on(async move {
            Qcow2::open(
                &e2,
                dev,
                OpenOptions {
                    writable: true,
                    ..Default::default()
                },
            )
            .await
        })
        .map_err(engine_err(path))?;
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).map_err(engine_err(path))?;
    exec.block_on(fill(Fill::Image(chain), opts.size))
        .map_err(engine_err(path))
}

/// What [`fill`] writes: the sample image through the engine, or the raw file's device.
enum Fill {
    Image(Rc<Chain<Dev>>),
    Raw(Exec<Dev>, DevId),
}

/// Writes the whole disk front to back in 1 MiB requests, one at a time, then closes the
/// image or flushes the raw file. The sample image and the raw baseline's scratch file are both written so:
/// the same requests through the same device (O_DIRECT unless `--buffered`) into a file
/// grown sparsely ahead, as the file system lays out blocks differently for direct and
/// buffered writes, and random writes into the two layouts run at different rates.
async fn fill(to: Fill, size: u64) -> qcow2_engine::Result<()> {
    let b = AlignedBuf::new(1 << 20);
    b.fill(0, 1 << 20, 0xa5);
    let mut off = 0;
    while off < size {
        let n = (size - off).min(1 << 20) as usize;
        let buf = BufSlice {
            buf: b.clone(),
            off: 0,
            len: n,
        };
        match &to {
            Fill::Image(chain) => chain.write(off, buf).await?,
            Fill::Raw(exec, dev) => exec.write(*dev, off, buf).await?,
        }
        off += n as u64;
    }
    match to {
        Fill::Image(chain) => chain.close().await,
        Fill::Raw(exec, dev) => exec.io(dev, DeviceOp::Flush).await,
    }
}

/// Reads a file once so a buffered run starts with it in the page cache.
pub(super) fn warm_page_cache(p: &Path) -> ToolResult<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(p).map_err(|source| ToolError::Io {
        path: p.display().to_string(),
        source,
    })?;
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf).map_err(|source| ToolError::Io {
        path: p.display().to_string(),
        source,
    })? > 0
    {}
    Ok(())
}

/// A temporary file removed on drop.
pub(super) struct TempFile(pub(super) PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The raw baseline's file beside `image` (same file system).
fn raw_path(image: &Path) -> PathBuf {
    image.with_extension(format!("perf-raw-{}", std::process::id()))
}

/// Makes `p` an empty (sparse) file of `len` bytes, replacing what it held.
pub(super) fn sparse_file(p: &Path, len: u64) -> ToolResult<()> {
    let f = std::fs::File::create(p).map_err(io_err(p))?;
    f.set_len(len).map_err(io_err(p))
}

/// A raw file of `len` bytes beside `image`, empty (`--fresh`: a raw disk's first writes).
pub(super) fn raw_sparse(image: &Path, len: u64) -> ToolResult<TempFile> {
    let t = TempFile(raw_path(image));
    sparse_file(&t.0, len)?;
    Ok(t)
}

/// A raw file as large as the image's file, beside it (same file system), written in full
/// the way the sample image was ([`fill`]).
pub(super) fn raw_scratch(image: &Path, a: &PerfArgs) -> ToolResult<TempFile> {
    let len = std::fs::metadata(image)
        .map_err(io_err(image))?
        .len()
        .div_ceil(1 << 20)
        << 20;
    let p = raw_path(image);
    let t = TempFile(p.clone());
    // Sparse first, as the image's device grows its file ahead of its writes.
    sparse_file(&p, len)?;
    let exec: Exec<Dev> = Exec::new();
    let dev = exec.add_device(open_dev(&p, true, a)?);
    exec.block_on(fill(Fill::Raw(exec.clone(), dev), len))
        .map_err(engine_err(&p))?;
    Ok(t)
}

fn io_err(p: &Path) -> impl FnOnce(std::io::Error) -> ToolError {
    let path = p.display().to_string();
    move |source| ToolError::Io { path, source }
}

fn engine_err(p: &Path) -> impl FnOnce(qcow2_engine::Error) -> ToolError {
    let path = p.display().to_string();
    move |source| ToolError::Engine { path, source }
}

pub(super) fn tempdir() -> ToolResult<crate::TempDir> {
    crate::TempDir::new("qcow2-perf").map_err(|(path, source)| ToolError::Io {
        path: path.display().to_string(),
        source,
    })
}
