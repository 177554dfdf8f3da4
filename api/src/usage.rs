//! Requests routed by this node and not yet reported, for ReportUsage.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What this node remembers about a routed request.
#[derive(Debug, Clone)]
pub(crate) struct Routed {
    /// `pool/worker`, or `provider:name`.
    pub(crate) target: String,
    /// The tenant it was routed for: only a caller that may route for it may report its usage.
    pub(crate) tenant: String,
    pub(crate) predicted_ttft_ms: f64,
    pub(crate) at: Instant,
    /// What tenant limits hold for it until its usage is reported. An unreported request
    /// stays charged at its reservation (the entry expires after `ttl`).
    pub(crate) reservations: Vec<crate::Reservation>,
    /// (worker set, worker) when it went to a worker through the policies.
    pub(crate) worker: Option<(String, String)>,
    /// Its first token was reported (the predictor has its time to first token).
    pub(crate) started: bool,
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
    },
}

/// A bounded table of requests in flight. Entries older than `ttl` are dropped when the table
/// is full, so an unreported request cannot pin memory.
#[derive(Debug)]
pub(crate) struct UsageBook {
    inner: Mutex<HashMap<String, Routed>>,
    capacity: usize,
    ttl: Duration,
    /// Counts the entries forgotten for room (`limits.in_flight_requests`).
    metrics: Option<std::sync::Arc<crate::ApiMetrics>>,
}

impl UsageBook {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(HashMap::new()),
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
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.capacity {
            let ttl = self.ttl;
            map.retain(|_, r| r.at.elapsed() < ttl);
            if map.len() >= self.capacity {
                // Still full of fresh entries: forget the oldest.
                if let Some(oldest) = map.iter().min_by_key(|(_, r)| r.at).map(|(k, _)| k.clone()) {
                    map.remove(&oldest);
                    if let Some(m) = &self.metrics {
                        m.limit_hit("in_flight_requests");
                    }
                }
            }
        }
        map.insert(request_id.to_owned(), routed);
    }

    /// Marks a routed request started: its first token came (its usage comes later).
    pub(crate) fn start(&self, request_id: &str) -> Start {
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match map.get_mut(request_id) {
            None => Start::Unknown,
            Some(r) if r.started => Start::Again,
            Some(r) => {
                r.started = true;
                Start::First {
                    worker: r.worker.clone(),
                    predicted_ttft_ms: r.predicted_ttft_ms,
                }
            }
        }
    }

    /// The tenant of a request routed here and not yet reported whole.
    pub(crate) fn tenant_of(&self, request_id: &str) -> Option<String> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(request_id)
            .map(|r| r.tenant.clone())
    }

    pub(crate) fn take(&self, request_id: &str) -> Option<Routed> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(request_id)
    }
}
