//! Everything toy-models checks on `--backend wgpu` (Mesa's lavapipe in CI, a real GPU
//! elsewhere), in one test binary: each binary that instantiates the cubecl backend pays ~5
//! minutes of build on 2 cores, so the wgpu halves of `families.rs`, `new_families.rs`,
//! `batching.rs` and `vit.rs` live here, as modules of those names, running the same generic
//! checks (`common`), and so does `--dtype f16` (module `f16`, on a device of its own). The fixtures' llama.cpp build (`common::expected` sets it process-wide)
//! matters only to the CPU backend, which these tests use as a reference within tolerances.
//!
//! First, toy's cubecl kernels on the real SmolLM2-135M-Instruct, against llama.cpp's oracle
//! and the CPU backend. What agreement to expect. On the F32 file the GPU computes the same math in another float
//! order: logits within 5e-4 of the CPU backend (measured ≤ 1.1e-4), so greedy ids must equal
//! llama.cpp's exactly. On Q8_0 the kernels compute llama.cpp's own algorithm (8-bit activation
//! blocks, integer block dots): a single token's logits agree with the CPU backend to 1.1e-5.
//! But every layer re-quantizes its activations to 8 bits, and a 1-ulp difference anywhere
//! upstream (the GPU's `exp` in the softmax is not ggml's polynomial) moves some value across a
//! rounding boundary; 30 layers amplify those flips to logit differences of up to ~0.55 from
//! the second position on (measured). So on Q8_0 the ids must equal llama.cpp's up to the first
//! step where llama.cpp's own top-2 margin is below 0.6 — the same rule as the CPU tests, with
//! the threshold this backend's deviation sets — and we print how far each prompt matches.

mod common;

use burn::backend::Flex;
use burn_cubecl::CubeBackend;
use cubecl::wgpu::WgpuRuntime;
use toy_core::gguf::GgufFile;

type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Each forward pass of the 135M model takes ~2.4 s on lavapipe (2 cores): two prompts of eight
/// steps per file keep this binary near two minutes of CI; the CPU backend's tests cover every
/// oracle prompt and all 16 steps.
const STEPS: usize = 8;
const PROMPTS: usize = 2;

/// Greedy ids on wgpu for the short oracle prompts of `kind`; each must equal llama.cpp's up to
/// the first step whose margin is below `margin_threshold`.
fn greedy_matches_llama_cpp(kind: &str, margin_threshold: f64) {
    let oracle = common::oracle("greedy.json");
    let file = GgufFile::open(common::smollm2(kind)).unwrap();
    let (_, gpu) = toy_models::load::<Wgpu>(&file, &Default::default(), |_, _| {}).unwrap();
    let mut failures = Vec::new();
    // The shortest oracle prompts; the 193-token chat prompt takes minutes on lavapipe and is
    // covered on the CPU backend.
    for (i, case) in oracle["results"][kind].as_array().unwrap()[..PROMPTS]
        .iter()
        .enumerate()
    {
        let prompt = common::ids(&case["prompt_ids"]);
        let expected = &common::ids(&case["gen_ids"])[..STEPS];
        let must_match = case["steps"].as_array().unwrap()[..STEPS]
            .iter()
            .position(|s| s["margin"].as_f64().unwrap() < margin_threshold)
            .unwrap_or(STEPS);
        let got = common::greedy(&gpu, &prompt, STEPS);
        let same = got.iter().zip(expected).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{kind} prompt {i}: {same}/{STEPS} ids equal llama.cpp's (required {must_match})"
        );
        if same < must_match {
            failures.push(format!(
                "prompt {i}: wgpu {got:?}\n  llama.cpp {expected:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{kind}: {}", failures.join("\n"));
}

#[test]
fn smollm2_f32_greedy_on_wgpu_equals_llama_cpp() {
    // Every step: F32 margins here are >= 0.08, the deviation ~1e-4.
    greedy_matches_llama_cpp("F32", 0.0);
}

#[test]
fn smollm2_q8_0_greedy_on_wgpu_equals_llama_cpp() {
    greedy_matches_llama_cpp("Q8_0", 0.6);
}

/// Logits on wgpu against the CPU backend, position by position, through one prefill of 14
/// tokens (tiled matmul and attention kernels) and through one-token decode steps after a
/// 6-token prefill (matrix-vector and row kernels).
#[test]
fn smollm2_logits_on_wgpu_equal_cpu() {
    let oracle = common::oracle("greedy.json");
    let case = &oracle["results"]["Q8_0"][1];
    let prompt = common::ids(&case["prompt_ids"]);
    let seq: Vec<u32> = prompt
        .iter()
        .chain(&common::ids(&case["gen_ids"])[..8])
        .copied()
        .collect();
    let whole = [&seq[..]];
    let mut steps: Vec<&[u32]> = vec![&seq[..prompt.len()]];
    steps.extend(seq[prompt.len()..].chunks(1));
    for kind in ["F32", "Q8_0"] {
        let file = GgufFile::open(common::smollm2(kind)).unwrap();
        let (_, gpu) = toy_models::load::<Wgpu>(&file, &Default::default(), |_, _| {}).unwrap();
        let (_, cpu) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
        for (mode, chunks) in [("prefill", &whole[..]), ("decode", &steps[..])] {
            let (g, c) = (common::logits(&gpu, chunks), common::logits(&cpu, chunks));
            let diffs = common::max_abs_diff_per_row(&g, &c);
            eprintln!("{kind} {mode}: max |wgpu - cpu| per position {diffs:?}");
            if kind == "F32" {
                assert!(diffs.iter().all(|&d| d < 5e-4), "{kind} {mode}: {diffs:?}");
            } else {
                // The first position sees no attention mixing: the pipelines agree to rounding.
                assert!(diffs[0] < 1e-4, "{kind} {mode} position 0: {}", diffs[0]);
                assert!(diffs.iter().all(|&d| d < 1.5), "{kind} {mode}: {diffs:?}");
            }
        }
    }
}

/// Every packed weight type in a whole model on wgpu: the tiny K-quant fixtures (Q2_K–Q6_K,
/// Q4_0, Q5_0/Q5_1, IQ4_NL/IQ4_XS, F16, BF16 and the Q4_K_M preset; see quant_types.rs), their
/// packed blocks read by the cubecl kernels, against llama.cpp's logits and greedy ids. These
/// kernels multiply f32 activations where llama.cpp quantizes them to 8-bit blocks (Q8_K, Q8_0)
/// or rounds them to f16, so logits differ by that rounding (measured: printed below), and ids
/// must equal llama.cpp's up to the first step whose own top-2 margin (from the CPU backend,
/// bit-exact with llama.cpp on these files) is below 0.1.
#[test]
fn every_packed_type_on_wgpu_follows_llama_cpp() {
    for name in ["kq-k", "kq-legacy", "kq-16bit", "kq-q4_k_m"] {
        let expected = common::expected(name);
        let (_, _, gpu) = common::load::<Wgpu>(name, &Default::default());
        let (_, _, cpu) = common::load::<Flex>(name, &Default::default());
        let worst = common::logit_deviation(&gpu, &expected, &Default::default());
        for case in expected["greedy"].as_array().unwrap() {
            let prompt = common::ids(&case["prompt_ids"]);
            let want = common::ids(&case["gen_ids"]);
            let got = common::greedy(&gpu, &prompt, want.len());
            // The CPU's logits at each generated position, teacher-forced on llama.cpp's ids.
            let seq: Vec<u32> = prompt.iter().chain(&want).copied().collect();
            let rows = common::logits(&cpu, &[&seq[..]]);
            let must_match = (0..want.len())
                .position(|s| top2_margin(&rows[prompt.len() - 1 + s]) < 0.1)
                .unwrap_or(want.len());
            let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "{name}: {same}/{} ids equal llama.cpp's (required {must_match}); largest logit deviation {worst:.1e}",
                want.len()
            );
            assert!(
                same >= must_match,
                "{name}: wgpu {got:?}\n  llama.cpp {want:?}"
            );
        }
        // Activation rounding on a width-256 model: ~1e-2 of logits of magnitude ~10.
        assert!(
            worst < 0.1,
            "{name}: logits differ from llama.cpp's by {worst}"
        );
    }
}

fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::MIN, f32::MIN);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// `families.rs`'s fixtures through toy's cubecl kernels. Greedy ids must all match llama.cpp's, as on the CPU. Logits: the
/// F32 fixtures keep the CPU tolerances (measured: olmoe 1.9e-6, mistral 1.9e-6, gemma2 7.6e-5,
/// gpt2 1.5e-4); the Q8_0 ones get `WGPU_QUANTIZED_TOL`.
mod families {
    use super::Wgpu;
    use crate::common::{F32_TOL, GELU_TOL, matches_llama_cpp};

    /// The cubecl Q8_0 kernels quantize activations to llama.cpp's 8-bit blocks and take integer
    /// block dots, but sum floats (norms, attention, block scales) in another order than ggml: an
    /// ulp that flips one activation's 8-bit rounding moves logits by up to ~0.02 two layers
    /// later (measured: qwen2 1.9e-2, qwen3 1.9e-2, llama3 and qwen2-yarn 4.8e-7;
    /// docs/correctness.md explains the mechanism).
    const WGPU_QUANTIZED_TOL: f64 = 5e-2;

    fn run(name: &str, arch: &str, tol: f64) {
        matches_llama_cpp::<Wgpu>(name, arch, tol, None, 0.0, &Default::default());
    }

    #[test]
    fn qwen2_on_wgpu() {
        run("qwen2", "qwen2", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn qwen3_on_wgpu() {
        run("qwen3", "qwen3", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn llama3_on_wgpu() {
        run("llama3", "llama", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn qwen2_yarn_on_wgpu() {
        run("qwen2-yarn", "qwen2", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn gemma2_on_wgpu() {
        run("gemma2", "gemma2", GELU_TOL);
    }

    #[test]
    fn olmoe_on_wgpu() {
        run("olmoe", "olmoe", F32_TOL);
    }

    #[test]
    fn olmoe_q8_0_on_wgpu() {
        run("olmoe-q8_0", "olmoe", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn gemma2_q8_0_on_wgpu() {
        run("gemma2-q8_0", "gemma2", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn gpt2_q8_0_on_wgpu() {
        run("gpt2-q8_0", "gpt2", WGPU_QUANTIZED_TOL);
    }

    #[test]
    fn gpt2_on_wgpu() {
        run("gpt2", "gpt2", GELU_TOL);
    }

    #[test]
    fn mistral_on_wgpu() {
        run("mistral", "llama", F32_TOL);
    }
}

/// `new_families.rs`'s fixtures through the cubecl kernels. F32 fixtures: every id, CPU tolerances. Q8_0: the
/// kernels sum floats in another order than ggml and an ulp can flip an 8-bit activation
/// rounding (docs/correctness.md), so logits get families.rs's 5e-2 and ids are required up to
/// the first step where llama.cpp's own top-2 margin is below 0.1.
mod new_families {
    use super::Wgpu;
    use crate::common::{F32_TOL, GELU_TOL, matches_llama_cpp};

    fn run(name: &str, arch: &str, tol: f64, min_margin: f64) {
        matches_llama_cpp::<Wgpu>(name, arch, tol, None, min_margin, &Default::default());
    }

    #[test]
    fn gemma3_on_wgpu() {
        run("gemma3", "gemma3", GELU_TOL, 0.0);
        run("gemma3-q8_0", "gemma3", 5e-2, 0.1);
    }

    #[test]
    fn phi3_on_wgpu() {
        run("phi3", "phi3", F32_TOL, 0.0);
        run("phi3-q8_0", "phi3", 5e-2, 0.1);
    }

    #[test]
    fn smollm3_on_wgpu() {
        run("smollm3", "smollm3", F32_TOL, 0.0);
        run("smollm3-q8_0", "smollm3", 5e-2, 0.1);
    }

    #[test]
    fn granite_on_wgpu() {
        run("granite", "granite", F32_TOL, 0.0);
        run("granite-q8_0", "granite", 5e-2, 0.1);
    }
}

/// `batching.rs`'s sequences on wgpu. The quantized kernels compute llama.cpp's algorithm too, but each
/// layer quantizes its activations to 8 bits, and a 1-ulp difference upstream (the GPU's own
/// `exp` or reductions, which depend on how many rows a pass has) sometimes moves one value
/// across a rounding boundary: a step of ~3e-2 in the logits (measured on tiny qwen2: wgpu and
/// the CPU agree to 4e-7 on 266 of its 267 single-token inputs, and differ by 3.7e-2 on one).
/// So on wgpu the rule is the oracle tests' margin rule: a sequence's batched greedy ids equal
/// its own up to the first step where its own top-2 margin is below [`WGPU_MARGIN`]; the
/// largest logit deviation is printed.
mod batching {
    use super::Wgpu;
    use crate::common::batching::{alone, argmax, margin, prompts, together};
    use crate::common::load;

    /// Top-2 margin under which an activation-rounding step (~3e-2, above) may flip a greedy id
    /// on wgpu.
    const WGPU_MARGIN: f32 = 0.1;

    /// wgpu: each sequence's batched greedy ids follow its own up to the first step whose margin
    /// is below [`WGPU_MARGIN`].
    fn check_wgpu(name: &str) {
        let device = Default::default();
        let (file, _, model) = load::<Wgpu>(name, &device);
        let prompts = prompts(&file);
        let batched = together(&model, &prompts);
        let mut worst = 0.0f32;
        let mut failures = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let single = alone(&model, p);
            for (step, (b, s)) in batched[i].iter().zip(&single).enumerate() {
                let deviation = b
                    .iter()
                    .zip(s)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                worst = worst.max(deviation);
                if argmax(b) != argmax(s) {
                    if margin(s) >= WGPU_MARGIN {
                        failures.push(format!(
                            "prompt {i}, step {step}: greedy id {} batched, {} alone (margin {})",
                            argmax(b),
                            argmax(s),
                            margin(s)
                        ));
                    }
                    break;
                }
            }
        }
        eprintln!("{name} on wgpu: largest |batched - alone| logit {worst:e}");
        assert!(
            failures.is_empty(),
            "{name} on wgpu:\n{}",
            failures.join("\n")
        );
    }

    #[test]
    fn batched_sequences_on_wgpu_follow_their_own_runs() {
        // A float model, Q8_0 and the K-quants: the cubecl matvec (one row) against the tiled
        // kernels (a batch).
        for name in ["qwen2", "gemma3-q8_0", "kq-q4_k_m"] {
            check_wgpu(name);
        }
    }
}

/// `vit.rs`'s checks against timm through the cubecl kernels.
mod vit {
    use super::Wgpu;
    use crate::common::vit::{full_attention_is_unmasked, matches_timm, vit224_matches_timm};

    #[test]
    fn logits_match_timm_on_wgpu() {
        matches_timm::<Wgpu>("wgpu");
    }

    #[test]
    fn full_attention_sees_every_key_on_wgpu() {
        full_attention_is_unmasked::<Wgpu>("wgpu");
    }

    /// `vit.rs`'s `vit_tiny_patch16_224_matches_timm` says how to make `TOY_VIT224_DIR`.
    #[test]
    #[ignore = "needs TOY_VIT224_DIR from make_vit_fixtures.py --tiny224"]
    fn vit_tiny_patch16_224_matches_timm_on_wgpu() {
        vit224_matches_timm::<Wgpu>("wgpu");
    }
}

/// `--dtype f16` on `--backend wgpu`: the real SmolLM2-135M-Instruct Q8_0 with f16 weights and
/// activations (burn's per-device dtype policy, set before the model loads), against the CPU
/// backend's f32 logits and llama.cpp's greedy ids.

///
/// What agreement to expect. f16 keeps 11 significant bits: the residual stream, the KV cache
/// and every matmul output round to ~5e-4 relative, and the quantized matmuls re-quantize those
/// rounded activations to 8 bits, 30 layers deep. Logits therefore differ from the f32 CPU
/// backend by about twice as much as on f32 wgpu: measured 0.14 at the first position, up to
/// 1.04 by the sixth (logits of magnitude ~20; f32 wgpu: 0.55). Greedy ids may leave llama.cpp's
/// only where llama.cpp's own top-2 margin is below 3.0 (measured: three prompts equal for all
/// 16 steps, the fourth parts at step 3).
mod f16 {
    use burn::backend::Flex;
    use burn::tensor::{DType, FloatDType, Int, IntDType, Tensor, TensorData, set_default_dtypes};
    use cubecl::wgpu::WgpuDevice;
    use toy_core::gguf::GgufFile;

    use super::Wgpu;
    use crate::common;

    /// Two short prompts of eight steps: each forward pass takes seconds on lavapipe.
    const STEPS: usize = 8;
    const PROMPTS: usize = 2;
    /// Greedy ids may leave llama.cpp's only at a step whose top-2 margin is below this: twice the
    /// logit tolerance, since both top logits may move.
    const MARGIN: f64 = 3.0;
    /// Largest |f16 wgpu − f32 cpu| logit difference allowed at any position (measured 1.04).
    const LOGIT_TOLERANCE: f32 = 1.5;

    /// The CPU adapter (lavapipe), set to create f16 float tensors (once per process). burn keeps
    /// a dtype policy per device id: `WgpuDevice::Cpu` is a device of its own, apart from the
    /// default device the f32 tests of this binary use, even when both are lavapipe.
    fn f16_device() -> WgpuDevice {
        static DEVICE: std::sync::OnceLock<WgpuDevice> = std::sync::OnceLock::new();
        DEVICE
            .get_or_init(|| {
                let device = WgpuDevice::Cpu;
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
}
