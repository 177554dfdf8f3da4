//! The in-house simulator against the engines we did not write: one Dynamo mocker and one
//! `kvplane sim engine` (its defaults, then its speed fitted to the mocker) answer the same
//! requests one at a time - a new prompt (uncached) and the same prompt again (cached) at
//! several lengths - and their TTFTs are set side by side.

use std::path::Path;

use kvplane_sim::params::EngineParams;
use kvplane_sim::workload::WorkItem;
use serde::Serialize;

use super::dynamo;
use crate::client::{percentile, send};
use crate::procs::{Procs, field, start_sim_engine};

/// Prompt lengths in words (about 1.1 tokens each with the default tokenizer).
const LENGTHS: [usize; 4] = [250, 1_000, 2_000, 4_000];
/// Requests of each kind at each length; the median counts.
const TRIALS: usize = 9;

/// One engine's median TTFTs at one prompt length.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Point {
    pub(super) prompt_tokens: u64,
    pub(super) uncached_ms: f64,
    pub(super) cached_ms: f64,
}

/// What the check found: the mocker's points, the simulator's with its defaults and with its
/// speed fitted to the mocker, and the fitted parameters.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Check {
    pub(super) mocker: Vec<Point>,
    pub(super) sim_default: Vec<Point>,
    pub(super) sim_fitted: Vec<Point>,
    pub(super) fitted_prefill_tokens_per_s: f64,
    pub(super) fitted_step_base_ms: f64,
    pub(super) fitted_max_num_batched_tokens: u32,
}

/// Median uncached and cached TTFT at each of [`LENGTHS`] on the engine at `url`, in engine
/// time (wall time times `speedup`).
async fn measure(url: &str, seed: usize, speedup: f64) -> anyhow::Result<Vec<Point>> {
    let client = reqwest::Client::new();
    let mut points = Vec::new();
    for (l, &words) in LENGTHS.iter().enumerate() {
        let (mut uncached, mut cached, mut tokens) = (Vec::new(), Vec::new(), 0);
        for t in 0..TRIALS {
            let item = WorkItem {
                at_ms: 0.0,
                family: None,
                system: prompt(words, seed * 1_000 + l * 100 + t),
                history: Vec::new(),
                question: "say something".into(),
                max_tokens: 2,
            };
            for list in [&mut uncached, &mut cached] {
                let o = send(&client, url, dynamo::MODEL, &item, speedup).await;
                anyhow::ensure!(o.ok(), "{url} failed a request (status {})", o.status);
                tokens = o.prompt_tokens;
                list.push(o.ttft_ms);
            }
        }
        points.push(Point {
            prompt_tokens: tokens,
            uncached_ms: percentile(&uncached, 0.5),
            cached_ms: percentile(&cached, 0.5),
        });
    }
    Ok(points)
}

/// `words` seeded words (about a token each) no other prompt begins with.
fn prompt(words: usize, n: usize) -> String {
    let vocabulary = [
        "engine", "cache", "token", "block", "prefix", "model", "queue", "state",
    ];
    let mut rng = kvplane_sim::rng::Rng::new(n as u64);
    let mut out = format!("timing{n}");
    for _ in 0..words {
        out.push(' ');
        out.push_str(vocabulary[rng.below(vocabulary.len() as u64) as usize]);
    }
    out
}

/// Starts `kvplane sim engine` with `params` and the model's tokenizer; its chat URL.
fn start_sim(
    procs: &mut Procs,
    name: &str,
    model: &Path,
    gpu_blocks: u32,
    params: &EngineParams,
) -> anyhow::Result<String> {
    let ready = start_sim_engine(
        procs,
        name,
        &[
            "--model".into(),
            dynamo::MODEL.into(),
            "--tokenizer".into(),
            model.display().to_string(),
            "--block-size".into(),
            dynamo::BLOCK_SIZE.to_string(),
            "--num-gpu-blocks".into(),
            gpu_blocks.to_string(),
            "--prefill-tokens-per-s".into(),
            params.prefill_tokens_per_s.to_string(),
            "--step-base-ms".into(),
            params.step_base_ms.to_string(),
            "--max-num-batched-tokens".into(),
            params.max_num_batched_tokens.to_string(),
        ],
    )?;
    Ok(format!(
        "http://{}/v1/chat/completions",
        field(&ready, "http")?
    ))
}

/// The mocker's scheduler token budget (its default): a prompt of up to this many tokens is
/// prefilled in one step.
const MOCKER_BATCHED_TOKENS: u32 = 8_192;

/// The simulator's speed fitted to `mocker`, with the mocker's token budget: a cached prompt
/// costs one step, so a step costs the median cached TTFT; an uncached prompt costs a step
/// and its tokens at the prefill rate, the rate least-squares over the uncached TTFTs.
fn fit(mocker: &[Point]) -> EngineParams {
    let defaults = EngineParams::default();
    let step = percentile(&mocker.iter().map(|p| p.cached_ms).collect::<Vec<_>>(), 0.5).max(0.0);
    let (sxy, sxx) = mocker.iter().fold((0.0, 0.0), |(sxy, sxx), p| {
        let x = p.prompt_tokens as f64;
        (sxy + x * (p.uncached_ms - step), sxx + x * x)
    });
    let ms_per_token = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    EngineParams {
        step_base_ms: step,
        max_num_batched_tokens: MOCKER_BATCHED_TOKENS,
        prefill_tokens_per_s: if ms_per_token > 0.0 {
            1000.0 / ms_per_token
        } else {
            defaults.prefill_tokens_per_s
        },
        ..defaults
    }
}

/// Runs the check in `dir` with engines of `gpu_blocks` blocks.
pub(super) async fn check(dir: &Path, setup: &dynamo::Setup) -> anyhow::Result<Check> {
    std::fs::create_dir_all(dir)?;
    let mut procs = Procs::new(dir);
    let engines = dynamo::start_engines(&mut procs, dir, setup, 1).await?;
    let mocker = measure(
        &format!("{}/v1/chat/completions", engines[0].openai),
        1,
        setup.speedup,
    )
    .await?;
    let defaults = EngineParams::default();
    let url = start_sim(
        &mut procs,
        "sim-default",
        &setup.model,
        setup.gpu_blocks,
        &defaults,
    )?;
    let sim_default = measure(&url, 2, 1.0).await?;
    let fitted = fit(&mocker);
    let url = start_sim(
        &mut procs,
        "sim-fitted",
        &setup.model,
        setup.gpu_blocks,
        &fitted,
    )?;
    let sim_fitted = measure(&url, 3, 1.0).await?;
    Ok(Check {
        mocker,
        sim_default,
        sim_fitted,
        fitted_prefill_tokens_per_s: fitted.prefill_tokens_per_s,
        fitted_step_base_ms: fitted.step_base_ms,
        fitted_max_num_batched_tokens: fitted.max_num_batched_tokens,
    })
}

/// The check as a table on stderr: each engine's TTFTs and the simulator's over the mocker's.
pub(super) fn print(c: &Check) {
    eprintln!();
    eprintln!(
        "in-house simulator against the mocker (one request at a time; fitted: {:.0} prefill tokens/s, {:.1} ms a step, {} tokens a step)",
        c.fitted_prefill_tokens_per_s, c.fitted_step_base_ms, c.fitted_max_num_batched_tokens
    );
    eprintln!(
        "{:>8} {:>21} {:>21} {:>21} {:>15} {:>15}",
        "tokens",
        "mocker unc./cached ms",
        "sim default ms",
        "sim fitted ms",
        "default/mocker",
        "fitted/mocker"
    );
    for ((m, d), f) in c.mocker.iter().zip(&c.sim_default).zip(&c.sim_fitted) {
        eprintln!(
            "{:>8} {:>10.1}/{:<10.1} {:>10.1}/{:<10.1} {:>10.1}/{:<10.1} {:>7.2}/{:<7.2} {:>7.2}/{:<7.2}",
            m.prompt_tokens,
            m.uncached_ms,
            m.cached_ms,
            d.uncached_ms,
            d.cached_ms,
            f.uncached_ms,
            f.cached_ms,
            d.uncached_ms / m.uncached_ms,
            d.cached_ms / m.cached_ms,
            f.uncached_ms / m.uncached_ms,
            f.cached_ms / m.cached_ms,
        );
    }
}
