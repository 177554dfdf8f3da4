//! One stream message to the item the log carries, or the reason it is rejected: pure (no I/O,
//! no metrics), so the consumer counts what it says and the fuzz targets drive it directly.

use kvplane_state::{IngestItem, IngestPayload, WorkerMetrics};

use crate::message::WorkerStatus;
use crate::subject::{MessageKind, Subject};
use crate::vllm::{SkippedEvent, decode_batch};
use crate::{MetricsMessage, RejectReason, WorkerMessage};

/// A message made an item.
#[derive(Debug)]
pub struct Converted {
    pub item: IngestItem,
    /// Its kind (`kv`, `metrics`, `worker`), as `kvplane_ingest_messages_total` counts it.
    pub kind: &'static str,
    /// vLLM events of the batch left out, each with its reason.
    pub skipped: Vec<SkippedEvent>,
}

/// A message rejected: why, and what is wrong with it.
#[derive(Debug)]
pub struct Rejected {
    pub reason: RejectReason,
    pub detail: String,
    /// Its kind, when its subject said it.
    pub kind: Option<&'static str>,
}

fn rejected(
    reason: RejectReason,
    detail: impl Into<String>,
    kind: Option<&'static str>,
) -> Rejected {
    Rejected {
        reason,
        detail: detail.into(),
        kind,
    }
}

/// Message `seq` of the stream, on `subject`: a payload over `max_message_bytes` is rejected
/// (`oversized`) before it is read.
pub fn convert(
    max_message_bytes: usize,
    seq: u64,
    subject: &str,
    payload: &[u8],
) -> Result<Converted, Rejected> {
    let Some(s) = Subject::parse(subject) else {
        return Err(rejected(RejectReason::UnknownSubject, "bad subject", None));
    };
    if payload.len() > max_message_bytes {
        return Err(rejected(RejectReason::Oversized, "payload too large", None));
    }
    let mut skipped = Vec::new();
    let (kind, payload) = match s.kind {
        MessageKind::Kv => {
            let kind = Some("kv");
            let d = decode_batch(payload)
                .map_err(|e| rejected(RejectReason::Undecodable, e.to_string(), kind))?;
            if let Some(rank) = s.rank
                && rank != d.batch.dp_rank
            {
                let why = format!(
                    "the batch is of rank {}, the subject of rank {rank}",
                    d.batch.dp_rank
                );
                return Err(rejected(RejectReason::RankMismatch, why, kind));
            }
            skipped = d.skipped;
            // Hashed here, once, for every member (the log's compact form).
            ("kv", IngestPayload::Kv(d.batch.compact()))
        }
        MessageKind::Metrics => {
            let kind = Some("metrics");
            let m = serde_json::from_slice::<MetricsMessage>(payload)
                .map_err(|e| e.to_string())
                .and_then(|m| m.check().map(|()| m).map_err(|e| e.to_string()))
                .map_err(|e| rejected(RejectReason::BadMetrics, e, kind))?;
            (
                "metrics",
                IngestPayload::Metrics(WorkerMetrics {
                    running: m.num_requests_running,
                    waiting: m.num_requests_waiting,
                    kv_cache_usage: m.kv_cache_usage_perc,
                    prefix_cache_hit_rate: m.prefix_cache_hit_rate,
                    ttft_sum_s: m.time_to_first_token_seconds_sum,
                    ttft_count: m.time_to_first_token_seconds_count,
                }),
            )
        }
        MessageKind::Worker => {
            let w = serde_json::from_slice::<WorkerMessage>(payload).map_err(|e| {
                rejected(
                    RejectReason::BadWorkerMessage,
                    e.to_string(),
                    Some("worker"),
                )
            })?;
            (
                "worker",
                IngestPayload::Worker {
                    up: w.status == WorkerStatus::Up,
                    address: w.address,
                },
            )
        }
    };
    Ok(Converted {
        item: IngestItem {
            seq,
            pool: s.pool.to_owned(),
            worker: s.worker.to_owned(),
            payload,
        },
        kind,
        skipped,
    })
}
