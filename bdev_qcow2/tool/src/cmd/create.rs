//! `qcow2 create`: formats a new qcow2 image file through the engine, with the option names,
//! defaults and "Formatting …" line of `qemu-img create`.
//!
//! The `-o` parser here is shared with `convert -O qcow2`.

use super::create_encrypt::EncryptOptions;
use crate::host::{Format, OpenSpec, ToolError, ToolResult};
use crate::uring::{OpenMode, UringDevice};
use qcow2_engine::create::{create, CreateOptions};
use qcow2_engine::format::header::CompressionType;
use qcow2_engine::{Exec, OpenOptions};
use std::path::{Path, PathBuf};

/// Arguments of `qcow2 create`.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// Image format to create (only qcow2).
    #[arg(short = 'f', long = "format", default_value = "qcow2")]
    pub format: String,
    /// Format options, comma-separated (`cluster_size=…,compat=…,refcount_bits=…,
    /// extended_l2=on|off,lazy_refcounts=on|off,compression_type=zlib|zstd,
    /// preallocation=off|metadata|falloc|full,backing_file=…,backing_fmt=…`, and
    /// `encrypt.format=luks,encrypt.key-secret=ID[,encrypt.cipher-alg=…,…]`); may be
    /// repeated.
    #[arg(short = 'o')]
    pub options: Vec<String>,
    /// A secret, as qemu-img's `--object secret,id=ID,data=…|file=…` (repeatable): the
    /// key an encrypted image gets (`-o encrypt.key-secret=ID`).
    #[arg(long = "object", value_name = "secret,id=ID,data=…|file=…")]
    pub objects: Vec<String>,
    /// Backing file recorded in the new image (opened only to read its size when SIZE is
    /// omitted; relative names resolve against the new image's directory).
    #[arg(short = 'b')]
    pub backing: Option<String>,
    /// Format of the backing file (required with -b: formats are never probed).
    #[arg(short = 'F', value_enum)]
    pub backing_format: Option<Format>,
    /// Quiet: do not print the "Formatting" line.
    #[arg(short = 'q')]
    pub quiet: bool,
    /// The image to create (overwritten if it exists, like qemu-img).
    pub image: PathBuf,
    /// Virtual size (k, M, G, T suffixes; fractions like 1.5G allowed). Defaults to the
    /// backing image's size.
    pub size: Option<String>,
}

/// `preallocation=` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// No preallocation (the default).
    Off,
    /// Allocate every L2 table and cluster in metadata; the data stays sparse.
    Metadata,
    /// As `Metadata`, and the file's blocks are reserved (`posix_fallocate`).
    Falloc,
    /// Allocate every cluster and write zeros into it (a fully allocated image).
    Full,
}

/// Parsed `-o` options: the engine's create options plus what the "Formatting" line echoes.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    /// What the engine will create.
    pub create: CreateOptions,
    /// The size as given (`-o size=` or the SIZE argument), in bytes.
    pub size: Option<u64>,
    /// `compat=` exactly as given, echoed only when given (like qemu-img).
    pub compat_text: Option<String>,
    /// `preallocation=` as given, echoed only when given.
    pub prealloc_text: Option<String>,
    /// Preallocation mode.
    pub preallocation: Preallocation,
    /// `lazy_refcounts=` as given (echoed verbatim), default `off`.
    pub lazy_text: String,
    /// `extended_l2=` as given (echoed verbatim), default `off`.
    pub extended_l2_text: String,
    /// `encrypt.*`: the LUKS encryption asked for.
    pub encrypt: EncryptOptions,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            create: CreateOptions::default(),
            size: None,
            compat_text: None,
            prealloc_text: None,
            preallocation: Preallocation::Off,
            lazy_text: "off".into(),
            extended_l2_text: "off".into(),
            encrypt: EncryptOptions::default(),
        }
    }
}

fn usage<T>(msg: impl Into<String>) -> ToolResult<T> {
    Err(ToolError::Usage(msg.into()))
}

/// Splits a qemu option string at commas; `,,` stands for a literal comma.
fn split_options(s: &str) -> Vec<String> {
    crate::secrets::split_commas(s)
}

/// QEMU's boolean option values.
fn parse_bool(name: &str, v: &str) -> ToolResult<bool> {
    match v {
        "on" | "yes" | "true" => Ok(true),
        "off" | "no" | "false" => Ok(false),
        _ => usage(format!(
            "Parameter '{name}' expects 'on' or 'off' (got '{v}')"
        )),
    }
}

/// Parses a size the way qemu-img does: a number (fractions allowed, e.g. `1.5G`) with an
/// optional `b`/`k`/`M`/`G`/`T`/`P`/`E` suffix (powers of 1024).
pub fn parse_qemu_size(s: &str) -> ToolResult<u64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'b' => 0,
                'k' => 10,
                'm' => 20,
                'g' => 30,
                't' => 40,
                'p' => 50,
                'e' => 60,
                _ => return usage(format!("Invalid size suffix in '{s}'")),
            };
            (&t[..t.len() - 1], 1u128 << shift)
        }
        _ => (t, 1u128),
    };
    let bad = || ToolError::Usage(format!("Invalid image size specified: '{s}'"));
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) || frac.len() > 18 {
        return Err(bad());
    }
    let int: u128 = int.parse().map_err(|_| bad())?;
    let mut v = int.checked_mul(mult).ok_or_else(bad)?;
    if !frac.is_empty() {
        let f: u128 = frac.parse().map_err(|_| bad())?;
        v += f * mult / 10u128.pow(frac.len() as u32);
    }
    u64::try_from(v).map_err(|_| bad())
}

impl FormatOptions {
    /// Applies one `-o` string (several options separated by commas).
    pub fn apply(&mut self, list: &str) -> ToolResult<()> {
        for kv in split_options(list) {
            let (k, v) = kv.split_once('=').unwrap_or((kv.as_str(), ""));
            if self.encrypt.apply(k, v)? {
                continue;
            }
            let c = &mut self.create;
            match k {
                "size" => self.size = Some(parse_qemu_size(v)?),
                "cluster_size" => {
                    let cs = parse_qemu_size(v)?;
                    if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
                        return usage("Cluster size must be a power of two between 512 and 2048k");
                    }
                    c.cluster_bits = cs.ilog2();
                }
                "compat" => {
                    c.version = match v {
                        "0.10" | "v2" => 2,
                        "1.1" | "v3" => 3,
                        _ => return usage(format!("Invalid compatibility level: '{v}'")),
                    };
                    self.compat_text = Some(v.to_string());
                }
                "refcount_bits" => {
                    let bits: u64 = v
                        .parse()
                        .map_err(|_| ToolError::Usage(format!("Invalid refcount_bits '{v}'")))?;
                    if !bits.is_power_of_two() || bits > 64 {
                        return usage(
                            "Refcount width must be a power of two and may not exceed 64 bits",
                        );
                    }
                    c.refcount_order = bits.ilog2();
                }
                "extended_l2" => {
                    c.extended_l2 = parse_bool(k, v)?;
                    self.extended_l2_text = v.to_string();
                }
                "lazy_refcounts" => {
                    c.lazy_refcounts = parse_bool(k, v)?;
                    self.lazy_text = v.to_string();
                }
                "compression_type" => {
                    c.compression_type = match v {
                        "zlib" => CompressionType::Zlib,
                        "zstd" => CompressionType::Zstd,
                        _ => return usage(format!("Invalid compression type '{v}'")),
                    };
                }
                "preallocation" => {
                    self.preallocation = match v {
                        "off" => Preallocation::Off,
                        "metadata" => Preallocation::Metadata,
                        "falloc" => Preallocation::Falloc,
                        "full" => Preallocation::Full,
                        _ => return usage(format!("Invalid preallocation mode: '{v}'")),
                    };
                    self.prealloc_text = Some(v.to_string());
                }
                "backing_file" => c.backing_file = Some(v.to_string()),
                "backing_fmt" => c.backing_format = Some(v.to_string()),
                _ => return usage(format!("Invalid parameter '{k}'")),
            }
        }
        Ok(())
    }

    /// Checks combinations qemu-img refuses, with its wording.
    pub fn validate(&self) -> ToolResult<()> {
        let c = &self.create;
        if c.version == 2 {
            if c.refcount_order != 4 {
                return usage("Different refcount widths than 16 bits require compatibility level 1.1 or above (use version=v3 or greater)");
            }
            if c.lazy_refcounts {
                return usage("Lazy refcounts only supported with compatibility level 1.1 and above (use version=v3 or greater)");
            }
            if c.extended_l2 {
                return usage("Extended L2 entries are only supported with compatibility level 1.1 and above (use version=v3 or greater)");
            }
            if c.compression_type != CompressionType::Zlib {
                return usage("Non-zlib compression type is only supported with compatibility level 1.1 and above (use version=v3 or greater)");
            }
        }
        if c.extended_l2 && c.cluster_bits < 14 {
            return usage(
                "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
            );
        }
        self.encrypt.validate()?;
        if self.encrypt.encrypted() && self.preallocation != Preallocation::Off {
            // QEMU maps the clusters without writing cipher text: they would read as noise.
            return usage(
                "preallocation of an encrypted image is not supported (its clusters would \
                 read as noise, not zeros)",
            );
        }
        if c.backing_format.is_some() && c.backing_file.is_none() {
            return usage("Backing format cannot be used without backing file");
        }
        if self.preallocation != Preallocation::Off && c.backing_file.is_some() && !c.extended_l2 {
            return usage("Backing file and preallocation can only be used at the same time if extended_l2 is on");
        }
        Ok(())
    }

    /// The text after `fmt=qcow2` in qemu-img's "Formatting" line.
    pub fn describe(&self, size: u64) -> String {
        let c = &self.create;
        let mut s = format!(
            "{}cluster_size={} extended_l2={}",
            self.encrypt.describe(),
            1u64 << c.cluster_bits,
            self.extended_l2_text
        );
        if let Some(p) = &self.prealloc_text {
            s += &format!(" preallocation={p}");
        }
        let ct = match c.compression_type {
            CompressionType::Zlib => "zlib",
            CompressionType::Zstd => "zstd",
        };
        s += &format!(" compression_type={ct} size={size}");
        if let Some(v) = &self.compat_text {
            s += &format!(" compat={v}");
        }
        if let Some(b) = &c.backing_file {
            s += &format!(" backing_file={b}");
        }
        if let Some(f) = &c.backing_format {
            s += &format!(" backing_fmt={f}");
        }
        s += &format!(
            " lazy_refcounts={} refcount_bits={}",
            self.lazy_text,
            1u32 << c.refcount_order
        );
        s
    }
}

/// Creates (or truncates) `path` and formats it with `opts` through the engine. As QEMU,
/// an existing file is truncated only once its create locks are taken (nobody else uses
/// it), and formatted under the locks of a writable image.
pub fn format_image(path: &Path, opts: &CreateOptions) -> ToolResult<()> {
    let io_err = |source| ToolError::Io {
        path: path.display().to_string(),
        source,
    };
    create_file(path, 0)?;
    // Buffered: a fresh, empty file cannot be probed for O_DIRECT support.
    let mut dev = UringDevice::open(
        path,
        OpenMode {
            writable: true,
            direct: false,
        },
        64,
    )
    .map_err(io_err)?;
    crate::host::lock_device(&mut dev, path, crate::lock::Access::Write)?;
    let exec: Exec<UringDevice> = Exec::new();
    let id = exec.add_device(dev);
    let e2 = exec.clone();
    let o2 = opts.clone();
    exec.block_on(async move { create(&e2, id, &o2).await })
        .map_err(|source| ToolError::Engine {
            path: path.display().to_string(),
            source,
        })
}

/// Creates `path`, or truncates it once its create locks ([`crate::lock::Access::Create`])
/// show that nobody else has it open in a conflicting way, and sets its length to `len`.
/// The locks go with the file, closed on return.
pub fn create_file(path: &Path, len: u64) -> ToolResult<()> {
    let io_err = |source| ToolError::Io {
        path: path.display().to_string(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_err)?;
    crate::host::lock_file(&f, path, crate::lock::Access::Create)?;
    f.set_len(0).map_err(io_err)?;
    f.set_len(len).map_err(io_err)
}

/// Virtual size of the backing image `name` (relative to `image`'s directory), opened
/// read-only in the stated format; its own backing chain is not opened.
fn backing_size(image: &Path, name: &str, format: Format) -> ToolResult<u64> {
    let p = Path::new(name);
    let path = if p.is_absolute() {
        p.to_path_buf()
    } else {
        image.parent().unwrap_or(Path::new(".")).join(p)
    };
    let spec = OpenSpec {
        keys: Default::default(),
        path,
        format,
        // Only the header is needed; a backing image's own backing file is not opened.
        allow_backing: false,
        writable: false,
        opts: OpenOptions::default(),
        queue_depth: 8,
        direct: false,
        // As qemu-img create, which probes the backing size with force-share: the backing
        // file may be in use (a base image under running guests).
        force_share: true,
    };
    match format {
        Format::Raw => {
            let md = std::fs::metadata(&spec.path).map_err(|source| ToolError::Io {
                path: spec.path.display().to_string(),
                source,
            })?;
            Ok(md.len())
        }
        Format::Qcow2 => {
            let (_exec, q) = crate::host::open_single(&spec)?;
            Ok(q.size())
        }
    }
}

/// Runs `qcow2 create`; returns the text to print.
pub fn run(args: &CreateArgs) -> ToolResult<String> {
    if args.format != "qcow2" {
        return usage(format!(
            "qcow2 create only writes qcow2 images (got -f {})",
            args.format
        ));
    }
    let mut fo = FormatOptions::default();
    for o in &args.options {
        fo.apply(o)?;
    }
    let secrets = crate::secrets::parse_objects(&args.objects).map_err(ToolError::Usage)?;
    if let Some(b) = &args.backing {
        fo.create.backing_file = Some(b.clone());
    }
    if let Some(f) = args.backing_format {
        fo.create.backing_format = Some(f.name().to_string());
    }
    if let Some(s) = &args.size {
        fo.size = Some(parse_qemu_size(s)?);
    }
    fo.validate()?;
    let size = match (fo.size, &fo.create.backing_file) {
        (Some(s), _) => s,
        (None, Some(b)) => {
            let fmt = match fo.create.backing_format.as_deref().map(Format::from_name) {
                Some(Some(f)) => f,
                Some(None) => return usage("Unsupported backing format (raw or qcow2)"),
                None => return usage("Backing file specified without backing format"),
            };
            backing_size(&args.image, b, fmt)?
        }
        (None, None) => return usage("Image creation needs a size parameter"),
    };
    if fo.create.backing_file.is_some() && fo.create.backing_format.is_none() {
        return usage("Backing file specified without backing format");
    }
    fo.create.size = size;
    fo.create.encryption = fo.encrypt.build(&secrets)?.map(|(area, _)| area);
    let mut out = String::new();
    if !args.quiet {
        out = format!(
            "Formatting '{}', fmt=qcow2 {}\n",
            args.image.display(),
            fo.describe(size)
        );
    }
    format_image(&args.image, &fo.create)?;
    let mode = match fo.preallocation {
        Preallocation::Off => None,
        // The file was just created: it reads zeros wherever nothing was written.
        Preallocation::Metadata | Preallocation::Falloc => {
            Some(qcow2_engine::create::Preallocation::Metadata {
                device_reads_zeros: true,
            })
        }
        Preallocation::Full => Some(qcow2_engine::create::Preallocation::Full),
    };
    if let Some(mode) = mode {
        preallocate(&args.image, mode)?;
    }
    if fo.preallocation == Preallocation::Falloc {
        reserve_blocks(&args.image)?;
    }
    Ok(out)
}

/// `preallocation=falloc`: reserves the blocks of the whole (preallocated) file, so that
/// later writes find the space; everything reads as before (zeros where nothing was
/// written).
fn reserve_blocks(path: &Path) -> ToolResult<()> {
    use std::os::fd::AsFd;
    let io = |source| ToolError::Io {
        path: path.display().to_string(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let len =
        libc::off_t::try_from(len).map_err(|_| io(std::io::ErrorKind::InvalidInput.into()))?;
    crate::ffi::sys::posix_fallocate(f.as_fd(), 0, len).map_err(io)
}

/// `preallocation=metadata|full` on a freshly formatted image.
fn preallocate(path: &Path, mode: qcow2_engine::create::Preallocation) -> ToolResult<()> {
    let spec = crate::host::OpenSpec {
        keys: Default::default(),
        path: path.to_path_buf(),
        format: Format::Qcow2,
        allow_backing: false,
        opts: qcow2_engine::OpenOptions {
            writable: true,
            ..Default::default()
        },
        queue_depth: 64,
        direct: true,
        writable: true,
        force_share: false,
    };
    let o = crate::host::open_chain(&spec)?;
    let chain = o.chain.clone();
    o.exec
        .block_on(async move { qcow2_engine::create::preallocate(&chain, mode).await })
        .map_err(|source| ToolError::Engine {
            path: path.display().to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_qemu_size("1.5M").ok(), Some(3 << 19));
        assert_eq!(parse_qemu_size("64k").ok(), Some(65536));
        assert_eq!(parse_qemu_size("1000").ok(), Some(1000));
        assert!(parse_qemu_size("x").is_err());
        assert!(parse_qemu_size("1.2.3").is_err());
    }

    #[test]
    fn options() {
        let mut f = FormatOptions::default();
        f.apply("cluster_size=4k,compat=1.1,refcount_bits=1,lazy_refcounts=on")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.create.cluster_bits, 12);
        assert_eq!(f.create.refcount_order, 0);
        assert!(f.create.lazy_refcounts);
        assert!(f.apply("foo=1").is_err());
        assert_eq!(
            split_options("backing_file=a,,b,x=1"),
            vec!["backing_file=a,b", "x=1"]
        );
    }
}
