//! A test's fleet of real processes: `nats-server` and `kvplane` processes on free loopback
//! ports, each with its own directory. Waits are on conditions (polled), never fixed sleeps.
//! Everything here panics on failure, with the process's log: it is for tests.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvplane_proto::v1::admin_client::AdminClient;
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{StatusRequest, StatusResponse};
use tempfile::TempDir;
use tonic::transport::Channel;

use crate::eventually;
pub use crate::metrics_text::metric_value;
use crate::process::{self, Spec, kill as stop, kvplane_binary};

/// Runs the `kvplane` binary with `args`, asserts it succeeded, and returns its stdout.
pub fn kvplane_ok(args: &[&str]) -> String {
    let out = Command::new(kvplane_binary()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    process::free_port().unwrap()
}

/// A JetStream-enabled nats-server with its own store directory.
pub struct Nats {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
    starts: u32,
    /// A nats-server config file (`max_payload: 4KB`, for instance), when one was given.
    config: Option<PathBuf>,
}

impl Nats {
    pub fn start() -> Self {
        Self::start_configured("")
    }

    /// With `config` as the server's config file (nothing when empty).
    pub fn start_configured(config: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let config = (!config.is_empty()).then(|| {
            let path = dir.path().join("nats.conf");
            std::fs::write(&path, config).unwrap();
            path
        });
        let mut n = Self {
            child: None,
            port,
            dir,
            starts: 0,
            config,
        };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let program = process::which("nats-server")
            .expect("nats-server must be installed (apt-get install -y nats-server)");
        let mut args = vec![
            "-js".to_owned(),
            "-a".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            self.port.to_string(),
            "-sd".to_owned(),
            self.dir.path().join("store").display().to_string(),
        ];
        if let Some(c) = &self.config {
            args.extend(["-c".to_owned(), c.display().to_string()]);
        }
        let (child, _) = process::start(Spec {
            program: &program,
            args: &args,
            env: &[],
            log: &self.dir.path().join(format!("nats.{}.log", self.starts)),
            ready: None,
        })
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    pub fn kill(&mut self) {
        stop(&mut self.child);
    }

    /// Starts again on the same port with the same store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGSTOP (`frozen`) or SIGCONT: a server that keeps its sockets and answers nothing.
    pub fn freeze(&self, frozen: bool) -> bool {
        let sig = if frozen { "-STOP" } else { "-CONT" };
        self.child.as_ref().is_some_and(|c| process::signal(c, sig))
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        let client = async_nats::connect(self.url()).await.unwrap();
        async_nats::jetstream::new(client)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Settings a test may change; the rest is `kvplane serve`'s defaults.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    pub pools: Vec<(String, u32)>,
    /// Models every pool serves (empty: any model).
    pub pool_models: Vec<String>,
    pub snapshot_every_entries: u64,
    pub max_message_bytes: usize,
    pub max_batch_messages: usize,
    /// `[ingest] worker_lease_ms`.
    pub worker_lease_ms: u64,
    /// `[ingest] ready_max_pending_messages`.
    pub ready_max_pending_messages: u64,
    /// The gRPC address (Raft members need a fixed one).
    pub grpc_listen: String,
    /// The `[raft]` section, for cluster members.
    pub raft: Option<RaftOptions>,
    /// A policy directory the leader keeps the state in line with (reread every 100 ms).
    pub policy_dir: Option<PathBuf>,
    /// Extra environment of the process (`OTEL_*`, for instance).
    pub env: Vec<(String, String)>,
    /// TOML sections appended to the config (`[quota]`, for instance).
    pub extra_toml: String,
    /// TLS on the gRPC port, and the certificate the test's clients present.
    pub tls: Option<crate::pki::NodeTls>,
}

/// A cluster member's Raft settings (the fault layer is always enabled in tests).
#[derive(Debug, Clone, Default)]
pub struct RaftOptions {
    pub id: u64,
    /// Every member as (id, gRPC address).
    pub peers: Vec<(u64, String)>,
    pub bootstrap: bool,
    /// Addresses to ask for membership when the log is empty.
    pub join: Vec<String>,
    /// `(snapshot_logs, keep_logs_after_snapshot)` when not the defaults.
    pub compaction: Option<(u64, u64)>,
    /// `(election_timeout_min_ms, election_timeout_max_ms)` when not 400-800 ms.
    pub election_timeout_ms: Option<(u64, u64)>,
    /// Added through `join` as a learner, for good.
    pub learner: bool,
    /// Writes, read barriers and the join go through `join`'s members, which relay them.
    pub relay_through_join: bool,
    /// The body of a `[raft.kubernetes]` section: the member is a StatefulSet pod (its id
    /// chosen on its volume; `id`, `peers` and `bootstrap` are not written).
    pub kubernetes: Option<String>,
}

impl Default for NodeOptions {
    fn default() -> Self {
        Self {
            pools: vec![("default".into(), 16)],
            grpc_listen: "127.0.0.1:0".into(),
            raft: None,
            policy_dir: None,
            pool_models: Vec::new(),
            env: Vec::new(),
            extra_toml: String::new(),
            snapshot_every_entries: 10_000,
            max_message_bytes: 1 << 20,
            max_batch_messages: 512,
            worker_lease_ms: 30_000,
            ready_max_pending_messages: 100_000,
            tls: None,
        }
    }
}

/// One `kvplane serve` process.
pub struct Node {
    pub name: String,
    child: Option<Child>,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub dir: PathBuf,
    /// The Raft id, for cluster members.
    pub raft_id: Option<u64>,
    config: PathBuf,
    /// Extra environment of the process, read at each (re)start.
    pub env: Vec<(String, String)>,
    starts: u32,
    /// How the test's clients reach it.
    pub dialer: kvplane_tls::Dialer,
    /// Its HTTP port's client: `https`, trusting the test CA, when the node has TLS.
    http_client: reqwest::Client,
    https: bool,
}

impl Node {
    /// Writes `dir/kvplane.toml` for a node named `name` with options `o`; returns its path.
    pub fn write_config(name: &str, dir: &Path, nats_url: &str, o: &NodeOptions) -> PathBuf {
        let policy = o
            .policy_dir
            .as_ref()
            .map(|d| format!("policy_dir = \"{}\"\npolicy_poll_ms = 100\n", d.display()))
            .unwrap_or_default();
        let mut toml = format!(
            "{policy}node_id = \"{name}\"\ndata_dir = \"{}\"\ngrpc_listen = \"{}\"\nhttp_listen = \"127.0.0.1:0\"\nnats_url = \"{nats_url}\"\n\n[ingest]\nmax_message_bytes = {}\nmax_batch_messages = {}\nworker_lease_ms = {}\nready_max_pending_messages = {}\n\n[raft]\nfault_injection = true\n",
            dir.join("data").display(),
            o.grpc_listen,
            o.max_message_bytes,
            o.max_batch_messages,
            o.worker_lease_ms,
            o.ready_max_pending_messages,
        );
        let (snapshot_logs, keep_logs) = o
            .raft
            .as_ref()
            .and_then(|r| r.compaction)
            .unwrap_or((o.snapshot_every_entries, 1_000));
        toml.push_str(&format!(
            "snapshot_logs = {snapshot_logs}\nkeep_logs_after_snapshot = {keep_logs}\n"
        ));
        if let Some(RaftOptions {
            id,
            peers,
            bootstrap,
            join,
            compaction: _,
            election_timeout_ms,
            learner,
            relay_through_join,
            kubernetes,
        }) = &o.raft
        {
            let (election_min, election_max) = election_timeout_ms.unwrap_or((400, 800));
            if kubernetes.is_none() {
                toml.push_str(&format!(
                    "id = {id}\nbootstrap = {bootstrap}\npeers = [{}]\n",
                    peers
                        .iter()
                        .map(|(i, a)| format!("{{ id = {i}, addr = \"{a}\" }}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                ));
            }
            toml.push_str(&format!(
                "learner = {learner}\nrelay_through_join = {relay_through_join}\nforward_timeout_ms = 3000\nheartbeat_ms = 100\nelection_timeout_min_ms = {election_min}\nelection_timeout_max_ms = {election_max}\njoin = [{}]\n",
                join.iter()
                    .map(|a| format!("{a:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            if let Some(k) = kubernetes {
                toml.push_str(&format!("[raft.kubernetes]\n{k}\n"));
            }
        }
        let models: Vec<String> = o.pool_models.iter().map(|m| format!("{m:?}")).collect();
        // With a policy directory the worker sets are the fleet: the default pool (every
        // model) is left to the node, which declares none then.
        let implicit = o.policy_dir.is_some() && o.pools == [("default".to_owned(), 16)];
        for (pool, bs) in o.pools.iter().filter(|_| !implicit) {
            toml.push_str(&format!(
                "\n[[pools]]\nname = \"{pool}\"\nblock_size = {bs}\nmodels = [{}]\n",
                models.join(", ")
            ));
        }
        toml.push('\n');
        toml.push_str(&o.extra_toml);
        if let Some(t) = &o.tls {
            toml.push_str(&t.toml());
        }
        let path = dir.join("kvplane.toml");
        std::fs::write(&path, toml).unwrap();
        path
    }

    pub fn start(name: &str, dir: &Path, nats_url: &str, o: &NodeOptions) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let config = Self::write_config(name, dir, nats_url, o);
        let mut node = Self {
            name: name.to_owned(),
            child: None,
            grpc: "0.0.0.0:0".parse().unwrap(),
            http: "0.0.0.0:0".parse().unwrap(),
            dir: dir.to_owned(),
            raft_id: o
                .raft
                .as_ref()
                .filter(|r| r.kubernetes.is_none())
                .map(|r| r.id),
            config,
            env: o.env.clone(),
            starts: 0,
            dialer: o
                .tls
                .as_ref()
                .map_or_else(kvplane_tls::Dialer::plain, crate::pki::NodeTls::dialer),
            // Trusting what the test's gRPC clients trust.
            http_client: http_client(
                o.tls
                    .as_ref()
                    .map(|t| t.client.as_ref().unwrap_or(&t.dir).join("ca.crt"))
                    .as_deref(),
            ),
            https: o.tls.is_some() && !o.extra_toml.contains("plaintext = true"),
        };
        node.spawn();
        node
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = self.dir.join(format!("node.{}.log", self.starts));
        let args = vec![
            "serve".into(),
            "--config".into(),
            self.config.display().to_string(),
        ];
        let mut env = vec![("RUST_LOG".to_owned(), "info".to_owned())];
        env.extend(self.env.iter().cloned());
        let (child, ready) = process::start(Spec {
            program: &kvplane_binary(),
            args: &args,
            env: &env,
            log: &log,
            ready: Some("kvplane ready "),
        })
        .unwrap_or_else(|e| panic!("node {}: {e}:\n{}", self.name, self.log()));
        for part in ready.split_whitespace() {
            if let Some(a) = part.strip_prefix("grpc=") {
                self.grpc = a.parse().unwrap();
            }
            if let Some(a) = part.strip_prefix("http=") {
                self.http = a.parse().unwrap();
            }
        }
        self.child = Some(child);
    }

    /// The node's log of its current (or last) run.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("node.{}.log", self.starts)))
            .unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// SIGKILL: no shutdown work at all.
    pub fn kill(&mut self) {
        stop(&mut self.child);
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal("-TERM");
        let mut c = self.child.take().expect("node is not running");
        c.wait().unwrap()
    }

    /// SIGTERM and wait up to `within` for its exit; past that, SIGKILL and `None`.
    pub fn terminate_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        self.signal("-TERM");
        let deadline = Instant::now() + within;
        let mut c = self.child.take().expect("node is not running");
        loop {
            if let Ok(Some(exit)) = c.try_wait() {
                return Some(exit);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The exit status once the process has ended on its own (it can then be restarted).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the node before restarting it");
        self.spawn();
    }

    fn signal(&self, sig: &str) {
        let c = self.child.as_ref().expect("node is not running");
        assert!(process::signal(c, sig), "kill {sig} {}", self.name);
    }

    /// SIGSTOP: the process freezes (its sockets stay open, nothing answers). Returns once
    /// every thread has stopped, so nothing the node does lands after this.
    pub fn pause(&self) {
        self.signal("-STOP");
        let c = self.child.as_ref().expect("node is not running");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !process::is_stopped(c) {
            assert!(
                Instant::now() < deadline,
                "{} did not stop within 10 s of SIGSTOP",
                self.name
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Disk faults: this node's failpoints (`name=actions;...`, empty clears them).
    pub async fn failpoints(&self, spec: &str) {
        self.admin()
            .await
            .set_failpoints(kvplane_proto::v1::SetFailpointsRequest {
                failpoints: spec.to_owned(),
            })
            .await
            .unwrap();
    }

    /// The fault layer: this node stops sending Raft traffic to these Raft ids.
    pub async fn block(&self, peers: Vec<u64>) {
        self.admin()
            .await
            .set_faults(kvplane_proto::v1::SetFaultsRequest {
                blocked_peers: peers,
            })
            .await
            .unwrap();
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel().await)
    }

    /// Its view of the Raft cluster (`Admin.ClusterStatus`); panics when it does not answer.
    pub async fn cluster_status(&self) -> kvplane_proto::v1::ClusterStatusResponse {
        self.admin()
            .await
            .cluster_status(kvplane_proto::v1::StatusRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    /// Its gRPC URL (`https` with TLS).
    pub fn endpoint(&self) -> String {
        self.dialer.url(&self.grpc.to_string())
    }

    /// A channel to its gRPC port, as the test's clients reach it.
    pub async fn channel(&self) -> Channel {
        self.dialer.connect(&self.grpc.to_string()).await.unwrap()
    }

    pub async fn router(&self) -> RouterClient<Channel> {
        RouterClient::new(self.channel().await)
    }

    pub async fn status(&self) -> StatusResponse {
        let mut c = AdminClient::new(self.channel().await);
        c.status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    /// Waits until the node has applied the stream up to `seq`.
    pub async fn wait_applied_seq(&self, seq: u64) -> StatusResponse {
        eventually(
            &format!("{} to apply stream sequence {seq}", self.name),
            Duration::from_secs(30),
            || async {
                let s = self.status().await;
                (s.ingest.as_ref().map_or(0, |i| i.applied_stream_sequence) >= seq).then_some(s)
            },
        )
        .await
    }

    /// The URL of `path` on its HTTP port (`https` when the node has TLS there).
    pub fn http_url(&self, path: &str) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}{path}", self.http.port())
    }

    /// `/readyz`: its status code and body.
    pub async fn readyz(&self) -> (u16, String) {
        let r = self
            .http_client
            .get(self.http_url("/readyz"))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// `/metrics` text.
    pub async fn metrics(&self) -> String {
        let r = self
            .http_client
            .get(self.http_url("/metrics"))
            .send()
            .await
            .unwrap();
        r.text().await.unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// NATS plus `n` kvplane nodes, each in its own directory under one temporary root.
pub struct Cluster {
    pub nats: Nats,
    pub nodes: Vec<Node>,
    pub root: TempDir,
}

impl Cluster {
    pub fn start(n: usize) -> Self {
        Self::start_with(n, &NodeOptions::default())
    }

    pub fn start_with(n: usize, o: &NodeOptions) -> Self {
        Self::start_on(Nats::start(), n, o)
    }

    /// `n` nodes on `nats`.
    pub fn start_on(nats: Nats, n: usize, o: &NodeOptions) -> Self {
        let root = tempfile::tempdir().unwrap();
        let nodes = (0..n)
            .map(|i| {
                let name = format!("kvplane-{i}");
                Node::start(&name, &root.path().join(&name), &nats.url(), o)
            })
            .collect();
        Self { nats, nodes, root }
    }

    /// NATS plus an `n`-node Raft cluster (node 0 bootstraps it), each node on a fixed port.
    pub fn start_raft(n: usize, o: &NodeOptions) -> Self {
        let nats = Nats::start();
        let root = tempfile::tempdir().unwrap();
        let peers: Vec<(u64, String)> = (0..n)
            .map(|i| (i as u64 + 1, format!("127.0.0.1:{}", free_port())))
            .collect();
        let nodes = (0..n)
            .map(|i| {
                let name = format!("kvplane-{i}");
                let mine = NodeOptions {
                    grpc_listen: peers[i].1.clone(),
                    raft: Some(RaftOptions {
                        id: peers[i].0,
                        peers: peers.clone(),
                        bootstrap: i == 0,
                        ..o.raft.clone().unwrap_or_default()
                    }),
                    ..o.clone()
                };
                Node::start(&name, &root.path().join(&name), &nats.url(), &mine)
            })
            .collect();
        Self { nats, nodes, root }
    }

    /// The index of the node that reports itself leader, if exactly one does.
    pub async fn leader(&self, among: &[usize]) -> Option<usize> {
        let mut leaders = Vec::new();
        for &i in among {
            if let Ok(mut c) = AdminClient::connect(self.nodes[i].endpoint()).await
                && let Ok(s) = c.status(StatusRequest::default()).await
                && s.into_inner().role == "leader"
            {
                leaders.push(i);
            }
        }
        (leaders.len() == 1).then(|| leaders[0])
    }

    /// Cuts node `i` off from every other running member (both directions).
    pub async fn isolate(&mut self, i: usize) {
        let id = self.nodes[i].raft_id.unwrap();
        let others: Vec<u64> = self
            .nodes
            .iter()
            .filter_map(|n| n.raft_id)
            .filter(|o| *o != id)
            .collect();
        self.nodes[i].block(others).await;
        for j in 0..self.nodes.len() {
            if j != i && self.nodes[j].raft_id.is_some() && self.nodes[j].is_running() {
                self.nodes[j].block(vec![id]).await;
            }
        }
    }

    /// Removes every cut.
    pub async fn heal(&mut self) {
        for n in &mut self.nodes {
            if n.raft_id.is_some() && n.is_running() {
                n.block(Vec::new()).await;
            }
        }
    }

    /// Waits until every node in `among` applied the stream up to `last` and all report the
    /// same digest and index size; returns the digest.
    pub async fn all_agree(&self, among: &[usize], last: u64) -> String {
        eventually(
            "every replica to apply the stream and agree",
            Duration::from_secs(30),
            || async {
                let mut digests = Vec::new();
                for &i in among {
                    let s = self.nodes[i].status().await;
                    if s.ingest.as_ref().map_or(0, |g| g.applied_stream_sequence) < last {
                        return None;
                    }
                    digests.push((s.state_digest, s.indexed_blocks));
                }
                digests
                    .windows(2)
                    .all(|w| w[0] == w[1])
                    .then(|| digests[0].0.clone())
            },
        )
        .await
    }

    /// Starts one more node on the same NATS, with its own empty directory.
    pub fn add_node(&mut self, name: &str, o: &NodeOptions) -> &mut Node {
        let node = Node::start(name, &self.root.path().join(name), &self.nats.url(), o);
        self.nodes.push(node);
        self.nodes.last_mut().unwrap()
    }
}

/// Publishes with JetStream acknowledgement; returns the stream sequence. Right after a
/// stream is created the server may not route its subjects yet ("no responders", reported as
/// StreamNotFound): that is retried until the stream answers, for up to 5 s.
pub async fn publish(
    js: &async_nats::jetstream::Context,
    subject: String,
    payload: Vec<u8>,
) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ack = js
            .publish(subject.clone(), payload.clone().into())
            .await
            .unwrap()
            .await;
        match ack {
            Ok(a) => return a.sequence,
            Err(e)
                if e.kind() == async_nats::jetstream::context::PublishErrorKind::StreamNotFound
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("publish to {subject}: {e}"),
        }
    }
}

/// Starts `kvplane ARGS...`, logging stderr to `log`, and waits for its `prefix` ready line.
pub fn spawn_ready(args: &[String], log: &Path, prefix: &str) -> (Child, String) {
    process::start(Spec {
        program: &kvplane_binary(),
        args,
        env: &[("RUST_LOG".to_owned(), "info".to_owned())],
        log,
        ready: Some(prefix),
    })
    .unwrap_or_else(|e| panic!("{e}:\n{}", std::fs::read_to_string(log).unwrap_or_default()))
}

/// `key=value` from a ready line.
pub fn field(line: &str, key: &str) -> String {
    process::field(line, key)
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_owned()
}

/// `kvplane gateway` on a free port in front of `replicas` (comma-separated gRPC URLs).
pub fn gateway(replicas: &str, log: PathBuf) -> Proc {
    gateway_with(replicas, &[], log)
}

/// A gateway asking `replicas`, with more `kvplane gateway` flags.
pub fn gateway_with(replicas: &str, args: &[String], log: PathBuf) -> Proc {
    let mut all = vec![
        "gateway".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--replicas".into(),
        replicas.into(),
    ];
    all.extend_from_slice(args);
    Proc::start(all, log, "kvplane-gateway ready")
}

/// A process killed when dropped.
pub struct Proc {
    pub child: Option<Child>,
    pub args: Vec<String>,
    pub log: PathBuf,
    pub ready: String,
    prefix: String,
    restarts: u32,
}

impl Proc {
    pub fn start(args: Vec<String>, log: PathBuf, prefix: &str) -> Self {
        let (child, ready) = spawn_ready(&args, &log, prefix);
        Self {
            child: Some(child),
            args,
            log,
            ready,
            prefix: prefix.to_owned(),
            restarts: 0,
        }
    }

    pub fn kill(&mut self) {
        stop(&mut self.child);
    }

    pub fn restart(&mut self) {
        self.kill();
        self.restarts += 1;
        let log = PathBuf::from(format!("{}.{}", self.log.display(), self.restarts));
        let (child, ready) = spawn_ready(&self.args, &log, &self.prefix);
        self.child = Some(child);
        self.ready = ready;
    }

    pub fn field(&self, key: &str) -> String {
        field(&self.ready, key)
    }

    /// SIGSTOP (`frozen`) or SIGCONT; false when it is not running or the signal failed.
    pub fn freeze(&self, frozen: bool) -> bool {
        let sig = if frozen { "-STOP" } else { "-CONT" };
        self.child.as_ref().is_some_and(|c| process::signal(c, sig))
    }

    /// The log of the current run.
    pub fn current_log(&self) -> String {
        let path = if self.restarts == 0 {
            self.log.clone()
        } else {
            PathBuf::from(format!("{}.{}", self.log.display(), self.restarts))
        };
        std::fs::read_to_string(path).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How [`Engine::start_with`] starts the engine and its bridge.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub pool: String,
    /// `[http, zmq pub, zmq replay]` (0: any).
    pub ports: [u16; 3],
    /// More `kvplane sim engine` flags (`--model`, `--dp-rank`...).
    pub sim_args: Vec<String>,
    /// More `kvplane bridge` flags (`--dp-rank`...).
    pub bridge_args: Vec<String>,
    /// The bridge's scrape interval.
    pub scrape_ms: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            pool: "default".into(),
            ports: [0, 0, 0],
            sim_args: Vec::new(),
            bridge_args: Vec::new(),
            scrape_ms: 50,
        }
    }
}

/// A simulated engine (10x real time) and its bridge, joined to `nats` as `pool/worker`.
pub struct Engine {
    pub worker: String,
    pub sim: Proc,
    pub bridge: Proc,
    pub http: String,
}

impl Engine {
    /// A simulated engine alone (10x real time), no bridge: an engine kvplane knows only from
    /// where a worker set says it is. `ports` as in [`Self::start_on`].
    pub fn sim(dir: &Path, worker: &str, ports: [u16; 3], sim_args: &[String]) -> Proc {
        std::fs::create_dir_all(dir).unwrap();
        let s = |v: &str| v.to_owned();
        let mut args = vec![
            s("sim"),
            s("engine"),
            s("--http-listen"),
            format!("127.0.0.1:{}", ports[0]),
            s("--zmq-pub"),
            format!("tcp://127.0.0.1:{}", ports[1]),
            s("--zmq-replay"),
            format!("tcp://127.0.0.1:{}", ports[2]),
            s("--speedup"),
            s("10"),
        ];
        args.extend_from_slice(sim_args);
        Proc::start(
            args,
            dir.join(format!("{worker}.sim.log")),
            "kvplane-sim ready",
        )
    }

    pub fn start(dir: &Path, nats_url: &str, worker: &str) -> Self {
        Self::start_on(dir, nats_url, worker, [0, 0, 0])
    }

    /// On fixed ports `[http, zmq pub, zmq replay]` (0: any), so a restart keeps its address.
    pub fn start_on(dir: &Path, nats_url: &str, worker: &str, ports: [u16; 3]) -> Self {
        Self::start_for(dir, nats_url, "default", worker, ports, &[])
    }

    /// In pool `pool`, with more `kvplane sim engine` flags (`--model`, `--tokenizer`...).
    pub fn start_for(
        dir: &Path,
        nats_url: &str,
        pool: &str,
        worker: &str,
        ports: [u16; 3],
        sim_args: &[String],
    ) -> Self {
        let o = EngineOptions {
            pool: pool.to_owned(),
            ports,
            sim_args: sim_args.to_vec(),
            ..EngineOptions::default()
        };
        Self::start_with(dir, nats_url, worker, &o)
    }

    /// With every option of [`EngineOptions`].
    pub fn start_with(dir: &Path, nats_url: &str, worker: &str, o: &EngineOptions) -> Self {
        let (pool, sim) = (
            o.pool.as_str(),
            Self::sim(dir, worker, o.ports, &o.sim_args),
        );
        let s = |v: &str| v.to_owned();
        let http = format!("http://{}", sim.field("http"));
        let bridge = Proc::start(
            vec![
                s("bridge"),
                s("--pool"),
                s(pool),
                s("--worker"),
                s(worker),
                s("--engine-url"),
                http.clone(),
                s("--zmq-pub"),
                sim.field("zmq_pub"),
                s("--zmq-replay"),
                sim.field("zmq_replay"),
                s("--nats-url"),
                s(nats_url),
                s("--scrape-interval-ms"),
                o.scrape_ms.to_string(),
            ]
            .into_iter()
            .chain(o.bridge_args.iter().cloned())
            .collect(),
            dir.join(format!("{worker}.bridge.log")),
            "kvplane-bridge ready",
        );
        Self {
            worker: worker.to_owned(),
            sim,
            bridge,
            http,
        }
    }

    /// A counter or gauge from the engine's own `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        metric_value(&http_get(&format!("{}/metrics", self.http)).await, name)
    }

    /// A counter from the bridge's `/metrics`.
    pub async fn bridge_metric(&self, name: &str) -> f64 {
        let url = format!("http://{}/metrics", self.bridge.field("http"));
        metric_value(&http_get(&url).await, name)
    }
}

/// An HTTP client trusting the CA in `ca` (a PEM file), or the web's roots without one.
///
/// It keeps no idle connections: a node closes one idle past its `header_read_ms`, and a
/// request that picked it from a pool just then would fail (a test's race, not the node's).
pub fn http_client(ca: Option<&Path>) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .pool_max_idle_per_host(0);
    if let Some(ca) = ca {
        let pem = std::fs::read(ca).unwrap();
        for c in reqwest::Certificate::from_pem_bundle(&pem).unwrap() {
            b = b.add_root_certificate(c);
        }
    }
    b.build().unwrap()
}

pub async fn http_get(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}
