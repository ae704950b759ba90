//! Twofish, Serpent and CAST5 sector ciphers: QEMU's names, known answers of the block
//! ciphers through our modes, and our generic XTS, CBC and ESSIV against straightforward
//! block-by-block references built from the cipher crates directly.

use super::cipher::{Backend, CipherAlg, IvGen, Mode};
use super::hash::HashAlg;
use super::*;
use aes::cipher::{generic_array::GenericArray, BlockEncrypt, KeyInit};

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

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

#[test]
fn specs_of_other_ciphers_as_qemu_names_them() {
    let s = CipherSpec::parse("twofish", "xts-plain64", 64).unwrap();
    assert_eq!((s.alg, s.mode), (CipherAlg::Twofish256, Mode::Xts));
    let s = CipherSpec::parse("serpent", "xts-plain64", 32).unwrap();
    assert_eq!(s.alg, CipherAlg::Serpent128);
    let s = CipherSpec::parse("twofish", "cbc-essiv:sha256", 16).unwrap();
    assert_eq!(s.alg, CipherAlg::Twofish128);
    // ESSIV keys the family's cipher by the whole digest: twofish-256 for sha256.
    assert_eq!(s.essiv_alg(), Some(CipherAlg::Twofish256));
    let s = CipherSpec::parse("cast5", "cbc-plain64", 16).unwrap();
    assert_eq!((s.alg, s.alg.block_len()), (CipherAlg::Cast5, 8));
    let s = CipherSpec::parse("cast5", "cbc-essiv:md5", 16).unwrap();
    assert_eq!(s.essiv_alg(), Some(CipherAlg::Cast5));
    for (name, mode, kb) in [
        ("cast5", "xts-plain64", 32),      // 8-byte blocks: no XTS
        ("cast5", "cbc-essiv:sha256", 16), // no 32-byte CAST5 key
        ("cast5", "cbc-plain64", 24),      // CAST5 is 128-bit only here
        ("serpent", "cbc-essiv:sha1", 32), // no 20-byte Serpent key
        ("twofish", "xts-plain64", 40),    // 20-byte halves
        ("sm4", "xts-plain64", 32),        // not built into QEMU
    ] {
        assert!(
            CipherSpec::parse(name, mode, kb).is_none(),
            "{name} {mode} {kb}"
        );
    }
    for a in CipherAlg::ALL {
        assert_eq!(CipherAlg::parse(a.name()), Some(a));
        assert_eq!(CipherAlg::from_name(a.family(), a.key_len()), Some(a));
    }
}

/// The first block of sector 0 in CBC with `plain64` (a zero IV) is the block cipher's
/// encryption of the plaintext: the ciphers' published answers.
#[test]
fn known_answers_through_cbc_plain64() {
    for (name, key, plain, want) in [
        // Twofish paper, 128-bit key, i = 1.
        (
            "twofish",
            "00000000000000000000000000000000",
            "00000000000000000000000000000000",
            "9f589f5cf6122c32b6bfec2f2ae8c35a",
        ),
        // RFC 2144 B.1, 128-bit key.
        (
            "cast5",
            "0123456712345678234567893456789a",
            "0123456789abcdef",
            "238b4fe5847e44b2",
        ),
    ] {
        let key = hex(key);
        let spec = CipherSpec::parse(name, "cbc-plain64", key.len()).unwrap();
        let c = SectorCipher::new(&spec, &key).unwrap();
        assert_eq!(c.backend(), Backend::RustCrypto, "{name}");
        let mut data = vec![0u8; 512];
        let p = hex(plain);
        data[..p.len()].copy_from_slice(&p);
        c.encrypt(0, &mut data);
        assert_eq!(data[..p.len()], hex(want)[..], "{name}");
        c.decrypt(0, &mut data);
        assert_eq!(data[..p.len()], p[..], "{name}");
    }
}

/// XTS, block by block (IEEE 1619 without stealing), with `c1`/`c2` keyed directly.
fn xts_reference<C: BlockEncrypt>(c1: &C, c2: &C, sector: u64, s: &mut [u8]) {
    let mut t = GenericArray::clone_from_slice(&u128::from(sector).to_le_bytes());
    c2.encrypt_block(&mut t);
    let mut tw = u128::from_le_bytes(t.as_slice().try_into().unwrap());
    for b in s.chunks_exact_mut(16) {
        let x = u128::from_le_bytes((&*b).try_into().unwrap()) ^ tw;
        let mut blk = GenericArray::clone_from_slice(&x.to_le_bytes());
        c1.encrypt_block(&mut blk);
        let y = u128::from_le_bytes(blk.as_slice().try_into().unwrap()) ^ tw;
        b.copy_from_slice(&y.to_le_bytes());
        tw = (tw << 1) ^ ((tw >> 127) * 0x87);
    }
}

fn check_xts<C: BlockEncrypt + KeyInit>(name: &str, kb: usize) {
    let mut seed = kb as u64;
    let key = noise(&mut seed, kb);
    let spec = CipherSpec::parse(name, "xts-plain64", kb).unwrap();
    let c = SectorCipher::new(&spec, &key).unwrap();
    let (k1, k2) = key.split_at(kb / 2);
    let (c1, c2) = (
        C::new_from_slice(k1).unwrap(),
        C::new_from_slice(k2).unwrap(),
    );
    let plain = noise(&mut seed, 512 * 3);
    let first = (1u64 << 32) - 2;
    let mut got = plain.clone();
    c.encrypt(first, &mut got);
    let mut want = plain.clone();
    for (i, s) in want.chunks_exact_mut(512).enumerate() {
        xts_reference(&c1, &c2, first + i as u64, s);
    }
    assert!(got == want, "{name} {kb}");
    c.decrypt(first, &mut got);
    assert!(got == plain, "{name} {kb} decrypt");
}

#[test]
fn xts_over_twofish_and_serpent_matches_block_by_block_xts() {
    for kb in [32, 48, 64] {
        check_xts::<twofish::Twofish>("twofish", kb);
        check_xts::<serpent::Serpent>("serpent", kb);
    }
}

/// CBC over CAST5's 8-byte blocks with `essiv:md5`, as QEMU: the IV is CAST5 keyed by
/// md5(key) over the little-endian sector number (one 8-byte block), and chaining runs
/// over 8-byte blocks.
#[test]
fn cast5_cbc_essiv_uses_8_byte_blocks_and_ivs() {
    use cast5::Cast5;
    let mut seed = 5;
    let key = noise(&mut seed, 16);
    let spec = CipherSpec::parse("cast5", "cbc-essiv:md5", 16).unwrap();
    assert_eq!(spec.ivgen, IvGen::Essiv(HashAlg::Md5));
    let c = SectorCipher::new(&spec, &key).unwrap();
    let k = Cast5::new_from_slice(&key).unwrap();
    let ess = Cast5::new_from_slice(&HashAlg::Md5.digest(&key)).unwrap();
    let plain = noise(&mut seed, 1024);
    let first = 0x0102_0304_0506_0708u64;
    let mut got = plain.clone();
    c.encrypt(first, &mut got);
    let mut want = plain.clone();
    for (i, s) in want.chunks_exact_mut(512).enumerate() {
        let mut prev = GenericArray::clone_from_slice(&(first + i as u64).to_le_bytes());
        ess.encrypt_block(&mut prev);
        for b in s.chunks_exact_mut(8) {
            let mut blk = GenericArray::clone_from_slice(b);
            blk.iter_mut().zip(&prev).for_each(|(x, y)| *x ^= y);
            k.encrypt_block(&mut blk);
            b.copy_from_slice(&blk);
            prev = blk;
        }
    }
    assert!(got == want, "cast5-cbc-essiv:md5");
    c.decrypt(first, &mut got);
    assert!(got == plain);
}

/// Every mode and IV generator of every non-AES cipher round-trips, through the shared
/// cipher and a worker alike, and depends on the sector number.
#[test]
fn every_other_cipher_round_trips() {
    let mut seed = 11;
    for alg in CipherAlg::ALL.into_iter().filter(|a| !a.is_aes()) {
        for mode in [
            "xts-plain64",
            "xts-plain",
            "xts-essiv:sha256",
            "cbc-plain64",
            "cbc-plain",
            "cbc-essiv:sha256",
            "cbc-essiv:md5",
        ] {
            let kb = alg.key_len() * if mode.starts_with("xts") { 2 } else { 1 };
            let Some(spec) = CipherSpec::parse(alg.family(), mode, kb) else {
                assert!(alg == CipherAlg::Cast5, "{alg:?} {mode}");
                continue;
            };
            let key = noise(&mut seed, kb);
            let c = std::sync::Arc::new(SectorCipher::new(&spec, &key).unwrap());
            let plain = noise(&mut seed, 512 * 4);
            let mut a = plain.clone();
            c.encrypt(7, &mut a);
            let mut b = plain[512..1024].to_vec();
            c.encrypt(8, &mut b);
            assert_eq!(b, a[512..1024], "{alg:?} {mode}");
            assert_ne!(a[..512], a[512..1024], "{alg:?} {mode}");
            let mut w = c.worker();
            w.decrypt(7, &mut a);
            assert!(a == plain, "{alg:?} {mode}");
        }
    }
}

#[test]
fn built_areas_of_other_ciphers_unlock() {
    for (opts, name, mode, kb) in [
        (
            &[("cipher-alg", "twofish-256")][..],
            "twofish",
            "xts-plain64",
            64,
        ),
        (
            &[("cipher-alg", "serpent-192")][..],
            "serpent",
            "xts-plain64",
            48,
        ),
        (
            &[
                ("cipher-alg", "twofish-128"),
                ("cipher-mode", "cbc"),
                ("ivgen-alg", "essiv"),
            ][..],
            "twofish",
            "cbc-essiv:sha256",
            16,
        ),
        (
            &[("cipher-alg", "cast5-128"), ("cipher-mode", "cbc")][..],
            "cast5",
            "cbc-plain64",
            16,
        ),
        (
            &[
                ("cipher-alg", "cast5-128"),
                ("cipher-mode", "cbc"),
                ("ivgen-alg", "essiv"),
                ("ivgen-hash-alg", "md5"),
            ][..],
            "cast5",
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
            (h.cipher_name.as_str(), h.cipher_mode.as_str(), h.key_bytes),
            (name, mode, kb),
            "{opts:?}"
        );
        h.unlock(a.bytes(), b"k").unwrap();
        assert!(h.unlock(a.bytes(), b"j").is_err());
    }
    // What QEMU refuses or aborts on.
    for opts in [
        &[("cipher-alg", "cast5-128")][..],
        &[
            ("cipher-alg", "cast5-128"),
            ("cipher-mode", "cbc"),
            ("ivgen-alg", "essiv"),
        ][..],
        &[("cipher-alg", "twofish-192"), ("cipher-mode", "cbc")][..],
        &[
            ("cipher-alg", "serpent-256"),
            ("cipher-mode", "cbc"),
            ("ivgen-alg", "essiv"),
            ("ivgen-hash-alg", "sha1"),
        ][..],
    ] {
        let mut p = LuksParams::default();
        p.set("iter-time", "1").unwrap();
        for (k, v) in opts {
            p.set(k, v).unwrap();
        }
        assert!(build_luks_area(&p, b"k").is_err(), "{opts:?}");
    }
    assert!(LuksParams::default().set("cipher-alg", "sm4").is_err());
}
