//! Backward passes on the CPU
//! ([`ToyBackend::rms_norm_backward`](crate::ToyBackend::rms_norm_backward),
//! [`ToyBackend::swiglu_backward`](crate::ToyBackend::swiglu_backward),
//! [`ToyBackend::attention_backward`](crate::ToyBackend::attention_backward)).
//!
//! Why: burn's autodiff of the reference bodies records about ten elementwise ops per RMSNorm and
//! SwiGLU and runs each op's backward as its own tensor-wide pass (with broadcasts, strided
//! reads and a fresh buffer per pass); the reference attention backward is some twenty tensor
//! ops per chunk of rows. Here RMSNorm and SwiGLU read their inputs once, and attention runs one
//! task per K/V head: five `gemm` products and two row passes on buffers of that head.

use gemm::Parallelism;
use rayon::prelude::*;

use super::AttnDims;
use super::linear::product;
use crate::AttentionOptions;

/// Rows per parallel task of the RMSNorm backward. Its weight gradient is summed per task and the
/// task sums are added in task order, so the bits do not depend on the thread count.
const ROWS: usize = 32;

/// Elements per parallel task of the SwiGLU backward.
const CHUNK: usize = 1 << 14;

/// `(dx, dweight)` of `y = x · r · w` per row of `d` (`r = 1 / sqrt(mean(x²) + eps)`, computed as
/// the forward [`super::rms_norm_row`] does), for the output gradient `dy`.
pub(super) fn rms_norm_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    weight_grad: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let d = w.len();
    let mut dx = vec![0.0f32; x.len()];
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(ROWS * d)
        .zip(x.par_chunks(ROWS * d).zip(dy.par_chunks(ROWS * d)))
        .map(|(dx, (x, dy))| {
            let mut dw = if weight_grad {
                vec![0.0f32; d]
            } else {
                Vec::new()
            };
            for ((dx, x), dy) in dx.chunks_mut(d).zip(x.chunks(d)).zip(dy.chunks(d)) {
                rms_norm_backward_row(x, w, dy, eps, dx, &mut dw);
            }
            dw
        })
        .collect();
    let dweight = weight_grad.then(|| {
        let mut dw = vec![0.0f32; d];
        for p in &partial {
            dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        dw
    });
    (dx, dweight)
}

/// One row: `dx = r · (g − x · r² · mean(g · x))` with `g = dy · w`; adds `dy · x · r` into `dw`
/// unless `dw` is empty.
fn rms_norm_backward_row(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let n = x.len() as f64;
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let r = 1.0 / ((sum / n) as f32 + eps).sqrt();
    let gx: f64 = x
        .iter()
        .zip(dy.iter().zip(w))
        .map(|(&x, (&dy, &w))| (dy * w * x) as f64)
        .sum();
    let c = r * r * (gx / n) as f32;
    for ((dx, &x), (&dy, &w)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)) {
        *dx = r * (dy * w - x * c);
    }
    if !dw.is_empty() {
        for ((dw, &x), &dy) in dw.iter_mut().zip(x).zip(dy) {
            *dw += dy * x * r;
        }
    }
}

/// `(dgate, dup)` of `y = silu(g) · u` for the output gradient `dy`, with the sigmoid from the
/// same `expf` as the forward ([`super::ggml_expf`]).
pub(super) fn swiglu_backward(g: &[f32], u: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut d_gate = vec![0.0f32; g.len()];
    let mut d_up = vec![0.0f32; g.len()];
    d_gate
        .par_chunks_mut(CHUNK)
        .zip(d_up.par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(dy.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), dy))| swiglu_backward_chunk(g, u, dy, dg, du));
    (d_gate, d_up)
}

with_fma!(fn swiglu_backward_chunk = swiglu_backward_impl(
    g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]
));

#[inline(always)]
fn swiglu_backward_impl(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
    for i in 0..g.len() {
        let x = g[i];
        let s = 1.0 / (1.0 + super::ggml_expf(0.0 - x));
        du[i] = dy[i] * x * s;
        dg[i] = dy[i] * u[i] * s * (1.0 + x * (1.0 - s));
    }
}

/// `(dq, dk, dv)` of causal attention for the output gradient `d_out`, one task per (batch, K/V
/// head). The `group` query heads that share a K/V head are adjacent in `q[b, h, tq, d]`, so they
/// are one `[group·tq, d]` block `Q`, as in the reference: `S = scale · Q·Kᵀ` (soft-capped,
/// masked), `P = softmax(S)`, `dP = dO·Vᵀ`, `dS = P ⊙ (dP − rowsum(P ⊙ dP))` (times `1 − tanh²`
/// under a soft-cap, and the scale), then `dV = Pᵀ·dO`, `dQ = dS·K`, `dK = dSᵀ·Q`. The sums over
/// the group are inside the products, in a fixed order.
pub(super) fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_out: &[f32],
    dims: &AttnDims,
    o: &AttentionOptions,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims {
        b,
        h,
        tq,
        d,
        h_kv,
        tk,
    } = *dims;
    let rows = h / h_kv * tq;
    let mut dq = vec![0.0f32; b * h * tq * d];
    let mut dk = vec![0.0f32; b * h_kv * tk * d];
    let mut dv = vec![0.0f32; b * h_kv * tk * d];
    dq.par_chunks_mut(rows * d)
        .zip(dk.par_chunks_mut(tk * d).zip(dv.par_chunks_mut(tk * d)))
        .enumerate()
        .for_each(|(t, (dq, (dk, dv)))| {
            let (bq, bk) = (
                t * rows * d..(t + 1) * rows * d,
                t * tk * d..(t + 1) * tk * d,
            );
            let (qg, dog) = (&q[bq.clone()], &d_out[bq]);
            let (kh, vh) = (&k[bk.clone()], &v[bk]);
            let mut p = vec![0.0f32; rows * tk];
            let mut ds = vec![0.0f32; rows * tk];
            let mut tanh = vec![0.0f32; if o.softcap.is_some() { rows * tk } else { 0 }];
            // SAFETY (all products): every pointer, stride and extent below addresses these
            // slices' elements: `[rows, d]`, `[tk, d]` and `[rows, tk]` row-major blocks.
            unsafe {
                product(
                    (rows, tk, d),
                    p.as_mut_ptr(),
                    tk,
                    (qg, 1, d),
                    (kh, d, 1),
                    Parallelism::None,
                ); // Q·Kᵀ
                product(
                    (rows, tk, d),
                    ds.as_mut_ptr(),
                    tk,
                    (dog, 1, d),
                    (vh, d, 1),
                    Parallelism::None,
                ); // dO·Vᵀ
            }
            for r in 0..rows {
                let pos = o.q_offset + r % tq;
                let hi = tk.min(pos + 1);
                let lo = o.window.map_or(0, |w| (pos + 1).saturating_sub(w)).min(hi);
                let at = r * tk..(r + 1) * tk;
                let t = if tanh.is_empty() {
                    &mut tanh[..]
                } else {
                    &mut tanh[at.clone()]
                };
                score_grad_row(&mut p[at.clone()], &mut ds[at], t, lo, hi, o);
            }
            unsafe {
                product(
                    (tk, d, rows),
                    dv.as_mut_ptr(),
                    d,
                    (&p, tk, 1),
                    (dog, 1, d),
                    Parallelism::None,
                ); // Pᵀ·dO
                product(
                    (rows, d, tk),
                    dq.as_mut_ptr(),
                    d,
                    (&ds, 1, tk),
                    (kh, 1, d),
                    Parallelism::None,
                ); // dS·K
                product(
                    (tk, d, rows),
                    dk.as_mut_ptr(),
                    d,
                    (&ds, tk, 1),
                    (qg, 1, d),
                    Parallelism::None,
                ); // dSᵀ·Q
            }
        });
    (dq, dk, dv)
}

with_fma!(fn score_grad_row = score_grad_row_impl(
    p: &mut [f32], ds: &mut [f32], tanh: &mut [f32], lo: usize, hi: usize, o: &AttentionOptions
));

/// One query row: `p` holds `q·k` for every key and becomes the probabilities (zero outside the
/// visible keys `lo..hi`); `ds` holds `dO·v` and becomes the gradient of `q·k`.
#[inline(always)]
fn score_grad_row_impl(
    p: &mut [f32],
    ds: &mut [f32],
    tanh: &mut [f32],
    lo: usize,
    hi: usize,
    o: &AttentionOptions,
) {
    let mut max = f32::NEG_INFINITY;
    for j in lo..hi {
        let mut s = p[j] * o.scale;
        if let Some(cap) = o.softcap {
            tanh[j] = (s / cap).tanh();
            s = cap * tanh[j];
        }
        p[j] = s;
        max = max.max(s);
    }
    let mut sum = 0.0f32;
    for x in &mut p[lo..hi] {
        *x = super::ggml_expf(*x - max);
        sum += *x;
    }
    let inv = 1.0 / sum;
    let mut row_dot = 0.0f32;
    for j in lo..hi {
        p[j] *= inv;
        row_dot += p[j] * ds[j];
    }
    for j in lo..hi {
        let mut g = p[j] * (ds[j] - row_dot) * o.scale;
        if o.softcap.is_some() {
            g *= 1.0 - tanh[j] * tanh[j];
        }
        ds[j] = g;
    }
    p[..lo].fill(0.0);
    p[hi..].fill(0.0);
    ds[..lo].fill(0.0);
    ds[hi..].fill(0.0);
}
