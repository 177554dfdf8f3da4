//! Stage 4, rule: the first rule of the attached policies whose `match` holds (tenants,
//! requested models, tags, pool state), else the default rule (minimize predicted TTFT over
//! the model's worker sets); see [`kvplane_policy::Catalog::select_rule`].

use kvplane_policy::{Catalog, Fleet, Request, Resolved, RuleChoice};

pub(crate) fn rule<'a, 'v>(
    catalog: &'a Catalog,
    resolved: &Resolved<'a>,
    fleet: &dyn Fleet<'v>,
    req: &Request<'_>,
) -> RuleChoice<'a> {
    catalog.select_rule(resolved, fleet, req)
}

/// Explain's words for the choice.
pub(crate) fn describe(choice: &RuleChoice<'_>) -> String {
    match choice.id {
        Some(_) => format!(
            "rule {} applies (minimize {:?})",
            choice.name(),
            choice.rule.minimize
        ),
        None => "no rule matches: the default rule (minimize PredictedTTFT)".into(),
    }
}
