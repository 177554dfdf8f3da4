//! How well kvplane predicted the engines' first tokens in a run: its members'
//! `kvplane_ttft_prediction_ratio` histograms (observed over predicted TTFT of every reported
//! request), read after a warm-up and at the end; the difference is what came after.

use serde::Serialize;

/// The ratio histogram summed over the members: (upper bound, cumulative count) and the count.
#[derive(Debug, Clone, Default)]
pub(super) struct Ratios {
    buckets: Vec<(f64, u64)>,
    count: u64,
    sum: f64,
}

/// What the reports after the warm-up say.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Summary {
    /// First tokens reported after the warm-up, over the members.
    pub(super) reports: u64,
    /// Of them, observed / predicted within 0.85..1.15.
    pub(super) within_15_percent: f64,
    pub(super) mean_ratio: f64,
    /// The ratio's median, as the histogram's buckets tell it (a bucket's upper bound).
    pub(super) median_ratio_at_most: f64,
}

/// Reads the members' metrics (`http://host:port` each); members that do not answer count
/// nothing.
pub(super) async fn read(members: &[String]) -> Ratios {
    let client = reqwest::Client::new();
    let mut total = Ratios::default();
    for m in members {
        let Ok(r) = client.get(format!("{m}/metrics")).send().await else {
            continue;
        };
        let Ok(text) = r.text().await else { continue };
        total.add(&parse(&text));
    }
    total
}

fn parse(text: &str) -> Ratios {
    const NAME: &str = "kvplane_ttft_prediction_ratio";
    let value = |suffix: &str| kvplane_testkit::metric_value(text, &format!("{NAME}{suffix}"));
    Ratios {
        buckets: kvplane_testkit::histogram_buckets(text, NAME)
            .into_iter()
            .map(|(le, n)| (le, n as u64))
            .collect(),
        count: value("_count") as u64,
        sum: value("_sum"),
    }
}

impl Ratios {
    fn add(&mut self, o: &Ratios) {
        if self.buckets.is_empty() {
            self.buckets = o.buckets.clone();
        } else {
            for (b, (_, n)) in self.buckets.iter_mut().zip(&o.buckets) {
                b.1 += n;
            }
        }
        self.count += o.count;
        self.sum += o.sum;
    }

    fn at_most(&self, bound: f64) -> u64 {
        self.buckets
            .iter()
            .find(|(b, _)| (b - bound).abs() < 1e-9)
            .map_or(0, |(_, n)| *n)
    }

    /// What was reported since `before`.
    pub(super) fn since(&self, before: &Ratios) -> Summary {
        let reports = self.count.saturating_sub(before.count);
        let count = |bound| self.at_most(bound).saturating_sub(before.at_most(bound));
        let within = count(1.15).saturating_sub(count(0.85));
        let median = self
            .buckets
            .iter()
            .map(|(b, _)| *b)
            .find(|b| 2 * count(*b) >= reports && reports > 0)
            .unwrap_or(f64::NAN);
        Summary {
            reports,
            within_15_percent: within as f64 / reports.max(1) as f64,
            mean_ratio: (self.sum - before.sum) / reports.max(1) as f64,
            median_ratio_at_most: median,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reports_after_a_warm_up_are_the_difference_of_two_readings() {
        let text = |c085: u64, c115: u64, count: u64, sum: f64| {
            format!(
                "# TYPE kvplane_ttft_prediction_ratio histogram\nkvplane_ttft_prediction_ratio_sum {sum}\nkvplane_ttft_prediction_ratio_count {count}\nkvplane_ttft_prediction_ratio_bucket{{le=\"0.85\"}} {c085}\nkvplane_ttft_prediction_ratio_bucket{{le=\"1.15\"}} {c115}\nkvplane_ttft_prediction_ratio_bucket{{le=\"+Inf\"}} {count}\n"
            )
        };
        let before = parse(&text(5, 8, 10, 12.0));
        let mut after = parse(&text(6, 95, 100, 102.0));
        // A second member's histogram adds up bucket by bucket.
        after.add(&parse(&text(1, 2, 3, 3.0)));
        let s = after.since(&before);
        assert_eq!(s.reports, 93);
        // (97 - 8) at most 1.15 less (7 - 5) at most 0.85.
        assert!((s.within_15_percent - 87.0 / 93.0).abs() < 1e-9);
        assert!((s.mean_ratio - 1.0).abs() < 1e-9);
        assert_eq!(s.median_ratio_at_most, 1.15);
    }
}
