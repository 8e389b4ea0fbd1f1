//! Tiers and `Pass`, resolved into the order keys of entries that decide by themselves, so that
//! the lookup contract does not change (crate documentation, "Tiers and Pass").
//!
//! [`MapState`] holds the caller's entries and keeps a [`Core`] over their resolution:
//! - an ordinary entry is itself, with the step of its key set (`Accept` for an Allow of the
//!   Admin or Baseline tier, so that at an equal key Deny < Pass < Allow);
//! - a Baseline entry is left out while the default is deny (the isolation default of the ordnet
//!   tier decides before the Baseline tier); a Baseline `Pass` is an allow (it skips to the
//!   final allow);
//! - an Admin `Pass` P becomes its end entry (P's key, step `PassEnd`, the default verdict) plus
//!   one **copy** of every entry S of a weaker tier: selector `P ∩ S`, L4 match `P ∩ S`, P's key
//!   with step `Passed(S's rank)`, S's verdict and origin. Under P the copies decide before
//!   anything weaker of P's tier, in S's order; what none of them decides gets the default.
//!
//! Copies have ids from [`COPY_BASE`] up; callers' ids must stay below it. A copy's id is made
//! of its pass's and its source's ids (when they fit: pass below 2^30, source below 2^32), so a
//! state built from scratch and one updated in place name their copies alike.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::changes::ChangeSet;
use crate::state::{Core, Covered, Decision, Key, StateEntry, Update, UpdateError};
use crate::types::{
    Action, Direction, EntryId, Identity, L4Match, Origin, PolicyEntry, Selector, Step, Tier,
    Verdict, Via,
};

/// The first id of the copies a MapState makes under `Pass` entries; callers' ids are below.
pub const COPY_BASE: u64 = 1 << 63;

/// The precedence-aware LPM MapState of one endpoint and one direction.
#[derive(Debug, Clone)]
pub struct MapState {
    core: Core,
    /// Every `Pass` entry as given (its selector kept current).
    passes: BTreeMap<EntryId, PolicyEntry>,
    /// Baseline entries as given, left out while the default is deny.
    dormant: BTreeMap<EntryId, PolicyEntry>,
    /// `(admin pass, source)` → copy.
    copies: BTreeMap<(EntryId, EntryId), EntryId>,
    /// `(source, admin pass)` → copy.
    by_source: BTreeMap<(EntryId, EntryId), EntryId>,
    /// The next id for a copy whose pass or source id is too large to make its id of.
    next_copy: u64,
}

/// The id of the copy of `source` under `pass`.
fn copy_id(pass: EntryId, source: EntryId, next: &mut u64) -> EntryId {
    if pass.0 < 1 << 30 && source.0 < 1 << 32 {
        return EntryId(COPY_BASE | pass.0 << 32 | source.0);
    }
    *next += 1;
    EntryId(COPY_BASE | 1 << 62 | *next)
}

fn is_admin_pass(e: &PolicyEntry) -> bool {
    e.action == Action::Pass && e.order.tier() == Tier::Admin
}

/// A copy's source: an entry of a tier weaker than Admin that the caller gave (not a copy).
fn is_source(e: &PolicyEntry) -> bool {
    e.order.tier() > Tier::Admin && e.id.0 < COPY_BASE
}

/// The step code of an entry's key in a [`Via`].
fn step_code(s: Step) -> u8 {
    match s {
        Step::Rule | Step::Passed(_) => 0,
        Step::PassEnd => 1,
        Step::Accept => 2,
    }
}

/// The entry the core holds for a caller's entry that is not an Admin Pass (see [`end_entry`]).
/// Taken by value: its selector may hold thousands of identities.
fn resolved(mut e: PolicyEntry) -> PolicyEntry {
    let step = match (e.order.tier(), e.action) {
        (Tier::Ordnet, _) | (_, Action::Deny) => Step::Rule,
        (_, Action::Pass) => Step::PassEnd,
        (_, Action::Allow) => Step::Accept,
    };
    e.order = e.order.with_step(step);
    if e.action == Action::Pass {
        e.action = Action::Allow;
    }
    e
}

/// An Admin Pass's own entry in the core: what no weaker tier decides gets `default`.
fn end_entry(p: &PolicyEntry, default: Verdict) -> PolicyEntry {
    PolicyEntry {
        order: p.order.with_step(Step::PassEnd),
        action: default.into(),
        ..p.clone()
    }
}

/// The caller's form of an entry the core holds (not a copy).
fn given(core: &PolicyEntry) -> PolicyEntry {
    let action = if core.order.step() == Step::PassEnd {
        Action::Pass
    } else {
        core.action
    };
    PolicyEntry {
        order: core.order.with_step(Step::Rule),
        action,
        ..core.clone()
    }
}

/// The traffic two L4 matches both match (`None`: nothing).
pub(crate) fn l4_both(a: L4Match, b: L4Match) -> Option<L4Match> {
    let proto = |m: L4Match| match m {
        L4Match::Any => None,
        L4Match::Proto(p) | L4Match::Ports { proto: p, .. } => Some(p),
    };
    let range = |m: L4Match| match m {
        L4Match::Ports { first, last, .. } => (first, last),
        _ => (0, u16::MAX),
    };
    match (a, b) {
        (L4Match::Any, x) | (x, L4Match::Any) => Some(x),
        _ if proto(a) != proto(b) => None,
        (L4Match::Proto(_), x) | (x, L4Match::Proto(_)) => Some(x),
        _ => {
            let ((f1, l1), (f2, l2)) = (range(a), range(b));
            let (first, last) = (f1.max(f2), l1.min(l2));
            (first <= last).then(|| L4Match::Ports {
                proto: proto(a).expect("ports have a protocol"),
                first,
                last,
            })
        }
    }
}

/// The peers two selectors both select.
fn selector_both(a: &Selector, b: &Selector) -> Selector {
    match (a, b) {
        (Selector::Any, x) | (x, Selector::Any) => x.clone(),
        (Selector::Ids(x), Selector::Ids(y)) => Selector::Ids(x.intersection(y)),
    }
}

/// The copy of `source` (as the core holds it) under the Admin Pass `pass`; `None` when they
/// share no traffic.
fn copy_entry(pass: &PolicyEntry, source: &PolicyEntry, id: EntryId) -> Option<PolicyEntry> {
    let l4 = l4_both(pass.l4, source.l4)?;
    let via = Via {
        tier: source.order.tier(),
        priority: source.order.priority,
        index: source.order.index,
        step: step_code(source.order.step()),
        verdict: source.verdict(),
    };
    Some(PolicyEntry {
        id,
        order: pass.order.with_step(Step::Passed(via)),
        action: source.action,
        selector: selector_both(&pass.selector, &source.selector),
        l4,
        origin: Arc::new(Origin {
            passed_by: Some(pass.origin.clone()),
            ..(*source.origin).clone()
        }),
    })
}

impl MapState {
    /// An empty MapState whose isolation default is `default`.
    pub fn new(direction: Direction, default: Verdict) -> MapState {
        MapState {
            core: Core::new(direction, default),
            passes: BTreeMap::new(),
            dormant: BTreeMap::new(),
            copies: BTreeMap::new(),
            by_source: BTreeMap::new(),
            next_copy: 0,
        }
    }

    /// The parts of a MapState for memory accounting, in the order of [`MapState::release`].
    pub const PARTS: [&'static str; 8] = Core::PARTS;

    /// Frees part `i` of [`MapState::PARTS`], for memory accounting (the scale benchmark's
    /// breakdown). The state answers nonsense afterwards; drop it.
    pub fn release(&mut self, i: usize) {
        self.core.release(i)
    }

    /// Builds the state from scratch from a list of entries.
    pub fn build(
        direction: Direction,
        default: Verdict,
        entries: impl IntoIterator<Item = PolicyEntry>,
    ) -> Result<MapState, UpdateError> {
        let mut ms = MapState::new(direction, default);
        let mut core_entries = Vec::new();
        let mut admin_passes = Vec::new();
        let mut seen = BTreeSet::new();
        for e in entries {
            ms.check_new(&e)?;
            if !seen.insert(e.id) {
                return Err(UpdateError::DuplicateEntry(e.id));
            }
            if e.order.tier() == Tier::Baseline && default == Verdict::Deny {
                ms.dormant.insert(e.id, e);
                continue;
            }
            if e.action == Action::Pass {
                ms.passes.insert(e.id, e.clone());
            }
            if is_admin_pass(&e) {
                core_entries.push(end_entry(&e, default));
                admin_passes.push(e);
            } else {
                core_entries.push(resolved(e));
            }
        }
        let sources: Vec<PolicyEntry> = core_entries
            .iter()
            .filter(|e| is_source(e))
            .cloned()
            .collect();
        for p in &admin_passes {
            for s in &sources {
                let id = copy_id(p.id, s.id, &mut ms.next_copy);
                if let Some(c) = copy_entry(p, s, id) {
                    ms.copies.insert((p.id, s.id), id);
                    ms.by_source.insert((s.id, p.id), id);
                    core_entries.push(c);
                }
            }
        }
        ms.core = Core::build(direction, default, core_entries)?;
        Ok(ms)
    }

    fn check_new(&self, e: &PolicyEntry) -> Result<(), UpdateError> {
        if e.id.0 >= COPY_BASE {
            return Err(UpdateError::ReservedEntryId(e.id));
        }
        if e.action == Action::Pass && e.order.tier() == Tier::Ordnet {
            return Err(UpdateError::PassInOrdnetTier(e.id));
        }
        Ok(())
    }

    /// The direction of the endpoint this MapState decides for.
    pub fn direction(&self) -> Direction {
        self.core.direction()
    }

    /// The verdict when no key matches: the isolation default.
    pub fn default_verdict(&self) -> Verdict {
        self.core.default_verdict()
    }

    /// Changes the isolation default and returns the keys that change with it: none unless the
    /// state has Baseline entries (they decide only while the default is allow) or Admin Pass
    /// entries (what their weaker tiers leave open gets the default).
    pub fn set_default(&mut self, default: Verdict) -> ChangeSet {
        let old = self.core.default_verdict();
        if old == default {
            return ChangeSet::default();
        }
        let has_baseline = !self.dormant.is_empty()
            || self
                .core
                .policy_entries()
                .any(|e| e.order.tier() == Tier::Baseline && e.id.0 < COPY_BASE);
        let admin: Vec<EntryId> = self
            .passes
            .values()
            .filter(|p| p.order.tier() == Tier::Admin)
            .map(|p| p.id)
            .collect();
        if !has_baseline && admin.is_empty() {
            self.core.set_default(default);
            return ChangeSet::default();
        }
        let mut changes = ChangeSet::default();
        if default == Verdict::Deny {
            // Baseline entries go dormant (with their copies).
            let baseline: Vec<PolicyEntry> = self
                .core
                .policy_entries()
                .filter(|e| e.order.tier() == Tier::Baseline && e.id.0 < COPY_BASE)
                .map(|e| self.given_form(e))
                .collect();
            for e in baseline {
                let cs = self.step(Update::RemoveEntry(e.id));
                changes = changes.then(cs);
                self.dormant.insert(e.id, e);
            }
        }
        self.core.set_default(default);
        for p in admin {
            let pass = self.passes[&p].clone();
            let cs = self.core_apply(vec![
                Update::RemoveEntry(p),
                Update::AddEntry(end_entry(&pass, default)),
            ]);
            changes = changes.then(cs);
        }
        if default == Verdict::Allow {
            for (_, e) in std::mem::take(&mut self.dormant) {
                let cs = self.step(Update::AddEntry(e));
                changes = changes.then(cs);
            }
        }
        changes
    }

    /// The caller's form of an entry the core holds.
    fn given_form(&self, e: &PolicyEntry) -> PolicyEntry {
        match self.passes.get(&e.id) {
            Some(p) => p.clone(),
            None => given(e),
        }
    }

    /// The entries as given (not the copies), by id.
    pub fn policy_entries(&self) -> Vec<PolicyEntry> {
        let mut out: Vec<PolicyEntry> = self
            .core
            .policy_entries()
            .filter(|e| e.id.0 < COPY_BASE)
            .map(|e| self.given_form(e))
            .chain(self.dormant.values().cloned())
            .collect();
        out.sort_by_key(|e| e.id);
        out
    }

    /// Number of entries as given.
    pub fn policy_entry_count(&self) -> usize {
        self.core
            .policy_entries()
            .filter(|e| e.id.0 < COPY_BASE)
            .count()
            + self.dormant.len()
    }

    /// One entry: as given for a Pass or a dormant Baseline entry; else as resolved (its
    /// selector is always the current one). Also finds the copies made under Pass entries.
    pub fn policy_entry(&self, id: EntryId) -> Option<&PolicyEntry> {
        self.passes
            .get(&id)
            .or_else(|| self.dormant.get(&id))
            .or_else(|| self.core.policy_entry(id))
    }

    /// For a copy made under an Admin Pass: `(the pass, the copied entry)`.
    pub fn copy_of(&self, id: EntryId) -> Option<(EntryId, EntryId)> {
        if id.0 < COPY_BASE {
            return None;
        }
        self.copies.iter().find(|(_, c)| **c == id).map(|(k, _)| *k)
    }

    /// The entries the state is computed from: every entry resolved into one that decides by
    /// itself, the copies included (what [`crate::reference::state`] defines the keys of).
    pub fn resolved_entries(&self) -> Vec<PolicyEntry> {
        self.core.policy_entries().cloned().collect()
    }

    /// The lookup contract of the datapath: the packet's own identity first (longest matching
    /// protocol/port prefix decides); only if that identity has no matching key, the longest
    /// matching key of `*`; else the default. No priority is compared here.
    pub fn lookup(&self, id: Option<Identity>, proto: u8, port: u16) -> Decision<'_> {
        self.core.lookup(id, proto, port)
    }

    /// Every key and entry, sorted by peer (`*` first) and prefix (parents before children).
    pub fn iter(&self) -> Vec<(Key, &StateEntry)> {
        self.core.iter()
    }

    /// The keys of [`MapState::iter`] in the same order, as they are read.
    pub fn keys_sorted(&self) -> impl Iterator<Item = (Key, &StateEntry)> {
        self.core.keys_sorted()
    }

    /// Number of keys (every peer).
    pub fn len(&self) -> usize {
        self.core.len()
    }

    /// Whether there is no key at all (every packet gets the default).
    pub fn is_empty(&self) -> bool {
        self.core.is_empty()
    }

    /// The entry at one key.
    pub fn get(&self, key: &Key) -> Option<&StateEntry> {
        self.core.get(key)
    }

    /// Every covered contribution, sorted.
    pub fn covered(&self) -> Vec<Covered> {
        self.core.covered()
    }

    /// Identities that have keys of their own (all others use the `*` keys only).
    pub fn identities_with_keys(&self) -> BTreeSet<Identity> {
        self.core.identities_with_keys()
    }

    /// The size of the full per-identity materialization of one identity (see
    /// `Core::materialized_len`).
    pub fn materialized_len(&self, id: Identity) -> usize {
        self.core.materialized_len(id)
    }

    /// Applies a batch of updates and returns exactly the keys that were added, changed and
    /// removed. On error nothing is changed.
    pub fn apply(
        &mut self,
        updates: impl IntoIterator<Item = Update>,
    ) -> Result<ChangeSet, UpdateError> {
        let updates: Vec<Update> = updates.into_iter().collect();
        // The common case (no Pass, nothing aside, no entry that would go aside or be a Pass):
        // every update is its own core update, which the core checks itself; checking the batch
        // here too would simulate it twice on the agent's hot path.
        let deny = self.core.default_verdict() == Verdict::Deny;
        let plain = self.passes.is_empty()
            && self.dormant.is_empty()
            && updates.iter().all(|u| match u {
                Update::AddEntry(e) => {
                    e.action != Action::Pass && !(deny && e.order.tier() == Tier::Baseline)
                }
                _ => true,
            });
        if plain {
            for u in &updates {
                if let Update::AddEntry(e) = u {
                    self.check_new(e)?;
                }
            }
            let batch: Vec<Update> = updates
                .into_iter()
                .map(|u| match u {
                    Update::AddEntry(e) => Update::AddEntry(resolved(e)),
                    u => u,
                })
                .collect();
            return self.core.apply(batch);
        }
        self.check(&updates)?;
        let admin_passes = self.copies_needed(&updates);
        if !admin_passes {
            // No copy to keep: one batch for the core.
            let mut batch = Vec::with_capacity(updates.len());
            for u in updates {
                self.translate(u, &mut batch);
            }
            return Ok(self.core_apply(batch));
        }
        // Copies read the selectors of their pass and source: one update at a time, each
        // against the current state.
        let mut changes = ChangeSet::default();
        for u in updates {
            let cs = self.step(u);
            changes = changes.then(cs);
        }
        Ok(changes)
    }

    /// Whether a batch involves Admin Pass entries (present or added).
    fn copies_needed(&self, updates: &[Update]) -> bool {
        !self.copies.is_empty()
            || self.passes.values().any(is_admin_pass)
            || updates
                .iter()
                .any(|u| matches!(u, Update::AddEntry(e) if is_admin_pass(e)))
    }

    fn core_apply(&mut self, batch: Vec<Update>) -> ChangeSet {
        match self.core.apply(batch) {
            Ok(cs) => cs,
            Err(e) => unreachable!("a checked batch resolves to a valid core batch: {e}"),
        }
    }

    /// One update, against the current state.
    fn step(&mut self, u: Update) -> ChangeSet {
        let mut batch = Vec::new();
        self.translate(u, &mut batch);
        self.core_apply(batch)
    }

    /// The selector of an entry the core holds, or of a Pass.
    fn selector(&self, id: EntryId) -> Option<&Selector> {
        self.policy_entry(id).map(|e| &e.selector)
    }

    /// The core updates of one update (applied after the previous update's). Keeps the
    /// bookkeeping of passes, dormant entries and copies.
    fn translate(&mut self, u: Update, out: &mut Vec<Update>) {
        match u {
            Update::AddEntry(e) => {
                if e.order.tier() == Tier::Baseline && self.core.default_verdict() == Verdict::Deny
                {
                    self.dormant.insert(e.id, e);
                    return;
                }
                if e.action == Action::Pass {
                    self.passes.insert(e.id, e.clone());
                }
                if is_admin_pass(&e) {
                    out.push(Update::AddEntry(end_entry(&e, self.core.default_verdict())));
                    let sources: Vec<PolicyEntry> = self
                        .core
                        .policy_entries()
                        .filter(|s| is_source(s))
                        .cloned()
                        .collect();
                    for s in sources {
                        self.add_copy(&e, &s, out);
                    }
                } else {
                    let r = resolved(e);
                    if is_source(&r) {
                        let passes: Vec<PolicyEntry> = self
                            .passes
                            .values()
                            .filter(|p| is_admin_pass(p))
                            .cloned()
                            .collect();
                        for p in passes {
                            self.add_copy(&p, &r, out);
                        }
                    }
                    out.push(Update::AddEntry(r));
                }
            }
            Update::RemoveEntry(id) => {
                if self.dormant.remove(&id).is_some() {
                    return;
                }
                self.passes.remove(&id);
                out.push(Update::RemoveEntry(id));
                let as_pass: Vec<(EntryId, EntryId)> = self
                    .copies
                    .range((id, EntryId(0))..=(id, EntryId(u64::MAX)))
                    .map(|(k, _)| *k)
                    .collect();
                let as_source: Vec<(EntryId, EntryId)> = self
                    .by_source
                    .range((id, EntryId(0))..=(id, EntryId(u64::MAX)))
                    .map(|(&(s, p), _)| (p, s))
                    .collect();
                for (p, s) in as_pass.into_iter().chain(as_source) {
                    if let Some(c) = self.copies.remove(&(p, s)) {
                        self.by_source.remove(&(s, p));
                        out.push(Update::RemoveEntry(c));
                    }
                }
            }
            Update::Select { entry, ids } => self.select(entry, ids, true, out),
            Update::Deselect { entry, ids } => self.select(entry, ids, false, out),
            Update::AddIdentity { id, selected_by } => {
                let mut core_by = Vec::with_capacity(selected_by.len());
                for e in &selected_by {
                    if let Some(d) = self.dormant.get_mut(e) {
                        if let Selector::Ids(s) = &mut d.selector {
                            s.insert(id);
                        }
                        continue;
                    }
                    if let Some(Selector::Ids(s)) = self.passes.get_mut(e).map(|p| &mut p.selector)
                    {
                        s.insert(id);
                    }
                    core_by.push(*e);
                }
                // A copy selects the identity when its pass and its source both do (one of
                // them may have selected it before: an identity the core already has).
                let selects = |e: EntryId, sel: Option<&Selector>| {
                    sel.is_some_and(|s| s.selects(id)) || selected_by.contains(&e)
                };
                for (&(p, s), &c) in &self.copies {
                    if matches!(self.selector(c), Some(Selector::Ids(_)))
                        && selects(p, self.selector(p))
                        && selects(s, self.selector(s))
                    {
                        core_by.push(c);
                    }
                }
                out.push(Update::AddIdentity {
                    id,
                    selected_by: core_by,
                });
            }
            Update::RemoveIdentity(id) => {
                for e in self.dormant.values_mut().chain(self.passes.values_mut()) {
                    if let Selector::Ids(s) = &mut e.selector {
                        s.remove(id);
                    }
                }
                out.push(Update::RemoveIdentity(id));
            }
        }
    }

    fn add_copy(&mut self, pass: &PolicyEntry, source: &PolicyEntry, out: &mut Vec<Update>) {
        let id = copy_id(pass.id, source.id, &mut self.next_copy);
        if let Some(c) = copy_entry(pass, source, id) {
            self.copies.insert((pass.id, source.id), id);
            self.by_source.insert((source.id, pass.id), id);
            out.push(Update::AddEntry(c));
        }
    }

    fn select(&mut self, entry: EntryId, ids: Vec<Identity>, add: bool, out: &mut Vec<Update>) {
        let set = |sel: &mut Selector| {
            if let Selector::Ids(s) = sel {
                for id in &ids {
                    if add {
                        s.insert(*id);
                    } else {
                        s.remove(*id);
                    }
                }
            }
        };
        if let Some(d) = self.dormant.get_mut(&entry) {
            set(&mut d.selector);
            return;
        }
        if let Some(p) = self.passes.get_mut(&entry) {
            set(&mut p.selector);
        }
        // The copies of the entry as a pass, then as a source: the identities the other side
        // selects too.
        let pairs: Vec<(EntryId, EntryId)> = self
            .copies
            .range((entry, EntryId(0))..=(entry, EntryId(u64::MAX)))
            .map(|(&(_, s), &c)| (s, c))
            .chain(
                self.by_source
                    .range((entry, EntryId(0))..=(entry, EntryId(u64::MAX)))
                    .map(|(&(_, p), &c)| (p, c)),
            )
            .collect();
        for (other, copy) in pairs {
            let these: Vec<Identity> = match self.selector(other) {
                Some(Selector::Any) => ids.clone(),
                Some(Selector::Ids(s)) => ids.iter().copied().filter(|i| s.contains(*i)).collect(),
                None => Vec::new(),
            };
            if these.is_empty() {
                continue;
            }
            out.push(if add {
                Update::Select {
                    entry: copy,
                    ids: these,
                }
            } else {
                Update::Deselect {
                    entry: copy,
                    ids: these,
                }
            });
        }
        out.push(if add {
            Update::Select { entry, ids }
        } else {
            Update::Deselect { entry, ids }
        });
    }

    /// Validates a batch without changing anything, simulating entry presence: the core's
    /// checks on the entries as given, plus the tier rules.
    fn check(&self, updates: &[Update]) -> Result<(), UpdateError> {
        let mut present: BTreeMap<EntryId, Option<bool>> = BTreeMap::new();
        // Some(wildcard) when present.
        let state = |id: EntryId, present: &BTreeMap<EntryId, Option<bool>>| match present.get(&id)
        {
            Some(s) => *s,
            None => (id.0 < COPY_BASE)
                .then(|| self.policy_entry(id))
                .flatten()
                .map(|e| e.selector == Selector::Any),
        };
        let selectable =
            |id: EntryId, present: &BTreeMap<EntryId, Option<bool>>| match state(id, present) {
                None => Err(UpdateError::UnknownEntry(id)),
                Some(true) => Err(UpdateError::WildcardSelection(id)),
                Some(false) => Ok(()),
            };
        for u in updates {
            match u {
                Update::AddEntry(e) => {
                    self.check_new(e)?;
                    if state(e.id, &present).is_some() {
                        return Err(UpdateError::DuplicateEntry(e.id));
                    }
                    present.insert(e.id, Some(e.selector == Selector::Any));
                }
                Update::RemoveEntry(id) => {
                    if state(*id, &present).is_none() {
                        return Err(UpdateError::UnknownEntry(*id));
                    }
                    present.insert(*id, None);
                }
                Update::Select { entry, .. } | Update::Deselect { entry, .. } => {
                    selectable(*entry, &present)?
                }
                Update::AddIdentity { selected_by, .. } => {
                    for entry in selected_by {
                        selectable(*entry, &present)?;
                    }
                }
                Update::RemoveIdentity(_) => {}
            }
        }
        Ok(())
    }
}
