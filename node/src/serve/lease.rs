//! Workers' leases, while leading: a worker that is up but has not been heard from (no KV
//! batch, metrics or announcement of its applied) for longer than the lease is taken down by an
//! `ExpireLeases` entry, so a bridge that stopped without saying so cannot leave its worker
//! routable with blocks it may no longer hold.
//!
//! The state decides who expires, from the entry's timestamp (the only clock it reads); the
//! leader only decides when to propose. It waits one lease into its term first (a worker whose
//! messages were applied by the previous leader has had a whole lease to be heard again), and
//! proposes only while its ingest is caught up with every stream it consumes - its own and
//! other clusters' (at most [`MAX_LAG`] messages behind each, as [`super::lag`] measured; a
//! stream it cannot read counts as behind): while NATS or a link to another cluster is away or
//! a backlog drains, a worker's messages may be waiting in a stream, so its silence proves
//! nothing. The entry expires every silent worker at once, so one cluster cut off holds every
//! lease, not only its own workers'.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use kvplane_ingest::IngestMetrics;
use kvplane_state::{Command, Proposer, StateHandle};
use tokio::sync::watch;

/// Ingest may be this many messages behind the stream when leases expire.
const MAX_LAG: u64 = 1024;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Proposes `ExpireLeases` whenever some worker's lease has run out, until the term ends.
pub(super) async fn expire(
    log: impl Proposer,
    handle: StateHandle,
    lease: Duration,
    ingest: Arc<IngestMetrics>,
    mut term_end: watch::Receiver<bool>,
) {
    let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
    tokio::select! {
        () = tokio::time::sleep(lease) => {}
        _ = term_end.wait_for(|ended| *ended) => return,
    }
    let mut ticks =
        super::ticks::TermTicks::new((lease / 4).max(Duration::from_millis(20)), term_end);
    while ticks.next().await {
        let now = now_ms();
        let due = handle
            .load()
            .workers()
            .any(|w| w.up && w.heard_ms.saturating_add(lease_ms) < now);
        if !due {
            continue;
        }
        match ingest.lag() {
            Some(lag) if lag <= MAX_LAG => {}
            lag => {
                tracing::info!(
                    ?lag,
                    "a lease ran out, but ingest is not caught up with the stream: not expiring"
                );
                continue;
            }
        }
        let behind = ingest.sources_behind(MAX_LAG);
        if !behind.is_empty() {
            tracing::info!(
                ?behind,
                "a lease ran out, but another cluster's stream is behind or unreachable: not expiring"
            );
            continue;
        }
        match log.propose(Command::ExpireLeases { lease_ms }).await {
            Ok(index) => tracing::info!(index, lease_ms, "workers' leases expired"),
            Err(e) => tracing::warn!(error = %e, "could not expire workers' leases"),
        }
    }
}
