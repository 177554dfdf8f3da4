//! One seeded run: start the fleet and the workload, inject the schedule's faults one after
//! another (each held, healed, then the fleet healthy for a while), stop, check, report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::check::{Verdict, check};
use crate::faults::Injected;
use crate::fleet::{Fleet, POOL, STREAM};
use crate::history::{GATEWAY, History, PICKER, RouteOutcome, Shared, record, shared};
use crate::schedule::{Fault, schedule};

/// What one run did and found.
pub struct Report {
    pub seed: u64,
    pub ran: Duration,
    /// Per fault kind: how long each took from the heal's start to every member ready.
    pub recoveries: BTreeMap<Fault, Vec<Duration>>,
    pub history: History,
    pub verdicts: Vec<Verdict>,
    /// Where the members' logs are, kept when an invariant broke.
    pub kept: Option<std::path::PathBuf>,
    /// Snapshot builds the members refused while their snapshot writes failed.
    pub snapshots_refused: u64,
}

impl Report {
    pub fn held(&self) -> bool {
        self.verdicts.iter().all(|v| v.held)
    }
}

/// What to run: a seed's schedule for about `duration`, drawing from `faults` (every kind when
/// empty), with usage reported twice now and then when `duplicate_reports`.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    pub duration: Duration,
    pub faults: Vec<Fault>,
    pub duplicate_reports: bool,
}

/// Runs `plan` (the fault in force when it ends is healed). An error (the fleet did not
/// recover) says where the members' logs were kept.
pub async fn run(plan: Plan) -> anyhow::Result<Report> {
    let seed = plan.seed;
    let mut fleet = Fleet::start().await?;
    // Kept unless the run ends well: a panic or an error leaves the logs to read.
    fleet.cluster.root.disable_cleanup(true);
    let root = fleet.cluster.root.path().to_owned();
    eprintln!("seed {seed}: members' directories in {}", root.display());
    match drive(&mut fleet, &plan).await {
        Ok(mut report) => {
            if report.held() {
                fleet.cluster.root.disable_cleanup(false);
            } else {
                report.kept = Some(root);
            }
            Ok(report)
        }
        Err(e) => Err(e.context(format!("members' logs kept in {}", root.display()))),
    }
}

async fn drive(fleet: &mut Fleet, plan: &Plan) -> anyhow::Result<Report> {
    let (seed, duration) = (plan.seed, plan.duration);
    let history = shared();
    let (stop_tx, stop) = watch::channel(false);
    let endpoints: Vec<String> = fleet.cluster.nodes.iter().map(|n| n.endpoint()).collect();
    let engines = fleet.engines.iter().map(|e| e.publisher.clone()).collect();
    let gateway = format!("http://{}", fleet.gateway.field("http"));
    let mut workload = crate::workload::start(
        &endpoints,
        &gateway,
        engines,
        &history,
        &stop,
        plan.duplicate_reports,
    );
    let started = Instant::now();
    let mut healthy = Vec::new();
    let mut recoveries: BTreeMap<Fault, Vec<Duration>> = BTreeMap::new();
    let mut healthy_since = Instant::now();
    let mut injected_count = 0;
    for step in schedule(seed, 10_000, &plan.faults) {
        if started.elapsed() >= duration {
            break;
        }
        tokio::time::sleep(Duration::from_millis(step.healthy_ms)).await;
        // A bridge is not on the way of a Route or a completion, nor the gateway on the way of
        // the members' and the picker's: the fleet stays healthy through their faults, and any
        // failure then counts (but the gateway's own calls during its faults).
        let off_the_path = matches!(
            step.fault,
            Fault::KillBridge | Fault::PauseBridge | Fault::KillGateway | Fault::PauseGateway
        );
        if !off_the_path {
            healthy.push((healthy_since, Instant::now()));
        }
        let fault_from = Instant::now();
        let injected = fleet.inject(&step).await?;
        injected_count += 1;
        eprintln!(
            "  seed {seed} {:>5.1} s: {}{}",
            started.elapsed().as_secs_f64(),
            step.fault.label(),
            injected
                .member()
                .map(|m| format!(" (member {m})"))
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(step.hold_ms)).await;
        let healing = Instant::now();
        fleet.heal(injected).await?;
        fleet
            .wait_healthy(Duration::from_secs(60), |_| true)
            .await?;
        // A bridge is back once it has forwarded what its engine published meanwhile.
        if matches!(
            injected,
            Injected::BridgeKilled(_) | Injected::BridgePaused(_)
        ) {
            forwarded(fleet, &history).await?;
        }
        // A rolling restart healed as it went: its slowest member's recovery.
        let recovery = match injected {
            Injected::Rolled(slowest) => slowest,
            _ => healing.elapsed(),
        };
        recoveries.entry(step.fault).or_default().push(recovery);
        // Members stopped by the fault, and when (its settles through the ledger are its).
        let stopped = match injected {
            Injected::Killed(i)
            | Injected::Replaced(i)
            | Injected::Skewed(i)
            | Injected::DiskFailed(i) => Some(Some(i)),
            Injected::SnapshotsFailing => None,
            Injected::Rolled(_) => Some(None),
            _ => None,
        };
        // And the followers that stopped for a snapshot they could not write.
        let restarted = std::mem::take(&mut fleet.restarted);
        for member in stopped.into_iter().chain(restarted.into_iter().map(Some)) {
            record(&history, |h| {
                h.stops.push((member, fault_from, Instant::now()))
            });
        }
        if matches!(injected, Injected::GatewayKilled | Injected::GatewayPaused) {
            record(&history, |h| {
                h.gateway_down.push((fault_from, Instant::now()))
            });
        }
        if !off_the_path {
            healthy_since = Instant::now();
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    healthy.push((healthy_since, Instant::now()));
    let _ = stop_tx.send(true);
    while let Some(ended) = workload.join_next().await {
        ended.map_err(|e| anyhow::anyhow!("a workload task failed: {e}"))?;
    }
    let ran = started.elapsed();
    // Every batch the engines published reaches the stream through their bridges (from the
    // engines' replay after a bridge was away); the members must then apply up to there.
    forwarded(fleet, &history).await?;
    let last = fleet
        .js
        .get_stream(STREAM)
        .await?
        .info()
        .await?
        .state
        .last_sequence;
    // A member that never saw the run: it catches up from snapshots and the log, and the
    // agreement check then holds it to the same index and digest as the others.
    fleet.join_new("kvplane-fresh", None);
    fleet.wait_membership(Duration::from_secs(60)).await?;
    let history = record(&history, std::mem::take);
    let verdicts = check(fleet, &history, injected_count, &healthy, last).await;
    Ok(Report {
        seed,
        ran,
        recoveries,
        history,
        verdicts,
        kept: None,
        snapshots_refused: fleet.snapshots_refused,
    })
}

/// Waits until the bridges forwarded every batch their engines published so far.
async fn forwarded(fleet: &Fleet, history: &Shared) -> anyhow::Result<()> {
    let mut published = vec![0u64; fleet.engines.len()];
    for w in record(history, |h| h.published.clone()) {
        published[w] += 1;
    }
    crate::engines::wait_forwarded(
        &fleet.engines,
        &published,
        &fleet.js,
        (STREAM, POOL),
        Duration::from_secs(60),
    )
    .await
}

fn millis(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// The run's table: faults by kind with recovery times, operations by outcome, invariants.
pub fn table(r: &Report) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "seed {} ({:.0} s)", r.seed, r.ran.as_secs_f64());
    let _ = writeln!(
        t,
        "  {:<28} {:>5} {:>14} {:>14}",
        "fault", "times", "recovery p50", "recovery max"
    );
    for (fault, times) in &r.recoveries {
        let mut sorted = times.clone();
        sorted.sort();
        let _ = writeln!(
            t,
            "  {:<28} {:>5} {:>14} {:>14}",
            fault.label(),
            times.len(),
            millis(sorted[(sorted.len() - 1) / 2]),
            millis(*sorted.last().unwrap_or(&Duration::ZERO)),
        );
    }
    let h = &r.history;
    let outcomes = |caller: &dyn Fn(usize) -> bool| {
        let mut by_outcome: BTreeMap<RouteOutcome, u64> = BTreeMap::new();
        for ((m, _, o), n) in &h.routes {
            if caller(*m) {
                *by_outcome.entry(*o).or_default() += n;
            }
        }
        by_outcome
            .iter()
            .map(|(o, n)| format!("{n} {}", o.label()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let routes = outcomes(&|m| m != GATEWAY && m != PICKER);
    let _ = writeln!(
        t,
        "  Route: {routes} ({} refused as failing closed)",
        h.failed_closed
    );
    let _ = writeln!(
        t,
        "  completions through the gateway: {}",
        outcomes(&|m| m == GATEWAY)
    );
    let _ = writeln!(
        t,
        "  requests through the endpoint picker: {}",
        outcomes(&|m| m == PICKER)
    );
    let _ = writeln!(
        t,
        "  ReportUsage: {} acknowledged, {} failed, {} sent twice; config writes: {} acknowledged, {} failed; KV batches: {} published",
        h.reports_acked,
        h.reports_failed,
        h.reports_retried,
        h.config_acked.len(),
        h.config_failed,
        h.published.len()
    );
    if r.recoveries.contains_key(&Fault::SnapshotsFail) {
        let _ = writeln!(
            t,
            "  snapshot builds refused while snapshot writes failed: {}",
            r.snapshots_refused
        );
    }
    for v in &r.verdicts {
        let _ = writeln!(
            t,
            "  {} {}: {}",
            if v.held { "ok  " } else { "FAIL" },
            v.name,
            v.detail
        );
    }
    if let Some(k) = &r.kept {
        let _ = writeln!(t, "  members' logs kept in {}", k.display());
    }
    t
}
