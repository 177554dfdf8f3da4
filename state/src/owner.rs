//! Who writes a configuration object. Each config source reconciles only the objects it owns;
//! a write to an object another source owns is refused with the owner's name, identically on
//! every replica.

use serde::{Deserialize, Serialize};

/// The source of a configuration object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Owner {
    /// The `[[pools]]` of the node configuration (created and updated, never deleted by it).
    Node,
    /// The policy directory (`policy_dir`).
    Directory,
    /// The policy custom resources of the Kubernetes cluster (`policy_kubernetes`).
    Kubernetes,
    /// `Admin.PutConfig` / `Admin.DeleteConfig`.
    Admin,
}

impl Owner {
    pub const ALL: [Self; 4] = [Self::Node, Self::Directory, Self::Kubernetes, Self::Admin];

    /// Its name, as Status, the CLI and `Admin.DeleteConfig`'s `owner` say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Directory => "directory",
            Self::Kubernetes => "kubernetes",
            Self::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_owner_parses_from_its_name() {
        for o in Owner::ALL {
            assert_eq!(Owner::parse(o.as_str()), Some(o));
        }
        assert_eq!(Owner::parse("root"), None);
    }
}
