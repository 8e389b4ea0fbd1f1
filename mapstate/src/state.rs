//! The MapState of one endpoint and direction, built by ordered insertion and kept up to date by
//! region-scoped ordered recomputation. See the crate documentation for the algorithm and why it
//! is correct.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use prefix_trie::PrefixMap;
use serde::Serialize;

use crate::changes::ChangeSet;
use crate::prefix::L4Prefix;
use crate::types::{
    Direction, EntryId, Identity, L4Match, OrderKey, Origin, Peer, PolicyEntry, Selector, Verdict,
};

/// A key of the MapState (the direction is the MapState's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Key {
    pub peer: Peer,
    pub prefix: L4Prefix,
}

/// A value of the MapState: what the datapath needs (the verdict) plus what a person debugging
/// needs (order key, origins, flags).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateEntry {
    pub verdict: Verdict,
    pub order: OrderKey,
    /// The policy entries merged into this key (equal order key and verdict), sorted.
    pub entries: Vec<EntryId>,
    /// Their origins, sorted and de-duplicated.
    pub origins: Vec<Arc<Origin>>,
    /// A covering entry: a wildcard (`*`) entry copied under a specific identity because it is
    /// stronger than a broader specific entry of that identity.
    pub synthesized: bool,
}

/// Why a policy entry does not appear at one of its keys.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Covered {
    pub entry: EntryId,
    /// The key the entry would have had.
    pub key: Key,
    /// The equal-or-broader, stronger key that makes it unreachable for that peer. Its peer is
    /// `*` when a wildcard entry covers a specific one without needing a copy.
    pub covered_by: Key,
}

/// The result of a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision<'a> {
    /// A key matched; its entry decides.
    Matched { key: Key, entry: &'a StateEntry },
    /// Nothing matched: the endpoint's isolation default applies.
    Default(Verdict),
}

impl Decision<'_> {
    pub fn verdict(&self) -> Verdict {
        match self {
            Decision::Matched { entry, .. } => entry.verdict,
            Decision::Default(v) => *v,
        }
    }
}

/// Errors of [`MapState::apply`]. The state is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    DuplicateEntry(EntryId),
    UnknownEntry(EntryId),
    /// Select/Deselect on an entry whose selector is the wildcard.
    WildcardSelection(EntryId),
}

impl std::fmt::Display for UpdateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpdateError::DuplicateEntry(id) => write!(f, "policy entry {id} already present"),
            UpdateError::UnknownEntry(id) => write!(f, "unknown policy entry {id}"),
            UpdateError::WildcardSelection(id) => {
                write!(f, "policy entry {id} selects every identity already")
            }
        }
    }
}

impl std::error::Error for UpdateError {}

/// One incremental change of the input.
#[derive(Debug, Clone)]
pub enum Update {
    AddEntry(PolicyEntry),
    RemoveEntry(EntryId),
    /// The entry's selector now also selects these identities.
    Select {
        entry: EntryId,
        ids: Vec<Identity>,
    },
    /// The entry's selector no longer selects these identities.
    Deselect {
        entry: EntryId,
        ids: Vec<Identity>,
    },
    /// A new identity, selected by these entries' selectors.
    AddIdentity {
        id: Identity,
        selected_by: Vec<EntryId>,
    },
    /// An identity is gone: no selector selects it any more.
    RemoveIdentity(Identity),
}

/// One contribution of a policy entry at one (peer, block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Contrib {
    order: OrderKey,
    verdict: Verdict,
    entry: EntryId,
}

impl Contrib {
    fn rank(&self) -> (OrderKey, Verdict) {
        (self.order, self.verdict)
    }
}

type Candidates = PrefixMap<L4Prefix, Vec<Contrib>>;

/// The precedence-aware LPM MapState of one endpoint and one direction.
#[derive(Debug, Clone)]
pub struct MapState {
    direction: Direction,
    default: Verdict,
    entries: BTreeMap<EntryId, PolicyEntry>,
    /// Candidate contributions per peer and block (the input, indexed).
    cand: HashMap<Peer, Candidates>,
    /// Identities that have specific candidates at each block (with contribution counts).
    spec_index: PrefixMap<L4Prefix, BTreeMap<Identity, u32>>,
    /// The state: one trie per peer.
    tries: HashMap<Peer, PrefixMap<L4Prefix, StateEntry>>,
    /// Covered contributions per peer, at the block where they would have been.
    covered: HashMap<Peer, PrefixMap<L4Prefix, Vec<Covered>>>,
}

/// One item of an ordered insertion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Item {
    order: OrderKey,
    verdict: Verdict,
    len: u8,
    prefix: L4Prefix,
    /// `false` for a wildcard contribution, `true` for a contribution of the identity itself.
    specific: bool,
    entry: EntryId,
}

/// A key of the scratch trie of one ordered insertion.
#[derive(Debug, Clone)]
struct Scratch {
    order: OrderKey,
    verdict: Verdict,
    entries: Vec<EntryId>,
    specific: bool,
}

impl MapState {
    /// An empty MapState whose isolation default is `default`.
    pub fn new(direction: Direction, default: Verdict) -> MapState {
        MapState {
            direction,
            default,
            entries: BTreeMap::new(),
            cand: HashMap::new(),
            spec_index: PrefixMap::new(),
            tries: HashMap::new(),
            covered: HashMap::new(),
        }
    }

    /// Builds the state from scratch from a list of entries.
    pub fn build(
        direction: Direction,
        default: Verdict,
        entries: impl IntoIterator<Item = PolicyEntry>,
    ) -> Result<MapState, UpdateError> {
        let mut ms = MapState::new(direction, default);
        for e in entries {
            if ms.entries.contains_key(&e.id) {
                return Err(UpdateError::DuplicateEntry(e.id));
            }
            ms.index_entry(&e, true);
            ms.entries.insert(e.id, e);
        }
        let mut sink = ChangeSet::default();
        let peers: Vec<Peer> = ms.cand.keys().copied().collect();
        for peer in peers {
            ms.recompute(peer, L4Prefix::ANY, &mut sink);
        }
        Ok(ms)
    }

    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The verdict when no key matches.
    pub fn default_verdict(&self) -> Verdict {
        self.default
    }

    /// Changes the isolation default. No key changes; the datapath stores it per endpoint.
    pub fn set_default(&mut self, default: Verdict) -> bool {
        let changed = self.default != default;
        self.default = default;
        changed
    }

    /// The input entries, by id.
    pub fn policy_entries(&self) -> impl Iterator<Item = &PolicyEntry> {
        self.entries.values()
    }

    pub fn policy_entry(&self, id: EntryId) -> Option<&PolicyEntry> {
        self.entries.get(&id)
    }

    /// The lookup contract of the datapath: the packet's own identity first (longest matching
    /// protocol/port prefix decides); only if that identity has no matching key, the longest
    /// matching key of `*`; else the default. No priority is compared here.
    pub fn lookup(&self, id: Option<Identity>, proto: u8, port: u16) -> Decision<'_> {
        let probe = L4Prefix::packet(proto, port);
        let mut peers = [id.map(Peer::Id), Some(Peer::Any)];
        for peer in peers.iter_mut().flatten() {
            if let Some(trie) = self.tries.get(peer)
                && let Some((prefix, entry)) = trie.get_lpm(&probe)
            {
                return Decision::Matched {
                    key: Key {
                        peer: *peer,
                        prefix,
                    },
                    entry,
                };
            }
        }
        Decision::Default(self.default)
    }

    /// Every key and entry, sorted by peer (`*` first) and prefix (parents before children).
    pub fn iter(&self) -> Vec<(Key, &StateEntry)> {
        let mut out: Vec<(Key, &StateEntry)> = self
            .tries
            .iter()
            .flat_map(|(peer, t)| {
                t.iter().map(move |(prefix, e)| {
                    (
                        Key {
                            peer: *peer,
                            prefix,
                        },
                        e,
                    )
                })
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Number of keys in the state.
    pub fn len(&self) -> usize {
        self.tries.values().map(|t| t.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry at one key.
    pub fn get(&self, key: &Key) -> Option<&StateEntry> {
        self.tries.get(&key.peer)?.get(&key.prefix)
    }

    /// Every covered contribution, sorted.
    pub fn covered(&self) -> Vec<&Covered> {
        let mut out: Vec<&Covered> = self
            .covered
            .values()
            .flat_map(|t| t.values().flatten())
            .collect();
        out.sort();
        out
    }

    /// Identities that have keys of their own (all others use the `*` keys only).
    pub fn identities_with_keys(&self) -> BTreeSet<Identity> {
        self.tries
            .iter()
            .filter(|(_, t)| !t.is_empty())
            .filter_map(|(p, _)| match p {
                Peer::Id(id) => Some(*id),
                Peer::Any => None,
            })
            .collect()
    }

    /// Applies a batch of updates and returns exactly the keys that were added, changed and
    /// removed. On error nothing is changed.
    pub fn apply(
        &mut self,
        updates: impl IntoIterator<Item = Update>,
    ) -> Result<ChangeSet, UpdateError> {
        let updates: Vec<Update> = updates.into_iter().collect();
        self.check(&updates)?;
        // Dirty regions per peer.
        let mut dirty: BTreeMap<Peer, Vec<L4Prefix>> = BTreeMap::new();
        let mut changes = ChangeSet::default();
        for u in updates {
            match u {
                Update::AddEntry(e) => {
                    self.mark_entry_dirty(&e, &mut dirty, true);
                    self.index_entry(&e, true);
                    self.entries.insert(e.id, e);
                }
                Update::RemoveEntry(id) => {
                    let e = self.entries.remove(&id).expect("checked");
                    self.index_entry(&e, false);
                    self.mark_entry_dirty(&e, &mut dirty, false);
                }
                Update::Select { entry, ids } => self.select(entry, &ids, true, &mut dirty),
                Update::Deselect { entry, ids } => self.select(entry, &ids, false, &mut dirty),
                Update::AddIdentity { id, selected_by } => {
                    for entry in selected_by {
                        self.select(entry, &[id], true, &mut dirty);
                    }
                }
                Update::RemoveIdentity(id) => {
                    let selecting: Vec<EntryId> = self
                        .entries
                        .values()
                        .filter(|e| matches!(&e.selector, Selector::Ids(s) if s.contains(&id)))
                        .map(|e| e.id)
                        .collect();
                    for entry in selecting {
                        self.select(entry, &[id], false, &mut dirty);
                    }
                }
            }
        }
        for (peer, regions) in dirty {
            for region in minimal_regions(regions) {
                self.recompute(peer, region, &mut changes);
            }
        }
        Ok(changes)
    }

    /// Validates a batch without changing anything, simulating entry presence.
    fn check(&self, updates: &[Update]) -> Result<(), UpdateError> {
        let mut present: HashMap<EntryId, bool> = HashMap::new();
        let mut wildcard: HashMap<EntryId, bool> = HashMap::new();
        let exists = |id: EntryId, present: &HashMap<EntryId, bool>| {
            present
                .get(&id)
                .copied()
                .unwrap_or_else(|| self.entries.contains_key(&id))
        };
        let is_wild = |id: EntryId, wildcard: &HashMap<EntryId, bool>| {
            wildcard.get(&id).copied().unwrap_or_else(|| {
                self.entries
                    .get(&id)
                    .is_some_and(|e| e.selector == Selector::Any)
            })
        };
        for u in updates {
            match u {
                Update::AddEntry(e) => {
                    if exists(e.id, &present) {
                        return Err(UpdateError::DuplicateEntry(e.id));
                    }
                    present.insert(e.id, true);
                    wildcard.insert(e.id, e.selector == Selector::Any);
                }
                Update::RemoveEntry(id) => {
                    if !exists(*id, &present) {
                        return Err(UpdateError::UnknownEntry(*id));
                    }
                    present.insert(*id, false);
                }
                Update::Select { entry, .. } | Update::Deselect { entry, .. } => {
                    if !exists(*entry, &present) {
                        return Err(UpdateError::UnknownEntry(*entry));
                    }
                    if is_wild(*entry, &wildcard) {
                        return Err(UpdateError::WildcardSelection(*entry));
                    }
                }
                Update::AddIdentity { selected_by, .. } => {
                    for entry in selected_by {
                        if !exists(*entry, &present) {
                            return Err(UpdateError::UnknownEntry(*entry));
                        }
                        if is_wild(*entry, &wildcard) {
                            return Err(UpdateError::WildcardSelection(*entry));
                        }
                    }
                }
                Update::RemoveIdentity(_) => {}
            }
        }
        Ok(())
    }

    fn select(
        &mut self,
        entry: EntryId,
        ids: &[Identity],
        add: bool,
        dirty: &mut BTreeMap<Peer, Vec<L4Prefix>>,
    ) {
        let e = self.entries.get_mut(&entry).expect("checked");
        let Selector::Ids(set) = &mut e.selector else {
            unreachable!("checked: not a wildcard")
        };
        let mut changed = Vec::new();
        for &id in ids {
            let did = if add { set.insert(id) } else { set.remove(&id) };
            if did {
                changed.push(id);
            }
        }
        if changed.is_empty() {
            return;
        }
        let (order, verdict, blocks) = (e.order, e.verdict, e.l4.blocks());
        let c = Contrib {
            order,
            verdict,
            entry,
        };
        for id in changed {
            for b in &blocks {
                self.index_contrib(Peer::Id(id), *b, c, add);
                dirty.entry(Peer::Id(id)).or_default().push(*b);
            }
        }
    }

    /// Marks the regions an entry's addition or removal can change. Must be called while the
    /// candidate index still holds the specific contributions that make identities relevant
    /// (after indexing an addition, before un-indexing a removal does not matter for wildcard
    /// entries, whose own blocks are what is dirty).
    fn mark_entry_dirty(
        &self,
        e: &PolicyEntry,
        dirty: &mut BTreeMap<Peer, Vec<L4Prefix>>,
        _adding: bool,
    ) {
        let blocks = e.l4.blocks();
        match &e.selector {
            Selector::Ids(ids) => {
                for id in ids {
                    dirty.entry(Peer::Id(*id)).or_default().extend(&blocks);
                }
            }
            Selector::Any => {
                for b in &blocks {
                    dirty.entry(Peer::Any).or_default().push(*b);
                    for ids in self
                        .spec_index
                        .cover(b)
                        .map(|(_, v)| v)
                        .chain(self.spec_index.children(b).map(|(_, v)| v))
                    {
                        for id in ids.keys() {
                            dirty.entry(Peer::Id(*id)).or_default().push(*b);
                        }
                    }
                }
            }
        }
    }

    fn index_entry(&mut self, e: &PolicyEntry, add: bool) {
        let c = Contrib {
            order: e.order,
            verdict: e.verdict,
            entry: e.id,
        };
        let blocks = e.l4.blocks();
        match &e.selector {
            Selector::Any => {
                for b in blocks {
                    self.index_contrib(Peer::Any, b, c, add);
                }
            }
            Selector::Ids(ids) => {
                for id in ids {
                    for b in &blocks {
                        self.index_contrib(Peer::Id(*id), *b, c, add);
                    }
                }
            }
        }
    }

    fn index_contrib(&mut self, peer: Peer, block: L4Prefix, c: Contrib, add: bool) {
        let cand = self.cand.entry(peer).or_default();
        if add {
            let v = cand.entry(block).or_default();
            let pos = v.binary_search(&c).unwrap_or_else(|p| p);
            v.insert(pos, c);
        } else if let Some(v) = cand.get_mut(&block) {
            if let Ok(pos) = v.binary_search(&c) {
                v.remove(pos);
            }
            if v.is_empty() {
                cand.remove(&block);
            }
        }
        if let Peer::Id(id) = peer {
            if add {
                *self
                    .spec_index
                    .entry(block)
                    .or_default()
                    .entry(id)
                    .or_default() += 1;
            } else if let Some(m) = self.spec_index.get_mut(&block) {
                if let Some(n) = m.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        m.remove(&id);
                    }
                }
                if m.is_empty() {
                    self.spec_index.remove(&block);
                }
            }
        }
    }

    /// Recomputes the keys of `peer` inside `region` (the region and its subtree) by ordered
    /// insertion of every contribution that can influence them, and records the differences.
    fn recompute(&mut self, peer: Peer, region: L4Prefix, changes: &mut ChangeSet) {
        let items = self.region_items(peer, region);
        let (scratch, covered) = ordered_insert(&items, peer, region);

        // Derive the keys of this peer: `Some(synthesized)` when the scratch key is kept.
        let kept = |prefix: L4Prefix, s: &Scratch| -> Option<bool> {
            match peer {
                Peer::Any => Some(false),
                Peer::Id(_) if s.specific => Some(false),
                Peer::Id(_) => scratch
                    .cover(&prefix)
                    .any(|(p, a)| p != prefix && a.specific)
                    .then_some(true),
            }
        };
        let mut new: BTreeMap<L4Prefix, StateEntry> = BTreeMap::new();
        for (prefix, s) in scratch.children(&region) {
            if let Some(synthesized) = kept(prefix, s) {
                new.insert(prefix, self.state_entry(s, synthesized));
            }
        }
        // Covered notes: a contribution blocked by a key that is not kept for this peer is
        // reported against the `*` key (the wildcard entry that makes it unreachable).
        let mut notes: BTreeMap<L4Prefix, Vec<Covered>> = BTreeMap::new();
        for (item, by) in covered {
            let by_kept = scratch.get(&by).is_some_and(|s| kept(by, s).is_some());
            let by_peer = if by_kept { peer } else { Peer::Any };
            notes.entry(item.prefix).or_default().push(Covered {
                entry: item.entry,
                key: Key {
                    peer,
                    prefix: item.prefix,
                },
                covered_by: Key {
                    peer: by_peer,
                    prefix: by,
                },
            });
        }

        // Diff against the current keys of the region and write.
        let trie = self.tries.entry(peer).or_default();
        let old: Vec<(L4Prefix, StateEntry)> = trie
            .children(&region)
            .map(|(p, e)| (p, e.clone()))
            .collect();
        for (prefix, old_entry) in old {
            match new.remove(&prefix) {
                None => {
                    trie.remove(&prefix);
                    changes.removed.push((Key { peer, prefix }, old_entry));
                }
                Some(n) if n != old_entry => {
                    trie.insert(prefix, n.clone());
                    changes.changed.push((Key { peer, prefix }, old_entry, n));
                }
                Some(_) => {}
            }
        }
        for (prefix, n) in new {
            trie.insert(prefix, n.clone());
            changes.added.push((Key { peer, prefix }, n));
        }
        if trie.is_empty() {
            self.tries.remove(&peer);
        }

        let cov = self.covered.entry(peer).or_default();
        let stale: Vec<L4Prefix> = cov.children(&region).map(|(p, _)| p).collect();
        for p in stale {
            cov.remove(&p);
        }
        for (p, mut v) in notes {
            v.sort();
            cov.insert(p, v);
        }
        if cov.is_empty() {
            self.covered.remove(&peer);
        }
        if let Some(c) = self.cand.get(&peer)
            && c.is_empty()
        {
            self.cand.remove(&peer);
        }
    }

    /// Every contribution that can influence the keys of `peer` inside `region`:
    /// - for `*`: the wildcard contributions on the region's ancestor chain and in its subtree;
    /// - for an identity: its own contributions there, plus the wildcard contributions that are
    ///   comparable with one of them (ancestors of it, or descendants that are stronger than it:
    ///   weaker descendants are blocked by it in any case).
    fn region_items(&self, peer: Peer, region: L4Prefix) -> Vec<Item> {
        let mut items = Vec::new();
        let push = |items: &mut Vec<Item>, prefix: L4Prefix, cs: &[Contrib], specific: bool| {
            for c in cs {
                items.push(Item {
                    order: c.order,
                    verdict: c.verdict,
                    len: prefix.len(),
                    prefix,
                    specific,
                    entry: c.entry,
                });
            }
        };
        let empty = PrefixMap::new();
        let any = self.cand.get(&Peer::Any).unwrap_or(&empty);
        match peer {
            Peer::Any => {
                for (p, cs) in region_iter(any, &region) {
                    push(&mut items, p, cs, false);
                }
            }
            Peer::Id(_) => {
                let Some(own) = self.cand.get(&peer) else {
                    return items;
                };
                let mut wild: BTreeSet<L4Prefix> = BTreeSet::new();
                let mut any_own = false;
                for (s, cs) in region_iter(own, &region) {
                    any_own = true;
                    push(&mut items, s, cs, true);
                    let strongest = cs.first().map(|c| c.rank());
                    for (w, _) in any.cover(&s) {
                        wild.insert(w);
                    }
                    // Descendants inside the region only: keys outside are not recomputed.
                    let below = if region.covers(&s) { s } else { region };
                    for (w, wcs) in any.children(&below) {
                        if wcs.first().map(|c| c.rank()) < strongest {
                            wild.insert(w);
                        }
                    }
                }
                if any_own {
                    // The wildcard keys on the region's own ancestor chain can block keys inside
                    // it; they are comparable with every own candidate above or inside it.
                    for (w, _) in any.cover(&region) {
                        wild.insert(w);
                    }
                }
                for w in wild {
                    if let Some(cs) = any.get(&w) {
                        push(&mut items, w, cs, false);
                    }
                }
            }
        }
        items
    }

    fn state_entry(&self, s: &Scratch, synthesized: bool) -> StateEntry {
        let mut entries = s.entries.clone();
        entries.sort();
        entries.dedup();
        let mut origins: Vec<Arc<Origin>> = entries
            .iter()
            .filter_map(|id| self.entries.get(id).map(|e| e.origin.clone()))
            .collect();
        origins.sort();
        origins.dedup();
        StateEntry {
            verdict: s.verdict,
            order: s.order,
            entries,
            origins,
            synthesized,
        }
    }

    /// Builds the full per-identity materialization of one identity (every entry that selects
    /// it, wildcard or not, inserted into one trie) — the layout a datapath with one lookup and
    /// no wildcard key would need. Used to compare entry counts.
    pub fn materialized_len(&self, id: Identity) -> usize {
        let mut items = Vec::new();
        for peer in [Peer::Any, Peer::Id(id)] {
            if let Some(c) = self.cand.get(&peer) {
                for (p, cs) in c.iter() {
                    for c in cs {
                        items.push(Item {
                            order: c.order,
                            verdict: c.verdict,
                            len: p.len(),
                            prefix: p,
                            specific: peer != Peer::Any,
                            entry: c.entry,
                        });
                    }
                }
            }
        }
        ordered_insert(&items, Peer::Id(id), L4Prefix::ANY).0.len()
    }
}

/// The candidate blocks on the ancestor chain of `region` and in its subtree, each once.
fn region_iter<'a>(
    map: &'a Candidates,
    region: &L4Prefix,
) -> impl Iterator<Item = (L4Prefix, &'a Vec<Contrib>)> {
    let region = *region;
    map.cover(&region)
        .filter(move |(p, _)| *p != region)
        .chain(map.children(&region))
}

/// Ordered insertion of `items` into a scratch trie: sorted by order key, deny before allow,
/// broader before narrower; an item whose block is already covered (equal or broader key present)
/// is not inserted, except that an item of equal rank at an equal key merges into it. Returns the
/// trie and the blocked items of `peer` inside `region` with the key that blocked each.
fn ordered_insert(
    items: &[Item],
    peer: Peer,
    region: L4Prefix,
) -> (PrefixMap<L4Prefix, Scratch>, Vec<(Item, L4Prefix)>) {
    let mut items = items.to_vec();
    items.sort();
    let mut trie: PrefixMap<L4Prefix, Scratch> = PrefixMap::new();
    let mut covered = Vec::new();
    for it in items {
        if let Some(s) = trie.get_mut(&it.prefix)
            && s.order == it.order
            && s.verdict == it.verdict
        {
            s.entries.push(it.entry);
            s.specific |= it.specific;
            continue;
        }
        if let Some((by, _)) = trie.get_spm(&it.prefix) {
            let reportable = peer == Peer::Any || it.specific;
            if reportable && region.covers(&it.prefix) {
                covered.push((it, by));
            }
            continue;
        }
        trie.insert(
            it.prefix,
            Scratch {
                order: it.order,
                verdict: it.verdict,
                entries: vec![it.entry],
                specific: it.specific,
            },
        );
    }
    (trie, covered)
}

/// Drops regions contained in other regions.
fn minimal_regions(mut regions: Vec<L4Prefix>) -> Vec<L4Prefix> {
    regions.sort_by_key(|p| p.sort_key());
    regions.dedup();
    let mut chosen: PrefixMap<L4Prefix, ()> = PrefixMap::new();
    let mut out = Vec::new();
    for r in regions {
        if chosen.get_spm(&r).is_none() {
            chosen.insert(r, ());
            out.push(r);
        }
    }
    out
}

/// Convenience: the L4 match of a block, for display of what a key covers.
pub fn block_match(p: &L4Prefix) -> L4Match {
    match (
        p.protocol().and_then(crate::types::Protocol::from_number),
        p.port_range(),
    ) {
        (None, _) => L4Match::Any,
        (Some(proto), Some((first, last))) if p.port_bits() > 0 => {
            L4Match::Ports { proto, first, last }
        }
        (Some(proto), _) => L4Match::Proto(proto),
    }
}
