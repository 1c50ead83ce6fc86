//! K-quant and Q4_0 kernels on CPUs with AVX-512 VNNI: the same bits as `blocks_avx2.rs` and
//! `blocks32_avx2.rs`, fewer instructions per product.
//!
//! What fixes an output's bits is ggml's float steps on exact integer sums; the integers may be
//! formed by any instructions. Two ways here, both on `vpdpbusd` (unsigned weight × signed
//! activation, four products per i32 lane):
//! - Q4_K and Q4_0, decode and prefill (`gemv_q4_k_x16`, `gemm_q4_k_x16`, `gemm_q4_0_x16`):
//!   sixteen weight rows side by side, as the CPU backend stores them (`packed::RowLayout::X16`),
//!   each 32-bit lane one output, the activations broadcast: no sums across lanes at all;
//! - Q6_K's tiled 4-row form: one weight row, 64 values per instruction, the lanes gathered
//!   into sub-block sums by a shuffle tree (`sums_of_fours`) and scaled by one `vpmulld`;
//! - Q6_K's one-row decode form (`dot_q6_k`): the AVX2 kernel's lanes, two registers in one.
//!
//! Each kernel is tested against the scalar specification (`blocks/tests.rs`, `qmatmul.rs`).

use std::arch::x86_64::*;

use super::blocks::Q8K;
use super::blocks_avx2::{f16c_at, hsum_float_8, load128, q6k_values};
use super::qmatmul::QuantRow;
use crate::packed::{BLOCK, GgmlType};

/// Sums of four lanes: per 128-bit lane `L`, element `j` of the result is the sum of lanes
/// `4L..4L + 4` of `a[j]`. Exact: integer additions in any order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn sums_of_fours(a: [__m512i; 4]) -> __m512i {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for registers a, b.
    let t0 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(a[0], a[1]),
        _mm512_unpackhi_epi32(a[0], a[1]),
    );
    let t1 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(a[2], a[3]),
        _mm512_unpackhi_epi32(a[2], a[3]),
    );
    _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1))
}

/// The sums of each register's 16 lanes, as lanes `a` of one 128-bit register (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn hsum4_i32_16(a: [__m512i; 4]) -> __m128i {
    let u = sums_of_fours(a);
    let half = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64::<1>(u));
    _mm_add_epi32(
        _mm256_castsi256_si128(half),
        _mm256_extracti128_si256::<1>(half),
    )
}

/// `dot_tiled` of a Q6_K row for four activation rows (as `blocks_avx2::dot_q6_k_tiled_rows4`):
/// per super-block the exact total `Σ sc·(q − 32)·y`, here as `vpdpbusd` sums of the unsigned
/// values 0..64 per 16-value sub-block, times the sub-block's i8 scale, minus `32·Σ sc·bsum`;
/// then `r = d · total` and `acc = fma(r, d_y, acc)` in each row's lane. The same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn dot_q6_k_tiled_rows4(w: &[u8], x: [&[Q8K]; 4]) -> [f32; 4] {
    let nb = w.len() / 210;
    assert!(x.iter().all(|x| x.len() >= nb));
    // `sums_of_fours` puts sub-block 4k + L (register k, 128-bit lane L) in element 4L + k.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let mut acc = _mm_setzero_ps();
    for (i, b) in w.chunks_exact(210).enumerate() {
        // 64 consecutive values per register: `q6k_values`' registers two by two.
        let q32 = q6k_values(b);
        let mut q = [_mm512_setzero_si512(); 4];
        for k in 0..4 {
            q[k] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q32[2 * k]), q32[2 * k + 1]);
        }
        let sc = load128(&b[192..208]);
        let scales = _mm512_permutexvar_epi32(order, _mm512_cvtepi8_epi32(sc));
        let sc16 = _mm256_cvtepi8_epi16(sc);
        let mut totals = [_mm512_setzero_si512(); 4];
        for a in 0..4 {
            let y = &x[a][i];
            let mut lanes = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                // SAFETY: `qs` is 256 bytes: four 64-byte loads.
                let yk = unsafe { _mm512_loadu_si512(y.qs.as_ptr().add(64 * k) as *const _) };
                lanes[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[k], yk);
            }
            let scaled = _mm512_mullo_epi32(sums_of_fours(lanes), scales);
            // SAFETY: `bsums` is 16 i16 = 32 bytes.
            let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, sc16));
            totals[a] = _mm512_sub_epi32(scaled, _mm512_zextsi256_si512(offset));
        }
        let totals = _mm_cvtepi32_ps(hsum4_i32_16(totals));
        let r = _mm_mul_ps(_mm_set1_ps(f16c_at(b, 208)), totals);
        let yd = _mm_setr_ps(x[0][i].d, x[1][i].d, x[2][i].d, x[3][i].d);
        acc = _mm_fmadd_ps(r, yd, acc);
    }
    let mut out = [0.0f32; 4];
    // SAFETY: 4 f32 = 16 bytes.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

/// `ggml_vec_dot_q6_K_q8_K` (the decode form; `blocks_avx2::dot_q6_k`) in 512-bit registers:
/// each register holds two of the AVX2 kernel's 32-value registers (`q6k_values`' order, two by
/// two), `vpmaddubsw` then `vpdpwssd` by the sub-block scales forms what the AVX2 code forms in
/// `maddubs`, `madd` and `add`, and the two halves are added at the end — so each of the eight
/// i32 lanes holds the AVX2 lane's integer, and the float steps (`acc = fma(d, lanes, acc)`, the
/// same horizontal sum) are the same: the same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn dot_q6_k(w: &[u8], x: &[Q8K]) -> f32 {
    let (m15, m_high) = (_mm512_set1_epi8(15), _mm512_set1_epi8(0x30));
    // Per 256-bit half: the shifts that bring a value's two high bits to bits 4..6 — left by 4
    // and 2 (bits 0..2 and 2..4 of `qh`), right by 0 and 2 (bits 4..6 and 6..8).
    let up = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let down = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    // Per register `k`: scale bytes 4k, 4k + 1 (low 256 bits: 16 values each), 4k + 2, 4k + 3.
    let picks: [__m256i; 4] = std::array::from_fn(|k| {
        let b = |i: usize| (4 * k + i) as i8;
        let lane = |i: usize| {
            _mm_set_epi64x(
                i64::from_ne_bytes([b(i + 1) as u8; 8]),
                i64::from_ne_bytes([b(i) as u8; 8]),
            )
        };
        _mm256_set_m128i(lane(2), lane(0))
    });
    let mut acc = _mm256_setzero_ps();
    for (b, y) in w.chunks_exact(210).zip(x) {
        let (ql, qh) = (&b[0..128], &b[128..192]);
        let sc = _mm256_broadcastsi128_si256(load128(&b[192..208]));
        let mut sumi = _mm512_setzero_si512();
        for j in 0..2 {
            let bits = load_at(ql, 64 * j);
            // SAFETY: 32 bytes of `qh` at 32·j.
            let h = _mm512_broadcast_i64x4(unsafe {
                _mm256_loadu_si256(qh.as_ptr().add(32 * j) as *const __m256i)
            });
            let q = [
                _mm512_or_si512(
                    _mm512_and_si512(bits, m15),
                    _mm512_and_si512(_mm512_sllv_epi16(h, up), m_high),
                ),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(bits), m15),
                    _mm512_and_si512(_mm512_srlv_epi16(h, down), m_high),
                ),
            ];
            for (t, q) in q.iter().enumerate() {
                let k = 2 * j + t;
                // SAFETY: 64 activations at 64·k + 64 ≤ 256.
                let y8 = unsafe { _mm512_loadu_si512(y.qs.as_ptr().add(64 * k) as *const _) };
                let scale = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc, picks[k]));
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(*q, y8), scale);
            }
        }
        let lanes = _mm256_add_epi32(
            _mm512_castsi512_si256(sumi),
            _mm512_extracti64x4_epi64::<1>(sumi),
        );
        // The offset of 32, per lane as the AVX2 code takes it out.
        // SAFETY: `bsums` is 16 i16 = 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
        let sc16 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(sc));
        let lanes = _mm256_sub_epi32(
            lanes,
            _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, sc16)),
        );
        let d = y.d * f16c_at(b, 208);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    hsum_float_8(acc)
}

/// Bytes of a super-block of sixteen Q4_K rows in the X16 layout (`packed::interleave_x16`).
pub(super) const Q4K_X16_BLOCK: usize = 16 * 144;

/// One X16 super-block's fields, sixteen rows per register (row `r` in 32-bit lane `r`).
struct X16Fields {
    /// `d · d_y` and `dmin · d_y` come from these: the rows' `d`, then their `dmin`.
    d: __m512,
    dmin: __m512,
    /// Per sub-block `s`: the rows' 6-bit scales.
    scales: [__m512i; 8],
    /// Per 64-value part `j`: the rows' mins of sub-blocks `2j` (low i16) and `2j + 1` (high).
    mins: [__m512i; 4],
}

/// The fields of X16 super-block `b` (2304 bytes): ggml's `scales_k4` unpacking of the 6-bit
/// scales and mins, done for the sixteen rows at once on their three scale words.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn x16_fields(b: &[u8]) -> X16Fields {
    assert!(b.len() >= Q4K_X16_BLOCK);
    let words = load_at(b, 0);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(words)));
    let (u0, u1, u2) = (load_at(b, 64), load_at(b, 128), load_at(b, 192));
    let k1 = _mm512_set1_epi32(0x3f3f_3f3f);
    let k2 = _mm512_set1_epi32(0x0f0f_0f0f);
    let k3 = _mm512_set1_epi32(0x0303_0303);
    // Each word: four 6-bit values as bytes (as `scales_mins_k4`).
    let scales_lo = _mm512_and_si512(u0, k1);
    let scales_hi = _mm512_or_si512(_mm512_and_si512(u2, k2), high_two(u0, k3));
    let mins_lo = _mm512_and_si512(u1, k1);
    let mins_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2),
        high_two(u1, k3),
    );
    let byte = _mm512_set1_epi32(0xFF);
    let mut scales = [_mm512_setzero_si512(); 8];
    for (s, out) in scales.iter_mut().enumerate() {
        let word = if s < 4 { scales_lo } else { scales_hi };
        let shift = _mm512_set1_epi32(8 * (s % 4) as i32);
        *out = _mm512_and_si512(_mm512_srlv_epi32(word, shift), byte);
    }
    let third_byte = _mm512_set1_epi32(0xFF_0000);
    let mut mins = [_mm512_setzero_si512(); 4];
    for (j, out) in mins.iter_mut().enumerate() {
        let word = if j < 2 { mins_lo } else { mins_hi };
        // Bytes 2(j % 2) and 2(j % 2) + 1 of the word as the two i16 halves.
        let t = _mm512_srlv_epi32(word, _mm512_set1_epi32(16 * (j % 2) as i32));
        *out = _mm512_or_si512(
            _mm512_and_si512(t, byte),
            _mm512_and_si512(_mm512_slli_epi32::<8>(t), third_byte),
        );
    }
    X16Fields {
        d,
        dmin,
        scales,
        mins,
    }
}

/// The top two bits of 6-bit values 4..8, which `scales_k4` keeps in bits 6..8 of the bytes
/// of the first two scale words, moved to bits 4..6.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn high_two(u: __m512i, k3: __m512i) -> __m512i {
    _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u), k3))
}

/// Per 64-value part `j` of a super-block's activations: the 32-value sums of sub-blocks `2j`
/// (low i16) and `2j + 1` (high), the pairs `vpdpwssd` multiplies by the mins.
#[inline]
fn sum_pairs(y: &Q8K) -> [i32; 4] {
    let bs = &y.bsums;
    std::array::from_fn(|j| {
        let lo = bs[4 * j] + bs[4 * j + 1];
        let hi = bs[4 * j + 2] + bs[4 * j + 3];
        (lo as u16 as i32) | ((hi as i32) << 16)
    })
}

/// The exact sums `Σ q·y` of part `j` of X16 super-block `b` for `A` activation rows: per
/// sub-block `2j` (low nibbles) and `2j + 1` (high nibbles), one lane per weight row. Per
/// 4-byte group one `vpdpbusd` of the sixteen rows' nibbles by the broadcast activations; the
/// high nibbles are kept in place (`& 0xF0`, sixteen times their value) and the sum shifted
/// back once at the end (exact: every product is a multiple of 16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn x16_part_sums<const A: usize>(b: &[u8], j: usize, y: [&Q8K; A]) -> ([__m512i; A], [__m512i; A]) {
    let (m_lo, m_hi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
    let mut lo = [_mm512_setzero_si512(); A];
    let mut hi = [_mm512_setzero_si512(); A];
    for g in 0..8 {
        let wq = load_at(b, 256 + 64 * (8 * j + g));
        let (q_lo, q_hi) = (_mm512_and_si512(wq, m_lo), _mm512_and_si512(wq, m_hi));
        let at = 64 * j + 4 * g;
        for a in 0..A {
            lo[a] = _mm512_dpbusd_epi32(lo[a], q_lo, broadcast4(&y[a].qs[at..]));
            hi[a] = _mm512_dpbusd_epi32(hi[a], q_hi, broadcast4(&y[a].qs[at + 32..]));
        }
    }
    for h in hi.iter_mut() {
        *h = _mm512_srai_epi32::<4>(*h);
    }
    (lo, hi)
}

/// `dot_q4_k_repacked(w_r, x, false)` (llama.cpp's `gemv_q4_K_8x8`, the decode form) for the
/// sixteen rows of an X16 group (`w`: its super-blocks, 2304 bytes each), each output in a lane
/// of its own: per super-block the exact `isum = Σ sc·Σq·y` and `imin = Σ m·Σy`, then
/// `acc = fma(isum, d·d_y, acc)` and likewise for the mins — the specification's integers and
/// float steps, so its bits, with no sum across lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemv_q4_k_x16(w: &[u8], x: &[Q8K]) -> [f32; 16] {
    assert!(w.len() >= x.len() * Q4K_X16_BLOCK);
    let mut acc = _mm512_setzero_ps();
    let mut acc_min = _mm512_setzero_ps();
    // No closures in the loops: they would not get this function's target features.
    for (i, y) in x.iter().enumerate() {
        let b = &w[Q4K_X16_BLOCK * i..Q4K_X16_BLOCK * (i + 1)];
        let f = x16_fields(b);
        let sums = sum_pairs(y);
        let mut isum = _mm512_setzero_si512();
        let mut imin = _mm512_setzero_si512();
        for j in 0..4 {
            let ([lo], [hi]) = x16_part_sums::<1>(b, j, [y]);
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(lo, f.scales[2 * j]));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(hi, f.scales[2 * j + 1]));
            imin = _mm512_dpwssd_epi32(imin, f.mins[j], _mm512_set1_epi32(sums[j]));
        }
        let yd = _mm512_set1_ps(y.d);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(f.d, yd), acc);
        acc_min = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(f.dmin, yd), acc_min);
    }
    let mut out = [0.0f32; 16];
    // SAFETY: 16 f32 = 64 bytes.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_sub_ps(acc, acc_min)) };
    out
}

/// `dot_q4_k_repacked(w_r, x[a], true)` (llama.cpp's 4-row repacked gemm, the prefill form) for
/// the sixteen rows of an X16 group against `A` activation rows, each output in a lane of its
/// own: per 64-value part `j` of a super-block, the sub-block sums times the scales give
/// `isum_j` and `vpdpwssd` of the mins by the activations' 32-value sums gives `imin_j` — the
/// same integers as the specification — then the same float steps in the same order
/// (`acc = fma(isum_j, d·d_y, acc)`, likewise for the mins), so the same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_q4_k_x16<const A: usize>(w: &[u8], x: [&[Q8K]; A]) -> [[f32; 16]; A] {
    let nb = w.len() / Q4K_X16_BLOCK;
    assert!(x.iter().all(|x| x.len() >= nb));
    let mut acc = [_mm512_setzero_ps(); A];
    let mut acc_min = [_mm512_setzero_ps(); A];
    for i in 0..nb {
        let b = &w[Q4K_X16_BLOCK * i..Q4K_X16_BLOCK * (i + 1)];
        let f = x16_fields(b);
        let y: [&Q8K; A] = std::array::from_fn(|a| &x[a][i]);
        // Per activation row: `d·d_y` and `dmin·d_y`, the multipliers of its float steps.
        let mut scale = [_mm512_setzero_ps(); A];
        let mut scale_min = [_mm512_setzero_ps(); A];
        let mut sums = [[0i32; 4]; A];
        for a in 0..A {
            let yd = _mm512_set1_ps(y[a].d);
            scale[a] = _mm512_mul_ps(f.d, yd);
            scale_min[a] = _mm512_mul_ps(f.dmin, yd);
            sums[a] = sum_pairs(y[a]);
        }
        for j in 0..4 {
            let (lo, hi) = x16_part_sums::<A>(b, j, y);
            for a in 0..A {
                let isum = _mm512_add_epi32(
                    _mm512_mullo_epi32(lo[a], f.scales[2 * j]),
                    _mm512_mullo_epi32(hi[a], f.scales[2 * j + 1]),
                );
                let pairs = _mm512_set1_epi32(sums[a][j]);
                let imin = _mm512_dpwssd_epi32(_mm512_setzero_si512(), f.mins[j], pairs);
                acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale[a], acc[a]);
                acc_min[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), scale_min[a], acc_min[a]);
            }
        }
    }
    let mut out = [[0.0f32; 16]; A];
    for a in 0..A {
        // SAFETY: 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(out[a].as_mut_ptr(), _mm512_sub_ps(acc[a], acc_min[a])) };
    }
    out
}

/// 64 bytes of `b` from byte `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load_at(b: &[u8], at: usize) -> __m512i {
    assert!(at + 64 <= b.len());
    // SAFETY: 64 bytes in bounds (asserted).
    unsafe { _mm512_loadu_si512(b.as_ptr().add(at) as *const _) }
}

/// Four activation bytes repeated in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn broadcast4(q: &[i8]) -> __m512i {
    assert!(q.len() >= 4);
    // SAFETY: four bytes, read unaligned.
    _mm512_set1_epi32(unsafe { (q.as_ptr() as *const i32).read_unaligned() })
}

/// An activation row as `gemm_q4_0_x16` reads it: its Q8_0 blocks and, per block, `−8·Σq`
/// (what Q4_0's unsigned nibbles owe their offset), formed once per matmul instead of once per
/// group of sixteen weight rows.
pub(super) struct Q40Row<'a> {
    pub(super) row: &'a QuantRow,
    offsets: Vec<i32>,
}

impl<'a> Q40Row<'a> {
    pub(super) fn new(row: &'a QuantRow) -> Self {
        let offsets = row
            .quants
            .chunks_exact(BLOCK)
            .map(|b| -8 * b.iter().map(|&q| q as i32).sum::<i32>())
            .collect();
        Q40Row { row, offsets }
    }
}

/// Bytes of a block of sixteen Q4_0 rows' nibbles in the X16 layout (`packed::interleave_x16`:
/// per 4-byte group, the rows' four bytes each; the rows' sixteen scales lie apart).
pub(super) const Q40_X16_BLOCK: usize = 256;

/// `dot_repacked_32` of a Q4_0 weight (llama.cpp's `gemv_q4_0_8x8` and `gemm_q4_0_8x8`, the
/// same float steps) for the sixteen rows of an X16 group — `qs`: its nibble blocks, `d`: its
/// scales, sixteen per block — against `A` activation rows, each output in a lane of its own:
/// per block, `vpdpbusd` adds the unsigned nibbles times broadcast activation groups onto
/// `−8·Σx` (`Q40Row`; so the lane is the exact block sum `Σ (q − 8)·x`), then
/// `acc = fma(isum, d_w·d_x, acc)`: the specification's integers and float steps, so its bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_q4_0_x16<const A: usize>(
    qs: &[u8],
    d: &[f32],
    x: [&Q40Row<'_>; A],
) -> [[f32; 16]; A] {
    let nb = qs.len() / Q40_X16_BLOCK;
    assert!(d.len() >= 16 * nb);
    assert!(x.iter().all(|x| {
        x.row.quants.len() >= BLOCK * nb && x.row.scales.len() >= nb && x.offsets.len() >= nb
    }));
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); A];
    for i in 0..nb {
        // Two chains of `vpdpbusd` per row (low and high nibbles), added at the end: one chain
        // of eight dependent instructions per block was the decode kernel's critical path.
        // Integer sums, so any order gives the same lanes.
        let mut isum: [__m512i; A] = std::array::from_fn(|a| _mm512_set1_epi32(x[a].offsets[i]));
        let mut isum_hi = [_mm512_setzero_si512(); A];
        for g in 0..4 {
            let wq = load_at(qs, Q40_X16_BLOCK * i + 64 * g);
            let lo = _mm512_and_si512(wq, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wq), m4);
            for a in 0..A {
                let q = &x[a].row.quants[BLOCK * i..BLOCK * i + BLOCK];
                isum[a] = _mm512_dpbusd_epi32(isum[a], lo, broadcast4(&q[4 * g..]));
                isum_hi[a] = _mm512_dpbusd_epi32(isum_hi[a], hi, broadcast4(&q[16 + 4 * g..]));
            }
        }
        for a in 0..A {
            isum[a] = _mm512_add_epi32(isum[a], isum_hi[a]);
        }
        // SAFETY: 16 scales at 16·i + 16 ≤ d.len() (asserted above).
        let dw = unsafe { _mm512_loadu_ps(d.as_ptr().add(16 * i)) };
        for a in 0..A {
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(x[a].row.scales[i]));
            acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[a]), scale, acc[a]);
        }
    }
    let mut out = [[0.0f32; 16]; A];
    for a in 0..A {
        // SAFETY: 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(out[a].as_mut_ptr(), acc[a]) };
    }
    out
}

/// `dot_q5_0` (`Q5_1 = false`) or `dot_q5_1` for the sixteen rows of an X16 group (`w`: its
/// blocks re-split by `packed::q5_x16`, 352 or 384 bytes each) against `R` activation rows
/// (decode takes one, prefill two). Each output lives in a 32-bit lane, its eight ggml lanes in
/// eight registers: per block and ggml lane `l`, the rows' nibbles of lane `l` get their fifth
/// bits from `l`'s byte mask in one masked add (once for the `R` rows), and one `vpdpbusd` by
/// an activation row's word `l` broadcast forms the exact lane sum (Q5_0's `q − 16` as
/// `Σ q·y − Σ 16·y`, the second sum the accumulator it starts from); then
/// `fma(d_w · d_x, lane, acc_l)` and, at the end, `hsum_float_8`'s additions across the eight
/// registers (plus Q5_1's `Σ m · s`, fused per block as `dot_q5_1` does). Per output the
/// operations of `dot_q5_0`/`dot_q5_1`, so their bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_q5_x16<const Q5_1: bool, const R: usize>(
    w: &[u8],
    x: [&QuantRow; R],
) -> [[f32; 16]; R] {
    let ty = if Q5_1 { GgmlType::Q5_1 } else { GgmlType::Q5_0 };
    let block = 16 * ty.type_size();
    let blocks = x[0].scales.len();
    assert!(w.len() >= blocks * block);
    for x in x {
        assert!(x.scales.len() == blocks && x.quants.len() >= blocks * BLOCK);
        assert!(!Q5_1 || x.sums.len() >= blocks);
    }
    let (at_qh, at_qs) = crate::packed::q5_x16_offsets(ty);
    let m4 = _mm512_set1_epi8(0x0F);
    let fifth = _mm512_set1_epi8(0x10);
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut mins = [_mm512_setzero_ps(); R];
    // SAFETY: every load is inside the slices (asserted above): block `i`'s fields at their
    // offsets within its `block` bytes, the activations' word `l` of block `i`.
    unsafe {
        for i in 0..blocks {
            let b = w.as_ptr().add(i * block);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b as *const __m256i));
            let m = match Q5_1 {
                true => _mm512_cvtph_ps(_mm256_loadu_si256(b.add(32) as *const __m256i)),
                false => _mm512_setzero_ps(),
            };
            let mut scale = [_mm512_setzero_ps(); R];
            // Q5_0: each ggml lane's −Σ 16·y, where its integer sum starts.
            let mut start = [[0i32; 8]; R];
            for r in 0..R {
                scale[r] = _mm512_mul_ps(dw, _mm512_set1_ps(*x[r].scales.get_unchecked(i)));
                if Q5_1 {
                    let s = _mm512_set1_ps(*x[r].sums.get_unchecked(i));
                    mins[r] = _mm512_fmadd_ps(m, s, mins[r]);
                } else {
                    let y = _mm256_loadu_si256(x[r].quants.as_ptr().add(BLOCK * i) as *const _);
                    let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(16), y);
                    let s = _mm256_sub_epi32(_mm256_setzero_si256(), s);
                    _mm256_storeu_si256(start[r].as_mut_ptr() as *mut __m256i, s);
                }
            }
            for l in 0..8 {
                let qs = _mm512_loadu_si512(b.add(at_qs + 64 * (l % 4)) as *const _);
                let nib = match l < 4 {
                    true => _mm512_and_si512(qs, m4),
                    false => _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4),
                };
                let mask = (b.add(at_qh + 8 * l) as *const u64).read_unaligned();
                let q = _mm512_mask_add_epi8(nib, mask, nib, fifth);
                for r in 0..R {
                    let y = x[r].quants.as_ptr().add(BLOCK * i + 4 * l);
                    let y = _mm512_set1_epi32((y as *const i32).read_unaligned());
                    let lane = _mm512_dpbusd_epi32(_mm512_set1_epi32(start[r][l]), q, y);
                    acc[r][l] = _mm512_fmadd_ps(scale[r], _mm512_cvtepi32_ps(lane), acc[r][l]);
                }
            }
        }
    }
    let mut out = [[0.0f32; 16]; R];
    for r in 0..R {
        let sums = super::vnni::hsum8_across(&acc[r]);
        let sums = if Q5_1 {
            _mm512_add_ps(sums, mins[r])
        } else {
            sums
        };
        // SAFETY: `out[r]` holds sixteen f32.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), sums) };
    }
    out
}
