//! Rotary position embedding angles, computed on the host exactly as llama.cpp does
//! (`ggml_rope_cache_init` + `rope_yarn` in ggml-cpu/ops.cpp, `ggml_rope_yarn_corr_dims` in
//! ggml.c, the YaRN attention factor in llama-context.cpp). Backends receive the resulting cos/sin
//! tables and only rotate, so every backend uses the same angles and they match llama.cpp's bits.

use crate::config::{ModelConfig, RopeScaling};

/// Everything that determines the angles.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeAngles {
    /// Rotated dims per head (pairs = `n_dims / 2`).
    pub n_dims: usize,
    /// RoPE base θ: pair i turns by `freq_base^(-2i / n_dims)` radians per position.
    pub freq_base: f32,
    /// Positions are multiplied by this (1 / scaling factor for linear and YaRN).
    pub freq_scale: f32,
    /// YaRN's extrapolation mix (1 with YaRN, else 0).
    pub ext_factor: f32,
    /// Magnitude scale of cos/sin (YaRN's attention factor; 1 otherwise).
    pub attn_factor: f32,
    /// YaRN's correction range, in pair indices.
    pub corr_dims: [f32; 2],
    /// Per-pair frequency divisors (`rope_freqs.weight`, Llama 3.x).
    pub freq_factors: Option<Vec<f32>>,
}

impl RopeAngles {
    /// The angles of a model, with its `rope_freqs.weight` factors if it has them.
    pub fn new(config: &ModelConfig, freq_factors: Option<Vec<f32>>) -> Self {
        let n_dims = config.rope_dim;
        let freq_base = config.rope_theta;
        let (freq_scale, ext_factor, attn_factor, corr_dims) = match config.rope_scaling {
            // `rope.scaling.attn_factor` scales cos/sin whatever the scaling (llama_context).
            RopeScaling::None => (1.0, 0.0, config.rope_attn_factor, [0.0, 0.0]),
            RopeScaling::Linear { factor } => {
                (1.0 / factor, 0.0, config.rope_attn_factor, [0.0, 0.0])
            }
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                attn_factor,
            } => {
                let freq_scale: f32 = 1.0 / factor;
                // llama_context: the YaRN magnitude 0.1·ln(s) + 1, divided by the same factor that
                // rope_yarn multiplies back in; both in f32 as there.
                let mscale = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * factor.ln() + 1.0
                };
                let attn = mscale * (1.0 / (1.0 + 0.1 * (1.0 / freq_scale).ln())) * attn_factor;
                let dims =
                    yarn_corr_dims(n_dims, original_context, freq_base, beta_fast, beta_slow);
                (freq_scale, 1.0, attn, dims)
            }
        };
        RopeAngles {
            n_dims,
            freq_base,
            freq_scale,
            ext_factor,
            attn_factor,
            corr_dims,
            freq_factors,
        }
    }

    /// The angles of gemma3's sliding-window layers: base `rope_theta_swa`, no frequency
    /// scaling (llama.cpp's `*_train_swa` values).
    pub fn sliding_window_layers(config: &ModelConfig) -> Option<Self> {
        config.rope_theta_swa.map(|freq_base| RopeAngles {
            n_dims: config.rope_dim,
            freq_base,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: config.rope_attn_factor,
            corr_dims: [0.0, 0.0],
            freq_factors: None,
        })
    }

    /// `(cos, sin)`, each `[positions.len() * n_dims / 2]`, row-major by position.
    pub fn cos_sin(&self, positions: impl IntoIterator<Item = i64>) -> (Vec<f32>, Vec<f32>) {
        let half = self.n_dims / 2;
        let theta_scale = self.freq_base.powf(-2.0 / self.n_dims as f32);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            // ggml_rope_cache_init: the angle of pair i is p · theta_scale^i by f32 recurrence.
            let mut theta = p as f32;
            for i in 0..half {
                let ff = self.freq_factors.as_ref().map_or(1.0, |f| f[i]);
                let (c, s) = self.rope_yarn(theta / ff, 2 * i);
                cos.push(c);
                sin.push(s);
                theta *= theta_scale;
            }
        }
        (cos, sin)
    }

    /// ggml's `rope_yarn` for the pair starting at dim `i0`.
    fn rope_yarn(&self, theta_extrap: f32, i0: usize) -> (f32, f32) {
        let theta_interp = self.freq_scale * theta_extrap;
        let mut theta = theta_interp;
        let mut mscale = self.attn_factor;
        if self.ext_factor != 0.0 {
            let ramp_mix = yarn_ramp(self.corr_dims[0], self.corr_dims[1], i0) * self.ext_factor;
            theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
        }
        (theta.cos() * mscale, theta.sin() * mscale)
    }
}

fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// `ggml_rope_yarn_corr_dims`: the pair range between the dims that rotate `beta_fast` and
/// `beta_slow` times over the original context.
fn yarn_corr_dims(
    n_dims: usize,
    n_ctx_orig: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let corr_dim = |n_rot: f32| {
        n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let start = corr_dim(beta_fast).floor();
    let end = corr_dim(beta_slow).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn angles(scaling: RopeScaling) -> RopeAngles {
        let (freq_scale, ext, attn, dims) = match scaling {
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                ..
            } => {
                let mscale = 0.1 * factor.ln() + 1.0;
                (
                    1.0 / factor,
                    1.0,
                    mscale / (1.0 + 0.1 * factor.ln()),
                    yarn_corr_dims(64, original_context, 1e4, beta_fast, beta_slow),
                )
            }
            _ => (1.0, 0.0, 1.0, [0.0, 0.0]),
        };
        RopeAngles {
            n_dims: 64,
            freq_base: 1e4,
            freq_scale,
            ext_factor: ext,
            attn_factor: attn,
            corr_dims: dims,
            freq_factors: None,
        }
    }

    /// Plain RoPE: cos/sin of p · base^(-2i/d), to f32 accuracy.
    #[test]
    fn plain_angles() {
        let (cos, sin) = angles(RopeScaling::None).cos_sin([0, 7, 300]);
        for (row, p) in [0f64, 7.0, 300.0].into_iter().enumerate() {
            for i in 0..32 {
                let a = p * 1e4f64.powf(-2.0 * i as f64 / 64.0);
                assert!(
                    (cos[row * 32 + i] as f64 - a.cos()).abs() < 2e-4,
                    "p {p} i {i}"
                );
                assert!(
                    (sin[row * 32 + i] as f64 - a.sin()).abs() < 2e-4,
                    "p {p} i {i}"
                );
            }
        }
    }

    /// YaRN: fast pairs (below the correction range) keep the original angle, slow ones (above
    /// it) are interpolated by 1/factor, with the magnitude scale on both.
    #[test]
    fn yarn_angles_interpolate_slow_dims_only() {
        let y = angles(RopeScaling::Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        });
        let [low, high] = y.corr_dims;
        assert!(0.0 <= low && low < high && high <= 63.0, "{low} {high}");
        let (cos, _) = y.cos_sin([100]);
        let m = y.attn_factor * (1.0 + 0.1 * 4f32.ln());
        let theta = |i: usize| 100.0 * 1e4f64.powf(-2.0 * i as f64 / 64.0);
        assert!((cos[0] as f64 - theta(0).cos() * m as f64).abs() < 1e-3);
        assert!((cos[31] as f64 - (theta(31) / 4.0).cos() * m as f64).abs() < 1e-3);
    }
}
