//! JSON messages next to the KV events: engine metrics and worker announcements.

use serde::{Deserialize, Serialize};

/// An engine's load, as a bridge scraped it from vLLM's `/metrics`.
/// Field names are vLLM's metric names without the `vllm:` prefix. Unknown fields are ignored
/// so that newer bridges can add fields.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct MetricsMessage {
    pub num_requests_running: u32,
    pub num_requests_waiting: u32,
    /// 0..=1.
    pub kv_cache_usage_perc: f64,
    /// 0..=1 (hits / queries over the engine's lifetime); absent when the engine had no queries.
    #[serde(default)]
    pub prefix_cache_hit_rate: f64,
    /// vLLM's `time_to_first_token_seconds` histogram over the engine's lifetime: its sum (s)
    /// and count. Absent from older bridges.
    #[serde(default)]
    pub time_to_first_token_seconds_sum: f64,
    #[serde(default)]
    pub time_to_first_token_seconds_count: u64,
}

impl MetricsMessage {
    /// Range checks; a message that fails them is rejected.
    pub fn check(&self) -> Result<(), MetricsError> {
        for (field, value) in [
            ("kv_cache_usage_perc", self.kv_cache_usage_perc),
            ("prefix_cache_hit_rate", self.prefix_cache_hit_rate),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(MetricsError::NotAFraction { field, value });
            }
        }
        let sum = self.time_to_first_token_seconds_sum;
        if !(sum.is_finite() && sum >= 0.0) {
            return Err(MetricsError::TtftSum(sum));
        }
        Ok(())
    }
}

/// Why a metrics message is out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetricsError {
    #[error("{field} must be within 0..=1, got {value}")]
    NotAFraction { field: &'static str, value: f64 },
    #[error("time_to_first_token_seconds_sum must be a non-negative number, got {0}")]
    TtftSum(f64),
}

/// A worker announcing itself or leaving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerMessage {
    /// `"up"` or `"down"`.
    pub status: WorkerStatus,
    /// Where gateways send its requests, e.g. `http://10.0.0.7:8000`.
    #[serde(default)]
    pub address: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerStatus {
    Up,
    Down,
}
