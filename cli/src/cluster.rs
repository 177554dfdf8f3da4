//! `kvplane cluster status|add|remove`: Raft membership from the command line. Changes are
//! sent to the leader (found through the node given with --addr); one change at a time.

use kvplane_proto::v1::admin_client::AdminClient;
use kvplane_proto::v1::{
    AddMemberRequest, ClusterStatusResponse, RemoveMemberRequest, StatusRequest,
};
use tonic::transport::Channel;

#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    #[command(flatten)]
    pub node: crate::NodeAddr,
    #[command(subcommand)]
    pub command: ClusterCmd,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum ClusterCmd {
    /// Members, voters, leader, term, commit and applied indexes.
    Status,
    /// Add a node: as a learner first, then, once it caught up, as a voter.
    Add {
        #[arg(long)]
        id: u64,
        /// The new node's gRPC address (host:port).
        #[arg(long = "member-addr")]
        member_addr: String,
        /// Keep it a learner: it serves reads from its own state and never votes (a replica
        /// in another cluster, near its gateways).
        #[arg(long)]
        learner: bool,
    },
    /// Remove a node (its id must never come back without its data).
    Remove {
        #[arg(long)]
        id: u64,
    },
}

pub(crate) async fn connect(
    tls: &crate::dial::TlsArgs,
    addr: &str,
) -> anyhow::Result<AdminClient<Channel>> {
    Ok(AdminClient::new(tls.connect(addr).await?))
}

/// A client connected to the current leader.
async fn leader(tls: &crate::dial::TlsArgs, addr: &str) -> anyhow::Result<AdminClient<Channel>> {
    let mut c = connect(tls, addr).await?;
    let s = c
        .cluster_status(StatusRequest::default())
        .await?
        .into_inner();
    if s.leader == s.node || s.leader_addr.is_empty() {
        return Ok(c);
    }
    connect(tls, &s.leader_addr).await
}

fn print(s: &ClusterStatusResponse) {
    println!("node         {}", s.node);
    println!("leader       {} {}", s.leader, s.leader_addr);
    println!("term         {}", s.term);
    println!("committed    {}", s.committed_index);
    println!("applied      {}", s.applied_index);
    println!("snapshot     {}", s.snapshot_index);
    println!("purged       {}", s.purged_index);
    for m in &s.members {
        println!(
            "member       {:<4} {:<24} {}",
            m.id,
            m.addr,
            if m.voter { "voter" } else { "learner" }
        );
    }
}

pub async fn run(a: ClusterArgs) -> anyhow::Result<()> {
    let status = match a.command {
        ClusterCmd::Status => connect(&a.node.tls, &a.node.addr)
            .await?
            .cluster_status(StatusRequest::default())
            .await?
            .into_inner(),
        ClusterCmd::Add {
            id,
            member_addr,
            learner,
        } => leader(&a.node.tls, &a.node.addr)
            .await?
            .add_member(AddMemberRequest {
                id,
                addr: member_addr,
                learner,
                relay: false,
            })
            .await?
            .into_inner(),
        ClusterCmd::Remove { id } => leader(&a.node.tls, &a.node.addr)
            .await?
            .remove_member(RemoveMemberRequest {
                id,
                ..Default::default()
            })
            .await?
            .into_inner(),
    };
    print(&status);
    Ok(())
}
