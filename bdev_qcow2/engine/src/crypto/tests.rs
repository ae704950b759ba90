//! Unit tests of the sector ciphers and LUKS headers: known answers, round trips, hostile
//! headers, the backends against each other.

use super::cipher::{Backend, CipherAlg, IvGen, Mode};
use super::hash::HashAlg;
use super::*;

#[test]
fn cipher_specs_qemu_names() {
    let s = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    assert_eq!(
        (s.alg, s.mode, s.ivgen),
        (CipherAlg::Aes256, Mode::Xts, IvGen::Plain64)
    );
    let s = CipherSpec::parse("aes", "cbc-essiv:sha256", 16).unwrap();
    assert_eq!(s.ivgen, IvGen::Essiv(HashAlg::Sha256));
    assert_eq!(s.alg, CipherAlg::Aes128);
    assert!(CipherSpec::parse("aes", "xts-plain64", 63).is_none());
    assert!(CipherSpec::parse("aes", "cbc-essiv:sha1", 32).is_none());
    assert!(CipherSpec::parse("sm4", "xts-plain64", 32).is_none());
    assert!(CipherSpec::parse("aes", "ecb", 32).is_none());
}

#[test]
fn sectors_round_trip_and_depend_on_the_sector_number() {
    for (mode, kb) in [
        ("xts-plain64", 64),
        ("xts-plain", 32),
        ("xts-essiv:sha256", 48),
        ("cbc-plain64", 32),
        ("cbc-essiv:sha256", 24),
    ] {
        let spec = CipherSpec::parse("aes", mode, kb).unwrap();
        let key: Vec<u8> = (0..kb as u8).collect();
        let c = SectorCipher::new(&spec, &key).unwrap();
        let plain: Vec<u8> = (0..2048u32).map(|i| (i * 7) as u8).collect();
        let mut a = plain.clone();
        c.encrypt(5, &mut a);
        assert_ne!(a, plain, "{mode}");
        // Sector 6 alone encrypts as the second sector of a run starting at 5.
        let mut b = plain[512..1024].to_vec();
        c.encrypt(6, &mut b);
        assert_eq!(b, a[512..1024], "{mode}");
        c.decrypt(5, &mut a);
        assert_eq!(a, plain, "{mode}");
    }
}

#[test]
fn xts_plain64_known_answer() {
    // IEEE 1619 XTS-AES-256 vector 10 (data unit sequence number 0xff): first 16 bytes.
    let k1 = "2718281828459045235360287471352662497757247093699959574966967627";
    let k2 = "3141592653589793238462643383279502884197169399375105820974944592";
    let key: Vec<u8> = (0..64)
        .map(|i| u8::from_str_radix(&format!("{k1}{k2}")[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let spec = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    let c = SectorCipher::new(&spec, &key).unwrap();
    let mut data: Vec<u8> = (0..512).map(|i| i as u8).collect();
    c.encrypt(0xff, &mut data);
    assert_eq!(
        &data[..16],
        &[
            0x1c, 0x3b, 0x3a, 0x10, 0x2f, 0x77, 0x03, 0x86, 0xe4, 0x83, 0x6c, 0x99, 0xe3, 0x70,
            0xcf, 0x9b
        ]
    );
}

use super::build::{build, LuksBuild};
use crate::error::{Error, Field};

fn area(secret: &[u8], iterations: u32) -> Vec<u8> {
    build(&LuksBuild {
        cipher: ("aes", "xts-plain64"),
        hash: HashAlg::Sha256,
        master_key: &[7u8; 64],
        secret,
        iterations,
        seed: 1,
    })
}

fn field(e: Error) -> Option<Field> {
    e.field()
}

#[test]
fn unlock_right_and_wrong_key() {
    let a = area(b"pw", 1000);
    let h = LuksHeader::parse(&a).unwrap();
    let c = h.unlock(&a, b"pw").unwrap();
    let reference = SectorCipher::new(&h.cipher, &[7u8; 64]).unwrap();
    let (mut x, mut y) = (vec![3u8; 1024], vec![3u8; 1024]);
    c.encrypt(9, &mut x);
    reference.encrypt(9, &mut y);
    assert_eq!(x, y, "unlocked key is the master key");
    assert_eq!(h.unlock(&a, b"nope").unwrap_err(), Error::WrongKey);
}

fn put32(a: &mut [u8], at: usize, v: u32) {
    a[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

/// A change to a header area.
type Mutation = Box<dyn Fn(&mut Vec<u8>)>;

#[test]
fn hostile_headers_refused_before_any_key_derivation() {
    let good = area(b"pw", 1000);
    let slot0 = 208;
    let cases: Vec<(&str, Mutation)> = vec![
        ("magic", Box::new(|a| a[0] = b'X')),
        ("version", Box::new(|a| a[7] = 2)),
        (
            "slot iterations",
            Box::new(move |a| put32(a, slot0 + 4, u32::MAX)),
        ),
        ("digest iterations", Box::new(|a| put32(a, 164, 0))),
        ("slot state", Box::new(move |a| put32(a, slot0, 0x1234))),
        ("stripes", Box::new(move |a| put32(a, slot0 + 44, 1 << 30))),
        (
            "material outside",
            Box::new(move |a| put32(a, slot0 + 40, u32::MAX)),
        ),
        (
            "overlaps header",
            Box::new(move |a| put32(a, slot0 + 40, 0)),
        ),
        (
            "overlapping slots",
            Box::new(move |a| put32(a, slot0 + 48 + 40, 9)),
        ),
        ("no active slot", Box::new(move |a| put32(a, slot0, 0xDEAD))),
        ("truncated", Box::new(|a| a.truncate(100))),
        ("key bytes", Box::new(|a| put32(a, 108, 1 << 31))),
    ];
    for (name, f) in cases {
        let mut a = good.clone();
        f(&mut a);
        let t = std::time::Instant::now();
        let r = LuksHeader::parse(&a);
        assert!(r.is_err(), "{name} accepted");
        let e = r.unwrap_err();
        assert!(
            field(e.clone()) == Some(Field::LuksHeader)
                || matches!(e, Error::UnsupportedFeature(_)),
            "{name}: {e}"
        );
        assert!(t.elapsed().as_millis() < 100, "{name}: slow refusal");
    }
    // Every active slot at the limit: refused as a whole (a wrong key would try them all).
    let mut a = good.clone();
    for i in 0..8 {
        let s = slot0 + 48 * i;
        put32(&mut a, s, 0x00AC_71F3);
        put32(&mut a, s + 4, crate::limits::MAX_LUKS_ITERATIONS);
    }
    assert!(LuksHeader::parse(&a).is_err());
}

/// Every mode and key size we parse, with the backend OpenSSL is expected to take.
const ALL_MODES: [(&str, usize, Backend); 14] = [
    ("xts-plain64", 32, Backend::OpenSsl),
    ("xts-plain64", 48, Backend::RustCrypto), // no AES-192 XTS in OpenSSL
    ("xts-plain64", 64, Backend::OpenSsl),
    ("xts-plain", 64, Backend::OpenSsl),
    ("xts-essiv:sha256", 64, Backend::OpenSsl),
    ("xts-essiv:sha256", 32, Backend::OpenSsl),
    ("cbc-plain", 16, Backend::OpenSsl),
    ("cbc-plain64", 16, Backend::OpenSsl),
    ("cbc-plain64", 24, Backend::OpenSsl),
    ("cbc-plain64", 32, Backend::OpenSsl),
    ("cbc-essiv:sha256", 16, Backend::OpenSsl),
    ("cbc-essiv:sha256", 24, Backend::OpenSsl),
    ("cbc-essiv:sha256", 32, Backend::OpenSsl),
    ("cbc-plain", 32, Backend::OpenSsl),
];

fn noise(seed: &mut u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 56) as u8
        })
        .collect()
}

/// The backend `SectorCipher::new` picks for XTS over AES-128/256 on this CPU.
fn fast_xts() -> Backend {
    if super::xts_vaes::VaesXts::new(&[1; 64]).is_some() {
        return Backend::Vaes;
    }
    Backend::OpenSsl
}

#[test]
fn openssl_matches_rustcrypto_in_every_mode() {
    let mut seed = 42;
    for (mode, kb, expect) in ALL_MODES {
        let xts = mode.starts_with("xts") && kb != 48;
        let expect = if xts { fast_xts() } else { expect };
        for _ in 0..4 {
            let spec = CipherSpec::parse("aes", mode, kb).unwrap();
            let key = noise(&mut seed, kb);
            let fast = std::sync::Arc::new(SectorCipher::new(&spec, &key).unwrap());
            let reference = SectorCipher::with_backend(&spec, &key, Backend::RustCrypto).unwrap();
            assert_eq!(fast.backend(), expect, "{mode} {kb}");
            // OpenSSL's path, asked for: it serves where VAES is missing.
            let evp = SectorCipher::with_backend(&spec, &key, Backend::OpenSsl).unwrap();
            if xts {
                assert_eq!(evp.backend(), Backend::OpenSsl);
            }
            assert_eq!(reference.backend(), Backend::RustCrypto);
            // 37 sectors: more than one chunk of the ECB-based XTS.
            let plain = noise(&mut seed, 512 * 37);
            // Sector numbers past 32 bits: `plain` truncates, `plain64` does not.
            let first = u64::from_le_bytes(noise(&mut seed, 8).try_into().unwrap()) >> 20;
            let (mut a, mut b) = (plain.clone(), plain.clone());
            fast.encrypt(first, &mut a);
            reference.encrypt(first, &mut b);
            assert_eq!(a, b, "encrypt {mode} {kb}");
            let mut e = plain.clone();
            evp.encrypt(first, &mut e);
            assert_eq!(a, e, "OpenSSL encrypt {mode} {kb}");
            // A worker (its own contexts) gives the same bytes as the shared path.
            let mut w = fast.worker();
            let mut c = plain.clone();
            w.encrypt(first, &mut c);
            assert_eq!(a, c, "worker encrypt {mode} {kb}");
            w.decrypt(first, &mut c);
            assert_eq!(c, plain, "worker decrypt {mode} {kb}");
            fast.decrypt(first, &mut a);
            reference.decrypt(first, &mut b);
            assert_eq!(a, plain, "decrypt {mode} {kb}");
            assert_eq!(b, plain, "reference decrypt {mode} {kb}");
        }
    }
}

#[test]
fn xts_key_with_equal_halves_works() {
    // OpenSSL 3's XTS refuses such a key; QEMU (nettle, gcrypt) accepts it, and so do we
    // (our XTS runs over AES-ECB): the same bytes as RustCrypto.
    let spec = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    let c = SectorCipher::new(&spec, &[7u8; 64]).unwrap();
    let r = SectorCipher::with_backend(&spec, &[7u8; 64], Backend::RustCrypto).unwrap();
    assert_eq!(c.backend(), fast_xts());
    let (mut x, mut y) = (vec![1u8; 1024], vec![1u8; 1024]);
    c.encrypt(3, &mut x);
    r.encrypt(3, &mut y);
    assert_eq!(x, y);
    c.decrypt(3, &mut x);
    assert_eq!(x, vec![1u8; 1024]);
}

#[test]
fn shared_cipher_from_many_threads() {
    // Threads encrypting through one `&SectorCipher` at once each borrow their own
    // contexts: every result equals the single-threaded one.
    let spec = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    let mut seed = 7;
    let key = noise(&mut seed, 64);
    let c = std::sync::Arc::new(SectorCipher::new(&spec, &key).unwrap());
    let plain = noise(&mut seed, 4096);
    let mut want = plain.clone();
    c.encrypt(100, &mut want);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (c, plain, want) = (c.clone(), plain.clone(), want.clone());
            std::thread::spawn(move || {
                let mut w = c.worker();
                for _ in 0..200 {
                    let mut x = plain.clone();
                    if t % 2 == 0 {
                        c.encrypt(100, &mut x);
                    } else {
                        w.encrypt(100, &mut x);
                    }
                    assert_eq!(x, want);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

use super::luks_build::{build_luks_area, LuksParams};

#[test]
fn built_area_has_qemus_layout_and_unlocks() {
    let mut p = LuksParams::default();
    p.set("iter-time", "1").unwrap();
    let a = build_luks_area(&p, b"pw").unwrap();
    // aes-256-xts: 64-byte key, 4000 stripes = 500 sectors, 504 aligned; 8 + 8 * 504.
    assert_eq!(a.len(), 4040 * 512);
    assert_eq!(p.area_bytes() as u64, a.len());
    let h = LuksHeader::parse(a.bytes()).unwrap();
    assert_eq!(
        (h.cipher_name.as_str(), h.cipher_mode.as_str()),
        ("aes", "xts-plain64")
    );
    assert_eq!(
        (h.hash, h.key_bytes, h.payload_offset),
        (HashAlg::Sha256, 64, 4040)
    );
    let offs: Vec<u32> = h.slots.iter().map(|s| s.key_offset).collect();
    assert_eq!(offs, [8, 512, 1016, 1520, 2024, 2528, 3032, 3536]);
    assert!(h.slots[0].active && h.slots[1..].iter().all(|s| !s.active));
    assert!(h.slots[0].iterations >= 1000 && h.mk_iterations >= 1000);
    assert_eq!(h.uuid.len(), 36);
    assert_eq!(&h.uuid[14..15], "4");
    h.unlock(a.bytes(), b"pw").unwrap();
    assert_eq!(h.unlock(a.bytes(), b"pW").unwrap_err(), Error::WrongKey);
    // Fresh randomness each time: another master key, salts and UUID.
    let b = build_luks_area(&p, b"pw").unwrap();
    assert_ne!(LuksHeader::parse(b.bytes()).unwrap().mk_salt, h.mk_salt);
    assert_ne!(a.bytes()[4096..8192], b.bytes()[4096..8192]);
}

#[test]
fn built_area_for_each_option_set() {
    for (opts, mode, kb) in [
        (&[("cipher-alg", "aes-128")][..], "xts-plain64", 32),
        (
            &[("cipher-mode", "cbc"), ("ivgen-alg", "essiv")][..],
            "cbc-essiv:sha256",
            32,
        ),
        (
            &[("cipher-alg", "aes-192"), ("hash-alg", "sha224")][..],
            "xts-plain64",
            48,
        ),
        (
            &[("cipher-alg", "aes-128"), ("cipher-mode", "cbc")][..],
            "cbc-plain64",
            16,
        ),
        (
            &[("ivgen-alg", "plain"), ("hash-alg", "sha1")][..],
            "xts-plain",
            64,
        ),
        (
            &[("ivgen-hash-alg", "sha1"), ("hash-alg", "sha512")][..],
            "xts-plain64:sha1",
            64,
        ),
        (&[("hash-alg", "md5")][..], "xts-plain64", 64),
        (
            &[("hash-alg", "ripemd160"), ("cipher-alg", "aes-128")][..],
            "xts-plain64",
            32,
        ),
        (
            &[
                ("cipher-mode", "cbc"),
                ("cipher-alg", "aes-128"),
                ("ivgen-alg", "essiv"),
                ("ivgen-hash-alg", "md5"),
            ][..],
            "cbc-essiv:md5",
            16,
        ),
    ] {
        let mut p = LuksParams::default();
        p.set("iter-time", "1").unwrap();
        for (k, v) in opts {
            p.set(k, v).unwrap();
        }
        let a = build_luks_area(&p, b"k").unwrap();
        let h = LuksHeader::parse(a.bytes()).unwrap();
        assert_eq!(
            (h.cipher_mode.as_str(), h.key_bytes),
            (mode, kb),
            "{opts:?}"
        );
        h.unlock(a.bytes(), b"k").unwrap();
    }
    let mut p = LuksParams::default();
    for (k, v) in [
        ("cipher-alg", "sm4"),
        ("hash-alg", "sha3-256"),
        ("iter-time", "x"),
        ("foo", "1"),
    ] {
        assert!(p.set(k, v).is_err(), "{k}={v}");
    }
    p.set("cipher-mode", "cbc").unwrap();
    p.set("cipher-alg", "aes-192").unwrap();
    assert!(
        build_luks_area(&p, b"k").is_err(),
        "aes-192-cbc: QEMU aborts on it"
    );
    p.set("cipher-alg", "aes-256").unwrap();
    p.set("ivgen-alg", "essiv").unwrap();
    p.set("ivgen-hash-alg", "sha1").unwrap();
    assert!(
        build_luks_area(&p, b"k").is_err(),
        "essiv:sha1 has no AES key length"
    );
    assert!(
        build_luks_area(&LuksParams::default(), b"a\0b").is_err(),
        "NUL in secret"
    );
}

/// Our XTS over AES-ECB, its AVX2 passes (where the CPU has them) and its portable ones,
/// and our XTS with VAES and AVX-512 (where the CPU has them), against RustCrypto's XTS
/// (`aes` 0.8, block by block), sector by sector: buffers of 1 to 40 sectors (one AES update
/// takes 16: across chunk boundaries), first sectors around 2^32 and 2^64 (the `plain64`
/// IV is the whole 64-bit number, wrapping as QEMU's does).
#[test]
fn ecb_xts_passes_match_rustcrypto_for_every_length() {
    use super::evp_xts::EcbXts;
    use super::soft::Soft;
    use openssl::cipher::Cipher;
    let mut seed = 7;
    for (bits, ecb) in [
        (CipherAlg::Aes128, Cipher::aes_128_ecb()),
        (CipherAlg::Aes256, Cipher::aes_256_ecb()),
    ] {
        let key = noise(&mut seed, 2 * ecb.key_length());
        let reference = Soft::new(Mode::Xts, bits, &key).unwrap();
        let fast = EcbXts::new(ecb, &key).unwrap();
        let mut portable = EcbXts::new(ecb, &key).unwrap().portable();
        let vaes = super::xts_vaes::VaesXts::new(&key);
        let mut fast = fast;
        for first in [0u64, (1 << 32) - 5, u64::MAX - 6, 0x0123_4567_89ab_cdef] {
            for n in [1usize, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 40] {
                let iv = |i: u64, out: &mut [[u8; 16]]| {
                    for (k, b) in out.iter_mut().enumerate() {
                        *b = u128::from(first.wrapping_add(i + k as u64)).to_le_bytes();
                    }
                };
                let plain = noise(&mut seed, 512 * n);
                let mut want = plain.clone();
                for (i, s) in want.chunks_exact_mut(512).enumerate() {
                    let mut b = [[0u8; 16]];
                    iv(i as u64, &mut b);
                    reference.sector(s, b[0], true);
                }
                for (name, x) in [("fast", &mut fast), ("portable", &mut portable)] {
                    let mut got = plain.clone();
                    assert_eq!(x.run(&mut got, &iv, true), n, "{name} {bits:?} {first} {n}");
                    assert!(got == want, "{name} encrypt {bits:?} {first:#x} {n}");
                    assert_eq!(x.run(&mut got, &iv, false), n);
                    assert!(got == plain, "{name} decrypt {bits:?} {first:#x} {n}");
                }
                if let Some(v) = &vaes {
                    let mut got = plain.clone();
                    v.run(&mut got, &iv, true);
                    assert!(got == want, "vaes encrypt {bits:?} {first:#x} {n}");
                    v.run(&mut got, &iv, false);
                    assert!(got == plain, "vaes decrypt {bits:?} {first:#x} {n}");
                }
            }
        }
    }
}

/// Through the public API: a multi-sector buffer whose sector numbers cross 2^32 encrypts
/// as its sectors one by one, `plain` (32-bit, truncating) unlike `plain64`.
#[test]
fn multi_sector_buffers_across_2_pow_32() {
    let first = (1u64 << 32) - 4;
    let mut seed = 9;
    let plain = noise(&mut seed, 512 * 9);
    let mut outs = Vec::new();
    for mode in ["xts-plain64", "xts-plain"] {
        let spec = CipherSpec::parse("aes", mode, 64).unwrap();
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29)).collect();
        let c = std::sync::Arc::new(SectorCipher::new(&spec, &key).unwrap());
        let r = SectorCipher::with_backend(&spec, &key, Backend::RustCrypto).unwrap();
        let mut whole = plain.clone();
        c.worker().encrypt(first, &mut whole);
        for (i, s) in plain.chunks_exact(512).enumerate() {
            let mut one = s.to_vec();
            r.encrypt(first + i as u64, &mut one);
            assert_eq!(one, whole[512 * i..512 * (i + 1)], "{mode} sector {i}");
        }
        c.decrypt(first, &mut whole.clone());
        outs.push(whole);
    }
    // Sectors 0..4 are below 2^32: both IVs agree; from 2^32 on, `plain` wraps to 0.
    assert_eq!(outs[0][..512 * 4], outs[1][..512 * 4]);
    assert_ne!(outs[0][512 * 4..512 * 5], outs[1][512 * 4..512 * 5]);
}
