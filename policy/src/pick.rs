//! Picking among scored candidates: the lowest objective wins; candidates within 1% of it
//! count as equal, and of the equal workers the one a request was routed to longest ago stays
//! (round-robin where nothing else tells them apart, as on a fleet with no prefix to reuse);
//! the request's tie-break (a hash of its id) takes one of those left and the equal providers,
//! so one request always gets the same answer. Routers that share when they routed (replicas
//! gossip it) and decide in the same instant may take the same worker: the hash spreads only
//! what is still equal after the turn-taking.

use crate::candidate::Candidate;

/// Candidates whose objective is within this share of the best one count as equal.
pub const TIE: f64 = 0.01;

/// The index of the pick among the unfiltered candidates, if any is left.
pub fn pick(cands: &[Candidate<'_>], tie_break: u64) -> Option<usize> {
    let best = cands
        .iter()
        .filter(|c| c.filtered.is_none())
        .map(|c| c.objective)
        .min_by(f64::total_cmp)?;
    let near = |c: &Candidate<'_>| {
        c.filtered.is_none()
            && (c.objective == best || (best > 0.0 && c.objective <= best * (1.0 + TIE)))
    };
    // Providers take no turns: they stay among the equal ones whatever the workers' turns.
    let last = |c: &Candidate<'_>| c.worker().map(|(_, w)| w.last_routed_ms);
    let oldest = cands.iter().filter(|c| near(c)).filter_map(last).min();
    let eligible = |c: &Candidate<'_>| near(c) && last(c).is_none_or(|t| Some(t) == oldest);
    let n = cands.iter().filter(|c| eligible(c)).count();
    let k = usize::try_from(tie_break % n.max(1) as u64).unwrap_or(0);
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| eligible(c))
        .nth(k)
        .map(|(i, _)| i)
}

/// An objective for ordering: NaN (whatever its sign) after every number.
fn last_if_nan(x: f64) -> f64 {
    if x.is_nan() { f64::INFINITY } else { x }
}

/// Up to `n` unfiltered candidates other than `chosen`, lowest objective first (equal ones in
/// their order): where a request may go when the chosen one does not answer.
pub fn alternatives(cands: &[Candidate<'_>], chosen: usize, n: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(n + 1);
    for (i, c) in cands.iter().enumerate() {
        if i == chosen || c.filtered.is_some() {
            continue;
        }
        // No better than the last of `n` kept: it would go after them (most candidates).
        if best.len() == n
            && best
                .last()
                .is_none_or(|&j| last_if_nan(cands[j].objective) <= last_if_nan(c.objective))
        {
            continue;
        }
        // Insert after every kept one that is no worse: one pass, `n` kept at most.
        let at =
            best.partition_point(|&j| last_if_nan(cands[j].objective) <= last_if_nan(c.objective));
        if at < n {
            best.insert(at, i);
            best.truncate(n);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::{Target, test_worker};

    fn worker(objective: f64, last_routed_ms: u64) -> Candidate<'static> {
        Candidate {
            objective,
            ..test_worker(|s| s.last_routed_ms = last_routed_ms)
        }
    }

    #[test]
    fn of_equal_candidates_the_one_routed_to_longest_ago_wins_whatever_the_tie_break() {
        let cands = [
            worker(100.0, 30),
            worker(100.5, 10),
            worker(100.0, 20),
            worker(103.0, 0),
        ];
        for tie_break in 0..8 {
            // 103 is more than 1% worse: never equal, however long ago it was chosen.
            assert_eq!(pick(&cands, tie_break), Some(1));
        }
    }

    #[test]
    fn an_equal_provider_takes_no_turn_and_shares_the_tie_break_with_the_workers_turn() {
        let mut provider = worker(100.0, 0);
        provider.target = Target::Provider {
            name: "cloud",
            endpoint: "https://example.com",
        };
        let cands = [worker(100.0, 30), worker(100.0, 50), provider];
        let picks: Vec<_> = (0..4).filter_map(|t| pick(&cands, t)).collect();
        assert_eq!(picks, [0, 2, 0, 2]);
    }

    #[test]
    fn equal_candidates_never_routed_to_are_spread_by_the_tie_break() {
        let cands = [worker(50.0, 0), worker(50.0, 0), worker(50.0, 7)];
        let picks: Vec<_> = (0..4).filter_map(|t| pick(&cands, t)).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }

    #[test]
    fn turns_taken_as_each_pick_is_recorded_are_round_robin() {
        let mut cands = [worker(10.0, 0), worker(10.0, 0), worker(10.0, 0)];
        let mut order = Vec::new();
        for now in 1..=6u64 {
            let i = pick(&cands, 1).unwrap();
            order.push(i);
            if let Target::Worker { state, .. } = &mut cands[i].target {
                state.last_routed_ms = now;
            }
        }
        assert_eq!(order[3..], order[..3]);
        let mut first = order[..3].to_vec();
        first.sort_unstable();
        assert_eq!(first, [0, 1, 2]);
    }

    #[test]
    fn alternatives_are_the_best_unfiltered_others_as_a_full_sort_orders_them() {
        use proptest::prelude::*;
        proptest!(|(objs in proptest::collection::vec((0u8..6, any::<bool>()), 0..12), chosen in 0usize..12, n in 0usize..4)| {
            let cands: Vec<Candidate<'static>> = objs
                .iter()
                .map(|(o, filtered)| Candidate {
                    objective: f64::from(*o),
                    filtered: filtered.then(|| crate::candidate::Filtered {
                        by: crate::candidate::FilterId("test"),
                        text: String::new(),
                    }),
                    ..crate::candidate::test_worker(|_| {})
                })
                .collect();
            // The oracle: every eligible other one, sorted stably by objective, the first n.
            let mut all: Vec<usize> = (0..cands.len())
                .filter(|&i| i != chosen && cands[i].filtered.is_none())
                .collect();
            all.sort_by(|a, b| cands[*a].objective.total_cmp(&cands[*b].objective));
            all.truncate(n);
            prop_assert_eq!(alternatives(&cands, chosen, n), all);
        });
    }

    #[test]
    fn an_objective_that_is_nan_of_either_sign_comes_after_every_number() {
        let with = |objective: f64| Candidate {
            objective,
            ..crate::candidate::test_worker(|_| {})
        };
        let cands = [
            with(-f64::NAN),
            with(5.0),
            with(f64::NAN),
            with(1.0),
            with(0.0),
        ];
        assert_eq!(alternatives(&cands, 4, 4), [3, 1, 0, 2]);
    }
}
