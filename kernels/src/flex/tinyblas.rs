//! llama.cpp's x86 matmul for float weights: llamafile's tinyBLAS for two or more activation
//! rows of F32, F16 or BF16 weights (`llamafile_sgemm`), and ggml's `vec_dot_f32` for an F32
//! weight against one row (decode) or where tinyBLAS declines.
//!
//! tinyBLAS gives every output one FMA accumulator of the build's vector width (8 lanes for
//! AVX2, 16 for AVX-512) that runs over the row in order, then sums its lanes horizontally. The
//! register tile — how many weight and activation rows share one pass over `k` — changes speed,
//! never bits, so the AVX2 kernel here tiles as tinyBLAS does on a 16-register machine (4 weight
//! rows × 3 activation rows: 12 accumulators) and reproduces the 16-lane order with two 8-lane
//! accumulators per output (lanes 0..8 and 8..16; `_mm512_reduce_add_ps` adds them first).
//! Activation rows come in blocks that stay in L2 while every weight row of a thread's share
//! passes over them.

use rayon::prelude::*;

use super::reduce::{hsum8, reduce_add16};
use super::{CpuLevel, GgmlIsa, cpu_level};

/// The element type of both operands (llama.cpp rounds the activations to the weight's 16-bit
/// type before tinyBLAS reads them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Elem {
    F32,
    F16,
    BF16,
}

impl Elem {
    pub(super) fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::BF16 => 2,
        }
    }

    /// Element `i` of little-endian bytes `b`.
    fn value(self, b: &[u8], i: usize) -> f32 {
        match self {
            Elem::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes")),
            Elem::F16 => half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            Elem::BF16 => {
                f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
            }
        }
    }
}

/// Whether llama.cpp's `llamafile_sgemm` takes a product of `n` weight rows of `k` values by `m`
/// activation rows (`n < 2` and `m % 4 != 0` in its names; `k % KN` for the elements per step:
/// the lane count, or 32 bf16 per `vdpbf16ps` in the AVX512_BF16 build).
pub(super) fn applies(m: usize, n: usize, k: usize, isa: GgmlIsa, elem: Elem) -> bool {
    m >= 2 && n.is_multiple_of(4) && k > 0 && k.is_multiple_of(step(isa, elem))
}

/// Elements of a row per accumulator step (tinyBLAS's `KN`).
fn step(isa: GgmlIsa, elem: Elem) -> usize {
    match (isa, elem) {
        (GgmlIsa::Avx512Bf16, Elem::BF16) => 32,
        _ => isa.lanes(),
    }
}

/// One output, the specification: weight row `w` by activation row `x` (bytes of `elem`), one
/// `lanes`-wide FMA accumulator over the row, then the build's horizontal sum.
///
/// The AVX512_BF16 build's bf16 tinyBLAS multiplies with `vdpbf16ps`: 32 elements per step, lane
/// `l` adding the product of elements `2l + 1`, then `2l`, each add rounded.
pub(super) fn dot(w: &[u8], x: &[u8], elem: Elem, isa: GgmlIsa) -> f32 {
    let lanes = isa.lanes();
    let k = w.len() / elem.bytes();
    let mut acc = [0.0f32; 16];
    let p = |e: usize| elem.value(w, e) * elem.value(x, e);
    if (isa, elem) == (GgmlIsa::Avx512Bf16, Elem::BF16) {
        for l0 in (0..k).step_by(32) {
            for (l, a) in acc.iter_mut().enumerate() {
                *a = (*a + p(l0 + 2 * l + 1)) + p(l0 + 2 * l);
            }
        }
        return reduce_add16(&acc);
    }
    for l0 in (0..k).step_by(lanes) {
        for (l, a) in acc[..lanes].iter_mut().enumerate() {
            *a = elem.value(w, l0 + l).mul_add(elem.value(x, l0 + l), *a);
        }
    }
    match isa {
        GgmlIsa::Avx2 => hsum8(acc[..8].try_into().expect("8 lanes")),
        GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => reduce_add16(&acc),
    }
}

/// Activations rounded to a 16-bit weight's type, as llama.cpp converts them before its dot
/// products (f16: round to nearest even, ggml's `_cvtss_sh(x, 0)`; bf16: `GGML_FP32_TO_BF16`),
/// as little-endian bytes.
fn round_to_half(x: &[f32], elem: Elem) -> Vec<u8> {
    let mut out = vec![0u8; x.len() * 2];
    out.par_chunks_mut(2 * CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| round_into(x, elem, o));
    out
}

/// Values per parallel chunk of the activation conversions.
const CHUNK: usize = 8192;

/// [`round_to_half`] of one chunk into `o` (two bytes per value).
fn round_into(x: &[f32], elem: Elem, o: &mut [u8]) {
    match elem {
        Elem::F16 => f16_bytes(x, o),
        _ => {
            for (o, &v) in o.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&toy_quant::f32_to_bf16(v).to_le_bytes());
            }
        }
    }
}

/// [`round_to_half`] widened back to f32 bytes in the same pass (each chunk rounded into a
/// buffer that stays in L1): the operand of the 512-bit tile, which multiplies 16-bit types in
/// f32 (`avx512::widens`). Exact: the widening of a rounded value is that value.
#[cfg(target_arch = "x86_64")]
fn rounded_f32(x: &[f32], elem: Elem) -> Vec<u8> {
    let mut out = vec![0u8; x.len() * 4];
    out.par_chunks_mut(4 * CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            let mut half = vec![0u8; 2 * x.len()];
            round_into(x, elem, &mut half);
            // SAFETY: only called where `avx512::takes` found AVX-512; `x.len()` is a multiple
            // of 16 (rows of `k`, a multiple of the 16-lane step, in chunks of 8192).
            unsafe { avx512::widen16(&half, elem, o) };
        });
    out
}

fn f16_bytes(x: &[f32], o: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if cpu_level() >= CpuLevel::Avx2 {
        // SAFETY: F16C is part of toy's AVX2 level; `o` holds two bytes per value.
        unsafe { avx2::f16_bytes(x, o) };
        return;
    }
    for (o, &v) in o.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
    }
}

/// `x[m, k] · wᵀ` as `[m, n]` for weight rows `w[n, k]` (bytes of `elem`), in tinyBLAS's
/// arithmetic for the llama.cpp build `isa`: the activations are rounded to `elem` first, as
/// llama.cpp rounds them. The caller has checked [`applies`].
pub(super) fn matmul(
    x: &[f32],
    m: usize,
    w: &[u8],
    n: usize,
    k: usize,
    elem: Elem,
    isa: GgmlIsa,
) -> Vec<f32> {
    debug_assert!(applies(m, n, k, isa, elem));
    let wrow = k * elem.bytes();
    assert!(
        x.len() >= m * k && w.len() >= n * wrow,
        "tinyBLAS operands too short"
    );
    // Weight rows per task: a multiple of 4, about eight tasks per thread so that uneven
    // finishing evens out.
    let per_task = (n / (rayon::current_num_threads() * 8))
        .max(4)
        .next_multiple_of(4);
    // Each task writes the columns of its weight rows straight into the row-major `[m, n]`
    // output (no transposed copy): disjoint elements, so the tasks share one pointer.
    let mut out = vec![0.0f32; m * n];
    let dst = OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let zmm = avx512::takes(elem, isa);
    // The 512-bit tile converts 16-bit operands as it loads them, and `vcvtph2ps` needs a
    // register of its own per load: a 4 × 6 tile then spills accumulators. So the activations
    // are rounded to `elem` and widened back to f32 in one pass here, each group of weight rows
    // widened once per task (`avx512::task`), and the f32 tile multiplies them: exact
    // widenings, the same products and sums.
    let x: std::borrow::Cow<'_, [u8]> = match elem {
        Elem::F32 => bytemuck::cast_slice(x).into(),
        #[cfg(target_arch = "x86_64")]
        _ if zmm && avx512::widens(elem, isa) => rounded_f32(x, elem).into(),
        _ => round_to_half(x, elem).into(),
    };
    let x = &x[..];
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|t| {
        let (r0, rows) = (t * per_task, per_task.min(n - t * per_task));
        let w = &w[r0 * wrow..(r0 + rows) * wrow];
        // SAFETY: column `r0 + r` of row `i` is `i · n + r0 + r < m · n`, written by this task only.
        let o = unsafe { dst.get().add(r0) };
        #[cfg(target_arch = "x86_64")]
        if zmm {
            // SAFETY: `takes` checked the CPU's AVX-512 features; the operands as below.
            unsafe { avx512::task(w, rows, x, m, k, elem, isa, o, n) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if cpu_level() >= CpuLevel::Avx2 {
            // SAFETY: the CPU has AVX2, FMA and F16C; the slices hold `rows` and `m` rows, and
            // `o` addresses this task's columns of `[m, n]`.
            unsafe { avx2::task(w, rows, x, m, k, elem, isa, o, n) };
            return;
        }
        // (Off the 512-bit tile, the activations are bytes of `elem` as the weights are.)
        for r in 0..rows {
            for i in 0..m {
                let y = dot(
                    &w[r * wrow..(r + 1) * wrow],
                    &x[i * wrow..(i + 1) * wrow],
                    elem,
                    isa,
                );
                // SAFETY: as above.
                unsafe { *o.add(i * n + r) = y };
            }
        }
    });
    out
}

/// The output buffer, shared by tasks that write disjoint elements of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the tasks write disjoint elements (see `matmul`) and the buffer outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// ggml's `vec_dot_f32` (the build's order) of each weight row by each activation row: F32
/// weights against one activation row, or where [`applies`] is false.
pub(super) fn vec_dot_matmul(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    isa: GgmlIsa,
) -> Vec<f32> {
    let per_task = (n / (rayon::current_num_threads() * 8)).max(1);
    let mut out_t = vec![0.0f32; n * m];
    out_t
        .par_chunks_mut(per_task * m)
        .enumerate()
        .for_each(|(t, cols)| {
            for (r, col) in cols.chunks_exact_mut(m).enumerate() {
                let wr = &w[(t * per_task + r) * k..(t * per_task + r + 1) * k];
                for (i, o) in col.iter_mut().enumerate() {
                    *o = vec_dot_f32(wr, &x[i * k..(i + 1) * k], isa);
                }
            }
        });
    super::transpose_columns(out_t, m, n)
}

/// `ggml_vec_dot_f32` of the build `isa`: four accumulators of its vector width over steps of
/// four vectors, reduced pairwise and horizontally; the tail summed serially.
fn vec_dot_f32(w: &[f32], x: &[f32], isa: GgmlIsa) -> f32 {
    assert_eq!(w.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if cpu_level() >= CpuLevel::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA; the rows have the same length.
        return unsafe {
            match isa {
                GgmlIsa::Avx2 => avx2::vec_dot_f32::<1>(w, x),
                GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => avx2::vec_dot_f32::<2>(w, x),
            }
        };
    }
    match isa {
        GgmlIsa::Avx2 => super::vec_dot_f32_avx2(w, x),
        GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => super::vec_dot_f32(x.len(), |i| w[i], |i| x[i]),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::blocks_avx2::hsum_float_8 as hsum;
    use super::super::blocks_avx2::{bf16_even as even, bf16_odd as odd};
    use super::{Elem, GgmlIsa};

    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;
    /// bf16 summed in pairs per lane, as `vdpbf16ps` (the AVX512_BF16 build).
    const BF16_PAIRS: u8 = 3;

    /// Eight elements of type `E` at `p`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const E: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller's pointer addresses 8 elements.
        unsafe {
            match E {
                F32 => _mm256_loadu_ps(p as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
                    16,
                )),
            }
        }
    }

    /// `x` rounded to f16 (nearest even, as `half` and ggml's F16C path round), as bytes `o`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_bytes(x: &[f32], o: &mut [u8]) {
        assert!(o.len() >= 2 * x.len());
        let n8 = x.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: `i + 8 <= x.len()`, and `o` holds `2 · x.len()` bytes (asserted).
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(
                    x.as_ptr().add(i),
                ));
                _mm_storeu_si128(o.as_mut_ptr().add(2 * i) as *mut __m128i, h);
            }
        }
        for i in n8..x.len() {
            o[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(x[i]).to_le_bytes());
        }
    }

    /// The `RM × RN` outputs of weight rows `w + r·ld` by activation rows `x + i·ld` (`ld`
    /// bytes apart), each with `H` 8-lane accumulators (H = 2: the 16-lane order), into
    /// `out[i·n + r]`. Not inlined, as the 512-bit tile (the caller's loops made LLVM spill
    /// accumulators).
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const E: u8, const H: usize, const RM: usize, const RN: usize>(
        w: *const u8,
        x: *const u8,
        ld: usize,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        let es = if E == F32 { 4 } else { 2 };
        let mut acc = [[[_mm256_setzero_ps(); H]; RN]; RM];
        let mut l = 0;
        // SAFETY: the caller's rows hold `k` elements each; `out` addresses the tile.
        unsafe {
            if E == BF16_PAIRS {
                // 16 lanes (two halves) of 2 elements each per step of 32: the odd elements'
                // products, then the even ones', added to each lane.
                while l < k {
                    for h in 0..H {
                        let off = (l + 16 * h) * es;
                        let mut b = [_mm256_setzero_si256(); RN];
                        for j in 0..RN {
                            b[j] = _mm256_loadu_si256(x.add(j * ld + off) as *const __m256i);
                        }
                        for i in 0..RM {
                            let a = _mm256_loadu_si256(w.add(i * ld + off) as *const __m256i);
                            for j in 0..RN {
                                let c = _mm256_fmadd_ps(odd(a), odd(b[j]), acc[i][j][h]);
                                acc[i][j][h] = _mm256_fmadd_ps(even(a), even(b[j]), c);
                            }
                        }
                    }
                    l += 32;
                }
            }
            // Every other element type (for BF16_PAIRS, `l == k` already).
            while l < k {
                for h in 0..H {
                    let off = (l + 8 * h) * es;
                    let mut b = [_mm256_setzero_ps(); RN];
                    for j in 0..RN {
                        b[j] = load8::<E>(x.add(j * ld + off));
                    }
                    for i in 0..RM {
                        let a = load8::<E>(w.add(i * ld + off));
                        for j in 0..RN {
                            acc[i][j][h] = _mm256_fmadd_ps(a, b[j], acc[i][j][h]);
                        }
                    }
                }
                l += 8 * H;
            }
            for i in 0..RM {
                for j in 0..RN {
                    let v = if H == 1 {
                        acc[i][j][0]
                    } else {
                        _mm256_add_ps(acc[i][j][1], acc[i][j][0])
                    };
                    *out.add(j * n + i) = hsum(v);
                }
            }
        }
    }

    /// `ggml_vec_dot_f32` with `H` ymm registers per accumulator: H = 1 is the AVX2 build's
    /// (4 × 8 lanes over steps of 32, `GGML_F32x8_REDUCE`, tail `sum += x·y`), H = 2 the AVX-512
    /// build's (4 × 16 lanes over steps of 64, pairs then `_mm512_reduce_add_ps`, tail fused).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn vec_dot_f32<const H: usize>(w: &[f32], x: &[f32]) -> f32 {
        let n = x.len();
        let step = 32 * H;
        let np = n / step * step;
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); H]; 4];
        let mut i = 0;
        // SAFETY: `i + step <= np <= n` elements of both rows.
        unsafe {
            while i < np {
                for (j, a) in acc.iter_mut().enumerate() {
                    for (h, a) in a.iter_mut().enumerate() {
                        let e = i + 8 * H * j + 8 * h;
                        *a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(xp.add(e)),
                            _mm256_loadu_ps(wp.add(e)),
                            *a,
                        );
                    }
                }
                i += step;
            }
        }
        let mut r = [_mm256_setzero_ps(); H];
        for (h, r) in r.iter_mut().enumerate() {
            *r = _mm256_add_ps(
                _mm256_add_ps(acc[0][h], acc[2][h]),
                _mm256_add_ps(acc[1][h], acc[3][h]),
            );
        }
        if H == 1 {
            let t0 = _mm_add_ps(_mm256_castps256_ps128(r[0]), _mm256_extractf128_ps(r[0], 1));
            let t1 = _mm_hadd_ps(t0, t0);
            let mut sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
            for e in np..n {
                sum += x[e] * w[e];
            }
            sum
        } else {
            let mut sum = hsum(_mm256_add_ps(r[H - 1], r[0]));
            for e in np..n {
                sum = x[e].mul_add(w[e], sum);
            }
            sum
        }
    }

    /// Weight rows `w[rows, k]` by all activation rows `x[m, k]`: `out[i·n + r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn task(
        w: &[u8],
        rows: usize,
        x: &[u8],
        m: usize,
        k: usize,
        elem: Elem,
        isa: GgmlIsa,
        out: *mut f32,
        n: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match (elem, isa) {
                (Elem::F32, GgmlIsa::Avx2) => task_of::<F32, 1, 4>(w, rows, x, m, k, out, n),
                (Elem::F16, GgmlIsa::Avx2) => task_of::<F16, 1, 4>(w, rows, x, m, k, out, n),
                (Elem::BF16, GgmlIsa::Avx2) => task_of::<BF16, 1, 4>(w, rows, x, m, k, out, n),
                (Elem::F32, _) => task_of::<F32, 2, 2>(w, rows, x, m, k, out, n),
                (Elem::F16, _) => task_of::<F16, 2, 2>(w, rows, x, m, k, out, n),
                (Elem::BF16, GgmlIsa::Avx512) => task_of::<BF16, 2, 2>(w, rows, x, m, k, out, n),
                (Elem::BF16, GgmlIsa::Avx512Bf16) => {
                    task_of::<BF16_PAIRS, 2, 2>(w, rows, x, m, k, out, n)
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn task_of<const E: u8, const H: usize, const RM: usize>(
        w: &[u8],
        rows: usize,
        x: &[u8],
        m: usize,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        let ld = k * if E == F32 { 4 } else { 2 };
        // Activation rows per block: about 192 KiB of them, a multiple of the tile's 3.
        let block = (192 * 1024 / ld).clamp(3, m.max(3)) / 3 * 3;
        let (w, x) = (w.as_ptr(), x.as_ptr());
        // SAFETY: every pointer below stays inside `w[rows · ld]`, `x[m · ld]` and the caller's
        // columns of `out` (`rows` is a multiple of 4 ≥ RM, so tiles of RM rows cover it).
        unsafe {
            for i0 in (0..m).step_by(block) {
                let i1 = (i0 + block).min(m);
                for r in (0..rows).step_by(RM) {
                    let (wr, o) = (w.add(r * ld), out.add(r));
                    let mut i = i0;
                    while i + 3 <= i1 {
                        tile::<E, H, RM, 3>(wr, x.add(i * ld), ld, k, o.add(i * n), n);
                        i += 3;
                    }
                    match i1 - i {
                        2 => tile::<E, H, RM, 2>(wr, x.add(i * ld), ld, k, o.add(i * n), n),
                        1 => tile::<E, H, RM, 1>(wr, x.add(i * ld), ld, k, o.add(i * n), n),
                        _ => {}
                    }
                }
            }
        }
    }
}

/// The AVX-512 builds' tiles on 512-bit registers, for CPUs that have them: one zmm accumulator
/// per output holds the 16 lanes the AVX2 kernel keeps in two ymm halves — each lane the same
/// chain of FMAs over the same elements, then `_mm512_reduce_add_ps`'s halves-first sum — so the
/// same bits; 32 registers hold a 4 × 6 tile. BF16 in the AVX512_BF16 build runs `vdpbf16ps`
/// itself (the AVX2 kernel's `BF16_PAIRS` emulates it: odd product, then even, per lane).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::blocks_avx2::hsum_float_8 as hsum;
    use super::super::{CpuLevel, cpu_level};
    use super::{Elem, GgmlIsa};

    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;
    const BF16_PAIRS: u8 = 3;
    /// Weight rows × activation rows per tile.
    const RM: usize = 4;
    const RN: usize = 6;

    /// Whether this CPU runs `elem` in the `isa` build's order here: a 16-lane build (the AVX2
    /// build's 8 lanes stay on the AVX2 kernel) and AVX-512 in use (`TOY_CPU=avx2` turns it off);
    /// `vdpbf16ps` needs AVX512_BF16.
    pub(super) fn takes(elem: Elem, isa: GgmlIsa) -> bool {
        if isa == GgmlIsa::Avx2 || cpu_level() < CpuLevel::Avx512 {
            return false;
        }
        elem != Elem::BF16
            || isa != GgmlIsa::Avx512Bf16
            || std::is_x86_feature_detected!("avx512bf16")
    }

    /// Whether [`task`] takes its activations widened to f32 (16-bit types but the AVX512_BF16
    /// build's bf16, whose `vdpbf16ps` reads bf16 pairs).
    pub(super) fn widens(elem: Elem, isa: GgmlIsa) -> bool {
        elem != Elem::F32 && !(elem == Elem::BF16 && isa == GgmlIsa::Avx512Bf16)
    }

    /// Sixteen elements of type `E` at `p`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn load16<const E: u8>(p: *const u8) -> __m512 {
        // SAFETY: the caller's pointer addresses 16 elements.
        unsafe {
            match E {
                F32 => _mm512_loadu_ps(p as *const f32),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)),
                    16,
                )),
            }
        }
    }

    /// The `R × C` outputs of weight rows `w + r·ld` by activation rows `x + i·ld` into
    /// `out[i·n + r]`. Not inlined: inside the caller's loops LLVM's register allocator spilled
    /// nine of the 4 × 6 tile's 24 accumulators to the stack on every step.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn tile<const E: u8, const R: usize, const C: usize>(
        w: *const u8,
        x: *const u8,
        ld: usize,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        // SAFETY: the caller's contract; BF16_PAIRS is only asked for where the CPU has
        // AVX512_BF16 (`takes`).
        unsafe {
            if E == BF16_PAIRS {
                return tile_pairs::<R, C>(w, x, ld, k, out, n);
            }
            // Otherwise f32 (16-bit operands arrive widened: `widens`).
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let mut l = 0;
            while l < k {
                let mut b = [_mm512_setzero_ps(); C];
                for j in 0..C {
                    b[j] = _mm512_loadu_ps(x.add(j * ld + 4 * l) as *const f32);
                }
                for i in 0..R {
                    let a = _mm512_loadu_ps(w.add(i * ld + 4 * l) as *const f32);
                    for j in 0..C {
                        acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
                    }
                }
                l += 16;
            }
            store(&acc, out, n);
        }
    }

    /// [`tile`] for bf16 in the AVX512_BF16 build: 32 elements per step, 16 lanes of one
    /// `vdpbf16ps` pair each.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    unsafe fn tile_pairs<const R: usize, const C: usize>(
        w: *const u8,
        x: *const u8,
        ld: usize,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut l = 0;
        // SAFETY: the caller's rows hold `k` (a multiple of 32) elements each.
        unsafe {
            while l < k {
                let mut b = [_mm512_setzero_si512(); C];
                for j in 0..C {
                    b[j] = _mm512_loadu_si512(x.add(j * ld + 2 * l) as *const __m512i);
                }
                for i in 0..R {
                    let a = _mm512_loadu_si512(w.add(i * ld + 2 * l) as *const __m512i);
                    let a: __m512bh = std::mem::transmute(a);
                    for j in 0..C {
                        let bj: __m512bh = std::mem::transmute(b[j]);
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, bj);
                    }
                }
                l += 32;
            }
            store(&acc, out, n);
        }
    }

    /// Each accumulator's 16 lanes summed as `_mm512_reduce_add_ps` sums them (the upper half
    /// onto the lower, then `hsum_float_8`), into `out[j·n + i]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn store<const R: usize, const C: usize>(
        acc: &[[__m512; C]; R],
        out: *mut f32,
        n: usize,
    ) {
        for i in 0..R {
            for j in 0..C {
                let v = acc[i][j];
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                // SAFETY: the caller's `out` addresses the tile.
                unsafe { *out.add(j * n + i) = hsum(_mm256_add_ps(hi, _mm512_castps512_ps256(v))) };
            }
        }
    }

    /// Weight rows `w[rows, k]` by all activation rows `x[m, k]`: `out[i·n + r]`. The CPU has
    /// what [`takes`] asks for. Where [`widens`], `x` is f32 and the weights `elem`.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn task(
        w: &[u8],
        rows: usize,
        x: &[u8],
        m: usize,
        k: usize,
        elem: Elem,
        isa: GgmlIsa,
        out: *mut f32,
        n: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match (elem, isa) {
                (Elem::F32, _) => task_of::<F32>(w, rows, x, m, k, out, n),
                (Elem::BF16, GgmlIsa::Avx512Bf16) => {
                    task_of::<BF16_PAIRS>(w, rows, x, m, k, out, n)
                }
                _ => {
                    // Each group of RM weight rows widened to f32 once, for all `m` rows.
                    let wrow = 2 * k;
                    let mut w32 = vec![0u8; 2 * w.len()];
                    for (o, w) in w32.chunks_mut(2 * RM * wrow).zip(w.chunks(RM * wrow)) {
                        widen16(w, elem, o);
                    }
                    task_of::<F32>(&w32, rows, x, m, k, out, n)
                }
            }
        }
    }

    /// 16-bit values widened to f32 bytes (exact): sixteen per instruction.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(super) fn widen16(w: &[u8], elem: Elem, out: &mut [u8]) {
        assert!(out.len() >= 2 * w.len() && w.len().is_multiple_of(32));
        for (i, o) in out.chunks_exact_mut(64).take(w.len() / 32).enumerate() {
            // SAFETY: 32 bytes of `w` at `32 i` (asserted), 64 of `o`.
            unsafe {
                let v = match elem {
                    Elem::F16 => load16::<F16>(w.as_ptr().add(32 * i)),
                    _ => load16::<BF16>(w.as_ptr().add(32 * i)),
                };
                _mm512_storeu_ps(o.as_mut_ptr() as *mut f32, v);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn task_of<const E: u8>(
        w: &[u8],
        rows: usize,
        x: &[u8],
        m: usize,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        let ld = k * if E == F32 { 4 } else { 2 };
        // Activation rows per block: about 192 KiB of them, a multiple of the tile's RN.
        let block = (192 * 1024 / ld).clamp(RN, m.max(RN)) / RN * RN;
        let (w, x) = (w.as_ptr(), x.as_ptr());
        // SAFETY: every pointer below stays inside `w[rows · ld]`, `x[m · ld]` and the caller's
        // columns of `out` (`rows` is a multiple of 4 = RM).
        unsafe {
            for i0 in (0..m).step_by(block) {
                let i1 = (i0 + block).min(m);
                for r in (0..rows).step_by(RM) {
                    let (wr, o) = (w.add(r * ld), out.add(r));
                    let mut i = i0;
                    while i + RN <= i1 {
                        tile::<E, RM, RN>(wr, x.add(i * ld), ld, k, o.add(i * n), n);
                        i += RN;
                    }
                    let (xr, or) = (x.add(i * ld), o.add(i * n));
                    match i1 - i {
                        5 => tile::<E, RM, 5>(wr, xr, ld, k, or, n),
                        4 => tile::<E, RM, 4>(wr, xr, ld, k, or, n),
                        3 => tile::<E, RM, 3>(wr, xr, ld, k, or, n),
                        2 => tile::<E, RM, 2>(wr, xr, ld, k, or, n),
                        1 => tile::<E, RM, 1>(wr, xr, ld, k, or, n),
                        _ => {}
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-2, 2) from a fixed-seed LCG.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        }
    }

    fn bytes(v: &[f32], elem: Elem) -> Vec<u8> {
        v.iter()
            .flat_map(|&f| match elem {
                Elem::F32 => f.to_le_bytes().to_vec(),
                Elem::F16 => half::f16::from_f32(f).to_le_bytes().to_vec(),
                Elem::BF16 => half::bf16::from_f32(f).to_le_bytes().to_vec(),
            })
            .collect()
    }

    /// The vector f16 rounding is `half`'s (and bf16's is `f32_to_bf16`), edge values included.
    #[test]
    fn half_rounding_matches_the_scalar_conversions() {
        let mut x: Vec<f32> = (0..20_000)
            .map(|i| ((i as f32) * 0.37).sin() * 70_000.0 / (1 + i % 97) as f32)
            .collect();
        x.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            1e-8,
            -6e-5,
            5.96e-8,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            3.0e38,
        ]);
        let f16 = round_to_half(&x, Elem::F16);
        let bf16 = round_to_half(&x, Elem::BF16);
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(
                &f16[2 * i..2 * i + 2],
                half::f16::from_f32(v).to_le_bytes(),
                "f16 of {v}"
            );
            assert_eq!(
                &bf16[2 * i..2 * i + 2],
                toy_quant::f32_to_bf16(v).to_le_bytes(),
                "bf16 of {v}"
            );
        }
    }

    /// The decode path: ggml's `vec_dot_f32` of both builds, tails included.
    #[test]
    fn vec_dot_products_are_bit_identical_to_the_spec() {
        let mut next = uniform(11);
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            for (m, n, k) in [(1, 5, 32), (1, 9, 100), (2, 3, 64), (3, 7, 576), (1, 4, 7)] {
                let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
                let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
                let got = vec_dot_matmul(&x, m, &w, n, k, isa);
                for i in 0..m {
                    for j in 0..n {
                        let (wr, xr) = (&w[j * k..(j + 1) * k], &x[i * k..(i + 1) * k]);
                        let want = match isa {
                            GgmlIsa::Avx2 => super::super::vec_dot_f32_avx2(wr, xr),
                            GgmlIsa::Avx512 | GgmlIsa::Avx512Bf16 => {
                                super::super::vec_dot_f32(k, |c| wr[c], |c| xr[c])
                            }
                        };
                        assert_eq!(
                            got[i * n + j].to_bits(),
                            want.to_bits(),
                            "{isa:?} {m} {n} {k}"
                        );
                    }
                }
            }
        }
    }

    /// Every tile shape and block edge, every build's order, all three element types: the
    /// kernel's bits are the per-output specification's.
    #[test]
    fn tiled_products_are_bit_identical_to_the_spec() {
        let mut next = uniform(7);
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512, GgmlIsa::Avx512Bf16] {
            for elem in [Elem::F32, Elem::F16, Elem::BF16] {
                for (m, n, k) in [
                    (2, 4, 16),
                    (3, 8, 32),
                    (7, 12, 48),
                    (17, 20, 64),
                    (40, 36, 4096),
                ] {
                    if !applies(m, n, k, isa, elem) {
                        continue; // the AVX512_BF16 build's bf16 steps are 32 elements
                    }
                    let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
                    let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
                    let (xb, wb) = (bytes(&x, elem), bytes(&w, elem));
                    let got = matmul(&x, m, &wb, n, k, elem, isa);
                    let rb = k * elem.bytes();
                    for i in 0..m {
                        for j in 0..n {
                            let want = dot(
                                &wb[j * rb..(j + 1) * rb],
                                &xb[i * rb..(i + 1) * rb],
                                elem,
                                isa,
                            );
                            assert_eq!(
                                got[i * n + j].to_bits(),
                                want.to_bits(),
                                "{isa:?} {elem:?} m {m} n {n} k {k} at ({i}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }
}
