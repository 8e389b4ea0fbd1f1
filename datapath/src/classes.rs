//! Node-local identity classes (issue 25; `docs/datapath.md` §13): identities that no rule set
//! of one *space* tells apart share one class, and the policy keys are written per class, not
//! per identity.
//!
//! [`Classes`] follows the identity-level writes of the control plane (the [`Write`]s the
//! rule set store and [`Control`](crate::Control) make, unchanged) and translates them into
//! the writes of class-level tables ([`ClassWrite`]), incrementally and in an order that never
//! lets a packet see a verdict that neither the identity-level state before a batch nor the one
//! after it gives. [`ClassTables`] holds the result; [`Classed`] is a [`TableWriter`] that
//! writes identity-level tables and keeps the class-level ones beside them. Userspace only so
//! far: nothing writes the class-level tables to the kernel yet (§13 says what that needs).
//!
//! **Spaces.** Two: the rule sets some endpoint uses for its ingress (their peer is a packet's
//! source) and those some endpoint uses for its egress (the peer is the destination). Every
//! address gets one class per space; an ingress policy is probed with the source's ingress
//! class, an egress policy with the destination's egress class. A rule set joins a space when
//! the first record that uses it in that direction is written, so its class keys are written
//! before any packet can probe them; it leaves when it has no identity key left, or when no
//! record has used it there for the grace period (its keys are then deleted from the classes).
//!
//! **Classes.** A class of a space is a set of identities that have addresses and equal keys
//! (`(rule set, prefix) → value`) in every rule set of the space. Identities with no key there
//! are in class 0, which the lookup never probes (the cell word's wildcard verdict and the
//! default decide, exactly as for an identity without keys). Identities without an address have
//! no class: no packet carries them, so their keys are kept here only.
//!
//! **Order** (one batch of identity-level writes, element by element as the kernel applies it):
//!
//! 1. *Splits, neutral.* The identities a run of policy writes changes are grouped by class and
//!    by their changes (sorted: the store writes one batch per phase of its order, within which
//!    the order is free). A class whose members all change alike is changed in place.
//!    Otherwise a group whose keys after the change are those of a class the run does not
//!    change (or none: class 0) *joins* it: its members' records are rewritten to it, so a
//!    packet that reads one sees that identity's keys as after the run — all of its writes
//!    first, which is one order of the run's writes — and one that read it before sees the old
//!    class, which the run does not change (a namespace relabel moves identities between
//!    existing classes so; copying the old class's keys and retiring the copy at once cost a
//!    thousand key writes per identity). Any other group moves to a new class: its keys are
//!    copied from the old class (no record points to the new class yet: invisible), then each
//!    member address's record is rewritten to it (one atomic write; the keys are equal, so no
//!    verdict changes). The old class keeps the members that do not change, and its keys do
//!    not change in this batch, so a packet that read a member's record just before it moved
//!    still sees the old state.
//!    Where the changed keys are in a rule set no record uses in the space (one joining or
//!    leaving it), the largest group stays, changed in place, and only the others move.
//! 2. *The change*, per class, in the order the identity-level run makes it: every class's
//!    members change alike, so every intermediate state is, for every packet, an intermediate
//!    state of the identity-level order (`docs/datapath.md` §6 holds with "class" for
//!    "identity").
//! 3. *Merges, neutral, at the end of the batch.* A class whose keys became equal to another's
//!    (or empty: class 0) moves its members' records there and is retired: its keys stay, unchanged,
//!    for a grace period (a packet that read an old record finds them) and are deleted after it,
//!    like a released rule set's slot.
//!
//! A record the control plane writes is written with the classes of its identity; a new
//! identity's class is found (equal keys) or created, with its keys written first.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    hash::{BuildHasher, BuildHasherDefault, DefaultHasher},
    time::{Duration, Instant},
};

use ordnet_datapath_common::layout::{IP_FLAG_CLASSES, IpInfo, IpKey, PolicyKey, PolicyValue};
use ordnet_mapstate::{FastMap, FastSet};
use smallvec::SmallVec;

use crate::{
    leafmap::LeafMap,
    tables::{MemTables, TableWriter, Write, WriteError},
};

mod adopt;
mod keys;

pub use adopt::Adopted;
pub(crate) use keys::IdentityKeys;
use keys::KeyChange;

/// The space of the rule sets endpoints use for their ingress (peer: the source).
pub const INGRESS: usize = 0;
/// The space of the rule sets endpoints use for their egress (peer: the destination).
pub const EGRESS: usize = 1;
/// Number of spaces (class ids per address).
pub const SPACES: usize = 2;

/// An address the ipcache holds a record for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Addr {
    /// An exact ipcache record.
    Exact(IpKey),
    /// A CIDR entry: masked address, address prefix length.
    Cidr(IpKey, u32),
}

/// One write of the class-level tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassWrite {
    /// A write that passes unchanged: cell words, blocks, state, Services, interfaces, and the
    /// wildcard keys (identity 0, kept for userspace).
    Plain(Write),
    /// A policy key of a class (`PolicyKey::identity` is the class).
    Key(Write),
    /// A record as the control plane wrote it (`IpUpsert`, `IpDelete`, `CidrUpsert`,
    /// `CidrDelete`) with its address's class in each space: one atomic write.
    Record {
        /// The record write.
        write: Write,
        /// The classes (0 for a deleted record).
        classes: [u32; SPACES],
    },
}

impl ClassWrite {
    /// The write of the class-level maps: a record with its classes (and
    /// [`IP_FLAG_CLASSES`], which makes the programs probe with them), anything else as it is.
    pub fn write(&self) -> Write {
        let classed = |info: IpInfo, classes: [u32; SPACES]| IpInfo {
            flags: info.flags | IP_FLAG_CLASSES,
            classes,
            ..info
        };
        match *self {
            ClassWrite::Plain(w) | ClassWrite::Key(w) => w,
            ClassWrite::Record { write, classes } => match write {
                Write::IpUpsert(k, info) => Write::IpUpsert(k, classed(info, classes)),
                Write::CidrUpsert(k, len, info) => {
                    Write::CidrUpsert(k, len, classed(info, classes))
                }
                w => w,
            },
        }
    }
}

/// A rule set key of one identity or class: (rule set slot, prefix).
type KeyAt = (u32, u32);
/// Identity keys added to the model after which it is compacted ([`Classes::compact`]).
const COMPACT_AFTER: usize = 1 << 16;

/// One change of a key: `Some` upserts, `None` deletes.
type Change = (KeyAt, Option<PolicyValue>);
/// Changes of several identities: (identity, change), sorted by identity and key (each
/// identity's changes one after another, with no allocation of its own).
type IdChanges = Vec<(u32, Change)>;
/// Identities of one class that change alike, with their changes.
type Group = (Vec<Change>, Vec<u32>);
/// A class to change, and how.
type Target = (u32, Vec<Change>);

#[derive(Debug, Default)]
struct Class {
    members: BTreeSet<u32>,
    keys: BTreeMap<KeyAt, PolicyValue>,
    /// Order-independent hash of `keys` (the sum of the keys' hashes).
    hash: u64,
    /// The hash `by_hash` files the class under.
    filed: u64,
}

#[derive(Debug, Default)]
struct Space {
    slots: FastSet<u32>,
    /// Identity → its class (identities in class 0 are not listed).
    of: FastMap<u32, u32>,
    classes: FastMap<u32, Class>,
    by_hash: FastMap<u64, Vec<u32>>,
}

fn key_hash(at: KeyAt, v: PolicyValue) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one((at, v.verdict, v.counter))
}

impl Space {
    fn class_of(&self, id: u32) -> u32 {
        self.of.get(&id).copied().unwrap_or(0)
    }

    fn unfile(&mut self, c: u32) {
        let filed = self.classes[&c].filed;
        if let Some(v) = self.by_hash.get_mut(&filed) {
            v.retain(|&x| x != c);
            if v.is_empty() {
                self.by_hash.remove(&filed);
            }
        }
    }

    fn file(&mut self, c: u32) {
        let class = self.classes.get_mut(&c).expect("a live class");
        class.filed = class.hash;
        self.by_hash.entry(class.hash).or_default().push(c);
    }

    /// A live class other than `c` with exactly `keys`.
    fn equal_to(&self, keys: &BTreeMap<KeyAt, PolicyValue>, hash: u64, not: u32) -> Option<u32> {
        self.by_hash
            .get(&hash)?
            .iter()
            .copied()
            .find(|&o| o != not && self.classes[&o].keys == *keys)
    }

    /// The live class, other than `c` and the `not` ones, whose keys are `c`'s (none for class
    /// 0) with `ch` applied (sorted by key, one change per key), found as [`Space::equal_to`]
    /// finds one but without building the keys: 0 when they are none and `c` is not 0.
    fn equal_after(&self, c: u32, ch: &[Change], not: &FastSet<u32>) -> Option<u32> {
        debug_assert!(ch.is_sorted_by(|a, b| a.0 < b.0));
        let empty = BTreeMap::new();
        let (base, mut hash) = match self.classes.get(&c) {
            Some(class) if c != 0 => (&class.keys, class.hash),
            _ => (&empty, 0),
        };
        let mut len = base.len();
        for &(at, v) in ch {
            if let Some(&old) = base.get(&at) {
                hash = hash.wrapping_sub(key_hash(at, old));
                len -= 1;
            }
            if let Some(v) = v {
                hash = hash.wrapping_add(key_hash(at, v));
                len += 1;
            }
        }
        if len == 0 {
            return (c != 0).then_some(0);
        }
        let equal = |keys: &BTreeMap<KeyAt, PolicyValue>| {
            keys.len() == len
                && ch.iter().all(|(at, v)| keys.get(at) == v.as_ref())
                && base.iter().all(|(at, v)| {
                    ch.binary_search_by_key(at, |c| c.0).is_ok() || keys.get(at) == Some(v)
                })
        };
        self.by_hash
            .get(&hash)?
            .iter()
            .copied()
            .find(|&o| o != c && !not.contains(&o) && equal(&self.classes[&o].keys))
    }

    fn set_key(&mut self, c: u32, at: KeyAt, v: Option<PolicyValue>) {
        let class = self.classes.get_mut(&c).expect("a live class");
        // One search of the keys either way.
        let old = match v {
            Some(v) => {
                class.hash = class.hash.wrapping_add(key_hash(at, v));
                class.keys.insert(at, v)
            }
            None => class.keys.remove(&at),
        };
        if let Some(old) = old {
            class.hash = class.hash.wrapping_sub(key_hash(at, old));
        }
    }
}

/// The class-level state of a node's datapath, following its identity-level writes.
#[derive(Debug)]
pub struct Classes {
    grace: Duration,
    /// Identity keys (identity ≠ 0), by rule set.
    keys: IdentityKeys,
    /// Identity → the addresses whose records carry it, sorted (most identities have one).
    addrs: FastMap<u32, SmallVec<[Addr; 1]>>,
    /// Address → the record the control plane wrote for it (its write: [`record_write`]).
    records: FastMap<Addr, IpInfo>,
    spaces: [Space; SPACES],
    /// Per space: rule set slot → the endpoint records that use it in that direction.
    refs: [FastMap<u32, u32>; SPACES],
    next: u32,
    free: Vec<u32>,
    /// Classes no record points to any more: id, the keys to delete, when.
    retired: VecDeque<(u32, Vec<KeyAt>, Instant)>,
    /// Rule sets no record uses any more in a space (space, slot, since when): they leave it
    /// after the grace period.
    leaving: VecDeque<(usize, u32, Instant)>,
    splits: usize,
    merges: usize,
    joins: usize,
    moved: usize,
    /// Class keys written and deleted so far.
    key_writes: usize,
    /// Identity keys added since the model was last compacted ([`Classes::compact`]).
    grown: usize,
    /// What each identity key the last batch wrote held before it, in order (rule set, (key,
    /// old value)): a batch the maps refuse is undone in the model ([`Classes::keys_before`]).
    undo: Vec<KeyChange>,
}

/// Counts of the class-level state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Live classes per space (class 0 not counted).
    pub classes: [usize; SPACES],
    /// Class keys per space (live classes).
    pub keys: [usize; SPACES],
    /// Keys of retired classes not deleted yet.
    pub retired_keys: usize,
    /// Identities with an address.
    pub identities: usize,
    /// Rule sets per space.
    pub rulesets: [usize; SPACES],
    /// Classes split off another (or off class 0) so far.
    pub splits: usize,
    /// Classes merged into another (or into class 0) so far.
    pub merges: usize,
    /// Groups of identities moved straight into a class that had their new keys so far.
    pub joins: usize,
    /// Class keys written (upserts and deletions) so far.
    pub key_writes: usize,
    /// Records rewritten by splits and merges so far.
    pub moved: usize,
}

impl Classes {
    /// No classes; retired classes' keys are deleted `grace` after their last record moved.
    pub fn new(grace: Duration) -> Classes {
        Classes {
            grace,
            keys: IdentityKeys::default(),
            addrs: FastMap::default(),
            records: FastMap::default(),
            spaces: Default::default(),
            refs: Default::default(),
            next: 1,
            free: Vec::new(),
            retired: VecDeque::new(),
            leaving: VecDeque::new(),
            splits: 0,
            merges: 0,
            joins: 0,
            moved: 0,
            key_writes: 0,
            grown: 0,
            undo: Vec::new(),
        }
    }

    /// The grace period of retired classes' keys.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// The counts.
    pub fn stats(&self) -> ClassStats {
        let mut s = ClassStats {
            retired_keys: self.retired.iter().map(|r| r.1.len()).sum(),
            identities: self.addrs.len(),
            splits: self.splits,
            merges: self.merges,
            joins: self.joins,
            moved: self.moved,
            key_writes: self.key_writes,
            ..ClassStats::default()
        };
        for (d, space) in self.spaces.iter().enumerate() {
            s.classes[d] = space.classes.len();
            s.keys[d] = space.classes.values().map(|c| c.keys.len()).sum();
            s.rulesets[d] = space.slots.len();
        }
        s
    }

    /// The class of identity `id` in each space (0: no key there, or no address).
    pub fn classes_of(&self, id: u32) -> [u32; SPACES] {
        [
            self.spaces[INGRESS].class_of(id),
            self.spaces[EGRESS].class_of(id),
        ]
    }

    /// Translates one batch of identity-level writes (applied in order) into class-level
    /// writes, appended to `out` in the order they must be applied. Deletes the keys of
    /// classes retired at least the grace period ago first.
    pub fn translate(&mut self, batch: &[Write], out: &mut Vec<ClassWrite>) {
        self.commit();
        self.reclaim(Instant::now(), out);
        let mut touched: [BTreeSet<u32>; SPACES] = Default::default();
        let mut i = 0;
        while i < batch.len() {
            let is_key = |w: &Write| matches!(w, Write::PolicyUpsert(k, _) | Write::PolicyDelete(k) if k.identity != 0);
            if is_key(&batch[i]) {
                let end = batch[i..]
                    .iter()
                    .position(|w| !is_key(w))
                    .map_or(batch.len(), |n| i + n);
                self.policy_run(&batch[i..end], &mut touched, out);
                i = end;
                continue;
            }
            match batch[i] {
                Write::IpUpsert(k, info) => {
                    let slots = info
                        .is_endpoint()
                        .then_some([info.ingress.ruleset, info.egress.ruleset]);
                    self.set_record(
                        Addr::Exact(k),
                        batch[i],
                        info.identity,
                        slots,
                        &mut touched,
                        out,
                    );
                }
                Write::CidrUpsert(k, len, info) => {
                    self.set_record(
                        Addr::Cidr(k, len),
                        batch[i],
                        info.identity,
                        None,
                        &mut touched,
                        out,
                    );
                }
                Write::IpDelete(k) => {
                    self.remove_record(Addr::Exact(k), batch[i], &mut touched, out)
                }
                Write::CidrDelete(k, len) => {
                    self.remove_record(Addr::Cidr(k, len), batch[i], &mut touched, out)
                }
                w => out.push(ClassWrite::Plain(w)),
            }
            i += 1;
        }
        for (d, t) in touched.into_iter().enumerate() {
            self.settle(d, t, out);
        }
        if self.grown > COMPACT_AFTER {
            self.compact();
        }
    }

    /// The model's identity keys of rule set `slot` (its leaves shared: the rule set store
    /// keeps them as its own, [`TableWriter::identity_keys`]); empty for a slot without any.
    pub fn identity_keys(&self, slot: u32) -> LeafMap<(u32, u32), PolicyValue> {
        self.keys.of_slot(slot)
    }

    /// Gives back the room the identity-level model's leaves grew into beyond what they hold
    /// (a full programming adds every key of the node, each leaf doubling as it fills; leaves
    /// shared with the store's are left alone).
    fn compact(&mut self) {
        self.keys.compact();
        self.grown = 0;
    }

    /// When the oldest retired class or rule set leaving its space is next due (its grace
    /// period over), if any: [`Classes::reclaim`] writes it from then on.
    pub fn reclaim_due(&self) -> Option<Instant> {
        let leaving = self.leaving.front().map(|&(_, _, at)| at + self.grace);
        let retired = self.retired.front().map(|(_, _, at)| *at + self.grace);
        leaving.into_iter().chain(retired).min()
    }

    /// Deletes the keys of classes retired at least the grace period before `now`, and takes
    /// the rule sets no record has used for that long out of their spaces.
    pub fn reclaim(&mut self, now: Instant, out: &mut Vec<ClassWrite>) {
        let mut touched: [BTreeSet<u32>; SPACES] = Default::default();
        while let Some(&(d, slot, at)) = self.leaving.front() {
            if now.saturating_duration_since(at) < self.grace {
                break;
            }
            self.leaving.pop_front();
            if !self.refs[d].contains_key(&slot) && self.spaces[d].slots.contains(&slot) {
                self.leave(d, slot, &mut touched[d], out);
            }
        }
        for (d, t) in touched.into_iter().enumerate() {
            self.settle(d, t, out);
        }
        while let Some((_, _, at)) = self.retired.front() {
            if now.saturating_duration_since(*at) < self.grace {
                break;
            }
            let (class, keys, _) = self.retired.pop_front().expect("checked");
            self.key_writes += keys.len();
            for (ruleset, prefix) in keys {
                out.push(ClassWrite::Key(Write::PolicyDelete(PolicyKey {
                    ruleset,
                    identity: class,
                    prefix,
                })));
            }
            self.free.push(class);
        }
    }

    /// A run of identity key writes (identity ≠ 0).
    fn policy_run(
        &mut self,
        run: &[Write],
        touched: &mut [BTreeSet<u32>; SPACES],
        out: &mut Vec<ClassWrite>,
    ) {
        // By rule set, each sorted by (identity, prefix), the last write of a key kept (a run
        // is one phase of the store's order: its writes may be applied in any order).
        let mut by_slot: Vec<KeyChange> = run
            .iter()
            .rev()
            .map(|w| match *w {
                Write::PolicyUpsert(k, v) => (k.ruleset, ((k.identity, k.prefix), Some(v))),
                Write::PolicyDelete(k) => (k.ruleset, ((k.identity, k.prefix), None)),
                _ => unreachable!("a run holds key writes only"),
            })
            .collect();
        keys::sort_first_kept(&mut by_slot);
        // The classes, where a rule set of a space changes (most runs install or release a
        // rule set no record uses yet or any more: none).
        let mut changes: IdChanges = by_slot
            .iter()
            .filter(|(slot, _)| self.spaces.iter().any(|s| s.slots.contains(slot)))
            .map(|&(slot, ((id, prefix), v))| (id, ((slot, prefix), v)))
            .collect();
        changes.sort_unstable_by_key(|&(id, (at, _))| (id, at));
        if !changes.is_empty() {
            for (d, t) in touched.iter_mut().enumerate() {
                self.change_space(d, &changes, false, t, out);
            }
        }
        // The identity-level model.
        let mut old = Vec::with_capacity(by_slot.len());
        self.keys.apply(&by_slot, &mut old);
        for (&(slot, (k, v)), &was) in by_slot.iter().zip(&old) {
            self.undo.push((slot, (k, was)));
            if was.is_none() && v.is_some() {
                self.grown += 1;
            }
        }
        // A rule set without identity keys has no class keys either: it leaves the spaces in
        // which no record uses it (it joins again, with its keys, when one does).
        for group in by_slot.chunk_by(|a, b| a.0 == b.0) {
            if !self.keys.has_slot(group[0].0) {
                for d in 0..SPACES {
                    self.leave_if_unused(d, group[0].0);
                }
            }
        }
    }

    /// Steps 1 and 2 of the order for space `d`: `changes` of identities (any space), sorted
    /// by identity and key.
    ///
    /// `invisible`: no packet probes the changed keys (a rule set no record uses in this
    /// direction): a class that splits keeps its largest group, changed in place, and only the
    /// others' records are rewritten.
    fn change_space(
        &mut self,
        d: usize,
        changes: &[(u32, Change)],
        invisible: bool,
        touched: &mut BTreeSet<u32>,
        out: &mut Vec<ClassWrite>,
    ) {
        debug_assert!(changes.is_sorted_by_key(|&(id, (at, _))| (id, at)));
        // Each identity's changes restricted to the space, one after another in `mine` (a run
        // is one phase of the store's order, whose writes may be applied in any order: sorted,
        // members with the same changes form one group).
        let mut mine: Vec<Change> = Vec::with_capacity(changes.len());
        let mut runs: Vec<(u32, u32, std::ops::Range<usize>)> = Vec::new();
        for run in changes.chunk_by(|a, b| a.0 == b.0) {
            let id = run[0].0;
            if !self.addrs.contains_key(&id) {
                continue;
            }
            let start = mine.len();
            let slots = &self.spaces[d].slots;
            // An identity's changes are sorted by rule set: one lookup per rule set.
            let mut last: Option<(u32, bool)> = None;
            mine.extend(
                run.iter()
                    .map(|&(_, ch)| ch)
                    .filter(|((slot, _), _)| match last {
                        Some((s, is)) if s == *slot => is,
                        _ => {
                            let is = slots.contains(slot);
                            last = Some((*slot, is));
                            is
                        }
                    }),
            );
            if mine.len() > start {
                runs.push((self.spaces[d].class_of(id), id, start..mine.len()));
            }
        }
        // class → (the change, restricted to the space) → identities
        let mut groups: BTreeMap<u32, FastMap<&[Change], Vec<u32>>> = BTreeMap::new();
        for (c, id, r) in runs {
            groups
                .entry(c)
                .or_default()
                .entry(&mine[r])
                .or_default()
                .push(id);
        }
        // 1. Splits. The classes this run changes: no group joins one (its keys are not yet
        // what they will be).
        let mut changing: FastSet<u32> = groups.keys().copied().collect();
        let mut targets: Vec<Target> = Vec::new();
        for (c, by_change) in groups {
            // In a fixed order (the identities are visited in order: each group's first).
            let mut by_change: Vec<Group> = by_change
                .into_iter()
                .map(|(ch, ids)| (ch.to_vec(), ids))
                .collect();
            by_change.sort_by_key(|(_, ids)| ids[0]);
            let whole = c != 0
                && by_change.len() == 1
                && by_change[0].1.len() == self.spaces[d].classes[&c].members.len();
            if whole {
                let ch = by_change.pop().expect("one").0;
                targets.push((c, ch));
                continue;
            }
            if invisible && c != 0 {
                match self.split_keeping_largest(d, c, by_change, touched, out) {
                    Ok(mut t) => {
                        changing.extend(t.iter().map(|t| t.0));
                        targets.append(&mut t);
                        continue;
                    }
                    Err(back) => by_change = back,
                }
            }
            for (ch, ids) in by_change {
                // A group whose keys after the change are an unchanging class's moves there
                // at once: a packet that reads a member's new record sees its keys as after
                // the run (its writes first: one order of a run's writes), one that read the
                // old record sees `c`, which this run does not change.
                if let Some(k) = self.spaces[d].equal_after(c, &ch, &changing) {
                    self.joins += 1;
                    for id in ids {
                        self.move_identity(d, id, k, out);
                    }
                    continue;
                }
                let n = self.split_off(d, c, ids, out);
                changing.insert(n);
                targets.push((n, ch));
            }
            if c != 0 && self.spaces[d].classes[&c].members.is_empty() {
                self.retire(d, c);
            }
        }
        // 2. The change.
        out.reserve(targets.iter().map(|t| t.1.len()).sum());
        for (c, ch) in targets {
            self.spaces[d].unfile(c);
            self.key_writes += ch.len();
            for (at, v) in ch {
                self.spaces[d].set_key(c, at, v);
                out.push(ClassWrite::Key(key_write(c, at, v)));
            }
            self.spaces[d].file(c);
            touched.insert(c);
        }
    }

    /// Splits class `c` of space `d` for an invisible change (see [`Classes::change_space`]):
    /// the largest changing group stays in `c`, the other groups and the unchanged members move
    /// to copies. Returns the classes to change and how, or the groups back when the unchanged
    /// members are the largest (then every changing group moves, as for a visible change).
    fn split_keeping_largest(
        &mut self,
        d: usize,
        c: u32,
        mut by_change: Vec<Group>,
        touched: &mut BTreeSet<u32>,
        out: &mut Vec<ClassWrite>,
    ) -> Result<Vec<Target>, Vec<Group>> {
        let members = &self.spaces[d].classes[&c].members;
        let changed: usize = by_change.iter().map(|g| g.1.len()).sum();
        let rest = members.len() - changed;
        let (big, size) = by_change
            .iter()
            .enumerate()
            .map(|(i, g)| (i, g.1.len()))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
            .expect("a group");
        if size <= rest {
            return Err(by_change);
        }
        let (stay, stayers) = by_change.remove(big);
        let mut targets = Vec::new();
        if rest > 0 {
            // The unchanged members keep the keys as they are, in a copy.
            let changing: FastSet<u32> = by_change
                .iter()
                .flat_map(|g| g.1.iter().copied())
                .chain(stayers.iter().copied())
                .collect();
            let unchanged: Vec<u32> = members
                .iter()
                .copied()
                .filter(|m| !changing.contains(m))
                .collect();
            let n = self.split_off(d, c, unchanged, out);
            touched.insert(n);
        }
        for (ch, ids) in by_change {
            let n = self.split_off(d, c, ids, out);
            targets.push((n, ch));
        }
        targets.push((c, stay));
        Ok(targets)
    }

    /// Moves `ids` (members of class `c` of space `d`) to a new class with `c`'s keys.
    fn split_off(&mut self, d: usize, c: u32, ids: Vec<u32>, out: &mut Vec<ClassWrite>) -> u32 {
        let n = self.new_class(d, c, out);
        self.splits += 1;
        for id in ids {
            self.move_identity(d, id, n, out);
        }
        n
    }

    /// A new class of space `d` with the keys of class `like` (written, invisibly: no record
    /// points to it yet).
    fn new_class(&mut self, d: usize, like: u32, out: &mut Vec<ClassWrite>) -> u32 {
        let n = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        let (keys, hash) = match self.spaces[d].classes.get(&like) {
            Some(c) if like != 0 => (c.keys.clone(), c.hash),
            _ => (BTreeMap::new(), 0),
        };
        self.key_writes += keys.len();
        for (&at, &v) in &keys {
            out.push(ClassWrite::Key(key_write(n, at, Some(v))));
        }
        self.spaces[d].classes.insert(
            n,
            Class {
                members: BTreeSet::new(),
                keys,
                hash,
                filed: hash,
            },
        );
        self.spaces[d].file(n);
        n
    }

    /// Moves identity `id` to class `to` of space `d` and rewrites its addresses' records.
    fn move_identity(&mut self, d: usize, id: u32, to: u32, out: &mut Vec<ClassWrite>) {
        let space = &mut self.spaces[d];
        let from = space.class_of(id);
        if from == to {
            return;
        }
        if from != 0 {
            space
                .classes
                .get_mut(&from)
                .expect("a live class")
                .members
                .remove(&id);
        }
        if to == 0 {
            space.of.remove(&id);
        } else {
            space.of.insert(id, to);
            space
                .classes
                .get_mut(&to)
                .expect("a live class")
                .members
                .insert(id);
        }
        let classes = self.classes_of(id);
        for addr in self.addrs.get(&id).into_iter().flatten() {
            let write = record_write(*addr, self.records[addr]);
            out.push(ClassWrite::Record { write, classes });
            self.moved += 1;
        }
    }

    /// Retires class `c` of space `d` (no member left): its keys go after the grace period.
    fn retire(&mut self, d: usize, c: u32) {
        self.spaces[d].unfile(c);
        let class = self.spaces[d].classes.remove(&c).expect("a live class");
        debug_assert!(class.members.is_empty());
        self.retired
            .push_back((c, class.keys.into_keys().collect(), Instant::now()));
    }

    /// Step 3 for the classes of space `d` a batch changed or created.
    fn settle(&mut self, d: usize, touched: BTreeSet<u32>, out: &mut Vec<ClassWrite>) {
        for c in touched {
            let Some(class) = self.spaces[d].classes.get(&c) else {
                continue;
            };
            let into = if class.keys.is_empty() {
                Some(0)
            } else {
                self.spaces[d].equal_to(&class.keys, class.hash, c)
            };
            let Some(mut into) = into else {
                continue;
            };
            let mut from = c;
            // The smaller class moves.
            if into != 0
                && self.spaces[d].classes[&into].members.len()
                    < self.spaces[d].classes[&c].members.len()
            {
                (from, into) = (into, from);
            }
            let members: Vec<u32> = self.spaces[d].classes[&from]
                .members
                .iter()
                .copied()
                .collect();
            for id in members {
                self.move_identity(d, id, into, out);
            }
            self.retire(d, from);
            self.merges += 1;
        }
    }

    /// Makes rule set `slot` part of space `d`: the classes are split by the slot's keys (as
    /// if they were upserted now) and the class keys written, before the record that makes a
    /// packet probe them.
    fn add_slot(
        &mut self,
        d: usize,
        slot: u32,
        touched: &mut [BTreeSet<u32>; SPACES],
        out: &mut Vec<ClassWrite>,
    ) {
        self.spaces[d].slots.insert(slot);
        let changes = self.keys.slot_changes(slot, false);
        self.change_space(d, &changes, true, &mut touched[d], out);
    }

    /// Rule set `slot` leaves space `d` if no record uses it there and it has no identity
    /// key (so no class has a key in it).
    fn leave_if_unused(&mut self, d: usize, slot: u32) {
        if !self.refs[d].contains_key(&slot) && !self.keys.has_slot(slot) {
            self.spaces[d].slots.remove(&slot);
        }
    }

    /// Rule set `slot` leaves space `d`, where no record has used it for the grace period: its
    /// keys are deleted from the classes (every member of a class has the same keys in it, so
    /// no class splits; no packet probes them), then classes that became equal merge.
    fn leave(
        &mut self,
        d: usize,
        slot: u32,
        touched: &mut BTreeSet<u32>,
        out: &mut Vec<ClassWrite>,
    ) {
        let changes = self.keys.slot_changes(slot, true);
        self.change_space(d, &changes, true, touched, out);
        self.spaces[d].slots.remove(&slot);
    }

    /// Counts the rule sets an endpoint record uses (`add`) or used (`!add`).
    fn count_refs(&mut self, write: Option<&Write>, add: bool) {
        let Some(Write::IpUpsert(_, info)) = write else {
            return;
        };
        if !info.is_endpoint() {
            return;
        }
        for (d, slot) in [info.ingress.ruleset, info.egress.ruleset]
            .into_iter()
            .enumerate()
        {
            if slot == 0 {
                continue;
            }
            if add {
                *self.refs[d].entry(slot).or_default() += 1;
            } else if let Some(n) = self.refs[d].get_mut(&slot) {
                *n -= 1;
                if *n == 0 {
                    self.refs[d].remove(&slot);
                    // Without identity keys at once; otherwise after the grace period (a
                    // packet that read the old record may still probe the class keys).
                    self.leave_if_unused(d, slot);
                    if self.spaces[d].slots.contains(&slot) {
                        self.leaving.push_back((d, slot, Instant::now()));
                    }
                }
            }
        }
    }

    /// The class of a new identity (its first address) in each space: an existing class with
    /// its keys, or a new one (keys written first).
    fn place(&mut self, id: u32, out: &mut Vec<ClassWrite>) {
        for d in 0..SPACES {
            let slots = &self.spaces[d].slots;
            let keys = self.keys.of(id, |slot| slots.contains(&slot));
            if keys.is_empty() {
                continue;
            }
            let hash = keys
                .iter()
                .fold(0u64, |h, (&at, &v)| h.wrapping_add(key_hash(at, v)));
            let c = match self.spaces[d].equal_to(&keys, hash, 0) {
                Some(c) => c,
                None => {
                    let n = self.new_class(d, 0, out);
                    self.key_writes += keys.len();
                    for (&at, &v) in &keys {
                        self.spaces[d].set_key(n, at, Some(v));
                        out.push(ClassWrite::Key(key_write(n, at, Some(v))));
                    }
                    self.spaces[d].unfile(n);
                    self.spaces[d].file(n);
                    n
                }
            };
            let space = &mut self.spaces[d];
            space.of.insert(id, c);
            space
                .classes
                .get_mut(&c)
                .expect("a live class")
                .members
                .insert(id);
        }
    }

    /// Identity `id` lost its last address: it leaves its classes.
    fn unplace(&mut self, id: u32, touched: &mut [BTreeSet<u32>; SPACES]) {
        for (d, t) in touched.iter_mut().enumerate() {
            let space = &mut self.spaces[d];
            let Some(c) = space.of.remove(&id) else {
                continue;
            };
            let class = space.classes.get_mut(&c).expect("a live class");
            class.members.remove(&id);
            if class.members.is_empty() {
                t.remove(&c);
                self.retire(d, c);
            }
        }
    }

    fn set_record(
        &mut self,
        addr: Addr,
        write: Write,
        id: u32,
        slots: Option<[u32; SPACES]>,
        touched: &mut [BTreeSet<u32>; SPACES],
        out: &mut Vec<ClassWrite>,
    ) {
        // The rule sets the record makes packets probe: their class keys first.
        for (d, slot) in slots.into_iter().flat_map(|s| s.into_iter().enumerate()) {
            if slot != 0 && !self.spaces[d].slots.contains(&slot) {
                self.add_slot(d, slot, touched, out);
            }
        }
        if id != 0 && !self.addrs.contains_key(&id) {
            self.place(id, out);
        }
        let old = self.records.insert(addr, record_info(&write));
        self.count_refs(Some(&write), true);
        self.count_refs(old.map(|i| record_write(addr, i)).as_ref(), false);
        let old = old.map(|i| i.identity);
        if id != 0 {
            add_address(self.addrs.entry(id).or_default(), addr);
        }
        out.push(ClassWrite::Record {
            write,
            classes: self.classes_of(id),
        });
        if let Some(old) = old.filter(|&o| o != id) {
            self.forget_address(old, addr, touched);
        }
    }

    fn remove_record(
        &mut self,
        addr: Addr,
        write: Write,
        touched: &mut [BTreeSet<u32>; SPACES],
        out: &mut Vec<ClassWrite>,
    ) {
        out.push(ClassWrite::Record {
            write,
            classes: [0; SPACES],
        });
        if let Some(info) = self.records.remove(&addr) {
            self.count_refs(Some(&record_write(addr, info)), false);
            self.forget_address(info.identity, addr, touched);
        }
    }

    fn forget_address(&mut self, id: u32, addr: Addr, touched: &mut [BTreeSet<u32>; SPACES]) {
        if id == 0 {
            return;
        }
        let Some(set) = self.addrs.get_mut(&id) else {
            return;
        };
        set.retain(|a| *a != addr);
        if set.is_empty() {
            self.addrs.remove(&id);
            self.unplace(id, touched);
        }
    }
}

/// The record of a record write (`IpUpsert`, `CidrUpsert`).
fn record_info(w: &Write) -> IpInfo {
    match *w {
        Write::IpUpsert(_, info) | Write::CidrUpsert(_, _, info) => info,
        _ => unreachable!("a record write"),
    }
}

/// The write of `addr`'s record `info`.
fn record_write(addr: Addr, info: IpInfo) -> Write {
    match addr {
        Addr::Exact(k) => Write::IpUpsert(k, info),
        Addr::Cidr(k, len) => Write::CidrUpsert(k, len, info),
    }
}

/// Adds `addr` to an identity's sorted addresses (once).
fn add_address(addrs: &mut SmallVec<[Addr; 1]>, addr: Addr) {
    if let Err(i) = addrs.binary_search(&addr) {
        addrs.insert(i, addr);
    }
}

fn key_write(class: u32, (ruleset, prefix): KeyAt, v: Option<PolicyValue>) -> Write {
    let k = PolicyKey {
        ruleset,
        identity: class,
        prefix,
    };
    match v {
        Some(v) => Write::PolicyUpsert(k, v),
        None => Write::PolicyDelete(k),
    }
}

/// Class-level tables: the maps as they are with classes (policy keys per class, each record
/// with its address's classes).
#[derive(Debug, Clone, Default)]
pub struct ClassTables {
    /// Cell words, blocks, records with their classes, class keys (`PolicyKey::identity` is
    /// the class) and the wildcard keys.
    pub tables: MemTables,
}

impl ClassTables {
    /// Empty tables of `cells` cell words and `blocks` block words.
    pub fn new(cells: u32, blocks: u32) -> ClassTables {
        ClassTables {
            tables: MemTables::new(cells, blocks),
        }
    }

    /// Applies one write.
    pub fn apply(&mut self, w: &ClassWrite) {
        self.tables.apply(&w.write());
    }

    /// The classes of `addr`'s record, if it has one.
    pub fn classes_of(&self, addr: &Addr) -> Option<[u32; SPACES]> {
        match *addr {
            Addr::Exact(k) => self.tables.ipcache.get(&k),
            Addr::Cidr(k, len) => self.tables.cidr.get(&(k, len)),
        }
        .map(|i| i.classes)
    }

    /// Every address with a record, and its classes.
    pub fn classes(&self) -> impl Iterator<Item = (Addr, [u32; SPACES])> + '_ {
        let exact = self
            .tables
            .ipcache
            .iter()
            .map(|(k, i)| (Addr::Exact(*k), i));
        let cidr = (self.tables.cidr.iter()).map(|((k, len), i)| (Addr::Cidr(*k, *len), i));
        exact.chain(cidr).map(|(a, i)| (a, i.classes))
    }

    /// The policy keys held (class keys and wildcard keys).
    pub fn policy_keys(&self) -> usize {
        self.tables.policy.len()
    }
}

/// A [`TableWriter`] that writes identity-level tables and keeps the class-level tables of
/// the same writes beside them ([`Classes`]).
#[derive(Debug)]
pub struct Classed {
    /// The identity-level tables (what [`TableWriter::tables`] returns).
    pub identity: MemTables,
    /// The translation.
    pub classes: Classes,
    /// The class-level tables.
    pub class_tables: ClassTables,
    pending: Vec<ClassWrite>,
}

impl Classed {
    /// Writes `identity` (its current contents are taken as written through this writer: pass
    /// empty tables) and class-level tables of the same sizes.
    pub fn new(identity: MemTables, grace: Duration) -> Classed {
        // The same words at both levels, held once.
        let mut tables = MemTables::default();
        tables.cells.clone_from(&identity.cells);
        tables.blocks.clone_from(&identity.blocks);
        let class_tables = ClassTables { tables };
        Classed {
            identity,
            classes: Classes::new(grace),
            class_tables,
            pending: Vec::new(),
        }
    }

    /// Deletes the keys of classes whose grace period is over.
    pub fn reclaim(&mut self) {
        self.apply(&[], |c, out| c.reclaim(Instant::now(), out));
    }

    /// Runs `f` on the translation of identity-level `writes` and applies the class-level
    /// writes it makes (in a buffer kept between calls).
    fn apply(&mut self, writes: &[Write], f: impl FnOnce(&mut Classes, &mut Vec<ClassWrite>)) {
        let mut out = std::mem::take(&mut self.pending);
        f(&mut self.classes, &mut out);
        for w in out.drain(..) {
            self.class_tables.apply(&w);
        }
        // Cell and block words pass unchanged: one copy for both levels.
        (self.class_tables.tables).share_words_from(&self.identity, writes);
        out.shrink_to(1 << 12);
        self.pending = out;
        self.classes.commit();
    }
}

impl TableWriter for Classed {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        self.identity.write(writes)?;
        self.apply(writes, |c, out| c.translate(writes, out));
        Ok(())
    }

    fn tables(&self) -> &MemTables {
        &self.identity
    }

    fn reclaim_below(&mut self) -> Result<(), WriteError> {
        self.reclaim();
        Ok(())
    }

    fn reclaim_due_below(&self) -> Option<Instant> {
        self.classes.reclaim_due()
    }

    fn identity_keys(&self, slot: u32) -> Option<LeafMap<(u32, u32), PolicyValue>> {
        Some(self.classes.identity_keys(slot))
    }
}

impl Classes {
    /// Checks the invariants (for tests): every class of a space has members, all with
    /// addresses and exactly the class's keys in the space's rule sets; no two classes of a space
    /// have equal keys; an identity with an address and keys in a space is in a class of it,
    /// one without keys there is not.
    pub fn check(&self) -> Result<(), String> {
        let all = self.keys.by_identity();
        for (d, space) in self.spaces.iter().enumerate() {
            let own = |id: u32| -> BTreeMap<KeyAt, PolicyValue> {
                all.get(&id)
                    .into_iter()
                    .flatten()
                    .filter(|((slot, _), _)| space.slots.contains(slot))
                    .map(|(&at, &v)| (at, v))
                    .collect()
            };
            let mut seen: FastMap<&BTreeMap<KeyAt, PolicyValue>, u32> = FastMap::default();
            for (&c, class) in &space.classes {
                if class.members.is_empty() || class.keys.is_empty() {
                    return Err(format!("space {d}: class {c} is empty: {class:?}"));
                }
                let hash = class
                    .keys
                    .iter()
                    .fold(0u64, |h, (&at, &v)| h.wrapping_add(key_hash(at, v)));
                if hash != class.hash || class.filed != hash {
                    return Err(format!("space {d}: class {c}'s hash is stale"));
                }
                if !space.by_hash.get(&hash).is_some_and(|v| v.contains(&c)) {
                    return Err(format!("space {d}: class {c} is not filed"));
                }
                if let Some(o) = seen.insert(&class.keys, c) {
                    return Err(format!("space {d}: classes {o} and {c} have equal keys"));
                }
                for &m in &class.members {
                    if !self.addrs.contains_key(&m) || space.of.get(&m) != Some(&c) {
                        return Err(format!("space {d}: member {m} of class {c} is stray"));
                    }
                    if own(m) != class.keys {
                        return Err(format!(
                            "space {d}: identity {m}'s keys {:?} are not class {c}'s {:?}",
                            own(m),
                            class.keys
                        ));
                    }
                }
            }
            for &id in self.addrs.keys() {
                let keyed = !own(id).is_empty();
                if keyed != space.of.contains_key(&id) {
                    return Err(format!(
                        "space {d}: identity {id} has keys: {keyed}, class: {:?}",
                        space.of.get(&id)
                    ));
                }
            }
        }
        Ok(())
    }
}
