//! `kvplane tls dev-certs`: a CA and certificates for a local cluster, its operator and a
//! gateway, in cert-manager's layout. For development: production certificates come from
//! cert-manager (`deploy/`).

use std::path::PathBuf;

use anyhow::Context as _;
use kvplane_tls::dev_ca::DevCa;

#[derive(Debug, Clone, clap::Args)]
pub struct DevCertsArgs {
    /// Where to write `member/`, `operator/` and `gateway/` (each `ca.crt`, `tls.crt`, `tls.key`).
    #[arg(long)]
    pub out: PathBuf,
    /// Hosts the members serve (DNS names or IP addresses), repeatable.
    #[arg(long = "host", default_values_t = ["127.0.0.1".to_owned(), "localhost".to_owned()])]
    pub hosts: Vec<String>,
    /// The SPIFFE trust domain the identities are in.
    #[arg(long, default_value = "kvplane.local")]
    pub trust_domain: String,
}

pub fn dev_certs(a: &DevCertsArgs) -> anyhow::Result<()> {
    let ca = DevCa::new("kvplane development ca")?;
    let hosts: Vec<&str> = a.hosts.iter().map(String::as_str).collect();
    let td = &a.trust_domain;
    let identities = [
        ("member", format!("spiffe://{td}/ns/kvplane/sa/kvplane")),
        ("operator", format!("spiffe://{td}/ns/kvplane/sa/operator")),
        ("gateway", format!("spiffe://{td}/ns/gateways/sa/gateway")),
    ];
    for (dir, id) in &identities {
        let path = a.out.join(dir);
        // Only the members serve: the operator's and the gateway's are client certificates.
        let serves: &[&str] = if *dir == "member" { &hosts } else { &[] };
        ca.write(&path, id, serves)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("{:<9} {id}  ({})", dir, path.display());
    }
    let member = a.out.join("member");
    println!(
        "\nnode config:\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n[access]\nadmins = [{:?}]\n",
        member.join("ca.crt"),
        member.join("tls.crt"),
        member.join("tls.key"),
        identities[1].1,
    );
    println!(
        "clients: kvplane status --tls-dir {}; kvplane gateway --tls-dir {} (and an AccessPolicy granting {} route)",
        a.out.join("operator").display(),
        a.out.join("gateway").display(),
        identities[2].1,
    );
    Ok(())
}
