//! Per-tenant admission metrics of one replica (Prometheus).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Tenant {
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantReason {
    tenant: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Debug, Clone)]
pub struct QuotaMetrics {
    admitted_requests: Family<Tenant, Counter>,
    reserved_tokens: Family<Tenant, Counter>,
    fail_open_tokens: Family<Tenant, Counter>,
    rejected_requests: Family<TenantReason, Counter>,
    rejected_tokens: Family<TenantReason, Counter>,
    settled_tokens: Family<Tenant, Counter>,
    refunded_tokens: Family<Tenant, Counter>,
    released_tokens: Family<Tenant, Counter>,
    escrow_tokens: Family<Tenant, Gauge>,
    grants: Family<Outcome, Counter>,
    grant_latency: Histogram,
}

impl Default for QuotaMetrics {
    fn default() -> Self {
        Self {
            admitted_requests: Family::default(),
            reserved_tokens: Family::default(),
            fail_open_tokens: Family::default(),
            rejected_requests: Family::default(),
            rejected_tokens: Family::default(),
            settled_tokens: Family::default(),
            refunded_tokens: Family::default(),
            released_tokens: Family::default(),
            escrow_tokens: Family::default(),
            grants: Family::default(),
            // 100 us .. ~3 s
            grant_latency: Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
        }
    }
}

fn tenant(t: &str) -> Tenant {
    Tenant {
        tenant: t.to_owned(),
    }
}

impl QuotaMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_quota_admitted_requests",
            "Requests admitted under tenant limits",
            self.admitted_requests.clone(),
        );
        r.register(
            "kvplane_quota_reserved_tokens",
            "Tokens reserved at admission (prompt plus maximum output)",
            self.reserved_tokens.clone(),
        );
        r.register(
            "kvplane_quota_fail_open_tokens",
            "Tokens admitted without a grant under a fail-open allowance",
            self.fail_open_tokens.clone(),
        );
        r.register(
            "kvplane_quota_rejected_requests",
            "Requests refused by tenant limits, by reason (exhausted, no_grant)",
            self.rejected_requests.clone(),
        );
        r.register(
            "kvplane_quota_rejected_tokens",
            "Tokens of the requests refused by tenant limits, by reason",
            self.rejected_tokens.clone(),
        );
        r.register(
            "kvplane_quota_settled_tokens",
            "Tokens charged when usage was reported",
            self.settled_tokens.clone(),
        );
        r.register(
            "kvplane_quota_refunded_tokens",
            "Reserved tokens returned to the escrow when usage was reported",
            self.refunded_tokens.clone(),
        );
        r.register(
            "kvplane_quota_released_tokens",
            "Escrow tokens this replica released (unused, idle) back to the window, by tenant",
            self.released_tokens.clone(),
        );
        r.register(
            "kvplane_quota_escrow_tokens",
            "Tokens this replica holds and has not spent in the current window",
            self.escrow_tokens.clone(),
        );
        r.register(
            "kvplane_quota_grant_attempts",
            "Grant entries proposed, by outcome",
            self.grants.clone(),
        );
        r.register(
            "kvplane_quota_grant_duration_seconds",
            "Time from proposing a grant entry to applying it here",
            self.grant_latency.clone(),
        );
    }

    pub(crate) fn admitted(&self, t: &str, tokens: u64, fail_open: bool) {
        self.admitted_requests.get_or_create(&tenant(t)).inc();
        self.reserved_tokens
            .get_or_create(&tenant(t))
            .inc_by(tokens);
        if fail_open {
            self.fail_open_tokens
                .get_or_create(&tenant(t))
                .inc_by(tokens);
        }
    }

    pub(crate) fn rejected(&self, t: &str, reason: &'static str, tokens: u64) {
        let label = TenantReason {
            tenant: t.to_owned(),
            reason,
        };
        self.rejected_requests.get_or_create(&label).inc();
        self.rejected_tokens.get_or_create(&label).inc_by(tokens);
    }

    pub(crate) fn settled(&self, t: &str, charged: u64, refunded: u64) {
        self.settled_tokens
            .get_or_create(&tenant(t))
            .inc_by(charged);
        self.refunded_tokens
            .get_or_create(&tenant(t))
            .inc_by(refunded);
    }

    pub(crate) fn released(&self, t: &str, tokens: u64) {
        self.released_tokens
            .get_or_create(&tenant(t))
            .inc_by(tokens);
    }

    pub(crate) fn escrow(&self, t: &str, tokens: u64) {
        self.escrow_tokens
            .get_or_create(&tenant(t))
            .set(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    pub(crate) fn grant(&self, seconds: f64, ok: bool) {
        self.grant_latency.observe(seconds);
        let outcome = if ok { "applied" } else { "failed" };
        self.grants.get_or_create(&Outcome { outcome }).inc();
    }
}
