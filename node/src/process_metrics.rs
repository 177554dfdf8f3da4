//! The process's own series, as Prometheus' client libraries name them, read from `/proc/self`
//! at each scrape (procfs): CPU seconds, resident and virtual memory, open and maximum file
//! descriptors, start time, threads; and `kvplane_build_info{version}` at 1. Every kvplane
//! process (node, gateway, bridge) serves them on its `/metrics`. A value `/proc` cannot give
//! is left out of that scrape, not reported as 0.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The process's series (see the module's words).
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl ProcessCollector {
    /// One, boxed, as a registry takes it.
    pub fn boxed() -> Box<dyn Collector> {
        Box::new(Self)
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: Option<f64>,
) -> Result<(), std::fmt::Error> {
    if let Some(v) = value {
        let g = ConstGauge::new(v);
        g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
    }
    Ok(())
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let info = ConstGauge::new(1i64);
        let labels = [("version", env!("CARGO_PKG_VERSION"))];
        let mut family = encoder.encode_descriptor(
            "kvplane_build_info",
            "The running build: its version as a label, the value 1",
            None,
            info.metric_type(),
        )?;
        info.encode(family.encode_family(&labels)?)?;
        let me = procfs::process::Process::myself().ok();
        let stat = me.as_ref().and_then(|p| p.stat().ok());
        let ticks = procfs::ticks_per_second() as f64;
        let page = procfs::page_size() as f64;
        if let Some(s) = &stat {
            let cpu = ConstCounter::new((s.utime + s.stime) as f64 / ticks);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                cpu.metric_type(),
            )?)?;
        }
        gauge(
            &mut encoder,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            stat.as_ref().map(|s| s.rss as f64 * page),
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            stat.as_ref().map(|s| s.vsize as f64),
        )?;
        gauge(
            &mut encoder,
            "process_threads",
            "Number of OS threads in the process",
            stat.as_ref().map(|s| s.num_threads as f64),
        )?;
        let boot = procfs::boot_time_secs().ok();
        gauge(
            &mut encoder,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            stat.as_ref()
                .zip(boot)
                .map(|(s, b)| b as f64 + s.starttime as f64 / ticks),
        )?;
        gauge(
            &mut encoder,
            "process_open_fds",
            "Number of open file descriptors",
            me.as_ref()
                .and_then(|p| p.fd_count().ok())
                .map(|n| n as f64),
        )?;
        let max_fds = me.as_ref().and_then(|p| p.limits().ok()).and_then(|l| {
            match l.max_open_files.soft_limit {
                procfs::process::LimitValue::Value(v) => Some(v as f64),
                procfs::process::LimitValue::Unlimited => None,
            }
        });
        gauge(
            &mut encoder,
            "process_max_fds",
            "Maximum number of open file descriptors",
            max_fds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    /// The values are the kernel's own, read back independently of the collector.
    #[test]
    fn the_process_series_are_the_kernels_figures_for_this_process() {
        let mut r = Registry::default();
        r.register_collector(Box::new(ProcessCollector));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap_or_default();
        let value = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.split([' ', '{']).next() == Some(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(-1.0)
        };
        assert!(
            text.contains(&format!(
                "kvplane_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        // /proc/self/status, read as text here: the same process's resident set (kB) and
        // threads, within what a scrape's own allocations can move them.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |key: &str| -> f64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(-1.0)
        };
        let rss = value("process_resident_memory_bytes");
        let kernel_rss = field("VmRSS:") * 1024.0;
        assert!(
            rss > 0.0 && (rss - kernel_rss).abs() < 16.0 * 1024.0 * 1024.0,
            "{rss} against {kernel_rss}"
        );
        assert!(value("process_threads") >= 1.0, "{text}");
        assert!(value("process_open_fds") >= 3.0, "{text}");
        assert!(value("process_cpu_seconds_total") >= 0.0, "{text}");
        let start = value("process_start_time_seconds");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        assert!(start > 1.6e9 && start <= now + 1.0, "{start} against {now}");
    }
}
