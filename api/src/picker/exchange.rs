//! One HTTP request's conversation with the proxy: its headers and body in, the decision out
//! (the picked endpoint as header and metadata, the body streamed back, possibly rewritten, or
//! an immediate refusal); then its answer's headers and body through, read for the first token
//! and the usage, which settle the request as a gateway's reports would.

use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_request::Request as In, processing_response::Response as Out,
};
use kvplane_proto::front::{self, AnswerTail};
use kvplane_proto::v1::{Outcome, RouteRequest, UsageReport};
use tonic::Status;

use super::PickerConfig;
use super::answer::{self, Refused};
use super::envoy::{self, header};
use crate::RouterService;

/// At most this much request body is read (a larger one is refused with 413).
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// A body streamed back to the proxy goes in chunks of at most this size (under gRPC's
/// default 4 MiB message limit, as the Inference Extension's picker does).
const CHUNK: usize = 62_000;

/// How the proxy sends a body (its `processing_mode`, told in `protocol_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyMode {
    /// Not sent.
    None,
    /// In chunks, each answered before the next is forwarded.
    Streamed,
    /// Whole, in one message.
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
struct Routed {
    request_id: String,
    at: Instant,
    /// `pool/worker` (or `provider:name`), for the answer's header.
    label: String,
    /// The `ip:port` it was sent to (first of the list).
    endpoint: String,
    first_token_ms: Option<f64>,
    streamed: bool,
    success: bool,
    tail: AnswerTail,
    reported: bool,
}

/// One request's state.
pub(crate) struct Exchange {
    router: RouterService,
    config: PickerConfig,
    /// The request's id when it has no `x-request-id`.
    own_id: String,
    request_mode: BodyMode,
    response_mode: BodyMode,
    headers: Vec<(String, String)>,
    metadata: Option<Metadata>,
    body: Vec<u8>,
    /// The request's headers were answered (so its body is answered as it comes).
    headers_answered: bool,
    decided: bool,
    routed: Option<Routed>,
}

/// What handling one message gives: the answers to send, or a stream error.
pub(crate) type Answers = Result<Vec<ProcessingResponse>, Status>;

impl Exchange {
    pub(crate) fn new(router: RouterService, config: PickerConfig, own_id: String) -> Self {
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
            headers_answered: false,
            decided: false,
            routed: None,
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
            Some(In::RequestHeaders(h)) => self.request_headers(h).await,
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

    async fn request_headers(&mut self, h: HttpHeaders) -> Answers {
        self.headers = envoy::headers(&h);
        if h.end_of_stream || matches!(self.request_mode, BodyMode::None | BodyMode::Streamed) {
            // No body will come that the picker may still act on.
            self.decided = true;
            return Ok(vec![self.refuse(Refused::new(
                400,
                "invalid_request",
                if h.end_of_stream {
                    "the endpoint picker routes requests with an OpenAI JSON body naming their model"
                } else {
                    "the endpoint picker needs the request body: set the proxy's request_body_mode to FULL_DUPLEX_STREAMED or BUFFERED"
                },
            ))]);
        }
        if self.request_mode == BodyMode::Buffered {
            // The proxy waits for this answer before it sends the body.
            self.headers_answered = true;
            return Ok(vec![respond(Out::RequestHeaders(
                HeadersResponse::default(),
            ))]);
        }
        Ok(Vec::new())
    }

    async fn request_body(&mut self, b: HttpBody) -> Answers {
        if self.decided {
            // Refused already: the proxy answers the client; nothing more to say.
            return Ok(Vec::new());
        }
        if self.body.len() + b.body.len() > MAX_BODY_BYTES {
            self.decided = true;
            return Ok(vec![self.refuse(Refused::new(
                413,
                "body_too_large",
                format!("the request body is over {MAX_BODY_BYTES} bytes"),
            ))]);
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            self.decide(true).await
        } else {
            Ok(Vec::new())
        }
    }

    async fn request_trailers(&mut self) -> Answers {
        let mut out = if self.decided {
            Vec::new()
        } else {
            // The body ended with trailers rather than an end-of-stream chunk.
            self.decide(false).await?
        };
        out.push(respond(Out::RequestTrailers(TrailersResponse::default())));
        Ok(out)
    }

    /// Decides from the whole request and answers its headers and body (`ends`: the last body
    /// chunk streamed back ends the stream).
    async fn decide(&mut self, ends: bool) -> Answers {
        self.decided = true;
        if self.router.state.load().applied_index == 0 {
            // Nothing to decide from: the proxy's failure mode (open or closed) applies.
            self.router.metrics.picker("unavailable");
            return Err(Status::unavailable("kvplane has no state yet"));
        }
        let subset = envoy::subset(self.metadata.as_ref());
        if subset.as_ref().is_some_and(Vec::is_empty) {
            return Ok(vec![self.refuse(Refused::new(
                503,
                "no_capacity",
                "the proxy's endpoint subset is empty",
            ))]);
        }
        let request_id = header(&self.headers, "x-request-id")
            .map(str::to_owned)
            .unwrap_or_else(|| std::mem::take(&mut self.own_id));
        let mut routed_headers = std::collections::HashMap::new();
        for (k, v) in &self.headers {
            if routed_headers.len() >= front::MAX_ROUTED_HEADERS {
                break;
            }
            if front::routed_header(k) {
                routed_headers
                    .entry(k.clone())
                    .and_modify(|e: &mut String| {
                        e.push_str(", ");
                        e.push_str(v);
                    })
                    .or_insert_with(|| v.clone());
            }
        }
        let req = RouteRequest {
            request_id: request_id.clone(),
            headers: routed_headers,
            body: std::mem::take(&mut self.body),
            endpoint_subset: subset.unwrap_or_default(),
            ..Default::default()
        };
        let resp = match self.router.route_traced(&req).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                return Ok(vec![self.refuse(Refused {
                    retry_after_ms: 1000,
                    ..Refused::new(
                        503,
                        "unavailable",
                        format!("kvplane could not decide: {}", s.message()),
                    )
                })]);
            }
        };
        let body = resp.rewritten_body.clone().unwrap_or(req.body);
        let picked = match answer::picked(&resp, self.config.fallbacks) {
            Ok(p) => p,
            Err(refused) => return Ok(vec![self.refuse(refused)]),
        };
        self.router.metrics.picker(picked.outcome);
        let mut out = Vec::new();
        let mut common = CommonResponse {
            header_mutation: Some(envoy::set_headers(picked.headers(body.len()))),
            clear_route_cache: true,
            ..Default::default()
        };
        let metadata = picked.metadata();
        self.routed = Some(Routed {
            request_id,
            at: Instant::now(),
            label: picked.label,
            endpoint: picked.endpoint,
            first_token_ms: None,
            streamed: false,
            success: false,
            tail: AnswerTail::default(),
            reported: false,
        });
        if self.headers_answered {
            // Buffered: the headers were answered; the body's answer carries the mutation.
            if resp.rewritten_body.is_some() {
                common.body_mutation = Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::Body(body)),
                });
            }
            out.push(ProcessingResponse {
                dynamic_metadata: metadata,
                ..respond(Out::RequestBody(BodyResponse {
                    response: Some(common),
                }))
            });
            return Ok(out);
        }
        out.push(ProcessingResponse {
            dynamic_metadata: metadata,
            ..respond(Out::RequestHeaders(HeadersResponse {
                response: Some(common),
            }))
        });
        self.headers_answered = true;
        out.extend(stream_back(&body, ends, Out::RequestBody));
        Ok(out)
    }

    async fn response_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Vec<ProcessingResponse> {
        let headers = envoy::headers(h);
        let mut set = Vec::new();
        if let Some(r) = &mut self.routed {
            let status = header(&headers, ":status").and_then(|s| s.parse::<u16>().ok());
            r.success = status.is_some_and(|s| (200..300).contains(&s));
            r.streamed = r.success
                && header(&headers, "content-type")
                    .is_some_and(|t| t.starts_with("text/event-stream"));
            if let Some(served) = envoy::served(metadata.as_ref())
                && served != r.endpoint
            {
                tracing::debug!(
                    request_id = r.request_id,
                    picked = r.endpoint,
                    served,
                    "the proxy served the request elsewhere"
                );
                self.router.metrics.picker("served_elsewhere");
            }
            set.push((super::WORKER_HEADER, r.label.clone()));
        }
        let ends = h.end_of_stream;
        let common = CommonResponse {
            header_mutation: Some(envoy::set_headers(set)),
            ..Default::default()
        };
        if ends {
            self.finish(None).await;
        }
        vec![respond(Out::ResponseHeaders(HeadersResponse {
            response: Some(common),
        }))]
    }

    async fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(r) = &mut self.routed
            && !r.reported
        {
            if r.first_token_ms.is_none() && !b.body.is_empty() {
                let ms = r.at.elapsed().as_secs_f64() * 1000.0;
                r.first_token_ms = Some(ms);
                if r.streamed {
                    let report = UsageReport {
                        request_id: r.request_id.clone(),
                        observed_ttft_ms: ms,
                        first_token: true,
                        ..Default::default()
                    };
                    let _ = self
                        .router
                        .report_usage_in(tonic::Request::new(report))
                        .await;
                }
            }
            r.tail.keep(&b.body);
        }
        let ends = b.end_of_stream;
        if ends {
            self.finish(None).await;
        }
        match self.response_mode {
            BodyMode::FullDuplex => stream_back(&b.body, ends, Out::ResponseBody),
            _ => vec![respond(Out::ResponseBody(BodyResponse::default()))],
        }
    }

    /// The final report, once (`outcome`: as the answer says when `None`).
    fn final_report(&mut self, outcome: Option<Outcome>) -> Option<UsageReport> {
        let r = self.routed.as_mut().filter(|r| !r.reported)?;
        r.reported = true;
        let outcome = outcome.unwrap_or(if r.success {
            Outcome::Success
        } else {
            Outcome::Error
        });
        Some(r.tail.usage().report(
            r.request_id.clone(),
            r.first_token_ms.unwrap_or(0.0),
            outcome,
        ))
    }

    /// Settles the request (its answer ended; `Some`: with that outcome).
    pub(crate) async fn finish(&mut self, outcome: Option<Outcome>) {
        if let Some(report) = self.final_report(outcome) {
            let _ = self
                .router
                .report_usage_in(tonic::Request::new(report))
                .await;
        }
    }
}

impl Exchange {
    /// The immediate answer refusing the request, counted.
    fn refuse(&mut self, r: Refused) -> ProcessingResponse {
        self.decided = true;
        self.router.metrics.picker(r.kind);
        r.answer()
    }
}

fn respond(r: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// `body` as streamed body answers of at most [`CHUNK`] bytes (one, possibly empty, at least),
/// the last ending the stream when `ends`.
fn stream_back(body: &[u8], ends: bool, wrap: fn(BodyResponse) -> Out) -> Vec<ProcessingResponse> {
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
