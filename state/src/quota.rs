//! The escrow ledger of tenant limits. A replica admits a request only against tokens (and
//! requests) granted to it by a committed entry; this is where grants are made and released.
//!
//! Each limit key (tenant, model) has a book for the window in force: windows start at
//! multiples of the limit's length on the clock of the entry that opens them (the leader's),
//! and a window never reopens, so a leader whose clock lags cannot grant a past window's budget
//! twice. A grant is never more than what is left of the window's budget; when what is left is
//! less than a full grant for every replica holding some, it is shared equally among them.
//! Latency decides no race for a scarce budget: until the last tenth of a window, each
//! replica is kept what it wanted of the window before (what it held at its end, and what it
//! asked for in vain), up to an equal share of the budget, less what it holds; the others are
//! granted only what is left beyond that. A replica one WAN round trip from the leader asks later
//! than the ones beside it, and would otherwise find the budget gone; a replica that wanted
//! little keeps little from the others. In the last tenth, whatever is left goes to whoever asks
//! ([`Book::grantable`]). A replica gives back what it will not use with a release; nothing is ever taken back by a
//! timer. Batches are deduplicated by (replica, incarnation, sequence). A replica's new process
//! (incarnation) starts holding nothing: what its earlier one held stays spent for the window,
//! since no one knows how much of it was.

use std::collections::{BTreeMap, BTreeSet};

use kvplane_policy::{Catalog, LimitKey};
use serde::{Deserialize, Serialize};

use crate::digest::Hasher;
pub use crate::quota_settle::{QuotaSettle, Ticket};

/// One replica's asks and releases, in one entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaBatch {
    /// The asking replica (its Raft id).
    pub replica: u64,
    /// Changes each time the replica's process starts; with `seq`, makes a batch applied once.
    pub incarnation: u64,
    pub seq: u64,
    pub asks: Vec<QuotaAsk>,
    pub releases: Vec<QuotaRelease>,
    /// Reservations of another replica's requests whose usage was reported here (see
    /// [`QuotaSettle`]). Left out when empty: builds from before settles read such a batch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settles: Vec<QuotaSettle>,
}

/// "Grant me up to this much more for the current window."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaAsk {
    pub key: LimitKey,
    pub tokens: u64,
    pub requests: u64,
}

/// "I will not use this much of what you granted me in this window."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaRelease {
    pub key: LimitKey,
    pub window_start_ms: u64,
    pub tokens: u64,
    pub requests: u64,
}

/// Tokens and requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    pub tokens: u64,
    pub requests: u64,
}

/// One key's window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Book {
    pub window_start_ms: u64,
    pub window_ms: u64,
    /// The window's budget (`u64::MAX`: that dimension is not limited, and never granted).
    pub budget: Amount,
    /// Granted and not released, over all replicas (with what earlier processes of a restarted
    /// replica held, which is no one's any more).
    pub granted: Amount,
    /// Per replica, what it holds.
    pub holders: BTreeMap<u64, Amount>,
    /// Tickets settled through the ledger in this window (see [`QuotaSettle`]), each once.
    #[serde(default)]
    pub settled: BTreeSet<Ticket>,
    /// Of those, the ones whose routing process may still hold them (its replica has not
    /// started again since), with the tokens to give back once it has.
    #[serde(default)]
    pub pending: BTreeMap<Ticket, u64>,
    /// What each gone process (replica, incarnation) held when its replica's next process
    /// spoke, less what its tickets gave back since.
    #[serde(default)]
    pub left_behind: BTreeMap<(u64, u64), u64>,
    /// Per replica, what its asks in this window were not granted (a demand it could not meet).
    #[serde(default)]
    pub unmet: BTreeMap<u64, Amount>,
    /// Per replica, what it wanted of the window just before this one: what it held when that
    /// window ended (granted less released) and what it asked for in vain. Until this window's
    /// last tenth, each is reserved as much of it as an equal share of the budget allows.
    #[serde(default)]
    pub previous: BTreeMap<u64, Amount>,
}

impl Book {
    pub fn window_end_ms(&self) -> u64 {
        self.window_start_ms.saturating_add(self.window_ms)
    }

    pub fn remaining(&self) -> Amount {
        Amount {
            tokens: self.budget.tokens.saturating_sub(self.granted.tokens),
            requests: self.budget.requests.saturating_sub(self.granted.requests),
        }
    }

    /// Process `incarnation` of `replica` is gone: what it holds is no one's any more (still
    /// counted as granted), kept as what it left behind for its tickets to give back.
    fn leave_behind(&mut self, replica: u64, incarnation: u64) {
        if let Some(held) = self.holders.remove(&replica)
            && held.tokens > 0
        {
            self.left_behind.insert((replica, incarnation), held.tokens);
        }
    }

    /// What `replica` holds in this window.
    pub fn held(&self, replica: u64) -> Amount {
        self.holders.get(&replica).copied().unwrap_or_default()
    }

    /// What is kept for the other replicas from `replica` at time `now_ms`: until the window's
    /// last tenth, each replica that wanted some of the previous window is reserved what
    /// it wanted then, up to an equal share of the budget (among those and `replica`), less
    /// what it holds now; in the last tenth, nothing (what was kept and not taken is anyone's).
    pub fn reserved(&self, replica: u64, now_ms: u64) -> Amount {
        let mut out = Amount::default();
        if now_ms >= self.reserved_until_ms() {
            return out;
        }
        let n = self.previous.len() as u64 + u64::from(!self.previous.contains_key(&replica));
        let share = |budget: u64| budget.div_ceil(n.max(1));
        for (r, wanted) in self.previous.iter().filter(|(r, _)| **r != replica) {
            let held = self.held(*r);
            out.tokens = out.tokens.saturating_add(
                wanted
                    .tokens
                    .min(share(self.budget.tokens))
                    .saturating_sub(held.tokens),
            );
            out.requests = out.requests.saturating_add(
                wanted
                    .requests
                    .min(share(self.budget.requests))
                    .saturating_sub(held.requests),
            );
        }
        out
    }

    /// When what is kept for replicas becomes anyone's: the start of the window's last tenth.
    pub fn reserved_until_ms(&self) -> u64 {
        self.window_start_ms
            .saturating_add(self.window_ms - self.window_ms / 10)
    }

    /// What can still be granted to `replica` at time `now_ms`: what is left of the budget less
    /// what is kept for the others ([`Book::reserved`]).
    pub fn grantable(&self, replica: u64, now_ms: u64) -> Amount {
        let (left, kept) = (self.remaining(), self.reserved(replica, now_ms));
        Amount {
            tokens: left.tokens.saturating_sub(kept.tokens),
            requests: left.requests.saturating_sub(kept.requests),
        }
    }

    /// Whether the ledger already knows that `replica` wants at least an equal share of this
    /// window (among the replicas that hold some, asked in vain, or wanted some of the last
    /// one): what it holds and asked for in vain reach it. Asking again in vain says nothing
    /// more.
    pub fn knows_demand(&self, replica: u64) -> bool {
        let mut sharing: BTreeSet<u64> = self.previous.keys().copied().collect();
        sharing.extend(self.holders.keys().copied());
        sharing.extend(self.unmet.keys().copied());
        sharing.insert(replica);
        let n = sharing.len() as u64;
        let (held, unmet) = (
            self.held(replica),
            self.unmet.get(&replica).copied().unwrap_or_default(),
        );
        // An unlimited dimension is never asked for.
        let known = |have: u64, budget: u64| budget == u64::MAX || have >= budget.div_ceil(n);
        known(held.tokens.saturating_add(unmet.tokens), self.budget.tokens)
            && known(
                held.requests.saturating_add(unmet.requests),
                self.budget.requests,
            )
    }

    /// What each replica wanted of this window, for the next one: what it holds, and what it
    /// asked for in vain.
    fn wanted(&self) -> BTreeMap<u64, Amount> {
        let mut out = self.holders.clone();
        for (r, u) in &self.unmet {
            let w = out.entry(*r).or_default();
            w.tokens = w.tokens.saturating_add(u.tokens);
            w.requests = w.requests.saturating_add(u.requests);
        }
        out.retain(|_, w| *w != Amount::default());
        out
    }
}

/// Every key's book, and the last batch of every replica.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub books: BTreeMap<LimitKey, Book>,
    /// Per replica: (incarnation, last applied seq).
    pub replicas: BTreeMap<u64, (u64, u64)>,
    /// Processes (replica, incarnation) that stopped in order ([`Ledger::close`]): they settled
    /// every report they acknowledged themselves, so their tickets settle nothing here. Kept
    /// while what they left behind is in a book, or until their replica starts again. Left out
    /// when empty: builds from before closes read such a state.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub closed: BTreeSet<(u64, u64)>,
}

/// The last sequence recorded for a replica that left the cluster ([`Ledger::retire`]): every
/// batch of its incarnation then counts as applied already.
const RETIRED_SEQ: u64 = u64::MAX;

/// What one batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaApplied {
    pub duplicate: bool,
    pub granted: Amount,
    pub released: Amount,
}

/// `ask` of a dimension, given what is left, the grant size and how many replicas share it.
fn grant(ask: u64, remaining: u64, grant_size: u64, holders: u64) -> u64 {
    let share = if remaining / holders.max(1) < grant_size {
        remaining.div_ceil(holders.max(1))
    } else {
        grant_size
    };
    ask.min(share).min(remaining)
}

impl Ledger {
    /// Applies one batch at leader time `now_ms` against the limits of `catalog`.
    pub fn apply(&mut self, b: &QuotaBatch, now_ms: u64, catalog: &Catalog) -> QuotaApplied {
        let mut out = QuotaApplied::default();
        match self.replicas.get(&b.replica) {
            // A later process of the replica; or, of a retired one, whatever its incarnation
            // after the one retired (it may be exactly the next): its id taken again.
            Some(&(inc, seq))
                if inc < b.incarnation || (seq == RETIRED_SEQ && inc == b.incarnation) =>
            {
                // The replica restarted: what its earlier process held may have been spent, and
                // that record died with it. Its holdings stay granted (counted against the
                // window) but are no one's to spend or release any more - except what reported
                // requests of that process did not use (its tickets settled elsewhere). A
                // retired replica holds nothing any more: only its tickets are left.
                for book in self.books.values_mut() {
                    book.leave_behind(b.replica, inc);
                    out.released.tokens +=
                        book.release_pending(b.replica, b.incarnation, &self.closed);
                }
                self.replicas.insert(b.replica, (b.incarnation, b.seq));
                self.prune_closed();
            }
            Some(&(inc, seq)) if b.incarnation < inc || (b.incarnation == inc && b.seq <= seq) => {
                out.duplicate = true;
                return out;
            }
            _ => {
                self.replicas.insert(b.replica, (b.incarnation, b.seq));
            }
        }
        for r in &b.releases {
            let Some(book) = self.books.get_mut(&r.key) else {
                continue;
            };
            if book.window_start_ms != r.window_start_ms {
                continue;
            }
            let Some(held) = book.holders.get_mut(&b.replica) else {
                continue;
            };
            let t = r.tokens.min(held.tokens);
            let q = r.requests.min(held.requests);
            held.tokens -= t;
            held.requests -= q;
            book.granted.tokens -= t;
            book.granted.requests -= q;
            out.released.tokens += t;
            out.released.requests += q;
            if *held == Amount::default() {
                book.holders.remove(&b.replica);
            }
        }
        for settle in &b.settles {
            out.released.tokens += self.settle(settle);
        }
        for a in &b.asks {
            let Some(limit) = catalog.limit_of(&a.key) else {
                continue;
            };
            let window_ms = limit.window_ms().max(1);
            let start = now_ms - now_ms % window_ms;
            let budget = Amount {
                tokens: limit.window_tokens().unwrap_or(u64::MAX),
                requests: limit.window_requests().unwrap_or(u64::MAX),
            };
            let book = self.books.entry(a.key.clone()).or_default();
            if start > book.window_start_ms || book.window_ms != window_ms {
                // What each replica wanted of the window just before is kept for it in this
                // one until its last tenth.
                let previous = if book.window_ms == window_ms && start == book.window_end_ms() {
                    book.wanted()
                } else {
                    BTreeMap::new()
                };
                *book = Book {
                    window_start_ms: start,
                    window_ms,
                    budget,
                    previous,
                    ..Book::default()
                };
            } else if start < book.window_start_ms {
                // A past window (a leader whose clock is behind): never reopened.
                continue;
            }
            let grantable = book.grantable(b.replica, now_ms);
            let mut holders = book.holders.len() as u64;
            if !book.holders.contains_key(&b.replica) {
                holders += 1;
            }
            let left = book.remaining();
            // An unlimited dimension is not granted (nor checked by replicas).
            let g = Amount {
                tokens: limit.window_tokens().map_or(0, |_| {
                    grant(a.tokens, left.tokens, limit.grant_tokens(), holders)
                        .min(grantable.tokens)
                }),
                requests: limit.window_requests().map_or(0, |_| {
                    grant(a.requests, left.requests, limit.grant_requests(), holders)
                        .min(grantable.requests)
                }),
            };
            let unmet = Amount {
                tokens: limit.window_tokens().map_or(0, |_| {
                    a.tokens.min(limit.grant_tokens()).saturating_sub(g.tokens)
                }),
                requests: limit.window_requests().map_or(0, |_| {
                    a.requests
                        .min(limit.grant_requests())
                        .saturating_sub(g.requests)
                }),
            };
            if unmet != Amount::default() {
                // More than the budget says nothing more.
                let u = book.unmet.entry(b.replica).or_default();
                u.tokens = u.tokens.saturating_add(unmet.tokens).min(budget.tokens);
                u.requests = u
                    .requests
                    .saturating_add(unmet.requests)
                    .min(budget.requests);
            }
            if g == Amount::default() {
                continue;
            }
            let held = book.holders.entry(b.replica).or_default();
            held.tokens += g.tokens;
            held.requests += g.requests;
            book.granted.tokens += g.tokens;
            book.granted.requests += g.requests;
            out.granted.tokens += g.tokens;
            out.granted.requests += g.requests;
        }
        out
    }

    /// Process `incarnation` of `replica` stops in order: it settled the reports it
    /// acknowledged, and gave back what it did not spend. A report of its requests that reaches
    /// the ledger later (a gateway's retry, or a report after it stopped) gives nothing back:
    /// the ledger cannot tell it from one the process settled itself, and giving back twice
    /// would let the window admit more than its budget.
    pub fn close(&mut self, replica: u64, incarnation: u64) {
        self.closed.insert((replica, incarnation));
        self.prune_closed();
        self.forget_wanted(replica);
    }

    /// A replica that stopped or left wants nothing more: nothing is kept for it.
    fn forget_wanted(&mut self, replica: u64) {
        for book in self.books.values_mut() {
            book.previous.remove(&replica);
            book.unmet.remove(&replica);
        }
    }

    /// `replica` left the cluster for good (its member was removed): as if a later process of
    /// it had spoken, what its process held is no one's any more (it stays counted against the
    /// window) and the tickets of its requests settled through the ledger give back what they
    /// did not use; batches of that process are ignored from now on. Returns the tokens given
    /// back. A replica the ledger never heard from, or already retired, changes nothing.
    pub fn retire(&mut self, replica: u64) -> u64 {
        let Some(&(inc, _)) = self.replicas.get(&replica) else {
            return 0;
        };
        if self.is_retired(replica) {
            return 0;
        }
        let mut released = 0;
        for book in self.books.values_mut() {
            book.leave_behind(replica, inc);
            released += book.release_pending(replica, inc.saturating_add(1), &self.closed);
        }
        self.forget_wanted(replica);
        // Its process's batches are a past incarnation's from now on, and the next
        // incarnation is marked as having applied them all: only a later process (its id taken
        // again) holds anything again.
        self.replicas
            .insert(replica, (inc.saturating_add(1), RETIRED_SEQ));
        self.prune_closed();
        released
    }

    /// Whether `replica` left the cluster and no later process of it spoke since.
    pub fn is_retired(&self, replica: u64) -> bool {
        self.replicas
            .get(&replica)
            .is_some_and(|&(_, seq)| seq == RETIRED_SEQ)
    }

    /// Forgets closed processes nothing can settle against any more: their replica started
    /// again (a later process spoke) and no book holds what they left behind. A close applied
    /// before its process's own batches stays until a later process speaks.
    fn prune_closed(&mut self) {
        if self.closed.is_empty() {
            return;
        }
        let (books, replicas) = (&self.books, &self.replicas);
        self.closed.retain(|&(r, inc)| {
            replicas.get(&r).is_none_or(|&(current, _)| current <= inc)
                || books
                    .values()
                    .any(|b| b.left_behind.contains_key(&(r, inc)))
        });
    }

    pub(crate) fn hash(&self, h: &mut Hasher) {
        h.u64(self.books.len() as u64);
        for (k, b) in &self.books {
            h.str(&k.tenant).str(&k.model);
            // Hashed only when present: tenants' keys keep their digest.
            if !k.provider.is_empty() {
                h.str("provider").str(&k.provider);
            }
            h.u64(b.window_start_ms).u64(b.window_ms);
            h.u64(b.budget.tokens).u64(b.budget.requests);
            h.u64(b.granted.tokens).u64(b.granted.requests);
            h.u64(b.holders.len() as u64);
            for (r, a) in &b.holders {
                h.u64(*r).u64(a.tokens).u64(a.requests);
            }
            // Hashed only when present: books without settled tickets keep their digest.
            if !b.settled.is_empty() || !b.pending.is_empty() {
                b.hash_tickets(h);
            }
            if !b.left_behind.is_empty() {
                b.hash_left_behind(h);
            }
            // Hashed only when present, as above.
            if !b.unmet.is_empty() || !b.previous.is_empty() {
                h.str("wanted");
                for m in [&b.unmet, &b.previous] {
                    h.u64(m.len() as u64);
                    for (r, a) in m {
                        h.u64(*r).u64(a.tokens).u64(a.requests);
                    }
                }
            }
        }
        h.u64(self.replicas.len() as u64);
        for (r, (inc, seq)) in &self.replicas {
            h.u64(*r).u64(*inc).u64(*seq);
        }
        // Hashed only when present: ledgers without closed processes keep their digest.
        if !self.closed.is_empty() {
            h.str("closed").u64(self.closed.len() as u64);
            for (r, inc) in &self.closed {
                h.u64(*r).u64(*inc);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use kvplane_policy::kinds::{InferencePolicySpec, TenantLimit};
    use kvplane_policy::{Object, Spec};

    /// Acme's limit of `tokens_per_minute` (grants of `burst`), for every model.
    pub(crate) fn catalog(tokens_per_minute: u64, burst: u64) -> Catalog {
        let mut c = Catalog::default();
        c.insert(Object {
            name: "limits".into(),
            spec: Spec::Policy(InferencePolicySpec {
                applies_to_models: vec![],
                rules: vec![],
                limits: vec![TenantLimit {
                    tenant: "acme".into(),
                    model: None,
                    tokens_per_minute: Some(tokens_per_minute),
                    requests_per_minute: None,
                    burst: Some(burst),
                    window_seconds: 60,
                    fail_open_tokens_per_minute: None,
                }],
            }),
        });
        c
    }

    pub(crate) fn key() -> LimitKey {
        LimitKey {
            tenant: "acme".into(),
            model: String::new(),
            provider: String::new(),
        }
    }

    fn ask(replica: u64, seq: u64, tokens: u64) -> QuotaBatch {
        QuotaBatch {
            replica,
            incarnation: 1,
            seq,
            asks: vec![QuotaAsk {
                key: key(),
                tokens,
                requests: 1,
            }],
            releases: vec![],
            settles: vec![],
        }
    }

    #[test]
    fn grants_never_exceed_the_window_budget_and_share_the_rest() {
        let c = catalog(1000, 400);
        let mut l = Ledger::default();
        assert_eq!(l.apply(&ask(1, 1, 1000), 5, &c).granted.tokens, 400);
        // 600 left is less than a full grant for each of two holders: half each.
        assert_eq!(l.apply(&ask(2, 1, 1000), 6, &c).granted.tokens, 300);
        assert_eq!(l.apply(&ask(3, 1, 1000), 7, &c).granted.tokens, 100);
        // 200 left, three holders: a third each (rounded up), never more than is left.
        assert_eq!(l.apply(&ask(1, 2, 1000), 8, &c).granted.tokens, 67);
        let mut seq = 3;
        while l.apply(&ask(1 + seq % 3, seq, 1000), 9, &c).granted.tokens > 0 {
            seq += 1;
        }
        assert_eq!(l.books[&key()].granted.tokens, 1000);
        // The next window starts afresh; until its last tenth, what the other two wanted of the
        // last one (up to a third each, rounded up) is kept for them.
        assert_eq!(l.apply(&ask(1, 100, 1000), 60_000, &c).granted.tokens, 332);
    }

    /// Replicas asking in turn for a window whose budget is far below their demand, one of them
    /// late (as one a WAN round trip from the leader asks): until the last tenth each is kept what
    /// it wanted of the last window up to an equal share, so a late replica that asked in vain
    /// in the window before still finds its share; in the last tenth the rest goes to whoever
    /// asks, and the budget is never exceeded. The expected shares come from a plain model:
    /// budget / replicas.
    #[test]
    fn a_late_replica_finds_its_equal_share_and_the_rest_goes_in_the_last_tenth() {
        let c = catalog(12_000, 1_000);
        let mut l = Ledger::default();
        let mut seq = BTreeMap::<u64, u64>::new();
        let mut ask_at = |l: &mut Ledger, replica: u64, now: u64| {
            let s = seq.entry(replica).or_default();
            *s += 1;
            l.apply(&ask(replica, *s, 1_000), now, &c).granted.tokens
        };
        // Window 0: replicas 1-3 beside the leader ask first and often, replica 4 once, late.
        for t in 0..30u64 {
            for r in 1..=3 {
                ask_at(&mut l, r, t);
            }
        }
        assert!(!l.books[&key()].knows_demand(4));
        for t in 100..105 {
            ask_at(&mut l, 4, t);
        }
        // Five asks in vain: more than a quarter, so asking again would say nothing more.
        assert!(l.books[&key()].knows_demand(4));
        let book = &l.books[&key()];
        // Nothing kept for anyone in a first window: the three before it took it all, and it
        // found nothing (five asks of 1,000 in vain).
        assert_eq!(book.granted.tokens, 12_000);
        assert_eq!(book.held(4).tokens, 0);
        assert_eq!(book.unmet[&4].tokens, 5_000);
        // Window 1 (60 s on): replica 4 is late again, but it wanted 5,000 of window 0, so a
        // quarter is kept for it from the start: the others stop at a quarter each.
        for t in 60_000..60_030u64 {
            for r in 1..=3 {
                ask_at(&mut l, r, t);
            }
        }
        let book = &l.books[&key()];
        for r in 1..=3 {
            assert_eq!(book.held(r).tokens, 12_000 / 4, "replica {r}: {book:?}");
        }
        while ask_at(&mut l, 4, 60_100) > 0 {}
        assert_eq!(l.books[&key()].held(4).tokens, 12_000 / 4);
        // In the last tenth, what a replica does not use is anyone's: all of it is granted, and
        // never more.
        let book = l.books.get_mut(&key()).unwrap();
        let held_4 = book.holders.get_mut(&4).unwrap();
        held_4.tokens -= 2_000;
        book.granted.tokens -= 2_000;
        while ask_at(&mut l, 1, 114_000) > 0 {}
        assert_eq!(l.books[&key()].granted.tokens, 12_000);
        assert_eq!(l.books[&key()].held(1).tokens, 5_000);
    }

    /// Replica `replica` asks for 1,000 at `at_ms` (its sequence numbers from `seq` on) until
    /// an ask is granted nothing.
    fn ask_until_refused(l: &mut Ledger, replica: u64, seq: &mut u64, at_ms: u64, c: &Catalog) {
        loop {
            *seq += 1;
            if l.apply(&ask(replica, *seq, 1_000), at_ms, c).granted.tokens == 0 {
                return;
            }
        }
    }

    /// A replica that wanted little of the last window keeps little from the others: one busy
    /// replica beside an idle one that took 200 is granted all but those 200 until the last
    /// tenth.
    #[test]
    fn an_idle_replica_keeps_only_what_it_wanted_from_a_busy_one() {
        let c = catalog(12_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(2, 1, 200), 0, &c);
        let mut seq = 0;
        ask_until_refused(&mut l, 1, &mut seq, 1, &c);
        assert_eq!(l.books[&key()].held(1).tokens, 11_800);
        // Window 1: 200 kept for replica 2, the rest for the busy one at once.
        ask_until_refused(&mut l, 1, &mut seq, 60_001, &c);
        assert_eq!(l.books[&key()].held(1).tokens, 11_800);
        assert_eq!(l.books[&key()].grantable(2, 60_002).tokens, 200);
        assert_eq!(l.books[&key()].grantable(1, 60_002).tokens, 0);
        // In the last tenth, those 200 are anyone's.
        assert_eq!(l.books[&key()].grantable(1, 113_999).tokens, 0);
        assert_eq!(l.books[&key()].grantable(1, 114_000).tokens, 200);
        // Replica 2 stopped in order: nothing is kept for it any more.
        l.close(2, 1);
        assert_eq!(l.books[&key()].grantable(1, 60_003).tokens, 200);
    }

    #[test]
    fn duplicates_and_past_windows_grant_nothing() {
        let c = catalog(1000, 400);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 100), 60_001, &c);
        assert!(l.apply(&ask(1, 1, 100), 60_002, &c).duplicate);
        // A leader with a clock one window behind.
        assert_eq!(l.apply(&ask(2, 1, 100), 59_999, &c).granted.tokens, 0);
        assert_eq!(l.books[&key()].granted.tokens, 100);
    }

    #[test]
    fn a_release_returns_tokens_to_the_window() {
        let c = catalog(1000, 1000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1000), 0, &c);
        let rel = QuotaBatch {
            replica: 1,
            incarnation: 1,
            seq: 2,
            asks: vec![],
            settles: vec![],
            releases: vec![QuotaRelease {
                key: key(),
                window_start_ms: 0,
                tokens: 700,
                requests: 0,
            }],
        };
        assert_eq!(l.apply(&rel, 10, &c).released.tokens, 700);
        // 700 left, shared with the replica still holding 300.
        assert_eq!(l.apply(&ask(2, 1, 1000), 11, &c).granted.tokens, 350);
    }
}
