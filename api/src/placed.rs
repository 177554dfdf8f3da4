//! Prefixes routed but not yet indexed. A prompt routed to a worker is cached there once its
//! prefill runs, but the prefix index learns it only from the engine's events, after that
//! prefill and the trip through the bridge, NATS and Raft. A burst of requests sharing a new
//! prefix would meanwhile see no holder and spread it over the fleet, each copy a full
//! prefill and KV space taken from other prefixes. So a replica remembers, per worker set,
//! the [`Anchor`]s of each prompt it (or, as gossip told it, another replica) routed, for the
//! worker and dp rank it went to, until a while after its first token was due; a decision
//! counts a worker's match here as cached where it is longer than the index's.
//!
//! Routing-side soft state, like the predictor's queues: never replicated, never in apply.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use kvplane_state::Anchor;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// A routed prompt is remembered by the sequence hash of every this many blocks (and of its
/// last complete one): the match is known to this many blocks (16 tokens each: 256).
pub const ANCHOR_EVERY: usize = 16;

/// How long after its first token was due a routed prompt is still taken as cached there:
/// enough for the engine's events to reach the index, which says it from then on. (An
/// eviction within that time is not seen: the longer of the two matches counts.)
pub const GRACE_MS: u64 = 2_000;

/// At most this many anchors remembered per worker set (those soonest to expire leave first).
const MAX_ANCHORS: usize = 65_536;

/// At most this many anchors of one prompt are remembered (its first ones): 65,536 blocks,
/// a million tokens of 16. A gossip note carrying more is refused as malformed; a placement
/// made otherwise is cut there.
pub const MAX_PROMPT_ANCHORS: usize = 4_096;

/// At most this many workers' names per worker set (a placement naming another is not kept).
const MAX_WORKERS: usize = 65_536;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker: u32,
    dp_rank: u32,
    until_ms: u64,
}

/// One worker set's routed prompts.
#[derive(Debug, Default)]
pub(crate) struct Placed {
    by_anchor: FxHashMap<u64, SmallVec<[Holder; 2]>>,
    /// When each remembered anchor's holders may next expire, soonest first.
    expiry: BinaryHeap<Reverse<(u64, u64)>>,
    names: Vec<Arc<str>>,
    ids: FxHashMap<Arc<str>, u32>,
}

/// A worker's match among the routed prompts: its name, the blocks matched, its dp rank.
pub type PlacedMatch = (Arc<str>, u32, u32);

impl Placed {
    fn id(&mut self, worker: &str) -> Option<u32> {
        if let Some(&i) = self.ids.get(worker) {
            return Some(i);
        }
        if self.names.len() >= MAX_WORKERS {
            return None;
        }
        let name: Arc<str> = Arc::from(worker);
        let i = u32::try_from(self.names.len()).ok()?;
        self.names.push(name.clone());
        self.ids.insert(name, i);
        Some(i)
    }

    /// Drops what expired by `now_ms`, and the soonest to expire while over the bound.
    fn prune(&mut self, now_ms: u64) {
        while let Some(&Reverse((until, seq))) = self.expiry.peek() {
            let over = self.by_anchor.len() > MAX_ANCHORS;
            if until > now_ms && !over {
                break;
            }
            self.expiry.pop();
            // A holder placed again since keeps its later time (and its own entry here).
            let cut = if over { until.max(now_ms) } else { now_ms };
            if let Some(h) = self.by_anchor.get_mut(&seq) {
                h.retain(|h| h.until_ms > cut);
                if h.is_empty() {
                    self.by_anchor.remove(&seq);
                }
            }
        }
    }

    /// Remembers a prompt (its anchors) routed to `worker` rank `dp_rank` until `until_ms`.
    pub(crate) fn place(
        &mut self,
        worker: &str,
        dp_rank: u32,
        anchors: &[Anchor],
        until_ms: u64,
        now_ms: u64,
    ) {
        self.prune(now_ms);
        if until_ms <= now_ms || anchors.is_empty() {
            return;
        }
        let Some(worker) = self.id(worker) else {
            return;
        };
        for a in anchors.iter().take(MAX_PROMPT_ANCHORS) {
            let holders = self.by_anchor.entry(a.seq).or_default();
            match holders.iter_mut().find(|h| h.worker == worker) {
                // Only a later time needs an entry of its own in the heap (the earlier one
                // would leave nothing); the rank is the one the latest-lasting placement named.
                Some(h) if h.until_ms >= until_ms => continue,
                Some(h) => {
                    h.dp_rank = dp_rank;
                    h.until_ms = until_ms;
                }
                None => holders.push(Holder {
                    worker,
                    dp_rank,
                    until_ms,
                }),
            }
            self.expiry.push(Reverse((until_ms, a.seq)));
        }
    }

    /// Each worker's longest match of `anchors` (a prompt's, in order) among the routed
    /// prompts not expired at `now_ms`; nothing for the workers with none. A prompt is
    /// placed without the anchors its worker's index match already covers (see
    /// [`crate::Predictor::place`]), so up to `indexed` blocks (the longest index match) an
    /// anchor held by nobody does not end the walk.
    pub(crate) fn matches(
        &self,
        anchors: &[Anchor],
        indexed: u32,
        now_ms: u64,
    ) -> SmallVec<[PlacedMatch; 4]> {
        let mut best: SmallVec<[(u32, u32, u32); 4]> = SmallVec::new();
        for a in anchors {
            let Some(holders) = self.by_anchor.get(&a.seq) else {
                if a.blocks <= indexed {
                    continue;
                }
                // A longer match implies this one (the hashes chain): none further on.
                break;
            };
            let mut any = false;
            for h in holders.iter().filter(|h| h.until_ms > now_ms) {
                any = true;
                match best.iter_mut().find(|b| b.0 == h.worker) {
                    Some(b) => *b = (h.worker, a.blocks, h.dp_rank),
                    None => best.push((h.worker, a.blocks, h.dp_rank)),
                }
            }
            if !any && a.blocks > indexed {
                break;
            }
        }
        best.into_iter()
            .map(|(w, blocks, rank)| (self.names[w as usize].clone(), blocks, rank))
            .collect()
    }

    #[cfg(test)]
    fn anchors_kept(&self) -> usize {
        self.by_anchor.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A prompt's anchors as a plain chain: block `i` of prompt `p` is `(p, i)` while `i`
    /// is below the prefix length `p` shares with prompt 0.
    fn anchors_of(blocks: &[u64]) -> Vec<Anchor> {
        let mut seq = 0u64;
        let mut out = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            seq = xxhash_rust::xxh3::xxh3_64_with_seed(&b.to_le_bytes(), seq);
            if (i + 1) % ANCHOR_EVERY == 0 || i + 1 == blocks.len() {
                out.push(Anchor {
                    blocks: u32::try_from(i + 1).unwrap(),
                    seq,
                });
            }
        }
        out
    }

    fn prompt(shared: usize, own: usize, tag: u64) -> Vec<u64> {
        (0..shared as u64)
            .chain((0..own as u64).map(|i| tag << 32 | i))
            .collect()
    }

    #[test]
    fn a_routed_prompts_prefix_matches_on_its_worker_until_it_expires() {
        let mut p = Placed::default();
        p.place("w1", 2, &anchors_of(&prompt(200, 10, 1)), 1_000, 0);
        let next = anchors_of(&prompt(200, 10, 2));
        // The shared 200 blocks are known to the 16th: 192.
        assert_eq!(
            p.matches(&next, 0, 999).to_vec(),
            [(Arc::from("w1"), 192, 2)]
        );
        assert!(p.matches(&next, 0, 1_000).is_empty());
        let other = anchors_of(&prompt(0, 50, 3));
        assert!(p.matches(&other, 0, 10).is_empty());
    }

    #[test]
    fn expired_prompts_are_forgotten_and_a_worker_placed_again_keeps_the_later_placement() {
        let mut p = Placed::default();
        let a = anchors_of(&prompt(64, 0, 0));
        p.place("w", 0, &a, 100, 0);
        p.place("w", 1, &a, 200, 50);
        // An earlier-ending placement (a late note) changes neither the time nor the rank.
        p.place("w", 2, &a, 120, 60);
        assert_eq!(p.matches(&a, 0, 150).to_vec(), [(Arc::from("w"), 64, 1)]);
        assert!(p.matches(&a, 0, 200).is_empty());
        p.place("x", 0, &anchors_of(&prompt(0, 16, 9)), 500, 300);
        assert_eq!(p.anchors_kept(), 1);
    }

    proptest! {
        /// Against a plain oracle: each worker's match is the longest prefix, in whole anchors,
        /// that it shares with a prompt placed there and not expired.
        #[test]
        fn matches_are_the_longest_live_shared_prefix_per_worker(
            placed in prop::collection::vec(
                (0usize..3, 0usize..60, 0usize..40, 1u64..6, 1u64..400, 0u32..70),
                0..20,
            ),
            ask in (0usize..60, 0usize..40, 0u64..6),
            now in 0u64..400,
        ) {
            let mut p = Placed::default();
            let mut oracle: BTreeMap<String, u32> = BTreeMap::new();
            let asked = prompt(ask.0, ask.1, ask.2 + 100);
            let n = placed.len() as u64;
            // Each prompt placed without the anchors its worker's index match covered (`skip`
            // blocks); the index's longest match is at least each of those.
            let indexed = placed.iter().map(|p| p.5).max().unwrap_or(0);
            for (i, (w, shared, own, tag, life, skip)) in placed.into_iter().enumerate() {
                // Placed in time order, all by `now`.
                let t = i as u64 * now / n.max(1);
                let name = format!("w{w}");
                let blocks = prompt(shared, own, tag);
                let beyond: Vec<Anchor> =
                    anchors_of(&blocks).into_iter().filter(|a| a.blocks > skip).collect();
                p.place(&name, 0, &beyond, t + life, t);
                if t + life > now {
                    // Blocks in common from the start, counted in whole anchors.
                    let common = blocks.iter().zip(&asked).take_while(|(a, b)| a == b).count();
                    let known = anchors_of(&asked)
                        .iter()
                        .zip(anchors_of(&blocks))
                        .take_while(|(a, b)| **a == *b)
                        .map(|(a, _)| a.blocks)
                        .last()
                        .unwrap_or(0);
                    prop_assert!(known as usize <= common);
                    if known > skip {
                        let e = oracle.entry(name).or_default();
                        *e = (*e).max(known);
                    }
                }
            }
            let got: BTreeMap<String, u32> =
                p.matches(&anchors_of(&asked), indexed, now).into_iter().map(|(n, b, _)| (n.to_string(), b)).collect();
            prop_assert_eq!(got, oracle);
        }
    }
}
