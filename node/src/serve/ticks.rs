//! A leader's periodic task: a tick every period until its term ends.

use std::time::Duration;

use tokio::sync::watch;

/// Ticks every `period` (a late tick is not made up) until the term ends.
pub(super) struct TermTicks {
    tick: tokio::time::Interval,
    /// Set when the term ends (see `LeadIngest`).
    pub(super) term_end: watch::Receiver<bool>,
}

impl TermTicks {
    /// The first tick is at once.
    pub(super) fn new(period: Duration, term_end: watch::Receiver<bool>) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self { tick, term_end }
    }

    /// Waits for the next tick: `false` once the term ended.
    pub(super) async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.tick.tick() => true,
            _ = self.term_end.wait_for(|ended| *ended) => false,
        }
    }
}
