//! `qcow2 convert`: copies the virtual disk (the whole backing chain, flattened) into a new
//! image.
//!
//! `-O raw`: reads are pipelined (several chunks in flight through the engine's read path);
//! chunks that read as all zeros are left as holes in the output, like `qemu-img convert`.
//!
//! `-O qcow2`: the output is created by the engine (`-o` as for `qcow2 create`) and written
//! through the engine's write path. Only allocated data is copied: the source's block status
//! (through its backing chain) skips unallocated and zero ranges, and output clusters that
//! read as all zeros are skipped too, so they stay unallocated. With `-c` every cluster is
//! written compressed (see `qcow2_engine::compressed_write`). Several chunks are copied
//! at once (`--queue-depth` tasks).

use super::ImageArgs;
use crate::host::{open_chain, ToolError, ToolResult};
use crate::lock::Access;
use crate::progress::Progress;
use crate::uring::{AlignedBuf, OpenMode, UringDevice};
use qcow2_engine::io::{BufSlice, DeviceOp};
use qcow2_engine::{Op, Request};

/// Tag bit marking output writes (read tags are slot numbers).
const WRITE_TAG: u64 = 1 << 63;
use std::path::PathBuf;

/// Output formats of `convert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutFormat {
    /// A raw disk image.
    Raw,
    /// A qcow2 image, created with the `-o` options.
    Qcow2,
}

/// Arguments of `qcow2 convert`.
#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Output format.
    #[arg(short = 'O', value_enum, default_value = "raw")]
    pub out_format: OutFormat,
    /// Options of the new qcow2 image, as for `qcow2 create -o` (repeatable).
    #[arg(short = 'o')]
    pub options: Vec<String>,
    /// Write compressed clusters (qcow2 output).
    #[arg(short = 'c')]
    pub compress: bool,
    /// Show progress on stdout, like qemu-img's "(xx.xx/100%)" lines.
    #[arg(short = 'p')]
    pub progress: bool,
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
    if args.out_format == OutFormat::Qcow2 {
        return qcow2_out::run(args);
    }
    if args.compress || !args.options.is_empty() {
        return Err(ToolError::Usage(
            "-c and -o need -O qcow2 (raw output has no options)".into(),
        ));
    }
    let o = open_chain(&args.image.spec()?)?;
    let size = o.chain.size();
    let io_err = |source| ToolError::Io {
        path: args.output.display().to_string(),
        source,
    };
    crate::cmd::create::create_file(&args.output, size)?;
    // Output writes go through io_uring too, so they overlap with reads (the kernel copies
    // into the page cache on its own workers) instead of stalling the polling loop.
    let mut out_dev = UringDevice::open(
        &args.output,
        OpenMode {
            writable: true,
            direct: false,
        },
        64,
    )
    .map_err(io_err)?;
    crate::host::lock_device(&mut out_dev, &args.output, Access::WriteRaw)?;
    let out_id = o.exec.add_device(out_dev);

    let depth = args.queue_depth.max(1);
    let chunk = args.chunk_size as usize;
    let bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(chunk)).collect();
    // Per slot: the guest offset and length being read or written, if any.
    let mut slots: Vec<Option<(u64, usize)>> = vec![None; depth];
    let mut next = 0u64;
    let mut done: Vec<(u64, qcow2_engine::Result<()>)> = Vec::with_capacity(depth);
    let mut progress = Progress::new(args.progress);
    progress.set(0.0);
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
                let req = Request::new(Op::Read, next, len as u64);
                crate::host::submit(&o.chain, i as u64, req, buf);
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
                if let Some((_, len)) = slots[i].take() {
                    progress.advance(len as u64, size);
                }
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
                progress.advance(len as u64, size);
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
    progress.set(100.0);
    progress.finish();
    // Like `qemu-img convert`, the output is not fsync()ed (run `sync` if it must be durable).
    Ok(String::new())
}

mod qcow2_out {
    //! `convert -O qcow2`.

    use super::ConvertArgs;
    use crate::cmd::create::{format_image, FormatOptions};
    use crate::cmd::CacheMode;
    use crate::host::{open_chain, ToolError, ToolResult};
    use crate::progress::Progress;
    use crate::uring::{AlignedBuf, OpenMode, UringDevice};
    use qcow2_engine::format::ClusterMapping;
    use qcow2_engine::io::{BlockDevice, BufSlice};
    use qcow2_engine::{Chain, Layer, OpenOptions};
    use std::cell::Cell;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Whether guest bytes at `pos` hold data somewhere in the chain (`true`), or read as
    /// zeros without any data (`false`); and how many bytes from `pos` share that answer.
    async fn status<D: BlockDevice>(
        chain: &Chain<D>,
        pos: u64,
        end: u64,
    ) -> qcow2_engine::Result<(bool, u64)> {
        let layers = chain.layers();
        let (mut idx, mut end) = (0, end);
        loop {
            if let Layer::Raw { .. } = layers[idx] {
                // Raw layers are all data; zero chunks are found by reading.
                return Ok((true, end - pos));
            }
            let (m, n) = chain.block_status(idx, pos, end).await?;
            if n == 0 {
                return Err(qcow2_engine::Error::InvalidRequest(
                    "block status made no progress",
                ));
            }
            match m {
                ClusterMapping::Data { .. } | ClusterMapping::Compressed(_) => {
                    return Ok((true, n))
                }
                ClusterMapping::Zero { .. } => return Ok((false, n)),
                ClusterMapping::Unallocated { .. } => {
                    if idx + 1 < layers.len() && pos < layers[idx + 1].size() {
                        end = (pos + n).min(layers[idx + 1].size());
                        idx += 1;
                        continue;
                    }
                    return Ok((false, n));
                }
            }
        }
    }

    /// Which image an error came from.
    #[derive(Debug, Clone, Copy)]
    enum Side {
        Source,
        Output,
    }

    type SideResult<T> = Result<T, (Side, qcow2_engine::Error)>;

    fn on_src<T>(r: qcow2_engine::Result<T>) -> SideResult<T> {
        r.map_err(|e| (Side::Source, e))
    }

    fn on_dst<T>(r: qcow2_engine::Result<T>) -> SideResult<T> {
        r.map_err(|e| (Side::Output, e))
    }

    /// Copies guest bytes `[start, end)` (cluster-aligned, except at the end of the disk).
    async fn copy_chunk(
        src: Rc<Chain<UringDevice>>,
        dst: Rc<Chain<UringDevice>>,
        buf: AlignedBuf,
        start: u64,
        end: u64,
        cluster: u64,
        compress: bool,
    ) -> SideResult<()> {
        // Output clusters touched by data in the source.
        let n = (end - start).div_ceil(cluster) as usize;
        let mut touched = vec![false; n];
        let mut pos = start;
        while pos < end {
            let (data, len) = on_src(status(&src, pos, end).await)?;
            if data {
                let a = ((pos - start) / cluster) as usize;
                let b = ((pos + len - start).div_ceil(cluster)) as usize;
                touched[a..b].iter_mut().for_each(|t| *t = true);
            }
            pos += len;
        }
        let mut i = 0;
        while i < n {
            if !touched[i] {
                i += 1;
                continue;
            }
            let mut j = i;
            while j < n && touched[j] {
                j += 1;
            }
            // Read the run [i, j) of output clusters.
            let a = start + i as u64 * cluster;
            let b = (start + j as u64 * cluster).min(end);
            let rbuf = BufSlice {
                buf: buf.clone(),
                off: 0,
                len: (b - a) as usize,
            };
            on_src(src.read(a, rbuf).await)?;
            // Write every non-zero cluster; runs of them in one request (uncompressed).
            let mut k = a;
            while k < b {
                let ce = (k + cluster).min(b);
                let boff = (k - a) as usize;
                if buf.is_zero(boff, (ce - k) as usize) {
                    k = ce;
                    continue;
                }
                if compress {
                    let data = buf.to_vec(boff, (ce - k) as usize);
                    on_dst(dst.write_compressed(k, &data).await)?;
                    k = ce;
                    continue;
                }
                let mut we = ce;
                while we < b {
                    let ne = (we + cluster).min(b);
                    if buf.is_zero((we - a) as usize, (ne - we) as usize) {
                        break;
                    }
                    we = ne;
                }
                let w = BufSlice {
                    buf: buf.clone(),
                    off: boff,
                    len: (we - k) as usize,
                };
                on_dst(dst.write(k, w).await)?;
                k = we;
            }
            i = j;
        }
        Ok(())
    }

    /// Awaits every future concurrently and returns their results in order.
    async fn futures_all<F: std::future::Future<Output = SideResult<()>>>(
        futs: Vec<F>,
    ) -> Vec<SideResult<()>> {
        let mut futs: Vec<_> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
        let mut results: Vec<Option<SideResult<()>>> = futs.iter().map(|_| None).collect();
        std::future::poll_fn(move |cx| {
            let mut pending = false;
            for (slot, res) in futs.iter_mut().zip(results.iter_mut()) {
                if let Some(f) = slot {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(r) => {
                            *res = Some(r);
                            *slot = None;
                        }
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(results.drain(..).map(|r| r.unwrap_or(Ok(()))).collect())
            }
        })
        .await
    }

    /// Runs `convert -O qcow2`.
    pub fn run(args: &ConvertArgs) -> ToolResult<String> {
        let mut fo = FormatOptions::default();
        for o in &args.options {
            fo.apply(o)?;
        }
        if fo.create.backing_file.is_some() {
            return Err(ToolError::Usage(
                "convert -O qcow2 writes a standalone image: backing_file is not supported".into(),
            ));
        }
        fo.validate()?;
        if args.compress && fo.encrypt.encrypted() {
            return Err(ToolError::Usage(
                "Compression is not supported with encryption (as qemu-img)".into(),
            ));
        }
        let secrets =
            crate::secrets::parse_objects(&args.image.objects).map_err(ToolError::Usage)?;
        let spec = args.image.spec()?;
        let o = open_chain(&spec)?;
        let size = o.chain.size();
        if !size.is_multiple_of(512) {
            return Err(ToolError::Usage(format!(
                "{}: size {size} is not a multiple of 512 bytes",
                args.image.image.display()
            )));
        }
        fo.create.size = size;
        let key = match fo.encrypt.build(&secrets)? {
            Some((area, key)) => {
                fo.create.encryption = Some(area);
                Some(key)
            }
            None => None,
        };
        format_image(&args.output, &fo.create)?;
        let out_err = |source| ToolError::Engine {
            path: args.output.display().to_string(),
            source,
        };
        let direct = args.image.cache == CacheMode::None;
        let mut dev = UringDevice::open(
            &args.output,
            OpenMode {
                writable: true,
                direct,
            },
            64,
        )
        .map_err(|source| ToolError::Io {
            path: args.output.display().to_string(),
            source,
        })?;
        crate::host::lock_device(&mut dev, &args.output, crate::lock::Access::Write)?;
        let id = o.exec.add_device(dev);
        let e2 = o.exec.clone();
        let q = o
            .exec
            .block_on(async move {
                let opts = OpenOptions {
                    writable: true,
                    ..OpenOptions::default()
                };
                crate::host::open_qcow2(e2, id, opts, key, true).await
            })
            .map_err(out_err)?;
        let dst = Chain::new(&o.exec, vec![Layer::Qcow2(Box::new(q))]).map_err(out_err)?;

        let cluster = 1u64 << fo.create.cluster_bits;
        let chunk = args.chunk_size.max(cluster).div_ceil(cluster) * cluster;
        let next = Rc::new(Cell::new(0u64));
        let pb = Rc::new(RefCell::new(Progress::new(args.progress)));
        pb.borrow_mut().set(0.0);
        let mut workers = Vec::new();
        for _ in 0..args.queue_depth.max(1) {
            let (src, dst, next, pb) = (o.chain.clone(), dst.clone(), next.clone(), pb.clone());
            let compress = args.compress;
            let buf = AlignedBuf::new(chunk as usize);
            workers.push(async move {
                loop {
                    let start = next.get();
                    if start >= size {
                        return Ok(());
                    }
                    let end = (start + chunk).min(size);
                    next.set(end);
                    let r = copy_chunk(
                        src.clone(),
                        dst.clone(),
                        buf.clone(),
                        start,
                        end,
                        cluster,
                        compress,
                    )
                    .await;
                    if r.is_err() {
                        // Stop the other workers at their next chunk.
                        next.set(size);
                        return r;
                    }
                    pb.borrow_mut().advance(end - start, size);
                }
            });
        }
        let d2 = dst.clone();
        o.exec
            .block_on(async move {
                // The first error of any worker, after all of them stopped.
                let mut first = None;
                for r in futures_all(workers).await {
                    if let Err(e) = r {
                        first.get_or_insert(e);
                    }
                }
                match first {
                    Some(e) => Err(e),
                    None => on_dst(d2.close().await),
                }
            })
            .map_err(|(side, source)| match side {
                Side::Source => ToolError::Engine {
                    path: args.image.image.display().to_string(),
                    source,
                },
                Side::Output => out_err(source),
            })?;
        pb.borrow_mut().set(100.0);
        pb.borrow().finish();
        Ok(String::new())
    }
}
