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

/// A cause from async-nats, whose error types differ by call.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Failures of the NATS side.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("jetstream stream {stream}: {reason}")]
    Stream { stream: String, reason: String },
    #[error("jetstream consumer: cannot create it: {0}")]
    CreateConsumer(BoxError),
    #[error("jetstream consumer: cannot read messages: {0}")]
    Messages(BoxError),
    #[error("jetstream consumer: the message stream ended")]
    Ended,
    #[error(
        "jetstream consumer: stalled: nothing delivered for {idle:?} while the stream holds {expected}..={last}"
    )]
    Stalled {
        expected: u64,
        last: u64,
        idle: std::time::Duration,
    },
    #[error("jetstream consumer: a message without stream info: {0}")]
    NoInfo(BoxError),
    #[error("proposing to the log failed: {0}")]
    Propose(#[from] kvplane_state::ProposeError),
}
