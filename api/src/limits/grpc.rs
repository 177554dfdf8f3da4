//! The tower layer that bounds a Router call's time and counts the calls tonic refused for
//! their size.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;

use crate::ApiMetrics;

/// Bounds every Router call to `route_call_ms` and counts Router's and Admin's refusals of too
/// large messages (`kvplane_limit_hits_total{limit="grpc_message_bytes"|"route_call_ms"}`; the
/// picker counts its own, which come after its stream's headers).
#[derive(Debug, Clone)]
pub struct LimitsLayer {
    route_call: Duration,
    metrics: Arc<ApiMetrics>,
}

impl LimitsLayer {
    pub fn new(limits: &super::Limits, metrics: Arc<ApiMetrics>) -> Self {
        Self {
            route_call: Duration::from_millis(limits.route_call_ms),
            metrics,
        }
    }
}

impl<S> tower::Layer<S> for LimitsLayer {
    type Service = Bounded<S>;
    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
    layer: LimitsLayer,
}

/// The Router service's path prefix: its calls are unary, bounded in time. Raft's (a
/// snapshot streams for as long as it takes) and the picker's (one stream per proxied
/// request, open while the request is) are not.
const ROUTER: &str = "/kvplane.v1.Router/";
/// Admin's: its too large messages are counted too (Raft's have a limit of their own).
const ADMIN: &str = "/kvplane.v1.Admin/";

/// tonic's words for a message over its decoding limit (OUT_OF_RANGE).
const TOO_LARGE: &str = "Error, decoded message length too large";

impl<S, B> tower::Service<http::Request<B>> for Bounded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let bounded = req.uri().path().starts_with(ROUTER);
        let counted = bounded || req.uri().path().starts_with(ADMIN);
        let call = self.inner.call(req);
        let layer = self.layer.clone();
        Box::pin(async move {
            let answer = if bounded {
                match tokio::time::timeout(layer.route_call, call).await {
                    Ok(a) => a,
                    Err(_) => {
                        layer.metrics.limit_hit("route_call_ms");
                        return Ok(tonic::Status::deadline_exceeded(format!(
                            "the call took longer than the limit of {} ms (limits.route_call_ms)",
                            layer.route_call.as_millis()
                        ))
                        .into_http());
                    }
                }
            } else {
                call.await
            };
            if counted
                && let Ok(r) = &answer
                && r.headers().get("grpc-status").is_some_and(|s| s == "11")
                && r.headers()
                    .get("grpc-message")
                    .and_then(|m| m.to_str().ok())
                    .and_then(|m| percent_decode(m).starts_with(TOO_LARGE).then_some(()))
                    .is_some()
            {
                layer.metrics.limit_hit("grpc_message_bytes");
            }
            answer
        })
    }
}

/// Whether `status` is tonic's refusal of a message over its decoding limit.
pub(crate) fn is_too_large(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().starts_with(TOO_LARGE)
}

/// gRPC's `grpc-message` is percent-encoded.
fn percent_decode(m: &str) -> String {
    percent_encoding::percent_decode_str(m)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tower::{Layer, Service};

    /// Answers OK after `delay`, as a slow handler would.
    #[derive(Clone)]
    struct Slow(Duration);

    impl Service<http::Request<()>> for Slow {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let d = self.0;
            Box::pin(async move {
                tokio::time::sleep(d).await;
                Ok(tonic::Status::ok("").into_http())
            })
        }
    }

    fn status(r: &http::Response<tonic::body::Body>) -> &str {
        r.headers().get("grpc-status").unwrap().to_str().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_router_call_over_its_time_is_ended_and_counted_and_others_are_not() {
        let metrics = Arc::new(ApiMetrics::default());
        let limits = crate::Limits {
            route_call_ms: 100,
            ..crate::Limits::default()
        };
        let mut svc =
            LimitsLayer::new(&limits, metrics.clone()).layer(Slow(Duration::from_secs(1)));
        let req = |path: &str| http::Request::builder().uri(path).body(()).unwrap();
        let cut = svc.call(req("/kvplane.v1.Router/Route")).await.unwrap();
        assert_eq!(status(&cut), "4", "DEADLINE_EXCEEDED");
        // Raft's calls (a snapshot streams as long as it takes) have no such bound.
        let raft = svc
            .call(req("/kvplane.v1.Raft/InstallSnapshot"))
            .await
            .unwrap();
        assert_eq!(status(&raft), "0");
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("kvplane_limit_hits_total{limit=\"route_call_ms\"} 1\n"),
            "{text}"
        );
    }
}
