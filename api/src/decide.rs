//! The routing decision: a pure function of the state view, the prompt and the cost model.
//! It allocates little on the hot path: candidates borrow names from the view, and the
//! human-readable steps are only written when asked for (Explain).

use kvplane_state::View;
use xxhash_rust::xxh3::Xxh3;

use crate::CostModel;

/// What the decision needs to know about one request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    pub request_id: &'a str,
    /// The requested model; empty matches every pool.
    pub model: &'a str,
    pub tokens: &'a [u32],
    /// The LoRA adapter the request names, if any (blocks are hashed with it).
    pub lora_name: Option<&'a str>,
}

/// One worker considered for a request, with every part of its cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    pub pool: &'a str,
    pub worker: &'a str,
    pub worker_id: u64,
    pub address: Option<&'a str>,
    pub dp_rank: u32,
    pub block_size: u32,
    pub prompt_blocks: u32,
    pub overlap_blocks: u32,
    pub uncached_tokens: u64,
    pub running: u32,
    pub waiting: u32,
    pub kv_cache_usage: f64,
    pub prefill_ms: f64,
    pub load_ms: f64,
    /// Predicted TTFT in ms; the cost (lower wins).
    pub cost: f64,
    /// Why it was filtered out; `None` when it competed.
    pub filtered: Option<&'static str>,
    pub chosen: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    UnknownModel,
    NoCapacity,
    InvalidRequest,
}

/// The decision and how it was reached.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision<'a> {
    pub applied_index: u64,
    pub candidates: Vec<Candidate<'a>>,
    /// Index into `candidates` of the pick, or why there is none.
    pub outcome: Result<usize, (RejectKind, String)>,
    /// Readable steps; empty unless the decision was asked to explain itself.
    pub steps: Vec<String>,
}

impl Decision<'_> {
    pub fn chosen(&self) -> Option<&Candidate<'_>> {
        self.outcome.as_ref().ok().map(|&i| &self.candidates[i])
    }
}

/// Picks the worker with the lowest cost among the live workers of the pools serving the model.
pub fn decide<'a>(
    view: &'a View,
    input: RouteInput<'_>,
    cost: &CostModel,
    explain: bool,
) -> Decision<'a> {
    let mut steps = Vec::new();
    let mut candidates = Vec::new();
    let mut pools = 0;
    for pool in view.pools.values().filter(|p| p.config.serves(input.model)) {
        pools += 1;
        let overlap = pool.index.overlaps(input.tokens, input.lora_name);
        let bs = pool.config.block_size;
        if explain {
            steps.push(format!(
                "pool {} serves {:?}: {} prompt tokens, {} complete blocks of {bs}, {} worker ranks hold a prefix",
                pool.name,
                input.model,
                input.tokens.len(),
                overlap.prompt_blocks,
                overlap.matched.len()
            ));
        }
        candidates.reserve(pool.workers.len());
        for w in &pool.workers {
            let (overlap_blocks, dp_rank) = overlap.best_for(w.id);
            let cached_tokens = u64::from(overlap_blocks) * u64::from(bs);
            let uncached_tokens = (input.tokens.len() as u64).saturating_sub(cached_tokens);
            let prefill_ms = cost.prefill_ms(uncached_tokens);
            let load_ms = cost.load_ms(w.metrics.waiting, w.metrics.running);
            candidates.push(Candidate {
                pool: &pool.name,
                worker: &w.name,
                worker_id: w.id,
                address: w.address.as_deref(),
                dp_rank,
                block_size: bs,
                prompt_blocks: overlap.prompt_blocks,
                overlap_blocks,
                uncached_tokens,
                running: w.metrics.running,
                waiting: w.metrics.waiting,
                kv_cache_usage: w.metrics.kv_cache_usage,
                prefill_ms,
                load_ms,
                cost: cost.base_ms + prefill_ms + load_ms,
                filtered: (!w.up).then_some("worker is down"),
                chosen: false,
            });
        }
    }
    if pools == 0 {
        let reason = format!("no pool serves model {:?}", input.model);
        if explain {
            steps.push(reason.clone());
        }
        return Decision {
            applied_index: view.applied_index,
            candidates,
            outcome: Err((RejectKind::UnknownModel, reason)),
            steps,
        };
    }
    let best = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.filtered.is_none())
        .min_by(|(_, a), (_, b)| {
            a.cost
                .total_cmp(&b.cost)
                .then(b.overlap_blocks.cmp(&a.overlap_blocks))
                .then_with(|| tie(input.request_id, a).cmp(&tie(input.request_id, b)))
        })
        .map(|(i, _)| i);
    let outcome = match best {
        Some(i) => {
            candidates[i].chosen = true;
            if explain {
                let c = &candidates[i];
                steps.push(format!(
                    "chose {}/{}: predicted {:.1} ms to first token ({} of {} blocks cached, {} waiting, {} running)",
                    c.pool, c.worker, c.cost, c.overlap_blocks, c.prompt_blocks, c.waiting, c.running
                ));
            }
            Ok(i)
        }
        None => {
            let reason = if candidates.is_empty() {
                "no worker has joined the serving pools".to_owned()
            } else {
                format!("all {} workers are down", candidates.len())
            };
            if explain {
                steps.push(reason.clone());
            }
            Err((RejectKind::NoCapacity, reason))
        }
    };
    Decision {
        applied_index: view.applied_index,
        candidates,
        outcome,
        steps,
    }
}

/// The tie-breaker among equal costs: a hash of request id and worker, so equal workers
/// share the load yet one request always gets the same answer.
fn tie(request_id: &str, c: &Candidate<'_>) -> u64 {
    let mut h = Xxh3::new();
    h.update(request_id.as_bytes());
    h.update(&[0]);
    h.update(c.pool.as_bytes());
    h.update(&[0]);
    h.update(c.worker.as_bytes());
    h.digest()
}
