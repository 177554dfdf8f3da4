//! Logging and tracing.
//!
//! - Logs: structured `tracing` events to stderr, as text or JSON lines; `RUST_LOG` overrides
//!   the default level (`info`).
//! - Traces: OpenTelemetry, exported over OTLP/gRPC when the standard variables ask for it
//!   (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
//!   `OTEL_TRACES_EXPORTER=otlp`; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn
//!   it off; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
//!   `OTEL_BSP_*` as the SDK reads them). Off by default. kvplane's spans are at debug level
//!   and only the trace layer asks for them, so with tracing off they are never created.
//! - Trace context: W3C `traceparent`/`tracestate` from gRPC metadata (see [`GrpcTraceLayer`])
//!   and from the gateway's HTTP headers, so a caller's trace continues through kvplane.

use std::sync::OnceLock;
use std::task::{Context, Poll};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, filter};

use crate::config::LogFormat;

static TRACING_ON: OnceLock<bool> = OnceLock::new();

/// Whether traces are exported (then requests' trace context is read).
pub fn tracing_on() -> bool {
    TRACING_ON.get().copied().unwrap_or(false)
}

/// Keeps the trace exporter; [`Telemetry::shutdown`] flushes what is buffered.
#[must_use]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    pub fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            eprintln!("kvplane: trace export did not flush: {e}");
        }
    }
}

fn env_on(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Whether the `OTEL_*` environment asks for OTLP trace export.
pub fn otlp_requested() -> bool {
    let disabled = env_on("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let exporter = env_on("OTEL_TRACES_EXPORTER").map(|v| v.to_ascii_lowercase());
    if disabled || exporter.as_deref() == Some("none") {
        return false;
    }
    exporter.as_deref() == Some("otlp")
        || env_on("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || env_on("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
}

/// Installs the global subscriber (inside a Tokio runtime: the exporter's client needs one).
/// `service` names the process when `OTEL_SERVICE_NAME` does not.
pub fn init(format: LogFormat, service: &str) -> Telemetry {
    let logs = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a terminal: a log written to a file or collected stays plain text.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).boxed(),
    }
    .with_filter(logs);
    let provider = if otlp_requested() {
        match exporter(service) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("kvplane: tracing off: {e}");
                None
            }
        }
    } else {
        None
    };
    let _ = TRACING_ON.set(provider.is_some());
    let traces = provider.as_ref().map(|p| {
        // kvplane's own spans (debug level and above), nothing from its dependencies.
        let ours = filter::filter_fn(|m| m.target().starts_with("kvplane"));
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("kvplane"))
            .with_filter(ours)
            .with_filter(filter::LevelFilter::DEBUG)
    });
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(traces)
        .try_init();
    Telemetry { provider }
}

fn exporter(service: &str) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if env_on("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Makes `span` a child of the W3C trace context in `headers`, if any.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// A tower layer for the gRPC server: each call runs in a `grpc` span (method, status) whose
/// parent is the caller's trace context. Does nothing when tracing is off.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcTraceLayer;

impl<S> tower::Layer<S> for GrpcTraceLayer {
    type Service = GrpcTrace<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcTrace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct GrpcTrace<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for GrpcTrace<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        std::pin::Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !tracing_on() {
            return futures::future::Either::Left(self.inner.call(req));
        }
        let span = tracing::debug_span!(
            target: "kvplane::grpc",
            "grpc",
            otel.name = %req.uri().path(),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.method = %req.uri().path(),
        );
        continue_trace(&span, req.headers());
        let fut = {
            let _enter = span.enter();
            self.inner.call(req)
        };
        futures::future::Either::Right(Box::pin(fut.instrument(span)))
    }
}
