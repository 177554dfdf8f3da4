//! Engines known from outside the stream: a worker set's static `endpoints` and what
//! Kubernetes reports for its selector become routable workers at their addresses without any
//! stream message; a bridge streaming for the same name is the same worker; its lease decides
//! what it caches, not whether it is routable; a pod that is not ready is not routable; and a
//! snapshot keeps all of it.

#![allow(clippy::unwrap_used)]

mod support;

use support::{apply_at, two_blocks};

use kvplane_state::{
    Command, DiscoveredEndpoint, EndpointHealth, EndpointsUpdate, Found, HealthUpdate,
    IngestPayload, Owner, StateMachine,
};
use serde_json::{Value, json};

fn worker_set(spec: Value) -> Command {
    Command::ConfigPut {
        kind: "InferenceWorkerSet".into(),
        name: "ws".into(),
        value: serde_json::to_vec(&spec).unwrap(),
        owner: Some(Owner::Kubernetes),
    }
}

fn static_set(endpoints: &[(&str, &str)]) -> Command {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(w, a)| json!({"worker": w, "address": a}))
        .collect();
    worker_set(json!({"model": "m", "blockSize": 4, "endpoints": endpoints}))
}

fn selector_set() -> Command {
    worker_set(json!({
        "model": "m",
        "blockSize": 4,
        "selector": {"matchLabels": {"app": "vllm"}, "port": 8000},
    }))
}

fn pods(endpoints: &[(&str, &str, bool)]) -> Command {
    Command::Endpoints(EndpointsUpdate {
        pool: "ws".into(),
        endpoints: endpoints
            .iter()
            .map(|(w, a, ready)| DiscoveredEndpoint {
                worker: (*w).into(),
                address: (*a).into(),
                ready: *ready,
            })
            .collect(),
    })
}

/// Health of `(worker, address, ready)`.
fn health_at(endpoints: &[(&str, &str, bool)]) -> Command {
    Command::EndpointHealth(HealthUpdate {
        pool: "ws".into(),
        endpoints: endpoints
            .iter()
            .map(|(w, address, ready)| EndpointHealth {
                worker: (*w).into(),
                address: (*address).into(),
                ready: *ready,
            })
            .collect(),
    })
}

/// Health of `(worker, ready)` at the addresses [`static_set`] lists them at in these tests
/// (`w0` at A0, `w1` at A1; others at A1).
fn health(endpoints: &[(&str, bool)]) -> Command {
    let at: Vec<(&str, &str, bool)> = endpoints
        .iter()
        .map(|(w, ready)| (*w, if *w == "w0" { A0 } else { A1 }, *ready))
        .collect();
    health_at(&at)
}

fn message(sm: &StateMachine, worker: &str, payload: IngestPayload) -> Command {
    support::message(sm, "ws", worker, payload)
}

fn announce(address: &str) -> IngestPayload {
    IngestPayload::Worker {
        up: true,
        address: Some(address.into()),
    }
}

/// Each worker as (name, routable, streaming, address, found, indexed blocks).
type Row = (String, bool, bool, String, Option<Found>, u64);

fn workers(sm: &StateMachine) -> Vec<Row> {
    sm.handle()
        .load()
        .workers()
        .map(|w| {
            (
                w.name.to_string(),
                w.up,
                w.streaming,
                w.address.as_deref().unwrap_or("").to_owned(),
                w.found,
                w.indexed_blocks,
            )
        })
        .collect()
}

fn row(
    name: &str,
    up: bool,
    streaming: bool,
    address: &str,
    found: Option<Found>,
    blocks: u64,
) -> Row {
    (name.into(), up, streaming, address.into(), found, blocks)
}

const A0: &str = "http://10.0.0.1:8000";
const A1: &str = "http://10.0.0.2:8000";

#[test]
fn static_endpoints_are_routable_workers_before_any_stream_message() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0), ("w1", A1)]));
    assert_eq!(
        workers(&sm),
        vec![
            row("w0", true, false, A0, Some(Found::Static), 0),
            row("w1", true, false, A1, Some(Found::Static), 0),
        ]
    );
}

#[test]
fn a_bridge_streaming_for_a_static_endpoint_is_the_same_worker_at_the_listed_address() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0)]));
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 1_000, m);
    let m = message(&sm, "w0", announce("http://elsewhere:9000"));
    apply_at(&mut sm, 1_000, m);
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, true, A0, Some(Found::Static), 2)],
        "the first stream message (a KV event) starts its stream, nothing is dropped"
    );
}

#[test]
fn an_expired_lease_clears_what_a_static_worker_caches_and_leaves_it_routable() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0)]));
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 1_000, m);
    let out = apply_at(&mut sm, 5_000, Command::ExpireLeases { lease_ms: 1_000 });
    assert_eq!(out.expired, vec![("ws".to_owned(), "w0".to_owned())]);
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, false, A0, Some(Found::Static), 0)]
    );
    let out = apply_at(&mut sm, 9_000, Command::ExpireLeases { lease_ms: 1_000 });
    assert!(out.expired.is_empty(), "a stream that is down expires once");
}

#[test]
fn a_static_worker_never_heard_from_has_no_lease_to_expire() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0)]));
    let out = apply_at(&mut sm, 60_000, Command::ExpireLeases { lease_ms: 1_000 });
    assert!(out.expired.is_empty());
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, false, A0, Some(Found::Static), 0)]
    );
}

#[test]
fn a_worker_set_that_stops_listing_an_endpoint_leaves_that_worker_to_its_stream_or_forgets_it() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0), ("w1", A1)]));
    let m = message(&sm, "w0", announce("http://announced:8000"));
    apply_at(&mut sm, 1_000, m);
    apply_at(&mut sm, 2_000, static_set(&[("w1", A1)]));
    assert_eq!(
        workers(&sm),
        vec![
            row("w0", true, true, "http://announced:8000", None, 0),
            row("w1", true, false, A1, Some(Found::Static), 0),
        ]
    );
    apply_at(&mut sm, 3_000, static_set(&[]));
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, true, "http://announced:8000", None, 0)],
        "a worker no source knows any more and whose stream never started is forgotten"
    );
}

#[test]
fn pods_kubernetes_reports_are_workers_routable_while_ready() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, selector_set());
    apply_at(
        &mut sm,
        2,
        pods(&[("pod-a", A0, true), ("pod-b", A1, false)]),
    );
    assert_eq!(
        workers(&sm),
        vec![
            row("pod-a", true, false, A0, Some(Found::Kubernetes), 0),
            row("pod-b", false, false, A1, Some(Found::Kubernetes), 0),
        ]
    );
    let m = message(&sm, "pod-a", two_blocks());
    apply_at(&mut sm, 1_000, m);
    apply_at(
        &mut sm,
        2_000,
        pods(&[("pod-a", A0, false), ("pod-b", A1, true)]),
    );
    assert_eq!(
        workers(&sm),
        vec![
            row("pod-a", false, true, A0, Some(Found::Kubernetes), 2),
            row("pod-b", true, false, A1, Some(Found::Kubernetes), 0),
        ],
        "readiness decides routing; the stream still decides what it caches"
    );
    apply_at(&mut sm, 3_000, pods(&[("pod-b", A1, true)]));
    assert_eq!(
        workers(&sm)[0],
        row("pod-a", true, true, "", None, 2),
        "a pod gone from kubernetes whose bridge still streams is known from its stream"
    );
}

#[test]
fn endpoints_from_kubernetes_are_refused_for_a_set_that_does_not_find_its_engines_there() {
    let mut sm = StateMachine::new();
    let out = apply_at(&mut sm, 1, pods(&[("pod-a", A0, true)]));
    assert!(
        out.rejected
            .unwrap()
            .to_string()
            .contains("no such worker set")
    );
    apply_at(&mut sm, 2, static_set(&[("w0", A0)]));
    let out = apply_at(&mut sm, 3, pods(&[("pod-a", A0, true)]));
    assert!(
        out.rejected
            .unwrap()
            .to_string()
            .contains("its endpoints do not come from kubernetes")
    );
    assert_eq!(workers(&sm).len(), 1);
}

#[test]
fn a_snapshot_keeps_every_workers_endpoint_and_stream() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, selector_set());
    apply_at(
        &mut sm,
        2,
        pods(&[("pod-a", A0, true), ("pod-b", A1, false)]),
    );
    let m = message(&sm, "pod-a", two_blocks());
    apply_at(&mut sm, 1_000, m);
    let mut restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), sm.digest());
    assert_eq!(workers(&restored), workers(&sm));
    // The never-heard pod's stream starts on its first message in both.
    for s in [&mut sm, &mut restored] {
        let m = message(s, "pod-b", two_blocks());
        apply_at(s, 2_000, m);
    }
    assert_eq!(restored.digest(), sm.digest());
    assert_eq!(
        workers(&restored)[1],
        row("pod-b", false, true, A1, Some(Found::Kubernetes), 2)
    );
}

#[test]
fn readiness_and_addresses_are_in_the_digest() {
    let digest = |eps: &[(&str, &str, bool)]| {
        let mut sm = StateMachine::new();
        apply_at(&mut sm, 1, selector_set());
        apply_at(&mut sm, 2, pods(eps));
        sm.digest()
    };
    let base = digest(&[("pod-a", A0, true)]);
    assert_ne!(base, digest(&[("pod-a", A0, false)]));
    assert_ne!(base, digest(&[("pod-a", A1, true)]));
    assert_eq!(base, digest(&[("pod-a", A0, true)]));
}

#[test]
fn a_set_that_turns_from_a_list_to_a_selector_keeps_no_listed_endpoint() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0), ("w1", A1)]));
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 1_000, m);
    apply_at(&mut sm, 2_000, selector_set());
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, true, "", None, 2)],
        "the streaming one is its stream's; the other was never anything but listed"
    );
    apply_at(&mut sm, 3_000, pods(&[("w0", A1, true)]));
    assert_eq!(
        workers(&sm),
        vec![row("w0", true, true, A1, Some(Found::Kubernetes), 2)]
    );
}

#[test]
fn a_routable_worker_whose_stream_goes_down_keeps_no_load_it_last_reported() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0)]));
    let busy = IngestPayload::Metrics(kvplane_state::WorkerMetrics {
        waiting: 9,
        kv_cache_usage: 0.9,
        ..Default::default()
    });
    let m = message(&sm, "w0", busy);
    apply_at(&mut sm, 1_000, m);
    let load = |sm: &StateMachine| {
        let v = sm.handle().load();
        let w = v.workers().next().unwrap();
        (w.up, w.metrics.waiting, w.metrics_index)
    };
    assert_eq!(load(&sm), (true, 9, 2));
    apply_at(&mut sm, 5_000, Command::ExpireLeases { lease_ms: 1_000 });
    assert_eq!(load(&sm), (true, 0, 0));
}

#[test]
fn a_static_endpoint_that_fails_its_health_check_is_not_routable_until_it_answers_again() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0), ("w1", A1)]));
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 1_000, m);
    let routable = |sm: &StateMachine| -> Vec<(String, bool)> {
        workers(sm).into_iter().map(|r| (r.0, r.1)).collect()
    };
    let s = |v: &str| v.to_owned();
    apply_at(&mut sm, 2_000, health(&[("w0", false), ("w1", true)]));
    assert_eq!(routable(&sm), vec![(s("w0"), false), (s("w1"), true)]);
    // What it streamed stays: the check decides whether it is routable, not what it caches.
    assert_eq!(
        workers(&sm)[0],
        row("w0", false, true, A0, Some(Found::Static), 2)
    );
    // The worker set applied again with the same address keeps what the checks said.
    apply_at(&mut sm, 3_000, static_set(&[("w0", A0), ("w1", A1)]));
    assert_eq!(routable(&sm), vec![(s("w0"), false), (s("w1"), true)]);
    apply_at(&mut sm, 4_000, health(&[("w0", true)]));
    assert_eq!(routable(&sm), vec![(s("w0"), true), (s("w1"), true)]);
    // At a new address it is a new endpoint: ready until checked, and a check of the old
    // address (made before the move) changes nothing.
    apply_at(&mut sm, 5_000, health(&[("w1", false)]));
    assert_eq!(routable(&sm), vec![(s("w0"), true), (s("w1"), false)]);
    apply_at(&mut sm, 6_000, static_set(&[("w0", A0), ("w1", A0)]));
    assert_eq!(routable(&sm), vec![(s("w0"), true), (s("w1"), true)]);
    apply_at(&mut sm, 7_000, health_at(&[("w1", A1, false)]));
    assert_eq!(routable(&sm), vec![(s("w0"), true), (s("w1"), true)]);
    apply_at(&mut sm, 8_000, health_at(&[("w1", A0, false)]));
    assert_eq!(routable(&sm), vec![(s("w0"), true), (s("w1"), false)]);
}

#[test]
fn health_of_endpoints_the_set_does_not_list_changes_nothing_and_a_set_without_a_list_is_refused() {
    let mut sm = StateMachine::new();
    let out = apply_at(&mut sm, 1, health(&[("w0", false)]));
    assert!(
        out.rejected
            .unwrap()
            .to_string()
            .contains("no such worker set")
    );
    apply_at(&mut sm, 2, selector_set());
    apply_at(&mut sm, 3, pods(&[("pod-a", A0, true)]));
    let out = apply_at(&mut sm, 4, health(&[("pod-a", false)]));
    assert!(
        out.rejected
            .unwrap()
            .to_string()
            .contains("only static endpoints are health-checked")
    );
    assert_eq!(
        workers(&sm),
        vec![row("pod-a", true, false, A0, Some(Found::Kubernetes), 0)]
    );
    // A streamed worker the list does not name, and a name nobody knows: untouched.
    apply_at(&mut sm, 5, static_set(&[("w0", A0)]));
    let m = message(&sm, "w9", announce(A1));
    apply_at(&mut sm, 1_000, m);
    let before = sm.digest();
    apply_at(&mut sm, 2_000, health(&[("w9", false), ("nobody", false)]));
    assert_eq!(sm.digest(), before);
    assert!(workers(&sm).iter().all(|r| r.1), "{:?}", workers(&sm));
}

#[test]
fn health_is_in_the_digest_and_a_snapshot_keeps_it() {
    let mut sm = StateMachine::new();
    apply_at(&mut sm, 1, static_set(&[("w0", A0), ("w1", A1)]));
    let up = sm.digest();
    apply_at(&mut sm, 2, health(&[("w1", false)]));
    assert_ne!(sm.digest(), up);
    let restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), sm.digest());
    assert_eq!(workers(&restored), workers(&sm));
    apply_at(&mut sm, 3, health(&[("w1", true)]));
    assert_eq!(sm.digest(), up, "back as it was: the same digest");
}
