//! `kvplane gateway`: the OpenAI-compatible front.

use anyhow::Context;
use kvplane_gateway::{GatewayConfig, Secrets, Strategy, run};

#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// HTTP address. Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub listen: String,
    /// kvplane replicas' gRPC URLs, in failover order.
    #[arg(
        long,
        value_delimiter = ',',
        env = "KVPLANE_REPLICAS",
        default_value = "http://127.0.0.1:7070"
    )]
    pub replicas: Vec<String>,
    #[command(flatten)]
    pub tls: kvplane_cli::dial::TlsArgs,
    /// Skip kvplane and cycle over these engine URLs (a baseline).
    #[arg(long, value_delimiter = ',')]
    pub round_robin: Option<Vec<String>>,
    /// The header that carries the tenant.
    #[arg(long, default_value = "x-tenant")]
    pub tenant_header: String,
    /// The cluster this gateway runs in (a worker set's `kvplane.io/cluster`). Sent with every
    /// Route: a replica of another cluster decides as from here (its round trips, and
    /// `filter.sameLocality`). Without it, the replica's own `[locality]` stands for it.
    #[arg(long, env = "KVPLANE_GATEWAY_CLUSTER")]
    pub cluster: Option<String>,
    /// The region this gateway runs in (`topology.kubernetes.io/region`).
    #[arg(long, env = "KVPLANE_GATEWAY_REGION")]
    pub region: Option<String>,
    /// The zone this gateway runs in (`topology.kubernetes.io/zone`).
    #[arg(long, env = "KVPLANE_GATEWAY_ZONE")]
    pub zone: Option<String>,
    /// Providers' credentials: `<dir>/<secret name>/<key>` (a Kubernetes Secret mounted per
    /// name), else `$KVPLANE_SECRET_<NAME>_<KEY>`.
    #[arg(
        long,
        env = "KVPLANE_SECRETS_DIR",
        default_value = "/etc/kvplane/secrets"
    )]
    pub secrets_dir: std::path::PathBuf,
    /// More certificate authorities (a PEM bundle) to trust for providers' HTTPS, besides the
    /// web's roots.
    #[arg(long, env = "KVPLANE_PROVIDER_CA_FILE")]
    pub provider_ca_file: Option<std::path::PathBuf>,
    /// After SIGTERM, how long requests in flight may take to finish (new ones are refused).
    #[arg(long, default_value_t = 30)]
    pub drain_seconds: u64,
    /// How long an engine or provider may take to answer a request's headers (a request that
    /// is not streamed gets them at its end).
    #[arg(long, default_value_t = 600)]
    pub upstream_timeout_seconds: u64,
    /// Serve clients over TLS with the certificate in this directory (`tls.crt`, `tls.key`,
    /// `ca.crt`: a cert-manager secret's layout; read again when renewed). Without it:
    /// plaintext.
    #[arg(long, env = "KVPLANE_LISTEN_TLS_DIR", value_name = "DIR")]
    pub listen_tls_dir: Option<std::path::PathBuf>,
    /// The largest request body taken; larger: 413.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's body; longer: 408.
    #[arg(long, default_value_t = 30_000)]
    pub body_read_ms: u64,
    /// Bytes of a request's start line and headers; more: 431 and the connection closed.
    #[arg(long, default_value_t = kvplane_tls::HttpSection::default().header_bytes)]
    pub max_header_bytes: usize,
    /// Headers of one request; more: 431 and the connection closed.
    #[arg(long, default_value_t = kvplane_tls::HttpSection::default().headers)]
    pub max_headers: usize,
    /// A client that has not sent a request's head this long after it began is dropped.
    #[arg(long, default_value_t = kvplane_tls::HttpSection::default().header_read_ms)]
    pub header_read_ms: u64,
}

pub async fn gateway(
    a: GatewayArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // The certificate it presents to kvplane, read again when cert-manager renews it.
    let tls = a.tls.load()?;
    let _renewals = tls.as_ref().map(kvplane_tls::Tls::watch);
    let strategy = match a.round_robin {
        Some(engines) => Strategy::RoundRobin { engines },
        None => Strategy::Kvplane {
            replicas: a.replicas,
            dialer: kvplane_tls::Dialer::new(tls),
        },
    };
    let ca_pem = match &a.provider_ca_file {
        Some(p) => Some(
            std::fs::read(p)
                .with_context(|| format!("cannot read --provider-ca-file {}", p.display()))?,
        ),
        None => None,
    };
    let http = kvplane_tls::HttpSection {
        plaintext: false,
        header_bytes: a.max_header_bytes,
        headers: a.max_headers,
        header_read_ms: a.header_read_ms,
    };
    let mut problems = http.problems(|k| match k {
        "header_bytes" => "--max-header-bytes".into(),
        "headers" => "--max-headers".into(),
        _ => "--header-read-ms".into(),
    });
    for (flag, v) in [
        ("--cluster", &a.cluster),
        ("--region", &a.region),
        ("--zone", &a.zone),
    ] {
        if v.as_deref().is_some_and(str::is_empty) {
            problems.push(format!("{flag} must not be empty"));
        }
    }
    if a.max_body_bytes == 0 {
        problems.push("--max-body-bytes must be at least 1".into());
    }
    if a.body_read_ms == 0 {
        problems.push("--body-read-ms must be at least 1".into());
    }
    if !problems.is_empty() {
        anyhow::bail!("invalid arguments:\n  - {}", problems.join("\n  - "));
    }
    let listen_tls = match &a.listen_tls_dir {
        Some(dir) => Some(
            kvplane_tls::Tls::load(
                &kvplane_tls::TlsSection::in_dir(dir),
                kvplane_tls::TlsMetrics::default(),
            )
            .with_context(|| format!("cannot use the TLS files in {}", dir.display()))?,
        ),
        None => None,
    };
    let _listen_renewals = listen_tls.as_ref().map(kvplane_tls::Tls::watch);
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    println!("kvplane-gateway ready http={}", listener.local_addr()?);
    run(
        GatewayConfig {
            strategy,
            tenant_header: a.tenant_header,
            origin: (a.cluster.is_some() || a.region.is_some() || a.zone.is_some()).then(|| {
                kvplane_proto::v1::Place {
                    cluster: a.cluster.clone().unwrap_or_default(),
                    region: a.region.clone().unwrap_or_default(),
                    zone: a.zone.clone().unwrap_or_default(),
                }
            }),
            secrets: Secrets {
                dir: Some(a.secrets_dir),
            },
            ca_pem,
            drain: std::time::Duration::from_secs(a.drain_seconds),
            headers_timeout: std::time::Duration::from_secs(a.upstream_timeout_seconds),
            listen_tls,
            http,
            max_body_bytes: a.max_body_bytes,
            body_read: std::time::Duration::from_millis(a.body_read_ms),
            collectors: vec![crate::process_metrics::ProcessCollector::boxed],
        },
        listener,
        shutdown,
    )
    .await?;
    Ok(())
}
