//! One HTTP request's conversation with the proxy: its state, the modes the proxy sends bodies
//! in, and the dispatch of its messages to the request side ([`super::request`]: headers and
//! body in, the decision out) and the answer side ([`super::response`]: the answer through,
//! read for its first token and usage).

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse, body_mutation, processing_request::Request as In,
    processing_response::Response as Out,
};
use kvplane_proto::front::AnswerTail;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

use super::PickerConfig;
use super::answer::Refused;
use crate::RouterService;

/// A body streamed back to the proxy goes in chunks of at most this size (under gRPC's
/// default 4 MiB message limit, as the Inference Extension's picker does).
const CHUNK: usize = 62_000;

/// How the proxy sends a body (its `processing_mode`, told in `protocol_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyMode {
    /// Not sent.
    None,
    /// In chunks, each answered before the next is forwarded.
    Streamed,
    /// Whole (or as much as the proxy buffers), in one message answered before it goes on.
    Buffered,
    /// In chunks the picker answers with the body it wants forwarded (the protocol's mode).
    FullDuplex,
}

impl BodyMode {
    fn of(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => Self::None,
            Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial) => Self::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) => Self::FullDuplex,
            // Streamed, and whatever a newer proxy may add.
            _ => Self::Streamed,
        }
    }
}

/// What the picker decided for the request and what it saw of the answer.
#[derive(Debug)]
pub(super) struct Routed {
    pub(super) request_id: String,
    pub(super) at: Instant,
    /// `pool/worker` (or `provider:name`), for the answer's header.
    pub(super) label: String,
    /// The `ip:port` it was sent to (first of the list).
    pub(super) endpoint: String,
    pub(super) first_token_ms: Option<f64>,
    /// The answer's headers came.
    pub(super) answered: bool,
    pub(super) streamed: bool,
    pub(super) success: bool,
    pub(super) tail: AnswerTail,
    pub(super) reported: bool,
    /// The `ip:port` the proxy says served it, when not `endpoint` (a fallback).
    pub(super) served: Option<String>,
}

/// One request's state.
pub(crate) struct Exchange {
    pub(super) router: RouterService,
    pub(super) config: PickerConfig,
    /// This stream's own name: the request's id, after its `x-request-id` when it has one.
    pub(super) own_id: String,
    pub(super) request_mode: BodyMode,
    pub(super) response_mode: BodyMode,
    pub(super) headers: Vec<(String, String)>,
    pub(super) metadata: Option<Metadata>,
    pub(super) body: Vec<u8>,
    /// What the body held so far takes of the picker's budget for bodies held at once.
    pub(super) budget: Arc<Semaphore>,
    pub(super) held: Vec<OwnedSemaphorePermit>,
    /// The request's headers were answered (so its body is answered as it comes).
    pub(super) headers_answered: bool,
    pub(super) decided: bool,
    pub(super) routed: Option<Routed>,
    /// Who the proxy is (its client certificate), for the tenants it may route for.
    pub(super) caller: Option<crate::Caller>,
    /// Where the proxy says it runs (its stream's metadata).
    pub(super) origin: Option<kvplane_proto::v1::Place>,
}

/// What handling one message gives: the answers to send, or a stream error.
pub(crate) type Answers = Result<Vec<ProcessingResponse>, Status>;

impl Exchange {
    pub(crate) fn new(
        router: RouterService,
        config: PickerConfig,
        own_id: String,
        budget: Arc<Semaphore>,
        caller: Option<crate::Caller>,
        origin: Option<kvplane_proto::v1::Place>,
    ) -> Self {
        Self {
            router,
            config,
            own_id,
            // Until the proxy says otherwise: the protocol's mode.
            request_mode: BodyMode::FullDuplex,
            response_mode: BodyMode::FullDuplex,
            headers: Vec::new(),
            metadata: None,
            body: Vec::new(),
            budget,
            held: Vec::new(),
            headers_answered: false,
            decided: false,
            routed: None,
            caller,
            origin,
        }
    }

    /// Handles one message of the proxy's.
    pub(crate) async fn on(&mut self, msg: ProcessingRequest) -> Answers {
        if let Some(p) = &msg.protocol_config {
            self.request_mode = BodyMode::of(p.request_body_mode);
            self.response_mode = BodyMode::of(p.response_body_mode);
        }
        if msg.metadata_context.is_some() && self.routed.is_none() {
            self.metadata.clone_from(&msg.metadata_context);
        }
        match msg.request {
            Some(In::RequestHeaders(h)) => Ok(self.request_headers(&h)),
            Some(In::RequestBody(b)) => self.request_body(b).await,
            Some(In::RequestTrailers(_)) => self.request_trailers().await,
            Some(In::ResponseHeaders(h)) => {
                Ok(self.response_headers(&h, msg.metadata_context).await)
            }
            Some(In::ResponseBody(b)) => Ok(self.response_body(b).await),
            Some(In::ResponseTrailers(_)) => {
                self.finish(None).await;
                Ok(vec![respond(Out::ResponseTrailers(
                    TrailersResponse::default(),
                ))])
            }
            None => Err(Status::invalid_argument(
                "a processing request without a message",
            )),
        }
    }

    /// The immediate answer refusing the request, counted.
    pub(super) fn refuse(&mut self, r: Refused) -> ProcessingResponse {
        self.decided = true;
        self.release_body();
        self.router.metrics.picker(r.kind);
        r.answer()
    }

    /// The stream ended: a request whose successful answer began and did not end was
    /// cancelled (its usage unknown, so it keeps its reservation); one whose answer never came,
    /// or failed, is settled as failed.
    pub(crate) async fn closed(&mut self) {
        let began = self
            .routed
            .as_ref()
            .is_some_and(|r| r.answered && r.success);
        self.finish(Some(if began {
            kvplane_proto::v1::Outcome::Cancelled
        } else {
            kvplane_proto::v1::Outcome::Error
        }))
        .await;
    }

    /// Drops the body held and gives its share of the budget back.
    pub(super) fn release_body(&mut self) {
        self.body = Vec::new();
        self.held.clear();
    }
}

impl Drop for Exchange {
    /// An exchange dropped without settling its request (its task panicked): settled as failed
    /// in a task of its own.
    fn drop(&mut self) {
        let Some(r) = self.routed.as_mut().filter(|r| !r.reported) else {
            return;
        };
        r.reported = true;
        let report = AnswerTail::default().report(
            r.request_id.clone(),
            0.0,
            kvplane_proto::v1::Outcome::Error,
        );
        let router = self.router.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = router
                    .report_usage_in(tonic::Request::new(report), None)
                    .await;
            });
        }
    }
}

pub(super) fn respond(r: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// `body` as streamed body answers of at most [`CHUNK`] bytes (one, possibly empty, at least),
/// the last ending the stream when `ends`.
pub(super) fn stream_back(
    body: &[u8],
    ends: bool,
    wrap: fn(BodyResponse) -> Out,
) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[]]
    } else {
        body.chunks(CHUNK).collect()
    };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            respond(wrap(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: c.to_vec(),
                                end_of_stream: ends && i + 1 == n,
                                ..Default::default()
                            },
                        )),
                    }),
                    ..Default::default()
                }),
            }))
        })
        .collect()
}
