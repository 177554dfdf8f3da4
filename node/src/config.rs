//! Node configuration: a TOML file, overridden by `KVPLANE_*` environment variables and flags,
//! validated once at start with every problem reported together.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvplane_api::CostModel;
use kvplane_state::valid_name;
use serde::Deserialize;

pub use kvplane_raft::{KubernetesSection, Membership, PeerSection, RaftSection};

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
    Invalid(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// `KVPLANE_LOG_FORMAT` (`json` or `text`), for the subcommands without a config file
    /// (bridge, gateway, simulated engine); text otherwise.
    pub fn from_env() -> Self {
        match std::env::var("KVPLANE_LOG_FORMAT").as_deref() {
            Ok("json") => Self::Json,
            _ => Self::Text,
        }
    }
}

/// Everything `kvplane serve` needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's name, unique in the cluster; never reused for a wiped node.
    pub node_id: String,
    /// Where the Raft log (`raft/log.redb`), the state snapshot (`raft/state/snapshot.bin`) and
    /// the member's id file live; locked by the process that serves it.
    pub data_dir: PathBuf,
    /// gRPC API address (`Router`, `Admin`, health, reflection). Port 0 picks a free port.
    pub grpc_listen: String,
    /// HTTP address for `/metrics`, `/healthz` and `/readyz`. Port 0 picks a free port.
    pub http_listen: String,
    /// The HTTP port's bounds, and whether it stays plaintext beside a `[tls]` gRPC port.
    pub http: kvplane_tls::HttpSection,
    pub nats_url: String,
    /// Credentials and TLS for NATS (absent: anonymous, plaintext).
    pub nats: kvplane_ingest::NatsAuth,
    pub log_format: LogFormat,
    pub ingest: IngestSection,
    pub cost: CostModel,
    /// The pools this node declares in the state at start. Not given: one pool `default`
    /// (block size 16, every model), unless a policy source declares the fleet (see
    /// [`Config::declared_pools`]).
    pub pools: Option<Vec<PoolSection>>,
    /// Policy objects (YAML, see `kvplane validate`) that the leader keeps the replicated state
    /// in line with: a valid change of the directory is applied as one entry.
    pub policy_dir: Option<PathBuf>,
    /// How often the leader rereads `policy_dir`.
    pub policy_poll_ms: u64,

    /// Admission against tenant limits.
    pub quota: QuotaSection,
    /// Policy objects as custom resources of the Kubernetes cluster the node runs in.
    pub policy_kubernetes: Option<crate::sources::kubernetes::KubeSourceSection>,
    /// Engines found as pods of the Kubernetes cluster the node runs in (worker sets with a
    /// `selector` or an `inferencePoolRef`).
    pub kubernetes_engines: Option<crate::sources::kube_engines::KubeEnginesSection>,
    /// Health checks of the engines worker sets list at fixed addresses.
    pub endpoint_health: crate::sources::static_health::EndpointHealthSection,
    /// Replication. Absent (or with no peers, join addresses or kubernetes): a one-member
    /// cluster of its own.
    pub raft: RaftSection,
    /// Models' own tokenizers (Hugging Face files on local disk), for nodes without policies;
    /// with policies, an InferenceWorkerSet's `tokenizer` names the directory.
    pub tokenizers: Vec<TokenizerSection>,
    /// The Envoy endpoint picker (ext_proc) on the gRPC port.
    pub picker: kvplane_api::PickerConfig,
    /// TLS on the gRPC port and for every call to the other members, with this node's
    /// certificate; callers are then named by their client certificates and hold only the
    /// rights granted to them. Absent: plaintext, and every caller may do everything.
    pub tls: Option<kvplane_tls::TlsSection>,
    /// Who holds every right whatever the replicated `AccessPolicy` objects say (with `[tls]`).
    pub access: AccessSection,
    /// Bounds on what a caller may send (message, body and name sizes, tags, headers, call
    /// time, requests remembered in flight); each hit counted in `kvplane_limit_hits_total`.
    pub limits: kvplane_api::Limits,
    /// Where this replica and the gateways that ask it are (`cluster`, `region`, `zone`), and
    /// the round trip from here to other clusters' engines (`rtt_ms = { a = 40 }`,
    /// `default_rtt_ms`): a candidate in another cluster (its worker set's `kvplane.io/cluster`
    /// label) adds that round trip to its predicted TTFT, and `filter.sameLocality` keeps a
    /// rule's candidates here.
    pub locality: kvplane_policy::Origin,
}

/// `[access]`: identities (a client certificate's URI name, else its DNS name; a trailing `*`
/// matches any rest) trusted by this node's own configuration.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AccessSection {
    /// The cluster's members: the only callers of Raft RPCs, and holders of every right.
    /// Empty: the identity of this node's own certificate (members share one in a StatefulSet).
    pub members: Vec<String>,
    /// Operators holding every right but Raft's: who writes the first `AccessPolicy`.
    pub admins: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSection {
    /// The model name requests use.
    pub model: String,
    /// The directory with `tokenizer.json` and `tokenizer_config.json`.
    pub dir: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestSection {
    pub stream: String,
    pub max_batch_messages: usize,
    pub max_batch_delay_ms: u64,
    pub max_message_bytes: usize,
    /// How often a consumer that delivers nothing reads its stream's end: found behind it at
    /// two checks in a row, it is started again from the applied position (a delivery lost in
    /// a reconnect is read again).
    pub stall_after_ms: u64,
    /// A worker not heard from (any stream message of its) for this long is taken down by
    /// the leader; 0: never. Must exceed the bridges' scrape interval.
    pub worker_lease_ms: u64,
    /// The leader is not ready while its consumer is more than this many messages behind the
    /// stream; 0: no bound.
    pub ready_max_pending_messages: u64,
    /// Other clusters' streams (`[[ingest.clusters]]`), each consumed as an ingest source of
    /// its own beside this one.
    pub clusters: Vec<ClusterSource>,
}

/// Another cluster's ingest stream: its engines' bridges publish to that cluster's NATS, and
/// the leader consumes the stream there from the position the state keeps under `name`, so a
/// cut link delays that cluster's events (the stream keeps them) and no other's.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSource {
    /// The source's name in the state, its position's key: letters, digits, - or _.
    pub name: String,
    pub nats_url: String,
    /// The stream there (default `KVPLANE`).
    #[serde(default = "default_stream")]
    pub stream: String,
    /// Credentials and TLS for that NATS (absent: anonymous, plaintext).
    #[serde(default)]
    pub nats: kvplane_ingest::NatsAuth,
}

fn default_stream() -> String {
    "KVPLANE".into()
}

/// Whether `name` may name a stream or a source: letters, digits, - or _.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Why `url` is not a NATS URL, if it is not.
fn nats_url_problem(key: &str, url: &str) -> Option<String> {
    (!["nats://", "tls://", "ws://", "wss://"]
        .iter()
        .any(|s| url.starts_with(s)))
    .then(|| format!("{key} {url:?} must start with nats://, tls://, ws:// or wss://"))
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    pub name: String,
    pub block_size: u32,
    #[serde(default)]
    pub models: Vec<String>,
    /// LoRA adapters its engines load (vLLM `--lora-modules` names).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

impl Config {
    /// The `[[tokenizers]]` as (model, directory) pairs.
    pub fn tokenizer_dirs(&self) -> Vec<(String, PathBuf)> {
        self.tokenizers
            .iter()
            .map(|t| (t.model.clone(), t.dir.clone()))
            .collect()
    }

    /// The pools declared at start: those of the config, else `default` (block size 16,
    /// serving every model) when no policy source is set. With a policy source the worker
    /// sets are the fleet: a catch-all pool beside them would serve every model nobody
    /// publishes.
    pub fn declared_pools(&self) -> Vec<PoolSection> {
        match &self.pools {
            Some(p) => p.clone(),
            None if self.policy_dir.is_some() || self.policy_kubernetes.is_some() => Vec::new(),
            None => vec![PoolSection {
                name: "default".into(),
                block_size: 16,
                models: Vec::new(),
                lora_adapters: Vec::new(),
            }],
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node_id: "kvplane-0".into(),
            data_dir: PathBuf::from("./kvplane-data"),
            grpc_listen: "127.0.0.1:7070".into(),
            http_listen: "127.0.0.1:7071".into(),
            http: kvplane_tls::HttpSection::default(),
            nats_url: "nats://127.0.0.1:4222".into(),
            nats: kvplane_ingest::NatsAuth::default(),
            log_format: LogFormat::Text,
            ingest: IngestSection::default(),
            cost: CostModel::default(),
            pools: None,
            raft: RaftSection::default(),
            tokenizers: Vec::new(),
            picker: kvplane_api::PickerConfig::default(),
            policy_dir: None,
            policy_poll_ms: 1000,

            policy_kubernetes: None,
            kubernetes_engines: None,
            endpoint_health: Default::default(),
            quota: QuotaSection::default(),
            tls: None,
            access: AccessSection::default(),
            limits: kvplane_api::Limits::default(),
            locality: kvplane_policy::Origin::default(),
        }
    }
}

/// `[quota]`: how this replica admits against its escrow of tenant limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaSection {
    /// How long a request may wait for a grant when this replica's escrow is empty.
    pub grant_wait_ms: u64,
    /// Escrow of a tenant unused this long is released to the other replicas.
    pub idle_release_ms: u64,
    /// Output tokens reserved when a request names no maximum.
    pub default_max_output_tokens: u32,
}

impl Default for QuotaSection {
    fn default() -> Self {
        Self {
            grant_wait_ms: 250,
            idle_release_ms: 2000,
            default_max_output_tokens: 256,
        }
    }
}

impl Default for IngestSection {
    fn default() -> Self {
        Self {
            stream: "KVPLANE".into(),
            max_batch_messages: 512,
            max_batch_delay_ms: 5,
            max_message_bytes: 1 << 20,
            stall_after_ms: 2_000,
            worker_lease_ms: 30_000,
            ready_max_pending_messages: 100_000,
            clusters: Vec::new(),
        }
    }
}

/// Values given on the command line or in `KVPLANE_*` variables; they win over the file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// TOML config file.
    #[arg(long, short = 'c', env = "KVPLANE_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(long, env = "KVPLANE_NODE_ID")]
    pub node_id: Option<String>,
    #[arg(long, env = "KVPLANE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    #[arg(long, env = "KVPLANE_GRPC_LISTEN")]
    pub grpc_listen: Option<String>,
    #[arg(long, env = "KVPLANE_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    #[arg(long, env = "KVPLANE_NATS_URL")]
    pub nats_url: Option<String>,
    #[arg(long, env = "KVPLANE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
}

impl Config {
    /// The file (if any), then the overrides, then validation.
    pub fn load(o: &Overrides) -> Result<Self, ConfigError> {
        let mut cfg = match &o.config {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        if let Some(v) = &o.node_id {
            cfg.node_id.clone_from(v);
        }
        if let Some(v) = &o.data_dir {
            cfg.data_dir.clone_from(v);
        }
        if let Some(v) = &o.grpc_listen {
            cfg.grpc_listen.clone_from(v);
        }
        if let Some(v) = &o.http_listen {
            cfg.http_listen.clone_from(v);
        }
        if let Some(v) = &o.nats_url {
            cfg.nats_url.clone_from(v);
        }
        if let Some(v) = o.log_format {
            cfg.log_format = v;
        }
        let problems = cfg.problems();
        if problems.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Every problem with this configuration.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if !valid_name(&self.node_id) {
            p.push(format!(
                "node_id {:?} must be 1-63 characters of [a-z0-9-_]",
                self.node_id
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            p.push("data_dir must not be empty".into());
        }
        for (name, v) in [
            ("grpc_listen", &self.grpc_listen),
            ("http_listen", &self.http_listen),
        ] {
            if v.parse::<SocketAddr>().is_err() {
                p.push(format!("{name} {v:?} is not an ip:port address"));
            }
        }
        p.extend(nats_url_problem("nats_url", &self.nats_url));
        p.extend(self.locality.problems("locality"));
        if !plain_name(&self.ingest.stream) {
            p.push(format!(
                "ingest.stream {:?} must be letters, digits, - or _",
                self.ingest.stream
            ));
        }
        let mut names = std::collections::BTreeMap::new();
        for (i, c) in self.ingest.clusters.iter().enumerate() {
            let key = |k: &str| format!("ingest.clusters[{i}].{k}");
            if !plain_name(&c.name) {
                p.push(format!(
                    "{} {:?} must be letters, digits, - or _",
                    key("name"),
                    c.name
                ));
            } else if c.name == "local" {
                p.push(format!(
                    "{} \"local\" names the node's own stream in metrics: choose another",
                    key("name")
                ));
            } else if let Some(j) = names.insert(c.name.as_str(), i) {
                p.push(format!(
                    "{} {:?} is also ingest.clusters[{j}].name",
                    key("name"),
                    c.name
                ));
            }
            p.extend(nats_url_problem(&key("nats_url"), &c.nats_url));
            if !plain_name(&c.stream) {
                p.push(format!(
                    "{} {:?} must be letters, digits, - or _",
                    key("stream"),
                    c.stream
                ));
            }
            p.extend(
                c.nats
                    .problems(|k| format!("ingest.clusters[{i}].nats.{k}")),
            );
        }
        if self.ingest.max_batch_messages == 0 {
            p.push("ingest.max_batch_messages must be at least 1".into());
        }
        if self.ingest.stall_after_ms < 100 {
            p.push("ingest.stall_after_ms must be at least 100".into());
        }
        if self.ingest.max_message_bytes < 1024 {
            p.push("ingest.max_message_bytes must be at least 1024".into());
        }
        for (name, list) in [
            ("access.members", &self.access.members),
            ("access.admins", &self.access.admins),
        ] {
            for (i, id) in list.iter().enumerate() {
                if let Some(problem) = kvplane_policy::access::pattern_problem(id) {
                    p.push(format!("{name}[{i}] {id:?} {problem}"));
                }
            }
        }
        if self.tls.is_none() && !(self.access.members.is_empty() && self.access.admins.is_empty())
        {
            p.push(
                "access names identities but there is no [tls] section to tell callers apart"
                    .into(),
            );
        }
        if let Some(t) = &self.tls
            && t.reload_ms == 0
        {
            p.push("tls.reload_ms must be at least 1".into());
        }
        p.extend(self.nats.problems(|key| format!("nats.{key}")));
        p.extend(self.cost.problems());
        p.extend(self.picker.problems());
        p.extend(self.endpoint_health.problems());
        p.extend(self.limits.problems());
        p.extend(self.http.problems(|k| format!("http.{k}")));
        if self.policy_poll_ms == 0 {
            p.push("policy_poll_ms must be at least 1".into());
        }
        if self.quota.grant_wait_ms == 0 {
            p.push("quota.grant_wait_ms must be at least 1".into());
        }
        if self.quota.idle_release_ms == 0 {
            p.push("quota.idle_release_ms must be at least 1".into());
        }
        if self.policy_dir.is_some() && self.policy_kubernetes.is_some() {
            p.push(
                "policy_dir and policy_kubernetes are two sources of the same objects: set one"
                    .into(),
            );
        }
        if let Some(k) = &self.kubernetes_engines {
            if k.resync_ms == 0 {
                p.push("kubernetes_engines.resync_ms must be at least 1".into());
            }
            if k.namespace.as_deref() == Some("") {
                p.push("kubernetes_engines.namespace must not be empty".into());
            }
        }
        if let Some(k) = &self.policy_kubernetes {
            if k.resync_ms == 0 {
                p.push("policy_kubernetes.resync_ms must be at least 1".into());
            }
            if k.namespace.as_deref() == Some("") {
                p.push("policy_kubernetes.namespace must not be empty".into());
            }
        }
        let mut models = std::collections::BTreeSet::new();
        for (i, t) in self.tokenizers.iter().enumerate() {
            if !models.insert(&t.model) {
                p.push(format!(
                    "tokenizers[{i}]: model {:?} is listed twice",
                    t.model
                ));
            }
            if let Err(e) = kvplane_tokenize::ModelTokenizer::load(&t.dir) {
                p.push(format!("tokenizers[{i}] (model {:?}): {e}", t.model));
            }
        }
        self.raft.problems(&self.grpc_listen, &mut p);
        let mut seen = std::collections::BTreeSet::new();
        for (i, pool) in self.declared_pools().iter().enumerate() {
            if !valid_name(&pool.name) {
                p.push(format!(
                    "pools[{i}].name {:?} must be 1-63 characters of [a-z0-9-_]",
                    pool.name
                ));
            }
            if !seen.insert(pool.name.as_str()) {
                p.push(format!("pools[{i}].name {:?} is declared twice", pool.name));
            }
            if pool.block_size == 0 || pool.block_size > kvplane_state::PoolConfig::MAX_BLOCK_SIZE {
                p.push(format!(
                    "pools[{i}].block_size must be in 1..={}",
                    kvplane_state::PoolConfig::MAX_BLOCK_SIZE
                ));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert!(Config::default().problems().is_empty());
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let cfg: Config = toml::from_str(
            r#"
            node_id = "Bad Id"
            grpc_listen = "nowhere"
            nats_url = "http://x"
            [ingest]
            max_batch_messages = 0
            stall_after_ms = 0
            [[pools]]
            name = "a"
            block_size = 0
            [[pools]]
            name = "a"
            block_size = 16
            "#,
        )
        .unwrap();
        let p = cfg.problems();
        assert_eq!(p.len(), 7, "{p:#?}");
        assert!(p.iter().any(|m| m.contains("stall_after_ms")), "{p:#?}");
    }

    #[test]
    fn other_clusters_streams_are_named_once_and_reachable() {
        let cfg: Config = toml::from_str(
            r#"
            nats_url = "nats://127.0.0.1:4222"
            [[ingest.clusters]]
            name = "cluster-b"
            nats_url = "nats://b:4222"
            [[ingest.clusters]]
            name = "cluster-b"
            nats_url = "http://c:4222"
            stream = "has space"
            [ingest.clusters.nats]
            user = "kvplane"
            [[ingest.clusters]]
            name = "local"
            nats_url = "nats://l:4222"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.ingest.clusters[0].stream, "KVPLANE");
        assert_eq!(
            cfg.problems(),
            [
                r#"ingest.clusters[1].name "cluster-b" is also ingest.clusters[0].name"#,
                r#"ingest.clusters[1].nats_url "http://c:4222" must start with nats://, tls://, ws:// or wss://"#,
                r#"ingest.clusters[1].stream "has space" must be letters, digits, - or _"#,
                "ingest.clusters[1].nats.user and ingest.clusters[1].nats.password_file go together",
                r#"ingest.clusters[2].name "local" names the node's own stream in metrics: choose another"#,
            ]
        );
    }

    #[test]
    fn a_replicas_locality_is_read_and_its_problems_reported() {
        let cfg: Config = toml::from_str(
            r#"
            [locality]
            cluster = "b"
            region = "eu-west"
            rtt_ms = { c = 40, b = 1 }
            default_rtt_ms = -1
            measure_rtt = true
            "#,
        )
        .unwrap();
        assert_eq!(cfg.locality.cluster.as_deref(), Some("b"));
        assert!(cfg.locality.measure_rtt);
        assert_eq!(cfg.locality.rtt_ms.get("c"), Some(&40.0));
        assert_eq!(
            cfg.problems(),
            [
                "locality.rtt_ms names b, this replica's own cluster (always 0)",
                "locality.default_rtt_ms must be a finite number >= 0, not -1",
            ]
        );
        let err = toml::from_str::<Config>(
            "[locality]
cluster_name = \"b\"",
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = toml::from_str::<Config>("node_idd = \"x\"").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}
