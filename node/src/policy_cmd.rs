//! `kvplane validate DIR...` and `kvplane crds`: policies checked offline, CRDs from the types.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kvplane_policy::{Catalog, Documents, Located};

#[derive(Debug, Clone, clap::Args)]
pub struct ValidateArgs {
    /// Directories (or files) of policy YAML; every `*.yaml` and `*.yml` file is read.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// The YAML files under `path`, sorted (a file is taken as given).
fn yaml_files(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(path).with_context(|| format!("cannot read {}", path.display()))? {
        let p = e?.path();
        if p.is_dir() {
            files.extend(yaml_files(&p)?);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Reads and checks every policy file under `paths`.
pub fn load(paths: &[PathBuf]) -> anyhow::Result<(Catalog, Vec<Located>)> {
    let mut docs = Documents::default();
    for path in paths {
        for f in yaml_files(path)? {
            let text = std::fs::read_to_string(&f)
                .with_context(|| format!("cannot read {}", f.display()))?;
            docs.add_file(&f.display().to_string(), &text);
        }
    }
    Ok(docs.check())
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
        "ok: {} worker sets, {} pools, {} providers, {} policies, {} gateway backends",
        catalog.worker_sets.len(),
        catalog.pools.len(),
        catalog.providers.len(),
        catalog.policies.len(),
        catalog.backends.len()
    );
    Ok(())
}

pub fn crds() {
    print!("{}", kvplane_policy::crds_yaml());
}
