//! Keys of SPDK's keyring (`keyring_file_add_key` and the like): the bytes of a key named
//! by the operator, read when an encrypted image is opened and zeroized when dropped.

use super::sys;
use std::ffi::CString;
use zeroize::Zeroizing;

/// Most bytes a key may hold (a LUKS passphrase; SPDK's file keyring refuses larger keys
/// with `ENOBUFS`).
pub const MAX_KEY_BYTES: usize = 8192;

/// The bytes of keyring key `name` (SPDK's form: `key0`, or `keyring0:key0`), or an errno
/// and a message that names the key and never shows its bytes.
pub fn key_bytes(name: &str) -> Result<Zeroizing<Vec<u8>>, (i32, String)> {
    let unknown = || {
        (
            libc::ENOKEY,
            format!("no key named '{name}' in SPDK's keyring (add it with keyring_file_add_key)"),
        )
    };
    let c = CString::new(name).map_err(|_| unknown())?;
    // SAFETY: `c` is a C string live for the call; the result is a reference we release
    // below, or NULL.
    let key = unsafe { sys::spdk_keyring_get_key(c.as_ptr()) };
    if key.is_null() {
        return Err(unknown());
    }
    let mut buf = Zeroizing::new(vec![0u8; MAX_KEY_BYTES]);
    // SAFETY: `key` is the live reference taken above and `buf` is `MAX_KEY_BYTES`
    // writable bytes, which SPDK does not write past.
    let rc = unsafe { sys::spdk_key_get_key(key, buf.as_mut_ptr().cast(), MAX_KEY_BYTES as i32) };
    // SAFETY: releases the one reference taken above, not used after.
    unsafe { sys::spdk_keyring_put_key(key) };
    match usize::try_from(rc) {
        Ok(n) if n <= MAX_KEY_BYTES => {
            buf.truncate(n);
            Ok(buf)
        }
        _ => {
            let e = rc.checked_neg().filter(|e| *e > 0).unwrap_or(libc::EIO);
            Err((
                e,
                format!(
                    "cannot read key '{name}' from SPDK's keyring: {} (at most {MAX_KEY_BYTES} bytes)",
                    std::io::Error::from_raw_os_error(e)
                ),
            ))
        }
    }
}
