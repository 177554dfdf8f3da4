//! What the clients sent and what they were told, with the times of each call: the checker's
//! source for what was acknowledged and admitted.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A Route call's outcome, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RouteOutcome {
    Routed,
    RateLimited,
    /// Refused for another reason (no capacity, unknown model, ...).
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

/// The "member" the gateway's calls are recorded under (it asks every member in turn).
pub const GATEWAY: usize = usize::MAX;

/// The "member" the endpoint picker's calls are recorded under (its client plays Envoy in
/// front of every member in turn).
pub const PICKER: usize = usize::MAX - 1;

/// Who answered a call, for a report: a member's index, the gateway, or the picker.
pub fn who(member: usize) -> String {
    match member {
        GATEWAY => "the gateway".to_owned(),
        PICKER => "the endpoint picker".to_owned(),
        m => format!("member {m}"),
    }
}

/// A call that did not route (failed, or refused for anything but the tenant's limit), from
/// when it was sent to when its client gave up or heard back.
#[derive(Debug, Clone)]
pub struct Miss {
    pub sent: Instant,
    pub done: Instant,
    pub member: usize,
    pub why: String,
}

/// One admission: the tokens the client asked for (prompt plus maximum output), the wall-clock
/// times it sent the call and heard back, and the window the answer's charge named.
#[derive(Debug, Clone)]
pub struct Admission {
    pub tenant: &'static str,
    pub tokens: u64,
    pub sent_ms: u64,
    pub done_ms: u64,
    pub charged_window_ms: Option<u64>,
}

/// A read that promised a state no older than `promised`: the index it answered at, or
/// `None` when it was refused or failed.
#[derive(Debug, Clone)]
pub struct Read {
    pub kind: &'static str,
    pub promised: u64,
    pub answered: Option<u64>,
}

/// Everything recorded during one run.
#[derive(Debug, Default)]
pub struct History {
    /// Route outcomes by (member, tenant, outcome).
    pub routes: BTreeMap<(usize, &'static str, RouteOutcome), u64>,
    pub misses: Vec<Miss>,
    /// Answers that refused for the limit because no grant came ("fails closed").
    pub failed_closed: u64,
    pub admissions: Vec<Admission>,
    pub reports_acked: u64,
    pub reports_failed: u64,
    /// Reports sent a second time to another member (after a failure, or although the first
    /// was acknowledged).
    pub reports_retried: u64,
    /// The highest log index a config write was acknowledged at.
    pub acked_index: u64,
    pub reads: Vec<Read>,
    /// Config objects whose write was acknowledged (pool names), and writes that failed.
    pub config_acked: Vec<String>,
    pub config_failed: u64,
    /// Answers through the gateway that were not what the engine said.
    pub bad_answers: Vec<String>,
    /// KV batches the engines published, in order: the worker of each.
    pub published: Vec<usize>,
    /// Requests a replica acknowledged as settled by its routing process (`known`), then
    /// another as settled through the ledger: (request id, the routing member, when the first
    /// and the second acknowledgement came).
    pub known_then_ledger: Vec<(String, usize, Instant, Instant)>,
    /// When members were stopped (kill -9, SIGTERM, a volume lost): the member (`None`: every
    /// member, in turn) and the stretch the fault took, from before it to its heal.
    pub stops: Vec<(Option<usize>, Instant, Instant)>,
    /// When the gateway was killed or frozen: from before the fault to its heal. Its calls
    /// then may fail; the members' and the picker's may not.
    pub gateway_down: Vec<(Instant, Instant)>,
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
