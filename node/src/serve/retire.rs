//! Replicas that left the cluster, in the quota ledger, while leading: a replica the ledger
//! heard from that is no member any more (removed, or replaced under a new id) is retired by
//! a `QuotaRetire` entry, so the tickets of its requests give back what they did not use
//! instead of waiting for a next process that never comes. Compared with the membership every
//! second, so a removal this member did not make itself, or one whose retirement a leader's
//! crash lost, is still seen.

use std::sync::Arc;
use std::time::Duration;

use kvplane_raft::RaftMember;
use kvplane_state::{Command, Proposer};
use tokio::sync::watch;

/// Retires, until the term ends, every replica of the ledger that is no member.
pub(super) async fn retire_removed(member: Arc<RaftMember>, term_end: watch::Receiver<bool>) {
    let mut ticks = super::ticks::TermTicks::new(Duration::from_secs(1), term_end);
    while ticks.next().await {
        let members: Vec<u64> = member.members().into_iter().map(|(id, _)| id).collect();
        if members.is_empty() {
            continue;
        }
        let gone: Vec<u64> = {
            let view = member.handle.load();
            view.quota
                .replicas
                .keys()
                .filter(|r| !members.contains(r) && !view.quota.is_retired(**r))
                .copied()
                .collect()
        };
        for replica in gone {
            match member.log.propose(Command::QuotaRetire { replica }).await {
                Ok(index) => tracing::info!(
                    replica,
                    index,
                    "quota of a replica that left the cluster retired"
                ),
                Err(e) => {
                    tracing::warn!(replica, error = %e, "quota of a removed replica not retired")
                }
            }
        }
    }
}
