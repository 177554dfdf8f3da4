//! Stage 6, filter: the rule's filters (see [`kvplane_policy::filters`]) remove candidates,
//! each with its filter's id and words; when none is left and the rule says `Fallback`, its
//! fallback targets are filtered too (without the load limits).

use kvplane_policy::kinds::{EmptyAction, Rule};
use kvplane_policy::{Candidate, Catalog, Fleet, Request, Resolved, Signals, filters};

/// Filters `cands`; adds the fallback's when nothing is left. Returns the explanation
/// (`explain`: the words of every refusal and of the stage; nothing is formatted otherwise).
#[allow(clippy::too_many_arguments)]
pub(crate) fn filter<'v>(
    catalog: &'v Catalog,
    fleet: &dyn Fleet<'v>,
    req: &Request<'_>,
    resolved: &Resolved<'_>,
    rule: &Rule,
    signals: Signals,
    explain: bool,
    cands: &mut Vec<Candidate<'v>>,
) -> Vec<String> {
    let mut steps = Vec::new();
    let preferred = filters::apply(catalog, &rule.filter, req, cands, false, explain);
    let survivors = cands.iter().filter(|c| c.filtered.is_none()).count();
    if explain {
        steps.extend(preferred);
        steps.push(format!(
            "{survivors} of {} candidates pass the filter",
            cands.len()
        ));
    }
    if survivors == 0 && rule.on_empty.action == EmptyAction::Fallback {
        let mut fb =
            catalog.candidates(fleet, req, resolved, &rule.on_empty.fallback, true, signals);
        let preferred = filters::apply(catalog, &rule.filter, req, &mut fb, true, explain);
        if explain {
            steps.push(format!(
                "nothing left: falling back to {} candidates ({} pass)",
                fb.len(),
                fb.iter().filter(|c| c.filtered.is_none()).count()
            ));
            steps.extend(preferred);
        }
        cands.extend(fb);
    }
    steps
}
