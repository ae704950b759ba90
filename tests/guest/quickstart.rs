//! The README's recipe, run: `configs/quickstart_vm.sh` boots the test kernel and initramfs
//! from a fresh overlay over a golden image (spdk_tgt started with
//! `configs/vhost_blk_qcow2.json`), the guest writes, discards and reads back through
//! vhost-user-blk; the host then holds the overlay to a model of every byte and the golden
//! image to what it was.

use super::plan::{self, Rng, BLOB_LEN, RAW_DISK};
use super::vm::{accel, Accel};
use super::{check_image, expect_lines, initramfs, md5, ready, run, run_ok, s, say, target, turn};
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// The golden image: every other MiB random (the overlay shows it through), the rest
/// unallocated. Returns its bytes.
fn golden(d: &Path, rng: &mut Rng) -> Vec<u8> {
    let mut bytes = vec![0u8; RAW_DISK as usize];
    for mib in (0..RAW_DISK >> 20).step_by(2) {
        let at = (mib << 20) as usize;
        bytes[at..at + (1 << 20)].copy_from_slice(&rng.bytes(1 << 20));
    }
    let raw = d.join("golden.raw");
    fs::write(&raw, &bytes).unwrap();
    run_ok(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        s(&raw),
        s(&d.join("golden.qcow2")),
    ]));
    bytes
}

#[test]
fn quickstart_script_boots_a_guest_on_an_overlay() {
    let Some(kernel) = ready() else { return };
    let _turn = turn();
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut rng = Rng::new(0x9_u64 << 40 | 0x51);
    let blob = rng.bytes(BLOB_LEN);
    let ops = plan::raw_ops(&mut rng);
    let mut model = golden(d, &mut rng);
    let golden_img = d.join("golden.qcow2");
    let golden_raw = d.join("golden.raw");
    plan::apply(&mut model, &blob, &ops);
    let model_file = d.join("model.raw");
    fs::write(&model_file, &model).unwrap();
    let ops_text = plan::ops_text(&ops);
    let payload: [(&str, &[u8]); 2] = [("blob", &blob), ("ops", ops_text.as_bytes())];
    let initrd = initramfs::build(d, "quickstart", &kernel, &payload);
    let accel = match accel(d, &kernel) {
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
    };

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/quickstart_vm.sh");
    let vm_dir = d.join("vm");
    let mut cmd = Command::new(&script);
    cmd.args(["--base", s(&golden_img), "--dir", s(&vm_dir)])
        .args(["--kernel", s(&kernel.vmlinuz), "--initrd", s(&initrd)])
        .args(["--append", "quiet panic=-1 g.mode=quickstart"])
        .args(["--accel", accel, "--mem", "256", "--timeout", "900"])
        .env("BDEV_QCOW2_SO", target::module_so())
        .env("SPDK_RPC", target::rpc_py().unwrap());
    let (code, out) = run(&mut cmd);
    let log = || out.clone() + &fs::read_to_string(vm_dir.join("spdk_tgt.log")).unwrap_or_default();
    assert_eq!(code, 0, "{script:?} failed:\n{}", log());
    let lines: Vec<String> = out
        .lines()
        .filter_map(|l| l.find("@@ ").map(|at| l[at + 3..].trim_end().to_string()))
        .collect();

    // The guest saw the overlay's whole disk, every write read back and discard read as
    // zeros, and the disk it left is the model (golden bytes under the writes).
    let mut want: Vec<String> = (1..=ops.len()).map(|i| format!("OK {i}")).collect();
    want.push(format!("DISK vda {RAW_DISK}"));
    want.push(format!("MD5 vda {}", md5(&model_file)));
    want.push("DONE".into());
    expect_lines("quickstart", &lines, &want, &log);

    // On the host: the overlay is clean and holds exactly the model, with the guest's
    // writes in the overlay itself and the rest read from the golden image, untouched.
    let overlay = vm_dir.join("vm0.qcow2");
    check_image(&overlay, false);
    run_ok(Command::new("qemu-img").args([
        "compare",
        "-f",
        "qcow2",
        "-F",
        "raw",
        s(&overlay),
        s(&model_file),
    ]));
    run_ok(Command::new("qemu-img").args([
        "compare",
        "-f",
        "qcow2",
        "-F",
        "raw",
        s(&golden_img),
        s(&golden_raw),
    ]));
    let (code, text) = run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        s(&golden_img),
        s(&overlay),
    ]));
    assert_eq!(
        code, 1,
        "the overlay must differ from its golden image:\n{text}"
    );
    let map: serde_json::Value = serde_json::from_str(&run_ok(Command::new("qemu-img").args([
        "map",
        "--output=json",
        s(&overlay),
    ])))
    .unwrap();
    let extents = map.as_array().unwrap();
    let data_at = |depth: u64| {
        extents
            .iter()
            .filter(|e| e["depth"] == depth && e["data"] == true)
            .map(|e| e["length"].as_u64().unwrap())
            .sum::<u64>()
    };
    let (own, golden) = (data_at(0), data_at(1));
    assert!(
        own > 0 && golden > 0,
        "the overlay holds {own} bytes, reads {golden} from the golden image:\n{map}"
    );
    say(&format!(
        "quickstart ({accel}): the overlay holds {} KiB, reads {} KiB from the golden image; {:.0} s",
        own >> 10,
        golden >> 10,
        started.elapsed().as_secs_f64()
    ));
}
