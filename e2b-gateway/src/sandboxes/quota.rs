//! How many sandboxes each team may hold at once (E2B's concurrent-sandbox limit): one team
//! must not take every node's room from the others.
//!
//! A team holds a sandbox from its create's first write until it ends or is hibernated (a
//! running or paused sandbox keeps its node's memory; a hibernated one only its files in the
//! blob store). The count is the routing table's (every manifest, as the ledger's watch
//! delivers them) plus this gateway's creates under way, so a burst of creates through one
//! gateway cannot overshoot; creates through several gateways at once may, by what each has
//! under way before the watch shows the others'.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

/// What a create past its team's limit is told (E2B answers 429 with the limit in words).
pub fn refusal(team_limit: u32) -> String {
    format!(
        "you have reached the maximum number of concurrent sandboxes ({team_limit}) for your team; kill or hibernate one first"
    )
}

/// This gateway's creates under way: each one's sandbox ID, by team.
#[derive(Clone, Default)]
pub struct UnderWay {
    by_team: Arc<Mutex<HashMap<String, HashSet<String>>>>,
}

/// A create counted as under way until it is dropped (answered either way: once it is in the
/// ledger, the routing table counts it).
pub struct Admitted {
    under_way: UnderWay,
    team: String,
    sandbox_id: String,
}

impl UnderWay {
    /// Admits the create of `sandbox_id` for `team` if that keeps the team within `limit`:
    /// `held` counts the sandboxes the routing table shows among the IDs given to it (this
    /// gateway's creates under way, whose manifests it may show already, are counted once),
    /// `None` while it cannot tell.
    pub fn admit(
        &self,
        team: &str,
        sandbox_id: &str,
        limit: u32,
        held: impl FnOnce(&HashSet<String>) -> Option<usize>,
    ) -> Result<Admitted, Refused> {
        let mut by_team = self.by_team.lock().unwrap_or_else(PoisonError::into_inner);
        let ours = by_team.entry(team.to_string()).or_default();
        let total = held(ours).map(|held| held + ours.len() + 1);
        let refused = match total {
            None => Some(Refused::Uncounted),
            Some(total) if total > usize::try_from(limit).unwrap_or(usize::MAX) => Some(Refused::AtLimit),
            Some(_) => None,
        };
        if let Some(refused) = refused {
            if ours.is_empty() {
                by_team.remove(team);
            }
            return Err(refused);
        }
        ours.insert(sandbox_id.to_string());
        Ok(Admitted {
            under_way: self.clone(),
            team: team.to_string(),
            sandbox_id: sandbox_id.to_string(),
        })
    }
}

/// Why a create was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The team holds its limit.
    AtLimit,
    /// The routing table has not listed the manifests yet: nobody's count is known.
    Uncounted,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut by_team = self.under_way.by_team.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(ours) = by_team.get_mut(&self.team) {
            ours.remove(&self.sandbox_id);
            if ours.is_empty() {
                by_team.remove(&self.team);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The routing table: one sandbox of team a's, and the given ones.
    fn table(extra: &[&'static str]) -> impl FnOnce(&HashSet<String>) -> Option<usize> {
        let mut ids = vec!["old"];
        ids.extend_from_slice(extra);
        move |ours| Some(ids.iter().filter(|id| !ours.contains(**id)).count())
    }

    #[test]
    fn creates_under_way_count_once_until_answered() {
        let under_way = UnderWay::default();
        let first = under_way.admit("a", "s1", 3, table(&[])).expect("2 of 3");
        // Its manifest shows already: counted once, not twice.
        let second = under_way.admit("a", "s2", 3, table(&["s1"])).expect("3 of 3");
        let fourth = under_way.admit("a", "s3", 3, table(&["s1", "s2"]));
        assert_eq!(fourth.err(), Some(Refused::AtLimit), "a fourth is past the limit");
        assert!(
            under_way.admit("b", "t1", 1, |_| Some(0)).is_ok(),
            "another team's are its own"
        );
        assert_eq!(under_way.admit("c", "u1", 1, |_| None).err(), Some(Refused::Uncounted));
        drop(first);
        // Answered, and in the table's count instead.
        assert!(under_way.admit("a", "s3", 3, table(&["s1", "s2"])).is_err());
        drop(second);
        assert!(under_way.admit("a", "s3", 3, table(&["s1"])).is_ok());
    }
}
