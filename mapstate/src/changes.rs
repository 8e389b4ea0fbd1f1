//! The exact key-level difference produced by one batch of updates, and a write order for the
//! datapath that never opens a transient allow.

use std::collections::BTreeMap;

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

/// A borrowed view of a [`ChangeSet`] or of a part of one (its upserts, its removals): what a
/// datapath applies in one step, without copying the keys out of the set they came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Changes<'a> {
    /// `(key, new)`.
    pub added: &'a [(Key, StateEntry)],
    /// `(key, old, new)`.
    pub changed: &'a [(Key, StateEntry, StateEntry)],
    /// `(key, old)`.
    pub removed: &'a [(Key, StateEntry)],
}

impl Changes<'_> {
    /// Whether no key changes.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }

    /// Which memory the view reads: two views with the same place hold the same changes
    /// (equal addresses and lengths of live slices are the same elements; empty parts, which
    /// may share an address, hold nothing), so work done for one can be reused for the other.
    pub fn place(&self) -> [usize; 6] {
        [
            self.added.as_ptr() as usize,
            self.added.len(),
            self.changed.as_ptr() as usize,
            self.changed.len(),
            self.removed.as_ptr() as usize,
            self.removed.len(),
        ]
    }
}

impl<'a> From<&'a ChangeSet> for Changes<'a> {
    fn from(c: &'a ChangeSet) -> Changes<'a> {
        c.view()
    }
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
    /// This change set followed by `later` (which starts from the state this one ends in), as
    /// one change set from this one's start to `later`'s end.
    pub fn then(self, later: ChangeSet) -> ChangeSet {
        if self.is_empty() {
            return later;
        }
        if later.is_empty() {
            return self;
        }
        // key -> (value before self, value after later)
        let mut net: BTreeMap<Key, (Option<StateEntry>, Option<StateEntry>)> = BTreeMap::new();
        for (k, e) in self.added {
            net.insert(k, (None, Some(e)));
        }
        for (k, o, e) in self.changed {
            net.insert(k, (Some(o), Some(e)));
        }
        for (k, o) in self.removed {
            net.insert(k, (Some(o), None));
        }
        let mut set = |k: Key, old: Option<StateEntry>, new: Option<StateEntry>| {
            net.entry(k).or_insert((old, None)).1 = new;
        };
        for (k, e) in later.added {
            set(k, None, Some(e));
        }
        for (k, o, e) in later.changed {
            set(k, Some(o), Some(e));
        }
        for (k, o) in later.removed {
            set(k, Some(o), None);
        }
        let mut out = ChangeSet::default();
        for (k, v) in net {
            match v {
                (None, Some(e)) => out.added.push((k, e)),
                (Some(o), Some(e)) if o != e => out.changed.push((k, o, e)),
                (Some(o), None) => out.removed.push((k, o)),
                _ => {}
            }
        }
        out
    }

    /// Whether no key changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }

    /// The whole set, as a view.
    pub fn view(&self) -> Changes<'_> {
        Changes {
            added: &self.added,
            changed: &self.changed,
            removed: &self.removed,
        }
    }

    /// Its added and changed keys (the upserts), as a view.
    pub fn upserts(&self) -> Changes<'_> {
        Changes {
            removed: &[],
            ..self.view()
        }
    }

    /// Its removed keys, as a view.
    pub fn removals(&self) -> Changes<'_> {
        Changes {
            removed: &self.removed,
            ..Changes::default()
        }
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
