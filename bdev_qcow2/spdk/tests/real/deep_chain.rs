//! A deep chain of qcow2 bdevs (#48): a writable overlay over read-only qcow2 bdevs, each
//! over the next, made by qemu-img with data in different layers (4 KiB clusters in one,
//! extended L2 in another, zeros written over data below, the overlay's own writes). The
//! overlay reads the layers' base bdevs as layers of its own chain (`backing_layers` in
//! `bdev_get_bdevs`), and reads what qemu-io reads of the same chain; bdevperf's verify
//! on two cores (copy-on-write from the deep layers, reads through the channels) leaves an
//! image QEMU checks clean and reads as SPDK does; a stream then makes the overlay hold
//! the whole disk alone.

use super::*;

/// Layers under the overlay.
const DEPTH: usize = 6;

/// The layer files, bottom first, and the overlay: `l0` holds data everywhere it writes;
/// each layer above writes its own pattern over part of it, some zeros, some fresh ranges.
fn chain(d: &Path) -> (Vec<PathBuf>, PathBuf) {
    let mut layers: Vec<PathBuf> = Vec::new();
    for i in 0..DEPTH {
        let f = d.join(format!("l{i}.qcow2"));
        let opts = match i {
            2 => "cluster_size=4096",
            3 => "cluster_size=16384,extended_l2=on",
            _ => "cluster_size=65536",
        };
        let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
        let below;
        if let Some(b) = layers.last() {
            below = s(b).to_string();
            args.extend(["-b", &below, "-F", "qcow2"]);
        }
        args.extend([s(&f), "32M"]);
        qemu_img(&args);
        let p = 0x40 + i;
        let writes = [
            format!("write -P {p:#x} {}k 1M", i * 3072),
            format!("write -P {:#x} {}k 12k", p + 0x20, 20480 + i * 40),
            format!("write -P {:#x} {}k 4k", p + 0x40, 24576 + i * 516),
            if i % 2 == 1 {
                format!("write -z {}k 64k", (i - 1) * 3072 + 512)
            } else {
                format!("write -P {:#x} 31M 512", p + 0x60)
            },
        ];
        let w: Vec<&str> = writes.iter().map(String::as_str).collect();
        qemu_io(&f, &w);
        pad(&f);
        layers.push(f);
    }
    let top = d.join("top.qcow2");
    let below = s(layers.last().unwrap()).to_string();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        &below,
        "-F",
        "qcow2",
        s(&top),
        "32M",
    ]);
    qemu_io(&top, &["write -P 0x99 100k 8k", "write -z 5M 64k"]);
    pad(&top);
    let f = fs::OpenOptions::new().write(true).open(&top).unwrap();
    f.set_len(256 * MIB).unwrap();
    (layers, top)
}

/// Starts `spdk_tgt` over config `cfg` of a chain of `depth` read-only qcow2 bdevs under
/// `q0`, and checks that `q0` reads them as layers of its own chain.
fn start_chain(d: &Path, tag: &str, cfg: &Path, depth: usize) -> Target {
    let t = Target::start(d, tag, Some(cfg));
    let q0 = t.bdev("q0").expect("no bdev q0");
    let q = &q0["driver_specific"]["qcow2"];
    assert_eq!(q["backing_layers"], json!(depth), "{q0}");
    t
}

/// The config: an AIO bdev per file, a read-only qcow2 bdev per layer over the one below,
/// the writable overlay `q0` over the last.
fn config(path: &Path, layers: &[PathBuf], top: &Path) {
    let mut calls = Vec::new();
    for (i, f) in layers.iter().enumerate() {
        calls.push(aio(f, &format!("a{i}")));
        let mut p =
            json!({"name": format!("l{i}"), "base_bdev": format!("a{i}"), "read_only": true});
        if i > 0 {
            p["backing_bdev"] = json!(format!("l{}", i - 1));
        }
        calls.push(json!({"method": "bdev_qcow2_create", "params": p}));
    }
    calls.push(aio(top, "atop"));
    let last = format!("l{}", layers.len() - 1);
    calls.push(qcow2("q0", "atop", Some(&last)));
    write_config(path, calls);
}

#[test]
fn a_deep_chain_of_qcow2_bdevs_reads_what_qemu_reads() {
    require!("spdk_tgt", "spdk_dd", "bdevperf");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (layers, top) = chain(d);
    let cfg = d.join("deep.json");
    config(&cfg, &layers, &top);

    // The overlay reads the six layers directly; a layer's base refuses a writer.
    let t = start_chain(d, "deep", &cfg, DEPTH);
    let (ok, text) = t.try_rpc(&["bdev_qcow2_create", "-b", "w3", "--base-bdev", "a3"]);
    assert!(!ok, "a writer of a layer's base was accepted: {text}");
    // Each read-only bdev's channel on the md thread was built once and stays (`keep.rs`):
    // SPDK's examine of each new bdev read it through channels that lived on, instead of
    // building and tearing down a channel of every bdev below (quadratic in the depth,
    // and a nested build that failed past a few hundred).
    for i in 0..DEPTH {
        let stats = t.rpc(&["bdev_qcow2_get_stats", "-b", &format!("l{i}")]);
        let channels = stats[0]["channels"].as_array().map_or(0, Vec::len);
        assert_eq!(channels, 1, "l{i} does not keep one channel: {stats}");
    }
    t.stop();

    // What QEMU reads of the chain (the owner's path: spdk_dd reads on the md thread).
    dd_and_compare(d, &cfg, "q0", &top, "deep-through");

    // bdevperf verify on two cores: copies on write from the deep layers, reads on the
    // channels' chains; then QEMU checks the overlay and reads what SPDK reads.
    let (ok, text) = bdevperf(
        d,
        &cfg,
        "deep-verify",
        &[
            "-m", "0x3", "-q", "16", "-o", "4096", "-w", "verify", "-t", "3", "-T", "q0",
        ],
        90,
    );
    assert!(ok, "bdevperf verify over the deep chain failed:\n{text}");
    let (ok, text) = bdevperf(
        d,
        &cfg,
        "deep-read",
        &[
            "-m", "0x3", "-q", "32", "-o", "4096", "-w", "randread", "-t", "2", "-T", "q0",
        ],
        90,
    );
    assert!(ok, "bdevperf randread over the deep chain failed:\n{text}");
    check_clean(&top, "the overlay after bdevperf over the deep chain");
    dd_and_compare(d, &cfg, "q0", &top, "deep-after-verify");
    for l in &layers {
        check_clean(l, "a layer under the overlay");
    }

    // A stream over the deep chain: the overlay then holds the disk alone.
    let want = d.join("deep-want.raw");
    qemu_img(&["convert", "-O", "raw", s(&top), s(&want)]);
    let t = Target::start(d, "deep-stream", Some(&cfg));
    t.rpc(&["bdev_qcow2_stream", "-b", "q0"]);
    wait_stream_done("q0", |a| t.try_rpc(a));
    t.stop();
    check_clean(&top, "the overlay after a stream over the deep chain");
    no_backing(&top);
    compare_with_raw(&top, &want);
    say(&format!(
        "a writable qcow2 bdev over {DEPTH} read-only qcow2 bdevs reads their bases as one chain \
         (backing_layers {DEPTH}), reads what qemu-img reads before and after bdevperf verify \
         on two cores, and streams to an image equal to the chain"
    ));
}

/// Layers of the chain in `a_layer_nothing_reads_holds_no_channel`.
const EMPTY_DEPTH: usize = 40;

/// An AIO bdev's channel is a kernel AIO context that SPDK polls on every pass of its
/// thread and whose `io_destroy` stalls it for an RCU grace period (tens of ms): at 1,000
/// layers, the contexts of layers nothing read took half of a core in polls and seconds
/// to tear down. A read-only bdev copies the image its creation opened (no channel of its
/// base to open it), and the overlay's chains take a layer's channel when a read reaches
/// it: over empty layers with the data in the bottom one, after the examines and reads,
/// no thread holds a channel of an empty layer's base.
#[test]
fn a_layer_nothing_reads_holds_no_channel() {
    require!("spdk_tgt", "spdk_dd");
    require_rpc!();
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut layers: Vec<PathBuf> = Vec::new();
    for i in 0..EMPTY_DEPTH {
        let f = d.join(format!("l{i}.qcow2"));
        let below = layers.last().map(|b| s(b).to_string());
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if let Some(b) = &below {
            // -u: qemu-img would open the whole chain below for each new layer.
            args.extend(["-u", "-b", b, "-F", "qcow2"]);
        }
        args.extend([s(&f), "32M"]);
        qemu_img(&args);
        if i == 0 {
            qemu_io(&f, &["write -P 0x5a 0 32M"]);
        }
        pad(&f);
        layers.push(f);
    }
    let top = d.join("top.qcow2");
    let last = s(layers.last().unwrap()).to_string();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        &last,
        "-F",
        "qcow2",
        s(&top),
        "32M",
    ]);
    pad(&top);
    let f = fs::OpenOptions::new().write(true).open(&top).unwrap();
    f.set_len(64 * MIB).unwrap();
    let cfg = d.join("empty.json");
    config(&cfg, &layers, &top);

    // What QEMU reads of the chain, through the overlay's chain on the md thread.
    dd_and_compare(d, &cfg, "q0", &top, "empty-through");

    let t = start_chain(d, "empty", &cfg, EMPTY_DEPTH);
    let threads = t.rpc(&["thread_get_io_channels"]);
    let held: Vec<String> = threads["threads"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|th| th["io_channels"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .filter(|n| {
            // A bdev's io_device is named `bdev_<name>`.
            n.strip_prefix("bdev_a")
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i > 0)
        })
        .collect();
    assert!(
        held.is_empty(),
        "channels of empty layers' bases are held: {held:?}\n{threads}"
    );
    let t0 = Instant::now();
    t.stop();
    say(&format!(
        "a chain of {EMPTY_DEPTH} qcow2 bdevs with data in the bottom one holds no channel of an \
         empty layer's base after its examines and reads; stopped in {:.2} s",
        t0.elapsed().as_secs_f64()
    ));
}
