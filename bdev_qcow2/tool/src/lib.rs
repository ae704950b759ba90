//! `qcow2_tool`: the standalone polled host (io_uring devices, one executor per core) and
//! the subcommands of the `qcow2` command-line tool.

// `unsafe` lives in `ffi` alone, behind safe wrappers.
#![deny(unsafe_code)]

pub mod cmd;
#[allow(unsafe_code)]
pub mod ffi;
pub mod host;
pub mod lock;
pub mod logwrites;
pub mod progress;
pub mod reactor;
pub mod rng;
pub mod secrets;
pub mod uring;

/// A scratch directory under `$TMPDIR` (default `/var/tmp`, on disk rather than in RAM),
/// named after `prefix` and the process, removed with everything in it on drop.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// Creates it; on failure returns the path it tried and the error.
    pub fn new(prefix: &str) -> Result<Self, (std::path::PathBuf, std::io::Error)> {
        let base = std::env::var_os("TMPDIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"));
        let p = base.join(format!("{prefix}-{}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| (p.clone(), e))?;
        Ok(TempDir(p))
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Parses a size with an optional qemu-img style suffix (k, M, G, T, P, E; powers of 1024;
/// a trailing `B`/`iB` is accepted).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'k' => 10,
                'm' => 20,
                'g' => 30,
                't' => 40,
                'p' => 50,
                'e' => 60,
                _ => return Err(format!("invalid size suffix in '{s}'")),
            };
            (&t[..t.len() - 1], shift)
        }
        _ => (t, 0),
    };
    let v: u64 = num.parse().map_err(|_| format!("invalid size '{s}'"))?;
    v.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999E").is_err());
    }
}
