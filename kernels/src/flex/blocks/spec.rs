//! The specification of every blocks-layout dot product: scalar, in ggml's order of operations,
//! one function per type and llama.cpp code path (see the parent module's docs for the paths).
//! The SIMD kernels (`blocks_avx2.rs`, `blocks32_avx2.rs`) are tested bit for bit against these.

// The block functions index several arrays with one counter, as ggml's C does; keeping that
// shape makes them easy to check against quants.c.
#![allow(clippy::needless_range_loop)]

use half::f16;
use toy_quant::IQ4_GRID;

use super::super::GgmlIsa;
use super::super::qmatmul::QuantRow;
use super::super::reduce::{hsum8, reduce_add16, reduce_f32x8};
use crate::packed::{BLOCK, GgmlType, QK_K};

#[inline(always)]
pub(in crate::flex) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// ggml's `block_q8_K`: a 256-value activation super-block, `x ≈ d · qs`, with the sums of each
/// 16 quants (which the K-quants' offsets multiply).
pub(in crate::flex) struct Q8K {
    pub(in crate::flex) d: f32,
    pub(in crate::flex) qs: [i8; QK_K],
    pub(in crate::flex) bsums: [i16; 16],
}

/// ggml's `quantize_row_q8_K_ref` (what x86 runs): `iscale = -127 / max` with `max` the first
/// value of largest magnitude, `q = min(127, round_half_even(iscale · x))`, `d = 1 / iscale`.
/// `positive_max`: the rule of the AVX2 `ggml_quantize_mat_q8_K_4x8` that the repacked 4-row
/// kernels read — when `+amax` and `-amax` both occur, the positive one sets the sign.
pub(in crate::flex) fn quantize_q8_k(x: &[f32], positive_max: bool) -> Vec<Q8K> {
    quantize_q8_k_fast(x, positive_max)
}

// Compiled for AVX2 too, where the rounding is one instruction instead of a libm call.
with_fma!(fn quantize_q8_k_fast = quantize_q8_k_impl(x: &[f32], positive_max: bool) -> Vec<Q8K>);

// A loop, not `map` with a closure: a closure is compiled with the features of the function that
// defines it, not of `quantize_q8_k_fast` that inlines this one, so its rounding was a libm
// `rintf` call per value (4% of a 1B-shaped Q4_K_M prefill).
#[inline(always)]
pub(super) fn quantize_q8_k_impl(x: &[f32], positive_max: bool) -> Vec<Q8K> {
    let mut blocks = Vec::with_capacity(x.len() / QK_K);
    for x in x.chunks_exact(QK_K) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut out = Q8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; 16],
        };
        if amax != 0.0 {
            if positive_max && x.contains(&amax) {
                max = amax;
            }
            let iscale = -127.0 / max;
            for (q, &v) in out.qs.iter_mut().zip(x) {
                *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            for (s, q) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
                let mut sum = 0i16;
                for &q in q {
                    sum += q as i16;
                }
                *s = sum;
            }
            out.d = 1.0 / iscale;
        }
        blocks.push(out);
    }
    blocks
}

/// The six-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks (`get_scale_min_k4`).
pub(in crate::flex) fn scales_k4(s: &[u8]) -> ([i32; 8], [i32; 8]) {
    let mut sc = [0; 8];
    let mut mn = [0; 8];
    for j in 0..8 {
        let (a, b) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        };
        sc[j] = a as i32;
        mn[j] = b as i32;
    }
    (sc, mn)
}

/// Q3_K's 16 six-bit scales minus 32.
pub(in crate::flex) fn scales_q3_k(s: &[u8]) -> [i32; 16] {
    std::array::from_fn(|k| {
        let low = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

/// The sums of each 32 activation quants: pairs of Q8_K's 16-value sums (`_mm_hadd_epi16`).
pub(super) fn q8_sums32(y: &Q8K) -> [i32; 8] {
    std::array::from_fn(|k| y.bsums[2 * k] as i32 + y.bsums[2 * k + 1] as i32)
}

/// The lane of ggml's 8-lane integer accumulators that value `e` of a block goes to.
#[inline(always)]
pub(super) fn lane(e: usize) -> usize {
    (e % 32) / 4
}

/// Unsigned 4-bit quant `e` (0..256) of a Q4_K/Q5_K super-block's `qs`: low nibbles of 32 bytes
/// for the first 32 values of each 64, high nibbles for the next 32.
#[inline(always)]
pub(super) fn nibble_k(qs: &[u8], e: usize) -> i32 {
    let byte = qs[32 * (e / 64) + e % 32];
    (if e % 64 < 32 { byte & 0x0F } else { byte >> 4 }) as i32
}

/// Two-bit field of value `e` of a Q2_K/Q3_K super-block's `qs` (each 128 values share 32
/// bytes, four shifts of 2 bits).
#[inline(always)]
pub(super) fn crumb(qs: &[u8], e: usize) -> i32 {
    ((qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3) as i32
}

/// ggml's `ggml_vec_dot_q2_K_q8_K` (AVX2).
pub(super) fn dot_q2_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, y) in w.chunks_exact(84).zip(x) {
        let (sc, qs) = (&b[0..16], &b[16..80]);
        let d = y.d * f16_at(b, 80);
        let dmin = -y.d * f16_at(b, 82);
        for l in 0..8 {
            let prod = (sc[2 * l] >> 4) as i32 * y.bsums[2 * l] as i32
                + (sc[2 * l + 1] >> 4) as i32 * y.bsums[2 * l + 1] as i32;
            acc[l] = dmin.mul_add(prod as f32, acc[l]);
        }
        let mut sumi = [0i32; 8];
        for e in 0..QK_K {
            sumi[lane(e)] += (sc[e / 16] & 0x0F) as i32 * crumb(qs, e) * y.qs[e] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// ggml's `ggml_vec_dot_q3_K_q8_K` (AVX2).
pub(super) fn dot_q3_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, y) in w.chunks_exact(110).zip(x) {
        let (hmask, qs, sc) = (&b[0..32], &b[32..96], scales_q3_k(&b[96..108]));
        let d = y.d * f16_at(b, 108);
        let mut sumi = [0i32; 8];
        for e in 0..QK_K {
            // A clear high bit means -4.
            let high = (hmask[e % 32] >> (e / 32)) & 1;
            let q = crumb(qs, e) - if high == 0 { 4 } else { 0 };
            sumi[lane(e)] += sc[e / 16] * q * y.qs[e] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// Σ scale · q · q8 over a Q4_K super-block's values `range`, with `q` from `quant(e)`.
#[inline(always)]
pub(super) fn q4k_isum(
    sc: &[i32; 8],
    y: &Q8K,
    range: std::ops::Range<usize>,
    quant: impl Fn(usize) -> i32,
) -> i32 {
    range.map(|e| sc[e / 32] * quant(e) * y.qs[e] as i32).sum()
}

/// ggml's `ggml_vec_dot_q4_K_q8_K` (AVX2).
pub(super) fn dot_q4_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    for (b, y) in w.chunks_exact(144).zip(x) {
        let d = y.d * f16_at(b, 0);
        let dmin = -y.d * f16_at(b, 2);
        let (sc, mn) = scales_k4(&b[4..16]);
        let qs = &b[16..144];
        let q8s = q8_sums32(y);
        for l in 0..4 {
            let prod = mn[2 * l] * q8s[2 * l] + mn[2 * l + 1] * q8s[2 * l + 1];
            acc_m[l] = dmin.mul_add(prod as f32, acc_m[l]);
        }
        let mut sumi = [0i32; 8];
        for e in 0..QK_K {
            sumi[lane(e)] += sc[e / 32] * nibble_k(qs, e) * y.qs[e] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
}

/// Q2_K through llama.cpp's repacked `q2_K_8x8` kernels, which its AVX-512 build takes for
/// matrices of a multiple of 8 rows: per super-block (`gemv`, `per_128 = false`) or per 128
/// values (the AVX-512 `gemm`), one fused multiply-add of the exact scaled sum `Σ scale·q·q8` by
/// `d_w · d_x` and one of the offsets' sum `Σ min·bsum` by `dmin_w · d_x`; the output is their
/// difference.
pub(super) fn dot_q2_k_repacked(w: &[u8], x: &[Q8K], per_128: bool) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for (b, y) in w.chunks_exact(84).zip(x) {
        let (sc, qs) = (&b[0..16], &b[16..80]);
        let (scale, scale_min) = (f16_at(b, 80) * y.d, f16_at(b, 82) * y.d);
        let half = |h: usize| -> (i32, i32) {
            let isum = (128 * h..128 * h + 128)
                .map(|e| (sc[e / 16] & 0x0F) as i32 * crumb(qs, e) * y.qs[e] as i32)
                .sum();
            let imin = (8 * h..8 * h + 8)
                .map(|k| (sc[k] >> 4) as i32 * y.bsums[k] as i32)
                .sum();
            (isum, imin)
        };
        let [(s0, m0), (s1, m1)] = [half(0), half(1)];
        let sums: &[(i32, i32)] = match per_128 {
            true => &[(s0, m0), (s1, m1)],
            false => &[(s0 + s1, m0 + m1)],
        };
        for &(isum, imin) in sums {
            acc = (isum as f32).mul_add(scale, acc);
            acc_min = (imin as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// Q4_K through llama.cpp's repacked `q4_K_8x8` kernels: per super-block (`gemv`, `per_64 =
/// false`) or per 64 values (`gemm`), one fused multiply-add of the exact scaled sum by
/// `d_w · d_x` and one of the offsets' sum by `dmin_w · d_x`; the output is their difference.
pub(super) fn dot_q4_k_repacked(w: &[u8], x: &[Q8K], per_64: bool) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for (b, y) in w.chunks_exact(144).zip(x) {
        let (dw, dmw) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, mn) = scales_k4(&b[4..16]);
        let qs = &b[16..144];
        let q8s = q8_sums32(y);
        let quant = |e| nibble_k(qs, e);
        let (scale, scale_min) = (dw * y.d, dmw * y.d);
        if per_64 {
            for sb in 0..4 {
                let isum = q4k_isum(&sc, y, 64 * sb..64 * sb + 64, quant);
                let imin = mn[2 * sb] * q8s[2 * sb] + mn[2 * sb + 1] * q8s[2 * sb + 1];
                acc = (isum as f32).mul_add(scale, acc);
                acc_min = (imin as f32).mul_add(scale_min, acc_min);
            }
        } else {
            let isum = q4k_isum(&sc, y, 0..QK_K, quant);
            let imin: i32 = (0..8).map(|k| mn[k] * q8s[k]).sum();
            acc = (isum as f32).mul_add(scale, acc);
            acc_min = (imin as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// ggml's `ggml_vec_dot_q5_K_q8_K` (AVX2).
pub(super) fn dot_q5_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (b, y) in w.chunks_exact(176).zip(x) {
        let d = y.d * f16_at(b, 0);
        let dmin = -y.d * f16_at(b, 2);
        let (sc, mn) = scales_k4(&b[4..16]);
        let (qh, qs) = (&b[16..48], &b[48..176]);
        let q8s = q8_sums32(y);
        let mins: i32 = (0..8).map(|k| mn[k] * q8s[k]).sum();
        // `summs += dmin * sum`, which GCC contracts to a fused multiply-add.
        summs = dmin.mul_add(mins as f32, summs);
        let mut sumi = [0i32; 8];
        for e in 0..QK_K {
            let q = nibble_k(qs, e) + 16 * ((qh[e % 32] >> (e / 32)) & 1) as i32;
            sumi[lane(e)] += sc[e / 32] * q * y.qs[e] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc) + summs
}

/// Unsigned 6-bit quant `e` of a Q6_K super-block (`ql` low 4 bits, `qh` high 2 bits).
#[inline(always)]
pub(super) fn q6_quant(ql: &[u8], qh: &[u8], e: usize) -> i32 {
    let (j, t, b) = (e / 128, (e % 128) / 32, e % 32);
    let h = qh[32 * j + b];
    let (low, high) = match t {
        0 => (ql[64 * j + b] & 0x0F, h & 3),
        1 => (ql[64 * j + 32 + b] & 0x0F, (h >> 2) & 3),
        2 => (ql[64 * j + b] >> 4, (h >> 4) & 3),
        _ => (ql[64 * j + 32 + b] >> 4, (h >> 6) & 3),
    };
    (low | (high << 4)) as i32
}

/// ggml's `ggml_vec_dot_q6_K_q8_K` (AVX2): the quants' offset of 32 is taken out per lane
/// through the activations' 16-value sums.
pub(super) fn dot_q6_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, y) in w.chunks_exact(210).zip(x) {
        let (ql, qh) = (&b[0..128], &b[128..192]);
        let sc: [i32; 16] = std::array::from_fn(|i| b[192 + i] as i8 as i32);
        let d = y.d * f16_at(b, 208);
        let mut sumi: [i32; 8] = std::array::from_fn(|l| {
            -32 * (y.bsums[2 * l] as i32 * sc[2 * l] + y.bsums[2 * l + 1] as i32 * sc[2 * l + 1])
        });
        for e in 0..QK_K {
            sumi[lane(e)] += sc[e / 16] * q6_quant(ql, qh, e) * y.qs[e] as i32;
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// Grid value of value `j` (0..32) of a 32-value IQ4 block whose 16 nibble bytes are `qs`.
#[inline(always)]
pub(super) fn iq4_value(qs: &[u8], j: usize) -> i32 {
    let nibble = if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    };
    IQ4_GRID[nibble as usize] as i32
}

/// ggml's `ggml_vec_dot_iq4_xs_q8_K` (AVX2).
pub(super) fn dot_iq4_xs(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, y) in w.chunks_exact(136).zip(x) {
        let d = f16_at(b, 0) * y.d;
        let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
        let (sl, qs) = (&b[4..8], &b[8..136]);
        let mut sumi = [0i32; 8];
        for ib in 0..8 {
            let ls = (((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32
                | (((sh >> (2 * ib)) & 3) << 4))
                - 32;
            let q = &qs[16 * ib..16 * ib + 16];
            for j in 0..32 {
                sumi[lane(j)] += ls * iq4_value(q, j) * y.qs[32 * ib + j] as i32;
            }
        }
        for l in 0..8 {
            acc[l] = d.mul_add(sumi[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// A K-quant or IQ4_XS super-block's weight scales and its exact integer sums against an
/// activation super-block: `(d, dmin, Σ scale · q · q8, Σ min · bsum)` (the second sum 0 for
/// types without offsets).
pub(super) fn superblock_sums(ty: GgmlType, b: &[u8], y: &Q8K) -> (f32, f32, i32, i32) {
    let dot = |value: &dyn Fn(usize) -> i32| -> i32 {
        (0..QK_K).map(|e| value(e) * y.qs[e] as i32).sum()
    };
    match ty {
        GgmlType::Q2K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let s1 = dot(&|e| (sc[e / 16] & 0x0F) as i32 * crumb(qs, e));
            let s2 = (0..16)
                .map(|k| (sc[k] >> 4) as i32 * y.bsums[k] as i32)
                .sum();
            (f16_at(b, 80), f16_at(b, 82), s1, s2)
        }
        GgmlType::Q3K => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], scales_q3_k(&b[96..108]));
            let s1 = dot(&|e| {
                let high = (hmask[e % 32] >> (e / 32)) & 1;
                sc[e / 16] * (crumb(qs, e) - if high == 0 { 4 } else { 0 })
            });
            (f16_at(b, 108), 0.0, s1, 0)
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (sc, mn) = scales_k4(&b[4..16]);
            let q8s = q8_sums32(y);
            let s1 = if ty == GgmlType::Q4K {
                let qs = &b[16..144];
                dot(&|e| sc[e / 32] * nibble_k(qs, e))
            } else {
                let (qh, qs) = (&b[16..48], &b[48..176]);
                dot(&|e| {
                    sc[e / 32] * (nibble_k(qs, e) + 16 * ((qh[e % 32] >> (e / 32)) & 1) as i32)
                })
            };
            let s2 = (0..8).map(|k| mn[k] * q8s[k]).sum();
            (f16_at(b, 0), f16_at(b, 2), s1, s2)
        }
        GgmlType::Q6K => {
            let (ql, qh) = (&b[0..128], &b[128..192]);
            let s1 = dot(&|e| (b[192 + e / 16] as i8 as i32) * (q6_quant(ql, qh, e) - 32));
            (f16_at(b, 208), 0.0, s1, 0)
        }
        GgmlType::IQ4XS => {
            let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
            let (sl, qs) = (&b[4..8], &b[8..136]);
            let s1 = dot(&|e| {
                let ib = e / 32;
                let ls = (((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32
                    | (((sh >> (2 * ib)) & 3) << 4))
                    - 32;
                ls * iq4_value(&qs[16 * ib..16 * ib + 16], e % 32)
            });
            (f16_at(b, 0), 0.0, s1, 0)
        }
        _ => unreachable!("{ty} is not a K-quant"),
    }
}

/// llama.cpp's tiled K-quant kernel (ggml-cpu/tiled, which takes unrepacked K-quant and IQ4_XS
/// weights from 8 activation rows on): per super-block, `r = d_w · s1` rounded, minus
/// `dmin_w · s2` in one fused step, then `acc += r · d_x` fused.
pub(super) fn dot_tiled(ty: GgmlType, w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(ty.type_size()).zip(x) {
        let (d, dmin, s1, s2) = superblock_sums(ty, b, y);
        let mut r = d * s1 as f32;
        if matches!(ty, GgmlType::Q2K | GgmlType::Q4K | GgmlType::Q5K) {
            r = (-dmin).mul_add(s2 as f32, r);
        }
        acc = r.mul_add(y.d, acc);
    }
    acc
}

/// The 8 lane sums (4 values each) of a 32-value block's products with its activation block.
#[inline(always)]
pub(super) fn lane_sums32(q: impl Fn(usize) -> i32, xq: &[i8]) -> [i32; 8] {
    std::array::from_fn(|l| (4 * l..4 * l + 4).map(|j| q(j) * xq[j] as i32).sum())
}

/// Value `j` of a Q5_0/Q5_1 block: the nibble with bit `j` of `qh` as its fifth bit.
#[inline(always)]
pub(super) fn q5_value(qs: &[u8], qh: u32, j: usize) -> i32 {
    let nibble = if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    } as i32;
    nibble | (((qh >> j) & 1) << 4) as i32
}

/// ggml's `ggml_vec_dot_q5_0_q8_0` (AVX2; llamafile's tinyBLAS computes the same per output).
pub(super) fn dot_q5_0(w: &[u8], x: &QuantRow) -> f32 {
    let mut acc = [0.0f32; 8];
    for (i, b) in w.chunks_exact(22).enumerate() {
        let d = f16_at(b, 0) * x.scales[i];
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        let p = lane_sums32(|j| q5_value(qs, qh, j) - 16, &x.quants[BLOCK * i..]);
        for l in 0..8 {
            acc[l] = d.mul_add(p[l] as f32, acc[l]);
        }
    }
    hsum8(acc)
}

/// ggml's `ggml_vec_dot_q5_1_q8_1` (AVX2).
pub(super) fn dot_q5_1(w: &[u8], x: &QuantRow) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (i, b) in w.chunks_exact(24).enumerate() {
        let (dx, m) = (f16_at(b, 0), f16_at(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        // `summs += m * s`, contracted by GCC.
        summs = m.mul_add(x.sums[i], summs);
        let p = lane_sums32(|j| q5_value(qs, qh, j), &x.quants[BLOCK * i..]);
        let d = dx * x.scales[i];
        for l in 0..8 {
            acc[l] = (p[l] as f32).mul_add(d, acc[l]);
        }
    }
    hsum8(acc) + summs
}

/// IQ4_NL: `ggml_vec_dot_iq4_nl_q8_0` (AVX2: even and odd blocks in two accumulators, an odd
/// last block in scalar code) for one row, llamafile's tinyBLAS (one accumulator) for several.
pub(super) fn dot_iq4_nl(w: &[u8], x: &QuantRow, tinyblas: bool) -> f32 {
    let nb = w.len() / 18;
    let block = |i: usize| {
        let b = &w[18 * i..18 * i + 18];
        let d = x.scales[i] * f16_at(b, 0);
        (
            d,
            lane_sums32(|j| iq4_value(&b[2..18], j), &x.quants[BLOCK * i..]),
        )
    };
    let mut acc = [[0.0f32; 8]; 2];
    if tinyblas {
        for i in 0..nb {
            let (d, p) = block(i);
            for l in 0..8 {
                acc[0][l] = d.mul_add(p[l] as f32, acc[0][l]);
            }
        }
        return hsum8(acc[0]);
    }
    let pairs = nb / 2 * 2;
    for i in 0..pairs {
        let (d, p) = block(i);
        for l in 0..8 {
            acc[i % 2][l] = d.mul_add(p[l] as f32, acc[i % 2][l]);
        }
    }
    let mut sumf = hsum8(std::array::from_fn(|l| acc[0][l] + acc[1][l]));
    if pairs < nb {
        let (d, p) = block(pairs);
        sumf = d.mul_add(p.iter().sum::<i32>() as f32, sumf);
    }
    sumf
}

/// Q4_0 / IQ4_NL through llama.cpp's repacked 8x8 kernels (`gemv` and `gemm` alike): one
/// accumulator per output, one fused multiply-add per block of the exact block sum by
/// `d_w · d_x`. `quant(block, j)` is value `j` of weight block `block`, `dw(block)` its scale.
pub(in crate::flex) fn dot_repacked_32(
    nb: usize,
    x: &QuantRow,
    quant: impl Fn(usize, usize) -> i32,
    dw: impl Fn(usize) -> f32,
) -> f32 {
    let mut acc = 0.0f32;
    for i in 0..nb {
        let xq = &x.quants[BLOCK * i..BLOCK * i + BLOCK];
        let isum: i32 = (0..BLOCK).map(|j| quant(i, j) * xq[j] as i32).sum();
        acc = (isum as f32).mul_add(dw(i) * x.scales[i], acc);
    }
    acc
}

/// `ggml_vec_dot_f16` of f16 weights with f16 activations (both widened exactly to f32): four
/// 8-lane (AVX2) or 16-lane (AVX-512) FMA accumulators over steps of 32 or 64, reduced, the tail
/// added in f64.
pub(super) fn dot_f16_vec(w: &[f32], y: &[f32], isa: GgmlIsa) -> f32 {
    let n = w.len();
    let lanes = isa.lanes();
    let step = 4 * lanes;
    let np = n / step * step;
    let mut sum = [[0.0f32; 16]; 4];
    for i in (0..np).step_by(step) {
        for j in 0..4 {
            for l in 0..lanes {
                let e = i + j * lanes + l;
                sum[j][l] = w[e].mul_add(y[e], sum[j][l]);
            }
        }
    }
    let mut sumf = match isa {
        GgmlIsa::Avx2 => reduce_f32x8(sum.map(|s| s[..8].try_into().expect("8 lanes"))),
        GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => {
            let r: [f32; 16] =
                std::array::from_fn(|l| (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]));
            reduce_add16(&r)
        }
    } as f64;
    for e in np..n {
        sumf += (w[e] * y[e]) as f64;
    }
    sumf as f32
}

/// `ggml_vec_dot_bf16` (AVX2: four 8-lane accumulators over steps of 32; AVX-512F: two 16-lane
/// ones, each reduced into the f64 sum; AVX512_BF16: two `vdpbf16ps` accumulators of 16 lanes
/// over steps of 64, lane `l` adding the product of elements `2l + 1`, then `2l`), the tail in
/// f64. bf16 products are exact in f32, so a multiply-then-add and a fused multiply-add agree.
pub(super) fn dot_bf16_vec(w: &[f32], y: &[f32], isa: GgmlIsa) -> f32 {
    let n = w.len();
    let mut i = 0;
    let mut sumf = 0.0f64;
    match isa {
        GgmlIsa::Avx2 => {
            let mut c = [[0.0f32; 8]; 4];
            while i + 32 <= n {
                for j in 0..4 {
                    for l in 0..8 {
                        let e = i + 8 * j + l;
                        c[j][l] += w[e] * y[e];
                    }
                }
                i += 32;
            }
            let r: [f32; 8] = std::array::from_fn(|l| (c[0][l] + c[2][l]) + (c[1][l] + c[3][l]));
            sumf += hsum8(r) as f64;
        }
        GgmlIsa::Avx512Bf16 => {
            let mut c = [[0.0f32; 16]; 2];
            while i + 64 <= n {
                for j in 0..2 {
                    for l in 0..16 {
                        let e = i + 32 * j + 2 * l;
                        c[j][l] = (c[j][l] + w[e + 1] * y[e + 1]) + w[e] * y[e];
                    }
                }
                i += 64;
            }
            sumf += reduce_add16(&c[0]) as f64;
            sumf += reduce_add16(&c[1]) as f64;
        }
        GgmlIsa::Avx512 => {
            let mut c = [[0.0f32; 16]; 2];
            while i + 32 <= n {
                for j in 0..2 {
                    for l in 0..16 {
                        let e = i + 16 * j + l;
                        c[j][l] += w[e] * y[e];
                    }
                }
                i += 32;
            }
            sumf += reduce_add16(&c[0]) as f64;
            sumf += reduce_add16(&c[1]) as f64;
        }
    }
    for e in i..n {
        sumf += (w[e] * y[e]) as f64;
    }
    sumf as f32
}
