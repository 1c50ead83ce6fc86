//! Backward passes of the row-wise ops on the CPU, one pass each
//! ([`ToyBackend::rms_norm_backward`](crate::ToyBackend::rms_norm_backward),
//! [`ToyBackend::swiglu_backward`](crate::ToyBackend::swiglu_backward)).
//!
//! Why: burn's autodiff of the reference bodies records about ten elementwise ops per RMSNorm and
//! SwiGLU and runs each op's backward as its own tensor-wide pass (with broadcasts, strided
//! reads and a fresh buffer per pass). Here each gradient reads its inputs once.

use rayon::prelude::*;

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
