//! AVX2 versions of the dot products of `blocks.rs` for the K-quants (256-value super-blocks
//! against Q8_K activations) and F16/BF16, plus the helpers `blocks32_avx2.rs` shares: the same
//! bits, faster.
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

use super::blocks::{Q8K, Rows8, scales_q3_k};
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
pub(super) fn hsum_i32_8(a: __m256i) -> i32 {
    hsum_i32_4(_mm_add_epi32(
        _mm256_castsi256_si128(a),
        _mm256_extracti128_si256(a, 1),
    ))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load256(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: 32 bytes are in bounds (asserted); unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load128(p: &[u8]) -> __m128i {
    assert!(p.len() >= 16);
    // SAFETY: as `load256`.
    unsafe { _mm_loadu_si128(p.as_ptr() as *const __m128i) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_q8(q: &[i8]) -> __m256i {
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

/// Q2_K's scaled integer lanes (without the offsets) of values `128·j..128·j + 128`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k_lanes_128(b: &[u8], y: &Q8K, j: usize) -> __m256i {
    let (sc, qs) = (&b[0..16], &b[16..80]);
    let m3 = _mm256_set1_epi8(3);
    let mut sumi = _mm256_setzero_si256();
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
    sumi
}

/// Q2_K's scaled integer lanes (without the offsets).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k_lanes(b: &[u8], y: &Q8K) -> __m256i {
    _mm256_add_epi32(q2k_lanes_128(b, y, 0), q2k_lanes_128(b, y, 1))
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
pub(super) fn hsum_i32_4(a: __m128i) -> i32 {
    let hi64 = _mm_unpackhi_epi64(a, a);
    let sum64 = _mm_add_epi32(hi64, a);
    let hi32 = _mm_shuffle_epi32(sum64, 0b10_11_00_01);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

/// An f16 field at byte `i` of `b`, through F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16c_at(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Q4_K's (or with `qh` Q5_K's) scaled integer lanes per 64 values; `scales` from
/// `scales_mins_k4`. A plain loop, not `array::from_fn`: a closure here was compiled as a
/// function of its own, called four times per super-block with its vectors spilled to the stack
/// (29% of a 1B-shaped Q4_K_M decode went to those calls).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q45k_lanes64(qs: &[u8], qh: Option<&[u8]>, scales: __m256i, y: &Q8K) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let hbits = match qh {
        Some(h) => load256(h),
        None => _mm256_setzero_si256(),
    };
    assert!(qs.len() >= 128 && y.qs.len() >= 256);
    let mut out = [_mm256_setzero_si256(); 4];
    for (j, out) in out.iter_mut().enumerate() {
        // SAFETY: 32 bytes at 32·j < 128 ≤ qs.len(); activations at 64·j + 32 + 32 ≤ 256.
        let (bits, y_lo, y_hi) = unsafe {
            (
                _mm256_loadu_si256(qs.as_ptr().add(32 * j) as *const __m256i),
                _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i),
                _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i),
            )
        };
        let mut lo = _mm256_and_si256(bits, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if qh.is_some() {
            let h_lo = _mm256_and_si256(
                _mm256_srlv_epi32(hbits, _mm256_set1_epi32(2 * j as i32)),
                one,
            );
            let h_hi = _mm256_and_si256(
                _mm256_srlv_epi32(hbits, _mm256_set1_epi32(2 * j as i32 + 1)),
                one,
            );
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(h_lo, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(h_hi, 4));
        }
        let p_lo = scaled_lanes(lo, y_lo, k4_scale(scales, 2 * j));
        let p_hi = scaled_lanes(hi, y_hi, k4_scale(scales, 2 * j + 1));
        *out = _mm256_add_epi32(p_lo, p_hi);
    }
    out
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
    q6k_scaled_lanes(&q6k_values(b), load128(&b[192..208]), y)
}

/// A Q6_K super-block's 256 values (0..64, before the offset of 32) as eight registers of 32,
/// in ggml's order: register `4j + t` holds values `128·j + 32·t ..`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k_values(b: &[u8]) -> [__m256i; 8] {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let (m15, m3) = (_mm256_set1_epi8(15), _mm256_set1_epi8(3));
    let mut q = [_mm256_setzero_si256(); 8];
    for j in 0..2 {
        let b1 = load256(&ql[64 * j..]);
        let b2 = load256(&ql[64 * j + 32..]);
        let h = load256(&qh[32 * j..]);
        // Bits 4..6 of each value: two bits of `h` from `shift` (no closure: see `q45k_lanes64`).
        let high0 = _mm256_slli_epi16(_mm256_and_si256(h, m3), 4);
        let high2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4);
        let high4 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4);
        let high6 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4);
        q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m15), high0);
        q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), high2);
        q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), high4);
        q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), high6);
    }
    q
}

/// The scaled integer lanes of a Q6_K super-block's values `q` (`q6k_values`) with its 16 i8
/// scales `sc`, against `y`: the offset of 32 taken out per lane through the activations'
/// 16-value sums, as ggml's AVX2 code does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_scaled_lanes(q: &[__m256i; 8], sc: __m128i, y: &Q8K) -> __m256i {
    assert!(y.qs.len() >= 256);
    let mut sumi = _mm256_setzero_si256();
    for (p, q) in q.iter().enumerate() {
        // SAFETY: 32 activations at 32·p + 32 ≤ 256.
        let y8 = unsafe { _mm256_loadu_si256(y.qs.as_ptr().add(32 * p) as *const __m256i) };
        sumi = _mm256_add_epi32(sumi, scaled_lanes(*q, y8, i8_scale_pair(sc, p)));
    }
    // SAFETY: `bsums` is 16 i16 = 32 bytes.
    let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
    let sc16 = _mm256_cvtepi8_epi16(sc);
    _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5))
}

/// 32 IQ4 grid values of a block's 16 nibble bytes: low nibbles (values 0..16), then high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4_values(qs: &[u8]) -> __m256i {
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
pub(super) fn signed_lanes(x: __m256i, y: __m256i) -> __m256i {
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

/// Q2_K through llama.cpp's repacked kernels (see `blocks::dot_q2_k_repacked`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k_repacked(w: &[u8], x: &[Q8K], per_128: bool) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for (b, y) in w.chunks_exact(84).zip(x) {
        let (scale, scale_min) = (f16c_at(b, 80) * y.d, f16c_at(b, 82) * y.d);
        let mut parts = [(0i32, 0i32); 2];
        for (h, part) in parts.iter_mut().enumerate() {
            let mut imin = 0i32;
            for k in 8 * h..8 * h + 8 {
                imin += (b[k] >> 4) as i32 * y.bsums[k] as i32;
            }
            *part = (hsum_i32_8(q2k_lanes_128(b, y, h)), imin);
        }
        let [(s0, m0), (s1, m1)] = parts;
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

/// The sums of four registers' 8 i32 lanes, as one 128-bit register (exact: any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum4_i32_8(p: [__m256i; 4]) -> __m128i {
    let t = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1))
}

/// `dot_q4_k_repacked(w, x[a], true)` (llama.cpp's 4-row repacked gemm) for four activation rows
/// at once: each super-block's nibbles and scales are unpacked once for the four rows, as the
/// gemm's register tile shares them. Per row the same integers and the same float steps in the
/// same order, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4_k_gemm_rows4(w: &[u8], x: [&[Q8K]; 4]) -> [f32; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let nb = w.len() / 144;
    for xa in &x {
        assert!(xa.len() >= nb);
    }
    // The four rows' float steps run in the lanes of one register: per super-block and each
    // 64-value part j in order, `acc = fma(isum_j, dw·d_y, acc)` and likewise for the mins —
    // the scalar chain of each row, four rows at once.
    let (mut acc, mut acc_min) = (_mm_setzero_ps(), _mm_setzero_ps());
    for (i, b) in w.chunks_exact(144).enumerate() {
        let (dw, dmw) = (f16c_at(b, 0), f16c_at(b, 2));
        let (scales, mins) = scales_mins_k4(&b[4..16]);
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        for j in 0..4 {
            let bits = load256(&b[16 + 32 * j..]);
            lo[j] = _mm256_and_si256(bits, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        }
        // Per row a: its four parts' exact sums (lanes j), and its four min products.
        let mut isums = [_mm_setzero_si128(); 4];
        let mut imins = [_mm_setzero_si128(); 4];
        for a in 0..4 {
            let y = &x[a][i];
            let mut parts = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                // SAFETY: activations at 64·j + 32 + 32 ≤ 256.
                let (y_lo, y_hi) = unsafe {
                    (
                        _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i),
                        _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i),
                    )
                };
                parts[j] = _mm256_add_epi32(
                    scaled_lanes(lo[j], y_lo, k4_scale(scales, 2 * j)),
                    scaled_lanes(hi[j], y_hi, k4_scale(scales, 2 * j + 1)),
                );
            }
            isums[a] = hsum4_i32_8(parts);
            imins[a] = mins_prod(mins, y);
        }
        // Lanes a of part j.
        let isums = transpose4(isums);
        let imins = transpose4(imins);
        let yd = _mm_setr_ps(x[0][i].d, x[1][i].d, x[2][i].d, x[3][i].d);
        let (scale, scale_min) = (
            _mm_mul_ps(_mm_set1_ps(dw), yd),
            _mm_mul_ps(_mm_set1_ps(dmw), yd),
        );
        for j in 0..4 {
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isums[j]), scale, acc);
            acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(imins[j]), scale_min, acc_min);
        }
    }
    let mut out = [0.0f32; 4];
    // SAFETY: 4 f32 = 16 bytes.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_min)) };
    out
}

/// The 4 × 4 transpose of i32 lanes: lane a of result j is lane j of `v[a]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose4(v: [__m128i; 4]) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(v[0], v[1]); // v0.0 v1.0 v0.1 v1.1
    let t1 = _mm_unpacklo_epi32(v[2], v[3]); // v2.0 v3.0 v2.1 v3.1
    let t2 = _mm_unpackhi_epi32(v[0], v[1]); // v0.2 v1.2 v0.3 v1.3
    let t3 = _mm_unpackhi_epi32(v[2], v[3]);
    [
        _mm_unpacklo_epi64(t0, t1),
        _mm_unpackhi_epi64(t0, t1),
        _mm_unpacklo_epi64(t2, t3),
        _mm_unpackhi_epi64(t2, t3),
    ]
}

/// Q4_K's one-row repacked kernel (`dot_q4_k_repacked(w, x, false)`) for eight weight rows at
/// once, as llama.cpp's `gemv_q4_K_8x8` computes eight outputs together: the float steps are
/// done 8 outputs wide, and each output gets the bits of the one-row
/// function (the same integers, then the same f32 multiply and fused multiply-adds per
/// super-block). The integer pass reads each row's 16-super-block chunk in turn, row after
/// row: with the rows interleaved (`Rows8::Interleaved`, the CPU backend's layout) that is one
/// contiguous stream — 2–3× the bandwidth of eight rows apart on a Zen 4, whose prefetcher
/// does not keep eight streams going.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot8_q4_k_gemv(w: Rows8<'_>, x: &[Q8K]) -> [f32; 8] {
    const CHUNK: usize = crate::packed::Q4K_X8_CHUNK;
    match w {
        Rows8::Apart(rows) => rows.iter().for_each(|r| assert!(r.len() >= 144 * x.len())),
        Rows8::Interleaved(group) => assert!(group.len() >= 8 * 144 * x.len()),
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
                let b = w.q4k_block(c, i0, ys.len(), i);
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

/// `dot_tiled` of a Q6_K row for four activation rows: each super-block's 6-bit values are
/// unpacked once for the four (as `q6k_lanes` unpacks them for one), and the four rows' float
/// steps run in the lanes of one register — per super-block `r = d · Σ`, then
/// `acc = fma(r, d_y, acc)`, each lane its row's chain. The same bits as four `dot_tiled` calls.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6_k_tiled_rows4(w: &[u8], x: [&[Q8K]; 4]) -> [f32; 4] {
    let nb = w.len() / 210;
    for xa in &x {
        assert!(xa.len() >= nb);
    }
    let mut acc = _mm_setzero_ps();
    for (i, b) in w.chunks_exact(210).enumerate() {
        let q = q6k_values(b);
        let sc = load128(&b[192..208]);
        let mut lanes = [_mm256_setzero_si256(); 4];
        for a in 0..4 {
            lanes[a] = q6k_scaled_lanes(&q, sc, &x[a][i]);
        }
        let totals = _mm_cvtepi32_ps(hsum4_i32_8(lanes));
        let r = _mm_mul_ps(_mm_set1_ps(f16c_at(b, 208)), totals);
        let yd = _mm_setr_ps(x[0][i].d, x[1][i].d, x[2][i].d, x[3][i].d);
        acc = _mm_fmadd_ps(r, yd, acc);
    }
    let mut out = [0.0f32; 4];
    // SAFETY: 4 f32 = 16 bytes.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), acc) };
    out
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

/// The odd bf16 of each 32-bit word (its high half) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bf16_odd(v: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_and_si256(
        v,
        _mm256_set1_epi32(0xFFFF_0000u32 as i32),
    ))
}

/// The even bf16 of each 32-bit word (its low half) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bf16_even(v: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
}

/// `ggml_vec_dot_bf16` of the AVX512_BF16 build (see `blocks::dot_bf16_vec`): two `vdpbf16ps`
/// accumulators of 16 lanes over steps of 64, each lane adding the product of its odd element,
/// then of its even one; each accumulator reduced into the f64 sum, the tail in f64. Any AVX2 CPU
/// computes it: a lane's pair is one 32-bit word, its odd element the high half (a bf16 is the
/// high half of its f32), its even one the low half shifted up.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_bf16_pairs(w: &[u8], y: &[u8]) -> f32 {
    let n = w.len() / 2;
    assert!(y.len() >= 2 * n);
    let np = n / 64 * 64;
    let mut c = [[_mm256_setzero_ps(); 2]; 2];
    for i in (0..np).step_by(64) {
        for (j, c) in c.iter_mut().enumerate() {
            for (h, c) in c.iter_mut().enumerate() {
                let o = 2 * (i + 32 * j + 16 * h);
                // SAFETY: 32 bytes at o + 32 ≤ 2·np ≤ both lengths.
                let (a, b) = unsafe {
                    (
                        _mm256_loadu_si256(w.as_ptr().add(o) as *const __m256i),
                        _mm256_loadu_si256(y.as_ptr().add(o) as *const __m256i),
                    )
                };
                // The products are exact in f32, so each FMA is the instruction's rounded add.
                *c = _mm256_fmadd_ps(bf16_odd(a), bf16_odd(b), *c);
                *c = _mm256_fmadd_ps(bf16_even(a), bf16_even(b), *c);
            }
        }
    }
    let mut sumf = hsum_float_8(_mm256_add_ps(c[0][1], c[0][0])) as f64;
    sumf += hsum_float_8(_mm256_add_ps(c[1][1], c[1][0])) as f64;
    let bf = |b: &[u8], e: usize| {
        f32::from_bits((u16::from_le_bytes([b[2 * e], b[2 * e + 1]]) as u32) << 16)
    };
    for e in np..n {
        sumf += (bf(w, e) * bf(y, e)) as f64;
    }
    sumf as f32
}

/// `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` of a 16-bit weight row `w` (bytes) by activations
/// already rounded to 16 bits, `y` (bytes of the same type), in the order of the build whose
/// vectors are `H` ymm registers wide: H = 1 the AVX2 build (8 lanes), H = 2 the AVX-512F build
/// (16 lanes, each kept as two 8-lane halves, so any AVX2 CPU computes it):
/// - f16: four accumulators over steps of `32·H`, `(s0 + s2) + (s1 + s3)` lanewise, then the
///   build's horizontal sum (`GGML_F32x8_REDUCE`'s `hadd`s, or `_mm512_reduce_add_ps`);
/// - bf16, AVX2: four 8-lane accumulators over steps of 32, reduced like f16's;
///   AVX-512F: two 16-lane accumulators over steps of 32, each reduced into the f64 sum.
///
/// The tail is added in f64. bf16's `add(mul)` and f16's FMA agree: the products are exact in
/// f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_half_vec<const H: usize>(w: &[u8], y: &[u8], bf16: bool) -> f32 {
    let n = w.len() / 2;
    let half = |b: &[u8], e: usize| {
        let bits = u16::from_le_bytes([b[2 * e], b[2 * e + 1]]);
        if bf16 {
            f32::from_bits((bits as u32) << 16)
        } else {
            half::f16::from_bits(bits).to_f32()
        }
    };
    let load = |b: &[u8], e: usize| load_half8(&b[2 * e..], bf16);
    if bf16 && H == 2 {
        let np = n / 32 * 32;
        let mut c = [[_mm256_setzero_ps(); 2]; 2];
        for i in (0..np).step_by(32) {
            for (j, c) in c.iter_mut().enumerate() {
                for (h, c) in c.iter_mut().enumerate() {
                    let e = i + 16 * j + 8 * h;
                    *c = _mm256_fmadd_ps(load(w, e), load(y, e), *c);
                }
            }
        }
        let mut sumf = hsum_float_8(_mm256_add_ps(c[0][1], c[0][0])) as f64;
        sumf += hsum_float_8(_mm256_add_ps(c[1][1], c[1][0])) as f64;
        for e in np..n {
            sumf += (half(w, e) * half(y, e)) as f64;
        }
        return sumf as f32;
    }
    let step = 32 * H;
    let np = n / step * step;
    let mut sum = [[_mm256_setzero_ps(); H]; 4];
    for i in (0..np).step_by(step) {
        for (j, s) in sum.iter_mut().enumerate() {
            for (h, s) in s.iter_mut().enumerate() {
                let e = i + 8 * H * j + 8 * h;
                *s = _mm256_fmadd_ps(load(w, e), load(y, e), *s);
            }
        }
    }
    let mut r = [_mm256_setzero_ps(); H];
    for (h, r) in r.iter_mut().enumerate() {
        *r = _mm256_add_ps(
            _mm256_add_ps(sum[0][h], sum[2][h]),
            _mm256_add_ps(sum[1][h], sum[3][h]),
        );
    }
    let mut sumf = if H == 2 {
        // `_mm512_reduce_add_ps`: the halves, then `hsum_float_8`'s quarters and pairs.
        hsum_float_8(_mm256_add_ps(r[1], r[0])) as f64
    } else if bf16 {
        hsum_float_8(r[0]) as f64
    } else {
        let t0 = _mm_add_ps(_mm256_castps256_ps128(r[0]), _mm256_extractf128_ps(r[0], 1));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1)) as f64
    };
    for e in np..n {
        sumf += (half(w, e) * half(y, e)) as f64;
    }
    sumf as f32
}
