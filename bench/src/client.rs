//! The drivers' OpenAI client: chat requests sent on a workload's schedule, each streamed and
//! timed to its first chunk (`kvplane demo`, `kvplane bench external`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvplane_sim::workload::WorkItem;
use serde_json::json;

/// One request's result, as the client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// Until the answer's first chunk (engine time: wall time times the speed-up); NaN when
    /// none came.
    pub(crate) ttft_ms: f64,
    /// The gateway's `x-kvplane-worker` header, when it sent one.
    pub(crate) worker: String,
    /// 0 when the request could not be sent.
    pub(crate) status: u16,
    /// The prompt tokens the answer's usage names, and of them the cached ones.
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
}

impl Outcome {
    fn failed() -> Self {
        Self {
            ttft_ms: f64::NAN,
            worker: String::new(),
            status: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
        }
    }

    pub(crate) fn ok(&self) -> bool {
        self.status == 200 && self.ttft_ms.is_finite()
    }
}

/// Sends `item` as a streamed chat request for `model`.
pub(crate) async fn send(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    item: &WorkItem,
    speedup: f64,
) -> Outcome {
    let mut body = item.chat_body(model);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let started = Instant::now();
    let Ok(resp) = client
        .post(url)
        .header("x-tenant", "bench")
        .json(&body)
        .send()
        .await
    else {
        return Outcome::failed();
    };
    let status = resp.status().as_u16();
    let worker = resp
        .headers()
        .get(kvplane_gateway::WORKER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut ttft = None;
    let mut text = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        if ttft.is_none() && chunk.windows(5).any(|w| w == b"data:") {
            ttft = Some(started.elapsed().as_secs_f64() * 1000.0 * speedup);
        }
        text.extend_from_slice(&chunk);
    }
    let (prompt_tokens, cached_tokens) = usage(&String::from_utf8_lossy(&text));
    Outcome {
        ttft_ms: ttft.unwrap_or(f64::NAN),
        worker,
        status,
        prompt_tokens,
        cached_tokens,
    }
}

/// Prompt and cached tokens of the last SSE chunk that carries a usage.
fn usage(text: &str) -> (u64, u64) {
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .find_map(|v| {
            let u = v.get("usage").filter(|u| !u.is_null())?;
            let n = |p: &str| {
                u.pointer(p)
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0)
            };
            Some((
                n("/prompt_tokens"),
                n("/prompt_tokens_details/cached_tokens"),
            ))
        })
        .unwrap_or((0, 0))
}

/// Sends `items` on schedule (engine time over `speedup`), the i-th to `urls[i % n]` (several
/// gateways behind one Service); says its progress on stderr every two seconds.
pub(crate) async fn run_phase(
    client: &reqwest::Client,
    name: &str,
    urls: &[String],
    model: &str,
    items: &[WorkItem],
    speedup: f64,
) -> Vec<Outcome> {
    let start = Instant::now();
    let total = items.len();
    let answered = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let progress = {
        let (answered, sent, name) = (answered.clone(), sent.clone(), name.to_owned());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            tick.tick().await;
            loop {
                tick.tick().await;
                eprintln!(
                    "  {name}: {} sent, {} answered, {:.0} s",
                    sent.load(Ordering::Relaxed),
                    answered.load(Ordering::Relaxed),
                    start.elapsed().as_secs_f64()
                );
            }
        })
    };
    let mut tasks = Vec::with_capacity(total);
    for (i, item) in items.iter().enumerate() {
        let at = Duration::from_secs_f64(item.at_ms / 1000.0 / speedup);
        tokio::time::sleep_until((start + at).into()).await;
        let (client, url, item, answered, model) = (
            client.clone(),
            urls[i % urls.len()].clone(),
            item.clone(),
            answered.clone(),
            model.to_owned(),
        );
        sent.fetch_add(1, Ordering::Relaxed);
        tasks.push(tokio::spawn(async move {
            let o = send(&client, &url, &model, &item, speedup).await;
            answered.fetch_add(1, Ordering::Relaxed);
            o
        }));
    }
    let mut out = Vec::with_capacity(total);
    for t in tasks {
        out.push(t.await.unwrap_or_else(|_| Outcome::failed()));
    }
    progress.abort();
    eprintln!(
        "  {name}: all {total} answered in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    out
}

/// The `p` quantile (0..=1) of the finite values of `v`; NaN when there are none.
pub(crate) fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}
