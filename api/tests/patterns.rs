//! The five policy patterns of `examples/policies/`, proved through the real routing service
//! and predictor over a real state fed the entries ingest commits; and the attachment rule:
//! naming a served model directly never escapes the policies of the backends serving it.

#![allow(clippy::unwrap_used)]

mod support;

use support::{EXAMPLES, TestFleet, explain, request, route, target, tokens};

/// Two workers per worker set of the examples' fleet, all idle.
fn fleet() -> TestFleet {
    let mut f = TestFleet::with_policies(EXAMPLES);
    f.up("large-a100", &["a0", "a1"])
        .up("small-l4", &["l0", "l1"]);
    f
}

fn steps(f: &TestFleet, model: &str, tags: &[&str], prompt: &[u32]) -> Vec<String> {
    explain(&f.service(), request("x", model, tags, prompt.to_vec())).steps
}

#[test]
fn simple_prompts_go_to_the_small_model_unless_the_large_one_caches_them() {
    let prompt = tokens(1, 1024);
    let mut f = fleet();
    let r = route(
        &f.service(),
        request("r1", "assistant", &["complexity=low"], prompt.clone()),
    );
    assert!(target(&r).starts_with("small-l4/"), "{}", target(&r));
    assert_eq!(r.model, "llama-8b");
    let body: serde_json::Value =
        serde_json::from_slice(r.rewritten_body.as_ref().unwrap()).unwrap();
    assert_eq!(body["model"], "llama-8b");
    assert!(
        steps(&f, "assistant", &["complexity=low"], &prompt)
            .iter()
            .any(|s| s.contains("rule simple-to-cheaper/low-complexity applies"))
    );

    // 60 of 64 blocks cached on a1: 4 blocks to prefill at 4k tok/s beat 64 at 20k tok/s.
    f.caches("large-a100", "a1", &prompt[..960], 16, None, None);
    let r = route(
        &f.service(),
        request("r2", "assistant", &["complexity=low"], prompt.clone()),
    );
    assert_eq!(target(&r), "large-a100/a1");
    assert_eq!(r.matched_blocks, 60);
    assert_eq!(r.model, "llama-70b");

    // Without the tag the default rule keeps the backend's pool: the large model.
    let r = route(&fleet().service(), request("r3", "assistant", &[], prompt));
    assert!(target(&r).starts_with("large-a100/"), "{}", target(&r));
}

#[test]
fn the_complexity_tagger_sends_a_short_prompt_to_the_small_model_unless_the_large_one_caches_it() {
    // 128 tokens: at most lowMaxPromptTokens, no code: complexity=low, from the tagger.
    let prompt = tokens(2, 128);
    let mut f = fleet();
    let mut req = request("c1", "assistant", &[], prompt.clone());
    req.body = br#"{"model":"assistant","prompt":"what is the capital of france?"}"#.to_vec();
    let r = route(&f.service(), req.clone());
    assert!(target(&r).starts_with("small-l4/"), "{}", target(&r));
    let words = explain(&f.service(), req.clone()).steps;
    assert!(
        words
            .iter()
            .any(|s| s.starts_with("tag complexity=low from tagger complexity")),
        "{words:#?}"
    );
    f.caches("large-a100", "a0", &prompt[..112], 16, None, None);
    let r = route(&f.service(), req);
    assert_eq!(target(&r), "large-a100/a0");
}

#[test]
fn busy_workers_are_skipped_and_the_burst_goes_to_the_cloud() {
    let prompt = tokens(3, 1024);
    let mut f = fleet();
    f.load("large-a100", "a0", 3, 0.2);
    let r = route(&f.service(), request("b1", "chat", &[], prompt.clone()));
    assert_eq!(target(&r), "large-a100/a1");
    let e = explain(&f.service(), request("b1", "chat", &[], prompt.clone()));
    let a0 = e
        .candidates
        .iter()
        .find(|c| c.endpoint.as_ref().unwrap().worker_id == "a0")
        .unwrap();
    assert_eq!(
        (a0.filtered_by.as_str(), a0.filtered_reason.as_str()),
        ("max_queued", "3 queued > maxQueued 2")
    );

    f.load("large-a100", "a1", 5, 0.2);
    let r = route(&f.service(), request("b2", "chat", &[], prompt));
    assert_eq!(target(&r), "provider:cloud");
    assert_eq!(r.model, "gpt-4o-mini");
    let body: serde_json::Value =
        serde_json::from_slice(r.rewritten_body.as_ref().unwrap()).unwrap();
    assert_eq!(body["model"], "gpt-4o-mini");
}

#[test]
fn pii_never_leaves_the_local_workers_and_is_refused_when_they_are_full() {
    let prompt = tokens(4, 1024);
    let mut f = fleet();
    let r = route(
        &f.service(),
        request("p1", "chat", &["pii"], prompt.clone()),
    );
    assert!(target(&r).starts_with("large-a100/"), "{}", target(&r));
    let e = explain(
        &f.service(),
        request("p1", "chat", &["pii"], prompt.clone()),
    );
    let cloud = e
        .candidates
        .iter()
        .find(|c| !c.endpoint.as_ref().unwrap().provider.is_empty())
        .unwrap();
    assert_eq!(cloud.filtered_by, "exclude_external");

    // Busy enough that burst-to-cloud would send it out: pii is refused instead.
    f.load("large-a100", "a0", 5, 0.2)
        .load("large-a100", "a1", 5, 0.2);
    let r = route(&f.service(), request("p2", "chat", &["pii"], prompt));
    let t = target(&r);
    assert!(
        t.starts_with("rejected(REJECT_CODE_POLICY)") && t.contains("local workers only"),
        "{t}"
    );
}

#[test]
fn naming_a_model_several_backends_serve_is_refused_not_routed_around_their_policies() {
    // `kvplane explain --policies examples/policies --tag pii --model llama-70b`: llama-70b is
    // served behind `assistant`, `chat` and `standard`; which backend's policies would apply is
    // ambiguous, so the request is refused - never sent to the provider.
    let prompt = tokens(5, 1024);
    let mut f = fleet();
    f.load("large-a100", "a0", 5, 0.2)
        .load("large-a100", "a1", 5, 0.2);
    for tags in [&["pii"][..], &[]] {
        let r = route(
            &f.service(),
            request("d1", "llama-70b", tags, prompt.clone()),
        );
        let t = target(&r);
        assert!(
            t.starts_with("rejected(REJECT_CODE_POLICY)")
                && t.contains("served behind GatewayBackends assistant, chat, standard"),
            "{t}"
        );
    }
    let words = steps(&f, "llama-70b", &["pii"], &prompt);
    assert!(
        words.iter().any(|s| s.starts_with("rejected: ")),
        "{words:#?}"
    );
    // Naming no model is as ambiguous.
    let t = target(&route(&f.service(), request("d2", "", &["pii"], prompt)));
    assert!(
        t.contains("a request that names no model is served behind"),
        "{t}"
    );
}

/// The examples' fleet and only the `chat` backend (patterns 2-4): llama-70b is served behind
/// one backend.
fn chat_only() -> TestFleet {
    let read = |f: &str| std::fs::read_to_string(format!("{EXAMPLES}/{f}")).unwrap();
    let mut f = TestFleet::with_yaml(&format!(
        "{}\n---\n{}",
        read("fleet.yaml"),
        read("2-3-4-chat.yaml")
    ));
    f.up("large-a100", &["a0", "a1"])
        .up("small-l4", &["l0", "l1"]);
    f
}

#[test]
fn naming_the_served_model_of_one_backend_is_under_its_policies_tags_and_tenant_header() {
    let prompt = tokens(5, 1024);
    let mut f = chat_only();
    f.load("large-a100", "a0", 5, 0.2)
        .load("large-a100", "a1", 5, 0.2);
    // Untagged, the busy fleet bursts to the cloud, as `chat` does.
    let r = route(
        &f.service(),
        request("d1", "llama-70b", &[], prompt.clone()),
    );
    assert_eq!(target(&r), "provider:cloud");
    // The backend's header mapping and PII tagger apply to the direct request too.
    let mut by_header = request("d2", "llama-70b", &[], prompt.clone());
    by_header
        .headers
        .insert("x-data-class".into(), "pii".into());
    let mut by_tagger = request("d3", "llama-70b", &[], prompt.clone());
    by_tagger.body = br#"{"model":"llama-70b","prompt":"mail me at jane@example.com"}"#.to_vec();
    for req in [by_header, by_tagger] {
        let t = target(&route(&f.service(), req.clone()));
        assert!(
            t.starts_with("rejected(REJECT_CODE_POLICY)") && t.contains("local workers only"),
            "{t}"
        );
        let e = explain(&f.service(), req);
        assert!(
            e.steps
                .iter()
                .any(|s| s.contains("rule pii-local/pii applies")),
            "{:#?}",
            e.steps
        );
    }
}

#[test]
fn batch_work_goes_only_to_workers_under_seventy_percent_cache_usage() {
    let prompt = tokens(6, 1024);
    let mut f = fleet();
    f.load("large-a100", "a0", 0, 0.9)
        .load("large-a100", "a1", 0, 0.9)
        .load("small-l4", "l0", 0, 0.75)
        .load("small-l4", "l1", 0, 0.5);
    let r = route(
        &f.service(),
        request("t1", "chat", &["batch"], prompt.clone()),
    );
    assert_eq!(target(&r), "small-l4/l1");
    let e = explain(
        &f.service(),
        request("t1", "chat", &["batch"], prompt.clone()),
    );
    let kept: Vec<&str> = e
        .candidates
        .iter()
        .filter(|c| c.filtered_reason.is_empty())
        .map(|c| c.endpoint.as_ref().unwrap().worker_id.as_str())
        .collect();
    assert_eq!(kept, ["l1"]);

    f.load("small-l4", "l1", 0, 0.71);
    let r = route(&f.service(), request("t2", "chat", &["batch"], prompt));
    assert!(target(&r).contains("idle enough"), "{}", target(&r));
}

#[test]
fn one_public_name_is_served_by_either_model_and_the_body_names_the_chosen_one() {
    let prompt = tokens(7, 1024);
    let mut f = fleet();
    f.caches("large-a100", "a0", &prompt[..992], 16, None, None);
    let r = route(
        &f.service(),
        request("s1", "standard-model", &[], prompt.clone()),
    );
    assert_eq!(target(&r), "large-a100/a0");
    assert_eq!(r.model, "llama-70b");

    let r = route(
        &fleet().service(),
        request("s2", "standard-model", &[], prompt),
    );
    assert!(target(&r).starts_with("small-l4/"), "{}", target(&r));
    assert_eq!(r.model, "llama-8b");
    let body: serde_json::Value =
        serde_json::from_slice(r.rewritten_body.as_ref().unwrap()).unwrap();
    assert_eq!(body["model"], "llama-8b");
    let Some(kvplane_proto::v1::route_response::Decision::Endpoint(e)) = &r.decision else {
        panic!("{r:?}")
    };
    assert!(e.address.ends_with(":8000"), "{}", e.address);
}

#[test]
fn models_nobody_serves_and_worker_sets_with_nobody_up_are_told_apart() {
    let r = route(
        &fleet().service(),
        request("u1", "no-such-model", &[], tokens(8, 64)),
    );
    assert!(
        target(&r).starts_with("rejected(REJECT_CODE_UNKNOWN_MODEL)"),
        "{}",
        target(&r)
    );
    let mut f = fleet();
    for (ws, w) in [
        ("large-a100", "a0"),
        ("large-a100", "a1"),
        ("small-l4", "l0"),
        ("small-l4", "l1"),
    ] {
        f.down(ws, w);
    }
    let r = route(
        &f.service(),
        request("u2", "standard-model", &[], tokens(8, 64)),
    );
    assert!(
        target(&r).starts_with("rejected(REJECT_CODE_NO_CAPACITY)"),
        "{}",
        target(&r)
    );
}
