//! `qcow2 io`: scripted guest I/O through the engine, in the manner of `qemu-io`.
//!
//! Commands (`-c`, repeatable, run in order): `read [-q] [-P pattern] OFF LEN`,
//! `write [-q] [-P pattern] OFF LEN` (pattern 0xcd by default, like qemu-io),
//! `write -z [-u] [-q] OFF LEN`, `discard [-q] OFF LEN`, `flush`, `sleep MS` (holds the
//! image open, and its locks, for MS milliseconds). Offsets and lengths take
//! k/M/G suffixes and need no alignment: partial 512-byte sectors are read, patched and
//! written back here (the engine only takes whole sectors). The image is opened writable
//! only if some command writes (never with `-r`, which makes writing commands fail like
//! qemu-io's "Block node is read-only"), and flushed at the end.
//!
//! `--log-writes LOG` records every write and flush the engine issues to the image file in
//! the dm-log-writes format (see [`crate::logwrites`]), with a mark `flush-N` after the
//! N-th flush completes (counting from 1; the final flush at close — `Chain::close`, which
//! also clears a lazy-refcount image's dirty bit — counts too).

use super::ImageArgs;
use crate::host::{open_chain_with, ToolError, ToolResult};
use crate::logwrites::{LogWrites, WriteLog};
use crate::uring::UringDevice;
use qcow2_engine::io::{BufSlice, IoBuffer, SECTOR};
use qcow2_engine::{Chain, DevId, Layer};
use std::cell::RefCell;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;

/// Arguments of `qcow2 io`.
#[derive(Debug, clap::Args)]
pub struct IoArgs {
    /// A command to run (repeatable; qemu-io syntax): read, write, write -z, discard, flush.
    #[arg(short = 'c', long = "cmd")]
    pub commands: Vec<String>,
    /// Open the image read-only (as `qemu-io -r`): writing commands fail.
    #[arg(short = 'r', long = "read-only")]
    pub read_only: bool,
    /// Record every write and flush issued to the image in dm-log-writes format.
    #[arg(long)]
    pub log_writes: Option<PathBuf>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// One parsed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoCmd {
    /// Read, verifying a byte pattern if given.
    Read {
        /// Byte every read byte must equal.
        pattern: Option<u8>,
        /// Guest offset.
        off: u64,
        /// Length.
        len: u64,
        /// No report.
        quiet: bool,
    },
    /// Write a byte pattern.
    Write {
        /// The byte written.
        pattern: u8,
        /// Guest offset.
        off: u64,
        /// Length.
        len: u64,
        /// No report.
        quiet: bool,
    },
    /// Write zeroes (`unmap`: clusters may be deallocated).
    WriteZeroes {
        /// May deallocate.
        unmap: bool,
        /// Guest offset.
        off: u64,
        /// Length.
        len: u64,
        /// No report.
        quiet: bool,
    },
    /// Discard (whole sectors inside the range).
    Discard {
        /// Guest offset.
        off: u64,
        /// Length.
        len: u64,
        /// No report.
        quiet: bool,
    },
    /// Guest flush.
    Flush,
    /// Wait, the image held open (qemu-io's `sleep`).
    Sleep {
        /// Milliseconds.
        ms: u64,
    },
}

impl IoCmd {
    /// Whether the command needs the image open for writing.
    pub fn writes(&self) -> bool {
        !matches!(
            self,
            IoCmd::Read { .. } | IoCmd::Flush | IoCmd::Sleep { .. }
        )
    }
}

/// qemu-io's pattern byte: a C integer literal (decimal, 0x hex or 0 octal) up to 255.
fn parse_pattern(s: &str) -> Result<u8, String> {
    let bad = || format!("{s} is not a valid pattern byte");
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).map_err(|_| bad())?
    } else if s.len() > 1 && s.starts_with('0') {
        u64::from_str_radix(&s[1..], 8).map_err(|_| bad())?
    } else {
        s.parse::<u64>().map_err(|_| bad())?
    };
    u8::try_from(v).map_err(|_| bad())
}

fn parse_num(s: &str) -> Result<u64, String> {
    super::create::parse_qemu_size(s).map_err(|_| format!("non-numeric argument -- {s}"))
}

/// Parses one command line.
pub fn parse_cmd(line: &str) -> Result<IoCmd, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&name, rest)) = words.split_first() else {
        return Err("empty command".into());
    };
    let mut pattern = None;
    let (mut zero, mut unmap, mut quiet) = (false, false, false);
    let mut pos = Vec::new();
    let mut i = 0;
    while i < rest.len() {
        let w = rest[i];
        match w {
            "-P" if name == "read" || name == "write" => {
                let v = rest.get(i + 1).ok_or("option -P needs a pattern")?;
                pattern = Some(parse_pattern(v)?);
                i += 1;
            }
            "-z" if name == "write" => zero = true,
            "-u" if name == "write" => unmap = true,
            "-q" => quiet = true,
            _ if w.starts_with('-') && w.len() > 1 => {
                return Err(format!("{name}: unsupported option {w}"))
            }
            _ => pos.push(w),
        }
        i += 1;
    }
    let two = |pos: &[&str]| -> Result<(u64, u64), String> {
        match pos {
            [o, l] => Ok((parse_num(o)?, parse_num(l)?)),
            _ => Err(format!("{name}: expects OFF LEN")),
        }
    };
    match name {
        "read" => {
            let (off, len) = two(&pos)?;
            Ok(IoCmd::Read {
                pattern,
                off,
                len,
                quiet,
            })
        }
        "write" => {
            let (off, len) = two(&pos)?;
            if zero && pattern.is_some() {
                return Err("-z and -P cannot be specified at the same time".into());
            }
            if unmap && !zero {
                return Err("-u requires -z to be specified".into());
            }
            if zero {
                Ok(IoCmd::WriteZeroes {
                    unmap,
                    off,
                    len,
                    quiet,
                })
            } else {
                Ok(IoCmd::Write {
                    pattern: pattern.unwrap_or(0xcd),
                    off,
                    len,
                    quiet,
                })
            }
        }
        "discard" => {
            let (off, len) = two(&pos)?;
            Ok(IoCmd::Discard { off, len, quiet })
        }
        "flush" if pos.is_empty() => Ok(IoCmd::Flush),
        "flush" => Err("flush takes no arguments".into()),
        "sleep" => match pos[..] {
            [ms] => Ok(IoCmd::Sleep {
                ms: ms
                    .parse()
                    .map_err(|_| format!("sleep: invalid milliseconds '{ms}'"))?,
            }),
            _ => Err("sleep: expects MS".into()),
        },
        _ => Err(format!("command \"{name}\" not found")),
    }
}

/// qemu's `cvtstr`: "64 KiB", "1.500 KiB", "512 bytes".
fn cvtstr(v: f64) -> String {
    const UNITS: [(f64, &str); 6] = [
        (1152921504606846976.0, " EiB"),
        (1125899906842624.0, " PiB"),
        (1099511627776.0, " TiB"),
        (1073741824.0, " GiB"),
        (1048576.0, " MiB"),
        (1024.0, " KiB"),
    ];
    let (div, suffix) = UNITS
        .iter()
        .find(|(d, _)| v >= *d)
        .copied()
        .unwrap_or((1.0, " bytes"));
    let s = format!("{:.3}", v / div);
    match s.strip_suffix(".000") {
        Some(t) => format!("{t}{suffix}"),
        None => format!("{s}{suffix}"),
    }
}

/// qemu-io's two report lines.
fn report(op: &str, off: u64, len: u64, secs: f64) -> String {
    let secs_nz = secs.max(1e-9);
    format!(
        "{op} {len}/{len} bytes at offset {off}\n{}, 1 ops; {:05.2} sec ({}/sec and {:.4} ops/sec)\n",
        cvtstr(len as f64),
        secs,
        cvtstr(len as f64 / secs_nz),
        1.0 / secs_nz
    )
}

type Dev = LogWrites<UringDevice>;

fn top_dev(chain: &Chain<Dev>) -> DevId {
    match &chain.layers()[0] {
        Layer::Qcow2(q) => q.dev(),
        Layer::Raw { dev, .. } => *dev,
    }
}

fn check_range(chain: &Chain<Dev>, off: u64, len: u64) -> qcow2_engine::Result<()> {
    if off.checked_add(len).is_none_or(|e| e > chain.size()) {
        return Err(qcow2_engine::Error::InvalidRequest(
            "request past the end of the disk",
        ));
    }
    Ok(())
}

/// Reads any byte range (sector-aligned reads underneath).
async fn read_bytes(chain: Rc<Chain<Dev>>, off: u64, len: u64) -> qcow2_engine::Result<Vec<u8>> {
    check_range(&chain, off, len)?;
    let a = off / SECTOR * SECTOR;
    let b = (off + len).div_ceil(SECTOR) * SECTOR;
    let buf = chain.exec().alloc_buf(top_dev(&chain), (b - a) as usize);
    chain.read(a, BufSlice::whole(buf.clone())).await?;
    let mut out = vec![0u8; len as usize];
    buf.copy_out((off - a) as usize, &mut out);
    Ok(out)
}

/// Writes any byte range: partial head and tail sectors are read, patched and written back
/// with the rest in one request.
async fn write_bytes(chain: Rc<Chain<Dev>>, off: u64, data: Vec<u8>) -> qcow2_engine::Result<()> {
    let len = data.len() as u64;
    check_range(&chain, off, len)?;
    if len == 0 {
        return Ok(());
    }
    let end = off + len;
    let a = off / SECTOR * SECTOR;
    let b = end.div_ceil(SECTOR) * SECTOR;
    let buf = chain.exec().alloc_buf(top_dev(&chain), (b - a) as usize);
    let sector = |at: u64| BufSlice {
        buf: buf.clone(),
        off: (at - a) as usize,
        len: SECTOR as usize,
    };
    if off != a {
        chain.read(a, sector(a)).await?;
    }
    if end != b && (b - SECTOR != a || off == a) {
        chain.read(b - SECTOR, sector(b - SECTOR)).await?;
    }
    buf.copy_in((off - a) as usize, &data);
    chain.write(a, BufSlice::whole(buf)).await
}

/// Write-zeroes over any byte range: whole sectors through the engine's write-zeroes,
/// partial ones as data.
async fn write_zeroes(
    chain: Rc<Chain<Dev>>,
    off: u64,
    len: u64,
    unmap: bool,
) -> qcow2_engine::Result<()> {
    check_range(&chain, off, len)?;
    let end = off + len;
    let a = off.div_ceil(SECTOR) * SECTOR;
    let b = end / SECTOR * SECTOR;
    if a >= b {
        return write_bytes(chain, off, vec![0; len as usize]).await;
    }
    if off < a {
        write_bytes(chain.clone(), off, vec![0; (a - off) as usize]).await?;
    }
    if b < end {
        write_bytes(chain.clone(), b, vec![0; (end - b) as usize]).await?;
    }
    chain.write_zeroes(a, b - a, unmap).await
}

/// Discards the whole sectors inside the range (discard is advisory).
async fn discard(chain: Rc<Chain<Dev>>, off: u64, len: u64) -> qcow2_engine::Result<()> {
    check_range(&chain, off, len)?;
    let a = off.div_ceil(SECTOR) * SECTOR;
    let b = (off + len) / SECTOR * SECTOR;
    if a < b {
        chain.discard(a, b - a).await?;
    }
    Ok(())
}

/// Runs the commands; prints as it goes. Returns whether every command succeeded.
fn run_commands(
    chain: &Rc<Chain<Dev>>,
    cmds: &[IoCmd],
    writable: bool,
    log: Option<&Rc<RefCell<WriteLog>>>,
    out: &mut dyn Write,
) -> bool {
    let exec = chain.exec().clone();
    let mut ok = true;
    let mut flushes = 0u64;
    // `close`: the final flush, which also clears the dirty bit of lazy-refcount images.
    let mut flush = |ok: &mut bool, out: &mut dyn Write, close: bool| {
        if !writable {
            return;
        }
        let c = chain.clone();
        let r = if close {
            exec.block_on(async move { c.close().await })
        } else {
            exec.block_on(async move { c.flush().await })
        };
        match r {
            Ok(()) => {
                flushes += 1;
                if let Some(l) = log {
                    l.borrow_mut().mark(&format!("flush-{flushes}"));
                }
            }
            Err(e) => {
                let _ = writeln!(out, "flush failed: {e}");
                *ok = false;
            }
        }
    };
    for cmd in cmds {
        if cmd.writes() && !writable {
            // qemu-io -r: the command fails, the others still run.
            eprintln!("qcow2: Block node is read-only");
            ok = false;
            continue;
        }
        let t0 = Instant::now();
        let c = chain.clone();
        match *cmd {
            IoCmd::Read {
                pattern,
                off,
                len,
                quiet,
            } => match exec.block_on(read_bytes(c, off, len)) {
                Ok(data) => {
                    let secs = t0.elapsed().as_secs_f64();
                    if let Some(p) = pattern {
                        if data.iter().any(|b| *b != p) {
                            let _ = writeln!(
                                out,
                                "Pattern verification failed at offset {off}, {len} bytes"
                            );
                            ok = false;
                        }
                    }
                    if !quiet {
                        let _ = out.write_all(report("read", off, len, secs).as_bytes());
                    }
                }
                Err(e) => {
                    let _ = writeln!(out, "read failed: {e}");
                    ok = false;
                }
            },
            IoCmd::Write {
                pattern,
                off,
                len,
                quiet,
            } => {
                let r = exec.block_on(write_bytes(c, off, vec![pattern; len as usize]));
                ok &= done("write", "wrote", r, off, len, quiet, t0, out);
            }
            IoCmd::WriteZeroes {
                unmap,
                off,
                len,
                quiet,
            } => {
                let r = exec.block_on(write_zeroes(c, off, len, unmap));
                ok &= done("write", "wrote", r, off, len, quiet, t0, out);
            }
            IoCmd::Discard { off, len, quiet } => {
                let r = exec.block_on(discard(c, off, len));
                ok &= done("discard", "discard", r, off, len, quiet, t0, out);
            }
            IoCmd::Flush => flush(&mut ok, out, false),
            IoCmd::Sleep { ms } => {
                // Output so far is seen before the wait (a test waits on it).
                let _ = out.flush();
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
        }
    }
    // Close: make everything durable, like qemu-io's bdrv_close.
    flush(&mut ok, out, true);
    ok
}

#[allow(clippy::too_many_arguments)]
fn done(
    name: &str,
    verb: &str,
    r: qcow2_engine::Result<()>,
    off: u64,
    len: u64,
    quiet: bool,
    t0: Instant,
    out: &mut dyn Write,
) -> bool {
    match r {
        Ok(()) => {
            if !quiet {
                let secs = t0.elapsed().as_secs_f64();
                let _ = out.write_all(report(verb, off, len, secs).as_bytes());
            }
            true
        }
        Err(e) => {
            let _ = writeln!(out, "{name} failed: {e}");
            false
        }
    }
}

fn run(args: &IoArgs, out: &mut dyn Write) -> ToolResult<bool> {
    let cmds = args
        .commands
        .iter()
        .map(|c| parse_cmd(c).map_err(ToolError::Usage))
        .collect::<ToolResult<Vec<_>>>()?;
    let writable = !args.read_only && cmds.iter().any(IoCmd::writes);
    let mut spec = args.image.spec()?;
    if writable && spec.format == crate::host::Format::Raw {
        return Err(ToolError::Usage(
            "writing raw images is not supported (qcow2 io writes through the qcow2 engine)".into(),
        ));
    }
    spec.writable = writable;
    let log = match &args.log_writes {
        Some(p) => Some(WriteLog::create(p).map_err(|source| ToolError::Io {
            path: p.display().to_string(),
            source,
        })?),
        None => None,
    };
    let o = open_chain_with(&spec, |dev, top| {
        LogWrites::new(dev, if top { log.clone() } else { None })
    })?;
    let ok = run_commands(&o.chain, &cmds, writable, log.as_ref(), out);
    drop(o);
    if let (Some(l), Some(p)) = (&log, &args.log_writes) {
        l.borrow_mut().finish().map_err(|source| ToolError::Io {
            path: p.display().to_string(),
            source,
        })?;
    }
    Ok(ok)
}

/// Runs `qcow2 io`: exit status 0 when every command succeeded (and every pattern
/// matched), 1 otherwise.
pub fn main(args: &IoArgs) -> ExitCode {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let r = run(args, &mut out);
    let _ = out.flush();
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("qcow2: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        assert_eq!(
            parse_cmd("write -P 0xab 64k 1M"),
            Ok(IoCmd::Write {
                pattern: 0xab,
                off: 65536,
                len: 1 << 20,
                quiet: false
            })
        );
        assert_eq!(
            parse_cmd("write 0 512"),
            Ok(IoCmd::Write {
                pattern: 0xcd,
                off: 0,
                len: 512,
                quiet: false
            })
        );
        assert_eq!(
            parse_cmd("write -z -u 1 2"),
            Ok(IoCmd::WriteZeroes {
                unmap: true,
                off: 1,
                len: 2,
                quiet: false
            })
        );
        assert_eq!(parse_cmd("flush"), Ok(IoCmd::Flush));
        assert_eq!(parse_cmd("sleep 250"), Ok(IoCmd::Sleep { ms: 250 }));
        assert!(parse_cmd("sleep").is_err());
        assert!(parse_cmd("write -u 0 1").is_err());
        assert!(parse_cmd("read -P 256 0 1").is_err());
        assert!(parse_cmd("bogus").is_err());
        assert_eq!(parse_pattern("010"), Ok(8));
    }

    #[test]
    fn sizes_as_qemu_prints_them() {
        assert_eq!(cvtstr(65536.0), "64 KiB");
        assert_eq!(cvtstr(1536.0), "1.500 KiB");
        assert_eq!(cvtstr(512.0), "512 bytes");
    }
}
