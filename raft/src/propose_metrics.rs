//! Failed writes and read barriers, by path and by reason ([`ProposeError::as_str`]): the
//! leader's own log (ingest, config sources), a replica's writes through the leader (Admin,
//! quota grants) and linearizable reads.

use std::sync::Arc;

use kvplane_state::ProposeError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabel {
    path: &'static str,
    reason: &'static str,
}

/// Shared by a member's log and replica (clones count into the same family).
#[derive(Debug, Clone, Default)]
pub struct ProposeFailures(Arc<Family<FailureLabel, Counter>>);

impl ProposeFailures {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_raft_propose_failures",
            "Writes and read barriers that failed, by path (log, replica_write, read_barrier, relay_write, relay_read_barrier) and reason",
            (*self.0).clone(),
        );
    }

    /// Counts `result` when it failed, and passes it on.
    pub(crate) fn count<T>(
        &self,
        path: &'static str,
        result: Result<T, ProposeError>,
    ) -> Result<T, ProposeError> {
        if let Err(e) = &result {
            self.0
                .get_or_create(&FailureLabel {
                    path,
                    reason: e.as_str(),
                })
                .inc();
        }
        result
    }

    /// The count of `path` and `reason` so far.
    pub fn get(&self, path: &'static str, reason: &'static str) -> u64 {
        self.0.get_or_create(&FailureLabel { path, reason }).get()
    }
}
