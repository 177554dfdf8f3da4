//! The policy directory as a config source: the leader rereads it, and when its valid content
//! differs from the objects the directory owns in the replicated catalog, proposes the
//! difference as one `ConfigApply` entry. An invalid directory changes nothing: its problems
//! are logged and counted, and the last valid policies stay in force. An object another source
//! owns is left out (logged, counted); an empty directory deletes nothing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvplane_policy::{Catalog, Kind};
use kvplane_state::{Command, ConfigKey, ConfigObject, Owner, Proposer, StateHandle, View};
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
    let (mut last_problems, mut last_conflicts) = (Vec::new(), Vec::new());
    loop {
        if leading() {
            sync_once(
                &dir,
                &log,
                &state,
                &metrics,
                (&mut last_problems, &mut last_conflicts),
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

/// The objects of the state's catalog that `owner` owns: all a source reconciles.
pub(crate) fn owned(view: &View, owner: Owner) -> Catalog {
    let mut c = Catalog::default();
    for o in view.catalog.objects() {
        if view.owner(o.kind().as_str(), &o.name) == Some(owner) {
            c.insert(o);
        }
    }
    c
}

/// Who else owns `kind`/`name`, if another source does (an object written before owners has
/// none: any source may claim it).
pub(crate) fn foreign_owner(view: &View, kind: Kind, name: &str, me: Owner) -> Option<Owner> {
    view.owner(kind.as_str(), name).filter(|o| *o != me)
}

/// What a source is to propose.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The one `ConfigApply` that turns what the source owns into what it wants, with its
    /// numbers of puts and deletes; `None` when they are equal.
    pub change: Option<(Command, usize, usize)>,
    /// Deletes held back: the source would delete every object it owns (an empty directory,
    /// an empty list from the API server), which only an explicit act may do.
    pub kept_last: usize,
}

/// The change that turns `current` (what `owner` owns) into `desired`, unless that deletes
/// every object `owner` owns.
pub(crate) fn plan(current: &Catalog, desired: &Catalog, owner: Owner) -> Plan {
    let (puts, deletes) = current.diff(desired);
    if puts.is_empty() && !deletes.is_empty() && desired.objects().is_empty() {
        return Plan {
            change: None,
            kept_last: deletes.len(),
        };
    }
    Plan {
        change: change(current, desired, Some(owner)),
        kept_last: 0,
    }
}

/// The one `ConfigApply` by `owner` that turns `current` into `desired`, with its numbers of
/// puts and deletes; `None` when they are equal.
pub(crate) fn change(
    current: &Catalog,
    desired: &Catalog,
    owner: Option<Owner>,
) -> Option<(Command, usize, usize)> {
    let (puts, deletes) = current.diff(desired);
    if puts.is_empty() && deletes.is_empty() {
        return None;
    }
    let command = Command::ConfigApply {
        owner,
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
    (last_problems, last_conflicts): (&mut Vec<String>, &mut Vec<String>),
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
    let view = state.load();
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
