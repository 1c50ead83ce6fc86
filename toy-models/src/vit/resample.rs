//! Resampling the position embeddings to another patch grid, as timm does it
//! (`resample_abs_pos_embed`: `F.interpolate(mode="bicubic", antialias=True,
//! align_corners=False)`): PyTorch's antialiased bicubic, which is PIL's — a cubic filter with
//! `a = -0.5`, widened by the scale when shrinking, its weights renormalized where they fall off
//! the edge (no edge replication). It is separable, so the grid `[g, g, d]` becomes
//! `Wh · grid · Wwᵀ` with two small weight matrices computed here on the host: two matmuls,
//! which every backend runs and autodiff differentiates.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// The cubic kernel PyTorch's antialiased path uses (`a = -0.5`).
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// `[to, from]`: row `i` holds the weights output position `i` gives each input position
/// (PyTorch's `_compute_indices_min_size_weights_aa`, align_corners = false).
pub fn weights(from: usize, to: usize) -> Vec<f32> {
    let scale = from as f64 / to as f64;
    // Shrinking widens the filter by the scale (that is the antialiasing).
    let (support, inv_scale) = if scale >= 1.0 {
        (2.0 * scale, 1.0 / scale)
    } else {
        (2.0, 1.0)
    };
    let mut out = vec![0.0f32; to * from];
    for i in 0..to {
        let center = scale * (i as f64 + 0.5);
        // C's (int) truncation toward zero, as PyTorch writes it.
        let lo = ((center - support + 0.5) as i64).max(0) as usize;
        let hi = ((center + support + 0.5) as i64).clamp(0, from as i64) as usize;
        let w: Vec<f64> = (lo..hi)
            .map(|j| cubic((j as f64 - center + 0.5) * inv_scale))
            .collect();
        let total: f64 = w.iter().sum();
        for (j, wj) in (lo..hi).zip(w) {
            out[i * from + j] = if total != 0.0 {
                (wj / total) as f32
            } else {
                0.0
            };
        }
    }
    out
}

/// `grid[g_h, g_w, d]` resampled to `[to_h, to_w, d]`.
pub fn resample<B: Backend>(grid: Tensor<B, 3>, to_h: usize, to_w: usize) -> Tensor<B, 3> {
    let [g_h, g_w, d] = grid.dims();
    let device = grid.device();
    let matrix = |from: usize, to: usize| {
        Tensor::<B, 2>::from_data(TensorData::new(weights(from, to), [to, from]), &device)
    };
    // Rows: [to_h, g_h] · [g_h, g_w·d].
    let rows = matrix(g_h, to_h).matmul(grid.reshape([g_h, g_w * d]));
    // Columns, per output row: [to_w, g_w] · [g_w, d].
    let cols = matrix(g_w, to_w)
        .unsqueeze_dim::<3>(0)
        .expand([to_h, to_w, g_w]);
    cols.matmul(rows.reshape([to_h, g_w, d]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each output's weights sum to 1, and the same size is the identity.
    #[test]
    fn weights_are_normalized_and_identity_at_the_same_size() {
        for (from, to) in [(4, 6), (6, 4), (14, 16), (16, 7), (3, 3)] {
            let w = weights(from, to);
            for row in w.chunks(from) {
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-6, "{from}->{to}: row sums to {sum}");
            }
        }
        let w = weights(5, 5);
        for i in 0..5 {
            for j in 0..5 {
                assert_eq!(w[i * 5 + j], if i == j { 1.0 } else { 0.0 }, "({i}, {j})");
            }
        }
    }
}
