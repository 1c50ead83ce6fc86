//! Run-time backend choice: each command body is generic over `B: ToyBackend` and monomorphized
//! once per backend here.

use anyhow::Result;
use burn::backend::{Flex, NdArray};
use clap::ValueEnum;
use toy_kernels::ToyBackend;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// burn's Flex backend (pure Rust, multithreaded) with toy's native CPU kernels.
    Cpu,
    /// burn's NdArray backend with the reference kernels.
    Ndarray,
}

/// A command body that can run on any backend.
pub trait BackendJob {
    type Output;
    fn run<B: ToyBackend>(self, device: B::Device) -> Result<Self::Output>;
}

pub fn dispatch<J: BackendJob>(kind: BackendKind, job: J) -> Result<J::Output> {
    match kind {
        BackendKind::Cpu => job.run::<Flex>(Default::default()),
        BackendKind::Ndarray => job.run::<NdArray>(Default::default()),
    }
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Ndarray => "ndarray",
        }
    }
}
