//! The fleet under test: nats-server, three Raft members holding a worker set and two tenants'
//! limits (two-second windows), an engine per worker joined by its `kvplane bridge`, and a
//! `kvplane gateway`; [`crate::faults`] applies the faults of [`crate::schedule`] to it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_proto::v1::{StatusRequest, admin_client::AdminClient};
use kvplane_testkit::{Cluster, NodeOptions, Proc, RaftOptions, free_port};

use crate::engines::Engine;
use crate::probe::{ready, status};

/// Members in the cluster (between faults: scaling out adds two for a while).
pub const MEMBERS: usize = 3;
/// Snapshot every this many entries and keep this many after it: members that join or come
/// back late catch up through snapshots, not only the log.
const COMPACTION: (u64, u64) = (500, 100);
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
    /// that fault was held 40 s without one.
    pub snapshots_refused: u64,
    pub snapshots_never_refused: u64,
    /// Members the last heal started again (a follower that could not write a snapshot).
    pub restarted: Vec<usize>,
    _policies: tempfile::TempDir,
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
        // On a port of its own: started again after a kill, it is where its clients look.
        let gateway = Proc::start(
            vec![
                "gateway".into(),
                "--listen".into(),
                format!("127.0.0.1:{}", free_port()),
                "--replicas".into(),
                replicas.join(","),
            ],
            cluster.root.path().join("gateway.log"),
            "kvplane-gateway ready",
        );
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
