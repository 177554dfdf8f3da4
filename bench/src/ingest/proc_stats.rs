//! A process's resident memory and CPU time, from `/proc` (Linux).

/// Resident set size in bytes (`VmRSS`).
pub(crate) fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// User plus system CPU time of every thread, in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    // /proc counts in USER_HZ, which the kernel fixes at 100 for user space on Linux.
    Some((utime + stime) as f64 / 100.0)
}

/// CPU time of one role (a node, NATS) across its restarts: each process's last reading,
/// summed.
#[derive(Debug, Default, Clone)]
pub(crate) struct CpuAcrossRestarts {
    /// CPU time of earlier processes.
    done: f64,
    current: Option<(u32, f64)>,
}

impl CpuAcrossRestarts {
    pub(crate) fn sample(&mut self, pid: Option<u32>) {
        let Some(pid) = pid else { return };
        let Some(now) = cpu_seconds(pid) else { return };
        match self.current {
            Some((p, last)) if p != pid => {
                self.done += last;
                self.current = Some((pid, now));
            }
            _ => self.current = Some((pid, now)),
        }
    }

    pub(crate) fn total(&self) -> f64 {
        self.done + self.current.map_or(0.0, |c| c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The readings of this very process are there and plausible; CPU time only grows.
    #[test]
    fn this_process_has_memory_and_cpu_time() {
        let me = std::process::id();
        assert!(rss_bytes(me).is_some_and(|b| b > 1 << 20));
        let before = cpu_seconds(me).unwrap_or(-1.0);
        assert!(before >= 0.0);
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(std::hint::black_box(x) != 1);
        assert!(cpu_seconds(me).unwrap_or(-1.0) >= before);
    }

    /// A restart (a new pid) keeps what the old process used.
    #[test]
    fn cpu_time_adds_up_across_restarts() {
        let mut c = CpuAcrossRestarts {
            done: 0.0,
            current: Some((1, 2.5)),
        };
        c.sample(Some(std::process::id()));
        assert!(c.total() >= 2.5);
    }
}
