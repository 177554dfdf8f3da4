//! `kvplane config put|delete`: config objects through `Admin.PutConfig` / `DeleteConfig`.
//! A put is the admin's; a delete may name the object's owner, the explicit act that removes
//! an object its source (node config, directory, Kubernetes) no longer holds.

use anyhow::Context;
use kvplane_proto::v1::{DeleteConfigRequest, PutConfigRequest};

#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    #[command(flatten)]
    pub node: crate::NodeAddr,
    #[command(subcommand)]
    pub command: ConfigCmd,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum ConfigCmd {
    /// Create or replace an object (owned by admin from then on).
    Put {
        /// `pool` or a policy kind (`InferencePolicy`, ...).
        #[arg(long)]
        kind: String,
        #[arg(long)]
        name: String,
        /// A file with the object's JSON value (`-`: standard input).
        #[arg(long)]
        file: String,
    },
    /// Delete an object.
    Delete {
        #[arg(long)]
        kind: String,
        #[arg(long)]
        name: String,
        /// Delete on behalf of its owner (`node`, `directory`, `kubernetes`); default: admin,
        /// which may delete only what it wrote.
        #[arg(long, default_value = "")]
        owner: String,
    },
}

pub async fn run(a: ConfigArgs) -> anyhow::Result<()> {
    let mut c = crate::cluster::connect(&a.node.tls, &a.node.addr).await?;
    let written = match a.command {
        ConfigCmd::Put { kind, name, file } => {
            let value = if file == "-" {
                let mut v = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
                v
            } else {
                std::fs::read(&file).with_context(|| format!("cannot read {file}"))?
            };
            c.put_config(PutConfigRequest { kind, name, value }).await
        }
        ConfigCmd::Delete { kind, name, owner } => {
            c.delete_config(DeleteConfigRequest { kind, name, owner })
                .await
        }
    }
    .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    println!("written      index {}", written.into_inner().index);
    Ok(())
}
