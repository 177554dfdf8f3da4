//! Where things run: a worker set's or provider's cluster, region and zone are its labels under
//! the well-known keys below; a decision's origin is where the asking gateway is (the replica's
//! `[locality]`, which its gateways share), with the round trip from there to each other
//! cluster. A candidate in another cluster adds that round trip to its predicted TTFT; a
//! rule's `filter.sameLocality` keeps only candidates at the origin's cluster, region or zone.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::kinds::Labels;

/// The label naming a worker set's (or provider's) cluster.
pub const CLUSTER_LABEL: &str = "kvplane.io/cluster";
/// Kubernetes' well-known region and zone labels.
pub const REGION_LABEL: &str = "topology.kubernetes.io/region";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A level of place, for `filter.sameLocality`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Level {
    Cluster,
    Region,
    Zone,
}

impl Level {
    /// The label that names a target's place at this level.
    pub fn label(self) -> &'static str {
        match self {
            Self::Cluster => CLUSTER_LABEL,
            Self::Region => REGION_LABEL,
            Self::Zone => ZONE_LABEL,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cluster => "cluster",
            Self::Region => "region",
            Self::Zone => "zone",
        }
    }
}

/// `filter.preferLocality`: local first, spilling elsewhere when local is slow.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Preference {
    /// The place preferred: the asking gateway's `Cluster`, `Region` or `Zone`.
    pub level: Level,
    /// Candidates elsewhere stay only when no eligible candidate there is predicted to give
    /// its first token within this many milliseconds.
    pub spill_above_ttft_ms: f64,
}

/// Where a gateway says it runs: its cluster, region and zone (empty: not said).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Place<'a> {
    pub cluster: &'a str,
    pub region: &'a str,
    pub zone: &'a str,
}

/// Where a decision is asked from, and the round trip from there to other clusters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Origin {
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default)]
    pub region: Option<String>,
    #[serde(default)]
    pub zone: Option<String>,
    /// Round trip in ms from here to an engine in each named cluster.
    #[serde(default)]
    pub rtt_ms: BTreeMap<String, f64>,
    /// Round trip to a cluster `rtt_ms` does not name (0: not told, nothing added).
    #[serde(default)]
    pub default_rtt_ms: f64,
    /// Measure the round trip to each other cluster from the gateways' reported TTFTs against
    /// the engines' own TTFT histograms; a cluster's measurement replaces its configured figure
    /// (or the default) from its first sample on.
    #[serde(default)]
    pub measure_rtt: bool,
}

impl Origin {
    /// Its place at `level`, if configured.
    pub fn at(&self, level: Level) -> Option<&str> {
        match level {
            Level::Cluster => self.cluster.as_deref(),
            Level::Region => self.region.as_deref(),
            Level::Zone => self.zone.as_deref(),
        }
    }

    /// The network time from here to a target with `labels`: nothing to one in this cluster
    /// or in no named cluster (taken to be here), else the round trip to its cluster.
    pub fn network_ms(&self, labels: &Labels) -> f64 {
        match labels.get(CLUSTER_LABEL) {
            None => 0.0,
            Some(c) if self.cluster.as_deref() == Some(c.as_str()) => 0.0,
            Some(c) => self.rtt_ms.get(c).copied().unwrap_or(self.default_rtt_ms),
        }
    }

    /// The origin of a request whose gateway says where it runs (each of `place` empty: not
    /// said). A gateway in this replica's cluster (or one that names none): this origin, with
    /// the region and zone it names. A gateway in another cluster: decided as from there, at
    /// the place it names; the round trip from there to this replica's cluster is this
    /// replica's to it (a link is taken as symmetric), to its own cluster nothing, to any other
    /// the default.
    pub fn seen_from(&self, place: Place<'_>) -> std::borrow::Cow<'_, Origin> {
        use std::borrow::Cow;
        let said = |v: &str| (!v.is_empty()).then(|| v.to_owned());
        if place.cluster.is_empty() || self.cluster.as_deref() == Some(place.cluster) {
            if place.region.is_empty() && place.zone.is_empty() {
                return Cow::Borrowed(self);
            }
            return Cow::Owned(Origin {
                region: said(place.region).or_else(|| self.region.clone()),
                zone: said(place.zone).or_else(|| {
                    // Another region's zone is not this replica's.
                    place.region.is_empty().then(|| self.zone.clone()).flatten()
                }),
                ..self.clone()
            });
        }
        let back = self.cluster.as_ref().map(|here| {
            let rtt = self
                .rtt_ms
                .get(place.cluster)
                .copied()
                .unwrap_or(self.default_rtt_ms);
            (here.clone(), rtt)
        });
        Cow::Owned(Origin {
            cluster: said(place.cluster),
            region: said(place.region),
            zone: said(place.zone),
            rtt_ms: back.into_iter().collect(),
            default_rtt_ms: self.default_rtt_ms,
            measure_rtt: false,
        })
    }

    /// Problems with the configuration, each naming its field under `at` (e.g. `locality`).
    pub fn problems(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        let bad = |v: f64| !v.is_finite() || v < 0.0;
        if self.cluster.is_none()
            && (!self.rtt_ms.is_empty() || self.default_rtt_ms > 0.0 || self.measure_rtt)
        {
            p.push(format!(
                "{at}.cluster is needed with round trips: without it every cluster, this one too, is another"
            ));
        }
        for (c, v) in &self.rtt_ms {
            if c.is_empty() {
                p.push(format!("{at}.rtt_ms has an empty cluster name"));
            }
            if bad(*v) {
                p.push(format!(
                    "{at}.rtt_ms.{c} must be a finite number >= 0, not {v}"
                ));
            }
            if self.cluster.as_deref() == Some(c.as_str()) {
                p.push(format!(
                    "{at}.rtt_ms names {c}, this replica's own cluster (always 0)"
                ));
            }
        }
        if bad(self.default_rtt_ms) {
            p.push(format!(
                "{at}.default_rtt_ms must be a finite number >= 0, not {}",
                self.default_rtt_ms
            ));
        }
        for (name, v) in [
            ("cluster", &self.cluster),
            ("region", &self.region),
            ("zone", &self.zone),
        ] {
            if v.as_deref().is_some_and(str::is_empty) {
                p.push(format!("{at}.{name} must not be empty"));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(cluster: &str) -> Labels {
        [(CLUSTER_LABEL.to_owned(), cluster.to_owned())].into()
    }

    /// A reference: the round trip between two clusters as the table a fleet's operator would
    /// write it, symmetric, with a default for pairs not in it.
    fn table_rtt(from: &str, to: &str) -> f64 {
        let table = [(("a", "b"), 40.0), (("a", "c"), 60.0)];
        // b to c is not known to a replica in a: the table leaves it to the default too.
        if from == to {
            return 0.0;
        }
        table
            .iter()
            .find(|((x, y), _)| (*x, *y) == (from, to) || (*y, *x) == (from, to))
            .map_or(90.0, |(_, v)| *v)
    }

    #[test]
    fn a_gateway_in_another_cluster_is_decided_for_as_from_there() {
        let a = Origin {
            cluster: Some("a".into()),
            region: Some("eu".into()),
            zone: Some("eu-1".into()),
            rtt_ms: [("b".to_owned(), 40.0), ("c".to_owned(), 60.0)].into(),
            default_rtt_ms: 90.0,
            measure_rtt: false,
        };
        let place = |cluster, region, zone| Place {
            cluster,
            region,
            zone,
        };
        // From b, the replica in a knows b's round trip to a and its own (nothing); b to c is
        // not in the table: its default.
        let from_b = a.seen_from(place("b", "us", ""));
        for to in ["a", "b", "c", "d"] {
            assert_eq!(
                from_b.network_ms(&labels(to)),
                table_rtt("b", to),
                "b to {to}"
            );
        }
        assert_eq!(from_b.at(Level::Cluster), Some("b"));
        assert_eq!(from_b.at(Level::Region), Some("us"));
        assert_eq!(from_b.at(Level::Zone), None, "not said: not a's zone");
        // From a itself (or nowhere said): the replica's own origin, its region and zone
        // where the gateway names none.
        for p in [place("", "", ""), place("a", "", "")] {
            assert_eq!(*a.seen_from(p), a);
        }
        let zone_2 = a.seen_from(place("a", "", "eu-2"));
        assert_eq!(
            (zone_2.at(Level::Region), zone_2.at(Level::Zone)),
            (Some("eu"), Some("eu-2"))
        );
        for to in ["a", "b", "c"] {
            assert_eq!(
                zone_2.network_ms(&labels(to)),
                table_rtt("a", to),
                "a to {to}"
            );
        }
        // An unplaced replica adds nothing for a gateway placed elsewhere, and keeps it there.
        let unplaced = Origin::default();
        let nowhere = unplaced.seen_from(place("b", "", ""));
        assert_eq!(nowhere.network_ms(&labels("a")), 0.0);
        assert_eq!(nowhere.at(Level::Cluster), Some("b"));
    }

    #[test]
    fn network_time_is_the_round_trip_to_another_named_cluster_and_nothing_here() {
        let o = Origin {
            cluster: Some("b".into()),
            rtt_ms: [("c".to_owned(), 40.0)].into(),
            default_rtt_ms: 90.0,
            ..Origin::default()
        };
        assert_eq!(o.network_ms(&labels("b")), 0.0);
        assert_eq!(o.network_ms(&Labels::new()), 0.0, "no cluster named: here");
        assert_eq!(o.network_ms(&labels("c")), 40.0);
        assert_eq!(o.network_ms(&labels("a")), 90.0, "not listed: the default");
        assert_eq!(Origin::default().network_ms(&labels("c")), 0.0, "not told");
    }

    #[test]
    fn a_bad_round_trip_or_an_empty_name_is_a_problem() {
        let unplaced = Origin {
            rtt_ms: [(String::new(), 1.0)].into(),
            ..Origin::default()
        };
        assert_eq!(
            unplaced.problems("locality"),
            [
                "locality.cluster is needed with round trips: without it every cluster, this one too, is another",
                "locality.rtt_ms has an empty cluster name",
            ]
        );
        let measuring = Origin {
            measure_rtt: true,
            ..Origin::default()
        };
        assert_eq!(
            measuring.problems("locality").len(),
            1,
            "measured from where"
        );
        let o = Origin {
            cluster: Some("b".into()),
            zone: Some(String::new()),
            rtt_ms: [("b".to_owned(), 1.0), ("c".to_owned(), -1.0)].into(),
            default_rtt_ms: f64::NAN,
            ..Origin::default()
        };
        assert_eq!(
            o.problems("locality"),
            [
                "locality.rtt_ms names b, this replica's own cluster (always 0)",
                "locality.rtt_ms.c must be a finite number >= 0, not -1",
                "locality.default_rtt_ms must be a finite number >= 0, not NaN",
                "locality.zone must not be empty",
            ]
        );
    }
}
