//! The `qcow2` command-line tool: qcow2 images through the bdev_qcow2 engine, with options,
//! output and exit codes shaped like `qemu-img`.

use clap::{Parser, Subcommand};
use qcow2_tool::cmd::{convert, create, info, io, map};
use std::io::Write;
use std::process::ExitCode;

#[derive(Parser)]
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
    /// Show what the image header says (like `qemu-img info`).
    Info(info::InfoArgs),
    /// Show where each guest range is stored (like `qemu-img map`).
    Map(map::MapArgs),
    /// Copy the virtual disk into a raw file (like `qemu-img convert -O raw`).
    Convert(convert::ConvertArgs),
    /// Create a new qcow2 image (like `qemu-img create`).
    Create(create::CreateArgs),
    /// Run guest I/O commands on an image (like `qemu-io -c …`).
    Io(io::IoArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("QCOW2_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Info(a) => info::run(a),
        Cmd::Map(a) => map::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Create(a) => create::run(a),
        // Exit status 1 when a command fails or a pattern does not match, like qemu-io.
        Cmd::Io(a) => return io::main(a),
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
