//! Where a run put its prefixes: how many prefix/engine pairs it made (a prefix kept on the
//! engines that hold it makes few; one sprayed over the fleet, many) and the prefix-cache hit
//! rate in each window of arrivals, from the answers' own usage.

use kvplane_sim::workload::WorkItem;
use serde::Serialize;

use crate::client::Outcome;

/// The hit-rate windows' width in ms of the workload's schedule.
pub(super) const WINDOW_MS: f64 = 10_000.0;

#[derive(Debug, Clone, Serialize)]
pub(super) struct Placement {
    /// Distinct (prefix, engine) pairs among answered requests that have a prefix family and
    /// name their engine (kvplane's gateways do, in both modes); 0 when none do.
    pub(super) prefix_engine_pairs: usize,
    /// Cached over prompt tokens of the requests arriving in each window, in order (NaN for a
    /// window without answered requests).
    pub(super) window_hit_rates: Vec<f64>,
    /// The lowest of them.
    pub(super) lowest_window_hit_rate: f64,
}

/// `outcomes[i]` is the answer to `items[i]`.
pub(super) fn placement(items: &[WorkItem], outcomes: &[Outcome]) -> Placement {
    let mut pairs: Vec<(usize, &str)> = items
        .iter()
        .zip(outcomes)
        .filter(|(_, o)| o.ok() && !o.worker.is_empty())
        .filter_map(|(i, o)| Some((i.family?, o.worker.as_str())))
        .collect();
    pairs.sort_unstable();
    pairs.dedup();
    let windows = items
        .last()
        .map_or(0, |i| (i.at_ms / WINDOW_MS).floor() as usize + 1);
    let mut tokens = vec![(0u64, 0u64); windows];
    for (i, o) in items.iter().zip(outcomes).filter(|(_, o)| o.ok()) {
        let w = &mut tokens[(i.at_ms / WINDOW_MS).floor() as usize];
        w.0 += o.cached_tokens;
        w.1 += o.prompt_tokens;
    }
    let window_hit_rates: Vec<f64> = tokens
        .iter()
        .map(|&(cached, prompt)| {
            if prompt == 0 {
                f64::NAN
            } else {
                cached as f64 / prompt as f64
            }
        })
        .collect();
    Placement {
        prefix_engine_pairs: pairs.len(),
        lowest_window_hit_rate: window_hit_rates
            .iter()
            .copied()
            .filter(|r| r.is_finite())
            .fold(f64::NAN, f64::min),
        window_hit_rates,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(at_ms: f64, family: Option<usize>) -> WorkItem {
        WorkItem {
            at_ms,
            family,
            system: String::new(),
            history: Vec::new(),
            question: String::new(),
            max_tokens: 1,
        }
    }

    fn answer(worker: &str, prompt: u64, cached: u64) -> Outcome {
        Outcome {
            ttft_ms: 1.0,
            worker: worker.into(),
            status: 200,
            prompt_tokens: prompt,
            cached_tokens: cached,
        }
    }

    #[test]
    fn pairs_count_each_prefix_on_each_engine_once_and_windows_split_by_arrival() {
        let items = [
            item(0.0, Some(1)),
            item(1_000.0, Some(1)),
            item(2_000.0, Some(2)),
            item(12_000.0, Some(1)),
            item(25_000.0, None),
        ];
        let outcomes = [
            answer("ws/e0", 100, 0),
            answer("ws/e0", 100, 90),
            answer("ws/e1", 100, 0),
            answer("ws/e2", 100, 50),
            answer("ws/e1", 100, 0),
        ];
        let p = placement(&items, &outcomes);
        // (1, e0), (2, e1), (1, e2); the request without a family makes none.
        assert_eq!(p.prefix_engine_pairs, 3);
        assert_eq!(p.window_hit_rates, [0.3, 0.5, 0.0]);
        assert_eq!(p.lowest_window_hit_rate, 0.0);
        // A failed answer counts in neither.
        let mut failed = outcomes.clone();
        failed[3].status = 0;
        let p = placement(&items, &failed);
        assert_eq!(p.prefix_engine_pairs, 2);
        assert!(p.window_hit_rates[1].is_nan());
    }
}
