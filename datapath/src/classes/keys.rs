//! The identity-level keys the class translation follows ([`IdentityKeys`]), held by rule set:
//! what the translation asks of them is "which identities have keys in this rule set, and
//! which" (a rule set joining or leaving a space, the store reading a slot back) and "apply this
//! run of writes" (thousands of keys of one rule set at a time when one is installed or
//! released); "the keys of one identity" is asked once per new identity.

use std::collections::BTreeMap;

use ordnet_mapstate::FastMap;

use ordnet_datapath_common::layout::PolicyValue;

use super::{Change, KeyAt};

/// One key of a rule set: (identity, prefix), and its value.
pub(crate) type Entry = ((u32, u32), PolicyValue);

/// A change of one key: (rule set slot, ((identity, prefix), `Some` upserts / `None` deletes)).
pub(crate) type KeyChange = (u32, ((u32, u32), Option<PolicyValue>));

/// Sorts `changes` by rule set and key and keeps the first change of each key (stable: the
/// first in the given order).
pub(crate) fn sort_first_kept(changes: &mut Vec<KeyChange>) {
    changes.sort_by_key(|&(slot, (k, _))| (slot, k));
    changes.dedup_by_key(|&mut (slot, (k, _))| (slot, k));
}

/// Entries per leaf at most: a change moves at most this many entries (a rule set holds up to
/// tens of thousands: one sorted vector per rule set made a namespace relabel, whose runs
/// change a few keys in each of hundreds of rule sets, 30-50 % slower than one vector per
/// identity; merging the changes into it in one pass did not help).
const LEAF: usize = 512;

/// One rule set's keys: sorted leaves of at most [`LEAF`] entries, none empty.
#[derive(Debug, Clone, Default)]
struct Leaves(Vec<Vec<Entry>>);

impl Leaves {
    /// The leaf key `k` is in or belongs in (the last one past the end), and where in it.
    fn locate(&self, k: (u32, u32)) -> (usize, Result<usize, usize>) {
        let li = self
            .0
            .partition_point(|l| l.last().expect("no empty leaf").0 < k)
            .min(self.0.len().saturating_sub(1));
        let at = self
            .0
            .get(li)
            .map_or(Err(0), |l| l.binary_search_by_key(&k, |e| e.0));
        (li, at)
    }

    fn set(&mut self, k: (u32, u32), v: Option<PolicyValue>) -> Option<PolicyValue> {
        match (self.locate(k), v) {
            ((li, Ok(i)), Some(v)) => Some(std::mem::replace(&mut self.0[li][i].1, v)),
            ((li, Ok(i)), None) => {
                let was = self.0[li].remove(i).1;
                if self.0[li].is_empty() {
                    self.0.remove(li);
                }
                Some(was)
            }
            ((li, Err(i)), Some(v)) => {
                self.insert(li, i, (k, v));
                None
            }
            ((_, Err(_)), None) => None,
        }
    }

    fn insert(&mut self, li: usize, i: usize, e: Entry) {
        let last = li + 1 == self.0.len();
        let Some(leaf) = self.0.get_mut(li) else {
            self.0.push(vec![e]);
            return;
        };
        if leaf.len() < LEAF {
            leaf.insert(i, e);
        } else if last && i == leaf.len() {
            // Appending (a rule set installed in key order): full leaves stay full.
            self.0.push(vec![e]);
        } else {
            let mut right = leaf.split_off(LEAF / 2);
            leaf.shrink_to_fit();
            match i.checked_sub(LEAF / 2) {
                Some(j) => right.insert(j, e),
                None => leaf.insert(i, e),
            }
            self.0.insert(li + 1, right);
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.0.iter().flatten()
    }

    /// The entries from key `k` on.
    fn from(&self, k: (u32, u32)) -> impl Iterator<Item = &Entry> {
        let (li, at) = self.locate(k);
        let i = at.unwrap_or_else(|i| i);
        self.0
            .get(li..)
            .unwrap_or_default()
            .iter()
            .enumerate()
            .flat_map(move |(n, l)| &l[if n == 0 { i } else { 0 }..])
    }
}

/// Identity-level keys (identity ≠ 0) by rule set slot, each slot's sorted by (identity,
/// prefix): 12 bytes a key (the model holds every identity key of the node, millions at 50,000
/// pods).
#[derive(Debug, Clone, Default)]
pub(crate) struct IdentityKeys {
    slots: FastMap<u32, Leaves>,
}

impl IdentityKeys {
    /// The keys of rule set `slot`, sorted by (identity, prefix).
    pub(crate) fn slot(&self, slot: u32) -> impl Iterator<Item = &Entry> {
        self.slots.get(&slot).into_iter().flat_map(Leaves::iter)
    }

    /// Whether rule set `slot` has identity keys.
    pub(crate) fn has_slot(&self, slot: u32) -> bool {
        self.slots.contains_key(&slot)
    }

    /// The keys of rule set `slot` by identity, as the changes that upsert them (`delete`:
    /// that delete them).
    pub(crate) fn slot_changes(&self, slot: u32, delete: bool) -> BTreeMap<u32, Vec<Change>> {
        let mut out: BTreeMap<u32, Vec<Change>> = BTreeMap::new();
        let mut run: Option<(u32, Vec<Change>)> = None;
        for &((id, prefix), v) in self.slot(slot) {
            let change = ((slot, prefix), (!delete).then_some(v));
            match &mut run {
                Some((at, changes)) if *at == id => changes.push(change),
                _ => {
                    out.extend(run.replace((id, vec![change])));
                }
            }
        }
        out.extend(run);
        out
    }

    /// Identity `id`'s keys in the rule sets `keep` accepts.
    pub(crate) fn of(&self, id: u32, keep: impl Fn(u32) -> bool) -> BTreeMap<KeyAt, PolicyValue> {
        let mut out = BTreeMap::new();
        for (&slot, leaves) in self.slots.iter().filter(|(s, _)| keep(**s)) {
            for &((_, prefix), v) in leaves.from((id, 0)).take_while(|((i, _), _)| *i == id) {
                out.insert((slot, prefix), v);
            }
        }
        out
    }

    /// Every identity's keys (one pass over all of them: for rebuilds and checks).
    pub(crate) fn by_identity(&self) -> FastMap<u32, BTreeMap<KeyAt, PolicyValue>> {
        let mut out: FastMap<u32, BTreeMap<KeyAt, PolicyValue>> = FastMap::default();
        for (slot, id, prefix, v) in self.iter() {
            out.entry(id).or_default().insert((slot, prefix), v);
        }
        out
    }

    /// Every key: (slot, identity, prefix, value).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32, u32, PolicyValue)> + '_ {
        self.slots.iter().flat_map(|(&slot, leaves)| {
            leaves
                .iter()
                .map(move |&((id, prefix), v)| (slot, id, prefix, v))
        })
    }

    /// Builds the keys from entries in any order; of two entries of one key the first is kept.
    pub(crate) fn from_entries(entries: impl IntoIterator<Item = (u32, Entry)>) -> IdentityKeys {
        let mut sorted: FastMap<u32, Vec<Entry>> = FastMap::default();
        for (slot, e) in entries {
            sorted.entry(slot).or_default().push(e);
        }
        let mut slots = FastMap::default();
        for (slot, mut entries) in sorted {
            entries.sort_by_key(|e| e.0);
            entries.dedup_by_key(|e| e.0);
            let leaves = entries.chunks(LEAF).map(<[Entry]>::to_vec).collect();
            slots.insert(slot, Leaves(leaves));
        }
        IdentityKeys { slots }
    }

    /// Applies `changes` in order (fastest grouped by rule set); pushes each key's old value
    /// onto `old`, in the order of `changes`.
    pub(crate) fn apply(&mut self, changes: &[KeyChange], old: &mut Vec<Option<PolicyValue>>) {
        for group in changes.chunk_by(|a, b| a.0 == b.0) {
            let slot = group[0].0;
            let leaves = self.slots.entry(slot).or_default();
            for &(_, (k, v)) in group {
                old.push(leaves.set(k, v));
            }
            if leaves.0.is_empty() {
                self.slots.remove(&slot);
            }
        }
    }

    /// Gives back the room the leaves grew into beyond what they hold.
    pub(crate) fn compact(&mut self) {
        for leaves in self.slots.values_mut() {
            for leaf in &mut leaves.0 {
                leaf.shrink_to_fit();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn v(x: u8) -> PolicyValue {
        PolicyValue {
            verdict: x,
            ..PolicyValue::default()
        }
    }

    /// The leaves hold what a map holds (leaves split: 3,000 changes over up to 3,800 keys).
    #[test]
    fn apply_agrees_with_a_map() {
        for n in [3usize, 40, 200, 3000] {
            let mut keys = IdentityKeys::default();
            let mut model: BTreeMap<(u32, u32), PolicyValue> = BTreeMap::new();
            for round in 0..6u32 {
                let mut changes: Vec<KeyChange> = (0..n as u32)
                    .map(|i| {
                        let k = ((i * 7 + round) % 50, i % (n as u32 / 40 + 3));
                        let val = ((i + round) % 4 != 0).then(|| v((i % 5) as u8));
                        (9, (k, val))
                    })
                    .collect();
                sort_first_kept(&mut changes);
                let mut old = Vec::new();
                keys.apply(&changes, &mut old);
                for (&(_, (k, val)), was) in changes.iter().zip(&old) {
                    let before = match val {
                        Some(val) => model.insert(k, val),
                        None => model.remove(&k),
                    };
                    assert_eq!(before, *was, "n {n} round {round} key {k:?}");
                }
                let held: BTreeMap<_, _> = keys.slot(9).copied().collect();
                let ids: Vec<u32> = keys.slot_changes(9, false).into_keys().collect();
                let want: BTreeSet<u32> = model.keys().map(|k| k.0).collect();
                assert_eq!(ids, want.into_iter().collect::<Vec<_>>());
                for id in [0, 7, 49] {
                    let of: BTreeMap<_, _> = keys
                        .of(id, |s| s == 9)
                        .into_iter()
                        .map(|((_, p), v)| ((id, p), v))
                        .collect();
                    let want: BTreeMap<_, _> = model
                        .iter()
                        .filter(|(k, _)| k.0 == id)
                        .map(|(k, v)| (*k, *v))
                        .collect();
                    assert_eq!(of, want);
                }
                assert_eq!(held, model, "n {n} round {round}");
                assert_eq!(keys.has_slot(9), !model.is_empty());
                let flat: Vec<_> = keys.slot(9).map(|e| e.0).collect();
                assert!(flat.windows(2).all(|w| w[0] < w[1]), "sorted");
                let leaves = keys.slots.get(&9).map_or(&[][..], |l| &l.0[..]);
                assert!(leaves.iter().all(|l| !l.is_empty() && l.len() <= LEAF));
            }
        }
    }
}
