//! `/readyz`: ready while the member is (a leader known and heard from, this replica keeping
//! up), NATS is reachable (the leader's ingest and the replicas' decision gossip ride it: a
//! node cut off from it routes on a state that no longer follows the engines) and, on the
//! leader, its consumer is not far behind the stream.

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use kvplane_ingest::IngestMetrics;
use kvplane_raft::RaftMember;

/// Why this node is not ready to serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum NotReady {
    #[error("{0}")]
    Raft(kvplane_raft::NotReady),
    #[error("nats at {url} is unreachable ({state})")]
    Nats { url: String, state: &'static str },
    #[error("ingest is {lag} messages behind the stream (at most {max} for ready)")]
    IngestBehind { lag: u64, max: u64 },
}

/// Why this node is not ready, if it is not.
pub(super) type Ready = Arc<dyn Fn() -> Result<(), NotReady> + Send + Sync>;

/// The node's readiness: the member's (`max_lag` entries behind at most, a leader heard from
/// within `lease`), NATS's, then the consumer's (`max_pending` messages behind at most).
pub(super) fn readiness(
    member: Arc<RaftMember>,
    (max_lag, lease): (u64, Duration),
    nats: async_nats::Client,
    url: String,
    (ingest, max_pending): (Arc<IngestMetrics>, u64),
) -> Ready {
    Arc::new(move || {
        member.readiness(max_lag, lease).map_err(NotReady::Raft)?;
        match nats.connection_state() {
            State::Connected => {}
            State::Pending => {
                return Err(NotReady::Nats {
                    url: url.clone(),
                    state: "connecting",
                });
            }
            State::Disconnected => {
                return Err(NotReady::Nats {
                    url: url.clone(),
                    state: "disconnected",
                });
            }
        }
        // Measured by the leader every second from its term's start (followers: 0).
        if let Some(lag) = ingest.lag()
            && max_pending > 0
            && lag > max_pending
        {
            return Err(NotReady::IngestBehind {
                lag,
                max: max_pending,
            });
        }
        Ok(())
    })
}
