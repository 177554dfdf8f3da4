//! The Kubernetes config source against a fake API server (tower-test's mock service answering as
//! the API server does, see `fake_api.rs`): the example policies as custom
//! resources enter the replicated state (a real state machine behind a one-member Raft
//! log), every object gets its `Accepted` condition, a broken object is refused with its reason
//! while the rest apply, and edits and deletions follow.

#![allow(clippy::unwrap_used)]

mod engines;
mod fake_api;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fake_api::FakeApi;
use kube::CustomResourceExt;
use kvplane_node::sources::{
    self,
    kubernetes::{self as kube_source, KubeSourceMetrics},
};
use kvplane_policy::kinds::{
    GatewayBackend, InferencePolicy, InferencePool, InferenceProvider, InferenceWorkerSet,
};
use kvplane_raft::{RaftMember, RaftSection};
use kvplane_state::{Command, Owner, Proposer, StateHandle};
use serde_json::{Value, json};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
const NS: &str = "fleet";

fn plural(kind: &str) -> String {
    match kind {
        "InferenceWorkerSet" => InferenceWorkerSet::api_resource().plural,
        "InferencePool" => InferencePool::api_resource().plural,
        "InferenceProvider" => InferenceProvider::api_resource().plural,
        "InferencePolicy" => InferencePolicy::api_resource().plural,
        "GatewayBackend" => GatewayBackend::api_resource().plural,
        other => panic!("{other}"),
    }
}

/// The example policy files as API objects: (plural, object).
fn examples() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(EXAMPLES).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let mut v: Value = serde::Deserialize::deserialize(doc).unwrap();
            v["metadata"]["namespace"] = json!(NS);
            out.push((plural(v["kind"].as_str().unwrap()), v));
        }
    }
    out
}

fn object(kind: &str, name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    })
}

fn accepted(status: &Value) -> (&str, &str, i64) {
    let c = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Accepted")
        .unwrap();
    (
        c["status"].as_str().unwrap(),
        c["message"].as_str().unwrap(),
        c["observedGeneration"].as_i64().unwrap(),
    )
}

async fn wait<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    kvplane_testkit::eventually_sync(what, Duration::from_secs(20), f).await
}

struct Source {
    api: FakeApi,
    state: StateHandle,
    leading: Arc<AtomicBool>,
    _stop: tokio::sync::watch::Sender<bool>,
    member: RaftMember,
    _dir: tempfile::TempDir,
}

/// A one-member Raft cluster of its own (a real log and state in a temporary directory;
/// nothing listens, as a single voter talks to no one), leading.
async fn one_member() -> (RaftMember, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let member = RaftMember::start(
        &RaftSection::default(),
        dir.path(),
        "127.0.0.1:1".parse().unwrap(),
        Arc::new(|_| {}),
        kvplane_tls::Dialer::plain(),
    )
    .await
    .unwrap();
    let (_keep, mut never) = tokio::sync::watch::channel(false);
    assert!(member.wait_leadership(&mut never).await);
    (member, dir)
}

/// The source in front of [`one_member`].
async fn start(api: FakeApi) -> Source {
    let (member, dir) = one_member().await;
    let (log, state) = (member.log.clone(), member.handle.clone());
    let leading = Arc::new(AtomicBool::new(false));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let l = leading.clone();
    tokio::spawn(kube_source::run(
        api.client(NS),
        NS.into(),
        Duration::from_millis(50),
        sources::Context {
            log,
            state: state.clone(),
            leading: Arc::new(move || l.load(Ordering::SeqCst)),
            synced: Arc::new(tokio::sync::watch::channel(0).0),
            tokenizers: Arc::default(),
        },
        Arc::new(KubeSourceMetrics::default()),
        stop_rx,
    ));
    Source {
        api,
        state,
        leading,
        _stop: stop,
        member,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_resources_enter_the_state_with_their_status_written_back() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("kvplane_node=debug,info")
        .with_test_writer()
        .try_init();
    let api = FakeApi::default();
    for (plural, o) in examples() {
        api.apply(&plural, o);
    }
    // A pool of a worker set nobody defined.
    let pools = plural("InferencePool");
    api.apply(
        &pools,
        object(
            "InferencePool",
            "broken",
            json!({"workerSets": ["missing"]}),
        ),
    );
    let s = start(api.clone()).await;

    // Not leading: the watches run, nothing is written.
    wait("six watches", || (s.api.served().0 == 6).then_some(())).await;
    assert!(s.state.load().catalog.is_empty());
    assert_eq!(s.api.status_patches(), 0);

    s.leading.store(true, Ordering::SeqCst);
    let catalog = wait("the examples in the state", || {
        let c = s.state.load().catalog.clone();
        (c.backends.len() == 3).then_some(c)
    })
    .await;
    assert_eq!(catalog.worker_sets.len(), 2);
    assert_eq!(
        catalog.pools.keys().map(String::as_str).collect::<Vec<_>>(),
        ["large", "local", "small"]
    );
    assert_eq!(catalog.providers.len(), 1);
    assert_eq!(catalog.policies.len(), 5);
    let first_index = s.state.load().config_index;

    // Every example accepted, at the index it took effect; the broken pool refused.
    let status = wait("the status of every object", || {
        let all: Option<Vec<Value>> = examples()
            .iter()
            .map(|(p, o)| s.api.status(p, o["metadata"]["name"].as_str().unwrap()))
            .collect();
        all.zip(s.api.status(&pools, "broken"))
    })
    .await;
    for st in &status.0 {
        assert_eq!(accepted(st), ("True", "in the replicated state", 1), "{st}");
        assert_eq!(st["appliedIndex"], json!(first_index), "{st}");
    }
    let (ok, why, _) = accepted(&status.1);
    assert_eq!(ok, "False");
    assert!(
        why.contains("spec.workerSets[0]") && why.contains("\"missing\" does not exist"),
        "{why}"
    );

    let objects = status.0.len() + 1;

    // An edit: the public name backed by the small model only.
    let backends = plural("GatewayBackend");
    api.apply(
        &backends,
        object(
            "GatewayBackend",
            "standard",
            json!({"publicModel": "standard-model", "backends": [{"model": "llama-8b"}]}),
        ),
    );
    let edited = wait("the edit applied", || {
        let v = s.state.load();
        (v.catalog.backends["standard"].backends.len() == 1).then_some(v.config_index)
    })
    .await;
    assert!(edited > first_index);
    let st = wait("the edit's status", || {
        s.api
            .status(&backends, "standard")
            .filter(|st| st["appliedIndex"] == json!(edited))
    })
    .await;
    assert_eq!(accepted(&st).2, 2);

    // A broken edit of a live pool: refused, and the accepted version stays.
    api.apply(
        &pools,
        object(
            "InferencePool",
            "large",
            json!({"workerSets": ["large-a100", "gone"]}),
        ),
    );
    let st = wait("the broken edit refused", || {
        s.api
            .status(&pools, "large")
            .filter(|st| accepted(st).0 == "False")
    })
    .await;
    assert!(accepted(&st).1.contains("stays in force"), "{st}");
    assert_eq!(st["appliedIndex"], json!(first_index));
    assert_eq!(
        s.state.load().catalog.pools["large"].worker_sets,
        ["large-a100"]
    );

    // A deletion leaves the state.
    api.delete(&backends, "standard");
    wait("the deletion applied", || {
        (!s.state.load().catalog.backends.contains_key("standard")).then_some(())
    })
    .await;
    // One status write per object, and one per change since (the source resyncs every 50 ms:
    // writes that would change nothing, and its own writes coming back, are skipped).
    assert_eq!(s.api.status_patches(), objects + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_another_source_owns_is_refused_with_its_owner_in_the_status() {
    let api = FakeApi::default();
    let providers = plural("InferenceProvider");
    let spec = |model: &str| json!({"endpoint": "https://p.example/v1", "api": "OpenAI", "model": model, "expectedTtftMs": 500});
    api.apply(
        &providers,
        object("InferenceProvider", "by-admin", spec("k")),
    );
    api.apply(
        &providers,
        object("InferenceProvider", "by-kube", spec("k")),
    );
    let s = start(api.clone()).await;
    // Admin wrote "by-admin" first.
    s.member
        .log
        .propose(Command::ConfigPut {
            kind: "InferenceProvider".into(),
            name: "by-admin".into(),
            value: serde_json::to_vec(&spec("a")).unwrap(),
            owner: Some(Owner::Admin),
        })
        .await
        .unwrap();
    s.leading.store(true, Ordering::SeqCst);
    let (theirs, mine) = wait("both statuses", || {
        s.api
            .status(&providers, "by-admin")
            .zip(s.api.status(&providers, "by-kube"))
    })
    .await;
    let (ok, why, _) = accepted(&theirs);
    assert_eq!(ok, "False");
    assert!(why.contains("is owned by admin"), "{why}");
    assert_eq!(accepted(&mine).0, "True");
    let view = s.state.load();
    assert_eq!(
        view.catalog.providers["by-admin"].model, "a",
        "the admin's version stays"
    );
    assert_eq!(
        view.owner("InferenceProvider", "by-kube"),
        Some(Owner::Kubernetes)
    );
    assert_eq!(
        view.owner("InferenceProvider", "by-admin"),
        Some(Owner::Admin)
    );
}
