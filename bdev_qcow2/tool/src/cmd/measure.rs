//! `qcow2 measure`: the file size a new image needs, computed as `qemu-img measure` does
//! (`qcow2_measure`, `raw_measure`), so the numbers are QEMU's for the same inputs.
//!
//! For qcow2 output: "fully allocated" is the header cluster, every L2 and L1 table, the
//! refcount metadata that covers them (QEMU's fixed point) and every data cluster;
//! "required" drops the data clusters the input does not need: with `--size`, all of
//! them; with an image, those its block status (through its chain) shows as zeros or
//! unallocated. With an image and a qcow2 v3 target, the room its persistent bitmaps would
//! take is listed too ("bitmaps size").

use super::create::{FormatOptions, Preallocation};
use super::map::{chain_status, layer_files, open_layer_files};
use super::OutputFormat;
use crate::host::{open_chain, Format, OpenSpec, ToolError, ToolResult};
use qcow2_engine::format::measure::prealloc_size;
use qcow2_engine::{Layer, OpenOptions};
use serde_json::{json, Map, Value};
use std::path::PathBuf;

/// Arguments of `qcow2 measure`.
#[derive(Debug, clap::Args)]
pub struct MeasureArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub output: OutputFormat,
    /// Format of the image to create (raw, like qemu-img, unless given).
    #[arg(short = 'O', long = "target-format", value_enum, default_value = "raw")]
    pub target_format: Format,
    /// Options of the image to create, as for `qcow2 create -o` (repeatable).
    #[arg(short = 'o')]
    pub options: Vec<String>,
    /// Measure for a new image of this virtual size (instead of an input image).
    #[arg(short = 's', long = "size")]
    pub size: Option<String>,
    /// Format of the input image (never probed).
    #[arg(short = 'f', long = "format", value_enum, default_value = "qcow2")]
    pub format: Format,
    /// Allow opening backing files named inside the image.
    #[arg(long)]
    pub allow_backing: bool,
    /// Force sharing (qemu-img's `-U`): read an image another process may be writing.
    #[arg(short = 'U', long = "force-share")]
    pub force_share: bool,
    /// Secrets (`--object secret,…`), as qemu-img takes them (an input image is measured
    /// without its key: no guest data is read).
    #[arg(long = "object", value_name = "secret,id=ID,data=…|file=…")]
    pub objects: Vec<String>,
    /// The input image (its contents are to be converted into the new image).
    pub filenames: Vec<PathBuf>,
}

/// What `measure` found (QEMU's `BlockMeasureInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Bytes the new image needs for the input's data.
    pub required: u64,
    /// Bytes it takes fully allocated.
    pub fully_allocated: u64,
    /// Bytes the input's persistent bitmaps would take, when both images can hold them.
    pub bitmaps: Option<u64>,
}

/// Bytes one bitmap directory entry takes with a name of `name_len` bytes.
fn dir_entry_size(name_len: usize) -> u64 {
    (24 + name_len as u64).div_ceil(8) * 8
}

/// What the input image brings: its size, the bytes of clusters its data needs in a
/// target of `cluster_size`, and its persistent bitmaps (name, granularity), when it can
/// have any.
struct Input {
    size: u64,
    data: u64,
    bitmaps: Option<Vec<(String, u64)>>,
}

/// Reads what [`Input`] says from the image `spec` names.
fn read_input(spec: &OpenSpec, cluster_size: u64) -> ToolResult<Input> {
    let o = open_chain(spec)?;
    let files = open_layer_files(&o)?;
    let chain = o.chain.clone();
    let size = chain.size();
    let r = o.exec.block_on(async move {
        let files = layer_files(&chain, files).await?;
        let mut data = 0u64;
        let mut pos = 0u64;
        while pos < size {
            let e = chain_status(&chain, &files, pos, size).await?;
            let mut n = e.length;
            if !e.zero && e.data && e.present {
                // Counted from the start of the cluster to the end of the one it ends in.
                n = (pos + n).div_ceil(cluster_size) * cluster_size - pos;
                data += pos % cluster_size + n;
            }
            pos += n;
        }
        let bitmaps = match chain.layers().first() {
            Some(Layer::Qcow2(q)) if q.header().header.version >= 3 => Some(
                q.bitmap_directory()
                    .await?
                    .into_iter()
                    .map(|b| (b.name, 1u64 << b.granularity_bits))
                    .collect(),
            ),
            _ => None,
        };
        Ok::<_, qcow2_engine::Error>(Input {
            size,
            data,
            bitmaps,
        })
    });
    r.map_err(|source| ToolError::Engine {
        path: spec.path.display().to_string(),
        source,
    })
}

/// Bytes the bitmaps take in a qcow2 image of `size` bytes and `cluster_size` (QEMU's
/// `qcow2_get_persistent_dirty_bitmap_size`): each wholly allocated, its table, and the
/// directory.
fn bitmaps_size(bitmaps: &[(String, u64)], size: u64, cluster_size: u64) -> u64 {
    let mut total = 0;
    let mut dir = 0;
    for (name, granularity) in bitmaps {
        let bits = size.div_ceil(*granularity);
        let clusters = bits.div_ceil(8).div_ceil(cluster_size);
        total += clusters * cluster_size;
        total += (clusters * 8).div_ceil(cluster_size) * cluster_size;
        dir += dir_entry_size(name.len());
    }
    total + dir.div_ceil(cluster_size) * cluster_size
}

/// The measurement for a qcow2 target with options `fo`: of a new image of `fo.size`
/// bytes, or of `input` converted.
fn measure_qcow2(fo: &FormatOptions, input: Option<&Input>) -> ToolResult<Measured> {
    let c = &fo.create;
    let cs = 1u64 << c.cluster_bits;
    let mut size = fo.size.unwrap_or(0).div_ceil(cs) * cs;
    let l2e = if c.extended_l2 { 16 } else { 8 };
    let l2_tables = (size / cs).div_ceil(cs / l2e);
    if l2_tables.saturating_mul(8) > 32 << 20 {
        return Err(ToolError::Usage(
            "The image size is too large (try using a larger cluster size)".into(),
        ));
    }
    let mut required = 0;
    if let Some(i) = input {
        size = i.size.div_ceil(cs) * cs;
        // Whatever the backing file shares with the input is unknown: all of it.
        required = if c.backing_file.is_some() {
            size
        } else {
            i.data
        };
    }
    if matches!(
        fo.preallocation,
        Preallocation::Full | Preallocation::Falloc
    ) {
        required = size;
    }
    // An encrypted image's LUKS header area, in whole clusters, as QEMU counts it.
    let luks = fo.encrypt.area_bytes().map_or(0, |b| b.div_ceil(cs) * cs);
    let fully_allocated = prealloc_size(size, cs, c.refcount_order, c.extended_l2) + luks;
    let bitmaps = match input.and_then(|i| i.bitmaps.as_ref()) {
        Some(b) if c.version >= 3 => Some(bitmaps_size(b, input.map_or(0, |i| i.size), cs)),
        _ => None,
    };
    Ok(Measured {
        required: fully_allocated - size + required,
        fully_allocated,
        bitmaps,
    })
}

/// The measurement: of what the arguments describe.
pub fn measure(args: &MeasureArgs) -> ToolResult<Measured> {
    let usage = |m: &str| Err(ToolError::Usage(m.into()));
    let file = match (args.filenames.as_slice(), &args.size) {
        ([], None) => return usage("Either --size N or one filename must be specified."),
        ([_, ..], Some(_)) => return usage("--size N cannot be used together with a filename."),
        ([_, _, ..], None) => return usage("At most one filename argument is allowed."),
        ([f], None) => Some(f),
        ([], Some(_)) => None,
    };
    let mut fo = FormatOptions::default();
    for o in &args.options {
        fo.apply(o)?;
    }
    crate::secrets::parse_objects(&args.objects).map_err(ToolError::Usage)?;
    if let Some(s) = &args.size {
        fo.size = Some(
            super::create::parse_qemu_size(s)
                .map_err(|_| ToolError::Usage(format!("Invalid image size specified: '{s}'.")))?,
        );
    }
    if args.target_format == Format::Qcow2 {
        fo.validate()?;
    } else if fo.create != qcow2_engine::create::CreateOptions::default() || fo.encrypt.any() {
        return usage("Invalid parameter for the raw format (only size and preallocation)");
    }
    let spec = |path: &PathBuf| OpenSpec {
        keys: Default::default(),
        path: path.clone(),
        format: args.format,
        allow_backing: args.allow_backing,
        writable: false,
        opts: OpenOptions::default(),
        queue_depth: 64,
        direct: false,
        force_share: args.force_share,
    };
    let cs = 1u64 << fo.create.cluster_bits;
    let input = file.map(|f| read_input(&spec(f), cs)).transpose()?;
    match args.target_format {
        Format::Qcow2 => measure_qcow2(&fo, input.as_ref()),
        Format::Raw => {
            let required = match &input {
                Some(i) => i.size,
                None => fo.size.unwrap_or(0).div_ceil(512) * 512,
            };
            Ok(Measured {
                required,
                fully_allocated: required,
                bitmaps: None,
            })
        }
    }
}

/// Runs `qcow2 measure`; returns the text to print.
pub fn run(args: &MeasureArgs) -> ToolResult<String> {
    let m = measure(args)?;
    Ok(match args.output {
        OutputFormat::Human => {
            let mut s = format!(
                "required size: {}\nfully allocated size: {}\n",
                m.required, m.fully_allocated
            );
            if let Some(b) = m.bitmaps {
                s += &format!("bitmaps size: {b}\n");
            }
            s
        }
        OutputFormat::Json => {
            let mut v = Map::new();
            if let Some(b) = m.bitmaps {
                v.insert("bitmaps".into(), json!(b));
            }
            v.insert("required".into(), json!(m.required));
            v.insert("fully-allocated".into(), json!(m.fully_allocated));
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            serde::Serialize::serialize(&Value::Object(v), &mut ser)
                .map_err(|e| ToolError::Usage(e.to_string()))?;
            String::from_utf8_lossy(&buf).into_owned() + "\n"
        }
    })
}
