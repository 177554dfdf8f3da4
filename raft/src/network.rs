//! Raft RPCs over tonic. Requests and responses are openraft's own types in MessagePack inside
//! `kvplane.v1.Raft` messages.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvplane_proto::v1::raft_client::RaftClient;
use kvplane_proto::v1::raft_server;
use kvplane_proto::v1::{RaftPayload, SnapshotChunk};
use openraft::BasicNode;
use openraft::alias::{SnapshotMetaOf, SnapshotOf, VoteOf};
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{
    Fatal, NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::faults::Faults;
use crate::forward::{ForwardError, ForwardReply, ReadIndexReply};
use crate::{KvRaft, Proposal, TypeConfig};

const SNAPSHOT_CHUNK: usize = 1 << 20;

/// MessagePack with structs as arrays, as the log stores entries (no field names: an ingest
/// entry's messages each repeat a dozen). A peer decodes either form.
pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, PeerError> {
    rmp_serde::to_vec(v).map_err(|e| PeerError::Encode(Arc::new(e)))
}

/// A reply to a peer, encoded; a reply that cannot be (a bug, never the peer's doing) is an
/// internal error to it rather than an empty payload it would misread.
fn encoded_reply<T: Serialize>(v: &T) -> Result<Response<RaftPayload>, Status> {
    let data = encode(v).map_err(|e| {
        tracing::error!(error = %e, "a raft reply cannot be encoded");
        Status::internal(e.to_string())
    })?;
    Ok(Response::new(RaftPayload { data, relay: false }))
}

pub(crate) fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, PeerError> {
    rmp_serde::from_slice(b).map_err(|e| PeerError::Decode(Arc::new(e)))
}

/// Why a call to a peer did not reach it, or its answer could not be read.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PeerError {
    #[error("peer {peer} is cut off by fault injection")]
    CutOff { peer: u64 },
    #[error("peer address {addr:?} is not a uri: {source}")]
    Address {
        addr: String,
        #[source]
        source: Arc<tonic::transport::Error>,
    },
    #[error("undecodable raft message: {0}")]
    Decode(#[source] Arc<rmp_serde::decode::Error>),
    #[error("unencodable raft message: {0}")]
    Encode(#[source] Arc<rmp_serde::encode::Error>),
    #[error("peer {peer} at {addr} is unreachable: {message}")]
    Unreachable {
        peer: u64,
        addr: String,
        message: String,
    },
    #[error("peer {peer} at {addr} answered {code:?}: {message}")]
    Refused {
        peer: u64,
        addr: String,
        code: tonic::Code,
        message: String,
    },
    /// A call to a member that relays to its leader ended without its answer: the request may
    /// have reached it.
    #[error("the relay at {addr} answered {code:?}: {message}")]
    Relay {
        addr: String,
        code: tonic::Code,
        message: String,
    },
    /// The member that relays refused the connection: nothing was sent.
    #[error("the relay at {addr} refused the connection: {message}")]
    RelayRefused { addr: String, message: String },
}

impl PeerError {
    /// Whether the request may have reached the other end (so a write must not be sent again).
    pub(crate) fn delivered_maybe(&self) -> bool {
        !matches!(
            self,
            Self::CutOff { .. }
                | Self::Address { .. }
                | Self::Encode(_)
                | Self::RelayRefused { .. }
        )
    }

    /// The error of a call to `peer` at `addr` (no peer: the relay there) that `status` ended.
    pub(crate) fn from_status(peer: Option<u64>, addr: &str, status: &Status) -> Self {
        let (addr, message) = (addr.to_owned(), status.message().to_owned());
        let Some(peer) = peer else {
            if kvplane_tls::connection_refused(status) {
                return Self::RelayRefused { addr, message };
            }
            return Self::Relay {
                addr,
                code: status.code(),
                message,
            };
        };
        match status.code() {
            tonic::Code::Unavailable => Self::Unreachable {
                peer,
                addr,
                message,
            },
            code => Self::Refused {
                peer,
                addr,
                code,
                message,
            },
        }
    }
}

/// Creates one connection per peer; channels are kept and reused.
#[derive(Debug, Clone, Default)]
pub struct Network {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    faults: Faults,
    dialer: kvplane_tls::Dialer,
    /// The least time a Raft RPC is given (see [`Network::with_rpc_timeout_floor`]).
    rpc_floor: Duration,
}

impl Network {
    pub fn new(faults: Faults, dialer: kvplane_tls::Dialer) -> Self {
        Self {
            channels: Arc::default(),
            faults,
            dialer,
            rpc_floor: Duration::ZERO,
        }
    }

    /// The same network giving every Raft RPC it sends at least `floor`. Openraft asks for one
    /// heartbeat interval (3/4 of it as the transport's timeout), which a peer a WAN round trip
    /// away never meets: without the floor, a learner 75 ms or more from its leader (at the
    /// default 100 ms heartbeat) would never take an entry. Openraft bounds heartbeats and
    /// votes by its own timers besides, so the floor lengthens only AppendEntries that carry
    /// entries.
    pub fn with_rpc_timeout_floor(mut self, floor: Duration) -> Self {
        self.rpc_floor = floor;
        self
    }

    /// A client for `peer` at `addr`, unless the fault layer cuts it off.
    pub(crate) fn peer(&self, peer: u64, addr: &str) -> Result<RaftClient<Channel>, PeerError> {
        if self.faults.is_blocked(peer) {
            return Err(PeerError::CutOff { peer });
        }
        self.channel(addr).map(RaftClient::new)
    }

    /// A client for the member at `addr` that relays requests to its leader. It is no peer of
    /// this node's Raft traffic (the fault layer does not cut it): a published name of the
    /// cluster, not one member's recorded address.
    pub(crate) fn relay(&self, addr: &str) -> Result<RaftClient<Channel>, PeerError> {
        self.channel(addr).map(RaftClient::new)
    }

    fn channel(&self, addr: &str) -> Result<Channel, PeerError> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let ch = self.dialer.channel(addr).map_err(|e| PeerError::Address {
            addr: addr.to_owned(),
            source: Arc::new(e),
        })?;
        map.insert(addr.to_owned(), ch.clone());
        Ok(ch)
    }
}

/// A connection to one peer.
#[derive(Debug)]
pub struct Connection {
    target: u64,
    client: Result<RaftClient<Channel>, PeerError>,
    faults: Faults,
    rpc_floor: Duration,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Connection {
        Connection {
            target,
            client: self.channel(&node.addr).map(RaftClient::new),
            faults: self.faults.clone(),
            rpc_floor: self.rpc_floor,
        }
    }
}

/// Metadata naming the Raft node an RPC is for: whoever answers at that address now must be
/// it. A pod back with a new volume (so a new id) never answers, or votes, for its old id.
const TARGET: &str = "kvplane-raft-target";

fn addressed<T>(mut request: Request<T>, target: u64) -> Request<T> {
    request
        .metadata_mut()
        .insert(TARGET, tonic::metadata::MetadataValue::from(target));
    request
}

fn status_error<E: std::error::Error>(s: &Status) -> RPCError<TypeConfig, E> {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::FailedPrecondition => {
            RPCError::Unreachable(Unreachable::from_string(s.message()))
        }
        _ => RPCError::Network(NetworkError::from_string(format!(
            "{}: {}",
            s.code(),
            s.message()
        ))),
    }
}

impl Connection {
    fn client(&self) -> Result<RaftClient<Channel>, Unreachable<TypeConfig>> {
        if self.faults.is_blocked(self.target) {
            return Err(Unreachable::from_string(PeerError::CutOff {
                peer: self.target,
            }));
        }
        self.client.clone().map_err(Unreachable::from_string)
    }

    async fn call<Req, Resp, F, Fut>(
        &self,
        req: &Req,
        option: &RPCOption,
        f: F,
    ) -> Result<Resp, RPCError<TypeConfig>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        F: FnOnce(RaftClient<Channel>, Request<RaftPayload>) -> Fut,
        Fut: Future<Output = Result<Response<RaftPayload>, Status>>,
    {
        let client = self.client()?;
        let data = encode(req).map_err(|e| RPCError::Network(NetworkError::from_string(e)))?;
        let mut request = addressed(
            Request::new(RaftPayload { data, relay: false }),
            self.target,
        );
        request.set_timeout(option.soft_ttl().max(self.rpc_floor));
        let reply = tokio::time::timeout(option.hard_ttl().max(self.rpc_floor), f(client, request))
            .await
            .map_err(|_| RPCError::Network(NetworkError::from_string("raft rpc timed out")))?
            .map_err(|s| status_error(&s))?
            .into_inner();
        let result: Result<Resp, RaftError<TypeConfig>> =
            decode(&reply.data).map_err(|e| RPCError::Network(NetworkError::from_string(e)))?;
        // The peer's Raft is shutting down or failed: to this node it is unreachable.
        result.map_err(|e| {
            RPCError::Unreachable(Unreachable::from_string(format!(
                "peer {}: {e}",
                self.target
            )))
        })
    }
}

impl RaftNetworkV2<TypeConfig> for Connection {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, &option, |mut c, r| async move {
            c.append_entries(r).await
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, &option, |mut c, r| async move { c.vote(r).await })
            .await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, &option, |mut c, r| async move { c.pre_vote(r).await })
            .await
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<TypeConfig>,
        snapshot: SnapshotOf<TypeConfig, Vec<u8>>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let mut client = self.client()?;
        let header = encode(&(vote, snapshot.meta))
            .map_err(|e| StreamingError::Network(NetworkError::from_string(e)))?;
        let data = snapshot.snapshot;
        let mut chunks: Vec<SnapshotChunk> = data
            .chunks(SNAPSHOT_CHUNK)
            .map(|c| SnapshotChunk {
                header: Vec::new(),
                data: c.to_vec(),
            })
            .collect();
        if chunks.is_empty() {
            chunks.push(SnapshotChunk::default());
        }
        chunks[0].header = header;
        let send = client.install_snapshot(addressed(
            Request::new(tokio_stream::iter(chunks)),
            self.target,
        ));
        let reply = tokio::select! {
            r = tokio::time::timeout(option.hard_ttl().max(Duration::from_secs(30)), send) => r,
            closed = cancel => return Err(StreamingError::Closed(closed)),
        };
        let reply = reply
            .map_err(|_| {
                StreamingError::Network(NetworkError::from_string("snapshot transfer timed out"))
            })?
            .map_err(|s| StreamingError::Network(NetworkError::from_string(s.message())))?
            .into_inner();
        let result: Result<SnapshotResponse<TypeConfig>, Fatal<TypeConfig>> =
            decode(&reply.data)
                .map_err(|e| StreamingError::Network(NetworkError::from_string(e)))?;
        result.map_err(|e| StreamingError::Network(NetworkError::from_string(e.to_string())))
    }
}

/// When this member last heard from a leader it accepted (an AppendEntries it did not refuse
/// for a higher vote). With Pre-Vote a member cut off from the quorum keeps its old leader in
/// its metrics; this says how long ago that leader was last heard from.
#[derive(Debug, Clone, Default)]
pub struct LeaderContact(Arc<Mutex<Option<Instant>>>);

impl LeaderContact {
    fn touch(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// Time since the last contact; `None` before any.
    pub fn elapsed(&self) -> Option<Duration> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|t| t.elapsed())
    }
}

/// The server side: hands Raft RPCs to the local Raft instance.
#[derive(Clone)]
pub struct RaftGrpc {
    raft: KvRaft,
    id: u64,
    contact: LeaderContact,
    /// Passes relayed writes and reads on to the leader (none: refuses them as a follower).
    relay: Option<crate::Replica>,
}

impl RaftGrpc {
    /// Records every accepted AppendEntries in `contact`.
    pub fn new(raft: KvRaft, contact: LeaderContact) -> Self {
        let id = raft.metrics().borrow_watched().id;
        Self {
            raft,
            id,
            contact,
            relay: None,
        }
    }

    /// The same service passing relayed requests on through `replica` (which calls the leader
    /// itself, so a request takes one hop at most).
    pub fn relaying(mut self, replica: &crate::Replica) -> Self {
        self.relay = Some(replica.direct());
        self
    }

    /// Refuses an RPC meant for another Raft node (an earlier incarnation at this address).
    fn for_me<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let to = request
            .metadata()
            .get(TARGET)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        match to {
            Some(to) if to != self.id => Err(Status::failed_precondition(format!(
                "addressed to raft node {to}; this is raft node {}",
                self.id
            ))),
            _ => Ok(()),
        }
    }

    pub fn into_service(self) -> raft_server::RaftServer<Self> {
        raft_server::RaftServer::new(self).max_decoding_message_size(256 << 20)
    }
}

fn bad_request(e: PeerError) -> Status {
    Status::invalid_argument(e.to_string())
}

#[tonic::async_trait]
impl raft_server::Raft for RaftGrpc {
    async fn append_entries(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        self.for_me(&request)?;
        let rpc: AppendEntriesRequest<TypeConfig> =
            decode(&request.into_inner().data).map_err(bad_request)?;
        let result = self.raft.append_entries(rpc).await;
        if matches!(&result, Ok(r) if !matches!(r, AppendEntriesResponse::HigherVote(_))) {
            self.contact.touch();
        }
        encoded_reply(&result)
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        self.for_me(&request)?;
        let rpc: VoteRequest<TypeConfig> =
            decode(&request.into_inner().data).map_err(bad_request)?;
        let result = self.raft.vote(rpc).await;
        encoded_reply(&result)
    }

    async fn pre_vote(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        self.for_me(&request)?;
        let rpc: VoteRequest<TypeConfig> =
            decode(&request.into_inner().data).map_err(bad_request)?;
        let result = self.raft.pre_vote(rpc).await;
        encoded_reply(&result)
    }

    async fn install_snapshot(
        &self,
        request: Request<tonic::Streaming<SnapshotChunk>>,
    ) -> Result<Response<RaftPayload>, Status> {
        self.for_me(&request)?;
        let mut stream = request.into_inner();
        let mut header = None;
        let mut data = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            if header.is_none() {
                let h: (VoteOf<TypeConfig>, SnapshotMetaOf<TypeConfig>) =
                    decode(&chunk.header).map_err(bad_request)?;
                header = Some(h);
            }
            data.extend_from_slice(&chunk.data);
        }
        let (vote, meta) =
            header.ok_or_else(|| Status::invalid_argument("empty snapshot stream"))?;
        let result = self
            .raft
            .install_full_snapshot(
                vote,
                SnapshotOf::<TypeConfig, Vec<u8>> {
                    meta,
                    snapshot: data,
                },
            )
            .await;
        if result.is_ok() {
            self.contact.touch();
        }
        encoded_reply(&result)
    }

    async fn propose(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let payload = request.into_inner();
        let command = decode(&payload.data).map_err(bad_request)?;
        if payload.relay
            && let Some(relay) = &self.relay
        {
            return encoded_reply(&relay.relay_write(command).await);
        }
        let reply: ForwardReply = match self.raft.client_write(Proposal::now(command)).await {
            Ok(r) => Ok(r.data),
            Err(RaftError::APIError(openraft::errors::ClientWriteError::ForwardToLeader(f))) => {
                Err(ForwardError::NotLeader {
                    leader: f.leader_id,
                })
            }
            Err(e) => Err(ForwardError::Failed(e.to_string())),
        };
        encoded_reply(&reply)
    }

    async fn read_index(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        if request.get_ref().relay
            && let Some(relay) = &self.relay
        {
            return encoded_reply(&relay.relay_read_index().await);
        }
        let reply: ReadIndexReply = match self
            .raft
            .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
            .await
        {
            Ok(read) => Ok(read.log_id().index),
            Err(RaftError::APIError(openraft::errors::LinearizableReadError::ForwardToLeader(
                f,
            ))) => Err(ForwardError::NotLeader {
                leader: f.leader_id,
            }),
            Err(e) => Err(ForwardError::Failed(e.to_string())),
        };
        encoded_reply(&reply)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A value whose serialization fails, as a bug in a message type would.
    struct Unencodable;

    impl Serialize for Unencodable {
        fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("no encoding for this"))
        }
    }

    #[test]
    fn a_message_that_cannot_be_encoded_is_an_error_not_an_empty_payload() {
        let e = encode(&Unencodable).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unencodable raft message: no encoding for this"
        );
        let status = encoded_reply(&Unencodable).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
        let round: u64 = decode(&encode(&7u64).unwrap()).unwrap();
        assert_eq!(round, 7);
    }
}
