//! Dense products on the CPU with `gemm`: the linear layer and its backward
//! ([`ToyBackend::dense_linear`](crate::ToyBackend::dense_linear),
//! [`ToyBackend::dense_linear_backward`](crate::ToyBackend::dense_linear_backward)), and the per-head
//! products of the attention backward.
//!
//! Why not burn-flex's matmul: it zero-fills each output and then copies it into an aligned
//! buffer before `gemm` overwrites it, two passes over every product's output (about 8% of a
//! LoRA step on SmolLM2). Here `gemm` writes into fresh, uninitialized memory. The `gemm` calls
//! are burn-flex's (the same strides, and its rule for when to use threads), so the products
//! have the same bits.

use gemm::{Parallelism, gemm};

/// One operand of a product: the data, its column stride and its row stride (in elements).
pub(super) type Operand<'a> = (&'a [f32], usize, usize);

/// `dst[m, n]` (row stride `dst_rs`) `= lhs[m, k] · rhs[k, n]`.
///
/// # Safety
/// `dst` must be valid for writes of the `m × n` elements at `i · dst_rs + j`, and the strides
/// and extents of `lhs` and `rhs` must address elements inside their slices.
pub(super) unsafe fn product(
    dims: (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    lhs: Operand,
    rhs: Operand,
    parallelism: Parallelism,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm_into(dims, dst, dst_rs, lhs, rhs, parallelism, false) }
}

/// [`product`], or with `accumulate` `dst += lhs · rhs` (then `dst` must also be initialized).
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    lhs: Operand,
    rhs: Operand,
    parallelism: Parallelism,
    accumulate: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.1 as isize,
            lhs.2 as isize,
            rhs.0.as_ptr(),
            rhs.1 as isize,
            rhs.2 as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Panics unless `lhs[m, k]` and `rhs[k, n]` address elements inside their slices; returns
/// burn-flex's threading for the product (threads from `m·n·k ≥ 192³`).
fn checked_parallelism(m: usize, n: usize, k: usize, lhs: Operand, rhs: Operand) -> Parallelism {
    let in_bounds = |(data, cs, rs): Operand, rows: usize, cols: usize| {
        assert!(
            (rows - 1) * rs + (cols - 1) * cs < data.len(),
            "product operand out of bounds"
        )
    };
    in_bounds(lhs, m, k);
    in_bounds(rhs, k, n);
    if m * n * k >= 192 * 192 * 192 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// `dst[m, n] += lhs[m, k] · rhs[k, n]` (row-major `dst`), on rayon's threads when large.
pub(super) fn add_product(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: Operand,
    rhs: Operand,
) {
    assert_eq!(dst.len(), m * n);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let parallelism = checked_parallelism(m, n, k, lhs, rhs);
    // SAFETY: `dst` holds the `m·n` initialized elements (asserted), the operands are in bounds.
    unsafe { gemm_into((m, n, k), dst.as_mut_ptr(), n, lhs, rhs, parallelism, true) }
}

/// `lhs[m, k] · rhs[k, n]` into a new row-major `[m, n]` buffer, on rayon's threads when the
/// product is large (burn-flex's threshold: `m·n·k ≥ 192³`).
pub(super) fn new_product(m: usize, n: usize, k: usize, lhs: Operand, rhs: Operand) -> Vec<f32> {
    if m == 0 || n == 0 || k == 0 {
        return vec![0.0; m * n];
    }
    let parallelism = checked_parallelism(m, n, k, lhs, rhs);
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: `out` has room for `m·n` elements, the operands are in bounds, and with `k > 0` and `read_dst = false` gemm writes every element of `dst` (never reads it),
    // so all `m·n` are initialized before `set_len`.
    unsafe {
        product((m, n, k), out.as_mut_ptr(), n, lhs, rhs, parallelism);
        out.set_len(m * n);
    }
    out
}
