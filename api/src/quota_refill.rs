//! The refiller of one replica's escrow: turns shortfalls and low escrow into grant asks,
//! idle escrow into releases, one `Quota` entry at a time through this node's log (a
//! follower's goes to the leader), and wakes the requests waiting for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplane_state::Command;
use tokio::sync::watch;

use crate::{Consistency, Escrow};

/// How often the refiller looks at the escrow without being woken.
const TICK: Duration = Duration::from_millis(50);

/// Runs until `stop`, then releases what this replica holds.
pub async fn run_refiller(
    escrow: Arc<Escrow>,
    log: Arc<dyn Consistency>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = escrow.wake.notified() => {}
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let Some(batch) = escrow.next_batch(false) else {
            continue;
        };
        let started = Instant::now();
        let result = log.write(Command::Quota(batch)).await;
        let failed = result.is_err();
        escrow.attempted(result.map(|_| ()), started.elapsed());
        if failed {
            // No quorum or no leader: do not spin; waiting requests fail closed meanwhile.
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                _ = stop.changed() => break,
            }
        }
    }
    if let Some(batch) = escrow.next_batch(true).filter(|b| !b.releases.is_empty()) {
        let tokens: u64 = batch.releases.iter().map(|r| r.tokens).sum();
        match tokio::time::timeout(Duration::from_secs(2), log.write(Command::Quota(batch))).await {
            Ok(Ok(index)) => tracing::info!(index, tokens, "escrow released at shutdown"),
            Ok(Err(e)) => tracing::warn!(error = %e, tokens, "escrow not released at shutdown"),
            Err(_) => tracing::warn!(tokens, "escrow release timed out at shutdown"),
        }
    }
    // This process settled every report it acknowledged: a retried report of its requests
    // must not settle again through the ledger. (One the ledger never heard from issued no
    // ticket: nothing to close.)
    if !escrow.known_to_ledger() {
        return;
    }
    let close = Command::QuotaClose {
        replica: escrow.config().replica,
        incarnation: escrow.config().incarnation,
    };
    match tokio::time::timeout(Duration::from_secs(2), log.write(close)).await {
        Ok(Ok(index)) => tracing::info!(index, "escrow closed at shutdown"),
        Ok(Err(e)) => tracing::warn!(error = %e, "escrow not closed at shutdown"),
        Err(_) => tracing::warn!("escrow close timed out at shutdown"),
    }
}
