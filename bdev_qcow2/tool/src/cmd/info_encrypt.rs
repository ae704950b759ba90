//! The `encrypt` part of `qcow2 info`, as `qemu-img info` shows a LUKS-encrypted qcow2
//! image (read from its LUKS header; no key needed).

use qcow2_engine::crypto::cipher::IvGen;
use qcow2_engine::image::Luks;
use serde_json::{json, Value};
use std::fmt::Write;

/// `format-specific.data.encrypt` of `qemu-img info --output=json`.
pub fn encrypt_json(l: &Luks) -> Value {
    let h = l.header();
    let slots: Vec<Value> = h
        .slots
        .iter()
        .map(|s| {
            let off = u64::from(s.key_offset) * 512;
            if s.active {
                json!({"active": true, "iters": s.iterations, "key-offset": off, "stripes": s.stripes})
            } else {
                json!({"active": false, "key-offset": off})
            }
        })
        .collect();
    let mut v = json!({ "ivgen-alg": h.cipher.ivgen.name() });
    if let (Some(m), IvGen::Essiv(hash)) = (v.as_object_mut(), h.cipher.ivgen) {
        m.insert("ivgen-hash-alg".into(), json!(hash.name()));
    }
    if let Some(m) = v.as_object_mut() {
        for (k, x) in [
            ("detached-header", json!(false)),
            ("hash-alg", json!(h.hash.name())),
            ("cipher-alg", json!(h.cipher.alg.name())),
            ("uuid", json!(h.uuid)),
            ("format", json!("luks")),
            ("cipher-mode", json!(h.cipher.mode_name())),
            ("slots", json!(slots)),
            ("payload-offset", json!(u64::from(h.payload_offset) * 512)),
            ("master-key-iters", json!(h.mk_iterations)),
        ] {
            m.insert(k.into(), x);
        }
    }
    v
}

/// The human form, indented under `Format specific information:`.
pub fn encrypt_human(e: &Value, s: &mut String) {
    let _ = writeln!(s, "    encrypt:");
    let Some(m) = e.as_object() else { return };
    for (k, v) in m {
        let label = k.replace('-', " ");
        match v.as_array() {
            Some(slots) => {
                let _ = writeln!(s, "        {label}:");
                for (i, slot) in slots.iter().enumerate() {
                    let _ = writeln!(s, "            [{i}]:");
                    for (sk, sv) in slot.as_object().into_iter().flatten() {
                        let _ =
                            writeln!(s, "                {}: {}", sk.replace('-', " "), plain(sv));
                    }
                }
            }
            None => {
                let _ = writeln!(s, "        {label}: {}", plain(v));
            }
        }
    }
}

fn plain(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_owned)
}
