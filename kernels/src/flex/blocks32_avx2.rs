//! AVX2 dot products of the 32-value block formats that pair with Q8_0/Q8_1 activations —
//! Q5_0, Q5_1, IQ4_NL — and the eight-row kernels over the repacked (8×8) Q4_0 and IQ4_NL layout
//! (llama.cpp's `gemv_*_8x8`). The same bits as the scalar specifications in `blocks.rs` and
//! `qmatmul.rs`; the exactness argument is the one at the top of `blocks_avx2.rs`.
//!
//! Callers must have checked that `cpu_level()` is at least AVX2 (which includes FMA and F16C).

use std::arch::x86_64::*;

use super::blocks_avx2::{
    f16c_at, hsum_float_8, hsum_i32_4, hsum_i32_8, iq4_values, load_q8, load128, load256,
    signed_lanes,
};
use super::qmatmul::QuantRow;
use crate::packed::BLOCK;
use toy_quant::IQ4_GRID;

/// 32 Q5_0/Q5_1 values of a block (nibbles with their fifth bit from `qh`), unsigned 0..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_values(qs: &[u8], qh: u32) -> __m256i {
    let bits = load128(qs);
    let m4 = _mm256_set1_epi8(0x0F);
    let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bits, 4), bits), m4);
    // Byte j gets bit j of qh (ggml's bytes_from_bits_32), as 0x10.
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1));
    _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// `ggml_vec_dot_q5_0_q8_0`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_0(w: &[u8], x: &QuantRow) -> f32 {
    dot_q5_rows::<false, 1>([w], x)[0]
}

/// `ggml_vec_dot_q5_1_q8_1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_1(w: &[u8], x: &QuantRow) -> f32 {
    dot_q5_rows::<true, 1>([w], x)[0]
}

/// `dot_q5_0` for four activation rows against one weight row: each block's weights are
/// unpacked once for the four (as llamafile's tinyBLAS shares them across its register tile),
/// and each output gets `dot_q5_0`'s operations, so its bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_0_rows4(w: &[u8], x: [&QuantRow; 4]) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let sixteen = _mm256_set1_epi8(16);
    for (i, b) in w.chunks_exact(22).enumerate() {
        let dw = f16c_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let q = _mm256_sub_epi8(q5_values(&b[6..22], qh), sixteen);
        let aq = _mm256_sign_epi8(q, q);
        for r in 0..4 {
            let d = dw * x[r].scales[i];
            let y = load_q8(&x[r].quants[BLOCK * i..]);
            let p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(y, q));
            let p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_float_8(acc[r]))
}

/// `dot_q5_0`/`dot_q5_1` for `R` weight rows against one activation row: `R` chains of FMAs in
/// flight, the activation block loaded once for all (R = 2: decode on AVX2 CPUs); each row gets
/// the one-row kernel's operations, so its bits.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn dot_q5_rows<const Q5_1: bool, const R: usize>(
    w: [&[u8]; R],
    x: &QuantRow,
) -> [f32; R] {
    let size = if Q5_1 { 24 } else { 22 };
    let nb = w[0].len() / size;
    assert!(w.iter().all(|w| w.len() >= nb * size));
    assert!(x.quants.len() >= nb * BLOCK && x.scales.len() >= nb);
    assert!(!Q5_1 || x.sums.len() >= nb);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    let sixteen = _mm256_set1_epi8(16);
    for i in 0..nb {
        let y = load_q8(&x.quants[BLOCK * i..]);
        for j in 0..R {
            let b = &w[j][size * i..size * (i + 1)];
            if Q5_1 {
                let (dx, m) = (f16c_at(b, 0), f16c_at(b, 2));
                summs[j] = m.mul_add(x.sums[i], summs[j]);
                let q = q5_values(&b[8..24], u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), _mm256_set1_epi16(1));
                let d = _mm256_set1_ps(dx * x.scales[i]);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[j]);
            } else {
                let d = f16c_at(b, 0) * x.scales[i];
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let q = _mm256_sub_epi8(q5_values(&b[6..22], qh), sixteen);
                let p = signed_lanes(q, y);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc[j]);
            }
        }
    }
    // (Q5_0 adds nothing after the sum: `+ 0.0` would turn a −0.0 into +0.0.)
    std::array::from_fn(|j| match Q5_1 {
        true => hsum_float_8(acc[j]) + summs[j],
        false => hsum_float_8(acc[j]),
    })
}

/// [`q5_values`] with AVX-512 BW: `qh`'s 32 bits are a byte mask, so the fifth bits are one
/// masked add (five instructions fewer than AVX2's shuffle, compare and blend).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn q5_values_512(qs: &[u8], qh: u32) -> __m256i {
    let bits = load128(qs);
    let m4 = _mm256_set1_epi8(0x0F);
    let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bits, 4), bits), m4);
    _mm256_mask_add_epi8(nib, qh, nib, _mm256_set1_epi8(0x10))
}

/// `dot_q5_0`/`dot_q5_1` for two weight rows against `R` activation rows on CPUs with AVX-512
/// VNNI (`vpdpbusd` on 256-bit registers): `2·R` accumulators in flight, and one instruction for
/// each block's integer dot. Decode takes `R = 1` (two independent chains of additions where
/// `dot_q5_0` has one), prefill `R = 4` (each block's weights unpacked once for four rows).
/// Each i32 lane is still the exact sum of its four products, so every output has `dot_q5_0`'s
/// (`dot_q5_1`'s) bits. Q5_0's signed weights (`q − 16`) are fed unsigned: the lane is
/// `Σ q·y − Σ 16·y`, the second sum computed once per activation block and passed as the
/// accumulator `vpdpbusd` starts from.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn dot2_q5_vnni<const Q5_1: bool, const R: usize>(
    w: [&[u8]; 2],
    x: [&QuantRow; R],
) -> [[f32; R]; 2] {
    let size = if Q5_1 { 24 } else { 22 };
    let nb = w[0].len() / size;
    assert!(w[1].len() >= nb * size && x.iter().all(|x| x.quants.len() >= nb * BLOCK));
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut summs = [[0.0f32; R]; 2];
    let sixteen = _mm256_set1_epi8(16);
    for i in 0..nb {
        let b = [
            &w[0][size * i..size * (i + 1)],
            &w[1][size * i..size * (i + 1)],
        ];
        // No closures here: they would not be inlined into this target-feature function.
        let at = if Q5_1 { 4 } else { 2 };
        let qh0 = u32::from_le_bytes([b[0][at], b[0][at + 1], b[0][at + 2], b[0][at + 3]]);
        let qh1 = u32::from_le_bytes([b[1][at], b[1][at + 1], b[1][at + 2], b[1][at + 3]]);
        let q = [
            q5_values_512(&b[0][at + 4..at + 20], qh0),
            q5_values_512(&b[1][at + 4..at + 20], qh1),
        ];
        let dw = [f16c_at(b[0], 0), f16c_at(b[1], 0)];
        for r in 0..R {
            let y = load_q8(&x[r].quants[BLOCK * i..]);
            let start = if Q5_1 {
                _mm256_setzero_si256()
            } else {
                _mm256_sub_epi32(
                    _mm256_setzero_si256(),
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), sixteen, y),
                )
            };
            for j in 0..2 {
                let p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, q[j], y));
                if Q5_1 {
                    summs[j][r] = f16c_at(b[j], 2).mul_add(x[r].sums[i], summs[j][r]);
                    let d = _mm256_set1_ps(dw[j] * x[r].scales[i]);
                    acc[j][r] = _mm256_fmadd_ps(p, d, acc[j][r]);
                } else {
                    let d = _mm256_set1_ps(dw[j] * x[r].scales[i]);
                    acc[j][r] = _mm256_fmadd_ps(d, p, acc[j][r]);
                }
            }
        }
    }
    let mut out = [[0.0f32; R]; 2];
    for j in 0..2 {
        for r in 0..R {
            out[j][r] = hsum_float_8(acc[j][r]);
            if Q5_1 {
                out[j][r] += summs[j][r];
            }
        }
    }
    out
}

/// `dot_q5_1` for four activation rows (as `dot_q5_0_rows4`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_1_rows4(w: &[u8], x: [&QuantRow; 4]) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0.0f32; 4];
    for (i, b) in w.chunks_exact(24).enumerate() {
        let (dx, m) = (f16c_at(b, 0), f16c_at(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let q = q5_values(&b[8..24], qh);
        for r in 0..4 {
            summs[r] = m.mul_add(x[r].sums[i], summs[r]);
            let p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q, load_q8(&x[r].quants[BLOCK * i..])),
                _mm256_set1_epi16(1),
            );
            let d = _mm256_set1_ps(dx * x[r].scales[i]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_float_8(acc[r]) + summs[r])
}

/// IQ4_NL's tinyBLAS form (`dot_iq4_nl(.., true)`) for four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq4_nl_tinyblas_rows4(w: &[u8], x: [&QuantRow; 4]) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    for (i, b) in w.chunks_exact(18).enumerate() {
        let dw = f16c_at(b, 0);
        let v = iq4_values(&b[2..18]);
        let av = _mm256_sign_epi8(v, v);
        for r in 0..4 {
            let d = x[r].scales[i] * dw;
            let y = load_q8(&x[r].quants[BLOCK * i..]);
            let p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(y, v));
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_float_8(acc[r]))
}

/// IQ4_NL (see `blocks::dot_iq4_nl`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq4_nl(w: &[u8], x: &QuantRow, tinyblas: bool) -> f32 {
    let nb = w.len() / 18;
    let block = |i: usize| -> (f32, __m256) {
        let b = &w[18 * i..18 * i + 18];
        let d = x.scales[i] * f16c_at(b, 0);
        (
            d,
            _mm256_cvtepi32_ps(signed_lanes(
                iq4_values(&b[2..18]),
                load_q8(&x.quants[BLOCK * i..]),
            )),
        )
    };
    if tinyblas {
        let mut acc = _mm256_setzero_ps();
        for i in 0..nb {
            let (d, p) = block(i);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
        }
        return hsum_float_8(acc);
    }
    let mut acc = [_mm256_setzero_ps(); 2];
    let pairs = nb / 2 * 2;
    for i in 0..pairs {
        let (d, p) = block(i);
        acc[i % 2] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[i % 2]);
    }
    let mut sumf = hsum_float_8(_mm256_add_ps(acc[0], acc[1]));
    if pairs < nb {
        let b = &w[18 * pairs..18 * pairs + 18];
        let d = x.scales[pairs] * f16c_at(b, 0);
        let isum = hsum_i32_8(signed_lanes(
            iq4_values(&b[2..18]),
            load_q8(&x.quants[BLOCK * pairs..]),
        ));
        sumf = d.mul_add(isum as f32, sumf);
    }
    sumf
}

/// One output of IQ4_NL's repacked kernels (`blocks::dot_repacked_32` for a row of 18-byte
/// blocks): each block's exact sum, then one fused multiply-add by `d_w · d_x`. The block
/// accessors are written here, inside the `target_feature` function, so that they inline.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq4_nl_repacked(w: &[u8], x: &QuantRow) -> f32 {
    let nb = w.len() / 18;
    let mut acc = 0.0f32;
    for i in 0..nb {
        let values = iq4_values(&w[18 * i + 2..]);
        let isum = hsum_i32_8(signed_lanes(values, load_q8(&x.quants[BLOCK * i..])));
        acc = (isum as f32).mul_add(f16c_at(w, 18 * i) * x.scales[i], acc);
    }
    acc
}

/// Eight weight rows of a type llama.cpp repacks into its 8x8 layout, for `dot8_repacked_32`.
pub(super) enum Repacked8<'a> {
    /// Q4_0 in the split layout: 16 bytes of nibbles per block, the f32 scales apart.
    Q4_0 {
        quants: [&'a [u8]; 8],
        scales: [&'a [f32]; 8],
    },
    /// IQ4_NL blocks: an f16 scale, then 16 bytes of grid indices.
    Iq4Nl([&'a [u8]; 8]),
}

/// Eight outputs of `dot_repacked_32` — weight rows `0..8` — for each of `A` activation rows, as
/// llama.cpp's `gemv_q4_0_8x8` / `gemv_iq4_nl_8x8` (one row) and `gemm_*_8x8` (four rows)
/// compute them: each row's exact block sums, then one 8-wide fused multiply-add per block for
/// all eight rows (the same bits per output as eight `dot_repacked_32` calls, whatever `A` is).
/// The integer work runs on two blocks per 256-bit vector (the low nibbles of blocks `b` and
/// `b + 1` in one register, against the activations rearranged once per call to match), so the
/// eight rows' block sums of a pair of blocks come out of one `hadd` tree; Q4_0's nibbles multiply
/// unsigned and `8 · Σx` is subtracted from each block sum (exact in i32) instead of re-signing
/// every weight. With `A = 4` (prefill) each weight register is unpacked once for four
/// activation rows. The rows are read one after another, each in memory order, a chunk of blocks
/// at a time: interleaving eight short rows defeats the hardware prefetcher. (The closures are
/// written here, inside the `target_feature` function, so that the SIMD helpers they call are
/// inlined.)
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot8_repacked_32<const A: usize>(
    nb: usize,
    x: [&QuantRow; A],
    w: Repacked8<'_>,
) -> [[f32; 8]; A] {
    for x in &x {
        assert!(x.quants.len() >= BLOCK * nb && x.scales.len() >= nb);
    }
    match w {
        Repacked8::Q4_0 { quants, scales } => {
            for r in 0..8 {
                assert!(quants[r].len() >= 16 * nb && scales[r].len() >= nb);
            }
            dot8_pairs::<false, A>(
                nb,
                x,
                |r, b, both| {
                    if both {
                        load256(&quants[r][16 * b..])
                    } else {
                        _mm256_set_m128i(_mm_setzero_si128(), load128(&quants[r][16 * b..]))
                    }
                },
                |b| {
                    _mm256_setr_ps(
                        scales[0][b],
                        scales[1][b],
                        scales[2][b],
                        scales[3][b],
                        scales[4][b],
                        scales[5][b],
                        scales[6][b],
                        scales[7][b],
                    )
                },
            )
        }
        Repacked8::Iq4Nl(blocks) => {
            for row in &blocks {
                assert!(row.len() >= 18 * nb);
            }
            let half =
                |r: usize, b: usize| i16::from_le_bytes([blocks[r][18 * b], blocks[r][18 * b + 1]]);
            dot8_pairs::<true, A>(
                nb,
                x,
                |r, b, both| {
                    let lo = load128(&blocks[r][18 * b + 2..]);
                    let hi = if both {
                        load128(&blocks[r][18 * b + 20..])
                    } else {
                        _mm_setzero_si128()
                    };
                    _mm256_set_m128i(hi, lo)
                },
                |b| {
                    _mm256_cvtph_ps(_mm_setr_epi16(
                        half(0, b),
                        half(1, b),
                        half(2, b),
                        half(3, b),
                        half(4, b),
                        half(5, b),
                        half(6, b),
                        half(7, b),
                    ))
                },
            )
        }
    }
}

/// The kernel of `dot8_repacked_32`. `nibbles(r, b, both)`: row `r`'s 16 bytes of nibbles of
/// block `b` in the low 128 bits and, when `both`, block `b + 1`'s in the high ones (zeros
/// otherwise); `dw(b)`: the eight rows' scales of block `b`. `IQ4`: the nibbles index IQ4_NL's
/// grid; otherwise they are Q4_0's `q` with value `q − 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot8_pairs<const IQ4: bool, const A: usize>(
    nb: usize,
    x: [&QuantRow; A],
    nibbles: impl Fn(usize, usize, bool) -> __m256i,
    dw: impl Fn(usize) -> __m256,
) -> [[f32; 8]; A] {
    // Blocks per chunk (even): 16 pairs of per-row lanes, 4 KiB of scratch per activation row.
    const CHUNK: usize = 32;
    const PAIRS: usize = CHUNK / 2;
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: IQ4_GRID holds 16 bytes.
    let grid = _mm256_broadcastsi128_si256(unsafe {
        _mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i)
    });
    let mut acc = [_mm256_setzero_ps(); A];
    // Per activation row and pair of the chunk, each weight row's eight i32 partial sums (four
    // per block). Left uninitialized: zeroing the scratch per call was a third of the kernel's
    // time.
    let mut lanes = [[[std::mem::MaybeUninit::<__m256i>::uninit(); 8]; PAIRS]; A];
    // Per activation row and pair, the activations matching the nibble registers: values 0..16
    // of both blocks, then values 16..32 of both.
    let mut xs = [[(_mm256_setzero_si256(), _mm256_setzero_si256()); PAIRS]; A];
    let mut sum_x = [[0i32; CHUNK]; A];
    for b0 in (0..nb).step_by(CHUNK) {
        let b1 = (b0 + CHUNK).min(nb);
        let pairs = (b1 - b0).div_ceil(2);
        for a in 0..A {
            for p in 0..pairs {
                let b = b0 + 2 * p;
                let xb = load_q8(&x[a].quants[BLOCK * b..]);
                let xn = if b + 1 < b1 {
                    load_q8(&x[a].quants[BLOCK * (b + 1)..])
                } else {
                    _mm256_setzero_si256()
                };
                let pair = (
                    _mm256_permute2x128_si256(xb, xn, 0x20),
                    _mm256_permute2x128_si256(xb, xn, 0x31),
                );
                xs[a][p] = pair;
                if !IQ4 {
                    let s = _mm256_madd_epi16(
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(_mm256_set1_epi8(1), pair.0),
                            _mm256_maddubs_epi16(_mm256_set1_epi8(1), pair.1),
                        ),
                        ones,
                    );
                    sum_x[a][2 * p] = hsum_i32_4(_mm256_castsi256_si128(s));
                    sum_x[a][2 * p + 1] = hsum_i32_4(_mm256_extracti128_si256(s, 1));
                }
            }
        }
        for r in 0..8 {
            for p in 0..pairs {
                let b = b0 + 2 * p;
                let bits = nibbles(r, b, b + 1 < b1);
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                if IQ4 {
                    let (vlo, vhi) = (_mm256_shuffle_epi8(grid, lo), _mm256_shuffle_epi8(grid, hi));
                    let (alo, ahi) = (_mm256_sign_epi8(vlo, vlo), _mm256_sign_epi8(vhi, vhi));
                    for a in 0..A {
                        let (xlo, xhi) = xs[a][p];
                        // |v| · (x with v's sign): each i16 pair sum fits (≤ 2 · 127 · 127).
                        let v = _mm256_add_epi32(
                            _mm256_madd_epi16(
                                _mm256_maddubs_epi16(alo, _mm256_sign_epi8(xlo, vlo)),
                                ones,
                            ),
                            _mm256_madd_epi16(
                                _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xhi, vhi)),
                                ones,
                            ),
                        );
                        lanes[a][p][r].write(v);
                    }
                } else {
                    for a in 0..A {
                        let (xlo, xhi) = xs[a][p];
                        // q ≤ 15, |x| ≤ 127: both i16 sums together stay ≤ 4 · 15 · 127.
                        let v = _mm256_madd_epi16(
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, xlo),
                                _mm256_maddubs_epi16(hi, xhi),
                            ),
                            ones,
                        );
                        lanes[a][p][r].write(v);
                    }
                }
            }
        }
        for p in 0..pairs {
            // Per activation row and 128-bit half (block b, then b + 1): the sums of weight
            // rows 0–3, then rows 4–7.
            let sums: [[__m256i; 2]; A] = std::array::from_fn(|a| {
                // SAFETY: the loop above wrote all eight rows of pairs 0..pairs.
                let v: [__m256i; 8] =
                    std::array::from_fn(|r| unsafe { lanes[a][p][r].assume_init() });
                let h0123 =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                let h4567 =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
                [
                    _mm256_permute2x128_si256(h0123, h4567, 0x20),
                    _mm256_permute2x128_si256(h0123, h4567, 0x31),
                ]
            });
            for h in 0..2 {
                let b = b0 + 2 * p + h;
                if b >= b1 {
                    break;
                }
                let dwb = dw(b);
                for a in 0..A {
                    let isum = if IQ4 {
                        sums[a][h]
                    } else {
                        _mm256_sub_epi32(sums[a][h], _mm256_set1_epi32(8 * sum_x[a][2 * p + h]))
                    };
                    let d = _mm256_mul_ps(dwb, _mm256_set1_ps(x[a].scales[b]));
                    acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[a]);
                }
            }
        }
    }
    let mut out = [[0.0f32; 8]; A];
    for a in 0..A {
        // SAFETY: 8 f32 = 32 bytes.
        unsafe { _mm256_storeu_ps(out[a].as_mut_ptr(), acc[a]) };
    }
    out
}
