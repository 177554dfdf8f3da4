//! One Raft member, assembled: the redb log, the replicated state, the network, bootstrap and
//! join, and the traits the rest of kvplane uses of it ([`crate::Consistency`],
//! [`crate::ClusterControl`], [`kvplane_state::Proposer`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Faults, KvRaft, LeaderContact, LogStore, LogStoreError, Network, OnApplied, Proposal, RaftGrpc,
    Replica, ReplicatedState,
};
use futures::future::BoxFuture;
use kvplane_state::{Command, ProposeError, Proposer, StateHandle};
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};
use tracing::Instrument;

use crate::section::{Membership, RaftSection};

/// Proposes through Raft; cheap to clone.
#[derive(Clone)]
pub struct RaftLog {
    raft: KvRaft,
    failures: crate::ProposeFailures,
}

impl std::fmt::Debug for RaftLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLog").finish_non_exhaustive()
    }
}

impl Proposer for RaftLog {
    async fn propose(&self, command: Command) -> Result<u64, ProposeError> {
        let result = self.propose_here(command).await;
        self.failures.count("log", result)
    }
}

impl RaftLog {
    async fn propose_here(&self, command: Command) -> Result<u64, ProposeError> {
        if matches!(command, Command::Ingest(_)) {
            fail::fail_point!(crate::failpoints::INGEST_PROPOSE, |_| Err(
                ProposeError::NotLeader { leader: None }
            ));
        }
        let span = tracing::debug_span!(
            "raft.propose",
            command = command.kind(),
            index = tracing::field::Empty
        );
        let written = self
            .raft
            .client_write(Proposal::now(command))
            .instrument(span.clone())
            .await;
        if let Ok(r) = &written {
            span.record("index", r.log_id.index);
        }
        match written {
            Ok(r) => match r.data.rejected {
                None => Ok(r.log_id.index),
                Some(reason) => Err(ProposeError::Refused {
                    index: r.log_id.index,
                    reason,
                }),
            },
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(ProposeError::NotLeader {
                    leader: f.leader_node.map(|n| n.addr),
                })
            }
            Err(e) => Err(ProposeError::Log(kvplane_state::LogFailure::Local(
                std::sync::Arc::new(e),
            ))),
        }
    }
}

/// Where a Raft node keeps its state snapshots, under its data directory.
pub const STATE_DIR: &str = "raft/state";

/// Where a standalone node kept its snapshots before every node was a Raft member.
const LEGACY_SNAPSHOT_DIR: &str = "snapshots";

/// A started Raft member.
pub struct RaftMember {
    pub raft: KvRaft,
    pub log: RaftLog,
    pub handle: StateHandle,
    pub membership: Membership,
    state: ReplicatedState,
    replica: Replica,
    faults: Option<Faults>,
    pub(crate) contact: LeaderContact,
    /// Failed writes and read barriers through this member, for `/metrics`.
    pub failures: crate::ProposeFailures,
    /// What this member's log writer committed, for `/metrics`.
    pub log_writes: crate::WriterCounts,
    /// Snapshot builds that failed, for `/metrics`.
    pub snapshot_failures: prometheus_client::metrics::counter::Counter,
    /// How it reaches the other members (TLS with its certificate when it has one).
    pub dialer: kvplane_tls::Dialer,
}

impl RaftMember {
    /// Opens the log and state under `data_dir`, starts Raft, and initializes a new cluster when
    /// asked to (or when it is a one-member cluster of its own) and the log is empty. `grpc` is
    /// the address the API listener bound: a member that names no other address is reached there.
    pub async fn start(
        r: &RaftSection,
        data_dir: &Path,
        grpc: std::net::SocketAddr,
        on_applied: OnApplied,
        dialer: kvplane_tls::Dialer,
    ) -> Result<Self, MemberError> {
        let mut membership = r
            .membership(&grpc.to_string())
            .map_err(MemberError::Config)?;
        let dir = data_dir.join("raft");
        std::fs::create_dir_all(&dir)?;
        let had_log = dir.join("log.redb").exists();
        if !had_log && data_dir.join(LEGACY_SNAPSHOT_DIR).is_dir() {
            tracing::warn!(
                dir = %data_dir.join(LEGACY_SNAPSHOT_DIR).display(),
                "this data directory holds snapshots of the earlier standalone layout; they are not \
                 read: the state is rebuilt from the stream, and objects written through \
                 Admin.PutConfig must be written again"
            );
        }
        if let Some(pod) = &membership.pod {
            let id =
                crate::identity::persistent_id(&dir, pod.ordinal, had_log, membership.learner)?;
            membership = membership.with_id(id);
        }
        let log = LogStore::open(&dir.join("log.redb"))?;
        let log_writes = log.counts();
        let state = ReplicatedState::open(&data_dir.join(STATE_DIR))?.observed_by(on_applied);
        let handle = state.handle();
        let config = openraft::Config {
            cluster_name: "kvplane".into(),
            heartbeat_interval: r.heartbeat_ms,
            election_timeout_min: r.election_timeout_min_ms,
            election_timeout_max: r.election_timeout_max_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(r.snapshot_logs),
            max_in_snapshot_log_to_keep: r.keep_logs_after_snapshot,
            // Ingest entries can be large (up to `ingest.max_batch_messages` messages): keep one
            // AppendEntries message well under the gRPC message limit.
            max_payload_entries: 64,
            // A member back from a pause or a partition first asks whether it could win: it
            // does not raise the term and unseat a leader the others still follow.
            enable_pre_vote: Some(true),
            // A leader that restarts comes back a follower, never leading its old term again.
            // It replicates entries from memory before its own disk holds them (the log's
            // writer), so the followers may commit entries a kill -9 then takes from it; leading
            // the same term again, its next entries would take those entries' log ids, which
            // the followers would keep as matching: members would apply different entries at
            // one index (found by the chaos runner, seed 1).
            enable_leader_restore: Some(false),
            ..Default::default()
        }
        .validate()?;
        let faults = Faults::default();
        let network = Network::new(faults.clone(), dialer.clone())
            .with_rpc_timeout_floor(Duration::from_millis(r.rpc_timeout_floor_ms));
        let id = membership.id;
        let raft =
            openraft::Raft::new(id, Arc::new(config), network.clone(), log, state.clone()).await?;
        // A StatefulSet member initializes only after asking the others (see `join`).
        if !membership.initial.is_empty() && membership.pod.is_none() {
            let members: BTreeMap<u64, BasicNode> = membership
                .initial
                .iter()
                .map(|p| (p.id, BasicNode::new(p.addr.clone())))
                .collect();
            match raft.initialize(members).await {
                Ok(()) => tracing::info!(id, "initialized a new raft cluster"),
                Err(e) => {
                    tracing::info!(id, reason = %e, "raft cluster already initialized")
                }
            }
        }
        // The only voter need not wait out an election timeout to lead again after a restart.
        let only_voter = {
            let m = raft.metrics().borrow_watched().clone();
            m.membership_config.membership().voter_ids().eq([id])
        };
        if only_voter && raft.trigger().elect(false).await.is_err() {
            tracing::warn!(id, "could not start an election");
        }
        let failures = crate::ProposeFailures::default();
        Ok(Self {
            log: RaftLog {
                raft: raft.clone(),
                failures: failures.clone(),
            },
            replica: Replica::new(
                raft.clone(),
                network,
                Duration::from_millis(r.forward_timeout_ms),
                failures.clone(),
            )
            .relaying_through(if membership.relay_through_join {
                membership.join.clone()
            } else {
                Vec::new()
            }),
            failures,
            log_writes,
            snapshot_failures: state.snapshot_failures(),
            raft,
            handle,
            membership,
            state,
            faults: r.fault_injection.then_some(faults),
            contact: LeaderContact::default(),
            dialer,
        })
    }

    /// The `kvplane.v1.Raft` service peers call, recording when a leader was last heard from.
    pub fn grpc_service(&self) -> kvplane_proto::v1::raft_server::RaftServer<RaftGrpc> {
        RaftGrpc::new(self.raft.clone(), self.contact.clone())
            .relaying(&self.replica)
            .into_service()
    }

    /// Whether this node belongs to a membership (its own log says so).
    pub(crate) fn is_member(&self) -> bool {
        let m = self.raft.metrics().borrow_watched().clone();
        m.membership_config.membership().get_node(&m.id).is_some()
    }

    /// Whether this node is a voter (its own log says so).
    fn is_voter(&self) -> bool {
        let id = self.raft.metrics().borrow_watched().id;
        self.is_voter_id(id)
    }

    /// Whether member `id` votes.
    pub(crate) fn is_voter_id(&self, id: u64) -> bool {
        let m = self.raft.metrics().borrow_watched().clone();
        m.membership_config
            .membership()
            .voter_ids()
            .any(|v| v == id)
    }

    /// Until this node is a voter (a member, for a learner for good): asks the `join` addresses (following leader hints) to add
    /// it. Returns at once for a node that already is one or has nowhere to ask. A StatefulSet's
    /// ordinal 0 first asks whether a cluster exists, and starts one when none does.
    pub async fn join(&self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let targets = self.membership.join.clone();
        if self.membership.pod.is_some()
            && !self.membership.initial.is_empty()
            && !self.is_member()
            && crate::identity::may_initialize(&self.dialer, &targets, &stop).await
        {
            let members: BTreeMap<u64, BasicNode> = self
                .membership
                .initial
                .iter()
                .map(|p| (p.id, BasicNode::new(p.addr.clone())))
                .collect();
            match self.raft.initialize(members).await {
                Ok(()) => tracing::info!(id = self.membership.id, "initialized a new raft cluster"),
                Err(e) => tracing::info!(reason = %e, "raft cluster already initialized"),
            }
            return;
        }
        if targets.is_empty() {
            return;
        }
        let mut attempt = 0u32;
        // Until a voter, not merely a member: the leader may have added this node as a learner
        // and then failed to promote it (another membership change in flight, or this call
        // timed out), and only another ask promotes it. A learner for good: until a member.
        let learner = self.membership.learner;
        while !(if learner {
            self.is_member()
        } else {
            self.is_voter()
        }) && !*stop.borrow()
        {
            for target in &targets {
                match add_through(
                    &self.dialer,
                    target,
                    (self.membership.id, &self.membership.addr),
                    learner,
                    self.membership.relay_through_join,
                )
                .await
                {
                    Ok(()) => {
                        tracing::info!(id = self.membership.id, via = target, "joined the cluster");
                        return;
                    }
                    Err(e) => {
                        if attempt.is_multiple_of(10) {
                            tracing::info!(via = target, error = %e, "cannot join yet; retrying");
                        }
                    }
                }
            }
            attempt += 1;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// The only voter of its cluster records the address it serves at now (a restart may have
    /// bound another port): members it adds later reach it there. A member of a larger cluster
    /// keeps the address it was added with.
    pub async fn refresh_own_address(&self) {
        let m = self.raft.metrics().borrow_watched().clone();
        let membership = m.membership_config.membership();
        let recorded = membership.get_node(&m.id).map(|n| n.addr.clone());
        if !self.is_leader()
            || !membership.voter_ids().eq([m.id])
            || membership.nodes().count() != 1
            || recorded.as_deref() == Some(self.membership.addr.as_str())
        {
            return;
        }
        let nodes = [(m.id, BasicNode::new(self.membership.addr.clone()))].into();
        match self
            .raft
            .change_membership(openraft::ChangeMembers::SetNodes(nodes), false)
            .await
        {
            Ok(_) => tracing::info!(
                addr = self.membership.addr,
                was = recorded.unwrap_or_default(),
                "recorded this member's new address"
            ),
            Err(e) => tracing::warn!(error = %e, "could not record this member's address"),
        }
    }

    /// Takes a snapshot of everything applied (so a restart replays nothing), waiting at most
    /// `timeout`.
    pub async fn final_snapshot(&self, timeout: Duration) {
        let applied = self.raft.metrics().borrow_watched().last_applied;
        let Some(applied) = applied else { return };
        if self.raft.trigger().snapshot().await.is_err() {
            return;
        }
        let done = self
            .raft
            .wait(Some(timeout))
            .metrics(
                |m| m.snapshot.is_some_and(|s| s.index >= applied.index),
                "final snapshot",
            )
            .await;
        match done {
            Ok(_) => tracing::info!(index = applied.index, "final snapshot taken"),
            Err(e) => tracing::warn!(error = %e, "final snapshot not confirmed"),
        }
    }

    /// Stops this member: a final snapshot (waited for at most `timeout`, so a restart replays
    /// little), then Raft itself.
    pub async fn stop(&self, timeout: Duration) {
        self.final_snapshot(timeout).await;
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft did not shut down cleanly");
        }
    }

    /// Resolves once Raft on this member has stopped without being asked to (a log or
    /// snapshot write failed): the member can do nothing more, and its node should exit so
    /// that it is started again on what its disk holds.
    pub async fn stopped(&self) {
        let mut metrics = self.raft.metrics();
        loop {
            let m = metrics.borrow_watched().clone();
            if m.state == ServerState::Shutdown || m.running_state.is_err() {
                if let Err(e) = &m.running_state {
                    tracing::error!(error = %e, "raft stopped");
                }
                return;
            }
            if metrics.changed().await.is_err() {
                return;
            }
        }
    }

    /// This node's role, as Status reports it.
    pub fn role(&self) -> String {
        role_name(self.raft.metrics().borrow_watched().state).to_owned()
    }

    /// Removes member `id`, voter or learner, from the membership (on the leader).
    pub async fn remove_member(&self, id: u64) -> Result<(), crate::ClusterError> {
        let voter = {
            let m = self.raft.metrics().borrow_watched().clone();
            m.membership_config
                .membership()
                .voter_ids()
                .any(|v| v == id)
        };
        let ids: std::collections::BTreeSet<u64> = [id].into();
        let change = if voter {
            openraft::ChangeMembers::RemoveVoters(ids)
        } else {
            openraft::ChangeMembers::RemoveNodes(ids)
        };
        self.raft
            .change_membership(change, false)
            .await
            .map_err(membership_error)?;
        Ok(())
    }

    /// The members as (id, address).
    pub fn members(&self) -> Vec<(u64, String)> {
        let m = self.raft.metrics().borrow_watched().clone();
        m.membership_config
            .membership()
            .nodes()
            .map(|(i, n)| (*i, n.addr.clone()))
            .collect()
    }

    pub fn is_leader(&self) -> bool {
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

impl crate::ClusterControl for RaftMember {
    fn dialer(&self) -> kvplane_tls::Dialer {
        self.dialer.clone()
    }

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
            snapshot_index: m.snapshot.map_or(0, |l| l.index),
            purged_index: m.purged.map_or(0, |l| l.index),
        }
    }

    fn add(
        &self,
        id: u64,
        addr: String,
        learner: bool,
        relay: bool,
    ) -> futures::future::BoxFuture<'_, Result<(), crate::ClusterError>> {
        Box::pin(async move {
            match self.leader_only() {
                Ok(()) => {}
                Err(crate::ClusterError::NotLeader {
                    leader: Some(leader),
                }) if relay => {
                    return add_through(&self.dialer, &leader, (id, &addr), learner, false)
                        .await
                        .map_err(|s| crate::ClusterError::Relay {
                            leader,
                            what: "add the member",
                            code: s.code(),
                            message: s.message().to_owned(),
                        });
                }
                Err(e) => return Err(e),
            }
            // Members reach each other at the addresses the membership records: a wildcard
            // one (a node that listens on 0.0.0.0 and advertises nothing) reaches no one.
            let wildcard = |a: &str| {
                a.parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_unspecified())
            };
            if wildcard(&self.membership.addr) {
                return Err(crate::ClusterError::UnreachableSelf(
                    self.membership.addr.clone(),
                ));
            }
            if wildcard(&addr) {
                return Err(crate::ClusterError::UnreachableTarget(addr));
            }
            self.refuse_another_cluster(&addr).await?;
            if learner && self.is_voter_id(id) {
                return Err(crate::ClusterError::AlreadyVoter(id));
            }
            self.raft
                .add_learner(id, BasicNode::new(addr.clone()), true)
                .await
                .map_err(membership_error)?;
            if learner {
                tracing::info!(id, addr, "learner added");
            } else {
                let ids: std::collections::BTreeSet<u64> = [id].into();
                self.raft
                    .change_membership(openraft::ChangeMembers::AddVoterIds(ids), false)
                    .await
                    .map_err(membership_error)?;
                tracing::info!(id, addr, "member added");
            }
            // An earlier incarnation at the same address (a pod back with a new volume) is gone
            // for good: it leaves the membership, so it never counts toward a quorum again.
            let stale = {
                let m = self.raft.metrics().borrow_watched().clone();
                let membership = m.membership_config.membership();
                crate::identity::stale_members(
                    membership.nodes().map(|(i, n)| (*i, n.addr.as_str())),
                    id,
                    &addr,
                )
            };
            for old in stale {
                self.remove_member(old).await?;
                tracing::info!(old, id, "earlier incarnation at the same address removed");
            }
            Ok(())
        })
    }

    fn remove(
        &self,
        id: u64,
        relay: bool,
        learner_only: bool,
    ) -> futures::future::BoxFuture<'_, Result<(), crate::ClusterError>> {
        Box::pin(async move {
            match self.leader_only() {
                Ok(()) => {}
                Err(crate::ClusterError::NotLeader {
                    leader: Some(leader),
                }) if relay => {
                    return remove_through(&self.dialer, &leader, id, false, learner_only)
                        .await
                        .map_err(|s| crate::ClusterError::Relay {
                            leader,
                            what: "remove the member",
                            code: s.code(),
                            message: s.message().to_owned(),
                        });
                }
                Err(e) => return Err(e),
            }
            if learner_only {
                if !self.members().iter().any(|(m, _)| *m == id) {
                    // Gone already (an ask repeated from a stale view): nothing to change.
                    return Ok(());
                }
                // A voter is kept whatever else is under way (openraft would say a change is
                // in progress before it says the node is no learner).
                if self.is_voter_id(id) {
                    return Err(crate::ClusterError::VoterKept(id));
                }
                // One membership change that removes a learner only: openraft refuses it for a
                // voter, so a learner promoted meanwhile is kept too.
                let ids: std::collections::BTreeSet<u64> = [id].into();
                match self
                    .raft
                    .change_membership(openraft::ChangeMembers::RemoveNodes(ids), false)
                    .await
                {
                    Ok(_) => {}
                    Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
                        openraft::error::ChangeMembershipError::LearnerNotFound(_),
                    ))) => return Err(crate::ClusterError::VoterKept(id)),
                    Err(e) => return Err(membership_error(e)),
                }
            } else {
                self.remove_member(id).await?;
            }
            tracing::info!(id, "member removed");
            Ok(())
        })
    }

    fn set_faults(&self, blocked: Vec<u64>) -> Result<Vec<u64>, crate::ClusterError> {
        let f = self
            .faults
            .as_ref()
            .ok_or(crate::ClusterError::FaultsDisabled)?;
        f.set_blocked(blocked);
        Ok(f.blocked())
    }

    fn set_failpoints(&self, spec: &str) -> Result<Vec<String>, crate::ClusterError> {
        self.faults
            .as_ref()
            .ok_or(crate::ClusterError::FaultsDisabled)?;
        Ok(crate::failpoints::configure(spec)?)
    }

    fn relay_via(&self) -> Vec<String> {
        if self.membership.relay_through_join {
            self.membership.join.clone()
        } else {
            Vec::new()
        }
    }

    fn cut_off(&self, id: u64) -> bool {
        self.faults.as_ref().is_some_and(|f| f.is_blocked(id))
    }
}

impl crate::Consistency for RaftMember {
    fn write(&self, command: Command) -> BoxFuture<'_, Result<u64, ProposeError>> {
        Box::pin(self.replica.write(command))
    }

    fn read_barrier(&self) -> BoxFuture<'_, Result<u64, ProposeError>> {
        Box::pin(self.replica.read_barrier())
    }

    fn export_state(&self) -> BoxFuture<'_, Result<(u64, Vec<u8>), ProposeError>> {
        Box::pin(async {
            self.state.export().await.map_err(|e| {
                ProposeError::Log(kvplane_state::LogFailure::Export(std::sync::Arc::new(e)))
            })
        })
    }
}

impl RaftMember {
    fn leader_only(&self) -> Result<(), crate::ClusterError> {
        if self.is_leader() {
            return Ok(());
        }
        let s = crate::ClusterControl::status(self);
        Err(crate::ClusterError::NotLeader {
            leader: (!s.leader_addr.is_empty()).then_some(s.leader_addr),
        })
    }
}

impl RaftMember {
    /// Refuses a target that already is a cluster other than this one (a standalone node
    /// with its own data, say): Raft would replace its log with this cluster's, and what it
    /// held would be lost without a word. Let through: a target that answers nothing within
    /// 2 s, one that holds no membership yet (a new member waiting to be added), and one whose
    /// membership shares a member (same id at the same address) with this cluster's (a member
    /// added again, a learner being promoted, a member back from a scale-down).
    async fn refuse_another_cluster(&self, addr: &str) -> Result<(), crate::ClusterError> {
        use kvplane_proto::v1::{StatusRequest, admin_client::AdminClient};
        let ask = async {
            let mut c = AdminClient::new(self.dialer.connect(addr).await.ok()?);
            c.cluster_status(StatusRequest::default())
                .await
                .ok()
                .map(tonic::Response::into_inner)
        };
        let Ok(Some(theirs)) = tokio::time::timeout(Duration::from_secs(2), ask).await else {
            return Ok(());
        };
        let ours: std::collections::BTreeSet<(u64, String)> = {
            let m = self.raft.metrics().borrow_watched().clone();
            m.membership_config
                .membership()
                .nodes()
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect()
        };
        let shared = theirs
            .members
            .iter()
            .any(|m| ours.contains(&(m.id, m.addr.clone())));
        if theirs.members.is_empty() || shared {
            return Ok(());
        }
        Err(crate::ClusterError::AnotherCluster {
            addr: addr.to_owned(),
            members: theirs.members.len(),
            applied_index: theirs.applied_index,
        })
    }
}

fn membership_error(
    e: RaftError<crate::TypeConfig, ClientWriteError<crate::TypeConfig>>,
) -> crate::ClusterError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            crate::ClusterError::NotLeader {
                leader: f.leader_node.map(|n| n.addr),
            }
        }
        other => crate::ClusterError::Raft(Box::new(other)),
    }
}

/// A Raft role's name, as Status and `kvplane_raft_role` say it.
pub fn role_name(state: ServerState) -> &'static str {
    match state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

/// Why a member could not start.
#[derive(Debug, thiserror::Error)]
pub enum MemberError {
    #[error("raft: {0}")]
    Config(#[from] crate::section::SectionError),
    #[error("raft data: {0}")]
    Io(#[from] std::io::Error),
    #[error("raft log: {0}")]
    Log(#[from] LogStoreError),
    #[error("raft settings: {0}")]
    Settings(#[from] openraft::ConfigError),
    #[error("raft did not start: {0}")]
    Start(#[from] openraft::errors::Fatal<crate::TypeConfig>),
}

/// How long an ask to remove a member may take (a leader without a quorum never commits it).
const REMOVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the node at `via` to remove member `id` (`relay`: its leader, if it does not lead),
/// giving up after [`REMOVE_TIMEOUT`].
pub(crate) async fn remove_through(
    dialer: &kvplane_tls::Dialer,
    via: &str,
    id: u64,
    relay: bool,
    learner_only: bool,
) -> Result<(), tonic::Status> {
    use kvplane_proto::v1::admin_client::AdminClient;
    let ask = async {
        let channel = dialer
            .connect(via)
            .await
            .map_err(|e| tonic::Status::unavailable(format!("cannot connect: {e}")))?;
        AdminClient::new(channel)
            .remove_member(kvplane_proto::v1::RemoveMemberRequest {
                id,
                relay,
                learner_only,
            })
            .await?;
        Ok(())
    };
    tokio::time::timeout(REMOVE_TIMEOUT, ask)
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} s",
                REMOVE_TIMEOUT.as_secs()
            )))
        })
}

/// Asks the cluster reachable at `via` to add node `id` at `addr`: learner, then voter (or a
/// learner for good). It follows `via`'s leader hint, or with `relay` has `via` pass the ask on
/// to its leader.
async fn add_through(
    dialer: &kvplane_tls::Dialer,
    via: &str,
    (id, addr): (u64, &str),
    learner: bool,
    relay: bool,
) -> Result<(), tonic::Status> {
    use kvplane_proto::v1::admin_client::AdminClient;
    let connect = |a: String| async move {
        dialer
            .connect(&a)
            .await
            .map(AdminClient::new)
            .map_err(|e| tonic::Status::unavailable(format!("cannot connect: {e}")))
    };
    let mut c = connect(via.to_owned()).await?;
    if !relay {
        let s = c
            .cluster_status(kvplane_proto::v1::StatusRequest::default())
            .await?
            .into_inner();
        if s.leader != s.node && !s.leader_addr.is_empty() {
            c = connect(s.leader_addr.clone()).await?;
        }
    }
    c.add_member(kvplane_proto::v1::AddMemberRequest {
        id,
        addr: addr.to_owned(),
        learner,
        relay,
    })
    .await?;
    Ok(())
}
