//! The fleet under test: nats-server, three Raft members holding a worker set and two tenants'
//! limits (two-second windows), an engine per worker joined by its `kvplane bridge`, and a
//! `kvplane gateway`, with the faults of [`crate::schedule`] applied to it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_proto::v1::{RemoveMemberRequest, StatusRequest, admin_client::AdminClient};
use kvplane_testkit::{Cluster, NodeOptions, Proc, RaftOptions, free_port};

use crate::engines::Engine;
use crate::schedule::{Fault, Step};

/// Members in the cluster (between faults: scaling out adds two for a while).
pub const MEMBERS: usize = 3;
/// Snapshot every this many entries and keep this many after it: members that join or come
/// back late catch up through snapshots, not only the log.
const COMPACTION: (u64, u64) = (500, 100);
/// A slow disk: each log round (a transaction, fsynced) takes 100 ms more, each snapshot 1 s.
const SLOW_DISK: &str = "raft-log-write=sleep(100);raft-snapshot-write=sleep(1000)";
/// Where Debian's libfaketime is, by architecture.
const FAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];
/// The tenants and their budgets per window (tokens).
pub const TENANTS: [(&str, u64); 2] = [("acme", 20_000), ("beta", 10_000)];
pub const WINDOW_MS: u64 = 2_000;
/// The worker set, and the stream the bridges publish to.
pub const POOL: &str = "gpu";
pub const STREAM: &str = "KVPLANE";
/// Workers announced in pool `gpu`.
pub const WORKERS: usize = 3;

pub struct Fleet {
    pub cluster: Cluster,
    pub js: async_nats::jetstream::Context,
    /// One per worker, `w0`...: what the runner publishes as the engines, through bridges.
    pub engines: Vec<Engine>,
    /// `kvplane gateway` in front of the first members (OpenAI's HTTP API; Route and
    /// ReportUsage to them, failing over between them).
    pub gateway: Proc,
    /// What every member runs with (a new one adds its own id, address and `join`).
    options: NodeOptions,
    /// The Raft id the next new member gets.
    next_id: u64,
    /// Snapshot builds the members refused under [`Fault::SnapshotsFail`], and how many times
    /// that fault was held 20 s without one.
    pub snapshots_refused: u64,
    pub snapshots_never_refused: u64,
    /// Members the last heal started again (a follower that could not write a snapshot).
    pub restarted: Vec<usize>,
    _policies: tempfile::TempDir,
}

/// A fault in force, to be healed.
#[derive(Debug, Clone, Copy)]
pub enum Injected {
    Killed(usize),
    Paused(usize),
    Isolated(usize),
    /// Every member isolated.
    Split,
    Nats,
    NatsPaused,
    /// Every member restarted in turn (nothing left to heal), and how long the slowest took
    /// from its start to the fleet ready.
    Rolled(Duration),
    /// The member at this index is a new incarnation, joining.
    Replaced(usize),
    /// This many members were added at the end of the list.
    Scaled(usize),
    /// The member at this index runs with a skewed clock.
    Skewed(usize),
    /// The member at this index had its log writes fail (it should have exited).
    DiskFailed(usize),
    /// The member at this index has failpoints set (a slow disk, failing snapshots).
    Failpoints(usize),
    /// Failing snapshot writes on every member.
    SnapshotsFailing,
    /// Engine `w`'s bridge was killed (SIGKILL).
    BridgeKilled(usize),
    /// Engine `w`'s bridge is frozen (SIGSTOP).
    BridgePaused(usize),
}

impl Injected {
    /// The member the fault is on (none for NATS and faults on every member).
    pub fn member(self) -> Option<usize> {
        match self {
            Injected::Killed(i)
            | Injected::Paused(i)
            | Injected::Isolated(i)
            | Injected::Replaced(i)
            | Injected::Skewed(i)
            | Injected::DiskFailed(i)
            | Injected::Failpoints(i) => Some(i),
            Injected::Split
            | Injected::Nats
            | Injected::NatsPaused
            | Injected::Rolled(_)
            | Injected::Scaled(_)
            | Injected::SnapshotsFailing
            | Injected::BridgeKilled(_)
            | Injected::BridgePaused(_) => None,
        }
    }
}

impl Fleet {
    /// Starts the fleet and waits until every member holds the policies and the workers.
    pub async fn start() -> anyhow::Result<Fleet> {
        let policies = tempfile::tempdir()?;
        let limits: String = TENANTS
            .iter()
            .map(|(t, budget)| {
                format!(
                    "    - {{tenant: {t}, tokensPerMinute: {}, burst: {}, windowSeconds: {}}}\n",
                    budget * 60_000 / WINDOW_MS,
                    budget / 10,
                    WINDOW_MS / 1000
                )
            })
            .collect();
        std::fs::write(
            policies.path().join("fleet.yaml"),
            format!(
                "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: gpu}}\nspec: {{model: m, blockSize: 16}}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: tenants}}\nspec:\n  limits:\n{limits}"
            ),
        )?;
        let options = NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            raft: Some(RaftOptions {
                compaction: Some(COMPACTION),
                ..Default::default()
            }),
            ..Default::default()
        };
        let cluster = Cluster::start_raft(MEMBERS, &options);
        let js = cluster.nats.jetstream().await;
        kvplane_ingest::ensure_stream(&js, STREAM).await?;
        let mut engines = Vec::new();
        for w in 0..WORKERS {
            let dir = cluster.root.path();
            let url = cluster.nats.url();
            engines.push(Engine::start(dir, POOL, &format!("w{w}"), &url).await?);
        }
        let replicas: Vec<String> = cluster.nodes.iter().map(|n| n.endpoint()).collect();
        let gateway =
            kvplane_testkit::gateway(&replicas.join(","), cluster.root.path().join("gateway.log"));
        let fleet = Fleet {
            cluster,
            js,
            engines,
            gateway,
            options,
            next_id: MEMBERS as u64 + 1,
            snapshots_refused: 0,
            snapshots_never_refused: 0,
            restarted: Vec::new(),
            _policies: policies,
        };
        fleet
            .wait_healthy(Duration::from_secs(60), |s| {
                s.policy_objects.get("InferencePolicy") == Some(&1)
                    && s.workers.iter().filter(|w| w.up).count() == WORKERS
            })
            .await
            .context("the fleet did not come up")?;
        Ok(fleet)
    }

    /// The member that says it leads, if exactly one of the running ones does.
    pub async fn leader(&self) -> Option<usize> {
        let all: Vec<usize> = (0..self.cluster.nodes.len()).collect();
        self.cluster.leader(&all).await
    }

    /// Starts a new, empty member named `name` at `addr` (a fresh port when `None`) under a
    /// new id, asking the running members to let it join; returns its index.
    pub fn join_new(&mut self, name: &str, addr: Option<String>) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        let addr = addr.unwrap_or_else(|| format!("127.0.0.1:{}", free_port()));
        let join: Vec<String> = self
            .cluster
            .nodes
            .iter_mut()
            .filter_map(|n| n.is_running().then(|| n.grpc.to_string()))
            .collect();
        let o = NodeOptions {
            grpc_listen: addr.clone(),
            raft: Some(RaftOptions {
                id,
                peers: vec![(id, addr)],
                join,
                compaction: Some(COMPACTION),
                ..Default::default()
            }),
            ..self.options.clone()
        };
        self.cluster.add_node(&format!("{name}-id{id}"), &o);
        self.cluster.nodes.len() - 1
    }

    /// Waits until the leader's membership is exactly the fleet's members, all voters.
    pub async fn wait_membership(&self, within: Duration) -> anyhow::Result<()> {
        let want: BTreeSet<u64> = self
            .cluster
            .nodes
            .iter()
            .filter_map(|n| n.raft_id)
            .collect();
        let started = Instant::now();
        let mut seen = String::new();
        while started.elapsed() < within {
            if let Some(l) = self.leader().await
                && let Ok(mut c) = AdminClient::connect(self.cluster.nodes[l].endpoint()).await
                && let Ok(s) = c.cluster_status(StatusRequest::default()).await
            {
                let s = s.into_inner();
                let voters: BTreeSet<u64> =
                    s.members.iter().filter(|m| m.voter).map(|m| m.id).collect();
                if voters == want && s.members.len() == want.len() {
                    return Ok(());
                }
                seen = format!("{:?}", s.members);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("membership not {want:?} within {within:?}: {seen}")
    }

    /// SIGTERM to member `i`, waiting up to 30 s for its clean exit (a blocking wait, off the
    /// runtime's threads).
    fn stop_in_order(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.cluster.nodes[i];
        let exit = tokio::task::block_in_place(|| node.terminate_within(Duration::from_secs(30)));
        match exit {
            Some(exit) if exit.success() => Ok(()),
            Some(exit) => bail!("member {i} exited with {exit} on SIGTERM"),
            None => bail!("member {i} did not exit within 30 s of SIGTERM (killed)"),
        }
    }

    /// Removes member `id` through whichever member leads.
    async fn remove(&self, id: u64, within: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let mut last = String::from("no leader");
            if let Some(l) = self.leader().await {
                match self.cluster.nodes[l]
                    .admin()
                    .await
                    .remove_member(RemoveMemberRequest { id })
                    .await
                {
                    Ok(_) => return Ok(()),
                    Err(e) => last = e.to_string(),
                }
            }
            if started.elapsed() > within {
                bail!("member {id} not removed within {within:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Applies `step`'s fault; returns what to heal.
    pub async fn inject(&mut self, step: &Step) -> anyhow::Result<Injected> {
        let leader = match self.leader().await {
            Some(l) => l,
            None => bail!("no leader to inject {} on", step.fault.label()),
        };
        let followers: Vec<usize> = (0..self.cluster.nodes.len())
            .filter(|i| *i != leader)
            .collect();
        let follower = followers[(step.pick % followers.len() as u64) as usize];
        let on = if matches!(
            step.fault,
            Fault::KillLeader
                | Fault::PauseLeader
                | Fault::IsolateLeader
                | Fault::DiskFailsLeader
                | Fault::SlowDiskLeader
        ) {
            leader
        } else {
            follower
        };
        Ok(match step.fault {
            Fault::KillLeader | Fault::KillFollower => {
                self.cluster.nodes[on].kill();
                Injected::Killed(on)
            }
            Fault::PauseLeader | Fault::PauseFollower => {
                self.cluster.nodes[on].pause();
                Injected::Paused(on)
            }
            Fault::IsolateLeader | Fault::IsolateFollower => {
                self.cluster.isolate(on).await;
                Injected::Isolated(on)
            }
            Fault::MuteLeader => {
                let others: Vec<u64> = followers
                    .iter()
                    .filter_map(|f| self.cluster.nodes[*f].raft_id)
                    .collect();
                self.cluster.nodes[leader].block(others).await;
                Injected::Isolated(leader)
            }
            Fault::SplitAll => {
                for i in 0..self.cluster.nodes.len() {
                    self.cluster.isolate(i).await;
                }
                Injected::Split
            }
            Fault::RestartNats => {
                self.cluster.nats.kill();
                Injected::Nats
            }
            Fault::PauseNats => {
                if !self.cluster.nats.freeze(true) {
                    bail!("kill -STOP nats-server failed");
                }
                Injected::NatsPaused
            }
            Fault::RollingRestart => {
                let mut slowest = Duration::ZERO;
                for i in followers.iter().copied().chain([leader]) {
                    self.stop_in_order(i)?;
                    let started = Instant::now();
                    self.cluster.nodes[i].restart();
                    self.wait_healthy(Duration::from_secs(60), |_| true)
                        .await
                        .with_context(|| format!("after member {i} restarted"))?;
                    slowest = slowest.max(started.elapsed());
                }
                Injected::Rolled(slowest)
            }
            Fault::WipeFollower => {
                let addr = self.cluster.nodes[on].grpc.to_string();
                self.cluster.nodes[on].kill();
                std::fs::remove_dir_all(self.cluster.nodes[on].dir.join("data"))?;
                let name = format!("kvplane-{on}");
                let new = self.join_new(&name, Some(addr));
                // The new incarnation takes the old one's place in the list.
                self.cluster.nodes.swap(on, new);
                self.cluster.nodes.pop();
                Injected::Replaced(on)
            }
            Fault::ScaleOut => {
                for k in 0..2 {
                    self.join_new(&format!("kvplane-extra{k}"), None);
                }
                self.wait_membership(Duration::from_secs(60)).await?;
                Injected::Scaled(2)
            }
            Fault::SkewFollower => {
                let lib = FAKETIME
                    .iter()
                    .find(|p| std::path::Path::new(p).exists())
                    .context("libfaketime is not installed (scripts/install-deps installs it)")?;
                self.stop_in_order(on)?;
                let node = &mut self.cluster.nodes[on];
                node.env.extend([
                    ("LD_PRELOAD".to_owned(), (*lib).to_owned()),
                    ("FAKETIME".to_owned(), "+1.5".to_owned()),
                    ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
                ]);
                node.restart();
                Injected::Skewed(on)
            }
            Fault::DiskFailsLeader | Fault::DiskFailsFollower => {
                failpoints(&self.cluster.nodes[on], "raft-log-write=return").await?;
                Injected::DiskFailed(on)
            }
            Fault::SlowDiskLeader => {
                failpoints(&self.cluster.nodes[on], SLOW_DISK).await?;
                Injected::Failpoints(on)
            }
            Fault::SnapshotsFail => {
                let before = self.snapshot_failures().await;
                for n in &self.cluster.nodes {
                    failpoints(n, "raft-snapshot-write=return").await?;
                }
                // Held until a build was refused (a snapshot comes every few hundred
                // entries), at most 20 s: what is checked is what follows one.
                let started = Instant::now();
                let refused = loop {
                    let refused: u64 = self
                        .snapshot_failures()
                        .await
                        .iter()
                        .map(|(url, n)| n.saturating_sub(before.get(url).copied().unwrap_or(0)))
                        .sum();
                    if refused > 0 || started.elapsed() > Duration::from_secs(20) {
                        break refused;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                self.snapshots_refused += refused;
                if refused == 0 {
                    self.snapshots_never_refused += 1;
                }
                Injected::SnapshotsFailing
            }
            Fault::KillBridge => {
                let w = (step.pick % self.engines.len() as u64) as usize;
                self.engines[w].bridge.kill();
                Injected::BridgeKilled(w)
            }
            Fault::PauseBridge => {
                let w = (step.pick % self.engines.len() as u64) as usize;
                self.engines[w].freeze_bridge(true)?;
                Injected::BridgePaused(w)
            }
        })
    }

    /// A node of a cluster of its own (one member) on the same stream and policies, started
    /// after the run: it knows the fleet only from what the stream holds, from its start.
    pub fn start_replayer(&self) -> kvplane_testkit::Node {
        let addr = format!("127.0.0.1:{}", free_port());
        let o = NodeOptions {
            grpc_listen: addr.clone(),
            raft: Some(RaftOptions {
                id: 1,
                peers: vec![(1, addr)],
                bootstrap: true,
                ..Default::default()
            }),
            ..self.options.clone()
        };
        let dir = self.cluster.root.path().join("kvplane-replay");
        kvplane_testkit::Node::start("kvplane-replay", &dir, &self.cluster.nats.url(), &o)
    }

    /// Snapshot builds refused so far, by the process of each member that answers (a
    /// restarted member is another process, counting from 0, on another HTTP port).
    async fn snapshot_failures(&self) -> BTreeMap<String, u64> {
        let mut by = BTreeMap::new();
        for n in &self.cluster.nodes {
            let url = n.http_url("/metrics");
            if let Some(text) = http_body(&url).await {
                let v =
                    kvplane_testkit::metric_value(&text, "kvplane_raft_snapshot_failures_total");
                by.insert(url, v as u64);
            }
        }
        by
    }

    /// Undoes `injected`.
    pub async fn heal(&mut self, injected: Injected) -> anyhow::Result<()> {
        match injected {
            Injected::Killed(i) => self.cluster.nodes[i].restart(),
            Injected::Paused(i) => self.cluster.nodes[i].resume(),
            Injected::Isolated(_) | Injected::Split => self.cluster.heal().await,
            Injected::Nats => self.cluster.nats.restart(),
            Injected::NatsPaused => {
                if !self.cluster.nats.freeze(false) {
                    bail!("kill -CONT nats-server failed");
                }
            }
            Injected::Rolled(_) => {}
            Injected::Replaced(_) => self.wait_membership(Duration::from_secs(60)).await?,
            Injected::Scaled(n) => {
                let from = self.cluster.nodes.len() - n;
                for i in from..self.cluster.nodes.len() {
                    let id = self.cluster.nodes[i]
                        .raft_id
                        .context("a member without an id")?;
                    self.remove(id, Duration::from_secs(60)).await?;
                }
                self.cluster.nodes.truncate(from);
                self.wait_membership(Duration::from_secs(60)).await?;
            }
            Injected::Skewed(i) => {
                self.stop_in_order(i)?;
                let node = &mut self.cluster.nodes[i];
                node.env
                    .retain(|(k, _)| !k.starts_with("FAKETIME") && k != "LD_PRELOAD");
                node.restart();
            }
            Injected::DiskFailed(i) => {
                // The next append fails; the member must then end on its own, with an error.
                let started = Instant::now();
                let node = &mut self.cluster.nodes[i];
                let exit = loop {
                    if let Some(exit) = node.exited() {
                        break exit;
                    }
                    if started.elapsed() > Duration::from_secs(30) {
                        bail!("member {i} still runs 30 s after its log writes were set to fail");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                if exit.success() {
                    bail!("member {i} exited successfully after its log writes failed");
                }
                node.restart();
            }
            Injected::Failpoints(i) => failpoints(&self.cluster.nodes[i], "").await?,
            Injected::SnapshotsFailing => {
                // A builder kept its last snapshot and goes on; a follower that could not
                // write a snapshot sent by the leader stopped Raft, as after a failed log
                // write, and exits: it is given up to 10 s to end (no answer while it ends
                // counts as ending), then started again. Any other exit fails the run.
                for node in &mut self.cluster.nodes {
                    if let Err(e) = failpoints(node, "").await
                        && node.is_running()
                    {
                        return Err(e);
                    }
                }
                let started = Instant::now();
                loop {
                    let mut stopping = false;
                    for (i, node) in self.cluster.nodes.iter_mut().enumerate() {
                        match node.exited() {
                            Some(exit) => {
                                let log = node.log();
                                let install = log.contains("raft stopped")
                                    && log.contains(
                                        "a snapshot sent by the leader could not be written",
                                    );
                                if exit.success() || !install {
                                    bail!(
                                        "member {i} exited ({exit}) while snapshot writes failed, not for a snapshot it was sent"
                                    );
                                }
                                node.restart();
                                self.restarted.push(i);
                            }
                            None => {
                                stopping |= status(node).await.is_none_or(|s| s.role == "shutdown");
                            }
                        }
                    }
                    if !stopping {
                        break;
                    }
                    if started.elapsed() > Duration::from_secs(10) {
                        bail!("a member whose raft stopped has not exited within 10 s");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Injected::BridgeKilled(w) => self.engines[w].bridge.restart(),
            Injected::BridgePaused(w) => self.engines[w].freeze_bridge(false)?,
        }
        Ok(())
    }

    /// Waits until every member answers ready (`/readyz`) and `also` holds of its status;
    /// returns how long that took.
    pub async fn wait_healthy(
        &self,
        within: Duration,
        also: impl Fn(&kvplane_proto::v1::StatusResponse) -> bool,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            let mut healthy = true;
            for n in &self.cluster.nodes {
                healthy &= ready(n).await && status(n).await.is_some_and(|s| also(&s));
                if !healthy {
                    break;
                }
            }
            if healthy {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!("the fleet was not healthy within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Sets `node`'s failpoints (`name=actions;...`; empty clears them).
async fn failpoints(node: &kvplane_testkit::Node, spec: &str) -> anyhow::Result<()> {
    let set = async {
        AdminClient::connect(node.endpoint())
            .await?
            .set_failpoints(kvplane_proto::v1::SetFailpointsRequest {
                failpoints: spec.to_owned(),
            })
            .await
            .map_err(anyhow::Error::from)
    };
    tokio::time::timeout(Duration::from_secs(10), set)
        .await
        .map_err(|_| anyhow::anyhow!("{} did not answer SetFailpoints within 10 s", node.name))?
        .with_context(|| format!("failpoints {spec:?} on {}", node.name))?;
    Ok(())
}

/// Whether `node` answers `/readyz` with 200 (false while it does not answer at all).
pub async fn ready(node: &kvplane_testkit::Node) -> bool {
    let url = node.http_url("/readyz");
    let r = tokio::time::timeout(Duration::from_secs(2), http_status(&url));
    matches!(r.await, Ok(Some(200)))
}

/// The body of a plaintext `GET url` answered 200, or `None`.
async fn http_body(url: &str) -> Option<String> {
    let url: tonic::codegen::http::Uri = url.parse().ok()?;
    let addr = format!("{}:{}", url.host()?, url.port_u16()?);
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(format!("GET {} HTTP/1.0\r\nhost: x\r\n\r\n", url.path()).as_bytes())
            .await
            .ok()?;
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.ok()?;
        let text = String::from_utf8(all).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// The status code of a plaintext `GET url`, or `None` without an answer.
async fn http_status(url: &str) -> Option<u16> {
    let url: tonic::codegen::http::Uri = url.parse().ok()?;
    let addr = format!("{}:{}", url.host()?, url.port_u16()?);
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(format!("GET {} HTTP/1.0\r\nhost: x\r\n\r\n", url.path()).as_bytes())
        .await
        .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// `node`'s status, or `None` while it does not answer.
pub async fn status(node: &kvplane_testkit::Node) -> Option<kvplane_proto::v1::StatusResponse> {
    let ask = async {
        let mut c = kvplane_proto::v1::admin_client::AdminClient::connect(node.endpoint())
            .await
            .ok()?;
        c.status(kvplane_proto::v1::StatusRequest::default())
            .await
            .ok()
            .map(tonic::Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}
