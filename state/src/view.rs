//! What readers see: an immutable view of the state as of one applied index.

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::{Digest, PoolConfig, PoolIndex, WorkerMetrics};

/// The state as of `applied_index`. The prefix index inside each pool is live: it may already
/// hold events of the entry being applied, never fewer than those of `applied_index`.
#[derive(Debug, Clone)]
pub struct View {
    pub applied_index: u64,
    /// Index of the last configuration change.
    pub config_index: u64,
    /// The last message applied of the ingest stream (the default source).
    pub last_stream_seq: u64,
    /// The last message applied of every source (the ingest stream's too, once it has one).
    pub positions: BTreeMap<crate::Source, u64>,
    pub digest: Digest,
    pub indexed_blocks: u64,
    /// Shared with earlier Views while nothing in the pool changed; the map itself is
    /// persistent, so publishing an entry that changed one pool costs the same however many
    /// pools there are.
    pub pools: imbl::OrdMap<String, Arc<PoolView>>,
    pub dropped: BTreeMap<&'static str, u64>,
    /// The policy objects (always consistent); `config_index` is their generation.
    pub catalog: Arc<kvplane_policy::Catalog>,
    /// Who wrote each config object, by (kind, name); objects from before owners are absent.
    pub owners: Arc<BTreeMap<(String, String), crate::Owner>>,
    /// Tenant limits' escrow: every replica's grants in the current windows.
    pub quota: Arc<crate::Ledger>,
}

#[derive(Debug, Clone)]
pub struct PoolView {
    pub name: String,
    pub config: PoolConfig,
    pub index: Arc<PoolIndex>,
    /// Sorted by name.
    pub workers: Vec<WorkerView>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub pool: String,
    /// Shared with the candidates of every decision that reads it.
    pub name: Arc<str>,
    pub id: u64,
    /// Whether requests may go to it: what its endpoint source says when it has one (static
    /// endpoints, Kubernetes), else what its stream says.
    pub up: bool,
    /// Whether its stream is up (its bridge announced it and its lease holds): its KV events
    /// and metrics count.
    pub streaming: bool,
    /// Where its endpoint comes from, when its worker set's static endpoints or Kubernetes
    /// know it (`up` and `address` are then what they say).
    pub found: Option<crate::Found>,
    /// Where requests go: the endpoint source's address, else the one its bridge announced.
    pub address: Option<Arc<str>>,
    pub metrics: WorkerMetrics,
    /// Index of the entry that carried the last metrics (0: none yet).
    pub metrics_index: u64,
    /// Proposer time of that entry.
    pub metrics_at_ms: u64,
    /// Proposer time of the entry with its last stream message (see [`crate::Command::ExpireLeases`]).
    pub heard_ms: u64,
    pub indexed_blocks: u64,
}

impl View {
    pub(crate) fn empty() -> Self {
        Self {
            applied_index: 0,
            config_index: 0,
            last_stream_seq: 0,
            positions: BTreeMap::new(),
            digest: Digest::default(),
            indexed_blocks: 0,
            pools: imbl::OrdMap::new(),
            dropped: BTreeMap::new(),
            catalog: Arc::default(),
            owners: Arc::default(),
            quota: Arc::default(),
        }
    }

    /// The owner of config object `kind`/`name`, if it has one.
    pub fn owner(&self, kind: &str, name: &str) -> Option<crate::Owner> {
        self.owners
            .get(&(kind.to_owned(), name.to_owned()))
            .copied()
    }

    pub fn workers(&self) -> impl Iterator<Item = &WorkerView> {
        self.pools.values().flat_map(|p| p.workers.iter())
    }

    /// The highest entry index whose effects a prefix lookup made so far through this View may
    /// have seen: `applied_index` while apply has not written past it, more once it has (the
    /// trees are live; see [`crate::PoolIndex::through`]). Load it after the lookups.
    pub fn index_through(&self) -> u64 {
        self.pools
            .values()
            .map(|p| p.index.through())
            .fold(self.applied_index, u64::max)
    }
}

/// Shared, lock-free access to the latest [`View`].
#[derive(Debug, Clone)]
pub struct StateHandle(Arc<ArcSwap<View>>);

impl StateHandle {
    pub(crate) fn new(view: View) -> Self {
        Self(Arc::new(ArcSwap::from_pointee(view)))
    }

    pub(crate) fn store(&self, view: View) {
        self.0.store(Arc::new(view));
    }

    /// The latest view.
    pub fn load(&self) -> Arc<View> {
        self.0.load_full()
    }
}
