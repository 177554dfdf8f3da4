//! The leader's ingest lag: every second, the stream's last sequence against the position the
//! state has applied. Readiness and the workers' leases read it: a leader far behind the
//! stream is not ready, and does not expire leases (a worker whose messages wait unconsumed
//! in the stream has not gone silent).

use std::sync::Arc;
use std::time::Duration;

use kvplane_ingest::IngestMetrics;
use kvplane_state::{Source, StateHandle};
use tokio::sync::watch;

/// Measures the lag until the term ends (unknown until the first measurement, and whenever
/// the stream cannot be asked).
pub(super) async fn watch(
    js: async_nats::jetstream::Context,
    stream: String,
    (handle, source): (StateHandle, Source),
    metrics: Arc<IngestMetrics>,
    mut term_end: watch::Receiver<bool>,
) {
    metrics.set_lag(None);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = term_end.wait_for(|ended| *ended) => return,
        }
        let last = match js.get_stream(&stream).await {
            Ok(mut s) => match s.info().await {
                Ok(info) => Some(info.state.last_sequence),
                Err(e) => {
                    tracing::debug!(error = %e, stream, "cannot read the stream's info");
                    None
                }
            },
            Err(e) => {
                tracing::debug!(error = %e, stream, "cannot read the stream");
                None
            }
        };
        let applied = handle.load().positions.get(&source).copied().unwrap_or(0);
        metrics.set_lag(last.map(|l| l.saturating_sub(applied)));
    }
}
