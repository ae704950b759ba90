//! Refcount table entries and refcount block entries of any width (1–64 bits).

use crate::error::{corrupt, Field, Result};
use crate::types::HostOffset;

/// Reserved bits 0..=8 of a refcount table entry.
const RT_RESERVED: u64 = 0x1ff;

/// Interprets a refcount table entry: `None` when the block is unallocated.
///
/// Errors (corruption) when reserved bits are set, the block is unaligned, at offset 0,
/// or past the device.
pub fn refcount_block_offset(
    entry: u64,
    cluster_size: u64,
    device_size: u64,
) -> Result<Option<HostOffset>> {
    if entry == 0 {
        return Ok(None);
    }
    if entry & RT_RESERVED != 0 {
        return Err(corrupt(
            Field::RefcountTableEntry,
            entry,
            "reserved bits set",
        ));
    }
    if !entry.is_multiple_of(cluster_size) {
        return Err(corrupt(
            Field::RefcountTableEntry,
            entry,
            "refcount block not aligned to a cluster",
        ));
    }
    if entry
        .checked_add(cluster_size)
        .is_none_or(|e| e > device_size)
    {
        return Err(corrupt(
            Field::RefcountTableEntry,
            entry,
            "refcount block past the end of the device",
        ));
    }
    Ok(Some(HostOffset(entry)))
}

/// Number of refcount entries in one refcount block.
pub fn entries_per_block(cluster_bits: u32, refcount_order: u32) -> u64 {
    (1u64 << (cluster_bits + 3)) >> refcount_order
}

/// Largest refcount representable with `refcount_order`.
pub fn max_refcount(refcount_order: u32) -> u64 {
    if refcount_order >= 6 {
        u64::MAX
    } else {
        (1u64 << (1 << refcount_order)) - 1
    }
}

/// Reads entry `index` of a refcount block (`block` is the whole block, big-endian).
/// Sub-byte widths are packed least significant bit first, as QEMU does.
pub fn get_refcount(block: &[u8], refcount_order: u32, index: u64) -> u64 {
    let bits = 1u64 << refcount_order;
    if bits < 8 {
        let bit = index * bits;
        let byte = block[(bit / 8) as usize];
        u64::from(byte >> (bit % 8)) & ((1 << bits) - 1)
    } else {
        let bytes = (bits / 8) as usize;
        let start = index as usize * bytes;
        block[start..start + bytes]
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
    }
}

/// Stores `value` in entry `index`; errors if it does not fit the width (never wraps).
pub fn set_refcount(block: &mut [u8], refcount_order: u32, index: u64, value: u64) -> Result<()> {
    if value > max_refcount(refcount_order) {
        return Err(corrupt(
            Field::RefcountBlockEntry,
            value,
            "refcount exceeds the refcount width",
        ));
    }
    let bits = 1u64 << refcount_order;
    if bits < 8 {
        let bit = index * bits;
        let b = &mut block[(bit / 8) as usize];
        let mask = (((1u16 << bits) - 1) as u8) << (bit % 8);
        *b = (*b & !mask) | (((value as u8) << (bit % 8)) & mask);
    } else {
        let bytes = (bits / 8) as usize;
        let start = index as usize * bytes;
        let be = value.to_be_bytes();
        block[start..start + bytes].copy_from_slice(&be[8 - bytes..]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_widths_roundtrip() {
        for order in 0..=6u32 {
            let mut block = vec![0u8; 512];
            let n = entries_per_block(9, order);
            let max = max_refcount(order);
            for i in 0..n {
                set_refcount(&mut block, order, i, (i * 7919) & max).unwrap();
            }
            for i in 0..n {
                assert_eq!(
                    get_refcount(&block, order, i),
                    (i * 7919) & max,
                    "order {order} index {i}"
                );
            }
            if order < 6 {
                assert!(set_refcount(&mut block, order, 0, max + 1).is_err());
            }
        }
    }

    #[test]
    fn qemu_bit_order() {
        // refcount_bits=1: entry 0 is the least significant bit of byte 0.
        assert_eq!(get_refcount(&[0b0000_0001], 0, 0), 1);
        assert_eq!(get_refcount(&[0b0000_0001], 0, 1), 0);
        assert_eq!(get_refcount(&[0x00, 0x01], 4, 0), 1);
    }

    #[test]
    fn table_entries() {
        assert_eq!(refcount_block_offset(0, 65536, 1 << 20), Ok(None));
        assert!(refcount_block_offset(0x10001, 65536, 1 << 20).is_err());
        assert!(refcount_block_offset(0x10200, 65536, 1 << 20).is_err());
        assert!(refcount_block_offset(1 << 20, 65536, 1 << 20).is_err());
        assert_eq!(
            refcount_block_offset(0x10000, 65536, 1 << 20),
            Ok(Some(HostOffset(0x10000)))
        );
    }
}
