//! Ingest counters, exported in Prometheus text by the node.

use std::sync::Mutex;

use kvplane_state::Source;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Why a stream message was rejected before it reached the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// A subject outside the scheme.
    UnknownSubject,
    /// A payload above `max_message_bytes`.
    Oversized,
    /// A KV batch that is not decodable msgpack of the right shape.
    Undecodable,
    /// A KV batch on one data-parallel rank's subject that names another rank.
    RankMismatch,
    /// A metrics message that is not the expected JSON or is out of range.
    BadMetrics,
    /// A worker message that is not the expected JSON.
    BadWorkerMessage,
}

impl RejectReason {
    pub const ALL: [RejectReason; 6] = [
        Self::UnknownSubject,
        Self::Oversized,
        Self::Undecodable,
        Self::RankMismatch,
        Self::BadMetrics,
        Self::BadWorkerMessage,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownSubject => "unknown_subject",
            Self::Oversized => "oversized",
            Self::Undecodable => "undecodable",
            Self::RankMismatch => "rank_mismatch",
            Self::BadMetrics => "bad_metrics",
            Self::BadWorkerMessage => "bad_worker_message",
        }
    }
}

/// The kinds of stream message (`kvplane_ingest_messages_total{kind}`).
const KINDS: [&str; 3] = ["kv", "metrics", "worker"];

/// Why a vLLM event inside an accepted batch is skipped
/// (`kvplane_ingest_skipped_events_total{reason}`).
const SKIP_REASONS: [&str; 3] = ["unknown_event_type", "malformed_event", "non_primary_group"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: String,
}

/// Counters of one node's ingest.
#[derive(Debug, Default)]
pub struct IngestMetrics {
    messages: Family<KindLabel, Counter>,
    rejected: Family<ReasonLabel, Counter>,
    skipped_events: Family<ReasonLabel, Counter>,
    batches: Counter,
    pending: Gauge,
    last_sequence: Gauge,
    /// Stream messages past the applied position, as the leader last measured (-1: not yet
    /// this term).
    lag: Gauge,
    /// The same three for other clusters' streams (`[[ingest.clusters]]`), by source name.
    source_pending: Family<SourceLabel, Gauge>,
    source_last_sequence: Family<SourceLabel, Gauge>,
    source_lag: Family<SourceLabel, Gauge>,
    /// Those sources' labels.
    sources: Mutex<Vec<SourceLabel>>,
    /// Consumers started again because they had stalled, by source (`local`: the node's own
    /// stream).
    stalls: Family<SourceLabel, Counter>,
}

impl IngestMetrics {
    pub fn register(&self, registry: &mut Registry) {
        // Every kind and reason has its series from the start, at 0.
        for kind in KINDS {
            let _created = self.messages.get_or_create(&KindLabel { kind });
        }
        for r in RejectReason::ALL {
            let _created = self
                .rejected
                .get_or_create(&ReasonLabel { reason: r.as_str() });
        }
        for reason in SKIP_REASONS {
            let _created = self.skipped_events.get_or_create(&ReasonLabel { reason });
        }
        let _created = self.stalls.get_or_create(&stall_label(&Source::stream()));
        registry.register(
            "kvplane_ingest_consumer_stalls",
            "Consumers started again from the applied position because the stream held messages they did not deliver, by source (local: the node's own stream)",
            self.stalls.clone(),
        );
        registry.register(
            "kvplane_ingest_messages",
            "Stream messages consumed, by kind",
            self.messages.clone(),
        );
        registry.register(
            "kvplane_ingest_rejected_messages",
            "Stream messages rejected before the log, by reason",
            self.rejected.clone(),
        );
        registry.register(
            "kvplane_ingest_skipped_events",
            "vLLM events skipped inside accepted batches, by reason",
            self.skipped_events.clone(),
        );
        registry.register(
            "kvplane_ingest_batches",
            "Log entries proposed by ingest",
            self.batches.clone(),
        );
        registry.register(
            "kvplane_ingest_pending_messages",
            "Stream messages not yet consumed, as the server last reported",
            self.pending.clone(),
        );
        registry.register(
            "kvplane_ingest_lag_messages",
            "Stream messages past the applied position, measured by the leader every second (-1: not known yet)",
            self.lag.clone(),
        );
        registry.register(
            "kvplane_ingest_last_consumed_sequence",
            "Stream sequence of the last consumed message",
            self.last_sequence.clone(),
        );
        registry.register(
            "kvplane_ingest_source_pending_messages",
            "Messages of another cluster's stream not yet consumed, as its server last reported, by source",
            self.source_pending.clone(),
        );
        registry.register(
            "kvplane_ingest_source_lag_messages",
            "Messages of another cluster's stream past the applied position, measured by the leader every second, by source (-1: not known yet)",
            self.source_lag.clone(),
        );
        registry.register(
            "kvplane_ingest_source_last_consumed_sequence",
            "Sequence of the last message consumed from another cluster's stream, by source",
            self.source_last_sequence.clone(),
        );
    }

    /// Registers the series of another cluster's source `name` (at -1 lag, 0 otherwise), so
    /// it is there before its first message.
    pub fn add_source(&self, name: &str) {
        let label = SourceLabel {
            source: name.to_owned(),
        };
        let _pending = self.source_pending.get_or_create(&label);
        let _last = self.source_last_sequence.get_or_create(&label);
        self.source_lag.get_or_create(&label).set(-1);
        let _stalls = self.stalls.get_or_create(&label);
        if let Ok(mut sources) = self.sources.lock() {
            sources.push(label);
        }
    }

    pub(crate) fn message(&self, kind: &'static str) {
        self.messages.get_or_create(&KindLabel { kind }).inc();
    }

    pub(crate) fn reject(&self, reason: RejectReason) {
        self.rejected
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub(crate) fn skipped(&self, reason: &'static str) {
        self.skipped_events
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub(crate) fn stalled(&self, source: &Source) {
        self.stalls.get_or_create(&stall_label(source)).inc();
    }

    /// Consumers of `source` started again after a stall so far.
    pub fn stalls(&self, source: &Source) -> u64 {
        self.stalls.get_or_create(&stall_label(source)).get()
    }

    pub(crate) fn batch(&self, source: &Source, last_seq: u64, pending: u64) {
        self.batches.inc();
        let (last_seq, pending) = (gauge(last_seq), gauge(pending));
        if *source == Source::stream() {
            self.last_sequence.set(last_seq);
            self.pending.set(pending);
        } else {
            let label = SourceLabel {
                source: source.as_str().to_owned(),
            };
            self.source_last_sequence
                .get_or_create(&label)
                .set(last_seq);
            self.source_pending.get_or_create(&label).set(pending);
        }
    }

    /// Rejections so far, by reason (all reasons, zeros included).
    pub fn rejected(&self) -> Vec<(&'static str, u64)> {
        RejectReason::ALL
            .iter()
            .map(|r| {
                (
                    r.as_str(),
                    self.rejected
                        .get_or_create(&ReasonLabel { reason: r.as_str() })
                        .get(),
                )
            })
            .collect()
    }

    /// Events skipped so far, by reason.
    pub fn skipped_events(&self) -> Vec<(&'static str, u64)> {
        SKIP_REASONS
            .iter()
            .map(|r| {
                (
                    *r,
                    self.skipped_events
                        .get_or_create(&ReasonLabel { reason: r })
                        .get(),
                )
            })
            .collect()
    }

    /// Consuming stopped (leadership lost): nothing is pending or lagging here any more.
    pub fn stopped(&self) {
        self.pending.set(0);
        self.lag.set(0);
        if let Ok(sources) = self.sources.lock() {
            for label in sources.iter() {
                self.source_pending.get_or_create(label).set(0);
                self.source_lag.get_or_create(label).set(0);
            }
        }
    }

    /// Messages the node's own stream holds past the applied position (`None`: not measured
    /// yet).
    pub fn lag(&self) -> Option<u64> {
        u64::try_from(self.lag.get()).ok()
    }

    /// Other clusters' sources whose measured lag is unknown (not read yet, or the last read
    /// failed) or above `max`.
    pub fn sources_behind(&self, max: u64) -> Vec<String> {
        let Ok(sources) = self.sources.lock() else {
            return Vec::new();
        };
        sources
            .iter()
            .filter(|label| {
                u64::try_from(self.source_lag.get_or_create(label).get()).map_or(true, |l| l > max)
            })
            .map(|label| label.source.clone())
            .collect()
    }

    /// Messages of `source`'s stream past the applied position, as just measured (`None`: not
    /// known).
    pub fn set_lag(&self, source: &Source, lag: Option<u64>) {
        let lag = lag.map_or(-1, gauge);
        if *source == Source::stream() {
            self.lag.set(lag);
        } else {
            self.source_lag
                .get_or_create(&SourceLabel {
                    source: source.as_str().to_owned(),
                })
                .set(lag);
        }
    }

    /// Last consumed stream sequence plus the server's pending count: the stream's end as
    /// last seen.
    pub fn stream_end(&self) -> u64 {
        u64::try_from(self.last_sequence.get() + self.pending.get()).unwrap_or(0)
    }
}

/// The stall counter's label of `source`: `local` for the node's own stream.
fn stall_label(source: &Source) -> SourceLabel {
    SourceLabel {
        source: if *source == Source::stream() {
            "local".to_owned()
        } else {
            source.as_str().to_owned()
        },
    }
}

/// A count as a gauge's value.
fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_and_reason_has_a_series_before_its_first_message() {
        let m = IngestMetrics::default();
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap_or_default();
        for line in [
            r#"kvplane_ingest_messages_total{kind="worker"} 0"#,
            r#"kvplane_ingest_rejected_messages_total{reason="rank_mismatch"} 0"#,
            r#"kvplane_ingest_skipped_events_total{reason="non_primary_group"} 0"#,
            r#"kvplane_ingest_consumer_stalls_total{source="local"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
