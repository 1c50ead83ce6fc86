//! The generation core: sequences, each with its KV cache and the tokens it has yet to run,
//! stepped together one forward pass at a time (continuous batching; llama.cpp's unified batch).
//!
//! `toy infer` ([`crate::generate::generate`]) runs one sequence through it and `toy serve` many;
//! neither has a prefill or decode loop of its own. Sampling stays with the caller: a step hands
//! back each sequence's next-token logits once its queued tokens have all run, the caller picks a
//! token and [`Batch::push`]es it for the next step.
//!
//! A step takes every sequence with a single token queued (a decode step, which never waits),
//! then prompt pieces of [`PROMPT_CHUNK`] tokens (the last shorter) in the order the sequences
//! joined, while they fit the token budget. A piece is never cut to fit: a prompt runs in the
//! same pieces under any load, so its numbers do not depend on what else runs (see
//! [`crate::cache`]). The first piece always goes, so prompts move on however many decode.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::Tensor;
use toy_kernels::ToyBackend;

use crate::cache::{KvCache, PROMPT_CHUNK};
use crate::model::CausalLm;

/// A sequence of a [`Batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(u64);

/// What one step did for one sequence.
#[derive(Debug, Clone)]
pub struct Ran {
    /// The sequence.
    pub id: SeqId,
    /// Tokens of this sequence the step ran.
    pub tokens: usize,
    /// The logits `[vocab]` of its next token, once everything it had queued has run (None
    /// after a middle piece of its prompt).
    pub logits: Option<Vec<f32>>,
}

/// A step that failed: the sequences it carried may hold some layers' keys of the failed pass,
/// so their caches are no longer usable ([`Batch::remove`] them).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct StepError {
    /// The sequences the failed step carried.
    pub ids: Vec<SeqId>,
    /// What went wrong.
    pub message: String,
}

struct Slot<B: ToyBackend> {
    id: SeqId,
    cache: KvCache<B>,
    /// Tokens queued to run, oldest first.
    queued: Vec<u32>,
}

/// Sequences generated together; see the module's documentation.
pub struct Batch<B: ToyBackend> {
    slots: Vec<Slot<B>>,
    batch_tokens: usize,
    /// Most tokens of one sequence in one pass ([`PROMPT_CHUNK`]).
    piece: usize,
    next_id: u64,
}

impl<B: ToyBackend> Batch<B> {
    /// An empty batch whose steps carry at most `batch_tokens` tokens (decode tokens and the
    /// first prompt piece go over it rather than wait).
    pub fn new(batch_tokens: usize) -> Self {
        Batch {
            slots: Vec::new(),
            batch_tokens: batch_tokens.max(1),
            piece: PROMPT_CHUNK,
            next_id: 0,
        }
    }

    /// Run prompts in pieces of `tokens` instead of [`PROMPT_CHUNK`] (tests split short prompts
    /// this way; a sequence gets the numbers of a single run only with the same pieces).
    pub fn with_prompt_piece(mut self, tokens: usize) -> Self {
        self.piece = tokens.max(1);
        self
    }

    /// Add a sequence whose cache already holds `cache.len()` tokens (empty, or a prefix cache's
    /// hit); queue its tokens with [`Batch::push`].
    pub fn add(&mut self, cache: KvCache<B>) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.slots.push(Slot {
            id,
            cache,
            queued: Vec::new(),
        });
        id
    }

    /// Queue `tokens` to run after what `id` holds and has queued (its prompt, or the token just
    /// sampled).
    pub fn push(&mut self, id: SeqId, tokens: &[u32]) {
        if let Some(slot) = self.slot_mut(id) {
            slot.queued.extend_from_slice(tokens);
        }
    }

    /// Take `id` out of the batch, with its cache (to keep in a prefix cache, say).
    pub fn remove(&mut self, id: SeqId) -> Option<KvCache<B>> {
        let i = self.slots.iter().position(|s| s.id == id)?;
        Some(self.slots.remove(i).cache)
    }

    /// `id`'s cache, to run something outside the batch's steps (scoring every position of a
    /// prompt needs all its logits, not the last row's).
    pub fn cache_mut(&mut self, id: SeqId) -> Option<&mut KvCache<B>> {
        self.slot_mut(id).map(|s| &mut s.cache)
    }

    /// Tokens `id` has queued.
    pub fn queued(&self, id: SeqId) -> usize {
        self.slots
            .iter()
            .find(|s| s.id == id)
            .map_or(0, |s| s.queued.len())
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the batch has no sequences.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// What the next step would run: (index into `slots`, tokens).
    fn plan(&self) -> Vec<(usize, usize)> {
        let mut plan: Vec<(usize, usize)> = (0..self.slots.len())
            .filter(|&i| self.slots[i].queued.len() == 1)
            .map(|i| (i, 1))
            .collect();
        let mut budget = self.batch_tokens.saturating_sub(plan.len());
        let mut pieces = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.queued.len() < 2 {
                continue;
            }
            let n = slot.queued.len().min(self.piece);
            if pieces > 0 && n > budget {
                break;
            }
            pieces += 1;
            budget = budget.saturating_sub(n);
            plan.push((i, n));
        }
        plan
    }

    /// One forward pass over what the sequences have queued (see the module's documentation).
    /// Returns what it ran for each sequence it carried; nothing when nothing is queued.
    pub fn step(&mut self, model: &impl CausalLm<B>) -> Result<Vec<Ran>, StepError> {
        let plan = self.plan();
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<SeqId> = plan.iter().map(|&(i, _)| self.slots[i].id).collect();
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, n)| self.slots[i].queued[..n].to_vec())
            .collect();
        let token_refs: Vec<&[u32]> = tokens.iter().map(Vec::as_slice).collect();
        // Line the caches up with the plan (decode tokens come before prompt pieces).
        let mut caches: Vec<Option<&mut KvCache<B>>> =
            self.slots.iter_mut().map(|s| Some(&mut s.cache)).collect();
        let caches: Vec<&mut KvCache<B>> = plan
            .iter()
            .map(|&(i, _)| caches[i].take().expect("each sequence once per step"))
            .collect();
        let logits = catch_unwind(AssertUnwindSafe(|| {
            host(model.forward_batch_last(&token_refs, caches))
        }))
        .unwrap_or_else(|_| Err("the model panicked during generation".into()))
        .map_err(|message| StepError {
            ids: ids.clone(),
            message,
        })?;
        let vocab = logits.len() / plan.len();
        let ran = plan
            .iter()
            .zip(logits.chunks(vocab))
            .map(|(&(i, n), row)| {
                let slot = &mut self.slots[i];
                slot.queued.drain(..n);
                Ran {
                    id: slot.id,
                    tokens: n,
                    logits: slot.queued.is_empty().then(|| row.to_vec()),
                }
            })
            .collect();
        Ok(ran)
    }

    /// Step until `id` has run everything it queued; its next-token logits.
    pub fn run_until_logits(
        &mut self,
        model: &impl CausalLm<B>,
        id: SeqId,
    ) -> Result<Vec<f32>, StepError> {
        loop {
            let ran = self.step(model)?;
            if let Some(logits) = ran.into_iter().find(|r| r.id == id).and_then(|r| r.logits) {
                return Ok(logits);
            }
            if self.queued(id) == 0 {
                return Err(StepError {
                    ids: vec![id],
                    message: "internal error: the sequence has nothing queued to run".into(),
                });
            }
        }
    }

    fn slot_mut(&mut self, id: SeqId) -> Option<&mut Slot<B>> {
        self.slots.iter_mut().find(|s| s.id == id)
    }
}

/// Logits on the host as f32 (`--dtype f16` runs in half precision).
fn host<B: ToyBackend>(logits: Tensor<B, 2>) -> Result<Vec<f32>, String> {
    logits
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("backend error: {e:?}"))
}
