//! Opening an encrypted image with a key from SPDK's keyring (`bdev_qcow2_create`'s `key`):
//! the key is checked against the image's LUKS header before the image is opened, since a
//! writable open may write (a dirty image is repaired first), so a wrong key writes
//! nothing. The key derivation (PBKDF2, as long as the image's creator asked: seconds with
//! QEMU's default `iter-time`) runs on a thread of its own while the md thread polls on.
//! The other threads' replicas take the unlocked cipher from the owner's seed, a read-only
//! bdev's channels from the node ([`UnlockedKey`]): none derives it again.

use crate::device::SpdkDevice;
use qcow2_engine::image::{LockedLuks, UnlockedKey};
use qcow2_engine::{DevId, Error, Exec, OpenOptions, Qcow2, Result};
use zeroize::Zeroizing;

/// What unlocks an image as it opens.
pub(crate) enum Unlock {
    /// Nothing: the image must be plain.
    Plain,
    /// The bytes of the keyring key the parameters name (derived on a thread of its own).
    Secret(Zeroizing<Vec<u8>>),
    /// The key another open of the same image was unlocked with.
    Key(UnlockedKey),
}

/// The image on `dev` opened with `opts` and, when encrypted, unlocked as `unlock` says:
/// with the key it was unlocked with.
pub(super) async fn open_image(
    exec: &Exec<SpdkDevice>,
    dev: DevId,
    opts: OpenOptions,
    unlock: Unlock,
) -> Result<(Qcow2<SpdkDevice>, Option<UnlockedKey>)> {
    let key = match (LockedLuks::read(exec, dev).await?, unlock) {
        (None, Unlock::Plain) => None,
        (None, _) => {
            return Err(Error::Refused(
                "key was given but the image is not encrypted".into(),
            ))
        }
        (Some(_), Unlock::Plain) => {
            return Err(Error::Refused(
                "the image is encrypted (LUKS): give key, the name of the key in SPDK's \
                 keyring that holds its passphrase (keyring_file_add_key)"
                    .into(),
            ))
        }
        (Some(area), Unlock::Secret(secret)) => Some(derive(exec, area, secret).await?),
        (Some(_), Unlock::Key(k)) => Some(k),
    };
    let q = Qcow2::open(exec, dev, opts).await?;
    if let Some(k) = &key {
        q.unlock_with(k)?;
    }
    Ok((q, key))
}

/// The key `secret` unlocks in `area`, derived on a thread of its own (the calling task
/// yields meanwhile); `secret` is zeroized there once used.
async fn derive(
    exec: &Exec<SpdkDevice>,
    area: LockedLuks,
    secret: Zeroizing<Vec<u8>>,
) -> Result<UnlockedKey> {
    crate::offthread::on_thread(exec, "qcow2_luks", move || area.unlock(&secret)).await
}
