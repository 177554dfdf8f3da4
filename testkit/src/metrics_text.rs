//! Samples and histograms read from a Prometheus metrics text.

/// The value of the first sample of `name` (any labels) in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.split(['{', ' ']).next() == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `(le, cumulative count)` of histogram `name`'s buckets in a Prometheus text, in the text's
/// order; `+Inf` is infinity. Every series' buckets: for an unlabelled histogram.
pub fn histogram_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, rest.rsplit(' ').next()?.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket that holds quantile `q` (NaN for an empty histogram).
pub fn quantile_bound(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total == 0.0 {
        return f64::NAN;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map_or(f64::NAN, |b| b.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_quantiles_read_as_prometheus_client_writes_them() {
        let text = "# TYPE d histogram\nd_sum 0.3\nd_count 4\nd_bucket{le=\"5e-5\"} 1\n\
                    d_bucket{le=\"0.0001\"} 3\nd_bucket{le=\"+Inf\"} 4\nother_bucket{le=\"1.0\"} 9\n";
        let b = histogram_buckets(text, "d");
        assert_eq!(b, [(5e-5, 1.0), (1e-4, 3.0), (f64::INFINITY, 4.0)]);
        assert_eq!(quantile_bound(&b, 0.5), 1e-4);
        assert_eq!(quantile_bound(&b, 0.25), 5e-5);
        assert!(quantile_bound(&b, 0.99).is_infinite());
        assert!(quantile_bound(&[], 0.5).is_nan());
    }
}
