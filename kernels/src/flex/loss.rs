//! The output head's cross-entropy without the `[n, vocab]` logits
//! ([`ToyBackend::linear_cross_entropy`](crate::ToyBackend::linear_cross_entropy)).
//!
//! Why: at a 49,152-token vocabulary the logits are 192 KiB per token. Computed as a tensor they
//! are a fresh 100 MB buffer per 512 tokens, then every vocabulary-wide op of the loss and of its
//! backward (max, `x - max`, `exp`, sum, the one-hot subtraction, the scale, and the product's
//! transposes) reads and writes another, each page zeroed by the kernel on first touch. For
//! the small presets that was over half of a training step.
//!
//! How: the vocabulary is cut into slices of `width` rows of `w`, narrow enough that one slice's
//! logits for all `n` tokens stay in the L2 cache, and the slices into at most [`RUNS`] runs of
//! consecutive slices, each a parallel task. A task computes each slice's logits `h · w_sliceᵀ`
//! with `gemm` and consumes them at once:
//! - forward: into each row's running max and sum of `exp(x - max)`, and the target's logit;
//! - backward: into `G = softmax - onehot` (from the forward's `logsumexp`), then
//!   `dw_slice = s · Gᵀ · h` (rows of `dw` no other task writes) and `dh_run += s · G · w_slice`,
//!   with `s = dloss / n`.
//!
//! Runs are combined in their order, and the run boundaries depend only on the shapes, so the
//! result is the same whatever the thread count or which thread ran what.

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// The most parallel tasks a pass is cut into (fixed, so that the result does not depend on the
/// thread count; each run adds an `[n, d]` partial `dh` to the backward's memory).
const RUNS: usize = 16;

/// How the vocabulary is cut: slices of `width` rows of `w`, grouped into runs.
struct Plan {
    n: usize,
    d: usize,
    vocab: usize,
    width: usize,
    slices: usize,
    runs: usize,
}

impl Plan {
    fn new(n: usize, d: usize, vocab: usize) -> Self {
        // One slice's logits, n · width · 4 bytes, near 1 MiB: in L2 while they are consumed.
        let width = ((1 << 18) / n.max(1)).clamp(16, 256).min(vocab.max(1));
        let slices = vocab.div_ceil(width);
        Plan {
            n,
            d,
            vocab,
            width,
            slices,
            runs: slices.clamp(1, RUNS),
        }
    }

    /// The vocabulary rows of run `r`.
    fn run_rows(&self, r: usize) -> std::ops::Range<usize> {
        let first = r * self.slices / self.runs;
        let end = (r + 1) * self.slices / self.runs;
        first * self.width..(end * self.width).min(self.vocab)
    }

    /// The slices `(first vocabulary row, rows)` of the vocabulary rows `rows`.
    fn slices_of(&self, rows: std::ops::Range<usize>) -> impl Iterator<Item = (usize, usize)> {
        let end = rows.end;
        rows.step_by(self.width)
            .map(move |v0| (v0, self.width.min(end - v0)))
    }

    /// `logits[n, rows] = h · w[v0 .. v0 + rows]ᵀ`.
    fn logits(&self, h: &[f32], w: &[f32], (v0, rows): (usize, usize), logits: &mut [f32]) {
        let (n, d) = (self.n, self.d);
        debug_assert!(logits.len() >= n * rows && w.len() >= (v0 + rows) * d);
        // SAFETY: the strides describe `h[n, d]`, `w[v0..v0 + rows, d]` read as its transpose,
        // and `logits[n, rows]`, all within the slices (checked above and by the callers).
        unsafe {
            gemm(
                n,
                rows,
                d,
                logits.as_mut_ptr(),
                1,
                rows as isize,
                false,
                h.as_ptr(),
                1,
                d as isize,
                w[v0 * d..].as_ptr(),
                d as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    }
}

/// The loss `mean(logsumexp(row) - row[target])` and each row's `logsumexp`. `targets` must be
/// below the vocabulary size (`w.len() / d`).
pub(super) fn forward(h: &[f32], w: &[f32], targets: &[usize], d: usize) -> (f32, Vec<f32>) {
    let n = targets.len();
    let plan = Plan::new(n, d, w.len() / d);
    // Per run: each row's max, Σ exp(x - max) over the run's slices, and the target's logit if
    // the target is in the run.
    let runs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..plan.runs)
        .into_par_iter()
        .map(|r| {
            let mut max = vec![f32::NEG_INFINITY; n];
            let mut sum = vec![0.0f32; n];
            let mut target_logit = vec![0.0f32; n];
            let mut logits = vec![0.0f32; n * plan.width];
            for (v0, rows) in plan.slices_of(plan.run_rows(r)) {
                plan.logits(h, w, (v0, rows), &mut logits);
                for (i, x) in logits[..n * rows].chunks_exact(rows).enumerate() {
                    let m = slice_max(x);
                    if m > max[i] || m.is_nan() {
                        // A new max (or a NaN, which then stays): rescale the sum so far.
                        sum[i] *= (max[i] - m).exp();
                        max[i] = m;
                    }
                    sum[i] += sum_exp(x, max[i]);
                    if (v0..v0 + rows).contains(&targets[i]) {
                        target_logit[i] = x[targets[i] - v0];
                    }
                }
            }
            (max, sum, target_logit)
        })
        .collect();
    let mut loss = 0.0f64;
    let mut logsumexp = vec![0.0f32; n];
    for (i, &t) in targets.iter().enumerate() {
        let max = runs
            .iter()
            .map(|(m, _, _)| m[i])
            .fold(
                f32::NEG_INFINITY,
                |a, b| {
                    if b > a || b.is_nan() { b } else { a }
                },
            );
        let sum: f64 = runs
            .iter()
            .map(|(m, s, _)| s[i] as f64 * ((m[i] - max) as f64).exp())
            .sum();
        let lse = max + sum.ln() as f32;
        let run = (0..plan.runs)
            .find(|&r| plan.run_rows(r).contains(&t))
            .expect("targets are inside the vocabulary");
        loss += (lse - runs[run].2[i]) as f64;
        logsumexp[i] = lse;
    }
    ((loss / n.max(1) as f64) as f32, logsumexp)
}

/// The gradients `(dh[n, d], dw[vocab, d])` for `scale = dloss / n`, from the forward's
/// `logsumexp`; `dw` only when `weight_grad`.
pub(super) fn backward(
    h: &[f32],
    w: &[f32],
    targets: &[usize],
    logsumexp: &[f32],
    scale: f32,
    d: usize,
    weight_grad: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let n = targets.len();
    let plan = Plan::new(n, d, w.len() / d);
    // Without a weight gradient the runs still write into a (zero-length) piece each.
    let mut dw = vec![0.0f32; if weight_grad { w.len() } else { 0 }];
    // Each run's rows of `dw`, cut off in run order.
    let mut pieces = Vec::with_capacity(plan.runs);
    let mut rest = dw.as_mut_slice();
    for r in 0..plan.runs {
        let rows = plan.run_rows(r);
        let (piece, tail) = rest.split_at_mut(if weight_grad { rows.len() * d } else { 0 });
        pieces.push((rows, piece));
        rest = tail;
    }
    let partial_dh: Vec<Vec<f32>> = pieces
        .into_par_iter()
        .map(|(rows, dw_run)| {
            let run_v0 = rows.start;
            let mut dh = vec![0.0f32; n * d];
            let mut g = vec![0.0f32; n * plan.width];
            for (v0, width) in plan.slices_of(rows) {
                plan.logits(h, w, (v0, width), &mut g);
                let g = &mut g[..n * width];
                for (i, x) in g.chunks_exact_mut(width).enumerate() {
                    exp_shifted(x, logsumexp[i]);
                    if (v0..v0 + width).contains(&targets[i]) {
                        x[targets[i] - v0] -= 1.0;
                    }
                }
                if weight_grad {
                    let dw_slice = &mut dw_run[(v0 - run_v0) * d..(v0 - run_v0 + width) * d];
                    // SAFETY: `dw_slice[width, d] = scale · Gᵀ · h` with `G[n, width]` read
                    // transposed and `h[n, d]`, all inside the slices' lengths.
                    unsafe {
                        gemm(
                            width,
                            d,
                            n,
                            dw_slice.as_mut_ptr(),
                            1,
                            d as isize,
                            false,
                            g.as_ptr(),
                            width as isize,
                            1,
                            h.as_ptr(),
                            1,
                            d as isize,
                            0.0,
                            scale,
                            false,
                            false,
                            false,
                            Parallelism::None,
                        );
                    }
                }
                // SAFETY: `dh[n, d] += scale · G · w[v0..v0 + width, d]`, all inside the
                // slices' lengths.
                unsafe {
                    gemm(
                        n,
                        d,
                        width,
                        dh.as_mut_ptr(),
                        1,
                        d as isize,
                        true,
                        g.as_ptr(),
                        1,
                        width as isize,
                        w[v0 * d..].as_ptr(),
                        1,
                        d as isize,
                        1.0,
                        scale,
                        false,
                        false,
                        false,
                        Parallelism::None,
                    );
                }
            }
            dh
        })
        .collect();
    let mut dh = vec![0.0f32; n * d];
    for part in &partial_dh {
        for (a, b) in dh.iter_mut().zip(part) {
            *a += b;
        }
    }
    (dh, weight_grad.then_some(dw))
}

with_fma!(fn slice_max = slice_max_impl(x: &[f32]) -> f32);

/// The largest element, or NaN if there is one (a NaN logit must not vanish from the loss).
#[inline(always)]
fn slice_max_impl(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut nan = [false; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
            nan[l] |= c[l].is_nan();
        }
    }
    let mut max = acc
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for &v in tail {
        max = if v > max { v } else { max };
    }
    if nan.iter().any(|&b| b) || tail.iter().any(|v| v.is_nan()) {
        return f32::NAN;
    }
    max
}

with_fma!(fn sum_exp = sum_exp_impl(x: &[f32], max: f32) -> f32);

/// `Σ exp(x - max)`, sixteen lanes at a time.
#[inline(always)]
fn sum_exp_impl(x: &[f32], max: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            acc[l] += exp_nonpositive(c[l] - max);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for &v in tail {
        sum += exp_nonpositive(v - max);
    }
    sum
}

with_fma!(fn exp_shifted = exp_shifted_impl(x: &mut [f32], shift: f32));

/// `x = exp(x - shift)` in place.
#[inline(always)]
fn exp_shifted_impl(x: &mut [f32], shift: f32) {
    for v in x {
        *v = exp_nonpositive(*v - shift);
    }
}

/// `exp(x)` for the `x ≤ 0` (up to rounding) of a softmax, branch-free so that loops of it
/// vectorize: ggml's degree-5 polynomial on the reduced argument (as [`super::ggml_expf`]),
/// scaled by `2^n` by adding `n` to the exponent bits. Arguments are clamped to `[-86, 88]`,
/// where that addition cannot leave the normal range: `exp(-86) ≈ 4e-38` stands for anything
/// smaller, which no softmax sum of at least 1 can tell apart. NaN stays NaN.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Comparisons, not `max`/`min`, which would replace a NaN.
    let x = if x < -86.0 { -86.0 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let (j, z) = super::expf_parts(x);
    if j.is_nan() {
        return j;
    }
    // z's bits are 0x4b40_0000 + n; shifted by 23 only n << 23 is left: 2^n's exponent.
    f32::from_bits(j.to_bits().wrapping_add(z.to_bits() << 23))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The specification: logits as plain f64 dot products, then the textbook formulas.
    fn spec(
        h: &[f32],
        w: &[f32],
        targets: &[usize],
        d: usize,
    ) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (n, vocab) = (targets.len(), w.len() / d);
        let logits: Vec<f64> = (0..n * vocab)
            .map(|ij| {
                let (i, j) = (ij / vocab, ij % vocab);
                (0..d)
                    .map(|k| h[i * d + k] as f64 * w[j * d + k] as f64)
                    .sum()
            })
            .collect();
        let mut loss = 0.0;
        let mut lse = vec![0.0; n];
        let mut dh = vec![0.0; n * d];
        let mut dw = vec![0.0; vocab * d];
        for i in 0..n {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            lse[i] = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            loss += lse[i] - row[targets[i]];
            for j in 0..vocab {
                let g = ((row[j] - lse[i]).exp() - (j == targets[i]) as u8 as f64) / n as f64;
                for k in 0..d {
                    dh[i * d + k] += g * w[j * d + k] as f64;
                    dw[j * d + k] += g * h[i * d + k] as f64;
                }
            }
        }
        (loss / n as f64, lse, dh, dw)
    }

    fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
        let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs()));
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * scale,
                "{what}[{i}]: {g} vs {w} (scale {scale})"
            );
        }
    }

    #[test]
    fn loss_and_gradients_match_the_textbook_formulas() {
        // One slice; four runs of one slice each, the last ragged; more slices than runs; a
        // slice narrowed by many tokens (width 2^18 / 2100 -> 124).
        for (n, d, vocab) in [(3, 8, 10), (5, 24, 1000), (40, 16, 5000), (2100, 4, 300)] {
            let mut rng = toy_core::rng::SplitMix64::new((n * vocab) as u64);
            let mut draw = |len: usize, s: f32| -> Vec<f32> {
                (0..len)
                    .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * s)
                    .collect()
            };
            let h = draw(n * d, 4.0);
            let w = draw(vocab * d, 4.0);
            let targets: Vec<usize> = (0..n).map(|i| (i * 7919 + 3) % vocab).collect();
            let (loss, lse) = forward(&h, &w, &targets, d);
            let (want_loss, want_lse, want_dh, want_dw) = spec(&h, &w, &targets, d);
            close("loss", &[loss], &[want_loss], 1e-5);
            close("lse", &lse, &want_lse, 1e-5);
            let (dh, dw) = backward(&h, &w, &targets, &lse, 1.0 / n as f32, d, true);
            close("dh", &dh, &want_dh, 1e-4);
            close("dw", &dw.unwrap(), &want_dw, 1e-4);
            // A frozen head: the same dh, no dw.
            let (frozen_dh, none) = backward(&h, &w, &targets, &lse, 1.0 / n as f32, d, false);
            assert_eq!(frozen_dh, dh);
            assert!(none.is_none());
        }
    }

    #[test]
    fn a_nan_logit_makes_the_loss_nan() {
        let (d, vocab) = (4, 100);
        let h = vec![0.5f32; 2 * d];
        let mut w = vec![0.25f32; vocab * d];
        w[57 * d] = f32::NAN; // one vocabulary row, not a target
        let (loss, _) = forward(&h, &w, &[3, 9], d);
        assert!(loss.is_nan());
    }

    #[test]
    fn exp_is_accurate_over_the_softmax_range() {
        let mut x = -86.0f32;
        while x <= 1.0 {
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        let floor = exp_nonpositive(-1000.0);
        assert!(floor > 0.0 && floor == exp_nonpositive(-86.0));
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }
}
