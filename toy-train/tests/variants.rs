//! The from-scratch loop's other models and inputs: GPT-2 (its gradients against finite
//! differences, a run whose loss falls and whose checkpoint is a `gpt2` GGUF), the warm start
//! from SmolLM2's embeddings through a projection folded into `token_embd`, pre-tokenized
//! data, and the loss curve of a fixed-seed run reproduced bit for bit from a committed fixture.

mod common;

use std::path::{Path, PathBuf};

use common::{
    corpus_dir, eval_losses, fixtures, losses, next_token_loss, scratch, small_config, smollm2,
};

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use toy_core::gguf::GgufFile;
use toy_models::gpt2::Gpt2;
use toy_models::{Gpt2Config, Model, QLinear};
use toy_train::config::Arch;
use toy_train::model::{DonorEmbedding, Trainee, init_trainee};
use toy_train::optim::OptimRecord;
use toy_train::{DataConfig, ModelShape, Recipe, RunDir, TrainConfig, TrainSetup};

fn fixture(name: &str) -> PathBuf {
    fixtures().join("train").join(name)
}

/// `small_config` as `arch`.
fn config(arch: Arch, steps: usize) -> TrainConfig {
    let mut c = small_config(steps);
    c.model = c.model.with_arch(arch);
    c
}

fn run(root: &Path, config: TrainConfig) -> RunDir {
    common::run(root, "run", config, None)
}

// ---------------------------------------------------------------------------------------------
// GPT-2 gradients: LayerNorm, GELU, learned positions, fused QKV and biases, all through burn's
// autodiff of the model's own ops, against central finite differences in f64 (NdArray). In f64
// `gelu_ggml`'s f16 rounding (a round-to-nearest by adding and subtracting 1.5·2^23·ulp, exact in
// f32) rounds at ~1e-9 only, so the loss is smooth; the step and extrapolation are those of
// `toy-models/tests/autodiff.rs`.

/// Add `delta` to coordinate `idx` (flat) of the parameter `id`.
struct Bump {
    id: ParamId,
    idx: usize,
    delta: f64,
}

impl<B: Backend> ModuleMapper<B> for Bump {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if param.id != self.id {
            return param;
        }
        let (id, value, mapper) = param.consume();
        let shape = value.shape();
        let mut v = vec![0.0f64; shape.num_elements()];
        v[self.idx] = self.delta;
        let bump = Tensor::from_data(TensorData::new(v, shape), &value.device());
        Param::from_mapped_value(id, value + bump, mapper)
    }
}

/// The gradient of the parameter `id`, flat.
struct GradOf<'a, B: AutodiffBackend> {
    id: ParamId,
    grads: &'a B::Gradients,
    out: Option<Vec<f64>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradOf<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.id == self.id {
            let g = param.val().grad(self.grads).expect("a gradient");
            self.out = Some(g.into_data().iter::<f64>().collect());
        }
    }
}

fn dense_id<B: Backend>(q: &QLinear<B>) -> ParamId {
    match q {
        QLinear::Dense(p) => p.id,
        _ => unreachable!("Gpt2Config::init makes dense weights"),
    }
}

#[test]
fn gpt2_gradients_match_finite_differences() {
    type B = Autodiff<NdArray<f64>>;
    let device = Default::default();
    <B as Backend>::seed(&device, 5);
    // Two layers, 4 heads of 4, MLP 40, vocab 19, 12 learned positions.
    let model: Gpt2<B> = Gpt2Config::new(2, 16, 4, 40, 19, 12).init(&device);
    let tokens: Vec<i64> = vec![1, 5, 9, 2, 17, 3, 3, 8, 0, 12, 4, 18, 6, 11];
    let batch = 2;
    let grads = next_token_loss(&model, &tokens, batch).backward();
    let inner = model.valid();

    let b0 = &model.blocks[0];
    let b1 = &model.blocks[1];
    let cases = [
        ("token_embd", model.token_embd.weight.id, 5 * 16 + 3),
        // Positions 0..6 are used.
        ("position_embd", model.pos_embd.weight.id, 4 * 16 + 7),
        ("blk.0.attn_norm.weight", b0.attn_norm.weight.id, 3),
        ("blk.1.attn_norm.bias", b1.attn_norm.bias.id, 9),
        (
            "blk.0.attn_qkv.weight (q)",
            dense_id(&b0.qkv.weight),
            2 * 16 + 5,
        ),
        (
            "blk.1.attn_qkv.weight (k)",
            dense_id(&b1.qkv.weight),
            20 * 16 + 1,
        ),
        (
            "blk.0.attn_qkv.weight (v)",
            dense_id(&b0.qkv.weight),
            40 * 16 + 9,
        ),
        // The K bias has no gradient (it adds the same q·b to every score of a query); Q's and
        // V's do.
        ("blk.0.attn_qkv.bias (q)", b0.qkv.bias.id, 6),
        ("blk.1.attn_qkv.bias (v)", b1.qkv.bias.id, 37),
        ("blk.1.attn_output.weight", dense_id(&b1.wo.weight), 100),
        ("blk.0.attn_output.bias", b0.wo.bias.id, 3),
        ("blk.0.ffn_norm.weight", b0.ffn_norm.weight.id, 8),
        ("blk.1.ffn_norm.bias", b1.ffn_norm.bias.id, 15),
        ("blk.0.ffn_up.weight", dense_id(&b0.up.weight), 300),
        ("blk.1.ffn_up.bias", b1.up.bias.id, 33),
        ("blk.1.ffn_down.weight", dense_id(&b1.down.weight), 250),
        ("blk.0.ffn_down.bias", b0.down.bias.id, 10),
        ("output_norm.weight", model.output_norm.weight.id, 4),
        ("output_norm.bias", model.output_norm.bias.id, 12),
        ("output", dense_id(&model.output), 7 * 16 + 2),
    ];
    let loss_at = |m: &Gpt2<NdArray<f64>>| {
        next_token_loss(m, &tokens, batch)
            .into_scalar()
            .elem::<f64>()
    };
    let eps = 1e-2;
    for (name, id, idx) in cases {
        let mut visit = GradOf::<B> {
            id,
            grads: &grads,
            out: None,
        };
        model.visit(&mut visit);
        let analytic = visit.out.expect("the parameter is in the model")[idx];
        let shifted = |delta: f64| {
            let m = inner.clone().map(&mut Bump { id, idx, delta });
            loss_at(&m)
        };
        let central = |e: f64| (shifted(e) - shifted(-e)) / (2.0 * e);
        // Richardson extrapolation of two central differences: error O(ε⁴).
        let numeric = (4.0 * central(eps / 2.0) - central(eps)) / 3.0;
        let err = (analytic - numeric).abs() / numeric.abs().max(1e-3);
        assert!(
            err < 1e-3,
            "{name}[{idx}]: autodiff {analytic:.9}, finite difference {numeric:.9}, rel err {err:.2e}"
        );
        assert!(numeric.abs() > 1e-6, "{name}[{idx}] does not move the loss");
    }
}

#[test]
fn gpt2_trains_from_scratch_and_saves_a_gpt2_gguf() {
    let root = scratch("variants-gpt2");
    let run = run(&root, config(Arch::Gpt2, 30));
    let curve = losses(&run);
    assert_eq!(curve.len(), 30);
    let ln_vocab = 828f64.ln();
    assert!(
        // Measured: 7.33 → 4.49 (the llama of the same width reaches ~3.9 in 30 steps).
        curve[29] < 0.7 * ln_vocab,
        "loss {} → {} did not fall enough",
        curve[0],
        curve[29]
    );
    let file = GgufFile::open(run.model_path()).unwrap();
    assert_eq!(
        file.get("general.architecture").and_then(|v| v.as_str()),
        Some("gpt2")
    );
    for name in [
        "token_embd.weight",
        "position_embd.weight",
        "blk.1.attn_qkv.bias",
        "blk.0.ffn_down.bias",
        "output_norm.bias",
        "output.weight",
    ] {
        assert!(file.tensor(name).is_some(), "{name} is missing");
    }
    let (config, model) =
        toy_models::load_model::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
    assert!(matches!(model, Model::Gpt2(_)));
    assert_eq!(
        (config.n_layer, config.d_model, config.n_head, config.d_ff),
        (2, 64, 4, 256)
    );
    // The held-out loss of the loaded GGUF is the run's final held-out loss: the file holds the
    // trained weights.
    let setup = TrainSetup::prepare(run.read_config().unwrap()).unwrap();
    let batches = setup.data.val_batches(4, 2);
    let loaded = toy_train::eval::evaluate_batches(&model, &batches).unwrap();
    let logged = *eval_losses(&run).last().unwrap();
    assert!(
        (loaded.mean_nll - logged).abs() < 1e-6,
        "loaded {} vs logged {logged}",
        loaded.mean_nll
    );
    std::fs::remove_dir_all(&root).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Warm start.

/// A few KB of the bundled stories as a text file of its own (SmolLM2's 49k vocabulary makes
/// the logits large; a short text keeps the test quick).
fn short_text(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(corpus_dir().join("stories.txt")).unwrap();
    let cut = text.char_indices().nth(6000).map_or(text.len(), |(i, _)| i);
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("short.txt");
    std::fs::write(&path, &text[..cut]).unwrap();
    path
}

fn warm_config(donor: &Path, text: PathBuf) -> TrainConfig {
    let mut c = config(Arch::Llama, 3);
    c.recipe = Recipe::WarmStart {
        donor: donor.to_path_buf(),
    };
    c.data = DataConfig {
        files: vec![text],
        tokenizer: donor.to_path_buf(),
        val_fraction: 0.1,
    };
    c.model = ModelShape {
        n_layer: 1,
        d_model: 32,
        n_head: 2,
        n_head_kv: 1,
        d_ff: 64,
        ..c.model
    };
    c.optim.batch_size = 2;
    c.optim.seq_len = 16;
    c.cadence.eval_batches = 1;
    c.cadence.sample_tokens = 4;
    c
}

#[test]
fn warm_start_from_smollm2_folds_the_projection_into_token_embd() {
    let donor = smollm2("Q8_0");
    let root = scratch("variants-warm");
    let config = warm_config(&donor, short_text(&root));
    let run = run(&root, config.clone());
    let curve = losses(&run);
    assert_eq!(curve.len(), 3);
    assert!(curve.iter().all(|l| l.is_finite()));

    // The checkpoint's projection P, trained away from its seeded start.
    let device = Default::default();
    let setup = TrainSetup::prepare(config.clone()).unwrap();
    let table = DonorEmbedding::read(&donor).unwrap();
    assert_eq!((table.vocab_size, table.width), (49152, 576));
    // Checkpoint records are written from the autodiff model; read them back the same way.
    type Ad = Autodiff<Flex>;
    let start: Trainee<Ad> =
        init_trainee(&setup.model_spec(), config.seed, Some(&table), &device).unwrap();
    let latest = run.latest().unwrap().unwrap();
    let (_, record, _) =
        RunDir::read_checkpoint::<Ad, <Trainee<Ad> as Module<Ad>>::Record, OptimRecord<Ad>>(
            &latest, &device,
        )
        .unwrap();
    let trained = start.clone().load_record(record).valid();
    let start = start.valid();
    let p = trained
        .embd_proj
        .as_ref()
        .expect("widths differ: a projection")
        .val();
    assert_eq!(p.dims(), [576, 32]);
    let p0 = start.embd_proj.as_ref().unwrap().val();
    assert!(
        p.clone().sub(p0).abs().max().into_scalar().elem::<f32>() > 0.0,
        "P is trained"
    );

    // model.gguf is a standard llama GGUF whose token_embd is donor · P.
    let file = GgufFile::open(run.model_path()).unwrap();
    let (_, model) = toy_models::load_model::<Flex>(&file, &device, |_, _| {}).unwrap();
    let Model::Llama(model) = model else {
        panic!("a llama")
    };
    assert!(file.tensors.iter().all(|t| !t.name.contains("proj")));
    let saved: Vec<f32> = model.token_embd.weight().into_data().to_vec().unwrap();
    let p: Vec<f32> = p.into_data().to_vec().unwrap();
    let mut worst = 0f64;
    for (row, out) in table.values.chunks_exact(576).zip(saved.chunks_exact(32)) {
        for (j, &got) in out.iter().enumerate() {
            let want: f64 = row
                .iter()
                .enumerate()
                .map(|(k, &x)| x as f64 * p[k * 32 + j] as f64)
                .sum();
            worst = worst.max((got as f64 - want).abs() / want.abs().max(1.0));
        }
    }
    // An f32 matmul of 576 terms against the f64 sum.
    assert!(
        worst < 1e-5,
        "token_embd differs from donor · P by {worst:.2e}"
    );

    // Another vocabulary than the donor's is refused.
    let mut mismatched = config;
    mismatched.data.tokenizer = corpus_dir().join("tokenizer.gguf");
    let err = TrainSetup::prepare(mismatched).err().unwrap().to_string();
    assert!(err.contains("drop --tokenizer"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn warm_start_at_the_donor_width_copies_the_embeddings() {
    let donor = smollm2("Q8_0");
    let root = scratch("variants-warm-same");
    let mut config = warm_config(&donor, short_text(&root));
    config.model = ModelShape {
        d_model: 576,
        n_head: 9,
        n_head_kv: 3,
        ..config.model
    };
    let setup = TrainSetup::prepare(config.clone()).unwrap();
    let table = setup.donor.as_ref().unwrap();
    let device = Default::default();
    let t: Trainee<Flex> = init_trainee(&setup.model_spec(), 1, Some(table), &device).unwrap();
    assert!(t.embd_proj.is_none());
    let embd: Vec<f32> = toy_train::model::token_embd(&t.model)
        .unwrap()
        .weight
        .val()
        .into_data()
        .to_vec()
        .unwrap();
    assert!(embd == table.values);
    std::fs::remove_dir_all(&root).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenized data.

#[test]
fn pre_tokenized_files_train_like_their_text() {
    let root = scratch("variants-u32");
    std::fs::create_dir_all(&root).unwrap();
    let text = config(Arch::Llama, 1);
    let from_text = TrainSetup::prepare(text.clone()).unwrap();
    let ids: Vec<u32> = from_text.data.tokens().to_vec();
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    for name in ["stories.u32", "stories.bin"] {
        let path = root.join(name);
        std::fs::write(&path, &bytes).unwrap();
        let mut c = text.clone();
        c.data.files = vec![path];
        let setup = TrainSetup::prepare(c).unwrap();
        assert!(setup.data.tokens() == ids.as_slice());
        assert_eq!(
            setup.data.train_batch(7, 3, 4).unwrap().tokens,
            from_text.data.train_batch(7, 3, 4).unwrap().tokens
        );
    }
    // An id outside the vocabulary, and a size that is not whole ids.
    let mut bad = bytes.clone();
    bad[4 * 1000..4 * 1001].copy_from_slice(&828u32.to_le_bytes());
    let path = root.join("bad.u32");
    std::fs::write(&path, &bad).unwrap();
    let mut c = text.clone();
    c.data.files = vec![path];
    let err = TrainSetup::prepare(c).err().unwrap().to_string();
    assert!(
        err.contains("token 1000 is id 828") && err.contains("vocabulary of 828"),
        "{err}"
    );
    let path = root.join("odd.bin");
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let mut c = text;
    c.data.files = vec![path];
    let err = TrainSetup::prepare(c).err().unwrap().to_string();
    assert!(err.contains("not a whole number"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The loss curve fixture.

/// The fixed run of `fixtures/train/loss_curve.json`: 12 steps of the small llama shape.
fn curve_config() -> TrainConfig {
    let mut c = config(Arch::Llama, 12);
    c.seed = 1234;
    c.cadence.sample_tokens = 0;
    c
}

#[test]
fn loss_curve_reproduces_the_fixture_bit_for_bit() {
    // The curve was made with the CPU backend reproducing llama.cpp's AVX-512 build (its SwiGLU
    // and attention arithmetic; toy-kernels' `GgmlIsa`), on a CPU with AVX-512 gemm kernels.
    toy_kernels::flex::set_ggml_isa(toy_kernels::flex::GgmlIsa::Avx512);
    let root = scratch("variants-curve");
    let curve = losses(&run(&root, curve_config()));
    std::fs::remove_dir_all(&root).unwrap();
    let path = fixture("loss_curve.json");
    if std::env::var_os("TOY_REGENERATE_FIXTURES").is_some() {
        let json = serde_json::json!({
            "generated_by": "TOY_REGENERATE_FIXTURES=1 cargo test --release -p toy-train --test variants loss_curve (cpu backend)",
            "run": "llama, 2 layers × 64, 4/2 heads, ffn 128, seq 32 × batch 4, 12 steps, seed 1234, bundled corpus",
            "loss": curve,
            "loss_f32_bits": curve.iter().map(|&l| format!("{:08x}", (l as f32).to_bits())).collect::<Vec<_>>(),
        });
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap() + "\n").unwrap();
        return;
    }
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let want: Vec<u32> = fixture["loss_f32_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u32::from_str_radix(b.as_str().unwrap(), 16).unwrap())
        .collect();
    let got: Vec<u32> = curve.iter().map(|&l| (l as f32).to_bits()).collect();
    assert_eq!(
        got, want,
        "the loss curve changed: {curve:?}; if the arithmetic changed on purpose, regenerate (docs/training.md)"
    );
}
