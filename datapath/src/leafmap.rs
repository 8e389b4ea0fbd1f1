//! [`LeafMap`]: a sorted map of small `Copy` entries kept in bounded sorted leaves, for the
//! datapath's copies of policy keys (a node holds millions of identity keys at 50,000 pods: a
//! rule set's keys in the store, and the class translation's model of them). An entry costs
//! its own size (12 bytes for a policy key and its value) where a `BTreeMap` node costs ~22
//! bytes a key; a change moves at most [`LEAF`] entries; a map filled in key order (a rule set
//! flattened, installed) appends to full leaves.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::{Bound, RangeBounds};

/// Entries per leaf at most: a change moves at most this many entries (a rule set holds up to
/// tens of thousands: one sorted vector per rule set made a namespace relabel, whose runs
/// change a few keys in each of hundreds of rule sets, 30-50 % slower than smaller vectors).
pub const LEAF: usize = 512;

/// A sorted map in leaves of at most [`LEAF`] entries, none empty.
#[derive(Clone)]
pub struct LeafMap<K, V> {
    leaves: Vec<Vec<(K, V)>>,
    len: usize,
}

impl<K, V> Default for LeafMap<K, V> {
    fn default() -> Self {
        LeafMap {
            leaves: Vec::new(),
            len: 0,
        }
    }
}

/// An iterator over a [`LeafMap`]'s entries, in key order.
pub type Iter<'a, K, V> = std::iter::Map<
    std::iter::Flatten<std::slice::Iter<'a, Vec<(K, V)>>>,
    fn(&'a (K, V)) -> (&'a K, &'a V),
>;

fn pair<K, V>(e: &(K, V)) -> (&K, &V) {
    (&e.0, &e.1)
}

impl<K: Ord + Copy, V: Copy> LeafMap<K, V> {
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
        let li = self
            .leaves
            .partition_point(|l| l.last().expect("no empty leaf").0 < *k)
            .min(self.leaves.len().saturating_sub(1));
        let at = self
            .leaves
            .get(li)
            .map_or(Err(0), |l| l.binary_search_by(|e| e.0.cmp(k)));
        (li, at)
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
            (li, Ok(i)) => Some(std::mem::replace(&mut self.leaves[li][i].1, v)),
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
        let was = self.leaves[li].remove(i).1;
        if self.leaves[li].is_empty() {
            self.leaves.remove(li);
        }
        self.len -= 1;
        Some(was)
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
            self.leaves.push(vec![e]);
            return;
        };
        if leaf.len() < LEAF {
            leaf.insert(i, e);
        } else if last && i == leaf.len() {
            // Appending (filled in key order): full leaves stay full.
            self.leaves.push(vec![e]);
        } else {
            let mut right = leaf.split_off(LEAF / 2);
            leaf.shrink_to_fit();
            match i.checked_sub(LEAF / 2) {
                Some(j) => right.insert(j, e),
                None => leaf.insert(i, e),
            }
            self.leaves.insert(li + 1, right);
        }
    }

    /// The entries in key order.
    pub fn iter(&self) -> Iter<'_, K, V> {
        self.leaves
            .iter()
            .flatten()
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

    /// Gives back the room the leaves grew into beyond what they hold.
    pub fn shrink_to_fit(&mut self) {
        for leaf in &mut self.leaves {
            leaf.shrink_to_fit();
        }
        self.leaves.shrink_to_fit();
    }

    /// The map of `entries` already sorted by key, each key once (checked: unsorted or
    /// repeated keys go through [`FromIterator`]'s sort).
    fn from_sorted(entries: Vec<(K, V)>) -> Self {
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
        LeafMap { leaves, len }
    }
}

impl<K: Ord + Copy, V: Copy> FromIterator<(K, V)> for LeafMap<K, V> {
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

impl<K: Ord + Copy, V: Copy> Extend<(K, V)> for LeafMap<K, V> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<'a, K: Ord + Copy, V: Copy> IntoIterator for &'a LeafMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Equal entries (wherever the leaves split).
impl<K: Ord + Copy, V: Copy + PartialEq> PartialEq for LeafMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<K: Ord + Copy, V: Copy + Eq> Eq for LeafMap<K, V> {}

impl<K: Ord + Copy + Hash, V: Copy + Hash> Hash for LeafMap<K, V> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.len.hash(state);
        for e in self.iter() {
            e.hash(state);
        }
    }
}

impl<K: Ord + Copy + fmt::Debug, V: Copy + fmt::Debug> fmt::Debug for LeafMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
                assert!(m.leaves.iter().all(|l| !l.is_empty() && l.len() <= LEAF));
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
