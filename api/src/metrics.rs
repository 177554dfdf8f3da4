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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FilterLabel {
    filter: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TagLabel {
    source: &'static str,
}

/// Counters and histograms of the routing service on one node.
#[derive(Debug)]
pub struct ApiMetrics {
    decisions: Family<OutcomeLabel, Counter>,
    latency: Histogram,
    usage_reports: Family<OutcomeLabel, Counter>,
    filtered: Family<FilterLabel, Counter>,
    tags: Family<TagLabel, Counter>,
    picker: Family<OutcomeLabel, Counter>,
    limits: Family<LimitLabel, Counter>,
    below_round_trip: Counter,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            // 10 us .. ~80 ms
            latency: Histogram::new(exponential_buckets(0.000_01, 2.0, 14)),
            usage_reports: Family::default(),
            filtered: Family::default(),
            tags: Family::default(),
            picker: Family::default(),
            limits: Family::default(),
            below_round_trip: Counter::default(),
        }
    }
}

/// The outcomes each family counts, present (at 0) from the start: a dashboard's rate of a
/// series that does not exist yet is no rate at all.
const DECISIONS: &[&str] = &[
    "routed",
    "invalid_request",
    "unknown_model",
    "no_capacity",
    "policy",
    "rate_limited",
];
const USAGE_REPORTS: &[&str] = &[
    "known",
    "unknown",
    "first_token",
    "forwarded",
    "not_forwarded",
    "ledger",
];
const PICKER: &[&str] = &[
    "routed",
    "provider",
    "invalid_request",
    "unknown_model",
    "no_capacity",
    "policy",
    "rate_limited",
    "unavailable",
    "no_address",
    "body_too_large",
    "picker_busy",
    "served_elsewhere",
    "permission_denied",
    "bad_origin",
];

impl ApiMetrics {
    pub fn register(&self, registry: &mut Registry) {
        for (family, outcomes) in [
            (&self.decisions, DECISIONS),
            (&self.usage_reports, USAGE_REPORTS),
            (&self.picker, PICKER),
        ] {
            for &outcome in outcomes {
                let _created = family.get_or_create(&OutcomeLabel { outcome });
            }
        }
        for &limit in crate::limits::LIMIT_NAMES {
            let _created = self.limits.get_or_create(&LimitLabel { limit });
        }
        registry.register(
            "kvplane_limit_hits",
            "Calls refused (or, for in_flight_requests, requests forgotten) for going over a [limits] bound, by the bound's name",
            self.limits.clone(),
        );
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
            "ReportUsage calls: final reports of requests routed here (known), first-token reports of them (first_token), and reports of requests this replica does not know (unknown)",
            self.usage_reports.clone(),
        );
        registry.register(
            "kvplane_ttft_reports_below_round_trip",
            "First-token reports of requests sent to another cluster observed sooner than the round trip added to their prediction (the configured or measured round trip is longer than the link): the engine model learns nothing from them",
            self.below_round_trip.clone(),
        );
        registry.register(
            "kvplane_route_filtered_candidates",
            "Candidates a Route decision's filters removed, by filter",
            self.filtered.clone(),
        );
        registry.register(
            "kvplane_route_tags",
            "Tags of routed requests, by where they came from (request, header, or the tagger rule)",
            self.tags.clone(),
        );
        registry.register(
            "kvplane_picker_requests",
            "Requests through the Envoy endpoint picker, by outcome (routed, provider, the refusal, unavailable, served_elsewhere: the proxy reported another endpoint served, bad_origin: its stream's origin metadata was unreadable)",
            self.picker.clone(),
        );
    }

    /// Counts one call over the bound `limit` (a [`crate::limits::LIMIT_NAMES`] name).
    pub fn limit_hit(&self, limit: &'static str) {
        self.limits.get_or_create(&LimitLabel { limit }).inc();
    }

    /// Counts the filters that removed candidates and the sources of the tags of a decision.
    pub(crate) fn stages(&self, d: &crate::Decision<'_>) {
        // Counted per filter first: one metric update per filter that refused, not per
        // candidate.
        let mut by: Vec<(kvplane_policy::FilterId, u64)> = Vec::new();
        for f in d.candidates.iter().filter_map(|c| c.filtered.as_ref()) {
            match by.iter_mut().find(|(id, _)| *id == f.by) {
                Some((_, n)) => *n += 1,
                None => by.push((f.by, 1)),
            }
        }
        for (id, n) in by {
            self.filtered
                .get_or_create(&FilterLabel { filter: id.0 })
                .inc_by(n);
        }
        for s in &d.tags.sources {
            let source = match s {
                crate::pipeline::TagSource::Request => "request",
                crate::pipeline::TagSource::Header(_) => "header",
                crate::pipeline::TagSource::Tagger(rule, _) => rule,
            };
            self.tags.get_or_create(&TagLabel { source }).inc();
        }
    }

    pub(crate) fn decision(&self, outcome: &'static str, seconds: f64) {
        self.decisions
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
        self.latency.observe(seconds);
    }

    /// A first-token report observed sooner than the round trip its prediction added.
    pub(crate) fn below_round_trip(&self) {
        self.below_round_trip.inc();
    }

    /// First-token reports observed sooner than their added round trip so far.
    pub fn reports_below_round_trip(&self) -> u64 {
        self.below_round_trip.get()
    }

    /// An endpoint picker request's outcome.
    pub(crate) fn picker(&self, outcome: &'static str) {
        self.picker.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Endpoint picker requests so far with this outcome.
    pub fn picker_requests(&self, outcome: &'static str) -> u64 {
        self.picker.get_or_create(&OutcomeLabel { outcome }).get()
    }

    /// A usage report: `known` (a final report of a request routed here), `first_token` (a
    /// first-token report of one) or `unknown`.
    pub(crate) fn usage(&self, outcome: &'static str) {
        self.usage_reports
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Usage reports so far with this outcome (`known`, `unknown`, `first_token`).
    pub fn usage_reports(&self, outcome: &'static str) -> u64 {
        self.usage_reports
            .get_or_create(&OutcomeLabel { outcome })
            .get()
    }

    /// Decisions so far with this outcome.
    pub fn decisions(&self, outcome: &'static str) -> u64 {
        self.decisions
            .get_or_create(&OutcomeLabel { outcome })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_has_a_series_before_its_first_event() {
        let m = ApiMetrics::default();
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        for line in [
            r#"kvplane_route_decisions_total{outcome="rate_limited"} 0"#,
            r#"kvplane_usage_reports_total{outcome="forwarded"} 0"#,
            r#"kvplane_picker_requests_total{outcome="picker_busy"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
