//! Each `ToyBackend` op timed against its reference body and against burn's own op, on one
//! backend, at SmolLM2-135M's shapes (d_model 576, FFN 1536, head_dim 64):
//!
//! ```sh
//! cargo run --release -p toy-kernels --example bench_kernels -- cpu
//! cargo run --release -p toy-kernels --example bench_kernels -- wgpu   # or cuda
//! ```
//!
//! Prints a markdown table: median time per call over the repetitions after one warm-up, the
//! bytes of weights (quantized matmuls) or of Q/K/V (attention) read per second, and FLOP/s.
//! "burn" is burn's dense f32 matmul of the dequantized weight, or `burn::tensor::module::
//! attention` (causal, same heads for Q and K/V since it has no grouped-query form).

use std::time::Instant;

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Int, Tensor, TensorData};
use toy_core::gguf::{GgmlType, dequantize_to_vec, quantize};
use toy_core::rng::SplitMix64;
use toy_kernels::PackedTensor;
use toy_kernels::packed::pack;
use toy_kernels::{AttentionOptions, RopeLayout, ToyBackend, reference};

const REPS: usize = 10;

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

fn tensor<B: Backend, const D: usize>(
    v: Vec<f32>,
    shape: [usize; D],
    d: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v, shape), d)
}

fn prim<B: Backend, const D: usize>(t: &Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.clone().into_primitive().tensor()
}

/// Median seconds of `f` over REPS runs after a warm-up, the device synchronized each time.
fn time<B: Backend, T>(device: &B::Device, mut f: impl FnMut() -> T) -> f64 {
    let mut run = || {
        let start = Instant::now();
        let out = f();
        B::sync(device).expect("device sync");
        drop(out);
        start.elapsed().as_secs_f64()
    };
    run();
    let mut times: Vec<f64> = (0..REPS).map(|_| run()).collect();
    times.sort_by(f64::total_cmp);
    times[REPS / 2]
}

fn row(op: &str, shape: &str, body: &str, secs: f64, bytes: f64, flops: f64) {
    println!(
        "| {op} | {shape} | {body} | {:.3} | {:.1} | {:.1} |",
        secs * 1e3,
        bytes / secs / 1e9,
        flops / secs / 1e9
    );
}

fn bench<B: ToyBackend>(device: B::Device) {
    println!("| op | shape | body | ms | GB/s | GFLOP/s |");
    println!("| --- | --- | --- | ---: | ---: | ---: |");

    // Q8_0 matmul: SmolLM2's FFN up projection (1536 × 576), decode and prefill.
    let (n, k) = (1536, 576);
    let blocks = quantize(GgmlType::Q8_0, &randn(n * k, 1)).unwrap();
    let dense = dequantize_to_vec(GgmlType::Q8_0, &blocks).unwrap();
    let p = pack(GgmlType::Q8_0, &blocks, n, k).unwrap();
    let words: Tensor<B, 2, Int> = Tensor::from_data(
        TensorData::new(p.words.clone(), [n, k / 4]),
        (&device, DType::U32),
    );
    let scales = tensor::<B, 2>(p.scales.clone().unwrap(), [n, k / 32], &device);
    let packed = || PackedTensor::<B> {
        ty: GgmlType::Q8_0,
        cols: k,
        words: words.clone().into_primitive(),
        scales: Some(prim(&scales)),
        mins: None,
        repackable: true,
        layout: toy_kernels::packed::RowLayout::Rows,
    };
    let w = tensor::<B, 2>(dense, [n, k], &device);
    let wt = w.clone().transpose();
    for m in [1usize, 128] {
        let x = tensor::<B, 2>(randn(m * k, 2), [m, k], &device);
        let shape = format!("{m}×{k} · ({n}×{k})ᵀ");
        let flops = 2.0 * (m * n * k) as f64;
        let q8_bytes = (n * k / 32 * 34) as f64;
        let toy = time::<B, _>(&device, || B::packed_matmul(prim(&x), packed()));
        row("q8_0_matmul", &shape, "toy", toy, q8_bytes, flops);
        let refr = time::<B, _>(&device, || {
            reference::packed_matmul::<B>(prim(&x), packed())
        });
        row("q8_0_matmul", &shape, "reference", refr, q8_bytes, flops);
        let burn = time::<B, _>(&device, || x.clone().matmul(wt.clone()));
        row(
            "q8_0_matmul",
            &shape,
            "burn f32 matmul",
            burn,
            (n * k * 4) as f64,
            flops,
        );
    }

    // RoPE over 9 heads × 128 positions × 64 dims.
    let (h, t, d) = (9, 128, 64);
    let x = tensor::<B, 4>(randn(h * t * d, 3), [1, h, t, d], &device);
    let angles: Vec<f32> = (0..t * d / 2).map(|i| i as f32 * 0.01).collect();
    let cos = tensor::<B, 2>(
        angles.iter().map(|a| a.cos()).collect(),
        [t, d / 2],
        &device,
    );
    let sin = tensor::<B, 2>(
        angles.iter().map(|a| a.sin()).collect(),
        [t, d / 2],
        &device,
    );
    let shape = format!("1×{h}×{t}×{d}");
    let bytes = (2 * h * t * d * 4) as f64;
    let flops = (3 * h * t * d) as f64;
    let toy = time::<B, _>(&device, || {
        B::rope(prim(&x), prim(&cos), prim(&sin), RopeLayout::Neox)
    });
    row("rope", &shape, "toy", toy, bytes, flops);
    let refr = time::<B, _>(&device, || {
        reference::rope::<B>(prim(&x), prim(&cos), prim(&sin), RopeLayout::Neox)
    });
    row("rope", &shape, "reference", refr, bytes, flops);

    // Causal attention, 9 heads of 64: a 128-token prefill, and one decode row over 512 keys.
    for (tq, tk) in [(128usize, 128usize), (1, 512)] {
        let q = tensor::<B, 4>(randn(h * tq * d, 4), [1, h, tq, d], &device);
        let kk = tensor::<B, 4>(randn(h * tk * d, 5), [1, h, tk, d], &device);
        let v = tensor::<B, 4>(randn(h * tk * d, 6), [1, h, tk, d], &device);
        let options = AttentionOptions {
            scale: 0.125,
            q_offset: tk - tq,
            window: None,
            softcap: None,
        };
        let shape = format!("{h} heads, {tq} rows × {tk} keys");
        let bytes = ((tq + 2 * tk) * h * d * 4) as f64;
        // Causal: about half the (row, key) pairs of a prefill, all of them for one row.
        let pairs = if tq == tk { tq * (tq + 1) / 2 } else { tq * tk };
        let flops = (4 * pairs * h * d) as f64;
        let toy = time::<B, _>(&device, || {
            <B as ToyBackend>::attention(prim(&q), prim(&kk), prim(&v), options)
        });
        row("attention", &shape, "toy", toy, bytes, flops);
        let refr = time::<B, _>(&device, || {
            reference::attention::<B>(prim(&q), prim(&kk), prim(&v), options)
        });
        row("attention", &shape, "reference", refr, bytes, flops);
        if tq == tk {
            // burn's causal mask aligns the first query with the first key: prefill only.
            let burn_options = AttentionModuleOptions {
                scale: Some(0.125),
                softcap: None,
                is_causal: true,
            };
            let burn = time::<B, _>(&device, || {
                burn_attention(q.clone(), kk.clone(), v.clone(), None, None, burn_options)
            });
            row("attention", &shape, "burn attention", burn, bytes, flops);
        }
    }
}

fn main() {
    let backend = std::env::args().nth(1).unwrap_or_else(|| "cpu".into());
    match backend.as_str() {
        "cpu" => bench::<Flex>(Default::default()),
        "wgpu" => bench::<burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>>(
            Default::default(),
        ),
        "cuda" => bench::<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>(
            Default::default(),
        ),
        other => {
            eprintln!("error: unknown backend {other:?}: expected cpu, wgpu or cuda");
            std::process::exit(2);
        }
    }
}
