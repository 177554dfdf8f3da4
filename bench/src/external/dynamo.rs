//! A fleet of engines we did not write: NVIDIA Dynamo's mocker (`python -m dynamo.mocker`,
//! from the `ai-dynamo` package), which simulates a vLLM engine, publishes vLLM-format KV
//! events on ZMQ and vLLM's metrics on its system port, and one Dynamo frontend
//! (`python -m dynamo.frontend`) per engine for its OpenAI endpoint. Each engine is in a Dynamo
//! namespace of its own (`bench-<i>`), so its frontend reaches it alone; Dynamo's own KV router
//! is a frontend over every namespace (`--namespace-prefix bench-`). Discovery is a directory
//! (`DYN_FILE_KV`), requests go over TCP and events over ZMQ: no etcd, no NATS of Dynamo's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_testkit::process;

use crate::procs::Procs;

/// The model name the engines serve.
pub(super) const MODEL: &str = "m";
/// Tokens per KV block, the engines' and kvplane's.
pub(super) const BLOCK_SIZE: u32 = 16;

/// One engine: its OpenAI endpoint (its own frontend), its metrics and health (the mocker's
/// system port) and its KV-event sockets.
#[derive(Debug, Clone)]
pub(super) struct Engine {
    pub(super) name: String,
    pub(super) openai: String,
    pub(super) system: String,
    pub(super) zmq_pub: String,
    pub(super) zmq_replay: String,
}

/// Where the mocker and frontends come from, and how the engines run.
#[derive(Debug, Clone)]
pub(super) struct Setup {
    pub(super) python: PathBuf,
    /// A model directory: the tokenizer (and chat template) both Dynamo and kvplane read,
    /// and the `config.json` the mocker reads.
    pub(super) model: PathBuf,
    /// The mocker's `--speedup-ratio`.
    pub(super) speedup: f64,
    /// The mocker's `--num-gpu-blocks-override` (its KV-cache size).
    pub(super) gpu_blocks: u32,
}

/// Copies the tokenizer files of `tokenizer` into `dir` with a small Llama `config.json`
/// (the mocker reads the architecture from it; the weights are never loaded).
pub(super) fn model_dir(tokenizer: &Path, dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    for entry in std::fs::read_dir(tokenizer)
        .with_context(|| format!("reading the tokenizer directory {}", tokenizer.display()))?
    {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_owned();
        if path.is_file() && name != "cases.json" {
            std::fs::copy(&path, dir.join(name))?;
        }
    }
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
"intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
"num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072,
"torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
"#,
    )?;
    Ok(dir.to_owned())
}

fn dynamo_env(store: &Path) -> Vec<(String, String)> {
    vec![
        ("DYN_FILE_KV".into(), store.display().to_string()),
        ("DYN_LOG".into(), "warn".into()),
    ]
}

fn planes() -> Vec<String> {
    [
        "--discovery-backend",
        "file",
        "--request-plane",
        "tcp",
        "--event-plane",
        "zmq",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Starts `n` mockers, each with its own frontend, in `dir`; returns them once every frontend
/// lists the model and every mocker's health says ready.
pub(super) async fn start_engines(
    procs: &mut Procs,
    dir: &Path,
    setup: &Setup,
    n: usize,
) -> anyhow::Result<Vec<Engine>> {
    let store = dir.join("dynamo-store");
    std::fs::create_dir_all(&store)?;
    let mut engines = Vec::new();
    for i in 0..n {
        let port = || process::free_port().map_err(anyhow::Error::from);
        let (system, zpub, zreplay, http) = (port()?, port()?, port()?, port()?);
        let mut env = dynamo_env(&store);
        env.extend([
            ("DYN_SYSTEM_ENABLED".into(), "true".into()),
            ("DYN_SYSTEM_PORT".into(), system.to_string()),
            // Healthy once its generate endpoint is up (not "notready" until a health probe).
            (
                "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS".into(),
                r#"["generate"]"#.into(),
            ),
        ]);
        let mut args: Vec<String> = vec![
            "-m".into(),
            "dynamo.mocker".into(),
            "--model-path".into(),
            setup.model.display().to_string(),
            "--model-name".into(),
            MODEL.into(),
            "--endpoint".into(),
            format!("dyn://bench-{i}.backend.generate"),
            "--block-size".into(),
            BLOCK_SIZE.to_string(),
            "--num-gpu-blocks-override".into(),
            setup.gpu_blocks.to_string(),
            "--speedup-ratio".into(),
            setup.speedup.to_string(),
            "--zmq-kv-events-ports".into(),
            zpub.to_string(),
            "--zmq-replay-ports".into(),
            zreplay.to_string(),
        ];
        args.extend(planes());
        procs.spawn_env(&format!("mocker-{i}"), &setup.python, &args, &env, None)?;
        spawn_frontend(
            procs,
            &format!("frontend-{i}"),
            setup,
            &store,
            http,
            [
                "--namespace",
                &format!("bench-{i}"),
                "--router-mode",
                "round-robin",
            ],
        )?;
        engines.push(Engine {
            name: format!("engine-{i}"),
            openai: format!("http://127.0.0.1:{http}"),
            system: format!("http://127.0.0.1:{system}"),
            zmq_pub: format!("tcp://127.0.0.1:{zpub}"),
            zmq_replay: format!("tcp://127.0.0.1:{zreplay}"),
        });
    }
    for e in &engines {
        wait_http(
            &format!("{}/health", e.system),
            "",
            Duration::from_secs(120),
        )
        .await?;
        wait_http(
            &format!("{}/v1/models", e.openai),
            &format!("\"{MODEL}\""),
            Duration::from_secs(120),
        )
        .await?;
    }
    Ok(engines)
}

/// Dynamo's own KV-aware router: a frontend over every engine (it reads their KV events);
/// returns its chat-completions URL once it lists the model.
pub(super) async fn start_kv_router(
    procs: &mut Procs,
    dir: &Path,
    setup: &Setup,
) -> anyhow::Result<String> {
    let http = process::free_port()?;
    spawn_frontend(
        procs,
        "frontend-kv-router",
        setup,
        &dir.join("dynamo-store"),
        http,
        ["--namespace-prefix", "bench-", "--router-mode", "kv"],
    )?;
    let base = format!("http://127.0.0.1:{http}");
    wait_http(
        &format!("{base}/v1/models"),
        &format!("\"{MODEL}\""),
        Duration::from_secs(120),
    )
    .await?;
    Ok(format!("{base}/v1/chat/completions"))
}

/// A Dynamo frontend (an OpenAI endpoint) on `http`, discovering through `store`, routing as
/// `routing` says (which namespaces, which router mode).
fn spawn_frontend(
    procs: &mut Procs,
    name: &str,
    setup: &Setup,
    store: &Path,
    http: u16,
    routing: [&str; 4],
) -> anyhow::Result<()> {
    let mut args: Vec<String> = [
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
    ]
    .map(str::to_owned)
    .to_vec();
    args.push(http.to_string());
    args.extend(routing.map(str::to_owned));
    args.extend(planes());
    procs.spawn_env(name, &setup.python, &args, &dynamo_env(store), None)?;
    Ok(())
}

/// Polls `url` until it answers with success and a body containing `expect`.
async fn wait_http(url: &str, expect: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = client.get(url).send().await
            && r.status().is_success()
            && r.text().await.is_ok_and(|t| t.contains(expect))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} did not answer within {timeout:?} (see the logs)");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
