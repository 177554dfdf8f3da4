//! The routing pipeline's stages on a real state and the real service: one catalog for config
//! pools and policy objects, classification from headers and taggers, lazy signals, and an
//! Explain that changes nothing.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use kvplane_api::predict::Predictor;
use kvplane_proto::v1::router_server::Router as _;
use support::{
    ACME_LIMIT, EXAMPLES, TestFleet, apply_policies, explain, pools_node, report,
    report_first_token, request, route, target, tokens,
};

#[test]
fn a_pools_node_with_a_limits_only_policy_still_routes() {
    let prompt = tokens(1, 64);
    let mut f = pools_node(&[]);
    f.caches("default", "w1", &prompt, 16, None, None);
    let r = route(&f.service(), request("a", "any-model", &[], prompt.clone()));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("default/w1", 4));
    // A policy holding only limits: the pool keeps routing (no second decision path).
    apply_policies(&mut f, ACME_LIMIT);
    assert!(!f.sm.handle().load().catalog.is_empty());
    let r = route(&f.service(), request("b", "any-model", &[], prompt));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("default/w1", 4));
    assert_eq!(
        r.model, "any-model",
        "a pool serving every model runs the requested one"
    );
    assert!(r.rewritten_body.is_none());
}

#[test]
fn lora_and_salt_work_on_a_pools_node_and_an_adapter_request_keeps_its_name() {
    let prompt = tokens(2, 64);
    let mut f = pools_node(&["sql-lora"]);
    f.caches("default", "w0", &prompt, 16, Some("sql-lora"), None)
        .caches("default", "w1", &prompt, 16, None, Some("alice"));
    let r = route(&f.service(), request("l1", "sql-lora", &[], prompt.clone()));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("default/w0", 4));
    assert_eq!(r.model, "sql-lora");
    assert!(
        r.rewritten_body.is_none(),
        "the body keeps naming the adapter"
    );
    // The base model's blocks are not the adapter's, and the other way round.
    let mut salted = request("s1", "base", &[], prompt.clone());
    salted.cache_salt = "alice".into();
    let r = route(&f.service(), salted.clone());
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("default/w1", 4));
    salted.cache_salt = "bob".into();
    salted.request_id = "s2".into();
    assert_eq!(route(&f.service(), salted).matched_blocks, 0);
}

#[test]
fn an_adapter_of_a_worker_set_keeps_its_model_name_in_the_body() {
    let prompt = tokens(3, 64);
    let mut f = TestFleet::with_yaml(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: base}\nspec: {model: base-model, loraAdapters: [sql-lora]}\n",
    );
    f.up("base", &["w0"])
        .caches("base", "w0", &prompt, 16, Some("sql-lora"), None);
    let mut req = request("x", "", &[], prompt);
    req.body = br#"{"model":"sql-lora","prompt":"select"}"#.to_vec();
    let r = route(&f.service(), req);
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("base/w0", 4));
    assert_eq!(r.model, "sql-lora");
    assert!(r.rewritten_body.is_none(), "{:?}", r.rewritten_body);
}

#[test]
fn an_adapter_behind_a_public_alias_keeps_its_name_and_its_blocks() {
    let prompt = tokens(10, 64);
    let mut f = TestFleet::with_yaml(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: base}\nspec: {model: base-model, loraAdapters: [sql-lora]}\n---\napiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata: {name: sql}\nspec: {publicModel: sql, backends: [{model: sql-lora}]}\n",
    );
    f.up("base", &["w0", "w1"])
        .caches("base", "w0", &prompt, 16, None, None)
        .caches("base", "w1", &prompt, 16, Some("sql-lora"), None);
    let r = route(&f.service(), request("a", "sql", &[], prompt));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("base/w1", 4));
    assert_eq!(r.model, "sql-lora");
    let body: serde_json::Value =
        serde_json::from_slice(r.rewritten_body.as_ref().unwrap()).unwrap();
    assert_eq!(body["model"], "sql-lora");
}

#[test]
fn explain_changes_nothing_and_shows_every_cost_part() {
    let prompt = tokens(4, 256);
    let mut f = pools_node(&[]);
    f.caches("default", "w0", &prompt[..128], 16, None, None)
        .load("default", "w1", 2, 0.5);
    let s = f.service_with_stopped_clock();
    // A request routed and not reported: it is in w0's queue.
    route(&s, request("first", "m", &[], prompt.clone()));
    // The probe shares w0's cached half of it, not the rest (which the routed request, if it
    // went there, would have w0 cache: see `placement.rs`).
    let mut probed = prompt[..128].to_vec();
    probed.extend(tokens(5, 128));
    let a = explain(&s, request("probe", "m", &[], probed.clone()));
    let b = explain(&s, request("probe", "m", &[], probed));
    assert_eq!(a, b, "a second Explain sees what the first saw");
    for c in &a.candidates {
        assert!(c.prefill_cost > 0.0, "{c:?}");
        assert!(c.predicted_ttft_ms > c.prefill_cost, "{c:?}");
        assert!(c.cost >= c.predicted_ttft_ms, "{c:?}");
    }
    let w1 = a
        .candidates
        .iter()
        .find(|c| c.endpoint.as_ref().unwrap().worker_id == "w1")
        .unwrap();
    // Two waiting there, each taken to cost what this replica's requests cost it (the first one).
    assert!(w1.load_cost > 0.0 && w1.waiting == 2, "{w1:?}");
    // Route after the Explains decides as Route alone would have.
    let after = route(&s, request("second", "m", &[], prompt.clone()));
    let fresh = f.service();
    route(&fresh, request("first", "m", &[], prompt.clone()));
    let alone = route(&fresh, request("second", "m", &[], prompt));
    assert_eq!(target(&after), target(&alone));
    assert!((after.predicted_ttft_ms - alone.predicted_ttft_ms).abs() < 50.0);
    assert!(report(&s, "first").known);
    assert!(
        !report(&s, "probe").known,
        "Explain records no routed request"
    );
}

/// What each worker runs as an Explain sees it.
fn running(s: &kvplane_api::RouterService) -> std::collections::BTreeMap<String, u32> {
    explain(s, request("x", "m", &[], tokens(3, 16)))
        .candidates
        .iter()
        .map(|c| {
            let e = c.endpoint.as_ref().unwrap();
            (e.worker_id.clone(), c.running)
        })
        .collect()
}

/// The requests the predictor counts as waiting on `worker` of pool `default`, asked as of no
/// metrics sample.
fn queued(p: &Predictor, worker: &str) -> u32 {
    let name: Arc<str> = worker.into();
    p.peek_pending(
        "default",
        kvplane_api::predict::Ask {
            worker: &name,
            metrics_index: 0,
            metrics_at_ms: 0,
            waiting: 0,
            ttft_histogram: (0.0, 0),
        },
    )
    .requests
}

#[test]
fn explain_reads_the_predictor_without_pruning_or_calibrating_it() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let clock = Arc::new(AtomicU64::new(1_000));
    let c = clock.clone();
    let predictor = Arc::new(Predictor::new(Arc::new(move || c.load(Ordering::Relaxed))));
    let prompt = tokens(9, 64);
    let mut f = pools_node(&[]);
    let r = route(
        &f.service().with_predictor(predictor.clone()),
        request("r1", "m", &[], prompt.clone()),
    );
    let worker = target(&r).trim_start_matches("default/").to_owned();
    // Much later the engine's metrics, sampled after r1 was due, show nothing waiting: a Route
    // would drop r1 from the queue; Explain must not.
    clock.store(20_000, Ordering::Relaxed);
    f.at(10_000).load("default", &worker, 0, 0.1);
    let stored = |p: &Predictor| queued(p, &worker);
    assert_eq!(stored(&predictor), 1);
    let s = f.service().with_predictor(predictor.clone());
    let a = explain(&s, request("x", "m", &[], prompt.clone()));
    let b = explain(&s, request("x", "m", &[], prompt.clone()));
    assert_eq!(a, b);
    assert_eq!(stored(&predictor), 1, "Explain left the queue as it was");
    assert_eq!(predictor.calibration("default"), 1.0);
    let r2 = route(&s, request("r2", "m", &[], prompt));
    assert_eq!(
        stored(&predictor),
        u32::from(target(&r2) == target(&r)),
        "Route pruned r1 (r2 is there if it went to the same worker)"
    );
}

#[test]
fn a_first_token_report_takes_the_request_out_of_its_queue_it_runs_there_until_its_final_report() {
    let predictor = Arc::new(Predictor::new(Arc::new(|| 1_000)));
    let prompt = tokens(9, 64);
    let f = pools_node(&[]);
    let s = f.service().with_predictor(predictor.clone());
    let r = route(&s, request("r1", "m", &[], prompt));
    let worker = target(&r).trim_start_matches("default/").to_owned();
    let predicted = r.predicted_ttft_ms;
    assert!(predicted > 0.0);
    let queued = || queued(&predictor, &worker);
    assert_eq!(queued(), 1, "routed, waiting for its first token");
    // Its first token came after twice the predicted time: out of the queue, and the set's
    // calibration moves toward 2 (once: a repeated first-token report changes nothing).
    assert!(report_first_token(&s, "r1", 2.0 * predicted).known);
    assert_eq!(queued(), 0);
    let calibrated = predictor.calibration("default");
    assert!(calibrated > 1.05, "{calibrated}");
    assert!(report_first_token(&s, "r1", 2.0 * predicted).known);
    assert_eq!(predictor.calibration("default"), calibrated);
    // Until its end it runs there (the engine's metrics, never sampled, say nothing).
    assert_eq!(running(&s)[&worker], 1);
    assert!(running(&s).iter().all(|(w, n)| *w == worker || *n == 0));
    // The final report still finds the request (what limits hold is settled there), once.
    assert!(report(&s, "r1").known);
    assert_eq!(predictor.calibration("default"), calibrated);
    assert_eq!(running(&s)[&worker], 0, "ended");
    assert!(!report(&s, "r1").known);
    assert!(
        !report_first_token(&s, "r1", 1.0).known,
        "nothing left to start"
    );
}

/// A usage report saying where the request was served (`UsageReport.served`).
fn report_served(
    s: &kvplane_api::RouterService,
    request_id: &str,
    ttft_ms: f64,
    first_token: bool,
    served: kvplane_proto::v1::Endpoint,
) -> bool {
    futures::executor::block_on(s.report_usage(tonic::Request::new(
        kvplane_proto::v1::UsageReport {
            request_id: request_id.into(),
            observed_ttft_ms: ttft_ms,
            first_token,
            prompt_tokens: u32::from(!first_token),
            served: Some(served),
            ..Default::default()
        },
    )))
    .unwrap()
    .into_inner()
    .known
}

#[test]
fn a_request_served_by_another_worker_teaches_the_chosen_one_nothing_and_runs_where_it_was_served()
{
    let predictor = Arc::new(Predictor::new(Arc::new(|| 1_000)));
    let f = pools_node(&[]);
    let s = f.service().with_predictor(predictor.clone());
    let other = |w: &str| if w == "w0" { "w1" } else { "w0" }.to_owned();

    // Streamed, retried by a gateway on its alternative: named by pool and worker.
    let r = route(&s, request("r1", "m", &[], tokens(9, 64)));
    let chosen = target(&r).trim_start_matches("default/").to_owned();
    let served = other(&chosen);
    assert_eq!(queued(&predictor, &chosen), 1);
    let by_name = kvplane_proto::v1::Endpoint {
        pool: "default".into(),
        worker_id: served.clone(),
        ..Default::default()
    };
    assert!(report_served(
        &s,
        "r1",
        10.0 * r.predicted_ttft_ms,
        true,
        by_name.clone()
    ));
    assert_eq!(
        queued(&predictor, &chosen),
        0,
        "it left the chosen one's queue"
    );
    assert_eq!(
        predictor.calibration("default"),
        1.0,
        "another engine's time to first token teaches the chosen one nothing"
    );
    assert_eq!(running(&s)[&served], 1, "it runs where it was served");
    assert_eq!(running(&s)[&chosen], 0);
    assert!(report_served(&s, "r1", 0.0, false, by_name));
    assert_eq!(running(&s)[&served], 0, "ended there");

    // Not streamed, served elsewhere as an endpoint picker's proxy says it: by address only.
    let r = route(&s, request("r2", "m", &[], tokens(11, 64)));
    let chosen = target(&r).trim_start_matches("default/").to_owned();
    let by_address = |w: &str| kvplane_proto::v1::Endpoint {
        address: format!("{w}:8000"),
        ..Default::default()
    };
    assert!(report_served(
        &s,
        "r2",
        10.0 * r.predicted_ttft_ms,
        false,
        by_address(&other(&chosen))
    ));
    assert_eq!(queued(&predictor, &chosen), 0);
    assert_eq!(predictor.calibration("default"), 1.0);

    // Served where it was routed (the proxy says so too): the chosen one learns as usual.
    let r = route(&s, request("r3", "m", &[], tokens(13, 64)));
    let chosen = target(&r).trim_start_matches("default/").to_owned();
    assert!(report_served(
        &s,
        "r3",
        10.0 * r.predicted_ttft_ms,
        false,
        by_address(&chosen)
    ));
    assert_eq!(queued(&predictor, &chosen), 0);
    assert!(predictor.calibration("default") > 1.05);
}

/// The examples' fleet with the large workers busy: untagged `chat` requests burst to the
/// cloud provider.
fn busy_chat() -> TestFleet {
    let mut f = TestFleet::with_policies(EXAMPLES);
    f.up("large-a100", &["a0", "a1"])
        .up("small-l4", &["l0"])
        .load("large-a100", "a0", 5, 0.2)
        .load("large-a100", "a1", 5, 0.2);
    f
}

#[test]
fn a_header_mapped_pii_tag_keeps_a_request_off_the_cloud() {
    let f = busy_chat();
    let r = route(&f.service(), request("h0", "chat", &[], tokens(5, 64)));
    assert_eq!(target(&r), "provider:cloud");
    let mut req = request("h1", "chat", &[], tokens(5, 64));
    req.headers
        .insert("X-Data-Class".into(), "internal, pii".into());
    let r = route(&f.service(), req.clone());
    assert!(
        target(&r).starts_with("rejected(REJECT_CODE_POLICY)"),
        "{}",
        target(&r)
    );
    let words = explain(&f.service(), req).steps;
    assert!(
        words
            .iter()
            .any(|s| s == "tag pii from header x-data-class"),
        "{words:#?}"
    );
}

#[test]
fn a_tagger_found_pii_keeps_a_request_off_the_cloud_and_explain_never_shows_the_text() {
    let f = busy_chat();
    let mut req = request("t1", "chat", &[], tokens(6, 64));
    req.body = br#"{"model":"chat","messages":[{"role":"user","content":"my card is 4111 1111 1111 1111, call me"}]}"#.to_vec();
    let r = route(&f.service(), req.clone());
    assert!(
        target(&r).starts_with("rejected(REJECT_CODE_POLICY)"),
        "{}",
        target(&r)
    );
    let e = explain(&f.service(), req);
    assert!(
        e.steps
            .iter()
            .any(|s| s == "tag pii from tagger pii/payment-card"),
        "{:#?}",
        e.steps
    );
    assert!(
        e.steps.iter().all(|s| !s.contains("4111")),
        "{:#?}",
        e.steps
    );
    // The same words with a wrong check digit are no card: the burst goes out.
    let mut req = request("t2", "chat", &[], tokens(6, 64));
    req.body = br#"{"model":"chat","messages":[{"role":"user","content":"my card is 4111 1111 1111 1112, call me"}]}"#.to_vec();
    assert_eq!(target(&route(&f.service(), req)), "provider:cloud");
}

#[test]
fn a_rule_that_reads_no_prefix_decides_without_it_and_still_predicts_its_pick() {
    // minimize: Load and no filter reading the cache: the candidates are not looked up; the
    // chosen worker's prediction is still made (the predictor's queue and the answer need it).
    let prompt = tokens(7, 64);
    let mut f = TestFleet::with_yaml(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: ws}\nspec: {model: m}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: by-load}\nspec:\n  appliesToModels: [m]\n  rules: [{name: least-loaded, minimize: Load}]\n",
    );
    f.up("ws", &["w0", "w1"])
        .caches("ws", "w0", &prompt, 16, None, None)
        .load("ws", "w0", 3, 0.1);
    let r = route(&f.service(), request("q", "m", &[], prompt.clone()));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("ws/w1", 0));
    assert!(r.predicted_ttft_ms > 0.0, "{r:?}");
    // Explain computes every signal: the cached prefix shows there.
    let e = explain(&f.service(), request("q", "m", &[], prompt));
    let w0 = e
        .candidates
        .iter()
        .find(|c| c.endpoint.as_ref().unwrap().worker_id == "w0")
        .unwrap();
    assert_eq!(w0.overlap_blocks, 4);
}

#[test]
fn a_worker_set_with_static_endpoints_routes_to_them_before_any_bridge_speaks() {
    // No stream message at all: the listed engines are the candidates, at their addresses;
    // a bridge streaming for one of them later adds its cache to the same worker.
    let prompt = tokens(8, 64);
    let mut f = TestFleet::with_yaml(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: ws}\nspec:\n  model: m\n  endpoints:\n  - {worker: e0, address: 'http://10.0.0.1:8000'}\n  - {worker: e1, address: 'http://10.0.0.2:8000'}\n",
    );
    let r = route(&f.service(), request("a", "m", &[], prompt.clone()));
    let use_address = |r: &kvplane_proto::v1::RouteResponse| match &r.decision {
        Some(kvplane_proto::v1::route_response::Decision::Endpoint(e)) => e.address.clone(),
        other => panic!("{other:?}"),
    };
    assert!(target(&r).starts_with("ws/e"), "{}", target(&r));
    assert!(use_address(&r).starts_with("http://10.0.0."));
    f.caches("ws", "e1", &prompt, 16, None, None);
    let r = route(&f.service(), request("b", "m", &[], prompt));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("ws/e1", 4));
    assert_eq!(use_address(&r), "http://10.0.0.2:8000");
    assert_eq!(f.sm.handle().load().workers().count(), 2);
}
