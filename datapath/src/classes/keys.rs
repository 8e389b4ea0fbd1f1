//! The identity-level keys the class translation follows ([`IdentityKeys`]), held by rule set:
//! what the translation asks of them is "which identities have keys in this rule set, and
//! which" (a rule set joining or leaving a space, the store reading a slot back) and "apply this
//! run of writes" (thousands of keys of one rule set at a time when one is installed or
//! released); "the keys of one identity" is asked once per new identity.

use std::collections::BTreeMap;

use ordnet_mapstate::FastMap;

use ordnet_datapath_common::layout::PolicyValue;

use crate::leafmap::LeafMap;

use super::{IdChanges, KeyAt};

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

/// Identity-level keys (identity ≠ 0) by rule set slot, each slot's sorted by (identity,
/// prefix): 12 bytes a key, in leaves the rule set store takes as its copy of the same keys
/// once a write of the slot has completed ([`super::Classes::identity_keys`]: the model holds
/// every identity key of the node, millions at 50,000 pods, and would otherwise double them).
#[derive(Debug, Clone, Default)]
pub(crate) struct IdentityKeys {
    slots: FastMap<u32, LeafMap<(u32, u32), PolicyValue>>,
}

impl IdentityKeys {
    /// The keys of rule set `slot`, sorted by (identity, prefix).
    pub(crate) fn slot(&self, slot: u32) -> impl Iterator<Item = Entry> + '_ {
        self.slots
            .get(&slot)
            .into_iter()
            .flat_map(|m| m.iter().map(|(k, v)| (*k, *v)))
    }

    /// Whether rule set `slot` has identity keys.
    pub(crate) fn has_slot(&self, slot: u32) -> bool {
        self.slots.contains_key(&slot)
    }

    /// The keys of rule set `slot` as the changes that upsert them (`delete`: that delete
    /// them), by identity: (identity, change), sorted by identity and key.
    pub(crate) fn slot_changes(&self, slot: u32, delete: bool) -> IdChanges {
        self.slot(slot)
            .map(|((id, prefix), v)| (id, ((slot, prefix), (!delete).then_some(v))))
            .collect()
    }

    /// Identity `id`'s keys in the rule sets `keep` accepts.
    pub(crate) fn of(&self, id: u32, keep: impl Fn(u32) -> bool) -> BTreeMap<KeyAt, PolicyValue> {
        let mut out = BTreeMap::new();
        for (&slot, keys) in self.slots.iter().filter(|(s, _)| keep(**s)) {
            for (&(_, prefix), &v) in keys.range((id, 0)..=(id, u32::MAX)) {
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
        self.slots.iter().flat_map(|(&slot, keys)| {
            keys.iter()
                .map(move |(&(id, prefix), &v)| (slot, id, prefix, v))
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
            slots.insert(slot, entries.into_iter().collect());
        }
        IdentityKeys { slots }
    }

    /// Applies `changes`, sorted by rule set and key with each key once (as
    /// [`sort_first_kept`] leaves them); pushes each key's old value onto `old`, in the order
    /// of `changes`.
    pub(crate) fn apply(&mut self, changes: &[KeyChange], old: &mut Vec<Option<PolicyValue>>) {
        // By rule set, each run merged into its leaves in one pass (`LeafMap::set_sorted`):
        // a rule set installed (tens of thousands of keys when a relabel installs one at 10k
        // pods / 5k policies) is made into leaves at once, one cleared (every key deleted, as
        // the store clears a slot it released) drops its leaves without copying them.
        for group in changes.chunk_by(|a, b| a.0 == b.0) {
            let slot = group[0].0;
            let keys = self.slots.entry(slot).or_default();
            let changes: Vec<((u32, u32), Option<PolicyValue>)> =
                group.iter().map(|&(_, c)| c).collect();
            keys.set_sorted(&changes, |was| old.push(was));
            if keys.is_empty() {
                self.slots.remove(&slot);
            }
        }
    }

    /// Rule set `slot`'s keys as a map sharing their leaves (empty for a slot without keys).
    pub(crate) fn of_slot(&self, slot: u32) -> LeafMap<(u32, u32), PolicyValue> {
        self.slots.get(&slot).cloned().unwrap_or_default()
    }

    /// Gives back the room the leaves grew into beyond what they hold.
    pub(crate) fn compact(&mut self) {
        for keys in self.slots.values_mut() {
            keys.shrink_to_fit();
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

    /// Applies `changes` (sorted first, as the translation does) to `keys` and to `model`, and
    /// checks that every old value `keys` reports is the model's.
    fn apply_checked(
        keys: &mut IdentityKeys,
        mut changes: Vec<KeyChange>,
        model: &mut BTreeMap<(u32, u32), PolicyValue>,
        at: &str,
    ) {
        sort_first_kept(&mut changes);
        let mut old = Vec::new();
        keys.apply(&changes, &mut old);
        assert_eq!(old.len(), changes.len(), "{at}");
        for (&(_, (k, val)), was) in changes.iter().zip(&old) {
            let before = match val {
                Some(val) => model.insert(k, val),
                None => model.remove(&k),
            };
            assert_eq!(before, *was, "{at} key {k:?}");
        }
    }

    /// The leaves hold what a map holds (leaves split: 3,000 changes over up to 3,800 keys). A
    /// second slot is installed (its first run all upserts: leaves made at once) and grows
    /// and shrinks after.
    #[test]
    fn apply_agrees_with_a_map() {
        for n in [3usize, 40, 200, 3000] {
            let mut keys = IdentityKeys::default();
            let mut installed: BTreeMap<(u32, u32), PolicyValue> = BTreeMap::new();
            for round in 0..3u32 {
                let changes: Vec<KeyChange> = (0..n as u32)
                    .map(|i| {
                        let k = (i * 3 + round, i % 5);
                        let val = (round == 0 || i % 3 != 0).then(|| v((i % 7) as u8));
                        (4, (k, val))
                    })
                    .collect();
                apply_checked(
                    &mut keys,
                    changes,
                    &mut installed,
                    &format!("n {n} round {round}"),
                );
                let held: BTreeMap<_, _> = keys.slot(4).collect();
                assert_eq!(held, installed, "n {n} round {round}");
            }
            let mut model: BTreeMap<(u32, u32), PolicyValue> = BTreeMap::new();
            for round in 0..6u32 {
                let changes: Vec<KeyChange> = (0..n as u32)
                    .map(|i| {
                        let k = ((i * 7 + round) % 50, i % (n as u32 / 40 + 3));
                        let val = ((i + round) % 4 != 0).then(|| v((i % 5) as u8));
                        (9, (k, val))
                    })
                    .collect();
                apply_checked(
                    &mut keys,
                    changes,
                    &mut model,
                    &format!("n {n} round {round}"),
                );
                let held: BTreeMap<_, _> = keys.slot(9).collect();
                let mut ids: Vec<u32> = keys.slot_changes(9, false).iter().map(|c| c.0).collect();
                ids.dedup();
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
            }
        }
    }

    /// A run that deletes every key of a slot (a cleared rule set) takes the slot away whole,
    /// with each old value; one that deletes all but one key, or a key the slot lacks as well,
    /// leaves what remains.
    #[test]
    fn a_cleared_slot_goes_whole() {
        let n = 2000u32;
        let install = |keys: &mut IdentityKeys, model: &mut BTreeMap<(u32, u32), PolicyValue>| {
            let changes: Vec<KeyChange> = (0..n)
                .map(|i| (6, ((i / 4, i % 4), Some(v((i % 9) as u8)))))
                .collect();
            apply_checked(keys, changes, model, "install");
        };
        let delete = |skip: Option<u32>, extra: bool| -> Vec<KeyChange> {
            let mut c: Vec<KeyChange> = (0..n)
                .filter(|i| Some(*i) != skip)
                .map(|i| (6, ((i / 4, i % 4), None)))
                .collect();
            if extra {
                c.push((6, ((n, 0), None)));
            }
            c
        };
        for (skip, extra) in [(None, false), (Some(777), false), (None, true)] {
            let mut keys = IdentityKeys::default();
            let mut model = BTreeMap::new();
            install(&mut keys, &mut model);
            apply_checked(&mut keys, delete(skip, extra), &mut model, "clear");
            let held: BTreeMap<_, _> = keys.slot(6).collect();
            assert_eq!(held, model, "{skip:?} {extra}");
            assert_eq!(keys.has_slot(6), skip.is_some(), "{skip:?} {extra}");
        }
    }
}
