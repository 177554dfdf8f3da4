//! `kvplane bench ingest`: a fleet of simulated vLLM engines publishing KV-event batches (and
//! now and then their metrics) through a real `nats-server` into a cluster of real `kvplane
//! serve` processes (Raft members on loopback, logs fsynced).
//!
//! It measures what ingest keeps up with (messages applied per second against those offered,
//! the backlog, the drain once publishing stops), the lag from a probe engine's publish to a
//! follower's routing decision seeing its blocks, each node's memory growth per indexed block
//! and the CPU the nodes and NATS spend per thousand events. Optionally it kills the leader
//! (SIGKILL) during the stream and restarts it. At the end every replica must have applied
//! the whole stream, agree on the digest, and report for every worker the blocks the
//! engines' own caches (a plain map per engine) hold: anything lost or applied twice shows.
//! JSON on stdout, a table on stderr; it fails when a check fails.

mod engines;
mod proc_stats;
mod publish;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use async_nats::jetstream;
use kvplane_proto::v1::StatusResponse;
use kvplane_testkit::process;
use serde_json::json;
use tokio::sync::watch;

use crate::procs::{Procs, field, raft_peers, start_nats, status};
use engines::{Engine, FleetShape};
use proc_stats::{CpuAcrossRestarts, rss_bytes};
use publish::{Acked, Pace, Sent};

#[derive(Debug, Clone, clap::Args)]
pub struct IngestBenchArgs {
    /// Simulated engines (vLLM workers), each publishing on its own subject.
    #[arg(long, default_value_t = 1_000)]
    pub engines: usize,
    /// KV-event batches each engine publishes per second (about one per scheduler step).
    #[arg(long, default_value_t = 20.0)]
    pub batches_per_s: f64,
    /// How long the engines publish.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Chance that a step also publishes the engine's metrics.
    #[arg(long, default_value_t = 0.05)]
    pub metrics_share: f64,
    /// Blocks an engine caches at most (past it, it evicts its least recently used prefixes).
    #[arg(long, default_value_t = 2_000)]
    pub capacity_blocks: u64,
    /// Documents the engines' prompts start from (shared across the fleet, popular ones
    /// cached by many engines).
    #[arg(long, default_value_t = 20_000)]
    pub docs: u64,
    /// kvplane nodes (Raft members).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// NATS connections the fleet publishes over (engines spread across them).
    #[arg(long, default_value_t = 4)]
    pub publishers: usize,
    /// How often the probe engine stores a new prefix to time.
    #[arg(long, default_value_t = 100)]
    pub probe_every_ms: u64,
    /// Leader kills (SIGKILL, then a restart) spread over the run.
    #[arg(long, default_value_t = 0)]
    pub kills: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where the processes keep their data and logs (default: a temporary directory, removed
    /// after).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The name of a node process and its gRPC endpoint.
struct Node {
    name: String,
    grpc: String,
}

const BLOCK_SIZE: u32 = 16;
const STREAM: &str = "KVPLANE";

/// Writes every member's config and starts them; the first initializes the cluster.
fn start_nodes(
    procs: &mut Procs,
    dir: &Path,
    nats_url: &str,
    n: usize,
) -> anyhow::Result<Vec<Node>> {
    let (addrs, peers) = raft_peers(n)?;
    let exe = process::kvplane_binary();
    let mut nodes = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let name = format!("kvplane-{i}");
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "node_id = \"{name}\"\n\n[[pools]]\nname = \"{}\"\nblock_size = {BLOCK_SIZE}\n\n[raft]\nid = {}\nbootstrap = {}\npeers = [{peers}]\n",
                publish::POOL,
                i + 1,
                i == 0,
            ),
        )?;
        let ready = procs.spawn(
            &name,
            &exe,
            &[
                "serve".into(),
                "--config".into(),
                config.display().to_string(),
                "--nats-url".into(),
                nats_url.to_owned(),
                "--grpc-listen".into(),
                addr.clone(),
                "--http-listen".into(),
                "127.0.0.1:0".into(),
                "--data-dir".into(),
                dir.join(&name).display().to_string(),
            ],
            Some("kvplane ready"),
        )?;
        nodes.push(Node {
            name,
            grpc: format!("http://{}", field(&ready, "grpc")?),
        });
    }
    Ok(nodes)
}

/// Every node's Status (`None` for one that does not answer).
async fn statuses(nodes: &[Node]) -> Vec<Option<StatusResponse>> {
    let plain = kvplane_tls::Dialer::plain();
    futures::future::join_all(nodes.iter().map(|n| status(&plain, &n.grpc))).await
}

fn applied_seq(s: &StatusResponse) -> u64 {
    s.ingest.as_ref().map_or(0, |i| i.applied_stream_sequence)
}

/// The node that reports itself leader, if exactly one does.
fn leader_of(s: &[Option<StatusResponse>]) -> Option<usize> {
    let l: Vec<usize> = (0..s.len())
        .filter(|&i| s[i].as_ref().is_some_and(|s| s.role == "leader"))
        .collect();
    (l.len() == 1).then(|| l[0])
}

async fn wait_leader(
    nodes: &[Node],
    except: Option<usize>,
    timeout: Duration,
) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(l) = leader_of(&statuses(nodes).await)
            && Some(l) != except
        {
            return Ok(l);
        }
        if Instant::now() > deadline {
            bail!("no leader within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGKILLs the leader, waits for another member to lead, restarts the killed one; returns
/// the milliseconds from the kill to the new leader.
async fn kill_leader(procs: &mut Procs, nodes: &[Node]) -> anyhow::Result<(String, f64)> {
    let l = wait_leader(nodes, None, Duration::from_secs(30)).await?;
    procs.kill(&nodes[l].name)?;
    let killed = Instant::now();
    wait_leader(nodes, Some(l), Duration::from_secs(30)).await?;
    let ms = killed.elapsed().as_secs_f64() * 1000.0;
    tokio::task::block_in_place(|| procs.restart(&nodes[l].name))?;
    Ok((nodes[l].name.clone(), ms))
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    if s.is_empty() {
        return 0.0;
    }
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}

/// Publishes, retrying while the freshly made stream does not answer yet.
async fn first_publish(
    js: &jetstream::Context,
    subject: String,
    body: Vec<u8>,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = match js.publish(subject.clone(), body.clone().into()).await {
            Ok(ack) => ack.await.map_err(anyhow::Error::from),
            Err(e) => Err(e.into()),
        };
        match r {
            Ok(a) => return Ok(a.sequence),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context("publishing to the stream"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

pub async fn run(a: IngestBenchArgs) -> anyhow::Result<()> {
    if !(a.engines > 0
        && a.batches_per_s > 0.0
        && a.seconds > 0.0
        && (0.0..=1.0).contains(&a.metrics_share)
        && a.capacity_blocks > 0
        && a.docs > 0
        && a.nodes > 0
        && a.publishers > 0
        && a.probe_every_ms > 0)
    {
        bail!(
            "engines, batches-per-s, seconds, capacity-blocks, docs, nodes, publishers and probe-every-ms must be positive, metrics-share within 0..=1"
        );
    }
    let tmp;
    let dir = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_owned()
        }
    };
    let mut procs = Procs::new(&dir);
    let nats_url = start_nats(&mut procs, &dir, None).await?;
    let nodes = start_nodes(&mut procs, &dir, &nats_url, a.nodes)?;
    wait_leader(&nodes, None, Duration::from_secs(30)).await?;
    eprintln!(
        "bench ingest: nats {nats_url}, {} nodes, logs in {}",
        nodes.len(),
        dir.display()
    );

    let js = jetstream::new(async_nats::connect(&nats_url).await?);
    kvplane_ingest::ensure_stream(&js, STREAM).await?;
    let acked = Arc::new(Acked::default());
    let shape = FleetShape {
        block_size: BLOCK_SIZE,
        docs: a.docs,
        capacity: a.capacity_blocks,
        store_share: 0.7,
    };
    let engines: Vec<Engine> = (0..a.engines)
        .map(|i| {
            Engine::new(
                format!("engine-{i:05}"),
                a.seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
            )
        })
        .collect();
    let up = serde_json::to_vec(&kvplane_ingest::WorkerMessage {
        status: kvplane_ingest::WorkerStatus::Up,
        address: Some("http://127.0.0.2:8000".into()),
    })?;
    first_publish(
        &js,
        kvplane_ingest::worker_subject(publish::POOL, "probe"),
        up,
    )
    .await?;
    let names: Vec<&str> = engines.iter().map(|e| e.name.as_str()).collect();
    publish::announce(&js, &names, &acked).await?;
    let workers = a.engines + 1;
    for n in &nodes {
        crate::procs::wait_status(
            &kvplane_tls::Dialer::plain(),
            &n.grpc,
            &format!("seeing {workers} workers"),
            Duration::from_secs(120),
            |s| s.workers.iter().filter(|w| w.up).count() >= workers,
        )
        .await?;
    }
    eprintln!(
        "every node sees {workers} workers; publishing for {} s",
        a.seconds
    );

    // Before the stream: memory, CPU and positions to measure from.
    let base = statuses(&nodes).await;
    let base_rss: Vec<Option<u64>> = nodes
        .iter()
        .map(|n| procs.pid(&n.name).and_then(rss_bytes))
        .collect();
    let mut node_cpu = vec![CpuAcrossRestarts::default(); nodes.len()];
    let mut nats_cpu = CpuAcrossRestarts::default();
    let sample_cpu =
        |procs: &Procs, node_cpu: &mut [CpuAcrossRestarts], nats_cpu: &mut CpuAcrossRestarts| {
            for (c, n) in node_cpu.iter_mut().zip(&nodes) {
                c.sample(procs.pid(&n.name));
            }
            nats_cpu.sample(procs.pid("nats"));
        };
    sample_cpu(&procs, &mut node_cpu, &mut nats_cpu);
    let cpu0: Vec<f64> = node_cpu.iter().map(CpuAcrossRestarts::total).collect();
    let nats0 = nats_cpu.total();

    let pace = Pace {
        start: Instant::now(),
        seconds: a.seconds,
        batches_per_s: a.batches_per_s,
        metrics_share: a.metrics_share,
    };
    let mut groups: Vec<Vec<(usize, Engine)>> = (0..a.publishers).map(|_| Vec::new()).collect();
    for (i, e) in engines.into_iter().enumerate() {
        groups[i % a.publishers].push((i, e));
    }
    let mut publishers = Vec::new();
    for g in groups {
        let js = jetstream::new(async_nats::connect(&nats_url).await?);
        publishers.push(tokio::spawn(publish::publisher(
            js,
            g,
            shape,
            pace,
            acked.clone(),
        )));
    }
    let (followers_tx, followers) = watch::channel(Vec::new());
    let probe = tokio::spawn(publish::probe(
        jetstream::new(async_nats::connect(&nats_url).await?),
        shape,
        pace,
        Duration::from_millis(a.probe_every_ms),
        followers,
        acked.clone(),
    ));

    let kill_at: Vec<f64> = (1..=a.kills)
        .map(|k| a.seconds * k as f64 / (a.kills + 1) as f64)
        .collect();
    let mut kills = Vec::new();
    let mut max_backlog = vec![0u64; nodes.len()];
    // (seconds, acknowledged sequence, each node's applied sequence), about once a second.
    let mut timeline: Vec<(f64, u64, Vec<Option<u64>>)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    while !publishers.iter().all(|p| p.is_finished()) {
        tick.tick().await;
        let s = statuses(&nodes).await;
        followers_tx.send_replace(
            (0..nodes.len())
                .filter(|&i| s[i].as_ref().is_some_and(|s| s.role == "follower"))
                .map(|i| nodes[i].grpc.clone())
                .collect(),
        );
        for (m, s) in max_backlog.iter_mut().zip(&s) {
            if let Some(s) = s {
                *m = (*m).max(acked.get().saturating_sub(applied_seq(s)));
            }
        }
        sample_cpu(&procs, &mut node_cpu, &mut nats_cpu);
        let at = pace.start.elapsed().as_secs_f64();
        if timeline.last().is_none_or(|l| at - l.0 >= 1.0) {
            timeline.push((
                at,
                acked.get(),
                s.iter().map(|s| s.as_ref().map(applied_seq)).collect(),
            ));
        }
        if kills.len() < kill_at.len() && pace.start.elapsed().as_secs_f64() >= kill_at[kills.len()]
        {
            let (name, ms) = kill_leader(&mut procs, &nodes).await?;
            eprintln!("killed the leader ({name}): a new one after {ms:.0} ms; restarted it");
            kills.push(ms);
        }
    }
    let mut sent = Sent::default();
    let mut model: BTreeMap<String, u64> = BTreeMap::new();
    for p in publishers {
        let (engines, s) = p.await?;
        sent.add(&s);
        for (_, e) in engines {
            model.insert(e.name.clone(), e.blocks);
        }
    }
    let published_s = pace.start.elapsed().as_secs_f64();
    let at_end = statuses(&nodes).await;
    let backlog_at_end: Vec<Option<u64>> = at_end
        .iter()
        .map(|s| {
            s.as_ref()
                .map(|s| acked.get().saturating_sub(applied_seq(s)))
        })
        .collect();
    let probe = probe.await?;
    if let Some(e) = &probe.engine {
        model.insert(e.name.clone(), e.blocks);
    }

    // Drain: every member applies the whole stream.
    let last = js
        .get_stream(STREAM)
        .await?
        .info()
        .await?
        .state
        .last_sequence;
    let drain_start = Instant::now();
    let deadline = drain_start + Duration::from_secs(180);
    let finals = loop {
        let s = statuses(&nodes).await;
        if s.iter()
            .all(|s| s.as_ref().is_some_and(|s| applied_seq(s) >= last))
        {
            break s;
        }
        if Instant::now() > deadline {
            bail!(
                "the nodes did not apply the stream's {last} messages within 180 s of the end of publishing"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let drain_ms = drain_start.elapsed().as_secs_f64() * 1000.0;
    sample_cpu(&procs, &mut node_cpu, &mut nats_cpu);
    let finals: Vec<StatusResponse> = finals.into_iter().flatten().collect();

    // Checks against the engines' own caches.
    let expected: u64 = model.values().sum();
    let digests_agree = finals
        .windows(2)
        .all(|w| w[0].state_digest == w[1].state_digest);
    let mut worker_mismatches = 0u64;
    for s in &finals {
        let seen: BTreeMap<&str, u64> = s
            .workers
            .iter()
            .filter(|w| w.pool == publish::POOL)
            .map(|w| (w.worker_id.as_str(), w.indexed_blocks))
            .collect();
        worker_mismatches += model
            .iter()
            .filter(|(w, b)| seen.get(w.as_str()).copied().unwrap_or(0) != **b)
            .count() as u64;
    }
    let blocks_match = finals.iter().all(|s| s.indexed_blocks == expected);
    let sum_map = |m: Option<&std::collections::HashMap<String, u64>>| {
        m.map_or(0, |m| m.values().sum::<u64>())
    };
    let rejected: u64 = finals
        .iter()
        .map(|s| sum_map(s.ingest.as_ref().map(|i| &i.rejected)))
        .sum();
    let dropped: u64 = finals
        .iter()
        .map(|s| sum_map(s.ingest.as_ref().map(|i| &i.dropped)))
        .sum();

    let events = sent.kv_events as f64;
    let messages = (sent.kv_batches + sent.metrics) as f64;
    let applied_rate: Vec<f64> = (0..nodes.len())
        .map(|i| {
            let b = base[i].as_ref().map_or(0, applied_seq);
            let e = at_end[i].as_ref().map_or(b, applied_seq);
            e.saturating_sub(b) as f64 / published_s
        })
        .collect();
    let rss_growth: Vec<Option<i64>> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            // A restarted node's first reading is of another process.
            let restarted = procs.starts(&n.name) > 1;
            let now = procs.pid(&n.name).and_then(rss_bytes)?;
            let before = base_rss[i]?;
            (!restarted).then(|| now as i64 - before as i64)
        })
        .collect();
    let node_cpu_s: f64 =
        node_cpu.iter().map(CpuAcrossRestarts::total).sum::<f64>() - cpu0.iter().sum::<f64>();
    let nats_cpu_s = nats_cpu.total() - nats0;
    let lag = &probe.lag_ms;
    let report = json!({
        "workload": {
            "engines": a.engines,
            "batches_per_s_per_engine": a.batches_per_s,
            "seconds": a.seconds,
            "metrics_share": a.metrics_share,
            "capacity_blocks_per_engine": a.capacity_blocks,
            "nodes": nodes.len(),
            "kv_batches": sent.kv_batches,
            "kv_events": sent.kv_events,
            "metrics_messages": sent.metrics,
            "stored_blocks": sent.counts.stored_blocks,
            "removed_blocks": sent.counts.removed_blocks,
            "probe_stores": lag.len() as u64 + probe.missed,
        },
        "ingest": {
            "offered_messages_per_s": messages / published_s,
            "offered_kv_events_per_s": events / published_s,
            "applied_messages_per_s": applied_rate,
            "max_backlog_messages": max_backlog,
            "backlog_when_publishing_stopped": backlog_at_end,
            "timeline": timeline.iter().map(|(t, a, n)| json!({"s": t, "acknowledged": a, "applied": n})).collect::<Vec<_>>(),
            "drain_ms": drain_ms,
            "stream_messages": last,
        },
        "lag_publish_to_follower_decision_ms": {
            "samples": lag.len(),
            "missed": probe.missed,
            "p50": percentile(lag, 0.5),
            "p99": percentile(lag, 0.99),
            "max": percentile(lag, 1.0),
        },
        "memory": {
            "indexed_blocks": expected,
            "rss_growth_bytes": rss_growth,
            "rss_growth_bytes_per_indexed_block": rss_growth.iter().map(|g| g.map(|g| g as f64 / expected.max(1) as f64)).collect::<Vec<_>>(),
        },
        "cpu": {
            "nodes_seconds": node_cpu_s,
            "nats_seconds": nats_cpu_s,
            "nodes_ms_per_1k_kv_events": node_cpu_s * 1000.0 / (events / 1000.0).max(1e-9),
            "nats_ms_per_1k_kv_events": nats_cpu_s * 1000.0 / (events / 1000.0).max(1e-9),
        },
        "failover": {
            "leader_kills": kills.len(),
            "kill_to_new_leader_ms": kills,
        },
        "checks": {
            "publishes_unacknowledged": sent.failed + probe.failed,
            "every_node_applied_the_stream": true,
            "digests_agree": digests_agree,
            "indexed_blocks_match_the_engines": blocks_match,
            "workers_off_their_engine": worker_mismatches,
            "rejected": rejected,
            "dropped": dropped,
        },
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!(
        "{:<40} {:>14}",
        "offered (msgs/s, kv events/s)",
        format!("{:.0}, {:.0}", messages / published_s, events / published_s)
    );
    for (i, n) in nodes.iter().enumerate() {
        eprintln!(
            "{:<40} {:>14}",
            format!("{}: applied msgs/s, max backlog", n.name),
            format!("{:.0}, {}", applied_rate[i], max_backlog[i])
        );
    }
    eprintln!(
        "{:<40} {:>14.0}",
        "drain after publishing stopped (ms)", drain_ms
    );
    eprintln!(
        "{:<40} {:>14}",
        "publish -> follower decision p50/p99 (ms)",
        format!("{:.1} / {:.1}", percentile(lag, 0.5), percentile(lag, 0.99))
    );
    for (i, n) in nodes.iter().enumerate() {
        if let Some(g) = rss_growth[i] {
            eprintln!(
                "{:<40} {:>14.1}",
                format!("{}: RSS growth per indexed block (B)", n.name),
                g as f64 / expected.max(1) as f64
            );
        }
    }
    eprintln!(
        "{:<40} {:>14.1}",
        "nodes' CPU per 1k kv events (ms)",
        node_cpu_s * 1e6 / events.max(1.0)
    );
    eprintln!(
        "{:<40} {:>14.1}",
        "nats' CPU per 1k kv events (ms)",
        nats_cpu_s * 1e6 / events.max(1.0)
    );
    eprintln!("{:<40} {:>14}", "indexed blocks (every replica)", expected);
    drop(procs);

    let mut problems = Vec::new();
    if sent.failed + probe.failed > 0 {
        problems.push(format!(
            "{} publishes were not acknowledged",
            sent.failed + probe.failed
        ));
    }
    if !digests_agree {
        problems.push("the replicas' digests differ".to_owned());
    }
    if !blocks_match || worker_mismatches > 0 {
        problems.push(format!(
            "the index does not hold the engines' caches ({expected} blocks expected, replicas report {:?}; {worker_mismatches} workers off)",
            finals.iter().map(|s| s.indexed_blocks).collect::<Vec<_>>()
        ));
    }
    if rejected + dropped > 0 {
        problems.push(format!(
            "{rejected} messages rejected, {dropped} events dropped"
        ));
    }
    if lag.is_empty() {
        problems.push("no probe was seen by a follower".to_owned());
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}
