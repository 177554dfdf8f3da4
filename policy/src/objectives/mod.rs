//! Objectives a rule minimizes (`minimize`): each a unit in its own file with the signals it
//! reads and its score of a candidate (lower wins; divided by the backend weight).
//!
//! Adding one: a variant of [`crate::kinds::Objective`], a file here implementing
//! [`ObjectiveUnit`], its line in [`REGISTERED`] and its arm in [`unit`].

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

/// The unit of `o` (a match: a new variant without its unit does not compile).
pub fn unit(o: Objective) -> &'static dyn ObjectiveUnit {
    match o {
        Objective::PredictedTTFT => &predicted_ttft::PredictedTtft,
        Objective::Cost => &cost::Cost,
        Objective::Load => &load::Load,
    }
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
    fn every_registered_unit_is_the_unit_of_its_objective_once() {
        for u in REGISTERED {
            let o = u.objective();
            assert_eq!(unit(o).label(), u.label());
            assert_eq!(REGISTERED.iter().filter(|x| x.objective() == o).count(), 1);
        }
        // Every variant is registered (a new variant makes this match fail to compile, so the
        // list below is kept whole).
        for o in [Objective::PredictedTTFT, Objective::Cost, Objective::Load] {
            match o {
                Objective::PredictedTTFT | Objective::Cost | Objective::Load => {}
            }
            assert!(REGISTERED.iter().any(|u| u.objective() == o), "{o:?}");
        }
        let labels: std::collections::BTreeSet<&str> =
            REGISTERED.iter().map(|u| u.label()).collect();
        assert_eq!(labels.len(), REGISTERED.len(), "labels are unique");
    }
}
