//! The NATS side: publishes each batch to the worker's KV subject (in parts when it is over the
//! server's max payload), retrying until JetStream acknowledges it, and finds where a
//! restarted bridge resumes.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use bytes::Bytes;
use tokio::sync::{mpsc, watch};

use super::split::{SplitError, fit};
use super::{
    BridgeConfig, BridgeMetrics, DIGEST_HEADER, PART_HEADER, SEQ_HEADER, cleared_batch, digest,
};
use crate::ensure_stream;

/// Room left in a message for its headers (`Kv-Seq`, `Kv-Part`, `Nats-Msg-Id`).
const HEADER_ROOM: usize = 512;

/// NATS's default max payload, used until the server has said its own; also the most a part
/// holds, since nodes refuse larger messages by default (`[ingest] max_message_bytes`).
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// What the ZMQ side hands to the NATS side.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub seq: Option<u64>,
    /// JetStream's `Nats-Msg-Id`: a publish retried after a lost acknowledgement is dropped by
    /// the stream's duplicate window instead of being stored twice.
    pub msg_id: String,
    pub payload: Bytes,
    /// Parts of this batch the stream already holds (a bridge stopped while publishing them),
    /// and how many parts it was cut into then.
    pub skip_parts: Option<(usize, usize)>,
}

/// Where the stream says this worker's bridge stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Resume {
    /// The engine sequence of the last batch published.
    pub seq: u64,
    /// When that batch went out in parts and not all of them are in the stream: how many
    /// are, of how many.
    pub parts_done: Option<(usize, usize)>,
    /// The digest of that batch (absent from bridges before digests).
    pub digest: Option<u64>,
}

impl Resume {
    /// From the headers of the last message on the worker's KV subject.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let seq = headers.get(SEQ_HEADER)?.as_str().parse::<u64>().ok()?;
        let parts_done = headers.get(PART_HEADER).and_then(|v| {
            let (done, of) = v.as_str().split_once('/')?;
            let (done, of) = (done.parse::<usize>().ok()?, of.parse::<usize>().ok()?);
            (done < of).then_some((done, of))
        });
        let digest = headers
            .get(DIGEST_HEADER)
            .and_then(|v| u64::from_str_radix(v.as_str(), 16).ok());
        Some(Self {
            seq,
            parts_done,
            digest,
        })
    }
}

/// The `Kv-Seq` (and part) of the last batch this worker's bridge published, from the stream.
pub(super) async fn last_published(
    js: &jetstream::Context,
    cfg: &BridgeConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Option<Resume> {
    let subject = cfg.kv_subject();
    let mut backoff = Duration::from_millis(100);
    loop {
        match ensure_stream(js, &cfg.stream).await {
            Ok(stream) => {
                return match stream.get_last_raw_message_by_subject(&subject).await {
                    Ok(m) => Resume::from_headers(&m.headers),
                    Err(_) => None,
                };
            }
            Err(e) => {
                tracing::warn!(error = %e, url = cfg.nats_url, "waiting for nats");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// The largest batch one message may carry, from what the server announced.
fn payload_limit(client: &async_nats::Client) -> usize {
    let max = match client.server_info().max_payload {
        0 => DEFAULT_MAX_PAYLOAD,
        n => n.min(DEFAULT_MAX_PAYLOAD),
    };
    max.saturating_sub(HEADER_ROOM).max(1)
}

/// The messages one batch becomes: itself, its parts, or (when even one block is over the
/// limit) a clear of the worker in its place, counted as lost.
fn messages(payload: Bytes, limit: usize, dp_rank: u32, metrics: &BridgeMetrics) -> Vec<Bytes> {
    match fit(payload, limit) {
        Ok(p) => {
            if p.parts.len() > 1 {
                metrics.split_batches.inc();
                metrics.dropped_events.inc_by(p.skipped as u64);
                tracing::info!(
                    parts = p.parts.len(),
                    limit,
                    "batch over the nats max payload; published in parts"
                );
            }
            p.parts
        }
        Err(e @ (SplitError::BlockTooLarge { .. } | SplitError::Decode(_))) => {
            metrics.lost.inc();
            tracing::warn!(error = %e, limit, "batch cannot be published; clearing this worker in kvplane");
            vec![cleared_batch(dp_rank)]
        }
    }
}

pub(super) async fn nats_loop(
    client: async_nats::Client,
    js: jetstream::Context,
    cfg: BridgeConfig,
    mut rx: mpsc::Receiver<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let subject = cfg.kv_subject();
    loop {
        let out = tokio::select! {
            o = rx.recv() => o,
            _ = shutdown.changed() => return,
        };
        let Some(out) = out else { return };
        metrics
            .pending
            .set(i64::try_from(rx.len()).unwrap_or(i64::MAX));
        let whole = format!("{:016x}", digest(&out.payload));
        let parts = messages(
            out.payload,
            payload_limit(&client),
            cfg.dp_rank.unwrap_or(0),
            &metrics,
        );
        let count = parts.len();
        let skip = match out.skip_parts {
            Some((done, of)) if of == count => done,
            Some((_, of)) => {
                tracing::warn!(
                    before = of,
                    now = count,
                    "a batch the stream holds part of is cut differently now; publishing every part"
                );
                0
            }
            None => 0,
        };
        for (i, part) in parts.into_iter().enumerate().skip(skip) {
            let mut headers = HeaderMap::new();
            if let Some(seq) = out.seq {
                headers.insert(SEQ_HEADER, seq.to_string().as_str());
                headers.insert(DIGEST_HEADER, whole.as_str());
            }
            if count > 1 {
                headers.insert(PART_HEADER, format!("{}/{count}", i + 1).as_str());
                headers.insert("Nats-Msg-Id", format!("{}-{i}", out.msg_id).as_str());
            } else {
                headers.insert("Nats-Msg-Id", out.msg_id.as_str());
            }
            if !publish(&js, &subject, headers, part, &metrics, &mut shutdown).await {
                return;
            }
        }
        metrics.forwarded.inc();
        if let Some(seq) = out.seq {
            metrics.last_seq.set(i64::try_from(seq).unwrap_or(i64::MAX));
        }
    }
}

/// Publishes until JetStream acknowledges; false when shut down first.
async fn publish(
    js: &jetstream::Context,
    subject: &str,
    headers: HeaderMap,
    payload: Bytes,
    metrics: &BridgeMetrics,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let mut backoff = Duration::from_millis(50);
    loop {
        let sent = match js
            .publish_with_headers(subject.to_owned(), headers.clone(), payload.clone())
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match sent {
            Ok(()) => return true,
            Err(e) => {
                metrics.publish_retries.inc();
                tracing::warn!(error = %e, "publish to nats failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return false,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn a_whole_batch_resumes_after_its_sequence_and_a_cut_one_at_its_missing_parts() {
        assert_eq!(
            Resume::from_headers(&headers(&[(SEQ_HEADER, "41")])),
            Some(Resume {
                seq: 41,
                parts_done: None,
                digest: None,
            })
        );
        assert_eq!(
            Resume::from_headers(&headers(&[
                (SEQ_HEADER, "41"),
                (PART_HEADER, "3/3"),
                (DIGEST_HEADER, "00000000000000ff")
            ])),
            Some(Resume {
                seq: 41,
                parts_done: None,
                digest: Some(255),
            })
        );
        assert_eq!(
            Resume::from_headers(&headers(&[(SEQ_HEADER, "41"), (PART_HEADER, "1/3")])),
            Some(Resume {
                seq: 41,
                parts_done: Some((1, 3)),
                digest: None,
            })
        );
        // A clear the bridge published in place of lost batches carries no sequence.
        assert_eq!(Resume::from_headers(&headers(&[])), None);
        assert_eq!(Resume::from_headers(&headers(&[(SEQ_HEADER, "x")])), None);
    }
}
