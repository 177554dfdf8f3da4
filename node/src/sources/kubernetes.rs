//! The Kubernetes config source: the six kinds watched in one namespace (kube's runtime
//! watchers, list then watch, restarted with backoff). While this node leads, every change
//! of the watched objects is admitted object by object ([`kvplane_policy::admit`]), the
//! difference to the replicated catalog is proposed as one `ConfigApply` entry, and each
//! object's `Accepted` condition is written back to its status subresource: True with the log
//! index it took effect at, or False with the reason it was refused (its last accepted version
//! stays in force). Status writes that would change nothing are skipped, so the watch does not
//! feed itself.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, stream::BoxStream};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, CustomResourceExt, ResourceExt};
use kvplane_policy::kinds::{
    AccessPolicy, GROUP, GatewayBackend, InferencePolicy, InferencePool, InferenceProvider,
    InferenceWorkerSet, ObjectStatus, VERSION,
};
use kvplane_policy::{Kind, Object, ParseError, Refused, Submitted, admit};
use kvplane_state::{Command, Owner, Proposer, StateHandle};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::sync::watch;

use super::Context;

/// `[policy_kubernetes]` of the node config.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KubeSourceSection {
    /// The namespace whose objects are the policies (default: the client's, which in a pod is
    /// the pod's own).
    pub namespace: Option<String>,
    /// How often the leader reconciles even when nothing changed (retries failed status writes).
    pub resync_ms: u64,
}

impl Default for KubeSourceSection {
    fn default() -> Self {
        Self {
            namespace: None,
            resync_ms: 30_000,
        }
    }
}

/// What the source did, for `/metrics`.
#[derive(Debug, Default)]
pub struct KubeSourceMetrics {
    applied: Counter,
    refused: Gauge,
    status_writes: Counter,
    errors: Counter,
}

impl KubeSourceMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_kube_source_changes_applied",
            "Changes of the watched Kubernetes objects committed to the replicated state",
            self.applied.clone(),
        );
        r.register(
            "kvplane_kube_source_refused_objects",
            "Watched Kubernetes objects currently refused by validation",
            self.refused.clone(),
        );
        r.register(
            "kvplane_kube_source_status_writes",
            "Status subresource updates written",
            self.status_writes.clone(),
        );
        r.register(
            "kvplane_kube_source_errors",
            "Watch, proposal and status-write errors",
            self.errors.clone(),
        );
    }
}

/// The API resource of one kind, from its CRD type.
fn api_resource(kind: Kind) -> ApiResource {
    let crd = match kind {
        Kind::WorkerSet => InferenceWorkerSet::api_resource(),
        Kind::Pool => InferencePool::api_resource(),
        Kind::Provider => InferenceProvider::api_resource(),
        Kind::Policy => InferencePolicy::api_resource(),
        Kind::Backend => GatewayBackend::api_resource(),
        Kind::Access => AccessPolicy::api_resource(),
    };
    debug_assert_eq!(crd.api_version, format!("{GROUP}/{VERSION}"));
    crd
}

type Key = (Kind, String);

/// The watched objects of every kind: kube's reflector stores, and which kinds have been
/// listed completely (before that, a missing object may only not be listed yet).
struct Mirror {
    stores: BTreeMap<Kind, reflector::Store<DynamicObject>>,
    ready: BTreeSet<Kind>,
    /// Worker sets' tokenizer directories, checked before they are admitted.
    tokenizers: Arc<kvplane_api::Tokenizers>,
}

impl Mirror {
    fn seen(&mut self, kind: Kind, event: &watcher::Event<DynamicObject>) {
        if matches!(event, watcher::Event::InitDone) {
            self.ready.insert(kind);
        }
    }

    fn complete(&self) -> bool {
        self.ready.len() == Kind::ALL.len()
    }

    /// Every object, by kind and name (a fixed order).
    fn objects(&self) -> BTreeMap<Key, Arc<DynamicObject>> {
        self.stores
            .iter()
            .flat_map(|(k, s)| s.state().into_iter().map(move |o| ((*k, o.name_any()), o)))
            .collect()
    }
}

fn submitted(
    objects: &BTreeMap<Key, Arc<DynamicObject>>,
    tokenizers: &kvplane_api::Tokenizers,
) -> Vec<Submitted> {
    objects
        .iter()
        .map(|((kind, name), o)| Submitted {
            kind: *kind,
            name: name.clone(),
            object: parse(*kind, name, o)
                .map_err(Refused::from)
                .and_then(|obj| match &obj.spec {
                    kvplane_policy::Spec::WorkerSet(s) => {
                        match super::tokenizer_problem(tokenizers, s) {
                            Some(p) => Err(p.into()),
                            None => Ok(obj),
                        }
                    }
                    _ => Ok(obj),
                }),
        })
        .collect()
}

fn parse(kind: Kind, name: &str, o: &DynamicObject) -> Result<Object, ParseError> {
    let spec = o
        .data
        .get("spec")
        .ok_or_else(|| ParseError::new("spec", "missing"))?;
    let json = serde_json::to_vec(spec).map_err(|e| ParseError::new("spec", e.to_string()))?;
    Object::from_json(kind, name, &json)
}

/// Keeps the objects Kubernetes owns in the replicated catalog equal to the admitted objects
/// of `namespace` while this node leads, until `stop`.
pub async fn run(
    client: Client,
    namespace: String,
    resync: Duration,
    node: Context<impl Proposer>,
    metrics: Arc<KubeSourceMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let apis: BTreeMap<Kind, Api<DynamicObject>> = Kind::ALL
        .into_iter()
        .map(|k| {
            (
                k,
                Api::namespaced_with(client.clone(), &namespace, &api_resource(k)),
            )
        })
        .collect();
    let mut mirror = Mirror {
        stores: BTreeMap::new(),
        ready: BTreeSet::new(),
        tokenizers: node.tokenizers.clone(),
    };
    let mut streams: Vec<
        BoxStream<'static, (Kind, watcher::Result<watcher::Event<DynamicObject>>)>,
    > = Vec::new();
    for (k, api) in &apis {
        let k = *k;
        let writer = reflector::store::Writer::new(api_resource(k));
        mirror.stores.insert(k, writer.as_reader());
        let events = watcher(api.clone(), watcher::Config::default()).default_backoff();
        streams.push(reflector(writer, events).map(move |e| (k, e)).boxed());
    }
    let mut events = futures::stream::select_all(streams);
    // What this node last wrote to each object's status: the watch may not have brought the
    // write back yet when the next reconcile runs.
    let mut written: BTreeMap<Key, ObjectStatus> = BTreeMap::new();
    let mut tick = tokio::time::interval(resync);
    tracing::info!(namespace, "watching policy objects in kubernetes");
    loop {
        tokio::select! {
            e = events.next() => match e {
                Some((kind, Ok(event))) => {
                    mirror.seen(kind, &event);
                    // Take every event that is already here before reconciling once.
                    while let Some(Some((kind, e))) = events.next().now_or_never() {
                        match e {
                            Ok(event) => mirror.seen(kind, &event),
                            Err(e) => watch_error(&metrics, kind, &e),
                        }
                    }
                }
                Some((kind, Err(e))) => {
                    watch_error(&metrics, kind, &e);
                    continue;
                }
                None => return,
            },
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if mirror.complete() && node.leading() {
            reconcile(
                &mirror,
                &apis,
                &node.log,
                &node.state,
                &metrics,
                &mut written,
            )
            .await;
            node.synced.send_modify(|n| *n += 1);
        } else {
            written.clear();
        }
    }
}

fn watch_error(metrics: &KubeSourceMetrics, kind: Kind, e: &watcher::Error) {
    metrics.errors.inc();
    tracing::warn!(%kind, error = %e, "kubernetes watch failed; retrying");
}

async fn reconcile(
    mirror: &Mirror,
    apis: &BTreeMap<Kind, Api<DynamicObject>>,
    log: &impl Proposer,
    state: &StateHandle,
    metrics: &KubeSourceMetrics,
    written: &mut BTreeMap<Key, ObjectStatus>,
) {
    let objects = mirror.objects();
    // A resource deleted and created again is a new object: it gets its status written anew.
    written.retain(|k, _| objects.contains_key(k));
    let view = state.load();
    let mut submitted = submitted(&objects, &mirror.tokenizers);
    for s in &mut submitted {
        if let Some(other) = super::foreign_owner(&view, s.kind, &s.name, Owner::Kubernetes) {
            s.object = Err(Refused::Owned {
                kind: s.kind,
                name: s.name.clone(),
                owner: other.to_string(),
            });
        }
    }
    let current = super::owned(&view, Owner::Kubernetes);
    let admission = admit(&submitted, &current);
    metrics
        .refused
        .set(i64::try_from(admission.refused.len()).unwrap_or(i64::MAX));
    let (puts, _) = current.diff(&admission.catalog);
    let changed: BTreeSet<Key> = puts.iter().map(|o| (o.kind(), o.name.clone())).collect();
    let mut index = None;
    let plan = super::plan(&current, &admission.catalog, Owner::Kubernetes);
    if plan.kept_last > 0 {
        tracing::warn!(
            objects = plan.kept_last,
            "the namespace holds no policy objects: the ones kubernetes owns stay until deleted \
             explicitly (Admin.DeleteConfig with owner kubernetes)"
        );
    }
    if let Some((command, puts, deletes)) = plan.change {
        if let Command::ConfigApply { puts, deletes, .. } = &command {
            tracing::debug!(
                puts = ?puts.iter().map(|p| format!("{}/{}", p.kind, p.name)).collect::<Vec<_>>(),
                deletes = ?deletes.iter().map(|d| format!("{}/{}", d.kind, d.name)).collect::<Vec<_>>(),
                "kubernetes policy change"
            );
        }
        match log.propose(command).await {
            Ok(i) => {
                metrics.applied.inc();
                tracing::info!(index = i, puts, deletes, "kubernetes policy change applied");
                index = Some(i);
            }
            Err(e) => {
                metrics.errors.inc();
                tracing::warn!(error = %e, "kubernetes policy change not applied");
                return;
            }
        }
    }
    let config_index = state.load().config_index;
    for ((kind, name), o) in &objects {
        let key = (*kind, name.clone());
        let seen: ObjectStatus = o
            .data
            .get("status")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_default();
        // The watch may not show this source's last write yet: that write is the newer one.
        let old = written.get(&key).unwrap_or(&seen).clone();
        let applied_index = match (admission.refused.contains_key(&key), index) {
            (false, Some(i)) if changed.contains(&key) => Some(i),
            (false, _) => old.applied_index.or(Some(config_index)),
            (true, _) => old.applied_index,
        };
        let refused = admission.refused.get(&key).map(|why| {
            if admission.catalog.get(*kind, name).is_some() {
                format!("{why}; the last accepted version stays in force")
            } else {
                why.to_string()
            }
        });
        let want = status(o, refused, applied_index, &old);
        if want == seen || written.get(&key) == Some(&want) {
            continue;
        }
        tracing::debug!(%kind, name, applied_index = ?want.applied_index, "writing the status");
        let patch = serde_json::json!({ "status": want });
        match apis[kind]
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                metrics.status_writes.inc();
                written.insert(key, want);
            }
            Err(e) => {
                metrics.errors.inc();
                tracing::warn!(%kind, name, error = %e, "cannot write the status");
            }
        }
    }
}

/// The status `o` should have: its `Accepted` condition (the transition time kept when the
/// condition's status did not change) and the index its spec took effect at.
fn status(
    o: &DynamicObject,
    refused: Option<String>,
    applied_index: Option<u64>,
    old: &ObjectStatus,
) -> ObjectStatus {
    let (status, reason, message) = match refused {
        None => ("True", "Accepted", "in the replicated state".to_owned()),
        Some(why) => ("False", "Invalid", why),
    };
    let previous = old.conditions.iter().find(|c| c.type_ == "Accepted");
    let last_transition_time = match previous {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(k8s_openapi::jiff::Timestamp::now()),
    };
    let mut conditions: Vec<Condition> = old
        .conditions
        .iter()
        .filter(|c| c.type_ != "Accepted")
        .cloned()
        .collect();
    conditions.push(Condition {
        type_: "Accepted".into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: o.metadata.generation,
        last_transition_time,
    });
    ObjectStatus {
        conditions,
        applied_index,
    }
}
