//! What an operator sees of a qcow2 bdev across restarts and while it changes: its UUID (and
//! so an NVMe-oF namespace's NGUID and UUID) is the same after every restart of `spdk_tgt`,
//! from the same config or from `save_config`; `bdev_get_bdevs`' `driver_specific.qcow2`
//! follows a resize, snapshots and a stream as they happen, as `qemu-img info -U` reads the
//! image at the same moment.

use super::*;

/// The AIO bases' UUIDs: given, as an operator's config gives them, so that the bases are
/// the same bdevs on every start (an AIO bdev created without one gets a random UUID).
const BASE_A: &str = "1b7e0c55-6f0a-4a8e-9d3c-2a5b6c7d8e9f";
const BASE_B: &str = "5d0c2a8e-7b1f-4c3d-a9e8-6f4b3a2c1d0e";

/// An AIO bdev over `file` with the UUID `uuid`.
fn aio_with_uuid(file: &Path, name: &str, uuid: &str) -> Value {
    let mut c = aio(file, name);
    c["params"]["uuid"] = json!(uuid);
    c
}

/// The UUID `bdev_get_bdevs` reports for `name`.
fn uuid_of(t: &Target, name: &str) -> String {
    let b = t
        .bdev(name)
        .unwrap_or_else(|| panic!("no bdev {name}:\n{}", t.log_text()));
    b["uuid"].as_str().expect("a uuid").to_string()
}

/// Whether `u` is in SPDK's lower-case form (8-4-4-4-12 hex digits).
fn canonical(u: &str) -> bool {
    let groups: Vec<&str> = u.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups.iter().all(|g| {
            g.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
        })
}

/// `save_config` output written to `path`.
fn save(t: &Target, path: &Path) -> Value {
    let saved = t.rpc(&["save_config"]);
    fs::write(path, serde_json::to_vec_pretty(&saved).unwrap()).unwrap();
    saved
}

#[test]
fn uuid_survives_restarts_and_save_config() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (a, b) = (d.join("a.qcow2"), d.join("b.qcow2"));
    for f in [&a, &b] {
        qemu_img(&["create", "-q", "-f", "qcow2", s(f), "16M"]);
    }
    // q1's UUID in capitals: SPDK's parser takes them, and it is kept in lower case.
    let given = "9C3A0D1E-2B4F-4A6B-8C7D-0E1F2A3B4C5D";
    let mut q1 = qcow2("q1", "aio1", None);
    q1["params"]["uuid"] = json!(given);
    let cfg = d.join("hand.json");
    let hand = |base_a: &str| {
        vec![
            aio_with_uuid(&a, "aio0", base_a),
            aio_with_uuid(&b, "aio1", BASE_B),
            qcow2("q0", "aio0", None),
            q1.clone(),
        ]
    };
    write_config(&cfg, hand(BASE_A));

    let t = Target::start(d, "id1", Some(&cfg));
    let u0 = uuid_of(&t, "q0");
    assert!(canonical(&u0), "{u0}");
    assert_ne!(u0, BASE_A, "the qcow2 bdev took its base's UUID");
    assert_eq!(uuid_of(&t, "q1"), given.to_lowercase());
    // SPDK finds the bdev by its UUID too (an alias).
    assert_eq!(t.bdev(&u0).expect("q0 by its UUID")["name"], "q0");

    // Refused with the reason, and the base is left as it was: unclaimed, its image intact.
    t.rpc(&["bdev_malloc_create", "-b", "m0", "16", "512"]);
    t.rpc(&["bdev_qcow2_format", "m0", "-s", "8388608"]);
    for (uuid, why) in [
        ("not-a-uuid", "is not a UUID"),
        ("9c3a0d1e-2b4f-4a6b-8c7d-0e1f2a3b4c5", "is not a UUID"),
        ("00000000-0000-0000-0000-000000000000", "null UUID"),
        (u0.as_str(), "already a bdev's UUID"),
        (given, "already a bdev's UUID"),
    ] {
        let (ok, text) = t.try_rpc(&[
            "bdev_qcow2_create",
            "-b",
            "q2",
            "--base-bdev",
            "m0",
            "--uuid",
            uuid,
        ]);
        assert!(!ok && text.contains(why), "uuid {uuid}: {text}");
        assert!(t.bdev("q2").is_none(), "uuid {uuid}: q2 registered");
        assert_eq!(
            t.bdev("m0").unwrap()["claimed"],
            json!(false),
            "uuid {uuid}"
        );
    }
    // Read-only bdevs sharing a base get UUIDs of their own (the name is hashed too).
    for n in ["r1", "r2"] {
        t.rpc(&[
            "bdev_qcow2_create",
            "-b",
            n,
            "--base-bdev",
            "m0",
            "--read-only",
        ]);
    }
    let (r1, r2) = (uuid_of(&t, "r1"), uuid_of(&t, "r2"));
    assert!(r1 != r2 && canonical(&r1) && canonical(&r2), "{r1} {r2}");
    for n in ["r1", "r2"] {
        t.rpc(&["bdev_qcow2_delete", n]);
    }
    t.rpc(&["bdev_malloc_delete", "m0"]);

    let saved_path = d.join("saved.json");
    let saved = save(&t, &saved_path);
    let text = saved.to_string();
    assert_eq!(
        saved_create(&text, "q0")["params"]["uuid"],
        json!(u0),
        "{text}"
    );
    assert_eq!(
        saved_create(&text, "q1")["params"]["uuid"],
        json!(given.to_lowercase())
    );
    t.stop();

    // The same hand-written config again: the same UUIDs, derived again.
    let t = Target::start(d, "id2", Some(&cfg));
    assert_eq!(uuid_of(&t, "q0"), u0, "q0's UUID changed across a restart");
    assert_eq!(uuid_of(&t, "q1"), given.to_lowercase());
    t.stop();

    // From save_config's output: the same.
    let t = Target::start(d, "id3", Some(&saved_path));
    assert_eq!(
        uuid_of(&t, "q0"),
        u0,
        "q0's UUID changed across save_config"
    );
    assert_eq!(uuid_of(&t, "q1"), given.to_lowercase());
    t.stop();

    // What derivation depends on: another base UUID derives another UUID...
    let other = "7a6b5c4d-3e2f-4a1b-8c9d-0e1f2a3b4c5d";
    let cfg_other = d.join("hand-other.json");
    write_config(&cfg_other, hand(other));
    let t = Target::start(d, "id4", Some(&cfg_other));
    let moved = uuid_of(&t, "q0");
    assert_ne!(moved, u0, "the derived UUID ignores the base's UUID");
    t.stop();
    // ...but a saved config keeps the bdev's UUID whatever the base's became.
    let mut saved_other = saved.clone();
    for sub in saved_other["subsystems"].as_array_mut().unwrap() {
        for c in sub["config"].as_array_mut().into_iter().flatten() {
            if c["method"] == "bdev_aio_create" && c["params"]["name"] == "aio0" {
                c["params"]["uuid"] = json!(other);
            }
        }
    }
    let p = d.join("saved-other.json");
    fs::write(&p, serde_json::to_vec_pretty(&saved_other).unwrap()).unwrap();
    let t = Target::start(d, "id5", Some(&p));
    assert_eq!(uuid_of(&t, "aio0"), other);
    assert_eq!(uuid_of(&t, "q0"), u0, "the saved UUID was not honoured");
    t.stop();
    say(&format!(
        "qcow2 bdev UUIDs: q0 derived {u0} on every start (hand config and save_config), q1 \
         given {given} kept in lower case, bad ones refused"
    ));
}

/// Namespace 1's (UUID, NGUID) in `nvmf_get_subsystems`, its bdev checked.
fn ns_ids(t: &Target, nqn: &str) -> (String, String) {
    let subs = t.rpc(&["nvmf_get_subsystems"]);
    let ns = subs
        .as_array()
        .and_then(|a| a.iter().find(|s| s["nqn"] == nqn))
        .map(|s| s["namespaces"][0].clone())
        .unwrap_or_else(|| panic!("no namespace in {nqn}: {subs}"));
    assert_eq!(ns["bdev_name"], "q0", "{ns}");
    let get = |k: &str| {
        ns[k]
            .as_str()
            .unwrap_or_else(|| panic!("no {k}: {ns}"))
            .to_string()
    };
    (get("uuid"), get("nguid"))
}

/// Exports q0 as namespace 1 of `nqn` over TCP on 127.0.0.1:`port`.
fn export(t: &Target, nqn: &str, port: &str) {
    t.rpc(&["nvmf_create_transport", "-t", "TCP"]);
    t.rpc(&["nvmf_create_subsystem", nqn, "-a", "-s", "QCOW2UUID0001"]);
    t.rpc(&["nvmf_subsystem_add_ns", nqn, "q0"]);
    t.listen_tcp(nqn, port);
}

/// Namespace 1's (UUID, NGUID) as an initiator reads them over TCP (`spdk_nvme_identify`).
fn identify_ids(d: &Path, tag: &str, nqn: &str, port: &str) -> (String, String) {
    let trid = format!("trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn}");
    let (ok, text) = run_timed(
        Command::new("spdk_nvme_identify")
            .args(mem_args())
            .args(["-r", &trid]),
        &d.join(format!("{tag}.identify.log")),
        60,
    );
    assert!(ok, "spdk_nvme_identify failed:\n{text}");
    let ns = text
        .split("Namespace ID:1\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no namespace 1 in:\n{text}"));
    let field = |k: &str| {
        ns.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_lowercase())
            .unwrap_or_else(|| panic!("no {k} in namespace 1:\n{ns}"))
    };
    (field("UUID:"), field("NGUID:"))
}

#[test]
fn nvmf_namespace_ids_survive_restarts() {
    require!("spdk_tgt", "spdk_nvme_identify");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("ns.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), "16M"]);
    let cfg = d.join("ns.json");
    write_config(
        &cfg,
        vec![
            aio_with_uuid(&img, "aio0", BASE_A),
            qcow2("q0", "aio0", None),
        ],
    );
    let nqn = "nqn.2016-06.io.spdk:qcow2-uuid";
    let port = free_port().to_string();

    let t = Target::start(d, "ns1", Some(&cfg));
    export(&t, nqn, &port);
    let first = ns_ids(&t, nqn);
    let bdev = uuid_of(&t, "q0");
    // SPDK gives the namespace the bdev's UUID, and its bytes as the NGUID.
    assert_eq!(first.0, bdev);
    assert_eq!(
        first.1.replace('-', "").to_lowercase(),
        bdev.replace('-', "")
    );
    let wire = identify_ids(d, "ns1", nqn, &port);
    assert_eq!(wire.0, bdev, "UUID over the wire");
    assert_eq!(
        wire.1.replace([' ', '-', ':'], ""),
        bdev.replace('-', ""),
        "NGUID over the wire"
    );
    let saved = d.join("ns-saved.json");
    save(&t, &saved);
    t.stop();

    // The same bdev config, the same export made again by RPC.
    let t = Target::start(d, "ns2", Some(&cfg));
    export(&t, nqn, &port);
    assert_eq!(
        ns_ids(&t, nqn),
        first,
        "the namespace's ids changed across a restart"
    );
    assert_eq!(identify_ids(d, "ns2", nqn, &port), wire);
    t.stop();

    // Everything from save_config (the export too).
    let t = Target::start(d, "ns3", Some(&saved));
    assert_eq!(
        ns_ids(&t, nqn),
        first,
        "the namespace's ids changed across save_config"
    );
    assert_eq!(identify_ids(d, "ns3", nqn, &port), wire);
    t.stop();
    say(&format!(
        "NVMe-oF/TCP namespace over q0: UUID {} NGUID {} on three starts, as the initiator reads them",
        first.0, first.1
    ));
}

/// `qemu-img info -U` of `img` (read while the bdev has it open).
fn qemu_info_shared(img: &Path) -> Value {
    let out = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json", s(img)]));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `driver_specific.qcow2` of bdev `name`, with its `num_blocks`.
fn driver_info(t: &Target, name: &str) -> (Value, u64) {
    let b = t.bdev(name).unwrap_or_else(|| panic!("no bdev {name}"));
    (
        b["driver_specific"]["qcow2"].clone(),
        b["num_blocks"].as_u64().unwrap(),
    )
}

fn snapshot_names(info: &Value) -> Vec<String> {
    info["snapshots"]
        .as_array()
        .unwrap_or_else(|| panic!("no snapshot list: {info}"))
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn driver_info_follows_resize_snapshots_and_stream() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A raw golden image under an overlay with lazy refcounts (its dirty bit is set by the
    // first write-back that needs it), on a file with room to grow.
    let golden = d.join("li-golden.raw");
    fs::write(&golden, golden_bytes(16 << 20, 0x11fe)).unwrap();
    let ov = d.join("li.qcow2");
    let opts = format!(
        "cluster_size=65536,lazy_refcounts=on,backing_file={},backing_fmt=raw",
        s(&golden)
    );
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", &opts, s(&ov), "16M"]);
    pad(&ov);
    sparse(&ov, 256 * MIB);
    let cfg = d.join("li.json");
    write_config(
        &cfg,
        vec![
            aio(&golden, "gold"),
            aio(&ov, "aio0"),
            qcow2("q0", "aio0", Some("gold")),
        ],
    );
    let t = Target::start(d, "li", Some(&cfg));
    let (info, blocks) = driver_info(&t, "q0");
    assert_eq!(info["virtual_size"].as_u64(), Some(16 * MIB), "{info}");
    assert_eq!(blocks, 16 * MIB / 512);
    assert_eq!(info["backing_file"], json!(s(&golden)), "{info}");
    assert_eq!(info["backing_format"], "raw");
    assert_eq!(info["backing_bdev"], "gold");
    assert!(snapshot_names(&info).is_empty(), "{info}");
    assert_eq!(info["dirty"], false);

    // Resize: the size SPDK reports and the image's, as QEMU reads the header.
    t.rpc(&[
        "bdev_qcow2_resize",
        "-b",
        "q0",
        "-s",
        &(48 * MIB).to_string(),
    ]);
    let (info, blocks) = driver_info(&t, "q0");
    assert_eq!(info["virtual_size"].as_u64(), Some(48 * MIB), "{info}");
    assert_eq!(blocks, 48 * MIB / 512);
    assert_eq!(
        qemu_info_shared(&ov)["virtual-size"].as_u64(),
        Some(48 * MIB)
    );

    // Snapshots: listed as they are taken and deleted, as QEMU lists them.
    t.rpc(&["bdev_qcow2_snapshot_create", "-b", "q0", "-n", "s1"]);
    assert_eq!(snapshot_names(&driver_info(&t, "q0").0), ["s1"]);
    t.rpc(&["bdev_qcow2_snapshot_create", "-b", "q0", "-n", "s2"]);
    assert_eq!(snapshot_names(&driver_info(&t, "q0").0), ["s1", "s2"]);
    t.rpc(&["bdev_qcow2_snapshot_delete", "-b", "q0", "-n", "s1"]);
    let info = driver_info(&t, "q0").0;
    assert_eq!(snapshot_names(&info), ["s2"]);
    let q = qemu_info_shared(&ov);
    let qemu_names: Vec<&str> = q["snapshots"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(qemu_names, ["s2"], "{q}");
    assert_eq!(info["snapshots"][0]["id"], q["snapshots"][0]["id"]);

    // Stream: the backing goes from the header and from the bdev. Its writes allocate
    // clusters, so with lazy refcounts the dirty bit goes up: the bdev says so as QEMU
    // reads it from the file.
    t.rpc(&["bdev_qcow2_stream", "-b", "q0"]);
    wait_stream_done("q0", |a| t.try_rpc(a));
    let info = driver_info(&t, "q0").0;
    assert_eq!(info["backing_file"], Value::Null, "{info}");
    assert_eq!(info["backing_format"], Value::Null, "{info}");
    assert_eq!(info["backing_bdev"], Value::Null, "{info}");
    let q = qemu_info_shared(&ov);
    assert!(q.get("backing-filename").is_none(), "{q}");
    let qemu_dirty = &q["dirty-flag"];
    assert_eq!(info["dirty"], *qemu_dirty, "bdev {info}\nqemu-img {q}");
    assert_eq!(
        info["dirty"], true,
        "no dirty bit after the stream's writes: {info}"
    );
    t.stop();
    // Closed: refcounts written, the dirty bit cleared, as the bdev would now say.
    let q = qemu_info_shared(&ov);
    assert_eq!(q["dirty-flag"], false, "{q}");
    check_clean(&ov, "after resize, snapshots and a stream");
    say("driver_specific.qcow2 followed a resize, two snapshots and a delete, a stream and the dirty bit, as qemu-img info read the image");
}

#[test]
fn external_snapshot_keeps_the_bdev_uuid() {
    require!("spdk_tgt");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let old = d.join("es-old.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&old), "16M"]);
    let (ov1, ov2) = (d.join("es-ov1.raw"), d.join("es-ov2.raw"));
    for f in [&ov1, &ov2] {
        sparse(f, 32 * MIB);
    }
    let cfg = d.join("es.json");
    write_config(
        &cfg,
        vec![
            aio_with_uuid(&old, "aio0", BASE_A),
            aio_with_uuid(&ov1, "aio1", BASE_B),
            aio_with_uuid(&ov2, "aio2", "3c2b1a09-8f7e-4d6c-b5a4-93827160f5e4"),
            qcow2("q0", "aio0", None),
        ],
    );
    let t = Target::start(d, "es1", Some(&cfg));
    let u0 = uuid_of(&t, "q0");
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_snapshot_external",
        "-b",
        "q0",
        "--base-bdev",
        "aio1",
        "--snapshot-uuid",
        "q0-snap",
    ]);
    assert!(
        !ok && text.contains("snapshot_uuid 'q0-snap' is not a UUID"),
        "{text}"
    );
    // Another bdev's UUID: refused before anything pauses.
    let (ok, text) = t.try_rpc(&[
        "bdev_qcow2_snapshot_external",
        "-b",
        "q0",
        "--base-bdev",
        "aio1",
        "--snapshot-uuid",
        BASE_B,
    ]);
    assert!(!ok && text.contains("already a bdev's UUID"), "{text}");
    assert_eq!(driver_info(&t, "q0").0["base_bdev"], "aio0");
    assert_eq!(t.bdev("aio1").unwrap()["claimed"], json!(false));
    let given = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let args = ["bdev_qcow2_snapshot_external", "-b", "q0", "--base-bdev"];
    t.rpc(&[&args[..], &["aio1", "--snapshot-uuid", given]].concat());
    t.rpc(&[&args[..], &["aio2"]].concat());
    // The bdev keeps its UUID over each overlay; each old image's bdev has its own.
    assert_eq!(driver_info(&t, "q0").0["base_bdev"], "aio2");
    assert_eq!(uuid_of(&t, "q0"), u0);
    assert_eq!(uuid_of(&t, "q0_snap0"), given);
    let s1 = uuid_of(&t, "q0_snap1");
    assert!(canonical(&s1) && s1 != u0 && s1 != given, "{s1}");
    let saved = d.join("es-saved.json");
    save(&t, &saved);
    t.stop();
    let t = Target::start(d, "es2", Some(&saved));
    for (n, u) in [
        ("q0", &u0),
        ("q0_snap0", &given.to_string()),
        ("q0_snap1", &s1),
    ] {
        assert_eq!(&uuid_of(&t, n), u, "{n} after a restart from save_config");
    }
    t.stop();
    say("bdev_qcow2_snapshot_external: q0 kept its UUID over two overlays; the old images' bdevs got the given and a derived one, all kept by save_config");
}
