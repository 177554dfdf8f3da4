//! The engine's metrics and liveness: scrapes `/metrics`, publishes the sample, announces the
//! worker up (again every `announce_every`) and down after three failed scrapes in a row. An
//! engine whose metrics lack vLLM's gauges (some set them only at their first request) is up
//! while its `/health` answers; a scrape that keeps failing is said at warning level.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::watch;

use super::{BridgeConfig, BridgeMetrics};
use crate::message::WorkerStatus;
use crate::scrape::{ScrapeError, scrape};
use crate::{WorkerMessage, metrics_subject, worker_subject};

pub(super) async fn scrape_loop(
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
    let engine = cfg.engine_url.trim_end_matches('/');
    let url = format!("{engine}/metrics");
    let health_url = format!("{engine}/health");
    let address = cfg
        .announce_address
        .clone()
        .unwrap_or_else(|| cfg.engine_url.clone());
    let mut up: Option<bool> = None;
    let mut announced = tokio::time::Instant::now();
    let mut failures = 0u32;
    let mut warned = None::<tokio::time::Instant>;
    let mut comebacks = 0u64;
    let mut tick = tokio::time::interval(cfg.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let scraped = scrape(&client, &url).await;
        let alive = match &scraped {
            Ok(_) => true,
            // An engine that answers without vLLM's gauges (some set them only at their first
            // request) is up when its health endpoint says so: it must get that request.
            Err(ScrapeError::Missing(_)) => healthy(&client, &health_url).await,
            Err(_) => false,
        };
        if let Err(e) = &scraped {
            metrics.scrapes_failed.inc();
            failures += 1;
            // Said once the failures are no accident, then once a minute while they last.
            let due = warned.is_none_or(|t: tokio::time::Instant| t.elapsed() >= WARN_EVERY);
            if failures >= 3 && due {
                warned = Some(tokio::time::Instant::now());
                tracing::warn!(
                    url,
                    error = %e,
                    failures,
                    up = alive,
                    "engine metrics scrape keeps failing"
                );
            } else {
                tracing::debug!(url, error = %e, "scrape failed");
            }
        } else {
            failures = 0;
            warned = None;
        }
        if alive {
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
            if let Ok(m) = &scraped
                && !publish_json(&js, metrics_subject(&cfg.pool, &cfg.worker), m).await
            {
                tracing::debug!("metrics not delivered");
            }
        } else if failures >= 3 && up == Some(true) {
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

/// How often a scrape that keeps failing is said at warning level.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Whether the engine's health endpoint answers with success.
async fn healthy(client: &reqwest::Client, url: &str) -> bool {
    client
        .get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
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
