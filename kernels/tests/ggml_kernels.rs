//! The CPU backend's packed matmuls against llama.cpp's own outputs, bit for bit: for every
//! packed weight type, `fixtures/quant/kernels/<TYPE>.gguf` holds a 24 × 512 weight, 9
//! activation rows and what llama.cpp's x86 CPU backend (its AVX2 build) computes for the first
//! M = 1..9 rows — with the weight repacked as llama.cpp's model loader repacks matmul weights
//! (`y.repack`), and in its plain buffer as it keeps a token embedding table (`y.plain`). Made by
//! `fixtures/quant/make_kernel_fixtures.sh`.

use std::path::PathBuf;

use burn::backend::Flex;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use toy_core::gguf::{GgmlType, GgufFile, tensor_to_f32};
use toy_kernels::flex::{GgmlIsa, set_ggml_isa};
use toy_kernels::packed::{PACKED_TYPES, pack};
use toy_kernels::{PackedTensor, ToyBackend};

fn fixture(ty: GgmlType) -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/quant/kernels")
        .join(format!("{}.gguf", ty.name()));
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(file: &GgufFile, name: &str) -> Vec<f32> {
    let info = file
        .tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    tensor_to_f32(file, info).unwrap()
}

/// `x[:m] · Wᵀ` on Flex, with the weight marked repackable or not.
fn flex_matmul(file: &GgufFile, ty: GgmlType, m: usize, repackable: bool) -> Vec<f32> {
    let info = file.tensor("w").unwrap();
    let (k, n) = (info.dims[0] as usize, info.dims[1] as usize);
    let host = pack(ty, file.tensor_data(info), n, k).unwrap();
    let d = Default::default();
    let f32_t = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<Flex, 2>::from_data(TensorData::new(v, shape), &d)
            .into_primitive()
            .tensor()
    };
    let per_row = host.words.len() / n;
    let w = PackedTensor::<Flex> {
        ty,
        cols: k,
        words: Tensor::<Flex, 2, burn::tensor::Int>::from_data(
            TensorData::new(host.words.clone(), [n, per_row]),
            (&d, DType::U32),
        )
        .into_primitive(),
        scales: host.scales.clone().map(|s| f32_t(s, [n, k / 32])),
        mins: host.mins.clone().map(|s| f32_t(s, [n, k / 32])),
        repackable,
        layout: toy_kernels::packed::RowLayout::Rows,
    };
    let x = f32s(file, "x");
    let y = Flex::packed_matmul(f32_t(x[..m * k].to_vec(), [m, k]), w);
    Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(y))
        .into_data()
        .into_vec::<f32>()
        .unwrap()
}

#[test]
fn packed_matmuls_are_bit_identical_to_llama_cpp_avx2() {
    set_ggml_isa(GgmlIsa::Avx2);
    let mut failures = Vec::new();
    let mut compared = 0;
    for ty in PACKED_TYPES {
        let file = fixture(ty);
        for m in 1..=9 {
            for (repackable, which) in [(true, "repack"), (false, "plain")] {
                let want = f32s(&file, &format!("y.{which}.m{m}"));
                let got = flex_matmul(&file, ty, m, repackable);
                assert_eq!(
                    (got.len(), want.len()),
                    (24 * m, 24 * m),
                    "{ty} {which} m={m}"
                );
                compared += got.len();
                let bad: Vec<(usize, f32, f32)> = got
                    .iter()
                    .zip(&want)
                    .enumerate()
                    .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
                    .map(|(i, (g, w))| (i, *g, *w))
                    .collect();
                if !bad.is_empty() {
                    let worst = bad
                        .iter()
                        .map(|(_, g, w)| (g - w).abs())
                        .fold(0.0, f32::max);
                    failures.push(format!(
                        "{ty} {which} m={m}: {} of {} outputs differ (max {worst:e}), first {:?}",
                        bad.len(),
                        got.len(),
                        bad[0]
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 14 types × M = 1..9 × both placements × 24 outputs.
    assert_eq!(compared, 14 * 45 * 2 * 24);
}
