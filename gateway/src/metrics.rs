//! Gateway metrics (Prometheus).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StatusLabel {
    pub(crate) status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LimitLabel {
    pub(crate) limit: &'static str,
}

/// The statuses the gateway answers with itself (an engine's or provider's others pass
/// through): each has its `kvplane_gateway_requests_total{status}` series from the start.
const STATUSES: [u16; 12] = [200, 400, 403, 404, 405, 408, 413, 429, 500, 502, 503, 504];

/// The gateway's bounds, as `kvplane_gateway_limit_hits_total{limit}` names them.
pub(crate) const LIMITS: &[&str] = &[
    "body_bytes",
    "body_read_ms",
    "http_headers",
    "http_header_read_ms",
];

#[derive(Debug)]
pub struct GatewayMetrics {
    pub(crate) limits: Family<LimitLabel, Counter>,
    pub(crate) requests: Family<StatusLabel, Counter>,
    pub(crate) route_seconds: Histogram,
    pub(crate) ttft_seconds: Histogram,
    pub(crate) replica_failovers: Counter,
    pub(crate) upstream_retries: Counter,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self {
            limits: Family::default(),
            requests: Family::default(),
            route_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 14)),
            ttft_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            replica_failovers: Counter::default(),
            upstream_retries: Counter::default(),
        }
    }
}

impl GatewayMetrics {
    /// Counts one request or connection ended by the bound `limit` (one of [`LIMITS`]).
    pub(crate) fn limit_hit(&self, limit: &'static str) {
        self.limits.get_or_create(&LimitLabel { limit }).inc();
    }

    pub fn register(&self, r: &mut Registry) {
        for &limit in LIMITS {
            let _created = self.limits.get_or_create(&LimitLabel { limit });
        }
        for status in STATUSES {
            let _created = self.requests.get_or_create(&StatusLabel { status });
        }
        r.register(
            "kvplane_gateway_limit_hits",
            "Requests refused, or connections closed, for going over a bound (--max-body-bytes, --body-read-ms, --max-headers or --max-header-bytes, --header-read-ms)",
            self.limits.clone(),
        );
        r.register(
            "kvplane_gateway_requests",
            "Requests answered, by HTTP status",
            self.requests.clone(),
        );
        r.register(
            "kvplane_gateway_route_seconds",
            "Time kvplane took to decide, as the gateway saw it",
            self.route_seconds.clone(),
        );
        r.register(
            "kvplane_gateway_ttft_seconds",
            "Time from request to the first streamed byte from the engine",
            self.ttft_seconds.clone(),
        );
        r.register(
            "kvplane_gateway_replica_failovers",
            "Route calls retried on another kvplane replica",
            self.replica_failovers.clone(),
        );
        r.register(
            "kvplane_gateway_upstream_retries",
            "Requests passed to the next target (a Route answer's alternatives) because the one before did not answer",
            self.upstream_retries.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_the_gateway_answers_with_has_a_series_before_its_first_request() {
        let m = GatewayMetrics::default();
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap_or_default();
        for status in [404, 405, 413, 429, 503, 504] {
            let line = format!("kvplane_gateway_requests_total{{status=\"{status}\"}} 0");
            assert!(text.contains(&line), "{line} missing from:\n{text}");
        }
    }
}
