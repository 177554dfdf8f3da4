//! The routing decision: a pure function of the state view, the prompt and the cost model.

use kvplane_state::View;
use xxhash_rust::xxh3::xxh3_64;

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
pub struct Candidate {
    pub pool: String,
    pub worker: String,
    pub worker_id: u64,
    pub address: Option<String>,
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
    pub filtered: Option<String>,
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
pub struct Decision {
    pub applied_index: u64,
    pub candidates: Vec<Candidate>,
    /// Index into `candidates` of the pick, or why there is none.
    pub outcome: Result<usize, (RejectKind, String)>,
    pub steps: Vec<String>,
}

impl Decision {
    pub fn chosen(&self) -> Option<&Candidate> {
        self.outcome.as_ref().ok().map(|&i| &self.candidates[i])
    }
}

/// Picks the worker with the lowest cost among the live workers of the pools serving the model.
pub fn decide(view: &View, input: RouteInput<'_>, cost: &CostModel) -> Decision {
    let mut steps = Vec::new();
    let pools: Vec<_> = view
        .pools
        .values()
        .filter(|p| p.config.serves(input.model))
        .collect();
    if pools.is_empty() {
        let reason = format!("no pool serves model {:?}", input.model);
        steps.push(reason.clone());
        return Decision {
            applied_index: view.applied_index,
            candidates: Vec::new(),
            outcome: Err((RejectKind::UnknownModel, reason)),
            steps,
        };
    }
    steps.push(format!(
        "pools serving {:?}: {}",
        input.model,
        pools
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut candidates = Vec::new();
    for pool in pools {
        let overlap = pool.index.overlaps(input.tokens, input.lora_name);
        let bs = pool.config.block_size;
        steps.push(format!(
            "pool {}: {} prompt tokens, {} complete blocks of {bs}, {} worker ranks matched",
            pool.name,
            input.tokens.len(),
            overlap.prompt_blocks,
            overlap.matched.len()
        ));
        for w in &pool.workers {
            let (overlap_blocks, dp_rank) = overlap.best_for(w.id);
            let cached_tokens = u64::from(overlap_blocks) * u64::from(bs);
            let uncached_tokens = (input.tokens.len() as u64).saturating_sub(cached_tokens);
            let prefill_ms = cost.prefill_ms(uncached_tokens);
            let load_ms = cost.load_ms(w.metrics.waiting, w.metrics.running);
            candidates.push(Candidate {
                pool: pool.name.clone(),
                worker: w.name.clone(),
                worker_id: w.id,
                address: w.address.clone(),
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
                filtered: (!w.up).then(|| "worker is down".to_owned()),
                chosen: false,
            });
        }
    }
    let best = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.filtered.is_none())
        .min_by(|(_, a), (_, b)| {
            a.cost
                .total_cmp(&b.cost)
                .then(b.overlap_blocks.cmp(&a.overlap_blocks))
                .then(tie(input.request_id, a).cmp(&tie(input.request_id, b)))
        })
        .map(|(i, _)| i);
    let outcome = match best {
        Some(i) => {
            candidates[i].chosen = true;
            let c = &candidates[i];
            steps.push(format!(
                "chose {}/{}: cost {:.1} ms ({} of {} blocks cached)",
                c.pool, c.worker, c.cost, c.overlap_blocks, c.prompt_blocks
            ));
            Ok(i)
        }
        None => {
            let reason = if candidates.is_empty() {
                "no worker has joined the serving pools".to_owned()
            } else {
                format!("all {} workers are down", candidates.len())
            };
            steps.push(reason.clone());
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

fn tie(request_id: &str, c: &Candidate) -> u64 {
    let mut buf = Vec::with_capacity(request_id.len() + c.worker.len() + c.pool.len() + 2);
    buf.extend_from_slice(request_id.as_bytes());
    buf.push(0);
    buf.extend_from_slice(c.pool.as_bytes());
    buf.push(0);
    buf.extend_from_slice(c.worker.as_bytes());
    xxh3_64(&buf)
}
