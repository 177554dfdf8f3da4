//! Engines known from outside the stream: a worker set's static `endpoints`, and the pods
//! Kubernetes runs for its `selector` (or for the Inference Extension's `InferencePool` it
//! names). Such a worker is routable while its source says it is ready, at the address its
//! source gives, whether or not a bridge streams for it; its stream (KV events, metrics,
//! announcements, the lease) decides only what it caches and how loaded it looks. A worker
//! known from both is one worker: the same `(pool, worker)` key.

use serde::{Deserialize, Serialize};

use crate::machine::{StateMachine, Worker, worker_fact};
use crate::{ApplyError, WorkerMetrics};

/// Where a worker's endpoint comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Found {
    /// The worker set's `spec.endpoints`.
    Static,
    /// Pods Kubernetes reports for the worker set's selector (or its `InferencePool`).
    Kubernetes,
}

impl Found {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Kubernetes => "kubernetes",
        }
    }
}

/// What a worker's endpoint source says of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Discovered {
    /// Where requests go, e.g. `http://10.0.0.7:8000`.
    pub address: String,
    /// Whether the source says it serves (a pod's `Ready` condition; static endpoints always).
    pub ready: bool,
    pub found: Found,
}

/// One endpoint of a pool as its source reports it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DiscoveredEndpoint {
    /// The worker's name (a pod's name; its bridge publishes under the same one).
    pub worker: String,
    pub address: String,
    pub ready: bool,
}

/// What the leader's health checks found of a worker set's static endpoints: each one named
/// answers or not. Endpoints not named keep what they had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthUpdate {
    pub pool: String,
    pub endpoints: Vec<EndpointHealth>,
}

/// One endpoint as a health check found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointHealth {
    pub worker: String,
    /// The address checked: a result for an address the worker set no longer lists for the
    /// worker changes nothing.
    pub address: String,
    pub ready: bool,
}

/// Every endpoint Kubernetes reports for one pool now: workers of the pool left out have no
/// Kubernetes endpoint any more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointsUpdate {
    pub pool: String,
    pub endpoints: Vec<DiscoveredEndpoint>,
}

/// Why an entry about `pool`'s endpoints is refused.
fn refused(pool: &str, reason: &str) -> ApplyError {
    ApplyError::InvalidConfig {
        kind: kvplane_policy::Kind::WorkerSet.as_str().into(),
        name: pool.to_owned(),
        reason: reason.into(),
    }
}

impl StateMachine {
    /// Applies what Kubernetes reports for a pool whose worker set finds its engines there.
    pub(crate) fn apply_endpoints(&mut self, update: &EndpointsUpdate) -> Result<(), ApplyError> {
        let refuse = |reason: &str| refused(&update.pool, reason);
        let Some(ws) = self.catalog.worker_sets.get(&update.pool) else {
            return Err(refuse(
                "no such worker set: its endpoints cannot come from kubernetes",
            ));
        };
        if !ws.finds_engines_in_kubernetes() {
            return Err(refuse(
                "it has no selector or inferencePool: its endpoints do not come from kubernetes",
            ));
        }
        let endpoints = update.endpoints.iter().map(|e| {
            let found = Discovered {
                address: e.address.clone(),
                ready: e.ready,
                found: Found::Kubernetes,
            };
            (e.worker.as_str(), found)
        });
        self.set_discovered(&update.pool, endpoints.collect());
        self.dirty.pools.insert(update.pool.clone());
        Ok(())
    }

    /// Applies what the leader's health checks found of `pool`'s static endpoints: a listed
    /// worker that does not answer is not routable until it answers again. Workers the worker
    /// set no longer lists are left alone (the list changed after the checks ran).
    pub(crate) fn apply_health(&mut self, update: &HealthUpdate) -> Result<(), ApplyError> {
        let refuse = |reason: &str| refused(&update.pool, reason);
        let Some(ws) = self.catalog.worker_sets.get(&update.pool) else {
            return Err(refuse(
                "no such worker set: its endpoints cannot be checked",
            ));
        };
        if ws.finds_engines_in_kubernetes() || ws.endpoints.is_empty() {
            return Err(refuse(
                "it lists no endpoints: only static endpoints are health-checked by kvplane",
            ));
        }
        for e in &update.endpoints {
            let key = (update.pool.clone(), e.worker.clone());
            let Some(worker) = self.workers.get_mut(&key) else {
                continue;
            };
            if !worker.discovered.as_ref().is_some_and(|d| {
                d.found == Found::Static && d.address == e.address && d.ready != e.ready
            }) {
                continue;
            }
            let before = worker_fact(&key.0, &key.1, worker);
            if let Some(d) = worker.discovered.as_mut() {
                d.ready = e.ready;
            }
            let after = worker_fact(&key.0, &key.1, worker);
            self.parts.workers = self.parts.workers.wrapping_sub(before).wrapping_add(after);
        }
        self.dirty.pools.insert(update.pool.clone());
        Ok(())
    }

    /// Makes the static endpoints of worker set `pool` its workers' endpoints (when it lists
    /// them, or finds none anywhere: a worker set that stops listing endpoints leaves its
    /// workers to their streams).
    pub(crate) fn apply_static_endpoints(
        &mut self,
        pool: &str,
        spec: &kvplane_policy::kinds::InferenceWorkerSetSpec,
    ) {
        if spec.finds_engines_in_kubernetes() {
            // Kubernetes tells the rest; a static endpoint left from before is no one's now.
            let kept: Vec<(String, Discovered)> = self
                .workers
                .range((pool.to_owned(), String::new())..)
                .take_while(|((p, _), _)| p == pool)
                .filter_map(|((_, n), w)| {
                    let d = w.discovered.as_ref()?;
                    (d.found != Found::Static).then(|| (n.clone(), d.clone()))
                })
                .collect();
            let kept = kept.iter().map(|(n, d)| (n.as_str(), d.clone())).collect();
            self.set_discovered(pool, kept);
            return;
        }
        // A listed endpoint is ready until a health check says otherwise; one listed again at
        // the same address keeps what the checks last said of it.
        let endpoints: Vec<(&str, Discovered)> = spec
            .endpoints
            .iter()
            .map(|e| {
                let ready = self
                    .workers
                    .get(&(pool.to_owned(), e.worker.clone()))
                    .and_then(|w| w.discovered.as_ref())
                    .filter(|d| d.found == Found::Static && d.address == e.address)
                    .is_none_or(|d| d.ready);
                let found = Discovered {
                    address: e.address.clone(),
                    ready,
                    found: Found::Static,
                };
                (e.worker.as_str(), found)
            })
            .collect();
        self.set_discovered(pool, endpoints);
    }

    /// Sets the endpoints of `pool`'s workers to `endpoints` (by worker name): a listed worker
    /// not known yet is created, its stream not started; a known one not listed keeps only
    /// what its stream says, and is forgotten when its stream never started (a pod gone
    /// before its bridge spoke leaves nothing behind).
    fn set_discovered(&mut self, pool: &str, mut endpoints: Vec<(&str, Discovered)>) {
        endpoints.sort_by(|a, b| a.0.cmp(b.0));
        endpoints.dedup_by(|a, b| a.0 == b.0);
        let range = (pool.to_owned(), String::new())..;
        let mut changed: Vec<(String, Option<Discovered>)> = self
            .workers
            .range(range)
            .take_while(|((p, _), _)| p == pool)
            .filter(|((_, n), w)| {
                w.discovered.is_some() && endpoints.binary_search_by(|e| e.0.cmp(n)).is_err()
            })
            .map(|((_, n), _)| (n.clone(), None))
            .collect();
        for (name, found) in endpoints {
            let key = (pool.to_owned(), name.to_owned());
            if self.workers.get(&key).and_then(|w| w.discovered.as_ref()) != Some(&found) {
                changed.push((name.to_owned(), Some(found)));
            }
        }
        for (name, found) in changed {
            let key = (pool.to_owned(), name);
            let before = self
                .workers
                .get(&key)
                .map_or(0, |w| worker_fact(&key.0, &key.1, w));
            if found.is_none() && self.workers.get(&key).is_some_and(|w| w.awaiting_stream) {
                self.workers.remove(&key);
                self.parts.workers = self.parts.workers.wrapping_sub(before);
                continue;
            }
            let next_id = &mut self.next_worker_id;
            let worker = self.workers.entry(key.clone()).or_insert_with(|| {
                let id = *next_id;
                *next_id += 1;
                Worker {
                    id,
                    up: false,
                    address: None,
                    metrics: WorkerMetrics::default(),
                    metrics_index: 0,
                    metrics_at_ms: 0,
                    heard_ms: 0,
                    discovered: None,
                    awaiting_stream: true,
                }
            });
            worker.discovered = found;
            let after = worker_fact(&key.0, &key.1, worker);
            self.parts.workers = self.parts.workers.wrapping_sub(before).wrapping_add(after);
        }
    }
}
