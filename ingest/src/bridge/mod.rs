//! `kvplane bridge`: joins one vLLM engine to the fleet.
//!
//! - KV events: subscribes to the engine's ZMQ PUB socket, checks the sequence numbers, fills
//!   gaps from the engine's replay socket, and republishes each raw batch to NATS on
//!   `kvplane.kv.<pool>.<worker>` (`.<rank>` with `--dp-rank`) with headers `Kv-Seq` (the
//!   engine's sequence) and `Kv-Digest` (of the batch's bytes); a batch over
//!   the server's max payload goes out in parts (header `Kv-Part: i/n`). At start it reads the
//!   last `Kv-Seq` (and part) it published from the stream, so a restarted bridge neither skips
//!   nor repeats a batch or a part. When the engine closes its sockets the bridge reconnects
//!   and tells a restarted engine from the same one by the last batch it forwarded. A batch it
//!   cannot recover (replay no longer has it) is counted, and an `AllBlocksCleared` batch is
//!   published in its place: kvplane then forgets that worker's blocks rather than keep a
//!   wrong picture.
//! - Metrics: scrapes the engine's `/metrics` every interval and publishes a
//!   [`crate::MetricsMessage`] on `kvplane.metrics.<pool>.<worker>`; announces the worker up (with its
//!   address) when the engine answers (and again every `announce_every` while it does: an
//!   announcement that arrived before the worker's InferenceWorkerSet existed was dropped) and
//!   down after three failed scrapes in a row.
//! - NATS or the engine going away is never fatal: the bridge reconnects, holds up to
//!   `max_pending` batches, and counts what it could not deliver.

mod announce;
mod engine;
mod metrics;
mod publish;
mod split;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use kvplane_state::{KvBatch, KvEvent};
use tokio::sync::{mpsc, watch};

pub use metrics::BridgeMetrics;

/// Header carrying the engine's ZMQ sequence number of a republished batch.
pub const SEQ_HEADER: &str = "Kv-Seq";

/// Header of a batch published in parts: `i/n`, the part's number from 1 and their count.
pub const PART_HEADER: &str = "Kv-Part";

/// Header with the xxh3-64 of the engine's whole batch (hex), on every part: a restarted
/// bridge tells from it whether the engine still holds the batch it published last.
pub const DIGEST_HEADER: &str = "Kv-Digest";

/// A batch's bytes, to recognise the same batch again (in the stream, from replay).
pub(crate) fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub pool: String,
    pub worker: String,
    /// The engine's data-parallel rank, when each rank has its own bridge: its batches go to
    /// the rank's own subject.
    pub dp_rank: Option<u32>,
    /// The engine's HTTP base URL (scraped, and announced as the worker's address).
    pub engine_url: String,
    /// The address gateways should use, when it differs from `engine_url`.
    pub announce_address: Option<String>,
    pub zmq_pub: String,
    pub zmq_replay: String,
    pub nats_url: String,
    /// Its NATS user's credentials (a bridge's user may publish only its worker's subjects).
    pub nats_auth: crate::NatsAuth,
    pub stream: String,
    pub scrape_interval: Duration,
    pub max_pending: usize,
    pub replay_timeout: Duration,
    /// While up, the worker is announced again this often: an announcement that reached the
    /// cluster before its worker set existed (and was dropped as of an unknown pool) is made
    /// good.
    pub announce_every: Duration,
}

/// Runs the bridge until `shutdown` turns true.
pub async fn run(cfg: BridgeConfig, metrics: Arc<BridgeMetrics>, shutdown: watch::Receiver<bool>) {
    let options = async_nats::ConnectOptions::new()
        .name(format!("kvplane-bridge-{}", cfg.worker))
        .custom_inbox_prefix(crate::bridge_inbox_prefix(&cfg.pool, &cfg.worker))
        .retry_on_initial_connect();
    let options = match cfg.nats_auth.apply(options).await {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "nats credentials");
            return;
        }
    };
    let client = match options.connect(cfg.nats_url.as_str()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, url = cfg.nats_url, "invalid nats url");
            return;
        }
    };
    let js = jetstream::new(client.clone());
    let (tx, rx) = mpsc::channel::<publish::Outgoing>(cfg.max_pending.max(1));
    let (resubscribe_tx, resubscribe_rx) = watch::channel(0u64);
    let resume = publish::last_published(&js, &cfg, shutdown.clone()).await;
    tracing::info!(?resume, "bridge resuming after engine sequence");
    let nats_task = tokio::spawn(publish::nats_loop(
        client,
        js.clone(),
        cfg.clone(),
        rx,
        metrics.clone(),
        shutdown.clone(),
    ));
    let zmq_task = tokio::spawn(engine::zmq_loop(
        cfg.clone(),
        resume,
        tx,
        metrics.clone(),
        resubscribe_rx,
        shutdown.clone(),
    ));
    let scrape_task = tokio::spawn(announce::scrape_loop(
        js,
        cfg,
        metrics,
        resubscribe_tx,
        shutdown,
    ));
    let _ = tokio::join!(nats_task, zmq_task, scrape_task);
}

impl BridgeConfig {
    /// Where this bridge publishes KV batches.
    pub fn kv_subject(&self) -> String {
        crate::kv_rank_subject(&self.pool, &self.worker, self.dp_rank)
    }
}

/// A batch that clears the worker's rank: published in place of batches that cannot be
/// delivered.
fn cleared_batch(dp_rank: u32) -> Bytes {
    Bytes::from(crate::vllm::encode_batch(
        0.0,
        &KvBatch {
            dp_rank,
            events: vec![KvEvent::Cleared],
        },
    ))
}
