//! Tenant limits, declared in `InferencePolicy.spec.limits`: tokens and requests per window,
//! shared exactly by every replica through the escrow ledger of the replicated state.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A tenant's budget. Every limit that matches a request applies (a tenant-wide one and one
/// for the requested model, say); the request is admitted only when all of them have room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantLimit {
    /// The tenant (as the request or the backend's tenant header names it), or `*`: each
    /// tenant without a limit of its own gets this one, separately.
    pub tenant: String,
    /// Only requests for this model (as requested, public names included); absent: all models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Prompt plus maximum output tokens admitted per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// The most tokens one replica is granted at once (default: a tenth of the window's
    /// budget). Smaller: fairer between replicas, more grant entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// The window the budget is counted in (default 60 s): the budget of a window is the
    /// per-minute figure times `windowSeconds / 60`. Windows start at multiples of their length
    /// on the leader's clock.
    #[serde(default = "default_window", skip_serializing_if = "is_default_window")]
    pub window_seconds: u32,
    /// Without a quorum a replica spends the escrow it holds, then refuses (fail closed).
    /// With this, it may then admit up to this many more tokens per minute on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_open_tokens_per_minute: Option<u64>,
}

fn default_window() -> u32 {
    60
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_default_window(w: &u32) -> bool {
    *w == 60
}

/// A window's budget for a per-minute rate.
fn per_window(per_minute: u64, window_seconds: u32) -> u64 {
    per_minute.saturating_mul(u64::from(window_seconds)) / 60
}

impl TenantLimit {
    pub fn window_ms(&self) -> u64 {
        u64::from(self.window_seconds) * 1000
    }

    /// Tokens per window (`None`: not limited).
    pub fn window_tokens(&self) -> Option<u64> {
        self.tokens_per_minute
            .map(|t| per_window(t, self.window_seconds))
    }

    pub fn window_requests(&self) -> Option<u64> {
        self.requests_per_minute
            .map(|r| per_window(r, self.window_seconds))
    }

    /// The most tokens one grant gives.
    pub fn grant_tokens(&self) -> u64 {
        let budget = self.window_tokens().unwrap_or(u64::MAX);
        self.burst.unwrap_or(budget / 10).clamp(1, budget.max(1))
    }

    /// The most requests one grant gives.
    pub fn grant_requests(&self) -> u64 {
        let budget = self.window_requests().unwrap_or(u64::MAX);
        (budget / 10).clamp(1, budget.max(1))
    }

    pub fn fail_open_window_tokens(&self) -> Option<u64> {
        self.fail_open_tokens_per_minute
            .map(|t| per_window(t, self.window_seconds))
    }
}
