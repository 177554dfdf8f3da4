//! `kvplane demo`: a local fleet routed end to end, against round-robin on the same workload.
//!
//! Starts NATS, a three-node kvplane cluster (Raft), three simulated engines with their
//! bridges, three gateways asking kvplane (each its own replica first) and one cycling
//! round-robin like a Kubernetes Service. Runs the seeded shared-prefix workload through the
//! round-robin gateway, resets the engines' prefix caches, runs it again spread over the
//! kvplane gateways, replays the same requests in virtual time, prints a summary, and stops
//! everything. Everything kvplane speaks is TLS, with certificates from a development CA
//! ([`crate::demo_pki`]), and the access checks are on: the gateways route by an
//! `AccessPolicy`, the demo reads the status as the configured admin.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use kvplane_sim::workload::{Kind, Spec, generate};
use kvplane_testkit::process;

use crate::client::{percentile, run_phase};
use crate::demo_pki::DemoPki;
use crate::procs::{
    Procs, field, start_gateways, start_members, start_nats, start_round_robin, start_sim_engine,
    wait_status,
};
use kvplane_tls::Dialer;
use serde_json::{Value, json};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// A quick run (fewer requests, smaller engines running 4x faster than real time): what
    /// CI runs.
    #[arg(long)]
    pub short: bool,
    /// Requests per strategy (default 400; 200 with --short).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Distinct system prompts (default 60; 20 with --short).
    #[arg(long)]
    pub system_prompts: Option<usize>,
    /// KV-cache blocks per engine (default 12,800, an L40S with an 8B model; 4,000 with
    /// --short). The demo's prompts are sized so one engine cannot cache them all but the
    /// fleet can.
    #[arg(long)]
    pub num_gpu_blocks: Option<u32>,
    /// Arrival rate in requests per second of engine time.
    #[arg(long, default_value_t = 4.0)]
    pub rate: f64,
    /// Engine time per wall second (default 1; 4 with --short).
    #[arg(long)]
    pub speedup: Option<f64>,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Also write the summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The model the simulated engines serve.
const MODEL: &str = "sim-8b";
/// kvplane replicas (a Raft cluster), each with a gateway of its own.
const NODES: usize = 3;

async fn engine_counters(client: &reqwest::Client, url: &str) -> (f64, f64) {
    let text = match client.get(format!("{url}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    let find = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        find("vllm:prefix_cache_queries_total"),
        find("vllm:prefix_cache_hits_total"),
    )
}

#[derive(Debug, Clone)]
struct PhaseSummary {
    p50: f64,
    p90: f64,
    failed: usize,
    hit_rate: f64,
    per_engine: BTreeMap<String, (usize, f64)>,
}

pub async fn run(a: DemoArgs) -> anyhow::Result<()> {
    let speedup = a.speedup.unwrap_or(if a.short { 4.0 } else { 1.0 });
    let requests = a.requests.unwrap_or(if a.short { 200 } else { 400 });
    let system_prompts = a.system_prompts.unwrap_or(if a.short { 20 } else { 60 });
    let num_gpu_blocks = a
        .num_gpu_blocks
        .unwrap_or(if a.short { 4_000 } else { 12_800 });
    if !(speedup > 0.0 && a.rate > 0.0 && requests > 0) {
        bail!("speedup, rate and requests must be positive");
    }
    let exe = process::kvplane_binary();
    let dir = std::env::temp_dir().join(format!("kvplane-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut procs = Procs::new(&dir);
    println!("kvplane demo: logs in {}", dir.display());
    let pki = DemoPki::new(&dir.join("pki"))?;
    let operator = pki.operator()?;
    println!(
        "wrote a development CA and certificates for members, gateways, bridges, NATS and an operator under {}",
        dir.join("pki").display()
    );

    let nats_url = start_nats(&mut procs, &dir, Some(&pki.nats_conf())).await?;
    println!("started nats-server (jetstream, mutual TLS) on {nats_url}");

    // The fleet as a policy: one worker set (the engines' pool), predicted TTFT from their
    // prefill rate; the node keeps its state in line with the directory.
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies)?;
    let engine = kvplane_sim::EngineParams {
        num_gpu_blocks,
        ..kvplane_sim::EngineParams::default()
    };
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: default}}\nspec: {{model: {MODEL}, blockSize: {}, prefillTokensPerSecond: {}}}\n",
            engine.block_size, engine.prefill_tokens_per_s
        ),
    )?;
    std::fs::write(policies.join("access.yaml"), DemoPki::access_policy_yaml())?;
    let cost = crate::routing::engine_cost(&engine);
    // Three Raft members; the first initializes the cluster.
    let (nodes, _) = start_members(
        &mut procs,
        &dir,
        &nats_url,
        NODES,
        &format!(
            "pools = []\npolicy_dir = \"{}\"\npolicy_poll_ms = 200\n\n[cost]\nbase_ms = {}\nprefill_tokens_per_s = {}\nwaiting_request_ms = {}\nrunning_request_ms = {}\n{}",
            policies.display(),
            cost.base_ms,
            cost.prefill_tokens_per_s,
            cost.waiting_request_ms,
            cost.running_request_ms,
            pki.member_toml(),
        ),
    )?;
    for n in &nodes {
        wait_policy(&operator, n).await?;
    }
    let grpc = nodes[0].clone();
    println!(
        "started a {NODES}-node kvplane cluster (Raft over mutual TLS), gRPC {}; every replica holds the fleet's InferenceWorkerSet and the gateways' AccessPolicy",
        nodes
            .iter()
            .map(|n| operator.url(n))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut engines = Vec::new();
    for i in 1..=3 {
        let name = format!("engine-{i}");
        let ready = start_sim_engine(
            &mut procs,
            &name,
            &[
                "--speedup".into(),
                speedup.to_string(),
                "--num-gpu-blocks".into(),
                num_gpu_blocks.to_string(),
                "--seed".into(),
                i.to_string(),
            ],
        )?;
        let http = format!("http://{}", field(&ready, "http")?);
        let zmq_pub = field(&ready, "zmq_pub")?;
        let zmq_replay = field(&ready, "zmq_replay")?;
        let mut args: Vec<String> = vec![
            "bridge".into(),
            "--worker".into(),
            name.clone(),
            "--engine-url".into(),
            http.clone(),
            "--zmq-pub".into(),
            zmq_pub,
            "--zmq-replay".into(),
            zmq_replay,
            "--nats-url".into(),
            nats_url.clone(),
            "--scrape-interval-ms".into(),
            ((250.0 / speedup).max(20.0) as u64).to_string(),
        ];
        args.extend(pki.bridge_args());
        procs.spawn(
            &format!("bridge-{i}"),
            &exe,
            &args,
            Some("kvplane-bridge ready"),
        )?;
        println!("started {name} (simulated vLLM, {speedup}x real time) on {http} with its bridge");
        engines.push((name, http));
    }
    for n in &nodes {
        wait_workers(&operator, n, 3).await?;
    }
    println!("every kvplane replica sees 3 workers up");

    // One gateway per replica (each asks its own first, the others on failure), requests
    // spread over them in turn: several routers deciding at once from the replicated state.
    let gw = start_gateways(&mut procs, &nodes, &pki.gateway_args(), true)?;
    let rr_engines: Vec<String> = engines.iter().map(|(_, u)| u.clone()).collect();
    let gw_rr = vec![start_round_robin(
        &mut procs,
        &rr_engines,
        &pki.gateway_args(),
        true,
    )?];
    println!("started gateways (HTTPS): {NODES} asking kvplane, one round-robin");

    let spec = Spec {
        kind: Kind::SharedPrefix,
        requests,
        rate_per_s: a.rate,
        system_prompts,
        system_words: 8_000,
        question_words: 60,
        max_tokens: 32,
        seed: a.seed,
    };
    let items = generate(&spec);
    println!(
        "workload: shared-prefix, {requests} chat requests at {} req/s (engine time), {} system prompts of ~{} tokens, distinct questions; engines cache {num_gpu_blocks} blocks of 16 tokens each",
        a.rate, spec.system_prompts, spec.system_words
    );

    let client = reqwest::Client::new();
    let gateway_client = pki.http_client()?;
    let mut summaries = Vec::new();
    for (label, urls) in [("round-robin", &gw_rr), ("kvplane", &gw)] {
        for (_, e) in &engines {
            let _ = client.post(format!("{e}/reset_prefix_cache")).send().await;
        }
        wait_blocks_cleared(&operator, &grpc).await?;
        let before: Vec<(f64, f64)> =
            futures::future::join_all(engines.iter().map(|(_, e)| engine_counters(&client, e)))
                .await;
        println!("running {label} ...");
        let outcomes = run_phase(&gateway_client, label, urls, MODEL, &items, speedup).await;
        let after: Vec<(f64, f64)> =
            futures::future::join_all(engines.iter().map(|(_, e)| engine_counters(&client, e)))
                .await;
        let ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms).collect();
        let mut per_engine = BTreeMap::new();
        let (mut q_all, mut h_all) = (0.0, 0.0);
        for (i, (name, url)) in engines.iter().enumerate() {
            let q = after[i].0 - before[i].0;
            let h = after[i].1 - before[i].1;
            q_all += q;
            h_all += h;
            let n = outcomes
                .iter()
                .filter(|o| o.worker.ends_with(name.as_str()) || o.worker == *url)
                .count();
            per_engine.insert(name.clone(), (n, if q > 0.0 { h / q } else { 0.0 }));
        }
        summaries.push((
            label,
            PhaseSummary {
                p50: percentile(&ttfts, 0.5),
                p90: percentile(&ttfts, 0.9),
                failed: outcomes.iter().filter(|o| !o.ok()).count(),
                hit_rate: if q_all > 0.0 { h_all / q_all } else { 0.0 },
                per_engine,
            },
        ));
    }

    // The same workload and engines in virtual time (`kvplane bench routing`'s fleet).
    let reqs: Vec<crate::routing::workloads::Req> = items
        .iter()
        .map(|i| {
            let body = serde_json::to_vec(&i.chat_body(MODEL)).unwrap_or_default();
            crate::routing::workloads::Req {
                at_ms: i.at_ms,
                tenant: "demo",
                tokens: kvplane_tokenize::prompt_from_body(&body)
                    .map(|p| p.tokens)
                    .unwrap_or_default(),
                max_tokens: i.max_tokens,
            }
        })
        .collect();
    let simulated = crate::routing::virtual_run(&reqs, engine, engines.len(), NODES);
    let virtual_p50 = |name: &str| {
        simulated
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0.0, |(_, t)| percentile(t, 0.5))
    };

    println!();
    println!("{:<28} {:>18} {:>18}", "", summaries[0].0, summaries[1].0);
    let row = |name: &str, f: &dyn Fn(&PhaseSummary) -> String| {
        println!(
            "{:<28} {:>18} {:>18}",
            name,
            f(&summaries[0].1),
            f(&summaries[1].1)
        );
    };
    row("TTFT p50", &|s| format!("{:.3} s", s.p50 / 1000.0));
    row("TTFT p90", &|s| format!("{:.3} s", s.p90 / 1000.0));
    row("prefix-cache hit rate", &|s| {
        format!("{:.1}%", s.hit_rate * 100.0)
    });
    row("failed requests", &|s| s.failed.to_string());
    println!(
        "{:<28} {:>18} {:>18}",
        "virtual time: TTFT p50",
        format!("{:.3} s", virtual_p50("round-robin") / 1000.0),
        format!("{:.3} s", virtual_p50("kvplane") / 1000.0)
    );
    for (name, _) in &engines {
        row(&format!("{name}: requests, hits"), &|s| {
            let (n, h) = s.per_engine.get(name).copied().unwrap_or((0, 0.0));
            format!("{n}, {:.1}%", h * 100.0)
        });
    }
    println!();
    let (rr, kv) = (&summaries[0].1, &summaries[1].1);
    println!(
        "kvplane's median TTFT is {:.1}% of round-robin's ({:.3} s vs {:.3} s).",
        kv.p50 / rr.p50 * 100.0,
        kv.p50 / 1000.0,
        rr.p50 / 1000.0
    );
    println!(
        "in virtual time (same workload, same engine model): {:.1}% ({:.3} s vs {:.3} s).",
        virtual_p50("kvplane") / virtual_p50("round-robin").max(1e-9) * 100.0,
        virtual_p50("kvplane") / 1000.0,
        virtual_p50("round-robin") / 1000.0
    );
    if let Some(path) = &a.json {
        let to_json = |s: &PhaseSummary| {
            json!({
                "ttft_p50_s": s.p50 / 1000.0, "ttft_p90_s": s.p90 / 1000.0, "hit_rate": s.hit_rate,
                "failed": s.failed,
                "per_engine": s.per_engine.iter().map(|(k, (n, h))| (k.clone(), json!({"requests": n, "hit_rate": h}))).collect::<serde_json::Map<String, Value>>(),
            })
        };
        let out = json!({
            "requests": requests, "rate_per_s": a.rate, "speedup": speedup, "seed": a.seed,
            "round_robin": to_json(rr), "kvplane": to_json(kv),
            "virtual_time": {
                "round_robin_ttft_p50_s": virtual_p50("round-robin") / 1000.0,
                "kvplane_ttft_p50_s": virtual_p50("kvplane") / 1000.0,
            },
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    drop(procs);
    println!("stopped everything.");
    if rr.failed + kv.failed > 0 {
        bail!("{} requests failed", rr.failed + kv.failed);
    }
    Ok(())
}

async fn wait_policy(operator: &Dialer, grpc: &str) -> anyhow::Result<()> {
    wait_status(
        operator,
        grpc,
        "applying the demo's policies",
        Duration::from_secs(30),
        |s| {
            s.policy_objects.get("InferenceWorkerSet") == Some(&1)
                && s.policy_objects.get("AccessPolicy") == Some(&1)
        },
    )
    .await
    .map(drop)
}

async fn wait_workers(operator: &Dialer, grpc: &str, n: usize) -> anyhow::Result<()> {
    wait_status(
        operator,
        grpc,
        &format!("seeing {n} workers"),
        Duration::from_secs(30),
        |s| {
            s.workers
                .iter()
                .filter(|w| w.up && !w.address.is_empty())
                .count()
                >= n
        },
    )
    .await
    .map(drop)
}

async fn wait_blocks_cleared(operator: &Dialer, grpc: &str) -> anyhow::Result<()> {
    wait_status(
        operator,
        grpc,
        "seeing the engines' caches cleared",
        Duration::from_secs(30),
        |s| s.indexed_blocks == 0,
    )
    .await
    .map(drop)
}
