//! The HTTP port: `/metrics` (OpenMetrics), `/healthz` (the process runs) and `/readyz` (the
//! member knows a leader and keeps up).

use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::ready::Ready;

/// Serves `listener` until `stop`.
pub(super) async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    ready: Ready,
    mut stop: watch::Receiver<bool>,
) {
    let served = axum::serve(listener, app(registry, ready))
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = served {
        tracing::warn!(error = %e, "http server ended with an error");
    }
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
