//! The arguments of `qcow2 perf` and the workloads they name.

use crate::cmd::create::FormatOptions;
use crate::host::{ToolError, ToolResult};
use qcow2_engine::create::CreateOptions;
use qcow2_engine::ring::RingConfig;
use std::path::PathBuf;

/// Workload kinds (bdevperf's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential mix (-M % reads).
    Rw,
    /// Random mix (-M % reads).
    Randrw,
    /// Write, read back and compare.
    Verify,
}

impl Workload {
    pub(super) fn writes(self) -> bool {
        !matches!(self, Workload::Read | Workload::Randread)
    }
    pub(super) fn random(self) -> bool {
        matches!(
            self,
            Workload::Randread | Workload::Randwrite | Workload::Randrw | Workload::Verify
        )
    }
}

/// Arguments of `qcow2 perf`.
#[derive(Debug, Clone, clap::Args)]
pub struct PerfArgs {
    /// Queue depth per core.
    #[arg(short = 'q', default_value_t = 32)]
    pub depth: usize,
    /// I/O size (e.g. 4k, 128k), as `qemu-img bench -s`.
    #[arg(short = 's', long, value_parser = crate::parse_size, default_value = "4k")]
    pub io_size: u64,
    /// Workload. Without -w (and without an image), a default set runs.
    #[arg(short = 'w', value_enum)]
    pub workload: Option<Workload>,
    /// Percentage of reads for rw/randrw.
    #[arg(short = 'M', default_value_t = 50)]
    pub rwmix: u32,
    /// Seconds per run.
    #[arg(short = 't', default_value_t = 3.0)]
    pub seconds: f64,
    /// Polling cores (reactors) on one image: core 0 owns the metadata; the others serve
    /// cache hits and in-place writes themselves and send the rest to core 0.
    #[arg(long, default_value_t = 1)]
    pub cores: usize,
    /// L2 slice cache size per core.
    #[arg(long, value_parser = crate::parse_size)]
    pub l2_cache_size: Option<u64>,
    /// L2 slice size.
    #[arg(long, value_parser = crate::parse_size, default_value = "4096")]
    pub l2_slice_size: u64,
    /// Ways per set of the slice cache.
    #[arg(long, default_value_t = 8)]
    pub cache_ways: usize,
    /// Bytes a first write takes at once where the clusters read as zeros (the image's
    /// `alloc_granule`, as the tool's other commands take it; 0: one cluster per first
    /// write, as QEMU).
    #[arg(long, value_parser = crate::parse_size, default_value = "64K")]
    pub alloc_granule: u64,
    /// Added device latency in microseconds (like SPDK's delay bdev).
    #[arg(long, default_value_t = 0)]
    pub base_latency_us: u64,
    /// Cold metadata: no warm-up, every L2 slice is read when first needed (read-ahead
    /// shows here).
    #[arg(long)]
    pub cold: bool,
    /// Read-ahead on sequential streams: guest data into each core's prefetch ring, and
    /// L2 slices into its cache.
    #[arg(long, value_enum, default_value = "on")]
    pub prefetch: Switch,
    /// Bytes of prefetch ring per core (a multiple of 128 KiB).
    #[arg(long, value_parser = crate::parse_size, default_value = "5M")]
    pub ring_size: u64,
    /// Most bytes one stream reads ahead (a multiple of 128 KiB, at most 8M).
    #[arg(long, value_parser = crate::parse_size, default_value = "1M")]
    pub max_window: u64,
    /// Run only the raw baseline (the same workload on the same file as a raw disk).
    #[arg(long)]
    pub raw: bool,
    /// Buffered I/O instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// One JSON object per run instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Thrash runs: random reads (-w randread unless -w says otherwise) with the slice cache
    /// covering these percentages of the image's L2 slices (e.g. 25,50), each side by side
    /// with the same workload on a cache covering all of them, reporting the miss rate and
    /// IOPS against the bound IOPS(whole cache) / (1 + miss rate): one slice read per miss.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=100))]
    pub thrash: Vec<u32>,
    /// Chain mode: reads (-w randread unless -w names another read workload) through a
    /// chain of this many images, the sample image at the bottom holding all the data
    /// under empty overlays, side by side with the same reads through a chain of 2; each
    /// run opens its chain and reads the whole disk once first (both timed). Only without
    /// IMG.
    #[arg(long, value_name = "DEPTH")]
    pub chain: Option<usize>,
    /// Fresh image: the sample image is made empty (not written), anew before each of our
    /// runs, so every write of the run lands on a cluster that was never written (as into a
    /// VM's new overlay); the raw baseline is likewise an empty (sparse) file of the disk's
    /// size, made anew before each raw run (a raw disk's first writes: the file system
    /// allocates as it goes for both). Only without IMAGE.
    #[arg(long)]
    pub fresh: bool,
    /// Size of the sample image when no image is given.
    #[arg(long, value_parser = crate::parse_size, default_value = "1G")]
    pub sample_size: u64,
    /// Format options of the sample image, as `qcow2 create -o` takes them
    /// (`cluster_size=…,extended_l2=on,refcount_bits=…,compat=…,lazy_refcounts=…,
    /// compression_type=…,size=…`); may be repeated. Only without IMG.
    #[arg(short = 'o')]
    pub options: Vec<String>,
    /// A secret, as qemu-img's `--object secret,id=ID,data=…|file=…`.
    #[arg(long = "object")]
    pub objects: Vec<String>,
    /// The secret (an `--object` id) that unlocks an encrypted IMG (qemu-img's
    /// `encrypt.key-secret`).
    #[arg(long)]
    pub key_secret: Option<String>,
    /// The image (qcow2, no backing file; write workloads overwrite its data, like bdevperf).
    /// Default: a sample image in a temporary directory.
    pub image: Option<PathBuf>,
}

/// A feature turned on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

impl PerfArgs {
    /// The key `--key-secret` names.
    pub(super) fn key(&self) -> ToolResult<Option<crate::secrets::Secret>> {
        let secrets = crate::secrets::parse_objects(&self.objects).map_err(ToolError::Usage)?;
        self.key_secret
            .as_ref()
            .map(|id| {
                secrets
                    .get(id)
                    .cloned()
                    .ok_or_else(|| ToolError::Usage(format!("No secret with id '{id}'")))
            })
            .transpose()
    }

    /// The prefetch ring these arguments ask for (`None`: off).
    pub(super) fn ring(&self) -> ToolResult<Option<RingConfig>> {
        if self.prefetch == Switch::Off {
            return Ok(None);
        }
        let cfg = RingConfig {
            ring_bytes: self.ring_size,
            max_window: self.max_window,
        };
        cfg.validate().map_err(|e| ToolError::Usage(e.into()))?;
        Ok(Some(cfg))
    }

    /// What the sample image is created with: `-o` (parsed and checked as `qcow2 create`
    /// does), its size from `-o size=` or `--sample-size`.
    pub(super) fn sample_options(&self) -> ToolResult<CreateOptions> {
        let usage = |m: &str| Err(ToolError::Usage(m.into()));
        if self.image.is_some() && self.fresh {
            return usage("--fresh makes its own image: it does not apply to a given image");
        }
        if self.chain.is_some() && self.fresh {
            return usage("--chain reads data under empty overlays: it does not take --fresh");
        }
        if self.image.is_some() && !self.options.is_empty() {
            return usage("-o formats the sample image: it does not apply to a given image");
        }
        let mut fo = FormatOptions::default();
        for o in &self.options {
            fo.apply(o)?;
        }
        fo.validate()?;
        if fo.create.backing_file.is_some() {
            return usage("the sample image has no backing file");
        }
        if fo.prealloc_text.is_some() {
            return usage(
                "the sample image is always written in full: preallocation does not apply",
            );
        }
        fo.create.size = fo.size.unwrap_or(self.sample_size);
        Ok(fo.create)
    }
}
