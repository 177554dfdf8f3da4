//! The right each gRPC method needs.

use kvplane_policy::kinds::Right;

/// What a call needs: a right, membership of the cluster, or nothing (health, reflection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    Nothing,
    Right(Right),
    /// Raft RPCs: only the cluster's members.
    Member,
}

impl Needs {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Needs::Nothing => "",
            Needs::Right(r) => r.as_str(),
            Needs::Member => "member",
        }
    }
}

/// The right the gRPC method at `path` (`/package.Service/Method`) needs.
pub fn needs(path: &str) -> Needs {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (service, method) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match (service, method) {
        ("kvplane.v1.Raft", _) => Needs::Member,
        ("kvplane.v1.Router", "Explain") => Needs::Right(Right::Read),
        ("kvplane.v1.Router", _) | ("envoy.service.ext_proc.v3.ExternalProcessor", _) => {
            Needs::Right(Right::Route)
        }
        ("kvplane.v1.Admin", "Status" | "ClusterStatus" | "ExportState") => {
            Needs::Right(Right::Read)
        }
        ("kvplane.v1.Admin", "PutConfig" | "DeleteConfig") => Needs::Right(Right::Config),
        ("kvplane.v1.Admin", "AddMember" | "RemoveMember" | "SetFaults" | "SetFailpoints") => {
            Needs::Right(Right::Membership)
        }
        // Health checks and reflection: a proxy's health checks carry no identity.
        (
            "grpc.health.v1.Health"
            | "grpc.reflection.v1.ServerReflection"
            | "grpc.reflection.v1alpha.ServerReflection",
            _,
        ) => Needs::Nothing,
        // Anything else (a method added without a line here): the members only.
        _ => Needs::Member,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rights table of the README, written out: every kvplane method in the descriptor
    /// set must be in it (a new method fails here until it is given a right).
    #[test]
    fn every_method_of_every_kvplane_service_needs_the_right_the_readme_table_gives() {
        use prost::Message as _;
        let table: &[(&str, Needs)] = &[
            ("kvplane.v1.Router/Route", Needs::Right(Right::Route)),
            ("kvplane.v1.Router/ReportUsage", Needs::Right(Right::Route)),
            ("kvplane.v1.Router/Models", Needs::Right(Right::Route)),
            ("kvplane.v1.Router/Explain", Needs::Right(Right::Read)),
            ("kvplane.v1.Admin/Status", Needs::Right(Right::Read)),
            ("kvplane.v1.Admin/ClusterStatus", Needs::Right(Right::Read)),
            ("kvplane.v1.Admin/ExportState", Needs::Right(Right::Read)),
            ("kvplane.v1.Admin/PutConfig", Needs::Right(Right::Config)),
            ("kvplane.v1.Admin/DeleteConfig", Needs::Right(Right::Config)),
            (
                "kvplane.v1.Admin/AddMember",
                Needs::Right(Right::Membership),
            ),
            (
                "kvplane.v1.Admin/RemoveMember",
                Needs::Right(Right::Membership),
            ),
            (
                "kvplane.v1.Admin/SetFaults",
                Needs::Right(Right::Membership),
            ),
            (
                "kvplane.v1.Admin/SetFailpoints",
                Needs::Right(Right::Membership),
            ),
        ];
        let set = prost_types::FileDescriptorSet::decode(kvplane_proto::FILE_DESCRIPTOR_SET)
            .unwrap_or_default();
        let mut seen = 0;
        for file in &set.file {
            let package = file.package();
            for service in &file.service {
                for method in &service.method {
                    let name = format!("{package}.{}/{}", service.name(), method.name());
                    let want = if service.name() == "Raft" {
                        Needs::Member
                    } else {
                        table
                            .iter()
                            .find(|(n, _)| *n == name)
                            .map(|(_, r)| *r)
                            .unwrap_or_else(|| panic!("{name} is not in the rights table"))
                    };
                    assert_eq!(needs(&format!("/{name}")), want, "{name}");
                    seen += 1;
                }
            }
        }
        assert!(
            seen >= table.len() + 6,
            "the descriptor set holds every service: {seen}"
        );
        assert_eq!(
            needs("/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
            Needs::Right(Right::Route)
        );
        for open in [
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ] {
            assert_eq!(needs(open), Needs::Nothing, "{open}");
        }
        assert_eq!(
            needs("/some.New/Service"),
            Needs::Member,
            "closed by default"
        );
    }
}
