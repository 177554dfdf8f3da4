//! The request side of an exchange: headers and body in (held until the body has ended, or
//! the headers answered at once for a buffered body), the decision out - the pick as header
//! and `envoy.lb` metadata with the body streamed back, possibly rewritten, or a refusal.

use std::collections::HashMap;
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingResponse, TrailersResponse, body_mutation, processing_response::Response as Out,
};
use kvplane_proto::front::{self, AnswerTail};
use kvplane_proto::v1::{Outcome, RouteRequest, route_response::Decision};
use tonic::Status;

use super::answer::{self, Refused};
use super::envoy::{self, header};
use super::exchange::{Answers, BodyMode, Exchange, Routed, respond, stream_back};

impl Exchange {
    pub(super) fn request_headers(&mut self, h: &HttpHeaders) -> Vec<ProcessingResponse> {
        self.headers = envoy::headers(h);
        if h.end_of_stream || matches!(self.request_mode, BodyMode::None | BodyMode::Streamed) {
            // No body will come that the picker may still act on.
            return vec![self.refuse(Refused::new(
                400,
                "invalid_request",
                if h.end_of_stream {
                    "the endpoint picker routes requests with an OpenAI JSON body naming their model"
                } else {
                    "the endpoint picker needs the request body: set the proxy's request_body_mode to FULL_DUPLEX_STREAMED or BUFFERED"
                },
            ))];
        }
        if self.request_mode == BodyMode::Buffered {
            // The proxy waits for this answer before it sends the body.
            self.headers_answered = true;
            return vec![respond(Out::RequestHeaders(HeadersResponse::default()))];
        }
        Vec::new()
    }

    pub(super) async fn request_body(&mut self, b: HttpBody) -> Answers {
        if self.decided {
            // Refused already: the proxy answers the client; nothing more to say.
            return Ok(Vec::new());
        }
        // At most `limits.body_bytes` of request body is read (a larger one is refused).
        let limit = self.router.limits.body_bytes;
        if self.body.len() + b.body.len() > limit {
            self.router.metrics.limit_hit("body_bytes");
            return Ok(vec![self.refuse(Refused::new(
                413,
                "body_too_large",
                format!("the request body is over {limit} bytes (limits.body_bytes)"),
            ))]);
        }
        let kib = u32::try_from(b.body.len().div_ceil(1024)).unwrap_or(u32::MAX);
        match self.budget.clone().try_acquire_many_owned(kib) {
            Ok(permit) => self.held.push(permit),
            Err(_) => {
                return Ok(vec![self.refuse(Refused {
                    retry_after_ms: 1000,
                    ..Refused::new(
                        503,
                        "picker_busy",
                        "the endpoint picker holds as many request bodies as it may",
                    )
                })]);
            }
        }
        self.body.extend_from_slice(&b.body);
        // A buffered body is all the proxy sends before it waits for the answer (it may end
        // with trailers, or be partial).
        if b.end_of_stream || self.request_mode == BodyMode::Buffered {
            self.decide(b.end_of_stream).await
        } else {
            Ok(Vec::new())
        }
    }

    pub(super) async fn request_trailers(&mut self) -> Answers {
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
            self.release_body();
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
        // The stream's own name keeps two requests apart that share an `x-request-id`.
        let request_id = match header(&self.headers, "x-request-id") {
            Some(x) => format!("{x}/{}", self.own_id),
            None => self.own_id.clone(),
        };
        let mut headers = HashMap::new();
        for (k, v) in &self.headers {
            if headers.len() >= front::MAX_ROUTED_HEADERS {
                break;
            }
            if front::routed_header(k) {
                headers
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
            headers,
            body: std::mem::take(&mut self.body),
            endpoint_subset: subset.unwrap_or_default(),
            origin: self.origin.clone(),
            ..Default::default()
        };
        let mut resp = match self.router.route_traced(&req, self.caller.as_ref()).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::PermissionDenied => {
                return Ok(vec![self.refuse(Refused::new(
                    403,
                    "permission_denied",
                    s.message().to_owned(),
                ))]);
            }
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
        let picked = match answer::picked(&resp, self.config.fallbacks) {
            Ok(p) => p,
            Err(refused) => {
                if matches!(resp.decision, Some(Decision::Endpoint(_))) {
                    // Routed, then refused here (no address to send it to): settled at once.
                    let report = AnswerTail::default().report(request_id, 0.0, Outcome::Error);
                    let _ = self
                        .router
                        .report_usage_in(tonic::Request::new(report), None)
                        .await;
                }
                return Ok(vec![self.refuse(refused)]);
            }
        };
        self.router.metrics.picker(picked.outcome);
        let rewritten = resp.rewritten_body.is_some();
        let body = resp.rewritten_body.take().unwrap_or(req.body);
        let mut common = CommonResponse {
            header_mutation: Some(envoy::mutate_headers(
                picked.headers(body.len()),
                &picked.removed_headers(),
            )),
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
            answered: false,
            streamed: false,
            success: false,
            tail: AnswerTail::default(),
            reported: false,
            served: None,
        });
        let mut out = Vec::new();
        if self.headers_answered {
            // Buffered: the headers were answered; the body's answer carries the mutation.
            if rewritten {
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
        } else {
            out.push(ProcessingResponse {
                dynamic_metadata: metadata,
                ..respond(Out::RequestHeaders(HeadersResponse {
                    response: Some(common),
                }))
            });
            self.headers_answered = true;
            out.extend(stream_back(&body, ends, Out::RequestBody));
        }
        self.release_body();
        Ok(out)
    }
}
