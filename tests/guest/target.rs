//! `spdk_tgt` with our module preloaded, serving qcow2 bdevs as vhost-user-blk controllers.

use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The first file called `bin` on PATH.
pub fn on_path(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|f| f.is_file())
    })
}

/// The module to preload: `BDEV_QCOW2_SO`, else the .so cargo built next to this test.
pub fn module_so() -> PathBuf {
    if let Some(p) = std::env::var_os("BDEV_QCOW2_SO") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [
        deps.join("libbdev_qcow2.so"),
        deps.join("../libbdev_qcow2.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .unwrap_or_else(|| deps.join("libbdev_qcow2.so"))
}

/// rpc.py: `SPDK_RPC`, else `spdk-rpc` or `rpc.py` on PATH.
pub fn rpc_py() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SPDK_RPC") {
        return Some(PathBuf::from(p));
    }
    on_path("spdk-rpc").or_else(|| on_path("rpc.py"))
}

/// Why SPDK cannot serve a guest here, if it cannot.
pub fn missing() -> Option<String> {
    if !cfg!(spdk) {
        return Some(
            "SPDK not installed when this was built (pkg-config spdk_bdev not found, or \
             SPDK_SYS_DISABLE=1): the module is not registered"
                .into(),
        );
    }
    if on_path("spdk_tgt").is_none() {
        return Some("SPDK application spdk_tgt not on PATH".into());
    }
    if rpc_py().is_none() {
        return Some("rpc.py not found (set SPDK_RPC or put spdk-rpc on PATH)".into());
    }
    if !module_so().is_file() {
        return Some(format!("{} not built", module_so().display()));
    }
    None
}

fn free_hugepages_mib() -> u64 {
    let info = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let get = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    get("HugePages_Free:") * get("Hugepagesize:") / 1024
}

/// Hugepages when there are enough (vhost maps the guest's memory; SPDK's own buffers are
/// DMA memory), else `--no-huge` with 1 GiB.
fn mem_args() -> Vec<String> {
    if free_hugepages_mib() >= 1024 {
        vec!["-s".into(), "512".into()]
    } else {
        vec!["--no-huge".into(), "-s".into(), "1024".into()]
    }
}

/// An AIO bdev over `file` (padded to whole 512-byte blocks first).
pub fn aio(file: &Path, name: &str) -> Value {
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.next_multiple_of(512)).unwrap();
    json!({"method": "bdev_aio_create",
           "params": {"filename": file.to_str().unwrap(), "name": name, "block_size": 512}})
}

/// A qcow2 bdev on `base`, its backing image on bdev `backing` if given.
pub fn qcow2(name: &str, base: &str, backing: Option<&str>) -> Value {
    let mut p = json!({"name": name, "base_bdev": base});
    if let Some(b) = backing {
        p["backing_bdev"] = json!(b);
    }
    json!({"method": "bdev_qcow2_create", "params": p})
}

/// A running `spdk_tgt`; killed if dropped while running.
pub struct Target {
    child: Option<Child>,
    rpc_sock: PathBuf,
    vhost_dir: PathBuf,
    log: PathBuf,
}

impl Target {
    /// Starts `spdk_tgt` on the cores of `mask` with the bdevs `calls` create (on its first
    /// core, so that is where each image's owner lives), and waits until it answers RPCs.
    pub fn start(dir: &Path, tag: &str, mask: &str, calls: Vec<Value>) -> Target {
        let mut calls = calls;
        calls.push(json!({"method": "bdev_wait_for_examine"}));
        let cfg = dir.join(format!("{tag}.json"));
        let body = json!({"subsystems": [{"subsystem": "bdev", "config": calls}]});
        fs::write(&cfg, serde_json::to_vec_pretty(&body).unwrap()).unwrap();
        let vhost_dir = dir.join(format!("{tag}.vhost"));
        fs::create_dir_all(&vhost_dir).unwrap();
        let rpc_sock = dir.join(format!("{tag}.sock"));
        let log = dir.join(format!("{tag}.tgt.log"));
        let out = fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new("spdk_tgt")
            .env("LD_PRELOAD", module_so())
            .args(mem_args())
            .args(["-m", mask, "--json"])
            .arg(&cfg)
            .arg("-S")
            .arg(&vhost_dir)
            .arg("-r")
            .arg(&rpc_sock)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start spdk_tgt: {e}"));
        let mut t = Target {
            child: Some(child),
            rpc_sock,
            vhost_dir,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = t.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("spdk_tgt exited ({st}) while starting:\n{}", t.log_text());
            }
            if t.rpc_sock.exists() && t.try_rpc(&["framework_wait_init"]).0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "spdk_tgt did not answer RPCs within 60 s:\n{}",
                t.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        t
    }

    /// The target's output so far.
    pub fn log_text(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    fn try_rpc(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(rpc_py().unwrap())
            .arg("-s")
            .arg(&self.rpc_sock)
            .args(["-t", "30"])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    /// Runs an RPC that must succeed.
    pub fn rpc(&self, args: &[&str]) -> String {
        let (ok, text) = self.try_rpc(args);
        assert!(ok, "rpc {args:?} failed: {text}\n{}", self.log_text());
        text
    }

    /// Exports bdev `bdev` as vhost-user-blk controller `ctrlr` polled on `cpumask`; returns
    /// the socket a VMM connects to.
    pub fn vhost_blk(&self, ctrlr: &str, bdev: &str, cpumask: &str) -> PathBuf {
        self.rpc(&[
            "vhost_create_blk_controller",
            "--cpumask",
            cpumask,
            ctrlr,
            bdev,
        ]);
        let info: Value = serde_json::from_str(&self.rpc(&["vhost_get_controllers", "-n", ctrlr]))
            .expect("vhost_get_controllers answers JSON");
        assert_eq!(
            info[0]["cpumask"].as_str(),
            Some(cpumask),
            "controller {ctrlr} polled where asked: {info}"
        );
        self.vhost_dir.join(ctrlr)
    }

    /// SIGINT and a clean exit (every qcow2 bdev flushed and closed) within 60 s.
    pub fn stop(mut self) {
        let mut child = self.child.take().unwrap();
        signal(&child, "INT");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                assert!(
                    st.success(),
                    "spdk_tgt exited with {st}:\n{}",
                    self.log_text()
                );
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("spdk_tgt did not stop within 60 s:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL: the target dies with whatever it had in flight.
    pub fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        signal(&child, "KILL");
        let _ = child.wait();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Sends `sig` (a name: INT, KILL) to our child, which is not reaped yet (its pid is not
/// reused).
fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {} failed", child.id());
}
