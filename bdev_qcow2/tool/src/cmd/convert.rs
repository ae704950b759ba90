//! `qcow2 convert -O raw`: reads the whole virtual disk through the engine into a raw file.
//!
//! Reads are pipelined (several chunks in flight through the engine's read path); chunks
//! that read as all zeros are left as holes in the output, like `qemu-img convert`.

use super::ImageArgs;
use crate::host::{open_chain, ToolError, ToolResult};
use crate::uring::{AlignedBuf, UringDevice};
use qcow2_engine::io::{BufSlice, DeviceOp};

/// Tag bit marking output writes (read tags are slot numbers).
const WRITE_TAG: u64 = 1 << 63;
use std::path::PathBuf;

/// Output formats of `convert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutFormat {
    /// A raw disk image.
    Raw,
}

/// Arguments of `qcow2 convert`.
#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Output format.
    #[arg(short = 'O', value_enum, default_value = "raw")]
    pub out_format: OutFormat,
    /// Bytes per read request.
    #[arg(long, value_parser = crate::parse_size, default_value = "1M")]
    pub chunk_size: u64,
    /// Read requests in flight.
    #[arg(long, default_value_t = 8)]
    pub queue_depth: usize,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
    /// The output file (created or truncated).
    pub output: PathBuf,
}

/// Runs `qcow2 convert`.
pub fn run(args: &ConvertArgs) -> ToolResult<String> {
    if args.chunk_size == 0 || !args.chunk_size.is_multiple_of(512) {
        return Err(ToolError::Usage(
            "--chunk-size must be a positive multiple of 512".into(),
        ));
    }
    let o = open_chain(&args.image.spec()?)?;
    let size = o.chain.size();
    let io_err = |source| ToolError::Io {
        path: args.output.display().to_string(),
        source,
    };
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&args.output)
        .map_err(io_err)?;
    out.set_len(size).map_err(io_err)?;

    drop(out);
    // Output writes go through io_uring too, so they overlap with reads (the kernel copies
    // into the page cache on its own workers) instead of stalling the polling loop.
    let out_dev = UringDevice::open(&args.output, true, false, 64).map_err(io_err)?;
    let out_id = o.exec.add_device(out_dev);

    let depth = args.queue_depth.max(1);
    let chunk = args.chunk_size as usize;
    let bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(chunk)).collect();
    // Per slot: the guest offset and length being read or written, if any.
    let mut slots: Vec<Option<(u64, usize)>> = vec![None; depth];
    let mut next = 0u64;
    let mut done: Vec<(u64, qcow2_engine::Result<()>)> = Vec::with_capacity(depth);
    loop {
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_none() && next < size {
                let len = (size - next).min(chunk as u64) as usize;
                *slot = Some((next, len));
                let buf = BufSlice {
                    buf: bufs[i].clone(),
                    off: 0,
                    len,
                };
                o.chain.submit_read(i as u64, next, buf);
                next += len as u64;
            }
        }
        if slots.iter().all(Option::is_none) {
            break;
        }
        o.exec.poll(&mut |tag, r| done.push((tag, r)));
        for (tag, r) in done.drain(..) {
            let i = (tag & !WRITE_TAG) as usize;
            if tag & WRITE_TAG != 0 {
                slots[i] = None;
                r.map_err(|source| ToolError::Engine {
                    path: args.output.display().to_string(),
                    source,
                })?;
                continue;
            }
            let Some((off, len)) = slots[i] else { continue };
            r.map_err(|source| ToolError::Engine {
                path: args.image.image.display().to_string(),
                source,
            })?;
            if bufs[i].is_zero(0, len) {
                // Leave a hole, like qemu-img.
                slots[i] = None;
                continue;
            }
            let req = o.exec.request_begin(WRITE_TAG | i as u64);
            let buf = BufSlice {
                buf: bufs[i].clone(),
                off: 0,
                len,
            };
            o.exec
                .request_op(req, out_id, DeviceOp::Write { offset: off, buf });
            o.exec.request_arm(req);
        }
    }
    // Like `qemu-img convert`, the output is not fsync()ed (run `sync` if it must be durable).
    Ok(String::new())
}
