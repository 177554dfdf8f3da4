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
//! (open or closed) decides.

mod answer;
mod envoy;
mod exchange;

use std::pin::Pin;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use serde::Deserialize;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

pub use answer::PROVIDER_HEADER;
pub use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
pub use exchange::MAX_BODY_BYTES;

use crate::RouterService;

/// The answer header naming where the request went (`pool/worker` or `provider:name`), as
/// kvplane's own gateway names it.
pub const WORKER_HEADER: &str = "x-kvplane-worker";

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
    /// Names requests that come without `x-request-id`: `picker-<start>-<n>`.
    started_ns: u128,
    next_id: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl EndpointPicker {
    pub fn new(router: RouterService, config: PickerConfig) -> Self {
        Self {
            router,
            config,
            started_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            next_id: std::sync::Arc::default(),
        }
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
        let mut inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        let n = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut exchange = exchange::Exchange::new(
            self.router.clone(),
            self.config,
            format!("picker-{:x}-{n}", self.started_ns),
        );
        tokio::spawn(async move {
            let mut ended = false;
            while let Ok(Some(msg)) = inbound.message().await {
                match exchange.on(msg).await {
                    Ok(answers) => {
                        for a in answers {
                            if tx.send(Ok(a)).await.is_err() {
                                break;
                            }
                        }
                    }
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        ended = true;
                        break;
                    }
                }
            }
            if !ended {
                // The proxy closed the stream: an answer it did not see to its end was
                // cancelled (settled at what its usage said so far).
                exchange
                    .finish(Some(kvplane_proto::v1::Outcome::Cancelled))
                    .await;
            }
        });
        let answers = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(Response::new(Box::pin(answers)))
    }
}
