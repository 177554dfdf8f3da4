//! What a `route` span says about its decision (the span exists only when tracing is on).

use kvplane_proto::v1::{RejectCode, RouteResponse, route_response::Decision};
use tonic::{Response, Status};

/// Records the decision's outcome, pool, endpoint, matched blocks, predicted TTFT and quota
/// outcome on `span`.
pub(crate) fn record_route(span: &tracing::Span, answer: &Result<Response<RouteResponse>, Status>) {
    let r = match answer {
        Ok(r) => r.get_ref(),
        Err(status) => {
            span.record("outcome", tracing::field::display(status.code()));
            return;
        }
    };
    match &r.decision {
        Some(Decision::Endpoint(e)) => {
            span.record("outcome", "routed");
            span.record("pool", e.pool.as_str());
            let endpoint = if e.provider.is_empty() {
                format!("{}/{}", e.pool, e.worker_id)
            } else {
                e.provider.clone()
            };
            span.record("endpoint", endpoint.as_str());
            span.record("matched_blocks", r.matched_blocks);
            span.record("predicted_ttft_ms", r.predicted_ttft_ms);
            span.record(
                "quota",
                if r.charges.is_empty() {
                    "unlimited"
                } else {
                    "admitted"
                },
            );
        }
        Some(Decision::Rejection(x)) => {
            let code = RejectCode::try_from(x.code).unwrap_or(RejectCode::Unspecified);
            span.record("outcome", code.as_str_name());
            if code == RejectCode::RateLimited {
                span.record("quota", "rate_limited");
            }
        }
        None => {}
    }
}
