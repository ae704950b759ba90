//! `qcow2 rebase -b ''`: makes an overlay stand alone, like `qemu-img rebase -b ''`: every
//! cluster it reads from its backing chain is copied in (the engine's stream), then the
//! backing reference is dropped. With `-u` only the reference goes (what the image read
//! from its backing chain then reads as zeros), as with `qemu-img rebase -u -b ''`.
//! Rebasing onto another backing file is not supported.

use super::ImageArgs;
use crate::host::{open_chain, Format, ToolError, ToolResult};
use std::io::Write;

/// Arguments of `qcow2 rebase`.
#[derive(Debug, clap::Args)]
pub struct RebaseArgs {
    /// The new backing file: only '' (none) is supported.
    #[arg(short = 'b', allow_hyphen_values = true)]
    pub backing: String,
    /// Unsafe: drop the reference without copying the backing data in.
    #[arg(short = 'u')]
    pub unsafe_: bool,
    /// Show progress.
    #[arg(short = 'p')]
    pub progress: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// Runs `qcow2 rebase`; returns the text to print (nothing on success, as qemu-img).
pub fn run(args: &RebaseArgs) -> ToolResult<String> {
    if !args.backing.is_empty() {
        return Err(ToolError::Usage(
            "only -b '' (copy the backing data in and drop the backing file) is supported".into(),
        ));
    }
    let mut spec = args.image.spec()?;
    if spec.format == Format::Raw {
        return Err(ToolError::Usage("a raw image has no backing file".into()));
    }
    spec.writable = true;
    if args.unsafe_ {
        // The backing chain is not read: do not open it.
        spec.allow_backing = false;
    }
    let o = if args.unsafe_ {
        crate::host::open_top_only(&spec)?
    } else {
        open_chain(&spec)?
    };
    let chain = o.chain.clone();
    let named = match chain.layers().first() {
        Some(qcow2_engine::Layer::Qcow2(q)) => q.header().backing_file.is_some(),
        _ => false,
    };
    if !named {
        // Nothing to do, as qemu-img.
        return Ok(String::new());
    }
    let (unsafe_, progress) = (args.unsafe_, args.progress);
    let r = o.exec.block_on(async move {
        let done = if unsafe_ {
            chain.forget_backing().await.map(|_| ())
        } else {
            chain
                .stream_with(|p| {
                    if progress {
                        let pct = if p.bytes_total == 0 {
                            100.0
                        } else {
                            p.bytes_done as f64 * 100.0 / p.bytes_total as f64
                        };
                        let mut e = std::io::stderr().lock();
                        let _ = write!(e, "    ({pct:.2}/100%)\r");
                        let _ = e.flush();
                    }
                })
                .await
                .map(|_| ())
        };
        // Closed either way: whatever was copied is written back.
        let closed = chain.close().await;
        done.and(closed)
    });
    if progress {
        eprintln!();
    }
    r.map_err(|source| match source {
        qcow2_engine::Error::Refused(msg) => ToolError::Usage(msg),
        source => ToolError::Engine {
            path: spec.path.display().to_string(),
            source,
        },
    })?;
    Ok(String::new())
}
