//! Settling a request's reservation through the ledger, when the replica that routed it cannot:
//! a gateway reported its usage elsewhere and the routing process is gone (killed, or restarted
//! and so forgetting what it reserved). The report carries the request's ticket - the routing
//! replica, its process (incarnation), and what each limit reserved - and the replica that got
//! it asks the ledger to give back what the request did not use.
//!
//! A process that is gone left its holdings granted and no one's (see [`crate::Ledger`]); the
//! book keeps how much each gone process left behind, and a settle gives back at most what is
//! left of that process's, once per ticket. While the routing replica
//! has not started again, its process may still be alive behind a partition and spend what it
//! holds: the ticket waits (`pending`) and is given back when a newer process of that replica
//! speaks to the ledger. A ticket is a window's: one for a window that ended gives nothing
//! back (the budget renewed anyway).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::digest::Hasher;
use crate::{Book, Ledger};
use kvplane_policy::LimitKey;

/// One routed request, as the replica that routed it named it: (replica, incarnation,
/// request id).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Ticket {
    pub replica: u64,
    pub incarnation: u64,
    pub request_id: String,
}

/// "Give back `tokens` of what the request `ticket` reserved under `key` in the window that
/// starts at `window_start_ms`: it did not use them."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaSettle {
    pub ticket: Ticket,
    pub key: LimitKey,
    pub window_start_ms: u64,
    pub tokens: u64,
}

impl Book {
    /// Gives back up to `tokens` of what process `incarnation` of `replica` left behind (it
    /// is gone); what it gave back.
    fn give_back(&mut self, replica: u64, incarnation: u64, tokens: u64) -> u64 {
        let Some(left) = self.left_behind.get_mut(&(replica, incarnation)) else {
            return 0;
        };
        let t = tokens.min(*left).min(self.granted.tokens);
        *left -= t;
        if *left == 0 {
            self.left_behind.remove(&(replica, incarnation));
        }
        self.granted.tokens -= t;
        t
    }

    /// Gives back the pending tickets of `replica`'s processes before `incarnation` (a newer
    /// one speaks now), except a `closed` process's (it may have settled them itself); what it
    /// gave back.
    pub(crate) fn release_pending(
        &mut self,
        replica: u64,
        incarnation: u64,
        closed: &BTreeSet<(u64, u64)>,
    ) -> u64 {
        let gone: Vec<Ticket> = self
            .pending
            .keys()
            .filter(|t| t.replica == replica && t.incarnation < incarnation)
            .cloned()
            .collect();
        let mut out = 0;
        for t in gone {
            if let Some(tokens) = self.pending.remove(&t)
                && !closed.contains(&(t.replica, t.incarnation))
            {
                out += self.give_back(t.replica, t.incarnation, tokens);
            }
        }
        out
    }

    pub(crate) fn hash_tickets(&self, h: &mut Hasher) {
        h.u64(self.settled.len() as u64);
        for t in &self.settled {
            h.u64(t.replica).u64(t.incarnation).str(&t.request_id);
        }
        h.u64(self.pending.len() as u64);
        for (t, tokens) in &self.pending {
            h.u64(t.replica).u64(t.incarnation).str(&t.request_id);
            h.u64(*tokens);
        }
    }

    pub(crate) fn hash_left_behind(&self, h: &mut Hasher) {
        h.str("left_behind").u64(self.left_behind.len() as u64);
        for ((replica, incarnation), tokens) in &self.left_behind {
            h.u64(*replica).u64(*incarnation).u64(*tokens);
        }
    }
}

impl Ledger {
    /// Applies one settle; the tokens it gave back now.
    pub(crate) fn settle(&mut self, s: &QuotaSettle) -> u64 {
        let current = self.replicas.get(&s.ticket.replica).map(|&(inc, _)| inc);
        if self
            .closed
            .contains(&(s.ticket.replica, s.ticket.incarnation))
        {
            return 0;
        }
        let Some(book) = self.books.get_mut(&s.key) else {
            return 0;
        };
        if book.window_start_ms != s.window_start_ms || !book.settled.insert(s.ticket.clone()) {
            return 0;
        }
        if current.is_some_and(|inc| inc > s.ticket.incarnation) {
            book.give_back(s.ticket.replica, s.ticket.incarnation, s.tokens)
        } else {
            book.pending.insert(s.ticket.clone(), s.tokens);
            0
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::quota::tests::{catalog, key};
    use crate::{QuotaAsk, QuotaBatch};

    fn batch(replica: u64, incarnation: u64, seq: u64) -> QuotaBatch {
        QuotaBatch {
            replica,
            incarnation,
            seq,
            asks: vec![],
            releases: vec![],
            settles: vec![],
        }
    }

    fn ask(replica: u64, incarnation: u64, seq: u64, tokens: u64) -> QuotaBatch {
        QuotaBatch {
            asks: vec![QuotaAsk {
                key: key(),
                tokens,
                requests: 0,
            }],
            ..batch(replica, incarnation, seq)
        }
    }

    fn settle(by: u64, seq: u64, of: (u64, u64, &str), window: u64, tokens: u64) -> QuotaBatch {
        QuotaBatch {
            settles: vec![QuotaSettle {
                ticket: Ticket {
                    replica: of.0,
                    incarnation: of.1,
                    request_id: of.2.into(),
                },
                key: key(),
                window_start_ms: window,
                tokens,
            }],
            ..batch(by, 1, seq)
        }
    }

    fn granted(l: &Ledger) -> u64 {
        l.books[&key()].granted.tokens
    }

    #[test]
    fn a_gone_processes_ticket_gives_back_what_its_request_did_not_use_once() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&ask(2, 1, 1, 1_000), 0, &c);
        assert_eq!(granted(&l), 2_000);
        // Replica 1 restarts (process 2): its 1,000 are no one's.
        l.apply(&batch(1, 2, 1), 10, &c);
        assert_eq!(granted(&l), 2_000);
        // Its request reserved 600 and used 100: 500 come back, once.
        let out = l.apply(&settle(2, 2, (1, 1, "r1"), 0, 500), 20, &c);
        assert_eq!((out.released.tokens, granted(&l)), (500, 1_500));
        l.apply(&settle(3, 1, (1, 1, "r1"), 0, 500), 21, &c);
        assert_eq!(granted(&l), 1_500, "a ticket settles once");
        // Never more than the gone process held.
        l.apply(&settle(2, 3, (1, 1, "r2"), 0, 900), 22, &c);
        assert_eq!(granted(&l), 1_000, "replica 2's 1,000 stay");
    }

    #[test]
    fn a_ticket_of_a_process_that_may_live_waits_for_its_replica_to_start_again() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&settle(2, 1, (1, 1, "r1"), 0, 400), 10, &c);
        assert_eq!(
            granted(&l),
            1_000,
            "replica 1 may still spend what it holds"
        );
        assert_eq!(l.books[&key()].pending.len(), 1);
        let out = l.apply(&batch(1, 2, 1), 20, &c);
        assert_eq!((out.released.tokens, granted(&l)), (400, 600));
        assert!(l.books[&key()].pending.is_empty());
    }

    #[test]
    fn a_ticket_gives_back_only_what_its_own_process_left_behind() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 300), 0, &c);
        l.apply(&ask(2, 1, 1, 1_000), 0, &c);
        // Both restart: replica 1's process 1 left 300, replica 2's process 1 left 1,000.
        l.apply(&batch(1, 2, 1), 10, &c);
        l.apply(&batch(2, 2, 1), 10, &c);
        l.apply(&settle(3, 1, (1, 1, "a"), 0, 250), 20, &c);
        l.apply(&settle(3, 2, (1, 1, "b"), 0, 250), 20, &c);
        assert_eq!(
            granted(&l),
            1_000,
            "50 of replica 1's, then nothing more of it"
        );
        l.apply(&settle(3, 3, (2, 1, "c"), 0, 400), 20, &c);
        assert_eq!(granted(&l), 600);
    }

    /// Replica 1's process spent 600 of its 1,000 on a request, settled it itself when its
    /// usage came (100 used: 500 back to its own escrow), released its unspent 900 at shutdown
    /// and closed. The 100 it keeps are what the request used: a retry of that report, settled
    /// through the ledger, must not give 500 back again.
    #[test]
    fn a_closed_processes_tickets_give_nothing_back_and_it_is_forgotten_with_its_window() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        let release = QuotaBatch {
            releases: vec![crate::QuotaRelease {
                key: key(),
                window_start_ms: 0,
                tokens: 900,
                requests: 0,
            }],
            ..batch(1, 1, 2)
        };
        l.apply(&release, 5, &c);
        l.close(1, 1);
        assert_eq!(granted(&l), 100);
        // A retry reaches replica 2 before and after replica 1 starts again.
        l.apply(&settle(2, 1, (1, 1, "r1"), 0, 500), 10, &c);
        assert!(l.books[&key()].pending.is_empty(), "nothing waits");
        l.apply(&batch(1, 2, 1), 20, &c);
        l.apply(&settle(2, 2, (1, 1, "r1"), 0, 500), 30, &c);
        assert_eq!(granted(&l), 100, "the 100 used stay spent");
        assert!(
            l.closed.contains(&(1, 1)),
            "its 100 are still in the window"
        );
        // The next window: nothing of process 1 is left anywhere, nor is its closing.
        l.apply(&ask(2, 1, 3, 1_000), 60_000, &c);
        l.apply(&batch(1, 3, 1), 60_010, &c);
        assert!(l.closed.is_empty(), "{:?}", l.closed);
    }

    /// A close that lands before anything of its process (its batches were late) is kept, and
    /// the process's tickets give nothing back; a snapshot holds it, one without closes is read
    /// as before, and the digest tells the two apart.
    #[test]
    fn an_early_close_is_kept_through_a_snapshot_and_changes_the_digest() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        let before = l.clone();
        l.close(1, 1);
        assert!(l.closed.contains(&(1, 1)));
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&batch(1, 2, 1), 10, &c);
        l.apply(&settle(2, 1, (1, 1, "r1"), 0, 500), 20, &c);
        assert_eq!(granted(&l), 1_000);
        let bytes = rmp_serde::to_vec(&l).unwrap();
        let back: Ledger = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, l);
        let empty = rmp_serde::to_vec(&before).unwrap();
        assert_eq!(rmp_serde::from_slice::<Ledger>(&empty).unwrap(), before);
        let digest = |l: &Ledger| {
            let mut h = Hasher::new();
            l.hash(&mut h);
            h.finish()
        };
        let mut unclosed = l.clone();
        unclosed.closed.clear();
        assert_ne!(digest(&l), digest(&unclosed));
    }

    /// Without the close (a process killed), the ticket is the only record: it gives back.
    #[test]
    fn a_killed_processes_ticket_still_gives_back() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&batch(1, 2, 1), 10, &c);
        l.apply(&settle(2, 1, (1, 1, "r1"), 0, 500), 20, &c);
        assert_eq!(granted(&l), 500);
    }

    #[test]
    fn a_ticket_of_another_window_gives_nothing_back() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&batch(1, 2, 1), 10, &c);
        l.apply(&settle(2, 1, (1, 1, "r1"), 60_000, 400), 20, &c);
        assert_eq!(granted(&l), 1_000);
        assert!(l.books[&key()].settled.is_empty());
    }

    #[test]
    fn a_retired_replicas_tickets_give_back_at_once_and_its_process_gets_nothing_more() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        l.apply(&ask(2, 1, 1, 1_000), 0, &c);
        // A ticket of replica 1's live process waits...
        l.apply(&settle(2, 2, (1, 1, "r1"), 0, 400), 10, &c);
        assert_eq!(granted(&l), 2_000);
        // ...until replica 1 leaves the cluster: then it gives back, and what replica 1 held
        // stays counted against the window.
        assert_eq!(l.retire(1), 400);
        assert_eq!(granted(&l), 1_600);
        assert!(!l.books[&key()].holders.contains_key(&1));
        assert!(l.books[&key()].pending.is_empty());
        // A ticket reported later gives back at once, within what replica 1 left behind.
        let out = l.apply(&settle(2, 3, (1, 1, "r2"), 0, 900), 20, &c);
        assert_eq!((out.released.tokens, granted(&l)), (600, 1_000));
        // Its process asks again (it was removed while alive): nothing.
        let out = l.apply(&ask(1, 1, 2, 1_000), 30, &c);
        assert!(out.duplicate && !l.books[&key()].holders.contains_key(&1));
        // Retiring again, or a replica the ledger never heard from, changes nothing.
        assert!(l.is_retired(1) && !l.is_retired(2));
        let before = l.clone();
        assert_eq!(l.retire(1), 0);
        assert_eq!(l.retire(9), 0);
        assert_eq!(l, before);
        // A later process of that replica (an id taken again) is a holder as any other - also
        // one whose incarnation is just the next (a clock that stepped back).
        let mut next = l.clone();
        let out = l.apply(&ask(1, 5, 1, 1_000), 40, &c);
        assert!(out.granted.tokens > 0 && !l.is_retired(1));
        let out = next.apply(&ask(1, 2, 1, 1_000), 40, &c);
        assert!(out.granted.tokens > 0 && !next.is_retired(1), "{out:?}");
        let out = next.apply(&ask(1, 2, 2, 1_000), 41, &c);
        assert!(!out.duplicate, "its later batches count too");
    }

    #[test]
    fn retirement_is_kept_through_a_snapshot_and_changes_the_digest() {
        let c = catalog(10_000, 1_000);
        let mut l = Ledger::default();
        l.apply(&ask(1, 1, 1, 1_000), 0, &c);
        let digest = |l: &Ledger| {
            let mut h = Hasher::new();
            l.hash(&mut h);
            h.finish()
        };
        let before = digest(&l);
        l.retire(1);
        assert_ne!(digest(&l), before);
        let back: Ledger = rmp_serde::from_slice(&rmp_serde::to_vec(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        assert_eq!(digest(&back), digest(&l));
    }
}
