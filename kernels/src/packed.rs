//! Weights kept in their GGUF block format ("packed"): the layouts every implementation of
//! [`ToyBackend::packed_matmul`](crate::ToyBackend::packed_matmul) reads, and packing from the
//! bytes of a GGUF tensor.
//!
//! A packed weight has `rows` rows of `cols` values (a GGUF matrix with ggml dims `[cols, rows]`,
//! i.e. a PyTorch `[out, in]` weight). Its words are little-endian u32 (the one integer type
//! every backend has), in one of two layouts:
//!
//! - **Split** (Q8_0, Q4_0, Q4_1, the formats toy's first kernels were written for): each block's
//!   quant bytes, without their f16 fields, as `words[rows, cols / per_word]`; the f16 scales
//!   widened to f32 (exactly) as `scales[rows, cols / 32]`, and Q4_1's offsets as `mins`.
//!   Q8_0: byte `j` of a row is the i8 quant of element `j`. Q4_0/Q4_1: each 32-value block is 16
//!   bytes, byte `j` holding element `j` in its low nibble and element `j + 16` in its high one.
//! - **Blocks** (every other type): each row's GGUF bytes as they are in the file, padded with
//!   zeros to a whole number of words: `words[rows, row_words]`. 16-bit weights (F16, BF16) are
//!   this layout too: two values per word, element `2i` in the low half.
//!
//! So a packed weight takes the memory its file takes (the split layout adds 2 bytes per block
//! for the widened scales); no f32 copy of it is ever made.

mod q5_x16;
pub(crate) use q5_x16::x16_offsets as q5_x16_offsets;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use half::f16;
pub use toy_quant::GgmlType;

/// Values per Q8_0/Q4_0/Q4_1 block.
pub const BLOCK: usize = 32;
/// Values per K-quant super-block (Q2_K..Q6_K, IQ4_XS, and the Q8_K activations they take).
pub const QK_K: usize = 256;

/// The weight types toy multiplies as they are stored (every other GGUF type is widened to f32
/// at load).
pub const PACKED_TYPES: [GgmlType; 14] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::F16,
    GgmlType::BF16,
];

/// Whether `ty` uses the split layout (quants, f32 scales and mins in separate tensors).
pub fn is_split(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1)
}

/// u32 words per row of `cols` values of `ty` in its packed layout.
pub fn row_words(ty: GgmlType, cols: usize) -> usize {
    match ty {
        GgmlType::Q8_0 => cols / 4,
        GgmlType::Q4_0 | GgmlType::Q4_1 => cols / 8,
        _ => (cols / ty.block_size() * ty.type_size()).div_ceil(4),
    }
}

/// A packed weight on a backend's device (see the module docs for the layouts).
#[derive(Debug, Clone)]
pub struct PackedTensor<B: Backend> {
    /// The GGUF type of the blocks (one of `PACKED_TYPES`).
    pub ty: GgmlType,
    /// Values per row (the `in` features).
    pub cols: usize,
    /// `[rows, row_words(ty, cols)]`, `DType::U32` (or I32 holding the same bits).
    pub words: IntTensor<B>,
    /// Split layouts: `[rows, cols / 32]` f32 block scales.
    pub scales: Option<FloatTensor<B>>,
    /// Q4_1: `[rows, cols / 32]` f32 block offsets.
    pub mins: Option<FloatTensor<B>>,
    /// Whether llama.cpp would move this weight into its repacked (interleaved) CPU layout if
    /// its type and shape allow: true for matmul weights, false for the token embedding table,
    /// which llama.cpp keeps in its plain buffer even when a tied output head multiplies by it.
    /// The repacked kernels sum in another order, so the CPU backend needs to know.
    pub repackable: bool,
    /// How the rows of a Q4_K matmul weight lie: as in the file, or in the layout of a backend
    /// whose [`row_layout`](crate::ToyBackend::row_layout) is another, for the weights
    /// [`row_layout_for`] gives it to. Every reader of the words honours it.
    pub layout: RowLayout,
}

/// A packed weight on the host, ready to become device tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPacked {
    /// The GGUF type of the blocks.
    pub ty: GgmlType,
    /// Rows of the weight (the `out` features).
    pub rows: usize,
    /// Values per row (the `in` features).
    pub cols: usize,
    /// `[rows, row_words(ty, cols)]`, row-major.
    pub words: Vec<u32>,
    /// Split layouts: `[rows, cols / 32]` f32 block scales, row-major.
    pub scales: Option<Vec<f32>>,
    /// Q4_1: `[rows, cols / 32]` f32 block offsets, row-major.
    pub mins: Option<Vec<f32>>,
}

/// Why GGUF bytes cannot be packed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    /// The type is not one of `PACKED_TYPES`.
    #[error("{ty} weights are not kept packed (packed types: {})", packed_names())]
    Unsupported {
        /// The weight's type.
        ty: GgmlType,
    },
    /// The rows are empty or not a whole number of the type's blocks.
    #[error(
        "a {ty} row holds a whole number of {block}-value blocks, but this weight's rows have {cols} values"
    )]
    PartialBlock {
        /// The weight's type.
        ty: GgmlType,
        /// Values per row.
        cols: usize,
        /// Values per block of `ty`.
        block: usize,
    },
    /// The data is not the length that `rows × cols` values of the type take.
    #[error(
        "{rows} rows of {cols} {ty} values take {need} bytes, but the tensor has {have}: the file is truncated or corrupt"
    )]
    Size {
        /// The weight's type.
        ty: GgmlType,
        /// Rows of the weight.
        rows: usize,
        /// Values per row.
        cols: usize,
        /// Bytes the weight takes.
        need: usize,
        /// Bytes given.
        have: usize,
    },
}

fn packed_names() -> String {
    let names: Vec<&str> = PACKED_TYPES.iter().map(|t| t.name()).collect();
    names.join(", ")
}

/// Pack the GGUF data `bytes` of a `rows × cols` weight of type `ty`.
pub fn pack(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<HostPacked, PackError> {
    if !PACKED_TYPES.contains(&ty) {
        return Err(PackError::Unsupported { ty });
    }
    let block = ty.block_size();
    if cols == 0 || !cols.is_multiple_of(block) {
        return Err(PackError::PartialBlock { ty, cols, block });
    }
    let row_bytes = cols / block * ty.type_size();
    let need = rows * row_bytes;
    if bytes.len() != need {
        return Err(PackError::Size {
            ty,
            rows,
            cols,
            need,
            have: bytes.len(),
        });
    }
    Ok(if is_split(ty) {
        split(ty, bytes, rows, cols)
    } else {
        let per_row = row_words(ty, cols);
        let mut words = vec![0u32; rows * per_row];
        for (row, out) in bytes
            .chunks_exact(row_bytes)
            .zip(words.chunks_exact_mut(per_row))
        {
            let out: &mut [u8] = bytemuck::cast_slice_mut(out);
            out[..row_bytes].copy_from_slice(row);
        }
        HostPacked {
            ty,
            rows,
            cols,
            words,
            scales: None,
            mins: None,
        }
    })
}

/// Split Q8_0/Q4_0/Q4_1 blocks into quant words, f32 scales and (Q4_1) mins.
fn split(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> HostPacked {
    let block_bytes = ty.type_size();
    let n_blocks = rows * cols / BLOCK;
    // The quants are the last 32 (Q8_0) or 16 (Q4_*) bytes of a block, after the f16 fields.
    let header = if ty == GgmlType::Q4_1 { 4 } else { 2 };
    let mut words = Vec::with_capacity(n_blocks * (block_bytes - header) / 4);
    let mut scales = Vec::with_capacity(n_blocks);
    let mut mins = (ty == GgmlType::Q4_1).then(|| Vec::with_capacity(n_blocks));
    for block in bytes.chunks_exact(block_bytes) {
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
    HostPacked {
        ty,
        rows,
        cols,
        words,
        scales: Some(scales),
        mins,
    }
}

/// The GGUF bytes of row `r` of a blocks-layout weight, from its words.
pub fn row_bytes(ty: GgmlType, cols: usize, words: &[u32], r: usize) -> &[u8] {
    let per_row = row_words(ty, cols);
    let bytes: &[u8] = bytemuck::cast_slice(&words[r * per_row..(r + 1) * per_row]);
    &bytes[..cols / ty.block_size() * ty.type_size()]
}

/// Super-blocks per chunk of the interleaved Q4_K layout ([`interleave_q4k_x8`]).
pub const Q4K_X8_CHUNK: usize = 16;

/// How a backend lays out the rows of a Q4_K, Q4_0, Q8_0, Q5_0 or Q5_1 weight (the CPU's
/// decode reads them sixteen rows at a time). Each interleaved layout is a permutation of the packed words (and,
/// for the split types, of the f32 scales) — no byte more — made once at load; [`gguf_row`]
/// reads any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowLayout {
    /// Row after row, as in the file.
    #[default]
    Rows,
    /// Q4_K: eight rows interleaved by chunks of super-blocks ([`interleave_q4k_x8`]): the
    /// AVX2 eight-row kernel reads a group as one stream.
    X8,
    /// Q4_K, Q4_0, Q8_0: sixteen rows' blocks transposed word by word ([`interleave_x16`]); Q5_0,
    /// Q5_1: each block re-split into its fields (`q5_x16`). Each field of a block holds the
    /// sixteen rows side by side, so an AVX-512 kernel keeps the sixteen outputs in the lanes of
    /// one register.
    X16,
}

/// The layout a backend that prefers `preferred` gives a weight: an interleaved one only for a
/// matmul weight llama.cpp repacks (`block_q4_Kx8`, `block_q4_0x8`: so the kernels that read it
/// compute llama.cpp's repacked forms), a Q5_0/Q5_1 matmul weight or a Q8_0 weight (whose
/// forms are the same either way), and only where its rows fill whole groups — X16 needs rows in sixteens (else Q4_K takes X8),
/// X8 rows in eights and more than one chunk per row (a row of one chunk already lies so).
pub fn row_layout_for(
    preferred: RowLayout,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    repackable: bool,
) -> RowLayout {
    // Q8_0 takes ggml's `vec_dot` whether or not the weight is a token embedding table: its
    // layout serves both. The others' tables keep their rows.
    if !repackable && ty != GgmlType::Q8_0 {
        return RowLayout::Rows;
    }
    let x8 = ty == GgmlType::Q4K && rows.is_multiple_of(8) && cols > Q4K_X8_CHUNK * QK_K;
    let x16 = matches!(
        ty,
        GgmlType::Q4K | GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q5_1
    ) && rows.is_multiple_of(16);
    match preferred {
        RowLayout::X16 if x16 => RowLayout::X16,
        RowLayout::X16 | RowLayout::X8 if x8 => RowLayout::X8,
        _ => RowLayout::Rows,
    }
}

/// The transposition unit of the X16 layout for a type: (values per block, u32 words per
/// block of its words). Q4_K: a super-block of 36 words (`d`/`dmin`, three scale words, 32
/// words of nibbles); Q4_0: a block of 4 words of nibbles, Q8_0 of 8 words of quants (their
/// scales are apart, one f32 each).
fn x16_unit(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q4K => (QK_K, 36),
        GgmlType::Q4_0 => (BLOCK, 4),
        GgmlType::Q8_0 => (BLOCK, 8),
        _ => unreachable!("{ty} has no X16 layout"),
    }
}

/// A weight's words `[rows, row_words]` in `layout` (from the file's row order), rearranged in
/// place one group of rows at a time: at load no second copy of the weight exists, only of a
/// group (a whole copy freed afterwards would stay in the process's heap, and in its peak RSS).
pub fn interleave_rows(
    layout: RowLayout,
    ty: GgmlType,
    mut words: Vec<u32>,
    rows: usize,
    cols: usize,
) -> Vec<u32> {
    let group_rows = match layout {
        RowLayout::Rows => return words,
        RowLayout::X8 => 8,
        RowLayout::X16 => 16,
    };
    assert!(rows.is_multiple_of(group_rows) && words.len().is_multiple_of(rows));
    let group = words.len() / rows * group_rows;
    for chunk in words.chunks_exact_mut(group) {
        let rearranged = match layout {
            RowLayout::X8 => interleave_q4k_x8(chunk, 8, cols / QK_K),
            _ if is_q5(ty) => q5_group(ty, chunk, cols, true),
            _ => {
                let (values, width) = x16_unit(ty);
                interleave_x16(chunk, 16, cols / values, width)
            }
        };
        chunk.copy_from_slice(&rearranged);
    }
    words
}

/// A weight's words in `layout` put back in the file's row order (the inverse of
/// [`interleave_rows`]).
pub fn deinterleave_rows(
    layout: RowLayout,
    ty: GgmlType,
    words: &[u32],
    rows: usize,
    cols: usize,
) -> Vec<u32> {
    match layout {
        RowLayout::Rows => words.to_vec(),
        RowLayout::X8 => deinterleave_q4k_x8(words, rows, cols / QK_K),
        RowLayout::X16 if is_q5(ty) => {
            let group = words.len() / rows * 16;
            (words.chunks_exact(group))
                .flat_map(|g| q5_group(ty, g, cols, false))
                .collect()
        }
        RowLayout::X16 => {
            let (values, width) = x16_unit(ty);
            deinterleave_x16(words, rows, cols / values, width)
        }
    }
}

fn is_q5(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1)
}

/// One group of sixteen Q5 rows (`16 × row_words` words) into the X16 layout (`to_x16`) or
/// back; the padding words at the group's end stay zero.
fn q5_group(ty: GgmlType, group: &[u32], cols: usize, to_x16: bool) -> Vec<u32> {
    let mut out = vec![0u32; group.len()];
    let (src, dst): (&[u8], &mut [u8]) = (
        bytemuck::cast_slice(group),
        bytemuck::cast_slice_mut(&mut out),
    );
    let (row_len, blocks) = (src.len() / 16, cols / BLOCK);
    match to_x16 {
        true => q5_x16::to_x16(ty, src, row_len, blocks, dst),
        false => q5_x16::from_x16(ty, src, blocks, row_len, dst),
    }
    out
}

/// A split weight's f32 block scales `[rows, cols / 32]` in `layout` (Q4_0 and Q8_0 in X16:
/// transposed per block as their words are, in place; otherwise as they are).
pub fn interleave_scales(
    layout: RowLayout,
    mut scales: Vec<f32>,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    if layout == RowLayout::X16 {
        assert!(rows.is_multiple_of(16));
        for chunk in scales.chunks_exact_mut(16 * (cols / BLOCK)) {
            let rearranged = interleave_x16(chunk, 16, cols / BLOCK, 1);
            chunk.copy_from_slice(&rearranged);
        }
    }
    scales
}

/// The inverse of [`interleave_scales`].
pub fn deinterleave_scales(
    layout: RowLayout,
    scales: &[f32],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    match layout {
        RowLayout::X16 => deinterleave_x16(scales, rows, cols / BLOCK, 1),
        _ => scales.to_vec(),
    }
}

/// A weight's words and split scales put back in the file's row order (copies; the scales
/// empty where the type has none).
pub fn deinterleaved_host(p: &HostPackedView<'_>) -> (Vec<u32>, Vec<f32>) {
    (
        deinterleave_rows(p.layout, p.ty, p.words, p.rows, p.cols),
        deinterleave_scales(p.layout, p.scales, p.rows, p.cols),
    )
}

/// Where element `k` of unit `i` of row `r` lies in the X16 layout (`units` per row, `width`
/// elements per unit).
fn x16_at(r: usize, i: usize, k: usize, units: usize, width: usize) -> usize {
    ((r / 16) * units + i) * 16 * width + 16 * k + r % 16
}

/// Rows of `units` units of `width` elements each (rows a multiple of 16), with each group of
/// sixteen rows' unit `i` transposed: element `k` of the group's unit is the sixteen rows'
/// element `k` side by side. For Q4_K (a 36-word super-block) the X16 block is 2304 bytes: the
/// rows' `d`/`dmin` pairs (64 bytes), their three scale words (3 × 64), then per 4-byte group
/// of nibbles the rows' four bytes each (32 × 64); for Q4_0 (a block of 4 words, its scales
/// transposed alike) 256 bytes of nibbles and 16 scales — llama.cpp's `block_q4_Kx8` /
/// `block_q4_0x8` idea, sixteen rows for 512-bit registers, and nothing widened.
pub fn interleave_x16<T: Copy + Default>(
    data: &[T],
    rows: usize,
    units: usize,
    width: usize,
) -> Vec<T> {
    regroup_x16(data, rows, units, width, true)
}

/// The inverse of [`interleave_x16`].
pub fn deinterleave_x16<T: Copy + Default>(
    data: &[T],
    rows: usize,
    units: usize,
    width: usize,
) -> Vec<T> {
    regroup_x16(data, rows, units, width, false)
}

/// Element `(r, i, k)` of each group of sixteen rows moved between its row-order place
/// `(r·units + i)·width + k` and its X16 place `(i·width + k)·16 + r`, one way or the other.
/// Plain nested loops, sixteen contiguous X16 elements innermost (no division per element).
fn regroup_x16<T: Copy + Default>(
    data: &[T],
    rows: usize,
    units: usize,
    width: usize,
    to_x16: bool,
) -> Vec<T> {
    assert!(rows.is_multiple_of(16) && data.len() == rows * units * width);
    let mut out = vec![T::default(); data.len()];
    let group = 16 * units * width;
    for (src, dst) in data.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        for i in 0..units {
            for k in 0..width {
                for r in 0..16 {
                    let (row_at, x16_at) = ((r * units + i) * width + k, (i * width + k) * 16 + r);
                    match to_x16 {
                        true => dst[x16_at] = src[row_at],
                        false => dst[row_at] = src[x16_at],
                    }
                }
            }
        }
    }
    out
}

/// Row `r`'s words (and, for a split type, its block scales) in the file's order, from a
/// weight in the X16 layout.
fn x16_row(p: &HostPackedView<'_>, r: usize) -> (Vec<u32>, Vec<f32>) {
    if is_q5(p.ty) {
        let per_row = p.words.len() / p.rows;
        let group = &p.words[r / 16 * 16 * per_row..(r / 16 + 1) * 16 * per_row];
        let mut row = vec![0u32; per_row];
        let blocks = p.cols / BLOCK;
        q5_x16::row_from_x16(
            p.ty,
            bytemuck::cast_slice(group),
            blocks,
            r % 16,
            bytemuck::cast_slice_mut(&mut row),
        );
        return (row, Vec::new());
    }
    let (values, width) = x16_unit(p.ty);
    let units = p.cols / values;
    let words = (0..units)
        .flat_map(|i| (0..width).map(move |k| x16_at(r, i, k, units, width)))
        .map(|at| p.words[at])
        .collect();
    let scales = match p.scales.is_empty() {
        true => Vec::new(),
        false => (0..p.cols / BLOCK)
            .map(|b| p.scales[x16_at(r, b, 0, p.cols / BLOCK, 1)])
            .collect(),
    };
    (words, scales)
}

/// Q4_K rows `[rows, sb super-blocks]` (row-major, any unit: bytes, or the 36 words of a
/// super-block) interleaved by eight: for each group of eight rows, the rows' super-blocks in
/// chunks of [`Q4K_X8_CHUNK`], row after row within a chunk — so the CPU's eight-row kernel
/// reads one contiguous stream instead of eight. `rows` is a multiple of 8.
pub fn interleave_q4k_x8<T: Copy>(data: &[T], rows: usize, sb: usize) -> Vec<T> {
    assert!(rows.is_multiple_of(8) && sb > 0 && data.len().is_multiple_of(rows * sb));
    let block = data.len() / (rows * sb);
    let row_len = sb * block;
    let mut out = Vec::with_capacity(data.len());
    for group in data.chunks_exact(8 * row_len) {
        for i0 in (0..sb).step_by(Q4K_X8_CHUNK) {
            let len = Q4K_X8_CHUNK.min(sb - i0);
            for r in 0..8 {
                let at = r * row_len + i0 * block;
                out.extend_from_slice(&group[at..at + len * block]);
            }
        }
    }
    out
}

/// Where super-block `i` of row `r` starts in the interleaved layout, counted in super-blocks.
fn interleaved_block(r: usize, i: usize, sb: usize) -> usize {
    let i0 = i - i % Q4K_X8_CHUNK;
    let len = Q4K_X8_CHUNK.min(sb - i0);
    (r / 8) * 8 * sb + 8 * i0 + (r % 8) * len + i % Q4K_X8_CHUNK
}

/// The inverse of [`interleave_q4k_x8`].
pub fn deinterleave_q4k_x8<T: Copy>(data: &[T], rows: usize, sb: usize) -> Vec<T> {
    assert!(rows.is_multiple_of(8) && sb > 0 && data.len().is_multiple_of(rows * sb));
    let block = data.len() / (rows * sb);
    (0..rows)
        .flat_map(|r| (0..sb).map(move |i| interleaved_block(r, i, sb)))
        .flat_map(|b| data[b * block..(b + 1) * block].iter().copied())
        .collect()
}

/// The GGUF bytes of row `r` of an interleaved Q4_K weight.
fn interleaved_row(p: &HostPackedView<'_>, r: usize) -> Vec<u8> {
    let sb = p.cols / QK_K;
    let bytes: &[u8] = bytemuck::cast_slice(p.words);
    (0..sb)
        .flat_map(|i| {
            let b = interleaved_block(r, i, sb);
            bytes[b * 144..(b + 1) * 144].iter().copied()
        })
        .collect()
}

/// Row `r` of a packed weight as the GGUF block bytes it came from (the split layouts are
/// re-assembled, interleaved rows gathered), so that `toy_quant::dequantize` can read it.
pub fn gguf_row<'a>(p: &HostPackedView<'a>, r: usize) -> Vec<u8> {
    let (ty, cols) = (p.ty, p.cols);
    let blocks = cols / BLOCK;
    let gathered;
    let (words, scales, mins): (&[u32], &[f32], &[f32]) = match p.layout {
        RowLayout::X8 => return interleaved_row(p, r),
        RowLayout::X16 => {
            gathered = x16_row(p, r);
            (&gathered.0, &gathered.1, &[])
        }
        RowLayout::Rows => {
            let per_row = row_words(ty, cols);
            // Row `r`'s block scales (or offsets), where the type has them.
            let split = |v: &'a [f32]| v.get(r * blocks..(r + 1) * blocks).unwrap_or(&[]);
            (
                &p.words[r * per_row..(r + 1) * per_row],
                split(p.scales),
                split(p.mins),
            )
        }
    };
    let bytes: &[u8] = bytemuck::cast_slice(words);
    if !is_split(ty) {
        return bytes[..cols / ty.block_size() * ty.type_size()].to_vec();
    }
    let qb = bytes.len() / blocks;
    let mut out = Vec::with_capacity(blocks * ty.type_size());
    for b in 0..blocks {
        out.extend_from_slice(&f16::from_f32(scales[b]).to_le_bytes());
        if ty == GgmlType::Q4_1 {
            out.extend_from_slice(&f16::from_f32(mins[b]).to_le_bytes());
        }
        out.extend_from_slice(&bytes[b * qb..(b + 1) * qb]);
    }
    out
}

/// Borrowed host data of a packed weight.
#[derive(Debug, Clone, Copy)]
pub struct HostPackedView<'a> {
    /// The GGUF type of the blocks.
    pub ty: GgmlType,
    /// Rows of the weight (the `out` features).
    pub rows: usize,
    /// Values per row (the `in` features).
    pub cols: usize,
    /// The packed words, `rows × row_words(ty, cols)` of them, in `layout`.
    pub words: &'a [u32],
    /// Empty for the blocks layout.
    pub scales: &'a [f32],
    /// Empty unless Q4_1.
    pub mins: &'a [f32],
    /// How the rows lie ([`RowLayout`]).
    pub layout: RowLayout,
}

impl HostPacked {
    /// This weight borrowed as a view, in the file's row layout.
    pub fn view(&self) -> HostPackedView<'_> {
        HostPackedView {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            words: &self.words,
            scales: self.scales.as_deref().unwrap_or(&[]),
            mins: self.mins.as_deref().unwrap_or(&[]),
            layout: RowLayout::Rows,
        }
    }
}

/// Dequantize rows `ids` of a packed weight to f32 (`ids.len() × cols`, row-major), as ggml's
/// `dequantize_row_*` computes them (bit for bit).
pub fn dequantize_rows(p: &HostPackedView<'_>, ids: impl IntoIterator<Item = usize>) -> Vec<f32> {
    let mut out = Vec::new();
    let mut row = vec![0.0f32; p.cols];
    for r in ids {
        let result = if is_split(p.ty) || p.layout != RowLayout::Rows {
            toy_quant::dequantize(p.ty, &gguf_row(p, r), &mut row)
        } else {
            toy_quant::dequantize(p.ty, row_bytes(p.ty, p.cols, p.words, r), &mut row)
        };
        result.expect("a packed row is whole blocks");
        out.extend_from_slice(&row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interleaving Q4_K rows by eight is undone by its inverse, and every row read from the
    /// interleaved words is the row it was (super-block counts around the chunk of 16).
    #[test]
    fn interleaved_q4k_rows_round_trip() {
        for (rows, sb) in [(8, 1), (16, 3), (8, 16), (24, 17), (8, 33)] {
            let bytes: Vec<u8> = (0..rows * sb * 144)
                .map(|i| (i * 7 + i / 13) as u8)
                .collect();
            let inter = interleave_q4k_x8(&bytes, rows, sb);
            assert!(sb <= 16 || inter != bytes, "{rows} × {sb}");
            assert_eq!(deinterleave_q4k_x8(&inter, rows, sb), bytes);
            let words: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let inter_words = interleave_q4k_x8(&words, rows, sb);
            assert_eq!(bytemuck::cast_slice::<u32, u8>(&inter_words), &inter[..]);
            let view = HostPackedView {
                ty: GgmlType::Q4K,
                rows,
                cols: sb * QK_K,
                words: &inter_words,
                scales: &[],
                mins: &[],
                layout: RowLayout::X8,
            };
            for r in 0..rows {
                assert_eq!(gguf_row(&view, r), bytes[r * sb * 144..(r + 1) * sb * 144]);
            }
        }
    }

    /// The X16 layout transposes each group's super-blocks word by word (row `r`'s word `k` at
    /// `16k + r`), is undone by its inverse, and every row read from it is the row it was.
    #[test]
    fn x16_q4k_rows_round_trip() {
        for (rows, sb) in [(16, 1), (32, 3), (16, 9)] {
            let words: Vec<u32> = (0..rows * sb * 36).map(|i| i as u32 * 2654435761).collect();
            let inter = interleave_x16(&words, rows, sb, 36);
            // Row 17's word 5 of super-block 0 (group 1, lane 1).
            if rows > 16 {
                assert_eq!(inter[sb * 576 + 16 * 5 + 1], words[17 * sb * 36 + 5]);
            }
            assert_eq!(inter[16 * 3 + 2], words[2 * sb * 36 + 3]);
            assert_eq!(deinterleave_x16(&inter, rows, sb, 36), words);
            let view = HostPackedView {
                ty: GgmlType::Q4K,
                rows,
                cols: sb * QK_K,
                words: &inter,
                scales: &[],
                mins: &[],
                layout: RowLayout::X16,
            };
            let bytes: &[u8] = bytemuck::cast_slice(&words);
            for r in 0..rows {
                assert_eq!(gguf_row(&view, r), bytes[r * sb * 144..(r + 1) * sb * 144]);
            }
        }
    }

    /// Q4_0 in the X16 layout: words and scales transposed per block, every row read back as
    /// its GGUF bytes.
    #[test]
    fn x16_q4_0_rows_round_trip() {
        let (rows, cols) = (32, 96);
        let bytes: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let mut block = vec![0u8; 18];
                block[..2].copy_from_slice(&f16::from_f32(b as f32 * 0.25 - 3.0).to_le_bytes());
                (2..18).for_each(|i| block[i] = (b * 31 + i * 7) as u8);
                block
            })
            .collect();
        let p = pack(GgmlType::Q4_0, &bytes, rows, cols).unwrap();
        let words = interleave_rows(RowLayout::X16, p.ty, p.words.clone(), rows, cols);
        let scales = interleave_scales(RowLayout::X16, p.scales.clone().unwrap(), rows, cols);
        assert_ne!(words, p.words);
        assert_eq!(
            deinterleave_rows(RowLayout::X16, p.ty, &words, rows, cols),
            p.words
        );
        assert_eq!(
            deinterleave_scales(RowLayout::X16, &scales, rows, cols),
            p.scales.unwrap()
        );
        let view = HostPackedView {
            ty: GgmlType::Q4_0,
            rows,
            cols,
            words: &words,
            scales: &scales,
            mins: &[],
            layout: RowLayout::X16,
        };
        let row = cols / 32 * 18;
        for r in 0..rows {
            assert_eq!(gguf_row(&view, r), bytes[r * row..(r + 1) * row], "row {r}");
        }
    }

    /// Which weights get which layout.
    #[test]
    fn row_layouts_go_to_whole_groups_of_repacked_weights() {
        use RowLayout::*;
        let k = |sb: usize| sb * QK_K;
        assert_eq!(row_layout_for(X16, GgmlType::Q4K, 32, k(8), true), X16);
        assert_eq!(row_layout_for(X16, GgmlType::Q4K, 24, k(32), true), X8);
        assert_eq!(row_layout_for(X16, GgmlType::Q4K, 24, k(8), true), Rows);
        assert_eq!(row_layout_for(X16, GgmlType::Q4K, 32, k(8), false), Rows);
        assert_eq!(row_layout_for(X16, GgmlType::Q6K, 32, k(8), true), Rows);
        assert_eq!(row_layout_for(X8, GgmlType::Q4K, 32, k(32), true), X8);
        assert_eq!(row_layout_for(X8, GgmlType::Q4K, 32, k(8), true), Rows);
        assert_eq!(row_layout_for(Rows, GgmlType::Q4K, 32, k(32), true), Rows);
        assert_eq!(row_layout_for(X16, GgmlType::Q4_0, 32, 64, true), X16);
        assert_eq!(row_layout_for(X16, GgmlType::Q4_0, 24, 64, true), Rows);
        assert_eq!(row_layout_for(X16, GgmlType::Q4_0, 32, 64, false), Rows);
        assert_eq!(row_layout_for(X8, GgmlType::Q4_0, 32, 64, true), Rows);
        assert_eq!(row_layout_for(X16, GgmlType::Q8_0, 32, 64, false), X16);
        assert_eq!(row_layout_for(X16, GgmlType::Q8_0, 40, 64, true), Rows);
    }

    /// Packing then re-assembling a row gives the GGUF bytes back, for every packed type.
    #[test]
    fn rows_round_trip_through_every_layout() {
        let (rows, cols) = (3, 512);
        for ty in PACKED_TYPES {
            let row_bytes = cols / ty.block_size() * ty.type_size();
            let mut bytes: Vec<u8> = (0..rows * row_bytes)
                .map(|i| (i * 131 % 251) as u8)
                .collect();
            // Keep the split formats' f16 fields finite, normal numbers: their widening to f32
            // and back must be exact for the round trip to hold.
            if is_split(ty) {
                for block in bytes.chunks_exact_mut(ty.type_size()) {
                    block[..2].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
                    if ty == GgmlType::Q4_1 {
                        block[2..4].copy_from_slice(&f16::from_f32(-0.5).to_le_bytes());
                    }
                }
            }
            let packed = pack(ty, &bytes, rows, cols).unwrap();
            assert_eq!(packed.words.len(), rows * row_words(ty, cols), "{ty}");
            for r in 0..rows {
                assert_eq!(
                    gguf_row(&packed.view(), r),
                    &bytes[r * row_bytes..(r + 1) * row_bytes],
                    "{ty} row {r}"
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_with_the_type_named() {
        let err = pack(GgmlType::Q4K, &[0; 144], 1, 128).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a Q4_K row holds a whole number of 256-value blocks, but this weight's rows have 128 values"
        );
        let err = pack(GgmlType::Q6K, &[0; 100], 1, 256).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        let err = pack(GgmlType::Q8K, &[0; 292], 1, 256).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("Q8_K weights are not kept packed"),
            "{err}"
        );
    }
}
