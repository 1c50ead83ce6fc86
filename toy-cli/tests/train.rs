//! `toy train` and `toy eval` end to end: the default preset learns the bundled corpus and its
//! checkpoint runs in `toy infer` and `toy eval`; a run killed with SIGKILL resumes from its last
//! checkpoint, loses none, and finishes on the exact loss curve of an uninterrupted run; `toy
//! eval` reproduces llama.cpp's NLL on SmolLM2; `toy runs` lists and plots runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::{events, of_kind, root, smollm2, step_losses, success, toy};
use std::time::{Duration, Instant};

use serde_json::Value;

fn scratch(name: &str) -> PathBuf {
    common::scratch_dir("train-tests", name)
}

#[test]
fn train_default_preset_learns_and_its_model_runs() {
    let runs = scratch("default");
    let runs_s = runs.to_str().unwrap();
    // The default command with fewer steps (the full 120 take about a minute).
    success(&toy(&[
        "train",
        "--steps",
        "25",
        "--quiet",
        "--runs-dir",
        runs_s,
        "--run-id",
        "t",
    ]));
    let run = runs.join("t");
    let log = events(&run.join("events.jsonl"));
    let start = of_kind(&log, "run_start")[0];
    assert_eq!(start["schema"], "toy/v1");
    assert_eq!(start["config"]["preset"], "tiny");
    assert_eq!(start["vocab_size"], 828);
    let losses = step_losses(&log);
    assert_eq!(losses.len(), 25);
    let ln_vocab = 828f64.ln();
    assert!(losses[0].1 > 0.9 * ln_vocab, "first loss {}", losses[0].1);
    assert!(
        losses[24].1 < 0.5 * ln_vocab,
        "loss after 25 steps {}",
        losses[24].1
    );
    assert_eq!(
        of_kind(&log, "sample").len(),
        2,
        "a sample before and after"
    );
    assert_eq!(of_kind(&log, "run_end")[0]["step"], 25);

    let model = run.join("model.gguf");
    let model_s = model.to_str().unwrap();
    let out = success(&toy(&[
        "infer",
        model_s,
        "-p",
        "Once upon a time",
        "-n",
        "12",
        "--temperature",
        "0",
        "--json",
    ]));
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(out["prompt_ids"].as_array().unwrap().len(), 5);
    assert!(!out["ids"].as_array().unwrap().is_empty());

    let corpus = root().join("fixtures/corpus/stories.txt");
    let out = success(&toy(&[
        "eval",
        model_s,
        "--data",
        corpus.to_str().unwrap(),
        "--context",
        "128",
        "--chunks",
        "4",
        "--json",
    ]));
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(out["windows"], 4);
    assert_eq!(out["scored"], 4 * 127);
    assert!(out["mean_nll"].as_f64().unwrap() < 0.5 * ln_vocab, "{out}");

    // `toy runs` summarizes the run from its log; `toy runs plot` draws its curve.
    let listed: Value =
        serde_json::from_str(success(&toy(&["runs", "--dir", runs_s, "--json"])).trim()).unwrap();
    let listed = &listed.as_array().unwrap()[0];
    assert_eq!(
        (listed["id"].as_str(), listed["finished"].as_bool()),
        (Some("t"), Some(true))
    );
    assert_eq!(
        (
            listed["steps_done"].as_u64(),
            listed["steps_total"].as_u64()
        ),
        (Some(25), Some(25))
    );
    assert_eq!(listed["loss"].as_f64(), Some(losses[24].1));
    let table = success(&toy(&["runs", "--dir", runs_s]));
    assert!(
        table.contains("from-scratch tiny") && table.contains("25/25"),
        "{table}"
    );
    let svg = runs.join("loss.svg");
    success(&toy(&[
        "runs",
        "--dir",
        runs_s,
        "plot",
        "t",
        "-o",
        svg.to_str().unwrap(),
    ]));
    let svg = std::fs::read_to_string(svg).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 1);
    assert_eq!(svg.matches("<circle").count(), of_kind(&log, "eval").len());
    let missing = toy(&["runs", "--dir", runs_s, "plot", "nope"]);
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("nope"));
    std::fs::remove_dir_all(&runs).unwrap();
}

const SMALL: &[&str] = &[
    "train",
    "--quiet",
    "--layers",
    "2",
    "--d-model",
    "64",
    "--ffn",
    "128",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "60",
    "--warmup",
    "5",
    "--checkpoint-every",
    "5",
    "--eval-every",
    "0",
    "--seed",
    "3",
];

#[test]
fn train_killed_with_sigkill_resumes_from_its_last_checkpoint() {
    let runs = scratch("kill");
    let runs_s = runs.to_str().unwrap();
    let run = runs.join("k");
    let log_path = run.join("events.jsonl");

    let mut child = common::toy_command()
        .args(SMALL)
        .args(["--runs-dir", runs_s, "--run-id", "k"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once a few checkpoints are down, mid-run.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let log = events(&log_path);
        if of_kind(&log, "checkpoint").len() >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "no checkpoint after 300 s");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let log = events(&log_path);
    assert!(of_kind(&log, "run_end").is_empty(), "killed before the end");
    let last_ckpt = of_kind(&log, "checkpoint")
        .iter()
        .map(|e| e["step"].as_u64().unwrap())
        .max()
        .unwrap();
    // No checkpoint lost: `latest` names one at least as new as the last one reported.
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let latest_step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    assert!(
        latest_step >= last_ckpt,
        "latest {latest_step} < reported {last_ckpt}"
    );
    for f in ["model.mpk", "optim.mpk", "state.json"] {
        assert!(
            run.join("checkpoints")
                .join(latest.trim())
                .join(f)
                .is_file(),
            "{f}"
        );
    }

    // Resume: other training flags are refused; --resume alone finishes the run.
    let out = toy(&["train", "--resume", run.to_str().unwrap(), "--steps", "9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));
    success(&toy(&[
        "train",
        "--resume",
        run.to_str().unwrap(),
        "--quiet",
    ]));

    let log = events(&log_path);
    let losses = step_losses(&log);
    let steps: Vec<u64> = losses.iter().map(|s| s.0).collect();
    assert_eq!(
        steps,
        (1..=60).collect::<Vec<_>>(),
        "each step once, in order"
    );
    let starts = of_kind(&log, "run_start");
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[1]["resumed_from_step"], latest_step);
    assert_eq!(of_kind(&log, "run_end")[0]["step"], 60);

    // The same run without the kill: the same curve, to the bit, and the same model.
    success(&toy(&[
        SMALL,
        &["--runs-dir", runs_s, "--run-id", "straight"],
    ]
    .concat()));
    let straight = events(&runs.join("straight/events.jsonl"));
    assert_eq!(step_losses(&straight), losses);
    assert_eq!(
        std::fs::read(runs.join("straight/model.gguf"))
            .unwrap()
            .len(),
        std::fs::read(run.join("model.gguf")).unwrap().len()
    );
    let out = |dir: &str| {
        success(&toy(&[
            "infer",
            runs.join(dir).join("model.gguf").to_str().unwrap(),
            "-p",
            "One day",
            "-n",
            "16",
            "--temperature",
            "0",
            "--json",
        ]))
    };
    let (a, b): (Value, Value) = (
        serde_json::from_str(out("k").trim()).unwrap(),
        serde_json::from_str(out("straight").trim()).unwrap(),
    );
    assert_eq!(a["ids"], b["ids"]);
    std::fs::remove_dir_all(&runs).unwrap();
}

#[test]
fn eval_matches_llama_cpp_nll_on_smollm2_f32() {
    let oracle: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/smollm2/logits.json")).unwrap(),
    )
    .unwrap();
    let ppl = &oracle["models"]["F32"]["ppl"];
    // The text llama.cpp's perplexity oracle scored (copied from the shared anchors).
    let text = root().join("fixtures/smollm2/ppl_text.txt");
    assert!(text.is_file(), "{} is missing", text.display());
    let out = success(&toy(&[
        "eval",
        smollm2("F32").to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--context",
        "512",
        "--chunks",
        "1",
        "--no-bos",
        "--json",
    ]));
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(out["text_tokens"], ppl["n_text_tokens"]);
    assert_eq!(out["scored"], ppl["n_scored"]);
    let (ours, theirs) = (
        out["mean_nll"].as_f64().unwrap(),
        ppl["mean_nll"].as_f64().unwrap(),
    );
    // Measured: 3.4684925 vs 3.468492 (the fixture's 6 decimals).
    assert!(
        (ours - theirs).abs() < 5e-6,
        "toy {ours:.7} vs llama.cpp {theirs:.6}"
    );
    let acc = out["top1_accuracy"].as_f64().unwrap();
    assert!(
        (acc - ppl["top1_accuracy"].as_f64().unwrap()).abs() < 1e-5,
        "top-1 {acc}"
    );
}

#[test]
fn llama_cpp_runs_a_toy_checkpoint_to_the_same_greedy_tokens() {
    // `fixtures/corpus/trained/model.gguf` is a `toy train` checkpoint; llama.cpp's greedy tokens
    // for it were recorded by `fixtures/corpus/make_trained.sh llama` (llama.cpp loads the file as a plain llama model).
    same_greedy_tokens_as_llama_cpp(&root().join("fixtures/corpus/trained"));
}

#[test]
fn llama_cpp_runs_a_toy_gpt2_checkpoint_to_the_same_greedy_tokens() {
    // `fixtures/corpus/trained-gpt2/model.gguf` is a `toy train --arch gpt2` checkpoint, which
    // llama.cpp loads as its `gpt2` architecture (`fixtures/corpus/make_trained.sh gpt2`).
    same_greedy_tokens_as_llama_cpp(&root().join("fixtures/corpus/trained-gpt2"));
}

/// Fine-tunes of a gemma3 (F32) and a qwen2 (Q8_0) base by `toy train`
/// (`fixtures/finetune/make_family_finetunes.sh`): llama.cpp runs the base with toy's GGUF
/// adapter (`--lora`) to the greedy tokens `toy infer` gives on `toy merge` of the base and the
/// adapter — in its GGUF and in its PEFT form — and the full fine-tune, saved in the base's
/// architecture, to the tokens `toy infer` gives on it.
#[test]
fn llama_cpp_runs_toy_fine_tunes_of_every_family() {
    // phi3's adapters sit on its fused attn_qkv and gate+up ffn_up, gpt2's on attn_qkv.
    for (family, base) in [
        ("gemma3", "tiny-gemma3.gguf"),
        ("qwen2", "tiny-qwen2.gguf"),
        ("phi3", "tiny-phi3.gguf"),
        ("gpt2", "tiny-gpt2-q8_0.gguf"),
    ] {
        let dir = root().join("fixtures/finetune").join(family);
        let base = root().join("fixtures/models").join(base);
        let oracle = dir.join("lora/llamacpp_greedy.json");
        for adapter in [dir.join("lora/adapter.gguf"), dir.join("lora")] {
            let merged = scratch(&format!("merged-{family}")).join("merged.gguf");
            success(&toy(&[
                "merge",
                base.to_str().unwrap(),
                adapter.to_str().unwrap(),
                merged.to_str().unwrap(),
            ]));
            same_greedy_tokens(&merged, &oracle);
        }
        same_greedy_tokens_as_llama_cpp(&dir.join("full"));
    }
}

/// `toy infer` gives llama.cpp's prompt ids and 32 greedy ids for every prompt recorded in
/// `dir/llamacpp_greedy.json`, on `dir/model.gguf`.
fn same_greedy_tokens_as_llama_cpp(dir: &Path) {
    same_greedy_tokens(&dir.join("model.gguf"), &dir.join("llamacpp_greedy.json"));
}

/// `toy infer` on `model` gives the prompt ids and greedy ids recorded in `oracle`.
fn same_greedy_tokens(model: &Path, oracle: &Path) {
    let oracle: Value = serde_json::from_str(&std::fs::read_to_string(oracle).unwrap()).unwrap();
    let model = model.to_path_buf();
    for case in oracle["greedy"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let out = success(&toy(&[
            "infer",
            model.to_str().unwrap(),
            "-p",
            prompt,
            "-n",
            "32",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ]));
        let out: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(out["prompt_ids"], case["prompt_ids"], "{prompt:?}");
        assert_eq!(out["ids"], case["gen_ids"], "{prompt:?}");
    }
}

/// Data parallel in one process: two replicas at batch 6 (burn's collective all-reduce over
/// two Flex devices) follow the loss curve of one device at batch 12 over 20 steps of the
/// default run, within 1e-5 per step (the sums are ordered differently, so not to the bit);
/// the two-device run resumed from its step-10 checkpoint on one device continues that curve.
#[test]
fn data_parallel_follows_one_device_and_resumes_on_another_count() {
    let runs = scratch("dp");
    let runs_s = runs.to_str().unwrap();
    // 20 steps of the default run, checkpointed at step 10, into run `id`.
    let flags = |id: &'static str| {
        [
            "train",
            "--quiet",
            "--steps",
            "20",
            "--eval-every",
            "0",
            "--sample-every",
            "0",
            "--checkpoint-every",
            "10",
            "--runs-dir",
            runs_s,
            "--run-id",
            id,
        ]
    };
    let run = |id: &'static str, extra: &[&str]| {
        success(&toy(&[&flags(id)[..], extra].concat()));
        events(&runs.join(id).join("events.jsonl"))
    };
    let close = |a: &[(u64, f64)], b: &[(u64, f64)]| {
        assert_eq!(a.len(), b.len());
        for ((sa, la), (sb, lb)) in a.iter().zip(b) {
            assert_eq!(sa, sb);
            assert!((la - lb).abs() < 1e-5, "step {sa}: {la} vs {lb}");
        }
    };
    let one = run("one", &[]);
    let two = run("two", &["--batch-size", "6", "--devices", "cpu:0,cpu:1"]);
    let start = of_kind(&two, "run_start")[0];
    assert_eq!(start["devices"], 2);
    assert_eq!(start["global_batch"], 12);
    assert_eq!(
        start["tokens_per_step"],
        of_kind(&one, "run_start")[0]["tokens_per_step"]
    );
    let (one_losses, two_losses) = (step_losses(&one), step_losses(&two));
    assert_eq!(one_losses.len(), 20);
    close(&one_losses, &two_losses);
    assert_ne!(
        one_losses[0].1, one_losses[19].1,
        "the curve moves (the comparison means something)"
    );

    // Killed after its step-10 checkpoint, then resumed on one device.
    let dir = runs.join("killed");
    let mut child = common::toy_command()
        .args(flags("killed"))
        .args(["--batch-size", "6", "--devices", "cpu:0,cpu:1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while of_kind(&events(&dir.join("events.jsonl")), "checkpoint").is_empty() {
        assert!(Instant::now() < deadline, "no checkpoint after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended first");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL, ten steps before the next checkpoint
    child.wait().unwrap();
    let latest = std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-0000010");
    let out = toy(&[
        "train",
        "--resume",
        dir.to_str().unwrap(),
        "--devices",
        "cpu:0,cpu:1,cpu:2,cpu:3,cpu:4",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not split over 5 devices"), "{stderr}");
    success(&toy(&[
        "train",
        "--quiet",
        "--resume",
        dir.to_str().unwrap(),
        "--devices",
        "cpu:0",
    ]));
    let resumed = events(&dir.join("events.jsonl"));
    let starts = of_kind(&resumed, "run_start");
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[1]["resumed_from_step"], 10);
    assert_eq!(starts[1]["devices"], 1);
    assert_eq!(starts[1]["global_batch"], 12);
    close(&one_losses, &step_losses(&resumed));
    std::fs::remove_dir_all(&runs).unwrap();
}

#[test]
fn train_refuses_bad_settings_before_creating_a_run() {
    let runs = scratch("bad");
    let runs_s = runs.to_str().unwrap();
    for (args, needle) in [
        (&["--heads", "3"][..], "kv heads"),
        (&["--seq-len", "512"][..], "longer than the model's context"),
        (&["--lr", "0"][..], "learning rate"),
        (&["--data", "/nonexistent/file.txt"][..], "does not exist"),
        (&["--arch", "gpt2", "--kv-heads", "2"][..], "kv heads"),
        (&["--recipe", "warm-start"][..], "needs --donor"),
        (&["--devices", "cpu:0,ndarray:0"][..], "one backend"),
    ] {
        let out = toy(&[&["train", "--runs-dir", runs_s, "--run-id", "r"], args].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{args:?}: {stderr}"
        );
        assert!(
            !runs.join("r").exists(),
            "{args:?} left a run directory behind"
        );
    }
    let out = toy(&["train", "--resume", runs_s]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
}

/// `toy eval --logprobs`: every token's log-probability and its top alternatives equal
/// llama.cpp's for the oracle's 16-token prompt on SmolLM2 Q8_0 (bit-exact logits; the oracle
/// rounds log-probs to 1e-6).
#[test]
fn eval_logprobs_match_llama_cpp() {
    let oracle: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/smollm2/logits.json")).unwrap(),
    )
    .unwrap();
    let case = &oracle["models"]["Q8_0"]["sixteen_per_position_top5"];
    let dir = scratch("logprobs");
    let text = dir.join("prompt.txt");
    std::fs::write(&text, case["prompt"].as_str().unwrap()).unwrap();
    let model = smollm2("Q8_0");
    let out = success(&toy(&[
        "eval",
        model.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--context",
        "16",
        "--logprobs",
        "5",
        "--json",
    ]));
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    let tokens = out["tokens"].as_array().unwrap();
    let positions = case["positions"].as_array().unwrap();
    assert_eq!(tokens.len(), 15, "every token after the first is scored");
    for t in tokens {
        let pos = t["pos"].as_u64().unwrap() as usize;
        let want = &positions[pos - 1];
        assert_eq!(t["id"], case["ids"][pos]);
        let close = |a: &Value, b: f64| (a.as_f64().unwrap() - b).abs() < 2e-6;
        assert!(
            close(&t["logprob"], want["next_logprob"].as_f64().unwrap()),
            "pos {pos}: {t}"
        );
        let lse = want["logsumexp"].as_f64().unwrap();
        for (got, top) in t["top"]
            .as_array()
            .unwrap()
            .iter()
            .zip(want["top"].as_array().unwrap())
        {
            assert_eq!(got["id"], top[0], "pos {pos}");
            assert!(
                close(&got["logprob"], top[1].as_f64().unwrap() - lse),
                "pos {pos}: {got}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `toy eval lmc`: the interpolation's endpoints are exactly the two models (the same NLL as
/// `toy eval` of each), a model against itself has no barrier, and two differently seeded runs
/// do have one.
#[test]
fn eval_lmc_interpolates_between_checkpoints() {
    let runs = scratch("lmc");
    let runs_s = runs.to_str().unwrap();
    for (id, seed) in [("a", "3"), ("b", "4")] {
        let mut args = SMALL.to_vec();
        let set = |args: &mut Vec<&str>, flag: &str, value: &'static str| {
            let at = args.iter().position(|&a| a == flag).unwrap();
            args[at + 1] = value;
        };
        set(&mut args, "--seed", seed);
        set(&mut args, "--steps", "20");
        args.extend(["--runs-dir", runs_s, "--run-id", id]);
        success(&toy(&args));
    }
    let (a, b) = (runs.join("a/model.gguf"), runs.join("b/model.gguf"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let corpus = root().join("fixtures/corpus/stories.txt");
    let data = [
        "--data",
        corpus.to_str().unwrap(),
        "--context",
        "32",
        "--chunks",
        "16",
    ];
    let eval = |model: &str| -> f64 {
        let out: Value = serde_json::from_str(
            success(&toy(&[&["eval", model, "--json"][..], &data].concat())).trim(),
        )
        .unwrap();
        out["mean_nll"].as_f64().unwrap()
    };
    let lmc = |x: &str, y: &str| -> Value {
        let args = [
            &["eval", "lmc", x, y, "--alphas", "0,0.5,1", "--json"][..],
            &data,
        ]
        .concat();
        serde_json::from_str(success(&toy(&args)).trim()).unwrap()
    };
    let line = lmc(a, b);
    let points = line["points"].as_array().unwrap();
    assert_eq!(points.len(), 3);
    assert_eq!(points[0]["mean_nll"].as_f64().unwrap(), eval(a));
    assert_eq!(points[2]["mean_nll"].as_f64().unwrap(), eval(b));
    assert!(line["barrier"].as_f64().unwrap() > 0.0, "{line}");
    let same = lmc(a, a);
    assert_eq!(same["barrier"].as_f64().unwrap(), 0.0, "{same}");
    std::fs::remove_dir_all(&runs).unwrap();
}
