//! Config sources: the writers that keep a part of the replicated catalog equal to something
//! outside it (the policy directory, the Kubernetes custom resources). Each owns what it wrote
//! ([`Owner`]) and reconciles only that; what they share is here.

pub mod directory;
pub mod kube_engines;
pub mod kubernetes;
pub mod static_health;

use std::sync::Arc;

use kvplane_policy::{Catalog, Kind};
use kvplane_state::{Command, Owner, Proposer, StateHandle, View};
use tokio::sync::watch;

/// Counts the config sources' passes while leading: a new leader's ingest waits for one, so
/// the catalog (and the pools of its worker sets) is in the state before the engines' messages.
pub type Synced = Arc<watch::Sender<u64>>;

/// What a config source needs of its node.
#[derive(Clone)]
pub struct Context<P> {
    /// Where its changes are proposed.
    pub log: P,
    /// What is in force, to compare with.
    pub state: StateHandle,
    /// Whether this node acts for the cluster now (only the leader writes).
    pub leading: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Counted after every pass while leading.
    pub synced: Synced,
    /// The tokenizers a worker set's `spec.tokenizer` must load with.
    pub tokenizers: Arc<kvplane_api::Tokenizers>,
}

impl<P: Proposer> Context<P> {
    fn leading(&self) -> bool {
        (self.leading)()
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
        change: Command::config_change(current, desired, Some(owner)),
        kept_last: 0,
    }
}

/// Why a worker set's `tokenizer` directory does not load on this node (`spec.tokenizer: ...`).
pub(crate) fn tokenizer_problem(
    tokenizers: &kvplane_api::Tokenizers,
    spec: &kvplane_policy::kinds::InferenceWorkerSetSpec,
) -> Option<kvplane_policy::ParseError> {
    let dir = std::path::Path::new(spec.tokenizer.as_deref()?);
    tokenizers
        .check(dir)
        .err()
        .map(|e| kvplane_policy::ParseError::new("spec.tokenizer", e.to_string()))
}
