//! Horizontal sums in the orders llama.cpp's x86 builds compute them. Float addition is not
//! associative, so each order is its own function, named for the code that uses it.

/// GCC's `_mm512_reduce_add_ps`: halves (8 + 8), quarters (4 + 4), then (0+2)+(1+3).
#[inline(always)]
pub(super) fn reduce_add16(v: &[f32; 16]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| v[8 + i] + v[i]);
    let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// ggml's `hsum_float_8` (and tinyBLAS's `hsum` of an `__m256`): (lanes 0..4 + lanes 4..8),
/// then pairs (0+2, 1+3), then the two.
#[inline(always)]
pub(super) fn hsum8(acc: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| acc[i + 4] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// ggml's `GGML_F32x8_REDUCE` (AVX) of its four accumulators: `(x0 + x2) + (x1 + x3)`
/// lanewise, then the low and high halves added, then two `hadd`s: `(t0 + t1) + (t2 + t3)`.
#[inline(always)]
pub(super) fn reduce_f32x8(x: [[f32; 8]; 4]) -> f32 {
    let r: [f32; 8] = std::array::from_fn(|l| (x[0][l] + x[2][l]) + (x[1][l] + x[3][l]));
    let t0: [f32; 4] = std::array::from_fn(|i| r[i] + r[i + 4]);
    (t0[0] + t0[1]) + (t0[2] + t0[3])
}
