//! The optimizer's elementwise work on the CPU, one pass each
//! ([`ToyBackend::adamw_step`](crate::ToyBackend::adamw_step),
//! [`ToyBackend::sum_squares`](crate::ToyBackend::sum_squares)).
//!
//! Why: burn composes an AdamW step of about fifteen elementwise tensor ops, each writing a fresh
//! parameter-sized buffer. For a 49,152 × 256 embedding (50 MB) every one of them is a new `mmap`
//! whose pages the kernel zeroes on first touch: 300 ms of a 1.2 s training step of the small
//! preset went to the optimizer, and 110 ms more to the gradient norm's `square` and clipping.
//! Here the step reads each parameter, gradient and moment once and writes them back in place,
//! with the same f32 operations in the same order as burn's, so the results are bit for bit
//! burn's.

use rayon::prelude::*;

use crate::AdamWStep;

/// Elements per parallel task: large enough to amortize the task, small enough to balance.
const CHUNK: usize = 1 << 15;

/// One AdamW step in place. `first`: the moments hold nothing yet (burn starts them from the
/// first gradient alone, not from zero moments: the same values, but the first step's
/// `m · β₁ + …` is skipped, so the bits follow that order too).
pub(super) fn adamw(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    first: bool,
    s: &AdamWStep,
) {
    let k = Constants::new(s);
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| adamw_chunk(p, g, m, v, first, &k));
}

/// The step's scalars, rounded to f32 as burn rounds them (`mul_scalar` takes an f64 and the
/// Flex backend casts it to the element type).
struct Constants {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    /// `1 - lr · weight_decay`, or none when the decay is zero (burn skips the multiply).
    keep: Option<f32>,
    lr: f32,
}

impl Constants {
    fn new(s: &AdamWStep) -> Self {
        let time = s.time as i32;
        let decay_rate = s.lr * s.weight_decay as f64;
        Constants {
            beta_1: s.beta_1,
            beta_2: s.beta_2,
            factor_1: 1.0 - s.beta_1,
            factor_2: 1.0 - s.beta_2,
            correction_1: 1f32 - s.beta_1.powi(time),
            correction_2: 1f32 - s.beta_2.powi(time),
            epsilon: s.epsilon,
            keep: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: s.lr as f32,
        }
    }
}

with_fma!(fn adamw_chunk = adamw_chunk_impl(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], first: bool, k: &Constants));

#[inline(always)]
fn adamw_chunk_impl(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    first: bool,
    k: &Constants,
) {
    for i in 0..p.len() {
        let g = g[i];
        let (mi, vi) = if first {
            (g * k.factor_1, (g * g) * k.factor_2)
        } else {
            (
                m[i] * k.beta_1 + g * k.factor_1,
                v[i] * k.beta_2 + (g * g) * k.factor_2,
            )
        };
        m[i] = mi;
        v[i] = vi;
        let delta = (mi / k.correction_1) / ((vi / k.correction_2).sqrt() + k.epsilon);
        let decayed = match k.keep {
            Some(keep) => p[i] * keep,
            None => p[i],
        };
        p[i] = decayed - delta * k.lr;
    }
}

/// `Σ x²`, accumulated in f64 per fixed chunk and the chunks added in order (the same bits
/// whatever the thread count).
pub(super) fn sum_squares(x: &[f32]) -> f32 {
    let partial: Vec<f64> = x.par_chunks(CHUNK).map(sum_squares_chunk).collect();
    partial.iter().sum::<f64>() as f32
}

with_fma!(fn sum_squares_chunk = sum_squares_chunk_impl(x: &[f32]) -> f64);

/// Eight running sums, so that the additions are not one serial chain (which ran at a quarter
/// of the memory's speed).
#[inline(always)]
fn sum_squares_chunk_impl(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] as f64 * c[l] as f64;
        }
    }
    let tail: f64 = tail.iter().map(|&v| v as f64 * v as f64).sum();
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    #[test]
    fn sum_squares_adds_every_element() {
        // Several chunks, and a length that is not a multiple of the eight lanes.
        let x: Vec<f32> = (0..100_003)
            .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
            .collect();
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let got = super::sum_squares(&x) as f64;
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        assert_eq!(super::sum_squares(&[]), 0.0);
        assert!(super::sum_squares(&[1.0, f32::NAN]).is_nan());
    }
}
