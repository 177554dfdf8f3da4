//! Routing decisions shared between replicas over NATS core (subject `kvplane-gossip.routed`,
//! outside the ingest stream's `kvplane.>`: gossip is never stored or replicated): each
//! replica publishes the worker it chose and when that request's first token is due, and the
//! others count it in that worker's queue until then ([`Predictor::routed_elsewhere`]), so
//! that replicas routing at once from the same state do not all pick the same idle worker.
//! Best effort: a note lost or late only makes a prediction less exact.

use std::sync::Arc;

use kvplane_api::predict::{Predictor, RoutedNote, RoutedSink};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

pub const SUBJECT: &str = "kvplane-gossip.routed";

#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    replica: String,
    #[serde(flatten)]
    note: RoutedNote,
}

#[derive(Debug, Default)]
pub struct ShareMetrics {
    published: Counter,
    dropped: Counter,
    received: Counter,
    malformed: Counter,
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
    }
}

/// The sink the router calls, and the queue behind it.
pub fn sink(metrics: Arc<ShareMetrics>) -> (RoutedSink, mpsc::Receiver<RoutedNote>) {
    let (tx, rx) = mpsc::channel(4096);
    let sink = RoutedSink(Arc::new(move |n| {
        if tx.try_send(n).is_err() {
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
    mut outgoing: mpsc::Receiver<RoutedNote>,
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
                let Some(note) = n else { return };
                let wire = Wire { replica: replica.clone(), note };
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
                    Ok(w) => {
                        metrics.received.inc();
                        predictor.routed_elsewhere(
                            &w.note.worker_set,
                            &w.note.worker,
                            w.note.at_ms,
                            w.note.due_ms,
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
