//! A switchable network fault layer for tests: the set of peers this node's Raft traffic (and
//! forwarded writes and reads) may not reach. Cutting both directions between two nodes makes a
//! partition; an empty set heals it. Nodes enable it only with `raft.fault_injection`.

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};

/// Peers this node cannot send to; cheap to clone, shared with the network.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    blocked: Arc<RwLock<BTreeSet<u64>>>,
}

impl Faults {
    /// Replaces the blocked set.
    pub fn set_blocked(&self, peers: impl IntoIterator<Item = u64>) {
        *self.blocked.write().unwrap_or_else(|p| p.into_inner()) = peers.into_iter().collect();
    }

    pub fn blocked(&self) -> Vec<u64> {
        self.blocked
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect()
    }

    pub fn is_blocked(&self, peer: u64) -> bool {
        self.blocked
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&peer)
    }
}
