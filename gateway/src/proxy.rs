//! The HTTP side of the gateway.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use kvplane_proto::front::{self, AnswerTail, Usage};
use kvplane_proto::v1::{Outcome, RejectCode, RouteRequest, UsageReport, route_response::Decision};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::metrics::StatusLabel;
use crate::{GatewayMetrics, Replicas, WORKER_HEADER};

/// How requests find an engine.
#[derive(Debug, Clone)]
pub enum Strategy {
    /// Ask kvplane (these gRPC URLs, in failover order).
    Kvplane { replicas: Vec<String> },
    /// Cycle over these engine base URLs.
    RoundRobin { engines: Vec<String> },
}

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub strategy: Strategy,
    /// Header that carries the tenant.
    pub tenant_header: String,
}

enum Mode {
    Kvplane(Replicas),
    RoundRobin(Vec<String>, AtomicU64),
}

struct Inner {
    mode: Mode,
    tenant_header: String,
    http: reqwest::Client,
    metrics: GatewayMetrics,
    registry: Registry,
    next_id: AtomicU64,
    id_prefix: String,
}

#[derive(Clone)]
struct App(Arc<Inner>);

/// Serves until `shutdown` resolves.
pub async fn run(
    cfg: GatewayConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), std::io::Error> {
    let mode = match cfg.strategy {
        Strategy::Kvplane { replicas } => {
            Mode::Kvplane(Replicas::new(&replicas).map_err(std::io::Error::other)?)
        }
        Strategy::RoundRobin { engines } => {
            if engines.is_empty() {
                return Err(std::io::Error::other(
                    "round-robin needs at least one engine",
                ));
            }
            Mode::RoundRobin(engines, AtomicU64::new(0))
        }
    };
    let metrics = GatewayMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let app = App(Arc::new(Inner {
        mode,
        tenant_header: cfg.tenant_header.to_ascii_lowercase(),
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .map_err(std::io::Error::other)?,
        metrics,
        registry,
        next_id: AtomicU64::new(1),
        id_prefix: format!("gw{}", std::process::id()),
    }));
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    app.forward("/v1/completions", headers, body).await
}

async fn chat(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    app.forward("/v1/chat/completions", headers, body).await
}

async fn metrics_text(State(app): State<App>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &app.0.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            out,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn error_response(status: StatusCode, kind: &str, message: &str, retry_after_ms: u64) -> Response {
    let mut r = (
        status,
        axum::Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}})),
    )
        .into_response();
    if retry_after_ms > 0 {
        let secs = retry_after_ms.div_ceil(1000).to_string();
        if let Ok(v) = HeaderValue::from_str(&secs) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    r
}

/// Where one request goes.
struct Target {
    url: String,
    label: String,
    body: Bytes,
    matched_blocks: u32,
}

impl App {
    fn count(&self, status: StatusCode) {
        self.0
            .metrics
            .requests
            .get_or_create(&StatusLabel {
                status: status.as_u16(),
            })
            .inc();
    }

    async fn pick(
        &self,
        path: &str,
        headers: &HeaderMap,
        body: &Bytes,
        request_id: &str,
    ) -> Result<Target, Response> {
        match &self.0.mode {
            Mode::RoundRobin(engines, next) => {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize % engines.len();
                let base = engines[i].trim_end_matches('/');
                Ok(Target {
                    url: format!("{base}{path}"),
                    label: base.to_owned(),
                    body: body.clone(),
                    matched_blocks: 0,
                })
            }
            Mode::Kvplane(replicas) => {
                let tenant = headers
                    .get(self.0.tenant_header.as_str())
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let model = serde_json::from_slice::<Value>(body)
                    .ok()
                    .and_then(|v| v.get("model").and_then(Value::as_str).map(str::to_owned))
                    .unwrap_or_default();
                // Every header but credentials and hop-by-hop ones (policies map headers to
                // tags and name the tenant's), at most MAX_ROUTED_HEADERS.
                let mut fwd: HashMap<String, String> = HashMap::new();
                for name in headers.keys() {
                    if !front::routed_header(name.as_str()) {
                        continue;
                    }
                    if fwd.len() >= front::MAX_ROUTED_HEADERS {
                        break;
                    }
                    // A repeated header is one comma-separated value (RFC 9110).
                    let values: Vec<&str> = headers
                        .get_all(name)
                        .iter()
                        .filter_map(|v| v.to_str().ok())
                        .collect();
                    if !values.is_empty() {
                        fwd.insert(name.as_str().to_owned(), values.join(", "));
                    }
                }
                let req = RouteRequest {
                    request_id: request_id.to_owned(),
                    tenant,
                    model,
                    headers: fwd,
                    body: body.to_vec(),
                    ..Default::default()
                };
                let started = Instant::now();
                let (resp, failed) = replicas.route(req, headers).await.map_err(|e| {
                    error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable",
                        &e.to_string(),
                        0,
                    )
                })?;
                self.0
                    .metrics
                    .route_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.0.metrics.replica_failovers.inc_by(failed as u64);
                match resp.decision {
                    Some(Decision::Endpoint(e)) => {
                        if e.address.is_empty() {
                            return Err(error_response(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "unavailable",
                                &format!(
                                    "worker {}/{} has not announced an address",
                                    e.pool, e.worker_id
                                ),
                                0,
                            ));
                        }
                        Ok(Target {
                            url: format!("{}{path}", e.address.trim_end_matches('/')),
                            label: format!("{}/{}", e.pool, e.worker_id),
                            body: resp
                                .rewritten_body
                                .map_or_else(|| body.clone(), Bytes::from),
                            matched_blocks: resp.matched_blocks,
                        })
                    }
                    Some(Decision::Rejection(r)) => {
                        let (status, kind) = match RejectCode::try_from(r.code) {
                            Ok(RejectCode::RateLimited) => {
                                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded")
                            }
                            Ok(RejectCode::UnknownModel) => {
                                (StatusCode::NOT_FOUND, "model_not_found")
                            }
                            Ok(RejectCode::InvalidRequest) => {
                                (StatusCode::BAD_REQUEST, "invalid_request_error")
                            }
                            Ok(RejectCode::Policy) => (StatusCode::FORBIDDEN, "policy_rejected"),
                            _ => (StatusCode::SERVICE_UNAVAILABLE, "no_capacity"),
                        };
                        Err(error_response(status, kind, &r.reason, r.retry_after_ms))
                    }
                    None => Err(error_response(
                        StatusCode::BAD_GATEWAY,
                        "bad_gateway",
                        "kvplane sent no decision",
                        0,
                    )),
                }
            }
        }
    }

    async fn forward(&self, path: &str, headers: HeaderMap, body: Bytes) -> Response {
        let received = Instant::now();
        let request_id = format!(
            "{}-{}",
            self.0.id_prefix,
            self.0.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let target = match self.pick(path, &headers, &body, &request_id).await {
            Ok(t) => t,
            Err(r) => {
                self.count(r.status());
                return r;
            }
        };
        let upstream = match self
            .0
            .http
            .post(&target.url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(target.body.clone())
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => {
                let r = error_response(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("engine {} did not answer: {e}", target.label),
                    0,
                );
                self.count(r.status());
                self.report(request_id, Usage::default(), 0.0, Outcome::Error);
                return r;
            }
        };
        let status =
            StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = upstream
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .cloned();
        self.count(status);
        // A streamed answer's first chunk carries the first token: reported at once, so the
        // replica stops counting the request as waiting on its engine long before its end.
        let streamed = status.is_success()
            && content_type
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
        let app = self.clone();
        let mut first_at: Option<f64> = None;
        let mut first_report: Option<JoinHandle<()>> = None;
        let mut tail = AnswerTail::default();
        let mut upstream_body = upstream.bytes_stream();
        let stream = async_stream_body(move |tx| async move {
            while let Some(chunk) = upstream_body.next().await {
                match chunk {
                    Ok(bytes) => {
                        if first_at.is_none() {
                            let t = received.elapsed().as_secs_f64();
                            app.0.metrics.ttft_seconds.observe(t);
                            first_at = Some(t * 1000.0);
                            if streamed {
                                first_report =
                                    app.report_first_token(request_id.clone(), t * 1000.0);
                            }
                        }
                        tail.keep(&bytes);
                        if tx.send(Ok(bytes)).await.is_err() {
                            app.report_after(
                                first_report.take(),
                                request_id,
                                tail.usage(),
                                first_at.unwrap_or(0.0),
                                Outcome::Cancelled,
                            );
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e))).await;
                        app.report_after(
                            first_report.take(),
                            request_id,
                            tail.usage(),
                            first_at.unwrap_or(0.0),
                            Outcome::Error,
                        );
                        return;
                    }
                }
            }
            let outcome = if status.is_success() {
                Outcome::Success
            } else {
                Outcome::Error
            };
            app.report_after(
                first_report.take(),
                request_id,
                tail.usage(),
                first_at.unwrap_or(0.0),
                outcome,
            );
        });
        let mut resp = Response::new(Body::from_stream(stream));
        *resp.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            resp.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        if let Ok(v) = HeaderValue::from_str(&target.label) {
            resp.headers_mut().insert(WORKER_HEADER, v);
        }
        if let Ok(v) = HeaderValue::from_str(&target.matched_blocks.to_string()) {
            resp.headers_mut().insert("x-kvplane-matched-blocks", v);
        }
        resp
    }

    /// Reports a streamed request's first token (see `UsageReport.first_token`); the handle
    /// of the report in flight, which the final report waits for.
    fn report_first_token(&self, request_id: String, ttft_ms: f64) -> Option<JoinHandle<()>> {
        let report = UsageReport {
            request_id,
            observed_ttft_ms: ttft_ms,
            first_token: true,
            ..Default::default()
        };
        self.send_report(report, None)
    }

    /// Sends `report` to the replicas in the background, after the report `after` (if any).
    fn send_report(
        &self,
        report: UsageReport,
        after: Option<JoinHandle<()>>,
    ) -> Option<JoinHandle<()>> {
        let Mode::Kvplane(_) = &self.0.mode else {
            return None;
        };
        let app = self.clone();
        Some(tokio::spawn(async move {
            if let Some(before) = after {
                let _ = before.await;
            }
            if let Mode::Kvplane(replicas) = &app.0.mode {
                replicas.report(report).await;
            }
        }))
    }

    /// The final report of a request: its usage and outcome (after its first-token report).
    fn report(&self, request_id: String, usage: Usage, ttft_ms: f64, outcome: Outcome) {
        self.report_after(None, request_id, usage, ttft_ms, outcome);
    }

    fn report_after(
        &self,
        first: Option<JoinHandle<()>>,
        request_id: String,
        usage: Usage,
        ttft_ms: f64,
        outcome: Outcome,
    ) {
        self.send_report(usage.report(request_id, ttft_ms, outcome), first);
    }
}

/// A body fed by a task through a small channel.
fn async_stream_body<F, Fut>(f: F) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream_from(rx)
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
