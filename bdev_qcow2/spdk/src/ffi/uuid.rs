//! Bdev UUIDs, parsed, printed and derived by SPDK's own functions, so that ours read and
//! compare as every other bdev's do (36 characters, 8-4-4-4-12 hex digits, printed in lower
//! case).

use super::sys;
use std::ffi::{c_char, CStr, CString};
use std::fmt;

/// A UUID as SPDK keeps it (`struct spdk_uuid`: 16 bytes, as in `spdk_bdev.uuid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Uuid([u8; 16]);

impl Uuid {
    /// `s` as SPDK parses a UUID (`spdk_uuid_parse`); `None`: `s` is not one.
    pub fn parse(s: &str) -> Option<Uuid> {
        let c = CString::new(s).ok()?;
        let mut u = sys::spdk_uuid::default();
        // SAFETY: `u` is a writable UUID and `c` a C string, both live for the call.
        let rc = unsafe { sys::spdk_uuid_parse(&mut u, c.as_ptr()) };
        (rc == 0).then(|| Uuid::of(&u))
    }

    /// The name-based UUID (SHA-1, RFC 4122 version 5) of `name` in namespace `ns`, as
    /// SPDK's passthru derives its bdev's from its base's (`spdk_uuid_generate_sha1`): the
    /// same inputs give the same UUID on every start. `None` if SPDK could not hash.
    pub fn sha1(ns: Uuid, name: &[u8]) -> Option<Uuid> {
        let mut ns = ns.raw();
        let mut out = sys::spdk_uuid::default();
        // SAFETY: `out` and `ns` are live UUIDs for the call; `name` is `name.len()` bytes.
        let rc = unsafe {
            sys::spdk_uuid_generate_sha1(&mut out, &mut ns, name.as_ptr().cast(), name.len())
        };
        (rc == 0).then(|| Uuid::of(&out))
    }

    /// Whether this is the null UUID (all zeros), which SPDK replaces at registration with
    /// a random one.
    pub fn is_null(&self) -> bool {
        self.0 == [0; 16]
    }

    /// Its 16 bytes.
    pub fn bytes(&self) -> [u8; 16] {
        self.0
    }

    /// The UUID in SPDK's struct.
    pub(super) fn of(u: &sys::spdk_uuid) -> Uuid {
        // SAFETY: the union's one member is the 16 raw bytes; every bit pattern is valid.
        Uuid(unsafe { u.u.raw })
    }

    /// SPDK's struct holding this UUID.
    pub(super) fn raw(self) -> sys::spdk_uuid {
        sys::spdk_uuid {
            u: sys::spdk_uuid__bindgen_ty_1 { raw: self.0 },
        }
    }
}

/// SPDK's lower-case form (`spdk_uuid_fmt_lower`), as `bdev_get_bdevs` prints UUIDs.
impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf: [c_char; sys::SPDK_UUID_STRING_LEN as usize] =
            [0; sys::SPDK_UUID_STRING_LEN as usize];
        let u = self.raw();
        // SAFETY: `buf` is SPDK_UUID_STRING_LEN bytes, what the call needs; `u` is live.
        let rc = unsafe { sys::spdk_uuid_fmt_lower(buf.as_mut_ptr(), buf.len(), &u) };
        if rc != 0 {
            return Err(fmt::Error);
        }
        // SAFETY: on success SPDK wrote a NUL-terminated string into `buf`.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        f.write_str(&s.to_string_lossy())
    }
}
