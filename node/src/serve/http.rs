//! The HTTP port: `/metrics` (OpenMetrics), `/healthz` (the process runs) and `/readyz` (the
//! member knows a leader and keeps up). TLS with the node's `[tls]` unless `[http] plaintext`;
//! bounded by `[http]` (a client's headers and how long it may take to send them).

use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::ready::Ready;

/// What the HTTP port serves and how.
pub(super) struct HttpPort {
    pub tls: Option<kvplane_tls::Tls>,
    pub section: kvplane_tls::HttpSection,
    /// Where a connection ended by a bound is counted.
    pub api: Arc<kvplane_api::ApiMetrics>,
    pub registry: Arc<Registry>,
    pub ready: Ready,
}

/// Serves `listener` until `stop`.
pub(super) async fn serve(listener: TcpListener, port: HttpPort, mut stop: watch::Receiver<bool>) {
    let api = port.api;
    kvplane_tls::serve_http(
        listener,
        port.tls,
        app(port.registry, port.ready),
        port.section,
        Arc::new(move |limit| api.limit_hit(limit)),
        async move {
            let _ = stop.wait_for(|s| *s).await;
        },
        std::time::Duration::from_secs(1),
    )
    .await;
}

fn app(registry: Arc<Registry>, ready: Ready) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(move || metrics(registry.clone())))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready();
                async move {
                    match ready {
                        Ok(()) => (StatusCode::OK, "ready".to_owned()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
                    }
                }
            }),
        )
}

async fn metrics(
    registry: Arc<Registry>,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            "metrics encoding failed".to_owned(),
        ),
    }
}
