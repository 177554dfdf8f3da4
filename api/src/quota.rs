//! Admission against tenant limits on one replica: the escrow this replica was granted by
//! committed entries (the ledger in the replicated state, [`kvplane_state::Ledger`]), what it
//! has spent of it, and the demand its refiller ([`crate::run_refiller`]) turns into grant
//! asks. A request is admitted only when every limit that matches it has room in this
//! replica's escrow for its prompt plus maximum output tokens; nothing on the request path
//! waits for consensus unless the escrow has run dry.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvplane_policy::{LimitKey, MatchedLimit};
use kvplane_proto::v1::{QuotaCharge, QuotaStatus};
use kvplane_state::{Amount, QuotaAsk, QuotaBatch, QuotaRelease, QuotaSettle, StateHandle};
use tokio::sync::{Notify, watch};

use crate::quota_metrics::QuotaMetrics;

/// Grant attempts failed in a row after which a short request is refused without waiting...
const FAILED_IN_A_ROW: u32 = 2;
/// ...while the last of them failed this recently (an older streak is no news: nothing was
/// asked since, and the next ask may well work).
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// How a replica admits against its escrow.
#[derive(Debug, Clone)]
pub struct QuotaConfig {
    /// This replica's id in the ledger (its Raft id).
    pub replica: u64,
    /// Different on every start of the process.
    pub incarnation: u64,
    /// How long a request may wait for a grant when the escrow is empty.
    pub grant_wait: Duration,
    /// Escrow of a key unused this long is released.
    pub idle_release: Duration,
    /// Reserved for output when a request names no maximum.
    pub default_max_output_tokens: u32,
    /// Windows of spending kept for Status.
    pub history_windows: usize,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        Self {
            replica: 1,
            incarnation: wall_ms(),
            grant_wait: Duration::from_millis(250),
            idle_release: Duration::from_secs(2),
            default_max_output_tokens: 256,
            history_windows: 64,
        }
    }
}

/// A limit's grant sizes, 0 for a dimension it does not limit.
fn grant_sizes(l: &kvplane_policy::kinds::TenantLimit) -> (u64, u64) {
    (
        l.window_tokens().map_or(0, |_| l.grant_tokens()),
        l.window_requests().map_or(0, |_| l.grant_requests()),
    )
}

/// Milliseconds since the Unix epoch by the wall clock (0 before it).
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What a request holds of one limit until its usage is reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub key: LimitKey,
    pub window_start_ms: u64,
    pub tokens: u64,
    pub fail_open: bool,
}

impl Reservation {
    pub fn charge(&self) -> QuotaCharge {
        QuotaCharge {
            tenant: self.key.tenant.clone(),
            model: self.key.model.clone(),
            window_start_ms: self.window_start_ms,
            tokens: self.tokens,
            provider: self.key.provider.clone(),
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refusal {
    #[error("{key}: {what} limit of {budget} per {window_s} s window reached")]
    Exhausted {
        key: LimitKey,
        what: &'static str,
        budget: u64,
        window_s: u64,
        retry_after_ms: u64,
    },
    /// What is left of the window is kept for the other replicas until its last tenth (see
    /// [`kvplane_state::Book::reserved`]).
    #[error(
        "{key}: the rest of the {what} limit of {budget} per {window_s} s window is kept for other replicas until the window's last tenth"
    )]
    ShareReached {
        key: LimitKey,
        what: &'static str,
        budget: u64,
        window_s: u64,
        retry_after_ms: u64,
    },
    #[error(
        "{key}: no grant within {waited_ms} ms ({why}); this replica spent its escrow and fails closed"
    )]
    NoGrant {
        key: LimitKey,
        waited_ms: u64,
        #[source]
        why: GrantPending,
        retry_after_ms: u64,
    },
}

/// Why the grant a request waited for had not come.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GrantPending {
    #[error("the grant is still in flight")]
    InFlight,
    /// The last grant attempt failed (no quorum, no leader).
    #[error(transparent)]
    Failed(kvplane_state::ProposeError),
}

impl Refusal {
    pub fn retry_after_ms(&self) -> u64 {
        match self {
            Refusal::Exhausted { retry_after_ms, .. }
            | Refusal::ShareReached { retry_after_ms, .. }
            | Refusal::NoGrant { retry_after_ms, .. } => *retry_after_ms,
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Refusal::Exhausted { .. } => "exhausted",
            Refusal::ShareReached { .. } => "share",
            Refusal::NoGrant { .. } => "no_grant",
        }
    }

    /// The limit that refused.
    pub(crate) fn key(&self) -> &LimitKey {
        match self {
            Refusal::Exhausted { key, .. }
            | Refusal::ShareReached { key, .. }
            | Refusal::NoGrant { key, .. } => key,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Spent {
    tokens: u64,
    requests: u64,
    fail_open_tokens: u64,
}

/// Escrow this replica proposed to release: unspendable from the moment the release is
/// proposed until the ledger applied the batch carrying it (its held amount then dropped) or a
/// later one (the release was lost: the ledger still counts it as held here).
#[derive(Debug, Clone)]
struct Releasing {
    seq: u64,
    key: LimitKey,
    window_start_ms: u64,
    tokens: u64,
    requests: u64,
}

#[derive(Debug, Default)]
struct Local {
    /// Releases in flight (see [`Releasing`]).
    releasing: Vec<Releasing>,
    /// By key and window start; the newest `history_windows` windows per key.
    spent: BTreeMap<(LimitKey, u64), Spent>,
    /// Keys whose escrow ran short, with the window's grant sizes.
    wanted: BTreeMap<LimitKey, (u64, u64)>,
    /// Keys in use, with the grant sizes of their limit (0: that dimension is not limited)
    /// and when they were last used.
    in_use: BTreeMap<LimitKey, (u64, u64, Instant)>,
    seq: u64,
    /// Why the last grant attempt failed, if it did, how many failed in a row, and when.
    failing: Option<(kvplane_state::ProposeError, u32, Instant)>,
    /// Other replicas' reservations to settle through the ledger, sent in every batch until
    /// the ledger has them (it takes each ticket once).
    settles: Vec<QuotaSettle>,
}

impl Local {
    /// Forgets the releases the ledger has seen (`applied`: this replica's incarnation and
    /// last applied batch there), and returns what is still set aside for `key` in the window
    /// starting at `start`.
    fn set_aside(
        &mut self,
        applied: Option<(u64, u64)>,
        incarnation: u64,
        key: &LimitKey,
        start: u64,
    ) -> (u64, u64) {
        self.prune_released(applied, incarnation);
        self.releasing
            .iter()
            .filter(|r| r.key == *key && r.window_start_ms == start)
            .fold((0, 0), |(t, q), r| (t + r.tokens, q + r.requests))
    }

    /// Forgets the releases the ledger has applied a batch at or after.
    fn prune_released(&mut self, applied: Option<(u64, u64)>, incarnation: u64) {
        self.releasing.retain(|r| match applied {
            Some((inc, seq)) => inc < incarnation || (inc == incarnation && seq < r.seq),
            None => true,
        });
    }

    /// Keeps the newest `keep` windows of `key`.
    fn forget_old_windows(&mut self, key: &LimitKey, keep: usize) {
        let range = (key.clone(), 0)..=(key.clone(), u64::MAX);
        let n = self.spent.range(range.clone()).count();
        let old: Vec<_> = self
            .spent
            .range(range)
            .take(n.saturating_sub(keep))
            .map(|(k, _)| k.clone())
            .collect();
        for k in old {
            self.spent.remove(&k);
        }
    }
}

/// This replica's escrow.
#[derive(Debug)]
pub struct Escrow {
    cfg: QuotaConfig,
    state: StateHandle,
    local: Mutex<Local>,
    /// Wakes the refiller.
    pub(crate) wake: Notify,
    /// Counts grant attempts; waiters watch it.
    attempts: watch::Sender<u64>,
    pub(crate) metrics: QuotaMetrics,
}

/// A limit's shortfall on this replica.
struct Short {
    key: LimitKey,
    refusal: Option<Box<Refusal>>,
}

impl Escrow {
    /// `metrics` may be registered already (clones share their series).
    pub fn new(cfg: QuotaConfig, state: StateHandle, metrics: QuotaMetrics) -> Self {
        Self {
            cfg,
            state,
            local: Mutex::default(),
            wake: Notify::new(),
            attempts: watch::channel(0).0,
            metrics,
        }
    }

    pub fn config(&self) -> &QuotaConfig {
        &self.cfg
    }

    /// Whether the ledger has applied a batch of this process (before that it holds nothing
    /// and has issued no ticket).
    pub(crate) fn known_to_ledger(&self) -> bool {
        self.state
            .load()
            .quota
            .replicas
            .get(&self.cfg.replica)
            .is_some_and(|&(inc, _)| inc == self.cfg.incarnation)
    }

    pub fn metrics(&self) -> &QuotaMetrics {
        &self.metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What this process may spend of `book`. Until the ledger has applied a batch of this
    /// process (incarnation), what it says this replica holds is an earlier process's, perhaps
    /// spent already: nothing.
    fn held(&self, view: &kvplane_state::View, book: &kvplane_state::Book) -> Amount {
        let mine = view
            .quota
            .replicas
            .get(&self.cfg.replica)
            .is_some_and(|(inc, _)| *inc == self.cfg.incarnation);
        if mine {
            book.held(self.cfg.replica)
        } else {
            Amount::default()
        }
    }

    /// Tokens a request reserves: its prompt and its maximum output.
    pub fn tokens_for(&self, prompt_tokens: usize, max_output: Option<u32>) -> u64 {
        prompt_tokens as u64 + u64::from(max_output.unwrap_or(self.cfg.default_max_output_tokens))
    }

    /// Reserves `tokens` (and one request) under every limit in `limits`, all or none,
    /// waiting up to `grant_wait` for grants when the escrow is short.
    pub async fn reserve(
        &self,
        limits: &[MatchedLimit<'_>],
        tokens: u64,
    ) -> Result<Vec<Reservation>, Refusal> {
        let started = Instant::now();
        let deadline = started + self.cfg.grant_wait;
        let mut attempts = self.attempts.subscribe();
        loop {
            let short = match self.try_reserve(limits, tokens, false) {
                Ok(r) => return Ok(self.admitted(r)),
                Err(s) => s,
            };
            if let Some(refusal) = short.refusal {
                return Err(self.refused(*refusal, tokens));
            }
            self.wake.notify_one();
            // Grants cannot be had (no quorum): a limit that allows it fails open.
            let failing = self.lock().failing.clone();
            if failing.is_some()
                && let Ok(r) = self.try_reserve(limits, tokens, true)
            {
                return Ok(self.admitted(r));
            }
            // Failing again and again (a partition, no leader): no grant is coming within the
            // wait, so the request is refused at once rather than held for nothing. One failure
            // may be a blip: it still waits.
            let streak = failing
                .as_ref()
                .is_some_and(|(_, n, at)| *n >= FAILED_IN_A_ROW && at.elapsed() < FAILED_RECENTLY);
            let left = if streak {
                Duration::ZERO
            } else {
                deadline.saturating_duration_since(Instant::now())
            };
            let attempt = tokio::time::timeout(left, attempts.changed()).await;
            if left.is_zero() || attempt.is_err() {
                if let Ok(r) = self.try_reserve(limits, tokens, false) {
                    return Ok(self.admitted(r));
                }
                let why =
                    failing.map_or(GrantPending::InFlight, |(e, _, _)| GrantPending::Failed(e));
                let r = Refusal::NoGrant {
                    key: short.key,
                    waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(0),
                    why,
                    retry_after_ms: 1000,
                };
                return Err(self.refused(r, tokens));
            }
        }
    }

    fn admitted(&self, r: Vec<Reservation>) -> Vec<Reservation> {
        for x in &r {
            self.metrics
                .admitted(&x.key.budget(), x.tokens, x.fail_open);
        }
        r
    }

    fn refused(&self, r: Refusal, tokens: u64) -> Refusal {
        self.metrics.rejected(&r.key().budget(), r.label(), tokens);
        r
    }

    /// One attempt; `fail_open` spends the limits' fail-open allowance instead of escrow.
    fn try_reserve(
        &self,
        limits: &[MatchedLimit<'_>],
        tokens: u64,
        fail_open: bool,
    ) -> Result<Vec<Reservation>, Short> {
        // The view is read under the lock: views only move forward, so no caller decides from
        // an older view than the one that cleared a set-aside release.
        let mut local = self.lock();
        let view = self.state.load();
        let now = wall_ms();
        let mut out = Vec::with_capacity(limits.len());
        for m in limits {
            let l = m.limit;
            let window_ms = l.window_ms().max(1);
            let start = now - now % window_ms;
            let sizes = grant_sizes(l);
            local
                .in_use
                .insert(m.key.clone(), (sizes.0, sizes.1, Instant::now()));
            let need_tokens = if l.tokens_per_minute.is_some() {
                tokens
            } else {
                0
            };
            let need_requests = u64::from(l.requests_per_minute.is_some());
            let spent = local
                .spent
                .get(&(m.key.clone(), start))
                .copied()
                .unwrap_or_default();
            if fail_open {
                match l.fail_open_window_tokens() {
                    Some(allow) if spent.fail_open_tokens + need_tokens <= allow => {}
                    _ => {
                        return Err(Short {
                            key: m.key.clone(),
                            refusal: None,
                        });
                    }
                }
            } else {
                let book = view
                    .quota
                    .books
                    .get(&m.key)
                    .filter(|b| b.window_start_ms == start);
                let applied = view.quota.replicas.get(&self.cfg.replica).copied();
                let (held, remaining, grantable) = book
                    .map(|b| {
                        (
                            self.held(&view, b),
                            b.remaining(),
                            b.grantable(self.cfg.replica, now),
                        )
                    })
                    .unwrap_or_default();
                let (aside_tokens, aside_requests) =
                    local.set_aside(applied, self.cfg.incarnation, &m.key, start);
                let avail_tokens = held.tokens.saturating_sub(spent.tokens + aside_tokens);
                let avail_requests = held
                    .requests
                    .saturating_sub(spent.requests + aside_requests);
                if avail_tokens < need_tokens || avail_requests < need_requests {
                    // Out of reach for this window, whatever is granted now? (What is being
                    // released returns to the window's remainder.)
                    let window_s = window_ms / 1000;
                    let retry_after_ms = start + window_ms - now;
                    let remaining = Amount {
                        tokens: remaining.tokens + aside_tokens,
                        requests: remaining.requests + aside_requests,
                    };
                    let refusal = if book.is_some() && avail_tokens + remaining.tokens < need_tokens
                    {
                        Some(Refusal::Exhausted {
                            key: m.key.clone(),
                            what: "token",
                            budget: l.window_tokens().unwrap_or(0),
                            window_s,
                            retry_after_ms,
                        })
                    } else if book.is_some() && avail_requests + remaining.requests < need_requests
                    {
                        Some(Refusal::Exhausted {
                            key: m.key.clone(),
                            what: "request",
                            budget: l.window_requests().unwrap_or(0),
                            window_s,
                            retry_after_ms,
                        })
                    } else if book.is_some()
                        && (avail_tokens + grantable.tokens + aside_tokens < need_tokens
                            || avail_requests + grantable.requests + aside_requests < need_requests)
                    {
                        // Room is left, kept for the other replicas until the last tenth
                        // (never after: what is grantable is then all that is left).
                        let tokens_short =
                            avail_tokens + grantable.tokens + aside_tokens < need_tokens;
                        Some(Refusal::ShareReached {
                            key: m.key.clone(),
                            what: if tokens_short { "token" } else { "request" },
                            budget: if tokens_short {
                                l.window_tokens().unwrap_or(0)
                            } else {
                                l.window_requests().unwrap_or(0)
                            },
                            window_s,
                            retry_after_ms: book
                                .map_or(0, kvplane_state::Book::reserved_until_ms)
                                .saturating_sub(now)
                                .max(1),
                        })
                    } else {
                        None
                    };
                    // Asked for even when refused, until the ledger knows this replica wants an
                    // equal share: it records what it could not grant, and keeps it for this
                    // replica in the next window. (Then refused replicas stop asking.)
                    if refusal.is_none() || book.is_some_and(|b| !b.knows_demand(self.cfg.replica))
                    {
                        local.wanted.insert(
                            m.key.clone(),
                            (sizes.0.max(need_tokens), sizes.1.max(need_requests)),
                        );
                    }
                    return Err(Short {
                        key: m.key.clone(),
                        refusal: refusal.map(Box::new),
                    });
                }
            }
            out.push(Reservation {
                key: m.key.clone(),
                window_start_ms: start,
                tokens: need_tokens,
                fail_open,
            });
        }
        // Every limit has room: spend.
        for (r, m) in out.iter().zip(limits) {
            let key = (r.key.clone(), r.window_start_ms);
            if !local.spent.contains_key(&key) {
                // A new window of this key: the oldest beyond the history kept go.
                local.forget_old_windows(&r.key, self.cfg.history_windows.saturating_sub(1));
            }
            let s = local.spent.entry(key).or_default();
            if r.fail_open {
                s.fail_open_tokens += r.tokens;
            } else {
                s.tokens += r.tokens;
                s.requests += u64::from(m.limit.requests_per_minute.is_some());
            }
        }
        Ok(out)
    }

    /// Settles a request at what it really used: the difference to its reservation goes back
    /// to the escrow of the window it was reserved in.
    pub fn settle(&self, reservations: &[Reservation], used_tokens: u64) {
        let mut local = self.lock();
        for r in reservations {
            let refund = r.tokens.saturating_sub(used_tokens);
            if let Some(s) = local.spent.get_mut(&(r.key.clone(), r.window_start_ms)) {
                if r.fail_open {
                    s.fail_open_tokens -= refund.min(s.fail_open_tokens);
                } else {
                    s.tokens -= refund.min(s.tokens);
                }
            }
            self.metrics
                .settled(&r.key.budget(), used_tokens.min(r.tokens), refund);
        }
    }

    /// Asks the ledger to give back what a request another process routed did not use (its
    /// routing process is gone: see [`kvplane_state::QuotaSettle`]).
    pub fn settle_elsewhere(&self, settles: Vec<QuotaSettle>) {
        if settles.is_empty() {
            return;
        }
        for s in &settles {
            self.metrics.settled(&s.key.budget(), 0, s.tokens);
        }
        self.lock().settles.extend(settles);
        self.wake.notify_one();
    }

    /// The next batch for the ledger: grants for keys that ran short or are running low,
    /// releases of escrow that idle keys (every key, at `shutdown`) will not use. `None` when
    /// there is nothing to ask. Updates the escrow gauges.
    pub(crate) fn next_batch(&self, shutdown: bool) -> Option<QuotaBatch> {
        let mut local = self.lock();
        let view = self.state.load();
        let now = wall_ms();
        let mut asks = Vec::new();
        let mut releases = Vec::new();
        let wanted = std::mem::take(&mut local.wanted);
        let in_use: Vec<_> = local.in_use.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (key, (grant_tokens, grant_requests, last)) in in_use {
            let book = view.quota.books.get(&key);
            let window = book.map(|b| (b.window_start_ms, b.window_end_ms()));
            let current = window.is_some_and(|(s, e)| s <= now && now < e);
            let held = book.map(|b| self.held(&view, b)).unwrap_or_default();
            let spent = window
                .and_then(|(s, _)| local.spent.get(&(key.clone(), s)).copied())
                .unwrap_or_default();
            let (aside, aside_requests) = match window {
                Some((s, _)) => local.set_aside(
                    view.quota.replicas.get(&self.cfg.replica).copied(),
                    self.cfg.incarnation,
                    &key,
                    s,
                ),
                None => (0, 0),
            };
            let avail = held.tokens.saturating_sub(spent.tokens + aside);
            let avail_requests = held
                .requests
                .saturating_sub(spent.requests + aside_requests);
            self.metrics
                .escrow(&key.budget(), if current { avail } else { 0 });
            if shutdown || last.elapsed() >= self.cfg.idle_release {
                if current && (avail > 0 || avail_requests > 0) {
                    let window_start_ms = window.map_or(0, |(s, _)| s);
                    // Unspendable from now on: this batch will carry seq + 1.
                    let seq = local.seq + 1;
                    self.metrics.released(&key.budget(), avail);
                    local.releasing.push(Releasing {
                        seq,
                        key: key.clone(),
                        window_start_ms,
                        tokens: avail,
                        requests: avail_requests,
                    });
                    releases.push(QuotaRelease {
                        key: key.clone(),
                        window_start_ms,
                        tokens: avail,
                        requests: avail_requests,
                    });
                }
                local.in_use.remove(&key);
                continue;
            }
            let want = wanted.get(&key).copied();
            let low = !current || avail < grant_tokens / 2 || avail_requests < grant_requests / 2;
            let exhausted = book.is_some_and(|b| {
                let left = b.grantable(self.cfg.replica, now);
                current
                    && ((grant_tokens > 0 && left.tokens == 0)
                        || (grant_requests > 0 && left.requests == 0))
            });
            // A request was short: ask even with nothing grantable, so that the ledger knows
            // the demand it could not meet (one ask per key and refill at most).
            if want.is_some() || (low && !exhausted) {
                let (t, q) = want.unwrap_or((grant_tokens, grant_requests));
                asks.push(QuotaAsk {
                    key,
                    tokens: t,
                    requests: q,
                });
            }
        }
        // A release whose batch was lost stays set aside until the ledger applied a later batch
        // of this replica: send one (empty) rather than keep the tokens from everyone.
        let applied = view.quota.replicas.get(&self.cfg.replica).copied();
        local.prune_released(applied, self.cfg.incarnation);
        // Settles stay until the ledger has their ticket, or their window is over.
        local.settles.retain(|s| {
            view.quota.books.get(&s.key).is_some_and(|b| {
                b.window_start_ms == s.window_start_ms && !b.settled.contains(&s.ticket)
            })
        });
        // A new process says so at once: what its earlier one held becomes no one's, and that
        // one's requests reported elsewhere give back what they did not use.
        let restarted = applied.is_some_and(|(inc, _)| inc < self.cfg.incarnation);
        if asks.is_empty()
            && releases.is_empty()
            && local.releasing.is_empty()
            && local.settles.is_empty()
            && !restarted
        {
            return None;
        }
        local.seq += 1;
        Some(QuotaBatch {
            replica: self.cfg.replica,
            incarnation: self.cfg.incarnation,
            seq: local.seq,
            asks,
            releases,
            settles: local.settles.clone(),
        })
    }

    /// Records a grant attempt and wakes the requests waiting for it.
    pub(crate) fn attempted(
        &self,
        result: Result<(), kvplane_state::ProposeError>,
        took: Duration,
    ) {
        self.metrics.grant(took.as_secs_f64(), result.is_ok());
        let mut local = self.lock();
        local.failing = match result {
            Ok(()) => None,
            // Committed but applied late here: grants are being made, no streak of failures.
            Err(
                e @ kvplane_state::ProposeError::Unavailable(
                    kvplane_state::Unavailable::NotApplied { .. },
                ),
            ) => Some((e, 0, Instant::now())),
            Err(e) => {
                let before = local.failing.as_ref().map_or(0, |(_, n, _)| *n);
                Some((e, before.saturating_add(1), Instant::now()))
            }
        };
        drop(local);
        self.attempts.send_modify(|n| *n += 1);
    }

    /// Spending per window (newest windows), with the cluster's figures for current ones.
    pub fn status(&self) -> Vec<QuotaStatus> {
        let view = self.state.load();
        let local = self.lock();
        local
            .spent
            .iter()
            .map(|((key, start), s)| {
                let book = view
                    .quota
                    .books
                    .get(key)
                    .filter(|b| b.window_start_ms == *start);
                let held = book.map(|b| self.held(&view, b)).unwrap_or_default();
                QuotaStatus {
                    tenant: key.budget().into_owned(),
                    model: key.model.clone(),
                    window_start_ms: *start,
                    window_ms: book.map_or(0, |b| b.window_ms),
                    spent_tokens: s.tokens,
                    spent_requests: s.requests,
                    held_tokens: held.tokens,
                    budget_tokens: book.map_or(0, |b| b.budget.tokens),
                    granted_tokens: book.map_or(0, |b| b.granted.tokens),
                    fail_open_tokens: s.fail_open_tokens,
                }
            })
            .collect()
    }
}

/// One limit as Explain shows it: the window's budget, what the cluster granted, what this
/// replica holds and has spent.
pub(crate) fn explain_limit(
    view: &kvplane_state::View,
    m: &MatchedLimit<'_>,
    escrow: Option<&Escrow>,
) -> String {
    let l = m.limit;
    let mut s = format!(
        "limit {}: {} tokens and {} requests per {} s window",
        m.key,
        l.window_tokens()
            .map_or("unlimited".into(), |t| t.to_string()),
        l.window_requests()
            .map_or("unlimited".into(), |t| t.to_string()),
        l.window_seconds
    );
    let now = wall_ms();
    let start = now - now % l.window_ms().max(1);
    match view
        .quota
        .books
        .get(&m.key)
        .filter(|b| b.window_start_ms == start)
    {
        None => s.push_str("; nothing granted in this window yet"),
        Some(b) => {
            s.push_str(&format!("; {} granted in this window", b.granted.tokens));
            if let Some(e) = escrow {
                let spent = e
                    .lock()
                    .spent
                    .get(&(m.key.clone(), start))
                    .map_or(0, |x| x.tokens);
                s.push_str(&format!(
                    ", this replica holds {} and spent {}",
                    e.held(view, b).tokens,
                    spent
                ));
            }
        }
    }
    if escrow.is_none() {
        s.push_str(" (not enforced here: no escrow)");
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use kvplane_policy::kinds::{InferencePolicySpec, TenantLimit};
    use kvplane_policy::{Object, Spec};
    use kvplane_state::{Command, ConfigObject, Entry, StateMachine};

    /// 3600 s windows: a window's budget is 60 times the per-minute figures.
    fn limit(per_minute: u64, burst: u64, fail_open_per_minute: Option<u64>) -> TenantLimit {
        TenantLimit {
            tenant: "acme".into(),
            model: None,
            tokens_per_minute: Some(per_minute),
            requests_per_minute: None,
            burst: Some(burst),
            window_seconds: 3600,
            fail_open_tokens_per_minute: fail_open_per_minute,
        }
    }

    /// What a refiller cut off from the quorum gets back.
    fn no_quorum() -> kvplane_state::ProposeError {
        kvplane_state::ProposeError::Unavailable(kvplane_state::Unavailable::NoLeader {
            what: "write",
            timeout: Duration::from_secs(1),
            why: "no leader is known".into(),
        })
    }

    /// A state with `l`, and replica 1 granted `grant` tokens of it (0: no grant).
    fn state(l: TenantLimit, grant: u64) -> (StateMachine, Escrow) {
        let mut sm = StateMachine::new();
        let policy = ConfigObject::policy(&Object {
            name: "limits".into(),
            spec: Spec::Policy(InferencePolicySpec {
                applies_to_models: vec![],
                rules: vec![],
                limits: vec![l],
            }),
        });
        let now = wall_ms();
        let apply = |sm: &mut StateMachine, command| {
            let a = sm
                .apply(&Entry {
                    index: sm.applied_index() + 1,
                    timestamp_ms: now,
                    command,
                })
                .unwrap();
            assert!(a.rejected.is_none(), "{:?}", a.rejected);
        };
        apply(
            &mut sm,
            Command::ConfigApply {
                owner: Some(kvplane_state::Owner::Admin),
                puts: vec![policy],
                deletes: vec![],
            },
        );
        if grant > 0 {
            apply(
                &mut sm,
                Command::Quota(QuotaBatch {
                    replica: 1,
                    incarnation: 1,
                    seq: 1,
                    asks: vec![QuotaAsk {
                        key: LimitKey {
                            tenant: "acme".into(),
                            model: String::new(),
                            provider: String::new(),
                        },
                        tokens: grant,
                        requests: 0,
                    }],
                    releases: vec![],
                    settles: vec![],
                }),
            );
        }
        // The process that was granted `grant`.
        let escrow = Escrow::new(
            QuotaConfig {
                grant_wait: Duration::from_millis(20),
                incarnation: 1,
                ..QuotaConfig::default()
            },
            sm.handle(),
            QuotaMetrics::default(),
        );
        (sm, escrow)
    }

    async fn reserve(
        sm: &StateMachine,
        e: &Escrow,
        tokens: u64,
    ) -> Result<Vec<Reservation>, Refusal> {
        let view = sm.handle().load();
        let limits = view.catalog.limits_for("acme", "m");
        e.reserve(&limits, tokens).await
    }

    #[tokio::test]
    async fn a_settled_request_returns_what_it_did_not_use() {
        let (sm, e) = state(limit(200, 1000, None), 1000);
        let first = reserve(&sm, &e, 600).await.unwrap();
        // 400 left in escrow, 11,000 still grantable: not exhausted, but no grant comes.
        let short = reserve(&sm, &e, 600).await.unwrap_err();
        assert!(matches!(short, Refusal::NoGrant { .. }), "{short}");
        e.settle(&first, 100);
        assert_eq!(reserve(&sm, &e, 600).await.unwrap()[0].tokens, 600);
    }

    #[tokio::test]
    async fn an_exhausted_window_is_refused_with_the_time_until_it_resets() {
        let (sm, e) = state(limit(20, 1200, None), 1200);
        reserve(&sm, &e, 900).await.unwrap();
        let r = reserve(&sm, &e, 400).await.unwrap_err();
        assert!(
            r.to_string()
                .contains("token limit of 1200 per 3600 s window reached"),
            "{r}"
        );
        assert!(r.retry_after_ms() > 0 && r.retry_after_ms() <= 3_600_000);
    }

    #[tokio::test]
    async fn without_grants_only_a_fail_open_limit_admits_and_only_up_to_its_bound() {
        let (sm, closed) = state(limit(200, 1000, None), 0);
        closed.attempted(Err(no_quorum()), Duration::ZERO);
        let r = reserve(&sm, &closed, 100).await.unwrap_err();
        assert!(r.to_string().contains("no quorum reachable"), "{r}");
        assert!(r.to_string().contains("fails closed"), "{r}");

        let (sm, open) = state(limit(200, 1000, Some(10)), 0);
        open.attempted(Err(no_quorum()), Duration::ZERO);
        let a = reserve(&sm, &open, 400).await.unwrap();
        assert!(a[0].fail_open);
        assert!(reserve(&sm, &open, 400).await.is_err());
        assert_eq!(open.status()[0].fail_open_tokens, 400);
    }

    #[tokio::test]
    async fn grants_failing_again_and_again_refuse_at_once_and_a_success_restores_the_wait() {
        let (sm, e) = state(limit(200, 1000, None), 0);
        let waited = |r: Refusal| match r {
            Refusal::NoGrant { waited_ms, .. } => waited_ms,
            other => panic!("{other}"),
        };
        // One failure may be a blip: the request waits out grant_wait (20 ms here).
        e.attempted(Err(no_quorum()), Duration::ZERO);
        assert!(waited(reserve(&sm, &e, 100).await.unwrap_err()) >= 20);
        // Two in a row: refused at once, saying why.
        e.attempted(Err(no_quorum()), Duration::ZERO);
        let r = reserve(&sm, &e, 100).await.unwrap_err();
        assert!(r.to_string().contains("no quorum reachable"), "{r}");
        assert!(waited(r) < 20);
        // A streak that ended long ago (nothing asked since) is no news: it waits again.
        if let Some((_, _, at)) = &mut e.lock().failing {
            *at = Instant::now().checked_sub(FAILED_RECENTLY).unwrap();
        }
        assert!(waited(reserve(&sm, &e, 100).await.unwrap_err()) >= 20);
        // A grant attempt that worked: short requests wait for the next one again.
        e.attempted(Ok(()), Duration::ZERO);
        assert!(waited(reserve(&sm, &e, 100).await.unwrap_err()) >= 20);
        // Grants committed but applied late here are being made: no streak.
        for _ in 0..FAILED_IN_A_ROW {
            e.attempted(
                Err(kvplane_state::ProposeError::Unavailable(
                    kvplane_state::Unavailable::NotApplied {
                        what: "write",
                        index: 7,
                        cause: std::sync::Arc::new(std::io::Error::other("slow apply")),
                    },
                )),
                Duration::ZERO,
            );
        }
        assert!(waited(reserve(&sm, &e, 100).await.unwrap_err()) >= 20);
    }

    /// Replicas of one 600-token window (grants of 200), committing through `sm`.
    fn replicas(sm: &StateMachine) -> Vec<Escrow> {
        (0..3u64).map(|r| replica(sm, r + 1, 1)).collect()
    }

    /// The process `incarnation` of replica `id`.
    fn replica(sm: &StateMachine, id: u64, incarnation: u64) -> Escrow {
        Escrow::new(
            QuotaConfig {
                replica: id,
                incarnation,
                idle_release: Duration::from_secs(3600),
                ..QuotaConfig::default()
            },
            sm.handle(),
            QuotaMetrics::default(),
        )
    }

    #[test]
    fn a_restarted_replica_cannot_spend_what_its_earlier_process_held() {
        let (mut sm, _) = state(limit(10, 200, None), 0);
        let first = replica(&sm, 1, 1);
        assert!(!try_spend(&sm, &first, 10));
        commit(&mut sm, first.next_batch(false).unwrap());
        assert!(try_spend(&sm, &first, 10), "granted 200, spent 10");
        // kill -9: the record of what was spent dies with the process.
        let second = replica(&sm, 1, 2);
        assert!(
            !try_spend(&sm, &second, 190),
            "the earlier process's 200 are not this one's"
        );
        commit(&mut sm, second.next_batch(false).unwrap());
        let view = sm.handle().load();
        let book = view.quota.books.values().next().unwrap();
        assert_eq!(book.granted.tokens, 400, "the old 200 stay spent");
        assert_eq!(
            book.held(1).tokens,
            200,
            "the new process holds its own grant"
        );
        assert!(try_spend(&sm, &second, 200));
        assert!(!try_spend(&sm, &second, 10));
    }

    fn commit(sm: &mut StateMachine, b: QuotaBatch) {
        let index = sm.applied_index() + 1;
        sm.apply(&Entry {
            index,
            timestamp_ms: wall_ms(),
            command: Command::Quota(b),
        })
        .unwrap();
        // The published digest is the one recomputed from the whole state.
        assert_eq!(sm.handle().load().digest, sm.digest());
    }

    fn try_spend(sm: &StateMachine, e: &Escrow, tokens: u64) -> bool {
        let view = sm.handle().load();
        let limits = view.catalog.limits_for("acme", "m");
        e.try_reserve(&limits, tokens, false).is_ok()
    }

    /// Tokens admitted in the current windows over `replicas`.
    fn admitted(replicas: &[Escrow]) -> u64 {
        replicas
            .iter()
            .map(|e| e.lock().spent.values().map(|s| s.tokens).sum::<u64>())
            .sum()
    }

    /// A 600-token window where replica 1 was granted 200, spent 50, then went idle: returns
    /// the state, the replicas and its release of the other 150 (proposed, not committed).
    fn releasing_150() -> (StateMachine, Vec<Escrow>, QuotaBatch) {
        let (mut sm, _) = state(limit(10, 200, None), 0);
        let r = replicas(&sm);
        assert!(!try_spend(&sm, &r[0], 50));
        let ask = r[0].next_batch(false).unwrap();
        commit(&mut sm, ask);
        assert!(try_spend(&sm, &r[0], 50));
        let release = r[0].next_batch(true).unwrap();
        assert_eq!(release.releases[0].tokens, 150);
        (sm, r, release)
    }

    #[test]
    fn escrow_being_released_cannot_be_spent_while_the_release_is_in_flight() {
        // A burst arrives while the release is in flight.
        let (mut sm, r, release) = releasing_150();
        assert!(
            !try_spend(&sm, &r[0], 150),
            "the 150 being released are set aside"
        );
        commit(&mut sm, release);
        // The others take the rest of the window (a ledger's first window keeps nothing for
        // anyone).
        for _ in 0..10 {
            for e in &r[1..] {
                while try_spend(&sm, e, 50) {}
                if let Some(b) = e.next_batch(false) {
                    commit(&mut sm, b);
                }
            }
        }
        let n = admitted(&r);
        assert!(
            (500..=600).contains(&n),
            "{n} tokens admitted of the window's 600"
        );
    }

    #[test]
    fn a_lost_release_is_cleared_by_a_later_batch_and_its_tokens_are_spendable_again() {
        // The release is lost (a leader change): its 150 stay set aside until a later batch of
        // this replica applies - one is sent even with nothing else in it.
        let (mut sm, r, _lost) = releasing_150();
        let later = r[0].next_batch(false).unwrap();
        assert!(later.asks.is_empty() && later.releases.is_empty());
        commit(&mut sm, later);
        assert!(
            r[0].next_batch(false).is_none(),
            "nothing set aside any more"
        );
        assert!(
            try_spend(&sm, &r[0], 100),
            "the ledger still counts them as held here"
        );
    }

    /// One step of the ledger property below.
    #[derive(Debug, Clone)]
    enum Op {
        Reserve {
            replica: usize,
            tokens: u64,
        },
        Settle {
            replica: usize,
            which: usize,
            used_percent: u64,
        },
        /// The replica's refiller builds its next batch: asks, or (`release`: its keys idle)
        /// releases of the escrow it holds.
        Batch {
            replica: usize,
            release: bool,
        },
        /// The leader commits one batch in flight (any of them: proposals interleave).
        Commit {
            which: usize,
        },
        /// A batch in flight is lost (a leader change before it committed).
        Lose {
            which: usize,
        },
        /// The replica's process is killed and started again: what it spent is forgotten by
        /// it (its batches in flight may still commit).
        Restart {
            replica: usize,
        },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0..3usize, 10..150u64).prop_map(|(replica, tokens)| Op::Reserve { replica, tokens }),
            1 => (0..3usize, 0..8usize, 50..=100u64)
                .prop_map(|(replica, which, used_percent)| Op::Settle { replica, which, used_percent }),
            2 => (0..3usize, proptest::bool::weighted(0.3))
                .prop_map(|(replica, release)| Op::Batch { replica, release }),
            3 => (0..8usize).prop_map(|which| Op::Commit { which }),
            1 => (0..8usize).prop_map(|which| Op::Lose { which }),
            1 => (0..3usize).prop_map(|replica| Op::Restart { replica }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Over any interleaving of asks, grants, releases of idle escrow, spends, refunds,
        /// lost proposals and replica restarts, the tokens three replicas admitted in a window
        /// never exceed its budget: a released amount is unspendable from the moment it is
        /// proposed, and what a killed process held is never spent again.
        #[test]
        fn replicas_never_admit_more_than_the_window_budget(
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            // 600 tokens per 3600 s window, grants of 200.
            let (mut sm, _) = state(limit(10, 200, None), 0);
            let mut replicas = replicas(&sm);
            let mut incarnations = [1u64; 3];
            // What killed processes admitted, per window (their own records died with them).
            let mut by_the_dead: BTreeMap<u64, u64> = BTreeMap::new();
            let mut held: Vec<Vec<Vec<Reservation>>> = vec![Vec::new(); 3];
            let mut in_flight: Vec<QuotaBatch> = Vec::new();
            for op in ops {
                match op {
                    Op::Reserve { replica, tokens } => {
                        let view = sm.handle().load();
                        let limits = view.catalog.limits_for("acme", "m");
                        if let Ok(r) = replicas[replica].try_reserve(&limits, tokens, false) {
                            held[replica].push(r);
                        }
                    }
                    Op::Settle { replica, which, used_percent } => {
                        if !held[replica].is_empty() {
                            let n = held[replica].len();
                            let r = held[replica].remove(which % n);
                            let used = r[0].tokens * used_percent / 100;
                            replicas[replica].settle(&r, used);
                        }
                    }
                    Op::Batch { replica, release } => {
                        if let Some(b) = replicas[replica].next_batch(release) {
                            in_flight.push(b);
                        }
                    }
                    Op::Commit { which } => {
                        if !in_flight.is_empty() {
                            let b = in_flight.remove(which % in_flight.len());
                            commit(&mut sm, b);
                        }
                    }
                    Op::Lose { which } => {
                        if !in_flight.is_empty() {
                            in_flight.remove(which % in_flight.len());
                        }
                    }
                    Op::Restart { replica: i } => {
                        for ((_, start), s) in &replicas[i].lock().spent {
                            *by_the_dead.entry(*start).or_default() += s.tokens;
                        }
                        held[i].clear();
                        incarnations[i] += 1;
                        replicas[i] = replica(&sm, i as u64 + 1, incarnations[i]);
                    }
                }
                // Admitted (net of refunds) per window, over all replicas.
                let mut per_window = by_the_dead.clone();
                for e in &replicas {
                    for ((_, start), s) in &e.lock().spent {
                        *per_window.entry(*start).or_default() += s.tokens;
                    }
                }
                for (start, spent) in per_window {
                    proptest::prop_assert!(spent <= 600, "window {start}: {spent} tokens admitted of 600");
                }
                let view = sm.handle().load();
                for b in view.quota.books.values() {
                    proptest::prop_assert!(b.granted.tokens <= b.budget.tokens);
                }
            }
        }
    }
}
