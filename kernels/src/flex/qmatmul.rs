//! Quantized matmuls on Q8_0 / Q4_0 / Q4_1 weights (the split layout of `crate::packed`), as
//! ggml's x86 CPU backend computes them.

use rayon::prelude::*;

use super::*;
use crate::packed::{GgmlType, RowLayout, is_split, row_words};

/// An activation row quantized to 8-bit blocks (ggml's Q8_0 / Q8_1).
pub(super) struct QuantRow {
    pub(super) quants: Vec<i8>,
    pub(super) scales: Vec<f32>,
    /// Q8_1's `f16(d * Σq)` per block: what Q4_1's offsets multiply.
    pub(super) sums: Vec<f32>,
}

/// `quantize_row_impl`, vectorized where the CPU allows (the same bits).
pub(super) fn quantize_row(x: &[f32]) -> QuantRow {
    #[cfg(target_arch = "x86_64")]
    if vnni::available() {
        return vnni::quantize_row(x);
    }
    quantize_row_fma(x)
}

with_fma!(fn quantize_row_fma = quantize_row_impl(x: &[f32]) -> QuantRow);

/// ggml's `quantize_row_q8_0` / `quantize_row_q8_1` (x86 path): `d = amax / 127` stored as
/// f16, `q = round_half_even(x * 127 / amax)`, and for Q8_1 `s = f16(d * Σq)` with the unrounded d.
#[inline(always)]
pub(super) fn quantize_row_impl(x: &[f32]) -> QuantRow {
    let mut quants = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut sums = Vec::with_capacity(x.len() / BLOCK);
    for block in x.chunks_exact(BLOCK) {
        // Loops, not closures: a closure keeps the features of this function's definition, not
        // of `quantize_row`'s AVX2 copy, and its rounding would be a libm call per value.
        let mut amax = 0.0f32;
        for &v in block {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        scales.push(f16::from_f32(d).to_f32());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for &v in block {
            let q = (v * id).round_ties_even() as i8;
            quants.push(q);
            sum += q as i32;
        }
        sums.push(f16::from_f32(d * sum as f32).to_f32());
    }
    QuantRow {
        quants,
        scales,
        sums,
    }
}

// The dot products reproduce ggml's x86 `ggml_vec_dot_*` to the bit: per block, eight lanes
// each hold an exact integer sum of 4 products (elements 4l..4l+4), converted to f32 and
// accumulated with one fused multiply-add by `d_w * d_x`; the 8 lanes are summed at the end in
// ggml's `hsum_float_8` order. The scalar functions are the specification; the AVX2 ones compute
// the same bits faster and are used when the CPU has AVX2 and FMA.

/// Which weight block format a dot product reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// Bytes of quants per block in the packed layout.
    pub(super) fn block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => BLOCK,
            Format::Q4_0 | Format::Q4_1 => BLOCK / 2,
        }
    }
}

/// Weight quant `i` (0..32) of a block, as the signed value ggml multiplies.
pub(super) fn weight_quant(format: Format, block: &[u8], i: usize) -> i32 {
    match format {
        Format::Q8_0 => block[i] as i8 as i32,
        Format::Q4_0 | Format::Q4_1 => {
            let byte = block[i % 16];
            let nibble = if i < 16 { byte & 0x0F } else { byte >> 4 } as i32;
            if format == Format::Q4_0 {
                nibble - 8
            } else {
                nibble
            }
        }
    }
}

/// The specification: one output element, scalar.
pub(super) fn dot_scalar(
    format: Format,
    x: &QuantRow,
    w: &[u8],
    w_scales: &[f32],
    w_mins: &[f32],
) -> f32 {
    let bb = format.block_bytes();
    let mut acc = [0.0f32; 8];
    let mut mins = 0.0f32;
    for (b, (xq, wq)) in x
        .quants
        .chunks_exact(BLOCK)
        .zip(w.chunks_exact(bb))
        .enumerate()
    {
        let d = w_scales[b] * x.scales[b];
        for (l, lane) in acc.iter_mut().enumerate() {
            let sumi: i32 = (4 * l..4 * l + 4)
                .map(|i| weight_quant(format, wq, i) * xq[i] as i32)
                .sum();
            *lane = d.mul_add(sumi as f32, *lane);
        }
        if format == Format::Q4_1 {
            mins = w_mins[b].mul_add(x.sums[b], mins);
        }
    }
    hsum8(acc) + mins
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Format, QuantRow};

    /// 32 weight quants of a block as i8 (Q4 nibbles unpacked: low nibbles then high nibbles).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load_weights(format: Format, block: &[u8]) -> __m256i {
        unsafe {
            match format {
                Format::Q8_0 => _mm256_loadu_si256(block.as_ptr() as *const __m256i),
                Format::Q4_0 | Format::Q4_1 => {
                    let packed = _mm_loadu_si128(block.as_ptr() as *const __m128i);
                    let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                    let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
                    if format == Format::Q4_0 {
                        _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
                    } else {
                        nibbles
                    }
                }
            }
        }
    }

    /// `lane_sums`' weight operand, computed once per weight block however many activation rows
    /// it meets: maddubs needs an unsigned operand, so |w| (Q4_1's weights are unsigned already).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unsigned_weights(format: Format, w: __m256i) -> __m256i {
        if format == Format::Q4_1 {
            w
        } else {
            _mm256_sign_epi8(w, w)
        }
    }

    /// Eight i32 lanes, lane l = Σ w[i] x[i] over i in 4l..4l+4 (ggml's mul_sum_i8_pairs), with
    /// `aw = unsigned_weights(format, w)`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn lane_sums(format: Format, aw: __m256i, w: __m256i, x: __m256i) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        // Unsigned Q4_1 weights multiply the signed activations directly; otherwise |w| times
        // x with w's sign moved onto x.
        let sx = if format == Format::Q4_1 {
            x
        } else {
            _mm256_sign_epi8(x, w)
        };
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones)
    }

    /// Four output elements — four weight rows against one activation row — with independent
    /// accumulators, so one chain's FMA latency does not stall the others. Each is bit-identical
    /// to `dot_scalar`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4(
        format: Format,
        x: &QuantRow,
        w: [&[u8]; 4],
        s: [&[f32]; 4],
        m: [&[f32]; 4],
    ) -> [f32; 4] {
        unsafe { tile::<4, 1>(format, [x], w, s, m)[0] }
    }

    /// One output element, reading its weight row alone and in memory order — what a decode
    /// step wants: interleaving four rows' blocks splits the read into four short streams
    /// (one row is only a few cache lines) that the hardware prefetcher never locks onto.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot1(format: Format, x: &QuantRow, w: &[u8], s: &[f32], m: &[f32]) -> f32 {
        unsafe { tile::<1, 1>(format, [x], [w], [s], [m])[0][0] }
    }

    /// Four weight rows × two activation rows, as tinyBLAS's AVX2 `gemm4xN<2>` tiles them: each
    /// weight block is loaded, unpacked and made non-negative once for both activation rows.
    /// `y[i][r]` is activation row `i` against weight row `r`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile4x2(
        format: Format,
        x: [&QuantRow; 2],
        w: [&[u8]; 4],
        s: [&[f32]; 4],
        m: [&[f32]; 4],
    ) -> [[f32; 4]; 2] {
        unsafe { tile::<4, 2>(format, x, w, s, m) }
    }

    /// `R` weight rows × `A` activation rows, every output with its own accumulator and
    /// bit-identical to `dot_scalar`. One specialized loop per format: no per-block branch on it.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const A: usize>(
        format: Format,
        x: [&QuantRow; A],
        w: [&[u8]; R],
        s: [&[f32]; R],
        m: [&[f32]; R],
    ) -> [[f32; R]; A] {
        unsafe {
            match format {
                Format::Q8_0 => tile_for::<0, R, A>(x, w, s, m),
                Format::Q4_0 => tile_for::<1, R, A>(x, w, s, m),
                Format::Q4_1 => tile_for::<2, R, A>(x, w, s, m),
            }
        }
    }

    const FORMATS: [Format; 3] = [Format::Q8_0, Format::Q4_0, Format::Q4_1];

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_for<const F: usize, const R: usize, const A: usize>(
        x: [&QuantRow; A],
        w: [&[u8]; R],
        s: [&[f32]; R],
        m: [&[f32]; R],
    ) -> [[f32; R]; A] {
        let format = FORMATS[F];
        let bb = format.block_bytes();
        let blocks = x[0].scales.len();
        // The caller passes whole rows: `blocks` blocks of activations (and their sums for
        // Q4_1), of weights, scales (and mins for Q4_1).
        for xi in &x {
            assert!(xi.scales.len() == blocks && xi.quants.len() >= blocks * BLOCK);
            assert!(format != Format::Q4_1 || xi.sums.len() >= blocks);
        }
        for r in 0..R {
            assert!(w[r].len() >= blocks * bb && s[r].len() >= blocks);
            assert!(format != Format::Q4_1 || m[r].len() >= blocks);
        }
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); R]; A];
            let mut mins = [[0.0f32; R]; A];
            for b in 0..blocks {
                let xq: [__m256i; A] = std::array::from_fn(|i| {
                    _mm256_loadu_si256(x[i].quants.as_ptr().add(b * BLOCK) as *const __m256i)
                });
                for r in 0..R {
                    // Decode (one activation row): 1 KiB ahead, past this row's end into the
                    // next rows, which follow. A decode step loads and waits on each weight
                    // block (a 576-wide Q8_0 row is 9 cache lines, too short a stream for the
                    // prefetcher to run ahead of): Zen 2/3 SmolLM2 Q8_0 decode +6–20%
                    // alternated. Prefill re-reads its rows from cache. Prefetches never fault.
                    if A == 1 {
                        _mm_prefetch::<_MM_HINT_T0>(
                            w[r].as_ptr().wrapping_add(b * bb + 1024) as *const i8
                        );
                    }
                    let wq = load_weights(format, w[r].get_unchecked(b * bb..));
                    let aw = unsigned_weights(format, wq);
                    let ws = *s[r].get_unchecked(b);
                    for i in 0..A {
                        let d = _mm256_set1_ps(ws * *x[i].scales.get_unchecked(b));
                        let q = _mm256_cvtepi32_ps(lane_sums(format, aw, wq, xq[i]));
                        acc[i][r] = _mm256_fmadd_ps(d, q, acc[i][r]);
                        if format == Format::Q4_1 {
                            mins[i][r] = m[r]
                                .get_unchecked(b)
                                .mul_add(*x[i].sums.get_unchecked(b), mins[i][r]);
                        }
                    }
                }
            }
            std::array::from_fn(|i| {
                std::array::from_fn(|r| {
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][r]);
                    super::hsum8(lanes) + mins[i][r]
                })
            })
        }
    }
}

/// Four output elements' dot products (see `avx2::dot4`).
pub(super) type Dot4Fn = fn(Format, &QuantRow, [&[u8]; 4], [&[f32]; 4], [&[f32]; 4]) -> [f32; 4];

/// The fastest implementation this CPU has (chosen once per matmul, not per element).
pub(super) fn dot4_impl() -> Dot4Fn {
    #[cfg(target_arch = "x86_64")]
    if cpu_level() >= CpuLevel::Avx2 {
        // SAFETY: the CPU has the features `avx2::dot4` is compiled for; callers pass whole blocks.
        return |format, x, w, s, m| unsafe { avx2::dot4(format, x, w, s, m) };
    }
    |format, x, w, s, m| std::array::from_fn(|r| dot_scalar(format, x, w[r], s[r], m[r]))
}

/// Four weight rows × two activation rows (see `avx2::tile4x2`); `None` without AVX2.
pub(super) type Tile4x2Fn =
    fn(Format, [&QuantRow; 2], [&[u8]; 4], [&[f32]; 4], [&[f32]; 4]) -> [[f32; 4]; 2];

/// The 4 × 2 register tile where the CPU has AVX2.
pub(super) fn tile4x2_impl() -> Option<Tile4x2Fn> {
    #[cfg(target_arch = "x86_64")]
    if cpu_level() >= CpuLevel::Avx2 {
        // SAFETY: the CPU has the features `avx2::tile4x2` is compiled for; callers pass
        // whole rows.
        return Some(|format, x, w, s, m| unsafe { avx2::tile4x2(format, x, w, s, m) });
    }
    None
}

/// One output element's dot product (see `avx2::dot1`).
pub(super) type Dot1Fn = fn(Format, &QuantRow, &[u8], &[f32], &[f32]) -> f32;

/// The fastest single-row implementation this CPU has.
pub(super) fn dot1_impl() -> Dot1Fn {
    #[cfg(target_arch = "x86_64")]
    if cpu_level() >= CpuLevel::Avx2 {
        // SAFETY: the CPU has the features `avx2::dot1` is compiled for; callers pass whole
        // rows.
        return |format, x, w, s, m| unsafe { avx2::dot1(format, x, w, s, m) };
    }
    dot_scalar
}

/// A packed weight's host buffers (contiguous; views of the tensors' memory, not copies).
pub(super) struct HostWeight {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    words: FlexTensor,
    scales: Option<FlexTensor>,
    mins: Option<FlexTensor>,
    layout: RowLayout,
}

impl HostWeight {
    /// `None` when the tensors are not in the packed layout's types and shapes.
    pub(super) fn new(w: &PackedTensor<Flex>) -> Option<Self> {
        let ws = w.words.shape();
        if ws.num_dims() != 2 || !matches!(w.words.dtype(), DType::U32 | DType::I32) {
            return None;
        }
        let (rows, cols) = (ws[0], w.cols);
        if !cols.is_multiple_of(w.ty.block_size()) || ws[1] != row_words(w.ty, cols) {
            return None;
        }
        let blocks = [rows, cols / BLOCK];
        let f32_blocks = |t: &Option<FlexTensor>| match t {
            Some(t) if t.dtype() == DType::F32 && t.shape().dims::<2>() == blocks => {
                Some(Some(t.to_contiguous()))
            }
            Some(_) => None,
            None => Some(None),
        };
        let (scales, mins) = (f32_blocks(&w.scales)?, f32_blocks(&w.mins)?);
        let split_ok = match w.ty {
            GgmlType::Q8_0 | GgmlType::Q4_0 => scales.is_some(),
            GgmlType::Q4_1 => scales.is_some() && mins.is_some(),
            _ => true,
        };
        split_ok.then(|| HostWeight {
            ty: w.ty,
            rows,
            cols,
            words: w.words.to_contiguous(),
            scales,
            mins,
            layout: w.layout,
        })
    }

    pub(super) fn view(&self) -> HostPackedView<'_> {
        let words: &[u32] = match self.words.dtype() {
            DType::U32 => self.words.as_slice::<u32>().expect("contiguous u32"),
            _ => bytemuck::cast_slice(self.words.as_slice::<i32>().expect("contiguous i32")),
        };
        fn f32s(t: &Option<FlexTensor>) -> &[f32] {
            t.as_ref()
                .map(|t| t.as_slice::<f32>().expect("contiguous f32"))
                .unwrap_or(&[])
        }
        HostPackedView {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            words,
            scales: f32s(&self.scales),
            mins: f32s(&self.mins),
            layout: self.layout,
        }
    }
}

/// The operands of a packed matmul, when they are in the layout the native loops need.
pub(super) struct Operands {
    /// Contiguous f32 activations (a view of the caller's buffer, not a copy).
    x: FlexTensor,
    m: usize,
    w: HostWeight,
    repackable: bool,
}

impl Operands {
    pub(super) fn new(x: &FlexTensor, w: &PackedTensor<Flex>) -> Option<Self> {
        let w_repackable = w.repackable;
        let xs = x.shape();
        if x.dtype() != DType::F32 || xs.num_dims() != 2 || xs[1] != w.cols {
            return None;
        }
        let w = HostWeight::new(w)?;
        let x = x.to_contiguous();
        x.as_slice::<f32>()?;
        Some(Operands {
            x,
            m: xs[0],
            w,
            repackable: w_repackable,
        })
    }

    pub(super) fn run(self) -> FlexTensor {
        let x = self.x.as_slice::<f32>().expect("checked in Operands::new");
        let w = self.w.view();
        let repacked_q4_0 =
            w.ty == GgmlType::Q4_0 && blocks::repacked(w.ty, w.rows, self.repackable);
        // A split weight in the X16 layout is read as it lies by the sixteen-row kernels of
        // Q8_0 and of repacked Q4_0; anywhere else (AVX-512 turned off, a Q4_0 weight made a
        // token table) its rows are put back in order first. (Blocks-layout types: per task,
        // in `blocks::matmul`.)
        let plain;
        let x16_read = super::x16_kernels() && (w.ty == GgmlType::Q8_0 || repacked_q4_0);
        let w = match is_split(w.ty) && w.layout != RowLayout::Rows && !x16_read {
            true => {
                plain = crate::packed::deinterleaved_host(&w);
                HostPackedView {
                    words: &plain.0,
                    scales: &plain.1,
                    layout: RowLayout::Rows,
                    ..w
                }
            }
            false => w,
        };
        let out = match w.ty {
            GgmlType::Q8_0 => split_matmul(Format::Q8_0, x, self.m, &w),
            GgmlType::Q4_0 if repacked_q4_0 => q4_0_repacked(x, self.m, &w),
            GgmlType::Q4_0 => split_matmul(Format::Q4_0, x, self.m, &w),
            GgmlType::Q4_1 => split_matmul(Format::Q4_1, x, self.m, &w),
            _ => blocks::matmul(x, self.m, &w, self.repackable),
        };
        FlexTensor::from_data(TensorData::new(out, [self.m, w.rows]))
    }
}

/// `dy[m, n] · dequant(W)[n, k]` (the activations' gradient of a packed matmul): the weight is
/// widened 256 rows at a time, so no f32 copy of all of it exists.
pub(super) fn packed_backward(dy: &[f32], m: usize, w: &HostPackedView<'_>) -> Vec<f32> {
    const ROWS: usize = 256;
    let (n, k) = (w.rows, w.cols);
    let mut dx = vec![0.0f32; m * k];
    for r0 in (0..n).step_by(ROWS) {
        let r1 = (r0 + ROWS).min(n);
        let chunk = dequantize_rows(w, r0..r1);
        // dx += dy[:, r0..r1] · chunk[r1 - r0, k]
        linear::add_product(&mut dx, m, k, r1 - r0, (&dy[r0..], 1, n), (&chunk, 1, k));
    }
    dx
}

/// `x[m, k] · Wᵀ` for a Q8_0/Q4_0/Q4_1 weight in the split layout.
fn split_matmul(format: Format, x: &[f32], m: usize, w: &HostPackedView<'_>) -> Vec<f32> {
    let (k, n) = (w.cols, w.rows);
    let bytes: &[u8] = bytemuck::cast_slice(w.words);
    let (scales, mins) = (w.scales, w.mins);
    #[cfg(target_arch = "x86_64")]
    if vnni::available() {
        let w = vnni::Weights {
            bytes,
            scales,
            mins,
            n,
            x16: w.layout == RowLayout::X16,
        };
        return vnni::matmul(format, x, m, k, w);
    }
    debug_assert_eq!(
        w.layout,
        RowLayout::Rows,
        "put back in order by `Operands::run`"
    );
    let rows: Vec<QuantRow> = x.par_chunks_exact(k).map(quantize_row).collect();
    let row_bytes = bytes.len() / n;
    let blocks = k / BLOCK;
    let dot4 = dot4_impl();
    let dot1 = dot1_impl();
    let tile4x2 = tile4x2_impl();
    let weight = |j: usize| {
        let mn = if mins.is_empty() {
            &[][..]
        } else {
            &mins[j * blocks..(j + 1) * blocks]
        };
        (
            &bytes[j * row_bytes..(j + 1) * row_bytes],
            &scales[j * blocks..(j + 1) * blocks],
            mn,
        )
    };
    // Output column j (weight row j) for every activation row, in parallel over groups of
    // columns (one column is too little work to hand to a thread), four columns per call.
    const COLS: usize = 16;
    let mut out_t = vec![0.0f32; n * m];
    let work = |(g, cols): (usize, &mut [f32])| {
        let ncols = cols.len() / m;
        if m == 1 {
            // Decode: bound by reading the weights, so one row at a time in memory order.
            for (c, out) in cols.iter_mut().enumerate() {
                let (w, s, mn) = weight(g * COLS + c);
                *out = dot1(format, &rows[0], w, s, mn);
            }
            return;
        }
        // Activation rows in blocks, as `blocks::matmul` (reuse from L1).
        for i0 in (0..m).step_by(blocks::ROW_BLOCK) {
            let i1 = (i0 + blocks::ROW_BLOCK).min(m);
            for c0 in (0..ncols).step_by(4) {
                // Past the last column, repeat it (computed, not stored).
                let parts: [_; 4] =
                    std::array::from_fn(|r| weight(g * COLS + (c0 + r).min(ncols - 1)));
                let (w, s, mn) = (parts.map(|p| p.0), parts.map(|p| p.1), parts.map(|p| p.2));
                let mut i = i0;
                // Two activation rows per call where the register tile exists.
                if let Some(tile) = tile4x2 {
                    while i + 2 <= i1 {
                        let y = tile(format, [&rows[i], &rows[i + 1]], w, s, mn);
                        for (di, y) in y.iter().enumerate() {
                            for (r, &v) in y.iter().enumerate().take(ncols - c0) {
                                cols[(c0 + r) * m + i + di] = v;
                            }
                        }
                        i += 2;
                    }
                }
                for (i, row) in rows.iter().enumerate().take(i1).skip(i) {
                    let y = dot4(format, row, w, s, mn);
                    for (r, &v) in y.iter().enumerate().take(ncols - c0) {
                        cols[(c0 + r) * m + i] = v;
                    }
                }
            }
        }
    };
    // Even a decode step's small projections gain from both cores: measured, running them on
    // one thread to save the pool's wake-up made decode 35% slower.
    out_t.par_chunks_mut(m * COLS).enumerate().for_each(work);
    transpose_columns(out_t, m, n)
}

/// Q4_0 as llama.cpp's repacked `q4_0_8x8` kernels compute it (see `blocks::dot_repacked_32`).
fn q4_0_repacked(x: &[f32], m: usize, w: &HostPackedView<'_>) -> Vec<f32> {
    let (k, n) = (w.cols, w.rows);
    // X16 only where its kernels run (`Operands::run` put other weights back in order).
    let x16 = w.layout == RowLayout::X16;
    let bytes: &[u8] = bytemuck::cast_slice(w.words);
    let (nb, row_bytes) = (k / BLOCK, k / 2);
    let rows: Vec<QuantRow> = x.par_chunks_exact(k).map(quantize_row).collect();
    let mut out_t = vec![0.0f32; n * m];
    let fast = cpu_level() >= CpuLevel::Avx2;
    let quants = |j: usize| &bytes[j * row_bytes..(j + 1) * row_bytes];
    let scales = |j: usize| &w.scales[j * nb..(j + 1) * nb];
    // Columns `j0..j0 + 8` (`cols`, `m` values each) for activation rows `i0..`.
    let eight = |j0: usize, i0: usize, cols: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if fast {
            let weights = || blocks32_avx2::Repacked8::Q4_0 {
                quants: std::array::from_fn(|r| quants(j0 + r)),
                scales: std::array::from_fn(|r| scales(j0 + r)),
            };
            // Four activation rows per call (each weight register unpacked once for all
            // four, as llama.cpp's `gemm_q4_0_8x8` does), then the rest one at a time.
            let mut i = i0;
            while i + 4 <= m {
                let x = std::array::from_fn(|a| &rows[i + a]);
                // SAFETY: the CPU has AVX2, FMA and F16C (`cpu_level`).
                let y = unsafe { blocks32_avx2::dot8_repacked_32::<4>(nb, x, weights()) };
                for (a, y) in y.iter().enumerate() {
                    (0..8).for_each(|r| cols[r * m + i + a] = y[r]);
                }
                i += 4;
            }
            for i in i..m {
                // SAFETY: as above.
                let [y] =
                    unsafe { blocks32_avx2::dot8_repacked_32::<1>(nb, [&rows[i]], weights()) };
                (0..8).for_each(|r| cols[r * m + i] = y[r]);
            }
            return;
        }
        for (c, col) in cols.chunks_mut(m).enumerate() {
            let (wq, ws) = (quants(j0 + c), scales(j0 + c));
            for (o, row) in col.iter_mut().zip(&rows).skip(i0) {
                *o = blocks::dot_repacked_32(
                    nb,
                    row,
                    |b, i| weight_quant(Format::Q4_0, &wq[16 * b..], i),
                    |b| ws[b],
                );
            }
        }
    };
    // Groups of eight columns, as llama.cpp's 8x8 kernels (the repacked layout needs n % 8 ==
    // 0); sixteen in the X16 layout, each output in a 32-bit lane of its own
    // (`blocks_vnni::gemm_q4_0_x16`).
    let width = if x16 { 16 } else { 8 };
    #[cfg(target_arch = "x86_64")]
    let x16_rows: Vec<blocks_vnni::Q40Row> = match x16 {
        true => rows.iter().map(blocks_vnni::Q40Row::new).collect(),
        false => Vec::new(),
    };
    out_t
        .par_chunks_mut(width * m)
        .enumerate()
        .for_each(|(g, cols)| {
            #[cfg(target_arch = "x86_64")]
            if x16 {
                let qs = &bytes[16 * g * row_bytes..16 * (g + 1) * row_bytes];
                let d = &w.scales[16 * g * nb..16 * (g + 1) * nb];
                let mut put =
                    |i: usize, y: &[f32; 16]| (0..16).for_each(|r| cols[r * m + i] = y[r]);
                let mut i = 0;
                // SAFETY (each call): the CPU has AVX-512 F/BW/VL/VNNI (an X16 weight reaches
                // here only then: `Operands::run`).
                while i + 4 <= m {
                    let x = std::array::from_fn(|a| &x16_rows[i + a]);
                    let y = unsafe { blocks_vnni::gemm_q4_0_x16::<4>(qs, d, x) };
                    y.iter().enumerate().for_each(|(a, y)| put(i + a, y));
                    i += 4;
                }
                for (i, row) in x16_rows.iter().enumerate().skip(i) {
                    put(
                        i,
                        &unsafe { blocks_vnni::gemm_q4_0_x16::<1>(qs, d, [row]) }[0],
                    );
                }
                return;
            }
            eight(width * g, 0, cols);
        });
    transpose_columns(out_t, m, n)
}

/// `out_t[n][m]` (one output column per weight row) as the row-major `[m, n]` output.
pub(super) fn transpose_columns(out_t: Vec<f32>, m: usize, n: usize) -> Vec<f32> {
    if m == 1 {
        return out_t;
    }
    // Sixteen output rows per task: for each column, sixteen neighbouring values of `out_t`
    // (one cache line) go to sixteen row streams. In parallel: run on one thread, this copy
    // kept the other one idle for 4% of a prefill.
    const ROWS: usize = 16;
    let mut out = vec![0.0f32; m * n];
    out.par_chunks_mut(ROWS * n)
        .enumerate()
        .for_each(|(t, block)| {
            let i0 = t * ROWS;
            let rows = block.len() / n;
            for j in 0..n {
                let src = &out_t[j * m + i0..j * m + i0 + rows];
                for (r, &v) in src.iter().enumerate() {
                    block[r * n + j] = v;
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform values in [0, 1] from a fixed seed (a 64-bit LCG's high bits).
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32 as f32 / u32::MAX as f32
        }
    }

    /// The SIMD path must give the scalar specification's bits exactly.
    #[test]
    fn simd_dot_is_bit_identical_to_scalar() {
        let mut next = uniform(1);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            for blocks in [1usize, 3, 18, 48] {
                let k = blocks * BLOCK;
                let x: Vec<f32> = (0..k).map(|_| next() * 4.0 - 2.0).collect();
                let row = quantize_row(&x);
                let w: Vec<u8> = (0..blocks * format.block_bytes())
                    .map(|_| (next() * 256.0) as u8)
                    .collect();
                let s: Vec<f32> = (0..blocks).map(|_| next() * 0.1).collect();
                let mn: Vec<f32> = (0..blocks).map(|_| next() - 0.5).collect();
                let want = dot_scalar(format, &row, &w, &s, &mn);
                let got = dot4_impl()(format, &row, [&w; 4], [&s; 4], [&mn; 4]);
                assert!(
                    got.iter().all(|g| g.to_bits() == want.to_bits()),
                    "{got:?} vs {want}"
                );
                let one = dot1_impl()(format, &row, &w, &s, &mn);
                assert_eq!(one.to_bits(), want.to_bits(), "{one} vs {want}");
            }
        }
    }

    /// The blocked parallel transpose is the plain one.
    #[test]
    fn transpose_columns_is_a_transpose() {
        for (m, n) in [(1usize, 7usize), (2, 3), (16, 5), (37, 9), (100, 33)] {
            let out_t: Vec<f32> = (0..m * n).map(|v| v as f32).collect();
            let got = transpose_columns(out_t.clone(), m, n);
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(got[i * n + j], out_t[j * m + i], "m {m} n {n} ({i}, {j})");
                }
            }
        }
    }

    /// The 4 × 2 register tile gives every output the specification's bits.
    #[test]
    fn tile_4x2_is_bit_identical_to_scalar() {
        let Some(tile) = tile4x2_impl() else {
            return;
        };
        let mut next = uniform(3);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            for blocks in [1usize, 3, 18, 48] {
                let k = blocks * BLOCK;
                let acts: Vec<QuantRow> = (0..2)
                    .map(|_| quantize_row(&(0..k).map(|_| next() * 4.0 - 2.0).collect::<Vec<_>>()))
                    .collect();
                let w: Vec<Vec<u8>> = (0..4)
                    .map(|_| {
                        (0..blocks * format.block_bytes())
                            .map(|_| (next() * 256.0) as u8)
                            .collect()
                    })
                    .collect();
                let s: Vec<Vec<f32>> = (0..4)
                    .map(|_| (0..blocks).map(|_| next() * 0.1).collect())
                    .collect();
                let mn: Vec<Vec<f32>> = (0..4)
                    .map(|_| (0..blocks).map(|_| next() - 0.5).collect())
                    .collect();
                let got = tile(
                    format,
                    [&acts[0], &acts[1]],
                    std::array::from_fn(|r| w[r].as_slice()),
                    std::array::from_fn(|r| s[r].as_slice()),
                    std::array::from_fn(|r| mn[r].as_slice()),
                );
                for i in 0..2 {
                    for r in 0..4 {
                        let want = dot_scalar(format, &acts[i], &w[r], &s[r], &mn[r]);
                        assert_eq!(got[i][r].to_bits(), want.to_bits(), "row {i} × {r}");
                    }
                }
            }
        }
    }

    /// Q4_0's eight-row repacked kernel gives each output the specification's bits, for one
    /// activation row (decode) and four at once (prefill).
    #[test]
    fn repacked_q4_0_eight_rows_match_the_spec() {
        if cpu_level() < CpuLevel::Avx2 {
            return;
        }
        let mut next = uniform(7);
        for nb in [1usize, 18, 64, 65, 200] {
            let k = nb * BLOCK;
            let rows: Vec<QuantRow> = (0..4)
                .map(|_| quantize_row(&(0..k).map(|_| next() * 4.0 - 2.0).collect::<Vec<_>>()))
                .collect();
            let w: Vec<u8> = (0..8 * nb * 16).map(|_| (next() * 256.0) as u8).collect();
            let s: Vec<f32> = (0..8 * nb).map(|_| next() * 0.1).collect();
            let weights = || blocks32_avx2::Repacked8::Q4_0 {
                quants: std::array::from_fn(|r| &w[r * nb * 16..(r + 1) * nb * 16]),
                scales: std::array::from_fn(|r| &s[r * nb..(r + 1) * nb]),
            };
            // SAFETY: the CPU has AVX2 (checked above).
            let four = unsafe {
                blocks32_avx2::dot8_repacked_32::<4>(
                    nb,
                    std::array::from_fn(|a| &rows[a]),
                    weights(),
                )
            };
            for (a, row) in rows.iter().enumerate() {
                // SAFETY: as above.
                let [one] = unsafe { blocks32_avx2::dot8_repacked_32::<1>(nb, [row], weights()) };
                for r in 0..8 {
                    let want = blocks::dot_repacked_32(
                        nb,
                        row,
                        |b, i| weight_quant(Format::Q4_0, &w[(r * nb + b) * 16..], i),
                        |b| s[r * nb + b],
                    );
                    assert_eq!(one[r].to_bits(), want.to_bits(), "row {r}, {nb} blocks");
                    assert_eq!(
                        four[a][r].to_bits(),
                        want.to_bits(),
                        "row {r}, act {a}, {nb} blocks"
                    );
                }
            }
        }
    }

    /// Q4_0's sixteen-row kernel (AVX-512 VNNI) on the X16 layout gives each output the
    /// specification's bits, four activation rows at a time (prefill) or one (decode).
    #[test]
    fn repacked_q4_0_sixteen_rows_match_the_spec() {
        if cpu_level() < CpuLevel::Avx512 {
            return;
        }
        let mut next = uniform(11);
        for nb in [1usize, 18, 65] {
            let k = nb * BLOCK;
            let rows: Vec<QuantRow> = (0..4)
                .map(|_| quantize_row(&(0..k).map(|_| next() * 4.0 - 2.0).collect::<Vec<_>>()))
                .collect();
            let w: Vec<u8> = (0..16 * nb * 16).map(|_| (next() * 256.0) as u8).collect();
            let s: Vec<f32> = (0..16 * nb).map(|_| next() * 0.1).collect();
            let words: Vec<u32> = bytemuck::pod_collect_to_vec(&w);
            let qs = crate::packed::interleave_x16(&words, 16, nb, 4);
            let qs: &[u8] = bytemuck::cast_slice(&qs);
            let d = crate::packed::interleave_x16(&s, 16, nb, 1);
            let acts: Vec<blocks_vnni::Q40Row> =
                rows.iter().map(blocks_vnni::Q40Row::new).collect();
            // SAFETY: the CPU has AVX-512 F/BW/VL/VNNI (checked above).
            let got = unsafe {
                blocks_vnni::gemm_q4_0_x16::<4>(qs, &d, std::array::from_fn(|a| &acts[a]))
            };
            for (a, act) in acts.iter().enumerate() {
                // SAFETY: as above.
                let one = unsafe { blocks_vnni::gemm_q4_0_x16::<1>(qs, &d, [act]) };
                assert_eq!(one[0].map(f32::to_bits), got[a].map(f32::to_bits));
            }
            for (a, row) in rows.iter().enumerate() {
                for r in 0..16 {
                    let want = blocks::dot_repacked_32(
                        nb,
                        row,
                        |b, i| weight_quant(Format::Q4_0, &w[(r * nb + b) * 16..], i),
                        |b| s[r * nb + b],
                    );
                    assert_eq!(
                        got[a][r].to_bits(),
                        want.to_bits(),
                        "row {r}, act {a}, {nb} blocks"
                    );
                }
            }
        }
    }
}
