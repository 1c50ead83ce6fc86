//! ggml's elementwise CPU ops that toy reproduces bit for bit: RoPE's rotation, the vector
//! `expf` and the SwiGLU gate built on it, and RMSNorm.

use super::*;

with_fma!(pub(super) fn rope_head = rope_head_impl(head: &mut [f32], cos: &[f32], sin: &[f32], dims: [usize; 2], layout: RopeLayout));

/// Rotate every row (token) of one head with that token's cos/sin row.
#[inline(always)]
pub(super) fn rope_head_impl(
    head: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    [d, half]: [usize; 2],
    layout: RopeLayout,
) {
    for (ti, row) in head.chunks_mut(d).enumerate() {
        let (cs, ss) = (
            &cos[ti * half..(ti + 1) * half],
            &sin[ti * half..(ti + 1) * half],
        );
        for i in 0..half {
            let (i0, i1) = match layout {
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                RopeLayout::Neox => (i, i + half),
            };
            let (x0, x1, c, s) = (row[i0], row[i1], cs[i], ss[i]);
            // GCC contracts ggml's `x0*cos - x1*sin` / `x0*sin + x1*cos` into these FMAs
            // (read off the disassembly of llama.cpp's x86-64 build).
            row[i0] = x0.mul_add(c, -(x1 * s));
            row[i1] = x0.mul_add(s, x1 * c);
        }
    }
}

/// ggml's vectorized `expf` (`ggml_v_expf`, AVX-512 flavour) in scalar form: a degree-5
/// polynomial on the reduced argument, scaled by `2^n` in one rounding. Used where llama.cpp
/// uses it (SiLU, softmax) so that our activations round exactly like its.
#[inline(always)]
pub(super) fn ggml_expf(x: f32) -> f32 {
    let (j, z) = expf_parts(x);
    let n = z - EXPF_ROUND;
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // `_mm512_scalef_ps(j, n)`: j · 2^n, exact in f64 for |n| <= 192, then one rounding.
    let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * pow2) as f32
}

/// 0x1.8p23: adding it to a float below 2^22 rounds to an integer (in the low mantissa bits).
pub(super) const EXPF_ROUND: f32 = 12_582_912.0;

/// The shared part of ggml's vector `expf`: `(j, z)` with `exp(x) = j · 2^n`, `j` ggml's degree-5
/// polynomial of the reduced argument `x - n ln 2`, and `z = x / ln 2 + EXPF_ROUND`, whose value
/// is `n + EXPF_ROUND` and whose low mantissa bits hold `n`. Callers differ in how they scale.
#[inline(always)]
pub(super) fn expf_parts(x: f32) -> (f32, f32) {
    let c = f32::from_bits;
    let z = x.mul_add(c(0x3fb8_aa3b), EXPF_ROUND); // x / ln 2 + r
    let n = z - EXPF_ROUND;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x)); // x - n ln 2, in two parts
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    let j = j.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    (j, z)
}

with_fma!(pub(super) fn swiglu_row = swiglu_row_impl(g: &[f32], u: &[f32], y: &mut [f32], isa: GgmlIsa));

/// ggml's `swiglu`: `silu(g) * u` with `silu(x) = x / (1 + expf(-x))`, a vector (16 lanes in the
/// AVX-512 build, 8 in the AVX2 one) at a time with that build's vector `expf`, the tail (row
/// length not a multiple of the vector) with libm's `expf`.
#[inline(always)]
pub(super) fn swiglu_row_impl(g: &[f32], u: &[f32], y: &mut [f32], isa: GgmlIsa) {
    let vector = g.len() / isa.lanes() * isa.lanes();
    for i in 0..g.len() {
        let x = g[i];
        let e = if i >= vector {
            (-x).exp()
        } else if isa == GgmlIsa::Avx2 {
            ggml_expf_avx2(0.0 - x)
        } else {
            ggml_expf(0.0 - x)
        };
        y[i] = x / (1.0 + e) * u[i];
    }
}

/// ggml's vectorized `expf` as its AVX2 build computes it (`ggml_v_expf`, `__m256`): the same
/// polynomial as the AVX-512 flavour but without its constant term, applied as `j · 2^n + 2^n`
/// in one fused step, with `2^n` built in the exponent bits; arguments past ±126 take a
/// two-factor path, past ±192 saturate.
#[inline(always)]
pub(super) fn ggml_expf_avx2(x: f32) -> f32 {
    let c = f32::from_bits;
    let z = x.mul_add(c(0x3fb8_aa3b), EXPF_ROUND); // x / ln 2 + r
    let n = z - EXPF_ROUND;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    let j = j.mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// ggml's `rms_norm` (+ the weight multiply it fuses): the sum of squares in f64, then
/// `y = (x * (1 / sqrtf(mean + eps))) * w` in f32.
pub(super) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
        *y = x * scale * w;
    }
}

#[cfg(test)]
mod expf_tests {
    use super::ggml_expf;

    /// The polynomial is accurate to a couple of ulp over the range activations take.
    #[test]
    fn ggml_expf_is_accurate() {
        for i in -8000..8000 {
            let x = i as f32 * 0.01;
            let want = (x as f64).exp();
            let got = ggml_expf(x) as f64;
            assert!(((got - want) / want).abs() < 4e-7, "x={x}: {got} vs {want}");
        }
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(200.0), f32::INFINITY);
    }
}
