//! cubecl kernels: the [`ToyBackend`] overrides for burn's `CubeBackend` (`--backend wgpu`,
//! `--backend cuda`).
//!
//! Portability rules every kernel here keeps: no plane (warp/subgroup) operations — lavapipe
//! exposes none and real GPUs differ in width (8 to 64) — so reductions go through shared
//! memory; at most a few KiB of shared memory per cube (lavapipe and Metal give 32 KiB); no
//! infinities as literals (WGSL rejects them), so masked scores are tracked explicitly. Tensors
//! are indexed through their strides: CUDA pads rows (pitched memory), and attention reads
//! K/V caches that are views.
//!
//! Files:
//! - `qmatmul`: Q8_0, Q4_0, Q4_1 (the split layout) as llama.cpp computes them: activations
//!   quantized to 8-bit blocks, exact integer block dots, one scale multiply per block.
//! - `blocks`: every other packed type (K-quants, Q5_0/Q5_1, IQ4, F16, BF16), read in its GGUF
//!   blocks and decoded value by value as the reference dequantizer does, in f32 products.
//! - `rope`, `attention`.

mod attention;
mod blocks;
mod qmatmul;
mod rope;

use burn::tensor::ops::{FloatTensor, IntTensor, IntTensorOps};
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::{AttentionOptions, PackedTensor, RopeLayout, ToyBackend, reference};

/// The largest cube count per grid dimension every runtime accepts (wgpu's limit).
const MAX_CUBES: usize = 65535;

/// An i8 stored in the low byte of `b` (0..=255), sign-extended.
#[cube]
fn sext8(b: u32) -> i32 {
    let s = i32::cast_from(b);
    s - ((s >> 7) << 8)
}

/// The sum of every unit's `value` over a cube of `units` units (a power of two), through
/// shared memory (no plane operations); every unit gets the total.
#[cube]
fn cube_sum(value: f32, lane: usize, #[comptime] units: u32) -> f32 {
    let mut partial = SharedMemory::<f32>::new(units as usize);
    partial[lane] = value;
    sync_cube();
    let mut width = (units / 2).runtime() as usize;
    while width > 0 {
        if lane < width {
            let other = partial[lane + width];
            partial[lane] += other;
        }
        sync_cube();
        width /= 2;
    }
    partial[0]
}

/// Split `n` cubes over the x and y grid dimensions (each at most 65535).
fn spread(n: usize) -> (u32, u32) {
    let x = n.clamp(1, MAX_CUBES);
    (x as u32, n.div_ceil(x).max(1) as u32)
}

/// Whether `TOY_CUBE_REFERENCE` (a comma-separated list of `matmul`, `rope`, `attention`, or
/// `all`) sends `op` to its reference body instead of the kernel: a switch for narrowing down a
/// wrong result on a new device to one kernel.
fn use_reference(op: &str) -> bool {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let list = LIST.get_or_init(|| {
        std::env::var("TOY_CUBE_REFERENCE")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .collect()
    });
    list.iter().any(|s| s == op || s == "all")
}

/// A packed weight of a `CubeBackend`.
type CubePacked<R, F, I, BT> = PackedTensor<CubeBackend<R, F, I, BT>>;

/// A packed weight as the `blocks` kernels take it, or back unchanged if its type has none.
fn device_weight<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    w: CubePacked<R, F, I, BT>,
) -> Result<blocks::Weight<R>, CubePacked<R, F, I, BT>> {
    match blocks::Format::of(w.ty) {
        Some(fmt) => Ok(blocks::Weight {
            words: w.words,
            scales: w.scales,
            mins: w.mins,
            fmt,
        }),
        None => Err(w),
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ToyBackend
    for CubeBackend<R, F, I, BT>
{
    fn packed_matmul(x: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        if use_reference("matmul") {
            return reference::packed_matmul::<Self>(x, w);
        }
        if let Some(fmt) = qmatmul::split_format(w.ty) {
            let scales = w.scales.expect("a split layout has scales");
            return qmatmul::qmatmul(x, w.words, scales, w.mins, fmt);
        }
        match device_weight(w) {
            Ok(weight) => blocks::matmul(x, weight),
            Err(w) => reference::packed_matmul::<Self>(x, w),
        }
    }

    fn packed_matmul_backward(dy: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        if use_reference("matmul") {
            return reference::packed_matmul_backward::<Self>(dy, w);
        }
        let cols = w.cols;
        match device_weight(w) {
            Ok(weight) => blocks::matmul_backward(dy, weight, cols),
            Err(w) => reference::packed_matmul_backward::<Self>(dy, w),
        }
    }

    fn packed_rows(w: PackedTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        if use_reference("matmul") {
            return reference::packed_rows::<Self>(w, ids);
        }
        let cols = w.cols;
        match device_weight(w) {
            Ok(weight) => blocks::rows(weight, ids, cols, F::dtype()),
            Err(w) => reference::packed_rows::<Self>(w, ids),
        }
    }

    fn packed_dequantize(w: PackedTensor<Self>) -> FloatTensor<Self> {
        if use_reference("matmul") {
            return reference::packed_dequantize::<Self>(w)
                .into_primitive()
                .tensor();
        }
        let (cols, rows) = (w.cols, w.words.shape().dims::<2>()[0]);
        let ids = Self::int_arange(0..rows as i64, &w.words.device, I::dtype().into());
        match device_weight(w) {
            Ok(weight) => blocks::rows(weight, ids, cols, DType::F32),
            Err(w) => reference::packed_dequantize::<Self>(w)
                .into_primitive()
                .tensor(),
        }
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        if use_reference("rope") || cos.dtype != DType::F32 || sin.dtype != DType::F32 {
            return reference::rope::<Self>(x, cos, sin, layout);
        }
        rope::rope(x, cos, sin, layout)
    }

    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        if use_reference("attention") {
            return reference::attention::<Self>(q, k, v, options);
        }
        attention::attention(q, k, v, options)
    }
}
