//! `minimize: PredictedTTFT`: the predicted time to first token as the client sees it (the
//! engine's, and the round trip to another cluster) plus what the request's uncached prefill
//! delays the requests after it there, so that a cached prefix is not given away for a
//! slightly shorter queue, nor a local engine for a remote cache that the link's delay eats.

use super::ObjectiveUnit;
use crate::candidate::{Candidate, Signals};
use crate::kinds::Objective;

pub(super) struct PredictedTtft;

impl ObjectiveUnit for PredictedTtft {
    fn objective(&self) -> Objective {
        Objective::PredictedTTFT
    }

    fn label(&self) -> &'static str {
        "predicted_ttft"
    }

    fn needs(&self) -> Signals {
        Signals::ALL
    }

    fn score(&self, c: &Candidate) -> f64 {
        c.client_ttft_ms() + c.prediction.displaced_ms
    }
}
