//! Stage 9, admit: a routed request is charged to every tenant limit that matches it, from
//! this replica's escrow (see [`crate::quota`]); a refusal replaces the decision. A request
//! that goes to an `InferenceProvider` with a `rateLimit` is charged to that provider's budget
//! too (one budget for every tenant, kept by the same ledger); when the provider has none left
//! the request goes to the next alternative that has, and is refused when none has.

use kvplane_policy::{LimitKey, MatchedLimit, Target};
use tracing::Instrument;
use tracing::field::Empty;

use super::{Decision, Outcome, Reject};
use crate::quota::{Escrow, Refusal, Reservation};

pub(crate) async fn admit(escrow: Option<&Escrow>, d: &mut Decision<'_>) -> Vec<Reservation> {
    let Some(escrow) = escrow else {
        return Vec::new();
    };
    if !matches!(d.outcome, Outcome::Routed(_)) {
        return Vec::new();
    }
    let limits = d.view.catalog.limits_for(&d.tenant, &d.prompted.model);
    if limits.is_empty() && !chosen_provider_limited(d) {
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
    let mut reserved = if limits.is_empty() {
        Vec::new()
    } else {
        let r = escrow
            .reserve(&limits, tokens)
            .instrument(span.clone())
            .await;
        match r {
            Ok(r) => r,
            Err(refusal) => {
                span.record("outcome", "rate_limited");
                refuse(d, &refusal, None);
                return Vec::new();
            }
        }
    };
    match provider_budget(escrow, d, tokens)
        .instrument(span.clone())
        .await
    {
        Ok(r) => {
            span.record("outcome", "admitted");
            reserved.extend(r);
            reserved
        }
        Err((refusal, provider)) => {
            span.record("outcome", "rate_limited");
            // The tenant's reservation was for a request that does not run.
            escrow.settle(&reserved, 0);
            refuse(d, &refusal, Some(&provider));
            Vec::new()
        }
    }
}

/// Whether the chosen candidate is a provider with a `rateLimit`.
fn chosen_provider_limited(d: &Decision<'_>) -> bool {
    let Some(Target::Provider { name, .. }) = d.chosen().map(|c| &c.target) else {
        return false;
    };
    d.view.catalog.provider_limit(name).is_some()
}

/// Charges the chosen provider's budget, moving the decision to the next alternative while the
/// chosen one is a provider with none left; the refusal of the last one tried otherwise.
async fn provider_budget(
    escrow: &Escrow,
    d: &mut Decision<'_>,
    tokens: u64,
) -> Result<Vec<Reservation>, (Refusal, String)> {
    loop {
        let Some(Target::Provider { name, .. }) = d.chosen().map(|c| &c.target) else {
            return Ok(Vec::new());
        };
        let name = (*name).to_owned();
        let Some(limit) = d.view.catalog.provider_limit(&name) else {
            return Ok(Vec::new());
        };
        let matched = [MatchedLimit {
            key: LimitKey::provider(&name),
            limit: &limit,
        }];
        match escrow.reserve(&matched, tokens).await {
            Ok(r) => return Ok(r),
            Err(refusal) if d.alternatives.is_empty() => return Err((refusal, name)),
            Err(_) => {
                let (next, model) = d.alternatives.remove(0);
                d.outcome = Outcome::Routed(next);
                d.model = model;
            }
        }
    }
}

fn refuse(d: &mut Decision<'_>, refusal: &Refusal, provider: Option<&str>) {
    let reason = match provider {
        Some(p) => format!("provider {p:?} has no capacity left: {refusal}"),
        None => refusal.to_string(),
    };
    d.outcome = Outcome::Rejected {
        kind: Reject::RateLimited,
        reason,
        retry_after_ms: refusal.retry_after_ms(),
    };
}
