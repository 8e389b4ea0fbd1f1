//! Flattening a MapState into the datapath's rule set layout, and the userspace lookup over it.
//!
//! A rule set is the MapState's keys with their verdicts, nothing else ([`RuleSetContent`]):
//! identity keys go to the policy hash map as they are, and the wildcard keys plus the set of
//! key lengths are folded into **cell words** (see `ordnet_datapath_common::lookup`). This module
//! computes those words ([`CellInputs`], [`cell_words`]); the same functions serve the kernel
//! tables (`store`) and the self-contained [`FlatRuleSet`] that the CLI can use without a
//! kernel.

use std::collections::BTreeMap;

use ordnet_datapath_common::{
    layout::{
        CELL_REFINED, CELLS_PER_RULESET, OTHER_SLOT_CELL, PolicyKey, PolicyRef, PolicyValue,
        SLOT_PROTOCOLS, V_ALLOW, V_DENY, WILD_ALLOW, WILD_DENY, WILD_NONE, cell_word, prefix_bits,
        proto_slot, wild_length_bits,
    },
    lookup::{PolicyDecision, PolicyMaps, policy_lookup},
};
use ordnet_mapstate::{Changes, MapState, Peer, Verdict};

use crate::counters::RuleCounters;
use crate::leafmap::LeafMap;

/// Why a MapState cannot be flattened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlattenError {
    /// A key fixes a protocol other than TCP, UDP or SCTP, or only part of the protocol bits.
    /// (MapStates built from policy entries never contain one.)
    #[error(
        "key {key} cannot be flattened: only the wildcard protocol or TCP/UDP/SCTP prefixes are supported"
    )]
    UnsupportedPrefix {
        /// The key's prefix, as displayed.
        key: String,
    },
    /// Identity 0 is the datapath's wildcard and not a valid identity.
    #[error("identity 0 is reserved for the wildcard and cannot have keys")]
    ZeroIdentity,
}

/// Key changes of a rule set: upserts carry the new value, removals the old one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContentDiff {
    /// ((identity, prefix), new value) of identity keys added or changed.
    pub specific_upserts: Vec<((u32, u32), PolicyValue)>,
    /// ((identity, prefix), old value) of identity keys removed.
    pub specific_removes: Vec<((u32, u32), PolicyValue)>,
    /// (prefix, new value) of `*` keys added or changed.
    pub wildcard_upserts: Vec<(u32, PolicyValue)>,
    /// (prefix, old value) of `*` keys removed.
    pub wildcard_removes: Vec<(u32, PolicyValue)>,
}

impl ContentDiff {
    /// Whether there is no key write.
    pub fn is_empty(&self) -> bool {
        self.specific_upserts.is_empty()
            && self.specific_removes.is_empty()
            && self.wildcard_upserts.is_empty()
            && self.wildcard_removes.is_empty()
    }

    /// Number of key writes.
    pub fn len(&self) -> usize {
        self.specific_upserts.len()
            + self.specific_removes.len()
            + self.wildcard_upserts.len()
            + self.wildcard_removes.len()
    }

    /// What turns `old` into `new` (O(size of both)).
    pub fn between(old: &RuleSetContent, new: &RuleSetContent) -> ContentDiff {
        let mut d = ContentDiff::default();
        for (k, &v) in &new.specific {
            if old.specific.get(k) != Some(&v) {
                d.specific_upserts.push((*k, v));
            }
        }
        for (k, &v) in &old.specific {
            if !new.specific.contains_key(k) {
                d.specific_removes.push((*k, v));
            }
        }
        for (&p, &v) in &new.wildcard {
            if old.wildcard.get(&p) != Some(&v) {
                d.wildcard_upserts.push((p, v));
            }
        }
        for (&p, &v) in &old.wildcard {
            if !new.wildcard.contains_key(&p) {
                d.wildcard_removes.push((p, v));
            }
        }
        d
    }

    /// The key changes of a MapState update (O(size of the change set)), the keys' rule
    /// counters drawn from `counters`. Changes that touch only a key's order key are not key
    /// changes; a change of its origins is (its counter changes).
    pub fn from_changeset(
        changes: Changes<'_>,
        counters: &mut RuleCounters,
    ) -> Result<ContentDiff, FlattenError> {
        let mut d = ContentDiff::default();
        let key = |k: &ordnet_mapstate::Key| -> Result<(Option<u32>, u32), FlattenError> {
            let prefix = encode_prefix(&k.prefix)?;
            match k.peer {
                Peer::Any => Ok((None, prefix)),
                Peer::Id(0) => Err(FlattenError::ZeroIdentity),
                Peer::Id(id) => Ok((Some(id), prefix)),
            }
        };
        let upsert = |d: &mut ContentDiff, k, v| -> Result<(), FlattenError> {
            match key(k)? {
                (Some(id), p) => d.specific_upserts.push(((id, p), v)),
                (None, p) => d.wildcard_upserts.push((p, v)),
            }
            Ok(())
        };
        for (k, e) in changes.added {
            upsert(&mut d, k, counters.value(e))?;
        }
        for (k, old, new) in changes.changed {
            let (before, after) = (counters.value(old), counters.value(new));
            if before != after {
                upsert(&mut d, k, after)?;
            }
        }
        for (k, old) in changes.removed {
            let v = counters.value(old);
            match key(k)? {
                (Some(id), p) => d.specific_removes.push(((id, p), v)),
                (None, p) => d.wildcard_removes.push((p, v)),
            }
        }
        Ok(d)
    }
}

/// A hash of one key and its value; a rule set's content hash is the XOR of its keys' hashes,
/// so it can be updated per changed key.
pub fn key_hash(identity: u32, prefix: u32, value: PolicyValue) -> u64 {
    // SplitMix64 finaliser over the packed key: cheap and well mixed.
    let packed = u64::from(value.verdict) | (u64::from(value.counter) << 8);
    let mut x = (u64::from(identity) << 32) ^ u64::from(prefix) ^ (packed << 40);
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The datapath encoding of a verdict.
pub fn verdict_code(v: Verdict) -> u8 {
    match v {
        Verdict::Allow => V_ALLOW,
        Verdict::Deny => V_DENY,
    }
}

/// The keys of a flattened rule set: what is shared between endpoints whose MapStates are
/// identical (the isolation default is not part of it: it lives in the endpoint record).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct RuleSetContent {
    /// (identity, prefix bits) -> verdict (`V_ALLOW`/`V_DENY`) and rule counter (in
    /// leaves: a node holds millions of these).
    pub specific: LeafMap<(u32, u32), PolicyValue>,
    /// `*` keys: prefix bits -> verdict and rule counter.
    pub wildcard: BTreeMap<u32, PolicyValue>,
}

impl RuleSetContent {
    /// Whether the rule set has no key.
    pub fn is_empty(&self) -> bool {
        self.specific.is_empty() && self.wildcard.is_empty()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.specific.len() + self.wildcard.len()
    }

    /// The keys as the policy map holds them in rule set `slot` (`*` keys have identity 0),
    /// with their values.
    pub fn policy_keys(&self, slot: u32) -> impl Iterator<Item = (PolicyKey, PolicyValue)> + '_ {
        let key = move |identity, prefix| PolicyKey {
            ruleset: slot,
            identity,
            prefix,
        };
        let specific = self
            .specific
            .iter()
            .map(move |(&(id, p), &v)| (key(id, p), v));
        let wildcard = self.wildcard.iter().map(move |(&p, &v)| (key(0, p), v));
        specific.chain(wildcard)
    }

    /// The value of policy map key `key` (its rule set aside).
    pub fn value_of(&self, key: &PolicyKey) -> Option<PolicyValue> {
        if key.identity == 0 {
            self.wildcard.get(&key.prefix).copied()
        } else {
            self.specific.get(&(key.identity, key.prefix)).copied()
        }
    }

    /// Adds policy map key `key` (its rule set aside) with `value`.
    pub fn insert_key(&mut self, key: &PolicyKey, value: PolicyValue) {
        if key.identity == 0 {
            self.wildcard.insert(key.prefix, value);
        } else {
            self.specific.insert((key.identity, key.prefix), value);
        }
    }

    /// The content hash (XOR of [`key_hash`] over the keys; `*` keys have identity 0).
    pub fn content_hash(&self) -> u64 {
        let s = self
            .specific
            .iter()
            .fold(0, |h, (&(id, p), &v)| h ^ key_hash(id, p, v));
        self.wildcard
            .iter()
            .fold(s, |h, (&p, &v)| h ^ key_hash(0, p, v))
    }

    /// The content hash after applying `d`, from the hash before (O(size of `d`)).
    pub fn hash_after(&self, hash: u64, d: &ContentDiff) -> u64 {
        self.hash_after_with(hash, d, |_| ())
    }

    /// [`RuleSetContent::hash_after`], which finds each identity key `d` upserts: those the
    /// content does not have go to `added` too, in `d`'s order (one search of each key for
    /// both).
    pub fn hash_after_with(
        &self,
        hash: u64,
        d: &ContentDiff,
        mut added: impl FnMut((u32, u32)),
    ) -> u64 {
        let mut h = hash;
        let mut keys = self.specific.finger();
        for &((id, p), v) in &d.specific_upserts {
            match keys.get(&(id, p)) {
                Some(&old) => h ^= key_hash(id, p, old),
                None => added((id, p)),
            }
            h ^= key_hash(id, p, v);
        }
        for &((id, p), v) in &d.specific_removes {
            h ^= key_hash(id, p, v);
        }
        for &(p, v) in &d.wildcard_upserts {
            if let Some(&old) = self.wildcard.get(&p) {
                h ^= key_hash(0, p, old);
            }
            h ^= key_hash(0, p, v);
        }
        for &(p, v) in &d.wildcard_removes {
            h ^= key_hash(0, p, v);
        }
        h
    }

    /// Applies a diff (its removals must be keys of `self` with those verdicts).
    pub fn apply(&mut self, d: &ContentDiff) {
        Self::apply_specific(&mut self.specific, d);
        self.apply_wildcards(d);
    }

    /// Applies a diff's identity keys to `specific` (a rule set's).
    pub(crate) fn apply_specific(specific: &mut LeafMap<(u32, u32), PolicyValue>, d: &ContentDiff) {
        // The identity keys in one pass over the leaves: sorted (stable: a key's removal
        // before its upsert), the last change of each key kept.
        let mut changes: Vec<((u32, u32), Option<PolicyValue>)> = d
            .specific_removes
            .iter()
            .map(|&(k, _)| (k, None))
            .chain(d.specific_upserts.iter().map(|&(k, v)| (k, Some(v))))
            .collect();
        if !changes.is_sorted_by(|a, b| a.0 < b.0) {
            changes.sort_by_key(|c| c.0);
            changes.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    *kept = *later;
                }
                same
            });
        }
        specific.set_sorted(&changes, |_| ());
    }

    /// Applies a diff's `*` keys.
    pub(crate) fn apply_wildcards(&mut self, d: &ContentDiff) {
        for (p, _) in &d.wildcard_removes {
            self.wildcard.remove(p);
        }
        for (p, v) in &d.wildcard_upserts {
            self.wildcard.insert(*p, *v);
        }
    }

    /// The inputs of the cell computation.
    pub fn cell_inputs(&self) -> CellInputs {
        let mut inputs = CellInputs {
            wildcard: self.wildcard.iter().map(|(p, v)| (*p, v.verdict)).collect(),
            ..CellInputs::default()
        };
        for &(_, prefix) in self.specific.keys() {
            inputs.add_specific(prefix);
        }
        inputs
    }
}

/// The key lengths a rule set can hold, longest first (0, and 8 to 24 bits).
const LENGTHS_DESC: [u32; 18] = [
    24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 0,
];

/// `prefix` (in `prefix_bits` form) cut to `len` bits.
fn truncate(prefix: u32, len: u32) -> u32 {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    (prefix & !0xff & mask) | len
}

/// The ancestors of `prefix` a rule set can hold, itself first, longest first.
fn ancestors(prefix: u32) -> impl Iterator<Item = u32> {
    let len = prefix_len(prefix);
    LENGTHS_DESC
        .into_iter()
        .filter(move |l| *l <= len)
        .map(move |l| truncate(prefix, l))
}

impl RuleSetContent {
    /// The verdict for peer `identity` (`None`: an identity without keys) on every packet of
    /// `prefix`, when the rule set decides them all alike (`prefix` is no shorter than the
    /// keys that matter): the datapath's lookup contract (the identity's longest covering key,
    /// else the longest covering `*` key, else `default`).
    pub fn verdict_at(&self, default: u8, identity: Option<u32>, prefix: u32) -> u8 {
        self.value_at(default, identity, prefix).verdict
    }

    /// The value deciding what [`RuleSetContent::verdict_at`] decides (the default's: without
    /// a rule counter).
    pub fn value_at(&self, default: u8, identity: Option<u32>, prefix: u32) -> PolicyValue {
        if let Some(id) = identity {
            for p in ancestors(prefix) {
                if let Some(v) = self.specific.get(&(id, p)) {
                    return *v;
                }
            }
        }
        ancestors(prefix)
            .find_map(|p| self.wildcard.get(&p).copied())
            .unwrap_or(PolicyValue::new(default))
    }
}

/// The prefixes at which two rule sets' verdicts can be compared (or combined) completely:
/// every `*` key of either, and per identity with keys in either, its keys plus each `*`
/// prefix one of them covers (so that the identity's longest match never hides a longer `*`
/// key that decides one of the two). Any packet's verdict in either rule set equals that rule
/// set's [`RuleSetContent::verdict_at`] at the packet's longest match among these prefixes.
fn refinement(
    a: &RuleSetContent,
    b: &RuleSetContent,
) -> (
    std::collections::BTreeSet<u32>,
    BTreeMap<u32, std::collections::BTreeSet<u32>>,
) {
    let wildcard: std::collections::BTreeSet<u32> = a
        .wildcard
        .keys()
        .chain(b.wildcard.keys())
        .copied()
        .collect();
    let mut by_identity: BTreeMap<u32, std::collections::BTreeSet<u32>> = BTreeMap::new();
    for &(id, p) in a.specific.keys().chain(b.specific.keys()) {
        by_identity.entry(id).or_default().insert(p);
    }
    for own in by_identity.values_mut() {
        let covered: Vec<u32> = wildcard
            .iter()
            .filter(|w| ancestors(**w).any(|p| own.contains(&p)))
            .copied()
            .collect();
        own.extend(covered);
    }
    (wildcard, by_identity)
}

/// The rule set that allows exactly what both `a` and `b` allow (each with its isolation
/// default), for every identity, protocol and port: the keys of their refinement (see `refinement` in the source), each
/// with the conjunction of both verdicts there. Used between two states of a batch that
/// changes both sides of some flow (one endpoint's egress and another's ingress): writing the
/// meet first and `b` after never lets a packet pass that neither `a` nor `b` lets pass,
/// whatever order the datapath sees the endpoints' writes in (`docs/datapath.md` §6).
pub fn meet(a: (&RuleSetContent, u8), b: (&RuleSetContent, u8)) -> (RuleSetContent, u8) {
    let ((ra, da), (rb, db)) = (a, b);
    let (wildcard, by_identity) = refinement(ra, rb);
    let mut out = RuleSetContent::default();
    for w in wildcard {
        out.wildcard.insert(
            w,
            and_value(ra.value_at(da, None, w), rb.value_at(db, None, w)),
        );
    }
    for (id, prefixes) in by_identity {
        for p in prefixes {
            let v = and_value(ra.value_at(da, Some(id), p), rb.value_at(db, Some(id), p));
            out.specific.insert((id, p), v);
        }
    }
    (out, and(da, db))
}

/// `V_ALLOW` only when both are.
fn and(x: u8, y: u8) -> u8 {
    if x == V_ALLOW && y == V_ALLOW {
        V_ALLOW
    } else {
        V_DENY
    }
}

/// Of two values deciding one packet in two rule sets, the one of their conjunction: the
/// denying one (the first if both deny), else the second.
fn and_value(x: PolicyValue, y: PolicyValue) -> PolicyValue {
    if x.verdict != V_ALLOW { x } else { y }
}

/// The value of an identity whose keys are `own` (prefix → value), over the `*` keys
/// `wildcard` and the default: [`RuleSetContent::value_at`] for one identity.
fn value_of(
    own: &BTreeMap<u32, PolicyValue>,
    wildcard: &BTreeMap<u32, PolicyValue>,
    default: u8,
    p: u32,
) -> PolicyValue {
    ancestors(p)
        .find_map(|a| own.get(&a).copied())
        .or_else(|| ancestors(p).find_map(|a| wildcard.get(&a).copied()))
        .unwrap_or(PolicyValue::new(default))
}

/// Appends to `d` what turns identity `id`'s keys `from` into `to`.
fn push_identity_diff(
    d: &mut ContentDiff,
    id: u32,
    from: &BTreeMap<u32, PolicyValue>,
    to: &BTreeMap<u32, PolicyValue>,
) {
    for (&p, &v) in to {
        if from.get(&p) != Some(&v) {
            d.specific_upserts.push(((id, p), v));
        }
    }
    for (&p, &v) in from {
        if !to.contains_key(&p) {
            d.specific_removes.push(((id, p), v));
        }
    }
}

/// The two steps of a change of identity keys only (the `*` keys and the default stay) when
/// both sides of some flow change: `(current → meet, meet → after)`, where per identity that
/// the change touches the meet is [`meet`] restricted to that identity (or its new keys, or
/// its old ones, when the meet decides like them, as in the whole-set choice of the control
/// plane). Identities the change does not touch keep their keys and so their verdicts, and
/// one identity's keys never decide another identity's packets: the per-identity meet gives
/// every packet the verdict the whole-set meet gives it, at a cost in the size of the change
/// instead of the size of the rule set. `None` when the change touches a `*` key.
pub fn meet_steps(
    current: &RuleSetContent,
    default: u8,
    diff: &ContentDiff,
) -> Option<(ContentDiff, ContentDiff)> {
    if !diff.wildcard_upserts.is_empty() || !diff.wildcard_removes.is_empty() {
        return None;
    }
    // Per touched identity: its removed prefixes and its upserted keys.
    type Change = (Vec<u32>, Vec<(u32, PolicyValue)>);
    let mut by_id: BTreeMap<u32, Change> = BTreeMap::new();
    for &((id, p), _) in &diff.specific_removes {
        by_id.entry(id).or_default().0.push(p);
    }
    for &((id, p), v) in &diff.specific_upserts {
        by_id.entry(id).or_default().1.push((p, v));
    }
    let (mut to_meet, mut to_after) = (ContentDiff::default(), ContentDiff::default());
    let w = &current.wildcard;
    for (id, (removes, upserts)) in by_id {
        let old: BTreeMap<u32, PolicyValue> = current
            .specific
            .range((id, 0)..=(id, u32::MAX))
            .map(|(&(_, p), &v)| (p, v))
            .collect();
        let mut new = old.clone();
        for p in removes {
            new.remove(&p);
        }
        new.extend(upserts);
        // The refinement of this identity (see `refinement`).
        let mut at: std::collections::BTreeSet<u32> =
            old.keys().chain(new.keys()).copied().collect();
        let covered: Vec<u32> = w
            .keys()
            .filter(|p| ancestors(**p).any(|a| at.contains(&a)))
            .copied()
            .collect();
        at.extend(covered);
        let both: Vec<(u32, PolicyValue, PolicyValue)> = at
            .iter()
            .map(|&p| {
                (
                    p,
                    value_of(&old, w, default, p),
                    value_of(&new, w, default, p),
                )
            })
            .collect();
        let meet = if both
            .iter()
            .all(|&(_, a, b)| and(a.verdict, b.verdict) == b.verdict)
        {
            new.clone()
        } else if both
            .iter()
            .all(|&(_, a, b)| and(a.verdict, b.verdict) == a.verdict)
        {
            old.clone()
        } else {
            both.iter().map(|&(p, a, b)| (p, and_value(a, b))).collect()
        };
        push_identity_diff(&mut to_meet, id, &old, &meet);
        push_identity_diff(&mut to_after, id, &meet, &new);
    }
    Some((to_meet, to_after))
}

/// Whether two rule sets (with their defaults) give every packet the same verdict, whatever
/// their keys. Sound, not complete: `true` only when they agree everywhere; `false` may also
/// mean they agree but one splits a prefix into longer keys that together cover it (the
/// comparison is at every prefix of the refinement, also those no packet ends at).
pub fn same_verdicts(a: (&RuleSetContent, u8), b: (&RuleSetContent, u8)) -> bool {
    let ((ra, da), (rb, db)) = (a, b);
    let (wildcard, by_identity) = refinement(ra, rb);
    da == db
        && wildcard
            .iter()
            .all(|&w| ra.verdict_at(da, None, w) == rb.verdict_at(db, None, w))
        && by_identity.iter().all(|(&id, ps)| {
            ps.iter()
                .all(|&p| ra.verdict_at(da, Some(id), p) == rb.verdict_at(db, Some(id), p))
        })
}

/// A MapState prefix in the datapath's `prefix_bits` form, if the datapath supports it.
fn encode_prefix(prefix: &ordnet_mapstate::L4Prefix) -> Result<u32, FlattenError> {
    let len = prefix.len();
    let supported =
        len == 0 || (len >= 8 && prefix.protocol().and_then(proto_slot).is_some() && len <= 24);
    if !supported {
        return Err(FlattenError::UnsupportedPrefix {
            key: prefix.to_string(),
        });
    }
    Ok(prefix.raw() | u32::from(len))
}

/// The keys of a MapState as a rule set, and its isolation default (`V_ALLOW`/`V_DENY`),
/// without rule counters (for a rule set that is not written to the kernel).
pub fn flatten(ms: &MapState) -> Result<(RuleSetContent, u8), FlattenError> {
    flatten_counted(ms, &mut RuleCounters::none())
}

/// The keys of a MapState as a rule set, each with the rule counter of the rules it comes
/// from (drawn from `counters`), and its isolation default.
pub fn flatten_counted(
    ms: &MapState,
    counters: &mut RuleCounters,
) -> Result<(RuleSetContent, u8), FlattenError> {
    let mut content = RuleSetContent::default();
    let mut specific = Vec::new();
    for (key, entry) in ms.iter() {
        let prefix = encode_prefix(&key.prefix)?;
        let v = counters.value(entry);
        match key.peer {
            Peer::Any => {
                content.wildcard.insert(prefix, v);
            }
            Peer::Id(0) => return Err(FlattenError::ZeroIdentity),
            Peer::Id(id) => specific.push(((id, prefix), v)),
        }
    }
    // Collected at once: the leaves hold exactly the keys (no room grown by inserts).
    content.specific = specific.into_iter().collect();
    Ok((content, verdict_code(ms.default_verdict())))
}

/// What the cell words of a rule set are computed from: how many identity keys sit at each
/// prefix (only "some or none" matters for the word) and the `*` verdict at each prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CellInputs {
    /// Number of identity keys at each prefix (`prefix_bits` form).
    pub specific_count: BTreeMap<u32, u32>,
    /// `*` verdict (`V_ALLOW`/`V_DENY`) at each prefix (`prefix_bits` form).
    pub wildcard: BTreeMap<u32, u8>,
}

impl CellInputs {
    /// Counts one more identity key at `prefix`. Returns whether it is the first (the cell
    /// words read only whether a prefix has identity keys, so only then can they change).
    pub fn add_specific(&mut self, prefix: u32) -> bool {
        let n = self.specific_count.entry(prefix).or_default();
        *n += 1;
        *n == 1
    }

    /// Counts one identity key fewer at `prefix` (no-op if there is none). Returns whether it
    /// was the last (only then can the cell words change).
    pub fn remove_specific(&mut self, prefix: u32) -> bool {
        if let Some(n) = self.specific_count.get_mut(&prefix) {
            *n -= 1;
            if *n == 0 {
                self.specific_count.remove(&prefix);
                return true;
            }
        }
        false
    }
}

/// The words of one first-level cell: the same word for all its ports, or one per low port
/// byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellWords {
    /// One word for every port of the cell.
    Uniform(u32),
    /// One word per low port byte.
    Refined(Box<[u32; 256]>),
}

fn prefix_len(prefix: u32) -> u32 {
    prefix & 0xff
}

fn wild_code(v: u8) -> u32 {
    if v == V_ALLOW { WILD_ALLOW } else { WILD_DENY }
}

/// The words of first-level cell `cell` (0..CELLS_PER_RULESET) of a rule set.
pub fn cell_words(inputs: &CellInputs, cell: u32) -> CellWords {
    if cell == OTHER_SLOT_CELL {
        // Other protocols: only length-0 keys can match.
        let mask = u32::from(inputs.specific_count.contains_key(&0));
        let wild = inputs.wildcard.get(&0).map_or(WILD_NONE, |v| wild_code(*v));
        return CellWords::Uniform(cell_word(mask, wild) | wild_length_bits(0));
    }
    let slot = cell / 256;
    let hi = cell % 256;
    let proto = SLOT_PROTOCOLS[slot as usize];
    let first_port = (hi << 8) as u16;
    // Ancestors of (and equal to) the 256-port block: lengths 0 and 8..=16.
    let mut mask = 0u32;
    // The wildcard verdict with the length of its key (`wild_length_bits`).
    let mut wild = (WILD_NONE, 0);
    for len in core::iter::once(0).chain(8..=16) {
        let p = prefix_bits(proto, first_port, len);
        if inputs.specific_count.contains_key(&p) {
            mask |= 1 << len;
        }
        if let Some(v) = inputs.wildcard.get(&p) {
            wild = (wild_code(*v), wild_length_bits(len)); // longer overrides shorter
        }
    }
    let word = |mask, (wild, len_bits)| cell_word(mask, wild) | len_bits;
    // Descendants: keys of length 17..=24 inside the block.
    let lo = prefix_bits(proto, first_port, 24) & !0xff;
    let hi_bound = lo | (0xff << 8) | 0xff;
    let specific: Vec<u32> = inputs
        .specific_count
        .range(lo..=hi_bound)
        .map(|(p, _)| *p)
        .filter(|p| prefix_len(*p) > 16)
        .collect();
    let mut wildcard: Vec<(u32, u8)> = inputs
        .wildcard
        .range(lo..=hi_bound)
        .map(|(p, v)| (*p, *v))
        .filter(|(p, _)| prefix_len(*p) > 16)
        .collect();
    if specific.is_empty() && wildcard.is_empty() {
        return CellWords::Uniform(word(mask, wild));
    }
    let mut masks = [mask; 256];
    let mut wilds = [wild; 256];
    let port_span = |p: u32| {
        let len = prefix_len(p);
        let first = (p >> 8) & 0xff;
        let count = 1u32 << (24 - len);
        (first, first + count - 1, len)
    };
    for p in specific {
        let (a, b, len) = port_span(p);
        for m in &mut masks[a as usize..=b as usize] {
            *m |= 1 << len;
        }
    }
    // Shorter first, so that a longer key overrides the shorter ones inside it.
    wildcard.sort_by_key(|(p, _)| prefix_len(*p));
    for (p, v) in wildcard {
        let (a, b, len) = port_span(p);
        for w in &mut wilds[a as usize..=b as usize] {
            *w = (wild_code(v), wild_length_bits(len));
        }
    }
    let mut words = Box::new([0u32; 256]);
    for i in 0..256 {
        words[i] = word(masks[i], wilds[i]);
    }
    if words.iter().all(|w| *w == words[0]) {
        CellWords::Uniform(words[0])
    } else {
        CellWords::Refined(words)
    }
}

/// The first-level cells whose words a key at `prefix` can influence.
pub fn affected_cells(prefix: u32) -> std::ops::RangeInclusive<u32> {
    let len = prefix_len(prefix);
    if len == 0 {
        return 0..=CELLS_PER_RULESET - 1;
    }
    let proto = (prefix >> 24) as u8;
    let slot = proto_slot(proto).expect("flattened prefixes have a supported protocol");
    let first = (prefix >> 8) & 0xffff;
    let last = if len <= 8 {
        0xffff
    } else {
        first | ((1u32 << (24 - len)) - 1)
    };
    (slot * 256 + (first >> 8))..=(slot * 256 + (last >> 8))
}

/// A flattened rule set on its own, with the cell words computed exactly as they are written to
/// the kernel. Its [`FlatRuleSet::lookup`] runs the kernel's lookup function
/// ([`policy_lookup`]) over it: the userspace verdict of a MapState as the datapath sees it.
#[derive(Debug, Clone)]
pub struct FlatRuleSet {
    content: RuleSetContent,
    default: u8,
    l1: Vec<u32>,
    blocks: Vec<u32>,
}

impl FlatRuleSet {
    /// Flattens a MapState.
    pub fn from_mapstate(ms: &MapState) -> Result<FlatRuleSet, FlattenError> {
        let (content, default) = flatten(ms)?;
        Ok(FlatRuleSet::new(content, default))
    }

    /// A rule set from its keys and default (`V_ALLOW`/`V_DENY`).
    pub fn new(content: RuleSetContent, default: u8) -> FlatRuleSet {
        let inputs = content.cell_inputs();
        let mut l1 = Vec::with_capacity(CELLS_PER_RULESET as usize);
        let mut blocks = Vec::new();
        for cell in 0..CELLS_PER_RULESET {
            match cell_words(&inputs, cell) {
                CellWords::Uniform(w) => l1.push(w),
                CellWords::Refined(words) => {
                    l1.push(CELL_REFINED | (blocks.len() / 256) as u32);
                    blocks.extend_from_slice(&words[..]);
                }
            }
        }
        FlatRuleSet {
            content,
            default,
            l1,
            blocks,
        }
    }

    /// The keys.
    pub fn content(&self) -> &RuleSetContent {
        &self.content
    }

    /// `V_ALLOW` or `V_DENY`.
    pub fn default_code(&self) -> u8 {
        self.default
    }

    /// Number of refined 256-word blocks.
    pub fn refined_blocks(&self) -> usize {
        self.blocks.len() / 256
    }

    /// The datapath's decision for a packet of `identity` (`None`: an address without identity)
    /// to `(protocol, port)`.
    pub fn lookup(&self, identity: Option<u32>, protocol: u8, port: u16) -> PolicyDecision {
        policy_lookup(
            self,
            PolicyRef::new(0, self.default),
            identity.unwrap_or(0),
            protocol,
            port,
        )
    }

    /// The verdict of [`FlatRuleSet::lookup`].
    pub fn verdict(&self, identity: Option<u32>, protocol: u8, port: u16) -> Verdict {
        if self.lookup(identity, protocol, port).allow {
            Verdict::Allow
        } else {
            Verdict::Deny
        }
    }
}

impl PolicyMaps for FlatRuleSet {
    fn cell(&self, index: u32) -> Option<u32> {
        self.l1.get(index as usize).copied()
    }

    fn block_word(&self, index: u32) -> Option<u32> {
        self.blocks.get(index as usize).copied()
    }

    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        if key.ruleset != 0 {
            return None;
        }
        self.content.value_of(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small random prefix: TCP or UDP, ports 80..88, a few lengths (nested blocks).
    fn small_prefix(g: &mut quickcheck::Gen) -> u32 {
        let proto = *g.choose(&[6u8, 17]).unwrap();
        let port = 80 + u16::arbitrary(g) % 8;
        let len = *g.choose(&[0u32, 8, 21, 22, 23, 24]).unwrap();
        if len == 0 {
            0
        } else {
            prefix_bits(proto, port, len)
        }
    }

    fn verdict(g: &mut quickcheck::Gen) -> u8 {
        *g.choose(&[V_ALLOW, V_DENY]).unwrap()
    }

    /// A verdict with one of a few rule counters.
    fn value(g: &mut quickcheck::Gen) -> PolicyValue {
        PolicyValue::counted(verdict(g), u16::arbitrary(g) % 3)
    }

    use quickcheck::Arbitrary;

    /// The two steps of a change of identity keys give every packet of every identity the
    /// conjunction of its old and new verdicts in between, and the new rule set at the end.
    #[test]
    fn meet_steps_is_the_meet_per_packet() {
        fn prop(seed: u64) -> bool {
            let mut g = quickcheck::Gen::new(8 + (seed % 8) as usize);
            let mut a = RuleSetContent::default();
            for _ in 0..u8::arbitrary(&mut g) % 12 {
                let id = 1 + u32::arbitrary(&mut g) % 4;
                a.specific.insert((id, small_prefix(&mut g)), value(&mut g));
            }
            for _ in 0..u8::arbitrary(&mut g) % 4 {
                a.wildcard.insert(small_prefix(&mut g), value(&mut g));
            }
            let default = verdict(&mut g);
            let mut b = a.clone();
            for _ in 0..u8::arbitrary(&mut g) % 6 {
                let k = (1 + u32::arbitrary(&mut g) % 4, small_prefix(&mut g));
                if bool::arbitrary(&mut g) {
                    b.specific.insert(k, value(&mut g));
                } else {
                    b.specific.remove(&k);
                }
            }
            let diff = ContentDiff::between(&a, &b);
            let (to_meet, to_after) = meet_steps(&a, default, &diff).expect("identity keys only");
            let mut m = a.clone();
            m.apply(&to_meet);
            let mut end = m.clone();
            end.apply(&to_after);
            if end != b {
                return false;
            }
            (0..=5).all(|id| {
                [6u8, 17, 1].iter().all(|&proto| {
                    (78..90).all(|port| {
                        let p = prefix_bits(proto, port, 24);
                        let id = (id > 0).then_some(id);
                        m.verdict_at(default, id, p)
                            == and(a.verdict_at(default, id, p), b.verdict_at(default, id, p))
                    })
                })
            })
        }
        quickcheck::QuickCheck::new()
            .tests(2000)
            .quickcheck(prop as fn(u64) -> bool);
    }

    #[test]
    fn affected_cells_of_each_length() {
        assert_eq!(affected_cells(0), 0..=768);
        assert_eq!(affected_cells(prefix_bits(6, 0, 8)), 0..=255);
        assert_eq!(affected_cells(prefix_bits(17, 0, 8)), 256..=511);
        assert_eq!(affected_cells(prefix_bits(132, 80, 24)), 512..=512);
        assert_eq!(affected_cells(prefix_bits(6, 0x1200, 16)), 0x12..=0x12);
        assert_eq!(affected_cells(prefix_bits(6, 0x1000, 12)), 0x10..=0x1f);
        assert_eq!(affected_cells(prefix_bits(6, 0xff00, 20)), 0xff..=0xff);
    }

    #[test]
    fn words_of_nested_keys() {
        let mut inputs = CellInputs::default();
        inputs.add_specific(prefix_bits(6, 80, 24));
        inputs.add_specific(prefix_bits(6, 0, 8));
        inputs.wildcard.insert(0, V_ALLOW);
        inputs.wildcard.insert(prefix_bits(6, 80, 22), V_DENY); // 80..=83
        let CellWords::Refined(w) = cell_words(&inputs, 0) else {
            panic!("block 0 of TCP must be refined")
        };
        let base = 1 << 8; // the TCP/* identity key
        assert_eq!(w[79], cell_word(base, WILD_ALLOW));
        // The /22 `*` key decides 80..=83: its length is in the word.
        let len22 = wild_length_bits(22);
        assert_eq!(w[80], cell_word(base | 1 << 24, WILD_DENY) | len22);
        assert_eq!(w[81], cell_word(base, WILD_DENY) | len22);
        assert_eq!(w[83], cell_word(base, WILD_DENY) | len22);
        for l in core::iter::once(0).chain(8..=24) {
            assert_eq!(
                ordnet_datapath_common::layout::wild_length(
                    cell_word(base, WILD_DENY) | wild_length_bits(l)
                ),
                l
            );
        }
        assert_eq!(w[84], cell_word(base, WILD_ALLOW));
        assert_eq!(
            cell_words(&inputs, 1),
            CellWords::Uniform(cell_word(base, WILD_ALLOW))
        );
        assert_eq!(
            cell_words(&inputs, 256),
            CellWords::Uniform(cell_word(0, WILD_ALLOW)),
            "UDP: only the any-protocol wildcard"
        );
        assert_eq!(
            cell_words(&inputs, OTHER_SLOT_CELL),
            CellWords::Uniform(cell_word(0, WILD_ALLOW))
        );
    }
}
