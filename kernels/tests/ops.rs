//! Every ToyBackend op against an independent f64 host computation, on both CPU backends, and the
//! native Flex quantized matmuls against the reference bodies.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use toy_core::gguf::{GgmlType, dequantize_to_vec, quantize};
use toy_core::rng::SplitMix64;
use toy_kernels::packed::{HostPacked, RowLayout, pack};
use toy_kernels::{AttentionOptions, PackedTensor, RopeLayout, ToyBackend, reference};

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

fn float<B: ToyBackend, const D: usize>(
    v: Vec<f32>,
    shape: [usize; D],
    d: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v, shape), d)
}

fn host<B: ToyBackend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().unwrap()
}

/// The bits of a 2-D op output, to compare two computations exactly.
fn bits<B: ToyBackend>(t: FloatTensor<B>) -> Vec<u32> {
    host(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)))
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn packed<B: ToyBackend>(p: &HostPacked, d: &B::Device) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let per_row = p.words.len() / p.rows;
    (
        Tensor::from_data(
            TensorData::new(p.words.clone(), [p.rows, per_row]),
            (d, DType::U32),
        ),
        float(p.scales.clone().unwrap(), [p.rows, p.cols / 32], d),
    )
}

/// The device form of a packed weight (either layout).
fn packed_tensor<B: ToyBackend>(p: &HostPacked, d: &B::Device) -> PackedTensor<B> {
    let per_row = p.words.len() / p.rows;
    let side = |v: &Option<Vec<f32>>| {
        v.as_ref().map(|v| {
            float::<B, 2>(v.clone(), [p.rows, p.cols / 32], d)
                .into_primitive()
                .tensor()
        })
    };
    PackedTensor {
        ty: p.ty,
        cols: p.cols,
        words: Tensor::<B, 2, Int>::from_data(
            TensorData::new(p.words.clone(), [p.rows, per_row]),
            (d, DType::U32),
        )
        .into_primitive(),
        scales: side(&p.scales),
        mins: side(&p.mins),
        repackable: false,
        layout: RowLayout::Rows,
    }
}

/// Random Q4_1 blocks: f16 scale in [0.01, 0.1), f16 min in [-0.5, 0.5), random nibbles.
fn random_q4_1(n_blocks: usize, seed: u64) -> Vec<u8> {
    let r = randn(n_blocks * 18, seed);
    let mut out = Vec::with_capacity(n_blocks * 20);
    for b in 0..n_blocks {
        let v = &r[b * 18..(b + 1) * 18];
        out.extend(half::f16::from_f32(0.055 + 0.045 * v[0]).to_le_bytes());
        out.extend(half::f16::from_f32(0.5 * v[1]).to_le_bytes());
        out.extend(v[2..].iter().map(|x| ((x + 1.0) * 127.99) as u8));
    }
    out
}

/// Random blocks of `ty`: every bit pattern, except that the f16 fields (scales and mins) hold
/// finite values of a realistic size.
fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let size = ty.type_size();
    let mut out: Vec<u8> = (0..n_blocks * size).map(|_| rng.next_u64() as u8).collect();
    let fields: &[usize] = match ty {
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q5_1 => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    };
    for block in out.chunks_exact_mut(size) {
        for &f in fields {
            let v = (rng.next_u64() % 2000) as f32 / 2000.0 * 0.05 + 1e-4;
            let v = if rng.next_u64() % 2 == 0 { -v } else { v };
            block[f..f + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    out
}

/// A random `[n, k]` weight of type `ty` (quantized with ggml's reference quantizer where toy-core
/// has one, else random blocks), packed, and its exact dequantization.
fn weight(ty: GgmlType, n: usize, k: usize, seed: u64) -> (HostPacked, Vec<f32>) {
    let blocks = match ty {
        GgmlType::Q4_1 => random_q4_1(n * k / 32, seed),
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::F16 | GgmlType::BF16 => {
            quantize(ty, &randn(n * k, seed)).unwrap()
        }
        _ => random_blocks(ty, n * k / ty.block_size(), seed),
    };
    let dense = dequantize_to_vec(ty, &blocks).unwrap();
    (pack(ty, &blocks, n, k).unwrap(), dense)
}

/// The reference dequantization of the packed layout is bit-identical to toy-core's GGUF
/// dequantizer (itself bit-identical to gguf-py / ggml).
fn dequant_matches_gguf<B: ToyBackend>() {
    let d = Default::default();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        let (p, dense) = weight(ty, 5, 96, 1);
        let (words, scales) = packed::<B>(&p, &d);
        let deq = match ty {
            GgmlType::Q8_0 => reference::dequant_q8_0(words, scales),
            GgmlType::Q4_0 => reference::dequant_q4_0(words, scales),
            _ => reference::dequant_q4_1(words, scales, mins::<B>(&p, &d)),
        };
        let got = host(deq);
        assert!(
            got.iter()
                .zip(&dense)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty}: dequant differs"
        );
    }
}

fn mins<B: ToyBackend>(p: &HostPacked, d: &B::Device) -> Tensor<B, 2> {
    float(
        p.mins.clone().expect("asymmetric format"),
        [p.rows, p.cols / 32],
        d,
    )
}

/// `y = x · Wᵀ` in f64 from the dequantized weight.
fn matmul_f64(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k)
                .map(|l| x[i * k + l] as f64 * w[j * k + l] as f64)
                .sum();
        }
    }
    y
}

/// The matmul of `B` against f64, within a bound for activation quantization when
/// `quantizes_activations` (ggml's algorithm rounds x to 8-bit blocks: each block's error is at
/// most one quantization step amax/127 per element, times Σ|w| over the block), else 1e-5
/// relative to Σ|x||w|.
fn check_matmul<B: ToyBackend>(ty: GgmlType, quantizes_activations: bool) {
    let d = Default::default();
    for (m, k, n) in [
        (1, 32, 1),
        (1, 96, 37),
        (3, 160, 64),
        (8, 64, 9),
        (17, 256, 33),
    ] {
        let (p, w) = weight(ty, n, k, 42 + m as u64);
        let x = randn(m * k, 7 + n as u64);
        let xt = float::<B, 2>(x.clone(), [m, k], &d);
        let y = B::packed_matmul(xt.into_primitive().tensor(), packed_tensor::<B>(&p, &d));
        let got = host(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)));
        let want = matmul_f64(&x, &w, m, k, n);
        for i in 0..m {
            for j in 0..n {
                let abs_sum: f64 = (0..k)
                    .map(|l| (x[i * k + l] as f64 * w[j * k + l] as f64).abs())
                    .sum();
                let mut bound = 1e-5 * abs_sum + 1e-6;
                if quantizes_activations && ty == GgmlType::Q4_1 {
                    // Q8_1's block sum s = f16(d Σq) multiplies the weight's min: f16 rounding.
                    bound += (0..k / 32)
                        .map(|b| {
                            let s: f64 = (0..32).map(|l| x[i * k + b * 32 + l].abs() as f64).sum();
                            s * p.mins.as_ref().unwrap()[j * (k / 32) + b].abs() as f64 * 1e-3
                        })
                        .sum::<f64>();
                }
                if quantizes_activations {
                    bound += (0..k / 32)
                        .map(|b| {
                            let amax = x[i * k + b * 32..i * k + b * 32 + 32]
                                .iter()
                                .fold(0f32, |a, v| a.max(v.abs()))
                                as f64;
                            let wsum: f64 =
                                (0..32).map(|l| w[j * k + b * 32 + l].abs() as f64).sum();
                            amax / 127.0 * wsum
                        })
                        .sum::<f64>();
                }
                let err = (got[i * n + j] as f64 - want[i * n + j]).abs();
                assert!(
                    err <= bound,
                    "{ty} m={m} k={k} n={n} [{i},{j}]: got {} want {} err {err} > {bound}",
                    got[i * n + j],
                    want[i * n + j]
                );
            }
        }
    }
}

/// Rotation in f64 with the given (f32) cos/sin tables `[t][half]`.
#[allow(clippy::needless_range_loop)] // index math mirrors the formula
fn rope_f64(
    x: &[f32],
    shape: [usize; 4],
    cos: &[f32],
    sin: &[f32],
    layout: RopeLayout,
) -> Vec<f64> {
    let [b, h, t, d] = shape;
    let half = cos.len() / t;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for bh in 0..b * h {
        for ti in 0..t {
            let base = (bh * t + ti) * d;
            for i in 0..half {
                let (c, s) = (cos[ti * half + i] as f64, sin[ti * half + i] as f64);
                let (i0, i1) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Neox => (i, i + half),
                };
                let (x0, x1) = (x[base + i0] as f64, x[base + i1] as f64);
                out[base + i0] = x0 * c - x1 * s;
                out[base + i1] = x0 * s + x1 * c;
            }
        }
    }
    out
}

fn check_rope<B: ToyBackend>() {
    let d = Default::default();
    // head_dim 64 fully rotated, and 80 with 32 rotated dims (partial rotary: the rest passes
    // through); positions far apart; both pair layouts.
    for (shape, rot) in [([1, 3, 5, 64], 64), ([2, 2, 3, 80], 32)] {
        for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
            let (t, half) = (shape[2], rot / 2);
            let x = randn(shape.iter().product(), 3);
            let angle = |ti: usize, i: usize| {
                (ti * 37 + 11) as f64 * 10000f64.powf(-2.0 * i as f64 / rot as f64)
            };
            let cos: Vec<f32> = (0..t * half)
                .map(|k| angle(k / half, k % half).cos() as f32)
                .collect();
            let sin: Vec<f32> = (0..t * half)
                .map(|k| angle(k / half, k % half).sin() as f32)
                .collect();
            let y = B::rope(
                float::<B, 4>(x.clone(), shape, &d)
                    .into_primitive()
                    .tensor(),
                float::<B, 2>(cos.clone(), [t, half], &d)
                    .into_primitive()
                    .tensor(),
                float::<B, 2>(sin.clone(), [t, half], &d)
                    .into_primitive()
                    .tensor(),
                layout,
            );
            let got = host(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(y)));
            let want = rope_f64(&x, shape, &cos, &sin, layout);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() < 1e-6,
                    "{layout:?} {shape:?}: {g} vs {w}"
                );
            }
        }
    }
}

fn attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    qs: [usize; 4],
    tk: usize,
    hkv: usize,
    o: &AttentionOptions,
) -> Vec<f64> {
    let [b, h, tq, d] = qs;
    let mask = reference::causal_mask(tq, tk, o);
    let mut out = vec![0.0; b * h * tq * d];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hkv);
            for i in 0..tq {
                let qrow = &q[((bi * h + hi) * tq + i) * d..][..d];
                let scores: Vec<f64> = (0..tk)
                    .map(|j| {
                        let krow = &k[((bi * hkv + kh) * tk + j) * d..][..d];
                        let mut s = qrow
                            .iter()
                            .zip(krow)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * o.scale as f64;
                        if let Some(c) = o.softcap {
                            s = c as f64 * (s / c as f64).tanh();
                        }
                        if mask[i * tk + j] {
                            f64::NEG_INFINITY
                        } else {
                            s
                        }
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..tk {
                    let vrow = &v[((bi * hkv + kh) * tk + j) * d..][..d];
                    for c in 0..d {
                        out[((bi * h + hi) * tq + i) * d + c] += e[j] / z * vrow[c] as f64;
                    }
                }
            }
        }
    }
    out
}

fn check_attention<B: ToyBackend>() {
    let d = Default::default();
    // (batch, heads, kv heads, tq, tk, head dim, window, softcap): GQA 1 and 3, decode (tq = 1)
    // with a cache, chunked prefill (tq < tk), sliding window, soft-cap.
    let cases = [
        (1, 3, 3, 4, 4, 16, None, None),
        (2, 6, 2, 1, 9, 64, None, None),
        (1, 6, 2, 5, 12, 32, Some(4), None),
        (1, 8, 1, 3, 3, 16, None, Some(5.0)),
    ];
    for (b, h, hkv, tq, tk, dim, window, softcap) in cases {
        let o = AttentionOptions {
            scale: 1.0 / (dim as f32).sqrt(),
            q_offset: tk - tq,
            window,
            softcap,
        };
        let q = randn(b * h * tq * dim, 1);
        let k = randn(b * hkv * tk * dim, 2);
        let v = randn(b * hkv * tk * dim, 3);
        let y = <B as ToyBackend>::attention(
            float::<B, 4>(q.clone(), [b, h, tq, dim], &d)
                .into_primitive()
                .tensor(),
            float::<B, 4>(k.clone(), [b, hkv, tk, dim], &d)
                .into_primitive()
                .tensor(),
            float::<B, 4>(v.clone(), [b, hkv, tk, dim], &d)
                .into_primitive()
                .tensor(),
            o,
        );
        let got = host(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(y)));
        let want = attention_f64(&q, &k, &v, [b, h, tq, dim], tk, hkv, &o);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (*g as f64 - w).abs() < 1e-5,
                "attention case b{b} h{h}/{hkv} tq{tq} tk{tk}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn dequant_reference_is_bit_exact() {
    dequant_matches_gguf::<Flex>();
    dequant_matches_gguf::<NdArray>();
}

#[test]
fn q8_0_matmul_flex_native() {
    check_matmul::<Flex>(GgmlType::Q8_0, true);
}

#[test]
fn q4_0_matmul_flex_native() {
    check_matmul::<Flex>(GgmlType::Q4_0, true);
}

#[test]
fn q4_1_matmul_flex_native() {
    check_matmul::<Flex>(GgmlType::Q4_1, true);
}

/// The CPU backend's interleaved layouts (`packed::RowLayout`: Q4_K in X8 for AVX2; Q4_K,
/// Q4_0, Q8_0, Q5_0 and Q5_1 in X16 for AVX-512 VNNI) give the bits of the file's layout in every op that reads a
/// weight: the matmul for every row count (the eight- and sixteen-row kernels on the groups
/// as they lie; where a form has no such kernel, rows put back in order), inside a batched
/// pass that declares its sequences, the activations' gradient, embedding rows and the whole
/// dequantized weight — on Flex and on NdArray's reference bodies.
#[test]
fn interleaved_layouts_give_the_file_layouts_bits() {
    for (ty, layout) in [
        (GgmlType::Q4K, RowLayout::X8),
        (GgmlType::Q4K, RowLayout::X16),
        (GgmlType::Q4_0, RowLayout::X16),
        (GgmlType::Q8_0, RowLayout::X16),
        (GgmlType::Q5_0, RowLayout::X16),
        (GgmlType::Q5_1, RowLayout::X16),
    ] {
        check::<Flex>(ty, layout);
        check::<NdArray>(ty, layout);
    }
    fn check<B: ToyBackend>(ty: GgmlType, layout: RowLayout) {
        use toy_kernels::packed::{interleave_rows, interleave_scales};
        let d = Default::default();
        let (n, k) = (48, 17 * 256); // Q4_K: two chunks of super-blocks, 16 and 1
        let (p, _) = weight(ty, n, k, 91);
        let plain = PackedTensor::<B> {
            repackable: true,
            ..packed_tensor::<B>(&p, &d)
        };
        let words = interleave_rows(layout, ty, p.words.clone(), n, k);
        let scales = p.scales.as_ref().map(|s| {
            float::<B, 2>(interleave_scales(layout, s.clone(), n, k), [n, k / 32], &d)
                .into_primitive()
                .tensor()
        });
        let inter = PackedTensor::<B> {
            words: Tensor::<B, 2, Int>::from_data(
                TensorData::new(words, [n, p.words.len() / n]),
                (&d, DType::U32),
            )
            .into_primitive(),
            scales,
            layout,
            ..plain.clone()
        };
        for m in [1, 2, 3, 4, 5, 8, 17] {
            let x = || float::<B, 2>(randn(m * k, 92 + m as u64), [m, k], &d);
            let want = bits::<B>(B::packed_matmul(
                x().into_primitive().tensor(),
                plain.clone(),
            ));
            let got = bits::<B>(B::packed_matmul(
                x().into_primitive().tensor(),
                inter.clone(),
            ));
            assert_eq!(got, want, "{ty} {layout:?}: matmul m={m}");
            if m == 17 {
                let lens = [1, 4, 12];
                let batched = |w: &PackedTensor<B>| {
                    B::with_row_groups(&lens, || {
                        bits::<B>(B::packed_matmul(x().into_primitive().tensor(), w.clone()))
                    })
                };
                assert_eq!(batched(&inter), batched(&plain), "row groups");
            }
            let dy = || float::<B, 2>(randn(m * n, 93 + m as u64), [m, n], &d);
            let want = bits::<B>(B::packed_matmul_backward(
                dy().into_primitive().tensor(),
                plain.clone(),
            ));
            let got = bits::<B>(B::packed_matmul_backward(
                dy().into_primitive().tensor(),
                inter.clone(),
            ));
            assert_eq!(got, want, "backward m={m}");
        }
        let ids = || {
            Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 7, 8, 39, 21], [5]), &d)
                .into_primitive()
        };
        assert_eq!(
            bits::<B>(B::packed_rows(inter.clone(), ids())),
            bits::<B>(B::packed_rows(plain.clone(), ids()))
        );
        assert_eq!(
            bits::<B>(B::packed_dequantize(inter)),
            bits::<B>(B::packed_dequantize(plain))
        );
    }
}

/// `packed_matmuls` (a block's Q, K and V, or gate and up, in one call) gives each weight's own
/// `packed_matmul`, bit for bit: for a decoded row, a prompt, and a batched pass's rows, whose
/// declared row groups must reach the thread that computes each weight (on Flex the products
/// run as tasks on rayon's workers; without the groups, the 17 rows would take the kernels of a
/// 17-row prompt — checked below to give other bits, so this test can tell).
#[test]
fn packed_matmuls_equal_one_matmul_each() {
    check::<Flex>();
    check::<NdArray>();
    fn check<B: ToyBackend>() {
        let d = Default::default();
        let k = 2 * 256;
        let types = [
            (GgmlType::Q4K, 48),
            (GgmlType::Q8_0, 16),
            (GgmlType::Q6K, 32),
            (GgmlType::Q4_0, 64),
        ];
        let weights: Vec<PackedTensor<B>> = types
            .iter()
            .enumerate()
            .map(|(i, &(ty, n))| PackedTensor::<B> {
                repackable: true,
                ..packed_tensor::<B>(&weight(ty, n, k, 300 + i as u64).0, &d)
            })
            .collect();
        for m in [1, 5, 17] {
            let x = || {
                float::<B, 2>(randn(m * k, 310 + m as u64), [m, k], &d)
                    .into_primitive()
                    .tensor()
            };
            let each = || -> Vec<Vec<u32>> {
                weights
                    .iter()
                    .map(|w| bits::<B>(B::packed_matmul(x(), w.clone())))
                    .collect()
            };
            let together = || -> Vec<Vec<u32>> {
                B::packed_matmuls(x(), weights.clone())
                    .into_iter()
                    .map(bits::<B>)
                    .collect()
            };
            assert_eq!(together(), each(), "m={m}");
            if m == 17 {
                let lens = [1, 4, 12];
                let grouped_each = B::with_row_groups(&lens, each);
                assert_eq!(
                    B::with_row_groups(&lens, together),
                    grouped_each,
                    "row groups"
                );
                if B::row_layout() != RowLayout::Rows {
                    assert_ne!(grouped_each, each(), "the row groups change no bits");
                }
            }
        }
    }
}

#[test]
fn quant_matmul_reference_ndarray() {
    check_matmul::<NdArray>(GgmlType::Q8_0, false);
    check_matmul::<NdArray>(GgmlType::Q4_0, false);
    check_matmul::<NdArray>(GgmlType::Q4_1, false);
}

#[test]
fn rope_matches_f64() {
    check_rope::<Flex>();
    check_rope::<NdArray>();
}

#[test]
fn attention_matches_f64() {
    check_attention::<Flex>();
    check_attention::<NdArray>();
}

/// A batched pass's attention: several sequences in one `attention_batch` call, each reading the
/// first tokens of a preallocated KV buffer (a view whose heads are not adjacent), give each
/// sequence the bits that `attention` gives it alone on contiguous copies; and `write_tokens`
/// writes what `slice_assign` writes.
fn check_attention_batch<B: ToyBackend>() {
    let d = Default::default();
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let tensor = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    // (heads, kv heads, new tokens, held tokens, head dim): decode steps and a prompt piece.
    let parts = [
        (6, 2, 1, 9, 64),
        (6, 2, 1, 30, 64),
        (6, 2, 5, 12, 64),
        (6, 2, 1, 1, 64),
    ];
    let capacity = 64;
    let mut batch = Vec::new();
    let mut alone = Vec::new();
    for (n, &(h, hkv, tq, tk, dim)) in parts.iter().enumerate() {
        let seed = 10 * n as u64;
        let options = AttentionOptions {
            scale: 1.0 / (dim as f32).sqrt(),
            q_offset: tk - tq,
            window: None,
            softcap: None,
        };
        let q = float::<B, 4>(randn(h * tq * dim, seed), [1, h, tq, dim], &d);
        let (k, v) = (
            float::<B, 4>(randn(hkv * tk * dim, seed + 1), [1, hkv, tk, dim], &d),
            float::<B, 4>(randn(hkv * tk * dim, seed + 2), [1, hkv, tk, dim], &d),
        );
        // The keys written into a zeroed buffer of `capacity` tokens, as a KV cache holds them.
        let buffer = |x: &Tensor<B, 4>| {
            let zeros = Tensor::<B, 4>::zeros([1, hkv, capacity, dim], &d);
            let written = tensor(B::write_tokens(prim(zeros.clone()), prim(x.clone()), 0));
            let assigned = zeros.slice_assign([0..1, 0..hkv, 0..tk, 0..dim], x.clone());
            assert_eq!(host(written.clone()), host(assigned), "write_tokens");
            written.narrow(2, 0, tk)
        };
        batch.push(toy_kernels::AttentionPart {
            q: prim(q.clone()),
            k: prim(buffer(&k)),
            v: prim(buffer(&v)),
            options,
        });
        alone.push(host(tensor(<B as ToyBackend>::attention(
            prim(q),
            prim(k),
            prim(v),
            options,
        ))));
    }
    let outs = B::attention_batch(batch);
    assert_eq!(outs.len(), parts.len());
    for (n, (out, want)) in outs.into_iter().zip(alone).enumerate() {
        assert_eq!(
            host(tensor(out)),
            want,
            "sequence {n}: batched attention differs"
        );
    }
}

#[test]
fn attention_batch_over_cache_views_equals_attention_alone() {
    check_attention_batch::<Flex>();
    check_attention_batch::<NdArray>();
}

/// The custom backward passes of `Autodiff<B>` (forward by `B`'s own op) against burn's autodiff
/// of the reference bodies on NdArray, for `L = Σ y ⊙ r`: the gradients w.r.t. x (quantized
/// matmul), x and the weight (dense linear layer; RMSNorm), x (splitting and merging heads), the gate and up (SwiGLU), x (RoPE), q, k, v (attention
/// with GQA 3, a window, a soft-cap and a cache offset) and the logits (cross-entropy).
fn check_grads<B: ToyBackend>() {
    type Ref = Autodiff<NdArray>;
    let (d, dr) = (Default::default(), Default::default());
    let grad_of =
        |t: &Tensor<Autodiff<B>, 4>,
         g: &<Autodiff<B> as burn::tensor::backend::AutodiffBackend>::Gradients| {
            host(t.grad(g).expect("tracked input has a gradient"))
        };
    let close = |what: &str, got: &[f32], want: &[f32], tol: f32| {
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            worst <= tol,
            "{what}: gradient differs by {worst} (> {tol})"
        );
    };

    // Quantized matmul, dX only.
    let (m, k, n) = (3, 96, 40);
    let (p, _) = weight(GgmlType::Q8_0, n, k, 3);
    let x = randn(m * k, 4);
    let r = randn(m * n, 5);
    let xt = float::<Autodiff<B>, 2>(x.clone(), [m, k], &d).require_grad();
    let y = Tensor::<Autodiff<B>, 2>::from_primitive(TensorPrimitive::Float(
        Autodiff::<B>::packed_matmul(
            xt.clone().into_primitive().tensor(),
            packed_tensor::<Autodiff<B>>(&p, &d),
        ),
    ));
    let g = (y * float::<Autodiff<B>, 2>(r.clone(), [m, n], &d))
        .sum()
        .backward();
    let got = host(xt.grad(&g).unwrap());
    let xr = float::<Ref, 2>(x, [m, k], &dr).require_grad();
    let y =
        Tensor::<Ref, 2>::from_primitive(TensorPrimitive::Float(reference::packed_matmul::<Ref>(
            xr.clone().into_primitive().tensor(),
            packed_tensor::<Ref>(&p, &dr),
        )));
    let g = (y * float::<Ref, 2>(r, [m, n], &dr)).sum().backward();
    close("q8_0_matmul dX", &got, &host(xr.grad(&g).unwrap()), 1e-5);

    // RoPE (neox, partial rotation), dX.
    let shape = [1, 2, 5, 24];
    let (t, half) = (5, 8);
    let cos: Vec<f32> = (0..t * half).map(|i| (i as f32 * 0.37).cos()).collect();
    let sin: Vec<f32> = (0..t * half).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = randn(shape.iter().product(), 6);
    let r = randn(shape.iter().product(), 7);
    let xt = float::<Autodiff<B>, 4>(x.clone(), shape, &d).require_grad();
    let y = Tensor::<Autodiff<B>, 4>::from_primitive(TensorPrimitive::Float(Autodiff::<B>::rope(
        xt.clone().into_primitive().tensor(),
        float::<Autodiff<B>, 2>(cos.clone(), [t, half], &d)
            .into_primitive()
            .tensor(),
        float::<Autodiff<B>, 2>(sin.clone(), [t, half], &d)
            .into_primitive()
            .tensor(),
        RopeLayout::Neox,
    )));
    let g = (y * float::<Autodiff<B>, 4>(r.clone(), shape, &d))
        .sum()
        .backward();
    let got = grad_of(&xt, &g);
    let xr = float::<Ref, 4>(x, shape, &dr).require_grad();
    let y = Tensor::<Ref, 4>::from_primitive(TensorPrimitive::Float(reference::rope::<Ref>(
        xr.clone().into_primitive().tensor(),
        float::<Ref, 2>(cos, [t, half], &dr)
            .into_primitive()
            .tensor(),
        float::<Ref, 2>(sin, [t, half], &dr)
            .into_primitive()
            .tensor(),
        RopeLayout::Neox,
    )));
    let g = (y * float::<Ref, 4>(r, shape, &dr)).sum().backward();
    close("rope dX", &got, &host(xr.grad(&g).unwrap()), 1e-6);

    // Attention: GQA 3, 4 new rows over a cache of 9, window 6, soft-cap (one backward chunk);
    // 150 rows (chunks of 64, 64, 22) with GQA 2 and a window of 40 that starts later chunks'
    // keys past 0; 150 rows over a cache of 20 with a soft-cap and no window.
    for (h, hkv, tq, tk, dim, window, softcap) in [
        (6, 2, 4, 9, 16, Some(6), Some(2.0)),
        (4, 2, 150, 150, 8, Some(40), None),
        (2, 1, 150, 170, 8, None, Some(3.0)),
    ] {
        let b = 1;
        let o = AttentionOptions {
            scale: 0.25,
            q_offset: tk - tq,
            window,
            softcap,
        };
        let (qs, ks) = ([b, h, tq, dim], [b, hkv, tk, dim]);
        let (q, k, v) = (
            randn(b * h * tq * dim, 8),
            randn(b * hkv * tk * dim, 9),
            randn(b * hkv * tk * dim, 10),
        );
        let r = randn(b * h * tq * dim, 11);
        let (qt, kt, vt) = (
            float::<Autodiff<B>, 4>(q.clone(), qs, &d).require_grad(),
            float::<Autodiff<B>, 4>(k.clone(), ks, &d).require_grad(),
            float::<Autodiff<B>, 4>(v.clone(), ks, &d).require_grad(),
        );
        let y = Tensor::<Autodiff<B>, 4>::from_primitive(TensorPrimitive::Float(
            <Autodiff<B> as ToyBackend>::attention(
                qt.clone().into_primitive().tensor(),
                kt.clone().into_primitive().tensor(),
                vt.clone().into_primitive().tensor(),
                o,
            ),
        ));
        let g = (y * float::<Autodiff<B>, 4>(r.clone(), qs, &d))
            .sum()
            .backward();
        let got: Vec<Vec<f32>> = [&qt, &kt, &vt].iter().map(|t| grad_of(t, &g)).collect();
        let (qr, kr, vr) = (
            float::<Ref, 4>(q, qs, &dr).require_grad(),
            float::<Ref, 4>(k, ks, &dr).require_grad(),
            float::<Ref, 4>(v, ks, &dr).require_grad(),
        );
        let y =
            Tensor::<Ref, 4>::from_primitive(TensorPrimitive::Float(reference::attention::<Ref>(
                qr.clone().into_primitive().tensor(),
                kr.clone().into_primitive().tensor(),
                vr.clone().into_primitive().tensor(),
                o,
            )));
        let g = (y * float::<Ref, 4>(r, qs, &dr)).sum().backward();
        for (name, (got, want)) in ["dQ", "dK", "dV"].iter().zip(
            got.iter()
                .zip([&qr, &kr, &vr].map(|t| host(t.grad(&g).unwrap()))),
        ) {
            close(&format!("attention {name} (T = {tq})"), got, &want, 1e-5);
        }
    }

    // Dense linear layer, dX and dW, and with a frozen weight dX only (the same dX): a product
    // over burn-flex's threading threshold and a small one.
    for (m, k, n) in [(200, 192, 200), (3, 20, 7)] {
        let (x, w, r) = (randn(m * k, 21), randn(n * k, 22), randn(m * n, 23));
        let xt = float::<Autodiff<B>, 2>(x.clone(), [m, k], &d).require_grad();
        let layer = |w: &Tensor<Autodiff<B>, 2>| {
            let y = Tensor::<Autodiff<B>, 2>::from_primitive(TensorPrimitive::Float(
                <Autodiff<B> as ToyBackend>::dense_linear(
                    xt.clone().into_primitive().tensor(),
                    w.clone().into_primitive().tensor(),
                ),
            ));
            (y * float::<Autodiff<B>, 2>(r.clone(), [m, n], &d))
                .sum()
                .backward()
        };
        let wt = float::<Autodiff<B>, 2>(w.clone(), [n, k], &d).require_grad();
        let g = layer(&wt);
        let (got_dx, got_dw) = (host(xt.grad(&g).unwrap()), host(wt.grad(&g).unwrap()));
        let frozen = float::<Autodiff<B>, 2>(w.clone(), [n, k], &d);
        let g = layer(&frozen);
        assert_eq!(
            host(xt.grad(&g).unwrap()),
            got_dx,
            "dX with a frozen weight"
        );
        assert!(frozen.grad(&g).is_none());
        let xr = float::<Ref, 2>(x, [m, k], &dr).require_grad();
        let wr = float::<Ref, 2>(w, [n, k], &dr).require_grad();
        let y = xr.clone().matmul(wr.clone().transpose());
        let g = (y * float::<Ref, 2>(r, [m, n], &dr)).sum().backward();
        close(
            "dense_linear dX",
            &got_dx,
            &host(xr.grad(&g).unwrap()),
            1e-4,
        );
        close(
            "dense_linear dW",
            &got_dw,
            &host(wr.grad(&g).unwrap()),
            1e-4,
        );
    }

    // Splitting into heads and merging them back (each the other's backward), against burn's
    // reshape and swap: y = merge(split(x) · r1) · r2, so both backwards run.
    let (bt, t, heads, hd) = (2, 5, 3, 4);
    let x = randn(bt * t * heads * hd, 24);
    let (r1, r2) = (randn(x.len(), 25), randn(x.len(), 26));
    let xt = float::<Autodiff<B>, 3>(x.clone(), [bt, t, heads * hd], &d).require_grad();
    let split = Tensor::<Autodiff<B>, 4>::from_primitive(TensorPrimitive::Float(
        <Autodiff<B> as ToyBackend>::split_heads(xt.clone().into_primitive().tensor(), heads),
    ));
    assert_eq!(split.dims(), [bt, heads, t, hd]);
    let scaled = split * float::<Autodiff<B>, 4>(r1.clone(), [bt, heads, t, hd], &d);
    let merged = Tensor::<Autodiff<B>, 3>::from_primitive(TensorPrimitive::Float(
        <Autodiff<B> as ToyBackend>::merge_heads(scaled.into_primitive().tensor()),
    ));
    let got_y = host(merged.clone());
    let g = (merged * float::<Autodiff<B>, 3>(r2.clone(), [bt, t, heads * hd], &d))
        .sum()
        .backward();
    let got = host(xt.grad(&g).unwrap());
    let xr = float::<Ref, 3>(x, [bt, t, heads * hd], &dr).require_grad();
    let split = xr.clone().reshape([bt, t, heads, hd]).swap_dims(1, 2);
    let merged = (split * float::<Ref, 4>(r1, [bt, heads, t, hd], &dr))
        .swap_dims(1, 2)
        .reshape([bt, t, heads * hd]);
    assert_eq!(
        got_y,
        host(merged.clone()),
        "merge_heads(split_heads(x) · r)"
    );
    let g = (merged * float::<Ref, 3>(r2, [bt, t, heads * hd], &dr))
        .sum()
        .backward();
    close(
        "split/merge heads dX",
        &got,
        &host(xr.grad(&g).unwrap()),
        0.0,
    );

    // RMSNorm, dX and dWeight: 70 rows (several of Flex's 32-row tasks) of 37.
    let (rows, dm) = (70, 37);
    let x = randn(rows * dm, 15);
    let w: Vec<f32> = randn(dm, 16).iter().map(|v| 1.0 + 0.5 * v).collect();
    let r = randn(rows * dm, 17);
    let eps = 1e-5;
    let xt = float::<Autodiff<B>, 2>(x.clone(), [rows, dm], &d).require_grad();
    let wt = float::<Autodiff<B>, 1>(w.clone(), [dm], &d).require_grad();
    let y = Tensor::<Autodiff<B>, 2>::from_primitive(TensorPrimitive::Float(
        <Autodiff<B> as ToyBackend>::rms_norm(
            xt.clone().into_primitive().tensor(),
            wt.clone().into_primitive().tensor(),
            eps,
        ),
    ));
    let g = (y * float::<Autodiff<B>, 2>(r.clone(), [rows, dm], &d))
        .sum()
        .backward();
    let (got_dx, got_dw) = (host(xt.grad(&g).unwrap()), host(wt.grad(&g).unwrap()));
    let xr = float::<Ref, 2>(x, [rows, dm], &dr).require_grad();
    let wr = float::<Ref, 1>(w, [dm], &dr).require_grad();
    let y = Tensor::<Ref, 2>::from_primitive(TensorPrimitive::Float(reference::rms_norm::<Ref>(
        xr.clone().into_primitive().tensor(),
        wr.clone().into_primitive().tensor(),
        eps,
    )));
    let g = (y * float::<Ref, 2>(r, [rows, dm], &dr)).sum().backward();
    close("rms_norm dX", &got_dx, &host(xr.grad(&g).unwrap()), 1e-5);
    close(
        "rms_norm dWeight",
        &got_dw,
        &host(wr.grad(&g).unwrap()),
        1e-4,
    );

    // SwiGLU, dGate and dUp: 3 rows of 7000 (several of Flex's tasks), gates up to ±200 (where
    // the sigmoid saturates).
    let shape = [3, 7000];
    let n = 21000;
    let mut gate: Vec<f32> = randn(n, 18).iter().map(|v| 4.0 * v).collect();
    gate[5] = 200.0;
    gate[6] = -200.0;
    let up = randn(n, 19);
    let r = randn(n, 20);
    let gt = float::<Autodiff<B>, 2>(gate.clone(), shape, &d).require_grad();
    let ut = float::<Autodiff<B>, 2>(up.clone(), shape, &d).require_grad();
    let y = Tensor::<Autodiff<B>, 2>::from_primitive(TensorPrimitive::Float(
        <Autodiff<B> as ToyBackend>::swiglu(
            gt.clone().into_primitive().tensor(),
            ut.clone().into_primitive().tensor(),
        ),
    ));
    let g = (y * float::<Autodiff<B>, 2>(r.clone(), shape, &d))
        .sum()
        .backward();
    let (got_dg, got_du) = (host(gt.grad(&g).unwrap()), host(ut.grad(&g).unwrap()));
    let gr = float::<Ref, 2>(gate, shape, &dr).require_grad();
    let ur = float::<Ref, 2>(up, shape, &dr).require_grad();
    let y = Tensor::<Ref, 2>::from_primitive(TensorPrimitive::Float(reference::swiglu::<Ref>(
        gr.clone().into_primitive().tensor(),
        ur.clone().into_primitive().tensor(),
    )));
    let g = (y * float::<Ref, 2>(r, shape, &dr)).sum().backward();
    close("swiglu dGate", &got_dg, &host(gr.grad(&g).unwrap()), 1e-5);
    close("swiglu dUp", &got_du, &host(ur.grad(&g).unwrap()), 1e-5);

    // Cross-entropy against burn's autodiff of `-mean(gather(log_softmax(x), target))`, with an
    // upstream gradient of 3 (the loss is scaled): same loss bits, gradients to rounding.
    let (n, vocab) = (7, 37);
    let x: Vec<f32> = randn(n * vocab, 12).iter().map(|v| 4.0 * v).collect();
    let targets: Vec<i64> = (0..n).map(|i| ((i * 11 + 3) % vocab) as i64).collect();
    let ids =
        |dev| Tensor::<Autodiff<B>, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), dev);
    let xt = float::<Autodiff<B>, 2>(x.clone(), [n, vocab], &d).require_grad();
    let loss = Tensor::<Autodiff<B>, 1>::from_primitive(TensorPrimitive::Float(
        <Autodiff<B> as ToyBackend>::cross_entropy(
            xt.clone().into_primitive().tensor(),
            ids(&d).into_primitive(),
        ),
    ));
    let got_loss = host(loss.clone());
    let got = host(xt.grad(&loss.mul_scalar(3.0).backward()).unwrap());
    let tb = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &d);
    let want_loss =
        burn::tensor::activation::log_softmax(float::<B, 2>(x.clone(), [n, vocab], &d), 1)
            .gather(1, tb.reshape([n, 1]))
            .mean()
            .neg();
    assert_eq!(
        got_loss[0].to_bits(),
        host(want_loss)[0].to_bits(),
        "cross-entropy loss bits"
    );
    let xr = float::<Ref, 2>(x, [n, vocab], &dr).require_grad();
    let tr = Tensor::<Ref, 1, Int>::from_data(TensorData::new(targets, [n]), &dr);
    let loss = burn::tensor::activation::log_softmax(xr.clone(), 1)
        .gather(1, tr.reshape([n, 1]))
        .mean()
        .neg();
    let want = host(xr.grad(&loss.mul_scalar(3.0).backward()).unwrap());
    close("cross_entropy dlogits", &got, &want, 1e-6);

    // The output head's loss against burn's autodiff of the matmul and `log_softmax`, with an
    // upstream gradient of 3: a vocabulary of several of Flex's slices, n = 9 tokens.
    let (n, dm, vocab) = (9, 24, 700);
    let h: Vec<f32> = randn(n * dm, 13);
    let w: Vec<f32> = randn(vocab * dm, 14);
    let targets: Vec<i64> = (0..n).map(|i| ((i * 263 + 5) % vocab) as i64).collect();
    let ht = float::<Autodiff<B>, 2>(h.clone(), [n, dm], &d).require_grad();
    let wt = float::<Autodiff<B>, 2>(w.clone(), [vocab, dm], &d).require_grad();
    let head_loss = |w: &Tensor<Autodiff<B>, 2>| {
        let ids =
            Tensor::<Autodiff<B>, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &d);
        Tensor::<Autodiff<B>, 1>::from_primitive(TensorPrimitive::Float(
            <Autodiff<B> as ToyBackend>::linear_cross_entropy(
                ht.clone().into_primitive().tensor(),
                w.clone().into_primitive().tensor(),
                ids.into_primitive(),
            ),
        ))
    };
    let loss = head_loss(&wt);
    let got_loss = host(loss.clone());
    let g = loss.mul_scalar(3.0).backward();
    let (got_dh, got_dw) = (host(ht.grad(&g).unwrap()), host(wt.grad(&g).unwrap()));
    // A frozen head (LoRA): the same dh, and no gradient for w.
    let frozen = float::<Autodiff<B>, 2>(w.clone(), [vocab, dm], &d);
    let g = head_loss(&frozen).mul_scalar(3.0).backward();
    assert_eq!(host(ht.grad(&g).unwrap()), got_dh, "dh with a frozen head");
    assert!(frozen.grad(&g).is_none());
    let hr = float::<Ref, 2>(h, [n, dm], &dr).require_grad();
    let wr = float::<Ref, 2>(w, [vocab, dm], &dr).require_grad();
    let tr = Tensor::<Ref, 1, Int>::from_data(TensorData::new(targets, [n]), &dr);
    let logits = hr.clone().matmul(wr.clone().transpose());
    let loss = burn::tensor::activation::log_softmax(logits, 1)
        .gather(1, tr.reshape([n, 1]))
        .mean()
        .neg();
    let want_loss = host(loss.clone());
    close("linear_cross_entropy loss", &got_loss, &want_loss, 1e-5);
    let g = loss.mul_scalar(3.0).backward();
    close(
        "linear_cross_entropy dh",
        &got_dh,
        &host(hr.grad(&g).unwrap()),
        1e-5,
    );
    close(
        "linear_cross_entropy dw",
        &got_dw,
        &host(wr.grad(&g).unwrap()),
        1e-5,
    );
}

#[test]
fn custom_backward_matches_reference_autodiff() {
    check_grads::<Flex>();
    check_grads::<NdArray>();
}

// ---------------------------------------------------------------------------------------------
// cubecl kernels on wgpu (lavapipe in CI)
// ---------------------------------------------------------------------------------------------

mod wgpu {
    use super::*;
    use burn_cubecl::CubeBackend;
    use cubecl::wgpu::WgpuRuntime;
    use toy_core::rope::RopeAngles;

    type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

    /// The quantized matmul kernels compute llama.cpp's algorithm (8-bit activation blocks,
    /// integer block dots), as the Flex native kernels do; only the order in which block results
    /// are summed differs, so the two agree to a few f32 roundings of the result's magnitude.
    /// Shapes: K of 1 to 25 blocks (not multiples of the 64 units striding over them), M on both
    /// sides of the matrix-vector/tiled switch (8) and not multiples of the 16-row tile, N not
    /// multiples of the tile.
    fn matches_flex(ty: GgmlType) {
        let (dw, df) = (Default::default(), Default::default());
        for (m, k, n) in [
            (1, 32, 1),
            (1, 800, 100),
            (3, 96, 37),
            (8, 160, 64),
            (9, 64, 17),
            (40, 800, 70),
        ] {
            let (p, w) = weight(ty, n, k, 5 + m as u64);
            let x = randn(m * k, 11 + n as u64);
            let run = |xs: Vec<f32>| -> (Vec<f32>, Vec<f32>) {
                let on = |b: u8| -> Vec<f32> {
                    if b == 0 {
                        let xt = float::<Wgpu, 2>(xs.clone(), [m, k], &dw)
                            .into_primitive()
                            .tensor();
                        let y = Wgpu::packed_matmul(xt, packed_tensor::<Wgpu>(&p, &dw));
                        host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(y)))
                    } else {
                        let xt = float::<Flex, 2>(xs.clone(), [m, k], &df)
                            .into_primitive()
                            .tensor();
                        let y = Flex::packed_matmul(xt, packed_tensor::<Flex>(&p, &df));
                        host(Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(y)))
                    }
                };
                (on(0), on(1))
            };
            let (gpu, cpu) = run(x.clone());
            for i in 0..m {
                for j in 0..n {
                    // Scale of the sum: Σ|x||w| over the row; 1e-6 of it is ~8 f32 roundings.
                    let scale: f64 = (0..k)
                        .map(|l| (x[i * k + l] * w[j * k + l]).abs() as f64)
                        .sum();
                    let (g, c) = (gpu[i * n + j] as f64, cpu[i * n + j] as f64);
                    assert!(
                        (g - c).abs() <= 1e-6 * scale + 1e-7,
                        "{ty} m={m} k={k} n={n} [{i},{j}]: wgpu {g} flex {c}"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_matmul_kernel() {
        check_matmul::<Wgpu>(GgmlType::Q8_0, true);
        matches_flex(GgmlType::Q8_0);
    }

    #[test]
    fn q4_0_matmul_kernel() {
        check_matmul::<Wgpu>(GgmlType::Q4_0, true);
        matches_flex(GgmlType::Q4_0);
    }

    #[test]
    fn q4_1_matmul_kernel() {
        check_matmul::<Wgpu>(GgmlType::Q4_1, true);
        matches_flex(GgmlType::Q4_1);
    }

    /// Every packed type's `blocks` kernels — the matrix-vector kernel (M ≤ 8), the tiled kernel
    /// forward and backward (dX = dY · W), the rows kernel — against the exact dequantized weight
    /// (ggml's `dequantize_row_*`), in f64. Shapes: M on both sides of the kernel switch and of
    /// the 16-row tile, K of 1, 3 and 9 super-blocks, N not a multiple of the tile.
    /// Q8_0/Q4_0/Q4_1's forward is the `qmatmul` kernels' (tested above); their backward and rows
    /// are these kernels'.
    fn blocks_kernels(ty: GgmlType) {
        let d = Default::default();
        let product_bound = |a: &[f32], wv: &[f32]| -> f64 {
            a.iter()
                .zip(wv)
                .map(|(x, w)| (*x as f64 * *w as f64).abs())
                .sum::<f64>()
                * 1e-5
                + 1e-6
        };
        for k in [256, 768, 2304] {
            let n = 37;
            let (p, w) = weight(ty, n, k, k as u64);
            // Rows and the whole weight, widened: the dequantizer's values.
            let ids = [n - 1, 0, 5, 5, 17];
            let ids_t = Tensor::<Wgpu, 1, Int>::from_data(
                TensorData::new(
                    ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
                    [ids.len()],
                ),
                &d,
            );
            let rows = Wgpu::packed_rows(packed_tensor::<Wgpu>(&p, &d), ids_t.into_primitive());
            let rows = host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(
                rows,
            )));
            for (r, &i) in ids.iter().enumerate() {
                for c in 0..k {
                    let (g, e) = (rows[r * k + c], w[i * k + c]);
                    assert!(
                        g == e,
                        "{ty} k={k} row {i} [{c}]: rows kernel {g}, dequantizer {e}"
                    );
                }
            }
            let all = Wgpu::packed_dequantize(packed_tensor::<Wgpu>(&p, &d));
            let all = host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(
                all,
            )));
            assert!(
                all == w,
                "{ty} k={k}: packed_dequantize differs from the dequantizer"
            );

            for m in [1, 3, 8, 9, 17, 40] {
                let x = randn(m * k, 3 + m as u64);
                if !toy_kernels::packed::is_split(ty) {
                    let xt = float::<Wgpu, 2>(x.clone(), [m, k], &d)
                        .into_primitive()
                        .tensor();
                    let y = Wgpu::packed_matmul(xt, packed_tensor::<Wgpu>(&p, &d));
                    let got = host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(y)));
                    let want = matmul_f64(&x, &w, m, k, n);
                    for i in 0..m {
                        for j in 0..n {
                            let bound =
                                product_bound(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                            let err = (got[i * n + j] as f64 - want[i * n + j]).abs();
                            assert!(
                                err <= bound,
                                "{ty} m={m} k={k} [{i},{j}]: err {err} > {bound}"
                            );
                        }
                    }
                }
                // dX = dY · W.
                let dy = randn(m * n, 9 + m as u64);
                let dyt = float::<Wgpu, 2>(dy.clone(), [m, n], &d)
                    .into_primitive()
                    .tensor();
                let dx = Wgpu::packed_matmul_backward(dyt, packed_tensor::<Wgpu>(&p, &d));
                let got = host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(
                    dx,
                )));
                for i in 0..m {
                    for c in 0..k {
                        let col: Vec<f32> = (0..n).map(|j| w[j * k + c]).collect();
                        let want: f64 = (0..n).map(|j| dy[i * n + j] as f64 * col[j] as f64).sum();
                        let bound = product_bound(&dy[i * n..(i + 1) * n], &col);
                        let err = (got[i * k + c] as f64 - want).abs();
                        assert!(
                            err <= bound,
                            "{ty} dX m={m} k={k} [{i},{c}]: err {err} > {bound}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn k_quant_kernels() {
        for ty in [
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            blocks_kernels(ty);
        }
    }

    #[test]
    fn q5_iq4_and_16_bit_kernels() {
        for ty in [
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::IQ4NL,
            GgmlType::IQ4XS,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            blocks_kernels(ty);
        }
        // 16-bit rows of any length (here 100 = 6 groups of 16 and 4 values).
        for ty in [GgmlType::F16, GgmlType::BF16] {
            let d = Default::default();
            let (m, k, n) = (2, 100, 21);
            let (p, w) = weight(ty, n, k, 77);
            let x = randn(m * k, 78);
            let xt = float::<Wgpu, 2>(x.clone(), [m, k], &d)
                .into_primitive()
                .tensor();
            let y = Wgpu::packed_matmul(xt, packed_tensor::<Wgpu>(&p, &d));
            let got = host(Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(y)));
            let want = matmul_f64(&x, &w, m, k, n);
            for (g, e) in got.iter().zip(&want) {
                assert!((*g as f64 - e).abs() < 1e-4, "{ty} k={k}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn split_layout_backward_and_rows_kernels() {
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            blocks_kernels(ty);
        }
    }

    #[test]
    fn rope_kernel() {
        check_rope::<Wgpu>();
        // YaRN and Llama-3 (`rope_freqs.weight`) tables, applied to a view (the model passes
        // `[b, t, h, d]` projections with heads swapped to dim 1, not copied).
        let d = Default::default();
        let yarn = RopeAngles {
            n_dims: 64,
            freq_base: 1_000_000.0,
            freq_scale: 0.25,
            ext_factor: 1.0,
            attn_factor: 1.0 + 0.1 * 4f32.ln(),
            corr_dims: [10.0, 23.0],
            freq_factors: None,
        };
        let llama3 = RopeAngles {
            n_dims: 128,
            freq_base: 500_000.0,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            corr_dims: [0.0, 0.0],
            freq_factors: Some((0..64).map(|i| 1.0 + (i as f32 / 8.0).floor()).collect()),
        };
        for (angles, layout, heads) in [
            (yarn, RopeLayout::Neox, 3),
            (llama3, RopeLayout::Interleaved, 2),
        ] {
            let (t, dim) = (7, angles.n_dims);
            let (cos, sin) = angles.cos_sin((0..t as i64).map(|p| p * 1000 + 3));
            let x = randn(t * heads * dim, 9);
            let want = rope_f64(
                &host(
                    float::<Flex, 4>(x.clone(), [1, t, heads, dim], &Default::default())
                        .swap_dims(1, 2),
                ),
                [1, heads, t, dim],
                &cos,
                &sin,
                layout,
            );
            let xv = float::<Wgpu, 4>(x, [1, t, heads, dim], &d).swap_dims(1, 2);
            let y = Wgpu::rope(
                xv.into_primitive().tensor(),
                float::<Wgpu, 2>(cos.clone(), [t, dim / 2], &d)
                    .into_primitive()
                    .tensor(),
                float::<Wgpu, 2>(sin.clone(), [t, dim / 2], &d)
                    .into_primitive()
                    .tensor(),
                layout,
            );
            let got = host(Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(y)));
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 2e-6, "{layout:?}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn custom_backward_on_wgpu() {
        check_grads::<Wgpu>();
    }

    #[test]
    fn attention_kernel() {
        check_attention::<Wgpu>();
        check_attention_batch::<Wgpu>();
        // Long prefill (T = 512, head_dim 64, GQA 8) and a decode row over a long cache with
        // head_dim 128 and GQA 3; a sliding window with a soft-cap over a cache offset.
        let d = Default::default();
        let cases = [
            (1, 8, 1, 512, 512, 64, None, None),
            (1, 6, 2, 1, 700, 128, None, None),
            (2, 4, 4, 33, 97, 128, Some(40), Some(30.0)),
        ];
        for (b, h, hkv, tq, tk, dim, window, softcap) in cases {
            let o = AttentionOptions {
                scale: 1.0 / (dim as f32).sqrt(),
                q_offset: tk - tq,
                window,
                softcap,
            };
            let q = randn(b * h * tq * dim, 21);
            let k = randn(b * hkv * tk * dim, 22);
            let v = randn(b * hkv * tk * dim, 23);
            let y = <Wgpu as ToyBackend>::attention(
                float::<Wgpu, 4>(q.clone(), [b, h, tq, dim], &d)
                    .into_primitive()
                    .tensor(),
                float::<Wgpu, 4>(k.clone(), [b, hkv, tk, dim], &d)
                    .into_primitive()
                    .tensor(),
                float::<Wgpu, 4>(v.clone(), [b, hkv, tk, dim], &d)
                    .into_primitive()
                    .tensor(),
                o,
            );
            let got = host(Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(y)));
            let want = attention_f64(&q, &k, &v, [b, h, tq, dim], tk, hkv, &o);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).abs())
                .fold(0.0, f64::max);
            // Outputs are averages of values in [-1, 1): 1e-5 is ~100 f32 roundings, room for
            // the GPU's exp (a few ulp) and the summation order over hundreds of keys.
            assert!(
                worst < 1e-5,
                "attention b{b} h{h}/{hkv} tq{tq} tk{tk} d{dim}: max err {worst}"
            );
        }
    }
}
