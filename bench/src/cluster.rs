//! `kvplane bench cluster`: what Raft costs. The same stream of KV-event batches is applied by
//! a bare state machine (the single-node ceiling) and committed through a three-node cluster of
//! real Raft members in this process: redb logs that fsync every write transaction but those
//! that only move the committed id (appends that queue up while one commits share the next),
//! gRPC over loopback.
//! Then the leader is stopped abruptly, again and again, and the time until the new leader
//! commits its first entry is measured. Prints one JSON document.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use kvplane_raft::Proposal;
use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND,
    PoolConfig, StateMachine, Tier,
};
use openraft::async_runtime::WatchReceiver;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use kvplane_raft::RaftMember;
use kvplane_raft::{PeerSection, RaftSection};

#[derive(Debug, Clone, clap::Args)]
pub struct ClusterBenchArgs {
    /// Log entries to commit (each one batch of KV-event messages).
    #[arg(long, default_value_t = 2_000)]
    pub entries: u64,
    /// vLLM KV-event messages per entry (one Stored event each).
    #[arg(long, default_value_t = 16)]
    pub messages_per_entry: u64,
    /// Blocks per Stored event.
    #[arg(long, default_value_t = 4)]
    pub blocks_per_event: u64,
    /// Entries submitted per batch to Raft, and batches in flight.
    #[arg(long, default_value_t = 32)]
    pub pipeline: usize,
    /// Leader stops to measure.
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Where the nodes keep their logs (default: a fresh temporary directory, removed after).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Policy objects in the large catalog of the catalog-size measurement (the same stream
    /// applied bare with one object and with this many).
    #[arg(long, default_value_t = 500)]
    pub catalog_objects: usize,
    #[command(flatten)]
    pub grants: super::grants::GrantArgs,
}

#[derive(Debug, Serialize)]
struct Report {
    workload: Workload,
    single_node_apply: Rate,
    /// Bare apply with a catalog of one policy object and of many: apply cost and catalog size.
    catalog_size: super::catalog_size::CatalogReport,
    cluster: ClusterRate,
    grants: super::grants::GrantReport,
    failover: Failover,
}

#[derive(Debug, Serialize)]
struct Workload {
    entries: u64,
    kv_events: u64,
    blocks: u64,
}

#[derive(Debug, Serialize)]
struct Rate {
    seconds: f64,
    entries_per_s: f64,
    kv_events_per_s: f64,
}

#[derive(Debug, Serialize)]
struct ClusterRate {
    nodes: usize,
    /// Per member, over the committed stream: entries its log wrote per fsynced transaction
    /// (appends queued while one commits share the next one's fsync).
    log_entries_per_fsync: Vec<f64>,
    transport: &'static str,
    committed: Rate,
    /// Committed events per second as a share of the bare apply rate.
    ratio_to_single_node: f64,
    /// Every replica ended with the digest of the bare state machine.
    digests_agree: bool,
    indexed_blocks: u64,
}

#[derive(Debug, Serialize)]
struct Failover {
    heartbeat_ms: u64,
    election_timeout_ms: [u64; 2],
    /// Leader stopped (no leadership transfer) to the new leader's first committed entry.
    kill_to_first_commit_ms: Vec<f64>,
    p50_ms: f64,
    max_ms: f64,
}

/// The stream: entry 1 declares the pool, the rest carry KV events for eight workers.
fn workload(a: &ClusterBenchArgs) -> Vec<Command> {
    let block_size = 16u32;
    let mut commands = vec![Command::ConfigPut {
        owner: Some(kvplane_state::Owner::Admin),
        kind: POOL_KIND.into(),
        name: "default".into(),
        value: PoolConfig {
            block_size,
            models: Vec::new(),
            lora_adapters: Vec::new(),
        }
        .to_json(),
    }];
    let mut seq = 0u64;
    for e in 0..a.entries {
        let first_seq = seq + 1;
        let items = (0..a.messages_per_entry)
            .map(|m| {
                seq += 1;
                let base = (e * a.messages_per_entry + m) * a.blocks_per_event;
                IngestItem {
                    seq,
                    pool: "default".into(),
                    worker: format!("w{}", seq % 8),
                    payload: IngestPayload::Kv(KvBatch {
                        dp_rank: 0,
                        events: vec![
                            KvEvent::Stored {
                                block_hashes: (base..base + a.blocks_per_event).collect(),
                                parent_hash: None,
                                token_ids: (0..a.blocks_per_event * u64::from(block_size))
                                    .map(|t| u32::try_from((base * 16 + t) % 50_000).unwrap_or(0))
                                    .collect(),
                                block_size,
                                lora_name: None,
                                cache_salt: None,
                                tier: Tier::Gpu,
                            }
                            // As the leader proposes it: hashed once, compact.
                            .compact(),
                        ],
                    }),
                }
            })
            .collect();
        commands.push(Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq,
            last_seq: seq,
            items,
        }));
    }
    commands
}

/// Applies `commands` to a fresh state machine (entries stamped `timestamp_ms`); returns the
/// seconds it took and the final digest.
fn apply_bare(
    commands: &[Command],
    timestamp_ms: u64,
) -> anyhow::Result<(f64, kvplane_state::Digest)> {
    let mut sm = StateMachine::new();
    let t = Instant::now();
    for (i, c) in commands.iter().enumerate() {
        sm.apply(&Entry {
            index: i as u64 + 1,
            timestamp_ms,
            command: c.clone(),
        })?;
    }
    Ok((t.elapsed().as_secs_f64(), sm.digest()))
}

fn rate(seconds: f64, entries: u64, events: u64) -> Rate {
    let s = seconds.max(1e-9);
    Rate {
        seconds,
        entries_per_s: entries as f64 / s,
        kv_events_per_s: events as f64 / s,
    }
}

/// Where one member listens and keeps its files, and its `[raft]` section.
struct MemberConfig {
    grpc_listen: String,
    data_dir: std::path::PathBuf,
    raft: RaftSection,
}

/// One in-process member: Raft plus its gRPC server.
struct Member {
    cfg: MemberConfig,
    raft: Option<RaftMember>,
    server: Option<(tokio::sync::oneshot::Sender<()>, JoinHandle<()>)>,
}

impl Member {
    /// Starts on `listener`, held since its port was picked so that no other process can take
    /// the port in between.
    async fn start(cfg: MemberConfig, listener: std::net::TcpListener) -> anyhow::Result<Self> {
        let mut m = Self {
            cfg,
            raft: None,
            server: None,
        };
        listener.set_nonblocking(true)?;
        m.serve(TcpListener::from_std(listener)?).await?;
        Ok(m)
    }

    /// Starts again on the member's address after a stop.
    async fn up(&mut self) -> anyhow::Result<()> {
        let listener = TcpListener::bind(&self.cfg.grpc_listen)
            .await
            .with_context(|| format!("cannot listen on {}", self.cfg.grpc_listen))?;
        self.serve(listener).await
    }

    async fn serve(&mut self, listener: TcpListener) -> anyhow::Result<()> {
        let member = RaftMember::start(
            &self.cfg.raft,
            &self.cfg.data_dir,
            listener.local_addr()?,
            std::sync::Arc::new(|_| {}),
            kvplane_tls::Dialer::plain(),
        )
        .await?;
        let service = member.grpc_service();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async move {
                        let _ = stop_rx.await;
                    },
                )
                .await;
        });
        self.server = Some((stop_tx, task));
        self.raft = Some(member);
        Ok(())
    }

    /// Stops abruptly: Raft stops without handing over leadership (no more heartbeats), then
    /// the server closes its connections.
    async fn stop(&mut self) {
        if let Some(m) = self.raft.take() {
            let _ = m.raft.shutdown().await;
        }
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }

    fn raft(&self) -> Option<&kvplane_raft::KvRaft> {
        self.raft.as_ref().map(|m| &m.raft)
    }

    fn leads(&self) -> bool {
        self.raft().is_some_and(|r| {
            let m = r.metrics().borrow_watched().clone();
            m.current_leader == Some(m.id)
        })
    }
}

fn member_config(
    dir: &Path,
    i: usize,
    addrs: &[SocketAddr],
    election: [u64; 2],
) -> anyhow::Result<MemberConfig> {
    let peers: Vec<PeerSection> = addrs
        .iter()
        .enumerate()
        .map(|(j, a)| PeerSection {
            id: j as u64 + 1,
            addr: a.to_string(),
        })
        .collect();
    // Every field but the ones set below at its default.
    let raft = RaftSection {
        id: Some(i as u64 + 1),
        peers,
        bootstrap: i == 0,
        heartbeat_ms: 100,
        election_timeout_min_ms: election[0],
        election_timeout_max_ms: election[1],
        snapshot_logs: 1_000_000,
        ..RaftSection::default()
    };
    Ok(MemberConfig {
        data_dir: dir.join(format!("node-{i}")),
        grpc_listen: addrs[i].to_string(),
        raft,
    })
}

/// The member that leads with a quorum's confirmation (a restarted member may believe in its
/// old leadership for a moment).
async fn wait_leader(members: &[Member], timeout: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        for (i, m) in members.iter().enumerate().filter(|(_, m)| m.leads()) {
            if let Some(r) = m.raft()
                && let Ok(Ok(_)) = tokio::time::timeout(
                    Duration::from_millis(500),
                    r.ensure_linearizable(openraft::ReadPolicy::ReadIndex),
                )
                .await
            {
                return Ok(i);
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "no leader within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Commits `commands` through `raft` in order, `pipeline` batches of `pipeline` in flight;
/// returns the last committed index.
async fn commit_all(
    raft: &kvplane_raft::KvRaft,
    commands: &[Command],
    pipeline: usize,
) -> anyhow::Result<u64> {
    let mut in_flight = std::collections::VecDeque::new();
    let mut last = 0;
    for chunk in commands.chunks(pipeline.max(1)) {
        let proposals: Vec<Proposal> = chunk.iter().cloned().map(Proposal::now).collect();
        in_flight.push_back(raft.client_write_many(proposals).await?);
        if in_flight.len() >= pipeline.max(1)
            && let Some(s) = in_flight.pop_front()
        {
            last = last.max(drain(s).await?);
        }
    }
    while let Some(s) = in_flight.pop_front() {
        last = last.max(drain(s).await?);
    }
    Ok(last)
}

/// Waits for every write of one batch; returns the highest index.
async fn drain<S, E1, E2>(mut stream: S) -> anyhow::Result<u64>
where
    S: futures::Stream<
            Item = Result<Result<openraft::raft::WriteResponse<kvplane_raft::TypeConfig>, E1>, E2>,
        > + Unpin,
    E1: std::fmt::Display,
    E2: std::fmt::Display,
{
    let mut last = 0;
    while let Some(r) = stream.next().await {
        match r {
            Ok(Ok(w)) => last = last.max(w.log_id.index),
            Ok(Err(e)) => anyhow::bail!("write failed: {e}"),
            Err(e) => anyhow::bail!("raft failed: {e}"),
        }
    }
    Ok(last)
}

pub async fn run(a: ClusterBenchArgs) -> anyhow::Result<()> {
    let temp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_owned()
        }
    };
    let commands = workload(&a);
    let events = a.entries * a.messages_per_entry;
    let workload_info = Workload {
        entries: a.entries,
        kv_events: events,
        blocks: events * a.blocks_per_event,
    };

    // The ceiling: a bare state machine applying the same entries.
    let (seconds, bare_digest) = apply_bare(&commands, 0)?;
    let single = rate(seconds, a.entries, events);
    let catalog_size = super::catalog_size::measure(&commands, events, a.catalog_objects)?;

    // Three members on loopback.
    let election = [500, 1000];
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        addrs.push(l.local_addr()?);
        listeners.push(l);
    }
    let mut members = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        members.push(Member::start(member_config(&dir, i, &addrs, election)?, l).await?);
    }
    let leader = wait_leader(&members, Duration::from_secs(20)).await?;
    let raft = members[leader].raft().context("leader is up")?.clone();
    let writes = |members: &[Member]| -> Vec<(u64, u64)> {
        members
            .iter()
            .filter_map(|m| m.raft.as_ref())
            .map(|m| (m.log_writes.entries(), m.log_writes.fsyncs()))
            .collect()
    };
    let writes_before = writes(&members);
    let t = Instant::now();
    let last = commit_all(&raft, &commands, a.pipeline).await?;
    let committed = rate(t.elapsed().as_secs_f64(), a.entries, events);
    let mut views = Vec::new();
    for m in &members {
        let r = m.raft().context("members are up")?;
        r.wait(Some(Duration::from_secs(30)))
            .applied_index_at_least(Some(last), "replicas apply the stream")
            .await?;
        views.push(m.raft.as_ref().context("members are up")?.handle.load());
    }
    let log_entries_per_fsync = writes(&members)
        .iter()
        .zip(&writes_before)
        .map(|((e, f), (e0, f0))| (e - e0) as f64 / (f - f0).max(1) as f64)
        .collect();
    let digests_agree = views.iter().all(|v| v.digest == bare_digest);
    let indexed_blocks = views.first().map_or(0, |v| v.indexed_blocks);

    // Grant entries of the escrow ledger: on a bare state machine, then through the cluster.
    let grant_commands = super::grants::workload(&a.grants);
    let (grant_single, _) = apply_bare(&grant_commands, 1)?;
    let t = Instant::now();
    commit_all(&raft, &grant_commands, a.pipeline).await?;
    let grant_cluster = t.elapsed().as_secs_f64();
    let n = grant_commands.len() as f64;
    let grants = super::grants::GrantReport {
        entries: grant_commands.len() as u64,
        asks_per_entry: a.grants.asks_per_entry,
        tenants: a.grants.tenants,
        single_node_entries_per_s: n / grant_single.max(1e-9),
        cluster_entries_per_s: n / grant_cluster.max(1e-9),
        cluster_asks_per_s: n * a.grants.asks_per_entry as f64 / grant_cluster.max(1e-9),
    };

    // Leader stops: time to the first entry the next leader commits.
    let mut times = Vec::new();
    for _ in 0..a.kills {
        let leader = wait_leader(&members, Duration::from_secs(20)).await?;
        let stopped = Instant::now();
        members[leader].stop().await;
        'commit: loop {
            for m in members.iter().filter(|m| m.leads()) {
                let r = m.raft().context("a leader is up")?;
                if tokio::time::timeout(
                    Duration::from_millis(500),
                    r.client_write(Proposal::now(Command::Noop)),
                )
                .await
                .is_ok_and(|r| r.is_ok())
                {
                    break 'commit;
                }
            }
            anyhow::ensure!(
                stopped.elapsed() < Duration::from_secs(30),
                "no commit within 30 s of the leader stopping"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        times.push(stopped.elapsed().as_secs_f64() * 1e3);
        // Back to three before the next round.
        members[leader].up().await?;
        let target = members
            .iter()
            .find(|m| m.leads())
            .and_then(|m| m.raft())
            .map_or(0, |r| {
                r.metrics()
                    .borrow_watched()
                    .last_applied
                    .map_or(0, |l| l.index)
            });
        if let Some(r) = members[leader].raft() {
            r.wait(Some(Duration::from_secs(30)))
                .applied_index_at_least(Some(target), "the restarted member catches up")
                .await?;
        }
    }
    for m in &mut members {
        m.stop().await;
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let report = Report {
        workload: workload_info,
        cluster: ClusterRate {
            nodes: 3,
            log_entries_per_fsync,
            transport: "grpc over loopback",
            ratio_to_single_node: committed.kv_events_per_s / single.kv_events_per_s.max(1e-9),
            committed,
            digests_agree,
            indexed_blocks,
        },
        single_node_apply: single,
        catalog_size,
        grants,
        failover: Failover {
            heartbeat_ms: 100,
            election_timeout_ms: election,
            p50_ms: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            max_ms: sorted.last().copied().unwrap_or(0.0),
            kill_to_first_commit_ms: times,
        },
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    anyhow::ensure!(
        report.cluster.digests_agree,
        "the replicas' digests differ from the bare state machine's"
    );
    Ok(())
}
