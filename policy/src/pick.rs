//! Picking among scored candidates: the lowest objective wins; candidates within 1% of it
//! count as equal and the request's tie-break (a hash of its id) takes one of them, so
//! routers deciding from the same state at once do not all choose the same worker, while one
//! request always gets the same answer.

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
    let n = cands.iter().filter(|c| near(c)).count();
    let k = usize::try_from(tie_break % n.max(1) as u64).unwrap_or(0);
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| near(c))
        .nth(k)
        .map(|(i, _)| i)
}
