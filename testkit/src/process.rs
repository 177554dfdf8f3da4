//! Real processes: started with their stderr in a log file, ready when a line of their stdout
//! starts with a given prefix (kvplane's roles each print one, `kvplane ready grpc=...`),
//! signalled and stopped by pid.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a process may take to print its ready line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot create the log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{program} exited ({status}) before it was ready; see {log}")]
    Exited {
        program: String,
        status: std::process::ExitStatus,
        log: PathBuf,
    },
    #[error("{program} did not become ready within {timeout:?}; see {log}")]
    NotReady {
        program: String,
        timeout: Duration,
        log: PathBuf,
    },
    #[error("nothing listens on port {port} after {timeout:?}")]
    NoListener { port: u16, timeout: Duration },
    #[error("no free port: {0}")]
    Port(std::io::Error),
}

/// What to start.
#[derive(Debug, Clone, Copy)]
pub struct Spec<'a> {
    pub program: &'a Path,
    pub args: &'a [String],
    pub env: &'a [(String, String)],
    /// Where its stderr goes (created anew).
    pub log: &'a Path,
    /// The start of its ready line; `None`: ready once spawned.
    pub ready: Option<&'a str>,
}

/// Starts `spec` and waits for its ready line (returned; empty without a prefix). The process
/// is killed if it does not become ready.
pub fn start(spec: Spec<'_>) -> Result<(Child, String), ProcessError> {
    let log = std::fs::File::create(spec.log).map_err(|source| ProcessError::Log {
        path: spec.log.to_owned(),
        source,
    })?;
    let program = spec.program.display().to_string();
    let mut child = Command::new(spec.program)
        .args(spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        // Read only for the ready line: an undrained pipe would stall the process once full.
        .stdout(if spec.ready.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(log)
        .spawn()
        .map_err(|source| ProcessError::Spawn {
            program: program.clone(),
            source,
        })?;
    let Some(prefix) = spec.ready else {
        return Ok((child, String::new()));
    };
    let (tx, rx) = mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        let prefix = prefix.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with(&prefix) {
                    let _ = tx.send(line);
                }
            }
        });
    }
    let program = format!("{program} {}", spec.args.join(" "));
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(line) => Ok((child, line)),
        // Its stdout closed without the line: it exited (or is about to).
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let status = child.wait().map_err(|source| ProcessError::Spawn {
                program: program.clone(),
                source,
            })?;
            Err(ProcessError::Exited {
                program,
                status,
                log: spec.log.to_owned(),
            })
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(ProcessError::NotReady {
                program,
                timeout: READY_TIMEOUT,
                log: spec.log.to_owned(),
            })
        }
    }
}

/// SIGKILL and reap, if running.
pub fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Sends `signal` (`-STOP`, `-CONT`, `-TERM`...) to `child`; whether it was delivered.
pub fn signal(child: &Child, signal: &str) -> bool {
    Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether every thread of `child` is stopped (SIGSTOP has taken effect everywhere: a write
/// in flight when the signal came has finished).
pub fn is_stopped(child: &Child) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", child.id())) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}

/// SIGTERM to every child (last started first), then SIGKILL to those still running after
/// `grace`, and reap them all.
pub fn stop_all(children: &mut [Child], grace: Duration) {
    for c in children.iter().rev() {
        signal(c, "-TERM");
    }
    let deadline = Instant::now() + grace;
    for c in children.iter_mut().rev() {
        while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A loopback port nothing listens on now, for a process to listen on soon.
///
/// Ports come from below the kernel's ephemeral range, where no `bind(0)` and no outgoing
/// connection's source port lands, walked from an offset of this process's id so that test
/// processes running side by side try different ports; the kernel's own choice is the fallback
/// when that range is too small.
pub fn free_port() -> Result<u16, ProcessError> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low > LOW + 1_000 {
        let span = u64::from(ephemeral_low - LOW);
        let base = u64::from(std::process::id()).wrapping_mul(2_654_435_761) % span;
        for _ in 0..span {
            let step = u64::from(NEXT.fetch_add(1, Ordering::Relaxed));
            let port = u64::from(LOW) + (base + step * 7_919) % span;
            let Ok(port) = u16::try_from(port) else {
                continue;
            };
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(ProcessError::Port)
}

/// Waits until something accepts connections on loopback `port`.
pub async fn wait_tcp(port: u16, timeout: Duration) -> Result<(), ProcessError> {
    let deadline = Instant::now() + timeout;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            return Err(ProcessError::NoListener { port, timeout });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `key=value` from a ready line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|p| p.strip_prefix(key)?.strip_prefix('='))
}

/// `name` on `PATH` (or in the sbin directories, where Debian puts `nats-server`).
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .chain(["/usr/sbin", "/usr/local/sbin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The `kvplane` binary: this process when it is `kvplane` (the demo); else the one nextest
/// names for the integration tests of the package that has it (`$NEXTEST_BIN_EXE_kvplane`,
/// the path Cargo's `CARGO_BIN_EXE_kvplane` names); else `$KVPLANE_BIN`; else `kvplane`
/// beside the directory of this test executable (`target/<profile>/deps/..`), where Cargo
/// builds it before the integration tests of `node/`, the package that has it.
pub fn kvplane_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    if exe.file_stem().is_some_and(|n| n == "kvplane") {
        return exe;
    }
    for var in ["NEXTEST_BIN_EXE_kvplane", "KVPLANE_BIN"] {
        if let Some(p) = std::env::var_os(var) {
            return PathBuf::from(p);
        }
    }
    let name = format!("kvplane{}", std::env::consts::EXE_SUFFIX);
    // A binary beside it (`target/debug/kvplane-chaos`), else one level up (a test binary in
    // `target/debug/deps`).
    let dir = exe.parent();
    if let Some(beside) = dir.map(|d| d.join(&name)).filter(|p| p.is_file()) {
        return beside;
    }
    dir.and_then(Path::parent)
        .map(|d| d.join(&name))
        .unwrap_or_else(|| PathBuf::from("kvplane"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn sh(script: &str, log: &Path) -> Result<(Child, String), ProcessError> {
        start(Spec {
            program: Path::new("sh"),
            args: &["-c".to_owned(), script.to_owned()],
            env: &[],
            log,
            ready: Some("ready "),
        })
    }

    #[test]
    fn the_ready_line_is_returned_and_its_fields_read() {
        let dir = tempfile_dir();
        let (mut child, line) = sh(
            "echo starting; echo ready port=7 x=y; sleep 5",
            &dir.join("a.log"),
        )
        .unwrap();
        assert_eq!(field(&line, "port"), Some("7"));
        assert_eq!(field(&line, "x"), Some("y"));
        assert_eq!(field(&line, "por"), None);
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_process_that_exits_before_its_ready_line_is_reported_with_its_status() {
        let dir = tempfile_dir();
        match sh("echo oops >&2; exit 3", &dir.join("b.log")) {
            Err(ProcessError::Exited { status, log, .. }) => {
                assert_eq!(status.code(), Some(3));
                assert_eq!(std::fs::read_to_string(log).unwrap(), "oops\n");
            }
            other => panic!("{other:?}"),
        }
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvplane-testkit-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
