//! kvplane's Raft log on openraft (pinned `=0.10.0-alpha.37`: async log appends that share one
//! fsync, lease reads, and the gRPC example the network follows).
//!
//! - [`TypeConfig`]: node ids are `u64` and never reused; a log payload is a [`Proposal`]: the
//!   leader's clock and one state command.
//! - [`LogStore`]: the log and the vote in one redb file, written by its own thread
//!   (`log_writer`): an append returns once readable and is acknowledged only after the write
//!   transaction holding it committed with `Durability::Immediate` (fsync); appends queued
//!   meanwhile share the next fsync. The vote, purge and truncate are durable before they
//!   return.
//! - [`ReplicatedState`]: the `state/` machine behind openraft's `RaftStateMachine`; snapshots
//!   are `StateMachine::snapshot` bytes.
//!
//! - [`Network`] / [`RaftGrpc`]: Raft RPCs over tonic (`kvplane.v1.Raft`), one long-lived lazily
//!   connecting channel per peer, a timeout on every call, snapshots streamed in chunks.
//!
//! - [`Replica`]: writes and linearizable reads from any member (a follower forwards to the
//!   leader, then waits until it applied the result).
//! - [`Faults`]: a switchable fault layer in the transport, for partition tests.
//! - [`failpoints`]: failing or slow log and snapshot writes (the `fail` crate), for disk faults.
//!
//! - [`RaftMember`]: one member assembled (log, state, network, bootstrap, join, the id kept on
//!   a StatefulSet volume, readiness and gauges, following a StatefulSet's scale-downs), seen by
//!   the rest through [`Consistency`], [`ClusterControl`] and `kvplane_state::Proposer`.

mod control;
pub mod durable;
pub mod failpoints;
mod faults;
mod forward;
mod health;
mod identity;
mod log_store;
mod log_writer;
mod member;
mod network;
mod proposal;
mod propose_metrics;
mod section;
mod state_machine;
mod statefulset;

pub use control::{ClusterControl, ClusterError, Consistency};
pub use faults::Faults;
pub use forward::{ForwardError, Replica};
pub use health::{NotReady, RaftGauges};
pub use log_store::{LogStore, LogStoreError};
pub use log_writer::WriterCounts;
pub use member::{MemberError, RaftLog, RaftMember, STATE_DIR, role_name};
pub use network::{LeaderContact, Network, RaftGrpc};
pub use proposal::{ApplyResult, Proposal};
pub use propose_metrics::ProposeFailures;
pub use section::{KubernetesSection, Membership, PeerSection, Pod, RaftSection, SectionError};
pub use state_machine::{OnApplied, ReplicatedState, SNAPSHOT_FILE, read_snapshot_file};
pub use statefulset::{run as follow_statefulset, run_learner_set as follow_learner_set};

openraft::declare_raft_types!(
    /// kvplane's Raft types.
    pub TypeConfig:
        D = Proposal,
        R = ApplyResult,
        NodeId = u64,
        Node = openraft::BasicNode,
);

/// The Raft instance type of a kvplane node.
pub type KvRaft = openraft::Raft<TypeConfig, ReplicatedState>;
