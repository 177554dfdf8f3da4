//! Stage 9, admit: a routed request is charged to every tenant limit that matches it, from
//! this replica's escrow (see [`crate::quota`]); a refusal replaces the decision. A request
//! that goes to an `InferenceProvider` with a `rateLimit` is charged to that provider's budget
//! too, in the same all-or-nothing reservation (one budget for every tenant, kept by the same
//! ledger); when the provider has none left the request goes to the next alternative, and is
//! refused when none has. Providers with a budget are not offered as alternatives to retry on:
//! a gateway's retry there would not be charged.

use kvplane_policy::{LimitKey, MatchedLimit, Target, kinds::TenantLimit};
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
    let catalog = &d.view.catalog;
    let tenant = catalog.limits_for(&d.tenant, &d.prompted.model);
    let tokens = escrow.tokens_for(d.prompted.total_tokens(), d.prompted.max_tokens);
    let span = tracing::debug_span!(
        "quota.admit",
        tenant = %d.tenant,
        limits = tenant.len(),
        tokens,
        outcome = Empty
    );
    loop {
        let provider = d.chosen().and_then(|c| provider_limit(catalog, &c.target));
        if tenant.is_empty() && provider.is_none() {
            d.alternatives
                .retain(|(j, _)| !budgeted(catalog, &d.candidates[*j].target));
            return Vec::new();
        }
        let mut limits = tenant.clone();
        if let Some((key, limit)) = &provider {
            limits.push(MatchedLimit {
                key: key.clone(),
                limit,
            });
        }
        let reserved = escrow
            .reserve(&limits, tokens)
            .instrument(span.clone())
            .await;
        match reserved {
            Ok(r) => {
                span.record("outcome", "admitted");
                d.alternatives
                    .retain(|(j, _)| !budgeted(catalog, &d.candidates[*j].target));
                return r;
            }
            // The provider has no budget left here (nor granted in time): the next one.
            Err(refusal) if !refusal.key().provider.is_empty() && !d.alternatives.is_empty() => {
                tracing::debug!(%refusal, "trying the next alternative");
                let (next, model) = d.alternatives.remove(0);
                d.outcome = Outcome::Routed(next);
                d.model = model;
            }
            Err(refusal) => {
                span.record("outcome", "rate_limited");
                refuse(d, &refusal);
                return Vec::new();
            }
        }
    }
}

/// Whether `target` is a provider with a `rateLimit` (a gateway's retry there would not be
/// charged).
fn budgeted(catalog: &kvplane_policy::Catalog, target: &Target<'_>) -> bool {
    matches!(target, Target::Provider { name, .. } if catalog.provider_limited(name))
}

/// The budget key and limit of `target`, when it is a provider with a `rateLimit`.
fn provider_limit(
    catalog: &kvplane_policy::Catalog,
    target: &Target<'_>,
) -> Option<(LimitKey, TenantLimit)> {
    let Target::Provider { name, .. } = target else {
        return None;
    };
    let limit = catalog.provider_limit(name)?;
    Some((LimitKey::provider(name), limit))
}

fn refuse(d: &mut Decision<'_>, refusal: &Refusal) {
    let key = refusal.key();
    let reason = if key.provider.is_empty() {
        refusal.to_string()
    } else {
        format!(
            "provider {:?} has no capacity left: {refusal}",
            key.provider
        )
    };
    d.outcome = Outcome::Rejected {
        kind: Reject::RateLimited,
        reason,
        retry_after_ms: refusal.retry_after_ms(),
    };
}
