//! Decompression of compressed clusters: raw deflate (as QEMU's zlib mode writes it) and
//! zstd. Output is bounded by the cluster size; anything that does not decode to exactly one
//! cluster is corruption.

use crate::error::{corrupt, Field, Result};
use crate::format::CompressionType;

/// Decompresses `input` into `out`, which must be filled completely (one cluster).
/// `input` may carry trailing bytes (the rest of the last sector); they are ignored.
pub fn decompress(ct: CompressionType, input: &[u8], out: &mut [u8]) -> Result<()> {
    match ct {
        CompressionType::Zlib => inflate_raw(input, out),
        CompressionType::Zstd => unzstd(input, out),
    }
}

fn inflate_raw(input: &[u8], out: &mut [u8]) -> Result<()> {
    let mut d = flate2::Decompress::new(false);
    match d.decompress(input, out, flate2::FlushDecompress::Finish) {
        Ok(_) if d.total_out() as usize == out.len() => Ok(()),
        Ok(_) => Err(corrupt(
            Field::CompressedData,
            d.total_out(),
            "deflate stream shorter than a cluster",
        )),
        Err(_) => Err(corrupt(
            Field::CompressedData,
            d.total_in(),
            "invalid deflate stream",
        )),
    }
}

fn unzstd(input: &[u8], out: &mut [u8]) -> Result<()> {
    use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
    let mut dec = Decoder::new()
        .map_err(|_| corrupt(Field::CompressedData, 0, "zstd decoder unavailable"))?;
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(out);
    // Bounded: every iteration either consumes input or produces output, or we stop.
    loop {
        let (before_in, before_out) = (inb.pos(), outb.pos());
        let hint = dec.run(&mut inb, &mut outb).map_err(|_| {
            corrupt(
                Field::CompressedData,
                inb.pos() as u64,
                "invalid zstd stream",
            )
        })?;
        if outb.pos() == outb.capacity() {
            return Ok(());
        }
        if hint == 0 {
            // End of a frame before the cluster is full.
            return Err(corrupt(
                Field::CompressedData,
                outb.pos() as u64,
                "zstd stream shorter than a cluster",
            ));
        }
        if inb.pos() == before_in && outb.pos() == before_out {
            return Err(corrupt(
                Field::CompressedData,
                inb.pos() as u64,
                "truncated zstd stream",
            ));
        }
    }
}

/// Compresses one cluster the way QEMU does (raw deflate, window 4 KiB; or a zstd frame).
/// Returns `None` when the result would not be smaller than the input.
pub fn compress(ct: CompressionType, input: &[u8]) -> Option<Vec<u8>> {
    let out = match ct {
        CompressionType::Zlib => {
            let mut c =
                flate2::Compress::new_with_window_bits(flate2::Compression::default(), false, 12);
            let mut out = Vec::with_capacity(input.len());
            match c.compress_vec(input, &mut out, flate2::FlushCompress::Finish) {
                Ok(flate2::Status::StreamEnd) => out,
                _ => return None,
            }
        }
        CompressionType::Zstd => zstd::bulk::compress(input, 0).ok()?,
    };
    (out.len() < input.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_both() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i / 100) as u8).collect();
        for ct in [CompressionType::Zlib, CompressionType::Zstd] {
            let mut c = compress(ct, &data).unwrap();
            c.extend_from_slice(&[0xAA; 300]); // sector padding junk
            let mut out = vec![0; 65536];
            decompress(ct, &c, &mut out).unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn garbage_is_corrupt_not_panic() {
        let mut out = vec![0; 4096];
        for ct in [CompressionType::Zlib, CompressionType::Zstd] {
            assert!(decompress(ct, &[0xff; 100], &mut out).is_err());
            assert!(decompress(ct, &[], &mut out).is_err());
        }
        // A valid stream that decodes to less than a cluster.
        let c = compress(CompressionType::Zlib, &[0u8; 8192]).unwrap();
        assert!(decompress(CompressionType::Zlib, &c, &mut vec![0; 16384]).is_err());
        let c = compress(CompressionType::Zstd, &[0u8; 8192]).unwrap();
        assert!(decompress(CompressionType::Zstd, &c, &mut vec![0; 16384]).is_err());
    }
}
