//! LoRA: gradients of the adapters against finite differences; only the adapters train (the
//! base stays bit-identical and has no gradient); base + adapter gives the merged model's logits;
//! the adapter files round-trip; LoRA and QLoRA on SmolLM2-135M reduce the loss.

mod common;

use std::ops::ControlFlow;
use std::path::PathBuf;

use common::{fixtures, info, next_token_loss, scratch, smollm2};

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use toy_core::gguf::{GgmlType, GgufFile};
use toy_kernels::ToyBackend;
use toy_models::lora::{self, Adaptable, LoraSpec, Target};
use toy_models::{CausalLm, LlamaConfig, Model, Transformer};
use toy_train::adapter::{Adapter, QkLayout, merge};
use toy_train::config::LoraSettings;
use toy_train::events::{Event, Record};
use toy_train::{DataConfig, Preset, Recipe, RunDir, TrainConfig, TrainSetup};

/// The tiny llama trained on the bundled corpus (4 layers × 128, F32): a small base.
fn tiny_base() -> PathBuf {
    fixtures().join("corpus/trained/model.gguf")
}

fn spec(targets: &[Target]) -> LoraSpec {
    LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.to_vec(),
    }
}

/// Deterministic pseudo-random values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `model` with adapters on `targets` whose A and B are both non-zero (a trained adapter).
fn with_random_adapters<B: ToyBackend, M: Adaptable<B>>(model: M, targets: &[Target]) -> M {
    let device = model.lora_device();
    let mut adapters = lora::new_adapters(&model, &spec(targets), |layer, t, [r, inp]| {
        values(r * inp, 1 + layer as u64 * 31 + t as u64, 0.2)
    })
    .unwrap();
    for (layer, block) in adapters.blocks.iter_mut().enumerate() {
        for t in Target::ALL {
            if let Some(l) = block.slot(t) {
                let [out, r] = l.b.dims();
                let b = values(out * r, 1000 + layer as u64 * 31 + t as u64, 0.2);
                l.b = Param::from_tensor(Tensor::from_data(TensorData::new(b, [out, r]), &device));
            }
        }
    }
    lora::install(model, adapters).unwrap()
}

/// Gradients of A and B of every target against central differences (with Richardson
/// extrapolation), in f64 on NdArray: the analytic gradients flow through the frozen base.
/// The fused targets (`qkv`, `gate_up`: one adapter whose rows the parts share out) are
/// checked on the same model beside the separate ones.
#[test]
fn lora_gradients_match_finite_differences() {
    let config = LlamaConfig::new(2, 16, 4, 2, 4, 24, 13, 16).with_tied_embeddings(false);
    assert_eq!(check_lora_gradients(&config, &Target::ALL, 1e-3), 2 * 9 * 2);
}

/// The same on a mixture-of-experts model (olmoe's shape: whole-projection Q/K norms, 4 experts,
/// 2 per token) with adapters on the attention: the gradient flows through the experts *and*
/// the router probabilities that weight them. Measured relative errors: at most 1.1e-3 (hence
/// the 3e-3 bound); with the router's path detached they are 8.9e-3 to 0.58, so the check
/// tells the two apart.
#[test]
fn moe_attention_lora_gradients_match_finite_differences() {
    let config = LlamaConfig::new(2, 16, 4, 2, 4, 24, 13, 16)
        .with_tied_embeddings(false)
        .with_qk_norm_full(true)
        .with_rope_interleaved(false)
        .with_n_expert(4)
        .with_n_expert_used(2);
    let attention = [Target::Q, Target::K, Target::V, Target::O];
    assert_eq!(check_lora_gradients(&config, &attention, 3e-3), 2 * 4 * 2);
}

/// Check one element of A and B of every adapter on `targets` against central differences
/// (with Richardson extrapolation), in f64, to a relative error under `tolerance`; returns how
/// many were checked.
fn check_lora_gradients(config: &LlamaConfig, targets: &[Target], tolerance: f64) -> usize {
    type B = NdArray<f64>;
    type Ad = Autodiff<B>;
    let device = Default::default();
    // Seeded (burn's global RNG is shared with the tests running beside this one).
    let base = toy_train::init::init_model::<Ad>(config, 3, &device);
    let model = with_random_adapters(base, targets);
    let tokens: Vec<i64> = (0..2 * 7).map(|i| (i * 5 + 3) % 13).collect();

    let l = next_token_loss(&model, &tokens, 2);
    let grads = l.backward();
    let mut checked = 0;
    for (layer, block) in model.blocks.iter().enumerate() {
        let lora = block.lora.as_ref().unwrap();
        for &t in targets {
            let adapter = lora.get(t).unwrap();
            for (which, param) in [("A", &adapter.a), ("B", &adapter.b)] {
                let g = param.val().grad(&grads).expect("adapter has a gradient");
                let g: Vec<f64> = g.into_data().convert::<f64>().into_vec().unwrap();
                let n = g.len();
                let idx = (layer * 7 + t as usize * 3) % n;
                let value_at = |delta: f64| -> f64 {
                    let shifted = model.clone().valid();
                    let mut shifted = shifted;
                    let block = shifted.blocks[layer].lora.as_mut().unwrap();
                    let a = block.slot(t).as_mut().unwrap();
                    let p = if which == "A" { &mut a.a } else { &mut a.b };
                    let dims = p.dims();
                    let mut v: Vec<f64> = p.val().into_data().convert::<f64>().into_vec().unwrap();
                    v[idx] += delta;
                    *p = Param::from_tensor(Tensor::from_data(TensorData::new(v, dims), &device));
                    next_token_loss(&shifted, &tokens, 2)
                        .into_scalar()
                        .elem::<f64>()
                };
                let h = 1e-2;
                let d1 = (value_at(h) - value_at(-h)) / (2.0 * h);
                let d2 = (value_at(h / 2.0) - value_at(-h / 2.0)) / h;
                let fd = (4.0 * d2 - d1) / 3.0;
                let err = (fd - g[idx]).abs() / fd.abs().max(1e-2);
                assert!(
                    err < tolerance,
                    "layer {layer} {t:?} {which}[{idx}]: autodiff {} vs finite differences {fd} (relative error {err:.2e})",
                    g[idx]
                );
                checked += 1;
            }
        }
    }
    checked
}

/// The starting model of the lora recipe: only adapter parameters get gradients; after AdamW
/// steps the adapters moved and every base tensor is bit-identical to the base GGUF's.
#[test]
fn only_adapters_train() {
    type Ad = Autodiff<Flex>;
    let device = Default::default();
    let config = lora_config(
        tiny_base(),
        vec!["q", "k", "v", "o", "gate", "up", "down"],
        2,
    );
    let base = toy_train::finetune::Base::open(&tiny_base()).unwrap();
    let Model::Llama(mut model) =
        toy_train::finetune::start_model::<Ad>(&config, &base, &device).unwrap()
    else {
        unreachable!("a llama base")
    };
    let (_, plain) = toy_models::load::<Flex>(&base.file, &device, |_, _| {}).unwrap();
    let n_layer = model.blocks.len();

    let tokens: Vec<i64> = (0..2 * 17).map(|i| (i * 37 + 11) % 800).collect();
    let mut optim = AdamWConfig::new().init::<Ad, Transformer<Ad>>();
    for _ in 0..3 {
        let grads = next_token_loss(&model, &tokens, 2).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        // 2 tensors (A, B) per target per layer, nothing else.
        assert_eq!(grads.len(), 2 * 7 * n_layer);
        model = optim.step(1e-2, model, grads);
    }
    let trained = model.valid();
    let floats = |m: &Transformer<Flex>| -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        struct Collect<'a>(&'a mut Vec<Vec<f32>>);
        impl<B: Backend> burn::module::ModuleVisitor<B> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                self.0
                    .push(p.val().into_data().convert::<f32>().into_vec().unwrap());
            }
        }
        let mut without = m.clone();
        for b in without.blocks.iter_mut() {
            b.lora = None;
        }
        without.visit(&mut Collect(&mut out));
        out
    };
    assert_eq!(floats(&trained), floats(&plain), "a base tensor changed");
    let adapter = Adapter::from_model(&trained, 16.0, 0.0).unwrap();
    assert_eq!(adapter.tensors.len(), 7 * n_layer);
    assert!(
        adapter
            .tensors
            .iter()
            .all(|t| t.b.iter().any(|&x| x != 0.0)),
        "every B moved away from zero"
    );
}

fn lora_config(base: PathBuf, targets: Vec<&str>, steps: usize) -> TrainConfig {
    let data = DataConfig {
        files: vec![fixtures().join("finetune/instructions.txt")],
        tokenizer: base.clone(),
        val_fraction: 0.0,
    };
    let mut c = TrainConfig::from_preset(Preset::Tiny, data, 5);
    c.preset = None;
    c.recipe = Recipe::Lora {
        base,
        adapter: LoraSettings {
            targets: targets.into_iter().map(String::from).collect(),
            ..LoraSettings::default()
        },
    };
    c.optim.steps = steps;
    c.optim.batch_size = 2;
    c.optim.seq_len = 64;
    c.optim.lr = 2e-3;
    c.optim.min_lr = 2e-3;
    c.optim.warmup_steps = 0;
    c.optim.weight_decay = 0.0;
    c.cadence.eval_every = 0;
    c.cadence.checkpoint_every = 0;
    c.cadence.sample_tokens = 4;
    c.cadence.sample_prompt = "### Instruction:".into();
    c
}

/// Base + adapters and the merged GGUF (F32) give the same logits: within 1e-4 of the largest
/// logit (1e-3 for gemma3). The adapter also round-trips through both files (GGUF and PEFT, whose q/k rows are
/// permuted to HF order and back where the base's converter permuted them). One base per
/// family that stores its projections apart: llama, gemma3 and smollm3, granite, qwen2 (Q8_0,
/// dequantized as the lora recipe does); phi3 fuses Q/K/V and gate/up, so its adapters take
/// the fused matrices (one adapter each, split over the parts the model keeps apart) and the
/// output and down projections; gpt2 (Q8_0) its fused qkv, o, up and down; olmoe's (mixture of
/// experts) take the attention.
#[test]
fn merged_model_equals_base_plus_adapter() {
    let models = fixtures().join("models");
    let phi3 = [Target::Qkv, Target::O, Target::GateUp, Target::Down];
    let gpt2 = [Target::Qkv, Target::O, Target::Up, Target::Down];
    let attention = [Target::Q, Target::K, Target::V, Target::O];
    // Gemma's GELU reads ggml's f16 table: where `x·(W + BA)` and `x·W + B(Ax)` differ by an
    // ulp across an f16 rounding boundary, an activation moves by one f16 step (see
    // docs/models.md), hence 1e-3 there.
    for (base, targets, tolerance) in [
        (tiny_base(), &Target::SEPARATE[..], 1e-4),
        (models.join("tiny-gemma3.gguf"), &Target::SEPARATE[..], 1e-3),
        (
            models.join("tiny-smollm3.gguf"),
            &Target::SEPARATE[..],
            1e-4,
        ),
        (
            models.join("tiny-granite.gguf"),
            &Target::SEPARATE[..],
            1e-4,
        ),
        (models.join("tiny-qwen2.gguf"), &Target::SEPARATE[..], 1e-4),
        (models.join("tiny-phi3.gguf"), &phi3[..], 1e-4),
        (models.join("tiny-gpt2-q8_0.gguf"), &gpt2[..], 1e-4),
        (models.join("tiny-olmoe.gguf"), &attention[..], 1e-4),
    ] {
        merged_equals_adapted(&base, targets, tolerance);
    }
}

fn merged_equals_adapted(base_path: &std::path::Path, targets: &[Target], tolerance: f32) {
    let what = base_path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let device = Default::default();
    let file = GgufFile::open(base_path).unwrap();
    let load = || {
        let (config, m) = toy_models::load_model::<Flex>(&file, &device, |_, _| {}).unwrap();
        (config, toy_train::finetune::dequantize(m))
    };
    let (config, base) = load();
    let adapted = with_random_adapters(base, targets);
    let adapter = Adapter::from_model(&adapted, 8.0, 0.0).unwrap();

    let dir = scratch(&format!("lora-merge-{what}"));
    std::fs::create_dir_all(&dir).unwrap();
    let layout = QkLayout::of(&config);
    adapter
        .write_all(&dir, layout, &config.architecture, "tiny", "test")
        .unwrap();
    let adapter_file = GgufFile::open(dir.join("adapter.gguf")).unwrap();
    assert_eq!(
        adapter_file.architecture().unwrap(),
        config.architecture,
        "{what}: the adapter declares its base's architecture"
    );
    let from_gguf = Adapter::read_gguf(&adapter_file, &config).unwrap();
    assert_eq!(from_gguf, adapter, "{what}");
    let from_peft = Adapter::read_peft(&dir, layout).unwrap();
    assert_eq!(from_peft.tensors, adapter.tensors, "{what}");

    merge(&file, &from_gguf, GgmlType::F32)
        .unwrap()
        .write_atomic(dir.join("merged.gguf"))
        .unwrap();
    let merged_file = GgufFile::open(dir.join("merged.gguf")).unwrap();
    let (_, merged) = toy_models::load_model::<Flex>(&merged_file, &device, |_, _| {}).unwrap();

    let vocab = config.vocab_size as i64;
    let tokens: Vec<i64> = (0..24).map(|i| (i * 37 + 11) % vocab).collect();
    let input = Tensor::<Flex, 2, Int>::from_data(TensorData::new(tokens, [1, 24]), &device);
    let logits = |m: &Model<Flex>| -> Vec<f32> {
        m.forward(input.clone(), &mut m.new_cache())
            .into_data()
            .into_vec()
            .unwrap()
    };
    let (a, b) = (logits(&adapted), logits(&merged));
    let p = logits(&load().1);
    let max = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let moved = a
        .iter()
        .zip(&p)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= tolerance * max,
        "{what}: max |adapted - merged| = {diff}, max |logit| = {max}"
    );
    assert!(
        moved > 1e-2 * max,
        "{what}: the adapter changes the logits ({moved})"
    );
}

/// Train two epochs over the instruction text (a handful of sequences): the mean training loss
/// of the second epoch (the same sequences) is lower than the first's.
fn fine_tune_reduces_loss(recipe: &str, base: PathBuf, targets: Vec<&str>) -> RunDir {
    let mut config = lora_config(base.clone(), targets, 1);
    if recipe == "qlora" {
        let Recipe::Lora { adapter, .. } = config.recipe.clone() else {
            unreachable!()
        };
        config.recipe = Recipe::Qlora { base, adapter };
    }
    let per_epoch = TrainSetup::prepare(config.clone())
        .unwrap()
        .data
        .batches_per_epoch(config.optim.batch_size);
    config.optim.steps = 2 * per_epoch;
    let run = common::run(&scratch(&format!("lora-{recipe}")), "run", config, None);
    let losses = common::losses(&run);
    eprintln!("{recipe} losses: {losses:?}");
    assert_eq!(losses.len(), 2 * per_epoch);
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, second) = (mean(&losses[..per_epoch]), mean(&losses[per_epoch..]));
    assert!(
        second < first - 0.1,
        "{recipe}: the loss did not fall ({first} -> {second}): {losses:?}"
    );
    for f in [
        "adapter.gguf",
        "adapter_model.safetensors",
        "adapter_config.json",
    ] {
        assert!(run.path.join(f).is_file(), "{f} written");
    }
    assert!(
        !run.model_path().exists(),
        "a LoRA run writes adapters, not a model"
    );
    run
}

#[test]
fn lora_on_smollm2_reduces_the_loss() {
    fine_tune_reduces_loss("lora", smollm2("Q8_0"), vec!["q", "v"]);
}

#[test]
fn qlora_on_smollm2_reduces_the_loss() {
    fine_tune_reduces_loss("qlora", smollm2("Q8_0"), vec!["q", "v"]);
}

/// LoRA, QLoRA and full fine-tunes of non-llama bases (tiny random gemma3 F32, qwen2 Q8_0,
/// phi3 F32 with its fused matrices adapted, gpt2 Q8_0): the loss falls; the adapter declares
/// the base's architecture; the full model is saved in the base's architecture with every
/// tensor the family has (Q/K norms, post-norms, biases, fused matrices) and loads back to the
/// trained weights.
#[test]
fn fine_tunes_of_every_family_learn_and_keep_their_architecture() {
    let models = fixtures().join("models");
    for (name, arch, targets) in [
        ("tiny-gemma3", "gemma3", vec!["q", "v"]),
        ("tiny-qwen2", "qwen2", vec!["q", "v"]),
        ("tiny-phi3", "phi3", vec!["qkv", "gate_up"]),
        ("tiny-gpt2-q8_0", "gpt2", vec!["qkv", "up"]),
    ] {
        let base = models.join(format!("{name}.gguf"));
        for recipe in ["lora", "qlora"] {
            let run = fine_tune_reduces_loss(recipe, base.clone(), targets.clone());
            let adapter = GgufFile::open(run.path.join("adapter.gguf")).unwrap();
            assert_eq!(adapter.architecture().unwrap(), arch, "{name} {recipe}");
        }
        let mut config = lora_config(base.clone(), vec![], 1);
        config.recipe = Recipe::Full { base: base.clone() };
        config.optim.lr = 1e-3;
        config.optim.min_lr = 1e-3;
        let per_epoch = TrainSetup::prepare(config.clone())
            .unwrap()
            .data
            .batches_per_epoch(config.optim.batch_size);
        config.optim.steps = 2 * per_epoch;
        let root = scratch(&format!("full-{name}"));
        let losses = run_steps(&root, "full", config, None);
        let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
        assert!(
            mean(&losses[per_epoch..]) < mean(&losses[..per_epoch]) - 0.1,
            "{name} full: {losses:?}"
        );
        let saved = GgufFile::open(root.join("full/model.gguf")).unwrap();
        let original = GgufFile::open(&base).unwrap();
        assert_eq!(saved.architecture().unwrap(), arch);
        for info in &original.tensors {
            let t = saved.tensor(&info.name);
            assert!(
                t.is_some_and(|t| t.dims == info.dims),
                "{name}: {}",
                info.name
            );
        }
        assert!(
            saved.tensor("output.weight").is_some(),
            "the head is saved untied"
        );
        for (key, value) in &original.metadata {
            if key.starts_with(&format!("{arch}.")) {
                assert_eq!(saved.get(key), Some(value), "{name}: {key} kept");
            }
        }
        let (_, trained) =
            toy_models::load_model::<Flex>(&saved, &Default::default(), |_, _| {}).unwrap();
        let (_, plain) =
            toy_models::load_model::<Flex>(&original, &Default::default(), |_, _| {}).unwrap();
        let plain = toy_train::finetune::dequantize(plain);
        let w = |m: &Model<Flex>| {
            let block = m.lora_blocks()[0];
            let parts = block.adapted(Target::Qkv).unwrap();
            match parts[0] {
                toy_models::QLinear::Dense(p) => p.val().into_data().into_vec::<f32>().unwrap(),
                _ => unreachable!("a full fine-tune saves f32"),
            }
        };
        assert_ne!(w(&trained), w(&plain), "{name}: the base weights trained");
    }
}

/// A LoRA run on the tiny base (stories, 32-token windows).
fn tiny_run_config(recipe: &str, steps: usize) -> TrainConfig {
    let base = tiny_base();
    let mut c = lora_config(base.clone(), vec!["q", "v", "down"], steps);
    c.data.files = vec![fixtures().join("corpus/stories.txt")];
    c.data.val_fraction = 0.05;
    c.optim.batch_size = 4;
    c.optim.seq_len = 32;
    c.cadence.eval_batches = 1;
    c.cadence.checkpoint_every = 2;
    c.cadence.sample_prompt = "Once upon a time".into();
    if recipe == "full" {
        // The instruction text is new to the tiny story model: its loss has room to fall.
        c.recipe = Recipe::Full { base };
        c.data.files = vec![fixtures().join("finetune/instructions.txt")];
        c.data.val_fraction = 0.0;
        c.optim.lr = 1e-3;
        c.optim.min_lr = 1e-3;
    }
    c
}

/// Run `config` in `root/id`; stop after the checkpoint of step `stop_at`, if given. Returns the
/// run's step losses.
fn run_steps(
    root: &std::path::Path,
    id: &str,
    config: TrainConfig,
    stop_at: Option<usize>,
) -> Vec<f64> {
    let setup = TrainSetup::prepare(config).unwrap();
    let run = match RunDir::open(&root.join(id)) {
        Ok(run) if run.latest().unwrap().is_some() => run,
        _ => RunDir::create(root, id).unwrap(),
    };
    let mut losses = Vec::new();
    let mut observer = |r: &Record| match (&r.event, stop_at) {
        (Event::Step { loss, .. }, _) => {
            losses.push(*loss);
            ControlFlow::Continue(())
        }
        (Event::Checkpoint { step, .. }, Some(at)) if *step >= at => ControlFlow::Break(()),
        _ => ControlFlow::Continue(()),
    };
    toy_train::train::<Flex>(&run, &setup, &info(), &Default::default(), &mut observer).unwrap();
    losses
}

/// A LoRA run stopped at a checkpoint and resumed (the checkpoint holds only the adapters and
/// their moments) continues the uninterrupted run's loss curve exactly, and ends with the same
/// adapter file.
#[test]
fn lora_resume_continues_the_same_curve() {
    let root = scratch("lora-resume");
    let whole = run_steps(&root, "whole", tiny_run_config("lora", 4), None);
    let first = run_steps(&root, "split", tiny_run_config("lora", 4), Some(2));
    assert_eq!(first, whole[..2]);
    let rest = run_steps(&root, "split", tiny_run_config("lora", 4), None);
    assert_eq!(rest, whole[2..]);
    let read = |id: &str| std::fs::read(root.join(id).join("adapter_model.safetensors")).unwrap();
    assert_eq!(read("split"), read("whole"));
    // The resume state is the adapters, not the base.
    let ckpt = std::fs::read_dir(root.join("whole/checkpoints"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .unwrap()
        .path();
    let record = std::fs::metadata(ckpt.join("model.mpk")).unwrap().len();
    let base = std::fs::metadata(tiny_base()).unwrap().len();
    assert!(
        record * 10 < base,
        "model.mpk ({record} B) holds more than the adapters"
    );
}

/// `full` trains every weight of the base and writes a whole model that loads; over two epochs
/// of the instruction text its mean loss falls.
#[test]
fn full_fine_tune_trains_the_base() {
    let root = scratch("lora-full");
    let config = tiny_run_config("full", 1);
    let per_epoch = TrainSetup::prepare(config.clone())
        .unwrap()
        .data
        .batches_per_epoch(config.optim.batch_size);
    let losses = run_steps(&root, "full", tiny_run_config("full", 2 * per_epoch), None);
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    assert!(
        mean(&losses[per_epoch..]) < mean(&losses[..per_epoch]) - 0.1,
        "{losses:?}"
    );
    let file = GgufFile::open(root.join("full/model.gguf")).unwrap();
    assert!(
        file.tensor("output.weight").is_some(),
        "the head is saved untied"
    );
    let (_, trained) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
    let base = GgufFile::open(tiny_base()).unwrap();
    let (_, plain) = toy_models::load::<Flex>(&base, &Default::default(), |_, _| {}).unwrap();
    let w = |m: &Transformer<Flex>| match &m.blocks[0].attn.wq {
        toy_models::QLinear::Dense(p) => p.val().into_data().into_vec::<f32>().unwrap(),
        _ => unreachable!(),
    };
    assert_ne!(w(&trained), w(&plain), "the base weights trained");
    assert!(!root.join("full/adapter.gguf").exists());
}

/// LoRA on a mixture-of-experts base (tiny olmoe, F32) adapts its attention: the loss falls and
/// the adapter declares `olmoe`. Its MLP and a full fine-tune are refused with what to do.
#[test]
fn lora_on_an_olmoe_base_trains_the_attention() {
    let base = fixtures().join("models/tiny-olmoe.gguf");
    let run = fine_tune_reduces_loss("lora", base.clone(), vec!["q", "v"]);
    let adapter = GgufFile::open(run.path.join("adapter.gguf")).unwrap();
    assert_eq!(adapter.architecture().unwrap(), "olmoe");

    let lora = lora_config(base.clone(), vec!["q", "down"], 1);
    let mut full = lora.clone();
    full.recipe = Recipe::Full { base };
    // (config, what the refusal must tell the user)
    for (config, says) in [(lora, "q,k,v,o"), (full, "--recipe lora")] {
        let setup = TrainSetup::prepare(config).unwrap();
        let base = setup.base.as_ref().unwrap();
        let err =
            toy_train::finetune::start_model::<Flex>(&setup.config, base, &Default::default())
                .expect_err("refused");
        assert!(err.to_string().contains(says), "{err}");
    }
}

/// An adapter sits on a matrix the base file has: phi3's Q/K/V and gate/up are one matrix each
/// (`qkv`, `gate_up`), a llama's are apart, GPT-2 has no gate. Each mismatch is refused with
/// the targets to use instead.
#[test]
fn lora_targets_must_be_matrices_of_the_base_file() {
    let models = fixtures().join("models");
    for (base, targets, says) in [
        (models.join("tiny-phi3.gguf"), vec!["q"], "use qkv"),
        (models.join("tiny-phi3.gguf"), vec!["up"], "use gate_up"),
        (tiny_base(), vec!["qkv"], "use q,k,v"),
        (
            models.join("tiny-qwen2.gguf"),
            vec!["gate_up"],
            "use gate,up",
        ),
        (
            models.join("tiny-gpt2.gguf"),
            vec!["gate"],
            "qkv, o, up, down",
        ),
    ] {
        let setup = TrainSetup::prepare(lora_config(base, targets, 1)).unwrap();
        let base = setup.base.as_ref().unwrap();
        let err =
            toy_train::finetune::start_model::<Flex>(&setup.config, base, &Default::default())
                .expect_err("refused");
        assert!(err.to_string().contains(says), "{err}");
    }
}
