//! `kvplane validate DIR...` and `kvplane crds`: policies checked offline, CRDs from the types.

use std::path::PathBuf;

use kvplane_policy::{Catalog, Documents, Located};

#[derive(Debug, Clone, clap::Args)]
pub struct ValidateArgs {
    /// Directories (or files) of policy YAML; every `*.yaml` and `*.yml` file is read.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// Reads and checks every policy file under `paths`.
pub fn load(paths: &[PathBuf]) -> anyhow::Result<(Catalog, Vec<Located>)> {
    Ok(Documents::read(paths)?.check())
}

pub fn validate(a: &ValidateArgs) -> anyhow::Result<()> {
    let (catalog, problems) = load(&a.paths)?;
    for p in &problems {
        println!("{p}");
    }
    anyhow::ensure!(
        problems.is_empty(),
        "{} problem{} found",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    println!(
        "ok: {} worker sets, {} pools, {} providers, {} policies, {} gateway backends, {} access policies",
        catalog.worker_sets.len(),
        catalog.pools.len(),
        catalog.providers.len(),
        catalog.policies.len(),
        catalog.backends.len(),
        catalog.access.len()
    );
    Ok(())
}

pub fn crds() {
    print!("{}", kvplane_policy::crds_yaml());
}
