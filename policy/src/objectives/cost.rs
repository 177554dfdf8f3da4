//! `minimize: Cost`: the token price of the request on the candidate.

use super::ObjectiveUnit;
use crate::candidate::{Candidate, Signals};
use crate::kinds::Objective;

pub(super) struct Cost;

impl ObjectiveUnit for Cost {
    fn objective(&self) -> Objective {
        Objective::Cost
    }

    fn label(&self) -> &'static str {
        "cost"
    }

    fn needs(&self) -> Signals {
        Signals::NONE
    }

    fn score(&self, c: &Candidate) -> f64 {
        c.price
    }
}
