//! Requests routed by this node and not yet reported, for ReportUsage.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What this node remembers about a routed request.
#[derive(Debug, Clone)]
pub(crate) struct Routed {
    /// `pool/worker`, or `provider:name`.
    pub(crate) target: String,
    /// The tenant it was routed for: only a caller that may route for it may report its usage.
    pub(crate) tenant: String,
    /// The engine's predicted time to first token (without the network's).
    pub(crate) predicted_ttft_ms: f64,
    /// The round trip between the asking gateway and the engine, which the gateway's observed
    /// time to first token includes and the engine's does not.
    pub(crate) network_ms: f64,
    pub(crate) at: Instant,
    /// What tenant limits hold for it until its usage is reported. An unreported request
    /// stays charged at its reservation (the entry expires after `ttl`).
    pub(crate) reservations: Vec<crate::Reservation>,
    /// (worker set, worker) when it went to a worker through the policies.
    pub(crate) worker: Option<(String, String)>,
    /// Its first token was reported (the predictor has its time to first token).
    pub(crate) started: bool,
    /// The worker's cluster, when it is another than this replica's and the request was
    /// decided from here: its observed time to first token measures the link
    /// ([`crate::rtt`]).
    pub(crate) remote_cluster: Option<String>,
}

/// What a first-token report found.
#[derive(Debug, PartialEq)]
pub(crate) enum Start {
    /// Not routed here, or already reported whole.
    Unknown,
    /// Its first token was reported before.
    Again,
    /// The first report of its first token: where it went and what was predicted there.
    First {
        worker: Option<(String, String)>,
        predicted_ttft_ms: f64,
        network_ms: f64,
        remote_cluster: Option<String>,
    },
}

/// A bounded table of requests in flight. Entries older than `ttl` are dropped as new ones
/// come (a request unreported that long is forgotten: its report finds nothing), and when the
/// table is full the oldest is forgotten too; both in amortized constant time per request,
/// whatever the table holds.
#[derive(Debug)]
pub(crate) struct UsageBook {
    inner: Mutex<Book>,
    capacity: usize,
    ttl: Duration,
    /// Counts the entries forgotten for room (`limits.in_flight_requests`).
    metrics: Option<std::sync::Arc<crate::ApiMetrics>>,
}

/// The entries, and their ids in the order they were routed (an id whose entry was taken or
/// routed again since is passed over when met).
#[derive(Debug, Default)]
struct Book {
    map: HashMap<String, Routed>,
    order: VecDeque<(Instant, String)>,
}

impl Book {
    /// Drops expired entries from the front, then the oldest fresh ones while the table is
    /// full; returns how many fresh entries were forgotten.
    fn make_room(&mut self, capacity: usize, ttl: Duration) -> u64 {
        let mut forgotten = 0;
        while let Some((at, id)) = self.order.front() {
            let current = self.map.get(id).is_some_and(|r| r.at == *at);
            if current {
                if at.elapsed() < ttl && self.map.len() < capacity {
                    break;
                }
                if at.elapsed() < ttl {
                    forgotten += 1;
                }
                self.map.remove(id);
            }
            self.order.pop_front();
        }
        // Ids passed over pile up when requests are reported in order: bounded all the same.
        if self.order.len() > 2 * capacity.max(self.map.len()) + 64 {
            let map = &self.map;
            self.order
                .retain(|(at, id)| map.get(id).is_some_and(|r| r.at == *at));
        }
        forgotten
    }
}

impl UsageBook {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(Book::default()),
            capacity,
            ttl,
            metrics: None,
        }
    }

    /// Counts each fresh entry forgotten for room in `kvplane_limit_hits_total`.
    pub(crate) fn counting(mut self, metrics: std::sync::Arc<crate::ApiMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub(crate) fn insert(&self, request_id: &str, routed: Routed) {
        if request_id.is_empty() {
            return;
        }
        let mut book = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        // An id routed again replaces its entry; room for one more.
        book.map.remove(request_id);
        let forgotten = book.make_room(self.capacity, self.ttl);
        if let Some(m) = &self.metrics {
            for _ in 0..forgotten {
                m.limit_hit("in_flight_requests");
            }
        }
        book.order.push_back((routed.at, request_id.to_owned()));
        book.map.insert(request_id.to_owned(), routed);
    }

    /// Marks a routed request started: its first token came (its usage comes later).
    pub(crate) fn start(&self, request_id: &str) -> Start {
        let mut book = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match book.map.get_mut(request_id) {
            None => Start::Unknown,
            Some(r) if r.started => Start::Again,
            Some(r) => {
                r.started = true;
                Start::First {
                    worker: r.worker.clone(),
                    predicted_ttft_ms: r.predicted_ttft_ms,
                    network_ms: r.network_ms,
                    remote_cluster: r.remote_cluster.clone(),
                }
            }
        }
    }

    /// The request was served by `worker` (`None`: not by a worker this replica knows), not
    /// where it was routed: its final report ends it there.
    pub(crate) fn moved(&self, request_id: &str, worker: Option<(String, String)>) {
        if let Some(r) = self
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get_mut(request_id)
        {
            r.worker = worker;
        }
    }

    /// The tenant of a request routed here and not yet reported whole.
    pub(crate) fn tenant_of(&self, request_id: &str) -> Option<String> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(request_id)
            .map(|r| r.tenant.clone())
    }

    pub(crate) fn take(&self, request_id: &str) -> Option<Routed> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .remove(request_id)
    }
}

/// Where a reported request was served when not by `routed` (its worker set and worker), as
/// `UsageReport.served` says: `None` when `routed` served it (or the report does not say),
/// `Some(None)` when something this replica cannot name as a worker did (a provider, an
/// address no worker has).
pub(crate) fn served_elsewhere(
    served: Option<&kvplane_proto::v1::Endpoint>,
    routed: (&str, &str),
    state: &kvplane_state::StateHandle,
) -> Option<Option<(String, String)>> {
    let e = served?;
    let view = state.load();
    if !e.provider.is_empty() {
        return Some(None);
    }
    let worker = if e.worker_id.is_empty() {
        // An address only (the endpoint picker's proxy says `ip:port`): the worker there, the
        // routed one first (workers of several pools may share an address).
        let bare = |a: &str| {
            let a = a.trim_end_matches('/');
            a.split_once("://").map_or(a, |(_, rest)| rest).to_owned()
        };
        let wanted = bare(&e.address);
        if wanted.is_empty() {
            return None;
        }
        let at = |w: &&kvplane_state::WorkerView| {
            w.address.as_deref().is_some_and(|a| bare(a) == wanted)
        };
        let routed_there = view
            .pools
            .get(routed.0)
            .and_then(|p| p.workers.iter().find(|w| &*w.name == routed.1))
            .is_some_and(|w| at(&w));
        if routed_there {
            return None;
        }
        view.workers()
            .find(at)
            .map(|w| (w.pool.clone(), w.name.to_string()))
    } else {
        // Only a worker the state knows: a report cannot make the predictor keep any name.
        view.pools
            .get(&e.pool)
            .and_then(|p| p.workers.iter().find(|w| *w.name == *e.worker_id))
            .map(|w| (w.pool.clone(), w.name.to_string()))
    };
    match worker {
        Some((pool, w)) if pool == routed.0 && w == routed.1 => None,
        other => Some(other),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn routed(tenant: &str) -> Routed {
        Routed {
            target: String::new(),
            tenant: tenant.into(),
            predicted_ttft_ms: 0.0,
            network_ms: 0.0,
            remote_cluster: None,
            at: Instant::now(),
            reservations: Vec::new(),
            worker: None,
            started: false,
        }
    }

    /// Against a plain list of the ids in flight, oldest first: the book holds the newest
    /// `capacity` of them, whatever was reported or routed again in between.
    #[test]
    fn a_full_book_forgets_the_oldest_in_flight_as_a_plain_list_would() {
        let capacity = 4;
        let book = UsageBook::new(capacity, Duration::from_secs(600));
        let mut model: Vec<String> = Vec::new();
        let mut forgotten = 0;
        let mut x: u64 = 7;
        for step in 0..5_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let id = format!("r{}", (x >> 33) % 9);
            if (x >> 20).is_multiple_of(3) {
                let taken = book.take(&id).is_some();
                assert_eq!(taken, model.contains(&id), "step {step}: take {id}");
                model.retain(|m| *m != id);
            } else {
                book.insert(&id, routed(&id));
                model.retain(|m| *m != id);
                model.push(id);
                while model.len() > capacity {
                    model.remove(0);
                    forgotten += 1;
                }
            }
            for m in &model {
                assert_eq!(
                    book.tenant_of(m).as_deref(),
                    Some(m.as_str()),
                    "step {step}"
                );
            }
            let inner = book.inner.lock().unwrap();
            assert_eq!(inner.map.len(), model.len(), "step {step}");
            assert!(inner.order.len() <= 2 * capacity + 64 + 1);
        }
        assert!(forgotten > 0);
    }
}
