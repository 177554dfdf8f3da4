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
    pub(super) fitted_prefill_ms_per_ktoken_squared: f64,
    /// What the simulator's answer path adds to its steps, measured on its default run.
    pub(super) sim_answer_overhead_ms: f64,
}

/// Median uncached and cached TTFT at each of [`LENGTHS`] on the engine at `url`, in engine
/// time (wall time times `speedup`).
///
/// Each request on a connection of its own: a Dynamo frontend (as any server that leaves
/// Nagle's algorithm on) holds a stream's first chunk until the client acknowledges the
/// response's headers, which a connection's delayed ACKs hold up to 40 ms, so on a kept
/// connection a first token measured 16 or 40-odd ms by turns, whatever the engine's time; a new
/// connection acknowledges at once.
async fn measure(url: &str, seed: usize, speedup: f64) -> anyhow::Result<Vec<Point>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
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
            "--prefill-ms-per-ktoken-squared".into(),
            params.prefill_ms_per_ktoken_squared.to_string(),
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

/// What the simulator's answer path adds to its steps (its HTTP, its tokenizer, its clock),
/// from its run with `params`: each cached TTFT less the one step it is (that step's sequence
/// and the prompt's last tokens, after its last full block), the median.
fn answer_overhead_ms(points: &[Point], params: &EngineParams) -> f64 {
    let bs = u64::from(params.block_size.max(1));
    let over: Vec<f64> = points
        .iter()
        .map(|p| {
            let computed = p.prompt_tokens - p.prompt_tokens.saturating_sub(1) / bs * bs;
            let step = params.step_base_ms
                + params.per_seq_ms
                + computed as f64 / params.prefill_tokens_per_s * 1000.0;
            p.cached_ms - step
        })
        .collect();
    percentile(&over, 0.5).max(0.0)
}

/// The simulator's speed fitted to `mocker`, with the mocker's token budget: a cached prompt
/// costs one step and the simulator's own answer path (`overhead_ms`, see
/// [`answer_overhead_ms`]), so a step costs the median cached TTFT less both; an uncached
/// prompt costs a cached one's time and its tokens' prefill, `a * tokens + b * tokens^2` (the
/// mocker's prefill is convex), `a` and `b` least-squares over the uncached TTFTs less the
/// median cached one, neither negative (see [`prefill_fit`]).
fn fit(mocker: &[Point], overhead_ms: f64) -> EngineParams {
    let defaults = EngineParams::default();
    let cached = percentile(&mocker.iter().map(|p| p.cached_ms).collect::<Vec<_>>(), 0.5);
    let pts: Vec<(f64, f64)> = mocker
        .iter()
        .map(|p| (p.prompt_tokens as f64, p.uncached_ms - cached))
        .collect();
    let (per_token, per_token_squared) = prefill_fit(&pts);
    EngineParams {
        step_base_ms: (cached - overhead_ms - defaults.per_seq_ms).max(0.0),
        max_num_batched_tokens: MOCKER_BATCHED_TOKENS,
        // No linear part (a prefill all square): a rate too high to count.
        prefill_tokens_per_s: if per_token > 0.0 {
            1000.0 / per_token
        } else {
            1e12
        },
        prefill_ms_per_ktoken_squared: per_token_squared * 1e6,
        ..defaults
    }
}

/// `(a, b)` minimizing the squared error of `y = a x + b x^2` over `pts` with `a, b >= 0`:
/// the unconstrained pair when both are, else the better of the line through the origin and
/// the parabola through it (each clamped at 0).
fn prefill_fit(pts: &[(f64, f64)]) -> (f64, f64) {
    let sum = |f: &dyn Fn(f64, f64) -> f64| pts.iter().map(|&(x, y)| f(x, y)).sum::<f64>();
    let (s2, s3, s4) = (
        sum(&|x, _| x * x),
        sum(&|x, _| x.powi(3)),
        sum(&|x, _| x.powi(4)),
    );
    let (s1y, s2y) = (sum(&|x, y| x * y), sum(&|x, y| x * x * y));
    let det = s2 * s4 - s3 * s3;
    if det > 0.0 {
        let (a, b) = ((s1y * s4 - s2y * s3) / det, (s2 * s2y - s3 * s1y) / det);
        if a >= 0.0 && b >= 0.0 {
            return (a, b);
        }
    }
    let error = |(a, b): (f64, f64)| sum(&|x, y| (y - a * x - b * x * x).powi(2));
    let line = (if s2 > 0.0 { (s1y / s2).max(0.0) } else { 0.0 }, 0.0);
    let parabola = (0.0, if s4 > 0.0 { (s2y / s4).max(0.0) } else { 0.0 });
    if error(parabola) < error(line) {
        parabola
    } else {
        line
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
    let overhead_ms = answer_overhead_ms(&sim_default, &defaults);
    let fitted = fit(&mocker, overhead_ms);
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
        fitted_prefill_ms_per_ktoken_squared: fitted.prefill_ms_per_ktoken_squared,
        sim_answer_overhead_ms: overhead_ms,
    })
}

/// The check as a table on stderr: each engine's TTFTs and the simulator's over the mocker's.
pub(super) fn print(c: &Check) {
    eprintln!();
    eprintln!(
        "in-house simulator against the mocker (one request at a time; fitted: {:.0} prefill tokens/s, {:.3} ms per thousand prefill tokens squared, {:.1} ms a step, {} tokens a step; the simulator's answer path adds {:.1} ms)",
        c.fitted_prefill_tokens_per_s,
        c.fitted_prefill_ms_per_ktoken_squared,
        c.fitted_step_base_ms,
        c.fitted_max_num_batched_tokens,
        c.sim_answer_overhead_ms
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_fit_finds_a_quadratic_with_no_negative_term() {
        // Dynamo's mocker's own prefill polynomial, without its intercept (the step's).
        let mocker = |x: f64| 1.518_344e-2 * x + 4.209_989e-7 * x * x;
        let pts: Vec<(f64, f64)> = [300.0, 1_200.0, 2_400.0, 4_700.0]
            .iter()
            .map(|&x| (x, mocker(x)))
            .collect();
        let (a, b) = prefill_fit(&pts);
        assert!(
            (a - 1.518_344e-2).abs() < 1e-9 && (b - 4.209_989e-7).abs() < 1e-12,
            "{a} {b}"
        );
        // Strongly convex, the free fit's line part negative: the parabola alone.
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 3.0, 4.0]
            .iter()
            .map(|&x: &f64| (x, x.powi(3)))
            .collect();
        let (a, b) = prefill_fit(&pts);
        let parabola = pts.iter().map(|(x, y)| x * x * y).sum::<f64>()
            / pts.iter().map(|(x, _)| x.powi(4)).sum::<f64>();
        assert_eq!(a, 0.0);
        assert!((b - parabola).abs() < 1e-12, "{b} {parabola}");
        // Concave data: the best line through the origin, no square.
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 3.0]
            .iter()
            .map(|&x: &f64| (x, x.sqrt()))
            .collect();
        let (a, b) = prefill_fit(&pts);
        let line = pts.iter().map(|(x, y)| x * y).sum::<f64>() / 14.0;
        assert_eq!(b, 0.0);
        assert!((a - line).abs() < 1e-12);
    }
}
