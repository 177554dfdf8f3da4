//! Objectives a rule minimizes (`minimize`): each a unit in its own file with the signals it
//! reads and its score of a candidate (lower wins; divided by the backend weight).
//!
//! Adding one: a variant of [`crate::kinds::Objective`], a file here implementing
//! [`ObjectiveUnit`], and one line in [`REGISTERED`].

mod cost;
mod load;
mod predicted_ttft;

use crate::candidate::{Candidate, Signals};
use crate::kinds::Objective;

pub trait ObjectiveUnit: Sync {
    fn objective(&self) -> Objective;
    /// Its metric label and name in Explain.
    fn label(&self) -> &'static str;
    fn needs(&self) -> Signals;
    /// The raw score of `c` (before the backend weight).
    fn score(&self, c: &Candidate) -> f64;
}

pub static REGISTERED: &[&dyn ObjectiveUnit] =
    &[&predicted_ttft::PredictedTtft, &cost::Cost, &load::Load];

/// The unit of `o`.
pub fn unit(o: Objective) -> &'static dyn ObjectiveUnit {
    REGISTERED
        .iter()
        .copied()
        .find(|u| u.objective() == o)
        .unwrap_or(&predicted_ttft::PredictedTtft)
}

/// Scores every candidate: `objective = score / weight`.
pub fn score(o: Objective, cands: &mut [Candidate]) {
    let u = unit(o);
    for c in cands {
        c.objective = u.score(c) / c.weight;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_objective_has_exactly_one_unit() {
        for o in [Objective::PredictedTTFT, Objective::Cost, Objective::Load] {
            let n = REGISTERED.iter().filter(|u| u.objective() == o).count();
            assert_eq!(n, 1, "{o:?}");
            assert_eq!(unit(o).objective(), o);
        }
    }
}
