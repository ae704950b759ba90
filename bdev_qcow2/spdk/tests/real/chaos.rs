//! `tests/chaos.sh` in its short size: spdk_tgt serves qcow2 bdevs (plain, extended L2,
//! overlays of a plain and a compressed golden image, one with persistent bitmaps) over
//! NVMe/TCP to our client, which writes, reads, flushes, write-zeroes and deallocates
//! against a model of every block while snapshots (internal and external) are taken and
//! deleted, the bdevs grow, stream and are re-created, and spdk_tgt is SIGKILLed at random
//! moments and restarted from its saved config. No acknowledged and flushed byte may be
//! lost, nothing may read what was never written there, bitmaps must be marked in use or
//! cover every write, and `qemu-img check` must find no corruption. `CHAOS_SECONDS` sets the run's length (default
//! 60), `SEED` replays a seed.

use super::*;

#[test]
fn chaos_kills_lose_no_flushed_byte_and_corrupt_nothing() {
    require!("spdk_tgt");
    if on_path("python3").is_none() {
        say("SKIPPED: python3 not on PATH");
        return;
    }
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/chaos.sh");
    let secs: u64 = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .env("BDEV_QCOW2_SO", module_so())
        .env("MEM_ARGS", mem_args().join(" "))
        .env("DURATION", secs.to_string())
        .env("TMPDIR", dir.path());
    let started = Instant::now();
    let (ok, text) = run_timed(&mut cmd, &dir.path().join("chaos.log"), secs + 600);
    let figures = text
        .lines()
        .find(|l| l.starts_with("CHAOS seed=") && l.contains(" cycles="))
        .unwrap_or("no CHAOS figures line")
        .to_string();
    assert!(ok, "tests/chaos.sh failed:\n{text}");
    assert!(
        figures.contains(" wrong_blocks=0 errors=0") && !figures.contains(" kills=0 "),
        "tests/chaos.sh: {figures}\n{text}"
    );
    say(&format!(
        "tests/chaos.sh ({:.0} s): {figures}",
        started.elapsed().as_secs_f64()
    ));
}
