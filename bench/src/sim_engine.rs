//! `kvplane sim engine`: one simulated vLLM engine, as a command-line role.

use kvplane_sim::EngineParams;
use kvplane_sim::server::{SimConfig, run};

#[derive(Debug, Clone, clap::Args)]
pub struct SimEngineArgs {
    /// HTTP address (OpenAI API, /metrics). Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http_listen: String,
    /// ZMQ PUB endpoint for KV events (vLLM's `endpoint`). Port 0 picks a free port.
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub zmq_pub: String,
    /// ZMQ ROUTER endpoint for replay (vLLM's `replay_endpoint`).
    #[arg(long, default_value = "tcp://127.0.0.1:5558")]
    pub zmq_replay: String,
    #[arg(long, default_value = "kv-events")]
    pub topic: String,
    #[arg(long, default_value = "sim-8b")]
    pub model: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    pub buffer_steps: usize,
    /// Engine time runs this many times faster than wall time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The data-parallel rank its KV batches name.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    #[arg(long, default_value_t = EngineParams::default().block_size)]
    pub block_size: u32,
    #[arg(long, default_value_t = EngineParams::default().num_gpu_blocks)]
    pub num_gpu_blocks: u32,
    #[arg(long, default_value_t = EngineParams::default().max_num_seqs)]
    pub max_num_seqs: u32,
    #[arg(long, default_value_t = EngineParams::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: u32,
    #[arg(long, default_value_t = EngineParams::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    #[arg(long, default_value_t = EngineParams::default().step_base_ms)]
    pub step_base_ms: f64,
    #[arg(long, default_value_t = EngineParams::default().per_seq_ms)]
    pub per_seq_ms: f64,
    /// Milliseconds a step adds per thousand prefill tokens squared (a prefill time convex in
    /// its tokens; 0: linear).
    #[arg(long, default_value_t = EngineParams::default().prefill_ms_per_ktoken_squared)]
    pub prefill_ms_per_ktoken_squared: f64,
    /// A directory with the model's `tokenizer.json` and `tokenizer_config.json`: prompts are
    /// then tokenized as vLLM does (else with the built-in word tokenizer).
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Show no vLLM gauge on `/metrics` before the first request, as some engines (and NVIDIA
    /// Dynamo's mocker) do.
    #[arg(long)]
    pub gauges_after_first_request: bool,
    /// Answers end after at most this many tokens (`finish_reason: stop`), as a model's do at
    /// its end-of-sequence token; unset: every answer runs to its `max_tokens`.
    #[arg(long)]
    pub answer_tokens: Option<u32>,
}

pub async fn engine(
    a: SimEngineArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let params = EngineParams {
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        step_base_ms: a.step_base_ms,
        per_seq_ms: a.per_seq_ms,
        prefill_ms_per_ktoken_squared: a.prefill_ms_per_ktoken_squared,
    };
    let mut problems = params.problems();
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        problems.push("speedup must be positive".into());
    }
    if !problems.is_empty() {
        anyhow::bail!(
            "invalid simulator parameters:\n  - {}",
            problems.join("\n  - ")
        );
    }
    let tokenizer = match &a.tokenizer {
        Some(dir) => Some(std::sync::Arc::new(kvplane_tokenize::ModelTokenizer::load(
            dir,
        )?)),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(&a.http_listen).await?;
    let cfg = SimConfig {
        model: a.model,
        zmq_pub: a.zmq_pub,
        zmq_replay: a.zmq_replay,
        topic: a.topic,
        buffer_steps: a.buffer_steps,
        params,
        speedup: a.speedup,
        seed: a.seed,
        dp_rank: a.dp_rank,
        default_max_tokens: 16,
        tokenizer,
        gauges_after_first_request: a.gauges_after_first_request,
        answer_tokens: a.answer_tokens,
    };
    run(cfg, listener, shutdown, |b| {
        println!(
            "kvplane-sim ready http={} zmq_pub={} zmq_replay={}",
            b.http, b.zmq.publish, b.zmq.replay
        );
    })
    .await?;
    Ok(())
}
