//! The Envoy endpoint picker: `envoy.service.ext_proc.v3.ExternalProcessor` as the Gateway API
//! Inference Extension's endpoint picker protocol uses it, one more front to the routing
//! pipeline (the same decision as `Router.Route`, on the same node and port).
//!
//! Per HTTP request the proxy opens one stream. With the protocol's `FULL_DUPLEX_STREAMED`
//! request body the picker holds the headers until the body has ended, decides, then answers
//! the headers (the picked `ip:port` in `x-gateway-destination-endpoint`, the same in the
//! `envoy.lb` dynamic metadata, the route cache cleared) and streams the body back, rewritten
//! when the model was. With a `BUFFERED` body it answers the headers at once and puts all of
//! that in the body's answer. Refusals are immediate answers (429 with `Retry-After` for
//! tenant limits, 503 when nothing can serve, 403 for policies, 404 for unknown models, 400
//! and 413 for bad requests). The answer's headers and body pass through: its first chunk
//! reports the first token, its end the usage (`usage` of the JSON or the last SSE event), so
//! tenant reservations settle and predictions calibrate as a gateway's reports would.
//! A node with no state yet ends the stream with `UNAVAILABLE`: the proxy's failure mode
//! (open or closed) decides. Where the proxy runs is the stream's gRPC metadata
//! ([`ORIGIN_METADATA`], set in the proxy's `grpc_service.initial_metadata`, never by its
//! clients): the decision's origin, as `kvplane gateway --cluster` gives it.

mod answer;
mod envoy;
mod exchange;
mod request;
mod response;

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::FutureExt;
use tokio::sync::Semaphore;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use kvplane_proto::v1::Place;
use serde::Deserialize;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

pub use answer::PROVIDER_HEADER;
pub use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

use crate::RouterService;

/// At most this much request body (in KiB) is held by all of a node's picker streams at once;
/// a request whose body does not fit is refused with 503.
const HELD_BODIES_KIB: usize = 256 << 10;

/// The answer header naming where the request went (`pool/worker` or `provider:name`), as
/// kvplane's own gateway names it.
pub const WORKER_HEADER: &str = "x-kvplane-worker";

/// The stream metadata naming where the proxy runs: its cluster, region and zone (each
/// optional; absent: this replica's place stands).
pub const ORIGIN_METADATA: [&str; 3] = ["x-kvplane-cluster", "x-kvplane-region", "x-kvplane-zone"];

/// The origin the proxy's stream metadata names, if any.
fn origin_of(meta: &tonic::metadata::MetadataMap) -> Result<Option<Place>, Status> {
    let mut said = [String::new(), String::new(), String::new()];
    for (key, value) in ORIGIN_METADATA.iter().zip(&mut said) {
        if let Some(v) = meta.get(*key) {
            let v = v
                .to_str()
                .map_err(|_| Status::invalid_argument(format!("{key} is not text")))?;
            v.trim().clone_into(value);
        }
    }
    if said.iter().all(String::is_empty) {
        return Ok(None);
    }
    let [cluster, region, zone] = said;
    Ok(Some(Place {
        cluster,
        region,
        zone,
    }))
}

/// The `[picker]` section of a node's config.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PickerConfig {
    /// Endpoints listed after the pick in `x-gateway-destination-endpoint` (comma-separated,
    /// the protocol's fallbacks) for proxies that retry on them. 0: the pick alone, which is
    /// what Envoy's `ORIGINAL_DST` cluster reads (it takes one address).
    pub fallbacks: usize,
}

impl PickerConfig {
    pub fn problems(&self) -> Vec<String> {
        if self.fallbacks > 3 {
            vec![format!(
                "picker.fallbacks: {} is over 3, the most a Route answer lists",
                self.fallbacks
            )]
        } else {
            Vec::new()
        }
    }
}

/// The ext_proc service over a node's [`RouterService`].
#[derive(Debug, Clone)]
pub struct EndpointPicker {
    router: RouterService,
    config: PickerConfig,
    /// Names the streams (`picker-<start>-<n>`), and the requests without `x-request-id`.
    started_ns: u128,
    next_id: Arc<AtomicU64>,
    held_bodies: Arc<Semaphore>,
}

impl EndpointPicker {
    pub fn new(router: RouterService, config: PickerConfig) -> Self {
        Self {
            router,
            config,
            started_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            next_id: Arc::default(),
            held_bodies: Arc::new(Semaphore::new(HELD_BODIES_KIB)),
        }
    }

    /// One request's conversation as the stream would hold it, for `caller` at `origin` (the
    /// stream metadata's), driven message by message (tests and fuzz targets play a proxy
    /// with it).
    pub fn conversation(
        &self,
        caller: Option<crate::Caller>,
        origin: Option<Place>,
    ) -> Conversation {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        Conversation(exchange::Exchange::new(
            self.router.clone(),
            self.config,
            format!("picker-{:x}-{n}", self.started_ns),
            self.held_bodies.clone(),
            caller,
            origin,
        ))
    }

    /// The gRPC service, taking messages up to `limits.grpc_message_bytes`.
    pub fn server(self) -> ExternalProcessorServer<Self> {
        let max = self.router.limits.grpc_message_bytes;
        ExternalProcessorServer::new(self).max_decoding_message_size(max)
    }
}

/// One proxy request's messages and the picker's answers, without the gRPC stream around them.
pub struct Conversation(exchange::Exchange);

impl Conversation {
    /// The answers to one message of the proxy's, or the error that ends the stream.
    pub async fn on(&mut self, msg: ProcessingRequest) -> Result<Vec<ProcessingResponse>, Status> {
        self.0.on(msg).await
    }

    /// The proxy closed the stream.
    pub async fn closed(&mut self) {
        self.0.closed().await;
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let caller = request.extensions().get::<crate::Caller>().cloned();
        let origin = origin_of(request.metadata()).inspect_err(|e| {
            // The proxy's configuration, not a client: every stream of it fails until fixed.
            self.router.metrics.picker("bad_origin");
            tracing::warn!(error = %e.message(), "the proxy's origin metadata is unreadable");
        })?;
        let inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        let exchange = self.conversation(caller, origin).0;
        let on_panic = tx.clone();
        tokio::spawn(async move {
            // A stream that ends without a status would tell the proxy to go on without a
            // pick, whatever its failure mode: a panic ends it with INTERNAL.
            if AssertUnwindSafe(converse(inbound, exchange, tx))
                .catch_unwind()
                .await
                .is_err()
            {
                let _ = on_panic
                    .send(Err(Status::internal("the endpoint picker failed")))
                    .await;
            }
        });
        let answers = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Answers the proxy's messages until it closes the stream; then settles the request.
async fn converse(
    mut inbound: Streaming<ProcessingRequest>,
    mut exchange: exchange::Exchange,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    'messages: loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                // The proxy's side broke (or sent what cannot be read): say so rather than
                // end as if all was answered.
                if crate::limits::is_too_large(&e) {
                    exchange.router.metrics.limit_hit("grpc_message_bytes");
                }
                let _ = tx.send(Err(e)).await;
                break;
            }
        };
        match exchange.on(msg).await {
            Ok(answers) => {
                for a in answers {
                    if tx.send(Ok(a)).await.is_err() {
                        break 'messages;
                    }
                }
            }
            Err(status) => {
                let _ = tx.send(Err(status)).await;
                break;
            }
        }
    }
    exchange.closed().await;
}
