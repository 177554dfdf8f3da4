//! What the drivers share: child processes by name (started with a ready line, killed and
//! restarted with the same arguments, all stopped when dropped) and a node's Status.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_proto::v1::{StatusRequest, StatusResponse, admin_client::AdminClient};
use kvplane_testkit::process;
use kvplane_tls::Dialer;

/// One started program.
struct Proc {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    ready: Option<String>,
    child: Option<Child>,
    starts: u32,
}

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped.
pub(crate) struct Procs {
    dir: PathBuf,
    procs: Vec<Proc>,
}

impl Procs {
    /// Logs go to `dir/<name>.log` (`<name>.<n>.log` for the n-th restart).
    pub(crate) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            procs: Vec::new(),
        }
    }

    /// Starts `program` as `name` and waits for its `ready` line (when given); returns it.
    pub(crate) fn spawn(
        &mut self,
        name: &str,
        program: &Path,
        args: &[String],
        ready: Option<&str>,
    ) -> anyhow::Result<String> {
        self.spawn_env(name, program, args, &[], ready)
    }

    /// [`Self::spawn`] with these environment variables set too.
    pub(crate) fn spawn_env(
        &mut self,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        ready: Option<&str>,
    ) -> anyhow::Result<String> {
        self.procs.push(Proc {
            name: name.to_owned(),
            program: program.to_owned(),
            args: args.to_vec(),
            env: env.to_vec(),
            ready: ready.map(str::to_owned),
            child: None,
            starts: 0,
        });
        let i = self.procs.len() - 1;
        self.start(i)
    }

    fn start(&mut self, i: usize) -> anyhow::Result<String> {
        let p = &mut self.procs[i];
        p.starts += 1;
        let log = match p.starts {
            1 => self.dir.join(format!("{}.log", p.name)),
            n => self.dir.join(format!("{}.{n}.log", p.name)),
        };
        let (child, line) = process::start(process::Spec {
            program: &p.program,
            args: &p.args,
            env: &p.env,
            log: &log,
            ready: p.ready.as_deref(),
        })
        .with_context(|| format!("starting {} (log {})", p.name, log.display()))?;
        p.child = Some(child);
        Ok(line)
    }

    fn find(&mut self, name: &str) -> anyhow::Result<usize> {
        self.procs
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no process named {name}"))
    }

    /// SIGKILL: no shutdown work at all.
    pub(crate) fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let i = self.find(name)?;
        process::kill(&mut self.procs[i].child);
        Ok(())
    }

    /// Starts a killed process again with the same arguments; returns its ready line.
    pub(crate) fn restart(&mut self, name: &str) -> anyhow::Result<String> {
        let i = self.find(name)?;
        if self.procs[i].child.is_some() {
            bail!("{name} is still running");
        }
        self.start(i)
    }

    /// How often `name` was started (0: no such process).
    pub(crate) fn starts(&self, name: &str) -> u32 {
        self.procs
            .iter()
            .find(|p| p.name == name)
            .map_or(0, |p| p.starts)
    }

    /// The process id of `name` while it runs.
    pub(crate) fn pid(&self, name: &str) -> Option<u32> {
        self.procs
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.child.as_ref())
            .map(Child::id)
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        let mut children: Vec<Child> = self
            .procs
            .iter_mut()
            .filter_map(|p| p.child.take())
            .collect();
        process::stop_all(&mut children, Duration::from_secs(5));
    }
}

/// `key=value` of a ready line.
pub(crate) fn field(line: &str, key: &str) -> anyhow::Result<String> {
    process::field(line, key)
        .map(str::to_owned)
        .with_context(|| format!("no {key}= in {line:?}"))
}

/// A node's Status, or `None` while it does not answer.
pub(crate) async fn status(dialer: &Dialer, grpc: &str) -> Option<StatusResponse> {
    let mut c = AdminClient::new(dialer.connect(grpc).await.ok()?);
    Some(c.status(StatusRequest::default()).await.ok()?.into_inner())
}

/// Polls `grpc`'s Status (asked through `dialer`) until `ok` holds, for up to `timeout`.
pub(crate) async fn wait_status(
    dialer: &Dialer,
    grpc: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&StatusResponse) -> bool,
) -> anyhow::Result<StatusResponse> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = status(dialer, grpc).await
            && ok(&s)
        {
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("{grpc}: {what} did not happen within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts a JetStream-enabled `nats-server` on a free loopback port, its store in
/// `dir/nats` (with the configuration `conf`, when given); returns its URL once it accepts
/// connections.
pub(crate) async fn start_nats(
    procs: &mut Procs,
    dir: &Path,
    conf: Option<&str>,
) -> anyhow::Result<String> {
    let nats = process::which("nats-server")
        .context("nats-server is not installed (run scripts/install-deps)")?;
    let port = process::free_port()?;
    let mut args: Vec<String> = vec![
        "-js".into(),
        "-a".into(),
        "127.0.0.1".into(),
        "-p".into(),
        port.to_string(),
        "-sd".into(),
        dir.join("nats").display().to_string(),
    ];
    if let Some(conf) = conf {
        let path = dir.join("nats.conf");
        std::fs::write(&path, conf)?;
        args.extend(["-c".into(), path.display().to_string()]);
    }
    procs.spawn("nats", &nats, &args, None)?;
    process::wait_tcp(port, Duration::from_secs(15)).await?;
    Ok(format!("nats://127.0.0.1:{port}"))
}

/// `n` free loopback addresses for Raft members, and the `[raft] peers` list naming them
/// (ids 1..=n in order).
pub(crate) fn raft_peers(n: usize) -> anyhow::Result<(Vec<String>, String)> {
    let addrs: Vec<String> = (0..n)
        .map(|_| process::free_port().map(|p| format!("127.0.0.1:{p}")))
        .collect::<Result<_, _>>()?;
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{{ id = {}, addr = \"{a}\" }}", i + 1))
        .collect::<Vec<_>>()
        .join(", ");
    Ok((addrs, peers))
}

/// Starts `n` kvplane Raft members on NATS `nats_url` (the first initializes the cluster), each
/// with `extra` in its config (TOML before the `[raft]` section); returns their gRPC URLs and
/// their HTTP (`/metrics`, `/healthz`) addresses.
pub(crate) fn start_members(
    procs: &mut Procs,
    dir: &Path,
    nats_url: &str,
    n: usize,
    extra: &str,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let exe = process::kvplane_binary();
    let (addrs, peers) = raft_peers(n)?;
    let (mut nodes, mut http) = (Vec::new(), Vec::new());
    for (i, addr) in addrs.iter().enumerate() {
        let config = dir.join(format!("kvplane-{i}.toml"));
        std::fs::write(
            &config,
            format!(
                "node_id = \"kvplane-{i}\"\n{extra}\n[raft]\nid = {}\nbootstrap = {}\npeers = [{peers}]\n",
                i + 1,
                i == 0,
            ),
        )?;
        let ready = procs.spawn(
            &format!("kvplane-{i}"),
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
                dir.join(format!("kvplane-{i}")).display().to_string(),
            ],
            Some("kvplane ready"),
        )?;
        nodes.push(format!("http://{}", field(&ready, "grpc")?));
        http.push(format!("http://{}", field(&ready, "http")?));
    }
    Ok((nodes, http))
}

/// The chat-completions URL of a gateway's ready line (`https` when it serves TLS).
fn chat_url(ready: &str, https: bool) -> anyhow::Result<String> {
    let scheme = if https { "https" } else { "http" };
    Ok(format!(
        "{scheme}://{}/v1/chat/completions",
        field(ready, "http")?
    ))
}

/// One kvplane gateway per member, each asking its own member first and the others on
/// failure, with `extra` flags (`https`: they serve TLS); returns their chat-completions URLs.
pub(crate) fn start_gateways(
    procs: &mut Procs,
    nodes: &[String],
    extra: &[String],
    https: bool,
) -> anyhow::Result<Vec<String>> {
    let exe = process::kvplane_binary();
    let mut urls = Vec::new();
    for i in 0..nodes.len() {
        let replicas = (0..nodes.len())
            .map(|k| nodes[(i + k) % nodes.len()].clone())
            .collect::<Vec<_>>()
            .join(",");
        let mut args: Vec<String> = vec![
            "gateway".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--replicas".into(),
            replicas,
        ];
        args.extend_from_slice(extra);
        let ready = procs.spawn(
            &format!("gateway-kvplane-{i}"),
            &exe,
            &args,
            Some("kvplane-gateway ready"),
        )?;
        urls.push(chat_url(&ready, https)?);
    }
    Ok(urls)
}

/// Starts a `kvplane sim engine` named `name` on free loopback ports with `args` added;
/// returns its ready line (`http`, `zmq_pub`, `zmq_replay`).
pub(crate) fn start_sim_engine(
    procs: &mut Procs,
    name: &str,
    args: &[String],
) -> anyhow::Result<String> {
    let mut all: Vec<String> = [
        "sim",
        "engine",
        "--http-listen",
        "127.0.0.1:0",
        "--zmq-pub",
        "tcp://127.0.0.1:0",
        "--zmq-replay",
        "tcp://127.0.0.1:0",
    ]
    .map(str::to_owned)
    .to_vec();
    all.extend_from_slice(args);
    procs.spawn(
        name,
        &process::kvplane_binary(),
        &all,
        Some("kvplane-sim ready"),
    )
}

/// A `kvplane gateway --round-robin` over `engines` (their base URLs), the baseline, with
/// `extra` flags (`https`: it serves TLS); returns its chat-completions URL.
pub(crate) fn start_round_robin(
    procs: &mut Procs,
    engines: &[String],
    extra: &[String],
    https: bool,
) -> anyhow::Result<String> {
    let mut args: Vec<String> = vec![
        "gateway".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--round-robin".into(),
        engines.join(","),
    ];
    args.extend_from_slice(extra);
    let ready = procs.spawn(
        "gateway-round-robin",
        &process::kvplane_binary(),
        &args,
        Some("kvplane-gateway ready"),
    )?;
    chat_url(&ready, https)
}
