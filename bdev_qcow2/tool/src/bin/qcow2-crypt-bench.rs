//! Cipher speed of encrypted images, side by side with OpenSSL, one core: GB/s of our
//! aes-256-xts-plain64 over 512-byte, 4 KiB and 128 KiB requests (512-byte sectors, each
//! with its own IV: the format's data unit), against OpenSSL's EVP over units of the same
//! sizes with no IV reset (what `openssl speed -evp aes-256-xts -bytes N` measures; timed
//! here in-process, and `openssl speed` itself run when installed). Ours is the backend
//! `SectorCipher::new` picks (VAES on a CPU with it and AVX-512, see PERFORMANCE.md §12),
//! beside our XTS over OpenSSL's AES-ECB (the backend on other CPUs: the same as ours
//! there) and the RustCrypto reference. Rounds alternate
//! the contenders; each figure is the median of the rounds. Then the other modes and
//! ciphers, once each.
//! A benchmark, not a test: it prints figures.
//!
//! `qcow2-crypt-bench [ROUNDS]` (default 5).

#![forbid(unsafe_code)]

use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;
use openssl::error::ErrorStack;
use qcow2_engine::crypto::{Backend, CipherSpec, SectorCipher};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RUN: Duration = Duration::from_millis(500);

/// This thread's CPU time: on a loaded machine, what it ran, not what others took.
fn cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// GB/s of this thread's CPU time (as `openssl speed` counts its user time) of `f` called
/// on a `len`-byte buffer for [`RUN`] (`f` gets the buffer and the number of the call).
fn timed(len: usize, mut f: impl FnMut(&mut [u8], u64)) -> f64 {
    // On a cache line, as an I/O buffer is (SPDK's are 4 KiB-aligned DMA memory; malloc
    // gives 16 bytes, and the contenders' 32-byte accesses would then straddle lines).
    let mut room = vec![0x5au8; len + 64];
    let at = room.as_ptr().align_offset(64).min(64);
    let buf = &mut room[at..at + len];
    let (t, c0, mut n, mut i) = (Instant::now(), cpu(), 0u64, 0u64);
    while t.elapsed() < RUN {
        for _ in 0..256 {
            f(buf, i);
            i += 1;
            n += len as u64;
        }
    }
    n as f64 / (cpu() - c0).as_secs_f64() / 1e9
}

/// OpenSSL's EVP aes-256-xts (encrypt) over `len`-byte units, keyed once; no IV reset (as
/// `openssl speed` runs it) unless `reset` (as a sector of the format needs).
fn evp_direct(key: &[u8], len: usize, reset: bool) -> Result<f64, ErrorStack> {
    let mut ctx = CipherCtx::new()?;
    let c = Cipher::aes_256_xts();
    ctx.encrypt_init(Some(c), Some(key), Some(&[0u8; 16]))?;
    Ok(timed(len, |b, i| {
        if reset {
            let mut iv = [0u8; 16];
            iv[..8].copy_from_slice(&i.to_le_bytes());
            let _ = ctx.encrypt_init(None, None, Some(&iv));
        }
        let n = b.len();
        let _ = ctx.cipher_update_inplace(b, n);
    }))
}

/// OpenSSL's EVP aes-256-ecb over 4096-byte units (one half of the XTS key): the AES our
/// XTS runs on.
fn evp_ecb(key: &[u8]) -> Result<f64, ErrorStack> {
    let mut ctx = CipherCtx::new()?;
    ctx.encrypt_init(Some(Cipher::aes_256_ecb()), Some(&key[..32]), None)?;
    ctx.set_padding(false);
    let mut out = vec![0u8; 4096 + 16];
    Ok(timed(4096, |b, _| {
        let _ = ctx.cipher_update(b, Some(&mut out));
    }))
}

/// `openssl speed -evp aes-256-xts -bytes N` (1 s), in GB/s.
fn openssl_speed(bytes: usize) -> Option<f64> {
    let n = bytes.to_string();
    let args = [
        "speed",
        "-evp",
        "aes-256-xts",
        "-bytes",
        &n,
        "-seconds",
        "1",
    ];
    let out = Command::new("openssl").args(args).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // Last line: "AES-256-XTS  <kB/s>k" (1000-byte units).
    let line = text
        .lines()
        .rev()
        .find(|l| l.to_lowercase().contains("xts"))?;
    let v = line.split_whitespace().last()?.trim_end_matches('k');
    Some(v.parse::<f64>().ok()? * 1000.0 / 1e9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn key(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(11))
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let spec = CipherSpec::parse("aes", "xts-plain64", 64).ok_or("xts-plain64")?;
    let k = key(64);
    let ours = Arc::new(SectorCipher::new(&spec, &k).map_err(|e| format!("{e:?}"))?);
    let old =
        SectorCipher::with_backend(&spec, &k, Backend::RustCrypto).map_err(|e| format!("{e:?}"))?;
    let ecb = Arc::new(
        SectorCipher::with_backend(&spec, &k, Backend::OpenSsl).map_err(|e| format!("{e:?}"))?,
    );
    let names = [
        "openssl speed -bytes 512",
        "openssl speed -bytes 4096",
        "openssl speed -bytes 131072",
        "EVP in-process, 512-byte units",
        "EVP in-process, 4096-byte units",
        "EVP in-process, 131072-byte units",
        "EVP in-process, 512-byte units, IV reset each",
        "EVP in-process aes-256-ecb, 4096-byte units",
        "ours 4 KiB encrypt (worker)",
        "ours 4 KiB decrypt (worker)",
        "ours 4 KiB encrypt (shared &SectorCipher)",
        "ours 512 B encrypt (worker)",
        "ours 512 B decrypt (worker)",
        "ours 128 KiB encrypt (worker)",
        "ours 128 KiB decrypt (worker)",
        "our XTS over OpenSSL's ECB, 4 KiB encrypt",
        "our XTS over OpenSSL's ECB, 4 KiB decrypt",
        "our XTS over OpenSSL's ECB, 512 B encrypt",
        "our XTS over OpenSSL's ECB, 128 KiB encrypt",
        "RustCrypto reference 4 KiB encrypt",
        "RustCrypto reference 4 KiB decrypt",
    ];
    // Indices of the rows compared below.
    const SPEED_512: usize = 0;
    const SPEED_4K: usize = 1;
    const SPEED_128K: usize = 2;
    const OURS_4K: usize = 8;
    const OURS_512: usize = 11;
    const OURS_128K: usize = 13;
    let mut figs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let have_openssl = openssl_speed(16).is_some();
    for _ in 0..rounds {
        let mut w = ours.worker();
        let mut e = ecb.worker();
        let speed = |n| have_openssl.then(|| openssl_speed(n)).flatten();
        let row = [
            speed(512),
            speed(4096),
            speed(131072),
            Some(evp_direct(&k, 512, false)?),
            Some(evp_direct(&k, 4096, false)?),
            Some(evp_direct(&k, 131072, false)?),
            Some(evp_direct(&k, 512, true)?),
            Some(evp_ecb(&k)?),
            Some(timed(4096, |b, i| w.encrypt(i * 8, b))),
            Some(timed(4096, |b, i| w.decrypt(i * 8, b))),
            Some(timed(4096, |b, i| ours.encrypt(i * 8, b))),
            Some(timed(512, |b, i| w.encrypt(i, b))),
            Some(timed(512, |b, i| w.decrypt(i, b))),
            Some(timed(131072, |b, i| w.encrypt(i * 256, b))),
            Some(timed(131072, |b, i| w.decrypt(i * 256, b))),
            Some(timed(4096, |b, i| e.encrypt(i * 8, b))),
            Some(timed(4096, |b, i| e.decrypt(i * 8, b))),
            Some(timed(512, |b, i| e.encrypt(i, b))),
            Some(timed(131072, |b, i| e.encrypt(i * 256, b))),
            Some(timed(4096, |b, i| old.encrypt(i * 8, b))),
            Some(timed(4096, |b, i| old.decrypt(i * 8, b))),
        ];
        let f = |i: usize| row[i].unwrap_or(f64::NAN);
        println!(
            "  round (GB/s): openssl speed 512 / 4096 / 131072 {:.2} / {:.2} / {:.2}, \
             ours {:.2} / {:.2} / {:.2}",
            f(SPEED_512),
            f(SPEED_4K),
            f(SPEED_128K),
            f(OURS_512),
            f(OURS_4K),
            f(OURS_128K)
        );
        for (f, v) in figs.iter_mut().zip(row) {
            f.extend(v);
        }
    }
    let med: Vec<f64> = figs.into_iter().map(median).collect();
    let ours_enc = med[OURS_4K];
    println!(
        "aes-256-xts, one core, medians of {rounds} alternating rounds (backend {:?}):",
        ours.backend()
    );
    for (name, m) in names.iter().zip(&med) {
        if m.is_nan() {
            println!("  {name:<44} (openssl not installed)");
        } else {
            println!("  {name:<44} {m:>6.2} GB/s");
        }
    }
    println!("ours 4 KiB encrypt (worker) against:");
    for (i, what) in [
        (SPEED_4K, "openssl speed -bytes 4096"),
        (SPEED_512, "openssl speed -bytes 512"),
        (4, "EVP in-process 4096"),
        (3, "EVP in-process 512"),
        (6, "EVP in-process 512 + IV reset (the format's bound)"),
    ] {
        if !med[i].is_nan() {
            println!("  {what:<52} {:.2}x", ours_enc / med[i]);
        }
    }
    if !med[SPEED_512].is_nan() {
        println!(
            "ours 512 B encrypt (worker) against openssl speed -bytes 512: {:.2}x",
            med[OURS_512] / med[SPEED_512]
        );
        println!(
            "ours 128 KiB encrypt (worker) against openssl speed -bytes 131072: {:.2}x",
            med[OURS_128K] / med[SPEED_128K]
        );
    }
    println!("other modes, one 4 KiB run each (encrypt / decrypt GB/s):");
    for (name, mode, kb) in [
        ("aes", "xts-plain64", 32),
        ("aes", "xts-plain64", 48),
        ("aes", "xts-essiv:sha256", 64),
        ("aes", "cbc-essiv:sha256", 32),
        ("aes", "cbc-plain64", 16),
        // QEMU's other ciphers (RustCrypto, portable code).
        ("twofish", "xts-plain64", 64),
        ("serpent", "xts-plain64", 64),
        ("twofish", "cbc-essiv:sha256", 16),
        ("cast5", "cbc-plain64", 16),
    ] {
        let spec = CipherSpec::parse(name, mode, kb).unwrap_or_else(|| panic!("{mode}"));
        let c = Arc::new(SectorCipher::new(&spec, &key(kb)).unwrap_or_else(|_| panic!("{mode}")));
        let mut w = c.worker();
        let e = timed(4096, |b, i| w.encrypt(i * 8, b));
        let d = timed(4096, |b, i| w.decrypt(i * 8, b));
        println!(
            "  {}-{mode}: {e:.3} / {d:.3} ({:?})",
            spec.alg.name(),
            c.backend()
        );
    }
    Ok(())
}
