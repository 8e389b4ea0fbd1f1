//! The datapath's maps as data: [`MemTables`] holds exactly the keys and values the kernel maps
//! hold, and [`TableWriter`] is the one interface through which the control plane changes them.
//!
//! * The kernel writer (`kernel::KernelTables`) writes every batch to the BPF maps and then to
//!   its [`MemTables`] mirror, so userspace can run the kernel's own decision function over the
//!   same bytes ([`MemTables`] implements `DatapathMaps`).
//! * Tests use [`MemTables`] directly as the writer, and can observe every single element write
//!   (the kernel applies a batch element by element, so these are exactly the intermediate
//!   states packets can see).

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap},
};

use ordnet_mapstate::FastHash;

use crate::{leafmap::LeafMap, store::Store, words::Words};

use ordnet_datapath_common::{
    DatapathMaps, addr_bytes, addr_words,
    layout::{
        BLOCK_WORDS, CELL_REFINED, CELLS_PER_RULESET, CtEntry, CtKey, FAMILY_V4, IfaceInfo, IpInfo,
        IpKey, PolicyKey, PolicyValue, State, SvcKey,
    },
    lookup::PolicyMaps,
};

/// One write to one map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Cell array word `.0` (a word index, not a `u64` element index) becomes `.1`.
    Cell(u32, u32),
    /// Refined-block array word `.0` becomes `.1`.
    Block(u32, u32),
    /// Inserts or overwrites a policy key.
    PolicyUpsert(PolicyKey, PolicyValue),
    /// Removes a policy key.
    PolicyDelete(PolicyKey),
    /// Inserts or overwrites an exact ipcache record.
    IpUpsert(IpKey, IpInfo),
    /// Removes an exact ipcache record.
    IpDelete(IpKey),
    /// Inserts or overwrites a CIDR ipcache entry: masked address, address prefix length, record.
    CidrUpsert(IpKey, u32, IpInfo),
    /// Removes a CIDR ipcache entry: masked address, address prefix length.
    CidrDelete(IpKey, u32),
    /// The global state (revision and clock parameters).
    State(State),
    /// A Service frontend appears or goes.
    SvcUpsert(SvcKey),
    /// Removes a Service frontend.
    SvcDelete(SvcKey),
    /// A local endpoint's interface appears, changes or goes.
    IfaceUpsert(u32, IfaceInfo),
    /// Removes a local endpoint's interface (by index).
    IfaceDelete(u32),
}

/// Errors of a table write.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A `bpf(2)` batch operation (update, delete or lookup) failed.
    #[error("{map}: {op} failed after {done} of {total} elements: {source}")]
    Syscall {
        /// Name of the map.
        map: &'static str,
        /// The operation (`update batch`, ...).
        op: &'static str,
        /// Elements applied before the failure (0 for a lookup).
        done: usize,
        /// Elements in the batch (0 for a lookup).
        total: usize,
        /// The error the kernel returned.
        #[source]
        source: std::io::Error,
    },
    /// An aya map operation failed.
    #[error("{map}: {source}")]
    Map {
        /// Name of the map.
        map: &'static str,
        /// The aya error.
        #[source]
        source: aya::maps::MapError,
    },
    /// A map has no room for another element: map name, capacity.
    #[error("{0} is full ({1} entries)")]
    Full(&'static str, u32),
}

impl WriteError {
    /// Whether a map had no room (the kernel's `E2BIG` for a full hash map, `ENOSPC`, or an
    /// allocation that failed with `ENOMEM`).
    pub fn is_capacity(&self) -> bool {
        match self {
            WriteError::Full(..) => true,
            WriteError::Syscall { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::E2BIG | libc::ENOSPC | libc::ENOMEM)
            ),
            WriteError::Map { .. } => false,
        }
    }

    /// [`WriteError::is_capacity`] of the policy map (the one a deny-all policy needs no room
    /// in).
    pub fn is_policy_capacity(&self) -> bool {
        let map = match self {
            WriteError::Syscall { map, .. }
            | WriteError::Map { map, .. }
            | WriteError::Full(map, _) => map,
        };
        *map == ordnet_datapath_common::layout::MAP_POLICY && self.is_capacity()
    }
}

/// Batched writes to the datapath maps. Each call is one batch; elements are applied in order.
pub trait TableWriter {
    /// Applies `writes`, in order, as one batch.
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError>;
    /// Current state (what has been written so far).
    fn tables(&self) -> &MemTables;
    /// The policy keys of rule set `slot` as the maps hold them (read back after a failed
    /// write). From [`MemTables::policy`] unless the tables keep no copy of the keys
    /// ([`MemTables::keys_in_store`]): then the writer reads them from where they are.
    fn slot_keys(&self, slot: u32) -> Result<Vec<(PolicyKey, PolicyValue)>, WriteError> {
        Ok(self.tables().policy_of(slot))
    }
    /// Writes what is due after a grace period below the identity level: the keys of retired
    /// identity classes (`classes`). Nothing for writers without classes (the default).
    fn reclaim_below(&mut self) -> Result<(), WriteError> {
        Ok(())
    }
    /// When [`TableWriter::reclaim_below`] next has something to write (`None`: nothing
    /// waits; the default).
    fn reclaim_due_below(&self) -> Option<std::time::Instant> {
        None
    }
    /// The writer's own copy of rule set `slot`'s identity keys (`(identity, prefix) → value`,
    /// empty for a slot without any), when it keeps one (the class translation's model,
    /// which follows every write): after a complete write of the slot it holds exactly the
    /// store's keys, so the store takes its leaves (one copy of the keys for two holders) instead
    /// of applying the write to a copy of its own. `None` for writers without such a copy (the
    /// default).
    fn identity_keys(&self, slot: u32) -> Option<LeafMap<(u32, u32), PolicyValue>> {
        let _ = slot;
        None
    }
}

/// An in-memory copy of the datapath maps.
#[derive(Debug, Clone, Default)]
pub struct MemTables {
    /// Exact ipcache records of both families (`ORDNET_IP4`, `ORDNET_IP6`).
    pub ipcache: HashMap<IpKey, IpInfo, FastHash>,
    /// How many of [`MemTables::ipcache`]'s records are IPv6 (kept by [`MemTables::apply`], so
    /// the maps' fill, read after every batch, counts no records: [`MemTables::ip_records`]).
    ipcache_v6: usize,
    /// (key, address prefix length) -> info.
    pub cidr: BTreeMap<(IpKey, u32), IpInfo>,
    /// Address prefix lengths present per family (for the longest-prefix search).
    cidr_lengths: BTreeMap<(u32, u32), usize>,
    /// The cell array (`ORDNET_CELLS`), as `u32` words (a chunk per rule set).
    pub cells: Words,
    /// The refined-block array (`ORDNET_BLOCKS`), as `u32` words (a chunk per block).
    pub blocks: Words,
    /// The policy keys of every rule set (`ORDNET_POLICY`); empty when
    /// [`MemTables::keys_in_store`]. Ordered, not hashed: a hash table that grows past its
    /// capacity rehashes every key within the one write that crossed it — with node-local
    /// classes this is the class-level mirror of every change, and at 10k pods / 5k policies
    /// such a rehash was 5-6 ms of one local relabel (its slowest datapath change 20.4-21.1 →
    /// 14.1-14.8 ms in `engine_changes`; the median 0.3-0.5 ms slower). It also gives a rule
    /// set's keys as a range.
    pub policy: BTreeMap<PolicyKey, PolicyValue>,
    /// The policy keys are not copied into [`MemTables::policy`]: the rule set store of the
    /// control plane that writes these tables has every one of them (as each slot's content),
    /// and decisions read them there ([`Mirror`]). The agent's datapaths keep no
    /// second copy (72 MiB at 50,000 pods); tests that check every single write keep it.
    pub keys_in_store: bool,
    /// The global state (`ORDNET_STATE`).
    pub state: State,
    /// Service frontends.
    pub services: std::collections::BTreeSet<SvcKey>,
    /// Interfaces of local endpoints, by index.
    pub ifaces: BTreeMap<u32, IfaceInfo>,
}

impl MemTables {
    /// Empty tables of the given array sizes (in words).
    pub fn new(cells: u32, blocks: u32) -> MemTables {
        MemTables {
            cells: Words::zeroed(cells as usize, CELLS_PER_RULESET as usize),
            blocks: Words::zeroed(blocks as usize, BLOCK_WORDS as usize),
            ..MemTables::default()
        }
    }

    /// The exact ipcache records per family: `[IPv4, IPv6]` (`ORDNET_IP4`, `ORDNET_IP6`). Counted
    /// by [`MemTables::apply`], the one writer of [`MemTables::ipcache`] (debug builds check).
    pub fn ip_records(&self) -> [usize; 2] {
        debug_assert_eq!(
            self.ipcache_v6,
            self.ipcache
                .keys()
                .filter(|k| k.family != u32::from(FAMILY_V4))
                .count(),
            "the ipcache was written around MemTables::apply"
        );
        let v6 = self.ipcache_v6.min(self.ipcache.len());
        [self.ipcache.len() - v6, v6]
    }

    /// Keeps one copy of the cell and block words these tables and `other` agree on, among
    /// those `writes` wrote ([`Words::share_written_from`]): with identity classes both levels
    /// write the same words, and debug builds check that no chunk is then held twice.
    pub fn share_words_from(&mut self, other: &MemTables, writes: &[Write]) {
        let cells = writes.iter().filter_map(|w| match *w {
            Write::Cell(i, _) => Some(i as usize),
            _ => None,
        });
        self.cells.share_written_from(&other.cells, cells);
        let blocks = writes.iter().filter_map(|w| match *w {
            Write::Block(i, _) => Some(i as usize),
            _ => None,
        });
        self.blocks.share_written_from(&other.blocks, blocks);
        debug_assert!(
            self.cells.own_chunks(&other.cells) == 0 && self.blocks.own_chunks(&other.blocks) == 0,
            "words held twice: the two tables' words differ"
        );
    }

    /// The keys of rule set `slot` in [`MemTables::policy`].
    pub fn policy_of(&self, slot: u32) -> Vec<(PolicyKey, PolicyValue)> {
        let from = PolicyKey {
            ruleset: slot,
            identity: 0,
            prefix: 0,
        };
        self.policy
            .range(from..)
            .take_while(|(k, _)| k.ruleset == slot)
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// Stops copying the policy keys ([`MemTables::keys_in_store`]) and frees the copy.
    pub fn keep_keys_in_store(&mut self) {
        self.keys_in_store = true;
        self.policy = BTreeMap::new();
    }

    /// Applies one write.
    pub fn apply(&mut self, w: &Write) {
        match *w {
            Write::Cell(i, v) => self.cells.set(i as usize, v),
            Write::Block(i, v) => self.blocks.set(i as usize, v),
            Write::PolicyUpsert(k, v) => {
                if !self.keys_in_store {
                    self.policy.insert(k, v);
                }
            }
            Write::PolicyDelete(k) => {
                if !self.keys_in_store {
                    self.policy.remove(&k);
                }
            }
            Write::IpUpsert(k, v) => {
                if self.ipcache.insert(k, v).is_none() && k.family != u32::from(FAMILY_V4) {
                    self.ipcache_v6 += 1;
                }
            }
            Write::IpDelete(k) => {
                if self.ipcache.remove(&k).is_some() && k.family != u32::from(FAMILY_V4) {
                    self.ipcache_v6 = self.ipcache_v6.saturating_sub(1);
                }
            }
            Write::CidrUpsert(k, len, v) => {
                if self.cidr.insert((k, len), v).is_none() {
                    *self.cidr_lengths.entry((k.family, len)).or_default() += 1;
                }
            }
            Write::CidrDelete(k, len) => {
                if self.cidr.remove(&(k, len)).is_some()
                    && let Some(n) = self.cidr_lengths.get_mut(&(k.family, len))
                {
                    *n -= 1;
                    if *n == 0 {
                        self.cidr_lengths.remove(&(k.family, len));
                    }
                }
            }
            Write::State(s) => self.state = s,
            Write::SvcUpsert(k) => {
                self.services.insert(k);
            }
            Write::SvcDelete(k) => {
                self.services.remove(&k);
            }
            Write::IfaceUpsert(i, v) => {
                self.ifaces.insert(i, v);
            }
            Write::IfaceDelete(i) => {
                self.ifaces.remove(&i);
            }
        }
    }

    /// Longest-prefix match of a full address in the CIDR table.
    pub fn cidr_lookup(&self, key: &IpKey) -> Option<IpInfo> {
        let addr = u128::from_be_bytes(addr_bytes(key.addr));
        self.cidr_lengths
            .range((key.family, 0)..=(key.family, 128))
            .rev()
            .find_map(|(&(_, len), _)| {
                let mask = if len == 0 {
                    0
                } else {
                    u128::MAX << (128 - len)
                };
                let masked = IpKey {
                    family: key.family,
                    addr: addr_words((addr & mask).to_be_bytes()),
                };
                self.cidr.get(&(masked, len)).copied()
            })
    }

    /// What the tables mean, independent of where things are stored: see [`CanonicalTables`].
    pub fn canonical(&self) -> CanonicalTables {
        let mut keys: HashMap<u32, BTreeMap<(u32, u32), u8>> = HashMap::new();
        for (k, v) in &self.policy {
            keys.entry(k.ruleset)
                .or_default()
                .insert((k.identity, k.prefix), v.verdict);
        }
        let mut slots: BTreeMap<u32, CanonicalRuleSet> = BTreeMap::new();
        let mut ruleset = |slot: u32| {
            slots
                .entry(slot)
                .or_insert_with(|| {
                    let base = (slot * CELLS_PER_RULESET) as usize;
                    let cells = (base..base + CELLS_PER_RULESET as usize)
                        .map(|i| {
                            let w = self.cells.get(i).unwrap_or(0);
                            if w & CELL_REFINED == 0 {
                                CanonicalCell::Word(w)
                            } else {
                                let b = ((w & !CELL_REFINED) * BLOCK_WORDS) as usize;
                                CanonicalCell::Block(
                                    self.blocks
                                        .get_range(b..b + BLOCK_WORDS as usize)
                                        .unwrap_or_default()
                                        .to_vec(),
                                )
                            }
                        })
                        .collect();
                    CanonicalRuleSet {
                        cells,
                        keys: keys.remove(&slot).unwrap_or_default(),
                    }
                })
                .clone()
        };
        let ipcache = self
            .ipcache
            .iter()
            .map(|(k, i)| {
                let record = CanonicalRecord {
                    identity: i.identity,
                    flags: i.flags,
                    endpoint: i.endpoint,
                    ingress: (i.ingress.default, ruleset(i.ingress.ruleset)),
                    egress: (i.egress.default, ruleset(i.egress.ruleset)),
                };
                (*k, record)
            })
            .collect();
        CanonicalTables {
            ipcache,
            cidr: self.cidr.clone(),
            services: self.services.clone(),
            ifaces: self.ifaces.clone(),
        }
    }
}

impl TableWriter for MemTables {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        for w in writes {
            self.apply(w);
        }
        Ok(())
    }

    fn tables(&self) -> &MemTables {
        self
    }
}

impl PolicyMaps for MemTables {
    fn cell(&self, index: u32) -> Option<u32> {
        self.cells.get(index as usize)
    }

    fn block_word(&self, index: u32) -> Option<u32> {
        self.blocks.get(index as usize)
    }

    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        self.policy.get(key).copied()
    }
}

/// What [`MemTables`] mean, independent of where things happen to be stored (rule set slot and
/// block numbers, the revision, leftovers that no record references): every address with its
/// record, whose policy references are replaced by the default and the rule set they point to,
/// and the CIDR table. Tables with equal canonical forms give every packet the same decision;
/// comparing them checks that two ways of programming the same state agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalTables {
    /// Exact ipcache records, with their rule sets resolved.
    pub ipcache: BTreeMap<IpKey, CanonicalRecord>,
    /// The CIDR table: (masked address, address prefix length) -> record.
    pub cidr: BTreeMap<(IpKey, u32), IpInfo>,
    /// Service frontends.
    pub services: std::collections::BTreeSet<SvcKey>,
    /// Interfaces of local endpoints, by index.
    pub ifaces: BTreeMap<u32, IfaceInfo>,
}

/// An ipcache record with its rule sets resolved: `(default, rule set)` per direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalRecord {
    /// Security identity (0 = none).
    pub identity: u32,
    /// `IP_FLAG_*`.
    pub flags: u32,
    /// Local endpoint id (0 = not a local endpoint).
    pub endpoint: u32,
    /// Ingress isolation default (`V_ALLOW`/`V_DENY`) and rule set.
    pub ingress: (u8, CanonicalRuleSet),
    /// Egress isolation default (`V_ALLOW`/`V_DENY`) and rule set.
    pub egress: (u8, CanonicalRuleSet),
}

/// A rule set as the program reads it: its cell words (a refined one replaced by its block's
/// words) and its policy keys `(identity, prefix) -> verdict`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalRuleSet {
    /// The `CELLS_PER_RULESET` cells, in index order.
    pub cells: Vec<CanonicalCell>,
    /// Policy keys: (identity, prefix bits) -> verdict; identity 0 = `*`.
    pub keys: BTreeMap<(u32, u32), u8>,
}

/// One first-level cell word, or the 256 words of its refined block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonicalCell {
    /// An unrefined cell word.
    Word(u32),
    /// The words of the cell's refined block (one per low port byte).
    Block(Vec<u32>),
}

/// A userspace connection-tracking table and clock for [`Mirror`].
#[derive(Debug, Default)]
pub struct UserCt {
    /// The tracked flows.
    pub entries: RefCell<HashMap<CtKey, CtEntry>>,
    /// `None`: CLOCK_MONOTONIC in ticks of the state's `hz` (the kernel counts jiffies; only
    /// differences matter); `Some`: a fixed time in ticks.
    pub clock: Option<u64>,
}

/// Monotonic time in ns.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// [`MemTables`] plus a connection-tracking table and the rule set store: everything `decide`
/// reads.
#[derive(Debug, Clone, Copy)]
pub struct Mirror<'a> {
    /// The map contents.
    pub tables: &'a MemTables,
    /// The connection-tracking table and clock.
    pub ct: &'a UserCt,
    /// The rule set store of the control plane that wrote `tables`: the policy keys are read
    /// there (each slot's content is exactly its keys in the maps), whether or not the tables
    /// keep a copy ([`MemTables::keys_in_store`]).
    pub store: &'a Store,
}

impl PolicyMaps for Mirror<'_> {
    fn cell(&self, index: u32) -> Option<u32> {
        self.tables.cell(index)
    }

    fn block_word(&self, index: u32) -> Option<u32> {
        self.tables.block_word(index)
    }

    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        self.store.policy_value(key)
    }
}

impl DatapathMaps for Mirror<'_> {
    fn state(&self) -> Option<&State> {
        Some(&self.tables.state)
    }

    fn ipcache(&self, key: &IpKey) -> Option<&IpInfo> {
        self.tables.ipcache.get(key)
    }

    fn ipcidr(&self, key: &IpKey) -> Option<[u32; 2]> {
        self.tables.cidr_lookup(key).map(|i| i.peer())
    }

    fn ct_lookup(&self, key: &CtKey) -> Option<CtEntry> {
        self.ct.entries.borrow().get(key).copied()
    }

    fn ct_store(&self, key: &CtKey, entry: &CtEntry) {
        self.ct.entries.borrow_mut().insert(*key, *entry);
    }

    fn ct_delete(&self, key: &CtKey) {
        self.ct.entries.borrow_mut().remove(key);
    }

    fn now(&self) -> u64 {
        self.ct.clock.unwrap_or_else(|| {
            let hz = self.tables.state.hz.max(1);
            (u128::from(monotonic_ns()) * u128::from(hz) / 1_000_000_000) as u64
        })
    }

    fn service(&self, key: &SvcKey) -> bool {
        self.tables.services.contains(key)
    }

    fn interface(&self, ifindex: u32) -> Option<IfaceInfo> {
        self.tables.ifaces.get(&ifindex).copied()
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::control::ip_key;

    /// The per-family record count follows every write (new, rewritten, removed, removed
    /// again) and agrees with a count of the records.
    #[test]
    fn ip_records_are_counted_per_family_as_written() {
        let mut t = MemTables::new(0, 0);
        let ips: Vec<IpAddr> = ["10.0.0.1", "10.0.0.2", "fd00::1", "fd00::2", "fd00::3"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let info = IpInfo::default();
        let recount = |t: &MemTables| {
            let v4 = t
                .ipcache
                .keys()
                .filter(|k| k.family == u32::from(FAMILY_V4))
                .count();
            [v4, t.ipcache.len() - v4]
        };
        for ip in &ips {
            t.apply(&Write::IpUpsert(ip_key(*ip), info));
        }
        assert_eq!(t.ip_records(), [2, 3]);
        // Rewriting a record adds none.
        t.apply(&Write::IpUpsert(
            ip_key(ips[2]),
            IpInfo {
                identity: 7,
                ..info
            },
        ));
        assert_eq!(t.ip_records(), [2, 3]);
        t.apply(&Write::IpDelete(ip_key(ips[0])));
        t.apply(&Write::IpDelete(ip_key(ips[3])));
        // A record removed twice is removed once.
        t.apply(&Write::IpDelete(ip_key(ips[3])));
        assert_eq!(t.ip_records(), [1, 2]);
        assert_eq!(t.ip_records(), recount(&t));
        assert_eq!(t.clone().ip_records(), [1, 2]);
    }
}
