//! `minimize: Load`: running plus waiting requests on the worker (providers count 0).

use super::ObjectiveUnit;
use crate::candidate::{Candidate, Signals};
use crate::kinds::Objective;

pub(super) struct Load;

impl ObjectiveUnit for Load {
    fn objective(&self) -> Objective {
        Objective::Load
    }

    fn label(&self) -> &'static str {
        "load"
    }

    fn needs(&self) -> Signals {
        Signals::NONE
    }

    fn score(&self, c: &Candidate) -> f64 {
        f64::from(c.load)
    }
}
