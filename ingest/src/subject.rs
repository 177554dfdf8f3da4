//! The NATS subject scheme (README, "NATS subjects").
//!
//! | subject                          | payload                                   |
//! |----------------------------------|-------------------------------------------|
//! | `kvplane.kv.<pool>.<worker>`     | one raw vLLM KV-event batch (msgpack)      |
//! | `kvplane.kv.<pool>.<worker>.<r>` | the same, of data-parallel rank `r` only   |
//! | `kvplane.metrics.<pool>.<worker>`| [`crate::MetricsMessage`] (JSON)           |
//! | `kvplane.worker.<pool>.<worker>` | [`crate::WorkerMessage`] (JSON)            |
//!
//! A bridge per data-parallel rank publishes on the rank's own subject, so each finds where it
//! stopped from its own last message. Pool and worker names are 1-63 characters of `[a-z0-9-_]`. Anything else under `kvplane.`
//! is rejected and counted (`unknown_subject`).

use kvplane_state::valid_name;

/// Subjects the ingest stream captures.
pub const STREAM_SUBJECTS: &str = "kvplane.>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    Kv,
    Metrics,
    Worker,
}

/// A parsed ingest subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject<'a> {
    pub kind: MessageKind,
    pub pool: &'a str,
    pub worker: &'a str,
    /// The data-parallel rank a KV subject is for, when it names one.
    pub rank: Option<u32>,
}

impl<'a> Subject<'a> {
    pub fn parse(subject: &'a str) -> Option<Self> {
        let mut parts = subject.split('.');
        if parts.next() != Some("kvplane") {
            return None;
        }
        let kind = match parts.next()? {
            "kv" => MessageKind::Kv,
            "metrics" => MessageKind::Metrics,
            "worker" => MessageKind::Worker,
            _ => return None,
        };
        let pool = parts.next()?;
        let worker = parts.next()?;
        let rank = match (kind, parts.next()) {
            (_, None) => None,
            (MessageKind::Kv, Some(r)) if r.bytes().all(|b| b.is_ascii_digit()) => {
                Some(r.parse().ok()?)
            }
            _ => return None,
        };
        if parts.next().is_some() || !valid_name(pool) || !valid_name(worker) {
            return None;
        }
        Some(Self {
            kind,
            pool,
            worker,
            rank,
        })
    }
}

pub fn kv_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.kv.{pool}.{worker}")
}

/// The KV subject of one data-parallel rank (`None`: the worker's, for any rank).
pub fn kv_rank_subject(pool: &str, worker: &str, rank: Option<u32>) -> String {
    match rank {
        Some(r) => format!("kvplane.kv.{pool}.{worker}.{r}"),
        None => kv_subject(pool, worker),
    }
}

pub fn metrics_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.metrics.{pool}.{worker}")
}

pub fn worker_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.worker.{pool}.{worker}")
}

/// Where the bridge of `worker` hears replies (its JetStream acknowledgements and stream
/// reads): `_INBOX.kvplane.<pool>.<worker>.>`, so its NATS user may subscribe to its own
/// replies only.
pub fn bridge_inbox_prefix(pool: &str, worker: &str) -> String {
    format!("_INBOX.kvplane.{pool}.{worker}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_subjects_parse() {
        let s = Subject::parse("kvplane.kv.pool-a.worker_1").unwrap();
        assert_eq!(
            (s.kind, s.pool, s.worker, s.rank),
            (MessageKind::Kv, "pool-a", "worker_1", None)
        );
        let ranked = kv_rank_subject("p", "w", Some(3));
        let s = Subject::parse(&ranked).unwrap();
        assert_eq!(
            (s.kind, s.pool, s.worker, s.rank),
            (MessageKind::Kv, "p", "w", Some(3))
        );
        assert_eq!(
            Subject::parse(&metrics_subject("p", "w")).unwrap().kind,
            MessageKind::Metrics
        );
    }

    #[test]
    fn malformed_subjects_are_refused() {
        for s in [
            "kvplane.kv.pool",
            "kvplane.kv.pool.w.extra",
            "kvplane.kv.pool.w.1.2",
            "kvplane.kv.pool.w.-1",
            "kvplane.kv.pool.w.99999999999",
            "kvplane.metrics.pool.w.1",
            "kvplane.other.pool.w",
            "other.kv.pool.w",
            "kvplane.kv.Pool.w",
            "kvplane.kv..w",
        ] {
            assert!(Subject::parse(s).is_none(), "{s}");
        }
    }
}
