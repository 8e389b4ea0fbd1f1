//! Rebuilding the classes from class-level tables ([`Classes::adopt`]): after an agent restart
//! the kernel maps hold class keys and classed records, and after a class-level batch failed
//! part-way they hold what was applied of it. Either way the tables are the truth: the
//! identity-level tables they stand for are derived from them (each identity with an address
//! has the keys of its classes), and the classes are rebuilt to match, with the writes that
//! repair what a batch left half done.

use std::{
    collections::{BTreeMap, BTreeSet, hash_map::Entry},
    time::{Duration, Instant},
};

use ordnet_datapath_common::layout::{IP_FLAG_CLASSES, IpInfo, PolicyValue};
use ordnet_mapstate::FastMap;

use super::keys::Entry as KeyEntry;
use super::{
    Addr, Change, Class, ClassWrite, Classes, IdChanges, IdentityKeys, KeyAt, SPACES, key_hash,
};
use crate::tables::{MemTables, Write};

/// Each identity's classes (what its records say).
type Peers = BTreeMap<u32, [u32; SPACES]>;

/// What [`Classes::adopt`] rebuilt.
#[derive(Debug)]
pub struct Adopted {
    /// The classes, as the tables hold them (after `repairs`).
    pub classes: Classes,
    /// The identity-level tables the class-level ones stand for: records without classes,
    /// the cell words, blocks, wildcard keys and state as they are, and every identity with an
    /// address given the keys of its classes. (Identities without an address have no keys
    /// in the tables: the control plane's next programming writes them again.)
    pub identity: MemTables,
    /// Writes that bring the class-level tables in line with the rebuilt classes (none when
    /// the tables were written by complete batches): classes with equal keys merged, members
    /// that disagree with their class moved, records of one identity made to agree.
    pub repairs: Vec<ClassWrite>,
}

/// A record as the control plane writes it: without classes.
fn plain(info: &IpInfo) -> IpInfo {
    IpInfo {
        flags: info.flags & !IP_FLAG_CLASSES,
        classes: [0; 2],
        ..*info
    }
}

impl Classes {
    /// Whether tables hold class-level records ([`IP_FLAG_CLASSES`]).
    pub fn classed(t: &MemTables) -> bool {
        t.ipcache
            .values()
            .chain(t.cidr.values())
            .any(|i| i.flags & IP_FLAG_CLASSES != 0)
    }

    /// Rebuilds the classes of class-level tables `t` (which must keep their policy keys).
    pub fn adopt(t: &MemTables, grace: Duration) -> Adopted {
        Self::adopt_with(t, grace, None)
    }

    /// [`Classes::adopt`] with the identity-level keys known (`keys`: every identity's, those
    /// without an address and those of rule sets no record uses yet included), as after a
    /// batch the maps refused: the classes are rebuilt from what the maps hold and repaired
    /// to stand for these keys.
    pub(crate) fn adopt_with(
        t: &MemTables,
        grace: Duration,
        keys: Option<IdentityKeys>,
    ) -> Adopted {
        assert!(!t.keys_in_store, "class-level tables keep their keys");
        let mut c = Classes::new(grace);
        let (peer, stray) = c.adopt_records(t);
        c.adopt_classes(t, &peer);
        // Each identity has the keys of its classes (a rule set of both spaces: the ingress
        // class's), unless they are known.
        match keys {
            Some(keys) => c.keys = keys,
            None => {
                let spaces = &c.spaces;
                let entries = peer.iter().flat_map(|(&id, p)| {
                    p.iter().enumerate().flat_map(move |(d, class)| {
                        let keys = spaces[d].classes.get(class).map(|cl| &cl.keys);
                        keys.into_iter()
                            .flatten()
                            .map(move |(&(slot, prefix), &v)| (slot, ((id, prefix), v)))
                    })
                });
                c.keys = IdentityKeys::from_entries(entries);
            }
        }
        let mut repairs = Vec::new();
        c.repair(&peer, &mut repairs);
        for addr in stray {
            let info = c.records[&addr];
            let (write, id) = (super::record_write(addr, info), info.identity);
            repairs.push(ClassWrite::Record {
                write,
                classes: c.classes_of(id),
            });
        }
        let identity = c.identity_tables(t);
        Adopted {
            classes: c,
            identity,
            repairs,
        }
    }

    /// The records of `t` (without their classes), and each identity's classes (its first
    /// address's), with the addresses whose record says other classes.
    fn adopt_records(&mut self, t: &MemTables) -> (Peers, Vec<Addr>) {
        let c = self;
        let mut peer: Peers = BTreeMap::new();
        let mut stray = Vec::new();
        let records =
            t.ipcache
                .iter()
                .map(|(k, i)| (Addr::Exact(*k), Write::IpUpsert(*k, plain(i)), i))
                .chain(t.cidr.iter().map(|((k, l), i)| {
                    (Addr::Cidr(*k, *l), Write::CidrUpsert(*k, *l, plain(i)), i)
                }));
        for (addr, write, info) in records {
            let id = info.identity;
            c.records.insert(addr, super::record_info(&write));
            c.count_refs(Some(&write), true);
            if id == 0 {
                continue;
            }
            super::add_address(c.addrs.entry(id).or_default(), addr);
            let classes = if info.flags & IP_FLAG_CLASSES != 0 {
                info.classes
            } else {
                [0; SPACES]
            };
            match peer.entry(id) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(classes);
                }
                std::collections::btree_map::Entry::Occupied(o) => {
                    if *o.get() != classes {
                        stray.push(addr);
                    }
                }
            }
        }
        (peer, stray)
    }

    /// The classes of `t`'s keys: each in the space its first identity (of `peer`) uses it in
    /// (ids are distinct across spaces); keys no record's class names belong to retired
    /// classes. Then the spaces' rule sets.
    fn adopt_classes(&mut self, t: &MemTables, peer: &Peers) {
        let c = self;
        let mut keys_of: FastMap<u32, BTreeMap<KeyAt, PolicyValue>> = FastMap::default();
        for (k, v) in t.policy.iter().filter(|(k, _)| k.identity != 0) {
            keys_of
                .entry(k.identity)
                .or_default()
                .insert((k.ruleset, k.prefix), *v);
        }
        let mut space_of: FastMap<u32, usize> = FastMap::default();
        for (&id, p) in peer {
            for (d, &class) in p.iter().enumerate() {
                if class == 0 || *space_of.entry(class).or_insert(d) != d {
                    continue;
                }
                let space = &mut c.spaces[d];
                if let Entry::Vacant(v) = space.classes.entry(class) {
                    let keys = keys_of.remove(&class).unwrap_or_default();
                    let hash = keys
                        .iter()
                        .fold(0u64, |h, (&at, &v)| h.wrapping_add(key_hash(at, v)));
                    v.insert(Class {
                        members: BTreeSet::new(),
                        keys,
                        hash,
                        filed: hash,
                    });
                    space.file(class);
                }
                space.of.insert(id, class);
                space
                    .classes
                    .get_mut(&class)
                    .expect("just made")
                    .members
                    .insert(id);
            }
        }
        let now = Instant::now();
        let mut used: BTreeSet<u32> = space_of.keys().copied().collect();
        for (class, keys) in keys_of {
            used.insert(class);
            c.retired
                .push_back((class, keys.into_keys().collect(), now));
        }
        c.next = used.last().map_or(1, |m| m + 1);
        c.free = (1..c.next).rev().filter(|i| !used.contains(i)).collect();
        // The spaces: the rule sets records use in them, and those their classes have keys in
        // (no record uses those: they leave after the grace period).
        for d in 0..SPACES {
            let mut slots: BTreeSet<u32> = c.refs[d].keys().copied().collect();
            let keyed: BTreeSet<u32> = c.spaces[d]
                .classes
                .values()
                .flat_map(|cl| cl.keys.keys().map(|&(slot, _)| slot))
                .collect();
            for &slot in keyed.difference(&slots) {
                c.leaving.push_back((d, slot, now));
            }
            slots.extend(keyed);
            c.spaces[d].slots = slots.into_iter().collect();
        }
    }

    /// Brings every class in line with its members' keys (a class without members retired,
    /// a member whose keys differ from its class's moved), then merges classes with equal keys.
    fn repair(&mut self, peer: &Peers, out: &mut Vec<ClassWrite>) {
        let all = self.keys.by_identity();
        for d in 0..SPACES {
            let empty: Vec<u32> = self.spaces[d]
                .classes
                .iter()
                .filter(|(_, cl)| cl.members.is_empty())
                .map(|(&k, _)| k)
                .collect();
            for class in empty {
                self.retire(d, class);
            }
            let mut changes: BTreeMap<u32, Vec<Change>> = BTreeMap::new();
            for &id in peer.keys() {
                let space = &self.spaces[d];
                let own: BTreeMap<KeyAt, PolicyValue> = all
                    .get(&id)
                    .into_iter()
                    .flatten()
                    .filter(|((slot, _), _)| space.slots.contains(slot))
                    .map(|(&at, &v)| (at, v))
                    .collect();
                let empty = BTreeMap::new();
                let now = space
                    .classes
                    .get(&space.class_of(id))
                    .map_or(&empty, |cl| &cl.keys);
                if *now == own {
                    continue;
                }
                let mut ch: Vec<Change> = now
                    .keys()
                    .filter(|at| !own.contains_key(at))
                    .map(|&at| (at, None))
                    .collect();
                ch.extend(
                    own.iter()
                        .filter(|(at, v)| now.get(at) != Some(v))
                        .map(|(&at, &v)| (at, Some(v))),
                );
                ch.sort_by_key(|&(at, _)| at);
                changes.insert(id, ch);
            }
            let changes: IdChanges = changes
                .into_iter()
                .flat_map(|(id, ch)| ch.into_iter().map(move |c| (id, c)))
                .collect();
            let mut touched: BTreeSet<u32> = self.spaces[d].classes.keys().copied().collect();
            self.change_space(d, &changes, false, &mut touched, out);
            self.settle(d, touched, out);
        }
    }

    /// The identity-level tables class-level tables `t` stand for (see [`Adopted::identity`]).
    fn identity_tables(&self, t: &MemTables) -> MemTables {
        let mut id = MemTables::new(t.cells.len() as u32, t.blocks.len() as u32);
        id.cells.clone_from(&t.cells);
        id.blocks.clone_from(&t.blocks);
        id.state = t.state;
        id.services.clone_from(&t.services);
        id.ifaces.clone_from(&t.ifaces);
        for (&addr, &info) in &self.records {
            id.apply(&super::record_write(addr, info));
        }
        for (k, v) in t.policy.iter().filter(|(k, _)| k.identity == 0) {
            id.policy.insert(*k, *v);
        }
        for (ruleset, identity, prefix, v) in self.keys.iter() {
            let k = ordnet_datapath_common::layout::PolicyKey {
                ruleset,
                identity,
                prefix,
            };
            id.policy.insert(k, v);
        }
        id
    }

    /// Takes the identity-level keys out, with the key writes of the last batch undone
    /// ([`Classes::translate`] logs what each key held before it).
    pub(crate) fn keys_before(&mut self) -> IdentityKeys {
        let mut keys = std::mem::take(&mut self.keys);
        // What each key held before the batch: its first entry in the log.
        let mut before = std::mem::take(&mut self.undo);
        super::keys::sort_first_kept(&mut before);
        keys.apply(&before, &mut Vec::new());
        keys
    }

    /// Forgets the last batch's undo log (it was written: nothing to undo).
    pub(crate) fn commit(&mut self) {
        self.undo.clear();
        // Not kept at a full programming's size between batches.
        self.undo.shrink_to(1 << 12);
    }

    /// The identity-level keys of rule set `slot` (identities with an address only after
    /// [`Classes::adopt`]; every identity otherwise).
    pub fn slot_keys(
        &self,
        slot: u32,
    ) -> Vec<(ordnet_datapath_common::layout::PolicyKey, PolicyValue)> {
        let key = |((identity, prefix), v): KeyEntry| {
            let k = ordnet_datapath_common::layout::PolicyKey {
                ruleset: slot,
                identity,
                prefix,
            };
            (k, v)
        };
        self.keys.slot(slot).map(key).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ordnet_datapath_common::layout::PolicyKey;

    fn k(ruleset: u32, identity: u32, prefix: u32) -> Write {
        Write::PolicyDelete(PolicyKey {
            ruleset,
            identity,
            prefix,
        })
    }

    fn up(w: Write, verdict: u8) -> Write {
        let Write::PolicyDelete(k) = w else {
            unreachable!()
        };
        Write::PolicyUpsert(k, PolicyValue::new(verdict))
    }

    /// A refused batch is undone in the model: each key back to what it held before the batch,
    /// also a key written in two runs of it (the first value logged is the one restored).
    #[test]
    fn keys_before_undoes_the_last_batch() {
        let mut c = Classes::new(Duration::ZERO);
        let mut out = Vec::new();
        let first = [up(k(1, 5, 0), 1), up(k(1, 6, 0), 1), up(k(2, 5, 3), 2)];
        c.translate(&first, &mut out);
        let before = c.keys.by_identity();
        // Three runs (a cell write between them), keys of three rule sets, (3, 7, 0) and
        // (1, 6, 0) written in two runs, one key upserted and deleted in one run.
        let second = [
            k(1, 5, 0),
            up(k(1, 6, 0), 2),
            up(k(3, 7, 0), 1),
            up(k(4, 8, 0), 1),
            k(4, 8, 0),
            Write::Cell(0, 0),
            up(k(3, 7, 0), 2),
            k(1, 6, 0),
            Write::Cell(0, 0),
            k(2, 5, 3),
        ];
        c.translate(&second, &mut out);
        let after = c.keys.by_identity();
        assert_ne!(after, before);
        assert_eq!(after[&7][&(3, 0)], PolicyValue::new(2));
        assert!(!after.contains_key(&8) && !after.contains_key(&6));
        assert_eq!(c.keys_before().by_identity(), before);
    }
}
