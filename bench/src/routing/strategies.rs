//! The strategies compared: what users would otherwise deploy, and kvplane.
//!
//! - `round-robin`: a Kubernetes Service.
//! - `least-queue`: fewest running + waiting requests, from the engines' metrics (with the
//!   same delay kvplane has) plus what it routed since the last sample.
//! - `prefix-hash`: the engine chosen by a hash of the first 4 blocks (the approximate
//!   affinity of several gateways).
//! - `dynamo-cost`: Dynamo's reference cost over the same prefix index, in blocks:
//!   `max(0, (active_prefill + prompt) / block - overlap) + decode_blocks + 0 * active_requests`
//!   (prefill_load_scale 1, active_request_weight 0), lowest wins.
//! - `kvplane`: Route through kvplane's RouterService on a replicated state fed by the stream
//!   (an InferenceWorkerSet, the default rule: minimize PredictedTTFT), ReportUsage on first
//!   token. `kvplane-3-replicas`: three such routers, each with its own state and lag,
//!   requests spread over them in turn (three gateways behind one Service).
//! - `oracle`: not a strategy anyone can deploy but the bound of every one that decides request
//!   by request: it copies each engine as it is at the request's arrival (cache, queue, step in
//!   progress), runs the copy until the request's first token, and picks the earliest. Nothing
//!   a router learns from events and metrics can beat it on a single request.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvplane_api::predict::{Predictor, RoutedNote, RoutedSink};
use kvplane_api::{CostModel, RouterService};
use kvplane_policy::kinds::InferenceWorkerSetSpec;
use kvplane_policy::{Object, Spec};
use kvplane_proto::v1::router_server::Router as _;
use kvplane_proto::v1::{
    RouteRequest, RouteResponse as RouteResponse_, UsageReport, route_response::Decision,
};
use kvplane_sim::model::{Engine, Output, SimRequest};
use kvplane_state::{Command, ConfigObject, Entry, IngestBatch, StateMachine};

use super::fleet::{Router, Stream, WORKER_SET};
use super::workloads::Req;

const BLOCK: u32 = 16;

/// A replicated state fed from the stream with a delay.
pub struct Feed {
    sm: StateMachine,
    cursor: usize,
    lag_ms: f64,
}

impl Feed {
    pub fn new(lag_ms: f64, prefill_tokens_per_s: f64) -> Self {
        let mut sm = StateMachine::new();
        let spec: InferenceWorkerSetSpec = serde_json::from_value(serde_json::json!({
            "model": "m", "blockSize": BLOCK, "prefillTokensPerSecond": prefill_tokens_per_s,
        }))
        .unwrap_or_else(|e| panic!("worker set spec: {e}"));
        let put = ConfigObject::policy(&Object {
            name: WORKER_SET.into(),
            spec: Spec::WorkerSet(spec),
        });
        let applied = sm.apply(&Entry {
            index: 1,
            timestamp_ms: 0,
            command: Command::ConfigApply {
                owner: Some(kvplane_state::Owner::Admin),
                puts: vec![put],
                deletes: Vec::new(),
            },
        });
        assert!(applied.is_ok_and(|a| a.rejected.is_none()));
        Self {
            sm,
            cursor: 0,
            lag_ms,
        }
    }

    /// Applies what this replica has seen by `now_ms`, as one entry stamped with the time of
    /// its last message.
    pub fn catch_up(&mut self, stream: &Stream, now_ms: f64) {
        let start = self.cursor;
        while self.cursor < stream.len() && stream[self.cursor].0 + self.lag_ms <= now_ms {
            self.cursor += 1;
        }
        if self.cursor == start {
            return;
        }
        let items: Vec<_> = stream[start..self.cursor]
            .iter()
            .map(|(_, i)| i.clone())
            .collect();
        let entry = Entry {
            index: self.sm.applied_index() + 1,
            timestamp_ms: stream[self.cursor - 1].0 as u64,
            command: Command::Ingest(IngestBatch {
                source: Default::default(),
                first_seq: items[0].seq,
                last_seq: items[items.len() - 1].seq,
                items,
            }),
        };
        if let Err(e) = self.sm.apply(&entry) {
            tracing::warn!(error = %e, "bench feed entry refused");
        }
    }

    /// The state as this replica has it at `now_ms`.
    pub fn view_at(&mut self, stream: &Stream, now_ms: f64) -> Arc<kvplane_state::View> {
        self.catch_up(stream, now_ms);
        self.sm.handle().load()
    }
}

fn engine_index(worker: &str) -> usize {
    worker
        .strip_prefix('e')
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub struct RoundRobin(pub usize, pub usize);

impl Router for RoundRobin {
    fn route(&mut self, _: u64, _: &Req, _: f64, _: &Stream) -> usize {
        self.0 = (self.0 + 1) % self.1;
        self.0
    }
}

/// Requests routed since a metrics sample, per engine: (time, uncached tokens).
#[derive(Default)]
struct Routed(BTreeMap<usize, Vec<(f64, u64)>>);

impl Routed {
    fn since(&mut self, e: usize, metrics_at_ms: u64) -> (u32, u64) {
        let list = self.0.entry(e).or_default();
        list.retain(|(t, _)| *t >= metrics_at_ms as f64);
        (
            u32::try_from(list.len()).unwrap_or(u32::MAX),
            list.iter().map(|(_, x)| x).sum(),
        )
    }
}

pub struct LeastQueue {
    pub feed: Feed,
    routed: Routed,
    turn: usize,
}

impl LeastQueue {
    pub fn new(feed: Feed) -> Self {
        Self {
            feed,
            routed: Routed::default(),
            turn: 0,
        }
    }
}

impl Router for LeastQueue {
    fn route(&mut self, _: u64, _: &Req, now: f64, stream: &Stream) -> usize {
        let view = self.feed.view_at(stream, now);
        let Some(pool) = view.pools.get(WORKER_SET) else {
            return 0;
        };
        let n = pool.workers.len().max(1);
        self.turn += 1;
        let mut best = (u32::MAX, 0);
        for k in 0..n {
            // Ties go round the engines, not to the first.
            let w = &pool.workers[(k + self.turn) % n];
            let e = engine_index(&w.name);
            let (since, _) = self.routed.since(e, w.metrics_at_ms);
            let q = w.metrics.running + w.metrics.waiting + since;
            if q < best.0 {
                best = (q, e);
            }
        }
        self.routed.0.entry(best.1).or_default().push((now, 0));
        best.1
    }
}

pub struct PrefixHash(pub usize);

impl Router for PrefixHash {
    fn route(&mut self, _: u64, req: &Req, _: f64, _: &Stream) -> usize {
        let head = &req.tokens[..req.tokens.len().min(4 * BLOCK as usize)];
        let bytes: Vec<u8> = head.iter().flat_map(|t| t.to_le_bytes()).collect();
        (xxhash_rust::xxh3::xxh3_64(&bytes) % self.0 as u64) as usize
    }
}

pub struct DynamoCost {
    pub feed: Feed,
    num_gpu_blocks: u32,
    routed: Routed,
}

impl DynamoCost {
    pub fn new(feed: Feed, num_gpu_blocks: u32) -> Self {
        Self {
            feed,
            num_gpu_blocks,
            routed: Routed::default(),
        }
    }
}

impl Router for DynamoCost {
    fn route(&mut self, _: u64, req: &Req, now: f64, stream: &Stream) -> usize {
        let view = self.feed.view_at(stream, now);
        let Some(pool) = view.pools.get(WORKER_SET) else {
            return 0;
        };
        let overlap = pool.index.overlaps(&req.tokens, None);
        let isl = req.tokens.len() as f64;
        let mut best = (f64::INFINITY, 0, 0u64);
        for w in &pool.workers {
            let e = engine_index(&w.name);
            let (overlap_blocks, _) = overlap.best_for(w.id);
            let (_, active_prefill) = self.routed.since(e, w.metrics_at_ms);
            let decode_blocks = w.metrics.kv_cache_usage * f64::from(self.num_gpu_blocks);
            let cost = ((active_prefill as f64 + isl) / f64::from(BLOCK)
                - f64::from(overlap_blocks))
            .max(0.0)
                + decode_blocks;
            if cost < best.0 {
                let uncached = (req.tokens.len() as u64)
                    .saturating_sub(u64::from(overlap_blocks) * u64::from(BLOCK));
                best = (cost, e, uncached);
            }
        }
        self.routed.0.entry(best.1).or_default().push((now, best.2));
        best.1
    }
}

/// One kvplane replica: its state, its RouterService, its clock, and the decisions of the
/// other replicas on their way to it.
pub struct KvRouter {
    feed: Feed,
    service: RouterService,
    predictor: Arc<Predictor>,
    clock: Arc<AtomicU64>,
    /// The other replicas' decisions, each with when it becomes visible here.
    shared: std::collections::VecDeque<(f64, RoutedNote)>,
    /// This replica's decisions as it tells them (its routed sink).
    told: Arc<std::sync::Mutex<Vec<RoutedNote>>>,
}

impl KvRouter {
    pub fn new(feed: Feed, cost: CostModel) -> Self {
        let clock = Arc::new(AtomicU64::new(0));
        let c = clock.clone();
        let predictor = Arc::new(Predictor::new(Arc::new(move || c.load(Ordering::Relaxed))));
        let told: Arc<std::sync::Mutex<Vec<RoutedNote>>> = Arc::default();
        let sink = told.clone();
        let service = RouterService::new(feed.sm.handle(), cost, Default::default())
            .with_predictor(predictor.clone())
            .with_routed_sink(RoutedSink(Arc::new(move |n| {
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(n);
            })));
        Self {
            feed,
            service,
            predictor,
            clock,
            shared: Default::default(),
            told,
        }
    }

    /// Routes one request; returns the engine and when its first token is predicted.
    fn route(&mut self, id: u64, req: &Req, now: f64, stream: &Stream) -> (usize, u64) {
        self.clock.store(now as u64, Ordering::Relaxed);
        self.feed.catch_up(stream, now);
        while self.shared.front().is_some_and(|s| s.0 <= now) {
            if let Some((_, n)) = self.shared.pop_front() {
                self.predictor
                    .routed_elsewhere(&n.worker_set, &n.worker, n.at_ms, n.due_ms);
                self.predictor.place(
                    &n.worker_set,
                    &n.worker,
                    n.dp_rank,
                    &n.anchors,
                    (n.at_ms, n.due_ms),
                );
            }
        }
        let r =
            futures::executor::block_on(self.service.route(tonic::Request::new(RouteRequest {
                request_id: id.to_string(),
                tenant: req.tenant.into(),
                model: "m".into(),
                token_ids: req.tokens.clone(),
                max_output_tokens: req.max_tokens,
                ..Default::default()
            })));
        match r.map(tonic::Response::into_inner) {
            Ok(RouteResponse_ {
                decision: Some(Decision::Endpoint(e)),
                predicted_ttft_ms,
                ..
            }) => (
                engine_index(&e.worker_id),
                now as u64 + predicted_ttft_ms as u64,
            ),
            _ => (0, now as u64),
        }
    }

    fn first_token(&mut self, id: u64, ttft_ms: f64, now: f64) {
        self.clock.store(now as u64, Ordering::Relaxed);
        let _ = futures::executor::block_on(self.service.report_usage(tonic::Request::new(
            UsageReport {
                request_id: id.to_string(),
                observed_ttft_ms: ttft_ms,
                ..Default::default()
            },
        )));
    }
}

/// kvplane with one or more replicas routing in turn. Each replica publishes its decisions
/// (worker, predicted first token) and the others count them in that worker's queue once they
/// arrive, `share_ms` later (`kvplane-gossip.routed` on NATS core in a deployment).
pub struct Kvplane {
    pub replicas: Vec<KvRouter>,
    next: usize,
    by_request: HashMap<u64, usize>,
    share_ms: f64,
}

impl Kvplane {
    pub fn new(replicas: Vec<KvRouter>, share_ms: f64) -> Self {
        Self {
            replicas,
            next: 0,
            by_request: HashMap::new(),
            share_ms,
        }
    }
}

impl Router for Kvplane {
    fn route(&mut self, id: u64, req: &Req, now: f64, stream: &Stream) -> usize {
        let r = self.next % self.replicas.len();
        self.next += 1;
        self.by_request.insert(id, r);
        let (e, _) = self.replicas[r].route(id, req, now, stream);
        let told: Vec<RoutedNote> = std::mem::take(
            &mut *self.replicas[r]
                .told
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for (q, other) in self.replicas.iter_mut().enumerate() {
            if q != r {
                for n in &told {
                    other.shared.push_back((now + self.share_ms, n.clone()));
                }
            }
        }
        e
    }

    fn first_token(&mut self, id: u64, ttft_ms: f64, now: f64) {
        if let Some(r) = self.by_request.remove(&id) {
            self.replicas[r].first_token(id, ttft_ms, now);
        }
    }
}

/// The perfect-knowledge greedy reference (see the module's documentation).
pub struct Oracle;

impl Oracle {
    /// Time to `req`'s first token on a copy of `engine`, if it accepts it.
    fn ttft_on(engine: &Engine, id: u64, req: &Req, now: f64) -> Option<f64> {
        let mut copy = engine.clone();
        copy.advance_to(now);
        copy.submit(SimRequest {
            id,
            tokens: req.tokens.clone(),
            max_tokens: req.max_tokens,
            lora_name: None,
            cache_salt: None,
        })
        .ok()?;
        while let Some(step) = copy.step() {
            let first = step
                .outputs
                .iter()
                .any(|o| matches!(*o, Output::FirstToken { id: x, .. } if x == id));
            if first {
                return Some(step.end_ms - now);
            }
        }
        None
    }
}

impl Router for Oracle {
    fn route(&mut self, _: u64, _: &Req, _: f64, _: &Stream) -> usize {
        0
    }

    fn sees_engines(&self) -> bool {
        true
    }

    fn route_seeing(&mut self, id: u64, req: &Req, now: f64, engines: &[Engine]) -> usize {
        engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| Self::ttft_on(e, id, req, now).map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or(0, |(_, i)| i)
    }
}
