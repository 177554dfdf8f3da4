//! Stage 9, admit: a routed request is charged to every tenant limit that matches it, from
//! this replica's escrow (see [`crate::quota`]); a refusal replaces the decision.

use tracing::Instrument;
use tracing::field::Empty;

use super::{Decision, Outcome, Reject};
use crate::quota::{Escrow, Reservation};

pub(crate) async fn admit(escrow: Option<&Escrow>, d: &mut Decision<'_>) -> Vec<Reservation> {
    let Some(escrow) = escrow else {
        return Vec::new();
    };
    if !matches!(d.outcome, Outcome::Routed(_)) {
        return Vec::new();
    }
    let limits = d.view.catalog.limits_for(&d.tenant, &d.prompted.model);
    if limits.is_empty() {
        return Vec::new();
    }
    let tokens = escrow.tokens_for(d.prompted.total_tokens(), d.prompted.max_tokens);
    let span = tracing::debug_span!(
        "quota.admit",
        tenant = %d.tenant,
        limits = limits.len(),
        tokens,
        outcome = Empty
    );
    let reserved = escrow
        .reserve(&limits, tokens)
        .instrument(span.clone())
        .await;
    span.record(
        "outcome",
        if reserved.is_ok() {
            "admitted"
        } else {
            "rate_limited"
        },
    );
    match reserved {
        Ok(r) => r,
        Err(refusal) => {
            d.outcome = Outcome::Rejected {
                kind: Reject::RateLimited,
                reason: refusal.to_string(),
                retry_after_ms: refusal.retry_after_ms(),
            };
            Vec::new()
        }
    }
}
