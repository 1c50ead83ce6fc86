//! K-quant and Q4_0 kernels on CPUs with AVX-512 VNNI: the same bits as `blocks_avx2.rs` and
//! `blocks32_avx2.rs`, fewer instructions per product.
//!
//! What fixes an output's bits is ggml's float steps on exact integer sums; the integers may be
//! formed by any instructions. Two ways here, both on `vpdpbusd` (unsigned weight × signed
//! activation, four products per i32 lane):
//! - Q4_K and Q4_0 prefill (`gemm_q4_k_x16`, `gemm_q4_0_x16`): sixteen weight rows side by side
//!   (`Q4kX16`, `Q40X16`, built per matmul task), each 32-bit lane one output, the activations
//!   broadcast — no sums across lanes at all;
//! - Q6_K's tiled 4-row form: one weight row, 64 values per instruction, the lanes gathered
//!   into sub-block sums by a shuffle tree (`sums_of_fours`) and scaled by one `vpmulld`.
//!
//! Each kernel is tested against the scalar specification (`blocks/tests.rs`, `qmatmul.rs`).

use std::arch::x86_64::*;

use super::blocks::Q8K;
use super::blocks_avx2::{f16c_at, hsum_i32_8, load128, q6k_values};
use super::qmatmul::QuantRow;
use crate::packed::BLOCK;

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

/// Sixteen Q4_K weight rows laid out for `gemm_q4_k_x16`: per super-block, every field holds
/// the sixteen rows' values side by side, row `r` in 32-bit lane `r`, so one 512-bit
/// instruction works on all sixteen outputs and no lanes need summing across (llama.cpp's
/// `block_q4_Kx8` idea, sixteen rows wide for 512-bit registers). Built per matmul task from
/// the file's rows: a few tens of KB, reused by every activation row of the task.
pub(super) struct Q4kX16 {
    blocks: Vec<Q4kX16Block>,
}

#[repr(C, align(64))]
struct Q4kX16Block {
    d: [f32; 16],
    dmin: [f32; 16],
    /// Per sub-block: the rows' 6-bit scales.
    scales: [[i32; 16]; 8],
    /// Per 64-value part `j`: the rows' mins of sub-blocks `2j` (low i16) and `2j + 1` (high).
    mins: [[i32; 16]; 4],
    /// Per 4-byte group of the 128 nibble bytes: the rows' four bytes, row `r` at `4r..4r + 4`.
    qs: [[u8; 64]; 32],
}

impl Q4kX16 {
    /// `rows`: sixteen rows of the same number of Q4_K super-blocks, as in the file.
    pub(super) fn new(rows: [&[u8]; 16]) -> Self {
        let nb = rows[0].len() / 144;
        assert!(rows.iter().all(|r| r.len() == nb * 144));
        let blocks = (0..nb)
            .map(|i| {
                let mut out = Q4kX16Block {
                    d: [0.0; 16],
                    dmin: [0.0; 16],
                    scales: [[0; 16]; 8],
                    mins: [[0; 16]; 4],
                    qs: [[0; 64]; 32],
                };
                for (r, row) in rows.iter().enumerate() {
                    let b = &row[144 * i..144 * (i + 1)];
                    out.d[r] = super::blocks::f16_at(b, 0);
                    out.dmin[r] = super::blocks::f16_at(b, 2);
                    let (sc, mn) = super::blocks::scales_k4(&b[4..16]);
                    for s in 0..8 {
                        out.scales[s][r] = sc[s];
                    }
                    for j in 0..4 {
                        out.mins[j][r] = mn[2 * j] | (mn[2 * j + 1] << 16);
                    }
                    for (g, group) in out.qs.iter_mut().enumerate() {
                        group[4 * r..4 * r + 4].copy_from_slice(&b[16 + 4 * g..20 + 4 * g]);
                    }
                }
                out
            })
            .collect();
        Self { blocks }
    }
}

/// `dot_q4_k_repacked(w_r, x[a], true)` (llama.cpp's 4-row repacked gemm) for sixteen weight
/// rows against four activation rows, each output in a lane of its own. Per 64-value part `j`
/// of a super-block, `vpdpbusd` adds four products of each row's nibbles and a broadcast group
/// of the activations into the row's lane; the sub-block sums times the scales give `isum_j`
/// and `vpdpwssd` of the mins by the activations' 32-value sums gives `imin_j`: the same
/// integers as the specification, then the same float steps in the same order
/// (`acc = fma(isum_j, dw·d_y, acc)`, likewise for the mins), so the same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_q4_k_x16(w: &Q4kX16, x: [&[Q8K]; 4]) -> [[f32; 16]; 4] {
    assert!(x.iter().all(|x| x.len() >= w.blocks.len()));
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut acc_min = [_mm512_setzero_ps(); 4];
    // No closures in here: they would not get this function's target features, so not inline.
    for (i, b) in w.blocks.iter().enumerate() {
        // Per activation row: `dw·d_y` and `dmin·d_y`, the multipliers of its float steps.
        let mut scale = [_mm512_setzero_ps(); 4];
        let mut scale_min = [_mm512_setzero_ps(); 4];
        for a in 0..4 {
            let yd = _mm512_set1_ps(x[a][i].d);
            scale[a] = _mm512_mul_ps(load_ps(&b.d), yd);
            scale_min[a] = _mm512_mul_ps(load_ps(&b.dmin), yd);
        }
        // Per activation row: its 32-value sums, two per i32 (sub-blocks 2j, 2j + 1).
        let mut sums = [[0i32; 4]; 4];
        for a in 0..4 {
            let bs = &x[a][i].bsums;
            for j in 0..4 {
                let lo = bs[4 * j] + bs[4 * j + 1];
                let hi = bs[4 * j + 2] + bs[4 * j + 3];
                sums[a][j] = (lo as u16 as i32) | ((hi as i32) << 16);
            }
        }
        for j in 0..4 {
            let mut lo_sums = [_mm512_setzero_si512(); 4];
            let mut hi_sums = [_mm512_setzero_si512(); 4];
            for g in 0..8 {
                let wq = load_bytes(&b.qs[8 * j + g]);
                let lo = _mm512_and_si512(wq, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wq), m4);
                let at = 64 * j + 4 * g;
                for a in 0..4 {
                    let qs = &x[a][i].qs;
                    lo_sums[a] = _mm512_dpbusd_epi32(lo_sums[a], lo, broadcast4(&qs[at..at + 4]));
                    hi_sums[a] =
                        _mm512_dpbusd_epi32(hi_sums[a], hi, broadcast4(&qs[at + 32..at + 36]));
                }
            }
            let (sc_lo, sc_hi) = (load_i32(&b.scales[2 * j]), load_i32(&b.scales[2 * j + 1]));
            let mins = load_i32(&b.mins[j]);
            for a in 0..4 {
                let isum = _mm512_add_epi32(
                    _mm512_mullo_epi32(lo_sums[a], sc_lo),
                    _mm512_mullo_epi32(hi_sums[a], sc_hi),
                );
                let pairs = _mm512_set1_epi32(sums[a][j]);
                let imin = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins, pairs);
                acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale[a], acc[a]);
                acc_min[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), scale_min[a], acc_min[a]);
            }
        }
    }
    let mut out = [[0.0f32; 16]; 4];
    for a in 0..4 {
        // SAFETY: 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(out[a].as_mut_ptr(), _mm512_sub_ps(acc[a], acc_min[a])) };
    }
    out
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load_ps(v: &[f32; 16]) -> __m512 {
    // SAFETY: 16 f32 = 64 bytes.
    unsafe { _mm512_loadu_ps(v.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load_i32(v: &[i32; 16]) -> __m512i {
    // SAFETY: 16 i32 = 64 bytes.
    unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load_bytes(v: &[u8; 64]) -> __m512i {
    // SAFETY: 64 bytes.
    unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) }
}

/// Four activation bytes repeated in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn broadcast4(q: &[i8]) -> __m512i {
    assert!(q.len() >= 4);
    // SAFETY: four bytes, read unaligned.
    _mm512_set1_epi32(unsafe { (q.as_ptr() as *const i32).read_unaligned() })
}

/// Sixteen Q4_0 weight rows (the split layout: nibbles, f32 scales apart) laid out for
/// `gemm_q4_0_x16`, row `r` in 32-bit lane `r` of every field, as `Q4kX16`.
pub(super) struct Q40X16 {
    blocks: Vec<Q40X16Block>,
}

#[repr(C, align(64))]
struct Q40X16Block {
    d: [f32; 16],
    /// Per 4-byte group of the 16 nibble bytes: the rows' four bytes, row `r` at `4r..4r + 4`.
    qs: [[u8; 64]; 4],
}

impl Q40X16 {
    /// `quants`: sixteen rows' nibbles (16 bytes per block); `scales`: their block scales.
    pub(super) fn new(quants: [&[u8]; 16], scales: [&[f32]; 16]) -> Self {
        let nb = scales[0].len();
        assert!((0..16).all(|r| quants[r].len() == 16 * nb && scales[r].len() == nb));
        let blocks = (0..nb)
            .map(|i| {
                let mut out = Q40X16Block {
                    d: std::array::from_fn(|r| scales[r][i]),
                    qs: [[0; 64]; 4],
                };
                for (r, row) in quants.iter().enumerate() {
                    for (g, group) in out.qs.iter_mut().enumerate() {
                        let at = 16 * i + 4 * g;
                        group[4 * r..4 * r + 4].copy_from_slice(&row[at..at + 4]);
                    }
                }
                out
            })
            .collect();
        Self { blocks }
    }
}

/// `dot_repacked_32` of a Q4_0 weight (llama.cpp's `gemm_q4_0_8x8`) for sixteen weight rows
/// against four activation rows, each output in a lane of its own: per block, `vpdpbusd` adds
/// the unsigned nibbles times broadcast activation groups onto `−8·Σx` (so the lane is the
/// exact block sum `Σ (q − 8)·x`), then `acc = fma(isum, d_w·d_x, acc)`: the specification's
/// integers and float steps, so its bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_q4_0_x16(w: &Q40X16, x: [&QuantRow; 4]) -> [[f32; 16]; 4] {
    let nb = w.blocks.len();
    assert!(
        x.iter()
            .all(|x| x.quants.len() >= BLOCK * nb && x.scales.len() >= nb)
    );
    let m4 = _mm512_set1_epi8(0x0F);
    let ones = _mm256_set1_epi8(1);
    let mut acc = [_mm512_setzero_ps(); 4];
    for (i, b) in w.blocks.iter().enumerate() {
        let mut isum = [_mm512_setzero_si512(); 4];
        for a in 0..4 {
            // SAFETY: block i's 32 activations are in `quants` (asserted above).
            let y = unsafe {
                _mm256_loadu_si256(x[a].quants.as_ptr().add(BLOCK * i) as *const __m256i)
            };
            let total = hsum_i32_8(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, y));
            isum[a] = _mm512_set1_epi32(-8 * total);
        }
        for g in 0..4 {
            let wq = load_bytes(&b.qs[g]);
            let lo = _mm512_and_si512(wq, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wq), m4);
            for a in 0..4 {
                let q = &x[a].quants[BLOCK * i..BLOCK * i + BLOCK];
                isum[a] = _mm512_dpbusd_epi32(isum[a], lo, broadcast4(&q[4 * g..]));
                isum[a] = _mm512_dpbusd_epi32(isum[a], hi, broadcast4(&q[16 + 4 * g..]));
            }
        }
        let d = load_ps(&b.d);
        for a in 0..4 {
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(x[a].scales[i]));
            acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[a]), scale, acc[a]);
        }
    }
    let mut out = [[0.0f32; 16]; 4];
    for a in 0..4 {
        // SAFETY: 16 f32 = 64 bytes.
        unsafe { _mm512_storeu_ps(out[a].as_mut_ptr(), acc[a]) };
    }
    out
}
