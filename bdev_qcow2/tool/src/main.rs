//! The `qcow2` command-line tool: qcow2 images through the bdev_qcow2 engine, with options,
//! output and exit codes shaped like `qemu-img`.

#![forbid(unsafe_code)]

use clap::{CommandFactory, FromArgMatches, Subcommand};
use qcow2_tool::cmd::{
    bitmap, check, commit, compare, convert, create, info, io, map, measure, perf, rebase, resize,
    snapshot,
};
use std::io::Write;
use std::process::ExitCode;

#[derive(clap::Parser)]
#[command(
    name = "qcow2",
    version,
    about = "qcow2 images through the bdev_qcow2 engine"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure the engine against the raw file, bdevperf style (no image: a sample image
    /// and a default set of workloads).
    Perf(perf::PerfArgs),
    /// Show what the image header says (like `qemu-img info`).
    Info(info::InfoArgs),
    /// Show where each guest range is stored (like `qemu-img map`).
    Map(map::MapArgs),
    /// Copy the virtual disk into a raw file (like `qemu-img convert -O raw`).
    Convert(convert::ConvertArgs),
    /// The file size a new image needs, empty or converted from an image (like
    /// `qemu-img measure`).
    Measure(measure::MeasureArgs),
    /// Create a new qcow2 image (like `qemu-img create`).
    Create(create::CreateArgs),
    /// Run guest I/O commands on an image (like `qemu-io -c …`).
    Io(io::IoArgs),
    /// Whether two images read the same (like `qemu-img compare [-s]`; exit status 0
    /// identical, 1 different, 2 open failed, 3 block status failed, 4 read failed).
    Compare(compare::CompareArgs),
    /// Check the image's consistency and repair it (like `qemu-img check [-r leaks|all]`).
    Check(check::CheckArgs),
    /// Change the virtual size (like `qemu-img resize [--shrink]`; a shrink is refused
    /// while the range cut off holds data).
    Resize(resize::ResizeArgs),
    /// Copy everything the image reads from its backing chain into it and drop the backing
    /// file (like `qemu-img rebase -b ''`; `-u`: drop the reference only).
    Rebase(rebase::RebaseArgs),
    /// Write an overlay's changes into its backing file, or with -b into a deeper image of
    /// its chain, then empty the overlay unless -d or -b (like `qemu-img commit`).
    Commit(commit::CommitArgs),
    /// Add, remove, enable, disable, clear or merge persistent dirty bitmaps (like
    /// `qemu-img bitmap --add|--remove|--enable|--disable|--clear|--merge`).
    Bitmap(bitmap::BitmapArgs),
    /// List, create, delete or apply internal snapshots (like `qemu-img snapshot
    /// -l|-c|-d|-a`).
    Snapshot(snapshot::SnapshotArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("QCOW2_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Cmd::Bitmap(a), Some(m)) = (&mut cli.cmd, matches.subcommand_matches("bitmap")) {
        a.order = bitmap::order_of(m);
    }
    let r = match &cli.cmd {
        Cmd::Info(a) => info::run(a),
        Cmd::Perf(a) => perf::run(a),
        Cmd::Map(a) => map::run(a),
        Cmd::Measure(a) => measure::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Create(a) => create::run(a),
        Cmd::Resize(a) => resize::run(a),
        Cmd::Rebase(a) => rebase::run(a),
        Cmd::Commit(a) => commit::run(a),
        Cmd::Snapshot(a) => snapshot::run(a),
        Cmd::Bitmap(a) => bitmap::run(a),
        // Exit status 1 when a command fails or a pattern does not match, like qemu-io.
        Cmd::Io(a) => return io::main(a),
        // Its own exit codes (0 clean, 1 failed, 2 corruptions, 3 leaks), like qemu-img.
        Cmd::Check(a) => return check::main(a),
        // Its own exit codes (0 identical, 1 different, 2..4 errors), like qemu-img.
        Cmd::Compare(a) => return compare::main(a),
    };
    match r {
        Ok(out) => {
            let mut so = std::io::stdout().lock();
            if so
                .write_all(out.as_bytes())
                .and_then(|_| so.flush())
                .is_err()
            {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("qcow2: {e}");
            ExitCode::FAILURE
        }
    }
}
