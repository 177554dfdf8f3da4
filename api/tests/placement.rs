//! Prompts routed before the engines' events say what they cache (`kvplane_api::placed`): a
//! burst on a new prefix stays with the worker its first request went to, on this replica and
//! on another that heard of it, until the events are overdue; other prefixes still balance.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvplane_api::placed::GRACE_MS;
use kvplane_api::predict::{Predictor, RoutedNote, RoutedSink};
use support::{TestFleet, explain, pools_node, request, route, target, tokens};

/// A prompt of a 4,096-token prefix (`prefix`) and a 32-token question of its own (`own`):
/// 258 blocks of 16, 256 of them the prefix's.
fn prompt(prefix: u32, own: u32) -> Vec<u32> {
    let mut t = tokens(prefix, 4_096);
    t.extend(tokens(1_000 + own, 32));
    t
}

fn predictor_at(clock: &Arc<AtomicU64>) -> Arc<Predictor> {
    let c = clock.clone();
    Arc::new(Predictor::new(Arc::new(move || c.load(Ordering::Relaxed))))
}

fn service_at(f: &TestFleet, clock: &Arc<AtomicU64>) -> kvplane_api::RouterService {
    f.service().with_predictor(predictor_at(clock))
}

#[test]
fn a_burst_on_a_new_prefix_stays_with_the_first_requests_worker_until_its_events_are_overdue() {
    let clock = Arc::new(AtomicU64::new(1_000));
    let f = pools_node(&[]);
    let s = service_at(&f, &clock);
    let first = route(&s, request("a0", "m", &[], prompt(1, 0)));
    assert_eq!(first.matched_blocks, 0, "nothing is cached anywhere yet");
    // No event has reached the index: the next requests on that prefix count it as cached
    // where the first went (256 blocks, known to the 16th), queue behind it and stay.
    for i in 1..4 {
        let r = route(&s, request(&format!("a{i}"), "m", &[], prompt(1, i)));
        assert_eq!(target(&r), target(&first), "request {i}");
        assert_eq!(r.matched_blocks, 256);
    }
    // A prompt of another prefix still goes where nothing waits.
    let other = route(&s, request("b0", "m", &[], prompt(2, 0)));
    assert_ne!(target(&other), target(&first));
    assert_eq!(other.matched_blocks, 0);
    // Long after the first tokens were due the events would have said it: nothing is taken
    // on trust any more.
    clock.fetch_add(60_000 + GRACE_MS, Ordering::Relaxed);
    let late = route(&s, request("a9", "m", &[], prompt(1, 9)));
    assert_eq!(late.matched_blocks, 0);
}

#[test]
fn another_replica_that_heard_of_a_routed_prompt_keeps_its_prefix_with_that_worker() {
    let clock = Arc::new(AtomicU64::new(1_000));
    let f = pools_node(&[]);
    let notes: Arc<Mutex<Vec<RoutedNote>>> = Arc::default();
    let told = notes.clone();
    let a = service_at(&f, &clock).with_routed_sink(RoutedSink(Arc::new(move |n| {
        told.lock().unwrap().push(n);
    })));
    let b_predictor = predictor_at(&clock);
    let b = f.service().with_predictor(b_predictor.clone());
    let first = route(&a, request("a0", "m", &[], prompt(3, 0)));
    // The note as it travels (JSON), read as the gossip task feeds it in.
    let note = notes.lock().unwrap().pop().unwrap();
    assert_eq!(note.anchors.len(), 17, "every 16th block and the last");
    let wire: RoutedNote = serde_json::from_slice(&serde_json::to_vec(&note).unwrap()).unwrap();
    b_predictor.routed_elsewhere(&wire.worker_set, &wire.worker, wire.at_ms, wire.due_ms);
    b_predictor.place(
        &wire.worker_set,
        &wire.worker,
        wire.dp_rank,
        &wire.anchors,
        (wire.at_ms, wire.due_ms),
    );
    let r = route(&b, request("b1", "m", &[], prompt(3, 1)));
    assert_eq!((target(&r), r.matched_blocks), (target(&first), 256));
    // Without the anchors (a note of an older version) the other replica only sees the
    // queue, and sends the prefix where nothing waits.
    let c_predictor = predictor_at(&clock);
    c_predictor.routed_elsewhere(&wire.worker_set, &wire.worker, wire.at_ms, wire.due_ms);
    let c = f.service().with_predictor(c_predictor);
    let r = route(&c, request("c1", "m", &[], prompt(3, 2)));
    assert_ne!(target(&r), target(&first));
}

#[test]
fn a_routed_prompt_counts_as_cached_until_two_seconds_after_its_first_token_was_due() {
    let clock = Arc::new(AtomicU64::new(1_000));
    let f = pools_node(&[]);
    let s = service_at(&f, &clock);
    let first = route(&s, request("a0", "m", &[], prompt(4, 0)));
    let due = 1_000 + first.predicted_ttft_ms as u64;
    let chosen = |at: u64| {
        clock.store(at, Ordering::Relaxed);
        let x = explain(&s, request("probe", "m", &[], prompt(4, 1)));
        x.candidates
            .into_iter()
            .find(|c| {
                c.endpoint.as_ref().unwrap().worker_id
                    == target(&first).trim_start_matches("default/")
            })
            .unwrap()
            .overlap_blocks
    };
    // The README's figure: two seconds.
    assert_eq!(GRACE_MS, 2_000);
    assert_eq!(chosen(due + GRACE_MS - 1), 256);
    assert_eq!(chosen(due + GRACE_MS), 0);
}
