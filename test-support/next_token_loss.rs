//! The loss the gradient checks of toy-models and toy-train differentiate. One file, included by
//! each test suite with `#[path = ".../test-support/next_token_loss.rs"] mod ...;`.

use burn::tensor::{Int, Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::CausalLm;

/// Mean next-token cross-entropy of `batch` equal-length rows of `tokens` (targets are the tokens
/// shifted by one), from an empty cache, through `CausalLm::loss`: the loss and backward that
/// training uses.
pub fn next_token_loss<B: ToyBackend>(
    model: &impl CausalLm<B>,
    tokens: &[i64],
    batch: usize,
) -> Tensor<B, 1> {
    let device = model.device();
    let t = tokens.len() / batch;
    let all = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens.to_vec(), [batch, t]), &device);
    let input = all.clone().narrow(1, 0, t - 1);
    let targets = all.narrow(1, 1, t - 1);
    model.loss(input, targets)
}
