//! XTS (IEEE 1619) over whole 512-byte sectors, written for speed: the 32 tweaks of a
//! sector are computed first, so that the block cipher runs on all 32 blocks at once (the
//! `aes` crate pipelines them through AES-NI, 8 at a time), rather than block by block.
//! Sectors are whole blocks: no ciphertext stealing.

use aes::cipher::{BlockDecrypt, BlockEncrypt, BlockSizeUser};
use aes::Block;

const BLOCKS: usize = 32; // 512 / 16

/// Two keyed block ciphers: data (`k1`) and tweak (`k2`).
pub struct Xts<C> {
    k1: C,
    k2: C,
}

/// `t · α` in GF(2^128), little-endian as XTS has it.
#[inline(always)]
pub(super) fn times_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

impl<C> Xts<C>
where
    C: BlockEncrypt + BlockDecrypt + BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    /// From the two halves of the key, keyed.
    pub fn new(k1: C, k2: C) -> Self {
        Xts { k1, k2 }
    }

    /// Encrypts (`enc`) or decrypts one 512-byte sector whose IV is `iv`, in place.
    pub fn sector(&self, s: &mut [u8], iv: [u8; 16], enc: bool) {
        let mut t = Block::from(iv);
        self.k2.encrypt_block(&mut t);
        let mut tw = u128::from_le_bytes(t.into());
        let mut tweaks = [0u128; BLOCKS];
        let mut blocks = [Block::default(); BLOCKS];
        for ((b, src), slot) in blocks.iter_mut().zip(s.chunks_exact(16)).zip(&mut tweaks) {
            *slot = tw;
            let mut w = [0u8; 16];
            w.copy_from_slice(src);
            *b = Block::from((u128::from_le_bytes(w) ^ tw).to_le_bytes());
            tw = times_alpha(tw);
        }
        if enc {
            self.k1.encrypt_blocks(&mut blocks);
        } else {
            self.k1.decrypt_blocks(&mut blocks);
        }
        for ((b, dst), tw) in blocks.iter().zip(s.chunks_exact_mut(16)).zip(&tweaks) {
            let mut w = [0u8; 16];
            w.copy_from_slice(b);
            dst.copy_from_slice(&(u128::from_le_bytes(w) ^ tw).to_le_bytes());
        }
    }
}
