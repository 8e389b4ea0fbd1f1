//! A set of identities: the peers a policy entry selects (once per MapState), a selector's
//! members in the engine's selector cache, the identities of one port block's keys.
//!
//! Two forms, whichever is smaller, chosen again as a set grows or shrinks:
//!
//! * **sparse**: a compressed bitmap (the `roaring` crate: sorted arrays of 16-bit members, a
//!   bitmap of 8 KiB per 65,536 identities once a container passes 4,096 members), two bytes a
//!   member;
//! * **dense**: a plain bitmap over the words from the smallest member to the largest, one bit
//!   per identity in that range, for sets that hold at least one in sixteen of it.
//!
//! Identities are numbered upwards from one counter, so the sets of a cluster's selectors cover
//! one range of a few thousand to tens of thousands, and most selectors select a good part of it
//! (an entry whose peers are every pod of a namespace, of a team, of the cluster). In arrays
//! only, the MapStates' policy entries and identity index took 24.7 and 5.4 MiB at 50k pods /
//! 5k policies (6.8 and 0.9 MiB with both forms), and every removal of a relabelled pod's old
//! identity was a binary search through a cold array in each of the thousands of entries that
//! select it: 8.5 % of the samples of the local relabels at 10k pods / 5k policies, nearly all
//! of it waiting for memory. In a bitmap a removal or an insertion touches one word.

use std::fmt;

use serde::Serialize;

use crate::types::Identity;

/// A set of identities (module docs: sparse or dense, whichever is smaller). Equal sets are
/// equal whatever their form.
#[derive(Clone)]
pub struct IdSet(Repr);

#[derive(Clone)]
enum Repr {
    Sparse(roaring::RoaringBitmap),
    Dense(Dense),
}

/// A bitmap from the word of the smallest member to the word of the largest: never empty, its
/// first and last words never zero (so that equal sets have equal words).
#[derive(Clone)]
struct Dense {
    /// The word `words[0]` stands for: member `id` is bit `id % 64` of `words[id / 64 - first]`.
    first: u32,
    words: Vec<u64>,
    len: u32,
}

/// The most members a roaring container keeps as a sorted array (above, a bitmap).
const ARRAY_MAX: u64 = 4096;

/// A sparse set of `len` members whose words span `words` becomes dense when the bitmap is no
/// larger than the arrays (two bytes a member, eight a word).
fn dense_is_smaller(len: u64, words: u64) -> bool {
    len >= 4 * words
}

/// A dense set goes back to sparse when its bitmap is four times what the arrays would take:
/// between the two lines a set keeps its form, so one identity coming and going at the line
/// does not convert it each time.
fn sparse_is_due(len: u64, words: u64) -> bool {
    len < words
}

/// Room for a copy of a set whose last part holds `len` members (or words): between none and
/// `len`, a different amount for each copy (a multiplicative hash of a counter), so that the
/// copies of one set do not fill up at the same change.
fn staggered_room(len: u64) -> u64 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static COPIES: AtomicU32 = AtomicU32::new(0);
    let hash = COPIES
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9);
    (u64::from(hash) * (len + 1)) >> 32
}

impl Default for IdSet {
    fn default() -> IdSet {
        IdSet(Repr::Sparse(roaring::RoaringBitmap::new()))
    }
}

impl Dense {
    /// The members of `set` (not empty) as a bitmap over their words.
    fn of(set: &roaring::RoaringBitmap, lo: u32, hi: u32) -> Dense {
        let first = lo / 64;
        let mut words = vec![0u64; (hi / 64 - first) as usize + 1];
        for id in set {
            words[(id / 64 - first) as usize] |= 1 << (id % 64);
        }
        Dense {
            first,
            words,
            len: set.len() as u32,
        }
    }

    /// The word index of `id`, if the bitmap spans it.
    fn index(&self, id: Identity) -> Option<usize> {
        let i = (id / 64).checked_sub(self.first)? as usize;
        (i < self.words.len()).then_some(i)
    }

    fn contains(&self, id: Identity) -> bool {
        self.index(id)
            .is_some_and(|i| self.words[i] & (1 << (id % 64)) != 0)
    }

    /// Sets `id`'s bit, growing the bitmap to its word. Whether it was new.
    fn insert(&mut self, id: Identity) -> bool {
        let w = id / 64;
        let bit = 1u64 << (id % 64);
        if let Some(i) = self.index(id) {
            let word = &mut self.words[i];
            if *word & bit != 0 {
                return false;
            }
            *word |= bit;
        } else if w >= self.first {
            // Above the largest member: the common case (identities are numbered upwards).
            self.words.resize((w - self.first) as usize + 1, 0);
            *self.words.last_mut().expect("just grown") = bit;
        } else {
            let below = (self.first - w) as usize;
            self.words.splice(0..0, std::iter::repeat_n(0, below));
            self.first = w;
            self.words[0] = bit;
        }
        self.len += 1;
        true
    }

    /// Clears `id`'s bit and the zero words it leaves at either end. Whether it was there.
    fn remove(&mut self, id: Identity) -> bool {
        let Some(i) = self.index(id) else {
            return false;
        };
        let bit = 1u64 << (id % 64);
        if self.words[i] & bit == 0 {
            return false;
        }
        self.words[i] &= !bit;
        self.len -= 1;
        if self.len > 0 && self.words[i] == 0 {
            if i + 1 == self.words.len() {
                while self.words.last() == Some(&0) {
                    self.words.pop();
                }
            } else if i == 0 {
                let zeros = self.words.iter().take_while(|w| **w == 0).count();
                self.words.drain(..zeros);
                self.first += zeros as u32;
            }
        }
        true
    }

    fn to_sparse(&self) -> roaring::RoaringBitmap {
        roaring::RoaringBitmap::from_sorted_iter(self.iter()).expect("ascending")
    }

    fn iter(&self) -> DenseIter<'_> {
        DenseIter {
            words: &self.words,
            first: self.first,
            front: 0,
            front_bits: self.words[0],
            back: self.words.len() - 1,
            back_bits: self.words[self.words.len() - 1],
            left: self.len as usize,
        }
    }
}

impl IdSet {
    /// The empty set.
    pub fn new() -> IdSet {
        IdSet::default()
    }

    /// `set` in the smaller form.
    fn from_sparse(set: roaring::RoaringBitmap) -> IdSet {
        let mut s = IdSet(Repr::Sparse(set));
        s.dense_if_smaller();
        s
    }

    /// Makes a sparse set dense if the bitmap over its range is no larger.
    fn dense_if_smaller(&mut self) {
        let Repr::Sparse(set) = &self.0 else {
            return;
        };
        let (Some(lo), Some(hi)) = (set.min(), set.max()) else {
            return;
        };
        if dense_is_smaller(set.len(), u64::from(hi / 64 - lo / 64) + 1) {
            self.0 = Repr::Dense(Dense::of(set, lo, hi));
        }
    }

    /// Adds `id`; whether it was new. Identities are numbered upwards, so a set mostly gains a
    /// member above all of its own (a relabelled pod's new identity, selected by thousands of
    /// entries at once): a dense set sets one bit (and adds a word every 64 identities); in a
    /// sparse one it is appended to the last array without a search. Only there: appending to
    /// a roaring bitmap container first scans it for its maximum (a third of a cluster-wide
    /// policy edit at 50k pods went into that scan), where an insert sets one bit, and a set of
    /// at most [`ARRAY_MAX`] members has no bitmap container.
    pub fn insert(&mut self, id: Identity) -> bool {
        match &mut self.0 {
            Repr::Dense(d) => {
                // Inside the range the form cannot change: a dense set has at least as many
                // members as words (a removal converts it below that).
                debug_assert!(!sparse_is_due(u64::from(d.len), d.words.len() as u64));
                if d.index(id).is_none() {
                    let w = id / 64;
                    let span = u64::from(w.max(d.first + d.words.len() as u32 - 1))
                        - u64::from(w.min(d.first))
                        + 1;
                    if sparse_is_due(u64::from(d.len) + 1, span) {
                        // Far outside the range (a CIDR identity, numbered apart): arrays again.
                        self.0 = Repr::Sparse(d.to_sparse());
                        return self.insert(id);
                    }
                }
                d.insert(id)
            }
            Repr::Sparse(set) => {
                let new = (set.len() <= ARRAY_MAX && set.try_push(id).is_ok()) || set.insert(id);
                if new && set.len() % 32 == 0 {
                    self.dense_if_smaller();
                }
                new
            }
        }
    }

    /// A copy with room to grow, a different amount for each copy.
    ///
    /// A clone is exactly as long as its members, so the first identity added to each copy moved
    /// it whole, and a relabel adds one to thousands of copies at once (the policy entries of
    /// every MapState that selects it): the first changes after the agent gave its free memory
    /// back spent a quarter of their time moving arrays (docs/agent.md, "Not done yet", the
    /// thirty-second). Room up to the next power of two (arrays appended member by member) only
    /// moved the problem: the copies of one set filled up at the same change and all moved at
    /// once, one local relabel at 10k pods / 5k policies, among the slowest in most runs (its
    /// engine 26-51 ms, the other slowest changes' 10-23; the thirty-fifth). Each copy now gets
    /// room of its own (`staggered_room`), made exact (a clone's capacity is its length, a
    /// `Vec::with_capacity`'s what it was asked), and a full one doubles, so copies that start
    /// apart stay apart. Identities are numbered upwards, so new members go to the end: a
    /// sparse copy gets between none and as much room as its last array holds (the others are
    /// exact, as a clone's; the padding never crosses into the next container, and a last
    /// container past [`ARRAY_MAX`] is a bitmap, which never moves), a dense copy between none
    /// and a quarter of its words more (a word holds 64 new identities).
    pub fn copy_with_room(&self) -> IdSet {
        let set = match &self.0 {
            Repr::Dense(d) => {
                let n = d.words.len();
                let mut words = Vec::with_capacity(n + staggered_room(n as u64 / 4) as usize);
                words.extend_from_slice(&d.words);
                return IdSet(Repr::Dense(Dense { words, ..*d }));
            }
            Repr::Sparse(set) => set,
        };
        let Some(max) = set.max() else {
            return IdSet::new();
        };
        let last = set.range_cardinality((max & !0xFFFF)..=max);
        let room = staggered_room(last)
            .min(ARRAY_MAX.saturating_sub(last))
            .min(u64::from(0xFFFF - (max & 0xFFFF)));
        if room == 0 {
            return self.clone();
        }
        let mut padded = set.clone();
        padded.insert_range(max + 1..=max + room as u32);
        let mut copy = padded.clone();
        drop(padded);
        copy.remove_biggest(room);
        IdSet(Repr::Sparse(copy))
    }

    /// Removes `id`; whether it was there.
    pub fn remove(&mut self, id: Identity) -> bool {
        match &mut self.0 {
            Repr::Sparse(set) => set.remove(id),
            Repr::Dense(d) => {
                if !d.remove(id) {
                    return false;
                }
                if d.len == 0 {
                    *self = IdSet::new();
                } else if sparse_is_due(u64::from(d.len), d.words.len() as u64) {
                    self.0 = Repr::Sparse(d.to_sparse());
                }
                true
            }
        }
    }

    /// Whether `id` is in the set.
    pub fn contains(&self, id: Identity) -> bool {
        match &self.0 {
            Repr::Sparse(set) => set.contains(id),
            Repr::Dense(d) => d.contains(id),
        }
    }

    /// Number of identities.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Sparse(set) => set.len() as usize,
            Repr::Dense(d) => d.len as usize,
        }
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The identities, ascending.
    pub fn iter(&self) -> Iter<'_> {
        Iter(match &self.0 {
            Repr::Sparse(set) => IterRepr::Sparse(set.iter()),
            Repr::Dense(d) => IterRepr::Dense(d.iter()),
        })
    }

    /// The identities in both sets.
    pub fn intersection(&self, other: &IdSet) -> IdSet {
        match (&self.0, &other.0) {
            (Repr::Sparse(a), Repr::Sparse(b)) => IdSet::from_sparse(a & b),
            _ => {
                let (small, large) = if self.len() <= other.len() {
                    (self, other)
                } else {
                    (other, self)
                };
                small.iter().filter(|id| large.contains(*id)).collect()
            }
        }
    }

    /// The identities of `self` that are not in `other`, ascending.
    pub fn difference<'a>(&'a self, other: &'a IdSet) -> impl Iterator<Item = Identity> + 'a {
        self.iter().filter(move |id| !other.contains(*id))
    }

    /// Whether the set is kept as a bitmap over its range (for the tests).
    #[cfg(test)]
    fn is_dense(&self) -> bool {
        matches!(self.0, Repr::Dense(_))
    }

    /// The bytes the set holds room for where it grows (for the tests): its arrays' capacity
    /// (roaring counts it), or its words'.
    #[cfg(test)]
    fn room_bytes(&self) -> u64 {
        match &self.0 {
            Repr::Sparse(set) => set.statistics().n_bytes_array_containers,
            Repr::Dense(d) => d.words.capacity() as u64 * 8,
        }
    }
}

impl PartialEq for IdSet {
    fn eq(&self, other: &IdSet) -> bool {
        match (&self.0, &other.0) {
            (Repr::Sparse(a), Repr::Sparse(b)) => a == b,
            (Repr::Dense(a), Repr::Dense(b)) => a.first == b.first && a.words == b.words,
            _ => self.len() == other.len() && self.iter().eq(other.iter()),
        }
    }
}

impl Eq for IdSet {}

/// The members of an [`IdSet`], ascending (or from the back).
pub struct Iter<'a>(IterRepr<'a>);

enum IterRepr<'a> {
    Sparse(roaring::bitmap::Iter<'a>),
    Dense(DenseIter<'a>),
}

/// A dense set's members: the lowest from the front, the highest from the back, `left` of them
/// not given yet (the two ends may hold copies of one word: the count keeps them from meeting).
struct DenseIter<'a> {
    words: &'a [u64],
    first: u32,
    front: usize,
    front_bits: u64,
    back: usize,
    back_bits: u64,
    left: usize,
}

impl Iterator for DenseIter<'_> {
    type Item = Identity;

    fn next(&mut self) -> Option<Identity> {
        if self.left == 0 {
            return None;
        }
        while self.front_bits == 0 {
            self.front += 1;
            self.front_bits = self.words[self.front];
        }
        let bit = self.front_bits.trailing_zeros();
        self.front_bits &= self.front_bits - 1;
        self.left -= 1;
        Some((self.first + self.front as u32) * 64 + bit)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl DoubleEndedIterator for DenseIter<'_> {
    fn next_back(&mut self) -> Option<Identity> {
        if self.left == 0 {
            return None;
        }
        while self.back_bits == 0 {
            self.back -= 1;
            self.back_bits = self.words[self.back];
        }
        let bit = 63 - self.back_bits.leading_zeros();
        self.back_bits &= !(1 << bit);
        self.left -= 1;
        Some((self.first + self.back as u32) * 64 + bit)
    }
}

impl Iterator for Iter<'_> {
    type Item = Identity;

    fn next(&mut self) -> Option<Identity> {
        match &mut self.0 {
            IterRepr::Sparse(i) => i.next(),
            IterRepr::Dense(i) => i.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::Sparse(i) => i.size_hint(),
            IterRepr::Dense(i) => i.size_hint(),
        }
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Identity> {
        match &mut self.0 {
            IterRepr::Sparse(i) => i.next_back(),
            IterRepr::Dense(i) => i.next_back(),
        }
    }
}

impl FromIterator<Identity> for IdSet {
    fn from_iter<I: IntoIterator<Item = Identity>>(iter: I) -> IdSet {
        IdSet::from_sparse(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a IdSet {
    type Item = Identity;
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl Extend<Identity> for IdSet {
    fn extend<I: IntoIterator<Item = Identity>>(&mut self, iter: I) {
        for id in iter {
            self.insert(id);
        }
    }
}

impl fmt::Debug for IdSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// As the sorted list of identities.
impl Serialize for IdSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::IdSet;
    use std::collections::BTreeSet;

    /// A xorshift sequence (the tests' members and operations).
    fn xorshift(x: &mut u32) -> u32 {
        *x ^= *x << 13;
        *x ^= *x >> 17;
        *x ^= *x << 5;
        *x
    }

    /// `IdSet::insert` appends a member above the others without a search and inserts any other:
    /// both say whether the member was new, as a `BTreeSet` does (members ascending, descending,
    /// repeated, across roaring's 65,536-member containers).
    #[test]
    fn insert_agrees_with_a_btree_set() {
        let mut set = IdSet::new();
        let mut model = BTreeSet::new();
        let mut x: u32 = 0x9e37_79b9;
        let mut ids: Vec<u32> = (0..300).chain((250..600).rev()).collect();
        ids.extend((0..2000).map(|_| xorshift(&mut x) % 200_000));
        ids.extend([70_000, 70_000, 65_535, 65_536, 1 << 20, 5]);
        // Past the arrays' limit (bitmap containers, and sets above it that append): ascending
        // runs, repeats and members below the largest.
        ids.extend(1_000..7_000);
        ids.extend((6_990..9_000).rev());
        ids.extend((0..3_000).map(|i| (i * 37) % 12_000));
        for id in ids {
            assert_eq!(set.insert(id), model.insert(id), "insert {id}");
        }
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            model.iter().copied().collect::<Vec<_>>()
        );

        // A copy with room is the same set (arrays, bitmap containers, several containers), and
        // takes members and loses them as the original does.
        let mut copy = set.copy_with_room();
        assert_eq!(copy, set);
        assert_eq!(IdSet::new().copy_with_room(), IdSet::new());
        for id in [1 << 21, 3, 65_537, 8_500, 199_999, 1 << 22] {
            assert_eq!(
                copy.insert(id),
                model.insert(id),
                "insert {id} into the copy"
            );
            assert_eq!(
                copy.remove(id + 1),
                model.remove(&(id + 1)),
                "remove {}",
                id + 1
            );
        }
        assert_eq!(
            copy.iter().collect::<Vec<_>>(),
            model.into_iter().collect::<Vec<_>>()
        );
    }

    /// Random inserts and removals, dense around a moving range with some members far from it
    /// (as CIDR identities are numbered apart): after each operation the set, its copy with
    /// room, a set collected from its members and the operations between sets agree with a
    /// `BTreeSet`, whichever form each is in; both forms and both conversions are exercised;
    /// iterating from both ends at once gives each member once.
    #[test]
    fn both_forms_agree_with_a_btree_set() {
        let mut x: u32 = 0x2545_f491;
        let (mut went_dense, mut went_sparse) = (0, 0);
        for round in 0..40 {
            let mut set = IdSet::new();
            let mut model = BTreeSet::new();
            let other: BTreeSet<u32> = (0..300).map(|_| xorshift(&mut x) % 3_000).collect();
            let other_set: IdSet = other.iter().copied().collect();
            let mut dense = false;
            for step in 0..1_500u32 {
                let r = xorshift(&mut x);
                // The range drifts upwards; a quarter of the rounds thin out towards the end.
                let base = step * 2;
                let id = if round % 3 == 1 && r.is_multiple_of(128) {
                    (1 << 24) | ((r >> 8) % 100)
                } else {
                    base + (r >> 4) % 1_000
                };
                let removing = if round % 4 == 0 && step > 700 {
                    !r.is_multiple_of(16)
                } else {
                    r.is_multiple_of(3)
                };
                if removing {
                    let victim = if r.is_multiple_of(2) {
                        model
                            .iter()
                            .nth((r >> 3) as usize % model.len().max(1))
                            .copied()
                    } else {
                        Some(id)
                    };
                    if let Some(v) = victim {
                        assert_eq!(set.remove(v), model.remove(&v), "remove {v}");
                    }
                } else {
                    assert_eq!(set.insert(id), model.insert(id), "insert {id}");
                }
                if set.is_dense() != dense {
                    dense = set.is_dense();
                    if dense {
                        went_dense += 1;
                    } else {
                        went_sparse += 1;
                    }
                }
                assert_eq!(set.len(), model.len());
                if step % 97 != 0 {
                    continue;
                }
                let members: Vec<u32> = model.iter().copied().collect();
                assert_eq!(set.iter().collect::<Vec<_>>(), members);
                assert_eq!(set.iter().rev().collect::<Vec<_>>(), {
                    let mut m = members.clone();
                    m.reverse();
                    m
                });
                let mut ends = set.iter();
                let (mut low, mut high) = (Vec::new(), Vec::new());
                while let Some(a) = ends.next() {
                    low.push(a);
                    let Some(b) = ends.next_back() else { break };
                    high.push(b);
                }
                high.reverse();
                low.extend(high);
                assert_eq!(low, members, "from both ends");
                assert!(set.iter().all(|id| set.contains(id)));
                assert!(!set.contains(u32::MAX));
                let copy = set.copy_with_room();
                assert_eq!(copy, set);
                let collected: IdSet = members.iter().copied().collect();
                assert_eq!(collected, set);
                assert_eq!(
                    set.intersection(&other_set).iter().collect::<Vec<_>>(),
                    model.intersection(&other).copied().collect::<Vec<_>>()
                );
                assert_eq!(
                    set.difference(&other_set).collect::<Vec<_>>(),
                    model.difference(&other).copied().collect::<Vec<_>>()
                );
                assert_eq!(set == other_set, model == other);
            }
        }
        assert!(went_dense >= 20, "{went_dense} sets became dense");
        assert!(went_sparse >= 10, "{went_sparse} sets became sparse again");
    }

    /// Equal sets are equal in either form, and each form's empty set is the empty set.
    #[test]
    fn equal_whatever_the_form() {
        let dense: IdSet = (1_000..2_000).collect();
        assert!(dense.is_dense());
        let mut sparse: IdSet = (1_000..2_000).step_by(100).collect();
        assert!(!sparse.is_dense());
        for id in 1_000..2_000 {
            sparse.insert(id);
        }
        assert_eq!(sparse, dense);
        let mut emptied = dense.clone();
        for id in 1_000..2_000 {
            assert!(emptied.remove(id));
        }
        assert_eq!(emptied, IdSet::new());
        assert!(emptied.is_empty());
        assert_eq!(emptied.iter().next(), None);
    }

    /// The copies of one set get different room where they grow, so that adding the same new
    /// identity to all of them moves only a few: a sparse set's last array, a dense set's words.
    /// A copy is the same set whatever its room, also where there is none to give (a last
    /// array at the containers' edge, or full, or a bitmap).
    #[test]
    fn copies_of_one_set_fill_up_at_different_changes() {
        // Sparse: a member in twenty over the range.
        let sparse: IdSet = (0..1_000).map(|i| 1_000 + i * 20).collect();
        assert!(!sparse.is_dense());
        // Dense: every identity of its range (299 words).
        let dense: IdSet = (1_000..20_000).collect();
        assert!(dense.is_dense());
        for (set, new, most) in [(&sparse, 21_000, 2.0), (&dense, 20_032, 1.25)] {
            let mut copies: Vec<IdSet> = (0..64).map(|_| set.copy_with_room()).collect();
            let room: Vec<u64> = copies.iter().map(IdSet::room_bytes).collect();
            let exact = set.clone().room_bytes();
            assert!(
                room.iter()
                    .all(|&r| r >= exact && r as f64 <= exact as f64 * most),
                "{room:?} against {exact}"
            );
            let distinct: BTreeSet<u64> = room.iter().copied().collect();
            assert!(
                distinct.len() >= 32,
                "{} distinct capacities",
                distinct.len()
            );
            for copy in &mut copies {
                assert_eq!(copy, set);
                assert!(copy.insert(new));
            }
            let moved = copies
                .iter()
                .zip(&room)
                .filter(|(c, r)| c.room_bytes() != **r)
                .count();
            assert!(moved <= 8, "{moved} of 64 copies moved");
        }

        // (Sparse: a member far below the last container.)
        let edge: IdSet = (0xF000..=0xFFFF).step_by(32).chain([0xFFFF]).collect();
        let full: IdSet = [5]
            .into_iter()
            .chain((0..4096).map(|i| (1 << 20) + i * 16))
            .collect();
        let bitmap: IdSet = [5]
            .into_iter()
            .chain((0..5000).map(|i| (1 << 20) + i * 13))
            .collect();
        for set in [edge, full, bitmap] {
            assert!(!set.is_dense());
            for _ in 0..8 {
                assert_eq!(set.copy_with_room(), set);
            }
        }
    }
}
