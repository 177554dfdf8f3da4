//! Predicted time to first token, per candidate (README, "Cost"):
//!
//! ```text
//! own_ms     = base_ms + uncached prompt tokens / rate * 1000 + running * running_request_ms
//! queue_ms   = until the requests this cluster routed there are predicted to have their first
//!              tokens (each prediction made when it was routed, so they chain; already
//!              calibrated), plus the others waiting there (metrics' waiting less ours) * the
//!              average prefill time of the requests this replica routes there (at first
//!              waiting_request_ms)
//! predicted  = ours_pending_ms + (own_ms + others_waiting_ms) * calibration
//! ```
//!
//! `rate` is the worker set's `prefillTokensPerSecond` (else the cost model's). `calibration`
//! is per worker set, learned online from the TTFTs that ReportUsage reports (an exponential
//! average of observed / predicted, within 0.2..5). Where gateways do not report usage, the
//! engines' own TTFT histograms (vLLM's `time_to_first_token_seconds`, in their metrics) stand
//! in: once the engines of a set counted 32 more first tokens and this replica predicted 32
//! more, the ratio of their mean TTFT to the mean prediction moves the calibration the same
//! way (only while no usage was reported for 10 s). A routed request stays pending until its
//! first token or its usage is reported; without reports, until metrics sampled after it was due show nothing
//! waiting, or show fewer waiting than the requests due before the sample (the oldest go); at
//! the latest for a minute.
//!
//! With `cost.learn` each worker also gets an engine model learned from the first tokens of
//! requests routed to it while quiet ([`crate::learn`]; the set's model stands in until the
//! worker has its own), and once that model predicted a set's first tokens better than the
//! calibrated configured one over 16 reports, its terms replace the configured figures and
//! the calibration there (`kvplane_worker_ttft_prediction_ratio` shows each worker's error).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::learn::{EngineFit, Features};
use crate::placed::{GRACE_MS, Placed, PlacedMatch};
use kvplane_state::Anchor;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// Milliseconds since the Unix epoch (a benchmark substitutes virtual time).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

pub fn wall_clock() -> Clock {
    Arc::new(crate::quota::wall_ms)
}

const PENDING_TTL_MS: u64 = 60_000;
/// Worker sets whose routed prompts are remembered at most (a note naming another is not).
const MAX_PLACED_SETS: usize = 1_024;
/// First tokens (observed and predicted) a histogram calibration step needs.
const HISTOGRAM_STEP: u64 = 32;
/// Histograms stand in for usage reports only when none came for this long.
const REPORTS_QUIET_MS: u64 = 10_000;
const RECENT: usize = 4096;
/// Started requests kept per worker for the metrics that may still count them waiting.
const MAX_STARTED: usize = 256;
const ALPHA: f64 = 0.1;
/// Reports both models must have predicted before the learned one can be used.
const COMPARE_FIRST: u64 = 16;
/// The weight of a report in [`ModelErrors`].
const ERROR_ALPHA: f64 = 0.05;
/// `kvplane_ttft_prediction_ratio`'s buckets: fine around 1 (the 0.85..1.15 band shows).
const RATIO_BUCKETS: [f64; 15] = [
    0.0625, 0.125, 0.25, 0.5, 0.7, 0.85, 0.95, 1.05, 1.15, 1.3, 1.5, 2.0, 4.0, 8.0, 16.0,
];

/// A routing decision, as replicas tell each other (see [`Predictor::routed_elsewhere`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RoutedNote {
    pub worker_set: String,
    pub worker: String,
    pub at_ms: u64,
    pub due_ms: u64,
    /// The worker's dp rank the request went to (see [`crate::placed`]).
    #[serde(default)]
    pub dp_rank: u32,
    /// The prompt's anchors (none from older versions, and for a prompt of no complete block).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub anchors: Vec<kvplane_state::Anchor>,
}

/// Where a replica sends its routing decisions.
#[derive(Clone)]
pub struct RoutedSink(pub Arc<dyn Fn(RoutedNote) + Send + Sync>);

impl std::fmt::Debug for RoutedSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoutedSink")
    }
}

/// What [`Predictor::pending`] says about one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct InFlight {
    pub requests: u32,
    pub prefill_tokens: u64,
    /// Until the last of them is predicted to have its first token, from now.
    pub busy_ms: u64,
    /// Of `requests`, routed before the metrics sample (so possibly among its waiting).
    pub in_metrics: u32,
    /// This replica's requests there between their first token and their end (reported at
    /// both): running on the engine now, whatever its last metrics sample said.
    pub decoding: u32,
    /// The engine model learned for the worker (else for its set), once a first token was
    /// reported: see [`crate::learn`].
    pub learned: Option<Features>,
    /// When this replica or, as they told it, another last routed a request there (ms).
    pub last_routed_ms: u64,
}

/// What a routed request can teach the engine model once its first token is reported.
#[derive(Debug, Clone, Copy)]
pub struct Learning {
    /// The decision's [`kvplane_policy::Prediction::inputs`].
    pub inputs: Features,
    /// What it predicted for this replica's requests ahead of it there: the observed time
    /// less this is the worker's own.
    pub ahead_ms: f64,
    /// Where a new fit starts: the configured cost model as terms.
    pub prior: Features,
    /// The set's calibration then: with `prior`, what the configured model predicted.
    pub calibration: f64,
    /// This replica's requests there without a first token then (due or not).
    pub pending: u32,
}

/// How well each model predicted a set's first tokens lately: an exponential average of
/// |ln(observed / predicted)|, over the reports both predicted.
#[derive(Debug, Default, Clone, Copy)]
struct ModelErrors {
    learned: f64,
    configured: f64,
    compared: u64,
}

impl ModelErrors {
    /// The learned model is used once it predicted better than the configured one over
    /// enough reports (where the configured figures are right, they stay).
    fn learned_better(&self) -> bool {
        self.compared >= COMPARE_FIRST && self.learned < self.configured
    }
}

#[derive(Debug, Clone)]
struct Pending {
    request_id: String,
    at_ms: u64,
    prefill_tokens: u64,
    /// When it was predicted to have its first token.
    due_ms: u64,
    /// Routed by another replica (its usage is reported there): gone once due.
    foreign: bool,
    learning: Option<Learning>,
}

/// One worker's requests as this replica knows them.
#[derive(Debug, Default)]
struct Queue {
    pending: Vec<Pending>,
    /// Requests that had their first token lately: (routed at, first token at). A metrics
    /// sample taken in between may still count them as waiting.
    started: Vec<(u64, u64)>,
    /// The engine's TTFT histogram as last seen: (sum in seconds, count).
    histogram: Option<(f64, u64)>,
    /// Requests whose first token was reported and whose end was not yet: (request id, first
    /// token at); at most a minute each.
    decoding: Vec<(String, u64)>,
    /// The engine model learned from this worker's first tokens (boxed: most queues have
    /// none, and a decision reads every queue of a set).
    fit: Option<Box<EngineFit>>,
    /// Observed over predicted TTFT, an exponential average of its reports.
    ratio: Option<f64>,
    /// When a request was last routed here (by any replica, as this one heard).
    last_routed_ms: u64,
}

/// Since the last histogram calibration step of a worker set: what this replica predicted and
/// what its engines' histograms observed (sums in ms, counts).
#[derive(Debug, Default, Clone, Copy)]
struct HistogramWindow {
    predicted_ms: f64,
    predicted: u64,
    observed_ms: f64,
    observed: u64,
    last_report_ms: u64,
}

/// One worker set's queues.
#[derive(Debug, Default)]
struct SetQueues {
    /// Each worker's queue, by its slot.
    queues: Vec<Queue>,
    /// The slot of each worker's queue, by name (a slot is never reused).
    slots: FxHashMap<String, usize>,
    /// The workers of the last list a decision asked about, in its order, with their slots.
    /// A view shares its workers' names with the views after it, so while the list stays the
    /// same (the same names, pointer for pointer), a decision finds each worker's queue by
    /// its position: no name hashed or compared per candidate. Holding the names keeps a
    /// pointer from meaning another name.
    roster: Vec<(Arc<str>, usize)>,
    /// The highest metrics index whose TTFT histograms were folded in: a worker whose
    /// metrics are no newer has nothing new to fold.
    histograms_through: Option<u64>,
    /// The engine model learned from every worker's first tokens: where a worker's own
    /// starts, and what stands for it until then.
    fit: Option<EngineFit>,
    errors: ModelErrors,
    /// The first tokens the fits learned from took this long on average (ms): what a request
    /// waiting there costs in the learned model.
    typical_ms: Option<f64>,
}

/// A fit's terms as predictions use them: a waiting request costs what the average first
/// token on a quiet engine took (`typical_ms`), the fit's own waiting term never being
/// observed (it learns from quiet engines only).
fn learned_terms(fit: Option<&EngineFit>, typical_ms: Option<f64>) -> Option<Features> {
    let mut t = fit?.terms();
    t[3] = typical_ms.unwrap_or(t[3]);
    Some(t)
}

impl SetQueues {
    /// What the engine model learns from a first token on the worker in `slot` observed after
    /// `observed_ms`; returns what the configured model (calibrated) predicted for it.
    fn learn(&mut self, slot: usize, l: &Learning, observed_ms: f64) -> f64 {
        let own =
            |terms: &Features| -> f64 { terms.iter().zip(&l.inputs).map(|(t, x)| t * x).sum() };
        let configured_ms = l.ahead_ms + l.calibration * own(&l.prior);
        let q = &self.queues[slot];
        if let Some(terms) = learned_terms(q.fit.as_deref().or(self.fit.as_ref()), self.typical_ms)
            && configured_ms > 0.0
        {
            let learned_ms = l.ahead_ms + own(&terms.map(|t| t.max(0.0)));
            let error = |p: f64| (observed_ms / p.max(1e-3)).ln().abs();
            let e = &mut self.errors;
            if e.compared == 0 {
                (e.learned, e.configured) = (error(learned_ms), error(configured_ms));
            } else {
                e.learned += ERROR_ALPHA * (error(learned_ms) - e.learned);
                e.configured += ERROR_ALPHA * (error(configured_ms) - e.configured);
            }
            e.compared += 1;
        }
        // Learned from first tokens on a quiet engine only (nothing of this replica's ahead,
        // nobody else's waiting): what the engine itself takes. What a waiting request costs
        // is what such a first token took on average.
        if l.pending == 0 && l.inputs[3] == 0.0 && observed_ms <= crate::learn::MAX_OWN_MS {
            let set_fit = self.fit.get_or_insert_with(|| EngineFit::new(l.prior));
            self.queues[slot]
                .fit
                .get_or_insert_with(|| Box::new(set_fit.clone()))
                .observe(&l.inputs, observed_ms);
            set_fit.observe(&l.inputs, observed_ms);
            let t = self.typical_ms.get_or_insert(observed_ms);
            *t += ALPHA * (observed_ms - *t);
        }
        configured_ms
    }

    fn slot(&mut self, worker: &str) -> usize {
        if let Some(&i) = self.slots.get(worker) {
            return i;
        }
        self.queues.push(Queue::default());
        self.slots.insert(worker.to_owned(), self.queues.len() - 1);
        self.queues.len() - 1
    }

    fn queue(&mut self, worker: &str) -> &mut Queue {
        let i = self.slot(worker);
        &mut self.queues[i]
    }

    /// Makes the roster `workers`' slots, in their order (nothing to do when it is the same
    /// list).
    fn follow(&mut self, workers: &[Ask<'_>]) {
        let same = self.roster.len() == workers.len()
            && self
                .roster
                .iter()
                .zip(workers)
                .all(|((n, _), a)| Arc::ptr_eq(n, a.worker));
        if !same {
            self.roster = workers
                .iter()
                .map(|a| (a.worker.clone(), self.slot(a.worker)))
                .collect();
        }
    }
}

impl Inner {
    fn set(&mut self, worker_set: &str) -> &mut SetQueues {
        if !self.queues.contains_key(worker_set) {
            self.queues
                .insert(worker_set.to_owned(), SetQueues::default());
        }
        self.queues
            .get_mut(worker_set)
            .unwrap_or_else(|| unreachable!())
    }

    fn queue(&mut self, worker_set: &str, worker: &str) -> &mut Queue {
        self.set(worker_set).queue(worker)
    }
}

/// One worker as a decision asks about it (see [`Predictor::pending_set`]): its name as the
/// view shares it, and its last metrics sample.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub worker: &'a Arc<str>,
    /// The index of the entry that carried the sample (it grows with every new sample).
    pub metrics_index: u64,
    pub metrics_at_ms: u64,
    pub waiting: u32,
    /// The engine's TTFT histogram: (sum in seconds, count).
    pub ttft_histogram: (f64, u64),
}

#[derive(Debug, Default)]
struct Inner {
    /// By worker set (looked up once per worker set a decision reads; nothing iterates it).
    queues: FxHashMap<String, SetQueues>,
    /// By worker set: observed / predicted.
    calibration: BTreeMap<String, f64>,
    /// Recently reported requests: (request id, predicted ms, observed ms).
    recent: VecDeque<(String, f64, f64)>,
    /// An average of the prefill time of the requests this replica routes, by worker set: what
    /// a request the metrics show waiting (another replica's) is taken to cost.
    typical_ms: BTreeMap<String, f64>,
    /// By worker set (see [`HistogramWindow`]).
    windows: BTreeMap<String, HistogramWindow>,
    /// By worker set: the prompts routed there, not yet known to be indexed.
    placed: FxHashMap<String, Placed>,
}

impl Inner {
    /// Folds an engine's histogram sample into its set's window; takes a calibration step when
    /// the window is full and no usage was reported lately.
    fn engine_histogram(
        &mut self,
        worker_set: &str,
        worker: &str,
        now: u64,
        (sum, count): (f64, u64),
    ) {
        let q = self.queue(worker_set, worker);
        let prev = q.histogram.replace((sum, count));
        let Some((prev_sum, prev_count)) = prev else {
            return;
        };
        // A restarted engine starts its histogram again.
        if count <= prev_count || sum < prev_sum {
            return;
        }
        let w = self.windows.entry(worker_set.to_owned()).or_default();
        w.observed += count - prev_count;
        w.observed_ms += (sum - prev_sum) * 1000.0;
        if w.observed < HISTOGRAM_STEP || w.predicted < HISTOGRAM_STEP {
            return;
        }
        let quiet = now.saturating_sub(w.last_report_ms) >= REPORTS_QUIET_MS;
        let ratio = (w.observed_ms / w.observed as f64) / (w.predicted_ms / w.predicted as f64);
        let last_report_ms = w.last_report_ms;
        *w = HistogramWindow {
            last_report_ms,
            ..HistogramWindow::default()
        };
        if quiet && ratio.is_finite() && ratio > 0.0 {
            let c = self.calibration.entry(worker_set.to_owned()).or_insert(1.0);
            *c = (*c * (1.0 - ALPHA + ALPHA * ratio)).clamp(0.2, 5.0);
        }
    }
}

/// Which of `pending` (oldest first) may still be waiting for their first token. A request
/// leaves after a minute; once due, when metrics sampled after it was due show nothing
/// waiting; a foreign one (another replica's, reported there) once due; and, without any
/// usage report, by the engine's metrics alone: of the requests routed and due before the
/// sample, at most as many as it shows waiting can still wait (the newest of them).
fn still_pending(
    pending: &[Pending],
    now: u64,
    metrics_at_ms: u64,
    metrics_waiting: u32,
) -> Vec<bool> {
    let mut keep: Vec<bool> = pending
        .iter()
        .map(|p| {
            p.at_ms + PENDING_TTL_MS > now
                && !(metrics_waiting == 0 && p.due_ms < metrics_at_ms)
                && !(p.foreign && p.due_ms < now)
        })
        .collect();
    if metrics_at_ms > 0 {
        let mut allowed = metrics_waiting as usize;
        for (i, p) in pending.iter().enumerate().rev() {
            if keep[i] && p.due_ms < metrics_at_ms {
                if allowed == 0 {
                    keep[i] = false;
                } else {
                    allowed -= 1;
                }
            }
        }
    }
    keep
}

/// This replica's in-flight view and calibration.
pub struct Predictor {
    inner: Mutex<Inner>,
    clock: Clock,
    /// observed / predicted, per reported request.
    error_ratio: Histogram,
    /// Per worker, the exponential average of observed / predicted.
    worker_ratio: Family<[(&'static str, String); 2], Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl std::fmt::Debug for Predictor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Predictor").finish_non_exhaustive()
    }
}

impl Predictor {
    pub fn new(clock: Clock) -> Self {
        Self {
            inner: Mutex::default(),
            clock,
            // 1/16 .. 16
            error_ratio: Histogram::new(RATIO_BUCKETS.iter().copied()),
            worker_ratio: Family::default(),
        }
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_ttft_prediction_ratio",
            "Observed over predicted time to first token, per reported request",
            self.error_ratio.clone(),
        );
        r.register(
            "kvplane_worker_ttft_prediction_ratio",
            "Observed over predicted time to first token of a worker's reported requests (an exponential average)",
            self.worker_ratio.clone(),
        );
    }

    pub fn now_ms(&self) -> u64 {
        (self.clock)()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This replica's requests to `ask.worker` that have not started: how many, their prefill
    /// tokens, and how many of them its metrics sample may count; folds the sample's TTFT
    /// histogram into the set's calibration.
    pub fn pending(&self, worker_set: &str, ask: Ask<'_>) -> InFlight {
        self.one(worker_set, ask, true)
    }

    /// What [`Self::pending`] would say, changing nothing (Explain).
    pub fn peek_pending(&self, worker_set: &str, ask: Ask<'_>) -> InFlight {
        self.one(worker_set, ask, false)
    }

    fn one(&self, worker_set: &str, ask: Ask<'_>, update: bool) -> InFlight {
        let mut out = InFlight::default();
        self.pending_set(worker_set, &[ask], update, |_, f| out = f);
        out
    }

    /// [`Self::pending`] (`update`) or [`Self::peek_pending`] for every worker of a set, under
    /// one lock and one clock read: `each(i, in_flight)` for the `i`th of `workers`, in order.
    pub fn pending_set(
        &self,
        worker_set: &str,
        workers: &[Ask<'_>],
        update: bool,
        mut each: impl FnMut(usize, InFlight),
    ) {
        let now = self.now_ms();
        let mut g = self.lock();
        if update {
            // Engines whose metrics are newer than those folded in, and whose TTFT histogram
            // moved since it was last seen (most did not).
            let through = g.queues.get(worker_set).and_then(|s| s.histograms_through);
            let newer = |a: &&Ask<'_>| through.is_none_or(|t| a.metrics_index > t);
            if workers.iter().any(|a| newer(&a)) {
                for a in workers.iter().filter(newer) {
                    let (w, hist) = (&**a.worker, a.ttft_histogram);
                    let moved = hist.1 > 0
                        && g.queues
                            .get(worker_set)
                            .and_then(|s| s.slots.get(w).map(|&i| &s.queues[i]))
                            .is_none_or(|q| q.histogram.is_none_or(|h| h.1 != hist.1));
                    if moved {
                        g.engine_histogram(worker_set, w, now, hist);
                    }
                }
                let top = workers.iter().map(|a| a.metrics_index).max();
                let set = g.set(worker_set);
                set.histograms_through = set.histograms_through.max(top);
            }
        }
        let Some(set) = g.queues.get_mut(worker_set) else {
            for i in 0..workers.len() {
                each(i, InFlight::default());
            }
            return;
        };
        let use_learned = set.errors.learned_better();
        let typical = set.typical_ms;
        let set_learned = learned_terms(set.fit.as_ref(), typical).filter(|_| use_learned);
        let learned = |q: &Queue| {
            learned_terms(q.fit.as_deref(), typical)
                .filter(|_| use_learned)
                .or(set_learned)
        };
        if !update {
            // A peek adds no queue: the workers without one have nothing in flight.
            for (i, a) in workers.iter().enumerate() {
                let f = set.slots.get(&**a.worker).map_or(
                    InFlight {
                        learned: set_learned,
                        ..InFlight::default()
                    },
                    |&k| {
                        let q = &mut set.queues[k];
                        InFlight {
                            learned: learned(q),
                            last_routed_ms: q.last_routed_ms,
                            ..Self::in_flight(q, now, a.metrics_at_ms, a.waiting, false)
                        }
                    },
                );
                each(i, f);
            }
            return;
        }
        set.follow(workers);
        for (i, a) in workers.iter().enumerate() {
            let q = &mut set.queues[set.roster[i].1];
            let f = InFlight {
                learned: learned(q),
                last_routed_ms: q.last_routed_ms,
                ..Self::in_flight(q, now, a.metrics_at_ms, a.waiting, true)
            };
            each(i, f);
        }
    }

    /// One worker's requests in flight (`update`: forgetting those that no longer are).
    fn in_flight(
        q: &mut Queue,
        now: u64,
        metrics_at_ms: u64,
        metrics_waiting: u32,
        update: bool,
    ) -> InFlight {
        let started_live =
            |&(_, done): &(u64, u64)| done >= metrics_at_ms && done + PENDING_TTL_MS > now;
        let decoding_live = |&(_, at): &(String, u64)| at + PENDING_TTL_MS > now;
        if update {
            q.decoding.retain(decoding_live);
        }
        let decoding = u32::try_from(q.decoding.iter().filter(|d| decoding_live(d)).count())
            .unwrap_or(u32::MAX);
        // Started requests only matter to a metrics sample taken before they started.
        if q.pending.is_empty() && (q.started.is_empty() || metrics_at_ms == 0) {
            return InFlight {
                decoding,
                ..InFlight::default()
            };
        }
        let still = still_pending(&q.pending, now, metrics_at_ms, metrics_waiting);
        if update {
            q.started.retain(started_live);
            let mut k = 0;
            q.pending.retain(|_| {
                k += 1;
                still[k - 1]
            });
        }
        let started = q
            .started
            .iter()
            .filter(|s| started_live(s))
            .filter(|&&(at, _)| at < metrics_at_ms)
            .count();
        let list: Vec<&Pending> = if update {
            q.pending.iter().collect()
        } else {
            q.pending
                .iter()
                .zip(&still)
                .filter(|(_, k)| **k)
                .map(|(p, _)| p)
                .collect()
        };
        InFlight {
            requests: u32::try_from(list.len()).unwrap_or(u32::MAX),
            prefill_tokens: list.iter().map(|p| p.prefill_tokens).sum(),
            busy_ms: list
                .iter()
                .map(|p| p.due_ms.saturating_sub(now))
                .max()
                .unwrap_or(0),
            in_metrics: u32::try_from(
                list.iter().filter(|p| p.at_ms < metrics_at_ms).count() + started,
            )
            .unwrap_or(u32::MAX),
            decoding,
            learned: None,
            last_routed_ms: 0,
        }
    }

    /// The calibration of `worker_set`, and what a waiting request of another replica is
    /// taken to cost there (one lock; a request's evaluation asks once per worker set).
    pub fn factors(&self, worker_set: &str) -> (f64, Option<f64>) {
        let g = self.lock();
        (
            g.calibration.get(worker_set).copied().unwrap_or(1.0),
            g.typical_ms.get(worker_set).copied(),
        )
    }

    pub fn calibration(&self, worker_set: &str) -> f64 {
        self.factors(worker_set).0
    }

    /// Remembers a request routed to `worker` with this much prefill to do (`prefill_ms` on
    /// its own), predicted to have its first token in `predicted_ms`; returns the decision as
    /// the other replicas are told it.
    pub fn routed(
        &self,
        worker_set: &str,
        worker: &str,
        request_id: &str,
        (prefill_tokens, prefill_ms): (u64, f64),
        predicted_ms: f64,
        learning: Option<Learning>,
    ) -> RoutedNote {
        let at_ms = self.now_ms();
        let due_ms = at_ms.saturating_add(predicted_ms.max(0.0) as u64);
        let mut g = self.lock();
        // (Looked up before they are entered: a request routed to a known set allocates no key.)
        match g.typical_ms.get_mut(worker_set) {
            Some(t) => *t = *t * (1.0 - ALPHA) + prefill_ms * ALPHA,
            None => {
                g.typical_ms.insert(worker_set.to_owned(), prefill_ms);
            }
        }
        if !g.windows.contains_key(worker_set) {
            g.windows
                .insert(worker_set.to_owned(), HistogramWindow::default());
        }
        let w = g
            .windows
            .get_mut(worker_set)
            .unwrap_or_else(|| unreachable!());
        w.predicted += 1;
        w.predicted_ms += predicted_ms.max(0.0);
        let q = g.queue(worker_set, worker);
        q.last_routed_ms = q.last_routed_ms.max(at_ms);
        q.pending.push(Pending {
            request_id: request_id.to_owned(),
            at_ms,
            prefill_tokens,
            due_ms,
            foreign: false,
            learning,
        });
        RoutedNote {
            worker_set: worker_set.to_owned(),
            worker: worker.to_owned(),
            at_ms,
            due_ms,
            dp_rank: 0,
            anchors: Vec::new(),
        }
    }

    /// A prompt (its `anchors`) routed to `worker` rank `dp_rank` at `at_ms`, its first
    /// token due at `due_ms` (the deciding replica's clock, perhaps another's): counted as
    /// cached there for as long from now as it had to wait (at most a minute) and
    /// [`crate::placed::GRACE_MS`] more, by this replica's clock. The anchors the worker's
    /// index match already covers may be left out; a set's worth is bounded (see
    /// [`crate::placed`]).
    pub fn place(
        &self,
        worker_set: &str,
        worker: &str,
        dp_rank: u32,
        anchors: &[Anchor],
        (at_ms, due_ms): (u64, u64),
    ) {
        if anchors.is_empty() {
            return;
        }
        let now = self.now_ms();
        let wait = due_ms.saturating_sub(at_ms).min(PENDING_TTL_MS);
        let until = now.saturating_add(wait).saturating_add(GRACE_MS);
        let mut g = self.lock();
        if !g.placed.contains_key(worker_set) {
            if g.placed.len() >= MAX_PLACED_SETS {
                return;
            }
            g.placed.insert(worker_set.to_owned(), Placed::default());
        }
        if let Some(p) = g.placed.get_mut(worker_set) {
            p.place(worker, dp_rank, anchors, until, now);
        }
    }

    /// Each worker's longest match of a prompt's `anchors` among the prompts routed to
    /// `worker_set` and still counted (see [`crate::placed`]); `indexed`: the longest match
    /// the prefix index shows for it there.
    pub fn placed_matches(
        &self,
        worker_set: &str,
        anchors: &[Anchor],
        indexed: u32,
    ) -> SmallVec<[PlacedMatch; 4]> {
        if anchors.is_empty() {
            return SmallVec::new();
        }
        let now = self.now_ms();
        let g = self.lock();
        g.placed
            .get(worker_set)
            .map_or_else(SmallVec::new, |p| p.matches(anchors, indexed, now))
    }

    /// Another replica routed a request to `worker` at `at_ms`, predicted to have its first
    /// token at `due_ms`: this replica counts it in that worker's queue until then.
    pub fn routed_elsewhere(&self, worker_set: &str, worker: &str, at_ms: u64, due_ms: u64) {
        let mut g = self.lock();
        let q = g.queue(worker_set, worker);
        q.last_routed_ms = q.last_routed_ms.max(at_ms);
        let pending = &mut q.pending;
        // Kept in the order they were routed (notes arrive late): the drain keeps the newest.
        let at = pending.partition_point(|p| p.at_ms <= at_ms);
        pending.insert(
            at,
            Pending {
                request_id: String::new(),
                at_ms,
                prefill_tokens: 0,
                due_ms,
                foreign: true,
                learning: None,
            },
        );
    }

    /// A routed request was served elsewhere (a gateway's retry on an alternative): it leaves
    /// the queue of the worker it was routed to, which learns nothing from it.
    pub fn forget(&self, worker_set: &str, worker: &str, request_id: &str) {
        let mut g = self.lock();
        let q = g.queue(worker_set, worker);
        if let Some(i) = q.pending.iter().position(|p| p.request_id == request_id) {
            q.pending.remove(i);
        }
    }

    /// A routed request's first token came after `observed_ms`: it is no longer pending, and
    /// its worker set's calibration moves toward observed / predicted.
    pub fn observed(
        &self,
        worker_set: &str,
        worker: &str,
        request_id: &str,
        predicted_ms: f64,
        observed_ms: f64,
    ) {
        let now = self.now_ms();
        let mut g = self.lock();
        let set = g.set(worker_set);
        let slot = set.slot(worker);
        let q = &mut set.queues[slot];
        let mut learning = None;
        if let Some(i) = q.pending.iter().position(|p| p.request_id == request_id) {
            let p = q.pending.remove(i);
            // Kept until a metrics sample taken after them prunes them; bounded for engines
            // whose metrics never come.
            if q.started.len() >= MAX_STARTED {
                q.started.drain(..MAX_STARTED / 2);
            }
            q.started.push((p.at_ms, now));
            learning = p.learning;
        }
        if !(predicted_ms.is_finite()
            && observed_ms.is_finite()
            && predicted_ms > 0.0
            && observed_ms > 0.0)
        {
            return;
        }
        let ratio = observed_ms / predicted_ms;
        let average = q.ratio.map_or(ratio, |r| r * (1.0 - ALPHA) + ratio * ALPHA);
        q.ratio = Some(average);
        self.worker_ratio
            .get_or_create(&[
                ("worker_set", worker_set.to_owned()),
                ("worker", worker.to_owned()),
            ])
            .set(average);
        // What the configured model predicted (the calibration follows it, whichever model
        // was used; a request whose decision is forgotten says nothing of it where the learned
        // model predicted it).
        let configured_ms = match learning {
            Some(l) => set.learn(slot, &l, observed_ms),
            None if set.errors.learned_better() => 0.0,
            None => predicted_ms,
        };
        g.windows
            .entry(worker_set.to_owned())
            .or_default()
            .last_report_ms = now;
        self.error_ratio.observe(ratio);
        if configured_ms > 0.0 {
            let c = g.calibration.entry(worker_set.to_owned()).or_insert(1.0);
            *c = (*c * (1.0 - ALPHA + ALPHA * observed_ms / configured_ms)).clamp(0.2, 5.0);
        }
        if g.recent.len() >= RECENT {
            g.recent.pop_front();
        }
        g.recent
            .push_back((request_id.to_owned(), predicted_ms, observed_ms));
    }

    /// A request's first token came and its end is still to come (a first-token report): it
    /// counts as running on `worker` until [`Self::finished`] (at most a minute; the newest
    /// 256 per worker).
    pub fn decoding(&self, worker_set: &str, worker: &str, request_id: &str) {
        let now = self.now_ms();
        let mut g = self.lock();
        let q = g.queue(worker_set, worker);
        if q.decoding.len() >= MAX_STARTED {
            q.decoding.drain(..MAX_STARTED / 2);
        }
        q.decoding.push((request_id.to_owned(), now));
    }

    /// A request reported [`Self::decoding`] ended.
    pub fn finished(&self, worker_set: &str, worker: &str, request_id: &str) {
        let mut g = self.lock();
        let q = g.queue(worker_set, worker);
        if let Some(i) = q.decoding.iter().position(|(id, _)| id == request_id) {
            // In order: when full, the oldest go.
            q.decoding.remove(i);
        }
    }

    /// Predicted and observed TTFT of a reported request, if it is recent.
    pub fn outcome(&self, request_id: &str) -> Option<(f64, f64)> {
        self.lock()
            .recent
            .iter()
            .rev()
            .find(|(id, _, _)| id == request_id)
            .map(|(_, p, o)| (*p, *o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Worker `w` as a metrics sample taken at `at` shows it, handed to `f` (the samples of a
    /// test come in time order, so the time stands for the sample's index).
    fn asking<R>(
        w: &str,
        at: u64,
        waiting: u32,
        hist: (f64, u64),
        f: impl FnOnce(Ask<'_>) -> R,
    ) -> R {
        let name: Arc<str> = w.into();
        f(Ask {
            worker: &name,
            metrics_index: at,
            metrics_at_ms: at,
            waiting,
            ttft_histogram: hist,
        })
    }

    fn pending(p: &Predictor, w: &str, at: u64, waiting: u32, hist: (f64, u64)) -> InFlight {
        asking(w, at, waiting, hist, |a| p.pending("ws", a))
    }

    fn peek(p: &Predictor, w: &str, at: u64, waiting: u32) -> InFlight {
        asking(w, at, waiting, (0.0, 0), |a| p.peek_pending("ws", a))
    }

    fn predictor() -> (Predictor, Arc<AtomicU64>) {
        let now = Arc::new(AtomicU64::new(1_000));
        let n = now.clone();
        (
            Predictor::new(Arc::new(move || n.load(Ordering::Relaxed))),
            now,
        )
    }

    #[test]
    fn routed_requests_queue_until_reported_and_chain() {
        let (p, now) = predictor();
        p.routed("ws", "w0", "a", (1000, 100.0), 150.0, None);
        p.routed("ws", "w0", "b", (1000, 100.0), 260.0, None);
        let f = pending(&p, "w0", 0, 0, (0.0, 0));
        assert_eq!((f.requests, f.prefill_tokens, f.busy_ms), (2, 2000, 260));
        now.store(1_100, Ordering::Relaxed);
        assert_eq!(pending(&p, "w0", 0, 0, (0.0, 0)).busy_ms, 160);
        // The first is reported: it leaves the queue; metrics sampled before it was routed
        // cannot have counted it, one sampled after may.
        p.observed("ws", "w0", "a", 150.0, 140.0);
        let f = pending(&p, "w0", 1_050, 1, (0.0, 0));
        assert_eq!((f.requests, f.in_metrics), (1, 2));
        assert!(
            p.outcome("a")
                .is_some_and(|(pr, ob)| pr == 150.0 && ob == 140.0)
        );
    }

    #[test]
    fn a_decision_finds_each_workers_queue_by_name_whatever_the_list_it_asks_with() {
        let (p, _) = predictor();
        p.routed("ws", "b", "1", (10, 1.0), 100.0, None);
        p.routed("ws", "b", "2", (10, 1.0), 100.0, None);
        p.routed("ws", "d", "3", (10, 1.0), 100.0, None);
        let names: Vec<Arc<str>> = ["a", "b", "c", "d"].iter().map(|&n| n.into()).collect();
        let requests = |list: &[&Arc<str>], update: bool| {
            let asks: Vec<Ask<'_>> = list
                .iter()
                .map(|&n| Ask {
                    worker: n,
                    metrics_index: 0,
                    metrics_at_ms: 0,
                    waiting: 0,
                    ttft_histogram: (0.0, 0),
                })
                .collect();
            let mut out = vec![u32::MAX; list.len()];
            p.pending_set("ws", &asks, update, |i, f| out[i] = f.requests);
            out
        };
        let [a, b, c, d] = [&names[0], &names[1], &names[2], &names[3]];
        // The same list twice (the second by position), then workers added, removed and
        // reordered, then the same names in new allocations: always by name.
        assert_eq!(requests(&[a, b, d], true), [0, 2, 1]);
        assert_eq!(requests(&[a, b, d], true), [0, 2, 1]);
        assert_eq!(requests(&[a, c, b, d], true), [0, 0, 2, 1]);
        assert_eq!(requests(&[d, b], true), [1, 2]);
        let fresh: Vec<Arc<str>> = ["d", "b", "a"].iter().map(|&n| n.into()).collect();
        assert_eq!(
            requests(&[&fresh[0], &fresh[1], &fresh[2]], true),
            [1, 2, 0]
        );
        assert_eq!(requests(&[b, c], false), [2, 0], "a peek finds them too");
        p.observed("ws", "b", "1", 100.0, 100.0);
        assert_eq!(
            requests(&[&fresh[0], &fresh[1], &fresh[2]], true),
            [1, 1, 0]
        );
    }

    #[test]
    fn without_reports_a_request_leaves_once_metrics_after_its_due_time_show_no_queue() {
        let (p, _) = predictor();
        p.routed("ws", "w0", "", (500, 50.0), 100.0, None);
        assert_eq!(pending(&p, "w0", 1_050, 0, (0.0, 0)).requests, 1);
        assert_eq!(pending(&p, "w0", 1_200, 0, (0.0, 0)).requests, 0);
    }

    #[test]
    fn without_reports_metrics_alone_drain_the_queue_keeping_the_newest() {
        let (p, now) = predictor();
        for i in 0..5 {
            p.routed("ws", "w0", &format!("r{i}"), (100, 10.0), 100.0, None);
            now.fetch_add(1, Ordering::Relaxed);
        }
        // A sample taken after all five were due shows two waiting: at most two still wait.
        now.store(2_000, Ordering::Relaxed);
        assert_eq!(peek(&p, "w0", 0, 0).requests, 5);
        let f = pending(&p, "w0", 1_500, 2, (0.0, 0));
        assert_eq!(f.requests, 2);
        assert_eq!(peek(&p, "w0", 0, 0).requests, 2, "the others are gone");
    }

    #[test]
    fn a_peek_says_what_pending_would_and_changes_nothing() {
        let (p, now) = predictor();
        p.routed("ws", "w0", "a", (100, 10.0), 50.0, None);
        p.routed_elsewhere("ws", "w0", 990, 1_020);
        // What is stored, seen from before anything was due.
        let stored = |p: &Predictor| {
            let t = now.swap(1_000, Ordering::Relaxed);
            let n = peek(p, "w0", 0, 0).requests;
            now.store(t, Ordering::Relaxed);
            n
        };
        now.store(1_500, Ordering::Relaxed);
        let peeked = peek(&p, "w0", 1_400, 0);
        assert_eq!(peeked.requests, 0);
        assert_eq!(stored(&p), 2, "a peek prunes nothing");
        assert_eq!(pending(&p, "w0", 1_400, 0, (0.0, 0)), peeked);
        assert_eq!(stored(&p), 0, "pending prunes");
    }

    #[test]
    fn other_replicas_requests_count_until_due_and_calibration_follows_observations() {
        let (p, now) = predictor();
        p.routed_elsewhere("ws", "w1", 990, 1_300);
        assert_eq!(pending(&p, "w1", 0, 0, (0.0, 0)).busy_ms, 300);
        now.store(1_301, Ordering::Relaxed);
        assert_eq!(pending(&p, "w1", 0, 0, (0.0, 0)).requests, 0);
        for i in 0..50 {
            let id = format!("r{i}");
            p.routed("ws", "w0", &id, (0, 0.0), 100.0, None);
            p.observed("ws", "w0", &id, 100.0, 200.0);
        }
        let c = p.calibration("ws");
        assert!(c > 1.9 && c <= 5.0, "{c}");
    }

    #[test]
    fn engine_histograms_calibrate_when_no_usage_is_reported() {
        let (p, now) = predictor();
        // Requests predicted at 100 ms; the engine's histogram says 200 ms on average.
        let mut count = 1u64;
        pending(&p, "w0", 0, 0, (0.0, count));
        let mut run = |tag: &str, step_ms: u64| {
            for i in 0..64 {
                p.routed("ws", "w0", &format!("{tag}{i}"), (0, 0.0), 100.0, None);
                count += 1;
                now.fetch_add(step_ms, Ordering::Relaxed);
                let at = now.load(Ordering::Relaxed);
                pending(&p, "w0", at, 0, (0.2 * (count - 1) as f64, count));
            }
            p.calibration("ws")
        };
        let c = run("r", 500);
        assert!(c > 1.15, "two steps toward 2: {c}");
        // Usage reported: the histograms no longer move it.
        p.routed("ws", "w1", "x", (0, 0.0), 100.0, None);
        p.observed("ws", "w1", "x", 100.0, 100.0);
        let reported = p.calibration("ws");
        assert_eq!(run("s", 10), reported);
    }
}
