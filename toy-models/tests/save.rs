//! A saved model is a GGUF that toy's loader reads back to the same model: same config, same
//! logits to the bit (F32 weights are written as they are), and the extra metadata is kept.

use std::path::PathBuf;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use toy_core::gguf::{GgufFile, Value};
use toy_models::{LlamaConfig, SaveError, Transformer, load, save};

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("toy-save-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn logits(model: &Transformer<Flex>, ids: &[i64]) -> Vec<f32> {
    let device = Default::default();
    let tokens =
        Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &device);
    model
        .forward(tokens, &mut model.new_cache())
        .into_data()
        .into_vec::<f32>()
        .unwrap()
}

fn round_trip(config: LlamaConfig, file_name: &str) {
    let device = Default::default();
    <Flex as burn::tensor::backend::Backend>::seed(&device, 3);
    let model: Transformer<Flex> = config.init(&device);
    let extra = vec![
        (
            "general.name".to_string(),
            Value::String("round trip".into()),
        ),
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
    ];
    let path = temp_path(file_name);
    save(&model, &config, &extra, &path).unwrap();

    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.get_str("general.name").unwrap(), Some("round trip"));
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    let (loaded_config, loaded) = load::<Flex>(&file, &device, |_, _| {}).unwrap();
    assert_eq!(loaded_config.n_layer, config.n_layer);
    assert_eq!(loaded_config.d_model, config.d_model);
    assert_eq!(loaded_config.n_head, config.n_head);
    assert_eq!(loaded_config.n_head_kv, config.n_head_kv);
    assert_eq!(loaded_config.head_dim, config.head_dim);
    assert_eq!(loaded_config.d_ff, config.d_ff);
    assert_eq!(loaded_config.vocab_size, config.vocab_size);
    assert_eq!(loaded_config.context_length, config.context_length);
    assert_eq!(loaded_config.rope_theta, config.rope_theta);
    assert_eq!(loaded_config.rms_eps, config.rms_eps as f32);
    assert_eq!(loaded_config.tied_embeddings, config.tied_embeddings);

    let ids = [0i64, 5, 17, 3, 9, 30, 2, 11];
    let before = logits(&model, &ids);
    let after = logits(&loaded, &ids);
    assert_eq!(before.len(), ids.len() * config.vocab_size);
    assert!(before == after, "logits changed after save + load");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn save_then_load_gives_identical_logits_untied() {
    round_trip(
        LlamaConfig::new(2, 32, 4, 2, 8, 48, 37, 64)
            .with_rope_theta(5000.0)
            .with_rms_eps(1e-6)
            .with_tied_embeddings(false),
        "untied.gguf",
    );
}

#[test]
fn save_then_load_gives_identical_logits_tied_and_wide_heads() {
    // head_dim * n_head != d_model: the file needs llama.attention.key_length.
    let config = LlamaConfig::new(1, 24, 2, 1, 16, 40, 31, 32).with_tied_embeddings(true);
    let device = Default::default();
    let model: Transformer<Flex> = config.init(&device);
    assert!(
        model.output.is_none(),
        "a tied head multiplies by token_embd"
    );
    let path = temp_path("tied.gguf");
    save(&model, &config, &[], &path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert!(file.tensor("output.weight").is_none());
    assert_eq!(
        file.get_u64("llama.attention.key_length").unwrap(),
        Some(16)
    );
    let (_, loaded) = load::<Flex>(&file, &device, |_, _| {}).unwrap();
    let ids = [1i64, 2, 3, 4, 30];
    assert!(logits(&model, &ids) == logits(&loaded, &ids));
    std::fs::remove_file(&path).unwrap();
    round_trip(config, "tied-init.gguf");
}

#[test]
fn save_refuses_reserved_metadata() {
    let config = LlamaConfig::new(1, 16, 2, 2, 8, 16, 10, 16);
    let model: Transformer<Flex> = config.init(&Default::default());
    let extra = vec![("llama.block_count".to_string(), Value::U32(7))];
    let err = save(&model, &config, &extra, temp_path("never.gguf")).unwrap_err();
    assert!(matches!(err, SaveError::ReservedKey(_)), "{err}");
    assert!(!temp_path("never.gguf").exists());
}

#[test]
fn save_refuses_what_llama_gguf_cannot_express() {
    let base = LlamaConfig::new(1, 16, 2, 2, 8, 16, 10, 16);
    for config in [
        base.clone().with_attn_bias(true),
        base.clone().with_qk_norm(true),
        base.clone().with_rope_interleaved(false),
    ] {
        let model: Transformer<Flex> = config.init(&Default::default());
        let err = save(&model, &config, &[], temp_path("never2.gguf")).unwrap_err();
        assert!(matches!(err, SaveError::Architecture(_)), "{err}");
    }
    assert!(!temp_path("never2.gguf").exists());
}

/// A model of any llama-family architecture but olmoe, saved in its base's architecture
/// (`save_like_base`, what a full fine-tune writes), is the base again: the same architecture,
/// metadata and tensor names and dims, and the same logits to the bit (packed weights are
/// written in their own type; phi3's split Q/K/V and gate/up are fused again). An untied head
/// adds `output.weight` and still loads to the same logits. olmoe is refused.
#[test]
fn every_family_saves_in_its_base_architecture() {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models");
    let device = Default::default();
    for name in [
        "tiny-qwen2",
        "tiny-qwen2-yarn",
        "tiny-qwen3",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-gemma3-q8_0",
        "tiny-phi3",
        "tiny-phi3-q8_0",
        "tiny-smollm3",
        "tiny-granite",
    ] {
        let base = GgufFile::open(models.join(format!("{name}.gguf"))).unwrap();
        let (config, model) = load::<Flex>(&base, &device, |_, _| {}).unwrap();
        let config = LlamaConfig::from_model_config(&config);
        let extra = [("general.name".to_string(), Value::String("saved".into()))];
        let path = temp_path(&format!("{name}-like-base.gguf"));
        toy_models::save_like_base(&model, &config, &base, &extra, &path).unwrap();
        let saved = GgufFile::open(&path).unwrap();
        assert_eq!(saved.architecture().unwrap(), base.architecture().unwrap());
        assert_eq!(saved.get_str("general.name").unwrap(), Some("saved"));
        for (key, value) in &base.metadata {
            if !matches!(key.as_str(), "general.name" | "general.file_type") {
                assert_eq!(saved.get(key), Some(value), "{name}: {key}");
            }
        }
        let names = |f: &GgufFile| {
            let mut v: Vec<_> = f
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.dims.clone()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&saved), names(&base), "{name}: the same tensors");
        let (_, loaded) = load::<Flex>(&saved, &device, |_, _| {}).unwrap();
        let ids: Vec<i64> = (0..12)
            .map(|i| (i * 29 + 3) % config.vocab_size as i64)
            .collect();
        assert!(
            logits(&model, &ids) == logits(&loaded, &ids),
            "{name}: logits changed"
        );
    }

    // Untied: the head as its own tensor.
    let base = GgufFile::open(models.join("tiny-gemma3.gguf")).unwrap();
    let (c, mut model) = load::<Flex>(&base, &device, |_, _| {}).unwrap();
    model.output = Some(model.head().dequantized());
    let config = LlamaConfig::from_model_config(&c).with_tied_embeddings(false);
    let path = temp_path("gemma3-untied.gguf");
    toy_models::save_like_base(&model, &config, &base, &[], &path).unwrap();
    let saved = GgufFile::open(&path).unwrap();
    assert!(saved.tensor("output.weight").is_some());
    let (_, loaded) = load::<Flex>(&saved, &device, |_, _| {}).unwrap();
    let ids = [1i64, 7, 40, 99];
    assert!(
        logits(&model, &ids) == logits(&loaded, &ids),
        "untied gemma3: logits changed"
    );

    let olmoe = GgufFile::open(models.join("tiny-olmoe.gguf")).unwrap();
    let (c, model) = load::<Flex>(&olmoe, &device, |_, _| {}).unwrap();
    let err = toy_models::save_like_base(
        &model,
        &LlamaConfig::from_model_config(&c),
        &olmoe,
        &[],
        temp_path("olmoe.gguf"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("mixture-of-experts"), "{err}");
}

/// The tied-head trap: a model made with tied embeddings (`LlamaConfig`'s default), trained in a
/// user's own loop with burn's optimizer and saved, must reload as the model that was trained.
/// A head holding its own copy of the embedding would train apart and be dropped on save
/// (a tied file has no `output.weight`), so the reloaded model would answer with the stale table.
#[test]
fn a_trained_tied_model_saves_what_was_trained() {
    use burn::backend::Autodiff;
    use burn::module::AutodiffModule;
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};

    type Train = Autodiff<Flex>;
    let config = LlamaConfig::new(1, 16, 2, 1, 8, 24, 19, 16);
    assert!(config.tied_embeddings, "the default is a tied head");
    let device = Default::default();
    <Train as burn::tensor::backend::Backend>::seed(&device, 11);
    let mut model: Transformer<Train> = config.init(&device);
    let mut optim = SgdConfig::new().init();
    let tokens = Tensor::<Train, 2, Int>::from_data(
        TensorData::new(vec![1i64, 5, 9, 3, 7, 2, 11, 4], [1, 8]),
        &device,
    );
    let targets = Tensor::<Train, 2, Int>::from_data(
        TensorData::new(vec![5i64, 9, 3, 7, 2, 11, 4, 6], [1, 8]),
        &device,
    );
    for _ in 0..3 {
        let loss = model.loss(tokens.clone(), targets.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.5, model, grads);
    }
    let trained = model.valid();
    let path = temp_path("trained-tied.gguf");
    save(&trained, &config, &[], &path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert!(file.tensor("output.weight").is_none(), "tied: one table");
    let (_, loaded) = load::<Flex>(&file, &device, |_, _| {}).unwrap();
    let ids = [1i64, 5, 9, 3];
    assert!(
        logits(&trained, &ids) == logits(&loaded, &ids),
        "the reloaded model is not the trained one"
    );
    std::fs::remove_file(&path).unwrap();
}
