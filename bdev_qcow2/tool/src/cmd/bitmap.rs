//! `qcow2 bitmap`: changes persistent dirty bitmaps of an image, like `qemu-img bitmap
//! --enable | --disable | --clear | --merge SRC [-b SRC_IMG [-F FMT]]`, through the
//! engine (the image opened for writing, the change stored at its close in the engine's
//! bitmap store order). Exit status 1 with qemu-img's "Operation … failed" line on error.
//!
//! Several operations run in a fixed order: clear, merge, enable, disable. `--add` and
//! `--remove` (which grow or shrink the bitmap directory and the header's bitmaps
//! extension) are refused: use `qemu-img bitmap` for them.

use crate::host::{open_single, open_top_only, Format, OpenSpec, ToolError, ToolResult};
use qcow2_engine::{BitmapChange, Layer, OpenOptions};
use std::path::{Path, PathBuf};

/// Arguments of `qcow2 bitmap`.
#[derive(Debug, clap::Args)]
pub struct BitmapArgs {
    /// Create BITMAP (not supported: use `qemu-img bitmap --add`).
    #[arg(long)]
    pub add: bool,
    /// Remove BITMAP (not supported: use `qemu-img bitmap --remove`).
    #[arg(long)]
    pub remove: bool,
    /// Clear every bit of BITMAP.
    #[arg(long)]
    pub clear: bool,
    /// Start recording guest writes in BITMAP.
    #[arg(long)]
    pub enable: bool,
    /// Stop recording guest writes in BITMAP.
    #[arg(long)]
    pub disable: bool,
    /// Set in BITMAP every bit set in bitmap SOURCE (of this image, or of -b's).
    #[arg(long, value_name = "SOURCE")]
    pub merge: Option<String>,
    /// The image holding the --merge source bitmap (opened read-only).
    #[arg(short = 'b', long = "source-file", value_name = "SRC_FILENAME")]
    pub source_file: Option<PathBuf>,
    /// Format of the -b image (only qcow2 holds bitmaps).
    #[arg(
        short = 'F',
        long = "source-format",
        value_enum,
        default_value = "qcow2"
    )]
    pub source_format: Format,
    /// Granularity of a new bitmap (only with --add).
    #[arg(short = 'g', long = "granularity")]
    pub granularity: Option<String>,
    /// Format of the image.
    #[arg(short = 'f', long = "format", value_enum, default_value = "qcow2")]
    pub format: Format,
    /// The image.
    pub image: PathBuf,
    /// The bitmap.
    pub bitmap: String,
}

fn spec(path: &Path, format: Format, writable: bool) -> OpenSpec {
    OpenSpec {
        path: path.to_path_buf(),
        format,
        allow_backing: false,
        writable,
        opts: OpenOptions::default(),
        queue_depth: 64,
        direct: false,
        force_share: false,
    }
}

/// Runs `qcow2 bitmap`; prints nothing on success, as qemu-img.
pub fn run(args: &BitmapArgs) -> ToolResult<String> {
    let usage = |m: &str| Err(ToolError::Usage(m.into()));
    let any = args.add
        || args.remove
        || args.clear
        || args.enable
        || args.disable
        || args.merge.is_some();
    if !any {
        return usage(
            "Need at least one of --add, --remove, --clear, --enable, --disable, or --merge",
        );
    }
    if args.granularity.is_some() && !args.add {
        return usage("granularity only supported with --add");
    }
    if args.source_file.is_some() && args.merge.is_none() {
        return usage("-b only supported with --merge");
    }
    let name = &args.bitmap;
    let failed = |op: &str, e: qcow2_engine::Error| {
        let msg = match e {
            qcow2_engine::Error::Refused(m) => m,
            e => e.to_string(),
        };
        ToolError::Usage(format!("Operation {op} on bitmap {name} failed: {msg}"))
    };
    for (on, op) in [(args.add, "add"), (args.remove, "remove")] {
        if on {
            return Err(ToolError::Usage(format!(
                "Operation {op} on bitmap {name} failed: not supported by this tool (it does \
                 not grow or shrink the bitmap directory); use qemu-img bitmap --{op}"
            )));
        }
    }
    if args.format != Format::Qcow2 {
        return Err(ToolError::Usage(format!(
            "Operation on bitmap {name} failed: a raw image has no persistent bitmaps"
        )));
    }
    // The merge source from another image, read before this one is opened for writing.
    let mut merge = None;
    if let Some(src) = &args.merge {
        if let Some(file) = &args.source_file {
            if args.source_format != Format::Qcow2 {
                return Err(failed(
                    "merge",
                    qcow2_engine::Error::Refused(format!("Dirty bitmap '{src}' not found")),
                ));
            }
            let (exec, q) = open_single(&spec(file, args.source_format, false))?;
            let s2 = src.clone();
            let bits = exec
                .block_on(async move { q.bitmap_bits(&s2).await })
                .map_err(|e| failed("merge", e))?;
            merge = Some(bits);
        }
    }
    let o = open_top_only(&spec(&args.image, args.format, true))?;
    let chain = o.chain.clone();
    let mut ops: Vec<(&str, Option<BitmapChange>)> = Vec::new();
    if args.clear {
        ops.push(("clear", Some(BitmapChange::Clear)));
    }
    if args.merge.is_some() {
        ops.push(("merge", merge.map(BitmapChange::Merge)));
    }
    if args.enable {
        ops.push(("enable", Some(BitmapChange::Enable)));
    }
    if args.disable {
        ops.push(("disable", Some(BitmapChange::Disable)));
    }
    let ops: Vec<(String, Option<BitmapChange>)> =
        ops.into_iter().map(|(o, c)| (o.to_string(), c)).collect();
    let (name2, src) = (name.clone(), args.merge.clone());
    let r = o.exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = chain.layers().first() else {
            return Err(("open".to_string(), qcow2_engine::Error::ReadOnly));
        };
        let mut done = Ok(());
        for (op, change) in ops {
            let change = match change {
                Some(c) => Ok(c),
                // A merge within this image: the source's bits as kept now.
                None => q
                    .bitmap_bits(src.as_deref().unwrap_or_default())
                    .await
                    .map(BitmapChange::Merge),
            };
            let r = match change {
                Ok(c) => q.change_bitmap(&name2, c).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                done = Err((op, e));
                break;
            }
        }
        // Closed either way: whatever changed is stored, the bitmaps consistent again.
        let closed = chain.close().await.map_err(|e| ("close".to_string(), e));
        done.and(closed)
    });
    r.map_err(|(op, e)| failed(&op, e))?;
    Ok(String::new())
}
