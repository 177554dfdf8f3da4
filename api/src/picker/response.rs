//! The answer side of an exchange: the answer's headers and body pass through (the worker
//! named in a header), read for the first token (a streamed answer's first chunk) and the
//! usage at its end, which settle the request as a gateway's reports would - once.

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders, ProcessingResponse,
    processing_response::Response as Out,
};
use kvplane_proto::v1::{Endpoint, Outcome, UsageReport};

use super::envoy::{self, header};
use super::exchange::{BodyMode, Exchange, respond, stream_back};

impl Exchange {
    pub(super) async fn response_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Vec<ProcessingResponse> {
        let headers = envoy::headers(h);
        let mut set = Vec::new();
        if let Some(r) = &mut self.routed {
            r.answered = true;
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
                // Its reports say where: the engine that served it is the one that ran it.
                r.served = Some(served);
            }
            set.push((super::WORKER_HEADER, r.label.clone()));
        }
        // The answer ends here, or its body is not sent to the picker: settled now (a body not
        // seen leaves its usage unknown).
        if h.end_of_stream || self.response_mode == BodyMode::None {
            self.finish(None).await;
        }
        vec![respond(Out::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(envoy::set_headers(set)),
                ..Default::default()
            }),
        }))]
    }

    pub(super) async fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(r) = &mut self.routed
            && !r.reported
        {
            // An error's body is no first token.
            if r.success && r.first_token_ms.is_none() && !b.body.is_empty() {
                let ms = r.at.elapsed().as_secs_f64() * 1000.0;
                r.first_token_ms = Some(ms);
                if r.streamed {
                    let report = UsageReport {
                        request_id: r.request_id.clone(),
                        observed_ttft_ms: ms,
                        first_token: true,
                        served: served_at(r.served.as_deref()),
                        ..Default::default()
                    };
                    let _ = self
                        .router
                        .report_usage_in(tonic::Request::new(report), None)
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

    /// Settles the request, once: its answer ended (`None`: with the outcome its status says)
    /// or the stream did (`Some(Cancelled)`).
    pub(crate) async fn finish(&mut self, outcome: Option<Outcome>) {
        let Some(r) = self.routed.as_mut().filter(|r| !r.reported) else {
            return;
        };
        r.reported = true;
        let outcome = outcome.unwrap_or(if r.success {
            Outcome::Success
        } else {
            Outcome::Error
        });
        let mut report = r.tail.report(
            r.request_id.clone(),
            r.first_token_ms.unwrap_or(0.0),
            outcome,
        );
        report.served = served_at(r.served.as_deref());
        let _ = self
            .router
            .report_usage_in(tonic::Request::new(report), None)
            .await;
    }
}

/// A report's `served` for the `ip:port` the proxy named (the replica finds the worker there).
fn served_at(address: Option<&str>) -> Option<Endpoint> {
    address.map(|a| Endpoint {
        address: a.to_owned(),
        ..Default::default()
    })
}
