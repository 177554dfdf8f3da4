//! `kvplane bench routing`: a virtual-time simulation of a fleet (the engine model of `kvplane
//! sim engine`, no sleeping) replaying seeded workloads through the routing strategies users
//! would otherwise deploy and through kvplane itself (its real RouterService on a state fed by
//! the engines' KV events and metrics). Prints a table on stderr, JSON on stdout, and writes
//! TTFT CDF charts (SVG).

mod fleet;
mod strategies;
pub(crate) mod workloads;

use std::path::PathBuf;

use kvplane_api::CostModel;
use kvplane_sim::EngineParams;
use serde::Serialize;

use fleet::Router;
use strategies::{DynamoCost, Feed, KvRouter, Kvplane, LeastQueue, Oracle, PrefixHash, RoundRobin};

/// How late replicas hear of each other's decisions by default (ms): what real nodes measured
/// over a real nats-server (`kvplane_routed_note_delay_seconds`, in
/// `node/tests/policy_routing.rs::replicas_hear_of_each_others_decisions_within_a_few_milliseconds`:
/// p50 at most 0.4 ms, p99 at most 1.6 ms, on loopback), rounded up.
pub const SHARE_MS: f64 = 2.0;

#[derive(Debug, Clone, clap::Args)]
pub struct RoutingBenchArgs {
    /// Requests per workload.
    #[arg(long, default_value_t = 2_000)]
    pub requests: usize,
    /// Engines in the fleet (the article's pools had 3 GPUs).
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Only these workloads (default: all).
    #[arg(long = "workload")]
    pub workloads: Vec<String>,
    /// How late a single router sees the engines' events and metrics (ms).
    #[arg(long, default_value_t = 10.0)]
    pub lag_ms: f64,
    /// How late a replica learns another replica's routing decision (ms): replicas deciding
    /// within it of each other may take the same idle engine.
    #[arg(long, default_value_t = SHARE_MS)]
    pub share_ms: f64,
    /// Where to write the charts (`ttft-<workload>.svg`) and `routing.json`.
    #[arg(long, default_value = "target/bench-routing")]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Row {
    strategy: String,
    ttft_p50_s: f64,
    ttft_p90_s: f64,
    ttft_p99_s: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    prefix_cache_hit_rate: f64,
    /// Most requests on one engine over the mean.
    load_imbalance: f64,
    completed: usize,
}

#[derive(Debug, Serialize)]
struct WorkloadReport {
    workload: String,
    requests: usize,
    rows: Vec<Row>,
    /// kvplane's median TTFT as a share of round-robin's.
    kvplane_p50_to_round_robin: f64,
    /// kvplane's p50 over the best other strategy's (1.0: tied; below: better).
    kvplane_p50_to_best_other: f64,
    kvplane_p90_to_best_other: f64,
    /// The perfect-knowledge bound (see `strategies`): how close kvplane's p50 comes to it.
    kvplane_p50_to_oracle: f64,
    /// Three replicas routing at once, over one router.
    three_replicas_p50_to_one: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The engines: the simulator's defaults with a smaller KV cache (4,096 blocks, 64k tokens), so
/// that the shared-prefix workload's prompts fit three engines but not one.
fn engine_params() -> EngineParams {
    EngineParams {
        num_gpu_blocks: 4_096,
        ..EngineParams::default()
    }
}

/// The cost model of a node configured for these engines: one step of overhead, their prefill
/// rate, a step's share per running sequence, an average prefill per waiting request.
pub(crate) fn engine_cost(p: &EngineParams) -> CostModel {
    CostModel {
        base_ms: p.step_base_ms,
        prefill_tokens_per_s: p.prefill_tokens_per_s,
        waiting_request_ms: 50.0,
        running_request_ms: 1.0,
        learn: false,
    }
}

fn strategies(a: &RoutingBenchArgs, p: &EngineParams) -> Vec<(String, Box<dyn Router>)> {
    let cost = engine_cost(p);
    let feed = |lag| Feed::new(lag, p.prefill_tokens_per_s);
    vec![
        (
            "round-robin".into(),
            Box::new(RoundRobin(0, a.engines)) as Box<dyn Router>,
        ),
        (
            "least-queue".into(),
            Box::new(LeastQueue::new(feed(a.lag_ms))),
        ),
        ("prefix-hash".into(), Box::new(PrefixHash(a.engines))),
        ("oracle".into(), Box::new(Oracle)),
        (
            "dynamo-cost".into(),
            Box::new(DynamoCost::new(feed(a.lag_ms), p.num_gpu_blocks)),
        ),
        (
            "kvplane".into(),
            Box::new(Kvplane::new(
                vec![KvRouter::new(feed(a.lag_ms), cost)],
                a.share_ms,
            )),
        ),
        (
            "kvplane-3-replicas".into(),
            Box::new(Kvplane::new(
                [a.lag_ms, 3.0 * a.lag_ms, 6.0 * a.lag_ms]
                    .into_iter()
                    .map(|lag| KvRouter::new(feed(lag), cost))
                    .collect(),
                a.share_ms,
            )),
        ),
    ]
}

/// Round-robin and kvplane with `replicas` routers (state 10, 20, 30... ms late) on `reqs` in
/// virtual time: each strategy's TTFTs, sorted (`kvplane demo` compares them with its real
/// processes).
pub(crate) fn virtual_run(
    reqs: &[workloads::Req],
    params: EngineParams,
    engines: usize,
    replicas: usize,
) -> Vec<(&'static str, Vec<f64>)> {
    let cost = engine_cost(&params);
    let mut routers: Vec<(&'static str, Box<dyn Router>)> = vec![
        ("round-robin", Box::new(RoundRobin(0, engines))),
        (
            "kvplane",
            Box::new(Kvplane::new(
                (1..=replicas.max(1))
                    .map(|r| {
                        KvRouter::new(
                            Feed::new(10.0 * r as f64, params.prefill_tokens_per_s),
                            cost,
                        )
                    })
                    .collect(),
                SHARE_MS,
            )),
        ),
    ];
    routers
        .iter_mut()
        .map(|(name, r)| {
            let mut t = fleet::run(reqs, params, engines, r.as_mut()).ttft_ms;
            t.sort_by(f64::total_cmp);
            (*name, t)
        })
        .collect()
}

pub async fn run(a: RoutingBenchArgs) -> anyhow::Result<()> {
    let params = engine_params();
    let names: Vec<String> = if a.workloads.is_empty() {
        workloads::NAMES.iter().map(|s| (*s).to_owned()).collect()
    } else {
        a.workloads.clone()
    };
    std::fs::create_dir_all(&a.out)?;
    let mut reports = Vec::new();
    for name in &names {
        let reqs = workloads::generate(name, a.requests, a.seed);
        anyhow::ensure!(!reqs.is_empty(), "unknown workload {name:?}");
        let mut rows = Vec::new();
        let mut series = Vec::new();
        for (strategy, mut router) in strategies(&a, &params) {
            let o = fleet::run(&reqs, params, a.engines, router.as_mut());
            let mut t = o.ttft_ms.clone();
            t.sort_by(f64::total_cmp);
            let span_s = ((o.last_finish_ms - o.first_arrival_ms) / 1000.0).max(1e-9);
            let mean = o.requests_per_engine.iter().sum::<u64>() as f64 / a.engines as f64;
            let max = o.requests_per_engine.iter().copied().max().unwrap_or(0) as f64;
            rows.push(Row {
                strategy: strategy.clone(),
                ttft_p50_s: percentile(&t, 0.5) / 1000.0,
                ttft_p90_s: percentile(&t, 0.9) / 1000.0,
                ttft_p99_s: percentile(&t, 0.99) / 1000.0,
                requests_per_s: t.len() as f64 / span_s,
                output_tokens_per_s: o.output_tokens as f64 / span_s,
                prefix_cache_hit_rate: o.cached_tokens as f64 / o.prompt_tokens.max(1) as f64,
                load_imbalance: max / mean.max(1e-9),
                completed: t.len(),
            });
            series.push((strategy, t));
        }
        let get = |s: &str| rows.iter().find(|r| r.strategy == s);
        let kv = get("kvplane");
        let best_other = |f: fn(&Row) -> f64| {
            rows.iter()
                .filter(|r| !r.strategy.starts_with("kvplane") && r.strategy != "oracle")
                .map(f)
                .fold(f64::INFINITY, f64::min)
        };
        let ratio = |x: Option<f64>, y: f64| x.map_or(0.0, |x| x / y.max(1e-12));
        let report = WorkloadReport {
            workload: name.clone(),
            requests: reqs.len(),
            kvplane_p50_to_round_robin: ratio(
                kv.map(|r| r.ttft_p50_s),
                get("round-robin").map_or(0.0, |r| r.ttft_p50_s),
            ),
            kvplane_p50_to_best_other: ratio(
                kv.map(|r| r.ttft_p50_s),
                best_other(|r| r.ttft_p50_s),
            ),
            kvplane_p90_to_best_other: ratio(
                kv.map(|r| r.ttft_p90_s),
                best_other(|r| r.ttft_p90_s),
            ),
            kvplane_p50_to_oracle: ratio(
                kv.map(|r| r.ttft_p50_s),
                get("oracle").map_or(0.0, |r| r.ttft_p50_s),
            ),
            three_replicas_p50_to_one: ratio(
                get("kvplane-3-replicas").map(|r| r.ttft_p50_s),
                kv.map_or(0.0, |r| r.ttft_p50_s),
            ),
            rows,
        };
        std::fs::write(
            a.out.join(format!("ttft-{name}.svg")),
            crate::svg::cdf_chart(name, &series),
        )?;
        print_table(&report);
        reports.push(report);
    }
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "engines": a.engines,
        "engine": params,
        "router_lag_ms": a.lag_ms,
        "seed": a.seed,
        "workloads": reports,
    }))?;
    std::fs::write(a.out.join("routing.json"), &json)?;
    println!("{json}");
    eprintln!("charts and JSON in {}", a.out.display());
    Ok(())
}

fn print_table(r: &WorkloadReport) {
    eprintln!("\n{} ({} requests)", r.workload, r.requests);
    eprintln!(
        "  {:<20} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>9}",
        "strategy", "p50 s", "p90 s", "p99 s", "req/s", "out tok/s", "hit %", "imbalance"
    );
    for row in &r.rows {
        eprintln!(
            "  {:<20} {:>8.3} {:>8.3} {:>8.3} {:>8.2} {:>9.0} {:>7.1} {:>9.2}",
            row.strategy,
            row.ttft_p50_s,
            row.ttft_p90_s,
            row.ttft_p99_s,
            row.requests_per_s,
            row.output_tokens_per_s,
            row.prefix_cache_hit_rate * 100.0,
            row.load_imbalance
        );
    }
    eprintln!(
        "  kvplane p50 = {:.1}% of round-robin's; {:.3}x / {:.3}x the best other's p50 / p90; {:.3}x the oracle's p50; 3 replicas {:.3}x one",
        r.kvplane_p50_to_round_robin * 100.0,
        r.kvplane_p50_to_best_other,
        r.kvplane_p90_to_best_other,
        r.kvplane_p50_to_oracle,
        r.three_replicas_p50_to_one
    );
}
