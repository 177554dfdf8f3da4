//! Errors at the ingest boundary.

/// A vLLM batch that cannot be decoded at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is not complete msgpack: {0}")]
    Msgpack(String),
    #[error("payload has {0} trailing bytes after the batch")]
    TrailingBytes(usize),
    #[error("batch must be an array [ts, events, dp_rank] or a map, got {0}")]
    BatchShape(&'static str),
    #[error("batch field {field}: {reason}")]
    BatchField { field: &'static str, reason: String },
}

/// Failures of the NATS side.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("jetstream stream {stream}: {reason}")]
    Stream { stream: String, reason: String },
    #[error("jetstream consumer: {0}")]
    Consumer(String),
    #[error("proposing to the log failed: {0}")]
    Propose(#[from] kvplane_state::ProposeError),
}
