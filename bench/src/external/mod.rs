//! `kvplane bench external`: routing on engines we did not write. A fleet of NVIDIA Dynamo's
//! mocker engines (see [`dynamo`]) serves the same seeded workloads three ways, each on a
//! fresh fleet (cold caches): round-robin over the engines' endpoints (a Kubernetes Service),
//! Dynamo's own KV-aware router, and kvplane (a three-member cluster fed by a bridge per
//! engine - its ZMQ events, its metrics - with a gateway per member, requests spread over
//! the gateways). The client streams every request and times its first chunk. Prints a table
//! and JSON; `--small` is what CI runs (it checks that every request was answered, not the
//! timings).

mod dynamo;
mod placement;
mod prediction;
mod timing;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use kvplane_sim::workload::{Kind, Spec, WorkItem, generate};
use kvplane_testkit::process;
use serde::Serialize;

use crate::client::{Outcome, percentile, run_phase};
use crate::procs::{
    Procs, start_gateways, start_members, start_nats, start_round_robin, wait_status,
};

#[derive(Debug, Clone, clap::Args)]
pub struct ExternalBenchArgs {
    /// A Python with the `ai-dynamo` package (`python -m dynamo.mocker` and
    /// `python -m dynamo.frontend`).
    #[arg(long, env = "KVPLANE_DYNAMO_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// A tokenizer directory (`tokenizer.json`, its config, a chat template) both the Dynamo
    /// frontends and kvplane tokenize with.
    #[arg(long, default_value = "tokenize/tests/fixtures/llama3-style")]
    pub tokenizer: PathBuf,
    /// Engines in the fleet.
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    /// Runs of each workload and strategy (each on a fresh fleet).
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// Workloads to run: `shared-prefix` (8 system prompts of 1,000 words, about 3,600 tokens
    /// with the default tokenizer, each request one of them and its own question; 600 requests
    /// at 10/s), `unique` (every prompt new, as long; 240 at 3.5/s), `multi-turn` (16
    /// conversations of up to six turns, each with its own 500-word system prompt, a turn
    /// repeating the conversation so far; 240 at 6/s) and `bursts` (`shared-prefix` arriving
    /// at 24/s for 5 s in every 15 s, 320 requests).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shared-prefix,unique,multi-turn,bursts"
    )]
    pub workloads: Vec<String>,
    /// Strategies to run: `round-robin`, `dynamo-kv` (Dynamo's KV router), `kvplane` (three
    /// members, a gateway each) and `kvplane-one-gateway` (the same members, every request
    /// through the first one's gateway: its replica alone sees what it routes).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,dynamo-kv,kvplane,kvplane-one-gateway"
    )]
    pub strategies: Vec<String>,
    /// The engines' KV-cache blocks (of 16 tokens): 1,024 hold four of the shared-prefix
    /// workload's system prompts, so one engine cannot cache them all and three can.
    #[arg(long, default_value_t = 1024)]
    pub gpu_blocks: u32,
    /// The mockers' speed-up over real time (requests arrive faster by as much).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// A quick run (20% of the requests, one repetition): what CI runs to check the benchmark
    /// still works, never its timings.
    #[arg(long)]
    pub small: bool,
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    /// More TOML for every kvplane member's config (after its top-level keys), e.g.
    /// `[cost]` and `learn = false` on two lines to route with the configured cost model only.
    #[arg(long, default_value = "")]
    pub kvplane_config: String,
    /// Skip the check of the in-house simulator's timings against one mocker engine.
    #[arg(long)]
    pub skip_timing_check: bool,
    /// Write each workload's TTFT CDFs (a line per strategy, every repetition's requests) to
    /// `ttft-<workload>.svg` in this directory.
    #[arg(long, default_value = "target/bench-external")]
    pub plot_dir: PathBuf,
    /// Where the processes keep their logs (default: a temporary directory, kept on failure).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// One workload's requests.
fn workload(name: &str, small: bool, seed: u64) -> anyhow::Result<Vec<WorkItem>> {
    let scale = |n: usize| if small { n / 5 } else { n };
    let spec = match name {
        "shared-prefix" => Spec {
            kind: Kind::SharedPrefix,
            requests: scale(600),
            rate_per_s: 10.0,
            system_prompts: 8,
            system_words: 1_000,
            question_words: 40,
            max_tokens: 32,
            seed,
        },
        "unique" => Spec {
            kind: Kind::NoPrefix,
            requests: scale(240),
            rate_per_s: 3.5,
            system_prompts: 1,
            system_words: 1_000,
            question_words: 40,
            max_tokens: 32,
            seed,
        },
        "multi-turn" => Spec {
            kind: Kind::MultiTurn,
            requests: scale(240),
            rate_per_s: 6.0,
            system_prompts: 16,
            system_words: 500,
            question_words: 40,
            max_tokens: 32,
            seed,
        },
        "bursts" => Spec {
            kind: Kind::Bursts,
            requests: scale(320),
            rate_per_s: 8.0,
            system_prompts: 8,
            system_words: 1_000,
            question_words: 40,
            max_tokens: 32,
            seed,
        },
        other => bail!("unknown workload {other:?} (shared-prefix, unique, multi-turn, bursts)"),
    };
    Ok(generate(&spec))
}

/// What one run of one strategy on one workload gave.
#[derive(Debug, Clone, Serialize)]
struct Run {
    workload: String,
    strategy: String,
    repetition: usize,
    requests: usize,
    failed: usize,
    ttft_p50_s: f64,
    ttft_p90_s: f64,
    ttft_p99_s: f64,
    /// Cached prompt tokens over prompt tokens, from the answers' usage (0 when the engines
    /// report no cached tokens).
    cached_share: f64,
    /// The mean prompt length in tokens, from the answers' usage.
    prompt_tokens_mean: f64,
    /// Requests per engine, where the gateway named the engine (kvplane's gateways do).
    per_engine: Vec<(String, usize)>,
    /// Where the prefixes went: prefix/engine pairs (where the gateway named the engine:
    /// kvplane's and the round-robin one do, Dynamo's frontend does not) and the hit rate per
    /// 10 s of arrivals.
    placement: placement::Placement,
    /// kvplane's: how well it predicted the first tokens reported after the first quarter of
    /// the run (its members' `kvplane_ttft_prediction_ratio`).
    prediction: Option<prediction::Summary>,
    /// TTFT's CDF: its 0th, 1st, ..., 100th percentile in seconds.
    ttft_cdf_s: Vec<f64>,
}

fn summarize(
    workload: &str,
    strategy: &str,
    repetition: usize,
    items: &[WorkItem],
    outcomes: &[Outcome],
    engines: &[dynamo::Engine],
    prediction: Option<prediction::Summary>,
) -> Run {
    let ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms / 1000.0).collect();
    let prompt: u64 = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
    Run {
        workload: workload.to_owned(),
        strategy: strategy.to_owned(),
        repetition,
        requests: outcomes.len(),
        failed: outcomes.iter().filter(|o| !o.ok()).count(),
        ttft_p50_s: percentile(&ttfts, 0.5),
        ttft_p90_s: percentile(&ttfts, 0.9),
        ttft_p99_s: percentile(&ttfts, 0.99),
        cached_share: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        prompt_tokens_mean: prompt as f64 / outcomes.len().max(1) as f64,
        per_engine: engines
            .iter()
            .map(|e| {
                let n = outcomes
                    .iter()
                    .filter(|o| o.worker.ends_with(&format!("/{}", e.name)))
                    .count();
                (e.name.clone(), n)
            })
            .collect(),
        placement: placement::placement(items, outcomes),
        prediction,
        ttft_cdf_s: (0..=100)
            .map(|p| percentile(&ttfts, f64::from(p) / 100.0))
            .collect(),
    }
}

/// kvplane in front of `engines`: NATS, three members whose one worker set is the fleet (with
/// the engines' tokenizer and nothing told of their speed), a bridge per engine, a gateway
/// for each of the first `gateways` members. Returns the gateways' URLs and the members' HTTP
/// addresses once every member sees every engine up.
async fn start_kvplane(
    procs: &mut Procs,
    dir: &Path,
    engines: &[dynamo::Engine],
    model_dir: &Path,
    gateways: usize,
    extra_config: &str,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let exe = process::kvplane_binary();
    let nats_url = start_nats(procs, dir, None).await?;
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies)?;
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: default}}\nspec: {{model: {}, blockSize: {}, tokenizer: {}}}\n",
            dynamo::MODEL,
            dynamo::BLOCK_SIZE,
            model_dir.display()
        ),
    )?;
    let (nodes, http) = start_members(
        procs,
        dir,
        &nats_url,
        3,
        &format!(
            "pools = []\npolicy_dir = \"{}\"\npolicy_poll_ms = 200\n{extra_config}\n",
            policies.display()
        ),
    )?;
    for e in engines {
        procs.spawn(
            &format!("bridge-{}", e.name),
            &exe,
            &[
                "bridge".into(),
                "--worker".into(),
                e.name.clone(),
                "--engine-url".into(),
                e.system.clone(),
                "--announce-address".into(),
                e.openai.clone(),
                "--zmq-pub".into(),
                e.zmq_pub.clone(),
                "--zmq-replay".into(),
                e.zmq_replay.clone(),
                "--nats-url".into(),
                nats_url.clone(),
                "--scrape-interval-ms".into(),
                "250".into(),
            ],
            Some("kvplane-bridge ready"),
        )?;
    }
    for n in &nodes {
        wait_status(
            &kvplane_tls::Dialer::plain(),
            n,
            "seeing every engine up",
            Duration::from_secs(60),
            |s| {
                s.policy_objects.get("InferenceWorkerSet") == Some(&1)
                    && s.workers
                        .iter()
                        .filter(|w| w.up && !w.address.is_empty())
                        .count()
                        >= engines.len()
            },
        )
        .await?;
    }
    let urls = start_gateways(procs, &nodes[..gateways.min(nodes.len())], &[], false)?;
    Ok((urls, http))
}

/// One strategy on one workload, on a fresh fleet in `dir`.
async fn run_once(
    a: &ExternalBenchArgs,
    setup: &dynamo::Setup,
    dir: &Path,
    strategy: &str,
    items: &[WorkItem],
) -> anyhow::Result<(
    Vec<Outcome>,
    Vec<dynamo::Engine>,
    Option<prediction::Summary>,
)> {
    std::fs::create_dir_all(dir)?;
    let mut procs = Procs::new(dir);
    let engines = dynamo::start_engines(&mut procs, dir, setup, a.engines).await?;
    let mut members = Vec::new();
    let urls: Vec<String> = match strategy {
        "round-robin" => {
            let list: Vec<String> = engines.iter().map(|e| e.openai.clone()).collect();
            vec![start_round_robin(&mut procs, &list, &[], false)?]
        }
        "dynamo-kv" => vec![dynamo::start_kv_router(&mut procs, dir, setup).await?],
        "kvplane" | "kvplane-one-gateway" => {
            let gateways = if strategy == "kvplane" { 3 } else { 1 };
            let (urls, http) = start_kvplane(
                &mut procs,
                dir,
                &engines,
                &setup.model,
                gateways,
                &a.kvplane_config,
            )
            .await?;
            members = http;
            urls
        }
        other => bail!(
            "unknown strategy {other:?} (round-robin, dynamo-kv, kvplane, kvplane-one-gateway)"
        ),
    };
    // The prediction ratios once a quarter of the schedule has passed (the warm-up), then at
    // the end.
    let warm_up = {
        let members = members.clone();
        let quarter_ms = items.last().map_or(0.0, |i| i.at_ms) / 4.0 / a.speedup;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(quarter_ms as u64)).await;
            prediction::read(&members).await
        })
    };
    let outcomes = run_phase(
        &reqwest::Client::new(),
        strategy,
        &urls,
        dynamo::MODEL,
        items,
        a.speedup,
    )
    .await;
    let prediction = if members.is_empty() {
        None
    } else {
        let before = warm_up.await.unwrap_or_default();
        Some(prediction::read(&members).await.since(&before))
    };
    drop(procs);
    Ok((outcomes, engines, prediction))
}

pub async fn run(a: ExternalBenchArgs) -> anyhow::Result<()> {
    if !(a.speedup > 0.0 && a.engines > 0) {
        bail!("speedup and engines must be positive");
    }
    let repetitions = if a.small { 1 } else { a.repetitions.max(1) };
    let temp = a.dir.is_none();
    let root = a.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvplane-bench-external-{}", std::process::id()))
    });
    std::fs::create_dir_all(&root)?;
    eprintln!("bench external: logs in {}", root.display());
    let setup = dynamo::Setup {
        python: a.python.clone(),
        model: dynamo::model_dir(&a.tokenizer, &root.join("model"))?,
        speedup: a.speedup,
        gpu_blocks: a.gpu_blocks,
    };
    let timing = if a.skip_timing_check {
        None
    } else {
        eprintln!("timing check: one mocker, the in-house simulator as it is and fitted to it");
        let dir = root.join("timing");
        Some(
            timing::check(&dir, &setup)
                .await
                .with_context(|| format!("timing check (logs in {})", dir.display()))?,
        )
    };
    let mut runs = Vec::new();
    std::fs::create_dir_all(&a.plot_dir)?;
    for w in &a.workloads {
        // Per strategy, every repetition's TTFTs in ms.
        let mut lines: Vec<(String, Vec<f64>)> = a
            .strategies
            .iter()
            .map(|s| (s.clone(), Vec::new()))
            .collect();
        let items = workload(w, a.small, a.seed)?;
        for r in 0..repetitions {
            for s in &a.strategies {
                let dir = root.join(format!("{w}-{s}-{r}"));
                eprintln!("{w}, {s}, run {}: {} requests", r + 1, items.len());
                let (outcomes, engines, predicted) = run_once(&a, &setup, &dir, s, &items)
                    .await
                    .with_context(|| {
                        format!("{w}, {s}, run {} (logs in {})", r + 1, dir.display())
                    })?;
                runs.push(summarize(w, s, r, &items, &outcomes, &engines, predicted));
                if let Some((_, line)) = lines.iter_mut().find(|(name, _)| name == s) {
                    line.extend(outcomes.iter().filter(|o| o.ok()).map(|o| o.ttft_ms));
                }
            }
        }
        for (_, line) in &mut lines {
            line.sort_by(f64::total_cmp);
        }
        let path = a.plot_dir.join(format!("ttft-{w}.svg"));
        std::fs::write(&path, crate::svg::cdf_chart(w, &lines))?;
    }
    eprintln!("TTFT CDFs in {}", a.plot_dir.display());
    print_table(&runs);
    if let Some(t) = &timing {
        timing::print(t);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "engines": a.engines, "gpu_blocks": a.gpu_blocks, "speedup": a.speedup,
            "repetitions": repetitions, "seed": a.seed, "runs": runs,
            "timing_check": timing,
        }))?
    );
    let failed: usize = runs.iter().map(|r| r.failed).sum();
    if failed > 0 {
        bail!("{failed} requests failed (logs in {})", root.display());
    }
    if temp {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}

/// Per workload and strategy: the median over repetitions of each figure, and p99's spread.
fn print_table(runs: &[Run]) {
    eprintln!();
    eprintln!(
        "{:<14} {:<20} {:>9} {:>9} {:>9} {:>10} {:>8} {:>11} {:>11} {:>7} {:>14}",
        "workload",
        "strategy",
        "p50 s",
        "p90 s",
        "p99 s",
        "p99 spread",
        "cached",
        "worst 10 s",
        "pairs",
        "failed",
        "predicted 15%"
    );
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in runs {
        let k = (r.workload.as_str(), r.strategy.as_str());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (w, s) in keys {
        let of: Vec<&Run> = runs
            .iter()
            .filter(|r| r.workload == w && r.strategy == s)
            .collect();
        let median = |f: fn(&Run) -> f64| {
            let v: Vec<f64> = of.iter().map(|r| f(r)).collect();
            percentile(&v, 0.5)
        };
        let p99: Vec<f64> = of.iter().map(|r| r.ttft_p99_s).collect();
        // Prefix/engine pairs, over the repetitions (where the gateway named the engine).
        let pairs = of
            .iter()
            .map(|r| r.placement.prefix_engine_pairs)
            .filter(|&n| n > 0)
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join("/");
        let pairs = if pairs.is_empty() {
            "-".to_owned()
        } else {
            pairs
        };
        // The share of first tokens predicted within 15% after the warm-up (kvplane's).
        let within: Vec<f64> = of
            .iter()
            .filter_map(|r| r.prediction.as_ref())
            .filter(|p| p.reports > 0)
            .map(|p| p.within_15_percent)
            .collect();
        let within = if within.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.0}%", percentile(&within, 0.5) * 100.0)
        };
        let spread = percentile(&p99, 1.0) / percentile(&p99, 0.0).max(1e-9) - 1.0;
        eprintln!(
            "{:<14} {:<20} {:>9.3} {:>9.3} {:>9.3} {:>9.0}% {:>7.1}% {:>10.1}% {:>11} {:>7} {:>14}",
            w,
            s,
            median(|r| r.ttft_p50_s),
            median(|r| r.ttft_p90_s),
            median(|r| r.ttft_p99_s),
            spread * 100.0,
            median(|r| r.cached_share) * 100.0,
            median(|r| r.placement.lowest_window_hit_rate) * 100.0,
            pairs,
            of.iter().map(|r| r.failed).sum::<usize>(),
            within
        );
    }
}
