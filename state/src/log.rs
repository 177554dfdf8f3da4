//! The one path by which anything changes the state: a proposer appends a command to the log,
//! and the state machine applies it once it is committed. The Raft log implements the trait;
//! nothing that proposes depends on more.

use std::future::Future;

use crate::Command;

/// An error from a layer this crate does not know (the Raft library, the network), kept with
/// its own type for its source chain.
pub type Cause = std::sync::Arc<dyn std::error::Error + Send + Sync>;

/// Why a command did not make it into the log.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProposeError {
    #[error("this node is not the leader{}", leader.as_ref().map(|l| format!(" (leader: {l})")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    #[error("the log is shut down")]
    Closed,
    /// No leader could be reached in time: this replica may be cut off from a quorum.
    #[error("no quorum reachable: {0}")]
    Unavailable(#[source] Unavailable),
    /// The entry was committed at `index`, but the state machine refused the command (every
    /// replica refuses it identically).
    #[error("refused at index {index}: {reason}")]
    Refused {
        index: u64,
        reason: crate::ApplyError,
    },
    #[error("log failure: {0}")]
    Log(#[source] LogFailure),
}

/// Why no leader answered in time.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unavailable {
    /// No attempt reached a leader before the deadline; `why` is the last attempt's reason.
    #[error("{what} found no reachable leader within {timeout:?}: {why}")]
    NoLeader {
        what: &'static str,
        timeout: std::time::Duration,
        why: String,
    },
    /// An attempt was under way at the deadline: it may or may not have taken effect.
    #[error("{what} did not complete within {timeout:?} ({why}); its outcome is unknown")]
    OutcomeUnknown {
        what: &'static str,
        timeout: std::time::Duration,
        why: String,
    },
    #[error("{what} committed at index {index} but this replica did not apply it in time: {cause}")]
    NotApplied {
        what: &'static str,
        index: u64,
        #[source]
        cause: Cause,
    },
    /// This member leads but could not confirm it with a quorum.
    #[error("leadership not confirmed: {0}")]
    NotConfirmed(#[source] Cause),
    /// The leader a read was forwarded to could not confirm its leadership.
    #[error("leader {leader} could not confirm its leadership: {message}")]
    LeaderNotConfirmed { leader: u64, message: String },
    /// A write relayed through `via` got no answer (the connection ended after it was sent):
    /// it may or may not have taken effect.
    #[error("the write relayed through {via} got no answer ({why}); its outcome is unknown")]
    RelayLost { via: String, why: String },
    /// The member a read was relayed through could not get it confirmed by its leader.
    #[error("the read relayed through {via} was not confirmed: {message}")]
    RelayNotConfirmed { via: String, message: String },
}

/// The log itself failed a write or an export.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LogFailure {
    #[error("{0}")]
    Local(#[source] Cause),
    /// The leader a write was forwarded to failed it (its message, as it sent it).
    #[error("leader {leader} failed the write: {message}")]
    Leader { leader: u64, message: String },
    /// The member a write was relayed through failed it, or lost track of it (its message).
    #[error("the write relayed through {via} failed: {message}")]
    Relay { via: String, message: String },
    #[error("the state could not be exported: {0}")]
    Export(#[source] Cause),
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
