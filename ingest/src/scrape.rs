//! Reading an engine's `/metrics` (Prometheus text, vLLM's metric names) into a
//! [`MetricsMessage`].

use crate::MetricsMessage;

/// Why a scrape produced nothing.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("metrics request failed: {0}")]
    Http(String),
    #[error("metrics text is not parseable: {0}")]
    Parse(String),
    #[error("metrics text lacks {0}")]
    Missing(&'static str),
}

/// Metric names may contain colons (vLLM's all do); prometheus-parse 0.2 only accepts word
/// characters in names, so `vllm:` becomes `vllm_` before parsing.
fn without_colon(line: &str) -> String {
    for prefix in ["vllm:", "# HELP vllm:", "# TYPE vllm:"] {
        if let Some(rest) = line.strip_prefix(prefix) {
            return format!("{}_{rest}", &prefix[..prefix.len() - 1]);
        }
    }
    line.to_owned()
}

/// Parses vLLM's metrics text. Gauges are summed over label sets (one engine may expose
/// several `engine` labels); `vllm:gpu_cache_usage_perc` is accepted for engines before 0.15,
/// and the prefix-cache counters under their earlier names (`vllm:gpu_prefix_cache_queries`,
/// `vllm:gpu_prefix_cache_hits`) as well as the current ones.
pub fn parse_vllm_metrics(text: &str) -> Result<MetricsMessage, ScrapeError> {
    let lines = text.lines().map(|l| Ok(without_colon(l)));
    let scrape =
        prometheus_parse::Scrape::parse(lines).map_err(|e| ScrapeError::Parse(e.to_string()))?;
    let value = |names: &[&str]| -> Option<(f64, usize)> {
        let mut found = None;
        for s in &scrape.samples {
            if names.contains(&s.metric.as_str()) {
                let v = match s.value {
                    prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    _ => continue,
                };
                let (sum, n) = found.unwrap_or((0.0, 0));
                found = Some((sum + v, n + 1));
            }
        }
        found
    };
    let running = value(&["vllm_num_requests_running"])
        .ok_or(ScrapeError::Missing("vllm:num_requests_running"))?;
    let waiting = value(&["vllm_num_requests_waiting"])
        .ok_or(ScrapeError::Missing("vllm:num_requests_waiting"))?;
    let usage = value(&["vllm_kv_cache_usage_perc", "vllm_gpu_cache_usage_perc"])
        .ok_or(ScrapeError::Missing("vllm:kv_cache_usage_perc"))?;
    // One name per engine version: an engine exposes one of them, never two.
    let queries = value(&[
        "vllm_prefix_cache_queries_total",
        "vllm_prefix_cache_queries",
        "vllm_gpu_prefix_cache_queries_total",
        "vllm_gpu_prefix_cache_queries",
    ])
    .map_or(0.0, |v| v.0);
    let hits = value(&[
        "vllm_prefix_cache_hits_total",
        "vllm_prefix_cache_hits",
        "vllm_gpu_prefix_cache_hits_total",
        "vllm_gpu_prefix_cache_hits",
    ])
    .map_or(0.0, |v| v.0);
    let to_u32 = |v: f64| {
        if v.is_finite() && v > 0.0 {
            v.round().min(f64::from(u32::MAX)) as u32
        } else {
            0
        }
    };
    let ttft_sum = value(&["vllm_time_to_first_token_seconds_sum"]).map_or(0.0, |v| v.0);
    let ttft_count = value(&["vllm_time_to_first_token_seconds_count"]).map_or(0.0, |v| v.0);
    Ok(MetricsMessage {
        time_to_first_token_seconds_sum: if ttft_sum.is_finite() {
            ttft_sum.max(0.0)
        } else {
            0.0
        },
        time_to_first_token_seconds_count: if ttft_count.is_finite() && ttft_count > 0.0 {
            ttft_count.round() as u64
        } else {
            0
        },
        num_requests_running: to_u32(running.0),
        num_requests_waiting: to_u32(waiting.0),
        // Averaged over engines (data-parallel ranks) when there are several.
        kv_cache_usage_perc: (usage.0 / usage.1.max(1) as f64).clamp(0.0, 1.0),
        prefix_cache_hit_rate: if queries > 0.0 {
            (hits / queries).clamp(0.0, 1.0)
        } else {
            0.0
        },
    })
}

/// Fetches and parses an engine's metrics.
pub async fn scrape(client: &reqwest::Client, url: &str) -> Result<MetricsMessage, ScrapeError> {
    let text = client
        .get(url)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| ScrapeError::Http(e.to_string()))?
        .text()
        .await
        .map_err(|e| ScrapeError::Http(e.to_string()))?;
    parse_vllm_metrics(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics_text_parses() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
"#;
        let m = parse_vllm_metrics(text).unwrap();
        assert_eq!(m.num_requests_running, 3);
        assert_eq!(m.num_requests_waiting, 2);
        assert_eq!(m.kv_cache_usage_perc, 0.25);
        assert_eq!(m.prefix_cache_hit_rate, 0.25);
    }

    #[test]
    fn current_and_earlier_metric_names_read_the_same() {
        let text = |usage: &str, prefix: &str| {
            format!(
                "vllm:num_requests_running{{engine=\"0\"}} 1\nvllm:num_requests_waiting{{engine=\"0\"}} 0\n{usage}{{engine=\"0\"}} 0.5\n{prefix}_queries_total{{engine=\"0\"}} 40\n{prefix}_hits_total{{engine=\"0\"}} 10\n"
            )
        };
        for (usage, prefix) in [
            ("vllm:kv_cache_usage_perc", "vllm:prefix_cache"),
            ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache"),
        ] {
            let m = parse_vllm_metrics(&text(usage, prefix)).unwrap();
            assert_eq!(
                (m.kv_cache_usage_perc, m.prefix_cache_hit_rate),
                (0.5, 0.25),
                "{usage}, {prefix}"
            );
        }
    }

    #[test]
    fn text_without_vllm_gauges_is_an_error() {
        assert!(matches!(
            parse_vllm_metrics("up 1\n"),
            Err(ScrapeError::Missing(_))
        ));
    }
}
