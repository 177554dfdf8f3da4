//! `kvplane bridge`: joins one vLLM engine to the fleet.
//!
//! - KV events: subscribes to the engine's ZMQ PUB socket, checks the sequence numbers, fills
//!   gaps from the engine's replay socket, and republishes each raw batch to NATS on
//!   `kvplane.kv.<pool>.<worker>` with header `Kv-Seq` (the engine's sequence). At start it
//!   reads the last `Kv-Seq` it published from the stream, so a restarted bridge neither skips
//!   nor repeats a batch. A batch it cannot recover (replay no longer has it) is counted, and
//!   an `AllBlocksCleared` batch is published in its place: kvplane then forgets that worker's
//!   blocks rather than keep a wrong picture.
//! - Metrics: scrapes the engine's `/metrics` every interval and publishes a
//!   [`MetricsMessage`] on `kvplane.metrics.<pool>.<worker>`; announces the worker up (with its
//!   address) when the engine answers (and again every `announce_every` while it does: an
//!   announcement that arrived before the worker's InferenceWorkerSet existed was dropped) and
//!   down after three failed scrapes in a row.
//! - NATS or the engine going away is never fatal: the bridge reconnects, holds up to
//!   `max_pending` batches, and counts what it could not deliver.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use bytes::Bytes;
use kvplane_state::{KvBatch, KvEvent};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::message::WorkerStatus;
use crate::scrape::scrape;
use crate::{WorkerMessage, ensure_stream, kv_subject, metrics_subject, worker_subject};

/// Header carrying the engine's ZMQ sequence number of a republished batch.
pub const SEQ_HEADER: &str = "Kv-Seq";

#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub pool: String,
    pub worker: String,
    /// The engine's HTTP base URL (scraped, and announced as the worker's address).
    pub engine_url: String,
    /// The address gateways should use, when it differs from `engine_url`.
    pub announce_address: Option<String>,
    pub zmq_pub: String,
    pub zmq_replay: String,
    pub nats_url: String,
    pub stream: String,
    pub scrape_interval: Duration,
    pub max_pending: usize,
    pub replay_timeout: Duration,
    /// While up, the worker is announced again this often: an announcement that reached the
    /// cluster before its worker set existed (and was dropped as of an unknown pool) is made
    /// good.
    pub announce_every: Duration,
}

/// Counters of one bridge.
#[derive(Debug, Default)]
pub struct BridgeMetrics {
    pub forwarded: Counter,
    pub gaps: Counter,
    pub replayed: Counter,
    pub lost: Counter,
    pub publish_retries: Counter,
    pub engine_restarts: Counter,
    pub scrapes_failed: Counter,
    pub malformed_frames: Counter,
    pub pending: Gauge,
    pub last_seq: Gauge,
}

impl BridgeMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_bridge_forwarded_batches",
            "KV batches published to NATS",
            self.forwarded.clone(),
        );
        r.register(
            "kvplane_bridge_gaps",
            "Sequence gaps detected on the engine's PUB socket",
            self.gaps.clone(),
        );
        r.register(
            "kvplane_bridge_replayed_batches",
            "Batches recovered from the engine's replay socket",
            self.replayed.clone(),
        );
        r.register(
            "kvplane_bridge_lost_batches",
            "Batches that could not be recovered or delivered",
            self.lost.clone(),
        );
        r.register(
            "kvplane_bridge_publish_retries",
            "NATS publish attempts that failed and were retried",
            self.publish_retries.clone(),
        );
        r.register(
            "kvplane_bridge_engine_restarts",
            "Times the engine's sequence went backwards",
            self.engine_restarts.clone(),
        );
        r.register(
            "kvplane_bridge_scrapes_failed",
            "Engine metrics scrapes that failed",
            self.scrapes_failed.clone(),
        );
        r.register(
            "kvplane_bridge_malformed_frames",
            "ZMQ messages from the engine that were not [topic, seq, payload], skipped",
            self.malformed_frames.clone(),
        );
        r.register(
            "kvplane_bridge_pending_batches",
            "Batches waiting for NATS",
            self.pending.clone(),
        );
        r.register(
            "kvplane_bridge_last_sequence",
            "Engine sequence of the last batch handed to NATS",
            self.last_seq.clone(),
        );
    }
}

/// What the ZMQ side hands to the NATS side.
#[derive(Debug)]
struct Outgoing {
    seq: Option<u64>,
    /// JetStream's `Nats-Msg-Id`: a publish retried after a lost acknowledgement is dropped by
    /// the stream's duplicate window instead of being stored twice.
    msg_id: String,
    payload: Bytes,
}

/// Runs the bridge until `shutdown` turns true.
pub async fn run(cfg: BridgeConfig, metrics: Arc<BridgeMetrics>, shutdown: watch::Receiver<bool>) {
    let client = match async_nats::ConnectOptions::new()
        .name(format!("kvplane-bridge-{}", cfg.worker))
        .retry_on_initial_connect()
        .connect(cfg.nats_url.as_str())
        .await
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, url = cfg.nats_url, "invalid nats url");
            return;
        }
    };
    let js = jetstream::new(client);
    let (tx, rx) = mpsc::channel::<Outgoing>(cfg.max_pending.max(1));
    let (resubscribe_tx, resubscribe_rx) = watch::channel(0u64);
    let resume = last_published_seq(&js, &cfg, shutdown.clone()).await;
    tracing::info!(?resume, "bridge resuming after engine sequence");
    let nats_task = tokio::spawn(nats_loop(
        js.clone(),
        cfg.clone(),
        rx,
        metrics.clone(),
        shutdown.clone(),
    ));
    let zmq_task = tokio::spawn(zmq_loop(
        cfg.clone(),
        resume,
        tx,
        metrics.clone(),
        resubscribe_rx,
        shutdown.clone(),
    ));
    let scrape_task = tokio::spawn(scrape_loop(js, cfg, metrics, resubscribe_tx, shutdown));
    let _ = tokio::join!(nats_task, zmq_task, scrape_task);
}

/// The `Kv-Seq` of the last batch this worker's bridge published, from the stream itself.
async fn last_published_seq(
    js: &jetstream::Context,
    cfg: &BridgeConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Option<u64> {
    let subject = kv_subject(&cfg.pool, &cfg.worker);
    let mut backoff = Duration::from_millis(100);
    loop {
        match ensure_stream(js, &cfg.stream).await {
            Ok(stream) => {
                return match stream.get_last_raw_message_by_subject(&subject).await {
                    Ok(m) => m
                        .headers
                        .get(SEQ_HEADER)
                        .and_then(|v| v.as_str().parse::<u64>().ok()),
                    Err(_) => None,
                };
            }
            Err(e) => {
                tracing::warn!(error = %e, "waiting for nats");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

fn cleared_batch() -> Bytes {
    Bytes::from(crate::vllm::encode_batch(
        0.0,
        &KvBatch {
            dp_rank: 0,
            events: vec![KvEvent::Cleared],
        },
    ))
}

async fn nats_loop(
    js: jetstream::Context,
    cfg: BridgeConfig,
    mut rx: mpsc::Receiver<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let subject = kv_subject(&cfg.pool, &cfg.worker);
    loop {
        let out = tokio::select! {
            o = rx.recv() => o,
            _ = shutdown.changed() => return,
        };
        let Some(out) = out else { return };
        metrics
            .pending
            .set(i64::try_from(rx.len()).unwrap_or(i64::MAX));
        let mut backoff = Duration::from_millis(50);
        loop {
            let mut headers = HeaderMap::new();
            if let Some(seq) = out.seq {
                headers.insert(SEQ_HEADER, seq.to_string().as_str());
            }
            headers.insert("Nats-Msg-Id", out.msg_id.as_str());
            let sent = match js
                .publish_with_headers(subject.clone(), headers, out.payload.clone())
                .await
            {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match sent {
                Ok(()) => {
                    metrics.forwarded.inc();
                    if let Some(seq) = out.seq {
                        metrics.last_seq.set(i64::try_from(seq).unwrap_or(i64::MAX));
                    }
                    break;
                }
                Err(e) => {
                    metrics.publish_retries.inc();
                    tracing::warn!(error = %e, "publish to nats failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// Sequence state of the engine's stream as the bridge has forwarded it.
struct Forwarder {
    expected: Option<u64>,
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    incarnation: String,
    sent: u64,
}

impl Forwarder {
    fn send(&mut self, seq: Option<u64>, payload: Bytes) {
        self.sent += 1;
        // Unique per bridge run and message; `sent` also separates an engine's sequences
        // before and after a restart.
        let msg_id = format!(
            "{}-{}-{}",
            self.incarnation,
            self.sent,
            seq.map_or(-1, |s| s as i128)
        );
        match self.tx.try_send(Outgoing {
            seq,
            msg_id,
            payload,
        }) {
            Ok(()) => {}
            Err(_) => {
                // NATS is behind by more than max_pending batches: this one is lost.
                self.metrics.lost.inc();
                tracing::warn!(?seq, "pending queue full; batch lost");
            }
        }
        if let Some(s) = seq {
            self.expected = Some(s + 1);
        }
    }
}

fn parse_seq(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

async fn connect_sockets(
    cfg: &BridgeConfig,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<(SubSocket, DealerSocket)> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut sub = SubSocket::new();
        let mut dealer = DealerSocket::new();
        let ok = async {
            sub.connect(&cfg.zmq_pub).await?;
            sub.subscribe("").await?;
            dealer.connect(&cfg.zmq_replay).await?;
            Ok::<_, zeromq::ZmqError>(())
        }
        .await;
        match ok {
            Ok(()) => return Some((sub, dealer)),
            Err(e) => {
                tracing::debug!(error = %e, "engine zmq sockets not reachable yet");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

async fn zmq_loop(
    cfg: BridgeConfig,
    resume_after: Option<u64>,
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    mut resubscribe: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut f = Forwarder {
        expected: resume_after.map(|s| s + 1),
        tx,
        metrics: metrics.clone(),
        incarnation: format!(
            "{}-{}",
            cfg.worker,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ),
        sent: 0,
    };
    'connect: loop {
        let Some((mut sub, mut dealer)) = connect_sockets(&cfg, &mut shutdown).await else {
            return;
        };
        tracing::info!(
            publish = cfg.zmq_pub,
            replay = cfg.zmq_replay,
            "subscribed to engine kv events"
        );
        // Whatever the engine published while we were away (or before the subscription took
        // effect) is in its replay buffer: catch up now instead of waiting for the next batch.
        // The same happens whenever the socket has been quiet for a second, which closes the race
        // between a catch-up and the subscription taking effect. Sequences a catch-up forwarded
        // may then arrive on the socket too: they are skipped; any other sequence below the
        // expected one means the engine restarted.
        let mut replayed = catch_up(&cfg, &mut dealer, &mut f).await;
        loop {
            let msg = tokio::select! {
                m = sub.recv() => m,
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    let r = catch_up(&cfg, &mut dealer, &mut f).await;
                    if !r.is_empty() {
                        replayed = replayed.start.min(r.start)..r.end;
                    }
                    continue;
                }
                _ = resubscribe.changed() => {
                    tracing::info!("engine came back; resubscribing");
                    continue 'connect;
                }
                _ = shutdown.changed() => return,
            };
            let frames = match msg {
                Ok(m) => m.into_vec(),
                Err(e) => {
                    tracing::warn!(error = %e, "zmq receive failed; reconnecting");
                    continue 'connect;
                }
            };
            // [topic, seq, payload]
            let (3, Some(seq), Some(payload)) = (
                frames.len(),
                frames.get(1).and_then(|s| parse_seq(s)),
                frames.get(2).cloned(),
            ) else {
                metrics.malformed_frames.inc();
                tracing::warn!(
                    frames = frames.len(),
                    "zmq message is not [topic, seq, payload]; skipped"
                );
                continue;
            };
            match f.expected {
                Some(e) if seq < e && replayed.contains(&seq) => continue,
                Some(e) if seq == e => {}
                Some(e) if seq > e => {
                    metrics.gaps.inc();
                    tracing::info!(expected = e, got = seq, "sequence gap; filling from replay");
                    fill(&cfg, &mut dealer, &mut f, e, seq).await;
                }
                Some(e) => {
                    metrics.engine_restarts.inc();
                    tracing::info!(
                        expected = e,
                        got = seq,
                        "engine sequence went backwards: engine restarted"
                    );
                    f.send(None, cleared_batch());
                    if seq > 0 {
                        fill(&cfg, &mut dealer, &mut f, 0, seq).await;
                    }
                }
                None if seq > 0 => {
                    metrics.gaps.inc();
                    tracing::info!(got = seq, "joined mid-stream; filling from replay");
                    fill(&cfg, &mut dealer, &mut f, 0, seq).await;
                }
                None => {}
            }
            f.send(Some(seq), payload);
        }
    }
}

/// Replays everything from `from` on, in order (used on connect, when the newest sequence is
/// not known yet).
/// Returns the sequences it forwarded.
async fn catch_up(
    cfg: &BridgeConfig,
    dealer: &mut DealerSocket,
    f: &mut Forwarder,
) -> std::ops::Range<u64> {
    let from = f.expected.unwrap_or(0);
    let got = replay(cfg, dealer, from, u64::MAX).await;
    let Some(first) = got.first().map(|(s, _)| *s) else {
        return 0..0;
    };
    if first > from {
        let lost = first - from;
        f.metrics.lost.inc_by(lost);
        tracing::warn!(
            from,
            first,
            lost,
            "replay no longer has every batch; clearing this worker in kvplane"
        );
        f.send(None, cleared_batch());
    }
    let mut next = first;
    for (s, p) in got {
        if s != next {
            break;
        }
        f.metrics.replayed.inc();
        f.send(Some(s), p);
        next = s + 1;
    }
    if next > first {
        f.metrics.gaps.inc();
        tracing::info!(from, to = next, "caught up from replay");
    }
    first..next
}

/// Asks the replay socket for `from..to`: the batches it has, sorted, without duplicates.
async fn replay(
    cfg: &BridgeConfig,
    dealer: &mut DealerSocket,
    from: u64,
    to: u64,
) -> Vec<(u64, Bytes)> {
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ]);
    let mut got = Vec::new();
    if let Ok(req) = request
        && dealer.send(req).await.is_ok()
    {
        let deadline = tokio::time::Instant::now() + cfg.replay_timeout;
        loop {
            let Ok(Ok(reply)) = tokio::time::timeout_at(deadline, dealer.recv()).await else {
                tracing::warn!("replay did not finish in time");
                break;
            };
            let frames: Vec<Bytes> = reply
                .into_vec()
                .into_iter()
                .skip_while(|b| b.is_empty())
                .collect();
            // >= 0.26: [topic, seq, payload]; <= 0.25: [seq, payload].
            let (seq, payload) = match frames.as_slice() {
                [_, s, p] => (parse_seq(s), p.clone()),
                // [seq, payload] (<= 0.25) or [topic, end marker].
                [a, b] => match parse_seq(a) {
                    Some(s) => (Some(s), b.clone()),
                    None => (parse_seq(b), Bytes::new()),
                },
                [s] => (parse_seq(s), Bytes::new()),
                _ => (None, Bytes::new()),
            };
            match seq {
                Some(u64::MAX) => break,
                Some(s) if s >= from && s < to => got.push((s, payload)),
                _ => {}
            }
        }
    }
    got.sort_by_key(|(s, _)| *s);
    got.dedup_by_key(|(s, _)| *s);
    got
}

/// Asks the replay socket for `from..to` and forwards what it has, in order.
async fn fill(
    cfg: &BridgeConfig,
    dealer: &mut DealerSocket,
    f: &mut Forwarder,
    from: u64,
    to: u64,
) {
    let got = replay(cfg, dealer, from, to).await;
    let recovered = got.len() as u64;
    let contiguous = got.first().is_some_and(|(s, _)| *s == from)
        && got.windows(2).all(|w| w[1].0 == w[0].0 + 1);
    let complete = recovered == to - from && contiguous;
    if !complete {
        let lost = (to - from).saturating_sub(recovered);
        f.metrics.lost.inc_by(lost);
        tracing::warn!(
            from,
            to,
            recovered,
            lost,
            "replay could not recover every batch; clearing this worker in kvplane"
        );
        // What kvplane holds for this worker is no longer trustworthy: reset it, then forward
        // the recovered tail only (earlier blocks' parents are gone with the reset).
        f.send(None, cleared_batch());
        let tail: Vec<(u64, Bytes)> = contiguous_tail(got, to);
        for (s, p) in tail {
            f.metrics.replayed.inc();
            f.send(Some(s), p);
        }
        f.expected = Some(to);
        return;
    }
    for (s, p) in got {
        f.metrics.replayed.inc();
        f.send(Some(s), p);
    }
}

/// The longest run of consecutive sequences ending right before `to`.
fn contiguous_tail(mut got: Vec<(u64, Bytes)>, to: u64) -> Vec<(u64, Bytes)> {
    let mut next = to;
    let mut keep = 0;
    for (s, _) in got.iter().rev() {
        if *s + 1 == next {
            keep += 1;
            next = *s;
        } else {
            break;
        }
    }
    got.split_off(got.len() - keep)
}

async fn scrape_loop(
    js: jetstream::Context,
    cfg: BridgeConfig,
    metrics: Arc<BridgeMetrics>,
    resubscribe: watch::Sender<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    let url = format!("{}/metrics", cfg.engine_url.trim_end_matches('/'));
    let address = cfg
        .announce_address
        .clone()
        .unwrap_or_else(|| cfg.engine_url.clone());
    let mut up: Option<bool> = None;
    let mut announced = tokio::time::Instant::now();
    let mut failures = 0u32;
    let mut comebacks = 0u64;
    let mut tick = tokio::time::interval(cfg.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        match scrape(&client, &url).await {
            Ok(m) => {
                failures = 0;
                if up != Some(true) || announced.elapsed() >= cfg.announce_every {
                    if up == Some(false) {
                        comebacks += 1;
                        let _ = resubscribe.send(comebacks);
                    }
                    let msg = WorkerMessage {
                        status: WorkerStatus::Up,
                        address: Some(address.clone()),
                    };
                    if publish_json(&js, worker_subject(&cfg.pool, &cfg.worker), &msg).await {
                        if up != Some(true) {
                            tracing::info!(address, "worker announced up");
                        }
                        up = Some(true);
                        announced = tokio::time::Instant::now();
                    }
                }
                if !publish_json(&js, metrics_subject(&cfg.pool, &cfg.worker), &m).await {
                    tracing::debug!("metrics not delivered");
                }
            }
            Err(e) => {
                metrics.scrapes_failed.inc();
                failures += 1;
                tracing::debug!(error = %e, "scrape failed");
                if failures >= 3 && up == Some(true) {
                    let msg = WorkerMessage {
                        status: WorkerStatus::Down,
                        address: None,
                    };
                    if publish_json(&js, worker_subject(&cfg.pool, &cfg.worker), &msg).await {
                        up = Some(false);
                        tracing::warn!("engine unreachable; worker announced down");
                    }
                }
            }
        }
    }
}

async fn publish_json<T: serde::Serialize>(
    js: &jetstream::Context,
    subject: String,
    v: &T,
) -> bool {
    let Ok(body) = serde_json::to_vec(v) else {
        return false;
    };
    match js.publish(subject, body.into()).await {
        Ok(ack) => tokio::time::timeout(Duration::from_secs(2), ack)
            .await
            .is_ok_and(|r| r.is_ok()),
        Err(_) => false,
    }
}
