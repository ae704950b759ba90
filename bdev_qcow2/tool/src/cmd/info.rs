//! `qcow2 info`: what the image header says, shaped like `qemu-img info`.
//!
//! Never opens the backing file (like `qemu-img info`, which does not need it either).

use super::{ImageArgs, OutputFormat};
use crate::host::{open_single, Format, ToolError, ToolResult};
use qcow2_engine::format::header::{autoclear, compat, incompat};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;

/// Arguments of `qcow2 info`.
#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub output: OutputFormat,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub image: ImageArgs,
}

/// `1.5 MiB`-style sizes as qemu-img prints them.
pub fn human_size(n: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    // Three significant digits, trailing zeros dropped (qemu's size_to_str).
    let s = if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s} {}", UNITS[i])
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) for a Unix time.
pub fn utc_date(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn feature_names(bits: u64, known: &[(u64, &str)]) -> Vec<String> {
    (0..64)
        .filter(|b| bits & (1u64 << b) != 0)
        .map(|b| {
            known
                .iter()
                .find(|(m, _)| *m == 1u64 << b)
                .map(|(_, n)| n.to_string())
                .unwrap_or_else(|| format!("bit {b}"))
        })
        .collect()
}

/// Runs `qcow2 info`; returns the text to print.
pub fn run(args: &InfoArgs) -> ToolResult<String> {
    let spec = args.image.spec()?;
    let md = std::fs::metadata(&spec.path).map_err(|source| ToolError::Io {
        path: spec.path.display().to_string(),
        source,
    })?;
    let actual = md.blocks() * 512;
    let filename = spec.path.display().to_string();
    let v: Value = match spec.format {
        Format::Raw => json!({
            "children": [],
            "virtual-size": md.len(),
            "filename": filename,
            "format": "raw",
            "actual-size": actual,
            "dirty-flag": false,
        }),
        Format::Qcow2 => {
            let (exec, q) = open_single(&spec)?;
            let q2 = q.clone();
            let bitmaps: Vec<Value> = exec
                .block_on(async move { q2.bitmap_directory().await })
                .map_err(|source| ToolError::Engine {
                    path: spec.path.display().to_string(),
                    source,
                })?
                .iter()
                .map(|b| {
                    let flags: Vec<&str> = [(b.in_use(), "in-use"), (b.auto(), "auto")]
                        .into_iter()
                        .filter_map(|(on, name)| on.then_some(name))
                        .collect();
                    json!({"flags": flags, "name": b.name, "granularity": 1u64 << b.granularity_bits})
                })
                .collect();
            let ih = q.header();
            let h = &ih.header;
            let snapshots: Vec<Value> = q
                .snapshots()
                .iter()
                .map(|s| {
                    let mut o = json!({
                        "icount": s.icount(),
                        "vm-clock-nsec": s.vm_clock_nsec % 1_000_000_000,
                        "name": s.name,
                        "date-sec": s.date_sec,
                        "date-nsec": s.date_nsec,
                        "vm-clock-sec": s.vm_clock_nsec / 1_000_000_000,
                        "id": s.id,
                        "vm-state-size": s.vm_state_size_large(),
                    });
                    if s.icount().is_none() {
                        if let Some(m) = o.as_object_mut() {
                            m.remove("icount");
                        }
                    }
                    o
                })
                .collect();
            // Like qemu-img, version 2 images list only the fields they can have.
            let mut data = if h.version == 2 {
                json!({
                    "compat": "0.10",
                    "compression-type": h.compression_type.name(),
                    "refcount-bits": ih.refcount_bits(),
                })
            } else {
                json!({
                    "compat": "1.1",
                    "compression-type": h.compression_type.name(),
                    "lazy-refcounts": ih.lazy_refcounts(),
                    "refcount-bits": ih.refcount_bits(),
                    "corrupt": ih.is_corrupt(),
                    "extended-l2": ih.extended_l2(),
                })
            };
            if let Some(m) = data.as_object_mut() {
                if let Some(df) = &ih.extensions.external_data_file {
                    m.insert("data-file".into(), json!(df));
                }
                if !bitmaps.is_empty() {
                    m.insert("bitmaps".into(), json!(bitmaps));
                }
                if let Some(l) = q.luks() {
                    m.insert("encrypt".into(), super::info_encrypt::encrypt_json(l));
                }
                // Our additions: the raw version and feature bits.
                m.insert("version".into(), json!(h.version));
                m.insert(
                    "incompatible-features".into(),
                    json!(h.incompatible_features),
                );
                m.insert("compatible-features".into(), json!(h.compatible_features));
                m.insert("autoclear-features".into(), json!(h.autoclear_features));
                // Ours too: where the device reads zeros from (ARCHITECTURE.md §8).
                if let Some(z) = ih.extensions.zeroed_tail {
                    m.insert("zeroed-tail".into(), json!(z.from));
                }
            }
            let mut v = json!({
                "children": [],
                "virtual-size": q.size(),
                "filename": filename,
                "cluster-size": ih.cluster_size(),
                "format": "qcow2",
                "actual-size": actual,
                "format-specific": { "type": "qcow2", "data": data },
                "dirty-flag": ih.is_dirty(),
            });
            if let Some(m) = v.as_object_mut() {
                if q.encrypted() {
                    m.insert("encrypted".into(), json!(true));
                }
                if !snapshots.is_empty() {
                    m.insert("snapshots".into(), json!(snapshots));
                }
                if let Some(b) = &ih.backing_file {
                    if let Some(f) = &ih.extensions.backing_format {
                        m.insert("backing-filename-format".into(), json!(f));
                    }
                    let full = if std::path::Path::new(b).is_absolute() {
                        b.clone()
                    } else {
                        spec.path
                            .parent()
                            .map(|p| p.join(b))
                            .unwrap_or_else(|| b.into())
                            .display()
                            .to_string()
                    };
                    m.insert("full-backing-filename".into(), json!(full));
                    m.insert("backing-filename".into(), json!(b));
                }
            }
            v
        }
    };
    Ok(match args.output {
        OutputFormat::Json => serde_json::to_string_pretty(&v).unwrap_or_default() + "\n",
        OutputFormat::Human => human(&v),
    })
}

fn human(v: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let g = |k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    let n = |k: &str| g(k).as_u64().unwrap_or(0);
    let _ = writeln!(s, "image: {}", g("filename").as_str().unwrap_or(""));
    let _ = writeln!(s, "file format: {}", g("format").as_str().unwrap_or(""));
    let _ = writeln!(
        s,
        "virtual size: {} ({} bytes)",
        human_size(n("virtual-size")),
        n("virtual-size")
    );
    let _ = writeln!(s, "disk size: {}", human_size(n("actual-size")));
    if g("encrypted").as_bool() == Some(true) {
        let _ = writeln!(s, "encrypted: yes");
    }
    if let Some(cs) = v.get("cluster-size").and_then(Value::as_u64) {
        let _ = writeln!(s, "cluster_size: {cs}");
    }
    if let Some(b) = v.get("backing-filename").and_then(Value::as_str) {
        let _ = writeln!(s, "backing file: {b}");
    }
    if let Some(b) = v.get("backing-filename-format").and_then(Value::as_str) {
        let _ = writeln!(s, "backing file format: {b}");
    }
    if let Some(snaps) = v.get("snapshots").and_then(Value::as_array) {
        let _ = writeln!(s, "Snapshot list:");
        let _ = writeln!(
            s,
            "{:<10}{:<17}{:>7}{:>20}{:>15}",
            "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK"
        );
        for sn in snaps {
            let secs = sn.get("vm-clock-sec").and_then(Value::as_u64).unwrap_or(0);
            let _ = writeln!(
                s,
                "{:<10}{:<17}{:>7}{:>20}{:>6}:{:02}:{:02}",
                sn.get("id").and_then(Value::as_str).unwrap_or(""),
                sn.get("name").and_then(Value::as_str).unwrap_or(""),
                human_size(sn.get("vm-state-size").and_then(Value::as_u64).unwrap_or(0)),
                utc_date(sn.get("date-sec").and_then(Value::as_u64).unwrap_or(0)),
                secs / 3600,
                secs / 60 % 60,
                secs % 60
            );
        }
    }
    if let Some(d) = v.pointer("/format-specific/data") {
        let _ = writeln!(s, "Format specific information:");
        let b = |k: &str| {
            d.get(k)
                .map(|x| x.to_string().trim_matches('"').to_string())
                .unwrap_or_default()
        };
        for (key, label) in [
            ("compat", "compat"),
            ("compression-type", "compression type"),
            ("lazy-refcounts", "lazy refcounts"),
            ("bitmaps", "bitmaps"),
            ("refcount-bits", "refcount bits"),
            ("corrupt", "corrupt"),
            ("extended-l2", "extended l2"),
        ] {
            match d.get(key).and_then(Value::as_array) {
                // Listed as qemu-img lists them.
                Some(list) => {
                    let _ = writeln!(s, "    {label}:");
                    for (i, bm) in list.iter().enumerate() {
                        let _ = writeln!(s, "        [{i}]:");
                        let _ = writeln!(s, "            flags:");
                        for (j, f) in bm["flags"].as_array().into_iter().flatten().enumerate() {
                            let _ =
                                writeln!(s, "                [{j}]: {}", f.as_str().unwrap_or(""));
                        }
                        let _ =
                            writeln!(s, "            name: {}", bm["name"].as_str().unwrap_or(""));
                        let _ = writeln!(s, "            granularity: {}", bm["granularity"]);
                    }
                }
                None if d.get(key).is_some() => {
                    let _ = writeln!(s, "    {label}: {}", b(key));
                }
                None => {}
            }
            if let (Some(e), "refcount-bits") = (d.get("encrypt"), key) {
                super::info_encrypt::encrypt_human(e, &mut s);
            }
        }
        let bits = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
        let inc = feature_names(
            bits("incompatible-features"),
            &[
                (incompat::DIRTY, "dirty"),
                (incompat::CORRUPT, "corrupt"),
                (incompat::EXTERNAL_DATA_FILE, "external data file"),
                (incompat::COMPRESSION_TYPE, "compression type"),
                (incompat::EXTENDED_L2, "extended L2"),
            ],
        );
        let com = feature_names(
            bits("compatible-features"),
            &[(compat::LAZY_REFCOUNTS, "lazy refcounts")],
        );
        let auto = feature_names(
            bits("autoclear-features"),
            &[
                (autoclear::BITMAPS, "bitmaps"),
                (autoclear::RAW_EXTERNAL, "raw external data"),
                (autoclear::ZEROED_TAIL, "zeroed tail"),
            ],
        );
        let _ = writeln!(s, "    format version: {}", b("version"));
        let _ = writeln!(s, "    incompatible features: [{}]", inc.join(", "));
        let _ = writeln!(s, "    compatible features: [{}]", com.join(", "));
        let _ = writeln!(s, "    autoclear features: [{}]", auto.join(", "));
        if let Some(from) = d.get("zeroed-tail").and_then(Value::as_u64) {
            let _ = writeln!(
                s,
                "    zeroed tail: the device reads zeros from offset {from} ({})",
                human_size(from)
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::human_size;

    #[test]
    fn dates() {
        assert_eq!(super::utc_date(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc_date(1_796_015_300), "2026-11-30 05:08:20");
    }

    #[test]
    fn sizes_like_qemu() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(4 << 20), "4 MiB");
        assert_eq!(human_size(397312), "388 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
    }
}
