//! The policy directory as a config source: the leader rereads it, and when its valid content
//! differs from the replicated catalog, proposes the difference as one `ConfigApply` entry.
//! An invalid directory changes nothing: its problems are logged and counted, and the last
//! valid policies stay in force.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvplane_policy::Catalog;
use kvplane_state::{Command, ConfigKey, ConfigObject, Proposer, StateHandle};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

/// What the source did, for `/metrics`.
#[derive(Debug, Default)]
pub struct PolicySourceMetrics {
    applied: Counter,
    invalid: Counter,
    problems: Gauge,
}

impl PolicySourceMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_policy_source_changes_applied",
            "Policy directory changes committed to the replicated state",
            self.applied.clone(),
        );
        r.register(
            "kvplane_policy_source_invalid_reads",
            "Reads of the policy directory refused because of problems",
            self.invalid.clone(),
        );
        r.register(
            "kvplane_policy_source_problems",
            "Problems found in the last read of the policy directory",
            self.problems.clone(),
        );
    }
}

/// Counts the config sources' passes while leading: a new leader's ingest waits for one, so
/// the catalog (and the pools of its worker sets) is in the state before the engines' messages.
pub type Synced = Arc<watch::Sender<u64>>;

/// Keeps the state's catalog equal to `dir` while `leading()` holds, until `stop`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    dir: PathBuf,
    every: Duration,
    log: impl Proposer,
    state: StateHandle,
    leading: impl Fn() -> bool + Send,
    metrics: Arc<PolicySourceMetrics>,
    synced: Synced,
    tokenizers: Arc<kvplane_api::Tokenizers>,
    mut stop: watch::Receiver<bool>,
) {
    let mut last_problems = Vec::new();
    loop {
        if leading() {
            sync_once(
                &dir,
                &log,
                &state,
                &metrics,
                &mut last_problems,
                &tokenizers,
            )
            .await;
            synced.send_modify(|n| *n += 1);
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The one `ConfigApply` that turns `current` into `desired`, with its numbers of puts and
/// deletes; `None` when they are equal.
pub(crate) fn change(current: &Catalog, desired: &Catalog) -> Option<(Command, usize, usize)> {
    let (puts, deletes) = current.diff(desired);
    if puts.is_empty() && deletes.is_empty() {
        return None;
    }
    let command = Command::ConfigApply {
        puts: puts.iter().map(ConfigObject::policy).collect(),
        deletes: deletes
            .iter()
            .map(|(k, n)| ConfigKey {
                kind: k.as_str().to_owned(),
                name: n.clone(),
            })
            .collect(),
    };
    Some((command, puts.len(), deletes.len()))
}

async fn sync_once(
    dir: &std::path::Path,
    log: &impl Proposer,
    state: &StateHandle,
    metrics: &PolicySourceMetrics,
    last_problems: &mut Vec<String>,
    tokenizers: &kvplane_api::Tokenizers,
) {
    let (desired, problems) = match crate::policy_cmd::load(&[dir.to_owned()]) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot read the policy directory");
            return;
        }
    };
    let mut problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
    for (name, spec) in &desired.worker_sets {
        if let Some(p) = tokenizer_problem(tokenizers, spec) {
            problems.push(format!("InferenceWorkerSet/{name}: {p}"));
        }
    }
    metrics
        .problems
        .set(i64::try_from(problems.len()).unwrap_or(i64::MAX));
    if !problems.is_empty() {
        if *last_problems != problems {
            metrics.invalid.inc();
            for p in &problems {
                tracing::warn!(problem = %p, "policy directory refused; the last valid policies stay");
            }
            *last_problems = problems;
        }
        return;
    }
    last_problems.clear();
    let Some((command, puts, deletes)) = change(&state.load().catalog, &desired) else {
        return;
    };
    match log.propose(command).await {
        Ok(index) => {
            metrics.applied.inc();
            tracing::info!(index, puts, deletes, "policy change applied");
        }
        Err(e) => tracing::warn!(error = %e, "policy change not applied"),
    }
}

/// Why a worker set's `tokenizer` directory does not load on this node (`spec.tokenizer: ...`).
pub(crate) fn tokenizer_problem(
    tokenizers: &kvplane_api::Tokenizers,
    spec: &kvplane_policy::kinds::InferenceWorkerSetSpec,
) -> Option<String> {
    let dir = std::path::Path::new(spec.tokenizer.as_deref()?);
    tokenizers
        .check(dir)
        .err()
        .map(|e| format!("spec.tokenizer: {e}"))
}
