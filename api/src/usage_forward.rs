//! Reports for requests another replica routed: a gateway that failed over between Route and
//! ReportUsage reports to a replica that never saw the request. The report names the replica
//! that did (its ticket, or `UsageReport.routed_by`), which holds the request's reservation and
//! queue entry; this one forwards it there, once (a forwarded report is never forwarded again).
//! When that replica's process is gone - it cannot be reached, or it restarted and forgot the
//! request - what the ticket says was reserved and the report says was not used goes back
//! through the quota ledger instead ([`ledger_settles`]). A replica that reaches the members
//! only through a relay (`relay_through_join`: a learner in another cluster, where the members'
//! recorded names do not resolve) hands the report to the relay as a fresh one, which forwards
//! it on (or settles it, when it routed the request).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvplane_policy::LimitKey;
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{Ticket, UsageAck, UsageReport};
use kvplane_raft::ClusterControl;
use kvplane_state::QuotaSettle;
use tonic::transport::Channel;

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
    #[error("the relay at {addr} did not take the report for replica {id}: {status}")]
    Relay {
        id: u64,
        addr: String,
        status: tonic::Status,
    },
}

impl ForwardError {
    /// Whether the report surely did not reach the routing replica: no such member, or its
    /// port refused the connection (its process is not running). Only then may the report's
    /// ticket settle through the ledger; after a timeout or a reset the routing process may
    /// have settled it itself, and a second settle would give the same tokens back twice.
    pub(crate) fn not_delivered(&self) -> bool {
        match self {
            Self::NotAMember(_) | Self::Address { .. } => true,
            Self::Call { status, .. } => kvplane_tls::connection_refused(status),
            // The relay may have passed it on before its answer was lost.
            Self::Relay { .. } => false,
        }
    }
}

/// This replica's id and the cluster's members, to forward reports to the replica that
/// routed them.
pub(crate) struct Forwarder {
    pub(crate) self_id: u64,
    cluster: Arc<dyn ClusterControl>,
    clients: Mutex<HashMap<u64, RouterClient<Channel>>>,
    /// Clients of the relay addresses, by address.
    relays: Mutex<HashMap<String, RouterClient<Channel>>>,
    /// The relay address the next report tries first.
    next_relay: std::sync::atomic::AtomicUsize,
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
            relays: Mutex::default(),
            next_relay: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Whether `report` is another replica's to settle.
    pub(crate) fn elsewhere(&self, report: &UsageReport) -> bool {
        let by = routed_by(report);
        !report.forwarded && by != 0 && by != self.self_id
    }

    /// Forwards `report` to the replica that routed it; its answer.
    pub(crate) async fn forward(
        &self,
        mut report: UsageReport,
        on_behalf_of: Option<&str>,
    ) -> Result<UsageAck, ForwardError> {
        let id = routed_by(&report);
        let via = self.cluster.relay_via();
        if !via.is_empty() {
            return self.through_relay(&via, report, on_behalf_of).await;
        }
        let mut client = self.client(id)?;
        if self.cluster.cut_off(id) {
            return Err(ForwardError::Call {
                id,
                status: tonic::Status::unavailable("cut off by fault injection"),
            });
        }
        report.forwarded = true;
        client
            .report_usage(request(report, on_behalf_of))
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ForwardError::Call { id, status })
    }

    /// Hands `report` to a relay as a fresh report (it forwards it to the routing replica, or
    /// settles it there); the next relay address only when one refused the connection.
    async fn through_relay(
        &self,
        via: &[String],
        report: UsageReport,
        on_behalf_of: Option<&str>,
    ) -> Result<UsageAck, ForwardError> {
        use std::sync::atomic::Ordering;
        let id = routed_by(&report);
        let first = self.next_relay.fetch_add(1, Ordering::Relaxed);
        let mut last = None;
        for k in 0..via.len() {
            let addr = &via[(first + k) % via.len()];
            let mut client = self.relay_client(addr, id)?;
            match client
                .report_usage(request(report.clone(), on_behalf_of))
                .await
            {
                Ok(ack) => return Ok(ack.into_inner()),
                Err(status) => {
                    let refused = kvplane_tls::connection_refused(&status);
                    last = Some(ForwardError::Relay {
                        id,
                        addr: addr.clone(),
                        status,
                    });
                    if !refused {
                        break;
                    }
                }
            }
        }
        Err(last.unwrap_or(ForwardError::NotAMember(id)))
    }

    fn relay_client(&self, addr: &str, id: u64) -> Result<RouterClient<Channel>, ForwardError> {
        let mut relays = self.relays.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = relays.get(addr) {
            return Ok(c.clone());
        }
        let c = self.dial(addr, id)?;
        relays.insert(addr.to_owned(), c.clone());
        Ok(c)
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
        let c = self.dial(&addr, id)?;
        clients.insert(id, c.clone());
        Ok(c)
    }

    /// A client of `addr` (reached for replica `id`'s report).
    fn dial(&self, addr: &str, id: u64) -> Result<RouterClient<Channel>, ForwardError> {
        let channel =
            self.cluster
                .dialer()
                .channel(addr)
                .map_err(|source| ForwardError::Address {
                    id,
                    addr: addr.to_owned(),
                    source,
                })?;
        Ok(RouterClient::new(channel))
    }
}

/// A report call: at most 2 s, naming whom it is made for.
fn request(report: UsageReport, on_behalf_of: Option<&str>) -> tonic::Request<UsageReport> {
    let mut request = tonic::Request::new(report);
    request.set_timeout(Duration::from_secs(2));
    if let Some(v) = on_behalf_of.and_then(|i| i.parse().ok()) {
        request
            .metadata_mut()
            .insert(crate::access::ON_BEHALF_OF, v);
    }
    request
}

/// The replica that routed a reported request: its ticket's, else the report's `routed_by`.
pub(crate) fn routed_by(report: &UsageReport) -> u64 {
    report
        .ticket
        .as_ref()
        .map_or(report.routed_by, |t| t.routed_by)
}

/// The ticket of a request this process (`incarnation` of replica `routed_by`) routed with
/// `reservations`.
pub(crate) fn ticket(
    routed_by: u64,
    incarnation: u64,
    reservations: &[crate::Reservation],
) -> Ticket {
    Ticket {
        routed_by,
        incarnation,
        charges: reservations
            .iter()
            .filter(|r| !r.fail_open)
            .map(crate::Reservation::charge)
            .collect(),
    }
}

/// What a final report gives back through the ledger: for each limit its ticket names, the
/// reservation less what the request used. Nothing for a first-token report, a report without
/// a ticket, or one whose usage was not seen (the request keeps what was reserved).
pub(crate) fn ledger_settles(report: &UsageReport) -> Vec<QuotaSettle> {
    let Some(t) = report
        .ticket
        .as_ref()
        .filter(|_| !report.first_token && !report.usage_unknown)
    else {
        return Vec::new();
    };
    let used = u64::from(report.prompt_tokens) + u64::from(report.completion_tokens);
    t.charges
        .iter()
        .filter(|c| c.tokens > used)
        .map(|c| QuotaSettle {
            ticket: kvplane_state::Ticket {
                replica: t.routed_by,
                incarnation: t.incarnation,
                request_id: report.request_id.clone(),
            },
            key: LimitKey {
                tenant: c.tenant.clone(),
                model: c.model.clone(),
                provider: c.provider.clone(),
            },
            window_start_ms: c.window_start_ms,
            tokens: c.tokens - used,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::Reservation;

    fn reservation(model: &str, tokens: u64, fail_open: bool) -> Reservation {
        Reservation {
            key: LimitKey {
                tenant: "acme".into(),
                model: model.into(),
                provider: String::new(),
            },
            window_start_ms: 60_000,
            tokens,
            fail_open,
        }
    }

    fn report(ticket: Ticket) -> UsageReport {
        UsageReport {
            request_id: "r".into(),
            prompt_tokens: 40,
            completion_tokens: 10,
            ticket: Some(ticket),
            ..Default::default()
        }
    }

    #[test]
    fn a_final_report_gives_back_each_ledger_reservation_less_what_was_used() {
        let t = ticket(
            3,
            7,
            &[
                reservation("", 540, false),
                reservation("m", 540, false),
                reservation("x", 900, true),
                reservation("y", 30, false),
            ],
        );
        assert_eq!(
            t.charges.len(),
            3,
            "fail-open admissions are not the ledger's"
        );
        let settles = ledger_settles(&report(t.clone()));
        let got: Vec<(u64, u64, &str, &str, u64, u64)> = settles
            .iter()
            .map(|s| {
                let k = &s.ticket;
                (
                    k.replica,
                    k.incarnation,
                    k.request_id.as_str(),
                    s.key.model.as_str(),
                    s.window_start_ms,
                    s.tokens,
                )
            })
            .collect();
        assert_eq!(
            got,
            [(3, 7, "r", "", 60_000, 490), (3, 7, "r", "m", 60_000, 490)],
            "a reservation smaller than the use gives nothing back"
        );
        let mut unknown = report(t.clone());
        unknown.usage_unknown = true;
        assert!(ledger_settles(&unknown).is_empty());
        let mut first = report(t);
        first.first_token = true;
        assert!(ledger_settles(&first).is_empty());
    }
}
