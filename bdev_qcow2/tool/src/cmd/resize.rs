//! `qcow2 resize`: changes the virtual size of an image, like `qemu-img resize`.
//!
//! Growing always works; shrinking needs `--shrink` and, unlike `qemu-img resize --shrink`
//! (which discards what lies past the new end), is refused when that range holds data.

use super::ImageArgs;
use crate::host::{open_chain, Format, ToolError, ToolResult};

/// Arguments of `qcow2 resize`.
#[derive(Debug, clap::Args)]
pub struct ResizeArgs {
    /// Allow the disk to become smaller (refused while the range cut off holds data).
    #[arg(long)]
    pub shrink: bool,
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    pub quiet: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
    /// The new size (`10G`), or a change of it (`+1G`, `-512M`).
    #[arg(allow_hyphen_values = true)]
    pub size: String,
}

/// The new size `spec` asks for, from the current size `old`.
pub fn new_size(spec: &str, old: u64) -> ToolResult<u64> {
    let bad = |e: String| ToolError::Usage(format!("Invalid image size specified: {e}"));
    let n = if let Some(d) = spec.strip_prefix('+') {
        old.checked_add(crate::parse_size(d).map_err(bad)?)
            .ok_or_else(|| bad(format!("'{spec}' is too large")))?
    } else if let Some(d) = spec.strip_prefix('-') {
        old.checked_sub(crate::parse_size(d).map_err(bad)?)
            .ok_or_else(|| bad(format!("'{spec}' would be negative")))?
    } else {
        crate::parse_size(spec).map_err(bad)?
    };
    if n == 0 {
        return Err(bad("the size must be positive".into()));
    }
    // Rounded up to whole sectors, as QEMU does.
    Ok(n.div_ceil(512) * 512)
}

/// Runs `qcow2 resize`; returns the text to print.
pub fn run(args: &ResizeArgs) -> ToolResult<String> {
    let mut spec = args.image.spec()?;
    if spec.format == Format::Raw {
        return Err(ToolError::Usage(
            "resizing raw images is not supported (use truncate)".into(),
        ));
    }
    spec.writable = true;
    let o = open_chain(&spec)?;
    let new = new_size(&args.size, o.chain.size())?;
    let chain = o.chain.clone();
    let shrink = args.shrink;
    let r = o.exec.block_on(async move {
        let resized = chain.resize(new, shrink).await;
        // Closed either way: whatever the resize changed is written back.
        let closed = chain.close().await;
        resized.and(closed)
    });
    r.map_err(|source| match source {
        qcow2_engine::Error::Refused(msg) => ToolError::Usage(msg),
        source => ToolError::Engine {
            path: spec.path.display().to_string(),
            source,
        },
    })?;
    Ok(if args.quiet {
        String::new()
    } else {
        "Image resized.\n".into()
    })
}

#[cfg(test)]
mod tests {
    use super::new_size;

    #[test]
    fn absolute_and_relative_sizes() {
        assert_eq!(new_size("1G", 5).unwrap(), 1 << 30);
        assert_eq!(new_size("+1M", 1 << 20).unwrap(), 2 << 20);
        assert_eq!(new_size("-1M", 2 << 20).unwrap(), 1 << 20);
        assert_eq!(new_size("1000", 0).unwrap(), 1024);
        assert!(new_size("-2M", 1 << 20).is_err());
        assert!(new_size("0", 1 << 20).is_err());
        assert!(new_size("x", 1 << 20).is_err());
    }
}
