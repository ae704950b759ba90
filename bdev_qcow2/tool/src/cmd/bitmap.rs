//! `qcow2 bitmap`: adds, removes and changes persistent dirty bitmaps of an image, like
//! `qemu-img bitmap --add [-g GRANULARITY] | --remove | --enable | --disable | --clear |
//! --merge SRC [-b SRC_IMG [-F FMT]]`, through the engine (the image opened for writing;
//! an add or remove switches the bitmap directory at once, in the engine's crash-safe
//! order; the other changes are stored at close). Exit status 1 with qemu-img's
//! "Operation … failed" line on error.
//!
//! Several operations run in the order given, as qemu-img runs them, up to the first that
//! fails. `--add` makes a disabled bitmap when `--disable` is given too; its granularity
//! defaults to QEMU's (the cluster size, within 4 KiB ..= 64 KiB).

use crate::host::{open_single, open_top_only, Format, OpenSpec, ToolError, ToolResult};
use crate::secrets::Keys;
use qcow2_engine::{BitmapChange, Layer, OpenOptions};
use std::path::{Path, PathBuf};

/// Arguments of `qcow2 bitmap`.
#[derive(Debug, clap::Args)]
pub struct BitmapArgs {
    /// Create BITMAP (enabled, unless --disable is given too).
    #[arg(long)]
    pub add: bool,
    /// Remove BITMAP, freeing its clusters.
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
    /// Granularity of a new bitmap in bytes, a power of 2 of at least 512 (k, M, G
    /// suffixes; only with --add; 0: the default).
    #[arg(short = 'g', long = "granularity", allow_hyphen_values = true)]
    pub granularity: Option<String>,
    /// Format of the image.
    #[arg(short = 'f', long = "format", value_enum, default_value = "qcow2")]
    pub format: Format,
    /// A secret, as qemu-img's `--object secret,id=ID,data=…|file=…` (repeatable): the
    /// key of an encrypted image, named with `--image-opts`.
    #[arg(long = "object", value_name = "secret,id=ID,data=…|file=…")]
    pub objects: Vec<String>,
    /// The image argument is an option string, as qemu-img's `--image-opts`
    /// (`driver=qcow2,file.filename=IMG,encrypt.key-secret=ID`).
    #[arg(long)]
    pub image_opts: bool,
    /// The image (with `--image-opts`, its option string).
    pub image: PathBuf,
    /// The bitmap.
    pub bitmap: String,
    /// The operations in the order given on the command line (the ids `add`, `remove`,
    /// `clear`, `enable`, `disable`, `merge`), filled by the caller from its parse; empty:
    /// that order.
    #[arg(skip)]
    pub order: Vec<String>,
}

/// The ids of the operation arguments, in the order a caller that knows none runs them.
pub const OPERATIONS: [&str; 6] = ["add", "clear", "merge", "enable", "disable", "remove"];

/// The operations of `m` (the subcommand's matches) in command-line order.
pub fn order_of(m: &clap::ArgMatches) -> Vec<String> {
    let mut at: Vec<(usize, &str)> = OPERATIONS
        .iter()
        .filter(|id| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        .filter_map(|id| m.index_of(id).map(|i| (i, *id)))
        .collect();
    at.sort();
    at.into_iter().map(|(_, id)| id.to_string()).collect()
}

/// `-g` as qemu-img reads it: a size (0: none given), then cut to 32 bits as QEMU passes
/// it on (so 4G is refused as 0 is, like qemu-img does).
fn granularity(arg: &str) -> ToolResult<Option<u32>> {
    if arg.trim_start().starts_with('-') {
        return Err(ToolError::Usage(
            "Invalid granularity specified. Must be between 0 and 9223372036854775807.".into(),
        ));
    }
    let g = crate::parse_size(arg)
        .ok()
        .filter(|g| *g <= i64::MAX as u64)
        .ok_or_else(|| ToolError::Usage(format!("Invalid granularity specified: '{arg}'.")))?;
    Ok((g != 0).then_some(g as u32))
}

/// One operation.
enum Op {
    Add,
    Remove,
    /// A change; a merge within this image has none yet (its source is read when it runs).
    Change(Option<BitmapChange>),
}

fn spec(path: &Path, format: Format, writable: bool, keys: Keys) -> OpenSpec {
    OpenSpec {
        keys,
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
    let gran = match &args.granularity {
        Some(g) => granularity(g)?,
        None => None,
    };
    if gran.is_some() && !args.add {
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
            let (exec, q) = open_single(&spec(file, args.source_format, false, Keys::default()))?;
            let s2 = src.clone();
            let bits = exec
                .block_on(async move { q.bitmap_bits(&s2).await })
                .map_err(|e| failed("merge", e))?;
            merge = Some(bits);
        }
    }
    let super::ImageTarget { path, format, keys } =
        super::image_target(&args.image, args.format, &args.objects, args.image_opts)?;
    if format != Format::Qcow2 {
        return Err(ToolError::Usage(format!(
            "Operation on bitmap {name} failed: a raw image has no persistent bitmaps"
        )));
    }
    let o = open_top_only(&spec(&path, format, true, keys))?;
    let chain = o.chain.clone();
    let on = |id: &str| match id {
        "add" => args.add,
        "remove" => args.remove,
        "clear" => args.clear,
        "enable" => args.enable,
        "disable" => args.disable,
        "merge" => args.merge.is_some(),
        _ => false,
    };
    let order: Vec<String> = if args.order.is_empty() {
        OPERATIONS
            .iter()
            .filter(|id| on(id))
            .map(|id| id.to_string())
            .collect()
    } else {
        args.order.clone()
    };
    let mut merge = merge.map(BitmapChange::Merge);
    let ops: Vec<(String, Op)> = order
        .into_iter()
        .map(|id| {
            let op = match id.as_str() {
                "add" => Op::Add,
                "remove" => Op::Remove,
                "clear" => Op::Change(Some(BitmapChange::Clear)),
                "enable" => Op::Change(Some(BitmapChange::Enable)),
                "disable" => Op::Change(Some(BitmapChange::Disable)),
                _ => Op::Change(merge.take()),
            };
            (id, op)
        })
        .collect();
    // --disable with --add makes the new bitmap disabled, as qemu-img does.
    let enabled = !args.disable;
    let (name2, src) = (name.clone(), args.merge.clone());
    let r = o.exec.block_on(async move {
        let Some(Layer::Qcow2(q)) = chain.layers().first() else {
            return Err(("open".to_string(), qcow2_engine::Error::ReadOnly));
        };
        let mut done = Ok(());
        for (op, what) in ops {
            let r = match what {
                Op::Add => q.add_bitmap(&name2, gran, enabled).await,
                Op::Remove => q.remove_bitmap(&name2).await,
                Op::Change(change) => {
                    let change = match change {
                        Some(c) => Ok(c),
                        // A merge within this image: the source's bits as kept now.
                        None => q
                            .bitmap_bits(src.as_deref().unwrap_or_default())
                            .await
                            .map(BitmapChange::Merge),
                    };
                    match change {
                        Ok(c) => q.change_bitmap(&name2, c).await,
                        Err(e) => Err(e),
                    }
                }
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
