//! The standalone host: opens an image and its backing chain from paths, on io_uring
//! devices driven by one executor (one core).

use crate::lock::{Access, LockFailure};
use crate::uring::{OpenMode, UringDevice};
use qcow2_engine::io::{BlockDevice, BufSlice};
use qcow2_engine::{Chain, Exec, Layer, OpenOptions, Qcow2, Request, Step};
use std::collections::HashSet;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Errors of the tool.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The engine refused the image or an I/O failed.
    #[error("{path}: {source}")]
    Engine {
        /// The image concerned.
        path: String,
        /// What the engine said.
        source: qcow2_engine::Error,
    },
    /// Opening or accessing a host file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file concerned.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The image's lock bytes (QEMU's scheme, see [`crate::lock`]) could not be taken:
    /// another process (QEMU, or this tool) uses the image in a conflicting way.
    #[error("Could not open '{path}': {failure}{}", lock_hint(failure, path))]
    Lock {
        /// The file concerned.
        path: String,
        /// What stood in the way.
        failure: LockFailure,
    },
    /// As [`ToolError::Lock`], for a file about to be created over (truncated).
    #[error("{path}: {failure}{}", lock_hint(failure, path))]
    CreateLock {
        /// The file concerned.
        path: String,
        /// What stood in the way.
        failure: LockFailure,
    },
    /// Bad usage or an unsupported request.
    #[error("{0}")]
    Usage(String),
}

/// QEMU's hint after a lock conflict (none when the lock call itself failed).
fn lock_hint(failure: &LockFailure, path: &str) -> String {
    if failure.is_conflict() {
        format!("\nIs another process using the image [{path}]?")
    } else {
        String::new()
    }
}

/// Result type of the tool.
pub type ToolResult<T> = Result<T, ToolError>;

/// Image formats the tool can open. There is no probing: the format is always stated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// qcow2 (version 2 or 3).
    Qcow2,
    /// A raw disk image.
    Raw,
}

impl Format {
    /// Parses a format name recorded in an image (backing format extension).
    pub fn from_name(s: &str) -> Option<Format> {
        match s {
            "qcow2" => Some(Format::Qcow2),
            "raw" => Some(Format::Raw),
            _ => None,
        }
    }
    /// The name qemu-img uses.
    pub fn name(&self) -> &'static str {
        match self {
            Format::Qcow2 => "qcow2",
            Format::Raw => "raw",
        }
    }
}

/// How to open an image.
#[derive(Debug, Clone)]
pub struct OpenSpec {
    /// Path of the top image.
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// Keys of encrypted images (top, backing).
    pub keys: crate::secrets::Keys,
    /// Whether backing files named inside images may be opened.
    pub allow_backing: bool,
    /// Open the top image for writing (backing layers are always read-only). Overrides
    /// `opts.writable` for the top image.
    pub writable: bool,
    /// Engine options (cache sizes).
    pub opts: OpenOptions,
    /// io_uring queue depth per device.
    pub queue_depth: u32,
    /// Bypass the page cache (O_DIRECT) where the file system allows.
    pub direct: bool,
    /// Take no lock that keeps others from writing (qemu-img's `-U`/`--force-share`), on
    /// every file of the chain; only for read-only opens.
    pub force_share: bool,
}

/// An opened chain with the paths and formats of its layers (top first). `D` is the device
/// type of every layer: the io_uring device, or a wrapper around it (see
/// [`open_chain_with`]).
pub struct Opened<D: BlockDevice = UringDevice> {
    /// The executor driving every device of the chain.
    pub exec: Exec<D>,
    /// The chain.
    pub chain: Rc<Chain<D>>,
    /// Path and format of each layer.
    pub files: Vec<(PathBuf, Format)>,
}

/// Puts guest read or write `req`, its data in `buf`, into `chain` as a host of one core
/// does: the engine plans it and the step is taken through the executor, which reports
/// the completion under `tag`. (With no other core there is no owner to send it to.)
pub fn submit<D: BlockDevice>(chain: &Rc<Chain<D>>, tag: u64, req: Request, buf: BufSlice<D::Buf>) {
    match chain.plan(req, || buf.clone()) {
        Step::Complete(r) => chain.exec().complete(tag, r),
        Step::Direct(grant) => chain.submit_direct(tag, grant, buf),
        Step::Task(task) => chain.start(task, tag, Some(buf)),
        Step::Owner(_) => {
            let e = qcow2_engine::Error::InvalidRequest("a request for an owner on one core");
            chain.exec().complete(tag, Err(e))
        }
    }
}

fn engine_err(path: &Path) -> impl FnOnce(qcow2_engine::Error) -> ToolError + '_ {
    move |source| ToolError::Engine {
        path: path.display().to_string(),
        source,
    }
}

/// [`engine_err`] for the image the operator named with the qcow2 format: a file without
/// the qcow2 magic is most likely a raw image, and since the format is never probed the
/// operator has to say so.
fn top_image_err(path: &Path) -> impl FnOnce(qcow2_engine::Error) -> ToolError + '_ {
    move |source| match source {
        qcow2_engine::Error::NotQcow2(_) => ToolError::Usage(format!(
            "{}: {source}; if it is a raw image, add -f raw (the format is never probed)",
            path.display()
        )),
        source => engine_err(path)(source),
    }
}

/// Opens one image file as an io_uring device (read-only unless `writable`) and takes its
/// lock bytes as QEMU would for the same open ([`crate::lock`]): a writable image, a
/// read-only one, or with `spec.force_share` one that lets others write. Refuses a
/// writable open with `force_share`, as QEMU does.
pub fn uring_device(path: &Path, writable: bool, spec: &OpenSpec) -> ToolResult<UringDevice> {
    let access = match (writable, spec.force_share) {
        (true, true) => {
            return Err(ToolError::Usage(format!(
                "Could not open '{}': force-share=on can only be used with read-only images",
                path.display()
            )))
        }
        (true, false) => Access::Write,
        (false, true) => Access::ReadForceShare,
        (false, false) => Access::Read,
    };
    let mut dev = UringDevice::open(
        path,
        OpenMode {
            writable,
            direct: spec.direct,
        },
        spec.queue_depth,
    )
    .map_err(|source| ToolError::Io {
        path: path.display().to_string(),
        source,
    })?;
    lock_device(&mut dev, path, access)?;
    Ok(dev)
}

/// Takes the lock bytes of `access` on the image `dev` ([`UringDevice::lock`]) before
/// anything reads or writes it; they go with the device.
pub fn lock_device(dev: &mut UringDevice, path: &Path, access: Access) -> ToolResult<()> {
    dev.lock(access).map_err(lock_error(path, access))
}

/// Takes the lock bytes of `access` on the open `file` ([`crate::lock::lock`]) before
/// anything reads or writes it; they go when the file is closed (on failure too, for
/// what was taken).
pub fn lock_file(file: &impl AsFd, path: &Path, access: Access) -> ToolResult<()> {
    crate::lock::lock(file.as_fd(), access).map_err(lock_error(path, access))
}

/// The error of a failed lock on `path`, as QEMU words it for an open or a creation.
fn lock_error(path: &Path, access: Access) -> impl FnOnce(LockFailure) -> ToolError + '_ {
    move |failure| {
        let path = path.display().to_string();
        match access {
            Access::Create => ToolError::CreateLock { path, failure },
            _ => ToolError::Lock { path, failure },
        }
    }
}

/// Opens one image file as a device on `exec`.
pub fn open_device(
    exec: &Exec<UringDevice>,
    path: &Path,
    writable: bool,
    spec: &OpenSpec,
) -> ToolResult<qcow2_engine::DevId> {
    Ok(exec.add_device(uring_device(path, writable, spec)?))
}

/// Opens a qcow2 image and unlocks it with `key` when it is encrypted; without a key an
/// encrypted image is refused when `need_key` (every command that reads or writes data),
/// as QEMU refuses it, and opens locked otherwise (`info`: its data is never read).
pub async fn open_qcow2<D: BlockDevice>(
    exec: Exec<D>,
    dev: qcow2_engine::DevId,
    opts: OpenOptions,
    key: Option<crate::secrets::Secret>,
    need_key: bool,
) -> qcow2_engine::Result<Qcow2<D>> {
    let q = Qcow2::open(&exec, dev, opts).await?;
    match key {
        Some(k) => q.unlock(k.bytes()).await?,
        None if need_key && q.encrypted() => return Err(qcow2_engine::Error::KeyRequired),
        None => {}
    }
    Ok(q)
}

/// Opens a qcow2 image on its own (no backing chain), for `info`.
pub fn open_single(spec: &OpenSpec) -> ToolResult<(Exec<UringDevice>, Rc<Qcow2<UringDevice>>)> {
    let exec = Exec::new();
    let dev = open_device(&exec, &spec.path, false, spec)?;
    let e2 = exec.clone();
    let opts = spec.opts;
    let key = spec.keys.top.clone();
    let q = exec
        .block_on(open_qcow2(e2, dev, opts, key, false))
        .map_err(top_image_err(&spec.path))?;
    Ok((exec, Rc::new(q)))
}

/// Opens the top image alone as a chain of one layer (writable when `spec.writable`),
/// whatever backing file it names: for changing that name without reading through it.
pub fn open_top_only(spec: &OpenSpec) -> ToolResult<Opened> {
    let exec = Exec::new();
    let dev = open_device(&exec, &spec.path, spec.writable, spec)?;
    let e2 = exec.clone();
    let opts = OpenOptions {
        writable: spec.writable,
        ..spec.opts
    };
    let key = spec.keys.top.clone();
    let q = exec
        .block_on(open_qcow2(e2, dev, opts, key, true))
        .map_err(top_image_err(&spec.path))?;
    let chain =
        Chain::new(&exec, vec![Layer::Qcow2(Box::new(q))]).map_err(engine_err(&spec.path))?;
    Ok(Opened {
        exec,
        chain,
        files: vec![(spec.path.clone(), spec.format)],
    })
}

/// Opens the image and, if allowed, its backing chain. A backing file named inside an image
/// is opened only with `allow_backing`; relative names resolve against the directory of the
/// image naming them; the backing format must be recorded (no probing); loops and chains
/// deeper than the engine's limit are refused.
pub fn open_chain(spec: &OpenSpec) -> ToolResult<Opened> {
    open_chain_with(spec, |dev, _top| dev)
}

/// [`open_chain`] with every layer's device passed through `wrap(device, is_top)` first
/// (e.g. to record the writes issued to the top image). Only the top image is opened
/// writable, and only when `spec.writable` says so.
pub fn open_chain_with<D: BlockDevice>(
    spec: &OpenSpec,
    wrap: impl FnMut(UringDevice, bool) -> D,
) -> ToolResult<Opened<D>> {
    open_chain_on(&Exec::new(), spec, wrap)
}

/// [`open_chain_with`] on an executor of the caller's, so that several chains (the two
/// images `compare` reads, or an image and its commit target) run on one.
pub fn open_chain_on<D: BlockDevice>(
    exec: &Exec<D>,
    spec: &OpenSpec,
    wrap: impl FnMut(UringDevice, bool) -> D,
) -> ToolResult<Opened<D>> {
    Ok(open_chain_until(exec, spec, wrap, |_| false)?.0)
}

/// Raises the soft limit on open files to the hard one (as QEMU does at start): each layer
/// of a chain holds its file and its io_uring open, and a chain of a thousand images needs
/// more than the usual soft limit of 1024. Best effort: a chain that needs more than the
/// limit fails to open a file with EMFILE, named.
fn raise_fd_limit() {
    use crate::ffi::sys;
    let Ok(mut lim) = sys::nofile_limit() else {
        return;
    };
    if lim.rlim_cur >= lim.rlim_max {
        return;
    }
    lim.rlim_cur = lim.rlim_max;
    let _ = sys::set_nofile_limit(&lim);
}

/// An image file and its format.
pub type ImageFile = (PathBuf, Format);

/// A backing file named in an image of the chain, before it is opened.
#[derive(Debug, Clone)]
pub struct BackingRef<'a> {
    /// The image naming it.
    pub named_by: &'a Path,
    /// The name as recorded in that image.
    pub name: &'a str,
    /// The name resolved against that image's directory.
    pub path: &'a Path,
    /// Its recorded format.
    pub format: Format,
}

/// [`open_chain_on`] that stops before the first backing file `stop` picks: that file
/// (path, format) is not opened and is returned beside the chain of the images above it
/// (`None` when `stop` picked none and the whole chain was opened). For `commit`, whose
/// target must be opened writable, apart from the images that read from it.
pub fn open_chain_until<D: BlockDevice>(
    exec: &Exec<D>,
    spec: &OpenSpec,
    mut wrap: impl FnMut(UringDevice, bool) -> D,
    mut stop: impl FnMut(&BackingRef<'_>) -> bool,
) -> ToolResult<(Opened<D>, Option<ImageFile>)> {
    let exec = exec.clone();
    if spec.allow_backing {
        raise_fd_limit();
    }
    let mut stopped = None;
    let mut layers = Vec::new();
    let mut files = Vec::new();
    let mut seen = HashSet::new();
    let mut path = spec.path.clone();
    let mut format = spec.format;
    loop {
        if layers.len() >= qcow2_engine::limits::MAX_BACKING_DEPTH {
            return Err(ToolError::Engine {
                path: spec.path.display().to_string(),
                source: qcow2_engine::Error::BackingChain(format!(
                    "backing chain deeper than {} images",
                    qcow2_engine::limits::MAX_BACKING_DEPTH
                )),
            });
        }
        let canon = std::fs::canonicalize(&path).map_err(|source| ToolError::Io {
            path: path.display().to_string(),
            source,
        })?;
        if !seen.insert(canon.clone()) {
            return Err(ToolError::Engine {
                path: spec.path.display().to_string(),
                source: qcow2_engine::Error::BackingChain(format!(
                    "loop: {} appears twice",
                    canon.display()
                )),
            });
        }
        let top = layers.is_empty();
        let writable = top && spec.writable;
        let dev = exec.add_device(wrap(uring_device(&path, writable, spec)?, top));
        files.push((path.clone(), format));
        match format {
            Format::Raw => {
                let size = exec.device_size(dev);
                layers.push(Layer::Raw { dev, size });
                break;
            }
            Format::Qcow2 => {
                let e2 = exec.clone();
                let opts = OpenOptions {
                    writable,
                    ..spec.opts
                };
                let key = if top {
                    spec.keys.top.clone()
                } else {
                    spec.keys.backing.clone()
                };
                let opened = exec.block_on(open_qcow2(e2, dev, opts, key, true));
                let q = if top {
                    opened.map_err(top_image_err(&path))?
                } else {
                    opened.map_err(engine_err(&path))?
                };
                let backing = q.header().backing_file.clone();
                let backing_fmt = q.header().extensions.backing_format.clone();
                layers.push(Layer::Qcow2(Box::new(q)));
                let Some(name) = backing else { break };
                if !spec.allow_backing {
                    return Err(ToolError::Engine {
                        path: path.display().to_string(),
                        source: qcow2_engine::Error::BackingNotAllowed(name),
                    });
                }
                let fmt = match backing_fmt.as_deref() {
                    None => {
                        return Err(ToolError::Engine {
                            path: path.display().to_string(),
                            source: qcow2_engine::Error::BackingChain(format!(
                                "backing file '{name}' has no recorded format; refusing to probe"
                            )),
                        })
                    }
                    Some(f) => Format::from_name(f).ok_or_else(|| ToolError::Engine {
                        path: path.display().to_string(),
                        source: qcow2_engine::Error::BackingChain(format!(
                            "unsupported backing format '{f}'"
                        )),
                    })?,
                };
                let next = Path::new(&name);
                let next = if next.is_absolute() {
                    next.to_path_buf()
                } else {
                    path.parent().unwrap_or(Path::new(".")).join(next)
                };
                let r = BackingRef {
                    named_by: &path,
                    name: &name,
                    path: &next,
                    format: fmt,
                };
                if stop(&r) {
                    stopped = Some((next, fmt));
                    break;
                }
                path = next;
                format = fmt;
            }
        }
    }
    let chain = Chain::new(&exec, layers).map_err(engine_err(&spec.path))?;
    Ok((Opened { exec, chain, files }, stopped))
}
