//! Stage 5, signals: the per-candidate inputs - each worker's metrics and the requests this
//! cluster sent there (always), the prompt's cached prefix (one prefix-index lookup per worker
//! set, only when a filter or the objective reads it), and the predicted TTFT with its parts
//! (see [`crate::predict`]). Explain reads the predictor without changing it.

use std::cell::RefCell;
use std::collections::BTreeMap;

use kvplane_policy::kinds::InferenceWorkerSetSpec;
use kvplane_policy::{Fleet, Prediction, Signals, WorkerState};
use kvplane_state::{Anchor, Overlap, View};

use crate::CostModel;
use crate::predict::{Ask, Predictor};

/// What besides the tokens a request's block hashes depend on, as the engines hash them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HashKeys<'a> {
    /// The model the request names, and the one each resolved worker set runs it as (a LoRA
    /// adapter of some worker sets).
    pub model: &'a str,
    pub sets: &'a BTreeMap<String, kvplane_policy::SetRef>,
    /// vLLM's `cache_salt`: only blocks cached under the same salt match.
    pub cache_salt: Option<&'a str>,
}

/// A worker set's calibration, and what a waiting request of another replica costs there.
type Factors = (f64, Option<f64>);

/// A worker set's overlap, the best match of each of its workers `(blocks, dp rank)` in the
/// pool's order (the index's, or a prompt just routed there: [`crate::placed`]), and the
/// prompt's anchors there.
type Matched = (Overlap, Vec<(u32, u32)>, Vec<Anchor>);

/// The fleet of one view (`'v`), for one prompt. Each worker set's overlap is looked up once.
pub(crate) struct ViewFleet<'a, 'v> {
    view: &'v View,
    /// The prompt's exact ids (perhaps not all of it), and its whole length in tokens.
    tokens: &'a [u32],
    prompt_tokens: usize,
    keys: HashKeys<'a>,
    cost: &'a CostModel,
    predictor: &'a Predictor,
    /// Explain: read the predictor, change nothing.
    peek: bool,
    /// Each looked-up worker set's.
    overlaps: RefCell<BTreeMap<String, Matched>>,
    /// Each worker set's calibration and typical waiting cost, read once (a decision reads a
    /// few sets, each for all its workers in a row: the newest first).
    factors: RefCell<Vec<(String, Factors)>>,
}

/// The prompt's tokens past what `w` caches, and their prefill time at the worker set's rate.
pub(crate) fn uncached(
    prompt_tokens: usize,
    set: &InferenceWorkerSetSpec,
    w: &WorkerState<'_>,
    cost: &CostModel,
) -> (u64, f64) {
    let cached = u64::from(w.overlap_blocks) * u64::from(set.block_size);
    let tokens = (prompt_tokens as u64).saturating_sub(cached);
    let rate = set
        .prefill_tokens_per_second
        .unwrap_or(cost.prefill_tokens_per_s);
    (tokens, tokens as f64 / rate * 1000.0)
}

/// The configured cost model as an engine model's terms (see [`crate::learn`]): where a
/// learned one starts. `typical_ms`: what a waiting request of another replica is taken to
/// cost there.
pub(crate) fn prior(
    set: &InferenceWorkerSetSpec,
    cost: &CostModel,
    typical_ms: Option<f64>,
) -> crate::learn::Features {
    let rate = set
        .prefill_tokens_per_second
        .unwrap_or(cost.prefill_tokens_per_s);
    [
        cost.base_ms,
        1_000_000.0 / rate,
        cost.running_request_ms,
        typical_ms.unwrap_or(cost.waiting_request_ms),
    ]
}

impl<'a, 'v> ViewFleet<'a, 'v> {
    pub(crate) fn new(
        view: &'v View,
        tokens: &'a [u32],
        prompt_tokens: usize,
        keys: HashKeys<'a>,
        cost: &'a CostModel,
        predictor: &'a Predictor,
        peek: bool,
    ) -> Self {
        Self {
            view,
            tokens,
            prompt_tokens,
            keys,
            cost,
            predictor,
            peek,
            overlaps: RefCell::default(),
            factors: RefCell::default(),
        }
    }

    fn factors(&self, name: &str) -> Factors {
        if let Some((_, f)) = self.factors.borrow().iter().rev().find(|(n, _)| n == name) {
            return *f;
        }
        let f = self.predictor.factors(name);
        self.factors.borrow_mut().push((name.to_owned(), f));
        f
    }

    /// Looks the prompt up in `worker_set`'s index, once.
    fn look_up(&self, worker_set: &str, pool: &kvplane_state::PoolView) {
        if self.overlaps.borrow().contains_key(worker_set) {
            return;
        }
        let span = tracing::debug_span!(
            "index.lookup",
            worker_set,
            prompt_tokens = self.tokens.len(),
            best_overlap_blocks = tracing::field::Empty
        );
        let _in = span.enter();
        let lora = self.view.catalog.worker_sets.get(worker_set).and_then(|s| {
            s.adapter_for(
                self.keys
                    .sets
                    .get(worker_set)
                    .map_or(self.keys.model, |r| r.model.as_str()),
            )
        });
        let hashes = pool.index.hash_tokens(self.tokens, lora);
        let (o, anchors) = pool.index.overlaps_anchored(
            &hashes,
            self.keys.cache_salt,
            crate::placed::ANCHOR_EVERY,
        );
        span.record("best_overlap_blocks", o.best_blocks());
        let ids: Vec<u64> = pool.workers.iter().map(|w| w.id).collect();
        let mut best = o.best_for_each(&ids);
        // A prompt routed there that the index does not show yet counts as cached.
        let indexed = o.best_blocks();
        for (name, blocks, rank) in self.predictor.placed_matches(worker_set, &anchors, indexed) {
            if let Some(i) = pool.workers.iter().position(|w| *w.name == *name)
                && blocks > best[i].0
            {
                best[i] = (blocks, rank);
            }
        }
        self.overlaps
            .borrow_mut()
            .insert(worker_set.to_owned(), (o, best, anchors));
    }

    /// The prompt's anchors in `worker_set`, and how many blocks the index shows `worker`
    /// holding of it (none and 0 if it was not looked up there).
    pub(crate) fn anchors_of(&self, worker_set: &str, worker: &str) -> (Vec<Anchor>, u32) {
        let Some(pool) = self.view.pools.get(worker_set) else {
            return (Vec::new(), 0);
        };
        let cache = self.overlaps.borrow();
        let Some((o, _, anchors)) = cache.get(worker_set) else {
            return (Vec::new(), 0);
        };
        let held = pool
            .workers
            .iter()
            .find(|w| *w.name == *worker)
            .map_or(0, |w| o.best_for(w.id).0);
        (anchors.clone(), held)
    }
}

impl<'v> Fleet<'v> for ViewFleet<'_, 'v> {
    fn workers(&self, worker_set: &str, signals: Signals, out: &mut Vec<WorkerState<'v>>) {
        let view: &'v View = self.view;
        let Some(pool) = view.pools.get(worker_set) else {
            return;
        };
        let lookup = signals.overlap || signals.prediction;
        if lookup {
            self.look_up(worker_set, pool);
        }
        let cache = self.overlaps.borrow();
        let overlap = cache.get(worker_set).filter(|_| lookup);
        let asks: Vec<Ask<'v>> = pool
            .workers
            .iter()
            .map(|w| Ask {
                worker: &w.name,
                metrics_index: w.metrics_index,
                metrics_at_ms: w.metrics_at_ms,
                waiting: w.metrics.waiting,
                ttft_histogram: (w.metrics.ttft_sum_s, w.metrics.ttft_count),
            })
            .collect();
        out.reserve(pool.workers.len());
        let prompt_blocks = overlap.map_or(0, |(o, _, _)| o.prompt_blocks);
        self.predictor
            .pending_set(worker_set, &asks, !self.peek, |i, f| {
                let w = &pool.workers[i];
                let (overlap_blocks, dp_rank) = overlap.map_or((0, 0), |(_, best, _)| best[i]);
                let others = w.metrics.waiting.saturating_sub(f.in_metrics);
                out.push(WorkerState {
                    worker: &w.name,
                    address: w.address.as_deref(),
                    up: w.up,
                    dp_rank,
                    waiting: others + f.requests,
                    pending: f.requests,
                    pending_ms: f.busy_ms as f64,
                    // Its last sample, or what this replica knows runs there now if more.
                    running: w.metrics.running.max(f.decoding),
                    kv_cache_usage: w.metrics.kv_cache_usage,
                    overlap_blocks,
                    prompt_blocks,
                    learned: f.learned,
                    last_routed_ms: f.last_routed_ms,
                });
            });
    }

    /// See [`crate::predict`]. The queue ahead (this replica's pending requests) is already
    /// calibrated: it is made of earlier predictions.
    /// With an engine model learned for the worker its terms replace the configured ones and
    /// the calibration.
    fn predict(&self, name: &str, set: &InferenceWorkerSetSpec, w: &WorkerState<'v>) -> Prediction {
        let (tokens, uncached_ms) = uncached(self.prompt_tokens, set, w, self.cost);
        let others = f64::from(w.waiting - w.pending);
        let inputs = [1.0, tokens as f64 / 1000.0, f64::from(w.running), others];
        if let Some(terms) = w.learned {
            let part = |i: usize| terms[i].max(0.0) * inputs[i];
            let (prefill, load) = (part(1), part(2) + part(3));
            return Prediction {
                ttft_ms: w.pending_ms + part(0) + prefill + load,
                prefill_ms: prefill,
                load_ms: w.pending_ms + load,
                displaced_ms: prefill,
                network_ms: 0.0,
                inputs,
            };
        }
        let (calibration, typical_ms) = self.factors(name);
        let load = others * typical_ms.unwrap_or(self.cost.waiting_request_ms)
            + f64::from(w.running) * self.cost.running_request_ms;
        let own = self.cost.base_ms + uncached_ms + load;
        Prediction {
            ttft_ms: w.pending_ms + own * calibration,
            prefill_ms: uncached_ms * calibration,
            load_ms: w.pending_ms + load * calibration,
            displaced_ms: uncached_ms * calibration,
            network_ms: 0.0,
            inputs,
        }
    }
}

/// Fills in the cached prefix and the prediction of a candidate chosen without them.
pub(crate) fn complete<'v>(
    fleet: &ViewFleet<'_, 'v>,
    catalog: &kvplane_policy::Catalog,
    c: &mut kvplane_policy::Candidate<'v>,
) {
    let kvplane_policy::Target::Worker { worker_set, state } = &mut c.target else {
        return;
    };
    let Some(spec) = catalog.worker_sets.get(*worker_set) else {
        return;
    };
    let mut all = Vec::new();
    fleet.workers(worker_set, Signals::ALL, &mut all);
    if let Some(w) = all.into_iter().find(|w| w.worker == state.worker) {
        c.prediction = kvplane_policy::Prediction {
            network_ms: c.prediction.network_ms,
            ..fleet.predict(worker_set, spec, &w)
        };
        *state = w;
    }
}
