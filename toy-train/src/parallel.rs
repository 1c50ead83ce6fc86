//! Data parallelism through burn's collective (`burn-collective`): each replica of a run knows
//! its place among the others ([`Place`]) and, every optimizer step, averages its gradients and
//! its loss with theirs by an all-reduce. The replicas' threads and their step loop are the
//! trainer's (`trainer.rs`); this module is the collective's side of it.
//!
//! Why the gradients of the replicas' mean equal those of one device's: replica `r` of `n`
//! takes rows `r·B..(r+1)·B` of micro-batch `g` drawn at `n·B` rows ([`crate::data::Batch::shard`]),
//! so the replicas together see exactly the rows one device sees at batch `n·B`, and the mean of
//! equal-sized shards' mean losses is the mean loss. What differs is the order of float sums
//! (each shard's, then the all-reduce's), so the curves agree to rounding, not bit for bit.
//!
//! burn's local collective is one server per backend type per process: [`Group::open`] holds a
//! process-wide lock for the length of a run, so that two runs in one process (tests) cannot
//! mix their peers.

use std::sync::{Mutex, MutexGuard};

use burn::backend::Autodiff;
use burn::collective::{
    self, CollectiveConfig, CollectiveError, PeerId, ReduceOperation, finish_collective, register,
    reset_collective,
};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor, TensorPrimitive};

use toy_kernels::ToyBackend;

use crate::TrainError;
use crate::optim::map_grads;

/// A replica's place among a run's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// This replica's rank: 0 is the one that evaluates, samples, writes events and checkpoints.
    pub rank: usize,
    /// Replicas in the run.
    pub count: usize,
}

impl Place {
    fn peer(self) -> PeerId {
        PeerId(self.rank as u32)
    }

    /// Join the collective on `device`. Returns once every replica has joined.
    pub fn join<B: Backend>(self, device: &B::Device) -> Result<(), TrainError> {
        if self.count == 1 {
            return Ok(());
        }
        let config = CollectiveConfig::default().with_num_devices(self.count);
        register::<B>(self.peer(), device.clone(), config).map_err(|e| collective_error("join", e))
    }

    /// Leave the collective at the end of a run.
    pub fn leave<B: Backend>(self) {
        if self.count > 1 {
            // Nothing is pending at the end of a run; an error here (the collective was reset
            // after another replica failed) changes nothing for this one.
            let _ = finish_collective::<B>(self.peer());
        }
    }

    /// Replace `grads` (this replica's gradients of `model`'s parameters) by their mean over
    /// every replica, and return the mean of every replica's `loss`. Every replica gets the
    /// same numbers back, so every replica's optimizer steps the same way.
    ///
    /// One all-reduce per step, of every gradient and the loss concatenated in the model's
    /// parameter order (the same on every replica), rather than burn's per-parameter
    /// `GradientsParams::all_reduce`: one collective round instead of one per tensor.
    pub fn mean_over_replicas<B: ToyBackend, M: AutodiffModule<Autodiff<B>>>(
        self,
        model: &M,
        grads: &mut GradientsParams,
        loss: f64,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        if self.count == 1 {
            return Ok(loss);
        }
        let mut parts: Vec<Tensor<B, 1>> = Vec::new();
        map_grads::<Autodiff<B>, M>(model, grads, &mut |g| {
            parts.push(g.clone());
            g
        });
        let lens: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
        parts.push(Tensor::from_floats([loss as f32], device));
        let all = Tensor::cat(parts, 0).into_primitive().tensor();
        let mean = collective::all_reduce::<B>(self.peer(), all, ReduceOperation::Mean)
            .map_err(|e| collective_error("all-reduce", e))?;
        let mean = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(mean));
        let (mut offset, mut next) = (0, lens.iter());
        map_grads::<Autodiff<B>, M>(model, grads, &mut |_| {
            let len = *next.next().expect("the same gradients as the first pass");
            offset += len;
            mean.clone().slice(offset - len..offset)
        });
        Ok(mean.slice(offset..offset + 1).into_scalar().elem::<f64>())
    }
}

/// The collective of one multi-device run in this process.
pub struct Group<B: Backend> {
    _lock: MutexGuard<'static, ()>,
    _backend: std::marker::PhantomData<B>,
}

/// One multi-device run at a time per process (burn's local collective server is global).
static RUN_LOCK: Mutex<()> = Mutex::new(());

impl<B: Backend> Group<B> {
    /// Take the process-wide lock of multi-device runs, waiting while another run holds it.
    pub fn open() -> Self {
        // A run that panicked released the lock poisoned; its collective was reset (below).
        let lock = RUN_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        Group {
            _lock: lock,
            _backend: std::marker::PhantomData,
        }
    }

    /// Fail whatever the collective has pending, so that a replica waiting in an all-reduce for
    /// one that has stopped gets an error instead of waiting forever. Called repeatedly until
    /// every replica's thread has ended: a replica may start its next all-reduce after a reset.
    pub fn abort(&self) {
        reset_collective::<B>();
    }
}

fn collective_error(what: &str, e: CollectiveError) -> TrainError {
    TrainError::Backend(format!("data parallel {what} failed: {e:?}"))
}
