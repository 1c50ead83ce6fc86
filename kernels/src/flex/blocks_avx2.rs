//! AVX2 versions of the dot products of `blocks.rs`: the same bits, faster.
//!
//! The integer parts are exact whatever instructions compute them, as long as each of ggml's
//! eight i32 lanes receives the same products (lane `l` of a 32-value group takes values
//! `4l..4l + 4`) and no 16-bit intermediate saturates — which the operand ranges below guarantee
//! (`maddubs` of an unsigned weight ≤ 63 by an i8 activation, pairs ≤ 2 · 63 · 128 < 2¹⁵). The
//! float parts are ggml's operations in ggml's order. Every function is tested against its
//! scalar specification on random blocks (`tests` below) and both against llama.cpp's outputs
//! (`tests/ggml_kernels.rs`).
//!
//! Callers must have checked that `cpu_level()` is at least AVX2 (which includes FMA and F16C).

use std::arch::x86_64::*;

use super::blocks::{Q8K, scales_q3_k};
use super::qmatmul::QuantRow;
use crate::packed::BLOCK;
use toy_quant::IQ4_GRID;

/// ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_float_8(x: __m256) -> f32 {
    let mut res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

/// The sum of the 8 i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32_8(a: __m256i) -> i32 {
    hsum_i32_4(_mm_add_epi32(
        _mm256_castsi256_si128(a),
        _mm256_extracti128_si256(a, 1),
    ))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load256(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: 32 bytes are in bounds (asserted); unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load128(p: &[u8]) -> __m128i {
    assert!(p.len() >= 16);
    // SAFETY: as `load256`.
    unsafe { _mm_loadu_si128(p.as_ptr() as *const __m128i) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_q8(q: &[i8]) -> __m256i {
    assert!(q.len() >= 32);
    // SAFETY: as `load256`.
    unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) }
}

/// i16 `lo` in the low 128 bits, `hi` in the high ones, each broadcast.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// `maddubs(u, s)` then `madd` by 16-bit `scales`: 8 i32 lanes, lane `l` = Σ over bytes `4l..4l+4`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled_lanes(u: __m256i, s: __m256i, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(scales, _mm256_maddubs_epi16(u, s))
}

/// Q2_K's scaled integer lanes (without the offsets).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k_lanes(b: &[u8], y: &Q8K) -> __m256i {
    let (sc, qs) = (&b[0..16], &b[16..80]);
    let m3 = _mm256_set1_epi8(3);
    let mut sumi = _mm256_setzero_si256();
    for j in 0..2 {
        let bits = load256(&qs[32 * j..]);
        for t in 0..4 {
            let q = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_set1_epi32(2 * t as i32)), m3);
            let s = scale_pair(
                (sc[8 * j + 2 * t] & 0x0F) as i32,
                (sc[8 * j + 2 * t + 1] & 0x0F) as i32,
            );
            let y8 = load_q8(&y.qs[128 * j + 32 * t..]);
            sumi = _mm256_add_epi32(sumi, scaled_lanes(q, y8, s));
        }
    }
    sumi
}

/// Q3_K's scaled integer lanes (values `low - 4` where the high bit is clear): two `maddubs`,
/// one of the low 2 bits and one of the 4 subtracted, as ggml does (both unsigned ≤ 4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q3k_lanes(b: &[u8], y: &Q8K) -> __m256i {
    let (hmask, qs) = (load256(&b[0..32]), &b[32..96]);
    let sc = scales_q3_k(&b[96..108]);
    let (m3, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut sumi = _mm256_setzero_si256();
    for j in 0..2 {
        let bits = load256(&qs[32 * j..]);
        for t in 0..4 {
            let bit = (4 * j + t) as i32;
            let low =
                _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_set1_epi32(2 * t as i32)), m3);
            // 4 where the high bit is clear, else 0.
            let set = _mm256_and_si256(_mm256_srlv_epi32(hmask, _mm256_set1_epi32(bit)), one);
            let high = _mm256_slli_epi16(_mm256_xor_si256(set, one), 2);
            let y8 = load_q8(&y.qs[128 * j + 32 * t..]);
            let p = _mm256_sub_epi16(
                _mm256_maddubs_epi16(low, y8),
                _mm256_maddubs_epi16(high, y8),
            );
            let s = scale_pair(sc[8 * j + 2 * t], sc[8 * j + 2 * t + 1]);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(s, p));
        }
    }
    sumi
}

/// A Q4_K/Q5_K super-block's 8 six-bit scales (i16, bytes 0..16, repeated in both 128-bit
/// halves) and 8 mins (i16, in a 128-bit register), unpacked with ggml's `utmp` word masks
/// (the same values as `scales_k4`, in a dozen integer operations instead of a loop).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins_k4(s: &[u8]) -> (__m256i, __m128i) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let mins_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let mins_lo = u1 & KMASK1;
    let scales_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let scales_lo = u0 & KMASK1;
    let both = _mm256_cvtepu8_epi16(_mm_set_epi32(
        mins_hi as i32,
        mins_lo as i32,
        scales_hi as i32,
        scales_lo as i32,
    ));
    let sc = _mm256_castsi256_si128(both);
    (_mm256_set_m128i(sc, sc), _mm256_extracti128_si256(both, 1))
}

/// Scale `i` of `scales_mins_k4`'s register broadcast to all 16 i16 elements
/// (`get_scale_shuffle_k4`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_scale(scales: __m256i, i: usize) -> __m256i {
    let pair = i16::from_le_bytes([2 * i as u8, 2 * i as u8 + 1]);
    _mm256_shuffle_epi8(scales, _mm256_set1_epi16(pair))
}

/// ggml's `prod` of a Q4_K/Q5_K super-block: lane `l` = `mn[2l]·s[2l] + mn[2l+1]·s[2l+1]`
/// with `s` the activations' 32-value sums (`_mm_hadd_epi16` of the 16-value ones).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mins_prod(mins: __m128i, y: &Q8K) -> __m128i {
    _mm_madd_epi16(mins, q8_sums32_i16(y))
}

/// The activations' 32-value sums as 8 i16 (each ≤ 32 · 128 in magnitude, so no overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_sums32_i16(y: &Q8K) -> __m128i {
    // SAFETY: `bsums` is 16 i16 = 32 bytes.
    let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
    _mm_hadd_epi16(
        _mm256_castsi256_si128(bsums),
        _mm256_extracti128_si256(bsums, 1),
    )
}

/// The sum of 4 i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32_4(a: __m128i) -> i32 {
    let hi64 = _mm_unpackhi_epi64(a, a);
    let sum64 = _mm_add_epi32(hi64, a);
    let hi32 = _mm_shuffle_epi32(sum64, 0b10_11_00_01);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

/// An f16 field at byte `i` of `b`, through F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16c_at(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Q4_K's (or with `qh` Q5_K's) scaled integer lanes per 64 values; `scales` from
/// `scales_mins_k4`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q45k_lanes64(qs: &[u8], qh: Option<&[u8]>, scales: __m256i, y: &Q8K) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let hbits = qh.map(|h| load256(h));
    assert!(qs.len() >= 128);
    std::array::from_fn(|j| {
        let bits = load256(&qs[32 * j..]);
        let mut lo = _mm256_and_si256(bits, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if let Some(h) = hbits {
            let h_lo = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(2 * j as i32)), one);
            let h_hi = _mm256_and_si256(
                _mm256_srlv_epi32(h, _mm256_set1_epi32(2 * j as i32 + 1)),
                one,
            );
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(h_lo, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(h_hi, 4));
        }
        let p_lo = scaled_lanes(lo, load_q8(&y.qs[64 * j..]), k4_scale(scales, 2 * j));
        let p_hi = scaled_lanes(
            hi,
            load_q8(&y.qs[64 * j + 32..]),
            k4_scale(scales, 2 * j + 1),
        );
        _mm256_add_epi32(p_lo, p_hi)
    })
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum4(v: [__m256i; 4]) -> __m256i {
    _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]))
}

/// i8 scales `2i` (low 128 bits) and `2i + 1` (high ones) of `sc` as broadcast i16 — what
/// `scale_pair` makes from two integers, by one shuffle (`get_scale_shuffle`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i8_scale_pair(sc: __m128i, i: usize) -> __m256i {
    let (lo, hi) = ((2 * i) as i8, (2 * i + 1) as i8);
    let pick = _mm_set_epi8(
        hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
    );
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick))
}

/// Q6_K's scaled integer lanes with the offset of 32 taken out per lane through the
/// activations' 16-value sums, as ggml's AVX2 code does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_lanes(b: &[u8], y: &Q8K) -> __m256i {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let sc = load128(&b[192..208]);
    let (m15, m3) = (_mm256_set1_epi8(15), _mm256_set1_epi8(3));
    let mut sumi = _mm256_setzero_si256();
    for j in 0..2 {
        let b1 = load256(&ql[64 * j..]);
        let b2 = load256(&ql[64 * j + 32..]);
        let h = load256(&qh[32 * j..]);
        let high = |shift: i32| {
            _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(shift)), m3),
                4,
            )
        };
        let q = [
            _mm256_or_si256(_mm256_and_si256(b1, m15), high(0)),
            _mm256_or_si256(_mm256_and_si256(b2, m15), high(2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), high(4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), high(6)),
        ];
        for (t, q) in q.into_iter().enumerate() {
            let s = i8_scale_pair(sc, 4 * j + t);
            sumi = _mm256_add_epi32(sumi, scaled_lanes(q, load_q8(&y.qs[128 * j + 32 * t..]), s));
        }
    }
    let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
    let sc16 = _mm256_cvtepi8_epi16(load128(&b[192..208]));
    _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5))
}

/// 32 IQ4 grid values of a block's 16 nibble bytes: low nibbles (values 0..16), then high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_values(qs: &[u8]) -> __m256i {
    let grid = unsafe { _mm_loadu_si128(IQ4_GRID.as_ptr() as *const __m128i) };
    let m4 = _mm_set1_epi8(0x0F);
    let bits = load128(qs);
    _mm256_set_m128i(
        _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(bits, 4), m4)),
        _mm_shuffle_epi8(grid, _mm_and_si128(bits, m4)),
    )
}

/// Lanes of signed `x · y` products (ggml's `mul_add_epi8` then `madd` by ones).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_lanes(x: __m256i, y: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// IQ4_XS's scaled integer lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4xs_lanes(b: &[u8], y: &Q8K) -> __m256i {
    let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
    let (sl, qs) = (&b[4..8], &b[8..136]);
    let mut sumi = _mm256_setzero_si256();
    for ib in 0..8 {
        let ls =
            (((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32 | (((sh >> (2 * ib)) & 3) << 4)) - 32;
        let x = iq4_values(&qs[16 * ib..]);
        let y8 = load_q8(&y.qs[32 * ib..]);
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y8, x));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(ls as i16)));
    }
    sumi
}

/// `ggml_vec_dot_q2_K_q8_K`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, y) in w.chunks_exact(84).zip(x) {
        let d = y.d * f16c_at(b, 80);
        let dmin = -y.d * f16c_at(b, 82);
        let mins = _mm256_cvtepi8_epi16(_mm_and_si128(
            _mm_srli_epi16(load128(&b[0..16]), 4),
            _mm_set1_epi8(0x0F),
        ));
        let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
        let prod = _mm256_madd_epi16(mins, bsums);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q2k_lanes(b, y)), acc);
    }
    hsum_float_8(acc)
}

/// `ggml_vec_dot_q3_K_q8_K`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q3_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, y) in w.chunks_exact(110).zip(x) {
        let d = y.d * f16c_at(b, 108);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q3k_lanes(b, y)), acc);
    }
    hsum_float_8(acc)
}

/// `ggml_vec_dot_q4_K_q8_K` (`qh`: Q5_K's `ggml_vec_dot_q5_K_q8_K`, whose offsets are summed
/// in a scalar instead of four lanes).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q45_k(w: &[u8], x: &[Q8K], q5: bool) -> f32 {
    let bytes = if q5 { 176 } else { 144 };
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    let mut summs = 0.0f32;
    for (b, y) in w.chunks_exact(bytes).zip(x) {
        let d = y.d * f16c_at(b, 0);
        let dmin = -y.d * f16c_at(b, 2);
        let (scales, mins) = scales_mins_k4(&b[4..16]);
        let prod = mins_prod(mins, y);
        if q5 {
            summs = dmin.mul_add(hsum_i32_4(prod) as f32, summs);
        } else {
            acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        }
        let lanes = if q5 {
            sum4(q45k_lanes64(&b[48..176], Some(&b[16..48]), scales, y))
        } else {
            sum4(q45k_lanes64(&b[16..144], None, scales, y))
        };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    if q5 {
        return hsum_float_8(acc) + summs;
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    hsum_float_8(acc) + _mm_cvtss_f32(acc_m)
}

/// Q4_K through llama.cpp's repacked kernels (see `blocks::dot_q4_k_repacked`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4_k_repacked(w: &[u8], x: &[Q8K], per_64: bool) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for (b, y) in w.chunks_exact(144).zip(x) {
        let (dw, dmw) = (f16c_at(b, 0), f16c_at(b, 2));
        let (scales, mins) = scales_mins_k4(&b[4..16]);
        let prod = mins_prod(mins, y);
        let parts = q45k_lanes64(&b[16..144], None, scales, y);
        let (scale, scale_min) = (dw * y.d, dmw * y.d);
        if per_64 {
            let mut imins = [0i32; 4];
            // SAFETY: 4 i32 = 16 bytes.
            unsafe { _mm_storeu_si128(imins.as_mut_ptr() as *mut __m128i, prod) };
            for (p, imin) in parts.into_iter().zip(imins) {
                acc = (hsum_i32_8(p) as f32).mul_add(scale, acc);
                acc_min = (imin as f32).mul_add(scale_min, acc_min);
            }
        } else {
            let imin = hsum_i32_4(prod);
            acc = (hsum_i32_8(sum4(parts)) as f32).mul_add(scale, acc);
            acc_min = (imin as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// Q4_K's one-row repacked kernel (`dot_q4_k_repacked(w, x, false)`) for eight weight rows at
/// once, as llama.cpp's `gemv_q4_K_8x8` computes eight outputs together: the float steps are
/// done 8 outputs wide, and each output gets the bits of the one-row
/// function (the same integers, then the same f32 multiply and fused multiply-adds per
/// super-block). The integer pass reads each row's blocks in order, row after row, so the
/// weights stream through memory as they lie (eight interleaved streams stall the prefetcher).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot8_q4_k_gemv(w: [&[u8]; 8], x: &[Q8K]) -> [f32; 8] {
    const CHUNK: usize = 16;
    for r in &w {
        assert!(r.len() >= 144 * x.len());
    }
    let (mut acc, mut acc_min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // Per super-block of the chunk, per output: the exact integer sums and the f16 pair.
    let mut isums = [[0i32; 8]; CHUNK];
    let mut imins = [[0i32; 8]; CHUNK];
    let mut d_dmin = [[0u32; 8]; CHUNK];
    for i0 in (0..x.len()).step_by(CHUNK) {
        let ys = &x[i0..(i0 + CHUNK).min(x.len())];
        for c in 0..8 {
            for (i, y) in ys.iter().enumerate() {
                let b = &w[c][144 * (i0 + i)..144 * (i0 + i) + 144];
                d_dmin[i][c] = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                let (scales, mins) = scales_mins_k4(&b[4..16]);
                imins[i][c] = hsum_i32_4(mins_prod(mins, y));
                isums[i][c] = hsum_i32_8(sum4(q45k_lanes64(&b[16..144], None, scales, y)));
            }
        }
        for (i, y) in ys.iter().enumerate() {
            // SAFETY: each row is 8 × 4 bytes = 32 bytes.
            let (isum, imin, words) = unsafe {
                (
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(isums[i].as_ptr() as *const __m256i)),
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(imins[i].as_ptr() as *const __m256i)),
                    _mm256_loadu_si256(d_dmin[i].as_ptr() as *const __m256i),
                )
            };
            let (dw, dmw) = split_f16_pairs(words);
            let yd = _mm256_set1_ps(y.d);
            acc = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, yd), acc);
            acc_min = _mm256_fmadd_ps(imin, _mm256_mul_ps(dmw, yd), acc_min);
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: 8 f32 = 32 bytes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, acc_min)) };
    out
}

/// Eight words of two f16 each (`d` low, `dmin` high) as two vectors of f32: the `d`s, the `dmin`s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn split_f16_pairs(words: __m256i) -> (__m256, __m256) {
    let lo = _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
    let hi = _mm256_srli_epi32(words, 16);
    // packus per 128-bit half: [lo0..3, hi0..3 | lo4..7, hi4..7] → reorder the 64-bit quarters.
    let packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0b11_01_10_00);
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(packed)),
        _mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1)),
    )
}

/// `ggml_vec_dot_q6_K_q8_K`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6_k(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, y) in w.chunks_exact(210).zip(x) {
        let d = y.d * f16c_at(b, 208);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q6k_lanes(b, y)), acc);
    }
    hsum_float_8(acc)
}

/// `ggml_vec_dot_iq4_xs_q8_K`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq4_xs(w: &[u8], x: &[Q8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, y) in w.chunks_exact(136).zip(x) {
        let d = f16c_at(b, 0) * y.d;
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(iq4xs_lanes(b, y)),
            acc,
        );
    }
    hsum_float_8(acc)
}

/// The tiled kernel's form (see `blocks::dot_tiled`), from the exact lane totals.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_tiled(ty: toy_quant::GgmlType, w: &[u8], x: &[Q8K]) -> f32 {
    use toy_quant::GgmlType as T;
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(ty.type_size()).zip(x) {
        let (d, dmin, s1, s2) = match ty {
            T::Q2K => {
                let s2: i32 = (0..16)
                    .map(|k| (b[k] >> 4) as i32 * y.bsums[k] as i32)
                    .sum();
                (
                    f16c_at(b, 80),
                    f16c_at(b, 82),
                    hsum_i32_8(q2k_lanes(b, y)),
                    s2,
                )
            }
            T::Q3K => (f16c_at(b, 108), 0.0, hsum_i32_8(q3k_lanes(b, y)), 0),
            T::Q4K | T::Q5K => {
                let (scales, mins) = scales_mins_k4(&b[4..16]);
                let s2 = hsum_i32_4(mins_prod(mins, y));
                let lanes = if ty == T::Q5K {
                    sum4(q45k_lanes64(&b[48..176], Some(&b[16..48]), scales, y))
                } else {
                    sum4(q45k_lanes64(&b[16..144], None, scales, y))
                };
                (f16c_at(b, 0), f16c_at(b, 2), hsum_i32_8(lanes), s2)
            }
            T::Q6K => (f16c_at(b, 208), 0.0, hsum_i32_8(q6k_lanes(b, y)), 0),
            _ => (f16c_at(b, 0), 0.0, hsum_i32_8(iq4xs_lanes(b, y)), 0),
        };
        let mut r = d * s1 as f32;
        if matches!(ty, T::Q2K | T::Q4K | T::Q5K) {
            r = (-dmin).mul_add(s2 as f32, r);
        }
        acc = r.mul_add(y.d, acc);
    }
    acc
}

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
    let mut acc = _mm256_setzero_ps();
    let sixteen = _mm256_set1_epi8(16);
    for (i, b) in w.chunks_exact(22).enumerate() {
        let d = f16c_at(b, 0) * x.scales[i];
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let q = _mm256_sub_epi8(q5_values(&b[6..22], qh), sixteen);
        let p = signed_lanes(q, load_q8(&x.quants[BLOCK * i..]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc);
    }
    hsum_float_8(acc)
}

/// `ggml_vec_dot_q5_1_q8_1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_1(w: &[u8], x: &QuantRow) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for (i, b) in w.chunks_exact(24).enumerate() {
        let (dx, m) = (f16c_at(b, 0), f16c_at(b, 2));
        summs = m.mul_add(x.sums[i], summs);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let q = q5_values(&b[8..24], qh);
        let p = _mm256_madd_epi16(
            _mm256_maddubs_epi16(q, load_q8(&x.quants[BLOCK * i..])),
            _mm256_set1_epi16(1),
        );
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * x.scales[i]), acc);
    }
    hsum_float_8(acc) + summs
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

/// 8 f16 or bf16 values widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_half8(p: &[u8], bf16: bool) -> __m256 {
    let v = load128(p);
    if bf16 {
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
    } else {
        _mm256_cvtph_ps(v)
    }
}

/// `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` (AVX2 build) of a 16-bit weight row `w` (bytes) by
/// activations already rounded to 16 bits, `y` (bytes of the same type).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_half_vec(w: &[u8], y: &[u8], bf16: bool) -> f32 {
    let n = w.len() / 2;
    let np = n / 32 * 32;
    let mut sum = [_mm256_setzero_ps(); 4];
    for i in (0..np).step_by(32) {
        for (j, s) in sum.iter_mut().enumerate() {
            let o = 2 * (i + 8 * j);
            let (a, b) = (load_half8(&w[o..], bf16), load_half8(&y[o..], bf16));
            // bf16's `add(mul)` and f16's FMA agree: the products are exact in f32.
            *s = _mm256_fmadd_ps(a, b, *s);
        }
    }
    let half = |b: &[u8], e: usize| {
        let bits = u16::from_le_bytes([b[2 * e], b[2 * e + 1]]);
        if bf16 {
            f32::from_bits((bits as u32) << 16)
        } else {
            half::f16::from_bits(bits).to_f32()
        }
    };
    let mut sumf = if bf16 {
        let c = _mm256_add_ps(_mm256_add_ps(sum[0], sum[2]), _mm256_add_ps(sum[1], sum[3]));
        hsum_float_8(c) as f64
    } else {
        let x0 = _mm256_add_ps(_mm256_add_ps(sum[0], sum[2]), _mm256_add_ps(sum[1], sum[3]));
        let t0 = _mm_add_ps(_mm256_castps256_ps128(x0), _mm256_extractf128_ps(x0, 1));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1)) as f64
    };
    for e in np..n {
        sumf += (half(w, e) * half(y, e)) as f64;
    }
    sumf as f32
}
