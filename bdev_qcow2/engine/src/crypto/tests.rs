use super::cipher::{AesBits, IvGen, Mode};
use super::hash::HashAlg;
use super::*;

#[test]
fn cipher_specs_qemu_names() {
    let s = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    assert_eq!(
        (s.bits, s.mode, s.ivgen),
        (AesBits::B256, Mode::Xts, IvGen::Plain64)
    );
    let s = CipherSpec::parse("aes", "cbc-essiv:sha256", 16).unwrap();
    assert_eq!(s.ivgen, IvGen::Essiv(HashAlg::Sha256));
    assert_eq!(s.bits, AesBits::B128);
    assert!(CipherSpec::parse("aes", "xts-plain64", 63).is_none());
    assert!(CipherSpec::parse("aes", "cbc-essiv:sha1", 32).is_none());
    assert!(CipherSpec::parse("twofish", "xts-plain64", 64).is_none());
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
