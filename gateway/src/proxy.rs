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
use kvplane_proto::front::{self, AnswerTail};
use kvplane_proto::v1::{
    Endpoint, Outcome, RejectCode, RouteRequest, Ticket, UsageReport, route_response::Decision,
};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::bedrock::BedrockError;
use crate::bedrock::stream::ConverseStream;
use crate::errors::error_response;
use crate::metrics::StatusLabel;
use crate::secrets::Secrets;
use crate::target::{Target, targets};
use crate::{GatewayMetrics, Replicas, WORKER_HEADER};

/// How requests find an engine.
#[derive(Debug, Clone)]
pub enum Strategy {
    /// Ask kvplane (these gRPC URLs, in failover order), over TLS when the dialer has a
    /// certificate.
    Kvplane {
        replicas: Vec<String>,
        dialer: kvplane_tls::Dialer,
    },
    /// Cycle over these engine base URLs.
    RoundRobin { engines: Vec<String> },
}

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub strategy: Strategy,
    /// Header that carries the tenant.
    pub tenant_header: String,
    /// Where this gateway runs (its cluster, region, zone), sent with every Route: a replica
    /// of another cluster (after a failover) decides as from here. `None`: the replica's place.
    pub origin: Option<kvplane_proto::v1::Place>,
    /// Where providers' credentials are found.
    pub secrets: Secrets,
    /// More certificate authorities (PEM) to trust for providers, besides the web's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// How long requests in flight may take to finish after the shutdown signal.
    pub drain: std::time::Duration,
    /// How long a target may take to answer a request's headers (an engine answering a
    /// request that is not streamed sends them at its end).
    pub headers_timeout: std::time::Duration,
    /// TLS on the listener (clients see this certificate); `None`: plaintext.
    pub listen_tls: Option<kvplane_tls::Tls>,
    /// What a client may send before its request is read: headers and how long they take.
    pub http: kvplane_tls::HttpSection,
    /// The largest request body taken (larger: 413).
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's body after its headers (longer: 408).
    pub body_read: std::time::Duration,
    /// More series for `/metrics` (the process's own, from the binary that runs the gateway),
    /// each made by its function when the gateway starts.
    pub collectors: Vec<fn() -> Box<dyn prometheus_client::collector::Collector>>,
}

/// Why the gateway cannot start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Replicas(#[from] crate::replicas::ReplicasError),
    #[error("round-robin needs at least one engine")]
    NoEngines,
    #[error("the CA file holds no usable certificate: {0}")]
    Ca(reqwest::Error),
    #[error("the HTTP client cannot be built: {0}")]
    Client(reqwest::Error),
    #[error(transparent)]
    Serve(#[from] std::io::Error),
}

enum Mode {
    Kvplane(Replicas),
    RoundRobin(Vec<String>, AtomicU64),
}

struct Inner {
    mode: Mode,
    tenant_header: String,
    origin: Option<kvplane_proto::v1::Place>,
    secrets: Secrets,
    headers_timeout: std::time::Duration,
    max_body_bytes: usize,
    body_read: std::time::Duration,
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
) -> Result<(), GatewayError> {
    let mode = match cfg.strategy {
        Strategy::Kvplane { replicas, dialer } => Mode::Kvplane(Replicas::new(&replicas, &dialer)?),
        Strategy::RoundRobin { engines } => {
            if engines.is_empty() {
                return Err(GatewayError::NoEngines);
            }
            Mode::RoundRobin(engines, AtomicU64::new(0))
        }
    };
    let mut http = reqwest::Client::builder()
        .use_rustls_tls()
        .pool_max_idle_per_host(64)
        .connect_timeout(std::time::Duration::from_secs(10));
    if let Some(pem) = &cfg.ca_pem {
        for cert in reqwest::Certificate::from_pem_bundle(pem).map_err(GatewayError::Ca)? {
            http = http.add_root_certificate(cert);
        }
    }
    let http = http.build().map_err(GatewayError::Client)?;
    let metrics = GatewayMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    for make in &cfg.collectors {
        registry.register_collector(make());
    }
    if let Some(tls) = &cfg.listen_tls {
        tls.metrics().register(&mut registry);
    }
    let app = App(Arc::new(Inner {
        mode,
        tenant_header: cfg.tenant_header.to_ascii_lowercase(),
        origin: cfg.origin.clone(),
        secrets: cfg.secrets,
        headers_timeout: cfg.headers_timeout,
        max_body_bytes: cfg.max_body_bytes,
        body_read: cfg.body_read,
        http,
        metrics,
        registry,
        next_id: AtomicU64::new(1),
        id_prefix: format!("gw{}", std::process::id()),
    }));
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(echo_request_id))
        .with_state(app.clone());
    // On the shutdown signal: no new connections; requests in flight get `drain` to finish.
    kvplane_tls::serve_http(
        listener,
        cfg.listen_tls,
        router,
        cfg.http,
        Arc::new(move |limit| app.0.metrics.limit_hit(limit)),
        shutdown,
        cfg.drain,
    )
    .await;
    Ok(())
}

type Body_ = axum::body::Body;

async fn completions(State(app): State<App>, headers: HeaderMap, body: Body_) -> Response {
    app.post("/v1/completions", headers, body).await
}

async fn chat(State(app): State<App>, headers: HeaderMap, body: Body_) -> Response {
    app.post("/v1/chat/completions", headers, body).await
}

/// `GET /v1/models`: the models kvplane's catalog lets a client name (round-robin: the first
/// engine's list).
async fn models(State(app): State<App>, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let id = client_request_id(&headers).unwrap_or_default();
    let resp = match &app.0.mode {
        Mode::Kvplane(replicas) => match replicas.models().await {
            Ok(m) => {
                let data: Vec<Value> = m
                    .models
                    .iter()
                    .map(|m| json!({"id": m.id, "object": "model", "created": 0, "owned_by": "kvplane"}))
                    .collect();
                axum::Json(json!({"object": "list", "data": data})).into_response()
            }
            Err(e) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &e.to_string(),
                1000,
            ),
        },
        Mode::RoundRobin(engines, _) => {
            let url = format!("{}/v1/models", engines[0].trim_end_matches('/'));
            let mut get = app.0.http.get(&url);
            if let Some(a) = headers.get(header::AUTHORIZATION) {
                get = get.header(header::AUTHORIZATION, a.clone());
            }
            match get.send().await {
                Ok(r) => {
                    let status = StatusCode::from_u16(r.status().as_u16())
                        .unwrap_or(StatusCode::BAD_GATEWAY);
                    let body = r.bytes().await.unwrap_or_default();
                    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
                }
                Err(e) => error_response(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("engine {url} did not answer: {e}"),
                    0,
                ),
            }
        }
    };
    app.answered("GET", "/v1/models", &id, started, &resp);
    resp
}

/// `GET /readyz`: ready while a kvplane replica says it is (its gRPC `readiness`); round-robin
/// is always ready.
async fn readyz(State(app): State<App>) -> Response {
    match &app.0.mode {
        Mode::Kvplane(replicas) => match replicas.ready().await {
            Ok(replica) => (StatusCode::OK, format!("ready: {replica} is serving")).into_response(),
            Err(why) => {
                let mut r = (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: no kvplane replica is ready ({why})"),
                )
                    .into_response();
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                r
            }
        },
        Mode::RoundRobin(..) => (StatusCode::OK, "ready").into_response(),
    }
}

/// Any other path: 404 in OpenAI's shape, counted.
async fn not_found(
    State(app): State<App>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    let r = error_response(
        StatusCode::NOT_FOUND,
        "not_found",
        &format!("{method} {} is not an endpoint of this gateway", uri.path()),
        0,
    );
    app.answered(method.as_str(), uri.path(), "", Instant::now(), &r);
    r
}

/// A known path with another method: 405 in OpenAI's shape, counted.
async fn method_not_allowed(
    State(app): State<App>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    let r = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        &format!("{} does not take {method}", uri.path()),
        0,
    );
    app.answered(method.as_str(), uri.path(), "", Instant::now(), &r);
    r
}

/// Every answer to a request that named itself (`x-request-id`) names it back.
async fn echo_request_id(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let id = client_request_id(req.headers());
    let mut r = next.run(req).await;
    if let Some(id) = id
        && !r.headers().contains_key("x-request-id")
        && let Ok(v) = HeaderValue::from_str(&id)
    {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

/// The client's `x-request-id`, when it is one a header may carry back (visible ASCII, at most
/// 200 bytes).
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get("x-request-id")?.to_str().ok()?;
    (!v.is_empty() && v.len() <= 200 && v.bytes().all(|b| b.is_ascii_graphic()))
        .then(|| v.to_owned())
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

/// The client's answer when provider `t` answered `r` with an error: a 429 stays a 429 (its
/// `Retry-After` kept), the rest is a 502 saying what the provider did.
fn provider_failed(t: &Target, r: &reqwest::Response) -> Response {
    let status = r.status();
    let name = t.label.strip_prefix("provider:").unwrap_or(&t.label);
    let retry_after_ms = r
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(0, |secs| secs.saturating_mul(1000));
    match status.as_u16() {
        429 => error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            &format!("provider {name} is rate limiting the gateway"),
            retry_after_ms.max(1000),
        ),
        401 | 403 => error_response(
            StatusCode::BAD_GATEWAY,
            "provider_error",
            &format!("provider {name} refused the gateway's credentials ({status})"),
            0,
        ),
        _ => error_response(
            StatusCode::BAD_GATEWAY,
            "provider_error",
            &format!("provider {name} failed ({status})"),
            0,
        ),
    }
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

    /// Where the request goes: the pick, then the alternatives to retry on; and the request's
    /// ticket (`RouteResponse.ticket`: the replica and process that decided it, what it
    /// reserved), which its reports carry so that any replica settles them.
    async fn pick(
        &self,
        path: &str,
        headers: &HeaderMap,
        body: &Bytes,
        request_id: &str,
    ) -> Result<(Vec<Target>, Option<Ticket>), Response> {
        match &self.0.mode {
            Mode::RoundRobin(engines, next) => {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize % engines.len();
                let base = engines[i].trim_end_matches('/');
                let target = Target {
                    url: format!("{base}{path}"),
                    label: base.to_owned(),
                    body: body.clone(),
                    matched_blocks: 0,
                    provider: None,
                    authorization: None,
                    bedrock: None,
                    served: None,
                };
                Ok((vec![target], None))
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
                    origin: self.0.origin.clone(),
                    ..Default::default()
                };
                let started = Instant::now();
                let (resp, failed) = replicas.route(req, headers).await.map_err(|e| match e {
                    crate::replicas::RouteError::Denied(m) => {
                        error_response(StatusCode::FORBIDDEN, "permission_denied", &m, 0)
                    }
                    crate::replicas::RouteError::NoReplica(e) => error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable",
                        &e.to_string(),
                        0,
                    ),
                })?;
                self.0
                    .metrics
                    .route_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.0.metrics.replica_failovers.inc_by(failed as u64);
                // A replica from before tickets names only itself; a refusal is never reported.
                let routed = matches!(resp.decision, Some(Decision::Endpoint(_)));
                let ticket = resp.ticket.clone().or_else(|| {
                    (routed && resp.routed_by != 0).then(|| Ticket {
                        routed_by: resp.routed_by,
                        ..Ticket::default()
                    })
                });
                match resp.decision.clone() {
                    Some(Decision::Endpoint(e)) => {
                        match targets(resp, e, path, body, &self.0.secrets).await {
                            Ok(t) => Ok((t, ticket)),
                            Err(e) => {
                                // Routed, and nowhere it may go: settled at once.
                                tracing::warn!(request_id, error = %e, "no target can be called");
                                self.report_failed(
                                    request_id.to_owned(),
                                    0.0,
                                    ticket.as_ref(),
                                    None,
                                );
                                let (status, kind) = e.status();
                                Err(error_response(status, kind, &e.public(), 0))
                            }
                        }
                    }
                    Some(Decision::Rejection(r)) => {
                        let code = RejectCode::try_from(r.code).unwrap_or(RejectCode::Unspecified);
                        let (status, kind) = front::refusal_answer(code);
                        let status =
                            StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
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

    /// Sends the request to the first of `targets` that answers. One that cannot be connected
    /// to, or a provider that answers 429 or 5xx (the request was not served there), passes it
    /// to the next, before any byte reached the client; a request that may have reached a
    /// target is never sent again. A provider's failure on the last target is told in the
    /// gateway's words (its `Retry-After` kept), never in the provider's.
    async fn send(
        &self,
        targets: &[Target],
        client: &HeaderMap,
        request_id: &str,
    ) -> Result<(Target, reqwest::Response), Response> {
        let mut last = None;
        for (i, t) in targets.iter().enumerate() {
            if i > 0 {
                self.0.metrics.upstream_retries.inc();
            }
            let more = i + 1 < targets.len();
            let what = if t.provider.is_some() {
                "provider"
            } else {
                "engine"
            };
            let mut request = self
                .0
                .http
                .post(&t.url)
                .headers(crate::target::upstream_headers(t, client, request_id))
                .body(t.body.clone());
            if let Some(b) = &t.bedrock {
                match crate::target::bedrock_signature(t, b) {
                    Ok(headers) => {
                        for (k, v) in headers {
                            request = request.header(k, v);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(target = t.label, error = %e, "cannot sign the request");
                        return Err(error_response(
                            StatusCode::BAD_GATEWAY,
                            "bad_gateway",
                            &format!("{what} {}: {e}", t.label),
                            0,
                        ));
                    }
                }
            }
            let sent = tokio::time::timeout(self.0.headers_timeout, request.send()).await;
            let r = match sent {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    // Without the URL: a provider's may carry a key in its query.
                    let e = e.without_url();
                    tracing::debug!(target = t.label, error = %e, "target did not answer");
                    let answer = error_response(
                        StatusCode::BAD_GATEWAY,
                        "bad_gateway",
                        &format!("{what} {} did not answer: {e}", t.label),
                        0,
                    );
                    if e.is_connect() && more {
                        last = Some(answer);
                        continue;
                    }
                    return Err(answer);
                }
                Err(_) => {
                    return Err(error_response(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout",
                        &format!(
                            "{what} {} sent no answer within {} s",
                            t.label,
                            self.0.headers_timeout.as_secs()
                        ),
                        0,
                    ));
                }
            };
            let status = r.status();
            if t.provider.is_none() || status.is_success() {
                return Ok((t.clone(), r));
            }
            if more && (status.as_u16() == 429 || status.is_server_error()) {
                tracing::debug!(target = t.label, %status, "trying the next target");
                last = Some(provider_failed(t, &r));
                continue;
            }
            if matches!(status.as_u16(), 401 | 403 | 429) || status.is_server_error() {
                return Err(provider_failed(t, &r));
            }
            // What the provider says of the request itself (400, 404, 422): its own answer.
            return Ok((t.clone(), r));
        }
        Err(last.unwrap_or_else(|| {
            error_response(
                StatusCode::BAD_GATEWAY,
                "bad_gateway",
                "nowhere to send the request",
                0,
            )
        }))
    }

    /// A POST whose body could not be read (too large, too slow, cut off) is refused in
    /// OpenAI's shape.
    async fn post(&self, path: &str, headers: HeaderMap, body: Body_) -> Response {
        let limit = self.0.max_body_bytes;
        let read = axum::body::to_bytes(body, limit);
        let (status, code, msg) = match tokio::time::timeout(self.0.body_read, read).await {
            Ok(Ok(b)) => return self.forward(path, headers, b).await,
            Ok(Err(e)) => {
                let e = e.into_inner();
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    self.0.metrics.limit_hit("body_bytes");
                    (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "request_too_large",
                        format!("the request body is over {limit} bytes (--max-body-bytes)"),
                    )
                } else {
                    (
                        StatusCode::BAD_REQUEST,
                        "invalid_request",
                        format!("the request body could not be read: {e}"),
                    )
                }
            }
            Err(_) => {
                self.0.metrics.limit_hit("body_read_ms");
                (
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} ms (--body-read-ms)",
                        self.0.body_read.as_millis()
                    ),
                )
            }
        };
        let r = error_response(status, code, &msg, 0);
        self.answered("POST", path, "", Instant::now(), &r);
        r
    }

    async fn forward(&self, path: &str, headers: HeaderMap, body: Bytes) -> Response {
        let received = Instant::now();
        let own = format!(
            "{}-{}",
            self.0.id_prefix,
            self.0.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let client = client_request_id(&headers);
        // The engine's id of the request: unique even when clients repeat theirs (vLLM refuses
        // a second request under an id still running), the client's first for tracing.
        let upstream = client
            .as_ref()
            .map_or_else(|| own.clone(), |c| format!("{c}-{own}"));
        let id = client.unwrap_or_else(|| own.clone());
        let mut resp = self.forward_as(path, &headers, body, own, &upstream).await;
        if let Ok(v) = HeaderValue::from_str(&id) {
            resp.headers_mut().insert("x-request-id", v);
        }
        self.answered("POST", path, &id, received, &resp);
        resp
    }

    /// Counts an answer by status and writes its access log line.
    fn answered(&self, method: &str, path: &str, id: &str, since: Instant, resp: &Response) {
        self.count(resp.status());
        let worker = resp
            .headers()
            .get(WORKER_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        tracing::info!(
            target: "kvplane::access",
            method,
            path,
            status = resp.status().as_u16(),
            request_id = id,
            worker,
            ms = since.elapsed().as_secs_f64() * 1000.0,
            "request"
        );
    }

    /// `forward`'s work: `request_id` names it to kvplane, `upstream_id` to the engine.
    async fn forward_as(
        &self,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
        request_id: String,
        upstream_id: &str,
    ) -> Response {
        let received = Instant::now();
        let (targets, ticket) = match self.pick(path, headers, &body, &request_id).await {
            Ok(t) => t,
            Err(r) => return r,
        };
        let (target, upstream) = match self.send(&targets, headers, upstream_id).await {
            Ok(sent) => sent,
            Err(r) => {
                self.report_failed(request_id, 0.0, ticket.as_ref(), None);
                return r;
            }
        };
        let status =
            StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        if let Some(b) = target.bedrock.clone() {
            return self
                .bedrock_answer(&target, &b, upstream, request_id, received, ticket.as_ref())
                .await;
        }
        let content_type = upstream
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .cloned();
        // A streamed answer's first chunk carries the first token: reported at once, so the
        // replica stops counting the request as waiting on its engine long before its end.
        let streamed = status.is_success()
            && content_type
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
        // An alternative served it: its reports say which.
        let served = target.served.clone();
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
                            let (ms, report) = app.first_token(
                                &request_id,
                                received,
                                streamed,
                                ticket.as_ref(),
                                served.as_ref(),
                            );
                            first_at = Some(ms);
                            first_report = report;
                        }
                        tail.keep(&bytes);
                        if tx.send(Ok(bytes)).await.is_err() {
                            app.report_after(
                                first_report.take(),
                                tail.report(
                                    request_id,
                                    first_at.unwrap_or(0.0),
                                    Outcome::Cancelled,
                                ),
                                ticket.as_ref(),
                                served.as_ref(),
                            );
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e))).await;
                        app.report_after(
                            first_report.take(),
                            tail.report(request_id, first_at.unwrap_or(0.0), Outcome::Error),
                            ticket.as_ref(),
                            served.as_ref(),
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
                tail.report(request_id, first_at.unwrap_or(0.0), outcome),
                ticket.as_ref(),
                served.as_ref(),
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

    /// A Bedrock provider's answer in OpenAI's shape (a Converse answer read whole; a
    /// ConverseStream one told while it arrives), reported as any answer is.
    async fn bedrock_answer(
        &self,
        target: &Target,
        call: &crate::target::BedrockCall,
        upstream: reqwest::Response,
        request_id: String,
        received: Instant,
        ticket: Option<&Ticket>,
    ) -> Response {
        let status = upstream.status();
        let name = target.provider.as_deref().unwrap_or(&target.label);
        if status.is_success() && call.asked.stream {
            let content_type = upstream
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none");
            if content_type.starts_with(crate::bedrock::stream::CONTENT_TYPE) {
                return self.bedrock_stream(target, call, upstream, request_id, received, ticket);
            }
            let message = format!(
                "provider {name} answered a stream as {content_type}, not as an event stream"
            );
            tracing::warn!(target = target.label, "{message}");
            self.report_failed(request_id, 0.0, ticket, target.served.as_ref());
            return error_response(StatusCode::BAD_GATEWAY, "bad_gateway", &message, 0);
        }
        let body = match upstream.bytes().await {
            Ok(b) => b,
            Err(e) => {
                self.report_failed(request_id, 0.0, ticket, target.served.as_ref());
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("provider {name} did not answer whole: {}", e.without_url()),
                    0,
                );
            }
        };
        let ttft_ms = received.elapsed().as_secs_f64() * 1000.0;
        self.0.metrics.ttft_seconds.observe(ttft_ms / 1000.0);
        let answer = if status.is_success() {
            crate::bedrock::openai_answer(&body, call.asked, &call.model, &request_id, unix_s())
                .map_err(|e| {
                    error_response(
                        StatusCode::BAD_GATEWAY,
                        "bad_gateway",
                        &format!("provider {name}: {e}"),
                        0,
                    )
                })
        } else {
            let said = crate::bedrock::error_message(&body);
            Err(match status.as_u16() {
                // The model timed out, or failed: the provider's failure, not the request's.
                408 => error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    &format!("provider {name} timed out: {said}"),
                    0,
                ),
                424 => error_response(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("provider {name} failed: {said}"),
                    0,
                ),
                // What Bedrock says of the request itself (400, 404, 422), in OpenAI's shape.
                code => error_response(
                    StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
                    "invalid_request",
                    &said,
                    0,
                ),
            })
        };
        match answer {
            Ok((bytes, used)) => {
                // Converse counts what the request used, whatever the client asked to see.
                self.report_after(
                    None,
                    UsageReport {
                        request_id,
                        prompt_tokens: used.prompt_tokens,
                        completion_tokens: used.completion_tokens,
                        observed_ttft_ms: ttft_ms,
                        outcome: Outcome::Success.into(),
                        ..Default::default()
                    },
                    ticket,
                    target.served.as_ref(),
                );
                provider_answer(Body::from(bytes), "application/json", &target.label)
            }
            Err(resp) => {
                self.report_failed(request_id, ttft_ms, ticket, target.served.as_ref());
                resp
            }
        }
    }

    /// A Bedrock provider's ConverseStream answer, told as OpenAI's events while it arrives:
    /// its first text is the first token (reported at once), Converse's own counts the final
    /// report's. A stream that fails (an exception frame, a cut) ends with an error event.
    fn bedrock_stream(
        &self,
        target: &Target,
        call: &crate::target::BedrockCall,
        upstream: reqwest::Response,
        request_id: String,
        received: Instant,
        ticket: Option<&Ticket>,
    ) -> Response {
        let mut answer = ConverseStream::new(call.asked, &call.model, &request_id, unix_s());
        let (app, ticket, served) = (self.clone(), ticket.cloned(), target.served.clone());
        let label = target.label.clone();
        let mut upstream_body = upstream.bytes_stream();
        let stream = async_stream_body(move |tx| async move {
            let mut first_at: Option<f64> = None;
            let mut first_report = None;
            let mut failed = None;
            let outcome = loop {
                // A client that left ends the provider's call at once, not at its next chunk.
                let next = tokio::select! {
                    next = upstream_body.next() => next,
                    () = tx.closed() => break Outcome::Cancelled,
                };
                let bytes = match next {
                    None => match answer.finish() {
                        Ok(done) => {
                            let _ = tx.send(Ok(done)).await;
                            break Outcome::Success;
                        }
                        Err(e) => {
                            failed = Some(e);
                            break Outcome::Error;
                        }
                    },
                    Some(Err(e)) => {
                        failed = Some(BedrockError::Answer(e.without_url().to_string()));
                        break Outcome::Error;
                    }
                    Some(Ok(bytes)) => bytes,
                };
                let (events, error) = answer.feed(&bytes);
                if first_at.is_none() && answer.text_started() {
                    let (ms, report) = app.first_token(
                        &request_id,
                        received,
                        true,
                        ticket.as_ref(),
                        served.as_ref(),
                    );
                    first_at = Some(ms);
                    first_report = report;
                }
                if !events.is_empty() && tx.send(Ok(events)).await.is_err() {
                    break Outcome::Cancelled;
                }
                if let Some(e) = error {
                    failed = Some(e);
                    break Outcome::Error;
                }
            };
            if let Some(e) = failed {
                tracing::warn!(target = label, error = %e, "the provider's stream failed");
                let _ = tx.send(Ok(ConverseStream::error_event(&e))).await;
            }
            let used = answer.used();
            let counted = used.unwrap_or_default();
            // Not counted: an answer that did not fail keeps its reservation, as does one
            // that failed once Bedrock took the request (a frame came: it counts the tokens).
            let usage_unknown = used.is_none() && (outcome != Outcome::Error || answer.began());
            app.report_after(
                first_report,
                UsageReport {
                    request_id,
                    prompt_tokens: counted.prompt_tokens,
                    completion_tokens: counted.completion_tokens,
                    observed_ttft_ms: first_at.unwrap_or(0.0),
                    outcome: outcome.into(),
                    usage_unknown,
                    ..Default::default()
                },
                ticket.as_ref(),
                served.as_ref(),
            );
        });
        provider_answer(
            Body::from_stream(stream),
            "text/event-stream",
            &target.label,
        )
    }

    /// A request's first token, `received` after it came: observed, and for a streamed
    /// answer reported at once. Its time in ms and the report's handle.
    fn first_token(
        &self,
        request_id: &str,
        received: Instant,
        streamed: bool,
        ticket: Option<&Ticket>,
        served: Option<&Endpoint>,
    ) -> (f64, Option<JoinHandle<()>>) {
        let t = received.elapsed().as_secs_f64();
        self.0.metrics.ttft_seconds.observe(t);
        let report = streamed
            .then(|| self.report_first_token(request_id.to_owned(), t * 1000.0, ticket, served))
            .flatten();
        (t * 1000.0, report)
    }

    /// Reports a streamed request's first token (see `UsageReport.first_token`); the handle
    /// of the report in flight, which the final report waits for.
    fn report_first_token(
        &self,
        request_id: String,
        ttft_ms: f64,
        ticket: Option<&Ticket>,
        served: Option<&Endpoint>,
    ) -> Option<JoinHandle<()>> {
        let report = UsageReport {
            request_id,
            observed_ttft_ms: ttft_ms,
            first_token: true,
            served: served.cloned(),
            ..Default::default()
        };
        self.send_report(report, ticket, None)
    }

    /// Sends `report` to the replicas in the background, after the report `after` (if any),
    /// with the request's ticket (naming the replica that routed it).
    fn send_report(
        &self,
        mut report: UsageReport,
        ticket: Option<&Ticket>,
        after: Option<JoinHandle<()>>,
    ) -> Option<JoinHandle<()>> {
        let Mode::Kvplane(_) = &self.0.mode else {
            return None;
        };
        report.ticket = ticket.cloned();
        report.routed_by = ticket.map_or(0, |t| t.routed_by);
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

    /// Settles a request that failed before any usage: an error, nothing used.
    fn report_failed(
        &self,
        request_id: String,
        ttft_ms: f64,
        ticket: Option<&Ticket>,
        served: Option<&Endpoint>,
    ) {
        let report = AnswerTail::default().report(request_id, ttft_ms, Outcome::Error);
        self.report_after(None, report, ticket, served);
    }

    /// Sends a request's final report (its usage and outcome) after its first-token report.
    fn report_after(
        &self,
        first: Option<JoinHandle<()>>,
        mut report: UsageReport,
        ticket: Option<&Ticket>,
        served: Option<&Endpoint>,
    ) {
        report.served = served.cloned();
        self.send_report(report, ticket, first);
    }
}

/// Now, in Unix seconds (an answer's `created`).
fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A provider's answer told in OpenAI's shape: `body` of `content_type`, naming the target.
fn provider_answer(body: Body, content_type: &'static str, label: &str) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Ok(v) = HeaderValue::from_str(label) {
        resp.headers_mut().insert(WORKER_HEADER, v);
    }
    resp
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
