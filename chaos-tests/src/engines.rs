//! The engines, played by the runner so that it knows what each one published: per worker a
//! vLLM-format KV-event publisher (a ZMQ PUB socket and its replay socket, as vLLM's
//! `ZmqEventPublisher`) and an HTTP port with vLLM's `/metrics` gauges and a `/v1/completions`
//! that answers at once with its usage, each joined to the fleet by a real `kvplane bridge`
//! process - the part under test, killed and frozen by the faults.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_sim::KvPublisher;
use kvplane_testkit::Proc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// Batches an engine keeps for replay: more than a run publishes, so a bridge that was away
/// always finds what it missed.
const REPLAY_BATCHES: usize = 1_000_000;

/// One engine: its publisher, its metrics endpoint, and the bridge that joins it to the fleet.
pub struct Engine {
    pub worker: String,
    pub publisher: KvPublisher,
    pub bridge: Proc,
    metrics: JoinHandle<()>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.metrics.abort();
    }
}

impl Engine {
    /// Starts worker `worker`'s engine in pool `pool` and its bridge to `nats_url`.
    pub async fn start(
        dir: &Path,
        pool: &str,
        worker: &str,
        nats_url: &str,
    ) -> anyhow::Result<Engine> {
        let (publisher, at) = KvPublisher::start(
            "tcp://127.0.0.1:0",
            "tcp://127.0.0.1:0",
            String::new(),
            REPLAY_BATCHES,
        )
        .await
        .context("binding the engine's zmq sockets")?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let http = format!("http://{}", listener.local_addr()?);
        let metrics = tokio::spawn(serve_http(listener));
        let s = |v: &str| v.to_owned();
        let bridge = Proc::start(
            vec![
                s("bridge"),
                s("--pool"),
                s(pool),
                s("--worker"),
                s(worker),
                s("--engine-url"),
                http,
                s("--zmq-pub"),
                at.publish,
                s("--zmq-replay"),
                at.replay,
                s("--nats-url"),
                s(nats_url),
                s("--scrape-interval-ms"),
                s("1000"),
            ],
            dir.join(format!("{worker}.bridge.log")),
            "kvplane-bridge ready",
        );
        Ok(Engine {
            worker: worker.to_owned(),
            publisher,
            bridge,
            metrics,
        })
    }

    /// SIGSTOP the bridge (its sockets stay open, it reads nothing), or SIGCONT it.
    pub fn freeze_bridge(&self, frozen: bool) -> anyhow::Result<()> {
        if !self.bridge.freeze(frozen) {
            bail!("freezing ({frozen}) {}'s bridge failed", self.worker);
        }
        Ok(())
    }
}

/// Waits until each engine's first `published[w]` batches (numbered from 0) are in `stream`:
/// the `Kv-Seq` header its bridge put on the worker's last message there is at least the last
/// of them (the bridge forwards in order).
pub async fn wait_forwarded(
    engines: &[Engine],
    published: &[u64],
    js: &async_nats::jetstream::Context,
    (stream, pool): (&str, &str),
    within: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let stream = js.get_stream(stream).await?;
    for (e, n) in engines.iter().zip(published) {
        let Some(last) = n.checked_sub(1) else {
            continue;
        };
        let subject = kvplane_ingest::kv_subject(pool, &e.worker);
        loop {
            let seq = stream
                .get_last_raw_message_by_subject(&subject)
                .await
                .ok()
                .and_then(|m| {
                    m.headers
                        .get(kvplane_ingest::bridge::SEQ_HEADER)
                        .and_then(|v| v.as_str().parse::<u64>().ok())
                });
            if seq.is_some_and(|s| s >= last) {
                break;
            }
            if started.elapsed() > within {
                bail!(
                    "{}'s bridge forwarded up to {seq:?}, not yet batch {last}, within {within:?}",
                    e.worker
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// vLLM's gauges, idle: the bridge scrapes them, announces the worker up, and publishes them.
const METRICS: &str = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n";

/// Answers `/v1/completions` with a completion of half the request's `max_tokens` and its
/// usage (what the gateway reports), anything else with [`METRICS`]; one request per
/// connection.
async fn serve_http(listener: tokio::net::TcpListener) {
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(answer(socket));
    }
}

async fn answer(mut socket: tokio::net::TcpStream) {
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => read.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&read[..head_end]).to_ascii_lowercase();
    let (kind, body) = if head.starts_with("post /v1/completions") {
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while read.len() < head_end + length {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => read.extend_from_slice(&buf[..n]),
            }
        }
        let request: serde_json::Value =
            serde_json::from_slice(&read[head_end..head_end + length]).unwrap_or_default();
        let prompt = request["prompt"].as_array().map_or(0, Vec::len);
        let output = request["max_tokens"].as_u64().unwrap_or(0) / 2;
        let answer = serde_json::json!({
            "id": "cmpl-chaos",
            "object": "text_completion",
            "created": 0,
            "model": request["model"],
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": output,
                "total_tokens": prompt as u64 + output,
            },
        });
        ("application/json", answer.to_string())
    } else {
        ("text/plain; version=0.0.4", METRICS.to_owned())
    };
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = socket.write_all(answer.as_bytes()).await;
}
