//! `qcow2 compare`: whether two images read the same, with `qemu-img compare`'s walk,
//! messages and exit codes: 0 identical, 1 different, 2 an image could not be opened,
//! 3 a block status failed, 4 a read failed.
//!
//! Both images are walked by block status through their chains (QEMU's
//! `bdrv_block_status_above`, as `map` computes it): ranges that read as zeros in both, or
//! are allocated in neither, are skipped; the rest is read and compared, and the first
//! differing 512-byte sector is reported. Past the end of the smaller image the larger one
//! must read as zeros (a warning says the sizes differ). `-s` (strict) also fails on
//! different sizes and on any difference in block status (allocation, zero, data flags).

use super::map::{chain_status, layer_files, open_layer_files, LayerFile, MapEntry};
use super::ImageArgs;
use crate::host::{open_chain_on, Format, Opened, ToolError};
use crate::progress::Progress;
use crate::uring::{AlignedBuf, UringDevice};
use qcow2_engine::io::BufSlice;
use qcow2_engine::{Chain, Exec, Layer};
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

/// Bytes compared at once (qemu-img's `IO_BUF_SIZE`).
const CHUNK: u64 = 2 << 20;

/// Arguments of `qcow2 compare`.
#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// Format of the second image (never probed).
    #[arg(short = 'F', long = "b-format", value_enum, default_value = "qcow2")]
    pub b_format: Format,
    /// Strict mode: images of different sizes, or whose block status differs anywhere
    /// (one allocates what the other does not), are different.
    #[arg(short = 's', long = "strict")]
    pub strict: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// Quiet: print nothing (the exit status says the result).
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
    /// The second image.
    pub image2: PathBuf,
}

/// How a comparison ended (the exit status is its code).
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Identical,
    /// Different; the line saying where.
    Different(String),
    /// A block status failed (3) or a read failed (4), with the message.
    Failed(u8, String),
}

/// One image being compared.
struct Side {
    chain: Rc<Chain<UringDevice>>,
    files: Rc<Vec<LayerFile>>,
    name: String,
    /// Bytes one L2 table of the top image maps (QEMU's block status stops there).
    table: u64,
}

impl Side {
    fn size(&self) -> u64 {
        self.chain.size()
    }

    /// QEMU's block status at `pos` (up to `end`): one call's worth, i.e. merged across
    /// L2 slices up to the end of the top image's L2 table.
    async fn status(&self, pos: u64, end: u64) -> Result<MapEntry, Outcome> {
        let failed = |e: qcow2_engine::Error| {
            Outcome::Failed(
                3,
                format!("Sector allocation test failed for {}: {e}", self.name),
            )
        };
        let stop = end.min((pos / self.table + 1).saturating_mul(self.table));
        let mut e = chain_status(&self.chain, &self.files, pos, stop)
            .await
            .map_err(failed)?;
        while e.start + e.length < stop {
            let next = chain_status(&self.chain, &self.files, e.start + e.length, stop)
                .await
                .map_err(failed)?;
            if !e.merges_with(&next) {
                break;
            }
            e.length += next.length;
        }
        Ok(e)
    }

    /// Reads `len` bytes at `pos` into `buf`.
    async fn read(&self, buf: &AlignedBuf, pos: u64, len: u64) -> Result<(), Outcome> {
        let slice = BufSlice {
            buf: buf.clone(),
            off: 0,
            len: len as usize,
        };
        self.chain.read(pos, slice).await.map_err(|e| {
            Outcome::Failed(
                4,
                format!("Error while reading offset {pos} of {}: {e}", self.name),
            )
        })
    }

    /// The first sector (its offset) of `[pos, pos + len)` that does not read as zeros.
    async fn first_nonzero(&self, buf: &AlignedBuf, pos: u64, len: u64) -> Result<(), Outcome> {
        self.read(buf, pos, len).await?;
        match first_sector(len, |o, n| !buf.is_zero(o, n)) {
            Some(at) => Err(mismatch(pos + at)),
            None => Ok(()),
        }
    }
}

fn mismatch(at: u64) -> Outcome {
    Outcome::Different(format!("Content mismatch at offset {at}!"))
}

/// The offset of the first 512-byte sector of `len` bytes for which `differs(off, n)`.
fn first_sector(len: u64, differs: impl Fn(usize, usize) -> bool) -> Option<u64> {
    (0..len)
        .step_by(512)
        .find(|&o| differs(o as usize, (len - o).min(512) as usize))
}

/// The comparison proper (QEMU's `img_compare` loop).
async fn compare(a: Side, b: Side, opts: Opts, progress: &mut Progress) -> Outcome {
    match walk(&a, &b, opts, progress).await {
        Ok(()) => Outcome::Identical,
        Err(o) => o,
    }
}

/// What the command line asks of the walk.
#[derive(Debug, Clone, Copy)]
struct Opts {
    strict: bool,
    quiet: bool,
}

async fn walk(a: &Side, b: &Side, opts: Opts, progress: &mut Progress) -> Result<(), Outcome> {
    let strict = opts.strict;
    let (size_a, size_b) = (a.size(), b.size());
    let common = size_a.min(size_b);
    let total = size_a.max(size_b);
    progress.set(0.0);
    if strict && size_a != size_b {
        return Err(Outcome::Different(
            "Strict mode: Image size mismatch!".into(),
        ));
    }
    let (buf_a, buf_b) = (
        AlignedBuf::new(CHUNK as usize),
        AlignedBuf::new(CHUNK as usize),
    );
    let mut pos = 0;
    while pos < common {
        let sa = a.status(pos, size_a).await?;
        let sb = b.status(pos, size_b).await?;
        let mut chunk = sa.length.min(sb.length);
        if strict && !same_status(&sa, size_a, &sb, size_b) {
            return Err(Outcome::Different(format!(
                "Strict mode: Offset {pos} block status mismatch!"
            )));
        }
        if sa.zero && sb.zero {
            // Both read as zeros.
        } else if sa.present == sb.present {
            if sa.present {
                chunk = chunk.min(CHUNK);
                let (ra, rb) = (a.read(&buf_a, pos, chunk), b.read(&buf_b, pos, chunk));
                ra.await?;
                rb.await?;
                let differs = |o: usize, n: usize| buf_a.to_vec(o, n) != buf_b.to_vec(o, n);
                if let Some(at) = first_sector(chunk, differs) {
                    return Err(mismatch(pos + at));
                }
            }
        } else {
            chunk = chunk.min(CHUNK);
            let side = if sa.present { a } else { b };
            side.first_nonzero(&buf_a, pos, chunk).await?;
        }
        pos += chunk;
        progress.advance(chunk, total);
    }
    if size_a != size_b {
        say("Warning: Image size mismatch!", opts.quiet);
        let over = if size_a > size_b { a } else { b };
        while pos < total {
            let s = over.status(pos, total).await?;
            let mut chunk = s.length;
            if s.present && !s.zero {
                chunk = chunk.min(CHUNK);
                over.first_nonzero(&buf_a, pos, chunk).await?;
            }
            pos += chunk;
            progress.advance(chunk, total);
        }
    }
    Ok(())
}

/// Prints a line on stdout, unless quiet.
fn say(line: &str, quiet: bool) {
    if !quiet {
        println!("{line}");
    }
}

/// Whether two block statuses are equal as QEMU compares them in strict mode: the same
/// flags, including "reaches the end of the image" (QEMU's `BDRV_BLOCK_EOF`).
fn same_status(a: &MapEntry, size_a: u64, b: &MapEntry, size_b: u64) -> bool {
    let flags = |e: &MapEntry, size: u64| {
        (
            e.present,
            e.zero,
            e.data,
            e.compressed,
            e.offset.is_some(),
            e.start + e.length == size,
        )
    };
    flags(a, size_a) == flags(b, size_b)
}

/// Opens one side on `exec`; the error is printed by the caller (exit status 2).
fn open_side(exec: &Exec<UringDevice>, spec: &crate::host::OpenSpec) -> Result<Side, ToolError> {
    let o: Opened = open_chain_on(exec, spec, |d, _| d)?;
    let files = open_layer_files(&o)?;
    let table = match o.chain.layers().first() {
        Some(Layer::Qcow2(q)) => {
            let g = q.geometry();
            g.l2_entries() * g.cluster_size()
        }
        _ => u64::MAX,
    };
    let chain = o.chain.clone();
    let files = exec
        .block_on(async move { layer_files(&chain, files).await })
        .map_err(|source| ToolError::Engine {
            path: spec.path.display().to_string(),
            source,
        })?;
    Ok(Side {
        chain: o.chain,
        files: Rc::new(files),
        name: spec.path.display().to_string(),
        table,
    })
}

/// Runs `qcow2 compare`; prints the outcome and returns qemu-img's exit status.
pub fn main(args: &CompareArgs) -> ExitCode {
    let spec_a = match args.image.spec() {
        Ok(s) => s,
        Err(e) => return fail(2, &e.to_string()),
    };
    let mut spec_b = spec_a.clone();
    spec_b.path = args.image2.clone();
    spec_b.format = args.b_format;
    let exec = Exec::new();
    let sides = open_side(&exec, &spec_a).and_then(|a| Ok((a, open_side(&exec, &spec_b)?)));
    let (a, b) = match sides {
        Ok(s) => s,
        Err(e) => return fail(2, &e.to_string()),
    };
    let mut progress = Progress::new(args.progress && !args.quiet);
    let opts = Opts {
        strict: args.strict,
        quiet: args.quiet,
    };
    let (outcome, progress) = exec.block_on(async move {
        let o = compare(a, b, opts, &mut progress).await;
        (o, progress)
    });
    let code = match outcome {
        Outcome::Identical => {
            say("Images are identical.", opts.quiet);
            0
        }
        Outcome::Different(line) => {
            say(&line, opts.quiet);
            1
        }
        Outcome::Failed(code, msg) => {
            eprintln!("qcow2: {msg}");
            code
        }
    };
    progress.finish();
    ExitCode::from(code)
}

fn fail(code: u8, msg: &str) -> ExitCode {
    eprintln!("qcow2: {msg}");
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::first_sector;

    #[test]
    fn first_differing_sector() {
        let at = |bad: usize, len: u64| first_sector(len, |o, n| (o..o + n).contains(&bad));
        assert_eq!(at(0, 4096), Some(0));
        assert_eq!(at(513, 4096), Some(512));
        assert_eq!(at(4095, 4096), Some(3584));
        assert_eq!(at(5000, 4096), None);
        // A last partial sector is compared too.
        assert_eq!(at(1030, 1031), Some(1024));
    }
}
