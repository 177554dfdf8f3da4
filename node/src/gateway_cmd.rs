//! `kvplane gateway`: the OpenAI-compatible front.

use kvplane_gateway::{GatewayConfig, Strategy, run};

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
    /// Skip kvplane and cycle over these engine URLs (a baseline).
    #[arg(long, value_delimiter = ',')]
    pub round_robin: Option<Vec<String>>,
    /// The header that carries the tenant.
    #[arg(long, default_value = "x-tenant")]
    pub tenant_header: String,
}

pub async fn gateway(
    a: GatewayArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let strategy = match a.round_robin {
        Some(engines) => Strategy::RoundRobin { engines },
        None => Strategy::Kvplane {
            replicas: a.replicas,
        },
    };
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
    println!("kvplane-gateway ready http={}", listener.local_addr()?);
    run(
        GatewayConfig {
            strategy,
            tenant_header: a.tenant_header,
        },
        listener,
        shutdown,
    )
    .await?;
    Ok(())
}
