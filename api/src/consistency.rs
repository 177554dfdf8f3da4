//! How a node writes to the replicated state and serves reads that must be fresh.

use std::sync::Arc;

use futures::future::BoxFuture;
use kvplane_proto::v1::ReadConsistency;
use kvplane_state::{ApplyError, Command, ProposeError, StateHandle};
use tonic::Status;

/// Writes and read barriers of this node's Raft log (a follower forwards to the leader).
pub trait Consistency: Send + Sync {
    /// Commits `command`; resolves once this node has applied it, with its index.
    fn write(&self, command: Command) -> BoxFuture<'_, Result<u64, ProposeError>>;
    /// Resolves once this node has applied every entry committed before the call.
    fn read_barrier(&self) -> BoxFuture<'_, Result<u64, ProposeError>>;
    /// This node's whole state as snapshot bytes, with the index it was taken at.
    fn export_state(&self) -> BoxFuture<'_, Result<(u64, Vec<u8>), ProposeError>>;
}

/// The gRPC status for a write or barrier that failed.
pub fn propose_status(e: &ProposeError) -> Status {
    match e {
        ProposeError::Refused {
            reason: ApplyError::Owned { .. },
            ..
        } => Status::failed_precondition(e.to_string()),
        ProposeError::Refused { .. } => Status::invalid_argument(e.to_string()),
        ProposeError::NotLeader { .. } | ProposeError::Unavailable(_) | ProposeError::Closed => {
            Status::unavailable(e.to_string())
        }
        ProposeError::Log(_) => Status::internal(e.to_string()),
    }
}

/// Applies a request's consistency demands before it reads `state`.
pub(crate) async fn ensure(
    consistency: Option<&Arc<dyn Consistency>>,
    state: &StateHandle,
    want: &ReadConsistency,
) -> Result<(), Status> {
    if want.linearizable
        && let Some(c) = consistency
    {
        c.read_barrier().await.map_err(|e| propose_status(&e))?;
    }
    let applied = state.load().applied_index;
    if applied < want.min_applied_index {
        return Err(Status::failed_precondition(format!(
            "state is at index {applied}, request needs at least {}",
            want.min_applied_index
        )));
    }
    Ok(())
}
