//! `kvplane sim engine`: the engine model driven in real time behind vLLM's interfaces.
//!
//! HTTP: `POST /v1/completions`, `POST /v1/chat/completions` (streaming with SSE or not, with
//! `usage`), `GET /v1/models`, `GET /metrics` (vLLM's metric names), `GET /health`,
//! `POST /reset_prefix_cache`, and `POST /sim/drop_next_batches` (tests: the next N KV batches
//! skip the PUB socket but stay in the replay buffer).
//! ZMQ: KV events as vLLM publishes them (see `zmq_pub`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvplane_state::KvBatch;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};

use crate::EngineParams;
use crate::model::{Engine, EngineStats, Output, SimRequest, Usage};
use crate::rng::Rng;
use crate::zmq_pub::{KvPublisher, PublisherEndpoints};

/// How to run one simulated engine.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub model: String,
    pub zmq_pub: String,
    pub zmq_replay: String,
    pub topic: String,
    pub buffer_steps: usize,
    pub params: EngineParams,
    /// Engine time runs this many times faster than wall time.
    pub speedup: f64,
    pub seed: u64,
    pub default_max_tokens: u32,
    /// The data-parallel rank its batches name (vLLM's `data_parallel_rank`).
    pub dp_rank: u32,
    /// The model's tokenizer and chat template (else the built-in word tokenizer).
    pub tokenizer: Option<std::sync::Arc<kvplane_tokenize::ModelTokenizer>>,
    /// `/metrics` shows no vLLM gauge before the engine's first request, as some engines (and
    /// NVIDIA Dynamo's mocker) do: their gauges appear once first set.
    pub gauges_after_first_request: bool,
    /// Answers end after at most this many tokens, as when the model writes its end-of-sequence
    /// token (`finish_reason: stop`); `None`: every answer runs to its `max_tokens` (`length`).
    pub answer_tokens: Option<u32>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-8b".into(),
            zmq_pub: "tcp://127.0.0.1:5557".into(),
            zmq_replay: "tcp://127.0.0.1:5558".into(),
            topic: "kv-events".into(),
            buffer_steps: 10_000,
            params: EngineParams::default(),
            speedup: 1.0,
            seed: 0,
            default_max_tokens: 16,
            dp_rank: 0,
            tokenizer: None,
            gauges_after_first_request: false,
            answer_tokens: None,
        }
    }
}

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; TTFT_BUCKETS.len()];
        }
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

struct Shared {
    engine: Engine,
    waiters: HashMap<u64, mpsc::UnboundedSender<Output>>,
    next_id: u64,
    ttft: Histogram,
}

#[derive(Clone)]
struct App {
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Notify>,
    publisher: KvPublisher,
    cfg: Arc<SimConfig>,
    started: Instant,
    /// Tells this process's answer ids from another engine's (the wall clock at its start).
    instance: u64,
}

impl App {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Engine time now, in ms.
    fn virtual_now(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1000.0 * self.cfg.speedup
    }
}

/// Addresses the engine serves on.
#[derive(Debug, Clone)]
pub struct SimBound {
    pub http: std::net::SocketAddr,
    pub zmq: PublisherEndpoints,
}

/// Runs the simulator until `shutdown` resolves.
pub async fn run(
    cfg: SimConfig,
    http: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_ready: impl FnOnce(SimBound),
) -> Result<(), std::io::Error> {
    let (publisher, zmq) = KvPublisher::start(
        &cfg.zmq_pub,
        &cfg.zmq_replay,
        cfg.topic.clone(),
        cfg.buffer_steps,
    )
    .await
    .map_err(|e| std::io::Error::other(format!("zmq: {e}")))?;
    let app = App {
        shared: Arc::new(Mutex::new(Shared {
            engine: Engine::new(cfg.params),
            waiters: HashMap::new(),
            next_id: 1,
            ttft: Histogram::default(),
        })),
        wake: Arc::new(Notify::new()),
        publisher,
        cfg: Arc::new(cfg),
        started: Instant::now(),
        instance: unix_now().as_nanos() as u64,
    };
    tokio::spawn(drive(app.clone()));
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "" }))
        .route("/reset_prefix_cache", post(reset))
        .route("/sim/drop_next_batches", post(drop_batches))
        .with_state(app);
    on_ready(SimBound {
        http: http.local_addr()?,
        zmq,
    });
    axum::serve(without_nagle(http), router)
        .with_graceful_shutdown(shutdown)
        .await
}

/// `http` with Nagle's algorithm off on every connection it accepts, as vLLM's server has it
/// (asyncio, under uvicorn, turns it off on every TCP transport): a stream's first chunk, a few bytes after the response's headers, is otherwise held
/// until the client acknowledges the headers, which a delayed ACK holds up to 40 ms - a first
/// token that came in one step measured as one step or as 40 ms, depending on the connection.
fn without_nagle(
    http: TcpListener,
) -> axum::serve::TapIo<TcpListener, impl FnMut(&mut tokio::net::TcpStream) + Send + 'static> {
    use axum::serve::ListenerExt;
    http.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not turn Nagle's algorithm off");
        }
    })
}

/// The scheduler loop: step, wait out the step in wall time, deliver.
async fn drive(app: App) {
    loop {
        let out = {
            let mut s = app.lock();
            let now = app.virtual_now();
            s.engine.advance_to(now);
            s.engine.step()
        };
        let Some(out) = out else {
            app.wake.notified().await;
            continue;
        };
        let wall_end = app.started + Duration::from_secs_f64(out.end_ms / 1000.0 / app.cfg.speedup);
        tokio::time::sleep_until(wall_end.into()).await;
        if !out.events.is_empty() {
            app.publisher.publish(
                out.end_ms / 1000.0,
                KvBatch {
                    dp_rank: app.cfg.dp_rank,
                    events: out.events,
                },
            );
        }
        let mut s = app.lock();
        for o in out.outputs {
            let id = match o {
                Output::FirstToken { id, ttft_ms } => {
                    // In wall time, as vLLM's histogram is: what a client next to the engine
                    // waited (engine time runs `speedup` times faster).
                    s.ttft.observe(ttft_ms / 1000.0 / app.cfg.speedup);
                    id
                }
                Output::Token { id } | Output::Finished { id, .. } => id,
            };
            if let Some(w) = s.waiters.get(&id) {
                let _ = w.send(o);
            }
            if matches!(o, Output::Finished { .. }) {
                s.waiters.remove(&id);
            }
        }
    }
}

/// The wall clock since the Unix epoch (answers' `created`, ids).
fn unix_now() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

fn error(status: StatusCode, message: &str) -> Box<Response> {
    Box::new(
        (
            status,
            // As vLLM answers: its exception's name as the type, the status as the code.
            Json(json!({"error": {
                "message": message,
                "type": if status == StatusCode::BAD_REQUEST { "BadRequestError" } else { "InternalServerError" },
                "param": null,
                "code": status.as_u16(),
            }})),
        )
            .into_response(),
    )
}

struct Parsed {
    tokens: Vec<u32>,
    /// What the engine generates: the request's maximum, or less where answers end sooner.
    max_tokens: u32,
    /// Why the answer ends (`length`: at the request's maximum).
    finish_reason: &'static str,
    /// The function a chat answer calls instead of writing text: the one `tool_choice` names,
    /// else the first of `tools` (unless `tool_choice` is `none`).
    tool: Option<String>,
    stream: bool,
    include_usage: bool,
    model: String,
    lora: Option<String>,
    cache_salt: Option<String>,
}

fn parse(app: &App, body: &[u8]) -> Result<Parsed, Box<Response>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("invalid json: {e}")))?;
    // What vLLM refuses too: more than one choice, a maximum that is no positive count.
    if v.get("n")
        .is_some_and(|n| !n.is_null() && n.as_u64() != Some(1))
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "n must be 1: the simulator answers with one choice",
        ));
    }
    for k in ["max_tokens", "max_completion_tokens"] {
        if v.get(k)
            .is_some_and(|m| !m.is_null() && m.as_u64().is_none_or(|m| m < 1))
        {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("{k} must be at least 1"),
            ));
        }
    }
    let p = kvplane_tokenize::prompt_from_body_with(body, app.cfg.tokenizer.as_deref())
        .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
    let model = p.model.clone().unwrap_or_else(|| app.cfg.model.clone());
    let asked = p.max_tokens.unwrap_or(app.cfg.default_max_tokens);
    let (max_tokens, finish_reason) = match app.cfg.answer_tokens {
        Some(n) if n < asked => (n.max(1), "stop"),
        _ => (asked, "length"),
    };
    let tool = match v.get("tool_choice") {
        Some(Value::String(s)) if s == "none" => None,
        Some(c @ Value::Object(_)) => c
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => v
            .pointer("/tools/0/function/name")
            .and_then(Value::as_str)
            .map(str::to_owned),
    };
    Ok(Parsed {
        tokens: p.tokens,
        max_tokens,
        finish_reason,
        tool,
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: v
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        lora: (model != app.cfg.model).then(|| model.clone()),
        cache_salt: v
            .get("cache_salt")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
        model,
    })
}

const WORDS: &[&str] = &[
    "the", "cache", "is", "warm", "and", "tokens", "flow", "fast", "again", "now",
];

fn submit(app: &App, p: &Parsed) -> Result<(u64, mpsc::UnboundedReceiver<Output>), Box<Response>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let id = {
        let mut s = app.lock();
        let now = app.virtual_now();
        s.engine.advance_to(now);
        let id = s.next_id;
        s.next_id += 1;
        s.engine
            .submit(SimRequest {
                id,
                tokens: p.tokens.clone(),
                max_tokens: p.max_tokens,
                lora_name: p.lora.clone(),
                cache_salt: p.cache_salt.clone(),
            })
            .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
        s.waiters.insert(id, tx);
        id
    };
    app.wake.notify_one();
    Ok((id, rx))
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn serve_request(app: App, body: bytes::Bytes, chat: bool) -> Response {
    let p = match parse(&app, &body) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let (id, mut rx) = match submit(&app, &p) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let mut rng = Rng::new(app.cfg.seed ^ id.wrapping_mul(0x9e37_79b9));
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let rid = format!(
        "{}-{:x}-{id}",
        if chat { "chatcmpl" } else { "cmpl" },
        app.instance
    );
    let created = unix_now().as_secs();
    let model = p.model.clone();
    // A chat answer that calls a tool ends as such; completions never call one.
    let tool = p.tool.clone().filter(|_| chat);
    let finish_reason = if tool.is_some() {
        "tool_calls"
    } else {
        p.finish_reason
    };
    if !p.stream {
        let mut text = String::new();
        let mut usage = Usage::default();
        while let Some(o) = rx.recv().await {
            match o {
                Output::FirstToken { .. } | Output::Token { .. } => {
                    if !text.is_empty() {
                        text.push(' ');
                    }
                    text.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
                }
                Output::Finished { usage: u, .. } => {
                    usage = u;
                    break;
                }
            }
        }
        let choice = if let Some(name) = &tool {
            // The words as the call's one argument, as a model writes a call's arguments.
            let call = json!({"id": format!("call-{rid}"), "type": "function",
                "function": {"name": name, "arguments": json!({"text": text}).to_string()}});
            json!({"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [call]}, "finish_reason": finish_reason})
        } else if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish_reason})
        };
        return Json(json!({
            "id": rid, "object": object, "created": created, "model": model,
            "choices": [choice], "usage": usage_json(&usage),
        }))
        .into_response();
    }
    let include_usage = p.include_usage;
    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let stream = async_stream(rx, move |o, first| match o {
        Output::FirstToken { .. } | Output::Token { .. } => {
            let word = WORDS[rng.below(WORDS.len() as u64) as usize];
            let text = if first {
                word.to_owned()
            } else {
                format!(" {word}")
            };
            let choice = if let Some(name) = &tool {
                // A call's arguments streamed piece by piece: `{"text": "`, the words, `"}`.
                let piece = if first {
                    format!("{{\"text\": \"{text}")
                } else {
                    text
                };
                let mut call = json!({"index": 0, "function": {"arguments": piece}});
                if first {
                    call["id"] = json!(format!("call-{rid}"));
                    call["type"] = json!("function");
                    call["function"]["name"] = json!(name);
                }
                let mut delta = json!({"tool_calls": [call]});
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": 0, "delta": delta, "finish_reason": null})
            } else if chat && first {
                // The first chunk of a chat stream names the speaker, as OpenAI's do.
                json!({"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": null})
            } else if chat {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": null})
            } else {
                json!({"index": 0, "text": text, "finish_reason": null})
            };
            vec![
                json!({"id": rid, "object": chunk_object, "created": created, "model": model, "choices": [choice]})
                    .to_string(),
            ]
        }
        Output::Finished { usage, .. } => {
            // The last choice chunk says why the answer ended.
            let last = if tool.is_some() {
                let call = json!({"index": 0, "function": {"arguments": "\"}"}});
                json!({"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish_reason})
            } else if chat {
                json!({"index": 0, "delta": {}, "finish_reason": finish_reason})
            } else {
                json!({"index": 0, "text": "", "finish_reason": finish_reason})
            };
            let mut v = vec![
                json!({"id": rid, "object": chunk_object, "created": created, "model": model, "choices": [last]})
                    .to_string(),
            ];
            if include_usage {
                v.push(json!({"id": rid, "object": chunk_object, "created": created, "model": model, "choices": [], "usage": usage_json(&usage)}).to_string());
            }
            v.push("[DONE]".to_owned());
            v
        }
    });
    Sse::new(stream).into_response()
}

/// Turns engine outputs into SSE events.
fn async_stream(
    rx: mpsc::UnboundedReceiver<Output>,
    mut render: impl FnMut(Output, bool) -> Vec<String> + Send + 'static,
) -> impl futures::Stream<Item = Result<Event, Infallible>> {
    use futures::StreamExt;
    let mut first = true;
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx).flat_map(move |o| {
        let lines = render(o, first);
        first = false;
        futures::stream::iter(lines.into_iter().map(|l| Ok(Event::default().data(l))))
    })
}

async fn completions(State(app): State<App>, body: bytes::Bytes) -> Response {
    serve_request(app, body, false).await
}

async fn chat(State(app): State<App>, body: bytes::Bytes) -> Response {
    serve_request(app, body, true).await
}

async fn models(State(app): State<App>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": app.cfg.model, "object": "model", "owned_by": "kvplane-sim"}]}),
    )
}

async fn reset(State(app): State<App>) -> StatusCode {
    let ev = app.lock().engine.reset_prefix_cache();
    app.publisher.publish(
        app.virtual_now() / 1000.0,
        KvBatch {
            dp_rank: app.cfg.dp_rank,
            events: vec![ev],
        },
    );
    StatusCode::OK
}

async fn drop_batches(State(app): State<App>, Json(v): Json<Value>) -> StatusCode {
    let n = v.get("count").and_then(Value::as_u64).unwrap_or(1);
    app.publisher.drop_next(n);
    StatusCode::OK
}

async fn metrics(State(app): State<App>) -> Response {
    let (stats, ttft) = {
        let s = app.lock();
        (
            s.engine.stats(),
            (s.ttft.counts.clone(), s.ttft.sum, s.ttft.count),
        )
    };
    let untouched = stats.running == 0
        && stats.waiting == 0
        && stats.prompt_tokens == 0
        && stats.request_success == 0;
    let text = if app.cfg.gauges_after_first_request && untouched {
        "# no request yet: no gauge set\n".to_owned()
    } else {
        render_metrics(&app.cfg.model, &stats, &ttft)
    };
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// vLLM's metrics in the Prometheus text format (the names and labels vLLM uses).
pub fn render_metrics(model: &str, s: &EngineStats, ttft: &(Vec<u64>, f64, u64)) -> String {
    use std::fmt::Write;
    let labels = format!("engine=\"0\",model_name=\"{model}\"");
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(
            out,
            "# HELP vllm:{name} {help}\n# TYPE vllm:{name} gauge\nvllm:{name}{{{labels}}} {v:?}"
        );
    };
    gauge(
        "num_requests_running",
        "Number of requests in model execution batches.",
        f64::from(s.running),
    );
    gauge(
        "num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(s.waiting),
    );
    gauge(
        "kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_cache_usage,
    );
    for (name, help, v) in [
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        ),
        (
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        ),
        (
            "prompt_tokens",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        ),
        (
            "generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
        ),
        (
            "request_success",
            "Count of successfully processed requests.",
            s.request_success,
        ),
        (
            "num_preemptions",
            "Cumulative number of preemption from the engine.",
            0,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP vllm:{name}_total {help}\n# TYPE vllm:{name}_total counter\nvllm:{name}_total{{{labels}}} {:?}",
            v as f64
        );
    }
    let name = "vllm:time_to_first_token_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram"
    );
    for (i, b) in TTFT_BUCKETS.iter().enumerate() {
        let c = ttft.0.get(i).copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {:?}", c as f64);
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {:?}",
        ttft.2 as f64
    );
    let _ = writeln!(out, "{name}_count{{{labels}}} {:?}", ttft.2 as f64);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", ttft.1);
    out
}

#[cfg(test)]
mod tests {
    use axum::serve::{Listener, ListenerExt};

    use super::*;

    #[tokio::test]
    async fn every_connection_the_engine_accepts_has_nagles_algorithm_off() {
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = http.local_addr().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        // What the operating system says of each accepted socket, after the engine's own tap.
        let mut listener = without_nagle(http).tap_io(move |tcp| {
            let _ = tx.send(tcp.nodelay().unwrap());
        });
        for _ in 0..2 {
            let client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (_io, _) = listener.accept().await;
            assert_eq!(rx.recv().await, Some(true));
            drop(client);
        }
    }
}
