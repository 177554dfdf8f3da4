//! The kvplane replicas a gateway may ask, with failover.

use std::sync::atomic::{AtomicUsize, Ordering};

use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{RouteRequest, RouteResponse, UsageReport};
use tonic::transport::{Channel, Endpoint};

/// The W3C trace context headers a gateway passes on to kvplane.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Replicas in a fixed order; calls start at the last one that answered.
#[derive(Debug)]
pub struct Replicas {
    clients: Vec<(String, RouterClient<Channel>)>,
    preferred: AtomicUsize,
}

/// Why the replicas named cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ReplicasError {
    #[error("invalid replica url {url:?}: {error}")]
    Url {
        url: String,
        error: tonic::transport::Error,
    },
    #[error("at least one kvplane replica is needed")]
    None,
}

/// No replica answered.
#[derive(Debug, thiserror::Error)]
#[error("no kvplane replica answered ({tried} tried): {last}")]
pub struct NoReplica {
    pub tried: usize,
    pub last: String,
}

impl Replicas {
    /// Lazily connecting clients for `urls` (`http://host:port`).
    pub fn new(urls: &[String]) -> Result<Self, ReplicasError> {
        let clients = urls
            .iter()
            .map(|u| {
                let ep = Endpoint::from_shared(u.clone())
                    .map_err(|error| ReplicasError::Url {
                        url: u.clone(),
                        error,
                    })?
                    .connect_timeout(std::time::Duration::from_millis(500))
                    .timeout(std::time::Duration::from_secs(2));
                Ok((u.clone(), RouterClient::new(ep.connect_lazy())))
            })
            .collect::<Result<Vec<_>, ReplicasError>>()?;
        if clients.is_empty() {
            return Err(ReplicasError::None);
        }
        Ok(Self {
            clients,
            preferred: AtomicUsize::new(0),
        })
    }

    /// Route on the preferred replica, then on each other one, passing on the caller's W3C trace
    /// context (`traceparent`, `tracestate` of `trace`). Returns the answer and how many
    /// replicas failed before it.
    pub async fn route(
        &self,
        req: RouteRequest,
        trace: &axum::http::HeaderMap,
    ) -> Result<(RouteResponse, usize), NoReplica> {
        let n = self.clients.len();
        let start = self.preferred.load(Ordering::Relaxed);
        let mut last = String::new();
        for k in 0..n {
            let i = (start + k) % n;
            let mut c = self.clients[i].1.clone();
            let mut call = tonic::Request::new(req.clone());
            for key in TRACE_HEADERS {
                if let Some(v) = trace
                    .get(key)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| tonic::metadata::MetadataValue::try_from(v).ok())
                {
                    call.metadata_mut().insert(key, v);
                }
            }
            match c.route(call).await {
                Ok(r) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok((r.into_inner(), k));
                }
                Err(status) => {
                    tracing::debug!(replica = self.clients[i].0, error = %status, "route failed on replica");
                    last = format!("{}: {}", self.clients[i].0, status.message());
                }
            }
        }
        Err(NoReplica { tried: n, last })
    }

    /// Best effort: usage goes to the preferred replica, then the others.
    pub async fn report(&self, report: UsageReport) {
        let n = self.clients.len();
        let start = self.preferred.load(Ordering::Relaxed);
        for k in 0..n {
            let mut c = self.clients[(start + k) % n].1.clone();
            if c.report_usage(report.clone()).await.is_ok() {
                return;
            }
        }
    }
}
