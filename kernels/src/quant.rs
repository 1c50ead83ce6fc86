//! The packed layout of quantized weights that every implementation of the quantized matmuls
//! reads: GGUF blocks split into their quant bytes, viewed as little-endian u32 words (the one
//! integer type every backend has), and their f16 scales widened to f32 (exactly).
//!
//! For a weight with `n` rows of `k` values (`k` a multiple of 32):
//! - Q8_0: `words[n, k / 4]`, byte `j` of row `r` is the i8 quant of element `j`;
//!   `scales[n, k / 32]`.
//! - Q4_0: `words[n, k / 8]`, each 32-value block is 16 bytes (4 words) laid out as in ggml:
//!   byte `j` holds element `j` in its low nibble and element `j + 16` in its high nibble, both
//!   offset by 8; `scales[n, k / 32]`.
//! - Q4_1: nibbles as Q4_0 but unsigned (value = `scale * q + min`); `scales` and `mins`
//!   `[n, k / 32]`.

use half::f16;

/// Values per quantization block (Q8_0 and Q4_0).
pub const BLOCK: usize = 32;
/// Bytes of a GGUF Q8_0 block: f16 scale + 32 × i8.
pub const Q8_0_BLOCK_BYTES: usize = 34;
/// Bytes of a GGUF Q4_0 block: f16 scale + 16 bytes of nibbles.
pub const Q4_0_BLOCK_BYTES: usize = 18;
/// Bytes of a GGUF Q4_1 block: f16 scale + f16 min + 16 bytes of nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 20;

/// A quantized matrix in the packed layout, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeight {
    pub rows: usize,
    pub cols: usize,
    pub words: Vec<u32>,
    pub scales: Vec<f32>,
    /// Per-block offsets of asymmetric formats (Q4_1); `None` for symmetric ones.
    pub mins: Option<Vec<f32>>,
}

/// Split GGUF Q8_0 blocks (`rows × cols` values) into words and scales.
pub fn pack_q8_0(blocks: &[u8], rows: usize, cols: usize) -> PackedWeight {
    pack(blocks, rows, cols, Q8_0_BLOCK_BYTES)
}

/// Split GGUF Q4_0 blocks (`rows × cols` values) into words and scales.
pub fn pack_q4_0(blocks: &[u8], rows: usize, cols: usize) -> PackedWeight {
    pack(blocks, rows, cols, Q4_0_BLOCK_BYTES)
}

/// Split GGUF Q4_1 blocks (`rows × cols` values) into words, scales and mins.
pub fn pack_q4_1(blocks: &[u8], rows: usize, cols: usize) -> PackedWeight {
    pack(blocks, rows, cols, Q4_1_BLOCK_BYTES)
}

fn pack(blocks: &[u8], rows: usize, cols: usize, block_bytes: usize) -> PackedWeight {
    assert_eq!(cols % BLOCK, 0, "row length must be a multiple of {BLOCK}");
    let n_blocks = rows * cols / BLOCK;
    assert_eq!(blocks.len(), n_blocks * block_bytes, "block data size");
    // The quants are the last 32 (Q8_0) or 16 (Q4_*) bytes of a block, after the f16 fields.
    let header = if block_bytes == Q4_1_BLOCK_BYTES {
        4
    } else {
        2
    };
    let mut words = Vec::with_capacity(n_blocks * (block_bytes - header) / 4);
    let mut scales = Vec::with_capacity(n_blocks);
    let mut mins = (header == 4).then(|| Vec::with_capacity(n_blocks));
    for block in blocks.chunks_exact(block_bytes) {
        scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
        if let Some(mins) = mins.as_mut() {
            mins.push(f16::from_le_bytes([block[2], block[3]]).to_f32());
        }
        words.extend(
            block[header..]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    PackedWeight {
        rows,
        cols,
        words,
        scales,
        mins,
    }
}
