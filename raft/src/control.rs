//! What the rest of kvplane uses of a member: writes and read barriers ([`Consistency`]) and
//! membership control ([`ClusterControl`]). [`crate::RaftMember`] implements both; the API
//! crate's services take them as trait objects, so routing semantics test without a member.

use futures::future::BoxFuture;
use kvplane_proto::v1::ClusterStatusResponse;
use kvplane_state::{Command, ProposeError};

/// Writes and read barriers of this node's Raft log (a follower forwards to the leader).
pub trait Consistency: Send + Sync {
    /// Commits `command`; resolves once this node has applied it, with its index.
    fn write(&self, command: Command) -> BoxFuture<'_, Result<u64, ProposeError>>;
    /// Resolves once this node has applied every entry committed before the call.
    fn read_barrier(&self) -> BoxFuture<'_, Result<u64, ProposeError>>;
    /// This node's whole state as snapshot bytes, with the index it was taken at.
    fn export_state(&self) -> BoxFuture<'_, Result<(u64, Vec<u8>), ProposeError>>;
}

impl std::fmt::Debug for dyn Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Consistency")
    }
}

/// Why a membership change was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClusterError {
    #[error("this node is not the leader{}", .leader.as_ref().map(|l| format!("; the leader is at {l}")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    #[error(
        "this member is recorded at {0}, which other members cannot reach: set raft.advertise_addr first"
    )]
    UnreachableSelf(String),
    #[error("member {0} is a voter: remove it before adding it again as a learner")]
    AlreadyVoter(u64),
    #[error("{0} is not an address other members can reach")]
    UnreachableTarget(String),
    #[error(
        "{addr} already is a cluster of its own ({members} members, applied index {applied_index}): adding it would replace its log and lose its state; start it with an empty data directory to add it"
    )]
    AnotherCluster {
        addr: String,
        members: usize,
        applied_index: u64,
    },
    #[error("membership change failed: {0}")]
    Raft(
        Box<
            openraft::error::RaftError<
                crate::TypeConfig,
                openraft::error::ClientWriteError<crate::TypeConfig>,
            >,
        >,
    ),
    #[error("member {0} is a voter: only a learner may be removed this way")]
    VoterKept(u64),
    /// A relayed ask the leader refused, or that did not reach it (its status).
    #[error("asking the leader at {leader} to {what} failed: {message}")]
    Relay {
        leader: String,
        /// `add the member` or `remove the member`.
        what: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("fault injection is disabled on this node (set raft.fault_injection, tests only)")]
    FaultsDisabled,
    #[error(transparent)]
    Failpoint(#[from] crate::failpoints::FailpointError),
}

/// Raft membership, as the Admin service drives it.
pub trait ClusterControl: Send + Sync {
    fn status(&self) -> ClusterStatusResponse;
    /// Adds member `id` at `addr`: a voter once it caught up, or a learner for good. With
    /// `relay`, a member that does not lead asks its leader (once) instead of refusing.
    fn add(
        &self,
        id: u64,
        addr: String,
        learner: bool,
        relay: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>>;
    /// Removes member `id`; when this node does not lead and `relay`, asks its leader to (see
    /// `RemoveMemberRequest`); `learner_only`: refuses a voter.
    fn remove(
        &self,
        id: u64,
        relay: bool,
        learner_only: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>>;
    /// Test-only fault layer: the peers this node stops sending Raft traffic to.
    fn set_faults(&self, blocked: Vec<u64>) -> Result<Vec<u64>, ClusterError>;
    /// Test-only disk faults: the failpoints set (`name=actions;...`, empty clears them);
    /// returns those now set.
    fn set_failpoints(&self, spec: &str) -> Result<Vec<String>, ClusterError>;
    /// How this node reaches the other members' gRPC ports.
    fn dialer(&self) -> kvplane_tls::Dialer;
    /// Where this node's calls to other members go instead of their recorded addresses
    /// (`relay_through_join`: a learner in another cluster); empty: to the members directly.
    fn relay_via(&self) -> Vec<String> {
        Vec::new()
    }
    /// Test-only fault layer: whether calls to member `id` are cut.
    fn cut_off(&self, _id: u64) -> bool {
        false
    }
}
