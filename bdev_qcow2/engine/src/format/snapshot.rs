//! The internal snapshot table.

use super::be::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::error::{invalid, Field, Result};
use crate::limits::{MAX_L1_ENTRIES, MAX_SNAPSHOT_EXTRA_DATA, MAX_SNAPSHOT_TABLE_BYTES};

/// One internal snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Host offset of the snapshot's L1 table.
    pub l1_table_offset: u64,
    /// Entries in the snapshot's L1 table.
    pub l1_size: u32,
    /// Unique id string.
    pub id: String,
    /// Name.
    pub name: String,
    /// Creation time, seconds.
    pub date_sec: u32,
    /// Creation time, nanoseconds.
    pub date_nsec: u32,
    /// Guest clock at creation, nanoseconds.
    pub vm_clock_nsec: u64,
    /// VM state size (32-bit field; the extra data may hold a 64-bit one).
    pub vm_state_size: u32,
    /// Extra data, preserved verbatim (vm_state_size_large, disk_size, icount, …).
    pub extra_data: Vec<u8>,
}

impl Snapshot {
    /// Virtual disk size at snapshot time, when the extra data records it.
    pub fn disk_size(&self) -> Option<u64> {
        (self.extra_data.len() >= 16).then(|| get_u64(&self.extra_data, 8))
    }
    /// VM state size, preferring the 64-bit field of the extra data.
    pub fn vm_state_size_large(&self) -> u64 {
        if self.extra_data.len() >= 8 {
            get_u64(&self.extra_data, 0)
        } else {
            u64::from(self.vm_state_size)
        }
    }
    /// Guest instruction count at snapshot time, when recorded.
    pub fn icount(&self) -> Option<u64> {
        (self.extra_data.len() >= 24)
            .then(|| get_u64(&self.extra_data, 16))
            .filter(|v| *v != u64::MAX)
    }
}

/// Result of decoding a snapshot table from a prefix of its bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum SnapshotDecode {
    /// All entries decoded.
    Done(Vec<Snapshot>),
    /// The buffer ended before the table did; at least this many bytes are needed.
    NeedBytes(u64),
}

/// Decodes `nb` snapshots from `buf` (the start of the table), validating each entry.
/// `cluster_size` and `device_size` bound each snapshot's L1 table.
pub fn decode_snapshots(
    buf: &[u8],
    nb: u32,
    cluster_size: u64,
    device_size: u64,
) -> Result<SnapshotDecode> {
    let mut out = Vec::with_capacity(nb.min(1024) as usize);
    let mut off = 0u64;
    for _ in 0..nb {
        if off + 40 > buf.len() as u64 {
            return need(off + 40);
        }
        let o = off as usize;
        let l1_table_offset = get_u64(buf, o);
        let l1_size = get_u32(buf, o + 8);
        let id_len = u64::from(get_u16(buf, o + 12));
        let name_len = u64::from(get_u16(buf, o + 14));
        let extra_len = u64::from(get_u32(buf, o + 36));
        if extra_len > MAX_SNAPSHOT_EXTRA_DATA {
            return Err(invalid(
                Field::SnapshotTable,
                extra_len,
                "snapshot extra_data_size above 1024",
            ));
        }
        let end = off + 40 + extra_len + id_len + name_len;
        let padded = end.div_ceil(8) * 8;
        if padded > MAX_SNAPSHOT_TABLE_BYTES {
            return Err(invalid(
                Field::SnapshotTable,
                padded,
                "snapshot table larger than 64 MiB",
            ));
        }
        if end > buf.len() as u64 {
            return need(padded);
        }
        if u64::from(l1_size) > MAX_L1_ENTRIES {
            return Err(invalid(
                Field::SnapshotL1Table,
                l1_size.into(),
                "snapshot L1 table larger than 32 MiB",
            ));
        }
        if !l1_table_offset.is_multiple_of(cluster_size) || (l1_size > 0 && l1_table_offset == 0) {
            return Err(invalid(
                Field::SnapshotL1Table,
                l1_table_offset,
                "snapshot L1 table not aligned to a cluster",
            ));
        }
        if l1_table_offset
            .checked_add(u64::from(l1_size) * 8)
            .is_none_or(|e| e > device_size)
        {
            return Err(invalid(
                Field::SnapshotL1Table,
                l1_table_offset,
                "snapshot L1 table past the end of the device",
            ));
        }
        let mut p = o + 40;
        let extra_data = buf[p..p + extra_len as usize].to_vec();
        p += extra_len as usize;
        let id = String::from_utf8_lossy(&buf[p..p + id_len as usize]).into_owned();
        p += id_len as usize;
        let name = String::from_utf8_lossy(&buf[p..p + name_len as usize]).into_owned();
        out.push(Snapshot {
            l1_table_offset,
            l1_size,
            id,
            name,
            date_sec: get_u32(buf, o + 16),
            date_nsec: get_u32(buf, o + 20),
            vm_clock_nsec: get_u64(buf, o + 24),
            vm_state_size: get_u32(buf, o + 32),
            extra_data,
        });
        off = padded;
    }
    Ok(SnapshotDecode::Done(out))
}

fn need(n: u64) -> Result<SnapshotDecode> {
    if n > MAX_SNAPSHOT_TABLE_BYTES {
        return Err(invalid(
            Field::SnapshotTable,
            n,
            "snapshot table larger than 64 MiB",
        ));
    }
    Ok(SnapshotDecode::NeedBytes(n))
}

/// Encodes a snapshot table.
pub fn encode_snapshots(snaps: &[Snapshot]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in snaps {
        let start = out.len();
        out.resize(start + 40, 0);
        let e = &mut out[start..];
        put_u64(e, 0, s.l1_table_offset);
        put_u32(e, 8, s.l1_size);
        put_u16(e, 12, s.id.len() as u16);
        put_u16(e, 14, s.name.len() as u16);
        put_u32(e, 16, s.date_sec);
        put_u32(e, 20, s.date_nsec);
        put_u64(e, 24, s.vm_clock_nsec);
        put_u32(e, 32, s.vm_state_size);
        put_u32(e, 36, s.extra_data.len() as u32);
        out.extend_from_slice(&s.extra_data);
        out.extend_from_slice(s.id.as_bytes());
        out.extend_from_slice(s.name.as_bytes());
        out.resize(out.len().div_ceil(8) * 8, 0);
    }
    out
}
