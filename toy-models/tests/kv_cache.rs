//! The KV cache must not change the numbers: logits of a prompt computed in one forward equal
//! those computed in chunks and token by token, on a small random model, on both CPU backends.

use burn::backend::{Flex, NdArray};
use burn::tensor::{Int, Tensor, TensorData, Tolerance};
use toy_kernels::ToyBackend;
use toy_models::LlamaConfig;

fn check<B: ToyBackend>() {
    let device = Default::default();
    B::seed(&device, 7);
    let config = LlamaConfig::new(2, 64, 4, 2, 16, 96, 50, 64).with_rope_theta(10000.0);
    let model = config.init::<B>(&device);
    let ids: Vec<i64> = vec![3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32];
    let t = ids.len();
    let tokens = |range: std::ops::Range<usize>| {
        let v = ids[range.clone()].to_vec();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [1, range.len()]), &device)
    };

    let mut cache = model.new_cache();
    let full = model.forward(tokens(0..t), &mut cache);
    assert_eq!(cache.len(), t);

    // 5 tokens, then 4, then one at a time.
    let mut cache = model.new_cache();
    let mut parts = vec![
        model.forward(tokens(0..5), &mut cache),
        model.forward(tokens(5..9), &mut cache),
    ];
    for i in 9..t {
        parts.push(model.forward(tokens(i..i + 1), &mut cache));
    }
    let chunked = Tensor::cat(parts, 1);
    // Same math in another grouping of rows: differences are f32 rounding only.
    full.into_data()
        .assert_approx_eq::<f32>(&chunked.into_data(), Tolerance::absolute(1e-4));
}

#[test]
fn kv_cache_matches_full_forward_flex() {
    check::<Flex>();
}

#[test]
fn kv_cache_matches_full_forward_ndarray() {
    check::<NdArray>();
}
