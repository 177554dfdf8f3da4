//! The five policy patterns of `examples/policies/`, each proved on a fleet state set up for it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use kvplane_policy::kinds::InferenceWorkerSetSpec;
use kvplane_policy::{
    Catalog, Documents, Evaluation, Fleet, RejectKind, Request, Target, WorkerState, target_name,
};

/// The examples directory, loaded and checked like `kvplane validate` does.
fn catalog() -> Catalog {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
    let docs = Documents::read(&[dir.into()]).unwrap();
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty(), "{problems:#?}");
    catalog
}

/// Two workers per worker set; tests change their load and cached prefix.
struct TestFleet {
    workers: BTreeMap<String, Vec<WorkerState>>,
}

fn worker(name: &str) -> WorkerState {
    WorkerState {
        worker: name.into(),
        address: Some(format!("http://{name}:8000")),
        up: true,
        dp_rank: 0,
        waiting: 0,
        running: 0,
        kv_cache_usage: 0.2,
        overlap_blocks: 0,
        prompt_blocks: 64,
        pending: 0,
        pending_ms: 0.0,
    }
}

impl TestFleet {
    fn new() -> Self {
        let mut workers = BTreeMap::new();
        workers.insert("large-a100".to_owned(), vec![worker("a0"), worker("a1")]);
        workers.insert("small-l4".to_owned(), vec![worker("l0"), worker("l1")]);
        Self { workers }
    }

    fn set(&mut self, ws: &str, i: usize, f: impl FnOnce(&mut WorkerState)) -> &mut Self {
        f(&mut self.workers.get_mut(ws).unwrap()[i]);
        self
    }

    fn all(&mut self, ws: &str, f: impl Fn(&mut WorkerState)) -> &mut Self {
        self.workers.get_mut(ws).unwrap().iter_mut().for_each(f);
        self
    }
}

impl Fleet for TestFleet {
    fn workers(&self, worker_set: &str) -> Vec<WorkerState> {
        self.workers.get(worker_set).cloned().unwrap_or_default()
    }

    fn predict_ms(&self, _: &str, set: &InferenceWorkerSetSpec, w: &WorkerState) -> f64 {
        let uncached = f64::from((w.prompt_blocks - w.overlap_blocks) * set.block_size);
        20.0 + uncached / set.prefill_tokens_per_second.unwrap_or(8000.0) * 1e3
            + f64::from(w.waiting) * 250.0
            + f64::from(w.running) * 8.0
    }
}

fn eval(fleet: &TestFleet, model: &str, tags: &[&str]) -> Evaluation {
    let tags: Vec<String> = tags.iter().map(|t| (*t).to_owned()).collect();
    catalog().evaluate(
        fleet,
        &Request {
            tenant: "acme",
            model,
            tags: &tags,
            prompt_tokens: 1024,
            max_output_tokens: 256,
            tie_break: 0,
        },
    )
}

fn chosen(e: &Evaluation) -> String {
    e.chosen()
        .map(|c| target_name(&c.target))
        .unwrap_or_else(|| format!("rejected: {:?}\n{:#?}", e.outcome, e.steps))
}

#[test]
fn simple_prompts_go_to_the_small_model_unless_the_large_one_caches_them() {
    let mut fleet = TestFleet::new();
    let e = eval(&fleet, "assistant", &["complexity=low"]);
    assert_eq!(chosen(&e), "small-l4/l0");
    assert_eq!(e.rule.as_deref(), Some("simple-to-cheaper/low-complexity"));
    assert_eq!(e.rewrite_model.as_deref(), Some("llama-8b"));

    // 60 of 64 blocks cached on a1: 4 blocks to prefill at 4k tok/s beat 64 at 20k tok/s.
    fleet.set("large-a100", 1, |w| w.overlap_blocks = 60);
    let e = eval(&fleet, "assistant", &["complexity=low"]);
    assert_eq!(chosen(&e), "large-a100/a1");
    assert_eq!(e.rewrite_model.as_deref(), Some("llama-70b"));

    // Without the tag the default rule keeps the backend's pool: the large model.
    let e = eval(&TestFleet::new(), "assistant", &[]);
    assert_eq!(e.rule, None);
    assert!(chosen(&e).starts_with("large-a100/"), "{}", chosen(&e));
}

#[test]
fn busy_workers_are_skipped_and_the_burst_goes_to_the_cloud() {
    let mut fleet = TestFleet::new();
    fleet.set("large-a100", 0, |w| w.waiting = 3);
    let e = eval(&fleet, "chat", &[]);
    assert_eq!(chosen(&e), "large-a100/a1");
    let a0 = e
        .candidates
        .iter()
        .find(|c| target_name(&c.target) == "large-a100/a0")
        .unwrap();
    assert_eq!(a0.filtered.as_deref(), Some("3 queued > maxQueued 2"));

    fleet.all("large-a100", |w| w.waiting = 5);
    let e = eval(&fleet, "chat", &[]);
    assert_eq!(chosen(&e), "provider:cloud");
    assert!(e.chosen().unwrap().fallback);
    assert_eq!(e.rewrite_model.as_deref(), Some("gpt-4o-mini"));
}

#[test]
fn pii_never_leaves_the_local_workers_and_is_refused_when_they_are_full() {
    let mut fleet = TestFleet::new();
    let e = eval(&fleet, "chat", &["pii"]);
    assert_eq!(e.rule.as_deref(), Some("pii-local/pii"));
    assert!(chosen(&e).starts_with("large-a100/"));
    let cloud = e.candidates.iter().find(|c| c.external).unwrap();
    assert_eq!(
        cloud.filtered.as_deref(),
        Some("external providers are excluded")
    );

    // Busy enough that burst-to-cloud would send it out: pii is refused instead.
    fleet.all("large-a100", |w| w.waiting = 5);
    let e = eval(&fleet, "chat", &["pii"]);
    let (kind, reason) = e.outcome.clone().unwrap_err();
    assert_eq!(kind, RejectKind::Policy);
    assert!(reason.contains("local workers only"), "{reason}");
    assert!(e.candidates.iter().all(|c| !c.chosen));
}

#[test]
fn batch_work_goes_only_to_workers_under_seventy_percent_cache_usage() {
    let mut fleet = TestFleet::new();
    fleet
        .all("large-a100", |w| w.kv_cache_usage = 0.9)
        .set("small-l4", 0, |w| w.kv_cache_usage = 0.75)
        .set("small-l4", 1, |w| w.kv_cache_usage = 0.5);
    let e = eval(&fleet, "chat", &["batch"]);
    assert_eq!(chosen(&e), "small-l4/l1");
    let kept: Vec<String> = e
        .candidates
        .iter()
        .filter(|c| c.filtered.is_none())
        .map(|c| target_name(&c.target))
        .collect();
    assert_eq!(kept, ["small-l4/l1"]);

    fleet.set("small-l4", 1, |w| w.kv_cache_usage = 0.71);
    let e = eval(&fleet, "chat", &["batch"]);
    assert!(e.outcome.unwrap_err().1.contains("idle enough"));
}

#[test]
fn one_public_name_is_served_by_either_model_and_the_body_names_the_chosen_one() {
    let mut fleet = TestFleet::new();
    fleet.set("large-a100", 0, |w| w.overlap_blocks = 62);
    let e = eval(&fleet, "standard-model", &[]);
    assert_eq!(e.backend.as_deref(), Some("standard"));
    assert_eq!(chosen(&e), "large-a100/a0");
    assert_eq!(e.rewrite_model.as_deref(), Some("llama-70b"));

    let e = eval(&TestFleet::new(), "standard-model", &[]);
    assert_eq!(chosen(&e), "small-l4/l0");
    assert_eq!(e.rewrite_model.as_deref(), Some("llama-8b"));
    match &e.chosen().unwrap().target {
        Target::Worker { state, .. } => {
            assert_eq!(state.address.as_deref(), Some("http://l0:8000"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn models_nobody_serves_and_worker_sets_with_nobody_up_are_told_apart() {
    let e = eval(&TestFleet::new(), "no-such-model", &[]);
    assert_eq!(e.outcome.unwrap_err().0, RejectKind::UnknownModel);
    let mut fleet = TestFleet::new();
    fleet
        .all("large-a100", |w| w.up = false)
        .all("small-l4", |w| w.up = false);
    let e = eval(&fleet, "standard-model", &[]);
    assert_eq!(e.outcome.unwrap_err().0, RejectKind::NoCapacity);
}
