//! `qemu-system-x86_64` booting the guest: KVM when a probe boot works, else TCG; its
//! memory a shared memfd so that a vhost-user backend can map it; its disks
//! `vhost-user-blk-pci` devices on the sockets given.

use super::initramfs::Kernel;
use std::fs;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How the guest's CPUs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// QEMU's binary translation.
    Tcg,
}

/// What to boot.
pub struct Spec<'a> {
    /// The kernel.
    pub kernel: &'a Kernel,
    /// The initramfs (`initramfs::build`).
    pub initrd: &'a Path,
    /// `g.mode=` on the command line: what `init.sh` does.
    pub mode: &'a str,
    /// vhost-user-blk sockets, in the guest's disk order (vda, vdb, ...).
    pub disks: &'a [PathBuf],
    /// Virtqueues per disk.
    pub queues: u32,
    /// Guest CPUs.
    pub cpus: u32,
}

/// A running guest; killed if dropped.
pub struct Vm {
    child: Option<Child>,
    lines: Receiver<String>,
    log: PathBuf,
}

const MEM_MIB: u32 = 256;

impl Vm {
    /// Boots `spec`, serial console to `<dir>/<tag>.serial`; the guest's `@@` lines are
    /// read by `next_line`.
    pub fn boot(dir: &Path, tag: &str, spec: &Spec) -> Vm {
        Vm::boot_with(dir, tag, spec, accel(dir, spec.kernel))
    }

    fn boot_with(dir: &Path, tag: &str, spec: &Spec, accel: Accel) -> Vm {
        let mut cmd = Command::new("qemu-system-x86_64");
        match accel {
            Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
            Accel::Tcg => cmd.args(["-accel", "tcg"]),
        };
        cmd.args(["-m", &format!("{MEM_MIB}M"), "-smp", &spec.cpus.to_string()])
            .args([
                "-object",
                &format!("memory-backend-memfd,id=mem,size={MEM_MIB}M,share=on"),
                "-numa",
                "node,memdev=mem",
            ])
            .args([
                "-nographic",
                "-nodefaults",
                "-no-reboot",
                "-serial",
                "stdio",
            ])
            .arg("-kernel")
            .arg(&spec.kernel.vmlinuz)
            .arg("-initrd")
            .arg(spec.initrd)
            .args([
                "-append",
                &format!("console=ttyS0 quiet panic=-1 g.mode={}", spec.mode),
            ]);
        for (i, sock) in spec.disks.iter().enumerate() {
            cmd.arg("-chardev")
                .arg(format!("socket,id=vu{i},path={}", sock.display()))
                .arg("-device")
                .arg(format!(
                    "vhost-user-blk-pci,chardev=vu{i},num-queues={}",
                    spec.queues
                ));
        }
        let log = dir.join(format!("{tag}.serial"));
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start qemu-system-x86_64: {e}"));
        let (tx, rx) = channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            let mut file = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).split(b'\n') {
                    let Ok(line) = line else { break };
                    let line = String::from_utf8_lossy(&line).replace('\r', "");
                    let _ = writeln!(file, "{line}");
                    if let Some(at) = line.find("@@ ") {
                        if tx.send(line[at + 3..].to_string()).is_err() {
                            break;
                        }
                    }
                }
            });
        }
        Vm {
            child: Some(child),
            lines: rx,
            log,
        }
    }

    /// The serial console so far.
    pub fn serial(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Reads the serial console, also after the `Vm` is gone.
    pub fn serial_reader(&self) -> impl Fn() -> String + 'static {
        let log = self.log.clone();
        move || fs::read_to_string(&log).unwrap_or_default()
    }

    /// The guest's next `@@` line (without the marker); `None` at `deadline` or when the
    /// guest is gone.
    pub fn next_line(&self, deadline: Instant) -> Option<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.lines.recv_timeout(left).ok()
    }

    /// Every `@@` line up to `DONE`, then waits for the guest to power off; fails the test
    /// after `secs`.
    pub fn run_to_end(mut self, secs: u64) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let mut lines = Vec::new();
        loop {
            match self.next_line(deadline) {
                Some(l) if l == "DONE" => break,
                Some(l) => lines.push(l),
                None => panic!(
                    "guest did not finish within {secs} s; its lines: {lines:?}\nserial:\n{}",
                    self.serial()
                ),
            }
        }
        let mut child = self.child.take().unwrap();
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("guest did not power off:\n{}", self.serial());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        lines
    }

    /// Kills the VMM (the guest dies with it).
    pub fn kill(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// KVM if `/dev/kvm` boots the guest kernel within a few seconds (a probe boot, once per
/// test run), else TCG: some hosts expose a `/dev/kvm` that cannot run a stock kernel.
pub fn accel(dir: &Path, kernel: &Kernel) -> Accel {
    static ACCEL: OnceLock<Accel> = OnceLock::new();
    *ACCEL.get_or_init(|| {
        if fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_err()
        {
            super::say("guest: no usable /dev/kvm: TCG");
            return Accel::Tcg;
        }
        let initrd = super::initramfs::build(dir, "kvm-probe", kernel, &[]);
        let spec = Spec {
            kernel,
            initrd: &initrd,
            mode: "probe",
            disks: &[],
            queues: 1,
            cpus: 1,
        };
        let vm = Vm::boot_with(dir, "kvm-probe", &spec, Accel::Kvm);
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut booted = false;
        while let Some(l) = vm.next_line(deadline) {
            if l == "DONE" {
                booted = true;
                break;
            }
        }
        vm.kill();
        let a = if booted { Accel::Kvm } else { Accel::Tcg };
        super::say(&format!(
            "guest: KVM probe boot {}: {a:?}",
            if booted { "worked" } else { "hung" }
        ));
        a
    })
}
