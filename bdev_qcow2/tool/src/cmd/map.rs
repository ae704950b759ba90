//! `qcow2 map`: where each guest range comes from, with the same JSON shape, values and
//! merging as `qemu-img map --output=json`.

use super::{ImageArgs, OutputFormat};
use crate::host::{open_chain, Format, Opened, ToolError, ToolResult};
use crate::uring::{data_or_hole, UringDevice};
use qcow2_engine::format::ClusterMapping;
use std::fmt::Write;
use std::fs::File;

/// Arguments of `qcow2 map`.
#[derive(Debug, clap::Args)]
pub struct MapArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub output: OutputFormat,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// One map entry (qemu-img's `MapEntry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    /// Guest offset.
    pub start: u64,
    /// Length in bytes.
    pub length: u64,
    /// Chain depth the data was found at (0 = top).
    pub depth: usize,
    /// Allocated at that depth.
    pub present: bool,
    /// Reads as zeros.
    pub zero: bool,
    /// Holds data.
    pub data: bool,
    /// Compressed cluster.
    pub compressed: bool,
    /// Host offset in the layer's file, when known.
    pub offset: Option<u64>,
}

impl MapEntry {
    /// Whether `next` continues this entry (qemu-img's merge rule).
    pub(crate) fn merges_with(&self, next: &MapEntry) -> bool {
        self.start + self.length == next.start
            && self.depth == next.depth
            && self.present == next.present
            && self.zero == next.zero
            && self.data == next.data
            && self.compressed == next.compressed
            && match (self.offset, next.offset) {
                (None, None) => true,
                (Some(a), Some(b)) => a + self.length == b,
                _ => false,
            }
    }
}

/// How `map` reads one layer's file.
pub(crate) struct LayerFile {
    file: File,
    /// A raw layer: its file is the disk.
    raw: bool,
    /// Data clusters are looked through to the file (a hole there reads as zeros). QEMU
    /// does this only for an image it takes for metadata-preallocated (see
    /// [`metadata_preallocated`]); otherwise a data cluster is data, hole or not.
    look_through: bool,
}

/// Whether `q` looks metadata-preallocated the way QEMU decides it: clusters with a
/// nonzero refcount, counted up to the file's end, reach a tenth more than the clusters
/// the file system actually holds (at least two more).
async fn metadata_preallocated(
    q: &qcow2_engine::Qcow2<crate::uring::UringDevice>,
    file: &File,
) -> qcow2_engine::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = file.metadata() else {
        return Ok(false);
    };
    let cs = q.geometry().cluster_size();
    let real_clusters = md.blocks() * 512 / cs;
    let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
    let end_cluster = md.len().div_ceil(cs);
    let mut count = 0;
    let mut c = 0;
    while c < end_cluster && count < threshold {
        if q.refcount(c * cs).await? != 0 {
            count += 1;
        }
        c += 1;
    }
    Ok(count >= threshold)
}

/// Status of guest bytes at `pos` (up to `end`) through the chain, with each layer's file
/// ([`layer_files`]): QEMU's block status of the range (`bdrv_block_status_above` down to
/// the bottom of the chain), at most one L2 slice of the layer that decides it.
pub(crate) async fn chain_status(
    chain: &qcow2_engine::Chain<UringDevice>,
    files: &[LayerFile],
    pos: u64,
    end: u64,
) -> qcow2_engine::Result<MapEntry> {
    let layers = chain.layers();
    let mut idx = 0;
    let mut end = end;
    loop {
        if files[idx].raw {
            let (is_data, run_end) = data_or_hole(&files[idx].file, pos, end);
            return Ok(MapEntry {
                start: pos,
                length: run_end - pos,
                depth: idx,
                present: true,
                zero: !is_data,
                data: is_data,
                compressed: false,
                offset: Some(pos),
            });
        }
        let (m, n) = chain.block_status(idx, pos, end).await?;
        let sc = match &layers[idx] {
            qcow2_engine::Layer::Qcow2(q) => q.geometry().subcluster_size(),
            qcow2_engine::Layer::Raw { .. } => 1,
        };
        let off_in = |h: qcow2_engine::types::HostOffset| h.0 + (pos & (sc - 1));
        let mut e = MapEntry {
            start: pos,
            length: n,
            depth: idx,
            present: true,
            zero: false,
            data: false,
            compressed: false,
            offset: m.host().map(off_in),
        };
        match m {
            ClusterMapping::Data { host, .. } => {
                e.data = true;
                if files[idx].look_through {
                    // Data whose host bytes are a hole (or past the end of the file)
                    // reads as zeros.
                    let h = off_in(host);
                    let (is_data, run_end) = data_or_hole(&files[idx].file, h, h + n);
                    e.zero = !is_data;
                    e.length = run_end - h;
                }
            }
            ClusterMapping::Compressed(_) => {
                e.data = true;
                e.compressed = true;
            }
            ClusterMapping::Zero { .. } => e.zero = true,
            ClusterMapping::Unallocated { .. } => {
                let has_backing = idx + 1 < layers.len();
                if has_backing && pos < layers[idx + 1].size() {
                    // Look in the backing image, no further than its end.
                    end = (pos + n).min(layers[idx + 1].size());
                    idx += 1;
                    continue;
                }
                // Unallocated at the bottom, or past the backing image's end: zeros.
                e.present = false;
                e.zero = true;
            }
        }
        return Ok(e);
    }
}

/// Opens each layer's file of `o` for [`layer_files`] (with whether it is a raw layer).
pub(crate) fn open_layer_files(o: &Opened) -> ToolResult<Vec<(File, bool)>> {
    o.files
        .iter()
        .map(|(p, f)| {
            File::open(p)
                .map(|file| (file, *f == Format::Raw))
                .map_err(|source| ToolError::Io {
                    path: p.display().to_string(),
                    source,
                })
        })
        .collect()
}

/// The layer files [`chain_status`] reads, from [`open_layer_files`].
pub(crate) async fn layer_files(
    chain: &qcow2_engine::Chain<UringDevice>,
    files: Vec<(File, bool)>,
) -> qcow2_engine::Result<Vec<LayerFile>> {
    let mut layer_files = Vec::with_capacity(files.len());
    for ((file, raw), layer) in files.into_iter().zip(chain.layers()) {
        let look_through = match layer {
            qcow2_engine::Layer::Qcow2(q) => metadata_preallocated(q, &file).await?,
            qcow2_engine::Layer::Raw { .. } => false,
        };
        layer_files.push(LayerFile {
            file,
            raw,
            look_through,
        });
    }
    Ok(layer_files)
}

/// Computes the merged map of the whole disk.
pub fn compute(o: &Opened) -> ToolResult<Vec<MapEntry>> {
    let files = open_layer_files(o)?;
    let size = o.chain.size();
    let exec = o.exec.clone();
    // The walk runs as one task on the executor (slices are loaded on demand).
    let chain = o.chain.clone();
    let res = exec.block_on(async move {
        let layer_files = layer_files(&chain, files).await?;
        let mut out: Vec<MapEntry> = Vec::new();
        let mut pos = 0;
        while pos < size {
            let e = chain_status(&chain, &layer_files, pos, size).await?;
            pos += e.length;
            match out.last_mut() {
                Some(last) if last.merges_with(&e) => last.length += e.length,
                _ => out.push(e),
            }
        }
        Ok::<_, qcow2_engine::Error>(out)
    });
    res.map_err(|source| ToolError::Engine {
        path: o.files[0].0.display().to_string(),
        source,
    })
}

/// Renders entries exactly as `qemu-img map --output=json` prints them.
pub fn to_json(entries: &[MapEntry]) -> String {
    let mut s = String::from("[");
    for (i, e) in entries.iter().enumerate() {
        let _ = write!(
            s,
            "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \"data\": {}, \"compressed\": {}",
            e.start, e.length, e.depth, e.present, e.zero, e.data, e.compressed
        );
        if let Some(o) = e.offset {
            let _ = write!(s, ", \"offset\": {o}");
        }
        s.push('}');
        if i + 1 < entries.len() {
            s.push_str(",\n");
        }
    }
    s.push_str("]\n");
    s
}

/// Runs `qcow2 map`; returns the text to print.
pub fn run(args: &MapArgs) -> ToolResult<String> {
    let o = open_chain(&args.image.spec()?)?;
    let entries = compute(&o)?;
    match args.output {
        OutputFormat::Json => Ok(to_json(&entries)),
        OutputFormat::Human => {
            let mut s = format!(
                "{:<16}{:<16}{:<16}{}\n",
                "Offset", "Length", "Mapped to", "File"
            );
            for e in entries.iter().filter(|e| e.data) {
                let Some(off) = e.offset else {
                    return Err(ToolError::Usage(
                        "File contains external, encrypted or compressed clusters.".into(),
                    ));
                };
                let _ = writeln!(
                    s,
                    "{:<16}{:<16}{:<16}{}",
                    c_hex(e.start),
                    c_hex(e.length),
                    c_hex(off),
                    o.files[e.depth].0.display()
                );
            }
            Ok(s)
        }
    }
}

/// C's `%#x`: `0` for zero, `0x…` otherwise.
fn c_hex(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}
