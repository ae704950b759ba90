//! An encrypted image's state: its LUKS header (read at open, shown by `info` without a
//! key), the payload cipher once a key unlocks it, and the executor view through which its
//! data clusters are read and written (`exec/crypt.rs`). Metadata goes to the device
//! itself; only data takes the view, so a plain image's path has nothing more to do.

use super::Qcow2;
use crate::crypto::{LuksArea, LuksHeader, LuksParams, SectorCipher};
use crate::error::{Error, Result};
use crate::exec::{read_bytes, DevId, Exec};
use crate::format::header::{peek_cluster_bits, PEEK_LEN};
use crate::format::ImageHeader;
use crate::io::BlockDevice;
use std::sync::{Arc, OnceLock};

/// An encrypted image's LUKS header and, once unlocked, its payload cipher (shared by every
/// core's replica).
#[derive(Debug)]
pub struct Luks {
    header: LuksHeader,
    /// The LUKS area in the image: (offset, length).
    area: (u64, u64),
    cipher: OnceLock<Arc<SectorCipher>>,
}

impl Luks {
    /// The decoded header.
    pub fn header(&self) -> &LuksHeader {
        &self.header
    }
    /// Where the header lies in the image: (offset, length).
    pub fn area(&self) -> (u64, u64) {
        self.area
    }
    /// Whether a key unlocked it.
    pub fn unlocked(&self) -> bool {
        self.cipher.get().is_some()
    }
}

/// Reads and decodes the LUKS header of an image whose header names one.
pub(super) async fn read_luks<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    header: &ImageHeader,
) -> Result<Option<Arc<Luks>>> {
    let Some((off, len)) = header.extensions.encryption else {
        return Ok(None);
    };
    // The header validated the area: inside the device, at most MAX_LUKS_HEADER_BYTES.
    let bytes = read_bytes(exec, dev, off, len).await?;
    Ok(Some(Arc::new(Luks {
        header: LuksHeader::parse(&bytes)?,
        area: (off, len),
        cipher: OnceLock::new(),
    })))
}

/// An encrypted image's LUKS header and the bytes of its area, read from the device
/// without opening the image: a host checks a key with it before a writable open (which
/// may repair and write) and derives the key on any thread ([`LockedLuks::unlock`] is
/// `Send` work: PBKDF2 takes as long as the image's creator asked, seconds with QEMU's
/// default `iter-time`).
pub struct LockedLuks {
    header: LuksHeader,
    region: Vec<u8>,
}

impl std::fmt::Debug for LockedLuks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockedLuks")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl LockedLuks {
    /// Reads the LUKS area of the image on `dev` (`None`: the image is not encrypted),
    /// validating the image header and the LUKS header as an open does.
    pub async fn read<D: BlockDevice>(exec: &Exec<D>, dev: DevId) -> Result<Option<LockedLuks>> {
        let device_size = exec.device_size(dev);
        if device_size < PEEK_LEN as u64 {
            return Err(crate::error::invalid(
                crate::error::Field::HeaderLength,
                device_size,
                "device smaller than a header",
            ));
        }
        let peek = read_bytes(exec, dev, 0, PEEK_LEN as u64).await?;
        let c0_len = (1u64 << peek_cluster_bits(&peek)?).min(device_size);
        let c0 = read_bytes(exec, dev, 0, c0_len).await?;
        let header = ImageHeader::decode(&c0, device_size)?;
        let Some((off, len)) = header.extensions.encryption else {
            return Ok(None);
        };
        let region = read_bytes(exec, dev, off, len).await?;
        Ok(Some(LockedLuks {
            header: LuksHeader::parse(&region)?,
            region,
        }))
    }

    /// The decoded header.
    pub fn header(&self) -> &LuksHeader {
        &self.header
    }

    /// The key `secret` unlocks ([`Error::WrongKey`]: none of the active slots): PBKDF2 of
    /// the secret for each active slot, then of the master key. Runs on any thread.
    pub fn unlock(&self, secret: &[u8]) -> Result<UnlockedKey> {
        Ok(UnlockedKey {
            header: self.header.clone(),
            cipher: Arc::new(self.header.unlock(&self.region, secret)?),
        })
    }
}

/// The payload cipher a secret unlocked, with the header it belongs to: another open of
/// the same image takes it ([`Qcow2::unlock_with`]) without deriving the key again. Its
/// key schedules are zeroized when the last copy is dropped; `Debug` shows nothing of them.
#[derive(Clone)]
pub struct UnlockedKey {
    header: LuksHeader,
    cipher: Arc<SectorCipher>,
}

impl UnlockedKey {
    /// A new LUKS area encrypted as `p` says whose key slot `secret` opens
    /// ([`build_luks_area`](crate::crypto::build_luks_area)), with its key: the image made
    /// with the area is unlocked by it ([`Qcow2::unlock_with`]) without a second derivation.
    pub fn build(p: &LuksParams, secret: &[u8]) -> Result<(LuksArea, UnlockedKey)> {
        let (area, master) = crate::crypto::luks_build::build_with_master(p, secret)?;
        let header = LuksHeader::parse(area.bytes())?;
        let cipher = SectorCipher::new(&header.cipher, &master).map_err(|e| e.into_error())?;
        let key = UnlockedKey {
            header,
            cipher: Arc::new(cipher),
        };
        Ok((area, key))
    }
}

impl std::fmt::Debug for UnlockedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnlockedKey(LUKS {})", self.header.uuid)
    }
}

/// The view data takes: the device itself for a plain image, an encrypted view (unlocked
/// when `luks` is) for an encrypted one.
pub(super) fn data_view<D: BlockDevice>(
    exec: &Exec<D>,
    dev: DevId,
    luks: Option<&Arc<Luks>>,
) -> DevId {
    let Some(l) = luks else { return dev };
    let view = exec.add_crypt_view(dev);
    if let Some(c) = l.cipher.get() {
        exec.set_view_cipher(view, c.clone());
    }
    view
}

impl<D: BlockDevice> Qcow2<D> {
    /// The LUKS header of an encrypted image (`None`: not encrypted).
    pub fn luks(&self) -> Option<&Luks> {
        self.luks.as_deref()
    }

    /// Whether the image's data is encrypted.
    pub fn encrypted(&self) -> bool {
        self.luks.is_some()
    }

    /// The device (or encrypted view) guest data clusters are read from and written to.
    pub(crate) fn data_dev(&self) -> DevId {
        self.data_dev
    }

    /// Unlocks an encrypted image with `secret` (the bytes of QEMU's secret object): its
    /// data becomes readable and writable. [`Error::WrongKey`](crate::Error::WrongKey) when
    /// the secret opens no key slot; nothing changes then. A plain image ignores it.
    pub async fn unlock(&self, secret: &[u8]) -> Result<()> {
        let Some(l) = &self.luks else { return Ok(()) };
        if let Some(c) = l.cipher.get() {
            self.exec.set_view_cipher(self.data_dev, c.clone());
            return Ok(());
        }
        let (off, len) = l.area;
        let region = read_bytes(&self.exec, self.dev, off, len).await?;
        let area = LockedLuks {
            header: l.header.clone(),
            region,
        };
        self.unlock_with(&area.unlock(secret)?)
    }

    /// Unlocks an encrypted image with a key another open of it unlocked (no key
    /// derivation). [`Error::WrongKey`] when `key` belongs to another LUKS header; a plain
    /// image refuses it likewise (a key given for an image that takes none is a mistake).
    pub fn unlock_with(&self, key: &UnlockedKey) -> Result<()> {
        let Some(l) = &self.luks else {
            return Err(Error::Refused(
                "a key was given but the image is not encrypted".into(),
            ));
        };
        if l.header != key.header {
            return Err(Error::WrongKey);
        }
        let c = l.cipher.get_or_init(|| key.cipher.clone()).clone();
        self.exec.set_view_cipher(self.data_dev, c);
        Ok(())
    }

    /// The key this image was unlocked with, for other opens of it (`None`: plain, or
    /// locked).
    pub fn unlocked_key(&self) -> Option<UnlockedKey> {
        let l = self.luks.as_ref()?;
        Some(UnlockedKey {
            header: l.header.clone(),
            cipher: l.cipher.get()?.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::create::{create, CreateOptions};
    use crate::crypto::{build_luks_area, LuksParams};
    use crate::testing::MemDevice;
    use crate::{Error, OpenOptions};

    /// A fresh 1 MiB image on its own device of `exec`, encrypted with `secret` if given.
    fn image(exec: &Exec<MemDevice>, secret: Option<&[u8]>) -> DevId {
        let dev = exec.add_device(MemDevice::fixed(Vec::new(), 4 << 20));
        let p = LuksParams {
            iter_time_ms: 1,
            ..LuksParams::default()
        };
        let opts = CreateOptions {
            size: 1 << 20,
            encryption: secret.map(|s| build_luks_area(&p, s).unwrap()),
            ..CreateOptions::default()
        };
        let e = exec.clone();
        exec.block_on(async move { create(&e, dev, &opts).await })
            .unwrap();
        dev
    }

    fn open(exec: &Exec<MemDevice>, dev: DevId) -> Qcow2<MemDevice> {
        let e = exec.clone();
        exec.block_on(async move { Qcow2::open(&e, dev, OpenOptions::default()).await })
            .unwrap()
    }

    fn locked(exec: &Exec<MemDevice>, dev: DevId) -> Option<LockedLuks> {
        let e = exec.clone();
        exec.block_on(async move { LockedLuks::read(&e, dev).await })
            .unwrap()
    }

    #[test]
    fn a_key_checked_before_opening_unlocks_every_open_of_its_image_only() {
        let exec: Exec<MemDevice> = Exec::new();
        let (a, b, plain) = (
            image(&exec, Some(b"pw-a")),
            image(&exec, Some(b"pw-b")),
            image(&exec, None),
        );
        assert!(locked(&exec, plain).is_none());
        let la = locked(&exec, a).unwrap();
        assert_eq!(la.unlock(b"wrong").unwrap_err(), Error::WrongKey);
        let key = la.unlock(b"pw-a").unwrap();
        assert!(!format!("{key:?}").contains("pw-a"));
        // Two opens of image a take the one derivation; image b and a plain image refuse it.
        for _ in 0..2 {
            let q = open(&exec, a);
            assert!(q.unlocked_key().is_none());
            q.unlock_with(&key).unwrap();
            assert!(q.luks().unwrap().unlocked());
            assert!(q.unlocked_key().is_some());
        }
        let qb = open(&exec, b);
        assert_eq!(qb.unlock_with(&key).unwrap_err(), Error::WrongKey);
        assert!(!qb.luks().unwrap().unlocked());
        assert!(matches!(
            open(&exec, plain).unlock_with(&key),
            Err(Error::Refused(_))
        ));
    }

    #[test]
    fn a_built_area_comes_with_the_key_its_secret_unlocks() {
        let exec: Exec<MemDevice> = Exec::new();
        let p = LuksParams {
            iter_time_ms: 1,
            ..LuksParams::default()
        };
        let (area, key) = UnlockedKey::build(&p, b"pw-new").unwrap();
        assert!(!format!("{key:?}").contains("pw-new"));
        let dev = exec.add_device(MemDevice::fixed(Vec::new(), 4 << 20));
        let opts = CreateOptions {
            size: 1 << 20,
            encryption: Some(area),
            ..CreateOptions::default()
        };
        let e = exec.clone();
        exec.block_on(async move { create(&e, dev, &opts).await })
            .unwrap();
        // The key the build kept unlocks the image, and is the one its secret derives.
        let q = open(&exec, dev);
        q.unlock_with(&key).unwrap();
        let derived = locked(&exec, dev).unwrap().unlock(b"pw-new").unwrap();
        let (mut a, mut b) = (vec![0x5au8; 4096], vec![0x5au8; 4096]);
        key.cipher.encrypt(7, &mut a);
        derived.cipher.encrypt(7, &mut b);
        assert_eq!(a, b);
        assert_ne!(a, vec![0x5au8; 4096]);
        // Another image's key does not pass for it.
        let other = image(&exec, Some(b"pw-new"));
        assert_eq!(
            open(&exec, other).unlock_with(&key).unwrap_err(),
            Error::WrongKey
        );
    }
}
