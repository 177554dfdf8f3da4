//! The routing cost (README, "Cost"): the predicted time to first token, in milliseconds.
//!
//! ```text
//! prefill_ms = uncached_prompt_tokens / prefill_tokens_per_s * 1000
//! load_ms    = waiting * waiting_request_ms + running * running_request_ms
//! cost       = base_ms + prefill_ms + load_ms            (lowest wins)
//! ```
//!
//! `uncached_prompt_tokens` is the prompt minus the blocks the worker already caches,
//! consecutively from the first block. Ties go to the larger overlap, then to a hash of the
//! request id and worker name (deterministic, and spread across equal workers).

use serde::Deserialize;

/// Parameters of the cost; defaults resemble an 8B model on one L40S-class GPU.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Fixed overhead of any request (scheduling, first decode step).
    pub base_ms: f64,
    /// Prefill throughput of one engine.
    pub prefill_tokens_per_s: f64,
    /// Expected delay added by each request waiting in the engine's queue.
    pub waiting_request_ms: f64,
    /// Expected delay added by each request already running (batch interference).
    pub running_request_ms: f64,
    /// Learn each worker's engine model from its reported first tokens, these figures its
    /// prior, and use it where it predicts better than these figures calibrated
    /// (`kvplane_api::learn`). Off by default: on engines we did not write it predicted
    /// better and routed bursts of shared prefixes worse (README, "Cost").
    pub learn: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            base_ms: 20.0,
            prefill_tokens_per_s: 8_000.0,
            waiting_request_ms: 250.0,
            running_request_ms: 8.0,
            learn: false,
        }
    }
}

impl CostModel {
    /// Every problem with the parameters, for config validation.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            out.push("cost.prefill_tokens_per_s must be a positive number".into());
        }
        for (name, v) in [
            ("cost.base_ms", self.base_ms),
            ("cost.waiting_request_ms", self.waiting_request_ms),
            ("cost.running_request_ms", self.running_request_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                out.push(format!("{name} must be a non-negative number"));
            }
        }
        out
    }

    pub fn prefill_ms(&self, uncached_tokens: u64) -> f64 {
        uncached_tokens as f64 / self.prefill_tokens_per_s * 1000.0
    }

    pub fn load_ms(&self, waiting: u32, running: u32) -> f64 {
        f64::from(waiting) * self.waiting_request_ms + f64::from(running) * self.running_request_ms
    }
}
