//! `qcow2 commit`: writes what an overlay holds into its backing file, like `qemu-img
//! commit`, or with `-b BASE` into a deeper image of its chain (what the images between
//! hold goes in too).
//!
//! The base gets exactly what a reader of the top image saw wherever an image above the
//! base holds something: data is read through the chain above the base and written through
//! the engine's write path (a raw base: to the file); zero clusters become write-zeroes;
//! ranges no image above the base holds are left alone; past the end of a shorter image
//! between, the reader saw zeros, and so does the base (as QEMU's block status counts
//! them). A shorter base grows to the top image's size first; a longer one is not cut.
//! Then, unless `-d` or `-b`, the top image is emptied (every cluster unallocated, as
//! QEMU's `bdrv_make_empty`): it reads the same as before, from the base now.
//!
//! The images above the base and the base's own chain are opened apart (one open per
//! file, so the locks of [`crate::lock`] do not meet): the top writable (as qemu-img opens
//! it), the images between read-only, the base writable, the images below it read-only.

use super::{CacheMode, ImageArgs};
use crate::host::{open_chain_on, open_chain_until, BackingRef, Format, ToolError, ToolResult};
use crate::progress::Progress;
use crate::uring::{AlignedBuf, UringDevice};
use qcow2_engine::format::ClusterMapping;
use qcow2_engine::io::BufSlice;
use qcow2_engine::{Chain, DevId, Exec, Layer};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Guest bytes committed per step (between two progress updates and rate checks).
const CHUNK: u64 = 1 << 20;

/// Arguments of `qcow2 commit`.
#[derive(Debug, clap::Args)]
pub struct CommitArgs {
    /// The image to commit into, as recorded in the image naming it or as a path
    /// (relative ones resolve against that image's directory, as qemu-img's); default:
    /// the top image's backing file. Implies -d.
    #[arg(short = 'b', value_name = "BASE")]
    pub base: Option<String>,
    /// Do not empty the top image afterwards.
    #[arg(short = 'd')]
    pub drop: bool,
    /// Show progress on stdout, like qemu-img's "(xx.xx/100%)" lines.
    #[arg(short = 'p')]
    pub progress: bool,
    /// Quiet: no "Image committed." line.
    #[arg(short = 'q')]
    pub quiet: bool,
    /// Cache mode of every image opened (qemu-img's `-t`; overrides `-T`).
    #[arg(short = 't', value_enum, value_name = "CACHE")]
    pub cache_mode: Option<CacheMode>,
    /// Rate limit in bytes per second (k, M, G suffixes), as qemu-img's `-r`.
    #[arg(short = 'r', value_parser = crate::parse_size, value_name = "RATE")]
    pub rate: Option<u64>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// What a range of the top image is, seen from the base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Data held above the base: copied.
    Copy,
    /// Zeros held above the base (zero clusters, or past a shorter image's end): zeroed.
    Zero,
    /// Nothing above the base: the base shows through and is left alone.
    Skip,
}

/// The image written: a qcow2 base through the engine, or a raw file.
#[derive(Clone)]
enum Target {
    Qcow2(Rc<Chain<UringDevice>>),
    Raw { exec: Exec<UringDevice>, dev: DevId },
}

impl Target {
    async fn write(&self, offset: u64, buf: BufSlice<AlignedBuf>) -> qcow2_engine::Result<()> {
        match self {
            Target::Qcow2(c) => c.write(offset, buf).await,
            Target::Raw { exec, dev } => exec.write(*dev, offset, buf).await,
        }
    }

    async fn zero(&self, offset: u64, len: u64) -> qcow2_engine::Result<()> {
        match self {
            Target::Qcow2(c) => c.write_zeroes(offset, len, true).await,
            Target::Raw { exec, dev } => exec.write_zeroes(*dev, offset, len).await,
        }
    }

    /// Makes everything written durable (a qcow2 base: closed cleanly).
    async fn close(&self) -> qcow2_engine::Result<()> {
        match self {
            Target::Qcow2(c) => c.close().await,
            Target::Raw { exec, dev } => exec.flush(*dev).await,
        }
    }
}

/// Which image an error came from.
#[derive(Debug, Clone, Copy)]
enum Side {
    Top,
    Base,
}

type SideResult<T> = Result<T, (Side, qcow2_engine::Error)>;

fn on<T>(side: Side, r: qcow2_engine::Result<T>) -> SideResult<T> {
    r.map_err(|e| (side, e))
}

/// Whether the backing file `r` is the base the operator named with `-b`: the name as
/// recorded, or a path that resolves (against the naming image's directory) to the same
/// file, as qemu-img's `bdrv_find_backing_image`.
fn names_base(r: &BackingRef<'_>, base: &str) -> bool {
    if r.name == base {
        return true;
    }
    let dir = r.named_by.parent().unwrap_or(Path::new("."));
    let want = std::fs::canonicalize(dir.join(base));
    let have = std::fs::canonicalize(r.path);
    matches!((want, have), (Ok(a), Ok(b)) if a == b)
}

/// The range at `pos` (up to `end`) as the base sees it: held by a layer of `upper` (the
/// images above the base), or not; and how many bytes from `pos` share the answer.
async fn status_above(
    upper: &Chain<UringDevice>,
    pos: u64,
    end: u64,
) -> qcow2_engine::Result<(Kind, u64)> {
    let mut end = end;
    for (i, layer) in upper.layers().iter().enumerate() {
        if pos >= layer.size() {
            // A shorter image between: the reader saw zeros, which count as its own.
            return Ok((Kind::Zero, end - pos));
        }
        end = end.min(layer.size());
        let (m, n) = upper.block_status(i, pos, end).await?;
        if n == 0 {
            return Err(qcow2_engine::Error::InvalidRequest(
                "block status made no progress",
            ));
        }
        match m {
            ClusterMapping::Data { .. } | ClusterMapping::Compressed(_) => {
                return Ok((Kind::Copy, n))
            }
            ClusterMapping::Zero { .. } => return Ok((Kind::Zero, n)),
            ClusterMapping::Unallocated { .. } => end = pos + n,
        }
    }
    Ok((Kind::Skip, end - pos))
}

/// Commits guest bytes `[start, end)`; returns how many were copied or zeroed.
async fn commit_chunk(
    upper: Rc<Chain<UringDevice>>,
    target: Target,
    buf: AlignedBuf,
    start: u64,
    end: u64,
) -> SideResult<u64> {
    let mut done = 0;
    let mut run: Option<(Kind, u64, u64)> = None;
    let mut pos = start;
    while pos <= end {
        let next = if pos < end {
            Some(on(Side::Top, status_above(&upper, pos, end).await)?)
        } else {
            None
        };
        match (&mut run, next) {
            (Some((k, _, e)), Some((kind, n))) if *k == kind && *e == pos => *e += n,
            _ => {
                if let Some((kind, a, b)) = run.take() {
                    let sub = BufSlice {
                        buf: buf.clone(),
                        off: (a - start) as usize,
                        len: (b - a) as usize,
                    };
                    match kind {
                        Kind::Copy => {
                            on(Side::Top, upper.read(a, sub.clone()).await)?;
                            on(Side::Base, target.write(a, sub).await)?;
                        }
                        Kind::Zero => on(Side::Base, target.zero(a, b - a).await)?,
                        Kind::Skip => {}
                    }
                    if kind != Kind::Skip {
                        done += b - a;
                    }
                }
                run = next.map(|(kind, n)| (kind, pos, pos + n));
            }
        }
        match next {
            Some((_, n)) => pos += n,
            None => break,
        }
    }
    Ok(done)
}

/// Runs `qcow2 commit`; returns the text to print ("Image committed." unless `-q`).
pub fn run(args: &CommitArgs) -> ToolResult<String> {
    let mut spec = args.image.spec()?;
    if let Some(c) = args.cache_mode {
        spec.direct = c == CacheMode::None;
    }
    spec.writable = true;
    let exec = Exec::new();
    let top_name = args.image.image.display().to_string();
    let (upper, found) = open_chain_until(
        &exec,
        &spec,
        |d, _| d,
        |r| args.base.as_deref().is_none_or(|b| names_base(r, b)),
    )?;
    let Some((base_path, base_format)) = found else {
        return Err(ToolError::Usage(match &args.base {
            Some(b) => format!("Did not find '{b}' in the backing chain of '{top_name}'"),
            None => "Image does not have a backing file".into(),
        }));
    };
    refuse_loop(&upper.files, &base_path)?;
    // The base's key is the chain's `backing.encrypt.key-secret`.
    let base_spec = crate::host::OpenSpec {
        keys: crate::secrets::Keys {
            top: spec.keys.backing.clone(),
            backing: None,
        },
        path: base_path.clone(),
        format: base_format,
        ..spec.clone()
    };
    let base = open_chain_on(&exec, &base_spec, |d, _| d)?;
    let target = match base.chain.layers().first() {
        Some(Layer::Raw { dev, .. }) => Target::Raw {
            exec: exec.clone(),
            dev: *dev,
        },
        _ => Target::Qcow2(base.chain.clone()),
    };
    let empty_top = !args.drop && args.base.is_none();
    let r = commit(args, &exec, upper.chain.clone(), target.clone(), empty_top);
    r.map_err(|(side, source)| {
        let path = match side {
            Side::Top => top_name.clone(),
            Side::Base => base_path.display().to_string(),
        };
        match source {
            qcow2_engine::Error::Refused(msg) => ToolError::Usage(format!("{path}: {msg}")),
            source => ToolError::Engine { path, source },
        }
    })?;
    Ok(if args.quiet {
        String::new()
    } else {
        "Image committed.\n".into()
    })
}

/// Refuses a base that is one of the images above it (a chain that loops back).
fn refuse_loop(upper: &[(PathBuf, Format)], base: &Path) -> ToolResult<()> {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    let b = canon(base);
    if b.is_some() && upper.iter().any(|(p, _)| canon(p) == b) {
        return Err(ToolError::Usage(format!(
            "backing chain: loop: {} appears twice",
            base.display()
        )));
    }
    Ok(())
}

/// Grows the base to the top image's size if shorter, commits every chunk, closes the base
/// (durable), then empties the top image if asked, and closes it. Both images are closed
/// on failure too, so what was written stays consistent.
fn commit(
    args: &CommitArgs,
    exec: &Exec<UringDevice>,
    upper: Rc<Chain<UringDevice>>,
    target: Target,
    empty_top: bool,
) -> SideResult<()> {
    let size = upper.size();
    let mut progress = Progress::new(args.progress);
    progress.set(0.0);
    let r = (|| {
        grow_base(exec, &target, size)?;
        let buf = AlignedBuf::new(CHUNK as usize);
        let t0 = Instant::now();
        let mut done = 0u64;
        let mut pos = 0;
        while pos < size {
            let end = (pos + CHUNK).min(size);
            let f = commit_chunk(upper.clone(), target.clone(), buf.clone(), pos, end);
            done += exec.block_on(f)?;
            progress.advance(end - pos, size);
            pos = end;
            if let Some(rate) = args.rate.filter(|r| *r > 0) {
                let due = Duration::from_secs_f64(done as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        Ok(())
    })();
    let t = target.clone();
    let closed = exec.block_on(async move { on(Side::Base, t.close().await) });
    let r = r.and(closed);
    let u = upper.clone();
    let emptied = exec.block_on(async move {
        let e = match r {
            Ok(()) if empty_top => on(Side::Top, u.make_empty().await),
            r => r,
        };
        let closed = on(Side::Top, u.close().await);
        e.and(closed)
    });
    progress.set(100.0);
    progress.finish();
    emptied
}

/// Makes the base at least `size` bytes long, as qemu-img's commit does (a qcow2 base is
/// resized, reading zeros in the new part; a raw file grows).
fn grow_base(exec: &Exec<UringDevice>, target: &Target, size: u64) -> SideResult<()> {
    match target {
        Target::Qcow2(c) if c.size() < size => {
            let c = c.clone();
            exec.block_on(async move { on(Side::Base, c.resize(size, false).await.map(|_| ())) })
        }
        Target::Qcow2(_) => Ok(()),
        Target::Raw { exec, dev } => {
            if exec.device_size(*dev) >= size {
                return Ok(());
            }
            exec.with_device(*dev, |d| {
                qcow2_engine::io::BlockDevice::ensure_size(d, size)
            })
            .map_err(|e| (Side::Base, qcow2_engine::Error::Io(e.0)))
        }
    }
}
