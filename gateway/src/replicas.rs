//! The kvplane replicas a gateway may ask, with failover.

use std::sync::atomic::{AtomicUsize, Ordering};

use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{ModelsRequest, ModelsResponse, RouteRequest, RouteResponse, UsageReport};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The W3C trace context headers a gateway passes on to kvplane.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Replicas in a fixed order; calls start at the last one that answered.
#[derive(Debug)]
pub struct Replicas {
    clients: Vec<(String, RouterClient<Channel>)>,
    /// Each replica's gRPC health, on the same connection.
    health: Vec<HealthClient<Channel>>,
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

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    NoReplica(#[from] NoReplica),
    /// kvplane refused this gateway's identity (every replica holds the same rights).
    #[error("{0}")]
    Denied(String),
}

impl Replicas {
    /// Lazily connecting clients for `urls` (`host:port` or `http(s)://host:port`), over
    /// TLS when `dialer` has a certificate.
    pub fn new(urls: &[String], dialer: &kvplane_tls::Dialer) -> Result<Self, ReplicasError> {
        let clients = urls
            .iter()
            .map(|u| {
                let ep = dialer
                    .endpoint(u)
                    .map_err(|error| ReplicasError::Url {
                        url: u.clone(),
                        error,
                    })?
                    .timeout(std::time::Duration::from_secs(2));
                Ok((u.clone(), dialer.lazy(&ep)))
            })
            .collect::<Result<Vec<_>, ReplicasError>>()?;
        let health = clients
            .iter()
            .map(|(_, c)| HealthClient::new(c.clone()))
            .collect();
        let clients: Vec<(String, RouterClient<Channel>)> = clients
            .into_iter()
            .map(|(u, c)| (u, RouterClient::new(c)))
            .collect();
        if clients.is_empty() {
            return Err(ReplicasError::None);
        }
        Ok(Self {
            clients,
            health,
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
    ) -> Result<(RouteResponse, usize), RouteError> {
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
                Err(status) if status.code() == tonic::Code::PermissionDenied => {
                    return Err(RouteError::Denied(status.message().to_owned()));
                }
                Err(status) => {
                    tracing::debug!(replica = self.clients[i].0, error = %status, "route failed on replica");
                    last = format!("{}: {}", self.clients[i].0, status.message());
                }
            }
        }
        Err(NoReplica { tried: n, last }.into())
    }

    /// Best effort: usage goes to the preferred replica, then the others.
    /// The models the first replica that answers lists.
    pub async fn models(&self) -> Result<ModelsResponse, NoReplica> {
        let n = self.clients.len();
        let start = self.preferred.load(Ordering::Relaxed);
        let mut last = String::new();
        for k in 0..n {
            let i = (start + k) % n;
            match self.clients[i].1.clone().models(ModelsRequest {}).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(status) => last = format!("{}: {}", self.clients[i].0, status.message()),
            }
        }
        Err(NoReplica { tried: n, last })
    }

    /// The first replica (in order) whose gRPC health says it is ready (`readiness`), or why
    /// none is; all asked at once, each given half a second (a probe's own timeout is short).
    pub async fn ready(&self) -> Result<String, String> {
        let checks = self.clients.iter().zip(&self.health).map(|((url, _), h)| {
            let mut h = h.clone();
            async move {
                let asked = h.check(HealthCheckRequest {
                    service: "readiness".into(),
                });
                match tokio::time::timeout(std::time::Duration::from_millis(500), asked).await {
                    Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32 => {
                        Ok(url.clone())
                    }
                    Ok(Ok(_)) => Err(format!("{url}: not ready")),
                    Ok(Err(status)) => Err(format!("{url}: {}", status.message())),
                    Err(_) => Err(format!("{url}: no answer within 500 ms")),
                }
            }
        });
        let answers = futures::future::join_all(checks).await;
        let mut why = Vec::new();
        for a in answers {
            match a {
                Ok(url) => return Ok(url),
                Err(w) => why.push(w),
            }
        }
        Err(why.join("; "))
    }

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
