//! Decompression of compressed clusters: raw deflate (as QEMU's zlib mode writes it) and
//! zstd. Output is bounded by the cluster size; anything that does not decode to exactly one
//! cluster is corruption.

use crate::error::{corrupt, Field, Result};
use crate::format::CompressionType;

/// Decompresses `input` into `out`, which must be filled completely (one cluster).
/// `input` may carry trailing bytes (the rest of the last sector); they are ignored.
/// New decompressor state each call: see [`Decompressor`] to keep it.
pub fn decompress(ct: CompressionType, input: &[u8], out: &mut [u8]) -> Result<()> {
    Decompressor::default().decompress(ct, input, out)
}

/// Decompressor state kept from one cluster to the next (created on first use, reset
/// before each cluster), so that decompressing allocates nothing once both kinds were
/// used: what the prefetch ring's compressed fills keep per chain.
#[derive(Default)]
pub struct Decompressor {
    inflate: Option<flate2::Decompress>,
    zstd: Option<zstd::stream::raw::Decoder<'static>>,
}

impl Decompressor {
    /// [`decompress`], with this state.
    pub fn decompress(&mut self, ct: CompressionType, input: &[u8], out: &mut [u8]) -> Result<()> {
        match ct {
            CompressionType::Zlib => {
                let d = match &mut self.inflate {
                    Some(d) => {
                        d.reset(false);
                        d
                    }
                    None => self.inflate.insert(flate2::Decompress::new(false)),
                };
                inflate_raw(d, input, out)
            }
            CompressionType::Zstd => {
                use zstd::stream::raw::{Decoder, Operation};
                let unavailable = || corrupt(Field::CompressedData, 0, "zstd decoder unavailable");
                let d = match &mut self.zstd {
                    Some(d) => {
                        d.reinit().map_err(|_| unavailable())?;
                        d
                    }
                    None => self.zstd.insert(Decoder::new().map_err(|_| unavailable())?),
                };
                unzstd(d, input, out)
            }
        }
    }
}

fn inflate_raw(d: &mut flate2::Decompress, input: &[u8], out: &mut [u8]) -> Result<()> {
    match d.decompress(input, out, flate2::FlushDecompress::Finish) {
        Ok(flate2::Status::StreamEnd) if d.total_out() as usize == out.len() => Ok(()),
        Ok(_) if d.total_out() as usize == out.len() => {
            // The cluster is full but the stream has not ended: only its end-of-block code
            // may be left (QEMU accepts that), or more data. Decode one more byte to tell;
            // errors in what follows a full cluster are ignored, as QEMU does.
            let rest = input.get(d.total_in() as usize..).unwrap_or_default();
            let _ = d.decompress(rest, &mut [0u8; 1], flate2::FlushDecompress::Finish);
            if d.total_out() as usize > out.len() {
                return Err(corrupt(
                    Field::CompressedData,
                    d.total_in(),
                    "deflate stream larger than a cluster",
                ));
            }
            Ok(())
        }
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

fn unzstd(
    dec: &mut zstd::stream::raw::Decoder<'static>,
    input: &[u8],
    out: &mut [u8],
) -> Result<()> {
    use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
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
            return if hint == 0 {
                Ok(())
            } else {
                zstd_check_no_more_output(dec, &mut inb)
            };
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

/// After a full cluster with the frame unfinished: errors if the stream still decodes to
/// more output (a compressed cluster larger than a cluster). What is left may also be just
/// the frame's epilogue; errors in it are ignored, as for deflate.
fn zstd_check_no_more_output(
    dec: &mut zstd::stream::raw::Decoder<'_>,
    inb: &mut zstd::stream::raw::InBuffer<'_>,
) -> Result<()> {
    use zstd::stream::raw::{Operation, OutBuffer};
    let mut extra = [0u8; 1];
    let mut xb = OutBuffer::around(&mut extra[..]);
    // Bounded: stops as soon as an iteration consumes no input.
    loop {
        let before = inb.pos();
        let Ok(hint) = dec.run(inb, &mut xb) else {
            return Ok(());
        };
        if xb.pos() > 0 {
            return Err(corrupt(
                Field::CompressedData,
                inb.pos() as u64,
                "zstd stream larger than a cluster",
            ));
        }
        if hint == 0 || inb.pos() == before {
            return Ok(());
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

/// The compressed cluster a core decompressed last, kept whole, as QEMU keeps one: a guest
/// (or a read-ahead chunk smaller than the cluster) reading a compressed cluster in pieces
/// reads and decompresses it once. Named by its compressed stream's place and length and
/// by the image's reuse generation read before its bytes were read: the bytes of a stream
/// in use change only once its clusters were freed and handed out again, which moves the
/// generation (`Qcow2::reuse_gen`), so a stream named the same under the same generation
/// holds the same bytes. (A corrupt image whose refcounts leave a stream's cluster free can
/// have it overwritten without a move: its reads then show the cluster as the image held it
/// before, never another image's bytes.)
#[derive(Default)]
pub struct LastCluster {
    key: Option<(u64, u64, u64)>,
    data: Vec<u8>,
}

impl LastCluster {
    /// The cluster, when it is the one whose stream starts at `offset` and is `len` bytes
    /// long, decompressed under reuse generation `gen` (the current one).
    pub fn get(&self, offset: u64, len: u64, gen: u64) -> Option<&[u8]> {
        (self.key == Some((offset, len, gen))).then_some(&self.data[..])
    }

    /// The cluster whose stream starts at `offset` and is `len` bytes long: kept under
    /// reuse generation `now` (the current one), else decoded by `decode` into its place
    /// as [`fill`](Self::fill) does, under `read` (the generation its bytes were read under).
    pub fn get_or_fill(
        &mut self,
        (offset, len): (u64, u64),
        (now, read): (u64, u64),
        cluster: usize,
        decode: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<&[u8]> {
        if self.key == Some((offset, len, now)) {
            return Ok(&self.data);
        }
        self.fill((offset, len, read), cluster, decode)
    }

    /// Decompresses `input` (the stream at `offset`, `len` bytes, read under reuse
    /// generation `gen`) into the kept cluster of `cluster` bytes, which it then is (none on
    /// an error); allocates only the first time, or for a larger cluster.
    pub fn fill(
        &mut self,
        (offset, len, gen): (u64, u64, u64),
        cluster: usize,
        decode: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<&[u8]> {
        self.key = None;
        self.data.resize(cluster, 0);
        decode(&mut self.data)?;
        self.key = Some((offset, len, gen));
        Ok(&self.data)
    }
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

    /// State kept across clusters decodes each as a fresh one would, a bad cluster in
    /// between included.
    #[test]
    fn kept_state_is_reset_per_cluster() {
        let a: Vec<u8> = (0..65536u32).map(|i| (i / 100) as u8).collect();
        let b: Vec<u8> = (0..65536u32).map(|i| (i / 7 % 251) as u8).collect();
        let mut d = Decompressor::default();
        for ct in [CompressionType::Zlib, CompressionType::Zstd] {
            let (ca, cb) = (compress(ct, &a).unwrap(), compress(ct, &b).unwrap());
            let mut out = vec![0; 65536];
            d.decompress(ct, &ca, &mut out).unwrap();
            assert_eq!(out, a);
            // Cut short: the state is left mid-stream.
            assert!(d.decompress(ct, &cb[..cb.len() / 2], &mut out).is_err());
            d.decompress(ct, &cb, &mut out).unwrap();
            assert_eq!(out, b);
            assert!(d.decompress(ct, &[0xff; 100], &mut out).is_err());
            d.decompress(ct, &ca, &mut out).unwrap();
            assert_eq!(out, a);
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
