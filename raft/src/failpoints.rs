//! Failpoints (the `fail` crate) on the member's disk writes, for fault tests: a log write or
//! a snapshot write that fails, or that is slow, as a disk would; and a stream batch's
//! proposal refused as if leadership had just moved. Set at run time through
//! `Admin.SetFailpoints`, only on a node with `raft.fault_injection`; with none set, each point
//! costs a lookup in an empty registry. The registry is the process's: one member per process.
//! Each disk point fires before its write (a write refused or delayed whole): torn writes, or an
//! fsync that fails after the data was written, are not modelled.

/// A round of the log's writer thread (one redb transaction: appends, truncations, the vote).
pub const LOG_WRITE: &str = "raft-log-write";
/// A snapshot written to the data directory (one built here, or one installed from the leader).
pub const SNAPSHOT_WRITE: &str = "raft-snapshot-write";

/// The proposal of a stream batch (ingest), refused as "not the leader" while the member
/// leads: what a term change too quick for the proposer to see looks like.
pub const INGEST_PROPOSE: &str = "raft-ingest-propose";

/// Every failpoint a member has.
pub const ALL: [&str; 3] = [LOG_WRITE, SNAPSHOT_WRITE, INGEST_PROPOSE];

/// Why a failpoint setting was refused (nothing of it was applied).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FailpointError {
    #[error("no failpoint {name:?} (there are: {})", ALL.join(", "))]
    Unknown { name: String },
    #[error("failpoint {name}: {reason}")]
    Actions { name: String, reason: String },
    #[error("a failpoint setting is name=actions, not {0:?}")]
    Malformed(String),
}

/// Applies `spec` (`name=actions;...`, the `FAILPOINTS` syntax of the `fail` crate): each named
/// point gets its actions, every other point is switched off. An empty `spec` switches all off.
/// Returns the points now set, as `name=actions`.
pub fn configure(spec: &str) -> Result<Vec<String>, FailpointError> {
    // One setting at a time: two interleaved would leave a mix of both.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut wanted = Vec::new();
    for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, actions) = part
            .split_once('=')
            .ok_or_else(|| FailpointError::Malformed(part.to_owned()))?;
        let name = name.trim();
        if !ALL.contains(&name) {
            return Err(FailpointError::Unknown {
                name: name.to_owned(),
            });
        }
        let actions = actions.trim();
        // A panic would take the writer thread down unanswered, a pause would hold it past
        // any heal: what a disk does is fail or be slow.
        if actions.contains("panic") || actions.contains("pause") {
            return Err(FailpointError::Actions {
                name: name.to_owned(),
                reason: "only return, sleep, delay, yield, print and off are taken".into(),
            });
        }
        wanted.push((name, actions));
    }
    // Every setting is checked before any is applied: `cfg` parses, so try each on a
    // scratch name first.
    for (name, actions) in &wanted {
        fail::cfg("kvplane-failpoint-check", actions).map_err(|reason| {
            FailpointError::Actions {
                name: (*name).to_owned(),
                reason,
            }
        })?;
        fail::remove("kvplane-failpoint-check");
    }
    for name in ALL {
        match wanted.iter().find(|(n, _)| *n == name) {
            Some((_, actions)) => {
                fail::cfg(name, actions).map_err(|reason| FailpointError::Actions {
                    name: name.to_owned(),
                    reason,
                })?
            }
            None => fail::remove(name),
        }
    }
    Ok(active())
}

/// The points set now, as `name=actions`.
pub fn active() -> Vec<String> {
    let mut set: Vec<String> = fail::list()
        .into_iter()
        .filter(|(name, _)| ALL.contains(&name.as_str()))
        .map(|(name, actions)| format!("{name}={actions}"))
        .collect();
    set.sort();
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_names_known_points_and_an_empty_one_clears_them() {
        assert_eq!(
            configure("raft-log-write=sleep(0); raft-snapshot-write=yield"),
            Ok(vec![
                "raft-log-write=sleep(0)".to_owned(),
                "raft-snapshot-write=yield".to_owned()
            ])
        );
        // Naming one switches the other off. (Harmless actions: other tests in this binary
        // may write meanwhile.)
        assert_eq!(
            configure("raft-snapshot-write=10%1*yield"),
            Ok(vec!["raft-snapshot-write=10%1*yield".to_owned()])
        );
        assert!(matches!(
            configure("raft-nothing=return"),
            Err(FailpointError::Unknown { .. })
        ));
        assert!(matches!(
            configure("raft-log-write"),
            Err(FailpointError::Malformed(_))
        ));
        assert!(matches!(
            configure("raft-log-write=sleep(x)"),
            Err(FailpointError::Actions { .. })
        ));
        assert!(matches!(
            configure("raft-log-write=panic"),
            Err(FailpointError::Actions { .. })
        ));
        // A refused setting changed nothing.
        assert_eq!(active(), vec!["raft-snapshot-write=10%1*yield".to_owned()]);
        assert_eq!(configure(""), Ok(Vec::new()));
    }
}
