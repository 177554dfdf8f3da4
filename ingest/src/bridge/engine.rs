//! The engine side: the engine's ZMQ PUB socket and its replay socket.
//!
//! Batches are forwarded in the engine's sequence order. A gap is filled from replay; a batch
//! replay no longer has is counted lost and a clear goes out in its place. When the engine
//! closes its sockets (it stopped, or restarted) the bridge reconnects both sockets and asks
//! replay for the last batch it forwarded: the same bytes mean the same engine, anything else
//! a new one, whose batches are forwarded from its first after a clear of the old one's. A
//! sequence below the expected one is a duplicate when the bridge forwarded exactly that
//! batch, and a restart otherwise.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::publish::{Outgoing, Resume};
use super::{BridgeConfig, BridgeMetrics, cleared_batch, digest};

/// How many forwarded batches are remembered to tell a duplicate from a restarted engine.
const RECENT: usize = 4096;

/// Sequence state of the engine's stream as the bridge has forwarded it.
struct Forwarder {
    expected: Option<u64>,
    /// A batch the stream holds only some parts of: its sequence, how many, of how many.
    partial: Option<(u64, (usize, usize))>,
    /// The last batches forwarded, oldest first: (sequence, digest).
    recent: VecDeque<(u64, u64)>,
    /// A replay answer did not finish: what is left of it would be read as the next one's, so
    /// the sockets are made anew.
    stale: bool,
    /// A batch was lost on a full queue: a clear goes out before the next batch.
    owe_clear: bool,
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    incarnation: String,
    sent: u64,
    dp_rank: u32,
}

impl Forwarder {
    fn send(&mut self, seq: Option<u64>, payload: Bytes) {
        let skip_parts = match (self.partial, seq) {
            (Some((p, done)), Some(s)) if p == s => {
                self.partial = None;
                Some(done)
            }
            _ => None,
        };
        if let Some(s) = seq {
            self.recent.push_back((s, digest(&payload)));
            if self.recent.len() > RECENT {
                self.recent.pop_front();
            }
            self.expected = Some(s + 1);
        }
        // A clear still owed goes first; while it cannot, later batches are lost too (they
        // would only be cleared after it).
        if !self.pay_clear() || !self.enqueue(seq, payload, skip_parts) {
            // NATS is behind by more than max_pending batches: this one is lost, and what
            // kvplane holds for this worker is cleared as soon as the queue has room.
            self.metrics.lost.inc();
            self.owe_clear = true;
            tracing::warn!(?seq, "pending queue full; batch lost");
        }
    }

    /// Sends the clear owed for batches lost on a full queue, if one is; false while it still
    /// cannot go. Also tried whenever the engine's socket is quiet, so it does not wait for the
    /// engine's next batch.
    fn pay_clear(&mut self) -> bool {
        if !self.owe_clear {
            return true;
        }
        self.owe_clear = !self.enqueue(None, cleared_batch(self.dp_rank), None);
        !self.owe_clear
    }

    /// Hands one message to the NATS side; false when its queue is full.
    fn enqueue(
        &mut self,
        seq: Option<u64>,
        payload: Bytes,
        skip_parts: Option<(usize, usize)>,
    ) -> bool {
        self.sent += 1;
        // Unique per bridge run and message; `sent` also separates an engine's sequences
        // before and after a restart.
        let msg_id = format!(
            "{}-{}-{}",
            self.incarnation,
            self.sent,
            seq.map_or(-1, i128::from)
        );
        self.tx
            .try_send(Outgoing {
                seq,
                msg_id,
                payload,
                skip_parts,
            })
            .is_ok()
    }

    /// kvplane forgets this worker rank's blocks.
    fn clear(&mut self) {
        self.send(None, cleared_batch(self.dp_rank));
    }

    /// Whether exactly this batch was forwarded under `seq`.
    fn already_sent(&self, seq: u64, payload: &[u8]) -> bool {
        let d = digest(payload);
        self.recent.iter().rev().any(|(s, h)| *s == seq && *h == d)
    }

    /// The engine started over: kvplane forgets what the old one held, and the new one's
    /// batches are forwarded from its first.
    fn restarted(&mut self, why: &str) {
        self.metrics.engine_restarts.inc();
        tracing::info!(expected = ?self.expected, "{why}: engine restarted");
        self.clear();
        self.recent.clear();
        self.partial = None;
        self.expected = Some(0);
    }
}

fn parse_seq(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// Both sockets, connected, and their events merged.
struct Sockets {
    sub: SubSocket,
    dealer: DealerSocket,
    events: futures::stream::Select<
        futures::channel::mpsc::Receiver<SocketEvent>,
        futures::channel::mpsc::Receiver<SocketEvent>,
    >,
}

async fn connect_sockets(
    cfg: &BridgeConfig,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Sockets> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut sub = SubSocket::new();
        let mut dealer = DealerSocket::new();
        let events = futures::stream::select(sub.monitor(), dealer.monitor());
        let ok = async {
            sub.connect(&cfg.zmq_pub).await?;
            sub.subscribe("").await?;
            dealer.connect(&cfg.zmq_replay).await?;
            Ok::<_, zeromq::ZmqError>(())
        }
        .await;
        match ok {
            Ok(()) => {
                return Some(Sockets {
                    sub,
                    dealer,
                    events,
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "engine zmq sockets not reachable yet");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Resolves when either socket loses its engine.
async fn disconnected(events: &mut (impl Stream<Item = SocketEvent> + Unpin)) {
    while let Some(ev) = events.next().await {
        if matches!(ev, SocketEvent::Disconnected(_)) {
            return;
        }
    }
    std::future::pending::<()>().await;
}

pub(super) async fn zmq_loop(
    cfg: BridgeConfig,
    resume: Option<Resume>,
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<BridgeMetrics>,
    mut resubscribe: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut f = Forwarder {
        // A batch cut in parts that did not all go out is forwarded again, from its next part.
        expected: resume.map(|r| match r.parts_done {
            Some(_) => r.seq,
            None => r.seq + 1,
        }),
        partial: resume.and_then(|r| r.parts_done.map(|done| (r.seq, done))),
        // The batch the stream holds last: catching up starts by checking the engine still
        // has it (the engine may have restarted while the bridge was away).
        // (A batch the stream holds only part of is forwarded again instead.)
        recent: resume
            .filter(|r| r.parts_done.is_none())
            .and_then(|r| r.digest.map(|d| (r.seq, d)))
            .into_iter()
            .collect(),
        stale: false,
        owe_clear: false,
        tx,
        metrics: metrics.clone(),
        incarnation: format!(
            "{}-{}-{}",
            cfg.worker,
            cfg.dp_rank.map_or(-1, i64::from),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ),
        sent: 0,
        dp_rank: cfg.dp_rank.unwrap_or(0),
    };
    'connect: loop {
        let Some(Sockets {
            mut sub,
            mut dealer,
            mut events,
        }) = connect_sockets(&cfg, &mut shutdown).await
        else {
            return;
        };
        tracing::info!(
            publish = cfg.zmq_pub,
            replay = cfg.zmq_replay,
            "subscribed to engine kv events"
        );
        // Whatever the engine published while we were away (or before the subscription took
        // effect) is in its replay buffer: catch up now instead of waiting for the next batch.
        // The same happens whenever the socket has been quiet for a second, which closes the race
        // between a catch-up and the subscription taking effect.
        catch_up(&cfg, &mut dealer, &mut f).await;
        loop {
            if std::mem::take(&mut f.stale) {
                tracing::info!("a replay answer did not finish; reconnecting");
                continue 'connect;
            }
            let msg = tokio::select! {
                biased;
                _ = shutdown.changed() => return,
                () = disconnected(&mut events) => {
                    metrics.engine_disconnects.inc();
                    tracing::info!("engine closed its zmq sockets; reconnecting");
                    continue 'connect;
                }
                _ = resubscribe.changed() => {
                    tracing::info!("engine came back; resubscribing");
                    continue 'connect;
                }
                m = sub.recv() => m,
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    f.pay_clear();
                    catch_up(&cfg, &mut dealer, &mut f).await;
                    continue;
                }
            };
            let frames = match msg {
                Ok(m) => m.into_vec(),
                Err(e) => {
                    tracing::warn!(error = %e, "zmq receive failed; reconnecting");
                    continue 'connect;
                }
            };
            // [topic, seq, payload]; the end-of-replay sequence is no batch's.
            let (3, Some(seq), Some(payload)) = (
                frames.len(),
                frames
                    .get(1)
                    .and_then(|s| parse_seq(s))
                    .filter(|s| *s != u64::MAX),
                frames.get(2).cloned(),
            ) else {
                metrics.malformed_frames.inc();
                tracing::warn!(
                    frames = frames.len(),
                    "zmq message is not [topic, seq, payload]; skipped"
                );
                continue;
            };
            match f.expected {
                Some(e) if seq < e && f.already_sent(seq, &payload) => continue,
                Some(e) if seq == e => {}
                Some(e) if seq > e => {
                    metrics.gaps.inc();
                    tracing::info!(expected = e, got = seq, "sequence gap; filling from replay");
                    fill(&cfg, &mut dealer, &mut f, e, seq).await;
                }
                Some(_) => {
                    f.restarted("engine sequence went backwards");
                    if seq > 0 {
                        fill(&cfg, &mut dealer, &mut f, 0, seq).await;
                    }
                }
                None if seq > 0 => {
                    metrics.gaps.inc();
                    tracing::info!(got = seq, "joined mid-stream; filling from replay");
                    fill(&cfg, &mut dealer, &mut f, 0, seq).await;
                }
                None => {}
            }
            f.send(Some(seq), payload);
        }
    }
}

/// Forwards what replay holds after the last batch forwarded (used on connect and when the
/// socket is quiet). Asking from that last batch tells whether the engine is still the one
/// that sent it.
async fn catch_up(cfg: &BridgeConfig, dealer: &mut DealerSocket, f: &mut Forwarder) {
    let last = f.recent.back().copied();
    let ask = match last {
        Some((s, _)) => s,
        None => f.expected.unwrap_or(0),
    };
    // No answer: nothing to learn until the engine answers.
    let Some(mut got) = replay(cfg, dealer, ask, u64::MAX, f).await else {
        return;
    };
    if let Some((s, d)) = last {
        match got.first() {
            Some((first, p)) if *first == s && digest(p) == d => {
                got.remove(0);
            }
            // Replay no longer holds our last batch: the engine moved on past its buffer.
            Some((first, _)) if *first > s => {}
            // Another batch under our last sequence, or nothing from it on: a new engine.
            _ => {
                f.restarted("replay does not hold the last batch forwarded");
                let Some(all) = replay(cfg, dealer, 0, u64::MAX, f).await else {
                    return;
                };
                got = all;
            }
        }
    }
    let from = f.expected.unwrap_or(0);
    let Some(first) = got.first().map(|(s, _)| *s) else {
        return;
    };
    if first > from {
        let lost = first - from;
        f.metrics.lost.inc_by(lost);
        tracing::warn!(
            from,
            first,
            lost,
            "replay no longer has every batch; clearing this worker in kvplane"
        );
        f.clear();
    }
    let mut next = first;
    for (s, p) in got {
        if s != next {
            break;
        }
        f.metrics.replayed.inc();
        f.send(Some(s), p);
        next = s + 1;
    }
    if next > first {
        f.metrics.gaps.inc();
        tracing::info!(from, to = next, "caught up from replay");
    }
}

/// Asks the replay socket for `from..to`: the batches it has, sorted, without duplicates.
/// `None` when the engine did not answer at all. An answer that does not finish in time marks
/// the sockets stale.
async fn replay(
    cfg: &BridgeConfig,
    dealer: &mut DealerSocket,
    from: u64,
    to: u64,
    f: &mut Forwarder,
) -> Option<Vec<(u64, Bytes)>> {
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .ok()?;
    dealer.send(request).await.ok()?;
    let mut got = Vec::new();
    let mut answered = false;
    let deadline = tokio::time::Instant::now() + cfg.replay_timeout;
    loop {
        let Ok(Ok(reply)) = tokio::time::timeout_at(deadline, dealer.recv()).await else {
            tracing::warn!("replay did not finish in time");
            // Only a partial answer leaves replies behind on the socket.
            f.stale = answered;
            break;
        };
        answered = true;
        let frames: Vec<Bytes> = reply
            .into_vec()
            .into_iter()
            .skip_while(|b| b.is_empty())
            .collect();
        // >= 0.26: [topic, seq, payload]; <= 0.25: [seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [_, s, p] => (parse_seq(s), p.clone()),
            // [seq, payload] (<= 0.25) or [topic, end marker].
            [a, b] => match parse_seq(a) {
                Some(s) => (Some(s), b.clone()),
                None => (parse_seq(b), Bytes::new()),
            },
            [s] => (parse_seq(s), Bytes::new()),
            _ => (None, Bytes::new()),
        };
        match seq {
            Some(u64::MAX) => break,
            Some(s) if s >= from && s < to => got.push((s, payload)),
            _ => {}
        }
    }
    got.sort_by_key(|(s, _)| *s);
    got.dedup_by_key(|(s, _)| *s);
    answered.then_some(got)
}

/// Asks the replay socket for `from..to` and forwards what it has, in order.
async fn fill(
    cfg: &BridgeConfig,
    dealer: &mut DealerSocket,
    f: &mut Forwarder,
    from: u64,
    to: u64,
) {
    let got = replay(cfg, dealer, from, to, f).await.unwrap_or_default();
    let recovered = got.len() as u64;
    let contiguous = got.first().is_some_and(|(s, _)| *s == from)
        && got.windows(2).all(|w| w[1].0 == w[0].0 + 1);
    let complete = recovered == to - from && contiguous;
    if !complete {
        let lost = (to - from).saturating_sub(recovered);
        f.metrics.lost.inc_by(lost);
        tracing::warn!(
            from,
            to,
            recovered,
            lost,
            "replay could not recover every batch; clearing this worker in kvplane"
        );
        // What kvplane holds for this worker is no longer trustworthy: reset it, then forward
        // the recovered tail only (earlier blocks' parents are gone with the reset).
        f.clear();
        for (s, p) in contiguous_tail(got, to) {
            f.metrics.replayed.inc();
            f.send(Some(s), p);
        }
        f.expected = Some(to);
        return;
    }
    for (s, p) in got {
        f.metrics.replayed.inc();
        f.send(Some(s), p);
    }
}

/// The longest run of consecutive sequences ending right before `to`.
fn contiguous_tail(mut got: Vec<(u64, Bytes)>, to: u64) -> Vec<(u64, Bytes)> {
    let mut next = to;
    let mut keep = 0;
    for (s, _) in got.iter().rev() {
        if *s + 1 == next {
            keep += 1;
            next = *s;
        } else {
            break;
        }
    }
    got.split_off(got.len() - keep)
}
