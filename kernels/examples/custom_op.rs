//! Add an op of your own the way toy adds its ops: a trait with a reference body, a native loop
//! for the CPU backend, a cubecl kernel for the GPU backends.
//!
//! ```sh
//! cargo run --release -p toy-kernels --example custom_op           # NdArray and Flex
//! cargo run --release -p toy-kernels --example custom_op -- wgpu   # and the kernel on wgpu
//! ```
//!
//! The op is Gemma 2's soft-cap, `cap · tanh(x / cap)`. burn's traits belong to burn, so you
//! cannot add a method to `Backend` or to toy's `ToyBackend`; you write a trait of your own over
//! `Backend` instead. Its default body, written in plain burn tensor ops, is the specification:
//! every backend runs it unless it overrides the method, and every override is tested against it
//! (as this program does). Implementing your trait for burn's backend types is allowed by the
//! orphan rule because the trait is yours. This is how `toy_kernels::ToyBackend` is built: see
//! `src/lib.rs` (the trait), `src/reference.rs` (the bodies), `src/flex.rs` and `src/cube.rs`.

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{ElementConversion, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

/// The op, as a trait over burn's `Backend`.
pub trait Softcap: Backend {
    /// `cap · tanh(x / cap)`, element by element.
    fn softcap(x: FloatTensor<Self>, cap: f32) -> FloatTensor<Self> {
        softcap_reference::<Self>(x, cap)
    }
}

/// The specification, in burn ops: short and obviously right. It is a free function (not only
/// the trait's default body) so that an override can fall back to it for inputs it does not
/// handle.
pub fn softcap_reference<B: Backend>(x: FloatTensor<B>, cap: f32) -> FloatTensor<B> {
    let shape = x.shape();
    let flat: Tensor<B, 1> = Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(
        x,
        Shape::new([shape.num_elements()]),
    )));
    let y = flat.div_scalar(cap).tanh().mul_scalar(cap);
    B::float_reshape(y.into_primitive().tensor(), shape)
}

/// What model code calls: the op on burn's `Tensor`, any rank.
pub fn softcap<B: Softcap, const D: usize>(x: Tensor<B, D>, cap: f32) -> Tensor<B, D> {
    let y = B::softcap(x.into_primitive().tensor(), cap);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// A backend with nothing faster runs the reference body.
impl Softcap for NdArray {}

/// burn's Flex keeps a tensor in host memory: read it as a slice and loop. (toy's own CPU ops
/// split such loops across rayon's threads and use the CPU's vector instructions.)
impl Softcap for Flex {
    fn softcap(x: FloatTensor<Self>, cap: f32) -> FloatTensor<Self> {
        let shape = x.shape();
        let contiguous = x.to_contiguous();
        let Some(xs) = contiguous.as_slice::<f32>() else {
            // f16 or bf16 tensors: the specification handles every dtype.
            return softcap_reference::<Self>(x, cap);
        };
        let ys: Vec<f32> = xs.iter().map(|v| cap * (v / cap).tanh()).collect();
        burn::backend::flex::FlexTensor::from_data(TensorData::new(ys, shape))
    }
}

/// The GPU backends: burn's `CubeBackend` over any cubecl runtime (wgpu, CUDA, ...), one kernel
/// written once in Rust with `#[cube]`.
mod gpu {
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{DType, TensorMetadata};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use cubecl::calculate_cube_count_elemwise;
    use cubecl::prelude::*;

    use super::{Softcap, softcap_reference};

    /// One unit per element. `F` is the tensor's float type, chosen at launch (`_dtype`).
    #[cube(launch)]
    fn softcap_kernel<F: Float>(
        x: &Tensor<F>,
        out: &mut Tensor<F>,
        cap: f32,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        // The last cube may run past the end.
        if i >= out.len() {
            terminate!();
        }
        let c = F::cast_from(cap);
        out[i] = c * F::tanh(x[i] / c);
    }

    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Softcap
        for CubeBackend<R, F, I, BT>
    {
        fn softcap(x: FloatTensor<Self>, cap: f32) -> FloatTensor<Self> {
            if !matches!(x.dtype, DType::F32 | DType::F16 | DType::BF16) {
                return softcap_reference::<Self>(x, cap);
            }
            // Flat indexing needs a dense tensor (a transposed view is not one).
            let x = into_contiguous(x);
            let out = empty_device_contiguous_dtype(
                x.client.clone(),
                x.device.clone(),
                x.shape(),
                x.dtype,
            );
            // One unit per element; cubecl spreads the cubes over the grid's dimensions within
            // each runtime's limits (the kernel's ABSOLUTE_POS spans them all).
            let cube_dim = CubeDim::new_1d(256);
            let cube_count =
                calculate_cube_count_elemwise(&x.client, x.shape().num_elements(), cube_dim);
            softcap_kernel::launch::<R>(
                &x.client,
                cube_count,
                cube_dim,
                x.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                cap,
                x.dtype.into(),
            );
            out
        }
    }
}

/// The op on `B` against its reference body, on a `[3, 1000]` tensor and on a transposed view
/// of it. Returns the largest difference.
fn check<B: Softcap>(device: &B::Device) -> f32 {
    let values: Vec<f32> = (0..3000).map(|i| (i as f32 - 1500.0) * 0.037).collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values, [3, 1000]), device);
    let mut worst = 0.0f32;
    for input in [x.clone(), x.transpose()] {
        let fast = softcap(input.clone(), 30.0);
        let spec: Tensor<B, 2> = Tensor::from_primitive(TensorPrimitive::Float(
            softcap_reference::<B>(input.into_primitive().tensor(), 30.0),
        ));
        assert_eq!(fast.dims(), spec.dims());
        let diff = (fast - spec).abs().max().into_scalar();
        worst = worst.max(diff.elem::<f32>());
    }
    worst
}

/// Outputs reach ±30, where an f32 ulp is ~2e-6: a GPU's `tanh` is an approximation a few ulp
/// off, and a wrong kernel is off by far more than this.
const TOLERANCE: f32 = 1e-4;

fn main() {
    let on_gpu = std::env::args().nth(1).as_deref() == Some("wgpu");
    let results = [
        (
            "ndarray (reference body)",
            check::<NdArray>(&Default::default()),
        ),
        ("flex (host loop)", check::<Flex>(&Default::default())),
    ];
    let mut ok = true;
    for (name, diff) in results {
        println!("{name:<28} max |op - reference| = {diff:e}");
        ok &= diff <= TOLERANCE;
    }
    if on_gpu {
        type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
        let diff = check::<Wgpu>(&Default::default());
        println!(
            "{:<28} max |op - reference| = {diff:e}",
            "wgpu (cubecl kernel)"
        );
        ok &= diff <= TOLERANCE;
    }
    assert!(ok, "an override differs from the reference body");
    println!("every override matches the reference body");
}
