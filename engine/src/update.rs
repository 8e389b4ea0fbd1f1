//! One shared MapState brought up to date in place ([`Engine::update_state`], step 5c of an
//! incremental update): the entries of changed policies are diffed against their new version;
//! the other entries follow the identity notifications (selectors that gained or lost
//! identities, and the egress named-port groups that follow them). The `Update`s go to
//! `MapState::apply` as one batch, whose ChangeSet is what the state's users get.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::Arc;

use ordnet_mapstate::{
    ChangeSet, EntryId, IdSet, Identity, L4Match, PolicyEntry, Selector, Update, Verdict,
};

use crate::build::Engine;
use crate::identity::Signature;
use crate::incremental::diff_states;
use crate::model::PolicyRef;
use crate::selector_cache::Notifications;
use crate::shared::{EntryKey, NamedGroup, PolicyIndex, ShareKey};

/// What one state's update collects before it is applied.
#[derive(Default)]
pub(crate) struct StateUpdate {
    updates: Vec<Update>,
    add_keys: Vec<(EntryId, EntryKey)>,
    remove_keys: Vec<EntryId>,
    new_indexes: Vec<(PolicyRef, Option<PolicyIndex>)>,
    /// AddIdentity selections: id -> entries.
    selections: BTreeMap<Identity, Vec<EntryId>>,
    removes: BTreeSet<Identity>,
    policy_changed: bool,
}

/// What the notifications say about one named-port group's selector.
struct NamedChanges<'a> {
    gained: Option<&'a BTreeSet<Identity>>,
    /// Identities that are gone.
    lost: Option<&'a BTreeSet<Identity>>,
    /// Relabelled identities the selector no longer selects.
    deselected: Option<&'a BTreeSet<Identity>>,
}

fn same_policy(origin: &ordnet_mapstate::Origin, id: &PolicyRef) -> bool {
    origin.kind == id.kind.as_str() && origin.namespace == id.namespace && origin.name == id.name
}

/// The updates that turn entry `id` (as the state has it: `have`) into `want`.
fn diff_entry(
    have: Option<&PolicyEntry>,
    id: EntryId,
    want: PolicyEntry,
    updates: &mut Vec<Update>,
) {
    match (have.map(|e| &e.selector), &want.selector) {
        (Some(Selector::Ids(h)), Selector::Ids(w)) => {
            let add: Vec<Identity> = w.difference(h).collect();
            let del: Vec<Identity> = h.difference(w).collect();
            if !add.is_empty() {
                updates.push(Update::Select {
                    entry: id,
                    ids: add,
                });
            }
            if !del.is_empty() {
                updates.push(Update::Deselect {
                    entry: id,
                    ids: del,
                });
            }
        }
        (Some(Selector::Any), Selector::Any) => {}
        _ => {
            updates.push(Update::RemoveEntry(id));
            updates.push(Update::AddEntry(want));
        }
    }
}

/// One state's update, ready to be applied: the batch for `MapState::apply` and what is
/// recorded after it (the update of [`Engine::prepare_update`], finished by
/// [`Engine::finish_update`]; the batch may be applied on another thread in between).
pub(crate) struct PreparedUpdate {
    pub batch: Vec<Update>,
    add_keys: Vec<(EntryId, EntryKey)>,
    remove_keys: Vec<EntryId>,
    new_indexes: Vec<(PolicyRef, Option<PolicyIndex>)>,
    isolation: Option<(bool, Vec<Arc<ordnet_mapstate::Origin>>)>,
}

impl Engine {
    /// What brings one shared state up to date: the entries of changed policies (`full`) are
    /// diffed against their new version; the other entries follow the identity notifications.
    /// `None` if the state does not exist.
    pub(crate) fn prepare_update(
        &mut self,
        key: &Arc<ShareKey>,
        full: &BTreeSet<PolicyRef>,
        ids: (&BTreeSet<Identity>, &BTreeMap<Identity, Signature>),
        notes: &Notifications,
    ) -> Option<PreparedUpdate> {
        let (added_ids, removed_ids) = ids;
        if !self.shared.contains_key(key) {
            return None;
        }
        let mut acc = StateUpdate::default();
        self.follow_notifications(key, full, notes, removed_ids, &mut acc);
        self.diff_changed_policies(key, full, &mut acc);
        for (id, selected_by) in acc.selections {
            if added_ids.contains(&id) {
                acc.updates.push(Update::AddIdentity { id, selected_by });
            } else {
                for entry in selected_by {
                    acc.updates.push(Update::Select {
                        entry,
                        ids: vec![id],
                    });
                }
            }
        }
        // Removals go first so that emptied named entries can be removed after them.
        let mut batch: Vec<Update> = acc
            .removes
            .into_iter()
            .map(Update::RemoveIdentity)
            .collect();
        batch.extend(acc.updates);
        Some(PreparedUpdate {
            batch,
            add_keys: acc.add_keys,
            remove_keys: acc.remove_keys,
            new_indexes: acc.new_indexes,
            isolation: acc.policy_changed.then(|| self.isolation(key)),
        })
    }

    /// Records an update whose batch the state's MapState has been given (`applied`: the
    /// batch's result; the MapState is back in the state): the new entry keys, indexes and
    /// isolation. Returns the state's ChangeSet and its isolation if that changed.
    pub(crate) fn finish_update(
        &mut self,
        key: &Arc<ShareKey>,
        prepared: PreparedUpdate,
        applied: Result<ChangeSet, ordnet_mapstate::UpdateError>,
    ) -> (ChangeSet, Option<bool>) {
        let mut cs = match applied {
            Ok(cs) => cs,
            Err(e) => {
                // Cannot happen (entry ids are tracked exactly); fall back to a rebuild.
                debug_assert!(false, "incremental MapState update rejected: {e}");
                let users = self.shared[key].users.clone();
                let mut fresh = self.compile(key);
                fresh.users = users;
                let cs = diff_states(
                    self.shared[key].policy.mapstate.keys_sorted(),
                    fresh.policy.mapstate.keys_sorted(),
                );
                self.shared.insert(key.clone(), fresh);
                let s = &self.shared[key];
                return (cs, Some(s.policy.isolated));
            }
        };
        let s = self.shared.get_mut(key).expect("prepared state exists");
        for id in prepared.remove_keys {
            s.entries.remove(&id);
        }
        for (id, ek) in prepared.add_keys {
            s.entries.insert(id, ek);
        }
        for (pref, index) in prepared.new_indexes {
            match index {
                Some(index) => s.notify.insert(pref, index),
                None => s.notify.remove(&pref),
            };
        }
        let mut iso = None;
        if let Some((isolated, isolated_by)) = prepared.isolation {
            if s.policy.isolated != isolated {
                iso = Some(isolated);
            }
            s.policy.isolated = isolated;
            s.policy.isolated_by = isolated_by;
            // Keys change with the default when the state has Baseline entries or Admin Passes.
            let more = s.policy.mapstate.set_default(if isolated {
                Verdict::Deny
            } else {
                Verdict::Allow
            });
            cs = cs.then(more);
        }
        (cs, iso)
    }

    /// The entries of unchanged policies follow the selectors that gained or lost identities.
    fn follow_notifications(
        &mut self,
        key: &Arc<ShareKey>,
        full: &BTreeSet<PolicyRef>,
        notes: &Notifications,
        removed_ids: &BTreeMap<Identity, Signature>,
        acc: &mut StateUpdate,
    ) {
        let (gained, lost, deselected) = (&notes.gained, &notes.lost, &notes.deselected);
        // The indexes of unchanged policies (cloned: the named groups need &mut self below).
        let mut named: Vec<NamedGroup> = Vec::new();
        let Some(shared) = self.shared.get(key) else {
            return;
        };
        for (pref, index) in &shared.notify {
            if full.contains(pref) {
                continue;
            }
            for (sel, id) in &index.plain {
                if !notes.touches(*sel) {
                    continue;
                }
                if let Some(g) = gained.get(sel) {
                    for i in g {
                        let v = acc.selections.entry(*i).or_default();
                        if !v.contains(id) {
                            v.push(*id);
                        }
                    }
                }
                if let Some(l) = lost.get(sel) {
                    acc.removes.extend(l.iter().copied());
                }
                if let Some(d) = deselected.get(sel) {
                    acc.updates.push(Update::Deselect {
                        entry: *id,
                        ids: d.iter().copied().collect(),
                    });
                }
            }
            for g in &index.named {
                if notes.touches(g.sel) {
                    named.push(g.clone());
                }
            }
        }
        for g in &named {
            if let Some(l) = lost.get(&g.sel) {
                acc.removes.extend(l.iter().copied());
            }
            let changes = NamedChanges {
                gained: gained.get(&g.sel),
                lost: lost.get(&g.sel),
                deselected: deselected.get(&g.sel),
            };
            self.named_notifications(key, g, changes, removed_ids, acc);
        }
    }

    /// Changed policies: full diff of their entries (no entries if the policy is gone or not
    /// in the key).
    fn diff_changed_policies(
        &mut self,
        key: &Arc<ShareKey>,
        full: &BTreeSet<PolicyRef>,
        acc: &mut StateUpdate,
    ) {
        for pref in full {
            let policy = self
                .store
                .policies
                .get(pref)
                .filter(|_| key.policies.binary_search(pref).is_ok())
                .cloned();
            acc.policy_changed = true;
            let mut desired = BTreeMap::new();
            match policy {
                Some(policy) => {
                    let mut index = PolicyIndex::default();
                    self.policy_entries(&policy, key, &mut desired, &mut index);
                    acc.new_indexes.push((pref.clone(), Some(index)));
                }
                None => acc.new_indexes.push((pref.clone(), None)),
            }
            let s = &self.shared[key];
            let current: Vec<EntryId> = s
                .entries
                .iter()
                .filter(|(_, ek)| same_policy(&ek.origin, pref))
                .map(|(id, _)| *id)
                .collect();
            for id in current {
                match desired.remove(&id) {
                    None => {
                        acc.updates.push(Update::RemoveEntry(id));
                        acc.remove_keys.push(id);
                    }
                    Some((_, want)) => diff_entry(
                        s.policy.mapstate.policy_entry(id),
                        id,
                        want,
                        &mut acc.updates,
                    ),
                }
            }
            for (id, (ek, e)) in desired {
                acc.updates.push(Update::AddEntry(e));
                acc.add_keys.push((id, ek));
            }
        }
    }

    /// Updates for one egress named-port group (rule, peer, name) after identity
    /// notifications: new identities join the entry of their port number (created if it does
    /// not exist), relabelled ones the selector lost leave theirs; entries whose last identity
    /// went are removed.
    fn named_notifications(
        &mut self,
        key: &Arc<ShareKey>,
        group: &NamedGroup,
        changes: NamedChanges<'_>,
        removed_ids: &BTreeMap<Identity, Signature>,
        acc: &mut StateUpdate,
    ) {
        let NamedChanges {
            gained,
            lost,
            deselected,
        } = changes;
        let NamedGroup {
            origin,
            order,
            action,
            spec,
            name,
            proto,
            ..
        } = group;
        let (order, action, proto, name) = (*order, *action, *proto, name.as_str());
        let ek = |n: u16| EntryKey {
            origin: origin.clone(),
            peer: Some(spec.clone()),
            l4: L4Match::port(proto, n),
            named: Some(name.to_string()),
        };
        // Losses per number.
        let mut lost_by: BTreeMap<u16, BTreeSet<Identity>> = BTreeMap::new();
        for id in lost.into_iter().flatten() {
            if let Some(Signature::Pod(sig)) = removed_ids.get(id) {
                for n in sig.resolve(name, proto) {
                    lost_by.entry(*n).or_default().insert(*id);
                }
            }
        }
        // A relabelled identity resolves its named ports as before (`Identities::relabel`).
        let deselected_by =
            self.group_by_port(deselected.into_iter().flatten().copied(), name, proto);
        for (n, ids) in &deselected_by {
            lost_by.entry(*n).or_default().extend(ids);
        }
        let gained_by = self.group_by_port(gained.into_iter().flatten().copied(), name, proto);
        let numbers: BTreeSet<u16> = lost_by.keys().chain(gained_by.keys()).copied().collect();
        for n in numbers {
            let k = ek(n);
            let existing = self
                .shared
                .existing_entry_id(&k)
                .filter(|id| self.shared[key].policy.mapstate.policy_entry(*id).is_some());
            let g = gained_by.get(&n);
            let l = lost_by.get(&n);
            match existing {
                Some(id) => {
                    // The entry's identities are borrowed, not copied: it selects up to every
                    // pod identity, and this runs for each group of every notified state.
                    let empty = IdSet::new();
                    let have: &IdSet = match self.shared[key]
                        .policy
                        .mapstate
                        .policy_entry(id)
                        .map(|e| &e.selector)
                    {
                        Some(Selector::Ids(s)) => s,
                        _ => &empty,
                    };
                    // Empty after the update iff nothing is gained and every identity is lost.
                    let emptied = g.is_none_or(|g| g.is_empty())
                        && have.iter().all(|i| l.is_some_and(|l| l.contains(&i)));
                    if emptied {
                        // Removed after the RemoveIdentity updates of the batch.
                        acc.updates.push(Update::RemoveEntry(id));
                        acc.remove_keys.push(id);
                    } else {
                        if let Some(d) = deselected_by.get(&n) {
                            let ids: Vec<Identity> =
                                d.iter().copied().filter(|i| have.contains(*i)).collect();
                            if !ids.is_empty() {
                                acc.updates.push(Update::Deselect { entry: id, ids });
                            }
                        }
                        for i in g.into_iter().flatten() {
                            if !have.contains(*i) {
                                let v = acc.selections.entry(*i).or_default();
                                if !v.contains(&id) {
                                    v.push(id);
                                }
                            }
                        }
                    }
                }
                None => {
                    let Some(g) = g.filter(|g| !g.is_empty()) else {
                        continue;
                    };
                    let id = self.shared.entry_id(&k);
                    acc.updates.push(Update::AddEntry(PolicyEntry {
                        id,
                        order,
                        action,
                        selector: Selector::Ids(g.iter().copied().collect()),
                        l4: k.l4,
                        origin: origin.clone(),
                    }));
                    acc.add_keys.push((id, k));
                }
            }
        }
    }
}
