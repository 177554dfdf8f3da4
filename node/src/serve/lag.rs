//! The leader's ingest lag: every second, a stream's last sequence against the position the
//! state has applied for it. Readiness and the workers' leases read the node's own stream's: a
//! leader far behind it is not ready, and does not expire leases (a worker whose messages wait
//! unconsumed in the stream has not gone silent). Another cluster's is a gauge of its own.

use std::sync::Arc;
use std::time::Duration;

use kvplane_ingest::IngestMetrics;
use kvplane_state::{Source, StateHandle};
use tokio::sync::watch;

/// Measures the lag until the term ends (unknown until the first measurement; a failed read
/// keeps the last one).
pub(super) async fn watch(
    js: async_nats::jetstream::Context,
    stream: String,
    (handle, source): (StateHandle, Source),
    metrics: Arc<IngestMetrics>,
    term_end: watch::Receiver<bool>,
) {
    metrics.set_lag(&source, None);
    let mut ticks = super::ticks::TermTicks::new(Duration::from_secs(1), term_end);
    while ticks.next().await {
        let last = tokio::select! {
            s = js.get_stream(&stream) => s.map(|s| s.cached_info().state.last_sequence),
            _ = ticks.term_end.wait_for(|ended| *ended) => return,
        };
        match last {
            Ok(last) => {
                let applied = handle.load().positions.get(&source).copied().unwrap_or(0);
                metrics.set_lag(&source, Some(last.saturating_sub(applied)));
            }
            Err(e) => {
                tracing::debug!(error = %e, stream, "cannot read the stream's info");
                // Another cluster's stream unread is of unknown lag (a cut link shows); the
                // node's own keeps its last measurement (readiness reads NATS's state).
                if source != Source::stream() {
                    metrics.set_lag(&source, None);
                }
            }
        }
    }
}
