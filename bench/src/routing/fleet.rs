//! The virtual-time fleet: engines of the simulator's model, requests arriving on schedule,
//! engine steps running to their end, KV events and metrics (every 100 ms) published on a
//! stream that routers read with their own lag. Nothing sleeps.

use std::collections::HashMap;

use kvplane_sim::EngineParams;
use kvplane_sim::model::{Engine, Output, SimRequest, StepOutput};
use kvplane_state::{IngestItem, IngestPayload, KvBatch, WorkerMetrics};

use super::workloads::Req;

/// What engines publish, in time order: (time, message).
pub type Stream = Vec<(f64, IngestItem)>;

pub const WORKER_SET: &str = "gpu";
const METRICS_EVERY_MS: f64 = 100.0;

pub fn engine_name(i: usize) -> String {
    format!("e{i}")
}

/// A routing strategy.
pub trait Router {
    /// Picks an engine for request `id` arriving at `now_ms`; `stream` is everything published
    /// so far (a router sees it with its own delay).
    fn route(&mut self, id: u64, req: &Req, now_ms: f64, stream: &Stream) -> usize;
    /// The request's first token came after `ttft_ms`.
    fn first_token(&mut self, _id: u64, _ttft_ms: f64, _now_ms: f64) {}
    /// Whether it decides from the engines themselves rather than from `stream` (the
    /// perfect-knowledge reference: see [`Router::route_seeing`]).
    fn sees_engines(&self) -> bool {
        false
    }
    /// Picks an engine seeing the engines' exact state; only called when `sees_engines`.
    fn route_seeing(&mut self, id: u64, req: &Req, now_ms: f64, _engines: &[Engine]) -> usize {
        self.route(id, req, now_ms, &Vec::new())
    }
}

/// What one run measured.
#[derive(Debug, Default)]
pub struct Outcome {
    pub ttft_ms: Vec<f64>,
    pub requests_per_engine: Vec<u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub first_arrival_ms: f64,
    pub last_finish_ms: f64,
    pub refused: u64,
}

struct Fleet {
    engines: Vec<Engine>,
    /// Each engine's step in progress, to be taken at its end.
    steps: Vec<Option<StepOutput>>,
    stream: Stream,
    seq: u64,
}

impl Fleet {
    fn publish(&mut self, at: f64, engine: usize, payload: IngestPayload) {
        self.seq += 1;
        self.stream.push((
            at,
            IngestItem {
                seq: self.seq,
                pool: WORKER_SET.into(),
                worker: engine_name(engine),
                payload,
            },
        ));
    }

    fn start_step(&mut self, e: usize) {
        if self.steps[e].is_none() && self.engines[e].has_work() {
            self.steps[e] = self.engines[e].step();
        }
    }
}

enum Next {
    Arrival,
    StepEnd(usize),
    Metrics,
}

/// Replays `reqs` on `n` engines through `router`.
pub fn run(reqs: &[Req], params: EngineParams, n: usize, router: &mut dyn Router) -> Outcome {
    let mut f = Fleet {
        engines: (0..n).map(|_| Engine::new(params)).collect(),
        steps: (0..n).map(|_| None).collect(),
        stream: Vec::new(),
        seq: 0,
    };
    for e in 0..n {
        f.publish(
            0.0,
            e,
            IngestPayload::Worker {
                up: true,
                address: Some(format!("http://{}:8000", engine_name(e))),
            },
        );
    }
    let mut out = Outcome {
        requests_per_engine: vec![0; n],
        first_arrival_ms: reqs.first().map_or(0.0, |r| r.at_ms),
        ..Outcome::default()
    };
    let mut arrived: HashMap<u64, f64> = HashMap::new();
    let mut next_req = 0usize;
    let mut next_metrics = 0.0f64;
    loop {
        let arrival = reqs.get(next_req).map(|r| r.at_ms);
        let step_end = f
            .steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s.end_ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if arrival.is_none() && step_end.is_none() {
            break;
        }
        let mut next = (Next::Metrics, next_metrics);
        if let Some(t) = arrival
            && t < next.1
        {
            next = (Next::Arrival, t);
        }
        if let Some((e, t)) = step_end
            && t < next.1
        {
            next = (Next::StepEnd(e), t);
        }
        let now = next.1;
        match next.0 {
            Next::Metrics => {
                for e in 0..n {
                    let s = f.engines[e].stats();
                    let hit = if s.prefix_cache_queries == 0 {
                        0.0
                    } else {
                        s.prefix_cache_hits as f64 / s.prefix_cache_queries as f64
                    };
                    f.publish(
                        now,
                        e,
                        IngestPayload::Metrics(WorkerMetrics {
                            running: s.running,
                            waiting: s.waiting,
                            kv_cache_usage: s.kv_cache_usage,
                            prefix_cache_hit_rate: hit,
                            ..Default::default()
                        }),
                    );
                }
                next_metrics += METRICS_EVERY_MS;
            }
            Next::Arrival => {
                let req = &reqs[next_req];
                let id = next_req as u64;
                next_req += 1;
                let e = if router.sees_engines() {
                    router.route_seeing(id, req, now, &f.engines)
                } else {
                    router.route(id, req, now, &f.stream)
                }
                .min(n - 1);
                out.requests_per_engine[e] += 1;
                arrived.insert(id, now);
                f.engines[e].advance_to(now);
                let submitted = f.engines[e].submit(SimRequest {
                    id,
                    tokens: req.tokens.clone(),
                    max_tokens: req.max_tokens,
                    lora_name: None,
                    cache_salt: None,
                });
                if submitted.is_err() {
                    out.refused += 1;
                }
                f.start_step(e);
            }
            Next::StepEnd(e) => {
                let Some(step) = f.steps[e].take() else {
                    continue;
                };
                for o in &step.outputs {
                    match *o {
                        Output::FirstToken { id, .. } => {
                            let ttft = now - arrived.get(&id).copied().unwrap_or(now);
                            out.ttft_ms.push(ttft);
                            router.first_token(id, ttft, now);
                        }
                        Output::Finished { usage, .. } => {
                            out.prompt_tokens += u64::from(usage.prompt_tokens);
                            out.cached_tokens += u64::from(usage.cached_tokens);
                            out.output_tokens += u64::from(usage.completion_tokens);
                            out.last_finish_ms = now;
                        }
                        Output::Token { .. } => {}
                    }
                }
                if !step.events.is_empty() {
                    f.publish(
                        now,
                        e,
                        IngestPayload::Kv(KvBatch {
                            dp_rank: 0,
                            events: step.events,
                        }),
                    );
                }
                f.start_step(e);
            }
        }
    }
    out
}
