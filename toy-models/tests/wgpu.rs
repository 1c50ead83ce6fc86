//! The model on `--backend wgpu` (Mesa's lavapipe in CI, a real GPU elsewhere), running toy's
//! cubecl kernels: SmolLM2-135M-Instruct Q8_0 must give llama.cpp's greedy ids — and so the CPU
//! backend's — for 16 tokens on every oracle prompt. The quantized matmul kernels compute
//! llama.cpp's 8-bit activation blocks and integer block dots, so only float summation order
//! differs; llama.cpp's own top-2 margin is at least 0.019 on these 80 steps, far above that.

mod common;

use burn::backend::Flex;
use burn_cubecl::CubeBackend;
use cubecl::wgpu::WgpuRuntime;
use toy_core::gguf::GgufFile;

type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

const STEPS: usize = 16;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_q8_0_greedy_on_wgpu_equals_llama_cpp_and_cpu() {
    let oracle = common::oracle("greedy.json");
    let file = GgufFile::open(common::smollm2("Q8_0")).unwrap();
    let (_, gpu) = toy_models::load::<Wgpu>(&file, &Default::default(), |_, _| {}).unwrap();
    let (_, cpu) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
    let mut failures = Vec::new();
    for (i, case) in oracle["results"]["Q8_0"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let expected = &ids(&case["gen_ids"])[..STEPS];
        let start = std::time::Instant::now();
        let got = common::greedy(&gpu, &prompt, STEPS);
        eprintln!(
            "prompt {i} ({} tokens): wgpu {:.1} s, {}/{STEPS} ids equal llama.cpp's",
            prompt.len(),
            start.elapsed().as_secs_f64(),
            got.iter().zip(expected).take_while(|(a, b)| a == b).count()
        );
        let on_cpu = common::greedy(&cpu, &prompt, STEPS);
        if got != expected || got != on_cpu {
            failures.push(format!(
                "prompt {i}: wgpu {got:?}\n  llama.cpp {expected:?}\n  cpu {on_cpu:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
