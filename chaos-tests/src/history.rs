//! What the clients sent and what they were told, with times: the checker's only source for
//! what was acknowledged and admitted (never the nodes' own counts).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A Route call's outcome, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RouteOutcome {
    Routed,
    RateLimited,
    /// Refused for another reason (no capacity while workers were unknown, ...).
    Refused,
    /// The call failed (connection refused, deadline, unavailable).
    Failed,
}

impl RouteOutcome {
    pub fn label(self) -> &'static str {
        match self {
            RouteOutcome::Routed => "routed",
            RouteOutcome::RateLimited => "rate limited",
            RouteOutcome::Refused => "refused",
            RouteOutcome::Failed => "failed",
        }
    }
}

/// Everything recorded during one run.
#[derive(Debug, Default)]
pub struct History {
    /// Route outcomes by (node, outcome), with the time of each failure.
    pub routes: BTreeMap<(usize, RouteOutcome), u64>,
    pub route_failures: Vec<(Instant, usize, String)>,
    /// Tokens each tenant was admitted, by the window its answer named: the client's own
    /// count (what it asked for, prompt plus maximum output).
    pub admitted: BTreeMap<(String, u64), u64>,
    /// Usage reports acknowledged and failed.
    pub reports_acked: u64,
    pub reports_failed: u64,
    /// Config objects whose write was acknowledged (pool names), and writes that failed.
    pub config_acked: Vec<String>,
    pub config_failed: u64,
    /// KV batches acknowledged by the stream (its sequence), and the distinct blocks they
    /// stored.
    pub published: Vec<u64>,
    pub blocks: u64,
}

/// The history shared by the workload's tasks.
pub type Shared = Arc<Mutex<History>>;

pub fn shared() -> Shared {
    Arc::default()
}

/// Runs `f` on the history (a poisoned lock still holds what was recorded).
pub fn record<T>(h: &Shared, f: impl FnOnce(&mut History) -> T) -> T {
    f(&mut h.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}
