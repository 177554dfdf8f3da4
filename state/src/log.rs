//! The one path by which anything changes the state: a proposer appends a command to the log,
//! and the state machine applies it once it is committed. The Raft log implements the trait;
//! nothing that proposes depends on more.

use std::future::Future;

use crate::Command;

/// Why a command did not make it into the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("this node is not the leader{}", leader.as_ref().map(|l| format!(" (leader: {l})")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    #[error("the log is shut down")]
    Closed,
    /// No leader could be reached in time: this replica may be cut off from a quorum.
    #[error("no quorum reachable: {0}")]
    Unavailable(String),
    /// The entry was committed at `index`, but the state machine refused the command (every
    /// replica refuses it identically).
    #[error("refused at index {index}: {reason}")]
    Refused {
        index: u64,
        reason: crate::ApplyError,
    },
    #[error("log failure: {0}")]
    Log(String),
}

impl ProposeError {
    /// Its metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotLeader { .. } => "not_leader",
            Self::Closed => "closed",
            Self::Unavailable(_) => "unavailable",
            Self::Refused { .. } => "refused",
            Self::Log(_) => "log",
        }
    }
}

/// Appends commands to the replicated log.
pub trait Proposer: Send + Sync + 'static {
    /// Resolves with the entry's index once it is committed and applied locally.
    fn propose(&self, command: Command) -> impl Future<Output = Result<u64, ProposeError>> + Send;
}
