//! vLLM's KV-event publisher: a ZMQ PUB socket sending `[topic, seq (u64 BE), payload]` per
//! batch, and a ROUTER replay socket answering `["", start_seq]` with every buffered batch from
//! `start_seq` on (`["", topic, seq, payload]`) and an end marker whose seq is -1.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvplane_state::KvBatch;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The end-of-replay sequence (-1 as 8 bytes).
pub const END_OF_REPLAY: [u8; 8] = [0xff; 8];

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Sends batches; cheap to clone.
#[derive(Debug, Clone)]
pub struct KvPublisher {
    tx: mpsc::UnboundedSender<(f64, KvBatch)>,
    drop_next: Arc<std::sync::atomic::AtomicU64>,
}

/// Bound endpoints (with the ports actually used).
#[derive(Debug, Clone)]
pub struct PublisherEndpoints {
    pub publish: String,
    pub replay: String,
}

impl KvPublisher {
    /// Binds both sockets and starts the publisher tasks.
    pub async fn start(
        pub_endpoint: &str,
        replay_endpoint: &str,
        topic: String,
        buffer_steps: usize,
    ) -> Result<(Self, PublisherEndpoints), zeromq::ZmqError> {
        let mut publisher = PubSocket::new();
        let bound_pub = publisher.bind(pub_endpoint).await?;
        let mut router = RouterSocket::new();
        let bound_replay = router.bind(replay_endpoint).await?;
        let buffer: Buffer = Arc::default();
        let (tx, mut rx) = mpsc::unbounded_channel::<(f64, KvBatch)>();
        let drop_next = Arc::new(std::sync::atomic::AtomicU64::new(0));
        {
            let buffer = buffer.clone();
            let topic = Bytes::from(topic.clone().into_bytes());
            let drop_next = drop_next.clone();
            tokio::spawn(async move {
                let mut seq = 0u64;
                while let Some((ts, batch)) = rx.recv().await {
                    let payload = Bytes::from(kvplane_ingest::vllm::encode_batch(ts, &batch));
                    {
                        let mut b = buffer.lock().unwrap_or_else(|p| p.into_inner());
                        b.push_back((seq, payload.clone()));
                        while b.len() > buffer_steps {
                            b.pop_front();
                        }
                    }
                    let dropping = drop_next
                        .fetch_update(
                            std::sync::atomic::Ordering::SeqCst,
                            std::sync::atomic::Ordering::SeqCst,
                            |n| n.checked_sub(1),
                        )
                        .is_ok();
                    if !dropping {
                        let frames = vec![
                            topic.clone(),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload,
                        ];
                        if let Ok(msg) = ZmqMessage::try_from(frames)
                            && let Err(e) = publisher.send(msg).await
                        {
                            tracing::warn!(error = %e, seq, "zmq publish failed");
                        }
                    } else {
                        tracing::info!(seq, "dropping a kv batch on purpose (replay still has it)");
                    }
                    seq += 1;
                }
            });
        }
        {
            let topic = Bytes::from(topic.into_bytes());
            tokio::spawn(async move {
                loop {
                    let msg = match router.recv().await {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(error = %e, "replay socket receive failed");
                            continue;
                        }
                    };
                    let frames = msg.into_vec();
                    let Some(identity) = frames.first().cloned() else {
                        continue;
                    };
                    let start = frames
                        .iter()
                        .skip(1)
                        .find(|f| f.len() == 8)
                        .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
                        .map_or(0, u64::from_be_bytes);
                    let batches: Vec<(u64, Bytes)> = buffer
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .cloned()
                        .collect();
                    for (seq, payload) in batches {
                        let reply = vec![
                            identity.clone(),
                            Bytes::new(),
                            topic.clone(),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload,
                        ];
                        if let Ok(m) = ZmqMessage::try_from(reply) {
                            let _ = router.send(m).await;
                        }
                    }
                    let end = vec![
                        identity,
                        Bytes::new(),
                        topic.clone(),
                        Bytes::copy_from_slice(&END_OF_REPLAY),
                        Bytes::new(),
                    ];
                    if let Ok(m) = ZmqMessage::try_from(end) {
                        let _ = router.send(m).await;
                    }
                }
            });
        }
        Ok((
            Self { tx, drop_next },
            PublisherEndpoints {
                publish: bound_pub.to_string(),
                replay: bound_replay.to_string(),
            },
        ))
    }

    pub fn publish(&self, ts: f64, batch: KvBatch) {
        let _ = self.tx.send((ts, batch));
    }

    /// The next `n` batches go to the replay buffer but not onto the PUB socket.
    pub fn drop_next(&self, n: u64) {
        self.drop_next
            .fetch_add(n, std::sync::atomic::Ordering::SeqCst);
    }
}
