//! `kvplane-chaos`: seeded random faults over a real kvplane fleet (nats-server, three Raft
//! members, engines joined by `kvplane bridge`), a workload whose clients record what they were told, and invariants checked
//! against those records. A failing run prints its seed; `--seed N` runs the same sequence of
//! faults again (not the same execution: which member leads, and the workload's interleaving,
//! are the run's own).

mod check;
mod engines;
mod faults;
mod fleet;
mod history;
mod picker;
mod probe;
mod run;
mod schedule;
mod workload;

use std::time::Duration;

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "kvplane-chaos", about)]
struct Args {
    /// The seeds to run, one after another (default: 1, or 1 to 4 with --short).
    #[arg(long, value_delimiter = ',')]
    seed: Vec<u64>,
    /// How long each seed injects faults, in seconds (default 600; 30 with --short).
    #[arg(long)]
    duration: Option<u64>,
    /// CI's mode: four seeds of 30 seconds each.
    #[arg(long)]
    short: bool,
    /// Draw only these faults (default: every kind).
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<schedule::Fault>,
    /// Draw only a named scenario's faults (`--list-scenarios` names them).
    #[arg(long, conflicts_with = "faults")]
    scenario: Option<String>,
    /// Print the named scenarios and their faults, and exit.
    #[arg(long)]
    list_scenarios: bool,
    /// Report every tenth request's usage a second time, to another member, although the
    /// first report was acknowledged (gateways retry only failed reports).
    #[arg(long)]
    duplicate_reports: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.list_scenarios {
        for (name, faults, what) in schedule::SCENARIOS {
            let kinds: Vec<&str> = faults.iter().map(|f| f.label()).collect();
            println!("{name:<18} {what}: {}", kinds.join(", "));
        }
        return Ok(());
    }
    let faults = match &args.scenario {
        Some(name) => schedule::scenario(name)
            .with_context(|| format!("no scenario {name:?} (--list-scenarios names them)"))?
            .to_vec(),
        None => args.faults.clone(),
    };
    let seeds = if args.seed.is_empty() {
        if args.short {
            vec![1, 2, 3, 4]
        } else {
            vec![1]
        }
    } else {
        args.seed
    };
    let duration = Duration::from_secs(args.duration.unwrap_or(if args.short { 30 } else { 600 }));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut failed = Vec::new();
    for seed in seeds {
        eprintln!("seed {seed}: starting the fleet");
        // A panic in the run (a member that does not start again) fails this seed, not all.
        match rt.block_on(async {
            tokio::spawn(run::run(run::Plan {
                seed,
                duration,
                faults: faults.clone(),
                duplicate_reports: args.duplicate_reports,
            }))
            .await
        }) {
            Ok(Ok(report)) => {
                println!("{}", run::table(&report));
                if !report.held() {
                    failed.push(seed);
                }
            }
            Ok(Err(e)) => {
                println!("seed {seed}: the run failed: {e:#}");
                failed.push(seed);
            }
            Err(e) => {
                println!("seed {seed}: the run panicked: {e}");
                failed.push(seed);
            }
        }
    }
    if failed.is_empty() {
        println!("chaos: every invariant held");
        Ok(())
    } else {
        let d = duration.as_secs();
        let only = match (&args.scenario, faults.is_empty()) {
            (Some(name), _) => format!(" --scenario {name}"),
            (None, false) => {
                let names: Vec<String> = faults
                    .iter()
                    .filter_map(clap::ValueEnum::to_possible_value)
                    .map(|v| v.get_name().to_owned())
                    .collect();
                format!(" --faults {}", names.join(","))
            }
            (None, true) => String::new(),
        };
        let only = if args.duplicate_reports {
            format!("{only} --duplicate-reports")
        } else {
            only
        };
        for s in &failed {
            println!("replay: scripts/chaos --seed {s} --duration {d}{only}");
        }
        anyhow::bail!("invariants broken under seeds {failed:?}")
    }
}
