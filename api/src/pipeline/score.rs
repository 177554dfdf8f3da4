//! Stage 7, score: the rule's objective (see [`kvplane_policy::objectives`]) scores every
//! candidate, divided by its backend weight; lower wins.

use kvplane_policy::kinds::Objective;
use kvplane_policy::{Candidate, Signals, objectives};

pub(crate) fn score(objective: Objective, cands: &mut [Candidate<'_>]) {
    objectives::score(objective, cands);
}

/// What the objective reads.
pub(crate) fn needs(objective: Objective) -> Signals {
    objectives::unit(objective).needs()
}
