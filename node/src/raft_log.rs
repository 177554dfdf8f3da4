//! The replicated log: proposals go through Raft; ingest runs only on the leader.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvplane_raft::{KvRaft, LogStore, Network, Proposal, ReplicatedState};
use kvplane_state::{Command, ProposeError, Proposer, StateHandle};
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};

use crate::config::{Config, RaftSection};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Proposes through Raft; cheap to clone.
#[derive(Clone)]
pub struct RaftLog {
    raft: KvRaft,
}

impl std::fmt::Debug for RaftLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLog").finish_non_exhaustive()
    }
}

impl Proposer for RaftLog {
    async fn propose(&self, command: Command) -> Result<u64, ProposeError> {
        match self
            .raft
            .client_write(Proposal {
                timestamp_ms: now_ms(),
                command,
            })
            .await
        {
            Ok(r) => Ok(r.log_id.index),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(ProposeError::NotLeader {
                    leader: f.leader_node.map(|n| n.addr),
                })
            }
            Err(e) => Err(ProposeError::Log(e.to_string())),
        }
    }
}

/// A started Raft member.
pub struct RaftMember {
    pub raft: KvRaft,
    pub log: RaftLog,
    pub handle: StateHandle,
}

impl RaftMember {
    /// Opens the log and state under `data_dir`, starts Raft, and initializes a new cluster when
    /// asked to and the log is empty.
    pub async fn start(cfg: &Config, r: &RaftSection) -> anyhow::Result<Self> {
        let dir = cfg.data_dir.join("raft");
        std::fs::create_dir_all(&dir)?;
        let log = LogStore::open(&dir.join("log.redb"))?;
        let state = ReplicatedState::open(&dir.join("state"))?;
        let handle = state.handle();
        let config = openraft::Config {
            cluster_name: "kvplane".into(),
            heartbeat_interval: r.heartbeat_ms,
            election_timeout_min: r.election_timeout_min_ms,
            election_timeout_max: r.election_timeout_max_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(r.snapshot_logs),
            ..Default::default()
        }
        .validate()?;
        let raft =
            openraft::Raft::new(r.id, Arc::new(config), Network::default(), log, state).await?;
        if r.bootstrap {
            let members: BTreeMap<u64, BasicNode> = r
                .peers
                .iter()
                .map(|p| (p.id, BasicNode::new(p.addr.clone())))
                .collect();
            match raft.initialize(members).await {
                Ok(()) => tracing::info!(id = r.id, "initialized a new raft cluster"),
                Err(e) => {
                    tracing::info!(id = r.id, reason = %e, "raft cluster already initialized")
                }
            }
        }
        Ok(Self {
            log: RaftLog { raft: raft.clone() },
            raft,
            handle,
        })
    }

    /// This node's role, as Status reports it.
    pub fn role(&self) -> String {
        match self.raft.metrics().borrow_watched().state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        }
        .to_owned()
    }

    fn is_leader(&self) -> bool {
        let m = self.raft.metrics().borrow_watched().clone();
        m.state == ServerState::Leader && m.current_leader == Some(m.id)
    }

    /// Waits until this node leads and its state holds every committed entry (so the recorded
    /// stream position is the cluster's), or until `stop`.
    pub async fn wait_leadership(&self, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
        loop {
            if *stop.borrow() {
                return false;
            }
            if self.is_leader()
                && self
                    .raft
                    .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
                    .await
                    .is_ok()
            {
                return true;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Resolves once this node no longer leads (or `stop`).
    pub async fn wait_lost_leadership(&self, stop: &mut tokio::sync::watch::Receiver<bool>) {
        while self.is_leader() && !*stop.borrow() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

impl kvplane_api::ClusterControl for RaftMember {
    fn status(&self) -> kvplane_proto::v1::ClusterStatusResponse {
        let m = self.raft.metrics().borrow_watched().clone();
        let membership = m.membership_config.membership();
        let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, n)| kvplane_proto::v1::Member {
                id: *id,
                addr: n.addr.clone(),
                voter: voters.contains(id),
            })
            .collect();
        let leader_addr = m
            .current_leader
            .and_then(|l| {
                membership
                    .nodes()
                    .find(|(id, _)| **id == l)
                    .map(|(_, n)| n.addr.clone())
            })
            .unwrap_or_default();
        kvplane_proto::v1::ClusterStatusResponse {
            node: m.id,
            leader: m.current_leader.unwrap_or(0),
            leader_addr,
            term: m.current_term,
            members,
            committed_index: m.local_committed.map_or(0, |l| l.index),
            applied_index: m.last_applied.map_or(0, |l| l.index),
        }
    }

    fn add(
        &self,
        id: u64,
        addr: String,
    ) -> futures::future::BoxFuture<'_, Result<(), kvplane_api::ClusterError>> {
        Box::pin(async move {
            self.leader_only()?;
            self.raft
                .add_learner(id, BasicNode::new(addr), true)
                .await
                .map_err(membership_error)?;
            let ids: std::collections::BTreeSet<u64> = [id].into();
            self.raft
                .change_membership(openraft::ChangeMembers::AddVoterIds(ids), false)
                .await
                .map_err(membership_error)?;
            tracing::info!(id, "member added");
            Ok(())
        })
    }

    fn remove(
        &self,
        id: u64,
    ) -> futures::future::BoxFuture<'_, Result<(), kvplane_api::ClusterError>> {
        Box::pin(async move {
            self.leader_only()?;
            let ids: std::collections::BTreeSet<u64> = [id].into();
            self.raft
                .change_membership(openraft::ChangeMembers::RemoveVoters(ids), false)
                .await
                .map_err(membership_error)?;
            tracing::info!(id, "member removed");
            Ok(())
        })
    }
}

impl RaftMember {
    fn leader_only(&self) -> Result<(), kvplane_api::ClusterError> {
        if self.is_leader() {
            return Ok(());
        }
        let s = kvplane_api::ClusterControl::status(self);
        Err(kvplane_api::ClusterError::NotLeader {
            leader: (!s.leader_addr.is_empty()).then_some(s.leader_addr),
        })
    }
}

fn membership_error(
    e: RaftError<kvplane_raft::TypeConfig, ClientWriteError<kvplane_raft::TypeConfig>>,
) -> kvplane_api::ClusterError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            kvplane_api::ClusterError::NotLeader {
                leader: f.leader_node.map(|n| n.addr),
            }
        }
        other => kvplane_api::ClusterError::Failed(other.to_string()),
    }
}
