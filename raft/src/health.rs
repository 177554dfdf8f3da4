//! What a Raft member says about itself: readiness (`/readyz`) and its Raft gauges.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use openraft::ServerState;
use openraft::async_runtime::Instant as _;
use openraft::async_runtime::WatchReceiver;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::member::RaftMember;

/// Why a member is not ready to serve (`/readyz` answers 503 with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error("no leader known")]
    NoLeader,
    #[error("leading without a quorum")]
    NoQuorum,
    #[error("leading since term {term} but no entry of that term applied yet")]
    NewLeader { term: u64 },
    #[error("no word from leader {leader} yet")]
    NotHeardFrom { leader: u64 },
    #[error("no word from leader {leader} for {ms} ms")]
    Silent { leader: u64, ms: u128 },
    #[error(
        "applied index {applied} is {lag} entries behind the committed {committed} (leader {leader})"
    )]
    Behind {
        applied: u64,
        lag: u64,
        committed: u64,
        leader: u64,
    },
}

impl NotReady {
    /// Its metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NoLeader => "no_leader",
            Self::NoQuorum => "no_quorum",
            Self::NewLeader { .. } => "new_leader",
            Self::NotHeardFrom { .. } | Self::Silent { .. } => "leader_silent",
            Self::Behind { .. } => "behind",
        }
    }
}

impl RaftMember {
    /// Ready to serve: a leader is known and was heard from within `lease` (a leader itself
    /// heard from a quorum within it), and this replica has applied all but at most `max_lag`
    /// of the entries the cluster committed.
    pub fn readiness(&self, max_lag: u64, lease: Duration) -> Result<(), NotReady> {
        let m = self.raft.metrics().borrow_watched().clone();
        let Some(leader) = m.current_leader else {
            return Err(NotReady::NoLeader);
        };
        if m.state == ServerState::Leader {
            // A leader that is its quorum alone (a one-member cluster) has no follower to
            // acknowledge it: openraft stamps `last_quorum_acked` once, when it starts leading.
            let alone = m.membership_config.membership().voter_ids().eq([m.id]);
            let acked = m.last_quorum_acked.map(|t| t.elapsed());
            if !alone && acked.is_none_or(|a| a > lease) {
                return Err(NotReady::NoQuorum);
            }
            // A new leader knows everything committed before it only once an entry of its own
            // term (its blank entry) is committed: until it has applied one, its state may lack
            // writes that were acknowledged before a restart or an election.
            let own = m.last_applied.as_ref().map(|l| l.leader_id.term);
            if own != Some(m.current_term) {
                return Err(NotReady::NewLeader {
                    term: m.current_term,
                });
            }
        } else {
            // With Pre-Vote a member cut off from the quorum never starts an election and keeps
            // the leader it knew: judge it by when that leader was last heard from.
            match self.contact.elapsed() {
                None => return Err(NotReady::NotHeardFrom { leader }),
                Some(e) if e > lease => {
                    return Err(NotReady::Silent {
                        leader,
                        ms: e.as_millis(),
                    });
                }
                Some(_) => {}
            }
        }
        let committed = m
            .cluster_committed
            .or(m.local_committed)
            .map_or(0, |l| l.index);
        let applied = m.last_applied.map_or(0, |l| l.index);
        let lag = committed.saturating_sub(applied);
        if lag > max_lag {
            return Err(NotReady::Behind {
                applied,
                lag,
                committed,
                leader,
            });
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: &'static str,
}

/// `kvplane_raft_*`: this member's view of the cluster, sampled every second.
#[derive(Debug, Default)]
pub struct RaftGauges {
    term: Gauge,
    leader_id: Gauge,
    role: Family<RoleLabel, Gauge>,
    last_log_index: Gauge,
    committed_index: Gauge,
    applied_index: Gauge,
    snapshot_index: Gauge,
    purged_index: Gauge,
    voters: Gauge,
    learners: Gauge,
    snapshot_bytes: Gauge<u64, AtomicU64>,
    ready: Gauge,
}

const ROLES: [&str; 5] = ["leader", "follower", "candidate", "learner", "shutdown"];

impl RaftGauges {
    pub fn register(&self, r: &mut Registry) {
        let g = |r: &mut Registry, name: &str, help: &str, m: &Gauge| {
            r.register(name, help, m.clone());
        };
        g(r, "kvplane_raft_term", "Current Raft term", &self.term);
        g(
            r,
            "kvplane_raft_leader_id",
            "Raft id of the leader this member knows (0: none)",
            &self.leader_id,
        );
        r.register(
            "kvplane_raft_role",
            "1 for this member's current Raft role",
            self.role.clone(),
        );
        g(
            r,
            "kvplane_raft_last_log_index",
            "Index of the last entry in this member's log",
            &self.last_log_index,
        );
        g(
            r,
            "kvplane_raft_committed_index",
            "Index the cluster committed, as this member knows it",
            &self.committed_index,
        );
        g(
            r,
            "kvplane_raft_applied_index",
            "Index this member applied to its state",
            &self.applied_index,
        );
        g(
            r,
            "kvplane_raft_snapshot_index",
            "Index of the last entry in this member's snapshot",
            &self.snapshot_index,
        );
        g(
            r,
            "kvplane_raft_purged_index",
            "Index up to which this member's log was purged",
            &self.purged_index,
        );
        g(
            r,
            "kvplane_raft_voters",
            "Voters in the membership",
            &self.voters,
        );
        g(
            r,
            "kvplane_raft_learners",
            "Learners in the membership",
            &self.learners,
        );
        r.register(
            "kvplane_raft_snapshot_bytes",
            "Size of this member's current state snapshot file",
            self.snapshot_bytes.clone(),
        );
        g(
            r,
            "kvplane_raft_ready",
            "1 when /readyz says ready",
            &self.ready,
        );
    }

    fn sample(&self, m: &RaftMember, snapshot: &std::path::Path, ready: bool) {
        let x = m.raft.metrics().borrow_watched().clone();
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.term.set(i(x.current_term));
        self.leader_id.set(i(x.current_leader.unwrap_or(0)));
        let role = crate::member::role_name(x.state);
        for r in ROLES {
            self.role
                .get_or_create(&RoleLabel { role: r })
                .set(i64::from(r == role));
        }
        self.last_log_index.set(i(x.last_log_index.unwrap_or(0)));
        self.committed_index.set(i(x
            .cluster_committed
            .or(x.local_committed)
            .map_or(0, |l| l.index)));
        self.applied_index
            .set(i(x.last_applied.map_or(0, |l| l.index)));
        self.snapshot_index
            .set(i(x.snapshot.map_or(0, |l| l.index)));
        self.purged_index.set(i(x.purged.map_or(0, |l| l.index)));
        let membership = x.membership_config.membership();
        let voters = membership.voter_ids().count();
        let nodes = membership.nodes().count();
        self.voters.set(i(voters as u64));
        self.learners.set(i(nodes.saturating_sub(voters) as u64));
        self.snapshot_bytes
            .set(std::fs::metadata(snapshot).map_or(0, |m| m.len()));
        self.ready.set(i64::from(ready));
    }

    /// Samples `member` every second until `stop` (`ready`: whether `/readyz` says ready).
    pub async fn run(
        self: Arc<Self>,
        member: Arc<RaftMember>,
        snapshot: PathBuf,
        ready: Arc<dyn Fn() -> bool + Send + Sync>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            self.sample(&member, &snapshot, ready());
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => return,
            }
        }
    }
}
