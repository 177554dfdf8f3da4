//! Routing decisions shared between replicas over NATS core (subject `kvplane-gossip.routed`,
//! outside the ingest stream's `kvplane.>`: gossip is never stored or replicated): each
//! replica publishes the worker it chose and when that request's first token is due, and the
//! others count it in that worker's queue until then ([`Predictor::routed_elsewhere`]), so
//! that replicas routing at once from the same state do not all pick the same idle worker.
//! Best effort: a note lost or late only makes a prediction less exact. How late notes arrive
//! is `kvplane_routed_note_delay_seconds`: replicas deciding within that time of each other do
//! not know of each other's decision and may take the same idle worker.

use std::sync::Arc;

use kvplane_api::predict::{Predictor, RoutedNote, RoutedSink};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

pub const SUBJECT: &str = "kvplane-gossip.routed";

#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    replica: String,
    #[serde(flatten)]
    note: RoutedNote,
    /// When the replica decided, in microseconds of its wall clock (notes of older versions
    /// have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    decided_us: Option<u64>,
}

#[derive(Debug)]
pub struct ShareMetrics {
    published: Counter,
    dropped: Counter,
    received: Counter,
    malformed: Counter,
    /// From a decision to another replica counting it (by the two replicas' clocks).
    delay: Histogram,
    /// Notes stamped later than this replica's clock says it is: not timed.
    from_clock_ahead: Counter,
}

impl Default for ShareMetrics {
    fn default() -> Self {
        Self {
            published: Counter::default(),
            dropped: Counter::default(),
            received: Counter::default(),
            malformed: Counter::default(),
            from_clock_ahead: Counter::default(),
            // 50 us to about 3.3 s.
            delay: Histogram::new(exponential_buckets(0.000_05, 2.0, 17)),
        }
    }
}

/// Microseconds since the Unix epoch by this host's clock.
fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl ShareMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_routed_notes_published",
            "Routing decisions told to the other replicas",
            self.published.clone(),
        );
        r.register(
            "kvplane_routed_notes_dropped",
            "Routing decisions not told (the outgoing queue was full)",
            self.dropped.clone(),
        );
        r.register(
            "kvplane_routed_notes_received",
            "Other replicas' routing decisions counted here",
            self.received.clone(),
        );
        r.register(
            "kvplane_routed_notes_malformed",
            "Messages on kvplane-gossip.routed that were not routing decisions",
            self.malformed.clone(),
        );
        r.register(
            "kvplane_routed_note_delay_seconds",
            "From another replica's routing decision to its note being counted here",
            self.delay.clone(),
        );
        r.register(
            "kvplane_routed_notes_from_clock_ahead",
            "Other replicas' routing decisions stamped later than this replica's clock (not timed)",
            self.from_clock_ahead.clone(),
        );
    }

    fn timed(&self, decided_us: u64, now_us: u64) {
        match now_us.checked_sub(decided_us) {
            Some(us) => self.delay.observe(us as f64 / 1e6),
            None => {
                self.from_clock_ahead.inc();
            }
        }
    }
}

/// A decision and when it was made, on its way out.
#[derive(Debug)]
pub struct Decided {
    note: RoutedNote,
    /// Microseconds since the Unix epoch.
    at_us: u64,
}

/// The sink the router calls, and the queue behind it.
/// Each note is stamped with the time it was decided.
pub fn sink(metrics: Arc<ShareMetrics>) -> (RoutedSink, mpsc::Receiver<Decided>) {
    let (tx, rx) = mpsc::channel(4096);
    let sink = RoutedSink(Arc::new(move |note| {
        if tx
            .try_send(Decided {
                note,
                at_us: wall_us(),
            })
            .is_err()
        {
            metrics.dropped.inc();
        }
    }));
    (sink, rx)
}

/// Publishes this replica's decisions and feeds the others' into `predictor`, until `stop`.
pub async fn run(
    client: async_nats::Client,
    replica: String,
    predictor: Arc<Predictor>,
    mut outgoing: mpsc::Receiver<Decided>,
    metrics: Arc<ShareMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut sub = match client.subscribe(SUBJECT).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot subscribe to {SUBJECT}; decisions are not shared");
            return;
        }
    };
    loop {
        tokio::select! {
            n = outgoing.recv() => {
                let Some(Decided { note, at_us }) = n else { return };
                let wire = Wire { replica: replica.clone(), note, decided_us: Some(at_us) };
                if let Ok(bytes) = serde_json::to_vec(&wire)
                    && client.publish(SUBJECT, bytes.into()).await.is_ok()
                {
                    metrics.published.inc();
                }
            }
            m = futures::StreamExt::next(&mut sub) => {
                let Some(m) = m else { return };
                match serde_json::from_slice::<Wire>(&m.payload) {
                    Ok(w) if w.replica == replica => {}
                    Ok(w) if !well_formed(&w.note) => {
                        metrics.malformed.inc();
                    }
                    Ok(w) => {
                        metrics.received.inc();
                        if let Some(at) = w.decided_us {
                            metrics.timed(at, wall_us());
                        }
                        predictor.routed_elsewhere(
                            &w.note.worker_set,
                            &w.note.worker,
                            w.note.at_ms,
                            w.note.due_ms,
                        );
                        predictor.place(
                            &w.note.worker_set,
                            &w.note.worker,
                            w.note.dp_rank,
                            &w.note.anchors,
                            (w.note.at_ms, w.note.due_ms),
                        );
                    }
                    Err(_) => {
                        metrics.malformed.inc();
                    }
                }
            }
            _ = stop.changed() => return,
        }
    }
}

/// A note whose dp rank no engine can have, or with more anchors than a prompt can (see
/// [`kvplane_api::placed`]), is not a decision of a replica of this version.
fn well_formed(n: &RoutedNote) -> bool {
    n.dp_rank <= kvplane_state::MAX_DP_RANK
        && n.anchors.len() <= kvplane_api::placed::MAX_PROMPT_ANCHORS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_with_an_impossible_rank_or_too_many_anchors_is_malformed() {
        let note = |dp_rank: u32, anchors: usize| RoutedNote {
            worker_set: "ws".into(),
            worker: "w0".into(),
            at_ms: 1,
            due_ms: 2,
            dp_rank,
            anchors: vec![kvplane_state::Anchor { blocks: 16, seq: 7 }; anchors],
        };
        assert!(well_formed(&note(3, 17)));
        assert!(well_formed(&note(
            kvplane_state::MAX_DP_RANK,
            kvplane_api::placed::MAX_PROMPT_ANCHORS
        )));
        assert!(!well_formed(&note(kvplane_state::MAX_DP_RANK + 1, 0)));
        assert!(!well_formed(&note(
            0,
            kvplane_api::placed::MAX_PROMPT_ANCHORS + 1
        )));
    }

    #[test]
    fn a_note_without_its_decision_time_reads_as_older_versions_send_it() {
        let old = r#"{"replica":"a","worker_set":"ws","worker":"w0","at_ms":5,"due_ms":9}"#;
        let w: Wire = serde_json::from_str(old).unwrap();
        assert_eq!(w.decided_us, None);
        assert!(w.note.anchors.is_empty() && w.note.dp_rank == 0);
        assert_eq!(
            (w.note.worker.as_str(), w.note.at_ms, w.note.due_ms),
            ("w0", 5, 9)
        );
        let new = r#"{"replica":"a","worker_set":"ws","worker":"w0","at_ms":5,"due_ms":9,"decided_us":7}"#;
        let w: Wire = serde_json::from_str(new).unwrap();
        assert_eq!(w.decided_us, Some(7));
        assert_eq!(w.note.worker_set, "ws");
    }

    #[test]
    fn a_note_from_a_clock_ahead_is_counted_not_timed() {
        let m = ShareMetrics::default();
        m.timed(2_000, 1_000);
        m.timed(1_000, 1_500);
        assert_eq!(m.from_clock_ahead.get(), 1);
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        assert!(
            text.contains("kvplane_routed_note_delay_seconds_count 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kvplane_routed_note_delay_seconds_sum 0.0005\n"),
            "{text}"
        );
    }
}
