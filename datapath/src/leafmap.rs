//! [`LeafMap`]: a sorted map of small `Copy` entries kept in bounded sorted leaves, for the
//! datapath's copies of policy keys (a node holds millions of identity keys at 50,000 pods: a
//! rule set's keys in the store, and the class translation's model of them). An entry costs
//! its own size (12 bytes for a policy key and its value) where a `BTreeMap` node costs ~22
//! bytes a key; a change moves at most [`LEAF`] entries; a map filled in key order (a rule set
//! flattened, installed) appends to full leaves.
//!
//! Leaves are shared between clones and copied when written (`Arc`): a map can take another's
//! leaves when their entries are equal ([`LeafMap::share_from`]), so two holders of the same
//! keys (the store and the class translation) keep one copy of them, and a change copies only
//! the leaves it touches.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

/// Entries per leaf at most: a change moves at most this many entries (a rule set holds up to
/// tens of thousands: one sorted vector per rule set made a namespace relabel, whose runs
/// change a few keys in each of hundreds of rule sets, 30-50 % slower than smaller vectors).
pub const LEAF: usize = 512;

/// A sorted map in leaves of at most [`LEAF`] entries, none empty.
#[derive(Clone)]
pub struct LeafMap<K, V> {
    leaves: Vec<Arc<Vec<(K, V)>>>,
    /// The last key of each leaf, in one array and as its rank ([`LeafKey`]): finding a key's
    /// leaf reads it instead of each leaf's end (a cache miss per step, through the leaf's `Arc`
    /// and `Vec`).
    lasts: Vec<u64>,
    len: usize,
}

/// A key a [`LeafMap`] holds: ordered as one integer, its rank. Finding a key compares ranks
/// (one instruction each, which a branch-free binary search turns into conditional moves) where
/// a tuple's derived order is a chain of comparisons and branches.
pub trait LeafKey: Ord + Copy {
    /// The key as one integer, in the key's order: `a < b` exactly when `a.rank() < b.rank()`.
    fn rank(&self) -> u64;
}

/// A policy key's (identity or class, prefix).
impl LeafKey for (u32, u32) {
    #[inline]
    fn rank(&self) -> u64 {
        (u64::from(self.0) << 32) | u64::from(self.1)
    }
}

impl LeafKey for u32 {
    #[inline]
    fn rank(&self) -> u64 {
        u64::from(*self)
    }
}

impl<K, V> Default for LeafMap<K, V> {
    fn default() -> Self {
        LeafMap {
            leaves: Vec::new(),
            lasts: Vec::new(),
            len: 0,
        }
    }
}

/// Finds keys of a [`LeafMap`] given mostly in ascending order (a diff's keys, checked against
/// a rule set before it is applied): each search starts where the last one ended and gallops
/// forward, so an ascending run reads the leaves once, front to back, where [`LeafMap::get`]
/// binary-searches from the top for each key (a cache miss per step). A key below the last one
/// is found by a full search.
pub struct Finger<'a, K, V> {
    map: &'a LeafMap<K, V>,
    /// The leaf the last search ended in, and the position in it.
    leaf: usize,
    at: usize,
    /// The rank of the last key searched (`None` before the first).
    last: Option<u64>,
}

impl<'a, K: LeafKey, V: Copy> Finger<'a, K, V> {
    /// The value of `k` (as [`LeafMap::get`]).
    pub fn get(&mut self, k: &K) -> Option<&'a V> {
        let m = self.map;
        let r = k.rank();
        if m.leaves.is_empty() {
            return None;
        }
        if self.last.is_none_or(|last| r < last) {
            let (li, at) = m.locate(k);
            (self.leaf, self.at, self.last) = (li, at.unwrap_or_else(|i| i), Some(r));
            return at.ok().map(|i| &m.leaves[li][i].1);
        }
        self.last = Some(r);
        if r > m.lasts[self.leaf] {
            let li = gallop(&m.lasts, self.leaf + 1, |&l| l < r).min(m.leaves.len() - 1);
            if li != self.leaf {
                (self.leaf, self.at) = (li, 0);
            }
        }
        let leaf = &m.leaves[self.leaf];
        self.at = gallop(leaf, self.at, |e| e.0.rank() < r);
        leaf.get(self.at).filter(|e| e.0.rank() == r).map(|e| &e.1)
    }
}

/// The first index at or after `from` whose element is not `before` (`before` holds for a
/// prefix of `s`), found by steps of 1, 2, 4, … from `from` and a binary search of the last step.
fn gallop<T>(s: &[T], from: usize, before: impl Fn(&T) -> bool) -> usize {
    // Everything in `from..lo` is before; the answer is in `lo..=hi`.
    let (mut lo, mut hi, mut step) = (from, from, 1usize);
    while hi < s.len() && before(&s[hi]) {
        lo = hi + 1;
        hi = hi.saturating_add(step);
        step = step.saturating_mul(2);
    }
    let hi = hi.min(s.len());
    lo + s[lo..hi].partition_point(before)
}

/// An iterator over a [`LeafMap`]'s entries, in key order.
pub type Iter<'a, K, V> = std::iter::Map<
    std::iter::FlatMap<
        std::slice::Iter<'a, Arc<Vec<(K, V)>>>,
        std::slice::Iter<'a, (K, V)>,
        fn(&'a Arc<Vec<(K, V)>>) -> std::slice::Iter<'a, (K, V)>,
    >,
    fn(&'a (K, V)) -> (&'a K, &'a V),
>;

fn pair<K, V>(e: &(K, V)) -> (&K, &V) {
    (&e.0, &e.1)
}

fn entries<K, V>(l: &Arc<Vec<(K, V)>>) -> std::slice::Iter<'_, (K, V)> {
    l.iter()
}

impl<K: LeafKey, V: Copy> LeafMap<K, V> {
    /// An empty map.
    pub fn new() -> Self {
        LeafMap::default()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the map has no entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The leaf `k` is in or belongs in (the last one past the end), and where in it.
    fn locate(&self, k: &K) -> (usize, Result<usize, usize>) {
        let r = k.rank();
        let li = self
            .lasts
            .partition_point(|&l| l < r)
            .min(self.leaves.len().saturating_sub(1));
        let at = self
            .leaves
            .get(li)
            .map_or(Err(0), |l| l.binary_search_by_key(&r, |e| e.0.rank()));
        (li, at)
    }

    /// A [`Finger`] for finding keys given mostly in ascending order.
    pub fn finger(&self) -> Finger<'_, K, V> {
        Finger {
            map: self,
            leaf: 0,
            at: 0,
            last: None,
        }
    }

    /// The value of `k`.
    pub fn get(&self, k: &K) -> Option<&V> {
        match self.locate(k) {
            (li, Ok(i)) => Some(&self.leaves[li][i].1),
            _ => None,
        }
    }

    /// Whether `k` has a value.
    pub fn contains_key(&self, k: &K) -> bool {
        self.get(k).is_some()
    }

    /// Sets `k` to `v`; the value it had.
    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        match self.locate(&k) {
            (li, Ok(i)) => {
                let leaf = Arc::make_mut(&mut self.leaves[li]);
                Some(std::mem::replace(&mut leaf[i].1, v))
            }
            (li, Err(i)) => {
                self.insert_at(li, i, (k, v));
                self.len += 1;
                None
            }
        }
    }

    /// Removes `k`; the value it had.
    pub fn remove(&mut self, k: &K) -> Option<V> {
        let (li, Ok(i)) = self.locate(k) else {
            return None;
        };
        let leaf = Arc::make_mut(&mut self.leaves[li]);
        let was = leaf.remove(i).1;
        match leaf.last() {
            Some(last) => self.lasts[li] = last.0.rank(),
            None => {
                self.leaves.remove(li);
                self.lasts.remove(li);
            }
        }
        self.len -= 1;
        Some(was)
    }

    /// Sets (`Some`) or removes (`None`) each key of `changes` (sorted by key, each key once)
    /// in one pass over the leaves: each leaf a change falls in is merged with its changes
    /// once, the others are kept as they are (shared leaves stay shared). `old` gets each
    /// key's previous value, in the order of `changes`. Key by key, each change searched the
    /// map from the top and copied a shared leaf or moved half of it: a rule set changed in
    /// place at 10k pods gets hundreds of changes, many in the same leaves.
    pub fn set_sorted(&mut self, changes: &[(K, Option<V>)], mut old: impl FnMut(Option<V>)) {
        debug_assert!(changes.windows(2).all(|w| w[0].0 < w[1].0));
        if changes.is_empty() {
            return;
        }
        if self.leaves.is_empty() {
            let mut entries = Vec::with_capacity(changes.len());
            for &(k, v) in changes {
                old(None);
                entries.extend(v.map(|v| (k, v)));
            }
            *self = LeafMap::from_sorted(entries);
            return;
        }
        let n = self.leaves.len();
        // Leaves whose merge does not fit one leaf (split) or is empty: spliced in at the end.
        let mut reshaped: Vec<(usize, Vec<(K, V)>)> = Vec::new();
        let mut merged: Vec<(K, V)> = Vec::new();
        let (mut li, mut rest) = (0, changes);
        while let Some(first) = rest.first() {
            // The leaf of the next change, and the changes up to its last key (all that are
            // left, for the last leaf).
            let r = first.0.rank();
            li += self.lasts[li..].partition_point(|&l| l < r);
            li = li.min(n - 1);
            let take = if li + 1 == n {
                rest.len()
            } else {
                let last = self.lasts[li];
                rest.partition_point(|c| c.0.rank() <= last)
            };
            let (mine, after) = rest.split_at(take);
            rest = after;
            let leaf = &self.leaves[li];
            merged.clear();
            merged.reserve(leaf.len() + mine.len());
            // Runs of unchanged entries copied whole, between the changed keys; a change at
            // the next entry (a dense run: a rule set cleared, keys added side by side) is
            // found without a search.
            let mut at = 0;
            for &(k, v) in mine {
                let r = k.rank();
                let i = if leaf.get(at).is_none_or(|e| e.0.rank() >= r) {
                    at
                } else {
                    at + leaf[at..].partition_point(|e| e.0.rank() < r)
                };
                merged.extend_from_slice(&leaf[at..i]);
                let was = leaf.get(i).filter(|e| e.0.rank() == r).map(|e| e.1);
                at = i + usize::from(was.is_some());
                old(was);
                self.len -= usize::from(was.is_some());
                if let Some(v) = v {
                    merged.push((k, v));
                    self.len += 1;
                }
            }
            merged.extend_from_slice(&leaf[at..]);
            if merged.is_empty() {
                reshaped.push((li, Vec::new()));
            } else if merged.len() > LEAF {
                reshaped.push((li, std::mem::take(&mut merged)));
            } else {
                self.lasts[li] = merged[merged.len() - 1].0.rank();
                match Arc::get_mut(&mut self.leaves[li]) {
                    Some(own) => {
                        own.clear();
                        own.extend_from_slice(&merged);
                    }
                    None => self.leaves[li] = Arc::new(merged.clone()),
                }
            }
            li += 1;
        }
        if !reshaped.is_empty() {
            self.reshape(reshaped);
        }
    }

    /// Replaces the leaves at the given indices (ascending) with `entries` each, cut into
    /// leaves of at most [`LEAF`] entries as even as they can be (none for no entries).
    fn reshape(&mut self, reshaped: Vec<(usize, Vec<(K, V)>)>) {
        let leaves = std::mem::take(&mut self.leaves);
        let lasts = std::mem::take(&mut self.lasts);
        self.leaves.reserve(leaves.len() + reshaped.len());
        self.lasts.reserve(leaves.len() + reshaped.len());
        let mut reshaped = reshaped.into_iter().peekable();
        for (li, (leaf, last)) in leaves.into_iter().zip(lasts).enumerate() {
            let Some((_, entries)) = reshaped.next_if(|r| r.0 == li) else {
                self.leaves.push(leaf);
                self.lasts.push(last);
                continue;
            };
            if entries.is_empty() {
                continue;
            }
            let pieces = entries.len().div_ceil(LEAF);
            let size = entries.len().div_ceil(pieces);
            for piece in entries.chunks(size) {
                self.lasts.push(piece[piece.len() - 1].0.rank());
                self.leaves.push(Arc::new(piece.to_vec()));
            }
        }
    }

    /// Sets (`Some`) or removes (`None`) `k`; the value it had.
    pub fn set(&mut self, k: K, v: Option<V>) -> Option<V> {
        match v {
            Some(v) => self.insert(k, v),
            None => self.remove(&k),
        }
    }

    fn insert_at(&mut self, li: usize, i: usize, e: (K, V)) {
        let last = li + 1 == self.leaves.len();
        let Some(leaf) = self.leaves.get_mut(li) else {
            self.leaves.push(Arc::new(vec![e]));
            self.lasts.push(e.0.rank());
            return;
        };
        if leaf.len() < LEAF {
            let leaf = Arc::make_mut(leaf);
            leaf.insert(i, e);
            self.lasts[li] = leaf[leaf.len() - 1].0.rank();
        } else if last && i == leaf.len() {
            // Appending (filled in key order): full leaves stay full.
            self.leaves.push(Arc::new(vec![e]));
            self.lasts.push(e.0.rank());
        } else {
            let leaf = Arc::make_mut(leaf);
            let mut right = leaf.split_off(LEAF / 2);
            leaf.shrink_to_fit();
            match i.checked_sub(LEAF / 2) {
                Some(j) => right.insert(j, e),
                None => leaf.insert(i, e),
            }
            self.lasts[li] = leaf[leaf.len() - 1].0.rank();
            self.lasts.insert(li + 1, right[right.len() - 1].0.rank());
            self.leaves.insert(li + 1, Arc::new(right));
        }
    }

    /// The entries in key order.
    pub fn iter(&self) -> Iter<'_, K, V> {
        self.leaves
            .iter()
            .flat_map(entries as fn(&Arc<Vec<(K, V)>>) -> std::slice::Iter<'_, (K, V)>)
            .map(pair as fn(&(K, V)) -> (&K, &V))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }

    /// The values in key order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// The entries whose keys are in `range`, in key order.
    pub fn range<R: RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &V)> {
        let (li, i) = match range.start_bound() {
            Bound::Unbounded => (0, 0),
            Bound::Included(k) => {
                let (li, at) = self.locate(k);
                (li, at.unwrap_or_else(|i| i))
            }
            Bound::Excluded(k) => {
                let (li, at) = self.locate(k);
                (li, at.map_or_else(|i| i, |i| i + 1))
            }
        };
        let end = range.end_bound().cloned();
        self.leaves
            .get(li..)
            .unwrap_or_default()
            .iter()
            .enumerate()
            .flat_map(move |(n, l)| &l[if n == 0 { i } else { 0 }..])
            .map(pair)
            .take_while(move |(k, _)| match end {
                Bound::Unbounded => true,
                Bound::Included(e) => **k <= e,
                Bound::Excluded(e) => **k < e,
            })
    }

    /// Gives back the room the leaves grew into beyond what they hold (leaves shared with
    /// another map are left as they are: copying them would cost more than it gives back).
    pub fn shrink_to_fit(&mut self) {
        for leaf in &mut self.leaves {
            if let Some(leaf) = Arc::get_mut(leaf) {
                leaf.shrink_to_fit();
            }
        }
        self.leaves.shrink_to_fit();
        self.lasts.shrink_to_fit();
    }

    /// Whether the two maps hold the same leaves (not only equal entries).
    pub fn shares(&self, other: &Self) -> bool {
        self.leaves.len() == other.leaves.len()
            && self
                .leaves
                .iter()
                .zip(&other.leaves)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }

    /// Takes `other`'s leaves if its entries are equal to this map's (one copy kept for both
    /// holders); whether they are (then this map shares `other`'s leaves). Leaves already
    /// shared are not compared again, so the cost is that of the entries held twice.
    pub fn share_from(&mut self, other: &Self) -> bool
    where
        V: PartialEq,
    {
        if self.len != other.len {
            return false;
        }
        if !same_entries(&self.leaves, &other.leaves) {
            return false;
        }
        if self.leaves.len() == other.leaves.len() {
            // Only the leaves not shared yet: taking a leaf's `Arc` again touches its count
            // (a cache miss per leaf, and most are shared already after a change of a few
            // keys).
            for (mine, theirs) in self.leaves.iter_mut().zip(&other.leaves) {
                if !Arc::ptr_eq(mine, theirs) {
                    *mine = Arc::clone(theirs);
                }
            }
        } else {
            self.leaves.clone_from(&other.leaves);
        }
        self.lasts.clone_from(&other.lasts);
        true
    }

    /// The map of `entries` already sorted by key, each key once (the caller knows it:
    /// [`FromIterator`] checks, and sorts what is not).
    pub(crate) fn from_sorted(entries: Vec<(K, V)>) -> Self {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        let len = entries.len();
        let leaves = if len <= LEAF {
            if entries.is_empty() {
                Vec::new()
            } else {
                vec![entries]
            }
        } else {
            entries.chunks(LEAF).map(<[(K, V)]>::to_vec).collect()
        };
        let lasts = leaves
            .iter()
            .map(|l: &Vec<(K, V)>| l[l.len() - 1].0.rank())
            .collect();
        let leaves = leaves.into_iter().map(Arc::new).collect();
        LeafMap { leaves, lasts, len }
    }
}

/// Whether two leaf sequences hold equal entries, skipping pairs of leaves that are one (the
/// same leaf at the same position in both): leaves split at different points compare entry by
/// entry until the sequences meet at a leaf boundary again.
fn same_entries<K: PartialEq, V: PartialEq>(
    a: &[Arc<Vec<(K, V)>>],
    b: &[Arc<Vec<(K, V)>>],
) -> bool {
    let (mut la, mut ia, mut lb, mut ib) = (0, 0, 0, 0);
    loop {
        if la == a.len() || lb == b.len() {
            return la == a.len() && lb == b.len();
        }
        if ia == 0 && ib == 0 && Arc::ptr_eq(&a[la], &b[lb]) {
            la += 1;
            lb += 1;
            continue;
        }
        let n = (a[la].len() - ia).min(b[lb].len() - ib);
        if a[la][ia..ia + n] != b[lb][ib..ib + n] {
            return false;
        }
        ia += n;
        ib += n;
        if ia == a[la].len() {
            (la, ia) = (la + 1, 0);
        }
        if ib == b[lb].len() {
            (lb, ib) = (lb + 1, 0);
        }
    }
}

impl<K: LeafKey, V: Copy> FromIterator<(K, V)> for LeafMap<K, V> {
    /// As a `BTreeMap` collects: of two entries of one key the last is kept.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut entries: Vec<(K, V)> = iter.into_iter().collect();
        if !entries.windows(2).all(|w| w[0].0 < w[1].0) {
            // Stable, from the back: the first of each key in reversed order is its last.
            entries.reverse();
            entries.sort_by_key(|e| e.0);
            entries.dedup_by(|a, b| a.0 == b.0);
        }
        entries.shrink_to_fit();
        LeafMap::from_sorted(entries)
    }
}

impl<K: LeafKey, V: Copy> Extend<(K, V)> for LeafMap<K, V> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<'a, K: LeafKey, V: Copy> IntoIterator for &'a LeafMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Equal entries (wherever the leaves split).
impl<K: LeafKey, V: Copy + PartialEq> PartialEq for LeafMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<K: LeafKey, V: Copy + Eq> Eq for LeafMap<K, V> {}

impl<K: LeafKey + Hash, V: Copy + Hash> Hash for LeafMap<K, V> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.len.hash(state);
        for e in self.iter() {
            e.hash(state);
        }
    }
}

impl<K: LeafKey + fmt::Debug, V: Copy + fmt::Debug> fmt::Debug for LeafMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Every leaf holds 1 to [`LEAF`] entries, and `lasts` has each leaf's last key.
    fn check_shape<K: LeafKey, V: Copy>(m: &LeafMap<K, V>) {
        assert!(m.leaves.iter().all(|l| !l.is_empty() && l.len() <= LEAF));
        assert!(
            m.lasts
                .iter()
                .copied()
                .eq(m.leaves.iter().map(|l| l[l.len() - 1].0.rank()))
        );
    }

    /// A finger finds what `get` finds, for keys in ascending order (dense and sparse, present
    /// and absent, beyond both ends), repeated, descending and in any order.
    #[test]
    fn a_finger_finds_what_get_finds() {
        for n in [0u32, 1, 5, 600, 4000] {
            let m: LeafMap<(u32, u32), u32> = (0..n).map(|i| ((i * 3, i % 2), i)).collect();
            let keys: Vec<(u32, u32)> = (0..3 * n + 4).map(|i| (i, (i / 2) % 2)).collect();
            let runs: [Vec<(u32, u32)>; 5] = [
                keys.clone(),
                keys.iter().copied().step_by(97).collect(),
                keys.iter().flat_map(|&k| [k, k]).collect(),
                keys.iter().rev().copied().collect(),
                (0..keys.len())
                    .map(|i| keys[(i * 7919) % keys.len()])
                    .collect(),
            ];
            for (r, run) in runs.iter().enumerate() {
                let mut f = m.finger();
                for k in run {
                    assert_eq!(f.get(k), m.get(k), "n {n} run {r} key {k:?}");
                }
            }
        }
    }

    /// Every operation agrees with a `BTreeMap` over inserts, overwrites and removals that
    /// split, empty and refill leaves, in key order and scattered.
    #[test]
    fn agrees_with_a_btree_map() {
        for n in [3u32, 40, 700, 5000] {
            let mut m: LeafMap<(u32, u32), u8> = LeafMap::new();
            let mut want: BTreeMap<(u32, u32), u8> = BTreeMap::new();
            for round in 0..6u32 {
                for i in 0..n {
                    let k = if round == 0 {
                        (i / 3, i % 3)
                    } else {
                        ((i * 7919 + round * 13) % (n / 2 + 5), i % 4)
                    };
                    let v = ((i + round) % 5 != 0).then_some((i % 7) as u8);
                    let want_was = match v {
                        Some(v) => want.insert(k, v),
                        None => want.remove(&k),
                    };
                    assert_eq!(m.set(k, v), want_was, "n {n} round {round} key {k:?}");
                }
                assert_eq!(m.len(), want.len());
                assert_eq!(m.is_empty(), want.is_empty());
                assert!(m.iter().eq(want.iter()), "n {n} round {round}");
                check_shape(&m);
                for id in [0, 1, n / 4, n / 2 + 4] {
                    let r = (id, 1)..=(id, 2);
                    assert!(m.range(r.clone()).eq(want.range(r)));
                    let r = (Bound::Excluded((id, 0)), Bound::Excluded((id + 1, 1)));
                    assert!(m.range(r).eq(want.range(r)));
                    assert_eq!(m.get(&(id, 1)), want.get(&(id, 1)));
                }
                assert!(m.range(..).eq(want.range(..)));
                let copy: LeafMap<_, _> = want.iter().map(|(k, v)| (*k, *v)).collect();
                assert_eq!(copy, m);
                let reversed: LeafMap<_, _> = want.iter().rev().map(|(k, v)| (*k, *v)).collect();
                assert_eq!(reversed, m);
            }
        }
    }

    /// `set_sorted` agrees with a `BTreeMap` (and reports the old values in order) over runs
    /// of sorted changes: into an empty map, appended after the last key, scattered over
    /// every leaf, emptying leaves and the whole map, on owned and on shared leaves; untouched
    /// leaves stay shared with a clone.
    #[test]
    fn set_sorted_agrees_with_a_btree_map() {
        for n in [1u32, 40, 700, 5000] {
            let mut m: LeafMap<(u32, u32), u8> = LeafMap::new();
            let mut want: BTreeMap<(u32, u32), u8> = BTreeMap::new();
            for round in 0..8u32 {
                let mut changes: Vec<((u32, u32), Option<u8>)> = (0..n)
                    .map(|i| match round {
                        0 => ((i, 0), Some(1)),
                        1 => ((n + i, 1), Some(2)),
                        6 => ((i, 0), None),
                        _ => {
                            let k = ((i * 7919 + round * 13) % (2 * n + 5), i % 3);
                            (k, ((i + round) % 4 != 0).then_some((i % 7) as u8))
                        }
                    })
                    .collect();
                if round == 5 {
                    changes.truncate(2);
                }
                changes.sort_by_key(|c| c.0);
                changes.dedup_by_key(|c| c.0);
                // Shared leaves in one round (copied when changed), owned ones in the others
                // (rewritten in place).
                let before = (round == 5).then(|| m.clone());
                let mut olds = Vec::new();
                m.set_sorted(&changes, |o| olds.push(o));
                let want_olds: Vec<Option<u8>> = changes
                    .iter()
                    .map(|&(k, v)| match v {
                        Some(v) => want.insert(k, v),
                        None => want.remove(&k),
                    })
                    .collect();
                let at = format!("n {n} round {round}");
                assert_eq!(olds, want_olds, "{at}");
                assert_eq!(m.len(), want.len(), "{at}");
                assert!(m.iter().eq(want.iter()), "{at}");
                check_shape(&m);
                if let Some(before) = before.filter(|_| m.leaves.len() > 4) {
                    let kept = m
                        .leaves
                        .iter()
                        .filter(|l| before.leaves.iter().any(|b| Arc::ptr_eq(b, l)))
                        .count();
                    assert!(kept + 2 >= m.leaves.len(), "{at}: {kept} leaves kept");
                }
                for k in [(0, 0), (n / 2, 1), (n + 3, 1)] {
                    assert_eq!(m.get(&k), want.get(&k), "{at}");
                }
            }
        }
    }

    /// Two maps with equal entries share leaves after `share_from` (however their leaves
    /// split), unequal ones do not; a write to one copies the leaves it touches and leaves the
    /// other as it was.
    #[test]
    fn shares_equal_leaves_and_copies_on_write() {
        let n = 3 * LEAF as u32;
        // In key order (full leaves) and scattered (split leaves): the same entries.
        let ordered: LeafMap<u32, u8> = (0..n).map(|i| (i * 2, (i % 3) as u8)).collect();
        let mut scattered: LeafMap<u32, u8> = LeafMap::new();
        for i in (0..n).map(|i| (i * 7919) % n) {
            scattered.insert(i * 2, (i % 3) as u8);
        }
        assert_eq!(scattered, ordered);
        assert!(!scattered.shares(&ordered));
        let mut other = scattered.clone();
        other.insert(1, 9);
        assert!(!other.share_from(&ordered), "more entries");
        other.remove(&1);
        other.insert(2, 7);
        assert!(!other.share_from(&ordered), "a value differs");
        assert!(scattered.share_from(&ordered));
        assert!(scattered.shares(&ordered));
        assert!(scattered.share_from(&ordered), "shared leaves are equal");
        // Copy on write: a change to one leaves the other alone, and only the touched leaf is
        // copied.
        let before: Vec<(u32, u8)> = ordered.iter().map(|(k, v)| (*k, *v)).collect();
        scattered.insert(3, 1);
        scattered.remove(&(2 * (n - 1)));
        scattered.insert(4, 2);
        assert!(
            ordered
                .iter()
                .map(|(k, v)| (*k, *v))
                .eq(before.iter().copied())
        );
        let shared = scattered
            .leaves
            .iter()
            .filter(|l| ordered.leaves.iter().any(|o| Arc::ptr_eq(l, o)))
            .count();
        assert_eq!(
            shared,
            ordered.leaves.len() - 2,
            "the first and last leaves copied"
        );
        let mut back = ordered.clone();
        back.insert(3, 1);
        back.remove(&(2 * (n - 1)));
        back.insert(4, 2);
        assert!(!back.shares(&scattered));
        assert!(back.share_from(&scattered));
        // Misaligned leaves with equal entries, then one entry different at the end.
        let mut a: LeafMap<u32, u8> = (0..n).map(|i| (i, 0)).collect();
        let mut b: LeafMap<u32, u8> = LeafMap::new();
        for i in (0..n).rev() {
            b.insert(i, 0);
        }
        assert!(a.leaves.len() != b.leaves.len() || !a.shares(&b));
        b.insert(n - 1, 1);
        assert!(!a.share_from(&b));
        b.insert(n - 1, 0);
        assert!(a.share_from(&b));
    }

    /// Collecting keeps the last value of a repeated key, as a `BTreeMap` does.
    #[test]
    fn collect_keeps_the_last_value() {
        let m: LeafMap<u32, u8> = [(2, 1), (1, 1), (2, 2), (1, 3)].into_iter().collect();
        assert_eq!(m.iter().collect::<Vec<_>>(), [(&1, &3), (&2, &2)]);
        let shifted: LeafMap<u32, u8> = [(1, 3), (2, 2)].into_iter().collect();
        assert_eq!(m, shifted);
        let other: LeafMap<u32, u8> = [(1, 3), (2, 1)].into_iter().collect();
        assert_ne!(m, other);
    }
}
