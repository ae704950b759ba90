//! `qcow2 check`: consistency check and repair, shaped like `qemu-img check` (same counts,
//! human and JSON output, exit codes: 0 clean, 1 check failed, 2 corruptions, 3 leaks only,
//! 63 format without checks).
//!
//! As qemu-img does, a repair that fixed something is followed by a second, read-only check
//! whose findings are reported together with the repaired counts.

use super::{CacheMode, OutputFormat};
use crate::host::{lock_device, Format};
use crate::lock::Access;
use crate::uring::{OpenMode, UringDevice};
use qcow2_engine::check::{check, CheckReport, Repair};
use qcow2_engine::Exec;
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// What `-r` may repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RepairArg {
    /// Leaked clusters only.
    Leaks,
    /// Leaks and refcount errors (and wrong COPIED flags).
    All,
}

/// Arguments of `qcow2 check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub output: OutputFormat,
    /// Repair the image (opens it writable).
    #[arg(short = 'r', long = "repair", value_enum)]
    pub repair: Option<RepairArg>,
    /// Image format (never probed).
    #[arg(short = 'f', long = "format", value_enum, default_value = "qcow2")]
    pub format: Format,
    /// Cache mode of the image file (`none`: O_DIRECT where the file system allows it).
    #[arg(short = 'T', long = "cache", value_enum, default_value = "none")]
    pub cache: CacheMode,
    /// Force sharing (qemu-img's `-U`): take no lock that keeps others from writing the
    /// image meanwhile (the check may then report what a writer is changing). Not with
    /// `-r`.
    #[arg(short = 'U', long = "force-share")]
    pub force_share: bool,
    /// Print nothing on stdout; only the exit code tells.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Secrets (`--object secret,…`), as qemu-img takes them; a check reads no guest
    /// data, so an encrypted image's key is not needed.
    #[arg(long = "object", value_name = "secret,id=ID,data=…|file=…")]
    pub objects: Vec<String>,
    /// The image argument is an option string, as qemu-img's `--image-opts`.
    #[arg(long)]
    pub image_opts: bool,
    /// The image (with `--image-opts`, its option string).
    pub image: PathBuf,
}

/// Exit code of a finished check, as qemu-img's.
pub fn exit_code(r: &CheckReport) -> u8 {
    if r.check_errors > 0 {
        1
    } else if r.corruptions > 0 {
        2
    } else if r.leaks > 0 {
        3
    } else {
        0
    }
}

/// The JSON object `qemu-img check --output=json` prints (optional keys only when set).
pub fn to_json(r: &CheckReport, filename: &str) -> Value {
    let mut m = Map::new();
    let mut opt = |k: &str, v: u64| {
        if v != 0 {
            m.insert(k.into(), json!(v));
        }
    };
    opt("image-end-offset", r.image_end_offset);
    opt("total-clusters", r.total_clusters);
    let mut m2 = Map::new();
    m2.insert("check-errors".into(), json!(r.check_errors));
    for (k, v) in [
        ("leaks", r.leaks),
        ("corruptions", r.corruptions),
        ("leaks-fixed", r.leaks_fixed),
        ("corruptions-fixed", r.corruptions_fixed),
        ("allocated-clusters", r.allocated_clusters),
    ] {
        if v != 0 {
            m2.insert(k.into(), json!(v));
        }
    }
    m2.insert("filename".into(), json!(filename));
    m2.insert("format".into(), json!("qcow2"));
    for (k, v) in [
        ("fragmented-clusters", r.fragmented_clusters),
        ("compressed-clusters", r.compressed_clusters),
    ] {
        if v != 0 {
            m2.insert(k.into(), json!(v));
        }
    }
    m.extend(m2);
    Value::Object(m)
}

/// The summary qemu-img prints for humans.
pub fn to_human(r: &CheckReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    if r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0 {
        s.push_str("No errors were found on the image.\n");
    } else {
        if r.corruptions > 0 {
            let _ = write!(
                s,
                "\n{} errors were found on the image.\nData may be corrupted, or further \
                 writes to the image may corrupt it.\n",
                r.corruptions
            );
        }
        if r.leaks > 0 {
            let _ = write!(
                s,
                "\n{} leaked clusters were found on the image.\nThis means waste of disk \
                 space, but no harm to data.\n",
                r.leaks
            );
        }
        if r.check_errors > 0 {
            let _ = write!(
                s,
                "\n{} internal errors have occurred during the check.\n",
                r.check_errors
            );
        }
    }
    if r.total_clusters != 0 && r.allocated_clusters != 0 {
        let a = r.allocated_clusters as f64;
        let _ = writeln!(
            s,
            "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters",
            r.allocated_clusters,
            r.total_clusters,
            a * 100.0 / r.total_clusters as f64,
            r.fragmented_clusters as f64 * 100.0 / a,
            r.compressed_clusters as f64 * 100.0 / a
        );
    }
    if r.image_end_offset != 0 {
        let _ = writeln!(s, "Image end offset: {}", r.image_end_offset);
    }
    s
}

fn eprint_messages(r: &CheckReport) {
    let mut e = std::io::stderr().lock();
    for m in &r.messages {
        let _ = writeln!(e, "{m}");
    }
    if r.messages_dropped > 0 {
        let _ = writeln!(e, "({} more messages not shown)", r.messages_dropped);
    }
}

/// Runs `qcow2 check`; prints its output and returns the exit code.
pub fn main(args: &CheckArgs) -> ExitCode {
    let (image, format) =
        match super::image_target(&args.image, args.format, &args.objects, args.image_opts) {
            Ok(t) => (t.path, t.format),
            Err(e) => {
                eprintln!("qcow2: {e}");
                return ExitCode::from(1);
            }
        };
    let filename = image.display().to_string();
    if format != Format::Qcow2 {
        eprintln!("qcow2: This image format does not support checks");
        return ExitCode::from(63);
    }
    let repair = match args.repair {
        None => Repair::None,
        Some(RepairArg::Leaks) => Repair::Leaks,
        Some(RepairArg::All) => Repair::All,
    };
    let access = match (repair != Repair::None, args.force_share) {
        (true, true) => {
            eprintln!(
                "qcow2: Could not open '{filename}': force-share=on can only be used with \
                 read-only images"
            );
            return ExitCode::from(1);
        }
        (true, false) => Access::Write,
        (false, true) => Access::ReadForceShare,
        (false, false) => Access::Read,
    };
    let mut dev = match UringDevice::open(
        &image,
        OpenMode {
            writable: access == Access::Write,
            direct: args.cache == CacheMode::None,
        },
        64,
    ) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("qcow2: Could not open '{filename}': {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = lock_device(&mut dev, &image, access) {
        eprintln!("qcow2: {e}");
        return ExitCode::from(1);
    }
    let exec: Exec<UringDevice> = Exec::new();
    let dev = exec.add_device(dev);
    let run = |mode: Repair| {
        let e2 = exec.clone();
        exec.block_on(async move { check(&e2, dev, mode).await })
    };
    let mut out = String::new();
    let mut report = match run(repair) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("qcow2: {filename}: {e}");
            eprintln!("qcow2: Check failed");
            return ExitCode::from(1);
        }
    };
    eprint_messages(&report);
    if report.leaks_fixed > 0 || report.corruptions_fixed > 0 {
        if args.output == OutputFormat::Human {
            out.push_str(&format!(
                "The following inconsistencies were found and repaired:\n\n    {} leaked \
                 clusters\n    {} corruptions\n\nDouble checking the fixed image now...\n",
                report.leaks_fixed, report.corruptions_fixed
            ));
        }
        let (leaks_fixed, corruptions_fixed) = (report.leaks_fixed, report.corruptions_fixed);
        report = match run(Repair::None) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("qcow2: {filename}: {e}");
                eprintln!("qcow2: Check failed");
                return ExitCode::from(1);
            }
        };
        eprint_messages(&report);
        report.leaks_fixed = leaks_fixed;
        report.corruptions_fixed = corruptions_fixed;
    }
    match args.output {
        OutputFormat::Human => out.push_str(&to_human(&report)),
        OutputFormat::Json => {
            let v = to_json(&report, &filename);
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            if serde::Serialize::serialize(&v, &mut ser).is_ok() {
                out.push_str(&String::from_utf8_lossy(&buf));
                out.push('\n');
            }
        }
    }
    if !args.quiet {
        let mut so = std::io::stdout().lock();
        if so
            .write_all(out.as_bytes())
            .and_then(|_| so.flush())
            .is_err()
        {
            return ExitCode::from(1);
        }
    }
    let code = exit_code(&report);
    if code == 1 {
        eprintln!("qcow2: Check failed");
    }
    ExitCode::from(code)
}
