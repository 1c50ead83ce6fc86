//! The learning-rate schedule: linear warmup, then a cosine decay to a floor.
//!
//! A pure function of the step, not one of burn's `LrScheduler`s: burn can compose schedulers
//! only by sum, product or average (not one after the other), and a stateful scheduler would be
//! one more thing to checkpoint. Here a resumed run computes the same rate from the step alone.

use crate::config::OptimConfig;

/// The learning rate of optimizer step `step` (0-based) of `o.steps`.
///
/// Steps `0..warmup` ramp linearly up to `lr` (step 0 already moves, at `lr / warmup`); the
/// remaining steps follow half a cosine from `lr` down to `min_lr`, reaching it at the last step.
pub fn learning_rate(o: &OptimConfig, step: usize) -> f64 {
    if step < o.warmup_steps {
        return o.lr * (step + 1) as f64 / o.warmup_steps as f64;
    }
    let decay_steps = o.steps.saturating_sub(o.warmup_steps + 1);
    if decay_steps == 0 {
        return o.lr;
    }
    let progress = ((step - o.warmup_steps) as f64 / decay_steps as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    o.min_lr + cosine * (o.lr - o.min_lr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OptimConfig {
        OptimConfig {
            steps: 110,
            warmup_steps: 10,
            lr: 1e-3,
            min_lr: 1e-4,
            ..OptimConfig::default()
        }
    }

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let o = config();
        assert!((learning_rate(&o, 0) - 1e-4).abs() < 1e-12);
        assert!((learning_rate(&o, 9) - 1e-3).abs() < 1e-12);
        assert!((learning_rate(&o, 10) - 1e-3).abs() < 1e-12);
        // Halfway through the decay: halfway between the peak and the floor.
        let mid = 10 + 99 / 2;
        assert!((learning_rate(&o, mid) - 5.5e-4).abs() < 2e-5);
        assert!((learning_rate(&o, 109) - 1e-4).abs() < 1e-12);
        let rates: Vec<f64> = (10..110).map(|s| learning_rate(&o, s)).collect();
        assert!(rates.windows(2).all(|w| w[1] <= w[0]), "decay is monotone");
    }

    #[test]
    fn no_warmup_and_single_step() {
        let o = OptimConfig {
            steps: 1,
            warmup_steps: 0,
            ..config()
        };
        assert_eq!(learning_rate(&o, 0), 1e-3);
    }
}
