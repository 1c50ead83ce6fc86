//! llama.cpp's attention without flash attention, reproduced op for op on the CPU (see
//! `attention_ggml`), with AVX-512 inner loops where the CPU has them.

use rayon::prelude::*;

use super::*;

/// ggml's `ggml_vec_dot_f32` (AVX-512): four 16-lane accumulators over steps of 64 with FMA,
/// reduced pairwise (0+2, 1+3, then 0+1) and horizontally; the tail is summed serially.
/// `x(i)`/`y(i)` give the operands so that strided rows need no copy.
#[inline(always)]
pub(super) fn vec_dot_f32(n: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [[0.0f32; 16]; 4];
    let np = n / 64 * 64;
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let idx = i + 16 * j + l;
                *a = x(idx).mul_add(y(idx), *a);
            }
        }
    }
    let mut r = [0.0f32; 16];
    for l in 0..16 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce_add16(&r);
    for i in np..n {
        sum = x(i).mul_add(y(i), sum);
    }
    sum
}

pub(super) struct AttnDims {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) tq: usize,
    pub(super) d: usize,
    pub(super) h_kv: usize,
    pub(super) tk: usize,
}

impl AttnDims {
    /// From the shapes of `q[b, h, tq, d]` and `k[b, h_kv, tk, d]`.
    pub(super) fn new(q: &burn::tensor::Shape, k: &burn::tensor::Shape) -> Self {
        AttnDims {
            b: q[0],
            h: q[1],
            tq: q[2],
            d: q[3],
            h_kv: k[1],
            tk: k[2],
        }
    }
}

/// K or V as `[b, h_kv, tk, d]` whose every head's `tk × d` elements are contiguous but whose
/// heads need not be adjacent: a view of the first `tk` tokens of a KV cache's preallocated
/// buffer is read where it lies, with no copy.
pub(super) struct Heads<'a> {
    pub(super) data: Cow<'a, [f32]>,
    pub(super) start: usize,
    /// Elements between batches and between heads.
    pub(super) strides: [usize; 2],
}

impl<'a> Heads<'a> {
    /// A contiguous `[b, h_kv, tk, d]`.
    pub(super) fn contiguous(data: Cow<'a, [f32]>, h_kv: usize, tk: usize, d: usize) -> Self {
        Heads {
            data,
            start: 0,
            strides: [h_kv * tk * d, tk * d],
        }
    }

    fn head(&self, bi: usize, hi: usize, len: usize) -> &[f32] {
        let at = self.start + bi * self.strides[0] + hi * self.strides[1];
        &self.data[at..at + len]
    }
}

/// One sequence's operands of [`attention_ggml`].
pub(super) struct AttnInput<'a> {
    pub(super) q: Cow<'a, [f32]>,
    pub(super) k: Heads<'a>,
    pub(super) v: Heads<'a>,
    pub(super) dims: AttnDims,
    pub(super) options: AttentionOptions,
}

/// llama.cpp's attention without flash attention, op for op: `kq = K·q` (vec_dot_f32), softmax
/// with the scale and causal mask over the KV length padded to 256 (ggml_soft_max: vector expf,
/// 16-wide chunk sums added in f64, then multiply by `(float)(1/sum)`), then `kqv = Vᵀ·p` —
/// vec_dot_f32 for one query row, llamafile's tinyBLAS (one 16-lane FMA accumulator, then a
/// horizontal sum) for several. Query heads `i` read K/V head `i / (h / h_kv)`.
///
/// Several sequences (a batched pass) run as one parallel loop over all their heads: a decode
/// step has one query row per head, too little work for a parallel region of its own.
pub(super) fn attention_ggml(inputs: &[AttnInput<'_>]) -> Vec<Vec<f32>> {
    let masks: Vec<Vec<bool>> = inputs
        .iter()
        .map(|x| reference::causal_mask(x.dims.tq, x.dims.tk, &x.options))
        .collect();
    let mut outs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| vec![0.0f32; x.dims.b * x.dims.h * x.dims.tq * x.dims.d])
        .collect();
    // (sequence, batch·head, its output rows), for every head of every sequence.
    let mut heads: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (n, out) in outs.iter_mut().enumerate() {
        let rows = inputs[n].dims.tq * inputs[n].dims.d;
        heads.extend(out.chunks_mut(rows).enumerate().map(|(bh, o)| (n, bh, o)));
    }
    heads.into_par_iter().for_each(|(n, bh, out)| {
        let AttnInput {
            q,
            k,
            v,
            dims,
            options,
        } = &inputs[n];
        let AttnDims {
            h, tq, d, h_kv, tk, ..
        } = *dims;
        let group = h / h_kv;
        let (bi, hi) = (bh / h, bh % h);
        let (kh, vh) = (
            k.head(bi, hi / group, tk * d),
            v.head(bi, hi / group, tk * d),
        );
        let qh = &q[bh * tq * d..(bh + 1) * tq * d];
        attend_head(qh, kh, vh, &masks[n], out, [tq, tk, d], options.scale);
    });
    outs
}

/// The two inner loops of `attend_head_impl` that decide its speed, in a portable form and, on
/// x86-64, an AVX-512 one (sixteen 16-lane accumulators fit AVX-512's 32 registers; the portable
/// form compiled for AVX-512 still keeps them on the stack). Both give the same bits.
///
/// The defaults are the AVX-512 build's arithmetic; [`Avx2Build`] overrides them with the AVX2
/// build's (8 lanes where AVX-512 has 16, and its own `expf`).
pub(super) trait HeadLoops {
    /// `vec_dot_f32(d, K[j], q)` for the keys `j0..j0 + 16` of a transposed `kt[d][stride]`.
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16];
    /// tinyBLAS's `out[c] = Σ_j V[j][c] · p[j]` over the keys `lo..end`.
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]);

    /// f32 lanes of the build's vectors: the softmax's chunks are this long.
    const LANES: usize = 16;

    /// `vec_dot_f32(d, k, q)` for one key.
    #[inline(always)]
    fn key_dot(k: &[f32], q: &[f32]) -> f32 {
        vec_dot_f32(q.len(), |c| k[c], |c| q[c])
    }

    /// The build's vector `expf`.
    #[inline(always)]
    fn expf(x: f32) -> f32 {
        ggml_expf(x)
    }

    /// The softmax's sum of one chunk of `LANES` exponentials.
    #[inline(always)]
    fn chunk_sum(chunk: &[f32]) -> f32 {
        reduce_add16(chunk.try_into().expect("16 lanes"))
    }

    /// `vec_dot_f32`'s reduction of its `4 · LANES` lane accumulators `lanes[lane][column]`
    /// into `out[column]` (decode's `V·p`, one query row).
    #[inline(always)]
    fn decode_reduce(lanes: &[f32], d: usize, out: &mut [f32]) {
        let lane = |l: usize| &lanes[l * d..(l + 1) * d];
        // r[l] = (L[l] + L[32+l]) + (L[16+l] + L[48+l]), then reduce_add16(r); column by column,
        // vectorized over columns.
        let mut r = vec![0.0f32; 16 * d];
        for l in 0..16 {
            let (a, b, c, e) = (lane(l), lane(32 + l), lane(16 + l), lane(48 + l));
            for (x, rv) in r[l * d..(l + 1) * d].iter_mut().enumerate() {
                *rv = (a[x] + b[x]) + (c[x] + e[x]);
            }
        }
        reduce_add16_columns(&r, d, out);
    }
}

/// The arithmetic of llama.cpp's AVX2 build, in portable form.
pub(super) struct Avx2Build;

impl HeadLoops for Avx2Build {
    #[inline(always)]
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
        vec_dot_f32_avx2_16keys(kt, stride, j0, q)
    }
    #[inline(always)]
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
        weighted_sum_rows8(v, p, lo, end, d, out)
    }

    const LANES: usize = 8;

    #[inline(always)]
    fn key_dot(k: &[f32], q: &[f32]) -> f32 {
        vec_dot_f32_avx2(k, q)
    }

    #[inline(always)]
    fn expf(x: f32) -> f32 {
        ggml_expf_avx2(x)
    }

    #[inline(always)]
    fn chunk_sum(chunk: &[f32]) -> f32 {
        hsum8(chunk.try_into().expect("8 lanes"))
    }

    #[inline(always)]
    fn decode_reduce(lanes: &[f32], d: usize, out: &mut [f32]) {
        // Accumulator `a` (of 4) lane `l` is lane 8a + l: r[l] = (acc0 + acc2) + (acc1 + acc3),
        // then the F32x8 reduction of r, column by column.
        // Each lane's columns are contiguous, so the loop runs over columns innermost: the
        // compiler vectorizes it (the same adds in the same order, eight columns at a time).
        let lane: [&[f32]; 32] = std::array::from_fn(|l| &lanes[l * d..(l + 1) * d]);
        let out = &mut out[..d];
        for x in 0..d {
            let r = |l: usize| (lane[l][x] + lane[16 + l][x]) + (lane[8 + l][x] + lane[24 + l][x]);
            let t0 = |i: usize| r(i) + r(i + 4);
            out[x] = (t0(0) + t0(1)) + (t0(2) + t0(3));
        }
    }
}

pub(super) struct Portable;

impl HeadLoops for Portable {
    #[inline(always)]
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
        vec_dot_f32_16keys(kt, stride, j0, q)
    }
    #[inline(always)]
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
        weighted_sum_rows(v, p, lo, end, d, out)
    }
}

/// One query head against its K/V head, with the fastest loops this CPU has.
pub(super) fn attend_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    dims: [usize; 3],
    scale: f32,
) {
    if ggml_isa() == GgmlIsa::Avx2 {
        return attend_head_avx2_fma(q, k, v, mask, out, dims, scale);
    }
    #[cfg(target_arch = "x86_64")]
    {
        if attn512::available() {
            // SAFETY: the CPU has the features `attn512::attend_head` is compiled for.
            return unsafe { attn512::attend_head(q, k, v, mask, out, dims, scale) };
        }
        attend_head_fma(q, k, v, mask, out, dims, scale)
    }
    #[cfg(not(target_arch = "x86_64"))]
    attend_head_impl::<Portable>(q, k, v, mask, out, dims, scale)
}

with_fma!(pub(super) fn attend_head_avx2_fma = attend_head_avx2(q: &[f32], k: &[f32], v: &[f32], mask: &[bool], out: &mut [f32], dims: [usize; 3], scale: f32));

#[inline(always)]
pub(super) fn attend_head_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    dims: [usize; 3],
    scale: f32,
) {
    attend_head_impl::<Avx2Build>(q, k, v, mask, out, dims, scale)
}

with_fma!(pub(super) fn attend_head_fma = attend_head_portable(q: &[f32], k: &[f32], v: &[f32], mask: &[bool], out: &mut [f32], dims: [usize; 3], scale: f32));

#[inline(always)]
pub(super) fn attend_head_portable(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    dims: [usize; 3],
    scale: f32,
) {
    attend_head_impl::<Portable>(q, k, v, mask, out, dims, scale)
}

#[cfg(target_arch = "x86_64")]
mod attn512 {
    use std::arch::x86_64::*;

    use super::{HeadLoops, attend_head_impl, weighted_sum_tail_columns};

    pub(super) fn available() -> bool {
        super::cpu_level() >= super::CpuLevel::Avx512
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("fma")
    }

    struct Avx512;

    impl HeadLoops for Avx512 {
        #[inline(always)]
        fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
            // SAFETY: only reached through `attend_head` below, which the caller runs after
            // checking `available()`.
            unsafe { scores16(kt, stride, j0, q) }
        }
        #[inline(always)]
        fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { weighted_sum(v, p, lo, end, d, out) }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn attend_head(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[bool],
        out: &mut [f32],
        dims: [usize; 3],
        scale: f32,
    ) {
        attend_head_impl::<Avx512>(q, k, v, mask, out, dims, scale)
    }

    /// `vec_dot_f32_16keys` (see there for the order of operations), one key per lane.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    fn scores16(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
        let d = q.len();
        let np = d / 64 * 64;
        assert!(j0 + 16 <= stride && kt.len() >= d * stride);
        // SAFETY: every load reads kt[c * stride + j0..][..16] with c < d (asserted in bounds)
        // and q[c] with c < d.
        unsafe {
            let keys = kt.as_ptr().add(j0);
            let fma = |c: usize, acc: __m512| {
                _mm512_fmadd_ps(
                    _mm512_loadu_ps(keys.add(c * stride)),
                    _mm512_set1_ps(*q.get_unchecked(c)),
                    acc,
                )
            };
            let mut t3 = [_mm512_setzero_ps(); 8];
            for (i, t) in t3.iter_mut().enumerate() {
                let mut r = [_mm512_setzero_ps(); 2];
                for (half, rl) in r.iter_mut().enumerate() {
                    let l = 8 * (1 - half) + i;
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for c0 in (0..np).step_by(64) {
                        for (rr, a) in acc.iter_mut().enumerate() {
                            *a = fma(c0 + 16 * rr + l, *a);
                        }
                    }
                    *rl =
                        _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
                }
                *t = _mm512_add_ps(r[0], r[1]);
            }
            let t6: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t3[4 + i], t3[i]));
            let mut sum = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
            for c in np..d {
                sum = fma(c, sum);
            }
            let mut keys_out = [0.0f32; 16];
            _mm512_storeu_ps(keys_out.as_mut_ptr(), sum);
            keys_out
        }
    }

    /// `weighted_sum_rows` (see there for the order of operations), sixteen columns per register.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    fn weighted_sum(v: &[f32], p: &[f32], lo: usize, end: usize, d: usize, out: &mut [f32]) {
        assert!(lo.is_multiple_of(16) && lo <= end && end * d <= v.len() && end <= p.len());
        assert_eq!(out.len(), d);
        let d16 = d / 16 * 16;
        let full = lo + (end - lo) / 16 * 16;
        // SAFETY: rows j < end (asserted), columns c0..c0 + 16 <= d16 <= d.
        unsafe {
            let add_key = |j: usize, c0: usize, acc: __m512| {
                _mm512_fmadd_ps(
                    _mm512_loadu_ps(v.as_ptr().add(j * d + c0)),
                    _mm512_set1_ps(*p.get_unchecked(j)),
                    acc,
                )
            };
            for c0 in (0..d16).step_by(16) {
                let mut acc = [_mm512_setzero_ps(); 16];
                for j0 in (lo..full).step_by(16) {
                    for (l, a) in acc.iter_mut().enumerate() {
                        *a = add_key(j0 + l, c0, *a);
                    }
                }
                // The last, partial group of keys: a branch per lane keeps the lane index
                // constant (an indexed store would put all 16 accumulators in memory).
                for (l, a) in acc.iter_mut().enumerate() {
                    if full + l < end {
                        *a = add_key(full + l, c0, *a);
                    }
                }
                let t3: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(acc[8 + i], acc[i]));
                let t6: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t3[4 + i], t3[i]));
                let sum = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
                _mm512_storeu_ps(out.as_mut_ptr().add(c0), sum);
            }
        }
        weighted_sum_tail_columns(v, p, lo, end, d, out);
    }
}

/// One query head against its K/V head (see `attention_ggml`).
///
/// The `V·p` products are accumulated for all output columns at once (key-major, so V is read
/// row by row), each column keeping its own lane accumulators in ggml's order. Keys whose
/// probability is exactly 0 (masked: in the future, outside the window, or llama.cpp's padding
/// up to 256) only ever add `v·0 = ±0` to a lane, which leaves it unchanged (a lane is never -0:
/// it starts at +0 and `+0 + -0 = +0`), and their softmax chunks add 0 to the sum; so the loops
/// run over the 64-aligned span of visible keys only.
#[inline(always)]
pub(super) fn attend_head_impl<L: HeadLoops>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    [tq, tk, d]: [usize; 3],
    scale: f32,
) {
    let n_pad = tk.div_ceil(64) * 64;
    let mut p = vec![0.0f32; n_pad];
    // Decode's lane accumulators, `[lane][column]`: vec_dot_f32's 4 · LANES lanes.
    let vec_lanes = 4 * L::LANES;
    let mut acc = vec![0.0f32; if tq == 1 { vec_lanes * d } else { 0 }];
    // For several query rows, K transposed once (`[d][tk16]`, zero-padded to 16 keys) lets the
    // scores of 16 keys be computed together, one key per lane.
    let tk16 = tk.div_ceil(16) * 16;
    let kt = (tq >= 4).then(|| {
        let mut kt = vec![0.0f32; d * tk16];
        for (j, row) in k.chunks_exact(d).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                kt[c * tk16 + j] = x;
            }
        }
        kt
    });
    for i in 0..tq {
        let qrow = &q[i * d..(i + 1) * d];
        let mrow = &mask[i * tk..(i + 1) * tk];
        // The 64-aligned span holding every visible key (all of it if none is visible).
        let (lo, hi) = match (
            mrow.iter().position(|&m| !m),
            mrow.iter().rposition(|&m| !m),
        ) {
            (Some(first), Some(last)) => (first / 64 * 64, (last / 64 + 1) * 64),
            _ => (0, n_pad),
        };
        // Scores, scaled and masked, as ggml_soft_max sees its input row.
        let visible = |j: usize| j < tk && !mrow[j];
        match &kt {
            Some(kt) => {
                for j0 in (lo..hi.min(tk16)).step_by(16) {
                    let dots = L::scores16(kt, tk16, j0, qrow);
                    for (l, dot) in dots.into_iter().enumerate() {
                        let j = j0 + l;
                        p[j] = if visible(j) {
                            dot * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }
                p[tk16.clamp(lo, hi)..hi].fill(f32::NEG_INFINITY);
            }
            None => {
                for (j, pj) in p.iter_mut().enumerate().take(hi).skip(lo) {
                    *pj = if visible(j) {
                        L::key_dot(&k[j * d..(j + 1) * d], qrow) * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
        let max = p[lo..hi].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0f64;
        for chunk in p[lo..hi].chunks_exact_mut(L::LANES) {
            for e in chunk.iter_mut() {
                *e = L::expf(*e - max);
            }
            sum += L::chunk_sum(chunk) as f64;
        }
        let inv = (1.0 / sum) as f32;
        p[lo..hi].iter_mut().for_each(|e| *e *= inv);
        let o = &mut out[i * d..(i + 1) * d];
        if tq > 1 {
            L::weighted_sum(v, &p, lo, hi.min(tk), d, o);
        } else {
            acc.fill(0.0);
            for (j, &pj) in p.iter().enumerate().take(hi.min(tk)).skip(lo) {
                let l = j % vec_lanes;
                let lane = &mut acc[l * d..(l + 1) * d];
                for (a, &vj) in lane.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *a = vj.mul_add(pj, *a);
                }
            }
            L::decode_reduce(&acc, d, o);
        }
    }
}

/// `vec_dot_f32(d, K[j], q)` for the 16 keys `j0..j0 + 16` of a transposed `kt[d][stride]`, each
/// key in its own lane with exactly `vec_dot_f32`'s operations (vectorized over keys).
///
/// `vec_dot_f32`'s accumulator lane `l` of register `r` only ever sees the columns
/// `c ≡ 16r + l (mod 64)`, so the 64 chains are independent: they are run one final lane `l` at a
/// time (its four registers' chains, then `(r0 + r2) + (r1 + r3)`), and folded straight into the
/// first level of the horizontal sum. That keeps about a dozen 16-key vectors live instead of 64,
/// which the compiler could only keep on the stack.
#[inline(always)]
pub(super) fn vec_dot_f32_16keys(kt: &[f32], stride: usize, j0: usize, q: &[f32]) -> [f32; 16] {
    type Keys = [f32; 16];
    let d = q.len();
    let np = d / 64 * 64;
    let key_lanes = |c: usize| -> &Keys {
        (&kt[c * stride + j0..c * stride + j0 + 16])
            .try_into()
            .expect("16 keys")
    };
    let add = |a: &Keys, b: &Keys| -> Keys { std::array::from_fn(|x| a[x] + b[x]) };
    // GCC's reduce_add16 over l: (r[8 + i] + r[i]), then quarters, then (0+2) + (1+3), where
    // r[l] = (acc0[l] + acc2[l]) + (acc1[l] + acc3[l]) and acc_r[l] sums the columns 16r + l + 64i.
    // (Plain loops: a closure this size would not be inlined, and would then be compiled without
    // the caller's FMA.)
    let mut t3 = [[0.0f32; 16]; 8];
    for (i, t) in t3.iter_mut().enumerate() {
        let mut r = [[0.0f32; 16]; 2];
        for (half, rl) in r.iter_mut().enumerate() {
            let l = 8 * (1 - half) + i;
            let mut acc = [[0.0f32; 16]; 4];
            for c0 in (0..np).step_by(64) {
                for (r, a) in acc.iter_mut().enumerate() {
                    let c = c0 + 16 * r + l;
                    let (kc, qc) = (key_lanes(c), q[c]);
                    for x in 0..16 {
                        a[x] = kc[x].mul_add(qc, a[x]);
                    }
                }
            }
            *rl = add(&add(&acc[0], &acc[2]), &add(&acc[1], &acc[3]));
        }
        *t = add(&r[0], &r[1]);
    }
    let t6: [Keys; 4] = std::array::from_fn(|i| add(&t3[4 + i], &t3[i]));
    let mut sum = add(&add(&t6[0], &t6[2]), &add(&t6[1], &t6[3]));
    for c in np..d {
        let kc = key_lanes(c);
        for x in 0..16 {
            sum[x] = kc[x].mul_add(q[c], sum[x]);
        }
    }
    sum
}

/// tinyBLAS's `Σ_j V[j][c] · p[j]` for the keys `lo..end` (`lo` a multiple of 16) and every
/// column `c`: key `j` goes to lane `j % 16` of column `c`'s accumulator, in key order, and the
/// 16 lanes are summed as `reduce_add16`. Sixteen columns at a time, so that the 16 lanes × 16
/// columns stay in registers while V is read row by row.
#[inline(always)]
pub(super) fn weighted_sum_rows(
    v: &[f32],
    p: &[f32],
    lo: usize,
    end: usize,
    d: usize,
    out: &mut [f32],
) {
    type Cols = [f32; 16];
    let d16 = d / 16 * 16;
    for c0 in (0..d16).step_by(16) {
        let mut acc = [[0.0f32; 16]; 16];
        // Keys j0..j0 + 16 go to lanes 0..16 (j0 is a multiple of 16); the lane index is a
        // constant of the unrolled loop, so each lane's accumulator is a register.
        let full = lo + (end - lo) / 16 * 16;
        for j0 in (lo..full).step_by(16) {
            for (l, a) in acc.iter_mut().enumerate() {
                let j = j0 + l;
                let vj: &Cols = (&v[j * d + c0..j * d + c0 + 16])
                    .try_into()
                    .expect("16 cols");
                for x in 0..16 {
                    a[x] = vj[x].mul_add(p[j], a[x]);
                }
            }
        }
        for (l, a) in acc.iter_mut().enumerate().take(end - full) {
            let j = full + l;
            for x in 0..16 {
                a[x] = v[j * d + c0 + x].mul_add(p[j], a[x]);
            }
        }
        let add = |a: &Cols, b: &Cols| -> Cols { std::array::from_fn(|x| a[x] + b[x]) };
        let t3: [Cols; 8] = std::array::from_fn(|i| add(&acc[8 + i], &acc[i]));
        let t6: [Cols; 4] = std::array::from_fn(|i| add(&t3[4 + i], &t3[i]));
        out[c0..c0 + 16].copy_from_slice(&add(&add(&t6[0], &t6[2]), &add(&t6[1], &t6[3])));
    }
    weighted_sum_tail_columns(v, p, lo, end, d, out);
}

/// `weighted_sum_rows` for the columns past the last multiple of 16, one column at a time.
#[inline(always)]
pub(super) fn weighted_sum_tail_columns(
    v: &[f32],
    p: &[f32],
    lo: usize,
    end: usize,
    d: usize,
    out: &mut [f32],
) {
    for (c, o) in out.iter_mut().enumerate().skip(d / 16 * 16) {
        let mut acc = [0.0f32; 16];
        for j in lo..end {
            acc[j % 16] = v[j * d + c].mul_add(p[j], acc[j % 16]);
        }
        *o = reduce_add16(&acc);
    }
}

/// `reduce_add16` of each column of `lanes[16][d]` into `out[d]`, vectorized over columns.
#[inline(always)]
pub(super) fn reduce_add16_columns(lanes: &[f32], d: usize, out: &mut [f32]) {
    let l = |i: usize| &lanes[i * d..(i + 1) * d];
    for (c, o) in out.iter_mut().enumerate() {
        let t3: [f32; 8] = std::array::from_fn(|i| l(8 + i)[c] + l(i)[c]);
        let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
        *o = (t6[0] + t6[2]) + (t6[1] + t6[3]);
    }
}

/// ggml's `ggml_vec_dot_f32` (AVX2): four 8-lane FMA accumulators over steps of 32, reduced by
/// ggml's F32x8 reduction; the tail fused into the f32 sum.
#[inline(always)]
pub(super) fn vec_dot_f32_avx2(x: &[f32], y: &[f32]) -> f32 {
    let n = y.len();
    let np = n / 32 * 32;
    let mut acc = [[0.0f32; 8]; 4];
    for i in (0..np).step_by(32) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let e = i + 8 * j + l;
                *a = x[e].mul_add(y[e], *a);
            }
        }
    }
    let mut sum = reduce_f32x8(acc);
    for e in np..n {
        sum += x[e] * y[e];
    }
    sum
}

/// `vec_dot_f32_avx2(d, K[j], q)` for the 16 keys `j0..j0 + 16` of a transposed `kt[d][stride]`,
/// one key per lane (as `vec_dot_f32_16keys` does for the AVX-512 order): accumulator `a` lane
/// `l` sums the columns `c ≡ 8a + l (mod 32)`.
#[inline(always)]
pub(super) fn vec_dot_f32_avx2_16keys(
    kt: &[f32],
    stride: usize,
    j0: usize,
    q: &[f32],
) -> [f32; 16] {
    type Keys = [f32; 16];
    let d = q.len();
    let np = d / 32 * 32;
    let key_lanes = |c: usize| -> &Keys {
        (&kt[c * stride + j0..c * stride + j0 + 16])
            .try_into()
            .expect("16 keys")
    };
    let add = |a: &Keys, b: &Keys| -> Keys { std::array::from_fn(|x| a[x] + b[x]) };
    // r[l] = (acc0[l] + acc2[l]) + (acc1[l] + acc3[l]); t0[i] = r[i] + r[i + 4]; then
    // (t0[0] + t0[1]) + (t0[2] + t0[3]).
    let mut t0 = [[0.0f32; 16]; 4];
    for (i, t) in t0.iter_mut().enumerate() {
        let mut r = [[0.0f32; 16]; 2];
        for (half, rl) in r.iter_mut().enumerate() {
            let l = i + 4 * half;
            let mut acc = [[0.0f32; 16]; 4];
            for c0 in (0..np).step_by(32) {
                for (a, lanes) in acc.iter_mut().enumerate() {
                    let c = c0 + 8 * a + l;
                    let (kc, qc) = (key_lanes(c), q[c]);
                    for x in 0..16 {
                        lanes[x] = kc[x].mul_add(qc, lanes[x]);
                    }
                }
            }
            *rl = add(&add(&acc[0], &acc[2]), &add(&acc[1], &acc[3]));
        }
        *t = add(&r[0], &r[1]);
    }
    let mut sum = add(&add(&t0[0], &t0[1]), &add(&t0[2], &t0[3]));
    for c in np..d {
        let kc = key_lanes(c);
        for x in 0..16 {
            sum[x] = kc[x].mul_add(q[c], sum[x]);
        }
    }
    sum
}

/// tinyBLAS's (AVX2) `Σ_j V[j][c] · p[j]` for the keys `lo..end` (`lo` a multiple of 8): key `j`
/// goes to lane `j % 8` of column `c`'s accumulator, in key order, summed as `hsum8`. Sixteen
/// columns at a time.
#[inline(always)]
pub(super) fn weighted_sum_rows8(
    v: &[f32],
    p: &[f32],
    lo: usize,
    end: usize,
    d: usize,
    out: &mut [f32],
) {
    type Cols = [f32; 16];
    let d16 = d / 16 * 16;
    let full = lo + (end - lo) / 8 * 8;
    for c0 in (0..d16).step_by(16) {
        let mut acc = [[0.0f32; 16]; 8];
        for j0 in (lo..full).step_by(8) {
            for (l, a) in acc.iter_mut().enumerate() {
                let j = j0 + l;
                let vj: &Cols = (&v[j * d + c0..j * d + c0 + 16])
                    .try_into()
                    .expect("16 cols");
                for x in 0..16 {
                    a[x] = vj[x].mul_add(p[j], a[x]);
                }
            }
        }
        for (l, a) in acc.iter_mut().enumerate().take(end - full) {
            let j = full + l;
            for x in 0..16 {
                a[x] = v[j * d + c0 + x].mul_add(p[j], a[x]);
            }
        }
        for x in 0..16 {
            out[c0 + x] = hsum8(std::array::from_fn(|l| acc[l][x]));
        }
    }
    for (c, o) in out.iter_mut().enumerate().skip(d16) {
        let mut acc = [0.0f32; 8];
        for j in lo..end {
            acc[j % 8] = v[j * d + c].mul_add(p[j], acc[j % 8]);
        }
        *o = hsum8(acc);
    }
}

#[cfg(test)]
mod attention_tests {
    use super::*;

    /// The specification: the straightforward loops over the whole padded key range (strided
    /// reads of V), as first written from llama.cpp's ops.
    fn attend_head_spec(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[bool],
        out: &mut [f32],
        [tq, tk, d]: [usize; 3],
        scale: f32,
    ) {
        let n_pad = tk.div_ceil(64) * 64;
        let mut p = vec![0.0f32; n_pad];
        for i in 0..tq {
            let qrow = &q[i * d..(i + 1) * d];
            let mut max = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = if j < tk && !mask[i * tk + j] {
                    vec_dot_f32(d, |c| k[j * d + c], |c| qrow[c]) * scale
                } else {
                    f32::NEG_INFINITY
                };
                max = max.max(*pj);
            }
            let mut sum = 0.0f64;
            for chunk in p.chunks_exact_mut(16) {
                for e in chunk.iter_mut() {
                    *e = ggml_expf(*e - max);
                }
                sum += reduce_add16((&*chunk).try_into().expect("16 lanes")) as f64;
            }
            let inv = (1.0 / sum) as f32;
            p.iter_mut().for_each(|e| *e *= inv);
            for (c, o) in out[i * d..(i + 1) * d].iter_mut().enumerate() {
                let vcol = |j: usize| if j < tk { v[j * d + c] } else { 0.0 };
                *o = if tq == 1 {
                    vec_dot_f32(n_pad, vcol, |j| p[j])
                } else {
                    let mut acc = [0.0f32; 16];
                    for l in (0..n_pad).step_by(16) {
                        for (lane, a) in acc.iter_mut().enumerate() {
                            *a = vcol(l + lane).mul_add(p[l + lane], *a);
                        }
                    }
                    reduce_add16(&acc)
                };
            }
        }
    }

    type AttendHead = fn(&[f32], &[f32], &[f32], &[bool], &mut [f32], [usize; 3], f32);

    /// The key-major, visible-span attention gives the specification's bits: decode and prefill,
    /// with and without a cache offset and a window, head widths that are and are not multiples
    /// of 16, key counts on both sides of the 64-key blocks.
    #[test]
    fn attention_is_bit_identical_to_spec() {
        // The spec is the AVX-512 build's arithmetic; the default follows the host CPU.
        crate::flex::set_ggml_isa(crate::flex::GgmlIsa::Avx512);
        let mut seed = 5u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for d in [64usize, 24, 80, 128] {
            for (tq, past) in [
                (1usize, 0usize),
                (1, 70),
                (1, 130),
                (5, 0),
                (37, 0),
                (9, 120),
                (70, 3),
            ] {
                for window in [None, Some(50)] {
                    let tk = tq + past;
                    let q: Vec<f32> = (0..tq * d).map(|_| next() * 3.0).collect();
                    let k: Vec<f32> = (0..tk * d).map(|_| next() * 3.0).collect();
                    let v: Vec<f32> = (0..tk * d).map(|_| next()).collect();
                    let o = AttentionOptions {
                        scale: 1.0 / (d as f32).sqrt(),
                        q_offset: past,
                        window,
                        softcap: None,
                    };
                    let mask = reference::causal_mask(tq, tk, &o);
                    let mut want = vec![0.0f32; tq * d];
                    attend_head_spec(&q, &k, &v, &mask, &mut want, [tq, tk, d], o.scale);
                    // The build this CPU dispatches to, and the portable one.
                    let build: [(&str, AttendHead); 2] = [
                        ("dispatched", attend_head),
                        ("portable", attend_head_impl::<Portable>),
                    ];
                    for (name, attend) in build {
                        let mut got = vec![0.0f32; tq * d];
                        attend(&q, &k, &v, &mask, &mut got, [tq, tk, d], o.scale);
                        for (x, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{name} d={d} tq={tq} past={past} window={window:?} [{x}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
