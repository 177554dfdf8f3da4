//! The bridge's counters (`/metrics` of `kvplane bridge`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
    pub split_batches: Counter,
    pub dropped_events: Counter,
    pub engine_disconnects: Counter,
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
            "Times the bridge found the engine started over (a lower sequence, or replay without the last batch forwarded)",
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
            "kvplane_bridge_split_batches",
            "Engine batches over NATS's max payload, published in parts",
            self.split_batches.clone(),
        );
        r.register(
            "kvplane_bridge_dropped_events",
            "Events of a batch published in parts that did not decode, left out of the parts",
            self.dropped_events.clone(),
        );
        r.register(
            "kvplane_bridge_engine_disconnects",
            "Times the engine closed its ZMQ sockets (the bridge reconnects and checks for a restart)",
            self.engine_disconnects.clone(),
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
