//! The node's metrics: every component's families in one registry, and the state machine's own.

use std::sync::Arc;
use std::time::Duration;

use kvplane_api::{ApiMetrics, QuotaMetrics};
use kvplane_ingest::IngestMetrics;
use kvplane_raft::RaftGauges;
use kvplane_state::{Applied, StateHandle};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::routed_share::ShareMetrics;
use crate::sources::directory::PolicySourceMetrics;
use crate::sources::kube_engines::KubeEnginesMetrics;
use crate::sources::kubernetes::KubeSourceMetrics;
use crate::sources::static_health::EndpointHealthMetrics;

/// The families of every component, registered once.
#[derive(Default)]
pub(super) struct NodeMetrics {
    pub ingest: Arc<IngestMetrics>,
    pub api: Arc<ApiMetrics>,
    pub state: Arc<StateMetrics>,
    pub directory: Arc<PolicySourceMetrics>,
    pub kubernetes: Arc<KubeSourceMetrics>,
    pub kube_engines: Arc<KubeEnginesMetrics>,
    pub endpoint_health: Arc<EndpointHealthMetrics>,
    pub share: Arc<ShareMetrics>,
    pub quota: QuotaMetrics,
    pub raft: Arc<RaftGauges>,
}

impl NodeMetrics {
    /// Registers every family; the Kubernetes sources' only when they run.
    pub(super) fn register(&self, r: &mut Registry, kubernetes: bool, kube_engines: bool) {
        self.ingest.register(r);
        self.api.register(r);
        self.state.register(r);
        self.directory.register(r);
        self.share.register(r);
        self.quota.register(r);
        self.raft.register(r);
        self.endpoint_health.register(r);
        if kubernetes {
            self.kubernetes.register(r);
        }
        if kube_engines {
            self.kube_engines.register(r);
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// State-machine metrics of this replica.
#[derive(Debug, Default)]
pub(super) struct StateMetrics {
    applied_index: Gauge,
    indexed_blocks: Gauge,
    kv_events: Counter,
    dropped: Family<ReasonLabel, Counter>,
    leases_expired: Counter,
    /// Workers already logged as sending for a pool that does not exist (at most 1,024).
    unknown_pool_logged: std::sync::Mutex<std::collections::BTreeSet<(String, String)>>,
}

impl StateMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_state_applied_index",
            "Log index of the last applied entry",
            self.applied_index.clone(),
        );
        r.register(
            "kvplane_state_indexed_blocks",
            "GPU blocks in the prefix index",
            self.indexed_blocks.clone(),
        );
        r.register(
            "kvplane_state_kv_events",
            "vLLM KV events applied",
            self.kv_events.clone(),
        );
        r.register(
            "kvplane_state_worker_leases_expired",
            "Workers taken down because nothing was heard from them for a lease",
            self.leases_expired.clone(),
        );
        r.register(
            "kvplane_state_dropped_events",
            "Items the state machine dropped, by reason",
            self.dropped.clone(),
        );
    }

    /// Counters, from what one entry did.
    pub(super) fn observe(&self, a: &Applied) {
        self.kv_events.inc_by(a.kv_events);
        if !a.unknown_pool.is_empty() {
            let mut logged = self
                .unknown_pool_logged
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (pool, worker) in &a.unknown_pool {
                if logged.len() < 1024 && logged.insert((pool.clone(), worker.clone())) {
                    tracing::warn!(
                        pool,
                        worker,
                        "messages for a pool the cluster does not know are dropped (unknown_pool): declare the pool or fix the bridge's --pool"
                    );
                }
            }
        }
        for (pool, worker) in &a.expired {
            self.leases_expired.inc();
            tracing::warn!(
                pool,
                worker,
                "nothing heard from the worker for a lease; taken down"
            );
        }
        for (reason, n) in &a.dropped {
            self.dropped
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .inc_by(*n);
        }
    }

    /// Refreshes the gauges from the view readers see every half second, until `stop`
    /// (entries are applied inside Raft, which knows nothing of them).
    pub(super) async fn follow(
        self: Arc<Self>,
        handle: StateHandle,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            let view = handle.load();
            self.applied_index
                .set(i64::try_from(view.applied_index).unwrap_or(i64::MAX));
            self.indexed_blocks
                .set(i64::try_from(view.indexed_blocks).unwrap_or(i64::MAX));
            drop(view);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return,
            }
        }
    }
}
