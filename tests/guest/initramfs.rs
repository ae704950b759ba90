//! The guest's kernel (Debian's, from /boot) and an initramfs built at test time: static
//! busybox, the kernel's own virtio and ext4 modules (dependencies from `modules.dep`),
//! mke2fs with its libraries, our `init.sh`, and the files the host wrote for this boot.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The modules the guest loads, dependencies resolved by `Kernel::modules`.
pub const GUEST_MODULES: &[&str] = &["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"];

/// A kernel image and its modules directory.
pub struct Kernel {
    /// `/boot/vmlinuz-<version>`.
    pub vmlinuz: PathBuf,
    modules_dir: PathBuf,
}

impl Kernel {
    /// The newest `/boot/vmlinuz-*` that has its `/lib/modules/<version>/modules.dep`.
    pub fn find() -> Result<Kernel, String> {
        let mut found: Vec<(String, PathBuf)> = fs::read_dir("/boot")
            .map_err(|e| format!("/boot: {e}"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let version = name.strip_prefix("vmlinuz-")?.to_string();
                Some((version, e.path()))
            })
            .filter(|(v, _)| {
                Path::new("/lib/modules")
                    .join(v)
                    .join("modules.dep")
                    .is_file()
            })
            .collect();
        found.sort();
        let (version, vmlinuz) = found
            .pop()
            .ok_or("no /boot/vmlinuz-* with its modules (install linux-image-amd64)")?;
        Ok(Kernel {
            vmlinuz,
            modules_dir: Path::new("/lib/modules").join(version),
        })
    }

    /// The module files that load `names`, each after the modules it depends on.
    pub fn modules(&self, names: &[&str]) -> Result<Vec<PathBuf>, String> {
        let dep = fs::read_to_string(self.modules_dir.join("modules.dep"))
            .map_err(|e| format!("modules.dep: {e}"))?;
        let mut table: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
        for line in dep.lines() {
            let Some((path, deps)) = line.split_once(':') else {
                continue;
            };
            let deps = deps.split_whitespace().map(String::from).collect();
            table.insert(module_name(path), (path.to_string(), deps));
        }
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for n in names {
            let key = n.replace('-', "_");
            let (path, _) = table
                .get(&key)
                .ok_or_else(|| format!("module {n} not in modules.dep"))?;
            self.visit(path, &table, &mut seen, &mut order)?;
        }
        Ok(order)
    }

    /// Depth-first: a module's dependencies enter `order` before it.
    fn visit(
        &self,
        path: &str,
        table: &BTreeMap<String, (String, Vec<String>)>,
        seen: &mut HashSet<String>,
        order: &mut Vec<PathBuf>,
    ) -> Result<(), String> {
        if !seen.insert(path.to_string()) {
            return Ok(());
        }
        if decompressor(path).is_none() && !path.ends_with(".ko") {
            return Err(format!("{path}: not a module file this test knows"));
        }
        let (_, deps) = table
            .get(&module_name(path))
            .ok_or_else(|| format!("{path} not in modules.dep"))?;
        for d in deps {
            self.visit(d, table, seen, order)?;
        }
        order.push(self.modules_dir.join(path));
        Ok(())
    }
}

/// `kernel/fs/ext4/ext4.ko` → `ext4` (with `-` as `_`, as the kernel names modules).
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split('.').next().unwrap_or(file).replace('-', "_")
}

/// The command that decompresses a compressed module file (busybox's insmod takes plain
/// `.ko` files).
fn decompressor(path: &str) -> Option<&'static str> {
    [(".ko.xz", "xz"), (".ko.zst", "zstd"), (".ko.gz", "gzip")]
        .into_iter()
        .find(|(ext, _)| path.ends_with(ext))
        .map(|(_, cmd)| cmd)
}

/// Why a guest cannot be built here, if it cannot.
pub fn missing() -> Option<String> {
    for (bin, pkg) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("cpio", "cpio"),
        ("qemu-img", "qemu-utils"),
        ("e2fsck", "e2fsprogs"),
        ("debugfs", "e2fsprogs"),
        ("md5sum", "coreutils"),
        ("ldd", "libc-bin"),
    ] {
        if super::target::on_path(bin).is_none() && !Path::new("/sbin").join(bin).is_file() {
            return Some(format!("{bin} not installed (package {pkg})"));
        }
    }
    if busybox().is_none() {
        return Some("static busybox not installed (package busybox-static)".into());
    }
    if mke2fs().is_none() {
        return Some("mke2fs not installed (package e2fsprogs)".into());
    }
    if let Err(e) = Kernel::find().and_then(|k| k.modules(GUEST_MODULES)) {
        return Some(e);
    }
    None
}

fn busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

fn mke2fs() -> Option<PathBuf> {
    ["/sbin/mke2fs", "/usr/sbin/mke2fs"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// Copies `bin` to `root/<dest>` and the shared libraries `ldd` names to the same paths
/// under `root` (nothing for a static binary).
fn copy_with_libs(root: &Path, bin: &Path, dest: &str) {
    let to = root.join(dest.trim_start_matches('/'));
    fs::create_dir_all(to.parent().unwrap()).unwrap();
    fs::copy(bin, &to).unwrap();
    let out = Command::new("ldd").arg(bin).output().unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let lib = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        let Some(lib) = lib.filter(|l| l.starts_with('/')) else {
            continue;
        };
        let to = root.join(lib.trim_start_matches('/'));
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(lib, &to).unwrap_or_else(|e| panic!("{lib}: {e}"));
    }
}

/// Builds `<dir>/<tag>.cpio`: busybox, the modules, mke2fs (as mkfs.ext4), `init.sh` as
/// `/init`, and `files` (name, contents) at the root. Returns its path.
pub fn build(dir: &Path, tag: &str, kernel: &Kernel, files: &[(&str, &[u8])]) -> PathBuf {
    let root = dir.join(format!("{tag}.root"));
    let _ = fs::remove_dir_all(&root);
    for d in [
        "bin",
        "sbin",
        "dev",
        "proc",
        "sys",
        "mnt",
        "tmp",
        "etc",
        "lib/modules",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    copy_with_libs(&root, &busybox().unwrap(), "/bin/busybox");
    copy_with_libs(&root, &mke2fs().unwrap(), "/sbin/mkfs.ext4");
    if Path::new("/etc/mke2fs.conf").is_file() {
        fs::copy("/etc/mke2fs.conf", root.join("etc/mke2fs.conf")).unwrap();
    }
    let mut names = String::new();
    for m in kernel.modules(GUEST_MODULES).unwrap() {
        let file = m.file_name().unwrap().to_str().unwrap();
        let name = format!("{}.ko", module_name(file));
        let to = root.join("lib/modules").join(&name);
        match decompressor(file) {
            Some(cmd) => {
                let out = Command::new(cmd).arg("-dc").arg(&m).output().unwrap();
                assert!(out.status.success(), "{cmd} -dc {}", m.display());
                fs::write(&to, out.stdout).unwrap();
            }
            None => {
                fs::copy(&m, &to).unwrap();
            }
        }
        names += &name;
        names.push('\n');
    }
    fs::write(root.join("modules"), names).unwrap();
    let init = root.join("init");
    fs::write(&init, include_str!("init.sh")).unwrap();
    let mut perm = fs::metadata(&init).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    fs::set_permissions(&init, perm).unwrap();
    for (name, body) in files {
        fs::write(root.join(name), body).unwrap();
    }
    let cpio = dir.join(format!("{tag}.cpio"));
    let st = Command::new("sh")
        .arg("-c")
        .arg("cd \"$1\" && find . | cpio -o -H newc --quiet > \"$2\"")
        .arg("sh")
        .arg(&root)
        .arg(&cpio)
        .status()
        .unwrap();
    assert!(st.success(), "cpio failed");
    let _ = fs::remove_dir_all(&root);
    cpio
}
