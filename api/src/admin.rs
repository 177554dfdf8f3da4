//! The `kvplane.v1.Admin` gRPC service.

use std::sync::Arc;

use kvplane_proto::v1::{
    self as pb, AddMemberRequest, ClusterStatusResponse, DeleteConfigRequest, ExportStateRequest,
    IngestPosition, PutConfigRequest, RemoveMemberRequest, SetFailpointsRequest,
    SetFailpointsResponse, SetFaultsRequest, SetFaultsResponse, StateChunk, StatusRequest,
    StatusResponse, WorkerStatus, WriteResponse,
};
use kvplane_state::{Command, StateHandle};

use crate::{Consistency, propose_status};
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

pub use kvplane_raft::{ClusterControl, ClusterError};

/// Node-level facts the Admin service reports next to the state.
#[derive(Clone)]
pub struct NodeInfo {
    pub node_id: String,
    pub role: Source<String>,
    pub ingest: Source<IngestStatus>,
    /// Membership control; `None` where there is no Raft member (tests of the API alone).
    pub cluster: Option<Arc<dyn ClusterControl>>,
    /// Writes and read barriers through this node's log.
    pub consistency: Arc<dyn Consistency>,
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
    escrow: Option<Arc<crate::Escrow>>,
    limits: crate::Limits,
    metrics: Option<Arc<crate::ApiMetrics>>,
}

impl AdminService {
    pub fn new(state: StateHandle, node: NodeInfo) -> Self {
        Self {
            state,
            node,
            escrow: None,
            limits: crate::Limits::default(),
            metrics: None,
        }
    }

    /// Bounds on a written config object, each hit counted in `metrics`.
    pub fn with_limits(mut self, limits: crate::Limits, metrics: Arc<crate::ApiMetrics>) -> Self {
        self.limits = limits;
        self.metrics = Some(metrics);
        self
    }

    /// A config object over the limits: refused before it reaches the log.
    fn check_object(&self, r: &PutConfigRequest) -> Result<(), Status> {
        let l = &self.limits;
        let over = [
            ("name_bytes", "kind", r.kind.len(), l.name_bytes),
            ("name_bytes", "name", r.name.len(), l.name_bytes),
            (
                "config_object_bytes",
                "value",
                r.value.len(),
                l.config_object_bytes,
            ),
        ]
        .into_iter()
        .find(|(_, _, found, limit)| found > limit);
        match over {
            None => Ok(()),
            Some((limit_name, field, found, limit)) => {
                if let Some(m) = &self.metrics {
                    m.limit_hit(limit_name);
                }
                Err(Status::invalid_argument(format!(
                    "the config object's {field} is {found} bytes, over the limit of {limit} (limits.{limit_name})"
                )))
            }
        }
    }

    /// Reports this replica's escrow in Status.
    pub fn with_quota(mut self, escrow: Arc<crate::Escrow>) -> Self {
        self.escrow = Some(escrow);
        self
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
                    worker_id: w.name.to_string(),
                    address: w.address.as_deref().unwrap_or_default().to_owned(),
                    up: w.up,
                    indexed_blocks: w.indexed_blocks,
                    running: w.metrics.running,
                    waiting: w.metrics.waiting,
                    kv_cache_usage: w.metrics.kv_cache_usage,
                    prefix_cache_hit_rate: w.metrics.prefix_cache_hit_rate,
                    metrics_index: w.metrics_index,
                    streaming: w.streaming,
                    found: w.found.map_or("", |f| f.as_str()).to_owned(),
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
            policy_objects: view
                .catalog
                .objects()
                .iter()
                .fold(Default::default(), |mut m, o| {
                    *m.entry(o.kind().as_str().to_owned()).or_insert(0) += 1;
                    m
                }),
            quota: self.escrow.as_ref().map(|e| e.status()).unwrap_or_default(),
            config_objects: config_objects(&view),
        }
    }
}

/// Every config object with its owner, pools first, then policy objects by kind and name.
fn config_objects(view: &kvplane_state::View) -> Vec<pb::ConfigObjectStatus> {
    let pools = view
        .catalog
        .config_pools
        .keys()
        .map(|n| (kvplane_state::POOL_KIND.to_owned(), n.clone()));
    let policies = view
        .catalog
        .objects()
        .into_iter()
        .map(|o| (o.kind().as_str().to_owned(), o.name));
    pools
        .chain(policies)
        .map(|(kind, name)| pb::ConfigObjectStatus {
            owner: view
                .owner(&kind, &name)
                .map(|o| o.as_str().to_owned())
                .unwrap_or_default(),
            kind,
            name,
        })
        .collect()
}

/// Bytes per `StateChunk` (well under the gRPC message limit).
const EXPORT_CHUNK: usize = 4 << 20;

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    type ExportStateStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<StateChunk, Status>> + Send>>;

    async fn export_state(
        &self,
        _request: Request<ExportStateRequest>,
    ) -> Result<Response<Self::ExportStateStream>, Status> {
        let (index, bytes) = self
            .node
            .consistency
            .export_state()
            .await
            .map_err(|e| propose_status(&e))?;
        tracing::info!(index, bytes = bytes.len(), "state exported");
        let chunks: Vec<Result<StateChunk, Status>> = bytes
            .chunks(EXPORT_CHUNK)
            .enumerate()
            .map(|(i, c)| {
                Ok(StateChunk {
                    data: c.to_vec(),
                    applied_index: if i == 0 { index } else { 0 },
                })
            })
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn status(
        &self,
        request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let want = request.into_inner().consistency.unwrap_or_default();
        crate::consistency::ensure(Some(&self.node.consistency), &self.state, &want).await?;
        Ok(Response::new(AdminService::status(self)))
    }

    async fn put_config(
        &self,
        request: Request<PutConfigRequest>,
    ) -> Result<Response<WriteResponse>, Status> {
        crate::access::check_access_write(request.extensions(), &request.get_ref().kind)?;
        let r = request.into_inner();
        if r.kind.is_empty() || r.name.is_empty() {
            return Err(Status::invalid_argument(
                "a config object needs a kind and a name",
            ));
        }
        self.check_object(&r)?;
        self.write(Command::ConfigPut {
            owner: Some(kvplane_state::Owner::Admin),
            kind: r.kind,
            name: r.name,
            value: r.value,
        })
        .await
    }

    async fn delete_config(
        &self,
        request: Request<DeleteConfigRequest>,
    ) -> Result<Response<WriteResponse>, Status> {
        crate::access::check_access_write(request.extensions(), &request.get_ref().kind)?;
        let r = request.into_inner();
        let owner = if r.owner.is_empty() {
            kvplane_state::Owner::Admin
        } else {
            kvplane_state::Owner::parse(&r.owner).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "unknown owner {:?} (known: {})",
                    r.owner,
                    kvplane_state::Owner::ALL
                        .map(kvplane_state::Owner::as_str)
                        .join(", ")
                ))
            })?
        };
        self.write(Command::ConfigDelete {
            owner: Some(owner),
            kind: r.kind,
            name: r.name,
        })
        .await
    }

    async fn set_faults(
        &self,
        request: Request<SetFaultsRequest>,
    ) -> Result<Response<SetFaultsResponse>, Status> {
        let blocked = self
            .cluster()?
            .set_faults(request.into_inner().blocked_peers)
            .map_err(cluster_status)?;
        tracing::warn!(
            ?blocked,
            "fault injection: raft traffic to these peers is cut"
        );
        Ok(Response::new(SetFaultsResponse {
            blocked_peers: blocked,
        }))
    }

    async fn set_failpoints(
        &self,
        request: Request<SetFailpointsRequest>,
    ) -> Result<Response<SetFailpointsResponse>, Status> {
        let spec = request.into_inner().failpoints;
        let failpoints = self
            .cluster()?
            .set_failpoints(&spec)
            .map_err(cluster_status)?;
        tracing::warn!(?failpoints, "fault injection: failpoints set");
        Ok(Response::new(SetFailpointsResponse { failpoints }))
    }

    async fn cluster_status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        Ok(Response::new(self.cluster()?.status()))
    }

    async fn add_member(
        &self,
        request: Request<AddMemberRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        let r = request.into_inner();
        if r.addr.is_empty() || r.id == 0 {
            return Err(Status::invalid_argument(
                "a member needs a non-zero id and an address",
            ));
        }
        let c = self.cluster()?;
        c.add(r.id, r.addr, r.learner, r.relay)
            .await
            .map_err(cluster_status)?;
        Ok(Response::new(c.status()))
    }

    async fn remove_member(
        &self,
        request: Request<RemoveMemberRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        let c = self.cluster()?;
        let r = request.into_inner();
        c.remove(r.id, r.relay, r.learner_only)
            .await
            .map_err(cluster_status)?;
        Ok(Response::new(c.status()))
    }
}

fn cluster_status(e: ClusterError) -> Status {
    match e {
        ClusterError::NotLeader { .. } => Status::failed_precondition(e.to_string()),
        ClusterError::UnreachableSelf(_)
        | ClusterError::AlreadyVoter(_)
        | ClusterError::VoterKept(_)
        | ClusterError::UnreachableTarget(_)
        | ClusterError::AnotherCluster { .. } => Status::failed_precondition(e.to_string()),
        ClusterError::Raft(_) => Status::aborted(e.to_string()),
        ClusterError::Relay { code, .. } => Status::new(code, e.to_string()),
        ClusterError::FaultsDisabled => Status::failed_precondition(e.to_string()),
        ClusterError::Failpoint(_) => Status::invalid_argument(e.to_string()),
    }
}

impl AdminService {
    async fn write(&self, command: Command) -> Result<Response<WriteResponse>, Status> {
        let index = self
            .node
            .consistency
            .write(command)
            .await
            .map_err(|e| propose_status(&e))?;
        Ok(Response::new(WriteResponse { index }))
    }

    fn cluster(&self) -> Result<&Arc<dyn ClusterControl>, Status> {
        self.node
            .cluster
            .as_ref()
            .ok_or_else(|| Status::unimplemented("this node has no raft member"))
    }
}
