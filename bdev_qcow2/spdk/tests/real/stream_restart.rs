//! A restart from a config saved before a stream dropped the backing file (a crash in that
//! window, found by `tests/chaos.sh`): the config still names `backing_bdev`, the image no
//! longer does. The create succeeds, says so, releases the backing bdev (unclaimed, and
//! deleted without taking the qcow2 bdev down), and `save_config` no longer names it; the
//! bdev reads what the stream copied, alone.

use super::*;

#[test]
fn a_config_naming_a_streamed_away_backing_still_restarts() {
    require!("spdk_tgt", "spdk_dd");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (golden, ov, bytes) = stream_images(d, "sr", &["write -P 0x31 1M 2M"]);
    let mut want = bytes;
    want[1 << 20..3 << 20].fill(0x31);
    let before = d.join("before.json");
    write_config(
        &before,
        vec![
            aio(&golden, "gold"),
            aio(&ov, "aio0"),
            qcow2("q0", "aio0", Some("gold")),
        ],
    );

    // The stream runs to its end; the config saved before it still names `gold`.
    let t = Target::start(d, "sr1", Some(&before));
    t.rpc(&["bdev_qcow2_stream", "-b", "q0"]);
    wait_stream_done("q0", |a| t.try_rpc(a));
    t.stop();
    no_backing(&ov);

    // Restarted from the old config: q0 comes up without its backing bdev.
    let t = Target::start(d, "sr2", Some(&before));
    let q0 = t
        .bdev("q0")
        .unwrap_or_else(|| panic!("no q0:\n{}", t.log_text()));
    let info = &q0["driver_specific"]["qcow2"];
    assert_eq!(info["backing_bdev"], Value::Null, "{info}");
    assert_eq!(info["backing_file"], Value::Null, "{info}");
    assert!(
        t.log_text().contains("backing_bdev gold released"),
        "no notice in the log:\n{}",
        t.log_text()
    );
    let gold = t.bdev("gold").unwrap();
    assert_eq!(gold["claimed"], json!(false), "{gold}");
    // The golden image can go; q0 stays, and is saved without it.
    t.rpc(&["bdev_aio_delete", "gold"]);
    assert!(t.bdev("q0").is_some(), "q0 went with its released backing");
    let (_, saved) = t.try_rpc(&["save_config"]);
    let call = saved_create(&saved, "q0");
    assert!(
        call.is_object() && call["params"].get("backing_bdev").is_none(),
        "{call}"
    );
    let after = d.join("after.json");
    fs::write(&after, saved.trim()).unwrap();
    t.stop();

    // What it reads, from the config it saved, with the golden file gone.
    fs::remove_file(&golden).unwrap();
    let raw = d.join("sr.want.raw");
    fs::write(&raw, &want).unwrap();
    compare_with_raw(&ov, &raw);
    check_no_corruption(&ov, "after the restart");
    dd_and_compare(d, &after, "q0", &ov, "sr-after");
    say("a config naming a backing bdev a stream dropped: the create succeeds, releases it, save_config no longer names it; reads the streamed image alone");
}
