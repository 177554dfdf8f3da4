//! Engines found in Kubernetes: the pods of every worker set with a `selector`, or with an
//! `inferencePoolRef` naming an `InferencePool` of the Gateway API Inference Extension
//! (`inference.networking.k8s.io/v1`: its selector and target port). Pods (and, once a worker
//! set names one, InferencePools) of one namespace are watched by kube's runtime watchers on
//! every node; while this node leads, each worker set whose pods differ from what the
//! replicated state holds gets one `Endpoints` entry with every pod it has now: name, address
//! (`http://<pod IP>:<port>`) and readiness. KV events and load still come from each pod's
//! bridge over NATS, under the pod's name: the worker Kubernetes reports and the one its
//! bridge streams for are one worker.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, stream::BoxStream};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use kvplane_policy::kinds::InferenceWorkerSetSpec;
use kvplane_state::{Command, DiscoveredEndpoint, EndpointsUpdate, Found, Proposer, View};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::sync::watch;

use super::Context;

/// `[kubernetes_engines]` of the node config.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KubeEnginesSection {
    /// The namespace whose pods (and InferencePools) are the engines (default: the client's,
    /// which in a pod is the pod's own).
    pub namespace: Option<String>,
    /// How often the leader compares even when no pod changed (a worker set's new selector is
    /// seen within this).
    pub resync_ms: u64,
}

impl Default for KubeEnginesSection {
    fn default() -> Self {
        Self {
            namespace: None,
            resync_ms: 1_000,
        }
    }
}

/// What the source did, for `/metrics`.
#[derive(Debug, Default)]
pub struct KubeEnginesMetrics {
    applied: Counter,
    unresolved: Gauge,
    errors: Counter,
    passes: Counter,
}

impl KubeEnginesMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_kube_engines_changes_applied",
            "Worker sets' endpoints from Kubernetes committed to the replicated state",
            self.applied.clone(),
        );
        r.register(
            "kvplane_kube_engines_unresolved_worker_sets",
            "Worker sets whose inferencePoolRef names no InferencePool",
            self.unresolved.clone(),
        );
        r.register(
            "kvplane_kube_engines_errors",
            "Watch and proposal errors",
            self.errors.clone(),
        );
        r.register(
            "kvplane_kube_engines_passes",
            "Comparisons of the pods with the state (while leading) or of nothing (while following), after the pods were listed",
            self.passes.clone(),
        );
    }

    /// Passes so far (see `kvplane_kube_engines_passes`).
    pub fn passes(&self) -> u64 {
        self.passes.get()
    }
}

/// The Gateway API Inference Extension's `InferencePool` (v1).
pub fn inference_pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    )
}

/// The part of an InferencePool's spec that says where its engines are (the rest is the
/// Inference Extension's to validate; unknown fields are its own).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InferencePoolSpec {
    selector: LabelSelector,
    #[serde(default)]
    target_ports: Vec<PortNumber>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LabelSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct PortNumber {
    number: u16,
}

/// Which pods a worker set's engines are, and on which port.
#[derive(Debug, Clone, PartialEq)]
pub struct PodsOf {
    pub labels: BTreeMap<String, String>,
    pub port: u16,
}

/// Why a worker set's pods cannot be told.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unresolved {
    #[error("no inference pool {0:?}: its worker set has no pods")]
    NoInferencePool(String),
    #[error("inference pool {name:?} cannot be read: {reason}")]
    BadInferencePool { name: String, reason: String },
    #[error("inference pools are not listed yet (are the inference extension's crds installed)")]
    NotListed,
}

/// The pods of worker set `spec`, if it finds its engines in Kubernetes (`None`: it does not).
pub fn pods_of(
    spec: &InferenceWorkerSetSpec,
    inference_pools: Option<&BTreeMap<String, serde_json::Value>>,
) -> Option<Result<PodsOf, Unresolved>> {
    if let Some(s) = &spec.selector {
        return Some(Ok(PodsOf {
            labels: s.match_labels.clone(),
            port: s.port,
        }));
    }
    let name = spec.inference_pool_ref.as_ref()?;
    let Some(inference_pools) = inference_pools else {
        return Some(Err(Unresolved::NotListed));
    };
    let Some(spec) = inference_pools.get(name) else {
        return Some(Err(Unresolved::NoInferencePool(name.clone())));
    };
    let bad = |reason: String| Unresolved::BadInferencePool {
        name: name.clone(),
        reason,
    };
    Some(
        InferencePoolSpec::deserialize(spec)
            .map_err(|e| bad(e.to_string()))
            .and_then(|p| {
                let port = p
                    .target_ports
                    .first()
                    .map(|t| t.number)
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad("spec.targetPorts names no port".into()))?;
                if p.selector.match_labels.is_empty() {
                    return Err(bad("spec.selector.matchLabels is empty".into()));
                }
                Ok(PodsOf {
                    labels: p.selector.match_labels,
                    port,
                })
            }),
    )
}

/// The endpoint `pod` is for `of`, if it is one: its labels hold the selector's and it has an
/// IP. Ready when its `Ready` condition is true and it is not being deleted.
pub fn endpoint(pod: &Pod, of: &PodsOf) -> Option<DiscoveredEndpoint> {
    let labels = pod.metadata.labels.as_ref();
    let selected = of
        .labels
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
    let status = pod.status.as_ref()?;
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    if !selected || matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let ready = pod.metadata.deletion_timestamp.is_none()
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    };
    Some(DiscoveredEndpoint {
        worker: pod.name_any(),
        address: format!("http://{host}:{}", of.port),
        ready,
    })
}

/// The `Endpoints` entries that make the state's worker sets' endpoints equal to what `pods`
/// and `inference_pools` (by name, their specs; `None`: not listed) say, and the worker sets
/// whose pods cannot be told (left as they are).
pub fn changes(
    view: &View,
    pods: &[Arc<Pod>],
    inference_pools: Option<&BTreeMap<String, serde_json::Value>>,
) -> (Vec<EndpointsUpdate>, Vec<(String, Unresolved)>) {
    let mut updates = Vec::new();
    let mut unresolved = Vec::new();
    for (name, ws) in &view.catalog.worker_sets {
        let mut want: Vec<DiscoveredEndpoint> = match pods_of(ws, inference_pools) {
            None => continue,
            Some(Ok(of)) => pods.iter().filter_map(|p| endpoint(p, &of)).collect(),
            // Listed, and not there (deleted, or not created yet): no pods are its.
            Some(Err(why @ Unresolved::NoInferencePool(_))) => {
                unresolved.push((name.clone(), why));
                Vec::new()
            }
            Some(Err(why)) => {
                unresolved.push((name.clone(), why));
                continue;
            }
        };
        want.sort();
        // What the state holds from Kubernetes: a worker it reports is routable while ready,
        // at its address (a static endpoint left from before the selector is gone already).
        let have: Vec<DiscoveredEndpoint> = view
            .pools
            .get(name)
            .into_iter()
            .flat_map(|p| p.workers.iter())
            .filter(|w| w.found == Some(Found::Kubernetes))
            .map(|w| DiscoveredEndpoint {
                worker: w.name.to_string(),
                address: w.address.as_deref().unwrap_or_default().to_owned(),
                ready: w.up,
            })
            .collect();
        if want != have {
            updates.push(EndpointsUpdate {
                pool: name.clone(),
                endpoints: want,
            });
        }
    }
    (updates, unresolved)
}

type Events = BoxStream<'static, watcher::Result<()>>;

/// Keeps every Kubernetes-found worker set's endpoints in the replicated state equal to its
/// pods in `namespace` while this node leads, until `stop`.
pub async fn run(
    client: Client,
    namespace: String,
    resync: Duration,
    node: Context<impl Proposer>,
    metrics: Arc<KubeEnginesMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pool_api: Api<DynamicObject> =
        Api::namespaced_with(client, &namespace, &inference_pool_resource());
    let (pods, pod_writer) = reflector::store();
    let events = watcher(pod_api, watcher::Config::default()).default_backoff();
    let mut pod_events: Events = reflector(pod_writer, events).map(|e| e.map(|_| ())).boxed();
    // InferencePools are watched from the first worker set that names one on (their CRD may
    // not be installed where no one uses them).
    let mut pool_store: Option<reflector::Store<DynamicObject>> = None;
    let mut pool_events: Option<Events> = None;
    let mut tick = tokio::time::interval(resync);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(namespace, "watching engine pods in kubernetes");
    loop {
        tokio::select! {
            e = pod_events.next() => match e {
                Some(Ok(())) => drain(&mut pod_events, &metrics, "pods"),
                Some(Err(e)) => { watch_error(&metrics, "pods", &e); continue; }
                None => return,
            },
            Some(e) = async { match pool_events.as_mut() {
                Some(s) => s.next().await,
                None => std::future::pending().await,
            } } => match e {
                Ok(()) => {
                    if let Some(s) = pool_events.as_mut() {
                        drain(s, &metrics, "inferencepools");
                    }
                }
                Err(e) => { watch_error(&metrics, "inferencepools", &e); continue; }
            },
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let view = node.state.load();
        let wants_pools = view
            .catalog
            .worker_sets
            .values()
            .any(|w| w.inference_pool_ref.is_some());
        if wants_pools && pool_events.is_none() {
            let writer = reflector::store::Writer::new(inference_pool_resource());
            let store = writer.as_reader();
            let events = watcher(pool_api.clone(), watcher::Config::default()).default_backoff();
            pool_events = Some(reflector(writer, events).map(|e| e.map(|_| ())).boxed());
            pool_store = Some(store);
            tracing::info!(namespace, "watching inference pools in kubernetes");
        }
        if pods.wait_until_ready().now_or_never().is_none() {
            continue;
        }
        if !node.leading() {
            metrics.unresolved.set(0);
            metrics.passes.inc();
            continue;
        }
        let inference_pools: Option<BTreeMap<String, serde_json::Value>> = pool_store
            .as_ref()
            .filter(|s| s.wait_until_ready().now_or_never().is_some())
            .map(|s| {
                s.state()
                    .into_iter()
                    .map(|o| {
                        (
                            o.name_any(),
                            o.data.get("spec").cloned().unwrap_or_default(),
                        )
                    })
                    .collect()
            });
        let (updates, unresolved) = changes(&view, &pods.state(), inference_pools.as_ref());
        metrics
            .unresolved
            .set(i64::try_from(unresolved.len()).unwrap_or(i64::MAX));
        for (ws, why) in &unresolved {
            tracing::debug!(worker_set = ws, reason = %why, "worker set's pods cannot be told");
        }
        for u in updates {
            let (pool, n) = (u.pool.clone(), u.endpoints.len());
            match node.log.propose(Command::Endpoints(u)).await {
                Ok(index) => {
                    metrics.applied.inc();
                    tracing::info!(
                        worker_set = pool,
                        endpoints = n,
                        index,
                        "engines from kubernetes applied"
                    );
                }
                Err(e) => {
                    metrics.errors.inc();
                    tracing::warn!(worker_set = pool, error = %e, "engines from kubernetes not applied");
                }
            }
        }
        metrics.passes.inc();
    }
}

/// Takes every event that is already here, so one pass follows a burst.
fn drain(events: &mut Events, metrics: &KubeEnginesMetrics, what: &str) {
    while let Some(Some(e)) = events.next().now_or_never() {
        if let Err(e) = e {
            watch_error(metrics, what, &e);
        }
    }
}

fn watch_error(metrics: &KubeEnginesMetrics, what: &str, e: &watcher::Error) {
    metrics.errors.inc();
    tracing::warn!(what, error = %e, "kubernetes watch failed; retrying");
}
