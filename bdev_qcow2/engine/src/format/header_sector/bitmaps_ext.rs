//! The bitmaps extension put into, changed in, or dropped from the header's first sector,
//! with the autoclear bit that validates it: one sector write switches the image from the
//! old bitmap directory to the new one (or to none).
//!
//! The new extension list must end inside the first sector: the feature name table (names
//! for messages only, which QEMU writes into every image and which fills most of that
//! sector) is dropped when it would not fit, and a backing file name kept in that sector
//! moves right after the list. What cannot fit is refused, nothing changed.

use super::super::be::{get_u32, get_u64, put_u32, put_u64};
use super::super::header::{autoclear, ext_type, BitmapsExt};
use super::{offset, HeaderSector};
use crate::io::SECTOR;

/// Why a bitmaps extension could not be put into the first sector.
pub const NO_ROOM: &str = "the header's extensions would not fit in its first sector with the \
     bitmaps extension (a long backing file name or unknown extensions take the room)";

impl HeaderSector {
    /// The bitmaps extension becomes `ext` (`None`: dropped), the autoclear bitmaps bit set
    /// with it (cleared without). `rest` is cluster 0 past this sector as on disk (the
    /// list may run into it). Refused, nothing changed, when the list does not end inside
    /// this sector even without the feature name table, when it is malformed, or when a
    /// zeroed tail extension would move (its writer patches it where it is).
    pub fn set_bitmaps_ext(
        &mut self,
        rest: &[u8],
        ext: Option<&BitmapsExt>,
    ) -> Result<(), &'static str> {
        if self.version() < 3 {
            return Err("a version 2 image has no autoclear bits to validate bitmaps");
        }
        let hl = get_u32(&self.0, 100) as usize;
        let mut all = self.0.clone();
        all.extend_from_slice(rest);
        // The list as it is: (type, bytes with header and padding), and where it ends.
        let mut list: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut off = hl;
        loop {
            if off + 8 > all.len() {
                return Err("the header extension list is not terminated");
            }
            let typ = get_u32(&all, off);
            if typ == ext_type::END {
                break;
            }
            let next = off + 8 + (get_u32(&all, off + 4) as usize).div_ceil(8) * 8;
            if next > all.len() {
                return Err("a header extension runs past the header cluster");
            }
            list.push((typ, all[off..next].to_vec()));
            off = next;
        }
        let tail_at = |l: &[(u32, Vec<u8>)]| {
            let mut at = hl;
            for (t, b) in l {
                if *t == ext_type::ZEROED_TAIL {
                    return Some(at);
                }
                at += b.len();
            }
            None
        };
        let tail_before = tail_at(&list);
        let new_ext = ext.map(|b| {
            let mut d = vec![0u8; 32];
            put_u32(&mut d, 0, ext_type::BITMAPS);
            put_u32(&mut d, 4, 24);
            put_u32(&mut d, 8, b.nb_bitmaps);
            put_u64(&mut d, 16, b.directory_size);
            put_u64(&mut d, 24, b.directory_offset);
            d
        });
        // In the old one's place (nothing before it moves), else last.
        let mut placed = false;
        let mut new: Vec<(u32, Vec<u8>)> = Vec::new();
        for (t, b) in list {
            if t != ext_type::BITMAPS {
                new.push((t, b));
            } else if let (Some(d), false) = (&new_ext, placed) {
                new.push((t, d.clone()));
                placed = true;
            }
        }
        if let (Some(d), false) = (new_ext, placed) {
            new.push((ext_type::BITMAPS, d));
        }
        let len = |l: &[(u32, Vec<u8>)]| hl + l.iter().map(|(_, b)| b.len()).sum::<usize>() + 8;
        let (bfo, bfs) = (get_u64(&self.0, 8) as usize, get_u32(&self.0, 16) as usize);
        // A backing file name in this sector follows the list; one past it stays there.
        let name_here = bfo != 0 && bfo < SECTOR as usize;
        let room = |l: &[(u32, Vec<u8>)]| len(l) + if name_here { bfs } else { 0 };
        if room(&new) > SECTOR as usize {
            new.retain(|(t, _)| *t != ext_type::FEATURE_NAME_TABLE);
        }
        if room(&new) > SECTOR as usize {
            return Err(NO_ROOM);
        }
        if tail_before.is_some() && tail_at(&new) != tail_before {
            return Err("the zeroed tail extension would move");
        }
        let name = if name_here {
            all.get(bfo..bfo + bfs)
                .ok_or("the backing file name runs past the header cluster")?
                .to_vec()
        } else {
            Vec::new()
        };
        let mut s = self.0[..hl].to_vec();
        for (_, b) in &new {
            s.extend_from_slice(b);
        }
        s.extend_from_slice(&[0u8; 8]);
        if name_here {
            let at = s.len() as u64;
            put_u64(&mut s, 8, at);
            s.extend_from_slice(&name);
        }
        s.resize(SECTOR as usize, 0);
        let bits = get_u64(&s, offset::AUTOCLEAR_FEATURES);
        let bits = if ext.is_some() {
            bits | autoclear::BITMAPS
        } else {
            bits & !autoclear::BITMAPS
        };
        put_u64(&mut s, offset::AUTOCLEAR_FEATURES, bits);
        self.0 = s;
        Ok(())
    }

    /// Where the backing file name starts (0: none).
    pub fn backing_file_offset(&self) -> u64 {
        get_u64(&self.0, 8)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::v3_image_header;
    use super::*;
    use crate::format::header::{default_feature_names, ImageHeader};

    fn ext(nb: u32, off: u64) -> BitmapsExt {
        BitmapsExt {
            nb_bitmaps: nb,
            directory_size: u64::from(nb) * 32,
            directory_offset: off,
        }
    }

    /// Cluster 0 of a QEMU-like image (the feature name table, a backing file) changed by
    /// `f`, decoded.
    fn round(
        c0: &[u8],
        f: impl Fn(&mut HeaderSector) -> Result<(), &'static str>,
    ) -> Result<ImageHeader, &'static str> {
        let mut s = HeaderSector::from_cluster0(c0);
        f(&mut s)?;
        let mut out = c0.to_vec();
        out[..SECTOR as usize].copy_from_slice(s.bytes());
        Ok(ImageHeader::decode(&out, 1 << 30).expect("decodes"))
    }

    fn qemu_like(backing: Option<&str>, bitmaps: Option<BitmapsExt>) -> Vec<u8> {
        let mut ih = v3_image_header();
        ih.extensions.zeroed_tail = None;
        ih.header.autoclear_features = if bitmaps.is_some() {
            autoclear::BITMAPS
        } else {
            0
        };
        ih.extensions.feature_names = default_feature_names();
        ih.extensions.bitmaps = bitmaps;
        ih.backing_file = backing.map(str::to_string);
        ih.encode().expect("encode")
    }

    #[test]
    fn added_changed_and_dropped_in_one_sector() {
        for backing in [None, Some("base.qcow2")] {
            let c0 = qemu_like(backing, None);
            let h = round(&c0, |s| {
                s.set_bitmaps_ext(&c0[512..], Some(&ext(1, 5 << 16)))
            })
            .unwrap();
            assert_eq!(h.extensions.bitmaps, Some(ext(1, 5 << 16)));
            assert_eq!(
                h.header.autoclear_features & autoclear::BITMAPS,
                autoclear::BITMAPS
            );
            assert!(h.extensions.feature_names.is_empty(), "no room for them");
            assert_eq!(h.backing_file.as_deref(), backing);
            // Changed in place, then dropped.
            let mut c1 = c0.clone();
            let mut s = HeaderSector::from_cluster0(&c0);
            s.set_bitmaps_ext(&c0[512..], Some(&ext(1, 5 << 16)))
                .unwrap();
            c1[..512].copy_from_slice(s.bytes());
            let h = round(&c1, |s| {
                s.set_bitmaps_ext(&c1[512..], Some(&ext(2, 7 << 16)))
            })
            .unwrap();
            assert_eq!(h.extensions.bitmaps, Some(ext(2, 7 << 16)));
            let h = round(&c1, |s| s.set_bitmaps_ext(&c1[512..], None)).unwrap();
            assert_eq!(h.extensions.bitmaps, None);
            assert_eq!(h.header.autoclear_features & autoclear::BITMAPS, 0);
            assert_eq!(h.backing_file.as_deref(), backing);
        }
    }

    #[test]
    fn a_zeroed_tail_stays_where_its_writer_patches_it() {
        use crate::format::header::ZeroedTail;
        let mut ih = v3_image_header();
        let at = 112 + 8;
        ih.extensions.zeroed_tail = Some(ZeroedTail { from: 9 << 16, at });
        ih.header.autoclear_features = autoclear::ZEROED_TAIL;
        ih.extensions.feature_names = default_feature_names();
        let c0 = ih.encode().unwrap();
        let h = round(&c0, |s| {
            s.set_bitmaps_ext(&c0[512..], Some(&ext(1, 5 << 16)))
        })
        .unwrap();
        assert_eq!(
            h.extensions.zeroed_tail,
            Some(ZeroedTail { from: 9 << 16, at })
        );
        assert_eq!(
            h.header.autoclear_features,
            autoclear::ZEROED_TAIL | autoclear::BITMAPS
        );
        assert_eq!(h.extensions.bitmaps, Some(ext(1, 5 << 16)));
    }

    #[test]
    fn what_cannot_fit_is_refused() {
        let long = "b".repeat(400);
        let c0 = qemu_like(Some(&long), None);
        let mut s = HeaderSector::from_cluster0(&c0);
        // QEMU put the name past the first sector: it stays there.
        assert!(s.backing_file_offset() >= 512);
        s.set_bitmaps_ext(&c0[512..], Some(&ext(1, 5 << 16)))
            .unwrap();
        // A name in the first sector that the list would not leave room for.
        let mut ih = v3_image_header();
        ih.extensions.zeroed_tail = None;
        ih.backing_file = Some("c".repeat(370));
        let c0 = ih.encode().unwrap();
        let mut s = HeaderSector::from_cluster0(&c0);
        assert!(s.backing_file_offset() < 512);
        assert_eq!(
            s.set_bitmaps_ext(&c0[512..], Some(&ext(1, 5 << 16))),
            Err(NO_ROOM)
        );
        assert_eq!(s, HeaderSector::from_cluster0(&c0));
    }
}
