//! Round trips to other clusters measured from reported TTFTs (`[locality] measure_rtt`).
//!
//! A gateway's first-token report (of a streamed answer: a final report's time may be the whole
//! answer's) for a request served in another cluster gives an observed time that is the
//! engine's own time plus the link's round trip. The engine's own time is in its metrics: vLLM's
//! `time_to_first_token_seconds` histogram, replicated with every metrics sample. So for each
//! remote worker this replica routed to, its gateways' observed TTFTs are summed over a window,
//! and when the window holds [`WINDOW_REPORTS`] reports and the engine's histogram counted as
//! many more first tokens, the mean observed less the engine's mean over that window is one
//! sample of the round trip to the worker's cluster. A cluster's measurement is the exponential
//! average of its samples; it stands in for the configured figure (or the default) from its
//! first sample on.
//!
//! The histogram counts every request the engine served, from any replica's gateways, and a
//! metrics sample trails the first tokens it counts by up to a scrape interval: a sample is an
//! estimate under steady traffic, not a per-request figure, hence the window and the average.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use kvplane_policy::Origin;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustc_hash::FxHashMap;

/// Reports (and engine first tokens) a window needs before it gives a sample.
pub const WINDOW_REPORTS: u64 = 8;
/// The weight of a new sample in a cluster's measurement.
const ALPHA: f64 = 0.3;
/// Remote workers whose windows are kept. When it is full, the one reported on longest ago
/// goes if no report came for it in the `MAX_WINDOWS` reports before this one (a fleet whose
/// pods come and go under new names would otherwise grow the map for ever); otherwise this
/// report of the new worker is dropped, and a later one may find room (with more remote
/// workers than this all reporting, evicting would end every window before it filled).
pub const MAX_WINDOWS: usize = 4096;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterLabel {
    cluster: String,
}

/// One remote worker's window: what its gateways observed, and its engine's histogram
/// (sum in seconds, count) when the window began.
#[derive(Debug)]
struct Window {
    cluster: String,
    observed_ms: f64,
    reports: u64,
    from: (f64, u64),
    /// When it was last reported on (`Inner::reports`).
    touched: u64,
}

#[derive(Debug, Default)]
struct Inner {
    windows: FxHashMap<(String, String), Window>,
    /// Reports taken, for `Window::touched`.
    reports: u64,
    /// Each cluster's measured round trip (ms) and its samples.
    clusters: BTreeMap<String, (f64, u64)>,
}

/// The measured round trips, and the origin they make (the configured one with each measured
/// cluster's figure in place of the configured).
#[derive(Debug)]
pub struct RttMeter {
    configured: Origin,
    inner: Mutex<Inner>,
    origin: Mutex<Arc<Origin>>,
    gauge: Family<ClusterLabel, Gauge<f64, AtomicU64>>,
}

impl RttMeter {
    pub fn new(configured: Origin) -> Self {
        Self {
            origin: Mutex::new(Arc::new(configured.clone())),
            configured,
            inner: Mutex::default(),
            gauge: Family::default(),
        }
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_locality_measured_rtt_ms",
            "Round trip from this replica's gateways to each other cluster's engines, measured from their reported TTFTs against the engines' own TTFT histograms",
            self.gauge.clone(),
        );
    }

    /// The origin decisions use now.
    pub fn origin(&self) -> Arc<Origin> {
        self.origin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A cluster's measured round trip (ms) and the samples it is from.
    pub fn measured(&self, cluster: &str) -> Option<(f64, u64)> {
        self.lock().clusters.get(cluster).copied()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A gateway observed `observed_ms` to the first token of a request this replica sent to
    /// `worker` of `worker_set`, in `cluster`; `histogram` is that engine's TTFT histogram as
    /// the state holds it now.
    pub fn observed(
        &self,
        (worker_set, worker): (&str, &str),
        cluster: &str,
        observed_ms: f64,
        histogram: (f64, u64),
    ) {
        if !(observed_ms.is_finite() && observed_ms > 0.0) {
            return;
        }
        let mut g = self.lock();
        g.reports += 1;
        let touched = g.reports;
        let fresh = || Window {
            cluster: cluster.to_owned(),
            observed_ms: 0.0,
            reports: 0,
            from: histogram,
            touched,
        };
        let key = (worker_set.to_owned(), worker.to_owned());
        let Some(w) = g.windows.get_mut(&key) else {
            // The first report only sets where the engine's count stands: whether its own
            // first token is counted there already is not known.
            if g.windows.len() >= MAX_WINDOWS {
                let idle = touched.saturating_sub(MAX_WINDOWS as u64);
                let oldest = g
                    .windows
                    .iter()
                    .min_by_key(|(_, w)| w.touched)
                    .filter(|(_, w)| w.touched < idle)
                    .map(|(k, _)| k.clone());
                match oldest {
                    Some(k) => {
                        g.windows.remove(&k);
                    }
                    None => return,
                }
            }
            g.windows.insert(key, fresh());
            return;
        };
        w.touched = touched;
        if histogram.1 < w.from.1 || histogram.0 < w.from.0 || w.cluster != cluster {
            // The engine restarted (its histogram began again), or its set moved: start over.
            *w = fresh();
            return;
        }
        w.observed_ms += observed_ms;
        w.reports += 1;
        let engine_first_tokens = histogram.1 - w.from.1;
        if w.reports < WINDOW_REPORTS || engine_first_tokens < WINDOW_REPORTS {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        let engine_ms = (histogram.0 - w.from.0) * 1000.0 / engine_first_tokens as f64;
        #[allow(clippy::cast_precision_loss)]
        let observed_mean = w.observed_ms / w.reports as f64;
        *w = fresh();
        let sample = observed_mean - engine_ms;
        if !sample.is_finite() {
            return;
        }
        let sample = sample.max(0.0);
        let (ms, n) = g.clusters.entry(cluster.to_owned()).or_insert((sample, 0));
        if *n > 0 {
            *ms += ALPHA * (sample - *ms);
        }
        *n += 1;
        let ms = *ms;
        let mut origin = self.configured.clone();
        for (c, (v, _)) in &g.clusters {
            origin.rtt_ms.insert(c.clone(), *v);
        }
        // Published under the lock: two samples never store their origins out of order.
        self.gauge
            .get_or_create(&ClusterLabel {
                cluster: cluster.to_owned(),
            })
            .set(ms);
        *self.origin.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(origin);
        drop(g);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn meter() -> RttMeter {
        RttMeter::new(Origin {
            cluster: Some("b".into()),
            rtt_ms: [("c".to_owned(), 5.0)].into(),
            default_rtt_ms: 7.0,
            ..Origin::default()
        })
    }

    /// An engine whose first tokens take `engine_ms[i]` behind a link of `link_ms`: each
    /// request's first token counted in the engine's histogram, then observed by the gateway.
    fn serve(m: &RttMeter, worker: &str, engine_ms: &[f64], link_ms: f64, hist: &mut (f64, u64)) {
        for e in engine_ms {
            hist.0 += e / 1000.0;
            hist.1 += 1;
            m.observed(("far", worker), "c", e + link_ms, *hist);
        }
    }

    #[test]
    fn windows_of_workers_gone_quiet_make_room_and_a_busy_ones_window_is_kept() {
        let m = meter();
        let mut busy = (0.0, 0);
        // The busy worker's first report, then a churning fleet's workers one report each.
        serve(&m, "busy", &[30.0], 100.0, &mut busy);
        for i in 0..MAX_WINDOWS + 10 {
            if i % 512 == 0 {
                serve(&m, "busy", &[30.0], 100.0, &mut busy);
            }
            m.observed(("far", &format!("gone-{i}")), "c", 50.0, (0.0, 0));
        }
        assert_eq!(m.lock().windows.len(), MAX_WINDOWS);
        assert!(
            m.lock()
                .windows
                .contains_key(&("far".into(), "busy".into()))
        );
        assert!(
            !m.lock()
                .windows
                .contains_key(&("far".into(), "gone-0".into()))
        );
        // Its window went on counting: the link is measured from it.
        while m.measured("c").is_none() {
            serve(&m, "busy", &[30.0], 100.0, &mut busy);
        }
        assert!((m.measured("c").unwrap().0 - 100.0).abs() < 1e-6);
    }

    #[test]
    fn with_every_window_reported_on_lately_a_newcomer_is_not_measured_and_none_is_cut() {
        let m = meter();
        for i in 0..MAX_WINDOWS {
            m.observed(("far", &format!("w{i}")), "c", 50.0, (0.0, 0));
        }
        m.observed(("far", "newcomer"), "c", 50.0, (0.0, 0));
        let g = m.lock();
        assert_eq!(g.windows.len(), MAX_WINDOWS);
        assert!(!g.windows.contains_key(&("far".into(), "newcomer".into())));
        assert!(g.windows.contains_key(&("far".into(), "w0".into())));
    }

    #[test]
    fn a_window_of_reports_measures_the_link_whatever_the_engines_time() {
        let m = meter();
        let mut hist = (3.0, 40);
        // The first report only notes the engine's count; seven more: no sample yet, the
        // configured figure stands.
        let times: Vec<f64> = (0..17).map(|i| 80.0 + f64::from(i) * 37.0).collect();
        serve(&m, "f0", &times[..8], 40.0, &mut hist);
        assert_eq!(m.measured("c"), None);
        assert_eq!(m.origin().rtt_ms.get("c"), Some(&5.0));
        serve(&m, "f0", &times[8..9], 40.0, &mut hist);
        let (ms, n) = m.measured("c").unwrap();
        assert!((ms - 40.0).abs() < 1e-6 && n == 1, "{ms} from {n}");
        assert_eq!(m.origin().rtt_ms.get("c"), Some(&ms));
        assert_eq!(m.origin().default_rtt_ms, 7.0, "the rest stays configured");
        // The link slows to 100 ms: the measurement moves toward it, sample by sample.
        serve(&m, "f0", &times[9..], 100.0, &mut hist);
        let (ms, n) = m.measured("c").unwrap();
        assert_eq!(n, 2);
        assert!((ms - (40.0 + ALPHA * 60.0)).abs() < 1e-6, "{ms}");
    }

    #[test]
    fn an_engine_that_restarts_or_counts_too_few_first_tokens_gives_no_sample() {
        let m = meter();
        let mut hist = (50.0, 1000);
        serve(&m, "f0", &[100.0; 5], 40.0, &mut hist);
        // Restarted: its histogram begins again; the window starts over.
        let mut hist = (0.0, 0);
        serve(&m, "f0", &[100.0; 8], 40.0, &mut hist);
        assert_eq!(m.measured("c"), None);
        // Reports whose first tokens the engine's metrics have not counted yet: no sample.
        for _ in 0..20 {
            m.observed(("far", "f1"), "c", 140.0, (1.0, 3));
        }
        assert_eq!(m.measured("c"), None);
        serve(&m, "f0", &[100.0], 40.0, &mut hist);
        assert!((m.measured("c").unwrap().0 - 40.0).abs() < 1e-6);
    }
}
