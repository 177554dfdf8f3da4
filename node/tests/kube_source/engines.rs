//! Engines found in Kubernetes, against the same fake API server: a worker set's selector and
//! an Inference Extension `InferencePool` it names become workers at their pods' addresses,
//! routable while the pods are ready, following pods that come, change and go.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvplane_node::sources::{
    self,
    kube_engines::{self, KubeEnginesMetrics},
};
use kvplane_raft::RaftMember;
use kvplane_state::{Command, Owner, Proposer, StateHandle};
use serde_json::{Value, json};

use super::fake_api::{FakeApi, key};
use super::{NS, one_member, wait};

struct Engines {
    state: StateHandle,
    leading: Arc<AtomicBool>,
    metrics: Arc<KubeEnginesMetrics>,
    member: RaftMember,
    _stop: tokio::sync::watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

async fn start(api: &FakeApi) -> Engines {
    let (member, dir) = one_member().await;
    let leading = Arc::new(AtomicBool::new(true));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let l = leading.clone();
    let metrics = Arc::new(KubeEnginesMetrics::default());
    tokio::spawn(kube_engines::run(
        api.client(NS),
        NS.into(),
        Duration::from_millis(50),
        sources::Context {
            log: member.log.clone(),
            state: member.handle.clone(),
            leading: Arc::new(move || l.load(Ordering::SeqCst)),
            synced: Arc::new(tokio::sync::watch::channel(0).0),
            tokenizers: Arc::default(),
        },
        metrics.clone(),
        stop_rx,
    ));
    Engines {
        state: member.handle.clone(),
        leading,
        metrics,
        member,
        _stop: stop,
        _dir: dir,
    }
}

impl Engines {
    /// Waits for `n` more passes of the source (each one compares the pods with the state
    /// while leading, and proposes what differs before it counts).
    async fn passes(&self, n: u64) {
        let until = self.metrics.passes() + n;
        wait("passes", || (self.metrics.passes() >= until).then_some(())).await;
    }

    async fn worker_set(&self, spec: Value) {
        self.member
            .log
            .propose(Command::ConfigPut {
                kind: "InferenceWorkerSet".into(),
                name: "llama".into(),
                value: serde_json::to_vec(&spec).unwrap(),
                owner: Some(Owner::Admin),
            })
            .await
            .unwrap();
    }

    /// The worker set's workers as (name, routable, address), once they are `want`.
    async fn workers_become(&self, what: &str, want: &[(&str, bool, &str)]) {
        let want: Vec<(String, bool, String)> = want
            .iter()
            .map(|(n, up, a)| ((*n).to_owned(), *up, (*a).to_owned()))
            .collect();
        wait(what, || {
            let have: Vec<(String, bool, String)> = self
                .state
                .load()
                .workers()
                .map(|w| {
                    let address = w.address.as_deref().unwrap_or("").to_owned();
                    (w.name.to_string(), w.up, address)
                })
                .collect();
            (have == want).then_some(())
        })
        .await;
    }
}

fn pod(name: &str, app: &str, ip: Option<&str>, ready: bool) -> Value {
    let mut status = json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status,
    })
}

/// An `InferencePool` as the Inference Extension's v1 API defines it (selector, one target
/// port, the endpoint picker it names: kvplane).
fn inference_pool(app: &str, port: u16) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama-pool", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "kvplane", "port": {"number": 7070}, "failureMode": "FailClose"},
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selectors_pods_are_workers_at_their_addresses_routable_while_ready() {
    let api = FakeApi::default();
    api.apply("pods", pod("llama-0", "llama", Some("10.1.0.1"), true));
    api.apply("pods", pod("llama-1", "llama", Some("10.1.0.2"), false));
    api.apply("pods", pod("llama-2", "llama", None, false));
    api.apply("pods", pod("other-0", "other", Some("10.1.0.9"), true));
    let e = start(&api).await;
    e.worker_set(json!({
        "model": "llama-8b",
        "selector": {"matchLabels": {"app": "llama"}, "port": 8000},
    }))
    .await;
    e.workers_become(
        "the selector's pods with an IP, routable while ready",
        &[
            ("llama-0", true, "http://10.1.0.1:8000"),
            ("llama-1", false, "http://10.1.0.2:8000"),
        ],
    )
    .await;

    // Converged: later passes propose nothing.
    let settled = e.state.load().applied_index;
    e.passes(3).await;
    assert_eq!(e.state.load().applied_index, settled);

    // llama-1 turns ready, llama-2 gets its IP, llama-0 goes away (never streamed: forgotten).
    api.apply("pods", pod("llama-1", "llama", Some("10.1.0.2"), true));
    api.apply("pods", pod("llama-2", "llama", Some("fd00::3"), true));
    api.delete("pods", "llama-0");
    e.workers_become(
        "the pods as they are now",
        &[
            ("llama-1", true, "http://10.1.0.2:8000"),
            ("llama-2", true, "http://[fd00::3]:8000"),
        ],
    )
    .await;

    // A follower proposes nothing: passes go by while the pod's change waits for a leader.
    e.leading.store(false, Ordering::SeqCst);
    e.passes(1).await;
    let before = e.state.load().applied_index;
    api.apply("pods", pod("llama-1", "llama", Some("10.1.0.2"), false));
    e.passes(3).await;
    assert_eq!(e.state.load().applied_index, before);
    e.leading.store(true, Ordering::SeqCst);
    e.workers_become(
        "the change applied once leading again",
        &[
            ("llama-1", false, "http://10.1.0.2:8000"),
            ("llama-2", true, "http://[fd00::3]:8000"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_pool_tells_which_pods_a_worker_set_routes_over() {
    let api = FakeApi::default();
    let pools = key("inference.networking.k8s.io", "inferencepools");
    api.apply("pods", pod("llama-0", "llama", Some("10.1.0.1"), true));
    api.apply("pods", pod("llama-1", "llama", Some("10.1.0.2"), true));
    let e = start(&api).await;
    e.worker_set(json!({"model": "llama-8b", "inferencePoolRef": "llama-pool"}))
        .await;
    // Not created yet: nothing to route to, and nothing proposed over and over.
    e.passes(2).await;
    let idle = e.state.load().applied_index;
    e.passes(3).await;
    assert_eq!(e.state.load().applied_index, idle);
    assert_eq!(e.state.load().workers().count(), 0);
    api.apply(&pools, inference_pool("llama", 8000));
    e.workers_become(
        "the InferencePool's pods on its target port",
        &[
            ("llama-0", true, "http://10.1.0.1:8000"),
            ("llama-1", true, "http://10.1.0.2:8000"),
        ],
    )
    .await;
    api.apply(&pools, inference_pool("llama", 8001));
    e.workers_become(
        "the new target port",
        &[
            ("llama-0", true, "http://10.1.0.1:8001"),
            ("llama-1", true, "http://10.1.0.2:8001"),
        ],
    )
    .await;
    // The InferencePool deleted: its worker set has no pods.
    api.delete(&pools, "llama-pool");
    e.workers_become("no pods without the InferencePool", &[])
        .await;
}
