//! The from-scratch recipe end to end on a small model and the bundled corpus: the loss falls,
//! the same seed gives the same loss curve, a run stopped at a checkpoint and resumed continues
//! the exact curve of an uninterrupted run, gradient accumulation of k micro-batches of b equals
//! one batch of k·b, and the checkpoint GGUF loads in toy with the run's tokenizer.

mod common;

use std::ops::ControlFlow;

use burn::backend::Flex;
use common::{info, losses, run, scratch, small_config as config};
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;
use toy_train::events::{Event, Record, read_events};
use toy_train::{RunDir, TrainSetup, train};

fn resume(run: &RunDir) {
    let setup = TrainSetup::prepare(run.read_config().unwrap()).unwrap();
    train::<Flex>(
        run,
        &setup,
        &info(),
        &Default::default(),
        &mut |_: &Record| ControlFlow::Continue(()),
    )
    .unwrap();
}

#[test]
fn loss_falls_and_the_checkpoint_loads() {
    let root = scratch("train-falls");
    let run = run(&root, "a", config(30), None);
    let curve = losses(&run);
    assert_eq!(curve.len(), 30);
    let vocab = 828f64;
    assert!(
        // Unit-variance logits at init add ~0.5 nats to the uniform ln(vocab).
        (curve[0] - vocab.ln()).abs() < 1.0,
        "first loss {} should be near ln(vocab) = {}",
        curve[0],
        vocab.ln()
    );
    assert!(
        curve[29] < 0.6 * vocab.ln(),
        "loss after 30 steps {} did not fall enough",
        curve[29]
    );
    let events = read_events(&run.events_path()).unwrap();
    let kinds: Vec<&str> = events
        .iter()
        .map(|r| match r.event {
            Event::RunStart { .. } => "run_start",
            Event::Step { .. } => "step",
            Event::Eval { .. } => "eval",
            Event::Sample { .. } => "sample",
            Event::Checkpoint { .. } => "checkpoint",
            Event::RunEnd { .. } => "run_end",
            Event::VisionRunStart { .. } => "vision_run_start",
        })
        .collect();
    assert_eq!(&kinds[..2], ["run_start", "sample"]);
    assert_eq!(
        &kinds[kinds.len() - 4..],
        ["eval", "sample", "checkpoint", "run_end"]
    );
    assert!(events.iter().all(|r| r.schema == "toy/v1"));

    // The checkpoint is a llama GGUF with the run's tokenizer.
    let file = GgufFile::open(run.model_path()).unwrap();
    let (config, _model) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
    assert_eq!(
        (config.n_layer, config.d_model, config.vocab_size),
        (2, 64, 828)
    );
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(
        tok.encode("Once upon", true, true).unwrap(),
        vec![0, 437, 518]
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn same_seed_same_curve_and_resume_continues_it() {
    let root = scratch("train-resume");
    let mut c = config(8);
    c.cadence.checkpoint_every = 3;
    let straight = run(&root, "straight", c.clone(), None);
    let again = run(&root, "again", c.clone(), None);
    assert_eq!(losses(&straight), losses(&again), "same seed, same backend");

    let mut other_seed = c.clone();
    other_seed.seed = 8;
    let other = run(&root, "other", other_seed, None);
    assert_ne!(losses(&straight), losses(&other));

    // Stopped after the checkpoint of step 6 (checkpoints at 3 and 6), then resumed.
    let stopped = run(&root, "stopped", c, Some(6));
    assert_eq!(losses(&stopped).len(), 6);
    assert!(stopped.latest().unwrap().unwrap().ends_with("step-0000006"));
    resume(&stopped);
    assert_eq!(
        losses(&stopped),
        losses(&straight),
        "resumed run continues the curve"
    );
    let events = read_events(&stopped.events_path()).unwrap();
    let starts: Vec<Option<usize>> = events
        .iter()
        .filter_map(|r| match &r.event {
            Event::RunStart {
                resumed_from_step, ..
            } => Some(*resumed_from_step),
            _ => None,
        })
        .collect();
    assert_eq!(starts, vec![None, Some(6)]);
    // The resumed run's model is the uninterrupted run's, to the bit.
    let a = std::fs::read(straight.model_path()).unwrap();
    let b = std::fs::read(stopped.model_path()).unwrap();
    let (fa, fb) = (
        GgufFile::from_bytes(a).unwrap(),
        GgufFile::from_bytes(b).unwrap(),
    );
    for t in &fa.tensors {
        let u = fb.tensor(&t.name).unwrap();
        assert!(fa.tensor_data(t) == fb.tensor_data(u), "{} differs", t.name);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    use burn::backend::Autodiff;
    use toy_train::data::Batch;
    use toy_train::trainer::accumulate_grads;

    let c = config(1);
    let setup = TrainSetup::prepare(c.clone()).unwrap();
    let device = Default::default();
    let llama: toy_models::Transformer<Autodiff<Flex>> =
        toy_train::init::init_model(&setup.llama_config(), 1, &device);
    let model = toy_train::model::Trainee {
        model: toy_models::Model::Llama(llama),
        embd_proj: None,
    };
    let micro: Vec<Batch> = (0..3)
        .map(|g| setup.data.train_batch(c.seed, g, 4).unwrap())
        .collect();
    let whole = Batch {
        tokens: micro.iter().flat_map(|b| b.tokens.clone()).collect(),
        batch: 12,
        seq_len: micro[0].seq_len,
        epoch: 0,
    };
    let (g_acc, loss_acc) = accumulate_grads::<Flex>(&model, None, &micro, &device);
    let (g_one, loss_one) = accumulate_grads::<Flex>(&model, None, &[whole], &device);
    assert!(
        (loss_acc - loss_one).abs() < 1e-5,
        "{loss_acc} vs {loss_one}"
    );
    let id = toy_train::model::token_embd(&model.model)
        .unwrap()
        .weight
        .id;
    let get = |g: &burn::optim::GradientsParams| -> Vec<f32> {
        g.get::<Flex, 2>(id)
            .unwrap()
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let (a, b) = (get(&g_acc), get(&g_one));
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        scale > 0.0 && worst < 1e-5 * scale.max(1.0),
        "max difference {worst} (scale {scale})"
    );
}
