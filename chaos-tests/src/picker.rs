//! A client playing Envoy in front of the members' endpoint picker (ext_proc, the Gateway API
//! Inference Extension's protocol): per request one stream - its headers, its body whole
//! (Envoy's buffered mode), the pick or a refusal; then the engine's answer headers and body
//! with its usage, which settle the request's reservation. Built from Envoy's own protos.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request as In, processing_response::Response as Out,
};
use kvplane_testkit::ext_proc::{header_map, message};
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

use crate::history::{Admission, PICKER, RouteOutcome, Shared, record};
use crate::workload::{MAX_OUTPUT, PROMPT, miss, now_ms, prompt_ids};

/// How a request's exchange with the picker ended.
enum Picked {
    /// An engine was picked and the answer's usage sent back.
    Routed,
    RateLimited,
    /// Refused otherwise, or the stream failed: why.
    Missed(String),
}

/// Requests of `tenant` through the picker of the members at `endpoints`, one at a time, the
/// next member after a failure.
pub async fn client(
    endpoints: Vec<String>,
    tenant: &'static str,
    history: Shared,
    stop: watch::Receiver<bool>,
) {
    let mut n = 0u64;
    let mut member = 0usize;
    let mut picker: Option<ExternalProcessorClient<Channel>> = None;
    while !*stop.borrow() {
        n += 1;
        let (sent, sent_ms) = (Instant::now(), now_ms());
        let c = match picker.as_mut() {
            Some(c) => c,
            None => match Channel::from_shared(endpoints[member].clone()) {
                Ok(e) => picker.insert(ExternalProcessorClient::new(e.connect_lazy())),
                Err(e) => {
                    miss(&history, PICKER, tenant, sent, e.to_string());
                    return;
                }
            },
        };
        let id = format!("{tenant}-picker-{n}");
        let asked = tokio::time::timeout(Duration::from_secs(5), exchange(c, tenant, &id, n));
        let picked = asked
            .await
            .unwrap_or_else(|_| Picked::Missed("no answer within 5 s".into()));
        let outcome = match picked {
            Picked::Routed => {
                let done_ms = now_ms();
                record(&history, |h| {
                    h.admissions.push(Admission {
                        tenant,
                        tokens: u64::from(PROMPT + USED_OUTPUT),
                        sent_ms,
                        done_ms,
                        charged_window_ms: None,
                    });
                });
                RouteOutcome::Routed
            }
            Picked::RateLimited => RouteOutcome::RateLimited,
            Picked::Missed(why) => {
                miss(
                    &history,
                    PICKER,
                    tenant,
                    sent,
                    format!("member {member}: {why}"),
                );
                picker = None;
                member = (member + 1) % endpoints.len();
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        record(&history, |h| {
            *h.routes.entry((PICKER, tenant, outcome)).or_default() += 1;
        });
        if outcome == RouteOutcome::RateLimited {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The output the engine's answer says it used (half of what was asked).
const USED_OUTPUT: u32 = MAX_OUTPUT / 2;

/// One request's stream: headers, body, the pick; the answer's headers and body.
async fn exchange(
    c: &mut ExternalProcessorClient<Channel>,
    tenant: &str,
    id: &str,
    n: u64,
) -> Picked {
    let (tx, rx) = mpsc::channel::<ProcessingRequest>(4);
    let out = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    // The stream's deadline, as Envoy's `message_timeout` bounds it: a paused member does not
    // pick for a client that gave up.
    let mut stream = tonic::Request::new(out);
    stream.set_timeout(Duration::from_secs(5));
    let mut answers = match c.process(stream).await {
        Ok(r) => r.into_inner(),
        Err(e) => return Picked::Missed(e.to_string()),
    };
    let body = serde_json::json!({
        "model": "m",
        "prompt": prompt_ids(n),
        "max_tokens": MAX_OUTPUT,
    })
    .to_string();
    let headers = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered.into(),
            response_body_mode: BodySendMode::Buffered.into(),
            send_body_without_waiting_for_header_response: false,
        }),
        ..message(In::RequestHeaders(HttpHeaders {
            headers: header_map(&[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
                ("x-request-id", id),
                ("x-tenant", tenant),
            ]),
            end_of_stream: false,
            ..Default::default()
        }))
    };
    let steps = [
        headers,
        message(In::RequestBody(HttpBody {
            body: body.into_bytes(),
            end_of_stream: true,
            ..Default::default()
        })),
        message(In::ResponseHeaders(HttpHeaders {
            headers: header_map(&[(":status", "200"), ("content-type", "application/json")]),
            end_of_stream: false,
            ..Default::default()
        })),
        message(In::ResponseBody(HttpBody {
            body: serde_json::json!({
                "id": id,
                "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": PROMPT, "completion_tokens": USED_OUTPUT},
            })
            .to_string()
            .into_bytes(),
            end_of_stream: true,
            ..Default::default()
        })),
    ];
    let mut picked = false;
    for (i, step) in steps.into_iter().enumerate() {
        if tx.send(step).await.is_err() {
            return Picked::Missed(format!("the stream closed before step {i}"));
        }
        let answer = match answers.message().await {
            Ok(Some(ProcessingResponse {
                response: Some(a), ..
            })) => a,
            Ok(_) => return Picked::Missed(format!("no answer to step {i}")),
            Err(e) => return Picked::Missed(e.to_string()),
        };
        match answer {
            Out::ImmediateResponse(r) => {
                let code = r.status.map_or(0, |s| s.code);
                return if code == 429 {
                    Picked::RateLimited
                } else {
                    Picked::Missed(format!(
                        "answered {code}: {}",
                        String::from_utf8_lossy(&r.body)
                    ))
                };
            }
            // The body's answer carries the pick (buffered mode).
            Out::RequestBody(b) => {
                // One of the engines, at the address its bridge announced.
                picked = b.response.and_then(|c| c.header_mutation).is_some_and(|m| {
                    m.set_headers.iter().any(|o| {
                        o.header.as_ref().is_some_and(|h| {
                            h.key == "x-gateway-destination-endpoint"
                                && h.raw_value.starts_with(b"127.0.0.1:")
                        })
                    })
                });
                if !picked {
                    return Picked::Missed("the body's answer named no engine".into());
                }
            }
            _ => {}
        }
    }
    if picked {
        Picked::Routed
    } else {
        Picked::Missed("no pick".into())
    }
}
