//! `kvplane gateway`: a thin OpenAI-compatible HTTP front for a vLLM fleet.
//!
//! For each `POST /v1/completions` or `/v1/chat/completions` it takes the tenant from a header,
//! asks a kvplane replica where the request goes (failing over between replicas), forwards the
//! (possibly rewritten) body to the chosen engine, streams the answer back unchanged, and
//! reports the usage it saw (tokens, observed time to first token) with `ReportUsage`. A
//! request kvplane sends to a provider goes to its base URL over HTTPS (rustls) with its
//! credentials ([`Secrets`]), or, for a Bedrock provider, to its Converse API signed with SigV4
//! (answered in OpenAI's shape); one whose target does not answer goes to the next of the Route
//! answer's alternatives before any byte reached the client.
//! Rejections become 429 (rate limited, with `Retry-After`), 503 (no capacity), 404 (unknown
//! model) or 400, with kvplane's reason in an OpenAI-style error body.
//!
//! A `round-robin` mode skips kvplane and cycles over a fixed engine list: the baseline a
//! Kubernetes Service gives, for comparisons.

mod bedrock;
mod errors;
mod metrics;
mod proxy;
mod replicas;
mod secrets;
mod target;

pub use metrics::GatewayMetrics;
pub use proxy::{GatewayConfig, GatewayError, Strategy, run};
pub use replicas::Replicas;
pub use secrets::{SecretError, Secrets};

/// Response header naming the engine that served a request (`pool/worker`, or the engine URL
/// in round-robin mode).
pub const WORKER_HEADER: &str = "x-kvplane-worker";
