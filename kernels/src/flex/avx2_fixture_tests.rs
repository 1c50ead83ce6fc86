//! The float ops of the forward pass, in the AVX2 build's arithmetic, against what llama.cpp's
//! AVX2 build computes (`fixtures/quant/kernels/f32_ops.gguf`, made by
//! `fixtures/quant/make_kernel_fixtures.sh`), bit for bit.

use std::path::PathBuf;

use toy_core::gguf::{GgufFile, tensor_to_f32};

use super::*;

fn fixture() -> GgufFile {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/quant/kernels/f32_ops.gguf");
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn values(f: &GgufFile, name: &str) -> Vec<f32> {
    tensor_to_f32(f, f.tensor(name).unwrap_or_else(|| panic!("no {name}"))).unwrap()
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(
        bad,
        0,
        "{what}: {bad} of {} values differ (max {worst:e})",
        got.len()
    );
}

/// ggml_soft_max_ext's row loop (scale, mask add, max, `ggml_vec_soft_max_f32`, `1/sum`) with
/// the AVX2 build's vector part — as the attention runs it — and libm's `expf` for the tail the
/// fixture's unpadded rows have (llama.cpp pads the KV length to 256, so attention never has one).
fn softmax_row(a: &[f32], mask: &[f32], scale: f32) -> Vec<f32> {
    let w: Vec<f32> = a.iter().zip(mask).map(|(&x, &m)| x * scale + m).collect();
    let max = w.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut y = vec![0.0f32; w.len()];
    let mut sum = 0.0f64;
    let vector = w.len() / 8 * 8;
    for (yc, wc) in y[..vector].chunks_exact_mut(8).zip(w.chunks_exact(8)) {
        for (o, &x) in yc.iter_mut().zip(wc) {
            *o = Avx2Build::expf(x - max);
        }
        sum += Avx2Build::chunk_sum(yc) as f64;
    }
    for (o, &x) in y[vector..].iter_mut().zip(&w[vector..]) {
        *o = (x - max).exp();
        sum += *o as f64;
    }
    let inv = (1.0 / sum) as f32;
    y.iter_mut().for_each(|v| *v *= inv);
    y
}

#[test]
fn softmax_matches_the_avx2_build() {
    let f = fixture();
    for (name, n) in [("softmax.300x5", 300), ("softmax.37x3", 37)] {
        let (a, mask, out) = (
            values(&f, &format!("{name}.a")),
            values(&f, &format!("{name}.mask")),
            values(&f, &format!("{name}.out")),
        );
        let got: Vec<f32> = a
            .chunks(n)
            .zip(mask.chunks(n))
            .flat_map(|(a, m)| softmax_row(a, m, 0.125))
            .collect();
        assert_bits(name, &got, &out);
    }
}

#[test]
fn swiglu_and_rms_norm_match_the_avx2_build() {
    let f = fixture();
    for (name, n) in [("swiglu.1536x3", 1536), ("swiglu.45x2", 45)] {
        let (g, u, out) = (
            values(&f, &format!("{name}.gate")),
            values(&f, &format!("{name}.up")),
            values(&f, &format!("{name}.out")),
        );
        let mut got = vec![0.0f32; out.len()];
        for ((y, g), u) in got.chunks_mut(n).zip(g.chunks(n)).zip(u.chunks(n)) {
            swiglu_row(g, u, y, GgmlIsa::Avx2);
        }
        assert_bits(name, &got, &out);
    }
    let (x, out) = (
        values(&f, "rms_norm.576x3.x"),
        values(&f, "rms_norm.576x3.out"),
    );
    let ones = vec![1.0f32; 576];
    let mut got = vec![0.0f32; out.len()];
    for (y, x) in got.chunks_mut(576).zip(x.chunks(576)) {
        rms_norm_row(x, &ones, 1e-5, y);
    }
    assert_bits("rms_norm", &got, &out);
}

/// tinyBLAS<8, __m256> for one output: one 8-lane FMA accumulator over the row, then `hsum8`.
fn tinyblas_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (ac, bc) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ac[l].mul_add(bc[l], acc[l]);
        }
    }
    hsum8(acc)
}

#[test]
fn f32_matmul_matches_the_avx2_build() {
    let f = fixture();
    let (k, n) = (576, 40);
    let (w, x) = (values(&f, "mm_f32.w"), values(&f, "mm_f32.x"));
    for m in 1..=9 {
        let want = values(&f, &format!("mm_f32.y.m{m}"));
        let got: Vec<f32> = (0..m * n)
            .map(|o| {
                let (wr, xr) = (
                    &w[(o % n) * k..(o % n + 1) * k],
                    &x[(o / n) * k..(o / n + 1) * k],
                );
                if m == 1 {
                    Avx2Build::key_dot(wr, xr)
                } else {
                    tinyblas_f32(wr, xr)
                }
            })
            .collect();
        assert_bits(&format!("mm_f32 m={m}"), &got, &want);
    }
}

/// One head group of the fixture's attention: `kq` by `vec_dot_f32` for every key, and `kqv`
/// from the fixture's probabilities by `vec_dot_f32` (one query row) or tinyBLAS (several).
#[test]
fn attention_products_match_the_avx2_build() {
    let f = fixture();
    let (d, n_kv, heads) = (64, 300, 3);
    let k = values(&f, "attn.k"); // [n_kv][d]
    let v_t = values(&f, "attn.v_t"); // [d][n_kv]
    // V row-major by key, as toy's caches hold it.
    let v: Vec<f32> = (0..n_kv * d).map(|i| v_t[(i % d) * n_kv + i / d]).collect();
    for t in [1usize, 5] {
        let q = values(&f, &format!("attn.t{t}.q")); // [t][heads][d]
        let kq = values(&f, &format!("attn.t{t}.kq")); // [heads][t][n_kv]
        let p = values(&f, &format!("attn.t{t}.kq_soft"));
        let kqv = values(&f, &format!("attn.t{t}.kqv")); // [heads][t][d]
        let mut got_kq = vec![0.0f32; kq.len()];
        let mut got_kqv = vec![0.0f32; kqv.len()];
        for h in 0..heads {
            for i in 0..t {
                let qrow = &q[(i * heads + h) * d..(i * heads + h + 1) * d];
                for j in 0..n_kv {
                    got_kq[(h * t + i) * n_kv + j] =
                        Avx2Build::key_dot(&k[j * d..(j + 1) * d], qrow);
                }
                let prow = &p[(h * t + i) * n_kv..(h * t + i + 1) * n_kv];
                let o = &mut got_kqv[(h * t + i) * d..(h * t + i + 1) * d];
                // 300 keys: tinyBLAS refuses a length that is not a multiple of its 8 lanes, so
                // llama.cpp takes vec_dot_f32 for every output, one query row or several. (It
                // pads the KV length to 256, so a real run takes tinyBLAS for several rows:
                // `tinyblas_f32` below checks that form against `mm_f32`.)
                for (c, o) in o.iter_mut().enumerate() {
                    *o = Avx2Build::key_dot(&v_t[c * n_kv..(c + 1) * n_kv], prow);
                }
                if t > 1 {
                    let n = 256;
                    let mut got = vec![0.0f32; d];
                    Avx2Build::weighted_sum(&v, prow, 0, n, d, &mut got);
                    for (c, g) in got.iter().enumerate() {
                        let want = tinyblas_f32(&v_t[c * n_kv..c * n_kv + n], &prow[..n]);
                        assert_eq!(g.to_bits(), want.to_bits(), "tinyBLAS V·p, column {c}");
                    }
                } else {
                    // Attention's decode keeps the 32 lanes for all columns at once and
                    // reduces them afterwards: the same bits as vec_dot_f32 when there is no
                    // tail, as with llama.cpp's KV length padded to 256 (here 256 of the 300).
                    let n = 256;
                    let mut lanes = vec![0.0f32; 32 * d];
                    for (j, &pj) in prow[..n].iter().enumerate() {
                        for c in 0..d {
                            let a = &mut lanes[(j % 32) * d + c];
                            *a = v[j * d + c].mul_add(pj, *a);
                        }
                    }
                    let mut reduced = vec![0.0f32; d];
                    Avx2Build::decode_reduce(&lanes, d, &mut reduced);
                    for (c, r) in reduced.iter().enumerate() {
                        let want = Avx2Build::key_dot(&v_t[c * n_kv..c * n_kv + n], &prow[..n]);
                        assert_eq!(r.to_bits(), want.to_bits(), "decode lanes, column {c}");
                    }
                }
            }
        }
        assert_bits(&format!("kq t={t}"), &got_kq, &kq);
        assert_bits(&format!("kqv t={t}"), &got_kqv, &kqv);
        // The 16-key form of the scores gives the same bits.
        let tk16 = n_kv.div_ceil(16) * 16;
        let mut kt = vec![0.0f32; d * tk16];
        for j in 0..n_kv {
            for c in 0..d {
                kt[c * tk16 + j] = k[j * d + c];
            }
        }
        let qrow = &q[..d];
        for j0 in (0..n_kv).step_by(16) {
            let dots = Avx2Build::scores16(&kt, tk16, j0, qrow);
            for (l, &dot) in dots.iter().enumerate().take(n_kv - j0) {
                assert_eq!(
                    dot.to_bits(),
                    got_kq[j0 + l].to_bits(),
                    "scores16 key {}",
                    j0 + l
                );
            }
        }
    }
}
