//! Subcommands of the `qcow2` tool.

pub mod bitmap;
pub mod check;
pub mod commit;
pub mod compare;
pub mod convert;
pub mod create;
pub mod create_encrypt;
pub mod info;
pub mod info_encrypt;
pub mod io;
pub mod map;
pub mod measure;
pub mod perf;
pub mod rebase;
pub mod resize;
pub mod snapshot;

use crate::host::{Format, OpenSpec};
use qcow2_engine::OpenOptions;
use std::path::PathBuf;

/// Options shared by subcommands that open an image.
#[derive(Debug, Clone, clap::Args)]
pub struct ImageArgs {
    /// Image format (never probed).
    #[arg(short = 'f', long = "format", value_enum, default_value = "qcow2")]
    pub format: Format,
    /// Allow opening backing files named inside the image (relative to its directory).
    #[arg(long)]
    pub allow_backing: bool,
    /// L2 slice cache size per core (e.g. 1M). Default: covers the image, at most 32 MiB.
    #[arg(long, value_parser = crate::parse_size)]
    pub l2_cache_size: Option<u64>,
    /// L2 slice size in bytes (power of two, 512 up to the cluster size).
    #[arg(long, value_parser = crate::parse_size, default_value = "4096")]
    pub l2_slice_size: u64,
    /// Ways per set of the slice cache.
    #[arg(long, default_value_t = 8)]
    pub cache_ways: usize,
    /// Cache mode of the image files, as qemu-img's `-t`/`-T`: `none` bypasses the page
    /// cache (O_DIRECT, where the file system allows it), `writeback` uses it.
    #[arg(short = 'T', long = "cache", value_enum, default_value = "none")]
    pub cache: CacheMode,
    /// On a block device (it cannot grow): lay each L2 slice's data clusters out in guest
    /// order, in a region reserved for the slice, whatever order they are written in.
    /// Without it clusters are appended as first written (as QEMU does). No effect on a
    /// file, which grows as clusters are appended.
    #[arg(long)]
    pub ordered_layout: bool,
    /// Bytes a first write into an image without a backing file takes at once where the
    /// clusters read as zeros (past a growing file's end, or a zeroed tail): the aligned
    /// group of unallocated clusters around it, so later first writes into the group are
    /// overwrites. 0 (or at most the cluster size): one cluster per first write, as QEMU.
    #[arg(long, value_parser = crate::parse_size, default_value = "64K")]
    pub alloc_granule: u64,
    /// Force sharing (qemu-img's `-U`): take no lock that keeps QEMU (or another `qcow2`)
    /// from writing the image and its backing files meanwhile, so an image in use can be
    /// read, at the risk of reading it mid-change. Only for commands that read.
    #[arg(short = 'U', long = "force-share")]
    pub force_share: bool,
    /// Give the image file's space back (punch holes) for the clusters a guest discard or
    /// a write-zeroes with unmap frees, as QEMU's `pass-discard-request` (on, as with
    /// qemu-io).
    #[arg(long, value_name = "on|off", action = clap::ArgAction::Set, value_parser = parse_on_off, default_value = "on")]
    pub pass_discard_request: bool,
    /// The same for the clusters a snapshot's deletion frees (QEMU's
    /// `pass-discard-snapshot`).
    #[arg(long, value_name = "on|off", action = clap::ArgAction::Set, value_parser = parse_on_off, default_value = "on")]
    pub pass_discard_snapshot: bool,
    /// The same for clusters freed otherwise: copied-on-write clusters, old tables
    /// (QEMU's `pass-discard-other`).
    #[arg(long, value_name = "on|off", action = clap::ArgAction::Set, value_parser = parse_on_off, default_value = "off")]
    pub pass_discard_other: bool,
    /// A secret, as qemu-img's `--object secret,id=ID,data=…|file=…` (repeatable); an
    /// encrypted image names the one that unlocks it with `--image-opts`.
    #[arg(long = "object", value_name = "secret,id=ID,data=…|file=…")]
    pub objects: Vec<String>,
    /// The image argument is an option string, as qemu-img's `--image-opts`:
    /// `driver=qcow2,file.filename=IMG,encrypt.key-secret=ID` (and, for the backing image,
    /// `backing.encrypt.key-secret=ID2`).
    #[arg(long)]
    pub image_opts: bool,
    /// The image (with `--image-opts`, its option string).
    pub image: PathBuf,
}

/// A QEMU boolean option value: `on`/`off` (also `yes`/`no`, `true`/`false`).
fn parse_on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" | "yes" | "true" => Ok(true),
        "off" | "no" | "false" => Ok(false),
        _ => Err(format!("expects 'on' or 'off' (got '{v}')")),
    }
}

/// Host page-cache use for image files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheMode {
    /// O_DIRECT (falls back to buffered I/O where unsupported).
    None,
    /// Buffered I/O through the page cache.
    Writeback,
}

impl ImageArgs {
    /// The open spec these arguments describe.
    pub fn spec(&self) -> Result<OpenSpec, crate::host::ToolError> {
        if !self.l2_slice_size.is_power_of_two() || self.l2_slice_size < 512 {
            return Err(crate::host::ToolError::Usage(format!(
                "--l2-slice-size must be a power of two of at least 512 (got {})",
                self.l2_slice_size
            )));
        }
        if self.cache_ways == 0 || self.cache_ways > 64 {
            return Err(crate::host::ToolError::Usage(
                "--cache-ways must be 1..=64".into(),
            ));
        }
        let ImageTarget { path, format, keys } =
            image_target(&self.image, self.format, &self.objects, self.image_opts)?;
        Ok(OpenSpec {
            path,
            format,
            keys,
            allow_backing: self.allow_backing,
            writable: false,
            opts: OpenOptions {
                l2_cache_bytes: self.l2_cache_size,
                l2_slice_bytes: self.l2_slice_size,
                cache_ways: self.cache_ways,
                ordered_layout: self.ordered_layout,
                alloc_granule: self.alloc_granule,
                pass_discard_request: self.pass_discard_request,
                pass_discard_snapshot: self.pass_discard_snapshot,
                pass_discard_other: self.pass_discard_other,
                ..OpenOptions::default()
            },
            queue_depth: 64,
            direct: self.cache == CacheMode::None,
            force_share: self.force_share,
        })
    }
}

/// The image a command names ([`image_target`]).
#[derive(Debug)]
pub struct ImageTarget {
    /// Its path.
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// The keys it is opened with.
    pub keys: crate::secrets::Keys,
}

/// The image's path, format and keys from the image argument, `-f`, `--object` and
/// `--image-opts` (then the argument is QEMU's option string).
pub fn image_target(
    image: &std::path::Path,
    format: Format,
    objects: &[String],
    image_opts: bool,
) -> Result<ImageTarget, crate::host::ToolError> {
    let usage = crate::host::ToolError::Usage;
    let secrets = crate::secrets::parse_objects(objects).map_err(usage)?;
    if !image_opts {
        return Ok(ImageTarget {
            path: image.to_path_buf(),
            format,
            keys: Default::default(),
        });
    }
    let o = crate::secrets::parse_image_opts(&image.to_string_lossy(), &secrets).map_err(usage)?;
    let format = if o.driver == "raw" {
        Format::Raw
    } else {
        Format::Qcow2
    };
    Ok(ImageTarget {
        path: o.path,
        format,
        keys: o.keys,
    })
}

/// `--output` choices, as qemu-img spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum OutputFormat {
    /// Human-readable text.
    #[default]
    Human,
    /// JSON.
    Json,
}
