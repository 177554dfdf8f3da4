//! What a Raft entry carries for kvplane.

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvplane_state::Command;
use serde::{Deserialize, Serialize};

/// One state command, stamped with the proposing leader's clock (the only time the state
/// machine ever sees). The command is shared: the log's tail, apply and replication each take
/// the entry, and a copy of an ingest entry would copy every message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    pub timestamp_ms: u64,
    pub command: Arc<Command>,
}

impl Proposal {
    /// A proposal stamped with this node's clock (only a leader proposes).
    pub fn now(command: Command) -> Self {
        let timestamp_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self {
            timestamp_ms,
            command: Arc::new(command),
        }
    }
}

impl fmt::Display for Proposal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &*self.command {
            Command::Noop => "noop".to_owned(),
            Command::Ingest(b) => format!(
                "ingest seq {}..={} ({} items)",
                b.first_seq,
                b.last_seq,
                b.items.len()
            ),
            Command::ConfigPut { kind, name, .. } => format!("config put {kind}/{name}"),
            Command::ConfigDelete { kind, name, .. } => format!("config delete {kind}/{name}"),
            Command::ConfigApply { puts, deletes, .. } => {
                format!(
                    "config apply ({} puts, {} deletes)",
                    puts.len(),
                    deletes.len()
                )
            }
            Command::Quota(b) => format!(
                "quota from replica {} ({} asks, {} releases)",
                b.replica,
                b.asks.len(),
                b.releases.len()
            ),
            Command::ExpireLeases { lease_ms } => format!("expire leases older than {lease_ms} ms"),
            Command::Endpoints(u) => format!(
                "endpoints of {} ({} from kubernetes)",
                u.pool,
                u.endpoints.len()
            ),
            Command::EndpointHealth(u) => format!(
                "health of {} ({} of {} static endpoints answer)",
                u.pool,
                u.endpoints.iter().filter(|e| e.ready).count(),
                u.endpoints.len()
            ),
            Command::QuotaClose {
                replica,
                incarnation,
            } => format!("quota closed by replica {replica} (process {incarnation})"),
            Command::QuotaRetire { replica } => {
                format!("quota of replica {replica} retired (no longer a member)")
            }
        };
        write!(f, "{kind} at {} ms", self.timestamp_ms)
    }
}

/// What applying one entry did, returned to the proposer.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ApplyResult {
    /// The log index the entry was applied at.
    pub index: u64,
    /// A refused configuration command, with the reason.
    pub rejected: Option<kvplane_state::ApplyError>,
}
