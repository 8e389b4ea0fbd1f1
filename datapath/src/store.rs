//! Rule set slots in the kernel tables: install, in-place update in a safe order, sharing by
//! content, release with deferred reuse.
//!
//! A slot `s` owns cell words `s * CELLS_PER_RULESET ..` of the cell array, the policy keys with
//! `ruleset = s`, and the refined blocks its cell words point to. Slot 0 is the permanent empty
//! rule set (all words zero: no keys, no wildcard, the default decides).
//!
//! **Update safety** (`docs/datapath.md` §6). A packet reads one cell word (through at most one
//! block) and then probes the policy hash; every single write changes one word or one key, and
//! the kernel applies a batch element by element. An in-place update runs in phases:
//!
//! * A: add the lengths of new identity keys to the cell masks (a longer mask only causes probes
//!   that miss: no verdict changes);
//! * 1..4: the key changes in the order of `ChangeSet::safe_order` — upserts to deny, deletions
//!   of allows, deletions of denies, upserts to allow — identity keys as hash writes, wildcard
//!   keys as rewrites of the affected cell words (each word is independently old or new, and a
//!   packet reads one word, so every packet sees a state that is a prefix of the safe order);
//! * Z: drop the lengths of removed identity keys from the masks.
//!
//! A cell that becomes refined gets its block fully written before the first-level word points
//! to it; a block or slot that is no longer referenced is reused only after a grace period, so
//! a packet that read the old reference while it was switched still finds the old contents.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    thread,
    time::{Duration, Instant},
};

use ordnet_datapath_common::layout::{
    BLOCK_WORDS, CELL_REFINED, CELLS_PER_RULESET, PolicyKey, PolicyValue, V_ALLOW, V_DENY,
};

use crate::{
    flat::{CellInputs, CellWords, ContentDiff, RuleSetContent, affected_cells, cell_words},
    leafmap::LeafMap,
    tables::{TableWriter, Write, WriteError},
};

/// Counts of what an operation wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Rule sets written into a fresh slot.
    pub rulesets_installed: u32,
    /// Rule sets changed in place.
    pub rulesets_updated: u32,
    /// Rule sets no longer used (released for deferred reuse).
    pub rulesets_released: u32,
    /// Policy hash writes (upserts + deletes).
    pub policy_writes: u32,
    /// First-level cell word writes.
    pub cell_writes: u32,
    /// Block word writes.
    pub block_writes: u32,
    /// ipcache / CIDR / Service frontend / interface writes.
    pub ip_writes: u32,
    /// Batches (one syscall each in the kernel writer).
    pub batches: u32,
}

impl WriteStats {
    /// Writes `batch` (if not empty) and counts it.
    pub(crate) fn write<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        batch: &[Write],
    ) -> Result<(), WriteError> {
        if batch.is_empty() {
            return Ok(());
        }
        w.write(batch)?;
        self.batches += 1;
        for op in batch {
            match op {
                Write::Cell(..) => self.cell_writes += 1,
                Write::Block(..) => self.block_writes += 1,
                Write::PolicyUpsert(..) | Write::PolicyDelete(..) => self.policy_writes += 1,
                Write::IpUpsert(..)
                | Write::IpDelete(..)
                | Write::CidrUpsert(..)
                | Write::CidrDelete(..)
                | Write::SvcUpsert(..)
                | Write::SvcDelete(..)
                | Write::IfaceUpsert(..)
                | Write::IfaceDelete(..) => self.ip_writes += 1,
                Write::State(_) => {}
            }
        }
        Ok(())
    }
}

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A table write failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// Every rule set slot is in use (the number of slots).
    #[error("no free rule set slot (all {0} in use); raise max_rulesets")]
    NoSlot(u32),
    /// Every refined cell block is in use (the number of blocks).
    #[error("no free cell block (all {0} in use); raise max_blocks")]
    NoBlock(u32),
    /// The policy map has no room for the keys an operation adds (checked before anything is
    /// written).
    #[error(
        "the policy map is full: {needed} more keys do not fit beside the {held} it holds \
         (capacity {capacity}); raise its size"
    )]
    PolicyFull {
        /// Keys the operation adds.
        needed: usize,
        /// Keys the map holds (rule sets in use and released ones not yet cleared).
        held: usize,
        /// The map's capacity.
        capacity: usize,
    },
}

impl StoreError {
    /// Whether the error says a table is full (rule set slots, cell blocks, policy keys): the
    /// operation wrote nothing, and a smaller one may still fit.
    pub fn is_capacity(&self) -> bool {
        match self {
            StoreError::NoSlot(_) | StoreError::NoBlock(_) | StoreError::PolicyFull { .. } => true,
            StoreError::Write(w) => w.is_capacity(),
        }
    }
}

#[derive(Debug, Clone)]
struct RuleSet {
    content: RuleSetContent,
    inputs: CellInputs,
    hash: u64,
    refs: u32,
}

fn content_hash(c: &RuleSetContent) -> u64 {
    c.content_hash()
}

/// The keys of `slot` as the maps hold them ([`TableWriter::slot_keys`]).
fn slot_content<W: TableWriter + ?Sized>(
    w: &W,
    slot: u32,
) -> Result<RuleSetContent, crate::tables::WriteError> {
    let mut c = RuleSetContent::default();
    for (k, v) in w.slot_keys(slot)? {
        c.insert_key(&k, v);
    }
    Ok(c)
}

/// Number of keys `diff` adds to `content` (upserts of keys it does not have): the policy map
/// holds them all before any removal of the diff is written.
pub(crate) fn added_keys(content: &RuleSetContent, diff: &ContentDiff) -> usize {
    added_specifics(content, diff).count() + added_wildcards(content, diff)
}

/// The identity keys `diff` upserts that `content` does not have.
fn added_specifics<'a>(
    content: &'a RuleSetContent,
    diff: &'a ContentDiff,
) -> impl Iterator<Item = (u32, u32)> + 'a {
    let mut keys = content.specific.finger();
    diff.specific_upserts
        .iter()
        .map(|&(k, _)| k)
        .filter(move |k| keys.get(k).is_none())
}

/// Keeps one copy of rule set `slot`'s identity keys for the store and a writer that keeps
/// its own ([`TableWriter::identity_keys`]): `keys` takes the writer's leaves when they hold the
/// same entries.
fn share_with_writer<W: TableWriter + ?Sized>(
    w: &W,
    slot: u32,
    keys: &mut LeafMap<(u32, u32), PolicyValue>,
) {
    if let Some(theirs) = w.identity_keys(slot) {
        keys.share_from(&theirs);
    }
}

/// Number of `*` keys `diff` adds to `content`.
fn added_wildcards(content: &RuleSetContent, diff: &ContentDiff) -> usize {
    diff.wildcard_upserts
        .iter()
        .filter(|(p, _)| !content.wildcard.contains_key(p))
        .count()
}

/// Summary of one slot, for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// The slot number.
    pub slot: u32,
    /// Number of keys of its rule set.
    pub keys: usize,
    /// Number of endpoint directions that use it.
    pub refs: u32,
}

/// The rule set slots.
#[derive(Debug)]
pub struct Store {
    max_rulesets: u32,
    max_blocks: u32,
    /// Capacity of the policy map (keys of all slots, also released ones not yet cleared).
    policy_capacity: usize,
    grace: Duration,
    slots: Vec<Option<RuleSet>>,
    free_slots: VecDeque<u32>,
    retired_slots: VecDeque<(u32, Instant)>,
    free_blocks: VecDeque<u32>,
    retired_blocks: VecDeque<(u32, Instant)>,
    by_hash: HashMap<u64, Vec<u32>>,
}

/// The writes of one phase, in the order they must be applied.
#[derive(Default)]
struct Phase {
    blocks: Vec<Write>,
    cells: Vec<Write>,
    policy: Vec<Write>,
    /// Blocks no longer referenced once `cells` is written.
    retire: Vec<u32>,
}

impl Store {
    /// An empty store for tables of `max_rulesets` slots and `max_blocks` blocks; released slots
    /// and blocks are reused after `grace`.
    pub fn new(max_rulesets: u32, max_blocks: u32, grace: Duration) -> Store {
        let mut slots = vec![None; max_rulesets as usize];
        slots[0] = Some(RuleSet {
            content: RuleSetContent::default(),
            inputs: CellInputs::default(),
            hash: content_hash(&RuleSetContent::default()),
            refs: 0,
        });
        Store {
            max_rulesets,
            max_blocks,
            policy_capacity: usize::MAX,
            grace,
            slots,
            free_slots: (1..max_rulesets).collect(),
            retired_slots: VecDeque::new(),
            free_blocks: (0..max_blocks).collect(),
            retired_blocks: VecDeque::new(),
            by_hash: HashMap::new(),
        }
    }

    /// The same store for a policy map of `capacity` keys: an operation that would add more
    /// keys than fit fails with [`StoreError::PolicyFull`] before writing anything.
    pub fn with_policy_capacity(mut self, capacity: u32) -> Store {
        self.policy_capacity = capacity as usize;
        self
    }

    /// Sets the capacity of the policy map (see [`Store::with_policy_capacity`]).
    pub fn set_policy_capacity(&mut self, capacity: u32) {
        self.policy_capacity = capacity as usize;
    }

    /// Capacity of the policy map (`usize::MAX`: not bounded).
    pub fn policy_capacity(&self) -> usize {
        self.policy_capacity
    }

    /// Capacity in rule set slots (slot 0, the empty rule set, included).
    pub fn max_rulesets(&self) -> u32 {
        self.max_rulesets
    }

    /// Capacity in refined cell blocks.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// Policy keys the map holds: those of every slot in use and of released slots not yet
    /// cleared.
    pub fn policy_keys_held(&self) -> usize {
        self.slots.iter().flatten().map(|r| r.content.len()).sum()
    }

    /// Makes room for `needed` more policy keys: waits out the grace period of released slots
    /// (their keys are cleared) while that helps; [`StoreError::PolicyFull`] when it does not
    /// (nothing else written).
    pub fn ensure_room<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        needed: usize,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        loop {
            let held = self.policy_keys_held();
            if held.saturating_add(needed) <= self.policy_capacity {
                return Ok(());
            }
            let releasable: usize = self
                .retired_slots
                .iter()
                .filter_map(|(s, _)| self.slots[*s as usize].as_ref())
                .map(|r| r.content.len())
                .sum();
            let Some(&(_, t)) = self.retired_slots.front() else {
                return Err(StoreError::PolicyFull {
                    needed,
                    held,
                    capacity: self.policy_capacity,
                });
            };
            if (held - releasable).saturating_add(needed) > self.policy_capacity {
                return Err(StoreError::PolicyFull {
                    needed,
                    held,
                    capacity: self.policy_capacity,
                });
            }
            thread::sleep(self.grace.saturating_sub(t.elapsed()));
            self.reclaim(w, stats)?;
        }
    }

    /// The content of a slot in use.
    pub fn content(&self, slot: u32) -> Option<&RuleSetContent> {
        self.slots.get(slot as usize)?.as_ref().map(|r| &r.content)
    }

    /// Slots in use (not 0), with their size and number of users.
    pub fn slots_in_use(&self) -> Vec<SlotInfo> {
        self.slots
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, r)| {
                r.as_ref().map(|r| SlotInfo {
                    slot: i as u32,
                    keys: r.content.len(),
                    refs: r.refs,
                })
            })
            .collect()
    }

    /// Blocks referenced by slots in use.
    pub fn blocks_in_use(&self) -> u32 {
        self.max_blocks - self.free_blocks.len() as u32 - self.retired_blocks.len() as u32
    }

    /// The slot holding exactly `content`, if any (slot 0 for the empty content).
    pub fn find(&self, content: &RuleSetContent) -> Option<u32> {
        if content.is_empty() {
            return Some(0);
        }
        self.by_hash
            .get(&content_hash(content))?
            .iter()
            .copied()
            .find(|s| self.content(*s) == Some(content))
    }

    /// Slots whose content has hash `hash` (candidates for equality).
    pub fn slots_with_hash(&self, hash: u64) -> &[u32] {
        self.by_hash.get(&hash).map_or(&[], |v| v.as_slice())
    }

    /// The content hash of a slot in use.
    pub fn hash(&self, slot: u32) -> Option<u64> {
        self.slots.get(slot as usize)?.as_ref().map(|r| r.hash)
    }

    /// The value of policy key `key` as the maps hold it: every slot's content, also of a slot
    /// released and not yet cleared, is exactly its keys in the maps (what was written
    /// successfully).
    pub fn policy_value(&self, key: &PolicyKey) -> Option<PolicyValue> {
        let r = self.slots.get(key.ruleset as usize)?.as_ref()?;
        r.content.value_of(key)
    }

    /// Every policy key the maps hold, from the slots' contents (see [`Store::policy_value`]).
    pub fn policy_keys(&self) -> impl Iterator<Item = (PolicyKey, PolicyValue)> + '_ {
        self.slots.iter().enumerate().flat_map(|(slot, r)| {
            r.iter()
                .flat_map(move |r| r.content.policy_keys(slot as u32))
        })
    }

    /// Number of references to `slot` (0 when it is not in use).
    pub fn refs(&self, slot: u32) -> u32 {
        self.slots
            .get(slot as usize)
            .and_then(|r| r.as_ref())
            .map_or(0, |r| r.refs)
    }

    /// Adds a reference to `slot` (no-op when it is not in use).
    pub fn add_ref(&mut self, slot: u32) {
        if let Some(Some(r)) = self.slots.get_mut(slot as usize) {
            r.refs += 1;
        }
    }

    /// Drops one reference; a slot (other than 0) without references is released: it keeps its
    /// contents for the grace period (packets may still be using it), then it is cleared.
    pub fn release(&mut self, slot: u32, stats: &mut WriteStats) {
        if slot == 0 {
            return;
        }
        let Some(Some(r)) = self.slots.get_mut(slot as usize) else {
            return;
        };
        r.refs = r.refs.saturating_sub(1);
        if r.refs == 0 {
            let hash = r.hash;
            if let Some(v) = self.by_hash.get_mut(&hash) {
                v.retain(|s| *s != slot);
                if v.is_empty() {
                    self.by_hash.remove(&hash);
                }
            }
            self.retired_slots.push_back((slot, Instant::now()));
            stats.rulesets_released += 1;
        }
    }

    /// When the oldest released slot or block is next due (its grace period over), if any:
    /// [`Store::reclaim`] clears and frees it from then on.
    pub fn reclaim_due(&self) -> Option<Instant> {
        let slot = self.retired_slots.front().map(|&(_, t)| t + self.grace);
        let block = self.retired_blocks.front().map(|&(_, t)| t + self.grace);
        slot.into_iter().chain(block).min()
    }

    /// Clears released slots and frees released blocks whose grace period is over.
    pub fn reclaim<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        while let Some(&(b, t)) = self.retired_blocks.front() {
            if now.duration_since(t) < self.grace {
                break;
            }
            self.retired_blocks.pop_front();
            self.free_blocks.push_back(b);
        }
        while let Some(&(slot, t)) = self.retired_slots.front() {
            if now.duration_since(t) < self.grace {
                break;
            }
            self.retired_slots.pop_front();
            // A released slot may have been taken back into use by `find` + `add_ref`? No:
            // released slots leave the content index, so nothing can find them.
            self.clear_slot(w, slot, stats)?;
            self.free_slots.push_back(slot);
        }
        Ok(())
    }

    /// Removes a slot's keys and zeroes its words (only for a slot nobody can read any more).
    fn clear_slot<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        slot: u32,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let Some(r) = self.slots[slot as usize].take() else {
            return Ok(());
        };
        let policy: Vec<Write> = r
            .content
            .policy_keys(slot)
            .map(|(k, _)| Write::PolicyDelete(k))
            .collect();
        let base = slot * CELLS_PER_RULESET;
        let mut cells = Vec::new();
        for i in 0..CELLS_PER_RULESET {
            let word = w.tables().cells[(base + i) as usize];
            if word & CELL_REFINED != 0 {
                self.free_blocks.push_back(word & !CELL_REFINED);
            }
            if word != 0 {
                cells.push(Write::Cell(base + i, 0));
            }
        }
        stats.write(w, &policy)?;
        stats.write(w, &cells)?;
        Ok(())
    }

    fn alloc_slot<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        stats: &mut WriteStats,
    ) -> Result<u32, StoreError> {
        loop {
            if let Some(s) = self.free_slots.pop_front() {
                return Ok(s);
            }
            let Some(&(_, t)) = self.retired_slots.front() else {
                return Err(StoreError::NoSlot(self.max_rulesets));
            };
            // Wait out the oldest released slot's grace period.
            thread::sleep(self.grace.saturating_sub(t.elapsed()));
            self.reclaim(w, stats)?;
        }
    }

    fn alloc_block(&mut self) -> Result<u32, StoreError> {
        loop {
            if let Some(b) = self.free_blocks.pop_front() {
                return Ok(b);
            }
            let Some(&(_, t)) = self.retired_blocks.front() else {
                return Err(StoreError::NoBlock(self.max_blocks));
            };
            // Wait out the oldest released block's grace period. (Only blocks are reclaimed
            // here: clearing slots would issue writes in the middle of a phase.)
            thread::sleep(self.grace.saturating_sub(t.elapsed()));
            let now = Instant::now();
            while let Some(&(b, t)) = self.retired_blocks.front() {
                if now.duration_since(t) < self.grace {
                    break;
                }
                self.retired_blocks.pop_front();
                self.free_blocks.push_back(b);
            }
        }
    }

    /// The writes that bring the given first-level cells of `slot` to the words of `inputs`.
    fn realize<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        slot: u32,
        inputs: &CellInputs,
        cells: &BTreeSet<u32>,
        phase: &mut Phase,
    ) -> Result<(), StoreError> {
        let base = slot * CELLS_PER_RULESET;
        for &cell in cells {
            let index = base + cell;
            let current = w.tables().cells[index as usize];
            match (current & CELL_REFINED != 0, cell_words(inputs, cell)) {
                (false, CellWords::Uniform(word)) => {
                    if current != word {
                        phase.cells.push(Write::Cell(index, word));
                    }
                }
                (false, CellWords::Refined(words)) => {
                    let b = self.alloc_block()?;
                    for (i, word) in words.iter().enumerate() {
                        phase
                            .blocks
                            .push(Write::Block(b * BLOCK_WORDS + i as u32, *word));
                    }
                    phase.cells.push(Write::Cell(index, CELL_REFINED | b));
                }
                (true, CellWords::Uniform(word)) => {
                    phase.cells.push(Write::Cell(index, word));
                    phase.retire.push(current & !CELL_REFINED);
                }
                (true, CellWords::Refined(words)) => {
                    let b = current & !CELL_REFINED;
                    let old = &w.tables().blocks
                        [(b * BLOCK_WORDS) as usize..((b + 1) * BLOCK_WORDS) as usize];
                    for (i, word) in words.iter().enumerate() {
                        if old[i] != *word {
                            phase
                                .blocks
                                .push(Write::Block(b * BLOCK_WORDS + i as u32, *word));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn run_phase<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        stats: &mut WriteStats,
        phase: Phase,
    ) -> Result<(), StoreError> {
        stats.write(w, &phase.blocks)?;
        stats.write(w, &phase.cells)?;
        stats.write(w, &phase.policy)?;
        let now = Instant::now();
        self.retired_blocks
            .extend(phase.retire.into_iter().map(|b| (b, now)));
        Ok(())
    }

    /// Writes `content` into a fresh slot (invisible until an endpoint record points to it) and
    /// returns the slot, with one reference.
    pub fn install<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        mut content: RuleSetContent,
        stats: &mut WriteStats,
    ) -> Result<u32, StoreError> {
        self.ensure_room(w, content.len(), stats)?;
        let slot = self.alloc_slot(w, stats)?;
        let inputs = content.cell_inputs();
        let mut phase = Phase::default();
        let all: BTreeSet<u32> = (0..CELLS_PER_RULESET).collect();
        let taken = |phase: &Phase| -> Vec<u32> {
            phase
                .cells
                .iter()
                .filter_map(|op| match op {
                    Write::Cell(_, word) if word & CELL_REFINED != 0 => Some(word & !CELL_REFINED),
                    _ => None,
                })
                .collect()
        };
        if let Err(e) = self.realize(w, slot, &inputs, &all, &mut phase) {
            // Blocks taken for this slot go back; nothing was written.
            self.free_blocks.extend(taken(&phase));
            self.free_slots.push_front(slot);
            return Err(e);
        }
        let blocks = taken(&phase);
        phase.policy.reserve(content.len());
        phase.policy.extend(
            content
                .policy_keys(slot)
                .map(|(k, v)| Write::PolicyUpsert(k, v)),
        );
        if let Err(e) = self.run_phase(w, stats, phase) {
            self.discard_partial_install(w, slot, &blocks);
            return Err(e);
        }
        let hash = content_hash(&content);
        self.by_hash.entry(hash).or_default().push(slot);
        share_with_writer(w, slot, &mut content.specific);
        self.slots[slot as usize] = Some(RuleSet {
            content,
            inputs,
            hash,
            refs: 1,
        });
        stats.rulesets_installed += 1;
        Ok(slot)
    }

    /// After an install that failed part-way: the slot holds what was written (nobody
    /// references it) and is released, so its keys and words are cleared after the grace
    /// period like any released slot's. Nothing leaks, and the held keys stay counted until
    /// then. `blocks` were taken for it: those no written word points to are free again.
    fn discard_partial_install<W: TableWriter + ?Sized>(
        &mut self,
        w: &W,
        slot: u32,
        blocks: &[u32],
    ) {
        let base = (slot * CELLS_PER_RULESET) as usize;
        let words = &w.tables().cells[base..base + CELLS_PER_RULESET as usize];
        for b in blocks {
            if !words.contains(&(CELL_REFINED | b)) {
                self.free_blocks.push_back(*b);
            }
        }
        let content = slot_content(w, slot).unwrap_or_default();
        self.slots[slot as usize] = Some(RuleSet {
            content,
            inputs: CellInputs::default(),
            hash: 0,
            refs: 0,
        });
        self.retired_slots.push_back((slot, Instant::now()));
    }

    /// Applies key changes to several slots in place (distinct slots), each in the safe order
    /// described in the module documentation; the slots go through each phase together, so a
    /// phase is one batch for all of them (a relabel changes ~150 rule sets by a few keys each:
    /// a batch per phase and slot cost more than the keys). Each slot's writes keep their order;
    /// how the slots interleave is free (`docs/datapath.md` §6, "In place"). The room for every
    /// key the changes add is checked before anything is written.
    pub fn update_with_diffs<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        updates: &[(u32, &ContentDiff)],
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let updates: Vec<(u32, &ContentDiff)> = updates
            .iter()
            .copied()
            .filter(|(_, diff)| !diff.is_empty())
            .collect();
        if updates.is_empty() {
            return Ok(());
        }
        // What each diff adds (the room it needs, and phase A's prefixes) and the content's
        // hash after it (one search of each upserted key for both).
        let mut grows = 0;
        let mut added = Vec::with_capacity(updates.len());
        let mut hashes = Vec::with_capacity(updates.len());
        for &(slot, diff) in &updates {
            assert!(slot != 0, "slot 0 is the permanent empty rule set");
            let current = self.content(slot).expect("update of a slot in use");
            let before = self.hash(slot).expect("update of a slot in use");
            let mut prefixes = Vec::new();
            hashes.push(current.hash_after_with(before, diff, |(_, p)| prefixes.push(p)));
            grows += prefixes.len() + added_wildcards(current, diff);
            added.push(prefixes);
        }
        self.ensure_room(w, grows, stats)?;
        let mut taken: Vec<(u32, RuleSet)> = updates
            .iter()
            .map(|&(slot, _)| {
                let rs = self.slots[slot as usize]
                    .take()
                    .expect("update of a slot in use (each slot once)");
                (slot, rs)
            })
            .collect();
        let result = self.update_slots(w, &mut taken, &updates, &added, stats);
        for (((slot, mut rs), &(_, diff)), hash) in taken.into_iter().zip(&updates).zip(hashes) {
            if let Some(v) = self.by_hash.get_mut(&rs.hash) {
                v.retain(|s| *s != slot);
                if v.is_empty() {
                    self.by_hash.remove(&rs.hash);
                }
            }
            if result.is_ok() {
                rs.hash = hash;
                match w.identity_keys(slot) {
                    // The writer's copy followed every write of the slot: it holds the identity
                    // keys with the diff applied, so the store takes it (its leaves shared)
                    // instead of applying the diff to its own (the same keys applied twice and
                    // compared: ~9 % of a local relabel's programming at 10k pods / 5k policies
                    // in a profile).
                    Some(keys) => {
                        #[cfg(debug_assertions)]
                        {
                            let mut mine = rs.content.specific.clone();
                            RuleSetContent::apply_specific(&mut mine, diff);
                            assert!(
                                mine == keys,
                                "slot {slot}: the writer's identity keys are not the store's"
                            );
                        }
                        rs.content.specific = keys;
                        rs.content.apply_wildcards(diff);
                    }
                    None => rs.content.apply(diff),
                }
            } else {
                // A write failed part-way: take the keys as the tables now hold them, and try
                // to bring the words in line with them (best effort; the error is reported
                // anyway). If even reading them back fails, the old content stays (the caller
                // programs everything again).
                if let Ok(content) = slot_content(w, slot) {
                    rs.content = content;
                }
                rs.inputs = rs.content.cell_inputs();
                rs.hash = content_hash(&rs.content);
                let all: BTreeSet<u32> = (0..CELLS_PER_RULESET).collect();
                let mut phase = Phase::default();
                if self.realize(w, slot, &rs.inputs, &all, &mut phase).is_ok() {
                    let _ = self.run_phase(w, stats, phase);
                }
            }
            self.by_hash.entry(rs.hash).or_default().push(slot);
            if result.is_err() {
                share_with_writer(w, slot, &mut rs.content.specific);
            }
            self.slots[slot as usize] = Some(rs);
        }
        result?;
        stats.rulesets_updated += updates.len() as u32;
        Ok(())
    }

    /// The phases of [`Store::update_with_diffs`], each one batch for all `slots` (taken out
    /// of the store: `rs.inputs` follows the writes, `rs.content` is the old content; `added`:
    /// per diff, the prefixes of the identity keys it adds).
    fn update_slots<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        slots: &mut [(u32, RuleSet)],
        diffs: &[(u32, &ContentDiff)],
        added: &[Vec<u32>],
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let key = |ruleset: u32, identity: u32, prefix: u32| PolicyKey {
            ruleset,
            identity,
            prefix,
        };

        // Phase A: widen the masks (only where a prefix gets its first identity key).
        let mut phase = Phase::default();
        for ((slot, rs), prefixes) in slots.iter_mut().zip(added) {
            let mut region = BTreeSet::new();
            for &p in prefixes {
                if rs.inputs.add_specific(p) {
                    region.extend(affected_cells(p));
                }
            }
            self.realize(w, *slot, &rs.inputs, &region, &mut phase)?;
        }
        self.run_phase(w, stats, phase)?;

        // Phases 1..4 (ChangeSet::safe_order).
        for (upsert, verdict) in [
            (true, V_DENY),
            (false, V_ALLOW),
            (false, V_DENY),
            (true, V_ALLOW),
        ] {
            let mut phase = Phase::default();
            for ((slot, rs), (_, diff)) in slots.iter_mut().zip(diffs) {
                let slot = *slot;
                let mut region = BTreeSet::new();
                if upsert {
                    for &((id, p), v) in &diff.specific_upserts {
                        if v.verdict == verdict {
                            phase.policy.push(Write::PolicyUpsert(key(slot, id, p), v));
                        }
                    }
                    for &(p, v) in &diff.wildcard_upserts {
                        if v.verdict == verdict {
                            rs.inputs.wildcard.insert(p, v.verdict);
                            region.extend(affected_cells(p));
                            phase.policy.push(Write::PolicyUpsert(key(slot, 0, p), v));
                        }
                    }
                } else {
                    for &((id, p), v) in &diff.specific_removes {
                        if v.verdict == verdict {
                            phase.policy.push(Write::PolicyDelete(key(slot, id, p)));
                        }
                    }
                    for &(p, v) in &diff.wildcard_removes {
                        if v.verdict == verdict {
                            rs.inputs.wildcard.remove(&p);
                            region.extend(affected_cells(p));
                            phase.policy.push(Write::PolicyDelete(key(slot, 0, p)));
                        }
                    }
                }
                self.realize(w, slot, &rs.inputs, &region, &mut phase)?;
            }
            self.run_phase(w, stats, phase)?;
        }

        // Phase Z: narrow the masks (only where a prefix loses its last identity key).
        let mut phase = Phase::default();
        for ((slot, rs), (_, diff)) in slots.iter_mut().zip(diffs) {
            let mut region = BTreeSet::new();
            for &((_, p), _) in &diff.specific_removes {
                if rs.inputs.remove_specific(p) {
                    region.extend(affected_cells(p));
                }
            }
            self.realize(w, *slot, &rs.inputs, &region, &mut phase)?;
        }
        self.run_phase(w, stats, phase)?;
        Ok(())
    }

    /// Rebuilds the store from what the tables hold (agent restart). Returns the store and the
    /// writes that repair inconsistencies (none when the previous process finished its last
    /// operation): cell words that do not match the slot's keys are recomputed, and slots that
    /// no endpoint references are cleared.
    pub fn adopt<W: TableWriter + ?Sized>(
        w: &mut W,
        max_rulesets: u32,
        max_blocks: u32,
        grace: Duration,
        refs: &BTreeMap<u32, u32>,
        stats: &mut WriteStats,
    ) -> Result<Store, StoreError> {
        assert!(
            !w.tables().keys_in_store,
            "adopting reads the policy keys from the tables: read them back first"
        );
        let mut store = Store::new(max_rulesets, max_blocks, grace);
        let mut contents: BTreeMap<u32, RuleSetContent> = BTreeMap::new();
        for (k, v) in &w.tables().policy {
            contents.entry(k.ruleset).or_default().insert_key(k, *v);
        }
        // Blocks referenced by any slot's words.
        let mut used_blocks = BTreeSet::new();
        let mut slots_with_words = BTreeSet::new();
        for slot in 0..max_rulesets {
            let base = slot * CELLS_PER_RULESET;
            for i in 0..CELLS_PER_RULESET {
                let word = w.tables().cells[(base + i) as usize];
                if word != 0 {
                    slots_with_words.insert(slot);
                }
                if word & CELL_REFINED != 0 {
                    used_blocks.insert(word & !CELL_REFINED);
                }
            }
        }
        store.free_blocks = (0..max_blocks)
            .filter(|b| !used_blocks.contains(b))
            .collect();
        let mut in_use = BTreeSet::new();
        for (&slot, &n) in refs {
            if slot != 0 && slot < max_rulesets && n > 0 {
                in_use.insert(slot);
            }
        }
        for &slot in &in_use {
            let mut content = contents.remove(&slot).unwrap_or_default();
            let inputs = content.cell_inputs();
            let hash = content_hash(&content);
            store.by_hash.entry(hash).or_default().push(slot);
            share_with_writer(w, slot, &mut content.specific);
            store.slots[slot as usize] = Some(RuleSet {
                content,
                inputs: inputs.clone(),
                hash,
                refs: refs[&slot],
            });
            // Repair words that do not match the keys (an interrupted update).
            let mut phase = Phase::default();
            let all: BTreeSet<u32> = (0..CELLS_PER_RULESET).collect();
            store.realize(w, slot, &inputs, &all, &mut phase)?;
            store.run_phase(w, stats, phase)?;
        }
        // Everything else is garbage of an interrupted operation: clear it.
        let orphans: BTreeSet<u32> = contents
            .keys()
            .copied()
            .chain(slots_with_words.iter().copied())
            .filter(|s| *s != 0 && !in_use.contains(s) && *s < max_rulesets)
            .collect();
        for slot in &orphans {
            store.slots[*slot as usize] = Some(RuleSet {
                content: contents.remove(slot).unwrap_or_default(),
                inputs: CellInputs::default(),
                hash: 0,
                refs: 0,
            });
            store.clear_slot(w, *slot, stats)?;
        }
        store.free_slots = (1..max_rulesets).filter(|s| !in_use.contains(s)).collect();
        Ok(store)
    }
}
