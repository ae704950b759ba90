//! The files a run reads and writes besides a given image: the sample image, the raw
//! baseline's scratch file, and the page cache they start from.

use super::args::PerfArgs;
use super::device::{open_dev, Dev};
use crate::host::{ToolError, ToolResult};
use crate::uring::AlignedBuf;
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::io::{BufSlice, IoBuffer};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2};
use std::path::{Path, PathBuf};

/// Creates a fully allocated sample image of `size` bytes at `path`.
pub(super) fn sample_image(path: &Path, size: u64, a: &PerfArgs) -> ToolResult<()> {
    std::fs::File::create(path).map_err(|source| ToolError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let exec: Exec<Dev> = Exec::new();
    let dev = exec.add_device(open_dev(path, true, a)?);
    let e2 = exec.clone();
    let err = |source| ToolError::Engine {
        path: path.display().to_string(),
        source,
    };
    exec.block_on(async move {
        create(
            &e2,
            dev,
            &CreateOptions {
                size,
                ..Default::default()
            },
        )
        .await
    })
    .map_err(err)?;
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
        .map_err(err)?;
    let chain = Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).map_err(err)?;
    exec.block_on(async move {
        let b = AlignedBuf::new(1 << 20);
        b.fill(0, 1 << 20, 0xa5);
        let mut off = 0;
        while off < size {
            let n = (size - off).min(1 << 20) as usize;
            chain
                .write(
                    off,
                    BufSlice {
                        buf: b.clone(),
                        off: 0,
                        len: n,
                    },
                )
                .await?;
            off += n as u64;
        }
        chain.close().await
    })
    .map_err(err)
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

/// A raw file as large as the image's file, beside it (same file system), fully written.
pub(super) fn raw_scratch(image: &Path) -> ToolResult<TempFile> {
    use std::io::Write;
    let io_err = |p: &Path| {
        let p = p.display().to_string();
        move |source| ToolError::Io { path: p, source }
    };
    let len = std::fs::metadata(image)
        .map_err(io_err(image))?
        .len()
        .div_ceil(1 << 20)
        << 20;
    let p = image.with_extension(format!("perf-raw-{}", std::process::id()));
    let t = TempFile(p.clone());
    let mut f = std::fs::File::create(&p).map_err(io_err(&p))?;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..(len >> 20) {
        f.write_all(&chunk).map_err(io_err(&p))?;
    }
    f.sync_all().map_err(io_err(&p))?;
    Ok(t)
}

pub(super) fn tempdir() -> ToolResult<crate::TempDir> {
    crate::TempDir::new("qcow2-perf").map_err(|(path, source)| ToolError::Io {
        path: path.display().to_string(),
        source,
    })
}
