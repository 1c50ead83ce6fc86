//! Q5_0 and Q5_1 weights sixteen rows wide ([`RowLayout::X16`](super::RowLayout::X16)).
//!
//! A Q5 block (22 or 24 bytes) is not a whole number of words, so the layout is not a word
//! transposition as for Q4_K, Q4_0 and Q8_0: each group of sixteen rows' block `i` is re-split
//! into its fields, each field of the sixteen rows side by side — the same bytes, no byte more:
//!
//! | field | bytes | lies as |
//! | --- | ---: | --- |
//! | `d` | 32 | the sixteen rows' f16 scales, row `r` at half `r` |
//! | `m` (Q5_1) | 32 | their f16 minimums alike |
//! | `qh` | 64 | eight u64 masks, one per ggml lane `l` (values [`lane_value`]`(l, 0..4)`): bit `4r + b` is row `r`'s fifth bit of value `lane_value(l, b)` |
//! | `qs` | 256 | nibble word `w` (bytes `4w..4w + 4`) of row `r` at word `16w + r` |
//!
//! So an AVX-512 kernel loads one nibble word of sixteen rows into one register, and its fifth
//! bits as one byte mask (`flex::blocks_vnni::gemm_q5_x16`).

use super::GgmlType;

/// Bytes of a Q5 block: 22 (Q5_0) or 24 (Q5_1).
fn block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q5_0 => 22,
        GgmlType::Q5_1 => 24,
        _ => unreachable!("{ty} is not a Q5 type"),
    }
}

/// Byte offsets in an X16 block of its `qh` masks and `qs` words.
pub(crate) fn x16_offsets(ty: GgmlType) -> (usize, usize) {
    let qh = if ty == GgmlType::Q5_1 { 64 } else { 32 };
    (qh, qh + 64)
}

/// The value (0..32) that byte `b` (0..4) of ggml's 32-bit lane `l` (0..8) holds in
/// `ggml_vec_dot_q5_0_q8_0`'s register: lanes 0–3 the low nibbles, 4–7 the high ones.
pub(crate) fn lane_value(l: usize, b: usize) -> usize {
    if l < 4 {
        4 * l + b
    } else {
        16 + 4 * (l - 4) + b
    }
}

/// Sixteen rows of Q5 bytes (row `r` at `r · row_len`, `blocks` blocks each) in the X16
/// layout, into `out` (16 · `blocks` · block bytes).
pub(crate) fn to_x16(ty: GgmlType, rows: &[u8], row_len: usize, blocks: usize, out: &mut [u8]) {
    let size = block_bytes(ty);
    let (at_qh, at_qs) = x16_offsets(ty);
    let fields = size - 20; // d, and m for Q5_1
    for i in 0..blocks {
        let x = &mut out[16 * size * i..16 * size * (i + 1)];
        let mut masks = [0u64; 8];
        for r in 0..16 {
            let b = &rows[r * row_len + size * i..r * row_len + size * (i + 1)];
            for f in 0..fields / 2 {
                x[32 * f + 2 * r..32 * f + 2 * r + 2].copy_from_slice(&b[2 * f..2 * f + 2]);
            }
            let qh = u32::from_le_bytes(b[fields..fields + 4].try_into().unwrap());
            for (l, mask) in masks.iter_mut().enumerate() {
                for bit in 0..4 {
                    *mask |= u64::from(qh >> lane_value(l, bit) & 1) << (4 * r + bit);
                }
            }
            for w in 0..4 {
                let at = at_qs + 4 * (16 * w + r);
                x[at..at + 4].copy_from_slice(&b[fields + 4 + 4 * w..fields + 8 + 4 * w]);
            }
        }
        for (l, mask) in masks.iter().enumerate() {
            x[at_qh + 8 * l..at_qh + 8 * l + 8].copy_from_slice(&mask.to_le_bytes());
        }
    }
}

/// The inverse of [`to_x16`]: the sixteen rows' bytes into `rows` (row `r` at `r · row_len`).
pub(crate) fn from_x16(ty: GgmlType, x16: &[u8], blocks: usize, row_len: usize, rows: &mut [u8]) {
    for (r, row) in rows.chunks_exact_mut(row_len).take(16).enumerate() {
        row_from_x16(ty, x16, blocks, r, row);
    }
}

/// Row `r` (0..16) of a group in the X16 layout, as its GGUF bytes (`blocks` blocks), into
/// `row`: one row read back without undoing the other fifteen.
pub(crate) fn row_from_x16(ty: GgmlType, x16: &[u8], blocks: usize, r: usize, row: &mut [u8]) {
    let size = block_bytes(ty);
    let (at_qh, at_qs) = x16_offsets(ty);
    let fields = size - 20;
    for i in 0..blocks {
        let x = &x16[16 * size * i..16 * size * (i + 1)];
        let b = &mut row[size * i..size * (i + 1)];
        for f in 0..fields / 2 {
            b[2 * f..2 * f + 2].copy_from_slice(&x[32 * f + 2 * r..32 * f + 2 * r + 2]);
        }
        let mut qh = 0u32;
        for l in 0..8 {
            let mask = u64::from_le_bytes(x[at_qh + 8 * l..at_qh + 8 * l + 8].try_into().unwrap());
            // Row r's four bits of lane l, one per value `lane_value(l, 0..4)`.
            let bits = (mask >> (4 * r)) as u32 & 0xF;
            for bit in 0..4 {
                qh |= (bits >> bit & 1) << lane_value(l, bit);
            }
        }
        b[fields..fields + 4].copy_from_slice(&qh.to_le_bytes());
        for w in 0..4 {
            let at = at_qs + 4 * (16 * w + r);
            b[fields + 4 + 4 * w..fields + 8 + 4 * w].copy_from_slice(&x[at..at + 4]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        GgmlType, HostPackedView, RowLayout, deinterleave_rows, gguf_row, interleave_rows, pack,
    };
    use super::*;

    /// Q5_0 and Q5_1 in the X16 layout: each field where the table above puts it, undone by the
    /// inverse, and every row read back as its GGUF bytes — with an odd block count, whose rows
    /// end in padding.
    #[test]
    fn x16_q5_rows_round_trip() {
        for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
            for (rows, cols) in [(16, 32), (32, 96), (48, 256)] {
                let size = block_bytes(ty);
                let row = cols / 32 * size;
                let bytes: Vec<u8> = (0..rows * row).map(|i| (i * 131 % 251) as u8).collect();
                let p = pack(ty, &bytes, rows, cols).unwrap();
                let words = interleave_rows(RowLayout::X16, ty, p.words.clone(), rows, cols);
                assert_ne!(words, p.words);
                let x: &[u8] = bytemuck::cast_slice(&words);
                let (at_qh, at_qs) = x16_offsets(ty);
                // Row 3, block 0: its d, its nibble word 2, the fifth bit of its value 21.
                assert_eq!(x[6..8], bytes[3 * row..3 * row + 2]);
                let qs = 3 * row + size - 16;
                assert_eq!(x[at_qs + 4 * 35..at_qs + 4 * 36], bytes[qs + 8..qs + 12]);
                let qh = u32::from_le_bytes(bytes[qs - 4..qs].try_into().unwrap());
                let (l, b) = (5, 1); // value 16 + 4 + 1
                assert_eq!(lane_value(l, b), 21);
                let mask =
                    u64::from_le_bytes(x[at_qh + 8 * l..at_qh + 8 * l + 8].try_into().unwrap());
                assert_eq!(mask >> (4 * 3 + b) & 1, u64::from(qh >> 21 & 1));
                assert_eq!(
                    deinterleave_rows(RowLayout::X16, ty, &words, rows, cols),
                    p.words
                );
                let view = HostPackedView {
                    ty,
                    rows,
                    cols,
                    words: &words,
                    scales: &[],
                    mins: &[],
                    layout: RowLayout::X16,
                };
                for r in 0..rows {
                    assert_eq!(
                        gguf_row(&view, r),
                        bytes[r * row..(r + 1) * row],
                        "{ty} row {r}"
                    );
                }
            }
        }
    }
}
