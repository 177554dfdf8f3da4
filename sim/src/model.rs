//! The engine model: vLLM's scheduler and prefix cache, reduced to what decides time to first
//! token. Virtual time only: [`Engine::step`] says how long a step takes; callers decide
//! whether to sleep through it (the simulator) or not (benchmarks).
//!
//! - KV cache: `num_gpu_blocks` blocks of `block_size` tokens. A prompt's full blocks are looked
//!   up by chained hash; the longest cached prefix is reused (never the whole prompt: the last
//!   token is always computed, as in vLLM). Blocks of finished requests stay cached and are
//!   evicted least recently freed first (a request's tail before its head).
//! - Scheduling: first come, first served. A waiting request is admitted when a sequence slot
//!   and KV blocks for its prompt plus `max_tokens` are free. Each step decodes one token for
//!   every running request and spends the rest of `max_num_batched_tokens` on prefill chunks.
//! - Step time: `step_base_ms + per_seq_ms * sequences_in_step + prefill_tokens / rate +
//!   prefill_ms_per_ktoken_squared * (prefill_tokens / 1000)^2`.
//!   The step that completes a prompt produces its first token.
//! - Events: blocks become cached (BlockStored) at the end of the step that computed them;
//!   evictions are BlockRemoved. One batch per step, like vLLM's publisher.

use std::collections::{BTreeSet, HashMap, VecDeque};

use kvplane_state::{KvEvent, Tier};

use crate::EngineParams;
use crate::hash::{block_hashes, salted_block_hashes};

/// A request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub lora_name: Option<String>,
    /// vLLM's `cache_salt`: the request shares cached blocks only with requests of the same.
    pub cache_salt: Option<String>,
}

/// Token counts of a finished request, as `usage` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// What a step produced for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Output {
    /// The first token; `ttft_ms` is from arrival to the end of this step.
    FirstToken { id: u64, ttft_ms: f64 },
    /// A further token.
    Token { id: u64 },
    /// The request is done (its last token was in this step).
    Finished { id: u64, usage: Usage },
}

/// One scheduler step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub start_ms: f64,
    pub end_ms: f64,
    /// The step's KV events (empty when no block changed).
    pub events: Vec<KvEvent>,
    pub outputs: Vec<Output>,
    pub prefill_tokens: u32,
    pub decode_tokens: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("request needs {needed} KV blocks but the engine has {capacity}")]
    TooLarge { needed: u32, capacity: u32 },
    #[error("request has an empty prompt")]
    EmptyPrompt,
}

/// The engine's gauges and counters (vLLM's metric meanings).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    pub running: u32,
    pub waiting: u32,
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub request_success: u64,
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    max_tokens: u32,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    arrival_ms: f64,
    hashes: Vec<u64>,
    blocks: Vec<u32>,
    cached_tokens: u32,
    computed: u32,
    generated: u32,
    /// Prompt blocks already cached (hits, or computed and registered).
    stored: usize,
}

impl Seq {
    fn prompt_len(&self) -> u32 {
        u32::try_from(self.tokens.len()).unwrap_or(u32::MAX)
    }
    fn prefilled(&self) -> bool {
        self.computed >= self.prompt_len()
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    hash: Option<u64>,
    refs: u32,
}

/// One simulated engine (benchmarks clone it to look ahead).
#[derive(Debug, Clone)]
pub struct Engine {
    p: EngineParams,
    now_ms: f64,
    blocks: Vec<Block>,
    free_fresh: Vec<u32>,
    /// Cached blocks nobody uses, by the order they were freed (evicted first to last).
    free_cached: BTreeSet<(u64, u32)>,
    freed_at: Vec<u64>,
    cache: HashMap<u64, u32>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    tick: u64,
    stats: EngineStats,
    pending_removed: Vec<u64>,
}

impl Engine {
    pub fn new(p: EngineParams) -> Self {
        let n = p.num_gpu_blocks;
        Self {
            p,
            now_ms: 0.0,
            blocks: vec![Block::default(); n as usize],
            free_fresh: (0..n).rev().collect(),
            free_cached: BTreeSet::new(),
            freed_at: vec![0; n as usize],
            cache: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            tick: 0,
            stats: EngineStats::default(),
            pending_removed: Vec::new(),
        }
    }

    pub fn params(&self) -> &EngineParams {
        &self.p
    }

    pub fn now_ms(&self) -> f64 {
        self.now_ms
    }

    /// Moves the clock forward (idle time); never backward.
    pub fn advance_to(&mut self, t_ms: f64) {
        if t_ms > self.now_ms {
            self.now_ms = t_ms;
        }
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn blocks_for(&self, tokens: u32, max_tokens: u32) -> u32 {
        (tokens + max_tokens).div_ceil(self.p.block_size)
    }

    /// Queues a request arriving now.
    pub fn submit(&mut self, r: SimRequest) -> Result<(), SubmitError> {
        if r.tokens.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let len = u32::try_from(r.tokens.len()).unwrap_or(u32::MAX);
        let needed = self.blocks_for(len, r.max_tokens.max(1));
        if needed > self.p.num_gpu_blocks {
            return Err(SubmitError::TooLarge {
                needed,
                capacity: self.p.num_gpu_blocks,
            });
        }
        let hashes = salted_block_hashes(
            &r.tokens,
            self.p.block_size,
            r.lora_name.as_deref(),
            r.cache_salt.as_deref(),
        );
        self.waiting.push_back(Seq {
            id: r.id,
            tokens: r.tokens,
            max_tokens: r.max_tokens.max(1),
            lora_name: r.lora_name,
            cache_salt: r.cache_salt,
            arrival_ms: self.now_ms,
            hashes,
            blocks: Vec::new(),
            cached_tokens: 0,
            computed: 0,
            generated: 0,
            stored: 0,
        });
        Ok(())
    }

    /// Clears the prefix cache of blocks nobody uses (vLLM's `/reset_prefix_cache`).
    /// Returns the event to publish.
    /// Blocks in use lose their cache identity (they are freed as plain blocks later).
    pub fn reset_prefix_cache(&mut self) -> KvEvent {
        for (_, id) in std::mem::take(&mut self.free_cached) {
            self.free_fresh.push(id);
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cache.clear();
        self.pending_removed.clear();
        KvEvent::Cleared
    }

    pub fn stats(&self) -> EngineStats {
        let used = self.blocks.iter().filter(|b| b.refs > 0).count();
        EngineStats {
            running: u32::try_from(self.running.len()).unwrap_or(u32::MAX),
            waiting: u32::try_from(self.waiting.len()).unwrap_or(u32::MAX),
            kv_cache_usage: used as f64 / f64::from(self.p.num_gpu_blocks),
            ..self.stats
        }
    }

    /// Cached prefix of a prompt in tokens (for tests and explanations).
    pub fn cached_prefix_tokens(&self, tokens: &[u32], lora_name: Option<&str>) -> u32 {
        let hashes = block_hashes(tokens, self.p.block_size, lora_name);
        let hit = hashes
            .iter()
            .take_while(|h| self.cache.contains_key(h))
            .count();
        u32::try_from(hit).unwrap_or(u32::MAX) * self.p.block_size
    }

    fn take_free_block(&mut self) -> Option<u32> {
        if let Some(id) = self.free_fresh.pop() {
            return Some(id);
        }
        let (tick, id) = self.free_cached.pop_first()?;
        let _ = tick;
        if let Some(h) = self.blocks[id as usize].hash.take() {
            self.cache.remove(&h);
            self.pending_removed.push(h);
        }
        Some(id)
    }

    fn release(&mut self, blocks: &[u32]) {
        // Tail first, so a prefix outlives its continuations.
        for &id in blocks.iter().rev() {
            let b = &mut self.blocks[id as usize];
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                if b.hash.is_some() {
                    self.tick += 1;
                    self.freed_at[id as usize] = self.tick;
                    self.free_cached.insert((self.tick, id));
                } else {
                    self.free_fresh.push(id);
                }
            }
        }
    }

    /// Admits waiting requests while slots and blocks allow (first come, first served).
    fn admit(&mut self) {
        let bs = self.p.block_size;
        while let Some(seq) = self.waiting.front() {
            if self.running.len() >= self.p.max_num_seqs as usize {
                return;
            }
            let len = seq.prompt_len();
            let mut hit: Vec<u32> = seq
                .hashes
                .iter()
                .map_while(|h| self.cache.get(h).copied())
                .collect();
            if hit.len() as u32 * bs >= len {
                hit.pop();
            }
            let total = self.blocks_for(len, seq.max_tokens);
            let needed = total - hit.len() as u32;
            let idle_hits = hit
                .iter()
                .filter(|id| self.blocks[**id as usize].refs == 0)
                .count();
            let available = self.free_fresh.len() + self.free_cached.len() - idle_hits;
            if (needed as usize) > available {
                return;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            for &id in &hit {
                let b = &mut self.blocks[id as usize];
                if b.refs == 0 {
                    self.free_cached.remove(&(self.freed_at[id as usize], id));
                }
                b.refs += 1;
            }
            seq.blocks = hit.clone();
            for _ in 0..needed {
                if let Some(id) = self.take_free_block() {
                    self.blocks[id as usize].refs = 1;
                    seq.blocks.push(id);
                }
            }
            let hit_tokens = hit.len() as u32 * bs;
            seq.cached_tokens = hit_tokens;
            seq.computed = hit_tokens;
            seq.stored = hit.len();
            self.stats.prefix_cache_queries += u64::from(len);
            self.stats.prefix_cache_hits += u64::from(hit_tokens);
            self.stats.prompt_tokens += u64::from(len);
            self.running.push(seq);
        }
    }

    /// Runs one scheduler step from the current time; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<StepOutput> {
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        let mut budget = self.p.max_num_batched_tokens;
        let mut decode_tokens = 0u32;
        for s in &self.running {
            if s.prefilled() && budget > 0 {
                budget -= 1;
                decode_tokens += 1;
            }
        }
        let mut chunks: Vec<(usize, u32)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if !s.prefilled() && budget > 0 {
                let chunk = (s.prompt_len() - s.computed).min(budget);
                budget -= chunk;
                chunks.push((i, chunk));
            }
        }
        let prefill_tokens: u32 = chunks.iter().map(|(_, c)| c).sum();
        let seqs = decode_tokens as usize + chunks.len();
        let duration = self.p.step_base_ms
            + self.p.per_seq_ms * seqs as f64
            + f64::from(prefill_tokens) / self.p.prefill_tokens_per_s * 1000.0
            + self.p.prefill_ms_per_ktoken_squared * (f64::from(prefill_tokens) / 1000.0).powi(2);
        let start = self.now_ms;
        let end = start + duration;

        let bs = self.p.block_size as usize;
        let mut events = Vec::new();
        if !self.pending_removed.is_empty() {
            events.push(KvEvent::Removed {
                block_hashes: std::mem::take(&mut self.pending_removed),
                tier: Tier::Gpu,
            });
        }
        let mut outputs = Vec::new();
        // Decodes first (they were scheduled first), then the prefill chunks.
        for s in self.running.iter_mut().filter(|s| s.prefilled()) {
            s.generated += 1;
            self.stats.generation_tokens += 1;
            outputs.push(Output::Token { id: s.id });
        }
        for (i, chunk) in chunks {
            let s = &mut self.running[i];
            s.computed += chunk;
            let full = (s.computed as usize / bs).min(s.hashes.len());
            let mut run: Vec<u64> = Vec::new();
            let mut run_start = s.stored;
            for j in s.stored..full {
                let h = s.hashes[j];
                let id = s.blocks[j];
                if self.cache.contains_key(&h) {
                    // Computed twice concurrently: keep the first copy, ours stays private.
                    if !run.is_empty() {
                        events.push(stored_event(
                            s,
                            run_start,
                            std::mem::take(&mut run),
                            self.p.block_size,
                        ));
                    }
                    run_start = j + 1;
                    continue;
                }
                self.cache.insert(h, id);
                self.blocks[id as usize].hash = Some(h);
                run.push(h);
            }
            if !run.is_empty() {
                events.push(stored_event(s, run_start, run, self.p.block_size));
            }
            s.stored = full;
            if s.prefilled() {
                s.generated = 1;
                self.stats.generation_tokens += 1;
                outputs.push(Output::FirstToken {
                    id: s.id,
                    ttft_ms: end - s.arrival_ms,
                });
            }
        }
        let mut finished = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].generated >= self.running[k].max_tokens {
                finished.push(self.running.remove(k));
            } else {
                k += 1;
            }
        }
        for s in finished {
            self.release(&s.blocks);
            self.stats.request_success += 1;
            outputs.push(Output::Finished {
                id: s.id,
                usage: Usage {
                    prompt_tokens: s.prompt_len(),
                    completion_tokens: s.generated,
                    cached_tokens: s.cached_tokens,
                },
            });
        }
        self.now_ms = end;
        Some(StepOutput {
            start_ms: start,
            end_ms: end,
            events,
            outputs,
            prefill_tokens,
            decode_tokens,
        })
    }
}

fn stored_event(s: &Seq, first_block: usize, hashes: Vec<u64>, block_size: u32) -> KvEvent {
    let bs = block_size as usize;
    let n = hashes.len();
    KvEvent::Stored {
        block_hashes: hashes,
        parent_hash: first_block.checked_sub(1).map(|p| s.hashes[p]),
        token_ids: s.tokens[first_block * bs..(first_block + n) * bs].to_vec(),
        block_size,
        lora_name: s.lora_name.clone(),
        // vLLM's extra keys hold the salt for a request's first block only.
        cache_salt: if first_block == 0 {
            s.cache_salt.clone()
        } else {
            None
        },
        tier: Tier::Gpu,
    }
}
