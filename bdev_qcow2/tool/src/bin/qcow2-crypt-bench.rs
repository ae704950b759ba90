//! Cipher speed of encrypted images, side by side with OpenSSL: GB/s of our sector cipher
//! (4 KiB requests, one core) for each mode, and `openssl speed -evp aes-256-xts` at 4 KiB
//! when openssl is installed. A benchmark, not a test: it prints figures.

use qcow2_engine::crypto::{CipherSpec, SectorCipher};
use std::process::Command;
use std::time::{Duration, Instant};

fn speed(c: &SectorCipher, enc: bool) -> f64 {
    let mut buf = vec![0x5au8; 4096];
    let (t, mut n, mut sector) = (Instant::now(), 0u64, 0u64);
    while t.elapsed() < Duration::from_millis(700) {
        for _ in 0..256 {
            if enc {
                c.encrypt(sector, &mut buf);
            } else {
                c.decrypt(sector, &mut buf);
            }
            sector += 8;
            n += 4096;
        }
    }
    n as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn openssl_xts() -> Option<f64> {
    let out = Command::new("openssl")
        .args([
            "speed",
            "-evp",
            "aes-256-xts",
            "-bytes",
            "4096",
            "-seconds",
            "1",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // Last line: "AES-256-XTS  <kB/s>k" (1000-byte units).
    let line = text
        .lines()
        .rev()
        .find(|l| l.to_lowercase().contains("xts"))?;
    let v = line.split_whitespace().last()?.trim_end_matches('k');
    Some(v.parse::<f64>().ok()? * 1000.0 / 1e9)
}

fn main() {
    let ossl = openssl_xts();
    for (mode, kb) in [
        ("xts-plain64", 64),
        ("xts-plain64", 32),
        ("cbc-essiv:sha256", 32),
        ("cbc-plain64", 16),
    ] {
        let spec = CipherSpec::parse("aes", mode, kb).unwrap_or_else(|| panic!("{mode}"));
        let key: Vec<u8> = (0..kb as u8).collect();
        let c = SectorCipher::new(&spec, &key).unwrap_or_else(|_| panic!("{mode}"));
        let (e, d) = (speed(&c, true), speed(&c, false));
        let ratio = match (mode, kb, ossl) {
            ("xts-plain64", 64, Some(o)) => format!(
                "  (vs openssl aes-256-xts {o:.2} GB/s: enc {:.2}x, dec {:.2}x)",
                e / o,
                d / o
            ),
            _ => String::new(),
        };
        println!(
            "aes-{}-{mode}: encrypt {e:.2} GB/s, decrypt {d:.2} GB/s{ratio}",
            spec.bits.name().trim_start_matches("aes-")
        );
    }
}
