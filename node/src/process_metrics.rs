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
        // Within a tenth (and 1 MiB) of the kernel's figure: a scrape allocates a little.
        let close = |ours: f64, kernel: f64| {
            ours > 0.0 && (ours - kernel).abs() <= (kernel * 0.1).max(1024.0 * 1024.0)
        };
        let (rss, kernel_rss) = (
            value("process_resident_memory_bytes"),
            field("VmRSS:") * 1024.0,
        );
        assert!(close(rss, kernel_rss), "{rss} against {kernel_rss}");
        let (vsize, kernel_vsize) = (
            value("process_virtual_memory_bytes"),
            field("VmSize:") * 1024.0,
        );
        assert!(close(vsize, kernel_vsize), "{vsize} against {kernel_vsize}");
        // Other test threads may start or end between the reads.
        let threads = value("process_threads");
        assert!(
            threads >= 1.0 && (threads - field("Threads:")).abs() <= 2.0,
            "{text}"
        );
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as f64;
        let open = value("process_open_fds");
        assert!(
            open >= 3.0 && (open - fds).abs() <= 2.0,
            "{open} against {fds}"
        );
        // `/proc/self/limits`: the soft limit of open files, unless unlimited (then left out).
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let soft = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse::<f64>().ok());
        match soft {
            Some(n) => assert_eq!(value("process_max_fds"), n, "{text}"),
            None => assert!(!text.contains("process_max_fds "), "{text}"),
        }
        assert!(value("process_cpu_seconds_total") >= 0.0, "{text}");
        let start = value("process_start_time_seconds");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        assert!(start > 1.6e9 && start <= now + 1.0, "{start} against {now}");
    }
}
