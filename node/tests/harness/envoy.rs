//! Envoy, for the tests that put a real proxy in front of kvplane or play a provider with it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Envoy's binary: `KVPLANE_ENVOY`, else what `scripts/install-envoy` links.
pub fn envoy_binary() -> PathBuf {
    let path = std::env::var_os("KVPLANE_ENVOY").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/envoy/envoy"
            ))
        },
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "no Envoy at {}: run scripts/install-envoy (or set KVPLANE_ENVOY)",
        path.display()
    );
    path
}

/// Envoy running `config` (written to `dir/<name>.yaml`, its log beside it).
pub fn spawn_envoy(dir: &Path, name: &str, config: &str) -> Child {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, config).unwrap();
    Command::new(envoy_binary())
        .arg("-c")
        .arg(&path)
        .args(["--disable-hot-restart", "--log-level", "warn"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap()
}
