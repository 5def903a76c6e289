//! Learning-rate schedule: linear warmup, then cosine decay to a floor (nanoGPT's `get_lr`).
//!
//! For step `t` (0-based, the index of the update about to be applied), warmup `W` and total `T`:
//!
//! ```text
//! t <  W:        max_lr * (t + 1) / (W + 1)      step 0 gets max_lr/(W+1): no update is wasted at 0
//! W <= t <  T:   min_lr + 0.5 * (1 + cos(pi * (t - W) / (T - W))) * (max_lr - min_lr)
//! t >= T:        min_lr
//! ```
//!
//! This is nanoGPT's current `train.py` convention; at `t = W` the cosine starts at exactly
//! `max_lr` and it would reach `min_lr` at `t = T`. With `W = T` there is no decay phase: warmup
//! ends in a drop to `min_lr` (use `min_lr = max_lr` for warmup-then-constant).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of warmup.
    pub max_lr: f64,
    /// Floor the cosine decays to (nanoGPT uses max_lr / 10).
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the decay reaches `min_lr`; later steps stay there.
    pub total_steps: u64,
}

impl LrSchedule {
    /// A validated schedule.
    pub fn new(max_lr: f64, min_lr: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        let s = Self {
            max_lr,
            min_lr,
            warmup_steps,
            total_steps,
        };
        s.validate()?;
        Ok(s)
    }

    /// The same rate at every step.
    pub fn constant(lr: f64) -> Result<Self> {
        Self::new(lr, lr, 0, 0)
    }

    /// Checks `0 <= min_lr <= max_lr` (finite) and `warmup_steps <= total_steps`.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason| {
            Err(Error::LrSchedule {
                reason,
                max_lr: self.max_lr,
                min_lr: self.min_lr,
                warmup_steps: self.warmup_steps,
                total_steps: self.total_steps,
            })
        };
        if !(self.max_lr.is_finite() && self.min_lr.is_finite()) {
            return bad("max_lr and min_lr must be finite");
        }
        if !(0.0 <= self.min_lr && self.min_lr <= self.max_lr) {
            return bad("need 0 <= min_lr <= max_lr");
        }
        if self.warmup_steps > self.total_steps {
            return bad("warmup_steps exceeds total_steps");
        }
        Ok(())
    }

    /// The learning rate for 0-based step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let (w, t) = (self.warmup_steps, self.total_steps);
        if step < w {
            return self.max_lr * (step + 1) as f64 / (w + 1) as f64;
        }
        if step >= t {
            return self.min_lr;
        }
        let ratio = (step - w) as f64 / (t - w) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values worked out by hand from nanoGPT's `get_lr` with learning_rate 6e-4, min_lr 6e-5,
    /// warmup_iters 10, lr_decay_iters 110.
    #[test]
    fn warms_up_linearly_then_decays_by_cosine_to_the_floor() {
        let s = LrSchedule::new(6e-4, 6e-5, 10, 110).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(close(s.lr_at(0), 6e-4 / 11.0));
        assert!(close(s.lr_at(9), 6e-4 * 10.0 / 11.0));
        assert_eq!(s.lr_at(10), 6e-4);
        // Halfway through the decay the cosine factor is 0.5.
        assert!(close(s.lr_at(60), 6e-5 + 0.5 * (6e-4 - 6e-5)));
        assert!(close(
            s.lr_at(35),
            6e-5 + 0.5 * (1.0 + (0.25 * std::f64::consts::PI).cos()) * 5.4e-4
        ));
        assert_eq!(s.lr_at(110), 6e-5);
        assert_eq!(s.lr_at(10_000), 6e-5);
        let lrs: Vec<f64> = (10..=110).map(|t| s.lr_at(t)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]), "decay is monotone");
    }

    #[test]
    fn constant_schedule_and_validation() {
        let c = LrSchedule::constant(3e-4).unwrap();
        assert_eq!(c.lr_at(0), 3e-4);
        assert_eq!(c.lr_at(123), 3e-4);
        assert!(LrSchedule::new(1e-3, 2e-3, 0, 10).is_err());
        let err = LrSchedule::new(1e-3, 0.0, 11, 10).unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::LrSchedule {
                    warmup_steps: 11,
                    total_steps: 10,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("warmup_steps 11"), "{err}");
        assert!(LrSchedule::new(f64::NAN, 0.0, 0, 10).is_err());
        let json = r#"{"max_lr":1e-3,"min_lr":1e-4,"warmup_steps":5,"total_steps":50}"#;
        let s: LrSchedule = serde_json::from_str(json).unwrap();
        assert_eq!(s, LrSchedule::new(1e-3, 1e-4, 5, 50).unwrap());
    }
}
