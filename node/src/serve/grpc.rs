//! The gRPC port: Router, the Envoy endpoint picker, Admin, the member's Raft service, health
//! and reflection, on one listener.

use std::sync::Arc;

use kvplane_api::picker::ExternalProcessorServer;
use kvplane_api::{
    Access, AccessLayer, AdminService, ClusterControl, Consistency, EndpointPicker, Escrow,
    IngestStatus, LimitsLayer, NodeInfo, RouterService, Tokenizers, predict::Predictor,
};
use kvplane_proto::v1::admin_server::AdminServer;
use kvplane_proto::v1::router_server::RouterServer;
use kvplane_raft::RaftMember;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::metrics::NodeMetrics;
use super::ready::Ready;
use crate::config::Config;
use kvplane_api::predict::RoutedSink;
use tonic_health::ServingStatus;

/// What the routing services share with the node's other components.
pub(super) struct Shared {
    pub tokenizers: Arc<Tokenizers>,
    pub predictor: Arc<Predictor>,
    pub escrow: Arc<Escrow>,
    pub routed: RoutedSink,
    /// Round trips measured from reports (`[locality] measure_rtt`).
    pub rtt: Option<Arc<kvplane_api::rtt::RttMeter>>,
}

/// The routing services of this member.
pub(super) struct Services {
    pub router: RouterService,
    pub picker: EndpointPicker,
    pub admin: AdminService,
    pub access: Access,
    pub limits: LimitsLayer,
    pub grpc: kvplane_api::Limits,
}

/// Router, the picker and Admin of this member.
pub(super) fn services(
    cfg: &Config,
    member: &Arc<RaftMember>,
    metrics: &NodeMetrics,
    shared: Shared,
    access: Access,
) -> Services {
    let consistency: Arc<dyn Consistency> = member.clone();
    let mut router = RouterService::new(member.handle.clone(), cfg.cost, metrics.api.clone())
        .with_tokenizers(shared.tokenizers)
        .with_consistency(consistency.clone())
        .with_quota(shared.escrow.clone())
        .with_predictor(shared.predictor)
        .with_routed_sink(shared.routed)
        .with_cluster(member.clone() as Arc<dyn ClusterControl>)
        .with_access(access.clone())
        .with_limits(cfg.limits)
        .with_origin(cfg.locality.clone());
    if let Some(meter) = shared.rtt {
        router = router.with_rtt_meter(meter);
    }
    let node_info = NodeInfo {
        node_id: cfg.node_id.clone(),
        role: {
            let m = member.clone();
            Arc::new(move || m.role())
        },
        cluster: Some(member.clone() as Arc<dyn ClusterControl>),
        consistency,
        ingest: {
            let m = metrics.ingest.clone();
            Arc::new(move || IngestStatus {
                stream_last_sequence: m.stream_end(),
                rejected: m.rejected(),
            })
        },
    };
    let admin = AdminService::new(member.handle.clone(), node_info)
        .with_quota(shared.escrow)
        .with_limits(cfg.limits, metrics.api.clone());
    Services {
        picker: EndpointPicker::new(router.clone(), cfg.picker),
        router,
        admin,
        access,
        limits: LimitsLayer::new(&cfg.limits, metrics.api.clone()),
        grpc: cfg.limits,
    }
}

/// Serves `listener` (TLS with `tls`) until `stop`.
pub(super) async fn serve(
    listener: TcpListener,
    tls: Option<kvplane_tls::Tls>,
    services: Services,
    member: Arc<RaftMember>,
    ready: Ready,
    mut stop: watch::Receiver<bool>,
) {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<RouterServer<RouterService>>()
        .await;
    health_reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    health_reporter
        .set_serving::<AdminServer<AdminService>>()
        .await;
    let follow = tokio::spawn(follow_readiness(health_reporter, ready, stop.clone()));
    // Server reflection in both protocol versions: grpcurl and the official Python client
    // (grpcio-reflection) still ask v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvplane_proto::FILE_DESCRIPTOR_SET)
    };
    let (v1, v1alpha) = match (reflection().build_v1(), reflection().build_v1alpha()) {
        (Ok(a), Ok(b)) => (Some(a), Some(b)),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "grpc reflection unavailable");
            (None, None)
        }
    };
    let max = services.grpc.grpc_message_bytes;
    let served = tonic::transport::Server::builder()
        .max_concurrent_streams(services.grpc.grpc_streams_per_connection)
        .http2_max_header_list_size(services.grpc.grpc_header_bytes)
        .layer(crate::telemetry::GrpcTraceLayer)
        .layer(services.limits)
        .layer(AccessLayer(services.access))
        .add_service(RouterServer::new(services.router).max_decoding_message_size(max))
        .add_service(services.picker.server())
        .add_service(AdminServer::new(services.admin).max_decoding_message_size(max))
        .add_service(health)
        .add_optional_service(v1)
        .add_optional_service(v1alpha)
        .add_service(member.grpc_service())
        // Accepted connections without Nagle: answers (AppendEntries acks, Route decisions) are
        // small writes, and Nagle holds one back until the peer's delayed ACK, about 40 ms.
        .serve_with_incoming_shutdown(kvplane_tls::incoming(listener, tls), async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    follow.abort();
    if let Err(e) = served {
        tracing::warn!(error = %e, "grpc server ended with an error");
    }
}

/// The health names a proxy's checks ask for, as the endpoint picker protocol names them:
/// `readiness`, `""` and the picker's own service follow the node's readiness (`/readyz`),
/// checked every second; `liveness` is serving while the process serves.
async fn follow_readiness(
    reporter: tonic_health::server::HealthReporter,
    ready: Ready,
    mut stop: watch::Receiver<bool>,
) {
    let picker = <ExternalProcessorServer<EndpointPicker> as tonic::server::NamedService>::NAME;
    let mut last = None;
    loop {
        let now = ready().is_ok();
        if last != Some(now) {
            let status = if now {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for name in ["readiness", "", picker] {
                reporter.set_service_status(name, status).await;
            }
            last = Some(now);
        }
        tokio::select! {
            () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
