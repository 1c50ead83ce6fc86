//! Training data: text files tokenized with the model's tokenizer, concatenated, packed into
//! fixed-length sequences, split into a training and a held-out part, and served as shuffled
//! micro-batches.
//!
//! Packing: the token stream is cut into windows of `seq_len + 1` tokens that overlap by one
//! (window `i` starts at token `i * seq_len`), so every token but the first is a target exactly
//! once. Documents are not padded: a file's tokens start with BOS when the tokenizer adds one,
//! and a corpus can separate documents with an end-of-text token in the text itself (special
//! tokens are parsed), so the model learns where a document ends and a new one begins.
//!
//! Order: the held-out part is the last `val_fraction` of the windows (contiguous, so it shares
//! no tokens with the training part except a window boundary). Each epoch visits the training
//! windows in a permutation drawn from the run's seed and the epoch number only, so micro-batch
//! `g` of a run is a pure function of `(seed, g)`: a resumed run sees the same batches as an
//! uninterrupted one without saving any data-loader state.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use toy_core::rng::SplitMix64;
use toy_core::tokenizer::Tokenizer;

use crate::TrainError;

/// A tokenized corpus cut into windows of `seq_len + 1` tokens.
#[derive(Debug, Clone)]
pub struct TokenData {
    tokens: Vec<u32>,
    seq_len: usize,
    n_train: usize,
    n_val: usize,
}

/// Tokenize `files` in order and concatenate them. A file named `*.u32` or `*.bin` is already
/// tokenized ([`read_token_file`]); any other is UTF-8 text ([`tokenize_file`]).
pub fn tokenize_files(tokenizer: &Tokenizer, files: &[PathBuf]) -> Result<Vec<u32>, TrainError> {
    let mut tokens = Vec::new();
    for path in files {
        if is_token_file(path) {
            tokens.extend(read_token_file(path, tokenizer.vocab_size())?);
        } else {
            tokens.extend(tokenize_file(tokenizer, path)?);
        }
    }
    Ok(tokens)
}

/// Whether `path` names a pre-tokenized file (by its extension: `.u32` or `.bin`).
pub fn is_token_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("u32" | "bin")
    )
}

/// A pre-tokenized file: little-endian u32 token ids, nothing else (the layout of
/// `train_tokens.u32` in `shared/anchors/pytorch/train_bench.py`, and of `np.uint32` arrays
/// written with `tofile`). Taken as it is: no BOS is added. Every id must be below `vocab_size`.
pub fn read_token_file(path: &Path, vocab_size: usize) -> Result<Vec<u32>, TrainError> {
    let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
        what: format!("cannot read training data {}", path.display()),
        source,
    })?;
    if !bytes.len().is_multiple_of(4) {
        return Err(TrainError::Data(format!(
            "{} is {} bytes, not a whole number of little-endian u32 token ids",
            path.display(),
            bytes.len()
        )));
    }
    let tokens: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some((i, &id)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab_size)
    {
        return Err(TrainError::Data(format!(
            "{}: token {i} is id {id}, outside the tokenizer's vocabulary of {vocab_size} (was it tokenized with another tokenizer?)",
            path.display()
        )));
    }
    Ok(tokens)
}

/// One UTF-8 text file as tokens: BOS first when the tokenizer adds one, special tokens parsed.
pub fn tokenize_file(tokenizer: &Tokenizer, path: &Path) -> Result<Vec<u32>, TrainError> {
    let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
        what: format!("cannot read training data {}", path.display()),
        source,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        TrainError::Data(format!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    tokenizer
        .encode(&text, true, true)
        .map_err(|e| TrainError::Data(format!("cannot tokenize {}: {e}", path.display())))
}

impl TokenData {
    /// Cut `tokens` into windows and hold out the last `val_fraction` of them (at least one
    /// window when the fraction is positive). Needs at least one window to train on.
    pub fn new(tokens: Vec<u32>, seq_len: usize, val_fraction: f64) -> Result<Self, TrainError> {
        let n_windows = tokens.len().saturating_sub(1) / seq_len;
        let n_val = if val_fraction > 0.0 {
            ((n_windows as f64 * val_fraction).ceil() as usize).max(1)
        } else {
            0
        };
        if n_windows <= n_val {
            return Err(TrainError::Data(format!(
                "{} tokens make {n_windows} sequences of {seq_len}: too few to train on with {n_val} held out; add text or shorten --seq-len",
                tokens.len()
            )));
        }
        Ok(TokenData {
            tokens,
            seq_len,
            n_train: n_windows - n_val,
            n_val,
        })
    }

    /// Tokens of the corpus (training and held-out).
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Every token, in order (training and held-out).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Predicted tokens per window (a window holds one more).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Training windows.
    pub fn n_train(&self) -> usize {
        self.n_train
    }

    /// Held-out windows.
    pub fn n_val(&self) -> usize {
        self.n_val
    }

    fn window(&self, i: usize) -> &[u32] {
        &self.tokens[i * self.seq_len..(i + 1) * self.seq_len + 1]
    }

    /// Micro-batches per epoch of training windows (a last partial batch is dropped).
    pub fn batches_per_epoch(&self, batch_size: usize) -> usize {
        self.n_train / batch_size
    }

    /// The training windows of micro-batch `g` of a run (counting every micro-batch since step
    /// 0), for a given seed.
    pub fn train_batch(&self, seed: u64, g: u64, batch_size: usize) -> Result<Batch, TrainError> {
        let per_epoch = self.batches_per_epoch(batch_size) as u64;
        if per_epoch == 0 {
            return Err(TrainError::Data(format!(
                "{} training sequences are fewer than one batch of {batch_size}; add text or lower --batch-size",
                self.n_train
            )));
        }
        let (epoch, k) = (g / per_epoch, (g % per_epoch) as usize);
        let order = permutation(
            self.n_train,
            seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let windows = order[k * batch_size..(k + 1) * batch_size]
            .iter()
            .map(|&i| self.window(i))
            .collect::<Vec<_>>();
        Ok(Batch::from_windows(&windows, epoch))
    }

    /// The held-out windows in order, in batches of at most `batch_size`; `max_batches` = 0
    /// means all of them.
    pub fn val_batches(&self, batch_size: usize, max_batches: usize) -> Vec<Batch> {
        let ids: Vec<usize> = (self.n_train..self.n_train + self.n_val).collect();
        let mut out: Vec<Batch> = ids
            .chunks(batch_size)
            .map(|chunk| {
                let windows: Vec<&[u32]> = chunk.iter().map(|&i| self.window(i)).collect();
                Batch::from_windows(&windows, 0)
            })
            .collect();
        if max_batches > 0 {
            out.truncate(max_batches);
        }
        out
    }
}

/// `batch` windows of `seq_len + 1` tokens, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The windows' token ids, `batch × (seq_len + 1)`.
    pub tokens: Vec<u32>,
    /// Windows (rows) in the batch.
    pub batch: usize,
    /// Predicted tokens per row (a row holds one more).
    pub seq_len: usize,
    /// The epoch this batch belongs to (0 for held-out batches).
    pub epoch: u64,
}

impl Batch {
    fn from_windows(windows: &[&[u32]], epoch: u64) -> Self {
        let seq_len = windows[0].len() - 1;
        Batch {
            tokens: windows.concat(),
            batch: windows.len(),
            seq_len,
            epoch,
        }
    }

    /// Rows `rank·(batch/parts)..(rank+1)·(batch/parts)`: a data-parallel replica's share of
    /// a micro-batch drawn at every replica's rows together.
    pub fn shard(&self, rank: usize, parts: usize) -> Batch {
        assert!(
            rank < parts && self.batch.is_multiple_of(parts),
            "batch of {} split {parts} ways",
            self.batch
        );
        let rows = self.batch / parts;
        let width = self.seq_len + 1;
        Batch {
            tokens: self.tokens[rank * rows * width..(rank + 1) * rows * width].to_vec(),
            batch: rows,
            seq_len: self.seq_len,
            epoch: self.epoch,
        }
    }

    /// Inputs `[batch, seq_len]` and targets `[batch, seq_len]` (the inputs shifted by one).
    pub fn tensors<B: Backend>(
        &self,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let ids: Vec<i64> = self.tokens.iter().map(|&t| t as i64).collect();
        let all = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids, [self.batch, self.seq_len + 1]),
            device,
        );
        (
            all.clone().narrow(1, 0, self.seq_len),
            all.narrow(1, 1, self.seq_len),
        )
    }

    /// Predicted tokens in this batch.
    pub fn n_targets(&self) -> usize {
        self.batch * self.seq_len
    }
}

/// A Fisher–Yates permutation of `0..n`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_every_target_once() {
        let data = TokenData::new((0..1001).collect(), 10, 0.1).unwrap();
        assert_eq!(data.n_train() + data.n_val(), 100);
        assert_eq!(data.n_val(), 10);
        // Window i ends where window i+1 starts.
        assert_eq!(data.window(3).last(), data.window(4).first());
        let batch = data.train_batch(1, 0, 4).unwrap();
        assert_eq!(batch.tokens.len(), 4 * 11);
        // Held-out windows are the last ones, in order.
        let val = data.val_batches(4, 0);
        assert_eq!(val.len(), 3);
        assert_eq!(val[0].tokens[0], 900);
        assert_eq!(val[2].batch, 2);
        assert_eq!(data.val_batches(4, 1).len(), 1);
    }

    #[test]
    fn batches_are_a_function_of_seed_and_index() {
        let data = TokenData::new((0..2001).collect(), 10, 0.0).unwrap();
        let per_epoch = data.batches_per_epoch(8) as u64;
        assert_eq!(per_epoch, 25);
        let a = data.train_batch(7, 30, 8).unwrap();
        assert_eq!(a, data.train_batch(7, 30, 8).unwrap());
        assert_eq!(a.epoch, 1);
        assert_ne!(a, data.train_batch(8, 30, 8).unwrap());
        // One epoch visits every training window exactly once.
        let mut starts: Vec<u32> = (0..per_epoch)
            .flat_map(|g| {
                let b = data.train_batch(7, g, 8).unwrap();
                (0..b.batch)
                    .map(move |r| b.tokens[r * 11])
                    .collect::<Vec<_>>()
            })
            .collect();
        starts.sort();
        assert_eq!(starts, (0..200).map(|i| i * 10).collect::<Vec<_>>());
        // A new epoch is a new order.
        assert_ne!(
            data.train_batch(7, 0, 8).unwrap().tokens,
            data.train_batch(7, per_epoch, 8).unwrap().tokens
        );
    }

    #[test]
    fn shards_partition_a_batch_in_rank_order() {
        let data = TokenData::new((0..2001).collect(), 10, 0.0).unwrap();
        let all = data.train_batch(3, 5, 6).unwrap();
        let shards: Vec<Batch> = (0..3).map(|r| all.shard(r, 3)).collect();
        assert!(shards.iter().all(|s| s.batch == 2 && s.epoch == all.epoch));
        let joined: Vec<u32> = shards.iter().flat_map(|s| s.tokens.clone()).collect();
        assert_eq!(joined, all.tokens);
        assert_ne!(shards[0].tokens, shards[1].tokens);
    }

    #[test]
    fn too_little_data_is_a_clear_error() {
        let err = TokenData::new((0..15).collect(), 10, 0.1).unwrap_err();
        assert!(err.to_string().contains("too few to train on"), "{err}");
        let data = TokenData::new((0..101).collect(), 10, 0.0).unwrap();
        let err = data.train_batch(0, 0, 16).unwrap_err();
        assert!(err.to_string().contains("fewer than one batch"), "{err}");
    }

    #[test]
    fn permutation_is_fixed() {
        // SplitMix64's published first outputs for seed 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        // Guards the reproducibility of recorded loss curves: this must never change.
        assert_eq!(permutation(8, 42), vec![4, 3, 2, 0, 7, 6, 1, 5]);
        let mut p = permutation(1000, 1);
        p.sort();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }
}
