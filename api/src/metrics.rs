//! Routing metrics (Prometheus).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Counters and histograms of the routing service on one node.
#[derive(Debug)]
pub struct ApiMetrics {
    decisions: Family<OutcomeLabel, Counter>,
    latency: Histogram,
    usage_reports: Family<OutcomeLabel, Counter>,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            // 10 us .. ~80 ms
            latency: Histogram::new(exponential_buckets(0.000_01, 2.0, 14)),
            usage_reports: Family::default(),
        }
    }
}

impl ApiMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvplane_route_decisions",
            "Route decisions, by outcome (routed or the rejection code)",
            self.decisions.clone(),
        );
        registry.register(
            "kvplane_route_duration_seconds",
            "Time to decide one Route call, tokenization included",
            self.latency.clone(),
        );
        registry.register(
            "kvplane_usage_reports",
            "ReportUsage calls, by whether the request id was known here",
            self.usage_reports.clone(),
        );
    }

    pub(crate) fn decision(&self, outcome: &'static str, seconds: f64) {
        self.decisions
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
        self.latency.observe(seconds);
    }

    pub(crate) fn usage(&self, known: bool) {
        let outcome = if known { "known" } else { "unknown" };
        self.usage_reports
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Decisions so far with this outcome.
    pub fn decisions(&self, outcome: &'static str) -> u64 {
        self.decisions
            .get_or_create(&OutcomeLabel { outcome })
            .get()
    }
}
