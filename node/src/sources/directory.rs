//! The policy directory as a config source: the leader rereads it, and when its valid content
//! differs from the objects the directory owns in the replicated catalog, proposes the
//! difference as one `ConfigApply` entry. An invalid directory changes nothing: its problems
//! are logged and counted, and the last valid policies stay in force. An object another source
//! owns is left out (logged, counted); an empty directory deletes nothing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvplane_policy::Documents;
use kvplane_state::{Owner, Proposer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::{Context, foreign_owner, owned, plan, tokenizer_problem};

/// What the source did, for `/metrics`.
#[derive(Debug, Default)]
pub struct PolicySourceMetrics {
    applied: Counter,
    invalid: Counter,
    problems: Gauge,
    conflicts: Gauge,
    kept_last: Gauge,
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
        r.register(
            "kvplane_policy_source_conflicts",
            "Objects of the policy directory left out because another source owns them",
            self.conflicts.clone(),
        );
        r.register(
            "kvplane_policy_source_kept_objects",
            "Objects the directory owns kept although it holds none (deleting a source's last objects is an explicit act)",
            self.kept_last.clone(),
        );
    }
}

/// Keeps the objects the directory owns in the state's catalog equal to `dir` while this node
/// leads, until `stop`.
pub async fn run(
    (dir, bounds): (PathBuf, kvplane_policy::FileBounds),
    every: Duration,
    node: Context<impl Proposer>,
    metrics: Arc<PolicySourceMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let (mut last_problems, mut last_conflicts) = (Vec::new(), Vec::new());
    loop {
        if node.leading() {
            sync_once(
                (&dir, bounds),
                &node,
                &metrics,
                (&mut last_problems, &mut last_conflicts),
            )
            .await;
            node.synced.send_modify(|n| *n += 1);
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn sync_once(
    (dir, bounds): (&std::path::Path, kvplane_policy::FileBounds),
    node: &Context<impl Proposer>,
    metrics: &PolicySourceMetrics,
    (last_problems, last_conflicts): (&mut Vec<String>, &mut Vec<String>),
) {
    let read = Documents::read_bounded(&[dir.to_owned()], bounds);
    let (desired, problems) = match read.map(Documents::check) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot read the policy directory");
            return;
        }
    };
    let mut problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
    for (name, spec) in &desired.worker_sets {
        if let Some(p) = tokenizer_problem(&node.tokenizers, spec) {
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
    let view = node.state.load();
    let mut desired = desired;
    let mut conflicts = Vec::new();
    for o in desired.objects() {
        if let Some(other) = foreign_owner(&view, o.kind(), &o.name, Owner::Directory) {
            desired.remove(o.kind(), &o.name);
            conflicts.push(format!("{}/{} is owned by {other}", o.kind(), o.name));
        }
    }
    metrics
        .conflicts
        .set(i64::try_from(conflicts.len()).unwrap_or(i64::MAX));
    if *last_conflicts != conflicts {
        for c in &conflicts {
            tracing::warn!(conflict = %c, "policy directory object left out: another source owns it");
        }
        *last_conflicts = conflicts;
    }
    let plan = plan(&owned(&view, Owner::Directory), &desired, Owner::Directory);
    metrics
        .kept_last
        .set(i64::try_from(plan.kept_last).unwrap_or(i64::MAX));
    if plan.kept_last > 0 {
        tracing::warn!(
            objects = plan.kept_last,
            "the policy directory holds no objects: the ones it owns stay until deleted explicitly \
             (Admin.DeleteConfig with owner directory)"
        );
    }
    let Some((command, puts, deletes)) = plan.change else {
        return;
    };
    match node.log.propose(command).await {
        Ok(index) => {
            metrics.applied.inc();
            tracing::info!(index, puts, deletes, "policy change applied");
        }
        Err(e) => tracing::warn!(error = %e, "policy change not applied"),
    }
}
