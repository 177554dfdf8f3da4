//! The JetStream consumer: reads the ingest stream in order from the recorded position,
//! turns messages into [`IngestItem`]s, and proposes them in batches.
//!
//! The consumer is an ordered one (no acks): a message the server delivered while the
//! connection was down is lost to it, and it notices only when a later message shows the gap.
//! So when two checks `stall_after` apart find the stream holding messages past the last one
//! proposed, and nothing arrived between them, consuming starts again from the recorded
//! position (counted as a stall).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig, stream};
use futures::StreamExt;
use kvplane_state::{Command, IngestBatch, IngestItem, Proposer};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use crate::subject::STREAM_SUBJECTS;
use crate::{IngestError, IngestMetrics, RejectReason};

/// How the consumer batches and what it accepts.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// JetStream stream name.
    pub stream: String,
    /// At most this many messages per log entry.
    pub max_batch_messages: usize,
    /// A batch closes this long after its first message at the latest.
    pub max_batch_delay: Duration,
    /// Larger payloads are rejected (`oversized`).
    pub max_message_bytes: usize,
    /// The state's name for this stream: its position is kept under it.
    pub source: kvplane_state::Source,
    /// Create the stream when it is missing (the node's own); another cluster's is that
    /// cluster's to create, and only read here.
    pub create_stream: bool,
    /// After this long without a message, the stream's end is read: a consumer behind it is
    /// stalled and started again from the recorded position.
    pub stall_after: Duration,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            stream: "KVPLANE".into(),
            max_batch_messages: 512,
            max_batch_delay: Duration::from_millis(5),
            max_message_bytes: 1 << 20,
            source: kvplane_state::Source::stream(),
            create_stream: true,
            stall_after: Duration::from_secs(2),
        }
    }
}

/// Gets the ingest stream, creating it (file storage, subjects `kvplane.>`) when missing.
pub async fn ensure_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<stream::Stream, IngestError> {
    js.get_or_create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![STREAM_SUBJECTS.to_owned()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| IngestError::Stream {
        stream: name.to_owned(),
        reason: e.to_string(),
    })
}

/// Consumes the stream and proposes what it reads.
pub struct Ingestor<P> {
    js: jetstream::Context,
    cfg: IngestConfig,
    proposer: P,
    metrics: Arc<IngestMetrics>,
}

impl<P: Proposer> Ingestor<P> {
    pub fn new(
        js: jetstream::Context,
        cfg: IngestConfig,
        proposer: P,
        metrics: Arc<IngestMetrics>,
    ) -> Self {
        Self {
            js,
            cfg,
            proposer,
            metrics,
        }
    }

    /// Runs until `shutdown` turns true. `resume_after` gives the last applied stream sequence;
    /// consumption (re)starts right after it, so nothing is skipped and nothing applied twice.
    pub async fn run(
        &self,
        resume_after: impl Fn() -> u64,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), IngestError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let start = resume_after() + 1;
            let mut stop = shutdown.clone();
            let attempt = async {
                let stream = if self.cfg.create_stream {
                    ensure_stream(&self.js, &self.cfg.stream).await?
                } else {
                    self.js
                        .get_stream(&self.cfg.stream)
                        .await
                        .map_err(|e| IngestError::Stream {
                            stream: self.cfg.stream.clone(),
                            reason: e.to_string(),
                        })?
                };
                backoff = Duration::from_millis(100);
                self.consume_from(&stream, start, &mut shutdown).await
            };
            // Reaching a server that is away can take its requests' timeouts: a term that
            // ends does not wait for them.
            let attempt = tokio::select! {
                a = attempt => a,
                _ = stop.wait_for(|s| *s) => return Ok(()),
            };
            match attempt {
                Ok(()) => return Ok(()),
                Err(IngestError::Propose(e)) => return Err(IngestError::Propose(e)),
                Err(e) => {
                    tracing::warn!(error = %e, start, "ingest consumer failed; restarting");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => return Ok(()),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn consume_from(
        &self,
        stream: &stream::Stream,
        start_sequence: u64,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), IngestError> {
        let consumer = stream
            .create_consumer(OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence { start_sequence },
                ..Default::default()
            })
            .await
            .map_err(|e| IngestError::CreateConsumer(e.into()))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| IngestError::Messages(e.into()))?;
        tracing::info!(start_sequence, "ingest consuming");
        let mut expected = start_sequence;
        let mut idle =
            tokio::time::interval_at(Instant::now() + self.cfg.stall_after, self.cfg.stall_after);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The position a check found behind the stream's end: a stall only when the next
        // check finds it still there (a message delivered while the first check waited on the
        // server is not one).
        let mut behind: Option<u64> = None;
        loop {
            let first = tokio::select! {
                biased;
                m = messages.next() => m,
                _ = shutdown.changed() => return Ok(()),
                _ = idle.tick() => {
                    behind = self.check_stalled(stream, expected, behind).await?;
                    continue;
                }
            };
            let Some(first) = first else {
                return Err(IngestError::Ended);
            };
            let first = first.map_err(|e| IngestError::Messages(e.into()))?;
            let deadline = Instant::now() + self.cfg.max_batch_delay;
            let mut batch = Batch::default();
            self.add(&mut batch, &first)?;
            while batch.len < self.cfg.max_batch_messages {
                match tokio::time::timeout_at(deadline, messages.next()).await {
                    Ok(Some(Ok(m))) => self.add(&mut batch, &m)?,
                    Ok(Some(Err(e))) => {
                        // Propose what we have; the restart resumes after it.
                        self.propose(batch, &mut expected).await?;
                        return Err(IngestError::Messages(e.into()));
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            self.propose(batch, &mut expected).await?;
            idle.reset();
            behind = None;
        }
    }

    /// Whether the stream holds messages from `expected` on that nothing delivers. Behind at
    /// this check: `expected`, for the next one to compare with; behind at two checks in a row
    /// with nothing delivered between them: an error (the caller starts again from the
    /// recorded position). Messages purged from the stream are not waited for, and a stream
    /// that cannot be read says nothing: the connection is away, and the client reconnects on
    /// its own.
    async fn check_stalled(
        &self,
        stream: &stream::Stream,
        expected: u64,
        behind: Option<u64>,
    ) -> Result<Option<u64>, IngestError> {
        let state = match stream.get_info().await {
            Ok(info) => info.state,
            Err(e) => {
                tracing::debug!(error = %e, stream = self.cfg.stream, "cannot read the stream's end");
                return Ok(None);
            }
        };
        let waiting =
            state.messages > 0 && state.last_sequence >= expected.max(state.first_sequence);
        if !waiting {
            return Ok(None);
        }
        if behind != Some(expected) {
            return Ok(Some(expected));
        }
        self.metrics.stalled(&self.cfg.source);
        Err(IngestError::Stalled {
            expected,
            last: state.last_sequence,
            idle: self.cfg.stall_after * 2,
        })
    }

    async fn propose(&self, batch: Batch, expected: &mut u64) -> Result<(), IngestError> {
        let (Some(first_seq), Some(last_seq)) = (batch.first_seq, batch.last_seq) else {
            return Ok(());
        };
        if first_seq != *expected {
            tracing::warn!(
                expected = *expected,
                got = first_seq,
                "stream sequence gap (messages removed from the stream before they were consumed)"
            );
        }
        *expected = last_seq + 1;
        let span = tracing::debug_span!(
            "ingest.batch",
            first_seq,
            last_seq,
            items = batch.items.len(),
            pending = batch.pending,
            index = tracing::field::Empty
        );
        let index = self
            .proposer
            .propose(Command::Ingest(IngestBatch {
                source: self.cfg.source.clone(),
                first_seq,
                last_seq,
                items: batch.items,
            }))
            .instrument(span.clone())
            .await?;
        span.record("index", index);
        self.metrics
            .batch(&self.cfg.source, last_seq, batch.pending);
        Ok(())
    }

    fn add(&self, batch: &mut Batch, msg: &jetstream::Message) -> Result<(), IngestError> {
        let info = msg.info().map_err(IngestError::NoInfo)?;
        let seq = info.stream_sequence;
        batch.first_seq.get_or_insert(seq);
        batch.last_seq = Some(seq);
        batch.pending = info.pending;
        batch.len += 1;
        if let Some(item) = self.convert(seq, msg.subject.as_str(), &msg.payload) {
            batch.items.push(item);
        }
        Ok(())
    }

    /// One message to an item; `None` when rejected (counted).
    fn convert(&self, seq: u64, subject: &str, payload: &[u8]) -> Option<IngestItem> {
        match crate::convert::convert(self.cfg.max_message_bytes, seq, subject, payload) {
            Ok(c) => {
                self.metrics.message(c.kind);
                for skipped in &c.skipped {
                    self.metrics.skipped(skipped.reason());
                    tracing::debug!(seq, subject, ?skipped, "vllm event skipped");
                }
                Some(c.item)
            }
            Err(r) => {
                if let Some(kind) = r.kind {
                    self.metrics.message(kind);
                }
                self.reject(r.reason, seq, subject, &r.detail)
            }
        }
    }

    fn reject(
        &self,
        reason: RejectReason,
        seq: u64,
        subject: &str,
        detail: &str,
    ) -> Option<IngestItem> {
        self.metrics.reject(reason);
        tracing::debug!(
            seq,
            subject,
            reason = reason.as_str(),
            detail,
            "ingest message rejected"
        );
        None
    }
}

#[derive(Default)]
struct Batch {
    first_seq: Option<u64>,
    last_seq: Option<u64>,
    pending: u64,
    len: usize,
    items: Vec<IngestItem>,
}
