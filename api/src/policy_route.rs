//! Routing through the policy catalog, once the replicated state holds one: the live fleet as
//! the policy evaluator sees it (workers of a worker set, their cached prefix of this prompt,
//! predicted TTFT from the cost model), and the evaluation turned into a gRPC answer.

use std::cell::RefCell;
use std::collections::BTreeMap;

use kvplane_policy::kinds::InferenceWorkerSetSpec;
use kvplane_policy::{Evaluation, Fleet, RejectKind, Target, WorkerState};
use kvplane_proto::v1::{
    CandidateExplanation, Endpoint, RejectCode, Rejection, RouteResponse, route_response,
};
use kvplane_state::{Overlap, View};

use crate::CostModel;
use crate::predict::Predictor;

/// The fleet of one view, for one prompt. Each worker set's overlap is looked up once.
pub(crate) struct ViewFleet<'a> {
    pub(crate) view: &'a View,
    pub(crate) tokens: &'a [u32],
    keys: HashKeys<'a>,
    pub(crate) cost: &'a CostModel,
    predictor: &'a Predictor,
    overlaps: RefCell<BTreeMap<String, Overlap>>,
    /// Each worker set's calibration and typical waiting cost, read once.
    factors: RefCell<BTreeMap<String, (f64, Option<f64>)>>,
}

/// What besides the tokens a request's block hashes depend on, as the engines hash them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HashKeys<'a> {
    /// The model the request names (a LoRA adapter of some worker sets).
    pub model: &'a str,
    /// vLLM's `cache_salt`: only blocks cached under the same salt match.
    pub cache_salt: Option<&'a str>,
}

impl<'a> ViewFleet<'a> {
    pub(crate) fn new(
        view: &'a View,
        tokens: &'a [u32],
        keys: HashKeys<'a>,
        cost: &'a CostModel,
        predictor: &'a Predictor,
    ) -> Self {
        Self {
            view,
            tokens,
            keys,
            cost,
            predictor,
            overlaps: RefCell::default(),
            factors: RefCell::default(),
        }
    }
}

/// The prompt's tokens past what `w` caches, and their prefill time at the worker set's rate.
pub(crate) fn uncached(
    prompt_tokens: usize,
    set: &InferenceWorkerSetSpec,
    w: &WorkerState,
    cost: &CostModel,
) -> (u64, f64) {
    let cached = u64::from(w.overlap_blocks) * u64::from(set.block_size);
    let tokens = (prompt_tokens as u64).saturating_sub(cached);
    let rate = set
        .prefill_tokens_per_second
        .unwrap_or(cost.prefill_tokens_per_s);
    (tokens, tokens as f64 / rate * 1000.0)
}

impl ViewFleet<'_> {
    fn uncached_ms(&self, set: &InferenceWorkerSetSpec, w: &WorkerState) -> f64 {
        uncached(self.tokens.len(), set, w, self.cost).1
    }

    fn factors(&self, name: &str) -> (f64, Option<f64>) {
        if let Some(f) = self.factors.borrow().get(name) {
            return *f;
        }
        let f = self.predictor.factors(name);
        self.factors.borrow_mut().insert(name.to_owned(), f);
        f
    }
}

impl Fleet for ViewFleet<'_> {
    fn workers(&self, worker_set: &str) -> Vec<WorkerState> {
        let Some(pool) = self.view.pools.get(worker_set) else {
            return Vec::new();
        };
        let mut cache = self.overlaps.borrow_mut();
        let overlap = cache.entry(worker_set.to_owned()).or_insert_with(|| {
            let span = tracing::debug_span!(
                "index.lookup",
                worker_set,
                prompt_tokens = self.tokens.len(),
                best_overlap_blocks = tracing::field::Empty
            );
            let _in = span.enter();
            let lora = self
                .view
                .catalog
                .worker_sets
                .get(worker_set)
                .and_then(|s| s.adapter_for(self.keys.model));
            let o = pool
                .index
                .overlaps_keyed(self.tokens, lora, self.keys.cache_salt);
            span.record("best_overlap_blocks", o.best_blocks());
            o
        });
        pool.workers
            .iter()
            .map(|w| {
                let (overlap_blocks, dp_rank) = overlap.best_for(w.id);
                let f = self.predictor.pending(
                    worker_set,
                    &w.name,
                    w.metrics_at_ms,
                    w.metrics.waiting,
                    (w.metrics.ttft_sum_s, w.metrics.ttft_count),
                );
                let others = w.metrics.waiting.saturating_sub(f.in_metrics);
                WorkerState {
                    worker: w.name.clone(),
                    address: w.address.clone(),
                    up: w.up,
                    dp_rank,
                    waiting: others + f.requests,
                    pending: f.requests,
                    pending_ms: f.busy_ms as f64,
                    running: w.metrics.running,
                    kv_cache_usage: w.metrics.kv_cache_usage,
                    overlap_blocks,
                    prompt_blocks: overlap.prompt_blocks,
                }
            })
            .collect()
    }

    /// The request's uncached prefill time there.
    fn displaced_ms(&self, name: &str, set: &InferenceWorkerSetSpec, w: &WorkerState) -> f64 {
        self.uncached_ms(set, w) * self.factors(name).0
    }

    /// See [`crate::predict`].
    fn predict_ms(&self, name: &str, set: &InferenceWorkerSetSpec, w: &WorkerState) -> f64 {
        // The queue ahead (this replica's pending requests) is already calibrated: it is made of
        // earlier predictions.
        let (calibration, typical_ms) = self.factors(name);
        let others = f64::from(w.waiting - w.pending);
        let own = self.cost.base_ms
            + self.uncached_ms(set, w)
            + others * typical_ms.unwrap_or(self.cost.waiting_request_ms)
            + f64::from(w.running) * self.cost.running_request_ms;
        w.pending_ms + own * calibration
    }
}

fn endpoint(t: &Target) -> Endpoint {
    match t {
        Target::Worker { worker_set, state } => Endpoint {
            address: state.address.clone().unwrap_or_default(),
            worker_id: state.worker.clone(),
            pool: worker_set.clone(),
            dp_rank: state.dp_rank,
            provider: String::new(),
        },
        Target::Provider { name, endpoint } => Endpoint {
            address: endpoint.clone(),
            worker_id: String::new(),
            pool: String::new(),
            dp_rank: 0,
            provider: name.clone(),
        },
    }
}

/// The body with `model` set to `model`; `None` when the body is not a JSON object.
fn rewrite_body(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), serde_json::Value::String(model.to_owned()));
    serde_json::to_vec(&v).ok()
}

/// The Route answer for an evaluation.
pub(crate) fn response(
    e: &Evaluation,
    applied_index: u64,
    prompt_tokens: usize,
    body: &[u8],
) -> RouteResponse {
    let mut out = RouteResponse {
        applied_index,
        prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
        ..Default::default()
    };
    match (&e.outcome, e.chosen()) {
        (Ok(_), Some(c)) => {
            out.decision = Some(route_response::Decision::Endpoint(endpoint(&c.target)));
            out.predicted_ttft_ms = c.predicted_ttft_ms;
            out.model = c.model.clone();
            if let Target::Worker { state, .. } = &c.target {
                out.matched_blocks = state.overlap_blocks;
                out.prompt_blocks = state.prompt_blocks;
            }
            if let Some(m) = &e.rewrite_model
                && !body.is_empty()
            {
                out.rewritten_body = rewrite_body(body, m);
            }
        }
        (Err((kind, reason)), _) => {
            let code = match kind {
                RejectKind::UnknownModel => RejectCode::UnknownModel,
                RejectKind::NoCapacity => RejectCode::NoCapacity,
                RejectKind::Policy => RejectCode::Policy,
            };
            out.decision = Some(route_response::Decision::Rejection(Rejection {
                code: code.into(),
                reason: reason.clone(),
                retry_after_ms: 0,
            }));
        }
        (Ok(_), None) => {}
    }
    out
}

/// Explain's view of each candidate.
pub(crate) fn explained(e: &Evaluation) -> Vec<CandidateExplanation> {
    e.candidates
        .iter()
        .map(|c| {
            let (overlap, prompt, running, waiting, kv) = match &c.target {
                Target::Worker { state, .. } => (
                    state.overlap_blocks,
                    state.prompt_blocks,
                    state.running,
                    state.waiting,
                    state.kv_cache_usage,
                ),
                Target::Provider { .. } => (0, 0, 0, 0, 0.0),
            };
            CandidateExplanation {
                endpoint: Some(endpoint(&c.target)),
                overlap_blocks: overlap,
                uncached_blocks: prompt.saturating_sub(overlap),
                running,
                waiting,
                kv_cache_usage: kv,
                prefill_cost: 0.0,
                load_cost: 0.0,
                cost: c.objective,
                predicted_ttft_ms: c.predicted_ttft_ms,
                filtered_reason: c.filtered.clone().unwrap_or_default(),
                chosen: c.chosen,
            }
        })
        .collect()
}
