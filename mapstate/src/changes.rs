//! The exact key-level difference produced by one batch of updates, and a write order for the
//! datapath that never opens a transient allow.

use serde::Serialize;

use crate::state::{Key, StateEntry};
use crate::types::Verdict;

/// Keys added, changed and removed by one [`crate::MapState::apply`] (or between two states).
/// A key appears in at most one of the lists.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChangeSet {
    /// `(key, new)`.
    pub added: Vec<(Key, StateEntry)>,
    /// `(key, old, new)`.
    pub changed: Vec<(Key, StateEntry, StateEntry)>,
    /// `(key, old)`.
    pub removed: Vec<(Key, StateEntry)>,
}

/// One write to a key-value datapath map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Op {
    /// Insert the key, or overwrite its value.
    Upsert(Key, StateEntry),
    /// Remove the key.
    Delete(Key),
}

impl ChangeSet {
    /// Whether no key changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }

    /// Number of keys changed (added, changed or removed).
    pub fn len(&self) -> usize {
        self.added.len() + self.changed.len() + self.removed.len()
    }

    /// The writes in an order under which every intermediate state (any prefix of the list
    /// applied) allows only what the old state or the new state allows:
    ///
    /// 1. upserts whose new verdict is deny (added, or changed to deny);
    /// 2. deletions of allow keys;
    /// 3. deletions of deny keys;
    /// 4. upserts whose new verdict is allow.
    ///
    /// Why: after (1) every new deny key is in place. During (2) the only allow keys left are old
    /// ones; a packet that finds one finds no longer old key except removed allows, so the old
    /// state allowed it too. After (2) every remaining allow key is unchanged in the new state;
    /// during (3) and (4) a packet that finds an allow key finds no longer new key except new
    /// allows not yet written (deny keys are all present), so the new state allows it. The same
    /// argument holds for the identity-then-`*` lookup, because an identity's keys are only
    /// bypassed when none of them matches.
    pub fn safe_order(&self) -> Vec<Op> {
        let mut ops = Vec::with_capacity(self.len());
        let upserts = || {
            self.added
                .iter()
                .map(|(k, e)| (k, e))
                .chain(self.changed.iter().map(|(k, _, e)| (k, e)))
        };
        for (k, e) in upserts().filter(|(_, e)| e.verdict == Verdict::Deny) {
            ops.push(Op::Upsert(*k, e.clone()));
        }
        for (k, _) in self
            .removed
            .iter()
            .filter(|(_, e)| e.verdict == Verdict::Allow)
        {
            ops.push(Op::Delete(*k));
        }
        for (k, _) in self
            .removed
            .iter()
            .filter(|(_, e)| e.verdict == Verdict::Deny)
        {
            ops.push(Op::Delete(*k));
        }
        for (k, e) in upserts().filter(|(_, e)| e.verdict == Verdict::Allow) {
            ops.push(Op::Upsert(*k, e.clone()));
        }
        ops
    }
}
