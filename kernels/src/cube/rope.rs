//! Rotary position embedding.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous_aligned;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::spread;
use crate::RopeLayout;

/// One unit per output element of `x[b, h, t, d]`: rotated pairs read both members, the dims
/// past the rotated ones are copied.
#[cube(launch)]
fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] neox: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let d = out.shape(3);
    let t_len = out.shape(2);
    let h_len = out.shape(1);
    let di = pos % d;
    let ti = (pos / d) % t_len;
    let hi = (pos / (d * t_len)) % h_len;
    let bi = pos / (d * t_len * h_len);
    let half = cos.shape(1);
    let base = bi * x.stride(0) + hi * x.stride(1) + ti * x.stride(2);
    let xs = x.stride(3);
    let mut y = x[base + di * xs];
    if di < 2 * half {
        let mut i = di / 2;
        let mut first = di % 2 == 0;
        let mut partner = di + 1;
        if comptime!(neox) {
            i = di % half;
            first = di < half;
            partner = di + half;
            if !first {
                partner = di - half;
            }
        } else if !first {
            partner = di - 1;
        }
        let c = F::cast_from(cos[ti * cos.stride(0) + i]);
        let s = F::cast_from(sin[ti * sin.stride(0) + i]);
        let other = x[base + partner * xs];
        if first {
            y = y * c - other * s;
        } else {
            y = other * s + y * c;
        }
    }
    out[pos] = y;
}

pub(super) fn rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    layout: RopeLayout,
) -> CubeTensor<R> {
    let cos = into_contiguous_aligned(cos);
    let sin = into_contiguous_aligned(sin);
    let out = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), x.shape(), x.dtype);
    let total = x.shape().num_elements();
    let units = 256u32;
    let (cx, cy) = spread(total.div_ceil(units as usize));
    rope_kernel::launch::<R>(
        &x.client,
        CubeCount::Static(cx, cy, 1),
        CubeDim::new_1d(units),
        x.clone().into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        layout == RopeLayout::Neox,
        x.dtype.into(),
    );
    out
}
