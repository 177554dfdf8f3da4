//! Reports for requests another replica routed: a gateway that failed over between Route and
//! ReportUsage reports to a replica that never saw the request. The report names the replica
//! that did (`UsageReport.routed_by`), which holds the request's reservation and queue entry;
//! this one forwards it there, once (a forwarded report is never forwarded again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{UsageAck, UsageReport};
use kvplane_raft::ClusterControl;
use tonic::transport::{Channel, Endpoint};

/// Why a report could not be forwarded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    #[error("replica {0} is not a member of the cluster")]
    NotAMember(u64),
    #[error("replica {id}'s address {addr:?} is not a url: {source}")]
    Address {
        id: u64,
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("replica {id} did not take the report: {status}")]
    Call { id: u64, status: tonic::Status },
}

/// This replica's id and the cluster's members, to forward reports to the replica that
/// routed them.
pub(crate) struct Forwarder {
    pub(crate) self_id: u64,
    cluster: Arc<dyn ClusterControl>,
    clients: Mutex<HashMap<u64, RouterClient<Channel>>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("self_id", &self.self_id)
            .finish_non_exhaustive()
    }
}

impl Forwarder {
    pub(crate) fn new(cluster: Arc<dyn ClusterControl>) -> Self {
        Self {
            self_id: cluster.status().node,
            cluster,
            clients: Mutex::default(),
        }
    }

    /// Whether `report` is another replica's to settle.
    pub(crate) fn elsewhere(&self, report: &UsageReport) -> bool {
        !report.forwarded && report.routed_by != 0 && report.routed_by != self.self_id
    }

    /// Forwards `report` to the replica that routed it; its answer.
    pub(crate) async fn forward(&self, mut report: UsageReport) -> Result<UsageAck, ForwardError> {
        let id = report.routed_by;
        let mut client = self.client(id)?;
        report.forwarded = true;
        client
            .report_usage(report)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ForwardError::Call { id, status })
    }

    fn client(&self, id: u64) -> Result<RouterClient<Channel>, ForwardError> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(&id) {
            return Ok(c.clone());
        }
        let addr = self
            .cluster
            .status()
            .members
            .into_iter()
            .find(|m| m.id == id)
            .map(|m| m.addr)
            .ok_or(ForwardError::NotAMember(id))?;
        let url = if addr.contains("://") {
            addr.clone()
        } else {
            format!("http://{addr}")
        };
        let channel = Endpoint::from_shared(url)
            .map_err(|source| ForwardError::Address {
                id,
                addr: addr.clone(),
                source,
            })?
            .connect_timeout(Duration::from_millis(500))
            .timeout(Duration::from_secs(2))
            .connect_lazy();
        let c = RouterClient::new(channel);
        clients.insert(id, c.clone());
        Ok(c)
    }
}
