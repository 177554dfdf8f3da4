//! Stage 8, pick: the lowest objective, near-ties (within 1%) spread by the request id's
//! hash (see [`kvplane_policy::pick`]); then the alternatives a gateway may retry on.

use kvplane_policy::Candidate;

/// `tie_break`: the request's ([`tie_break`]).
pub(crate) fn pick(cands: &mut [Candidate<'_>], tie_break: u64) -> Option<usize> {
    let i = kvplane_policy::pick::pick(cands, tie_break)?;
    cands[i].chosen = true;
    Some(i)
}

/// At most this many alternatives in a Route answer.
const ALTERNATIVES: usize = 3;

/// The candidates to retry on when `chosen` does not answer, best first.
pub(crate) fn alternatives(cands: &[Candidate<'_>], chosen: usize) -> Vec<usize> {
    kvplane_policy::pick::alternatives(cands, chosen, ALTERNATIVES)
}

pub(crate) fn tie_break(request_id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(request_id.as_bytes())
}
