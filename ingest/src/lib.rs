//! How engine messages reach the state: vLLM KV-event decoding, the NATS subject scheme,
//! and the JetStream consumer that batches messages into log entries.

pub mod bridge;
mod consumer;
mod convert;
mod error;
mod message;
mod metrics;
mod nats_auth;
pub mod scrape;
mod subject;
pub mod vllm;

pub use consumer::{IngestConfig, Ingestor, ensure_stream};
pub use convert::{Converted, Rejected, convert};
pub use error::{DecodeError, IngestError};
pub use message::{MetricsMessage, WorkerMessage, WorkerStatus};
pub use metrics::{IngestMetrics, RejectReason};
pub use nats_auth::{NatsAuth, NatsAuthError};
pub use subject::{
    MessageKind, STREAM_SUBJECTS, Subject, bridge_inbox_prefix, kv_rank_subject, kv_subject,
    metrics_subject, worker_subject,
};
