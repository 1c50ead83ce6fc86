#!/usr/bin/env python3
"""Helper of benches/make-llama-1b.sh: a random-weight GGUF with Llama-3.2-1B's shapes, and
llama.cpp's greedy ids on its quantized copies.

    python3 benches/make_llama_1b.py write OUT.gguf --tokenizer SmolLM2.gguf [--dtype BF16|F16] [--seed N]
    python3 benches/make_llama_1b.py expect --oracle toy-oracle --out expected.json MODEL.gguf ...

`write` streams the model tensor by tensor (header and tensor infos first, then each tensor is
generated, converted and written; peak memory ~1.6 GB for the 128256 x 2048 embedding, never
the whole 2.5 GB model):
  llama architecture, width 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64, d_ff 8192,
  vocab 128256, RoPE theta 500000 (no llama3 rope_freqs), RMS eps 1e-5, context 4096 in the
  metadata, tied embeddings (no output.weight).
  Weights: numpy default_rng(seed).standard_normal(float32) * 0.02 for every matrix (embedding
  included), norms 1.0; matrices in BF16 (round-to-nearest-even, as ggml and gguf-py do) or F16,
  norms F32.
  Tokenizer: SmolLM2-135M's byte-level BPE (49152 tokens, its merges, token types, bos/eos/unk/
  pad ids, chat template, pre-tokenizer smollm) padded to 128256 with control tokens
  `<|reserved_0|>` .. `<|reserved_79103|>`.

`expect` runs toy-oracle (F32 KV cache, no flash attn, 2 threads) with greedy 16 tokens on two
short prompts for each model and writes ids, margins, file sizes and sha256s to a small JSON.
"""
import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFReader, GGUFWriter, TokenType

D, N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM, D_FF, N_VOCAB, CTX = 2048, 16, 32, 8, 64, 8192, 128256, 4096
STD = 0.02
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
N_PREDICT = 16


def tensors():
    """(name, PyTorch shape, kind) in file order."""
    yield "token_embd.weight", (N_VOCAB, D), "matrix"
    yield "output_norm.weight", (D,), "norm"
    q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYER):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (D,), "norm"
        yield p + "attn_q.weight", (q, D), "matrix"
        yield p + "attn_k.weight", (kv, D), "matrix"
        yield p + "attn_v.weight", (kv, D), "matrix"
        yield p + "attn_output.weight", (D, q), "matrix"
        yield p + "ffn_norm.weight", (D,), "norm"
        yield p + "ffn_gate.weight", (D_FF, D), "matrix"
        yield p + "ffn_up.weight", (D_FF, D), "matrix"
        yield p + "ffn_down.weight", (D, D_FF), "matrix"


def to_bf16(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even (ggml_compute_fp32_to_bf16 / gguf-py), in chunks."""
    flat = x.reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    step = 1 << 24
    for a in range(0, flat.size, step):
        u = flat[a:a + step].view(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        if nan.any():
            r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
        out[a:a + step] = r
    return out.reshape(x.shape)


def write(args) -> None:
    t0 = time.time()
    src = GGUFReader(args.tokenizer)
    f = src.fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    ttypes = [int(t) for t in f["tokenizer.ggml.token_type"].contents()]
    merges = list(f["tokenizer.ggml.merges"].contents())
    n_src = len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(N_VOCAB - n_src)]
    ttypes += [int(TokenType.CONTROL)] * (N_VOCAB - n_src)
    bf16 = args.dtype == "BF16"
    mdtype = QT.BF16 if bf16 else QT.F16

    w = GGUFWriter(args.out, "llama")
    w.add_name("llama-1b-shape (random weights, Llama-3.2-1B shapes)")
    w.add_file_type(32 if bf16 else 1)  # LLAMA_FTYPE_MOSTLY_BF16 / MOSTLY_F16
    w.add_block_count(N_LAYER)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(D_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(N_VOCAB)
    w.add_uint32("general.seed", args.seed)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id),
                     ("padding", w.add_pad_token_id)):
        k = f"tokenizer.ggml.{key}_token_id"
        if k in f:
            add(int(f[k].contents()))
    w.add_add_bos_token(False)
    if "tokenizer.chat_template" in f:
        w.add_chat_template(f["tokenizer.chat_template"].contents())

    items = list(tensors())
    for name, shape, kind in items:
        n = int(np.prod(shape))
        if kind == "norm":
            w.add_tensor_info(name, shape, np.dtype(np.float32), n * 4)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.uint16 if bf16 else np.float16), n * 2, raw_dtype=mdtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for i, (name, shape, kind) in enumerate(items):
        if kind == "norm":
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(STD)
        w.write_tensor_data(to_bf16(x) if bf16 else x.astype(np.float16))
        del x
        if name.endswith("ffn_down.weight") or i == 0:
            print(f"[write] {name} done, {time.time() - t0:.0f}s", flush=True)
    w.close()
    print(f"[write] {args.out}: {Path(args.out).stat().st_size} bytes, {len(items)} tensors, {time.time() - t0:.0f}s")


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def expect(args) -> None:
    out = {"what": "llama.cpp (toy-oracle: F32 KV cache, flash attn off, 2 threads) greedy ids on the random-weight "
                   "Llama-3.2-1B-shaped model of benches/make-llama-1b.sh, on this machine's AVX2 build "
                   "(llama-cpp-python 0.3.36 -> llama.cpp 0c1e57098). Margins = top1 - top2 logit per step.",
           "prompts": PROMPTS, "n_predict": N_PREDICT, "models": {}}
    if args.meta:
        out |= json.loads(Path(args.meta).read_text())
    for m in args.models:
        p = Path(m)
        with tempfile.TemporaryDirectory() as td:
            rq, op = Path(td) / "req.json", Path(td) / "out.json"
            rq.write_text(json.dumps({"greedy": {"prompts": PROMPTS, "n_predict": N_PREDICT}}))
            t0 = time.time()
            r = subprocess.run([args.oracle, "-m", str(p), "-r", str(rq), "-o", str(op), "-t", "2"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"toy-oracle failed on {p}:\n{r.stderr[-3000:]}")
            secs = time.time() - t0
            res = json.loads(op.read_text())
        types = {}
        for t in GGUFReader(p).tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        out["models"][p.name] = {
            "bytes": p.stat().st_size, "sha256": sha256(p), "tensor_type_counts": types,
            "model_desc": res.get("model_desc"), "oracle_seconds": round(secs, 1),
            "greedy": [{"prompt": g["prompt"], "prompt_ids": g["prompt_ids"], "gen_ids": g["gen_ids"],
                        "gen_text": g.get("gen_text"), "margins": [s["margin"] for s in g["steps"]]}
                       for g in res["greedy"]],
        }
        if res.get("llama_cpp"):
            out["llama_cpp"] = res["llama_cpp"]
        print(f"[expect] {p.name}: {secs:.1f}s, gen {[g['gen_ids'][:6] for g in res['greedy']]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("write")
    a.add_argument("out")
    a.add_argument("--tokenizer", required=True)
    a.add_argument("--dtype", choices=["BF16", "F16"], default="BF16")
    a.add_argument("--seed", type=int, default=1234)
    b = sub.add_parser("expect")
    b.add_argument("models", nargs="+")
    b.add_argument("--oracle", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--meta", help="JSON file merged into the output (timings, sizes)")
    args = ap.parse_args()
    write(args) if args.cmd == "write" else expect(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
