//! The quantized matmuls on CPUs with AVX-512 VNNI: the same per-output arithmetic as
//! `dot_scalar` (ggml's), with the loops reordered so that each loaded weight block serves several
//! activation rows (prefill) and each instruction serves two outputs.
//!
//! What stays fixed per output `(i, j)`: the 8 lanes of exact integer sums of 4 products per
//! block, one `fma(d_w * d_x, lane, acc)` per block in block order, `hsum_float_8`, then Q4_1's
//! `+ Σ fma(m_w, s_x)`. Integer sums are exact whichever instruction forms them, so they are taken
//! with `vpdpbusd` (unsigned × signed bytes, 4 products per i32 lane): the weight is made unsigned
//! by an offset (`w + 128` for Q8_0; Q4_0's nibbles are already `w + 8`) and the offset's
//! contribution, `-offset · Σx` over the lane's 4 activations, is the lane's starting value.
//!
//! Prefill: a 512-bit register holds two outputs' 8 lanes, two activation rows against one weight
//! row (`Pairs`). Lanes never mix, so each output sees exactly the scalar specification's
//! operations in its order. Decode (one activation row, `Row`): one weight row at a time in
//! memory order, one block per 256-bit register.

use std::arch::x86_64::*;

use half::f16;
use rayon::prelude::*;

use super::Format;
use crate::packed::BLOCK;

/// Can this CPU run this module's kernels?
pub(super) fn available() -> bool {
    super::cpu_level() >= super::CpuLevel::Avx512
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
}

/// One block of two activation rows, as the kernels read it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PairBlock {
    /// The two rows' 32 quants, side by side.
    q: [i8; 64],
    /// Per i32 lane: `-offset · Σ` of the lane's 4 quants (see the module doc).
    bias: [i32; 16],
    /// The rows' scales, each repeated over its 8 lanes.
    d: [f32; 16],
}

/// Activations quantized to ggml's Q8_0 / Q8_1 blocks, rows taken two at a time (an odd last
/// row is paired with itself; its twin is computed and not stored).
struct Pairs {
    m: usize,
    blocks: usize,
    /// `[pair][block]`.
    data: Vec<PairBlock>,
    /// Q8_1's `f16(d · Σq)` (what Q4_1's mins multiply), `[block][row]`, rows padded to a
    /// multiple of 8 with zeros.
    sums: Vec<f32>,
    rows_padded: usize,
}

/// How much the weight's unsigned form exceeds its value.
fn offset(format: Format) -> i32 {
    match format {
        Format::Q8_0 => 128,
        Format::Q4_0 => 8,
        Format::Q4_1 => 0,
    }
}

/// `quantize_row_impl` (the specification) block by block through `quantize_block`.
pub(super) fn quantize_row(x: &[f32]) -> super::QuantRow {
    let nb = x.len() / BLOCK;
    let mut row = super::QuantRow {
        quants: vec![0; nb * BLOCK],
        scales: vec![0.0; nb],
        sums: vec![0.0; nb],
    };
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        // SAFETY: callers checked `available()`.
        let (q, d, _, s) = unsafe { quantize_block(block) };
        row.quants[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&q);
        row.scales[b] = d;
        row.sums[b] = s;
    }
    row
}

/// ggml's `quantize_row_q8_0`/`q8_1` on one block (see `quantize_row_impl`, the specification):
/// the quants, `f16(amax / 127)`, the 8 lane sums of 4 quants, and `f16(d · Σq)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
fn quantize_block(x: &[f32]) -> ([i8; 32], f32, [i32; 8], f32) {
    assert_eq!(x.len(), BLOCK);
    // SAFETY: x holds 32 floats (asserted); the stores write local arrays of the stored size.
    unsafe {
        let a = _mm512_loadu_ps(x.as_ptr());
        let b = _mm512_loadu_ps(x.as_ptr().add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        // Round half to even (`vrndscaleps` mode 0), then the exact conversion of small integers.
        let qa = _mm512_cvtps_epi32(_mm512_roundscale_ps::<0x08>(_mm512_mul_ps(a, id)));
        let qb = _mm512_cvtps_epi32(_mm512_roundscale_ps::<0x08>(_mm512_mul_ps(b, id)));
        let mut q = [0i8; 32];
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(
            q.as_mut_ptr().add(16) as *mut __m128i,
            _mm512_cvtsepi32_epi8(qb),
        );
        let qv = _mm256_loadu_si256(q.as_ptr() as *const __m256i);
        let lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), qv);
        let mut s4 = [0i32; 8];
        _mm256_storeu_si256(s4.as_mut_ptr() as *mut __m256i, lanes);
        let sum: i32 = s4.iter().sum();
        let s = f16::from_f32(d * sum as f32).to_f32();
        (q, f16::from_f32(d).to_f32(), s4, s)
    }
}

impl Pairs {
    fn quantize(x: &[f32], m: usize, k: usize, format: Format) -> Pairs {
        let blocks = k / BLOCK;
        let pairs = m.div_ceil(2);
        let rows_padded = (2 * pairs).div_ceil(8) * 8;
        let off = offset(format);
        let empty = PairBlock {
            q: [0; 64],
            bias: [0; 16],
            d: [0.0; 16],
        };
        let mut data = vec![empty; pairs * blocks];
        let mut pair_sums = vec![[0.0f32; 2]; pairs * blocks];
        let work = |(p, (dst, sums)): (usize, (&mut [PairBlock], &mut [[f32; 2]]))| {
            for half in 0..2 {
                let i = (2 * p + half).min(m - 1);
                let row = &x[i * k..(i + 1) * k];
                for (b, (blk, s)) in dst.iter_mut().zip(sums.iter_mut()).enumerate() {
                    // SAFETY: `available()` was checked before any `Pairs` is built.
                    let (q, d, s4, sum) =
                        unsafe { quantize_block(&row[b * BLOCK..(b + 1) * BLOCK]) };
                    blk.q[32 * half..32 * half + 32].copy_from_slice(&q);
                    for l in 0..8 {
                        blk.bias[8 * half + l] = -off * s4[l];
                        blk.d[8 * half + l] = d;
                    }
                    s[half] = sum;
                }
            }
        };
        if pairs > 1 {
            data.par_chunks_mut(blocks)
                .zip(pair_sums.par_chunks_mut(blocks))
                .enumerate()
                .for_each(work);
        } else {
            work((0, (&mut data, &mut pair_sums)));
        }
        let mut sums = Vec::new();
        if format == Format::Q4_1 {
            sums = vec![0.0f32; blocks * rows_padded];
            for i in 0..m {
                for b in 0..blocks {
                    sums[b * rows_padded + i] = pair_sums[(i / 2) * blocks + b][i % 2];
                }
            }
        }
        Pairs {
            m,
            blocks,
            data,
            sums,
            rows_padded,
        }
    }
}

/// One activation row (decode), compact: a block's operands are 32 quant bytes, 8 lane biases
/// and a scale, in three arrays that stay in L1 (`PairBlock` would hold each twice, 192 bytes).
struct Row {
    /// `[k]` quants.
    q: Vec<i8>,
    /// `[blocks][8]` lane biases (see `PairBlock::bias`).
    bias: Vec<i32>,
    /// `[blocks]` scales.
    d: Vec<f32>,
    /// `[blocks]` Q8_1 sums (Q4_1 only).
    sums: Vec<f32>,
}

impl Row {
    /// `x[k]` quantized as ggml's Q8_0 / Q8_1 blocks (`quantize_block`), with each lane's
    /// `-offset · Σ` for `format`.
    fn quantize(x: &[f32], format: Format) -> Row {
        let blocks = x.len() / BLOCK;
        let off = offset(format);
        let mut row = Row {
            q: Vec::with_capacity(blocks * BLOCK),
            bias: Vec::with_capacity(blocks * 8),
            d: Vec::with_capacity(blocks),
            sums: Vec::new(),
        };
        for block in x.chunks_exact(BLOCK) {
            // SAFETY: `available()` was checked before any `Row` is built.
            let (q, d, s4, sum) = unsafe { quantize_block(block) };
            row.q.extend_from_slice(&q);
            row.bias.extend(s4.iter().map(|s| -off * s));
            row.d.push(d);
            if format == Format::Q4_1 {
                row.sums.push(sum);
            }
        }
        row
    }
}

/// A matmul's activations as its kernels read them.
enum Acts {
    Row(Row),
    Pairs(Pairs),
}

/// The weight operands of one matmul.
#[derive(Clone, Copy)]
pub(super) struct Weights<'a> {
    pub bytes: &'a [u8],
    pub scales: &'a [f32],
    /// Q4_1's per-block offsets (empty otherwise).
    pub mins: &'a [f32],
    /// Output columns (weight rows).
    pub n: usize,
    /// Q8_0 in the X16 layout (`packed::RowLayout::X16`): each group of sixteen rows' blocks
    /// transposed word by word, the scales alike; `n` a multiple of 16.
    pub x16: bool,
}

/// `[u8; 64]` of weight block `b` of row `j` placed in both 256-bit halves, unsigned.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
unsafe fn weight_both_halves<const F: usize>(p: *const u8) -> __m512i {
    unsafe {
        if F == 0 {
            let w = _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
            _mm512_xor_si512(w, _mm512_set1_epi8(0x80u8 as i8))
        } else {
            // Low nibbles are elements 0..16, high nibbles 16..32.
            let v = _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i));
            let hi = _mm512_srli_epi16::<4>(v);
            _mm512_and_si512(
                _mm512_mask_blend_epi64(0b1100_1100, v, hi),
                _mm512_set1_epi8(0x0F),
            )
        }
    }
}

/// ggml's `hsum_float_8` of each 256-bit half: `(a[i] + a[i+4])`, then `(r0 + r2) + (r1 + r3)`
/// (float addition is commutative, so the shuffled operand order gives the same bits).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
unsafe fn hsum8_halves(acc: __m512) -> [f32; 2] {
    let r = _mm512_add_ps(acc, _mm512_shuffle_f32x4::<0b10_11_00_01>(acc, acc));
    let r = _mm512_add_ps(r, _mm512_permute_ps::<0b01_00_11_10>(r));
    let r = _mm512_add_ps(r, _mm512_permute_ps::<0b10_11_00_01>(r));
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), r) };
    [lanes[0], lanes[8]]
}

/// Where a tile's outputs go: `out[i * n + j]`, written by several threads at disjoint columns.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    m: usize,
    n: usize,
}
// SAFETY: tasks write disjoint column ranges of the buffer, which outlives the parallel loop.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// Output columns `j0..j0 + RM` (clamped: past `n` the last column is recomputed and not
/// stored) against activation pairs `p0..p0 + RP`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
unsafe fn tile_pairs<const F: usize, const RM: usize, const RP: usize>(
    x: &Pairs,
    w: &Weights,
    j0: usize,
    p0: usize,
    out: Out,
) {
    let blocks = x.blocks;
    let bb = if F == 0 { BLOCK } else { BLOCK / 2 };
    let cols: [usize; RM] = std::array::from_fn(|r| (j0 + r).min(w.n - 1));
    assert!(p0 + RP <= x.data.len() / blocks);
    assert!(w.bytes.len() >= w.n * blocks * bb && w.scales.len() >= w.n * blocks);
    assert!(F != 2 || (w.mins.len() >= w.n * blocks && 2 * p0 + 8 <= x.rows_padded));
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); RP]; RM];
        let mut mins = [_mm256_setzero_ps(); RM];
        let xs = x.data.as_ptr().add(p0 * blocks);
        for b in 0..blocks {
            let mut wv = [_mm512_setzero_si512(); RM];
            let mut sw = [_mm512_setzero_ps(); RM];
            for r in 0..RM {
                wv[r] = weight_both_halves::<F>(w.bytes.as_ptr().add((cols[r] * blocks + b) * bb));
                sw[r] = _mm512_set1_ps(*w.scales.get_unchecked(cols[r] * blocks + b));
            }
            for pp in 0..RP {
                let blk = &*xs.add(pp * blocks + b);
                let xq = _mm512_load_si512(blk.q.as_ptr() as *const __m512i);
                let bias = _mm512_load_si512(blk.bias.as_ptr() as *const __m512i);
                let xd = _mm512_load_ps(blk.d.as_ptr());
                for r in 0..RM {
                    let q = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, wv[r], xq));
                    acc[r][pp] = _mm512_fmadd_ps(_mm512_mul_ps(sw[r], xd), q, acc[r][pp]);
                }
            }
            if F == 2 {
                let s = _mm256_loadu_ps(x.sums.as_ptr().add(b * x.rows_padded + 2 * p0));
                for r in 0..RM {
                    let mw = _mm256_set1_ps(*w.mins.get_unchecked(cols[r] * blocks + b));
                    mins[r] = _mm256_fmadd_ps(mw, s, mins[r]);
                }
            }
        }
        for r in 0..RM {
            if j0 + r >= w.n {
                break;
            }
            let mut m8 = [0.0f32; 8];
            _mm256_storeu_ps(m8.as_mut_ptr(), mins[r]);
            for pp in 0..RP {
                let y = hsum8_halves(acc[r][pp]);
                for (h, y) in y.into_iter().enumerate() {
                    let i = 2 * (p0 + pp) + h;
                    if i < out.m {
                        let v = if F == 2 { y + m8[2 * pp + h] } else { y };
                        *out.ptr.add(i * out.n + j0 + r) = v;
                    }
                }
            }
        }
    }
}

/// Weight block `b` of one row as 32 unsigned bytes in a 256-bit register (`weight_both_halves`
/// for one half).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
unsafe fn weight_block<const F: usize>(p: *const u8) -> __m256i {
    unsafe {
        if F == 0 {
            _mm256_xor_si256(
                _mm256_loadu_si256(p as *const __m256i),
                _mm256_set1_epi8(0x80u8 as i8),
            )
        } else {
            // Low nibbles are elements 0..16, high nibbles 16..32.
            let v = _mm_loadu_si128(p as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        }
    }
}

/// Output `j` for a single activation row: the row's blocks in memory order, one block per
/// 256-bit `vpdpbusd` and one FMA chain — per output the operations of `tile_pairs`. One weight
/// stream per call: two weight rows per 512-bit register (the earlier decode tile, two streams
/// 2 KiB apart on a 1B model) read 20 GB/s on a Zen 4 EPYC where this reads 29 (2 threads, 64 MB).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
unsafe fn row_dot<const F: usize>(x: &Row, w: &Weights, j: usize) -> f32 {
    let blocks = x.d.len();
    let bb = if F == 0 { BLOCK } else { BLOCK / 2 };
    assert!(j < w.n && x.q.len() >= blocks * BLOCK && x.bias.len() >= blocks * 8);
    assert!(w.bytes.len() >= w.n * blocks * bb && w.scales.len() >= w.n * blocks);
    assert!(F != 2 || (w.mins.len() >= w.n * blocks && x.sums.len() >= blocks));
    unsafe {
        let wq = w.bytes.as_ptr().add(j * blocks * bb);
        let ws = w.scales.as_ptr().add(j * blocks);
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0.0f32;
        for b in 0..blocks {
            let wv = weight_block::<F>(wq.add(b * bb));
            let xq = _mm256_loadu_si256(x.q.as_ptr().add(b * BLOCK) as *const __m256i);
            let bias = _mm256_loadu_si256(x.bias.as_ptr().add(b * 8) as *const __m256i);
            let q = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(bias, wv, xq));
            let scale = *ws.add(b) * *x.d.get_unchecked(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), q, acc);
            if F == 2 {
                let m = *w.mins.get_unchecked(j * blocks + b);
                mins = m.mul_add(*x.sums.get_unchecked(b), mins);
            }
        }
        let y = super::blocks_avx2::hsum_float_8(acc);
        if F == 2 { y + mins } else { y }
    }
}

/// Outputs of one X16 group of a Q8_0 weight for a single activation row (decode): `bytes`,
/// per block, the sixteen rows' eight quant words side by side (512 bytes); `scales`, per
/// block, their sixteen scales. Each output lives in a 32-bit lane, its eight ggml lanes in
/// eight registers: per block and lane `l`, one `vpdpbusd` of the rows' word `l` (made
/// unsigned, `w + 128`) by the activations' word `l` broadcast, from the lane's bias — the
/// exact lane sum of `row_dot` — then `fma(d_w · d_x, lane, acc_l)`; at the end
/// `hsum_float_8`'s additions across the eight registers. Per output the operations of
/// `row_dot`, so its bits, with no sum across lanes and one weight stream per group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn row_x16(x: &Row, bytes: &[u8], scales: &[f32]) -> [f32; 16] {
    let blocks = x.d.len();
    assert!(bytes.len() >= blocks * 16 * BLOCK && scales.len() >= blocks * 16);
    assert!(x.q.len() >= blocks * BLOCK && x.bias.len() >= blocks * 8);
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [_mm512_setzero_ps(); 8];
    // SAFETY: every load is inside the slices (asserted above).
    unsafe {
        for b in 0..blocks {
            let dw = _mm512_loadu_ps(scales.as_ptr().add(16 * b));
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(b)));
            for (l, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_loadu_si512(bytes.as_ptr().add(16 * BLOCK * b + 64 * l) as *const _);
                let xw = (x.q.as_ptr().add(BLOCK * b + 4 * l) as *const i32).read_unaligned();
                let bias = _mm512_set1_epi32(*x.bias.get_unchecked(8 * b + l));
                let lane =
                    _mm512_dpbusd_epi32(bias, _mm512_xor_si512(w, flip), _mm512_set1_epi32(xw));
                *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(lane), *acc);
            }
        }
        let mut out = [0.0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), hsum8_across(&acc));
        out
    }
}

/// `hsum_float_8` of each lane's eight registers (the X16 kernels keep an output's eight ggml
/// lanes in eight registers): `(a[i] + a[i + 4])`, then `(r0 + r2) + (r1 + r3)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
pub(super) fn hsum8_across(acc: &[__m512; 8]) -> __m512 {
    let t: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(acc[i + 4], acc[i]));
    _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]))
}

/// `row_x16` for activation pair `p` (prefill): the same operations per output as `tile_pairs`
/// (`fma(d_w · d_x, lane, acc)` per block, then `hsum_float_8`), sixteen outputs per register
/// and eight registers per activation row, each weight word loaded once for both rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn pair_x16(x: &Pairs, p: usize, bytes: &[u8], scales: &[f32]) -> [[f32; 16]; 2] {
    let blocks = x.blocks;
    assert!(bytes.len() >= blocks * 16 * BLOCK && scales.len() >= blocks * 16);
    let xs = &x.data[p * blocks..(p + 1) * blocks];
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [[_mm512_setzero_ps(); 8]; 2];
    // SAFETY: every load is inside the slices (asserted above; `PairBlock`'s arrays are read
    // at fixed offsets within their sizes).
    unsafe {
        for (b, blk) in xs.iter().enumerate() {
            let dw = _mm512_loadu_ps(scales.as_ptr().add(16 * b));
            let mut w = [_mm512_setzero_si512(); 8];
            for (l, w) in w.iter_mut().enumerate() {
                let v = _mm512_loadu_si512(bytes.as_ptr().add(16 * BLOCK * b + 64 * l) as *const _);
                *w = _mm512_xor_si512(v, flip);
            }
            for (h, acc) in acc.iter_mut().enumerate() {
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(blk.d[8 * h]));
                for l in 0..8 {
                    let xw = (blk.q.as_ptr().add(32 * h + 4 * l) as *const i32).read_unaligned();
                    let bias = _mm512_set1_epi32(blk.bias[8 * h + l]);
                    let lane = _mm512_dpbusd_epi32(bias, w[l], _mm512_set1_epi32(xw));
                    acc[l] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(lane), acc[l]);
                }
            }
        }
        let mut out = [[0.0f32; 16]; 2];
        for (acc, out) in acc.iter().zip(out.iter_mut()) {
            _mm512_storeu_ps(out.as_mut_ptr(), hsum8_across(acc));
        }
        out
    }
}

/// Weight rows per tile (prefill) and activation pairs per tile.
const RM: usize = 4;
const RP: usize = 4;
/// Output columns per parallel task.
const TASK_COLS: usize = 16;

/// `y[m, n] = x[m, k] · Wᵀ` for a quantized `W`, every output bit-identical to `dot_scalar`.
/// The caller checks `available()`.
pub(super) fn matmul(format: Format, x: &[f32], m: usize, k: usize, w: Weights) -> Vec<f32> {
    assert!(available());
    // Decode quantizes its one row compactly; prefill takes the rows in pairs.
    let acts = match m {
        1 => Acts::Row(Row::quantize(&x[..k], format)),
        _ => Acts::Pairs(Pairs::quantize(x, m, k, format)),
    };
    let mut y = vec![0.0f32; m * w.n];
    let out = Out {
        ptr: y.as_mut_ptr(),
        m,
        n: w.n,
    };
    assert!(!w.x16 || (format == Format::Q8_0 && w.n.is_multiple_of(TASK_COLS)));
    let task = |t: usize| {
        let (c0, c1) = (t * TASK_COLS, ((t + 1) * TASK_COLS).min(w.n));
        if w.x16 {
            // A task is one X16 group: its sixteen rows' blocks and scales.
            let bytes = &w.bytes[c0 * k..c1 * k];
            let scales = &w.scales[c0 * (k / BLOCK)..c1 * (k / BLOCK)];
            match &acts {
                Acts::Row(row) => {
                    // SAFETY: the CPU has the features (asserted above).
                    let y = unsafe { row_x16(row, bytes, scales) };
                    // SAFETY: the task writes only its columns c0..c1 of `y` (m = 1).
                    unsafe { std::ptr::copy_nonoverlapping(y.as_ptr(), out.ptr.add(c0), 16) };
                }
                Acts::Pairs(pairs) => {
                    for p in 0..pairs.data.len() / pairs.blocks {
                        // SAFETY: the CPU has the features (asserted above).
                        let y = unsafe { pair_x16(pairs, p, bytes, scales) };
                        for (h, y) in y.iter().enumerate() {
                            let i = 2 * p + h;
                            if i < m {
                                // SAFETY: row i's columns c0..c1 of `y`: this task's alone.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        y.as_ptr(),
                                        out.ptr.add(i * out.n + c0),
                                        16,
                                    )
                                };
                            }
                        }
                    }
                }
            }
            return;
        }
        // SAFETY: the CPU has the features (asserted above); tiles stay inside the operands
        // (asserted in the tiles) and each task writes only its columns c0..c1 of `y`.
        unsafe {
            match (format, &acts) {
                (Format::Q8_0, Acts::Row(row)) => row_columns::<0>(row, &w, c0, c1, out),
                (Format::Q4_0, Acts::Row(row)) => row_columns::<1>(row, &w, c0, c1, out),
                (Format::Q4_1, Acts::Row(row)) => row_columns::<2>(row, &w, c0, c1, out),
                (Format::Q8_0, Acts::Pairs(pairs)) => columns::<0>(pairs, &w, c0, c1, out),
                (Format::Q4_0, Acts::Pairs(pairs)) => columns::<1>(pairs, &w, c0, c1, out),
                (Format::Q4_1, Acts::Pairs(pairs)) => columns::<2>(pairs, &w, c0, c1, out),
            }
        }
    };
    (0..w.n.div_ceil(TASK_COLS)).into_par_iter().for_each(task);
    y
}

/// Columns `c0..c1` of the output for a single activation row (decode), one weight row at a time
/// in memory order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn row_columns<const F: usize>(x: &Row, w: &Weights, c0: usize, c1: usize, out: Out) {
    for j in c0..c1 {
        // SAFETY: `j < c1 <= n`; the task writes only its own columns.
        unsafe { *out.ptr.add(j) = row_dot::<F>(x, w, j) };
    }
}

/// Columns `c0..c1` of the output for every activation row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn columns<const F: usize>(x: &Pairs, w: &Weights, c0: usize, c1: usize, out: Out) {
    // Past c1 the tiles recompute the last column of the whole matrix (not stored); inside the
    // task, a tile that crosses c1 must not write into the next task's columns.
    let w_task = Weights { n: c1, ..*w };
    let pairs = x.m.div_ceil(2);
    unsafe {
        for j in (c0..c1).step_by(RM) {
            let mut p = 0;
            while p + RP <= pairs {
                tile_pairs::<F, RM, RP>(x, &w_task, j, p, out);
                p += RP;
            }
            match pairs - p {
                1 => tile_pairs::<F, RM, 1>(x, &w_task, j, p, out),
                2 => tile_pairs::<F, RM, 2>(x, &w_task, j, p, out),
                3 => tile_pairs::<F, RM, 3>(x, &w_task, j, p, out),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dot_scalar, quantize_row_impl};
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// Quantization: the same quants, scales and Q8_1 sums as the scalar specification, including
    /// all-zero blocks and exact halves (ties).
    #[test]
    fn quantize_block_is_bit_identical_to_scalar() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: nothing to compare");
            return;
        }
        let mut next = rng(7);
        for case in 0..200 {
            let x: Vec<f32> = (0..BLOCK)
                .map(|i| match case % 4 {
                    0 => 0.0,
                    // amax 127 makes the scale 1: the .5 values are ties.
                    1 if i == 0 => 127.0,
                    1 => i as f32 * if i % 2 == 0 { 1.0 } else { -1.0 } - 0.5,
                    _ => next() as f32 / u32::MAX as f32 * 6.0 - 3.0,
                })
                .collect();
            let want = quantize_row_impl(&x);
            let row = super::quantize_row(&x);
            assert_eq!(row.quants, want.quants, "case {case}");
            assert_eq!(row.scales[0].to_bits(), want.scales[0].to_bits());
            assert_eq!(row.sums[0].to_bits(), want.sums[0].to_bits());
            let (q, d, s4, s) = unsafe { quantize_block(&x) };
            assert_eq!(&q[..], &want.quants[..], "case {case}");
            assert_eq!(d.to_bits(), want.scales[0].to_bits());
            assert_eq!(s.to_bits(), want.sums[0].to_bits());
            for (l, s) in s4.iter().enumerate() {
                let lane: i32 = want.quants[4 * l..4 * l + 4]
                    .iter()
                    .map(|&q| q as i32)
                    .sum();
                assert_eq!(*s, lane);
            }
        }
    }

    /// Every output of the tiled kernels equals `dot_scalar` to the bit, for row counts that are
    /// not multiples of the tile (m = 1..=9), column counts that are not multiples of the tile
    /// or the task, and several K.
    #[test]
    fn tiled_matmul_is_bit_identical_to_scalar() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: nothing to compare");
            return;
        }
        let mut next = rng(11);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            for blocks in [1usize, 3, 18] {
                let k = blocks * BLOCK;
                for n in [1usize, 3, 7, 17, 37] {
                    let bytes: Vec<u8> = (0..n * blocks * format.block_bytes())
                        .map(|_| next() as u8)
                        .collect();
                    let scales: Vec<f32> = (0..n * blocks)
                        .map(|_| f16::from_f32(next() as f32 / u32::MAX as f32 * 0.1).to_f32())
                        .collect();
                    let mins: Vec<f32> = if format == Format::Q4_1 {
                        (0..n * blocks)
                            .map(|_| f16::from_f32(next() as f32 / u32::MAX as f32 - 0.5).to_f32())
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let w = Weights {
                        bytes: &bytes,
                        scales: &scales,
                        mins: &mins,
                        n,
                        x16: false,
                    };
                    for m in 1..=9 {
                        let x: Vec<f32> = (0..m * k)
                            .map(|_| next() as f32 / u32::MAX as f32 * 4.0 - 2.0)
                            .collect();
                        let got = matmul(format, &x, m, k, w);
                        let bb = format.block_bytes() * blocks;
                        for i in 0..m {
                            let row = quantize_row_impl(&x[i * k..(i + 1) * k]);
                            for j in 0..n {
                                let mn = if mins.is_empty() {
                                    &[][..]
                                } else {
                                    &mins[j * blocks..(j + 1) * blocks]
                                };
                                let want = dot_scalar(
                                    format,
                                    &row,
                                    &bytes[j * bb..(j + 1) * bb],
                                    &scales[j * blocks..(j + 1) * blocks],
                                    mn,
                                );
                                assert_eq!(
                                    got[i * n + j].to_bits(),
                                    want.to_bits(),
                                    "{} m={m} n={n} k={k} ({i}, {j}): {} vs {want}",
                                    format.block_bytes(),
                                    got[i * n + j],
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A Q8_0 weight's quants and scales in the X16 layout.
    fn x16_copy(w: &Weights, blocks: usize) -> (Vec<u32>, Vec<f32>) {
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(w.bytes);
        (
            crate::packed::interleave_x16(&words, w.n, blocks, 8),
            crate::packed::interleave_x16(w.scales, w.n, blocks, 1),
        )
    }

    /// Q8_0 in the X16 layout: decode (`row_x16`) and prefill (`pair_x16`) give the file
    /// layout's bits, for m = 1..=5 and two groups.
    #[test]
    fn x16_q8_0_matmul_is_bit_identical_to_the_rows() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: nothing to compare");
            return;
        }
        let mut next = rng(13);
        let n = 32;
        for blocks in [1usize, 18] {
            let k = blocks * BLOCK;
            let bytes: Vec<u8> = (0..n * k).map(|_| next() as u8).collect();
            let scales: Vec<f32> = (0..n * blocks)
                .map(|_| f16::from_f32(next() as f32 / u32::MAX as f32 * 0.1).to_f32())
                .collect();
            let rows = Weights {
                bytes: &bytes,
                scales: &scales,
                mins: &[],
                n,
                x16: false,
            };
            let (x16_words, x16_scales) = x16_copy(&rows, blocks);
            let x16 = Weights {
                bytes: bytemuck::cast_slice(&x16_words),
                scales: &x16_scales,
                x16: true,
                ..rows
            };
            for m in 1..=5 {
                let x: Vec<f32> = (0..m * k)
                    .map(|_| next() as f32 / u32::MAX as f32 * 4.0 - 2.0)
                    .collect();
                let want = matmul(Format::Q8_0, &x, m, k, rows);
                let got = matmul(Format::Q8_0, &x, m, k, x16);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "m={m} k={k}"
                );
            }
        }
    }

    /// Not a test: decode bandwidth of a Q8_0 matrix in rows and in X16, 64 MB (past the
    /// caches) and 4 MB (in them). `cargo test --release -p toy-kernels --lib q8_0_decode_bandwidth
    /// -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn q8_0_decode_bandwidth() {
        if !available() {
            return;
        }
        let mut next = rng(3);
        for (n, k) in [(32768usize, 2048usize), (2048, 2048), (49152, 576)] {
            let blocks = k / BLOCK;
            let bytes: Vec<u8> = (0..n * k).map(|_| next() as u8).collect();
            let scales: Vec<f32> = (0..n * blocks).map(|_| 0.01).collect();
            let rows = Weights {
                bytes: &bytes,
                scales: &scales,
                mins: &[],
                n,
                x16: false,
            };
            let (x16_words, x16_scales) = x16_copy(&rows, blocks);
            let x16 = Weights {
                bytes: bytemuck::cast_slice(&x16_words),
                scales: &x16_scales,
                x16: true,
                ..rows
            };
            let x: Vec<f32> = (0..k)
                .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
                .collect();
            let mut best = [f64::MAX; 2];
            for _ in 0..5 {
                for (i, w) in [rows, x16].into_iter().enumerate() {
                    let t = std::time::Instant::now();
                    for _ in 0..10 {
                        std::hint::black_box(matmul(Format::Q8_0, &x, 1, k, w));
                    }
                    best[i] = best[i].min(t.elapsed().as_secs_f64() / 10.0);
                }
            }
            let mb = (n * k) as f64 * 34.0 / 32.0;
            eprintln!(
                "{n} × {k}: rows {:.1} GB/s, X16 {:.1} GB/s",
                mb / best[0] / 1e9,
                mb / best[1] / 1e9
            );
        }
    }
}
