//! The workload: Route and ReportUsage from a client per tenant on every member, config writes,
//! and KV batches on the stream; each recording what it sent and what it was told.

use std::time::{Duration, Instant};

use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{
    PutConfigRequest, RejectCode, RouteRequest, UsageReport, admin_client::AdminClient,
    route_response::Decision,
};
use kvplane_state::{KvBatch, KvEvent, Tier};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::fleet::{TENANTS, WORKERS};
use crate::history::{Admission, Miss, RouteOutcome, Shared, record};

/// Prompt and maximum output tokens of every request: what a client counts as admitted.
const PROMPT: u32 = 100;
const MAX_OUTPUT: u32 = 100;
/// How long one call may take before its client counts it failed.
const CALL: Duration = Duration::from_secs(2);

/// Starts every workload task on the members at `endpoints`; they stop when `stop` turns true.
pub fn start(
    endpoints: &[String],
    js: &async_nats::jetstream::Context,
    history: &Shared,
    stop: &watch::Receiver<bool>,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    for (node, endpoint) in endpoints.iter().enumerate() {
        for (tenant, _) in TENANTS {
            tasks.spawn(router_client(
                node,
                endpoint.clone(),
                tenant,
                history.clone(),
                stop.clone(),
            ));
        }
    }
    tasks.spawn(config_writer(
        endpoints.to_vec(),
        history.clone(),
        stop.clone(),
    ));
    tasks.spawn(kv_publisher(js.clone(), history.clone(), stop.clone()));
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

/// Routes `tenant`'s requests through member `node` as fast as they are answered, reporting
/// each routed one's usage (all it reserved: nothing is given back).
async fn router_client(
    node: usize,
    endpoint: String,
    tenant: &'static str,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
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
        let request_id = format!("{tenant}-{node}-{n}");
        let req = RouteRequest {
            request_id: request_id.clone(),
            tenant: tenant.into(),
            model: "m".into(),
            token_ids: (0..PROMPT)
                .map(|t| t + 7 * u32::try_from(n % 50).unwrap_or(0))
                .collect(),
            max_output_tokens: MAX_OUTPUT,
            ..Default::default()
        };
        let (sent, sent_ms) = (Instant::now(), now_ms());
        let answer = match tokio::time::timeout(CALL, c.route(req)).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                miss(&history, node, tenant, sent, status.to_string());
                client = None;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(_) => {
                miss(&history, node, tenant, sent, "no answer within 2 s".into());
                client = None;
                continue;
            }
        };
        let done_ms = now_ms();
        let outcome = match &answer.decision {
            Some(Decision::Endpoint(e)) if e.address.starts_with("http://w") => {
                RouteOutcome::Routed
            }
            Some(Decision::Rejection(j)) if j.code == i32::from(RejectCode::RateLimited) => {
                if j.reason.contains("fails closed") {
                    record(&history, |h| h.failed_closed += 1);
                }
                RouteOutcome::RateLimited
            }
            other => {
                let why = format!("refused: {other:?}");
                record(&history, |h| {
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
        record(&history, |h| {
            *h.routes.entry((node, tenant, outcome)).or_default() += 1;
            if outcome == RouteOutcome::Routed {
                h.admissions.push(Admission {
                    tenant,
                    tokens: u64::from(PROMPT + MAX_OUTPUT),
                    sent_ms,
                    done_ms,
                    charged_window_ms: answer
                        .charges
                        .iter()
                        .find(|c| c.tenant == tenant)
                        .map(|c| c.window_start_ms),
                });
            }
        });
        if outcome != RouteOutcome::Routed {
            // Pacing: refused clients leave the members some CPU.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let report = UsageReport {
            request_id,
            prompt_tokens: PROMPT,
            completion_tokens: MAX_OUTPUT,
            outcome: kvplane_proto::v1::Outcome::Success.into(),
            ticket: answer.ticket,
            ..Default::default()
        };
        let acked = matches!(
            tokio::time::timeout(CALL, c.report_usage(report)).await,
            Ok(Ok(_))
        );
        record(&history, |h| {
            if acked {
                h.reports_acked += 1;
            } else {
                h.reports_failed += 1;
            }
        });
    }
}

fn miss(history: &Shared, member: usize, tenant: &'static str, sent: Instant, why: String) {
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

/// Writes a new pool object every 250 ms, through the members in turn.
async fn config_writer(endpoints: Vec<String>, history: Shared, stop: watch::Receiver<bool>) {
    let mut n = 0usize;
    while !*stop.borrow() {
        n += 1;
        let name = format!("chaos-{n}");
        let write = async {
            let channel = connect(&endpoints[n % endpoints.len()]).await?;
            AdminClient::new(channel)
                .put_config(PutConfigRequest {
                    kind: "pool".into(),
                    name: name.clone(),
                    value: br#"{"block_size":16,"models":["chaos"]}"#.to_vec(),
                })
                .await
                .ok()
        };
        let acked = tokio::time::timeout(Duration::from_secs(5), write)
            .await
            .ok()
            .flatten()
            .is_some();
        record(&history, |h| {
            if acked {
                h.config_acked.push(name);
            } else {
                h.config_failed += 1;
            }
        });
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Publishes a KV batch every 100 ms, each storing a chain of three new blocks on one of the
/// workers; a batch counts once the stream acknowledged it (retried until then, or the end).
async fn kv_publisher(
    js: async_nats::jetstream::Context,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
    let mut i = 0u64;
    while !*stop.borrow() {
        i += 1;
        let w = usize::try_from(i).unwrap_or(0) % WORKERS;
        let worker = format!("w{w}");
        let subject = kvplane_ingest::kv_subject("gpu", &worker);
        let payload = chain(i);
        loop {
            if *stop.borrow() {
                return;
            }
            let acked = async {
                // One id per batch: a retry of a batch the stream holds is not stored twice.
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", format!("chaos-{i}").as_str());
                let ack = js
                    .publish_with_headers(subject.clone(), headers, payload.clone().into())
                    .await
                    .ok()?;
                tokio::time::timeout(Duration::from_secs(2), ack)
                    .await
                    .ok()?
                    .ok()
            };
            if let Some(ack) = acked.await {
                record(&history, |h| h.published.push((ack.sequence, w)));
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Blocks in each published chain.
pub(crate) const BLOCKS: u64 = 3;

/// A vLLM batch storing a chain of [`BLOCKS`] blocks whose hashes no other batch uses.
fn chain(i: u64) -> Vec<u8> {
    let tokens: Vec<u32> = (0..16 * BLOCKS as u32)
        .map(|t| u32::try_from(i % 1_000_000).unwrap_or(0) * 64 + t)
        .collect();
    kvplane_ingest::vllm::encode_batch(
        0.0,
        &KvBatch {
            dp_rank: 0,
            events: vec![KvEvent::Stored {
                block_hashes: (0..BLOCKS).map(|b| i * 1_000 + b).collect(),
                parent_hash: None,
                token_ids: tokens,
                block_size: 16,
                lora_name: None,
                cache_salt: None,
                tier: Tier::Gpu,
            }],
        },
    )
}
