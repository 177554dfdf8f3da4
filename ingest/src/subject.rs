//! The NATS subject scheme (README, "NATS subjects").
//!
//! | subject                          | payload                                   |
//! |----------------------------------|-------------------------------------------|
//! | `kvplane.kv.<pool>.<worker>`     | one raw vLLM KV-event batch (msgpack)      |
//! | `kvplane.metrics.<pool>.<worker>`| [`crate::MetricsMessage`] (JSON)           |
//! | `kvplane.worker.<pool>.<worker>` | [`crate::WorkerMessage`] (JSON)            |
//!
//! Pool and worker names are 1-63 characters of `[a-z0-9-_]`. Anything else under `kvplane.`
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
        if parts.next().is_some() || !valid_name(pool) || !valid_name(worker) {
            return None;
        }
        Some(Self { kind, pool, worker })
    }
}

pub fn kv_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.kv.{pool}.{worker}")
}

pub fn metrics_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.metrics.{pool}.{worker}")
}

pub fn worker_subject(pool: &str, worker: &str) -> String {
    format!("kvplane.worker.{pool}.{worker}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_subjects_parse() {
        let s = Subject::parse("kvplane.kv.pool-a.worker_1").unwrap();
        assert_eq!(
            (s.kind, s.pool, s.worker),
            (MessageKind::Kv, "pool-a", "worker_1")
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
            "kvplane.other.pool.w",
            "other.kv.pool.w",
            "kvplane.kv.Pool.w",
            "kvplane.kv..w",
        ] {
            assert!(Subject::parse(s).is_none(), "{s}");
        }
    }
}
