//! The fleet's side of the stream: publishers that send each engine's batches at its step
//! rate (and now and then its metrics) over JetStream, and the probe that measures how long
//! a published block takes to reach a follower's routing decisions.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kvplane_ingest::{MetricsMessage, WorkerMessage, kv_subject, metrics_subject, worker_subject};
use kvplane_proto::v1::RouteRequest;
use kvplane_proto::v1::route_response::Decision;
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_sim::rng::Rng;
use kvplane_state::{KvBatch, KvEvent};
use tokio::sync::watch;
use tonic::transport::Channel;

use super::engines::{Engine, FleetShape, StepCounts};

/// The pool every simulated engine is in.
pub(crate) const POOL: &str = "default";
/// Acknowledgements a publisher waits for at most at once.
const MAX_IN_FLIGHT: usize = 4_096;

/// What a publisher sent.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sent {
    pub kv_batches: u64,
    pub kv_events: u64,
    pub metrics: u64,
    pub counts: StepCounts,
    /// Publishes JetStream did not acknowledge.
    pub failed: u64,
}

impl Sent {
    pub(crate) fn add(&mut self, o: &Sent) {
        self.kv_batches += o.kv_batches;
        self.kv_events += o.kv_events;
        self.metrics += o.metrics;
        self.counts.stored_blocks += o.counts.stored_blocks;
        self.counts.removed_blocks += o.counts.removed_blocks;
        self.failed += o.failed;
    }
}

/// When the engines step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pace {
    pub start: Instant,
    pub seconds: f64,
    pub batches_per_s: f64,
    /// Chance that a step also publishes the engine's metrics.
    pub metrics_share: f64,
}

/// The highest stream sequence JetStream acknowledged so far.
#[derive(Debug, Default)]
pub(crate) struct Acked(AtomicU64);

impl Acked {
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    fn saw(&self, seq: u64) {
        self.0.fetch_max(seq, Ordering::Relaxed);
    }
}

fn metrics_payload(rng: &mut Rng) -> Vec<u8> {
    let m = MetricsMessage {
        num_requests_running: rng.below(32) as u32,
        num_requests_waiting: rng.below(8) as u32,
        kv_cache_usage_perc: rng.unit(),
        prefix_cache_hit_rate: rng.unit(),
        time_to_first_token_seconds_sum: 0.0,
        time_to_first_token_seconds_count: 0,
    };
    serde_json::to_vec(&m).unwrap_or_default()
}

/// Announces `engines` (up, with an address, and first metrics) and waits for the acks.
pub(crate) async fn announce(
    js: &jetstream::Context,
    engines: &[&str],
    acked: &Acked,
) -> anyhow::Result<u64> {
    let mut rng = Rng::new(1);
    let mut acks = FuturesUnordered::new();
    for (i, name) in engines.iter().enumerate() {
        let up = WorkerMessage {
            status: kvplane_ingest::WorkerStatus::Up,
            address: Some(format!(
                "http://10.{}.{}.{}:8000",
                i >> 16,
                (i >> 8) & 255,
                i & 255
            )),
        };
        acks.push(
            js.publish(worker_subject(POOL, name), serde_json::to_vec(&up)?.into())
                .await?
                .into_future(),
        );
        acks.push(
            js.publish(
                metrics_subject(POOL, name),
                metrics_payload(&mut rng).into(),
            )
            .await?
            .into_future(),
        );
    }
    let mut n = 0;
    while let Some(ack) = acks.next().await {
        acked.saw(ack.context("announcing the fleet")?.sequence);
        n += 1;
    }
    Ok(n)
}

/// Publishes `engines`' batches on schedule until the pace's end; returns them (their caches
/// as the cluster must now index them) and what was sent.
pub(crate) async fn publisher(
    js: jetstream::Context,
    mut engines: Vec<(usize, Engine)>,
    shape: FleetShape,
    pace: Pace,
    acked: Arc<Acked>,
) -> (Vec<(usize, Engine)>, Sent) {
    let mut sent = Sent::default();
    let mut rng = Rng::new(engines.first().map_or(0, |e| e.0 as u64) ^ 0x5eed);
    let mut stepped = vec![0u64; engines.len()];
    let mut acks = FuturesUnordered::new();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let t = pace.start.elapsed().as_secs_f64().min(pace.seconds);
        for (j, (i, e)) in engines.iter_mut().enumerate() {
            // Engines step out of phase with each other.
            let phase = (*i as f64 * 0.618_034).fract();
            let due = (t * pace.batches_per_s + phase).floor() as u64;
            while stepped[j] < due {
                stepped[j] += 1;
                let events: Vec<KvEvent> = e.step(&shape, &mut sent.counts);
                sent.kv_batches += 1;
                sent.kv_events += events.len() as u64;
                let payload =
                    kvplane_ingest::vllm::encode_batch(t, &KvBatch { dp_rank: 0, events });
                match js.publish(kv_subject(POOL, &e.name), payload.into()).await {
                    Ok(a) => acks.push(a.into_future()),
                    Err(_) => sent.failed += 1,
                }
                if rng.unit() < pace.metrics_share {
                    sent.metrics += 1;
                    let m = metrics_payload(&mut rng);
                    match js.publish(metrics_subject(POOL, &e.name), m.into()).await {
                        Ok(a) => acks.push(a.into_future()),
                        Err(_) => sent.failed += 1,
                    }
                }
                while acks.len() > MAX_IN_FLIGHT {
                    if let Some(r) = acks.next().await {
                        note_ack(r, &acked, &mut sent);
                    }
                }
            }
        }
        while let Some(r) = futures::FutureExt::now_or_never(acks.next()).flatten() {
            note_ack(r, &acked, &mut sent);
        }
        if t >= pace.seconds {
            break;
        }
    }
    while let Some(r) = acks.next().await {
        note_ack(r, &acked, &mut sent);
    }
    (engines, sent)
}

fn note_ack(
    r: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
    acked: &Acked,
    sent: &mut Sent,
) {
    match r {
        Ok(a) => acked.saw(a.sequence),
        Err(_) => sent.failed += 1,
    }
}

/// What the probe measured.
#[derive(Debug, Default)]
pub(crate) struct ProbeResult {
    /// Publish to the first follower decision that matched every block, per probe.
    pub lag_ms: Vec<f64>,
    /// Probes no follower saw within 20 s.
    pub missed: u64,
    /// The probe's cache, as the cluster must index it.
    pub engine: Option<Engine>,
    pub failed: u64,
}

/// Every `every`, stores a new 4-block prefix as worker `probe` and asks followers (whichever
/// `followers` names first) for a decision on exactly that prompt until one routes it to the
/// probe with all 4 blocks matched.
pub(crate) async fn probe(
    js: jetstream::Context,
    shape: FleetShape,
    pace: Pace,
    every: Duration,
    followers: watch::Receiver<Vec<String>>,
    acked: Arc<Acked>,
) -> ProbeResult {
    let mut engine = Engine::new("probe".into(), 0x9120be);
    let mut out = ProbeResult::default();
    let mut clients: BTreeMap<String, RouterClient<Channel>> = BTreeMap::new();
    // Documents beyond the fleet's pool: no other engine holds them.
    let mut doc = 1u64 << 40;
    while pace.start.elapsed().as_secs_f64() < pace.seconds {
        let next = Instant::now() + every;
        doc += 1;
        let ev = engine.store(doc, 4, &shape);
        let KvEvent::Stored { token_ids, .. } = &ev else {
            continue;
        };
        let token_ids = token_ids.clone();
        let payload = kvplane_ingest::vllm::encode_batch(
            0.0,
            &KvBatch {
                dp_rank: 0,
                events: vec![ev],
            },
        );
        let published = Instant::now();
        match js.publish(kv_subject(POOL, "probe"), payload.into()).await {
            Ok(ack) => match ack.await {
                Ok(a) => acked.saw(a.sequence),
                Err(_) => out.failed += 1,
            },
            Err(_) => out.failed += 1,
        }
        let req = RouteRequest {
            model: "bench".into(),
            tenant: "bench".into(),
            token_ids: token_ids.clone(),
            ..Default::default()
        };
        loop {
            if published.elapsed() > Duration::from_secs(20) {
                out.missed += 1;
                break;
            }
            let Some(f) = followers.borrow().first().cloned() else {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            };
            if !clients.contains_key(&f) {
                match RouterClient::connect(f.clone()).await {
                    Ok(c) => {
                        clients.insert(f.clone(), c);
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                }
            }
            let Some(c) = clients.get_mut(&f) else {
                continue;
            };
            match c.explain(req.clone()).await {
                Ok(r) => {
                    let d = r.into_inner().decision.unwrap_or_default();
                    let to_probe = matches!(
                        d.decision,
                        Some(Decision::Endpoint(ref e)) if e.worker_id == "probe"
                    );
                    if to_probe && d.matched_blocks == 4 {
                        out.lag_ms.push(published.elapsed().as_secs_f64() * 1000.0);
                        break;
                    }
                }
                Err(_) => {
                    clients.remove(&f);
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep_until(next.into()).await;
    }
    out.engine = Some(engine);
    out
}
