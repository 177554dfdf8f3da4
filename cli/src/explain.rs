//! `kvplane explain`: online, a node's Explain; offline (`--state` and/or `--policies`), the
//! same decision computed here, from a state read out of a snapshot file, a node's data
//! directory or a live node (`Admin.ExportState`), with the policies of a directory applied to
//! it the way the cluster would apply them (one `ConfigApply` entry, validated by `apply`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use kvplane_api::{ApiMetrics, CostModel, RouterService};
use kvplane_proto::v1::admin_client::AdminClient;
use kvplane_proto::v1::router_server::Router;
use kvplane_proto::v1::{ExportStateRequest, RouteRequest};
use kvplane_state::StateMachine;
use serde::Deserialize;

use crate::route::{self, RouteArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub route: RouteArgs,
    /// Offline: decide with the policies in these directories (or files) instead of the
    /// state's own.
    #[arg(long)]
    pub policies: Vec<PathBuf>,
    /// Offline: the state to decide from: a snapshot file, a node's data directory, or a
    /// node's gRPC address (`http://...`). Without it, an empty fleet.
    #[arg(long, value_name = "SNAPSHOT_OR_ADDR")]
    pub state: Option<String>,
    /// Offline: also show what this caller (a client certificate's SPIFFE URI or DNS name) may
    /// do as the AccessPolicy objects grant, and whether it may route this request's tenant (a
    /// node's [access] members and admins hold every right besides). Online, Explain shows the
    /// rights of the certificate it is asked with.
    #[arg(long)]
    pub identity: Option<String>,
    /// Offline: decide as a replica in this cluster would (its `[locality] cluster`): what
    /// `filter.sameLocality` compares with, and where round trips start.
    #[arg(long, value_name = "CLUSTER")]
    pub cluster: Option<String>,
    /// Offline: the round trip from `--cluster` to another cluster's engines, in ms
    /// (repeatable), as the replica's `[locality] rtt_ms`.
    #[arg(long = "rtt", value_name = "CLUSTER=MS", value_parser = parse_rtt)]
    pub rtt: Vec<(String, f64)>,
    /// The request as JSON: `{"tenant", "model", "tags", "headers", "body", "token_ids",
    /// "max_output_tokens"}` (`body` is the OpenAI request body). Else the flags above.
    #[arg(value_name = "REQUEST.json")]
    pub request: Option<PathBuf>,
}

/// The request file of `kvplane explain`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RequestFile {
    request_id: String,
    tenant: String,
    model: String,
    tags: Vec<String>,
    headers: BTreeMap<String, String>,
    body: Option<serde_json::Value>,
    token_ids: Vec<u32>,
    max_output_tokens: u32,
}

fn read_request(path: &Path) -> anyhow::Result<RouteRequest> {
    let text = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let f: RequestFile = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a request file", path.display()))?;
    Ok(RouteRequest {
        request_id: f.request_id,
        tenant: f.tenant,
        model: f.model,
        tags: f.tags,
        headers: f.headers.into_iter().collect(),
        body: match f.body {
            Some(b) => serde_json::to_vec(&b)?,
            None => Vec::new(),
        },
        token_ids: f.token_ids,
        max_output_tokens: f.max_output_tokens,
        ..Default::default()
    })
}

pub async fn run(a: ExplainArgs) -> anyhow::Result<()> {
    if a.state.is_none() && a.policies.is_empty() {
        anyhow::ensure!(
            a.request.is_none(),
            "a request file is for offline explain: give --state and/or --policies"
        );
        anyhow::ensure!(
            a.identity.is_none(),
            "--identity is for offline explain (give --state and/or --policies); online, Explain shows the rights of the certificate given with --tls-dir"
        );
        anyhow::ensure!(
            a.cluster.is_none() && a.rtt.is_empty(),
            "--cluster and --rtt are for offline explain (give --state and/or --policies); online, the node's [locality] applies"
        );
        return route::route(a.route, true).await;
    }
    let req = match &a.request {
        Some(path) => read_request(path)?,
        None => route::request(&a.route)?,
    };
    let mut sm = match &a.state {
        Some(s) => load_state(&a.route.tls, s).await?,
        None => StateMachine::new(),
    };
    if !a.policies.is_empty() {
        apply_policies(&mut sm, &a.policies)?;
    }
    let origin = kvplane_policy::Origin {
        cluster: a.cluster.clone(),
        rtt_ms: a.rtt.iter().cloned().collect(),
        ..kvplane_policy::Origin::default()
    };
    let problems = origin.problems("locality");
    anyhow::ensure!(
        problems.is_empty(),
        "{}",
        problems
            .join("; ")
            .replace("locality.cluster", "--cluster")
            .replace("locality.rtt_ms", "--rtt")
    );
    let service = RouterService::new(
        sm.handle(),
        CostModel::default(),
        Arc::new(ApiMetrics::default()),
    )
    .with_origin(origin);
    let mut request = tonic::Request::new(req);
    if let Some(id) = &a.identity {
        let grants = sm.handle().load().catalog.grants(id);
        request
            .extensions_mut()
            .insert(kvplane_api::Caller::Granted {
                identity: id.clone(),
                grants,
            });
    }
    let x = service
        .explain(request)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    route::print_explain(&x, a.route.json)
}

/// `CLUSTER=MS`.
fn parse_rtt(s: &str) -> Result<(String, f64), String> {
    let (c, ms) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not CLUSTER=MS"))?;
    let ms: f64 = ms
        .parse()
        .map_err(|_| format!("{ms:?} in {s:?} is not a number of milliseconds"))?;
    Ok((c.to_owned(), ms))
}

/// Replaces the state's policy catalog with the one in `paths`, through `apply`.
fn apply_policies(sm: &mut StateMachine, paths: &[PathBuf]) -> anyhow::Result<()> {
    let (desired, problems) = kvplane_policy::Documents::read(paths)?.check();
    for p in &problems {
        eprintln!("{p}");
    }
    anyhow::ensure!(
        problems.is_empty(),
        "the policies have {} problem(s)",
        problems.len()
    );
    // What if these were all the policies: whoever owns what is beside the point here.
    let current = sm.handle().load().catalog.clone();
    let Some((command, _, _)) = kvplane_state::Command::config_change(&current, &desired, None)
    else {
        return Ok(());
    };
    // As a leader would propose it, stamped with this clock.
    let p = kvplane_raft::Proposal::now(command);
    let at = kvplane_state::Stamp {
        index: sm.applied_index() + 1,
        timestamp_ms: p.timestamp_ms,
    };
    let applied = sm.apply_command(at, &p.command)?;
    if let Some(e) = applied.rejected {
        anyhow::bail!("these policies do not fit the state: {e}");
    }
    Ok(())
}

/// The state behind `--state`.
async fn load_state(tls: &crate::dial::TlsArgs, s: &str) -> anyhow::Result<StateMachine> {
    if s.starts_with("http://") || s.starts_with("https://") {
        return fetch_state(tls, s).await;
    }
    let path = Path::new(s);
    if path.is_dir() {
        let raft = path
            .join(kvplane_raft::STATE_DIR)
            .join(kvplane_raft::SNAPSHOT_FILE);
        if raft.exists() {
            return kvplane_raft::read_snapshot_file(&raft)
                .with_context(|| format!("cannot read {}", raft.display()));
        }
        anyhow::bail!(
            "{} is not a kvplane data directory or holds no snapshot yet (no {})",
            path.display(),
            raft.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    match StateMachine::restore(&bytes) {
        Ok(sm) => Ok(sm),
        // Not a bare state snapshot: a Raft snapshot file (openraft's metadata around one).
        Err(kvplane_state::SnapshotError::BadMagic) => kvplane_raft::read_snapshot_file(path)
            .with_context(|| format!("{} is not a kvplane snapshot", path.display())),
        Err(e) => Err(e).with_context(|| format!("cannot restore {}", path.display())),
    }
}

async fn fetch_state(tls: &crate::dial::TlsArgs, addr: &str) -> anyhow::Result<StateMachine> {
    let mut client = AdminClient::new(tls.connect(addr).await?).max_decoding_message_size(64 << 20);
    let mut stream = client
        .export_state(ExportStateRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{addr} did not export its state: {}", s.message()))?
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await? {
        bytes.extend_from_slice(&chunk.data);
    }
    StateMachine::restore(&bytes).with_context(|| format!("the state {addr} sent is not valid"))
}
