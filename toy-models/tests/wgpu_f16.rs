//! `--dtype f16` on `--backend wgpu`: the real SmolLM2-135M-Instruct Q8_0 with f16 weights and
//! activations (burn's per-device dtype policy, set before the model loads), against the CPU
//! backend's f32 logits and llama.cpp's greedy ids.
//!
//! A separate test binary because the policy holds for the whole process: the f32 wgpu tests
//! (`wgpu.rs`) use the same default device.
//!
//! What agreement to expect. f16 keeps 11 significant bits: the residual stream, the KV cache
//! and every matmul output round to ~5e-4 relative, and the quantized matmuls re-quantize those
//! rounded activations to 8 bits, 30 layers deep. Logits therefore differ from the f32 CPU
//! backend by about twice as much as on f32 wgpu: measured 0.14 at the first position, up to
//! 1.04 by the sixth (logits of magnitude ~20; f32 wgpu: 0.55). Greedy ids may leave llama.cpp's
//! only where llama.cpp's own top-2 margin is below 3.0 (measured: three prompts equal for all
//! 16 steps, the fourth parts at step 3).

mod common;

use burn::backend::Flex;
use burn::tensor::{DType, FloatDType, Int, IntDType, Tensor, TensorData, set_default_dtypes};
use burn_cubecl::CubeBackend;
use cubecl::wgpu::WgpuRuntime;
use toy_core::gguf::GgufFile;

type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Two short prompts of eight steps: each forward pass takes seconds on lavapipe.
const STEPS: usize = 8;
const PROMPTS: usize = 2;
/// Greedy ids may leave llama.cpp's only at a step whose top-2 margin is below this: twice the
/// logit tolerance, since both top logits may move.
const MARGIN: f64 = 3.0;
/// Largest |f16 wgpu − f32 cpu| logit difference allowed at any position (measured 1.04).
const LOGIT_TOLERANCE: f32 = 1.5;

/// The default wgpu device, set to create f16 float tensors (once per process).
fn f16_device() -> cubecl::wgpu::WgpuDevice {
    static DEVICE: std::sync::OnceLock<cubecl::wgpu::WgpuDevice> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let device = Default::default();
            assert!(
                <Wgpu as burn::tensor::backend::Backend>::supports_dtype(&device, DType::F16),
                "this wgpu device has no f16 support (lavapipe has it)"
            );
            set_default_dtypes::<Wgpu>(&device, FloatDType::F16, IntDType::I32).unwrap();
            device
        })
        .clone()
}

#[test]
fn smollm2_q8_0_with_f16_activations_on_wgpu() {
    let oracle = common::oracle("greedy.json");
    let file = GgufFile::open(common::smollm2("Q8_0")).unwrap();
    let (_, gpu) = toy_models::load::<Wgpu>(&file, &f16_device(), |_, _| {}).unwrap();
    let (_, cpu) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();

    // Logits of a 10-token prompt: computed in f16, close to the f32 CPU backend's.
    let cases = oracle["results"]["Q8_0"].as_array().unwrap();
    let prompt = common::ids(&cases[1]["prompt_ids"]);
    let one = Tensor::<Wgpu, 2, Int>::from_data(
        TensorData::new(vec![prompt[0] as i64], [1, 1]),
        &gpu.device(),
    );
    assert_eq!(
        gpu.forward(one, &mut gpu.new_cache()).dtype(),
        DType::F16,
        "the logits were not computed in f16"
    );
    let g = common::logits(&gpu, &[&prompt]);
    let c = common::logits(&cpu, &[&prompt]);
    let diffs = common::max_abs_diff_per_row(&g, &c);
    eprintln!("Q8_0 f16: max |wgpu f16 - cpu f32| per position {diffs:?}");
    assert!(
        diffs.iter().all(|&d| d < LOGIT_TOLERANCE),
        "f16 logits too far from f32: {diffs:?}"
    );

    // Greedy ids on the shortest oracle prompts: they may leave llama.cpp's only at a step
    // where llama.cpp itself was unsure (top-2 margin below MARGIN); a departure at a confident
    // step fails.
    let mut failures = Vec::new();
    for (i, case) in cases[..PROMPTS].iter().enumerate() {
        let prompt = common::ids(&case["prompt_ids"]);
        let expected = &common::ids(&case["gen_ids"])[..STEPS];
        let got = common::greedy(&gpu, &prompt, STEPS);
        let same = got.iter().zip(expected).take_while(|(a, b)| a == b).count();
        let margin = (same < STEPS).then(|| case["steps"][same]["margin"].as_f64().unwrap());
        eprintln!(
            "Q8_0 f16 prompt {i}: {same}/{STEPS} ids equal llama.cpp's (llama.cpp's margin where \
             they part: {margin:?})"
        );
        if margin.is_some_and(|m| m >= MARGIN) {
            failures.push(format!(
                "prompt {i}: wgpu f16 {got:?}\n  llama.cpp {expected:?}\n  parted at step {same}, margin {margin:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
