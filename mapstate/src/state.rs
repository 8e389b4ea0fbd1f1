//! The MapState of one endpoint and direction, built by ordered insertion and kept up to date by
//! region-scoped ordered recomputation. See the crate documentation for the algorithm and why it
//! is correct.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use prefix_trie::PrefixMap;
use serde::Serialize;
use smallvec::SmallVec;

use crate::changes::ChangeSet;
use crate::idset::IdSet;
use crate::prefix::L4Prefix;
use crate::types::{
    Direction, EntryId, Identity, OrderKey, Origin, Peer, PolicyEntry, Selector, Verdict,
};

use crate::types::{FastMap, FastSet};

/// A key of the MapState (the direction is the MapState's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Key {
    /// One identity, or `*` (every identity without a matching key of its own).
    pub peer: Peer,
    /// The protocol/port block.
    pub prefix: L4Prefix,
}

/// A value of the MapState: what the datapath needs (the verdict) plus what a person debugging
/// needs (order key, origins, flags).
///
/// The two lists are shared slices (`Arc<[_]>`; build one from a `Vec` with `.into()`): values
/// are cloned into every ChangeSet, diff and synthesized copy, and a clone is then two
/// reference-count increments instead of two allocations.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct StateEntry {
    /// What the datapath does with a matching packet.
    pub verdict: Verdict,
    /// The order key of the rule(s) this key comes from (smaller is stronger).
    pub order: OrderKey,
    /// The policy entries merged into this key (equal order key and verdict), sorted.
    pub entries: Arc<[EntryId]>,
    /// Their origins, sorted and de-duplicated.
    pub origins: Arc<[Arc<Origin>]>,
    /// A covering entry: a wildcard (`*`) entry copied under a specific identity because it is
    /// stronger than a broader specific entry of that identity.
    pub synthesized: bool,
}

/// Why a policy entry does not appear at one of its keys.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Covered {
    /// The policy entry that has no key here.
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
    Matched {
        /// The longest matching key (the identity's own, else `*`).
        key: Key,
        /// Its value.
        entry: &'a StateEntry,
    },
    /// Nothing matched: the endpoint's isolation default applies.
    Default(Verdict),
}

impl Decision<'_> {
    /// The verdict, from the key or the default.
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
    /// `AddEntry` of an id that is already an input entry.
    DuplicateEntry(EntryId),
    /// An update names an entry that is not an input entry.
    UnknownEntry(EntryId),
    /// Select/Deselect on an entry whose selector is the wildcard.
    WildcardSelection(EntryId),
    /// An entry id from the range the MapState keeps for its own copies (`COPY_BASE` up).
    ReservedEntryId(EntryId),
    /// A `Pass` entry of the ordnet tier (only the Admin and Baseline tiers have Pass).
    PassInOrdnetTier(EntryId),
}

impl std::fmt::Display for UpdateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpdateError::DuplicateEntry(id) => write!(f, "policy entry {id} already present"),
            UpdateError::UnknownEntry(id) => write!(f, "unknown policy entry {id}"),
            UpdateError::WildcardSelection(id) => {
                write!(f, "policy entry {id} selects every identity already")
            }
            UpdateError::ReservedEntryId(id) => {
                write!(
                    f,
                    "policy entry id {id} is in the range reserved for copies"
                )
            }
            UpdateError::PassInOrdnetTier(id) => {
                write!(f, "policy entry {id} is a Pass of the ordnet tier")
            }
        }
    }
}

impl std::error::Error for UpdateError {}

/// One incremental change of the input.
#[derive(Debug, Clone)]
pub enum Update {
    /// A new input entry (its id must be new).
    AddEntry(PolicyEntry),
    /// An input entry goes.
    RemoveEntry(EntryId),
    /// The entry's selector now also selects these identities.
    Select {
        /// The entry (its selector must be a set of identities).
        entry: EntryId,
        /// Identities it selects from now on.
        ids: Vec<Identity>,
    },
    /// The entry's selector no longer selects these identities.
    Deselect {
        /// The entry (its selector must be a set of identities).
        entry: EntryId,
        /// Identities it no longer selects.
        ids: Vec<Identity>,
    },
    /// A new identity, selected by these entries' selectors.
    AddIdentity {
        /// The identity.
        id: Identity,
        /// The entries whose selectors select it.
        selected_by: Vec<EntryId>,
    },
    /// An identity is gone: no selector selects it any more.
    RemoveIdentity(Identity),
}

/// One contribution of a policy entry at one (peer, block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Contrib {
    order: OrderKey,
    verdict: Verdict,
    entry: EntryId,
}

impl Contrib {
    fn rank(&self) -> Rank {
        (self.order, self.verdict)
    }
}

/// The contributions at one block, strongest first (most blocks have one or two).
type Contribs = SmallVec<[Contrib; 2]>;

/// The candidate contributions of one peer, sorted by block. In the block order a block sorts
/// just before its subtree, so a subtree is one contiguous run and the ancestors of a block all
/// sort before it. (A sorted vector rather than a trie: most identities have one to a few
/// blocks, and a `PrefixMap` costs ~400 bytes and several allocations even when small.)
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Candidates(Vec<(L4Prefix, Contribs)>);

impl Candidates {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (L4Prefix, &Contribs)> + '_ {
        self.0.iter().map(|(p, c)| (*p, c))
    }

    fn find(&self, block: &L4Prefix) -> Result<usize, usize> {
        self.0.binary_search_by(|(p, _)| p.cmp(block))
    }

    fn entry(&mut self, block: L4Prefix) -> &mut Contribs {
        let i = match self.find(&block) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (block, Contribs::new()));
                i
            }
        };
        &mut self.0[i].1
    }

    fn get_mut(&mut self, block: &L4Prefix) -> Option<&mut Contribs> {
        let i = self.find(block).ok()?;
        Some(&mut self.0[i].1)
    }

    fn remove(&mut self, block: &L4Prefix) {
        if let Ok(i) = self.find(block) {
            self.0.remove(i);
        }
    }

    /// Calls `f` for the blocks strictly above `region` and then for `region` and its subtree.
    fn region<'a>(&'a self, region: L4Prefix, mut f: impl FnMut(L4Prefix, &'a Contribs)) {
        let start = self.0.partition_point(|(p, _)| *p < region);
        if start <= 32 {
            for (p, c) in &self.0[..start] {
                if p.covers(&region) {
                    f(*p, c);
                }
            }
        } else {
            for len in 0..region.len() {
                let a = <L4Prefix as prefix_trie::Prefix>::from_repr_len(region.raw(), len);
                if let Ok(i) = self.find(&a) {
                    f(a, &self.0[i].1);
                }
            }
        }
        for (p, c) in &self.0[start..] {
            if !region.covers(p) {
                break;
            }
            f(*p, c);
        }
    }
}

/// The keys of one peer, sorted by block like [`Candidates`] (a block just before its
/// subtree). Most identities have one to a few keys: a sorted vector iterates, compares, copies
/// and frees far faster than a trie, and a subtree is one contiguous run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Keys(Vec<(L4Prefix, StateEntry)>);

/// Up to this many keys, the ancestors of a block are found by a scan instead of one binary
/// search per prefix length.
const SCAN_KEYS: usize = 32;

impl Keys {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (L4Prefix, &StateEntry)> + '_ {
        self.0.iter().map(|(p, e)| (*p, e))
    }

    fn find(&self, block: &L4Prefix) -> Result<usize, usize> {
        self.0.binary_search_by(|(p, _)| p.cmp(block))
    }

    fn get(&self, block: &L4Prefix) -> Option<&StateEntry> {
        self.find(block).ok().map(|i| &self.0[i].1)
    }

    /// The keys that cover `block` (itself included), broadest first.
    fn cover(&self, block: L4Prefix) -> impl Iterator<Item = (L4Prefix, &StateEntry)> + '_ {
        // Every ancestor sorts before the block (masked bits are not larger; equal bits sort
        // broader first).
        let end = self.0.partition_point(|(p, _)| *p <= block);
        let (scan, lens) = if end <= SCAN_KEYS {
            (&self.0[..end], 0..0)
        } else {
            (&self.0[..0], 0..block.len() + 1)
        };
        let scanned = scan
            .iter()
            .filter(move |(p, _)| p.covers(&block))
            .map(|(p, e)| (*p, e));
        let searched = lens.filter_map(move |len| {
            let a = <L4Prefix as prefix_trie::Prefix>::from_repr_len(block.raw(), len);
            self.find(&a).ok().map(|i| (a, &self.0[i].1))
        });
        scanned.chain(searched)
    }

    /// The longest key that covers `block`.
    fn get_lpm(&self, block: &L4Prefix) -> Option<(L4Prefix, &StateEntry)> {
        self.cover(*block).last()
    }

    /// The run of `region` and its subtree.
    fn run(&self, region: &L4Prefix) -> std::ops::Range<usize> {
        let start = self.0.partition_point(|(p, _)| *p < *region);
        let end = start
            + self.0[start..]
                .iter()
                .take_while(|(p, _)| region.covers(p))
                .count();
        start..end
    }

    /// `region` and the keys inside it, in order.
    fn children(&self, region: &L4Prefix) -> impl Iterator<Item = (L4Prefix, &StateEntry)> + '_ {
        self.0[self.run(region)].iter().map(|(p, e)| (*p, e))
    }
}

/// `(order key, verdict)`: lower is stronger.
type Rank = (OrderKey, Verdict);

/// Blocks up to this length (every protocol, one protocol, or a /4 of its ports) look up the
/// `*` keys inside them through the rank index rather than by enumerating their subtree.
const BROAD_LEN: u8 = 12;

/// A block visited by the walk of [`MapState::compute`].
struct Node<'a> {
    prefix: L4Prefix,
    /// The peer's own contributions at this block, strongest first.
    own: &'a [Contrib],
    /// For an identity: the `*` key at this block.
    wild: Option<&'a StateEntry>,
}

/// A key on the chain above the block being visited.
struct KeyFrame {
    prefix: L4Prefix,
    rank: Rank,
    /// Whether the key is a key of the peer (for an identity: it or a key above it is specific).
    kept: bool,
    /// For an identity: this key or one above it is specific.
    chain_specific: bool,
}

/// The precedence-aware LPM state of one endpoint and one direction, over entries that decide
/// by themselves (Allow or Deny, every tier and Pass already resolved into their order keys:
/// `crate::tiers`). [`crate::MapState`] wraps it.
#[derive(Debug, Clone)]
pub(crate) struct Core {
    direction: Direction,
    default: Verdict,
    entries: BTreeMap<EntryId, PolicyEntry>,
    /// Candidate contributions per peer and block (the input, indexed). Shared between the
    /// peers whose candidates are equal (see `pool`): the identities one set of selectors
    /// holds all have the same ones.
    cand: FastMap<Peer, Arc<Candidates>>,
    /// Identities that have specific candidates at each block. (A bitmap per block: with a
    /// count of contributions per identity it was the largest part of a MapState at 50,000
    /// pods; the candidates have the counts.)
    spec_index: PrefixMap<L4Prefix, IdSet>,
    /// The state: the keys of each peer, shared like the candidates (equal candidates give
    /// equal keys).
    tries: FastMap<Peer, Arc<Keys>>,
    /// The `*` keys by protocol (256 for the "every protocol" key) and rank, strongest first:
    /// finds the `*` keys stronger than an own key without visiting the weaker ones.
    /// (With a copy of each `*` entry: `*` has few keys, and the walk then needs no trie lookup.)
    star_rank: BTreeMap<u16, BTreeMap<(Rank, L4Prefix), StateEntry>>,
    /// Covered contributions per peer, at the block where they would have been.
    /// (Sorted by block like [`Candidates`]: a region's notes are one contiguous run.)
    /// (Without the peer in each note, so that the notes of peers with equal candidates are
    /// equal and shared like them.)
    covered: FastMap<Peer, Arc<Notes>>,
    /// Entries whose L4 match has no block (an empty port range): they contribute nothing, so
    /// the candidates of an identity do not list them although their selector may hold it.
    blockless: BTreeSet<EntryId>,
    /// The entry and origin lists of the keys, one allocation per distinct list: the keys of
    /// the identities one selector holds carry equal lists, and a MapState of 6,500 keys had
    /// 13,000 two-word allocations for a few dozen distinct lists. Lists no key uses any more
    /// are dropped when the table has doubled since the last sweep.
    lists: FastMap<Arc<[EntryId]>, Arc<[Arc<Origin>]>>,
    lists_swept_at: usize,
    /// The number of keys (`len`).
    key_count: usize,
    /// The distinct candidate lists and key lists of the peers. At 10,000 pods a node's
    /// MapStates held 750,000 keys for 2,000 identities, ~3 keys per identity and state, and
    /// most identities of a state have the same candidates; each distinct list is kept once.
    /// A peer whose list changes gets its own copy (`Arc::make_mut`) and is shared again when
    /// recomputed. Lists no peer uses are dropped when a pool has doubled since its last sweep.
    pool: Pool,
    /// For a shared candidate list (by address), an identity that holds it. An identity whose
    /// whole space is dirty and whose candidates equal that one's takes its keys and notes
    /// instead of being computed (equal candidates give equal keys and notes), as long as that
    /// identity still holds that very list and is up to date. (A relabel adds an identity to
    /// every state of the node; nearly always another identity has the same candidates.)
    /// Stale entries are dropped when the map has doubled since the last sweep.
    twins: FastMap<usize, Identity>,
    twins_swept_at: usize,
}

/// A [`Covered`] note of one peer, without the peer (the map key gives it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Note {
    entry: EntryId,
    /// The covering key's block...
    by: L4Prefix,
    /// ...and whether it is a `*` key of an identity's note (else a key of the peer itself).
    by_star: bool,
}

/// The covered notes of one peer, sorted by block like [`Candidates`].
type Notes = Vec<(L4Prefix, Vec<Note>)>;

/// The shared candidate, key and note lists of a MapState.
#[derive(Debug, Clone, Default)]
struct Pool {
    cand: FastSet<Arc<Candidates>>,
    keys: FastSet<Arc<Keys>>,
    notes: FastSet<Arc<Notes>>,
    cand_swept_at: usize,
    keys_swept_at: usize,
    notes_swept_at: usize,
}

/// `slot`'s list, replaced by the equal one of `pool` (or added to it).
fn share<T: Eq + std::hash::Hash>(
    pool: &mut FastSet<Arc<T>>,
    swept_at: &mut usize,
    slot: &mut Arc<T>,
) {
    if let Some(p) = pool.get(&**slot) {
        if !Arc::ptr_eq(p, slot) {
            *slot = Arc::clone(p);
        }
        return;
    }
    if pool.len() >= 2 * (*swept_at).max(64) {
        pool.retain(|a| Arc::strong_count(a) > 1);
        *swept_at = pool.len();
    }
    pool.insert(Arc::clone(slot));
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

impl Core {
    /// An empty MapState whose isolation default is `default`.
    pub fn new(direction: Direction, default: Verdict) -> Core {
        Core {
            direction,
            default,
            entries: BTreeMap::new(),
            cand: FastMap::default(),
            spec_index: PrefixMap::new(),
            tries: FastMap::default(),
            star_rank: BTreeMap::new(),
            covered: FastMap::default(),
            blockless: BTreeSet::new(),
            lists: FastMap::default(),
            lists_swept_at: 0,
            key_count: 0,
            pool: Pool::default(),
            twins: FastMap::default(),
            twins_swept_at: 0,
        }
    }

    /// The parts of a MapState for memory accounting, in the order of [`MapState::release`].
    pub const PARTS: [&'static str; 8] = [
        "MapState keys",
        "MapState candidates",
        "MapState identity index",
        "MapState covered notes",
        "MapState star rank index",
        "MapState policy entries",
        "MapState entry lists",
        "MapState shared lists",
    ];

    /// Frees part `i` of [`MapState::PARTS`], for memory accounting (the scale benchmark's
    /// breakdown): with a counting allocator, the bytes freed are what that part held. The
    /// state answers nonsense afterwards; drop it.
    pub fn release(&mut self, i: usize) {
        match i {
            0 => {
                self.tries = FastMap::default();
                self.key_count = 0;
            }
            1 => self.cand = FastMap::default(),
            2 => self.spec_index = PrefixMap::new(),
            3 => self.covered = FastMap::default(),
            4 => self.star_rank = BTreeMap::new(),
            5 => {
                self.entries = BTreeMap::new();
                self.blockless = BTreeSet::new();
            }
            6 => self.lists = FastMap::default(),
            _ => {
                self.pool = Pool::default();
                self.twins = FastMap::default();
            }
        }
    }

    /// `e` with its entry and origin lists shared with the keys that have equal ones.
    fn intern(&mut self, mut e: StateEntry) -> StateEntry {
        if let Some((entries, origins)) = self.lists.get_key_value(&*e.entries)
            && *origins == e.origins
        {
            e.entries = Arc::clone(entries);
            e.origins = Arc::clone(origins);
            return e;
        }
        if self.lists.len() >= 2 * self.lists_swept_at.max(64) {
            self.lists.retain(|k, _| Arc::strong_count(k) > 1);
            self.lists_swept_at = self.lists.len();
        }
        self.lists
            .insert(Arc::clone(&e.entries), Arc::clone(&e.origins));
        e
    }

    /// Builds the state from scratch from a list of entries.
    pub fn build(
        direction: Direction,
        default: Verdict,
        entries: impl IntoIterator<Item = PolicyEntry>,
    ) -> Result<Core, UpdateError> {
        let mut ms = Core::new(direction, default);
        // The candidate index in one go. Identities selected by the same entries have equal
        // candidates (and so equal keys): the pairs (identity, entry) are sorted, each
        // identity's list of entries is looked up, and each distinct list's candidates are
        // computed once. (Sorting one (peer, block, contribution) triple per identity, entry and
        // block was 40 % of a build at 50,000 pods.)
        let mut wild: Vec<(L4Prefix, Contrib)> = Vec::new();
        let mut specific: Vec<(Contrib, Vec<L4Prefix>)> = Vec::new();
        let mut pairs: Vec<(Identity, u32)> = Vec::new();
        for e in entries {
            if ms.entries.contains_key(&e.id) {
                return Err(UpdateError::DuplicateEntry(e.id));
            }
            let c = Contrib {
                order: e.order,
                verdict: e.verdict(),
                entry: e.id,
            };
            let blocks = e.l4.blocks();
            if blocks.is_empty() {
                ms.blockless.insert(e.id);
            } else {
                match &e.selector {
                    Selector::Any => wild.extend(blocks.iter().map(|b| (*b, c))),
                    Selector::Ids(ids) => {
                        let index = specific.len() as u32;
                        pairs.extend(ids.iter().map(|id| (id, index)));
                        specific.push((c, blocks));
                    }
                }
            }
            ms.entries.insert(e.id, e);
        }
        fn candidates(mut all: Vec<(L4Prefix, Contrib)>) -> Candidates {
            all.sort_unstable();
            Candidates(
                all.chunk_by(|a, b| a.0 == b.0)
                    .map(|g| (g[0].0, g.iter().map(|x| x.1).collect::<Contribs>()))
                    .collect(),
            )
        }
        if !wild.is_empty() {
            ms.cand.insert(Peer::Any, Arc::new(candidates(wild)));
        }
        let pairs = sort_by_identity(pairs);
        let lists: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let mut distinct: FastMap<&[u32], Arc<Candidates>> = FastMap::default();
        let mut at = 0;
        ms.cand.reserve(pairs.chunk_by(|a, b| a.0 == b.0).count());
        for group in pairs.chunk_by(|a, b| a.0 == b.0) {
            let list = &lists[at..at + group.len()];
            at += group.len();
            let cand = distinct.entry(list).or_insert_with(|| {
                let all = list
                    .iter()
                    .flat_map(|&i| {
                        let (c, blocks) = &specific[i as usize];
                        blocks.iter().map(move |b| (*b, *c))
                    })
                    .collect();
                Arc::new(candidates(all))
            });
            ms.cand.insert(Peer::Id(group[0].0), Arc::clone(cand));
        }
        drop(distinct);
        ms.tries.reserve(ms.cand.len());
        ms.index_identities();
        // `*` first: the identities' keys are computed from the `*` keys.
        // Equal candidates give equal keys and notes: each distinct list is computed once.
        let mut peers: Vec<Peer> = ms.cand.keys().copied().collect();
        peers.sort_unstable();
        for peer in peers {
            if !ms.take_twin(peer, &FastSet::default(), None) {
                ms.recompute(peer, L4Prefix::ANY, None);
                ms.note_twin(peer);
            }
        }
        Ok(ms)
    }

    /// Builds the identity index in one go: per block, the identities with candidates there.
    fn index_identities(&mut self) {
        // The identity index in one go: per block, the identities with candidates there. The
        // blocks (a few dozen) are ranked once, each identity's pairs read off its list's ranks
        // (identities share a handful of lists), and the pairs sorted as plain integers, rank
        // above identity (sorting (block, identity) by the block's key was most of a build's
        // sorting).
        let shared: FastMap<*const Candidates, &Candidates> =
            self.cand.values().map(|c| (Arc::as_ptr(c), &**c)).collect();
        let mut ranked: Vec<L4Prefix> = shared
            .values()
            .flat_map(|c| c.iter().map(|(b, _)| b))
            .collect();
        ranked.sort_unstable_by_key(|b| b.sort_key());
        ranked.dedup();
        let rank = |b: &L4Prefix| {
            ranked
                .binary_search_by_key(&b.sort_key(), |r| r.sort_key())
                .expect("ranked above") as u64
        };
        let ranks: FastMap<*const Candidates, Vec<u64>> = shared
            .iter()
            .map(|(&ptr, c)| (ptr, c.iter().map(|(b, _)| rank(&b) << 32).collect()))
            .collect();
        let mut pairs: Vec<u64> = Vec::new();
        for (peer, cand) in &self.cand {
            if let Peer::Id(id) = peer {
                pairs.extend(ranks[&Arc::as_ptr(cand)].iter().map(|r| r | u64::from(*id)));
            }
        }
        pairs.sort_unstable();
        for group in pairs.chunk_by(|a, b| a >> 32 == b >> 32) {
            let ids = group.iter().map(|&p| p as Identity).collect();
            self.spec_index
                .insert(ranked[(group[0] >> 32) as usize], ids);
        }
    }

    /// The direction of the endpoint this MapState decides for.
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

    /// One input entry.
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
        let mut out: Vec<(Key, &StateEntry)> = Vec::with_capacity(self.len());
        out.extend(self.keys_sorted());
        out
    }

    /// [`Core::iter`] without the list: the keys in the same order, as they are read (only
    /// the peers are listed and sorted first). Two states are diffed in one pass over both
    /// without copying either's keys.
    pub fn keys_sorted(&self) -> impl Iterator<Item = (Key, &StateEntry)> {
        // Peer by peer in peer order (each trie iterates its keys in prefix order).
        let mut peers: Vec<(&Peer, &Keys)> = self.tries.iter().map(|(p, k)| (p, &**k)).collect();
        peers.sort_unstable_by_key(|(p, _)| **p);
        peers.into_iter().flat_map(|(peer, t)| {
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
    }

    /// Number of keys (every peer). Kept as the keys are written: the agent's metrics read it
    /// after every batch, for every local endpoint.
    pub fn len(&self) -> usize {
        debug_assert_eq!(
            self.key_count,
            self.tries.values().map(|t| t.len()).sum::<usize>()
        );
        self.key_count
    }

    /// Whether there is no key at all (every packet gets the default).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry at one key.
    pub fn get(&self, key: &Key) -> Option<&StateEntry> {
        self.tries.get(&key.peer)?.get(&key.prefix)
    }

    /// Every covered contribution, sorted.
    pub fn covered(&self) -> Vec<Covered> {
        let mut out: Vec<Covered> = self
            .covered
            .iter()
            .flat_map(|(&peer, t)| {
                t.iter().flat_map(move |&(prefix, ref v)| {
                    v.iter().map(move |n| Covered {
                        entry: n.entry,
                        key: Key { peer, prefix },
                        covered_by: Key {
                            peer: if n.by_star { Peer::Any } else { peer },
                            prefix: n.by,
                        },
                    })
                })
            })
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
        // Identities whose candidates were all dropped by `RemoveIdentity`.
        let mut dropped: Vec<Identity> = Vec::new();
        for u in updates {
            match u {
                Update::AddEntry(e) => {
                    self.mark_entry_dirty(&e, &mut dirty, true);
                    self.index_entry(&e, true);
                    if e.l4.blocks().is_empty() {
                        self.blockless.insert(e.id);
                    }
                    self.entries.insert(e.id, e);
                }
                Update::RemoveEntry(id) => {
                    let e = self.entries.remove(&id).expect("checked");
                    self.blockless.remove(&id);
                    self.index_entry(&e, false);
                    self.mark_entry_dirty(&e, &mut dirty, false);
                }
                Update::Select { entry, ids } => self.select(entry, &ids, true, &mut dirty),
                Update::Deselect { entry, ids } => self.select(entry, &ids, false, &mut dirty),
                Update::AddIdentity { id, selected_by } => {
                    if self.cand.contains_key(&Peer::Id(id)) {
                        for entry in selected_by {
                            self.select(entry, &[id], true, &mut dirty);
                        }
                    } else {
                        self.add_identity(id, &selected_by, &mut dirty);
                    }
                }
                Update::RemoveIdentity(id) => {
                    self.remove_identity(id);
                    dropped.push(id);
                }
            }
        }
        // A dropped identity's keys all go, unless a later update of the batch gave it
        // candidates again: then its whole space is recomputed with the others.
        for id in dropped {
            let peer = Peer::Id(id);
            if let Some(regions) = dirty.get_mut(&peer) {
                regions.push(L4Prefix::ANY);
                continue;
            }
            if let Some(keys) = self.tries.remove(&peer) {
                self.key_count -= keys.len();
                changes.removed.extend(
                    Arc::unwrap_or_clone(keys)
                        .0
                        .into_iter()
                        .map(|(prefix, e)| (Key { peer, prefix }, e)),
                );
            }
            self.covered.remove(&peer);
        }
        // `Peer::Any` sorts first: the identities' keys are computed from the `*` keys.
        // Identities not yet recomputed are not up to date: none of them is taken as a twin.
        let mut pending: FastSet<Peer> = dirty.keys().copied().collect();
        for (peer, regions) in dirty {
            pending.remove(&peer);
            // An up-to-date twin (equal candidates) holds the keys a recompute would give in
            // every region, not only when the whole space is dirty: a policy edit that moves
            // one entry dirties the entry's ports for each of the thousands of identities it
            // selects, and most of them share a handful of candidate lists.
            let regions = minimal_regions(regions);
            if self.take_twin(peer, &pending, Some(&mut changes)) {
                continue;
            }
            for region in regions {
                self.recompute(peer, region, Some(&mut changes));
            }
            self.note_twin(peer);
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

    /// `RemoveIdentity`: no selector holds `id` any more, and its candidates are gone (its keys
    /// are removed by the caller). Its candidates list every entry that selects it, except
    /// those without blocks.
    fn remove_identity(&mut self, id: Identity) {
        let peer = Peer::Id(id);
        let cand = self.cand.remove(&peer);
        let mut selecting: Vec<EntryId> = cand
            .iter()
            .flat_map(|c| c.0.iter().flat_map(|(_, cs)| cs.iter().map(|c| c.entry)))
            .chain(self.blockless.iter().copied())
            .collect();
        selecting.sort_unstable();
        selecting.dedup();
        for entry in selecting {
            if let Some(e) = self.entries.get_mut(&entry)
                && let Selector::Ids(set) = &mut e.selector
            {
                set.remove(id);
            }
        }
        for (block, _) in cand.iter().flat_map(|c| c.0.iter()) {
            if let Some(v) = self.spec_index.get_mut(block) {
                v.remove(id);
                if v.is_empty() {
                    self.spec_index.remove(block);
                }
            }
        }
    }

    /// `AddIdentity` of an identity without candidates: its candidates in one sorted go and its
    /// whole space dirty.
    fn add_identity(
        &mut self,
        id: Identity,
        selected_by: &[EntryId],
        dirty: &mut BTreeMap<Peer, Vec<L4Prefix>>,
    ) {
        let mut all: Vec<(L4Prefix, Contrib)> = Vec::new();
        for entry in selected_by {
            let e = self.entries.get_mut(entry).expect("checked");
            let Selector::Ids(set) = &mut e.selector else {
                unreachable!("checked: not a wildcard")
            };
            if !set.insert(id) {
                continue;
            }
            let c = Contrib {
                order: e.order,
                verdict: e.verdict(),
                entry: *entry,
            };
            all.extend(e.l4.blocks().into_iter().map(|b| (b, c)));
        }
        if all.is_empty() {
            return;
        }
        all.sort_unstable();
        let blocks: Vec<(L4Prefix, Contribs)> = all
            .chunk_by(|a, b| a.0 == b.0)
            .map(|g| (g[0].0, g.iter().map(|x| x.1).collect::<Contribs>()))
            .collect();
        for (block, _) in &blocks {
            self.spec_index.entry(*block).or_default().insert(id);
        }
        self.cand.insert(Peer::Id(id), Arc::new(Candidates(blocks)));
        dirty.entry(Peer::Id(id)).or_default().push(L4Prefix::ANY);
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
            let did = if add { set.insert(id) } else { set.remove(id) };
            if did {
                changed.push(id);
            }
        }
        if changed.is_empty() {
            return;
        }
        let (order, verdict, blocks) = (e.order, e.verdict(), e.l4.blocks());
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
                    dirty.entry(Peer::Id(id)).or_default().extend(&blocks);
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
                        for id in ids {
                            dirty.entry(Peer::Id(id)).or_default().push(*b);
                        }
                    }
                }
            }
        }
    }

    fn index_entry(&mut self, e: &PolicyEntry, add: bool) {
        let c = Contrib {
            order: e.order,
            verdict: e.verdict(),
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
                // Identities holding one candidate list (one allocation: equal lists are
                // shared) get one new list: the change is made once per distinct list, not
                // once per identity (an entry selects thousands of identities, which hold a
                // handful of lists). The memo keeps the old lists alive, so that no address
                // is reused while it is a key.
                type Memo = FastMap<usize, (Option<Arc<Candidates>>, Arc<Candidates>)>;
                let mut memo: Memo = FastMap::default();
                for id in ids {
                    let peer = Peer::Id(id);
                    let old = self.cand.get(&peer).cloned();
                    let key = old.as_ref().map_or(0, |a| Arc::as_ptr(a) as usize);
                    if let Some((_, new)) = memo.get(&key) {
                        self.cand.insert(peer, new.clone());
                        continue;
                    }
                    for b in &blocks {
                        self.index_cand(peer, *b, c, add);
                    }
                    let new = self.cand.get(&peer).cloned().unwrap_or_default();
                    memo.insert(key, (old, new));
                }
                for b in &blocks {
                    self.index_spec(ids.iter(), *b);
                }
            }
        }
    }

    /// Brings the identity index at `block` up to date for `ids` (indexed while an identity has
    /// a contribution at the block).
    fn index_spec(&mut self, ids: impl IntoIterator<Item = Identity>, block: L4Prefix) {
        let v = self.spec_index.entry(block).or_default();
        for id in ids {
            if self
                .cand
                .get(&Peer::Id(id))
                .is_some_and(|c| c.find(&block).is_ok())
            {
                v.insert(id);
            } else {
                v.remove(id);
            }
        }
        if v.is_empty() {
            self.spec_index.remove(&block);
        }
    }

    fn index_contrib(&mut self, peer: Peer, block: L4Prefix, c: Contrib, add: bool) {
        self.index_cand(peer, block, c, add);
        if let Peer::Id(id) = peer {
            self.index_spec([id], block);
        }
    }

    /// The candidate part of [`Self::index_contrib`].
    fn index_cand(&mut self, peer: Peer, block: L4Prefix, c: Contrib, add: bool) {
        let cand = Arc::make_mut(self.cand.entry(peer).or_default());
        if add {
            let v = cand.entry(block);
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
    }

    /// Recomputes the keys of `peer` inside `region` (the region and its subtree), writes them
    /// and records the differences in `changes` (if given). For an identity, the `*` keys must
    /// already be up to date.
    fn recompute(&mut self, peer: Peer, region: L4Prefix, changes: Option<&mut ChangeSet>) {
        let (new, notes) = self.compute(peer, region);
        self.write_keys(peer, region, new, changes);
        self.write_notes(peer, region, notes);
        if let Some(c) = self.cand.get(&peer)
            && c.is_empty()
        {
            self.cand.remove(&peer);
        }
        let pool = &mut self.pool;
        if let Some(c) = self.cand.get_mut(&peer) {
            share(&mut pool.cand, &mut pool.cand_swept_at, c);
        }
        if let Some(k) = self.tries.get_mut(&peer) {
            share(&mut pool.keys, &mut pool.keys_swept_at, k);
        }
        if let Some(n) = self.covered.get_mut(&peer) {
            share(&mut pool.notes, &mut pool.notes_swept_at, n);
        }
    }

    /// The keys and covered notes of `peer` inside `region`, in prefix order: the ordered
    /// insertion of the crate documentation, computed as one walk down the blocks that can
    /// matter (see "How the state is computed" there).
    fn compute(&self, peer: Peer, region: L4Prefix) -> (Vec<(L4Prefix, StateEntry)>, Vec<Covered>) {
        let nodes = self.region_nodes(peer, region);
        self.walk(peer, region, &nodes)
    }

    /// The blocks that can matter for `peer` inside `region`, in prefix order: the peer's own
    /// candidate blocks, and for an identity the `*` keys on and under them that can bound or
    /// become one of its keys.
    fn region_nodes(&self, peer: Peer, region: L4Prefix) -> Vec<Node<'_>> {
        let Some(own) = self.cand.get(&peer) else {
            return Vec::new();
        };
        let mut nodes: Vec<Node<'_>> = Vec::with_capacity(if region == L4Prefix::ANY {
            own.len() + 4
        } else {
            4
        });
        own.region(region, |prefix, cs| {
            nodes.push(Node {
                prefix,
                own: cs,
                wild: None,
            })
        });
        if nodes.is_empty() {
            return Vec::new();
        }
        nodes.sort_unstable_by_key(|n| n.prefix);
        if let (Peer::Id(_), Some(star)) = (peer, self.tries.get(&Peer::Any)) {
            fn wild(prefix: L4Prefix, e: &StateEntry) -> Node<'_> {
                Node {
                    prefix,
                    own: &[],
                    wild: Some(e),
                }
            }
            let own_count = nodes.len();
            let best_own = |n: &Node<'_>| n.own.first().map(Contrib::rank).expect("own");
            if nodes[0].prefix.covers(&region) {
                // An own block on the region's chain: every `*` key inside the region lies under
                // it, and the `*` keys above the region bound what is inserted inside.
                let t = nodes
                    .iter()
                    .filter(|n| n.prefix.covers(&region))
                    .map(best_own)
                    .min()
                    .expect("nodes[0]");
                for (p, e) in star.cover(region) {
                    nodes.push(wild(p, e));
                }
                self.star_inside(star, region, t, &mut nodes);
            } else {
                // Under each maximal own block: its `*` ancestors and descendants. `*` keys that
                // are comparable with no own block never become keys of this identity and cannot
                // bound one (crate documentation).
                let mut maximal: Option<L4Prefix> = None;
                for i in 0..own_count {
                    let s = nodes[i].prefix;
                    if maximal.is_some_and(|m| m.covers(&s)) {
                        continue;
                    }
                    maximal = Some(s);
                    let t = best_own(&nodes[i]);
                    for (p, e) in star.cover(s) {
                        nodes.push(wild(p, e));
                    }
                    self.star_inside(star, s, t, &mut nodes);
                }
            }
            if nodes.len() > own_count {
                nodes.sort_unstable_by_key(|n| n.prefix);
                nodes.dedup_by(|later, first| {
                    if later.prefix != first.prefix {
                        return false;
                    }
                    first.wild = first.wild.or(later.wild);
                    if first.own.is_empty() {
                        first.own = later.own;
                    }
                    true
                });
            }
        }
        nodes
    }

    /// The ordered insertion over `nodes` as one walk: the keys inside `region` and the notes
    /// of the contributions they cover.
    fn walk(
        &self,
        peer: Peer,
        region: L4Prefix,
        nodes: &[Node<'_>],
    ) -> (Vec<(L4Prefix, StateEntry)>, Vec<Covered>) {
        let mut out = Vec::new();
        let mut notes = Vec::new();
        // The walk. `frames` is the chain of visited blocks above the current one with the
        // strongest rank at or above each; `keys` the chain of keys, strictly stronger going
        // down (a key is only inserted when it beats everything above it).
        let mut frames: Vec<(L4Prefix, Rank)> = Vec::new();
        let mut keys: Vec<KeyFrame> = Vec::new();
        for n in nodes {
            while frames.last().is_some_and(|f| !f.0.covers(&n.prefix)) {
                frames.pop();
            }
            while keys.last().is_some_and(|k| !k.prefix.covers(&n.prefix)) {
                keys.pop();
            }
            let above = frames.last().map(|f| f.1);
            let best_own = n.own.first().map(Contrib::rank);
            let best_wild = n.wild.map(|e| (e.order, e.verdict));
            let best = match (best_own, best_wild) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => continue,
            };
            let is_key = above.is_none_or(|m| best < m);
            frames.push((n.prefix, above.map_or(best, |m| m.min(best))));
            let inside = region.covers(&n.prefix);
            if is_key {
                let specific = best_own == Some(best);
                let chain_specific = specific || keys.last().is_some_and(|k| k.chain_specific);
                let kept = peer == Peer::Any || chain_specific;
                keys.push(KeyFrame {
                    prefix: n.prefix,
                    rank: best,
                    kept,
                    chain_specific,
                });
                if kept && inside {
                    let entry = match (specific, n.wild) {
                        (false, Some(w)) => StateEntry {
                            synthesized: true,
                            ..w.clone()
                        },
                        (_, wild) => {
                            let mut ids: Vec<EntryId> = n
                                .own
                                .iter()
                                .take_while(|c| c.rank() == best)
                                .map(|c| c.entry)
                                .collect();
                            if let Some(w) = wild.filter(|w| (w.order, w.verdict) == best) {
                                ids.extend(w.entries.iter());
                                ids.sort_unstable();
                                ids.dedup();
                            }
                            self.state_entry(best, ids)
                        }
                    };
                    out.push((n.prefix, entry));
                }
            }
            if inside {
                for c in n.own {
                    let r = c.rank();
                    if is_key && r == best {
                        continue;
                    }
                    // The key that was present when this contribution came in the ordered
                    // insertion and covers it: the broadest one inserted before it.
                    let by = keys
                        .iter()
                        .find(|k| k.rank < r || (k.rank == r && k.prefix != n.prefix))
                        .expect("a skipped contribution has a stronger key on its chain");
                    notes.push(Covered {
                        entry: c.entry,
                        key: Key {
                            peer,
                            prefix: n.prefix,
                        },
                        covered_by: Key {
                            peer: if by.kept { peer } else { Peer::Any },
                            prefix: by.prefix,
                        },
                    });
                }
            }
        }
        (out, notes)
    }

    /// Pushes the `*` keys strictly inside `outer` that are stronger than `t`, the strongest
    /// own rank at `outer` or above. The weaker ones can neither become keys inside `outer`
    /// (everything there is bounded by `t`) nor lower a bound, so the walk can skip them. For a
    /// broad block the keys are found through the rank index (only the stronger ones are
    /// visited); for a narrow one by enumerating its subtree.
    fn star_inside<'a>(
        &'a self,
        star: &'a Keys,
        outer: L4Prefix,
        t: Rank,
        nodes: &mut Vec<Node<'a>>,
    ) {
        let push = |nodes: &mut Vec<Node<'a>>, prefix: L4Prefix, e: &'a StateEntry| {
            nodes.push(Node {
                prefix,
                own: &[],
                wild: Some(e),
            })
        };
        if outer.len() <= BROAD_LEN {
            let sets = match outer.protocol() {
                Some(proto) => self.star_rank.range(u16::from(proto)..=u16::from(proto)),
                None => self.star_rank.range(..),
            };
            for (_, set) in sets {
                for (&(_, p), e) in set.range(..(t, L4Prefix::ANY)) {
                    if p != outer && outer.covers(&p) {
                        push(nodes, p, e);
                    }
                }
            }
        } else {
            for (p, e) in star.children(&outer) {
                if p != outer && (e.order, e.verdict) < t {
                    push(nodes, p, e);
                }
            }
        }
    }

    /// Replaces the keys of `peer` inside `region` by `new` (sorted by prefix).
    fn write_keys(
        &mut self,
        peer: Peer,
        region: L4Prefix,
        new: Vec<(L4Prefix, StateEntry)>,
        changes: Option<&mut ChangeSet>,
    ) {
        let new: Vec<(L4Prefix, StateEntry)> =
            new.into_iter().map(|(p, e)| (p, self.intern(e))).collect();
        if peer == Peer::Any {
            self.index_star(region, &new);
        }
        let keys = Arc::make_mut(self.tries.entry(peer).or_default());
        let run = keys.run(&region);
        self.key_count = self.key_count + new.len() - run.len();
        match changes {
            None => {
                keys.0.splice(run, new);
            }
            Some(changes) => {
                let old: Vec<(L4Prefix, StateEntry)> =
                    keys.0.splice(run, new.iter().cloned()).collect();
                diff_keys(peer, old, new, changes);
            }
        }
        if keys.is_empty() {
            self.tries.remove(&peer);
        }
    }

    /// If `peer` is an identity whose candidates (shared first) are held by an up-to-date twin
    /// (see `twins`; not in `pending`), gives it the twin's keys and notes, records the key
    /// differences in `changes` (if given) and returns true.
    fn take_twin(
        &mut self,
        peer: Peer,
        pending: &FastSet<Peer>,
        changes: Option<&mut ChangeSet>,
    ) -> bool {
        let Peer::Id(id) = peer else {
            return false;
        };
        let Some(cand) = self.cand.get_mut(&peer) else {
            return false;
        };
        if cand.is_empty() {
            return false;
        }
        // By address first (in a build, equal lists are one allocation already), then shared
        // with an equal list of the pool (a list made for this update).
        let mut addr = Arc::as_ptr(cand) as usize;
        if !self.twins.contains_key(&addr) {
            share(&mut self.pool.cand, &mut self.pool.cand_swept_at, cand);
            addr = Arc::as_ptr(cand) as usize;
        }
        let Some(&twin) = self.twins.get(&addr) else {
            return false;
        };
        let twin = Peer::Id(twin);
        if twin == Peer::Id(id)
            || pending.contains(&twin)
            || self
                .cand
                .get(&twin)
                .is_none_or(|c| Arc::as_ptr(c) as usize != addr)
        {
            return false;
        }
        let keys = self.tries.get(&twin).cloned();
        let notes = self.covered.get(&twin).cloned();
        let old = self.tries.remove(&peer);
        self.key_count -= old.as_ref().map_or(0, |k| k.len());
        self.key_count += keys.as_ref().map_or(0, |k| k.len());
        if let Some(changes) = changes {
            let new = keys.as_deref().map_or(&[][..], |k| &k.0[..]);
            let old = old.as_deref().map_or(&[][..], |k| &k.0[..]);
            diff_keys(peer, old.iter().cloned(), new.iter().cloned(), changes);
        }
        if let Some(keys) = keys {
            self.tries.insert(peer, keys);
        }
        match notes {
            Some(notes) => self.covered.insert(peer, notes),
            None => self.covered.remove(&peer),
        };
        true
    }

    /// Records `peer` (just brought up to date) as the twin of its candidate list.
    fn note_twin(&mut self, peer: Peer) {
        let Peer::Id(id) = peer else {
            return;
        };
        let Some(cand) = self.cand.get(&peer) else {
            return;
        };
        let addr = Arc::as_ptr(cand) as usize;
        if self.twins.len() >= 2 * self.twins_swept_at.max(64) {
            let cands = &self.cand;
            self.twins.retain(|a, t| {
                cands
                    .get(&Peer::Id(*t))
                    .is_some_and(|c| Arc::as_ptr(c) as usize == *a)
            });
            self.twins_swept_at = self.twins.len();
        }
        self.twins.insert(addr, id);
    }

    /// Brings the rank index of the `*` keys up to date for the keys inside `region` becoming
    /// `new` (called before they are written).
    fn index_star(&mut self, region: L4Prefix, new: &[(L4Prefix, StateEntry)]) {
        let proto = |p: &L4Prefix| p.protocol().map_or(256, u16::from);
        if let Some(star) = self.tries.get(&Peer::Any) {
            for (p, e) in star.children(&region) {
                if let Some(set) = self.star_rank.get_mut(&proto(&p)) {
                    set.remove(&((e.order, e.verdict), p));
                }
            }
        }
        for (p, e) in new {
            self.star_rank
                .entry(proto(p))
                .or_default()
                .insert(((e.order, e.verdict), *p), e.clone());
        }
    }

    /// Replaces the covered notes of `peer` inside `region`.
    fn write_notes(&mut self, peer: Peer, region: L4Prefix, notes: Vec<Covered>) {
        if notes.is_empty() && !self.covered.contains_key(&peer) {
            return;
        }
        let cov = Arc::make_mut(self.covered.entry(peer).or_default());
        // The stale notes: the run of blocks inside `region`.
        let start = cov.partition_point(|(p, _)| *p < region);
        let end = start
            + cov[start..]
                .iter()
                .take_while(|(p, _)| region.covers(p))
                .count();
        let mut notes = notes;
        notes.sort_by_key(|n| n.key.prefix);
        let note = |c: Covered| {
            debug_assert!(c.covered_by.peer == peer || c.covered_by.peer == Peer::Any);
            Note {
                entry: c.entry,
                by: c.covered_by.prefix,
                by_star: c.covered_by.peer != peer,
            }
        };
        let mut groups: Notes = Vec::new();
        let mut notes = notes.into_iter().peekable();
        while let Some(first) = notes.next() {
            let prefix = first.key.prefix;
            let mut v = vec![note(first)];
            while let Some(n) = notes.next_if(|n| n.key.prefix == prefix) {
                v.push(note(n));
            }
            v.sort();
            groups.push((prefix, v));
        }
        cov.splice(start..end, groups);
        if cov.is_empty() {
            self.covered.remove(&peer);
        }
    }

    /// The value of a key made of the contributions `ids` of rank `rank`.
    fn state_entry(&self, (order, verdict): Rank, entries: Vec<EntryId>) -> StateEntry {
        let mut origins: Vec<Arc<Origin>> = entries
            .iter()
            .filter_map(|id| self.entries.get(id).map(|e| e.origin.clone()))
            .collect();
        if origins.len() > 1 {
            origins.sort();
            origins.dedup();
        }
        StateEntry {
            verdict,
            order,
            entries: entries.into(),
            origins: origins.into(),
            synthesized: false,
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

/// Ordered insertion of `items` into a scratch trie: sorted by order key, deny before allow,
/// broader before narrower; an item whose block is already covered (equal or broader key present)
/// is not inserted, except that an item of equal rank at an equal key merges into it. Returns the
/// trie and the blocked items of `peer` inside `region` with the key that blocked each.
/// Records in `changes` how the keys of `peer` went from `old` to `new` (both sorted by prefix).
fn diff_keys(
    peer: Peer,
    old: impl IntoIterator<Item = (L4Prefix, StateEntry)>,
    new: impl IntoIterator<Item = (L4Prefix, StateEntry)>,
    changes: &mut ChangeSet,
) {
    let mut old = old.into_iter().peekable();
    for (prefix, n) in new {
        while let Some((o, e)) = old.next_if(|(o, _)| *o < prefix) {
            changes.removed.push((Key { peer, prefix: o }, e));
        }
        let key = Key { peer, prefix };
        match old.next_if(|(o, _)| *o == prefix) {
            Some((_, o)) => {
                if o != n {
                    changes.changed.push((key, o, n));
                }
            }
            None => changes.added.push((key, n)),
        }
    }
    for (o, e) in old {
        changes.removed.push((Key { peer, prefix: o }, e));
    }
}

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
    if regions.contains(&L4Prefix::ANY) {
        return vec![L4Prefix::ANY];
    }
    if regions.len() <= 1 {
        return regions;
    }
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

/// `pairs` of (identity, entry index) sorted, as `sort_unstable` sorts them. They are distinct
/// and made entry by entry, so each identity's indices come in ascending order: when the
/// identities are dense (numbered upwards from 1, as the engine numbers them), a counting sort
/// by identity puts them in order in two passes; otherwise a comparison sort.
fn sort_by_identity(mut pairs: Vec<(Identity, u32)>) -> Vec<(Identity, u32)> {
    let max = pairs.iter().map(|p| p.0 as usize).max().unwrap_or(0);
    if max > 4 * pairs.len() + 1024 {
        pairs.sort_unstable();
        return pairs;
    }
    let mut start = vec![0u32; max + 2];
    for p in &pairs {
        start[p.0 as usize + 1] += 1;
    }
    for i in 1..start.len() {
        start[i] += start[i - 1];
    }
    let mut out = vec![(0, 0); pairs.len()];
    for &p in &pairs {
        let at = &mut start[p.0 as usize];
        out[*at as usize] = p;
        *at += 1;
    }
    debug_assert!(
        out.is_sorted(),
        "each identity's entries in ascending order"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::sort_by_identity;

    /// Pairs made entry by entry (each entry's identities ascending) come out as `sort_unstable`
    /// sorts them, by counting (dense identities) and by comparison (sparse ones).
    #[test]
    fn sort_by_identity_is_sort_unstable() {
        let mut x: u32 = 0x2545_f491;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for spread in [50, 5_000, 1 << 30] {
            let mut pairs = Vec::new();
            for entry in 0..40 {
                let mut ids: Vec<u32> = (0..next() % 200).map(|_| 1 + next() % spread).collect();
                ids.sort_unstable();
                ids.dedup();
                pairs.extend(ids.into_iter().map(|id| (id, entry)));
            }
            let mut want = pairs.clone();
            want.sort_unstable();
            assert_eq!(sort_by_identity(pairs), want, "identities up to {spread}");
        }
    }
}
