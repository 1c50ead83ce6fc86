//! Tests of the blocks-layout dot products: the AVX2 and multi-row kernels against the scalar
//! specifications.

use super::*;
use crate::packed::{BLOCK, QK_K};

fn rng(seed: u64) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    }
}

/// `k` activations, uniform in [-3, 3].
fn random_activations(k: usize, next: &mut impl FnMut() -> u32) -> Vec<f32> {
    (0..k)
        .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 6.0)
        .collect()
}

/// Random blocks of `ty` with finite f16 fields (the scales), every bit pattern elsewhere.
fn random_row(ty: GgmlType, blocks: usize, next: &mut impl FnMut() -> u32) -> Vec<u8> {
    let size = ty.type_size();
    let mut row: Vec<u8> = (0..blocks * size).map(|_| next() as u8).collect();
    let finite = |next: &mut dyn FnMut() -> u32, signed: bool| {
        let v = (next() % 2000) as f32 / 2000.0 * 0.05 + 1e-4;
        let v = if signed && next() % 2 == 0 { -v } else { v };
        f16::from_f32(v).to_le_bytes()
    };
    let fields: &[usize] = match ty {
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q5_1 => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    };
    if matches!(ty, GgmlType::F16 | GgmlType::BF16) {
        for v in row.chunks_exact_mut(2) {
            let x = (next() as f32 / u32::MAX as f32 - 0.5) * 4.0;
            v.copy_from_slice(&if ty == GgmlType::F16 {
                f16::from_f32(x).to_le_bytes()
            } else {
                f32_to_bf16(x).to_le_bytes()
            });
        }
        return row;
    }
    for b in row.chunks_exact_mut(size) {
        for &f in fields {
            b[f..f + 2].copy_from_slice(&finite(next, f == 0 || f == 80 || f == 108 || f == 208));
        }
    }
    row
}

/// The 8-row kernels give each row the specification's bits.
#[cfg(target_arch = "x86_64")]
#[test]
fn eight_row_dots_are_bit_identical_to_the_spec() {
    if super::super::cpu_level() < super::super::CpuLevel::Avx2 {
        return;
    }
    let mut next = rng(11);
    let mut checked = 0;
    for (ty, form) in [(GgmlType::Q4K, Form::Gemv), (GgmlType::IQ4NL, Form::Gemv)] {
        for sb in [1usize, 2, 3, 9, 17, 33] {
            let k = sb * QK_K;
            let blocks = k / ty.block_size();
            let rows: Vec<Vec<u8>> = (0..8).map(|_| random_row(ty, blocks, &mut next)).collect();
            let x = random_activations(k, &mut next);
            let act = activation(ty, &x, form);
            let w: [&[u8]; 8] = std::array::from_fn(|r| rows[r].as_slice());
            let got = dot8(ty, Rows8::Apart(w), &act, form).expect("an 8-row kernel");
            if ty == GgmlType::Q4K {
                // The CPU backend's interleaved layout reads the same bits.
                let inter = crate::packed::interleave_q4k_x8(&rows.concat(), 8, sb);
                let got_i = dot8(ty, Rows8::Interleaved(&inter), &act, form).unwrap();
                assert_eq!(got_i.map(f32::to_bits), got.map(f32::to_bits), "{sb}");
            }
            for r in 0..8 {
                let want = dot(ty, w[r], &act, form, GgmlIsa::Avx2);
                assert_eq!(
                    got[r].to_bits(),
                    want.to_bits(),
                    "{ty} row {r}, {sb} super-blocks"
                );
                checked += 1;
            }
            // Four activation rows at once, where that kernel exists.
            let acts: Vec<ActRow> = (0..4)
                .map(|_| activation(ty, &random_activations(k, &mut next), form))
                .collect();
            let x = [&acts[0], &acts[1], &acts[2], &acts[3]];
            if let Some(got) = dot8_rows4(ty, Rows8::Apart(w), x, form) {
                for (a, act) in acts.iter().enumerate() {
                    for r in 0..8 {
                        let want = dot(ty, w[r], act, form, GgmlIsa::Avx2);
                        assert_eq!(
                            got[a][r].to_bits(),
                            want.to_bits(),
                            "{ty} row {r}, activation row {a}, {sb} super-blocks"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    // Q4_K: 8 rows; IQ4_NL: 8 rows, then 4 × 8 by the four-row kernel; 6 sizes each.
    assert_eq!(checked, 6 * 8 + 6 * (8 + 32));
}

/// The 4-row kernels give each activation row the specification's bits.
#[cfg(target_arch = "x86_64")]
#[test]
fn four_row_dots_are_bit_identical_to_the_spec() {
    if super::super::cpu_level() < super::super::CpuLevel::Avx2 {
        return;
    }
    let mut next = rng(13);
    let mut checked = 0;
    for (ty, form) in [
        (GgmlType::Q5_0, Form::VecDot),
        (GgmlType::Q5_1, Form::VecDot),
        (GgmlType::IQ4NL, Form::TinyBlas),
        (GgmlType::Q4K, Form::Gemm),
        (GgmlType::Q6K, Form::Tiled),
    ] {
        for sb in [1usize, 2, 9] {
            let k = sb * QK_K;
            let w = random_row(ty, k / ty.block_size(), &mut next);
            let acts: Vec<ActRow> = (0..4)
                .map(|_| {
                    let x = random_activations(k, &mut next);
                    activation(ty, &x, form)
                })
                .collect();
            let rows = [&acts[0], &acts[1], &acts[2], &acts[3]];
            let got = dot_rows4(ty, &w, rows, form).expect("a 4-row kernel");
            // On an AVX-512 machine `dot_rows4` takes Q6_K's VNNI kernel: check the AVX2 one
            // it stands in for as well.
            let avx2_q6k = match q8k_rows(rows) {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                Some(x) if ty == GgmlType::Q6K => {
                    Some(unsafe { super::super::blocks_avx2::dot_q6_k_tiled_rows4(&w, x) })
                }
                _ => None,
            };
            for r in 0..4 {
                if let Some(avx2) = avx2_q6k {
                    assert_eq!(avx2[r].to_bits(), got[r].to_bits(), "Q6_K AVX2 row {r}");
                }
                let want = dot(ty, &w, &acts[r], form, GgmlIsa::Avx2);
                assert_eq!(
                    got[r].to_bits(),
                    want.to_bits(),
                    "{ty} row {r}, {sb} super-blocks"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 60);
}

/// The AVX2 two-row decode kernel gives each output the specification's bits (on any AVX2 CPU:
/// called directly, as an AVX-512 CPU's `dot2_rows` takes the VNNI one).
#[cfg(target_arch = "x86_64")]
#[test]
fn two_row_avx2_decode_dots_are_bit_identical_to_the_spec() {
    if super::super::cpu_level() < super::super::CpuLevel::Avx2 {
        return;
    }
    let mut next = rng(29);
    for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
        for blocks in [1usize, 2, 7, 18, 72] {
            let k = blocks * ty.block_size();
            let w = [
                random_row(ty, blocks, &mut next),
                random_row(ty, blocks, &mut next),
            ];
            let act = activation(ty, &random_activations(k, &mut next), Form::VecDot);
            let ActRow::Q8(y) = &act else { unreachable!() };
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            let got = unsafe {
                match ty {
                    GgmlType::Q5_1 => {
                        super::super::blocks32_avx2::dot_q5_rows::<true, 2>([&w[0], &w[1]], y)
                    }
                    _ => super::super::blocks32_avx2::dot_q5_rows::<false, 2>([&w[0], &w[1]], y),
                }
            };
            for j in 0..2 {
                let want = dot(ty, &w[j], &act, Form::VecDot, GgmlIsa::Avx2);
                assert_eq!(
                    got[j].to_bits(),
                    want.to_bits(),
                    "{ty} row {j}, {blocks} blocks"
                );
            }
        }
    }
}

/// The 2 × 4 and 2 × 1 kernels (AVX-512 VNNI) give each output the specification's bits.
#[cfg(target_arch = "x86_64")]
#[test]
fn two_by_four_dots_are_bit_identical_to_the_spec() {
    if super::super::cpu_level() < super::super::CpuLevel::Avx512 {
        return;
    }
    let mut next = rng(17);
    let mut checked = 0;
    for (ty, form) in [
        (GgmlType::Q5_0, Form::VecDot),
        (GgmlType::Q5_1, Form::VecDot),
    ] {
        for blocks in [1usize, 2, 7, 72] {
            let k = blocks * ty.block_size();
            let w0 = random_row(ty, blocks, &mut next);
            let w1 = random_row(ty, blocks, &mut next);
            let acts: Vec<ActRow> = (0..4)
                .map(|_| activation(ty, &random_activations(k, &mut next), form))
                .collect();
            let rows = [&acts[0], &acts[1], &acts[2], &acts[3]];
            let got = dot2_rows(ty, [&w0, &w1], rows, form).expect("a 2 × 4 kernel");
            for (j, w) in [&w0, &w1].into_iter().enumerate() {
                for r in 0..4 {
                    let want = dot(ty, w, &acts[r], form, GgmlIsa::Avx2);
                    assert_eq!(
                        got[j][r].to_bits(),
                        want.to_bits(),
                        "{ty} weight row {j}, activation row {r}, {blocks} blocks"
                    );
                    // The decode form (one activation row) gives the same bits.
                    let [[one], _] = dot2_rows(ty, [w, &w0], [&acts[r]], form).expect("2 × 1");
                    assert_eq!(one.to_bits(), want.to_bits(), "{ty} 2 × 1, row {r}");
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 64);
}

/// The AVX2 dots (and the AVX-512 ones `dot_avx2` takes where the CPU has them) give the
/// specification's bits for every type and form, on rows of 1 to 9 super-blocks (odd block
/// counts exercise IQ4_NL's scalar last block).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_dots_are_bit_identical_to_the_spec() {
    if super::super::cpu_level() < super::super::CpuLevel::Avx2 {
        return;
    }
    let mut next = rng(7);
    let types = [
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4XS,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::IQ4NL,
        GgmlType::F16,
        GgmlType::BF16,
    ];
    let forms = [
        Form::VecDot,
        Form::Gemv,
        Form::Gemm,
        Form::TinyBlas,
        Form::Tiled,
    ];
    let mut checked = 0;
    for ty in types {
        let half = matches!(ty, GgmlType::F16 | GgmlType::BF16);
        // 16-bit rows of any length: tails past the 32- and 64-value steps of either build.
        let ks: &[usize] = match half {
            true => &[256, 512, 2304, 40, 96, 296, 616],
            false => &[256, 512, 768, 2304],
        };
        for &k in ks {
            let sb = k / QK_K;
            let w = random_row(ty, k / ty.block_size(), &mut next);
            let x = random_activations(k, &mut next);
            for form in forms {
                let valid = match form {
                    Form::Gemv => matches!(ty, GgmlType::Q4K | GgmlType::Q2K | GgmlType::IQ4NL),
                    Form::Gemm => matches!(ty, GgmlType::Q4K | GgmlType::Q2K),
                    Form::TinyBlas => ty == GgmlType::IQ4NL,
                    Form::Tiled => ty.block_size() == QK_K,
                    Form::VecDot => true,
                };
                if !valid {
                    continue;
                }
                let act = activation(ty, &x, form);
                // The 16-bit dots differ between llama.cpp's AVX2 and AVX-512 builds.
                let isas: &[GgmlIsa] = match half {
                    true => &[GgmlIsa::Avx2, GgmlIsa::Avx512, GgmlIsa::Avx512Bf16],
                    false => &[GgmlIsa::Avx2],
                };
                for &isa in isas {
                    let want = dot(ty, &w, &act, form, isa);
                    let got = dot_avx2(ty, &w, &act, form, isa);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty} {form:?} {isa:?} k {k} ({sb} super-blocks): {got} vs {want}"
                    );
                    checked += 1;
                }
                // Where `dot_avx2` takes an AVX-512 kernel, the AVX2 one it stands in for.
                if let (GgmlType::Q6K, Form::VecDot, ActRow::Q8K(y)) = (ty, form, &act) {
                    let want = dot(ty, &w, &act, form, GgmlIsa::Avx2);
                    // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                    let got = unsafe { super::super::blocks_avx2::dot_q6_k(&w, y) };
                    assert_eq!(got.to_bits(), want.to_bits(), "AVX2 Q6_K, k {k}");
                }
            }
        }
    }
    assert!(checked > 60, "{checked}");
}

/// Not a test: the bandwidth the decode kernels read a 1B-model-sized matrix at (one activation
/// row, both cores), each kernel against the one it replaces on this CPU: Q4_K with the rows
/// apart, interleaved by eight (AVX2) and as X16 (AVX-512 VNNI); Q6_K's one-row AVX2 and
/// AVX-512 kernels. Rounds alternate the kernels, so a noisy machine moves them alike.
/// `cargo test --release -p toy-kernels --lib gemv_bandwidth -- --ignored --nocapture`.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn gemv_bandwidth() {
    use super::super::{blocks_avx2, blocks_vnni};
    let vnni = super::super::x16_kernels();
    // 75 MB of Q4_K each: far past the caches, as a 1B model's weights are.
    for (rows, sb) in [(65536usize, 8usize), (16384, 32)] {
        let k = sb * QK_K;
        let mut next = rng(5);
        let x = random_activations(k, &mut next);
        let ActRow::Q8K(y) = activation(GgmlType::Q4K, &x, Form::Gemv) else {
            unreachable!()
        };
        let q4k: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(GgmlType::Q4K, sb, &mut next))
            .collect();
        let x8 = crate::packed::interleave_q4k_x8(&q4k, rows, sb);
        let x16: Vec<u32> =
            crate::packed::interleave_x16(&bytemuck::pod_collect_to_vec(&q4k), rows, sb, 36);
        let x16: &[u8] = bytemuck::cast_slice(&x16);
        let q6k: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(GgmlType::Q6K, sb, &mut next))
            .collect();
        let row_len = sb * 144;
        // SAFETY (every kernel call): AVX2 and, for the VNNI kernels, AVX-512 VNNI are checked
        // (`x16_kernels`) before they run.
        let q4k_rows8 = |interleaved: bool| -> Vec<f32> {
            (0..rows / 8)
                .into_par_iter()
                .flat_map_iter(|g| {
                    let w = match interleaved {
                        true => Rows8::Interleaved(&x8[g * 8 * row_len..(g + 1) * 8 * row_len]),
                        false => Rows8::Apart(std::array::from_fn(|r| {
                            &q4k[(g * 8 + r) * row_len..(g * 8 + r + 1) * row_len]
                        })),
                    };
                    unsafe { blocks_avx2::dot8_q4_k_gemv(w, &y) }
                })
                .collect()
        };
        let q4k_x16 = || -> Vec<f32> {
            x16.par_chunks(16 * row_len)
                .flat_map_iter(|g| unsafe { blocks_vnni::gemv_q4_k_x16(g, &y) })
                .collect()
        };
        let q6k_rows = |avx512: bool| -> Vec<f32> {
            q6k.par_chunks(sb * 210)
                .map(|w| unsafe {
                    match avx512 {
                        true => blocks_vnni::dot_q6_k(w, &y),
                        false => blocks_avx2::dot_q6_k(w, &y),
                    }
                })
                .collect()
        };
        assert_eq!(
            q4k_rows8(false),
            q4k_rows8(true),
            "the same bits either way"
        );
        let mut kernels: Vec<(&str, usize, Box<dyn Fn() -> Vec<f32> + Sync + '_>)> = vec![
            (
                "Q4_K rows apart, AVX2 8-row",
                q4k.len(),
                Box::new(|| q4k_rows8(false)),
            ),
            (
                "Q4_K X8, AVX2 8-row",
                q4k.len(),
                Box::new(|| q4k_rows8(true)),
            ),
            ("Q6_K, AVX2", q6k.len(), Box::new(|| q6k_rows(false))),
        ];
        if vnni {
            assert_eq!(q4k_x16(), q4k_rows8(true), "the same bits in X16");
            assert_eq!(q6k_rows(true), q6k_rows(false), "the same bits in AVX-512");
            kernels.push(("Q4_K X16, AVX-512 VNNI", q4k.len(), Box::new(q4k_x16)));
            kernels.push(("Q6_K, AVX-512 VNNI", q6k.len(), Box::new(|| q6k_rows(true))));
        }
        let mut best = vec![f64::MAX; kernels.len()];
        for _round in 0..5 {
            for (i, (_, _, run)) in kernels.iter().enumerate() {
                let t = std::time::Instant::now();
                let reps = 10;
                for _ in 0..reps {
                    std::hint::black_box(run());
                }
                best[i] = best[i].min(t.elapsed().as_secs_f64() / reps as f64);
            }
        }
        for ((name, bytes, _), s) in kernels.iter().zip(best) {
            eprintln!(
                "{rows} × {k} {name}: {:.2} ms, {:.1} GB/s (best of 5 rounds)",
                s * 1e3,
                *bytes as f64 / s / 1e9
            );
        }
    }
}

/// The sixteen-row Q5_0/Q5_1 kernels (AVX-512 VNNI, on the re-split X16 layout), for one and
/// two activation rows, give each output the specification's bits, on rows of 1 to 37 blocks
/// (odd counts end in padding).
#[cfg(target_arch = "x86_64")]
#[test]
fn sixteen_row_q5_kernels_are_bit_identical_to_the_spec() {
    use super::super::blocks_vnni::gemm_q5_x16;
    use crate::packed::{RowLayout, interleave_rows, pack};
    if !super::super::x16_kernels() {
        return;
    }
    let mut next = rng(23);
    for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
        for blocks in [1usize, 2, 7, 18, 37] {
            let k = blocks * BLOCK;
            let w: Vec<Vec<u8>> = (0..16).map(|_| random_row(ty, blocks, &mut next)).collect();
            let words = pack(ty, &w.concat(), 16, k).unwrap().words;
            let x16 = interleave_rows(RowLayout::X16, ty, words, 16, k);
            let x16: &[u8] = bytemuck::cast_slice(&x16);
            let acts: Vec<ActRow> = (0..3)
                .map(|_| activation(ty, &random_activations(k, &mut next), Form::VecDot))
                .collect();
            let y: Vec<&QuantRow> = acts
                .iter()
                .map(|a| match a {
                    ActRow::Q8(y) => y,
                    _ => unreachable!(),
                })
                .collect();
            // SAFETY: the CPU has AVX-512 F/BW/VL/VNNI (`x16_kernels`).
            let (one, two) = unsafe {
                match ty {
                    GgmlType::Q5_1 => (
                        gemm_q5_x16::<true, 1>(x16, [y[0]]),
                        gemm_q5_x16::<true, 2>(x16, [y[1], y[2]]),
                    ),
                    _ => (
                        gemm_q5_x16::<false, 1>(x16, [y[0]]),
                        gemm_q5_x16::<false, 2>(x16, [y[1], y[2]]),
                    ),
                }
            };
            for (a, got) in [one[0], two[0], two[1]].iter().enumerate() {
                for (r, w) in w.iter().enumerate() {
                    let want = dot(ty, w, &acts[a], Form::VecDot, GgmlIsa::Avx2);
                    assert_eq!(
                        got[r].to_bits(),
                        want.to_bits(),
                        "{ty}: row {r}, activation row {a}, {blocks} blocks"
                    );
                }
            }
        }
    }
}

/// The sixteen-row Q4_K kernels (AVX-512 VNNI) on the X16 layout give every output the
/// specification's bits: the decode form one activation row at a time, the prefill form four
/// at a time and one at a time.
#[cfg(target_arch = "x86_64")]
#[test]
fn sixteen_row_q4_k_kernels_are_bit_identical_to_the_spec() {
    use super::super::blocks_vnni::{gemm_q4_k_x16, gemv_q4_k_x16};
    if !super::super::x16_kernels() {
        return;
    }
    let mut next = rng(19);
    let ty = GgmlType::Q4K;
    for sb in [1usize, 2, 9] {
        let k = sb * QK_K;
        let w: Vec<Vec<u8>> = (0..16).map(|_| random_row(ty, sb, &mut next)).collect();
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&w.concat());
        let x16: Vec<u32> = crate::packed::interleave_x16(&words, 16, sb, 36);
        let x16: &[u8] = bytemuck::cast_slice(&x16);
        let x: Vec<Vec<f32>> = (0..4).map(|_| random_activations(k, &mut next)).collect();
        for form in [Form::Gemm, Form::Gemv] {
            let acts: Vec<ActRow> = x.iter().map(|x| activation(ty, x, form)).collect();
            let y: Vec<&[Q8K]> = acts
                .iter()
                .map(|a| match a {
                    ActRow::Q8K(y) => y.as_slice(),
                    _ => unreachable!(),
                })
                .collect();
            // SAFETY: the CPU has AVX-512 F/BW/VL/VNNI (`x16_kernels`).
            let got: Vec<[f32; 16]> = match form {
                Form::Gemm => {
                    let four = unsafe { gemm_q4_k_x16::<4>(x16, [y[0], y[1], y[2], y[3]]) };
                    for (a, four) in four.iter().enumerate() {
                        let one = unsafe { gemm_q4_k_x16::<1>(x16, [y[a]])[0] };
                        assert_eq!(one.map(f32::to_bits), four.map(f32::to_bits), "{sb}");
                    }
                    four.to_vec()
                }
                _ => y.iter().map(|y| unsafe { gemv_q4_k_x16(x16, y) }).collect(),
            };
            for (a, got) in got.iter().enumerate() {
                for (r, w) in w.iter().enumerate() {
                    let want = dot(ty, w, &acts[a], form, GgmlIsa::Avx2);
                    assert_eq!(
                        got[r].to_bits(),
                        want.to_bits(),
                        "{form:?}: row {r}, activation row {a}, {sb} super-blocks"
                    );
                }
            }
        }
    }
}
