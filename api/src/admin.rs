//! The `kvplane.v1.Admin` gRPC service.

use std::sync::Arc;

use kvplane_proto::v1::{self as pb, IngestPosition, StatusRequest, StatusResponse, WorkerStatus};
use kvplane_state::StateHandle;
use tonic::{Request, Response, Status};

/// What this node's ingest reports (it lives outside the replicated state).
#[derive(Debug, Clone, Default)]
pub struct IngestStatus {
    /// Last stream sequence as the consumer last saw it (0 when unknown).
    pub stream_last_sequence: u64,
    /// Messages rejected before the log, by reason.
    pub rejected: Vec<(&'static str, u64)>,
}

type Source<T> = Arc<dyn Fn() -> T + Send + Sync>;

/// Node-level facts the Admin service reports next to the state.
#[derive(Clone)]
pub struct NodeInfo {
    pub node_id: String,
    pub role: Source<String>,
    pub ingest: Source<IngestStatus>,
}

impl std::fmt::Debug for NodeInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeInfo")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub struct AdminService {
    state: StateHandle,
    node: NodeInfo,
}

impl AdminService {
    pub fn new(state: StateHandle, node: NodeInfo) -> Self {
        Self { state, node }
    }

    pub fn status(&self) -> StatusResponse {
        let view = self.state.load();
        let ingest = (self.node.ingest)();
        StatusResponse {
            node_id: self.node.node_id.clone(),
            role: (self.node.role)(),
            applied_index: view.applied_index,
            state_digest: view.digest.to_string(),
            workers: view
                .workers()
                .map(|w| WorkerStatus {
                    pool: w.pool.clone(),
                    worker_id: w.name.clone(),
                    address: w.address.clone().unwrap_or_default(),
                    up: w.up,
                    indexed_blocks: w.indexed_blocks,
                    running: w.metrics.running,
                    waiting: w.metrics.waiting,
                    kv_cache_usage: w.metrics.kv_cache_usage,
                    prefix_cache_hit_rate: w.metrics.prefix_cache_hit_rate,
                    metrics_index: w.metrics_index,
                })
                .collect(),
            indexed_blocks: view.indexed_blocks,
            ingest: Some(IngestPosition {
                applied_stream_sequence: view.last_stream_seq,
                stream_last_sequence: ingest.stream_last_sequence,
                rejected: ingest
                    .rejected
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), *v))
                    .collect(),
                dropped: view
                    .dropped
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), *v))
                    .collect(),
            }),
            config_index: view.config_index,
        }
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        Ok(Response::new(AdminService::status(self)))
    }
}
