//! How a node writes to the replicated state and serves reads that must be fresh.

use std::sync::Arc;

use kvplane_proto::v1::ReadConsistency;
use kvplane_state::{ApplyError, ProposeError, StateHandle};
use tonic::Status;

pub use kvplane_raft::Consistency;

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
