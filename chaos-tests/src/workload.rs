//! The workload: Route and ReportUsage from a client per tenant on every member, completions
//! through the gateway and through the members' endpoint picker, config writes, and KV batches from the engines (through their
//! bridges); each recording what it sent and what it was told.

use std::time::{Duration, Instant};

use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{
    PutConfigRequest, RejectCode, RouteRequest, RouteResponse, UsageReport,
    admin_client::AdminClient, route_response::Decision,
};
use kvplane_sim::KvPublisher;
use kvplane_state::{KvBatch, KvEvent, Tier};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::fleet::{POOL, TENANTS, WINDOW_MS, WORKERS};
use crate::history::{Admission, GATEWAY, Miss, Read, RouteOutcome, Shared, record};

/// Prompt and maximum output tokens of every request: what a client counts as admitted.
pub(crate) const PROMPT: u32 = 100;
pub(crate) const MAX_OUTPUT: u32 = 100;
/// How long one call may take before its client counts it failed.
const CALL: Duration = Duration::from_secs(2);

/// Starts every workload task on the members at `endpoints`; they stop when `stop` turns true.
/// With `duplicates`, some usage is reported twice (see [`report`]).
pub fn start(
    endpoints: &[String],
    gateway: &str,
    engines: Vec<KvPublisher>,
    history: &Shared,
    stop: &watch::Receiver<bool>,
    duplicates: bool,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    let members = Members::new(endpoints, duplicates);
    for node in 0..endpoints.len() {
        for (tenant, _) in TENANTS {
            tasks.spawn(router_client(
                node,
                members.clone(),
                tenant,
                history.clone(),
                stop.clone(),
            ));
        }
    }
    for (tenant, _) in TENANTS {
        tasks.spawn(burst_client(
            members.clone(),
            tenant,
            history.clone(),
            stop.clone(),
        ));
    }
    for (tenant, _) in TENANTS {
        tasks.spawn(crate::picker::client(
            endpoints.to_vec(),
            tenant,
            history.clone(),
            stop.clone(),
        ));
        tasks.spawn(gateway_client(
            gateway.to_owned(),
            tenant,
            history.clone(),
            stop.clone(),
        ));
    }
    tasks.spawn(config_writer(members, history.clone(), stop.clone()));
    tasks.spawn(kv_publisher(engines, history.clone(), stop.clone()));
    tasks
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

async fn connect(endpoint: &str) -> Option<Channel> {
    let e = Channel::from_shared(endpoint.to_owned()).ok()?;
    tokio::time::timeout(Duration::from_secs(1), e.connect())
        .await
        .ok()?
        .ok()
}

/// A channel to every member that connects when first used and again after a failure: for
/// the calls that go to another member than the client's own (reports retried elsewhere,
/// bursts, reads).
#[derive(Clone)]
struct Members {
    endpoints: Vec<String>,
    channels: Vec<Channel>,
    /// Report some usage twice although the first report was acknowledged.
    duplicates: bool,
}

impl Members {
    fn new(endpoints: &[String], duplicates: bool) -> Members {
        Members {
            duplicates,
            endpoints: endpoints.to_vec(),
            channels: endpoints
                .iter()
                .filter_map(|e| Channel::from_shared(e.clone()).ok())
                .map(|e| e.connect_timeout(Duration::from_secs(1)).connect_lazy())
                .collect(),
        }
    }

    fn router(&self, i: usize) -> RouterClient<Channel> {
        RouterClient::new(self.channels[i % self.channels.len()].clone())
    }

    fn len(&self) -> usize {
        self.channels.len()
    }
}

/// A call carrying its client's deadline (`grpc-timeout`), so a member that was paused past
/// it knows the client gave up.
fn with_deadline<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(CALL);
    r
}

/// Request `n` of `tenant`: prompts repeat every 50 requests, so some hit the cache.
fn request(tenant: &str, request_id: String, n: u64) -> RouteRequest {
    RouteRequest {
        request_id,
        tenant: tenant.into(),
        model: "m".into(),
        token_ids: prompt_ids(n),
        max_output_tokens: MAX_OUTPUT,
        ..Default::default()
    }
}

/// Request `n`'s prompt: [`PROMPT`] token ids, the same every 50 requests.
pub(crate) fn prompt_ids(n: u64) -> Vec<u32> {
    (0..PROMPT)
        .map(|t| t + 7 * u32::try_from(n % 50).unwrap_or(0))
        .collect()
}

/// What one Route call came to.
enum Called {
    Routed(Box<RouteResponse>),
    /// Answered, not routed (the limit, or another refusal): recorded.
    NotRouted,
    /// The call failed: recorded as a miss; the client should reconnect.
    Failed,
}

/// Sends `req` through `c` (member `node`) and records what it was told.
async fn route(
    c: &mut RouterClient<Channel>,
    node: usize,
    tenant: &'static str,
    req: RouteRequest,
    history: &Shared,
) -> Called {
    let used = u64::from(PROMPT + used_output(&req.request_id));
    let (sent, sent_ms) = (Instant::now(), now_ms());
    let answer = match tokio::time::timeout(CALL, c.route(with_deadline(req))).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(status)) => {
            miss(history, node, tenant, sent, status.to_string());
            return Called::Failed;
        }
        Err(_) => {
            miss(history, node, tenant, sent, "no answer within 2 s".into());
            return Called::Failed;
        }
    };
    let done_ms = now_ms();
    let outcome = match &answer.decision {
        // One of the engines, at the address its bridge announced.
        Some(Decision::Endpoint(e))
            if e.pool == POOL
                && e.worker_id.starts_with('w')
                && e.address.starts_with("http://127.0.0.1:") =>
        {
            RouteOutcome::Routed
        }
        Some(Decision::Rejection(j)) if j.code == i32::from(RejectCode::RateLimited) => {
            if j.reason.contains("fails closed") {
                record(history, |h| h.failed_closed += 1);
            }
            RouteOutcome::RateLimited
        }
        other => {
            let why = format!("refused: {other:?}");
            record(history, |h| {
                h.misses.push(Miss {
                    sent,
                    done: Instant::now(),
                    member: node,
                    why,
                });
            });
            RouteOutcome::Refused
        }
    };
    record(history, |h| {
        *h.routes.entry((node, tenant, outcome)).or_default() += 1;
    });
    if outcome != RouteOutcome::Routed {
        return Called::NotRouted;
    }
    record(history, |h| {
        h.admissions.push(Admission {
            tenant,
            tokens: used,
            sent_ms,
            done_ms,
            charged_window_ms: answer
                .charges
                .iter()
                .find(|c| c.tenant == tenant)
                .map(|c| c.window_start_ms),
        });
    });
    Called::Routed(Box::new(answer))
}

/// The output tokens request `id` used: between none and all of [`MAX_OUTPUT`], so reports
/// give back what was reserved and not used (a lower bound of what the limit is charged).
fn used_output(id: &str) -> u32 {
    let h = id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    h % (MAX_OUTPUT + 1)
}

/// Reports a routed request's usage to `node`; when that fails, again to the next member (a
/// gateway's retry). With `members.duplicates`, every tenth request is reported a second time
/// to another member although the first was acknowledged (a retry whose first try landed).
/// Records a request the routing process settled and another member then asked the ledger to.
async fn report(
    c: &mut RouterClient<Channel>,
    members: &Members,
    node: usize,
    request_id: String,
    answer: Box<RouteResponse>,
    n: u64,
    history: &Shared,
) {
    let report = UsageReport {
        request_id: request_id.clone(),
        prompt_tokens: PROMPT,
        completion_tokens: used_output(&request_id),
        outcome: kvplane_proto::v1::Outcome::Success.into(),
        ticket: answer.ticket,
        routed_by: answer.routed_by,
        ..Default::default()
    };
    let send = |mut c: RouterClient<Channel>, r: UsageReport| async move {
        match tokio::time::timeout(CALL, c.report_usage(with_deadline(r))).await {
            Ok(Ok(ack)) => Some((ack.into_inner(), Instant::now())),
            _ => None,
        }
    };
    let first = send(c.clone(), report.clone()).await;
    let retry = first.is_none() || (members.duplicates && n.is_multiple_of(10));
    let second = if retry {
        send(members.router(node + 1), report).await
    } else {
        None
    };
    record(history, |h| {
        if first.is_none() && second.is_none() {
            h.reports_failed += 1;
        } else {
            h.reports_acked += 1;
        }
        if retry {
            h.reports_retried += 1;
        }
        // The routing process settled it, then the ledger was asked to: the second gives
        // back what the first already did, unless that process stopped in between.
        if let (Some((a, at)), Some((b, bt))) = (&first, &second)
            && a.known
            && b.settled_by_ledger
        {
            h.known_then_ledger.push((request_id, node, *at, *bt));
        }
    });
}

/// Routes `tenant`'s requests through member `node` as fast as they are answered, reporting
/// each routed one's usage.
async fn router_client(
    node: usize,
    members: Members,
    tenant: &'static str,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
    let endpoint = members.endpoints[node].clone();
    let mut client: Option<RouterClient<Channel>> = None;
    let mut n = 0u64;
    while !*stop.borrow() {
        let Some(c) = client.as_mut() else {
            let sent = Instant::now();
            client = connect(&endpoint).await.map(RouterClient::new);
            if client.is_none() {
                miss(&history, node, tenant, sent, "cannot connect".into());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        n += 1;
        let id = format!("{tenant}-{node}-{n}");
        match route(c, node, tenant, request(tenant, id.clone(), n), &history).await {
            Called::Routed(answer) => report(c, &members, node, id, answer, n, &history).await,
            // Pacing: refused clients leave the members some CPU.
            Called::NotRouted => tokio::time::sleep(Duration::from_millis(10)).await,
            Called::Failed => {
                client = None;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Requests in one burst.
const BURST: u64 = 24;

/// Idle, then a burst: every few windows, [`BURST`] requests of `tenant` at once over every
/// member, timed against a window boundary (just before, at, or just after it), where a
/// replica's grants renew and escrow is released.
async fn burst_client(
    members: Members,
    tenant: &'static str,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
    // Offsets from the boundary, in ms: bursts that straddle it and bursts right after it.
    const OFFSETS: [i64; 5] = [-150, -20, 0, 15, 120];
    let mut round = 0u64;
    while !*stop.borrow() {
        round += 1;
        // One to three windows idle, then to the chosen point around the next boundary.
        let offset = OFFSETS[usize::try_from(round).unwrap_or(0) % OFFSETS.len()];
        let idle = WINDOW_MS * (1 + round % 3);
        let now = now_ms();
        let boundary = (now + idle) / WINDOW_MS * WINDOW_MS;
        let at = boundary.saturating_add_signed(offset).max(now);
        tokio::time::sleep(Duration::from_millis(at - now)).await;
        let mut burst = JoinSet::new();
        for k in 0..BURST {
            let node = usize::try_from(k).unwrap_or(0) % members.len();
            let (members, history) = (members.clone(), history.clone());
            let n = round * BURST + k;
            burst.spawn(async move {
                let mut c = members.router(node);
                let id = format!("{tenant}-burst-{n}");
                let req = request(tenant, id.clone(), n);
                if let Called::Routed(answer) = route(&mut c, node, tenant, req, &history).await {
                    report(&mut c, &members, node, id, answer, n, &history).await;
                }
            });
        }
        while burst.join_next().await.is_some() {}
    }
}

/// Completions through the gateway, one at a time, as an OpenAI client sends them (the prompt
/// as token ids, so that it counts what the direct clients count): a 200 is an admission, a
/// 429 the limit, anything else a miss.
async fn gateway_client(
    gateway: String,
    tenant: &'static str,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
    let client = reqwest::Client::new();
    let url = format!("{gateway}/v1/completions");
    let mut n = 0u64;
    while !*stop.borrow() {
        n += 1;
        let body = serde_json::json!({
            "model": "m",
            "prompt": prompt_ids(n),
            "max_tokens": MAX_OUTPUT,
        });
        let (sent, sent_ms) = (Instant::now(), now_ms());
        let call = client
            .post(&url)
            .header("x-tenant", tenant)
            .timeout(Duration::from_secs(5))
            .json(&body)
            .send();
        let outcome = match call.await {
            Ok(r) if r.status() == 200 => {
                // The engines answer half the output asked for: the gateway reports that
                // usage and gives back what the request reserved and did not use. An answer
                // that says otherwise is a miss.
                let used = u64::from(PROMPT + MAX_OUTPUT / 2);
                let answer: serde_json::Value = r.json().await.unwrap_or_default();
                let usage = &answer["usage"];
                let said = usage["prompt_tokens"]
                    .as_u64()
                    .zip(usage["completion_tokens"].as_u64())
                    .map(|(p, c)| p + c);
                if said != Some(used) {
                    let why = format!("an answer's usage said {said:?} tokens, not {used}");
                    record(&history, |h| h.bad_answers.push(why));
                }
                let done_ms = now_ms();
                record(&history, |h| {
                    h.admissions.push(Admission {
                        tenant,
                        tokens: used,
                        sent_ms,
                        done_ms,
                        charged_window_ms: None,
                    });
                });
                RouteOutcome::Routed
            }
            Ok(r) if r.status() == 429 => RouteOutcome::RateLimited,
            Ok(r) => {
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                miss(&history, GATEWAY, tenant, sent, format!("{status}: {text}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => {
                miss(&history, GATEWAY, tenant, sent, e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        record(&history, |h| {
            *h.routes.entry((GATEWAY, tenant, outcome)).or_default() += 1;
        });
        if outcome == RouteOutcome::RateLimited {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub(crate) fn miss(
    history: &Shared,
    member: usize,
    tenant: &'static str,
    sent: Instant,
    why: String,
) {
    record(history, |h| {
        *h.routes
            .entry((member, tenant, RouteOutcome::Failed))
            .or_default() += 1;
        h.misses.push(Miss {
            sent,
            done: Instant::now(),
            member,
            why,
        });
    });
}

/// The tenant the read probes route for (no limit: probes spend no one's budget).
const READER: &str = "reader";

/// Writes a new pool object every 250 ms, through the members in turn. After each
/// acknowledged write, two reads at other members: one asking for that write's index
/// (`min_applied_index`), one linearizable, which must see every write acknowledged before
/// it was sent.
async fn config_writer(members: Members, history: Shared, stop: watch::Receiver<bool>) {
    let mut n = 0usize;
    while !*stop.borrow() {
        n += 1;
        let name = format!("chaos-{n}");
        let write = async {
            let mut admin = AdminClient::new(members.channels[n % members.len()].clone());
            admin
                .put_config(with_deadline(PutConfigRequest {
                    kind: "pool".into(),
                    name: name.clone(),
                    value: br#"{"block_size":16,"models":["chaos"]}"#.to_vec(),
                }))
                .await
                .ok()
                .map(|r| r.into_inner().index)
        };
        let acked = tokio::time::timeout(Duration::from_secs(5), write)
            .await
            .ok()
            .flatten();
        record(&history, |h| {
            if let Some(index) = acked {
                h.config_acked.push(name);
                h.acked_index = h.acked_index.max(index);
            } else {
                h.config_failed += 1;
            }
        });
        if let Some(index) = acked {
            read(&members, n + 1, index, false, &history).await;
        }
        let promised = record(&history, |h| h.acked_index);
        read(&members, n + 2, promised, true, &history).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A Route at member `node` that must decide from a state at `promised` or later: asking
/// for it (`min_applied_index`), or as a linearizable read sent after a write at `promised`
/// was acknowledged. Records whether the answer kept the promise.
async fn read(members: &Members, node: usize, promised: u64, linearizable: bool, h: &Shared) {
    let mut c = members.router(node);
    let req = RouteRequest {
        request_id: format!("read-{node}-{promised}-{linearizable}"),
        tenant: READER.into(),
        model: "m".into(),
        token_ids: vec![1; 32],
        max_output_tokens: 1,
        min_applied_index: if linearizable { 0 } else { promised },
        linearizable,
        ..Default::default()
    };
    let kind = if linearizable {
        "linearizable"
    } else {
        "min_applied_index"
    };
    let answer = tokio::time::timeout(CALL, c.route(with_deadline(req))).await;
    record(h, |h| match answer {
        Ok(Ok(r)) => {
            let at = r.into_inner().applied_index;
            h.reads.push(Read {
                kind,
                promised,
                answered: Some(at),
            });
        }
        // Refusing is allowed (a follower behind, no quorum): answering from before is not.
        _ => h.reads.push(Read {
            kind,
            promised,
            answered: None,
        }),
    });
}

/// Publishes a KV batch every 100 ms, each storing a chain of three new blocks on one of the
/// engines (`engines[w]` is worker `w`), in turn. What an engine publishes is out: its bridge
/// must deliver it, from the engine's replay when it was away.
async fn kv_publisher(engines: Vec<KvPublisher>, history: Shared, stop: watch::Receiver<bool>) {
    let mut i = 0u64;
    while !*stop.borrow() {
        i += 1;
        let w = usize::try_from(i).unwrap_or(0) % WORKERS;
        engines[w].publish(
            0.0,
            KvBatch {
                dp_rank: 0,
                events: events(i),
            },
        );
        record(&history, |h| h.published.push(w));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Blocks in each published chain.
const BLOCKS: u64 = 3;

/// Batch `i`'s events: a chain of [`BLOCKS`] blocks whose hashes no other batch uses, and the
/// removal of the last block its worker's previous batch (`i - WORKERS`) stored. Applied once
/// each and in order, a worker's `n` batches leave [`blocks_after`]`(n)` blocks; a batch applied
/// twice after the next one brings its removed block back, a lost or reordered one leaves a
/// different count.
pub(crate) fn events(i: u64) -> Vec<KvEvent> {
    let tokens: Vec<u32> = (0..16 * BLOCKS as u32)
        .map(|t| u32::try_from(i % 1_000_000).unwrap_or(0) * 64 + t)
        .collect();
    let mut events = vec![KvEvent::Stored {
        block_hashes: (0..BLOCKS).map(|b| i * 1_000 + b).collect(),
        parent_hash: None,
        token_ids: tokens,
        block_size: 16,
        lora_name: None,
        cache_salt: None,
        tier: Tier::Gpu,
    }];
    let workers = WORKERS as u64;
    if i > workers {
        events.push(KvEvent::Removed {
            block_hashes: vec![(i - workers) * 1_000 + BLOCKS - 1],
            tier: Tier::Gpu,
        });
    }
    events
}

/// The blocks a worker holds after `n` of its batches, each applied once, in order.
pub(crate) fn blocks_after(n: u64) -> u64 {
    BLOCKS * n - n.saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A reference model (a set of block hashes per worker) applying each batch's events.
    fn model(order: &[u64]) -> [usize; WORKERS] {
        let mut held: [BTreeSet<u64>; WORKERS] = Default::default();
        for &i in order {
            let w = usize::try_from(i).unwrap_or(0) % WORKERS;
            for e in events(i) {
                match e {
                    KvEvent::Stored { block_hashes, .. } => held[w].extend(block_hashes),
                    KvEvent::Removed { block_hashes, .. } => {
                        for h in block_hashes {
                            held[w].remove(&h);
                        }
                    }
                    _ => {}
                }
            }
        }
        held.map(|h| h.len())
    }

    #[test]
    fn batches_applied_once_in_order_leave_blocks_after_and_a_replay_or_a_loss_does_not() {
        let once: Vec<u64> = (1..=30).collect();
        let per_worker = (30 / WORKERS) as u64;
        assert_eq!(
            model(&once),
            [usize::try_from(blocks_after(per_worker)).unwrap_or(0); WORKERS]
        );
        // Batch 4 (worker 1) delivered again after batch 7 removed one of its blocks.
        let mut replayed = once.clone();
        replayed.insert(9, 4);
        assert_ne!(model(&replayed), model(&once));
        // Batch 10 lost; batches 13 and 16 swapped.
        let lost: Vec<u64> = once.iter().copied().filter(|i| *i != 10).collect();
        assert_ne!(model(&lost), model(&once));
        let mut swapped = once.clone();
        swapped.swap(12, 15);
        assert_ne!(model(&swapped), model(&once));
    }
}
