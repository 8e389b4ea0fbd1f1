//! The layout comparison: builders for the alternative policy layouts of
//! `ordnet_datapath_common::alt`, their userspace lookups (same code as the kernel), and the
//! loader of the benchmark object ([`BENCH_OBJECT`](crate::BENCH_OBJECT)). Used by
//! `cargo bench -p ordnet-datapath` and the tests; not part of enforcement.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    os::fd::AsFd as _,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap as BpfHashMap, IterableMap as _, MapData, lpm_trie::Key, lpm_trie::LpmTrie,
    },
    programs::{
        LinkOrder, SchedClassifier, Xdp,
        tc::{TcAttachOptions, TcAttachType},
    },
};
use ordnet_datapath_common::{
    alt::{
        CILIUM_FIXED_BITS, CiliumData, CiliumMaps, CiliumValue, ClassKey, ClassMaps,
        LPM_POLICY_FIXED_BITS, LpmMaps, LpmPolicyData, ProbeMaps, ProbeMeta,
    },
    layout::{
        BLOCK_WORDS, CELL_REFINED, CELLS_PER_RULESET, OTHER_SLOT_CELL, PolicyKey, PolicyRef,
        PolicyValue, SLOT_PROTOCOLS, V_ALLOW, proto_slot,
    },
    lookup::PolicyMaps,
};
use ordnet_mapstate::{MapState, Peer};

use crate::{
    DatapathError, TestRunOutcome,
    flat::{RuleSetContent, flatten, verdict_code},
    store::{Store, WriteStats},
    sys,
    tables::{MemTables, TableWriter, Write, WriteError},
    test_run_program,
};

fn prefix_len(p: u32) -> u32 {
    p & 0xff
}

/// Protocol and inclusive port range of a prefix (len >= 8).
fn port_range(p: u32) -> (u8, u32, u32) {
    let len = prefix_len(p);
    let proto = (p >> 24) as u8;
    let first = (p >> 8) & 0xffff;
    let last = if len <= 8 {
        0xffff
    } else {
        first | ((1 << (24 - len)) - 1)
    };
    (proto, first, last)
}

/// The class layout of one rule set: port classes (elementary intervals between all key
/// boundaries, per protocol) in cell arrays, and one hash entry per (identity or `*`, class)
/// the identity's keys cover.
#[derive(Debug, Clone, Default)]
pub struct ClassLayout {
    /// The rule set number the layout is for.
    pub ruleset: u32,
    /// First-level cell words (as the enforcing layout's).
    pub l1: Vec<u32>,
    /// Refined cells' blocks.
    pub blocks: Vec<u32>,
    /// (rule set, identity or 0, class) -> verdict.
    pub entries: HashMap<ClassKey, PolicyValue>,
    /// Number of port classes.
    pub classes: u32,
}

/// Builds the class layout of `content` as rule set `ruleset`.
pub fn class_layout(content: &RuleSetContent, ruleset: u32) -> ClassLayout {
    // Boundaries per protocol slot: the first port of every interval.
    let mut starts: [BTreeSet<u32>; 3] = Default::default();
    for s in &mut starts {
        s.insert(0);
    }
    let all_prefixes = content
        .specific
        .keys()
        .map(|(_, p)| *p)
        .chain(content.wildcard.keys().copied());
    for p in all_prefixes {
        if prefix_len(p) < 8 {
            continue;
        }
        let (proto, first, last) = port_range(p);
        let slot = proto_slot(proto).expect("flattened") as usize;
        starts[slot].insert(first);
        if last < 0xffff {
            starts[slot].insert(last + 1);
        }
    }
    // Class numbers: slot intervals in order, then one class for other protocols.
    let mut class_start: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut next = 0u32;
    let mut first_class = [0u32; 3];
    for (slot, s) in starts.iter().enumerate() {
        first_class[slot] = next;
        let v: Vec<u32> = s.iter().copied().collect();
        next += v.len() as u32;
        class_start.push((slot, v));
    }
    let other_class = next;
    let classes = next + 1;
    let class_of = |slot: usize, port: u32| -> u32 {
        let v = &class_start[slot].1;
        let i = v.partition_point(|s| *s <= port) - 1;
        first_class[slot] + i as u32
    };
    // Cell words.
    let mut l1 = vec![0u32; CELLS_PER_RULESET as usize];
    let mut blocks = Vec::new();
    for slot in 0..3 {
        for hi in 0..256u32 {
            let a = class_of(slot, hi << 8);
            let b = class_of(slot, (hi << 8) | 0xff);
            let cell = slot as u32 * 256 + hi;
            if a == b {
                l1[cell as usize] = a;
            } else {
                l1[cell as usize] = CELL_REFINED | (blocks.len() as u32 / BLOCK_WORDS);
                for lo in 0..256 {
                    blocks.push(class_of(slot, (hi << 8) | lo));
                }
            }
        }
    }
    l1[OTHER_SLOT_CELL as usize] = other_class;
    // Entries: per peer, keys from shortest to longest overwrite the classes they cover.
    let mut by_peer: BTreeMap<u32, Vec<(u32, u8)>> = BTreeMap::new();
    for (&(id, p), &v) in &content.specific {
        by_peer.entry(id).or_default().push((p, v.verdict));
    }
    for (&p, &v) in &content.wildcard {
        by_peer.entry(0).or_default().push((p, v.verdict));
    }
    let mut entries = HashMap::new();
    for (peer, mut keys) in by_peer {
        keys.sort_by_key(|(p, _)| prefix_len(*p));
        let mut classes_of_peer: BTreeMap<u32, u8> = BTreeMap::new();
        for (p, v) in keys {
            if prefix_len(p) == 0 {
                for c in 0..classes {
                    classes_of_peer.insert(c, v);
                }
                continue;
            }
            let (proto, first, last) = port_range(p);
            let slot = proto_slot(proto).expect("flattened") as usize;
            for c in class_of(slot, first)..=class_of(slot, last) {
                classes_of_peer.insert(c, v);
            }
        }
        for (class, v) in classes_of_peer {
            entries.insert(
                ClassKey {
                    ruleset,
                    identity: peer,
                    class,
                },
                PolicyValue::new(v),
            );
        }
    }
    ClassLayout {
        ruleset,
        l1,
        blocks,
        entries,
        classes,
    }
}

impl PolicyMaps for ClassLayout {
    fn cell(&self, index: u32) -> Option<u32> {
        let base = self.ruleset * CELLS_PER_RULESET;
        index
            .checked_sub(base)
            .and_then(|i| self.l1.get(i as usize).copied())
    }
    fn block_word(&self, index: u32) -> Option<u32> {
        self.blocks.get(index as usize).copied()
    }
    fn policy(&self, _key: &PolicyKey) -> Option<PolicyValue> {
        None
    }
}

impl ClassMaps for ClassLayout {
    fn class_policy(&self, key: &ClassKey) -> Option<PolicyValue> {
        self.entries.get(key).copied()
    }
}

/// The probe layout of one rule set: every key in the hash (identity 0 for `*`) and the sets of
/// lengths used.
#[derive(Debug, Clone, Default)]
pub struct ProbeLayout {
    /// The rule set number the layout is for.
    pub ruleset: u32,
    /// The key lengths used, per protocol slot.
    pub meta: ProbeMeta,
    /// Every key.
    pub entries: HashMap<PolicyKey, PolicyValue>,
}

/// The probe layout of a flattened rule set.
pub fn probe_layout(content: &RuleSetContent, ruleset: u32) -> ProbeLayout {
    let mut l = ProbeLayout {
        ruleset,
        ..ProbeLayout::default()
    };
    for (&(identity, prefix), &v) in &content.specific {
        l.meta.specific_lengths |= 1 << prefix_len(prefix);
        l.entries.insert(
            PolicyKey {
                ruleset,
                identity,
                prefix,
            },
            v,
        );
    }
    for (&prefix, &v) in &content.wildcard {
        l.meta.wildcard_lengths |= 1 << prefix_len(prefix);
        l.entries.insert(
            PolicyKey {
                ruleset,
                identity: 0,
                prefix,
            },
            v,
        );
    }
    l
}

impl ProbeMaps for ProbeLayout {
    fn meta(&self, ruleset: u32) -> Option<ProbeMeta> {
        (ruleset == self.ruleset).then_some(self.meta)
    }
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        self.entries.get(key).copied()
    }
}

/// Whether the first `bits` bits of `a` and `b` agree.
fn prefix_eq(a: &[u8], b: &[u8], bits: u32) -> bool {
    let full = (bits / 8) as usize;
    if a[..full] != b[..full] {
        return false;
    }
    let rest = bits % 8;
    rest == 0 || (a[full] ^ b[full]) >> (8 - rest) == 0
}

fn lpm_bytes(d: &LpmPolicyData) -> [u8; 11] {
    let mut b = [0u8; 11];
    b[..4].copy_from_slice(&d.ruleset);
    b[4..8].copy_from_slice(&d.identity);
    b[8..].copy_from_slice(&d.l4);
    b
}

/// The LPM layout of one rule set: every key as an LPM entry (rule set, identity or 0, prefix).
#[derive(Debug, Clone, Default)]
pub struct LpmLayout {
    /// (prefix length, key data, verdict) of every key.
    pub entries: Vec<(u32, LpmPolicyData, PolicyValue)>,
}

/// The LPM layout of a flattened rule set.
pub fn lpm_layout(content: &RuleSetContent, ruleset: u32) -> LpmLayout {
    let key = |identity: u32, prefix: u32| {
        let len = prefix_len(prefix);
        let data = LpmPolicyData::new(
            ruleset,
            identity,
            (prefix >> 24) as u8,
            ((prefix >> 8) & 0xffff) as u16,
        );
        (LPM_POLICY_FIXED_BITS + len, data)
    };
    let mut entries = Vec::new();
    for (&(id, p), &v) in &content.specific {
        let (l, d) = key(id, p);
        entries.push((l, d, v));
    }
    for (&p, &v) in &content.wildcard {
        let (l, d) = key(0, p);
        entries.push((l, d, v));
    }
    LpmLayout { entries }
}

impl LpmMaps for LpmLayout {
    fn lpm(&self, prefix_len: u32, data: &LpmPolicyData) -> Option<PolicyValue> {
        let q = lpm_bytes(data);
        self.entries
            .iter()
            .filter(|(l, d, _)| *l <= prefix_len && prefix_eq(&lpm_bytes(d), &q, *l))
            .max_by_key(|(l, _, _)| *l)
            .map(|(_, _, v)| *v)
    }
}

fn cilium_bytes(d: &CiliumData) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&d.sec_label);
    b[4] = d.egress;
    b[5] = d.protocol;
    b[6..].copy_from_slice(&d.dport);
    b
}

/// Cilium's layout of one endpoint and direction: every MapState key with a precedence derived
/// from its rank (order key, deny before allow).
#[derive(Debug, Clone, Default)]
pub struct CiliumLayout {
    /// (prefix length, key data, value with precedence) of every key.
    pub entries: Vec<(u32, CiliumData, CiliumValue)>,
}

/// Cilium's layout of a MapState (`egress`: the direction bit of its keys).
pub fn cilium_layout(ms: &MapState, egress: bool) -> CiliumLayout {
    let keys = ms.iter();
    let ranks: BTreeSet<_> = keys.iter().map(|(_, e)| (e.order, e.verdict)).collect();
    let ranks: Vec<_> = ranks.into_iter().collect();
    let mut entries = Vec::new();
    for (k, e) in keys {
        let rank = ranks.binary_search(&(e.order, e.verdict)).expect("present");
        // Stronger (smaller rank) = higher precedence; never MAX_PRECEDENCE.
        let precedence = u32::MAX - 1 - rank as u32;
        let identity = match k.peer {
            Peer::Any => 0,
            Peer::Id(id) => id,
        };
        let proto = k.prefix.protocol().unwrap_or(0);
        let port = k.prefix.port_range().map_or(0, |(first, _)| first);
        entries.push((
            CILIUM_FIXED_BITS + u32::from(k.prefix.len()),
            CiliumData::new(identity, egress, proto, port),
            CiliumValue {
                precedence,
                deny: u8::from(verdict_code(e.verdict) != V_ALLOW),
                prefix_len: k.prefix.len(),
                _pad: [0; 2],
            },
        ));
    }
    CiliumLayout { entries }
}

impl CiliumMaps for CiliumLayout {
    fn cilium(&self, prefix_len: u32, data: &CiliumData) -> Option<CiliumValue> {
        let q = cilium_bytes(data);
        self.entries
            .iter()
            .filter(|(l, d, _)| *l <= prefix_len && prefix_eq(&cilium_bytes(d), &q, *l))
            .max_by_key(|(l, _, _)| *l)
            .map(|(_, _, v)| *v)
    }
}

/// A layout of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    /// Parsing and the config read only, no policy decision (the shared baseline).
    Parse,
    /// One exact hash lookup (the floor).
    Floor,
    /// The enforcing layout.
    Ordnet,
    /// Port classes: (identity, class) then (0, class).
    Classes,
    /// Hash probes at every length the rule set uses.
    Probes,
    /// Two LPM lookups of the MapState's keys.
    Lpm,
    /// Cilium's layout and lookup (reference).
    Cilium,
}

impl Layout {
    /// Every layout, in the order the benchmark prints them.
    pub const ALL: [Layout; 7] = [
        Layout::Parse,
        Layout::Floor,
        Layout::Ordnet,
        Layout::Classes,
        Layout::Probes,
        Layout::Lpm,
        Layout::Cilium,
    ];

    /// The name of its benchmark program in the benchmark eBPF object.
    pub fn program(self) -> &'static str {
        match self {
            Layout::Parse => "bench_parse",
            Layout::Floor => "bench_floor",
            Layout::Ordnet => "bench_ordnet",
            Layout::Classes => "bench_classes",
            Layout::Probes => "bench_probes",
            Layout::Lpm => "bench_lpm",
            Layout::Cilium => "bench_cilium",
        }
    }

    /// How the benchmark's tables name it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Parse => "parse only (no policy)",
            Layout::Floor => "floor (1 hash)",
            Layout::Ordnet => "ordnet cells+probes",
            Layout::Classes => "port classes",
            Layout::Probes => "length probes",
            Layout::Lpm => "2x LPM (MapState keys)",
            Layout::Cilium => "Cilium 2x LPM+precedence",
        }
    }
}

/// The class layout is not installed above this many hash entries (it grows with
/// identities × port classes; see `docs/datapath.md` §4.3).
pub const CLASS_LIMIT: usize = 1 << 21;

/// Entries each layout needed for one rule set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutSizes {
    /// Whether the class layout was small enough to install.
    pub classes_installed: bool,
    /// Keys of the MapState.
    pub mapstate_keys: usize,
    /// Identity keys (the floor's hash entries).
    pub floor: usize,
    /// Policy hash entries of the enforcing layout.
    pub ordnet_policy: usize,
    /// Refined-cell blocks of the enforcing layout.
    pub ordnet_blocks: u32,
    /// Port classes of the class layout.
    pub classes: u32,
    /// Its hash entries.
    pub class_entries: usize,
    /// Its blocks.
    pub class_blocks: u32,
    /// Hash entries of the probe layout.
    pub probe_entries: usize,
    /// LPM entries of the LPM layout.
    pub lpm_entries: usize,
    /// LPM entries of Cilium's layout.
    pub cilium_entries: usize,
}

/// The benchmark object's programs that do nothing (XDP, TC).
const EMPTY_XDP: &str = "bench_pass";
const EMPTY_TC: &str = "bench_tc_pass";

/// The rule set number every benchmark program uses.
pub const BENCH_RULESET: u32 = 1;

/// The benchmark object, loaded.
pub struct BenchObject {
    ebpf: Ebpf,
    ordnet: PolicyOnlyTables,
}

/// The benchmark object's copy of the enforcing layout's policy maps, as a [`TableWriter`].
struct PolicyOnlyTables {
    cells: sys::MappedWords,
    blocks: sys::MappedWords,
    policy: BpfHashMap<MapData, PolicyKey, PolicyValue>,
    mirror: MemTables,
}

impl TableWriter for PolicyOnlyTables {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        let mut policy = (Vec::new(), Vec::new());
        for w in writes {
            match *w {
                Write::Cell(i, v) => self.cells.set(i as usize, v),
                Write::Block(i, v) => self.blocks.set(i as usize, v),
                Write::PolicyUpsert(k, v) => {
                    policy.0.push(k);
                    policy.1.push(v);
                }
                _ => panic!("the benchmark tables only take fresh installs"),
            }
            self.mirror.apply(w);
        }
        sys::update_batch(self.policy.map().fd().as_fd(), &policy.0, &policy.1).map_err(
            |(done, source)| WriteError::Syscall {
                map: "ORDNET_POLICY",
                op: "update batch",
                done,
                total: policy.0.len(),
                source,
            },
        )
    }

    fn tables(&self) -> &MemTables {
        &self.mirror
    }
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(DatapathError::Missing(name))?;
    Ok(T::try_from(map)?)
}

/// A batch update's result as a datapath error naming the map.
fn batch_result(
    what: &'static str,
    r: Result<(), (usize, std::io::Error)>,
) -> Result<(), DatapathError> {
    r.map_err(|(done, source)| {
        DatapathError::Write(WriteError::Syscall {
            map: what,
            op: "update batch",
            done,
            total: 0,
            source,
        })
    })
}

impl BenchObject {
    /// Loads the benchmark object (all programs) and writes `ms` into every layout's maps (as
    /// rule set [`BENCH_RULESET`], with the isolation default of `ms`). The class layout is
    /// skipped (and its program must not be run) when it needs more than [`CLASS_LIMIT`]
    /// entries; [`LayoutSizes::classes_installed`] says which.
    pub fn load(ms: &MapState) -> Result<(BenchObject, LayoutSizes), DatapathError> {
        let (content, _) = flatten(ms).map_err(|source| {
            DatapathError::Control(crate::ControlError::Flatten {
                endpoint: 0,
                direction: ms.direction(),
                source,
            })
        })?;
        let classes = class_layout(&content, BENCH_RULESET);
        let install_classes = classes.entries.len() <= CLASS_LIMIT;
        let entries = (ms.len() as u32 + 16).next_power_of_two();
        let mut loader = EbpfLoader::new();
        for m in [
            "FLOOR",
            "ORDNET_POLICY",
            "PRB_POLICY",
            "LPM_POLICY",
            "CIL_POLICY",
        ] {
            loader.map_max_entries(m, entries.max(1024));
        }
        let class_entries = if install_classes {
            classes.entries.len() as u32 + 16
        } else {
            16
        };
        loader.map_max_entries("CLS_POLICY", class_entries.next_power_of_two().max(1024));
        let mut ebpf = loader.load(crate::BENCH_OBJECT).map_err(Box::new)?;
        for l in Layout::ALL {
            program_mut::<Xdp>(&mut ebpf, l.program())?.load()?;
        }
        let cells: Array<MapData, u64> = take(&mut ebpf, "ORDNET_CELLS")?;
        let blocks: Array<MapData, u64> = take(&mut ebpf, "ORDNET_BLOCKS")?;
        let (cw, bw) = (cells.len() * 2, blocks.len() * 2);
        let mmap = |map: &Array<MapData, u64>, words: u32| {
            sys::MappedWords::new(map.map().fd().as_fd(), words as usize).map_err(|source| {
                DatapathError::Io {
                    path: "benchmark cell arrays".into(),
                    source,
                }
            })
        };
        let ordnet = PolicyOnlyTables {
            cells: mmap(&cells, cw)?,
            blocks: mmap(&blocks, bw)?,
            mirror: MemTables::new(cw, bw),
            policy: take(&mut ebpf, "ORDNET_POLICY")?,
        };
        let mut obj = BenchObject { ebpf, ordnet };
        let sizes = obj.install(ms, content, install_classes.then_some(classes))?;
        Ok((obj, sizes))
    }

    fn install(
        &mut self,
        ms: &MapState,
        content: RuleSetContent,
        classes: Option<ClassLayout>,
    ) -> Result<LayoutSizes, DatapathError> {
        let default = verdict_code(ms.default_verdict());
        let rs = BENCH_RULESET;
        let mut sizes = LayoutSizes {
            mapstate_keys: ms.len(),
            ..LayoutSizes::default()
        };
        let mut cfg: Array<MapData, PolicyRef> = self.map_mut("BENCH_CFG")?;
        cfg.set(0, PolicyRef::new(rs, default), 0)?;

        // Ordnet: the store's own install into slot 1 (slot 0 stays empty).
        let mut store = Store::new(
            self.ordnet.cells.len() as u32 / CELLS_PER_RULESET,
            self.ordnet.blocks.len() as u32 / BLOCK_WORDS,
            std::time::Duration::ZERO,
        );
        let mut stats = WriteStats::default();
        let slot = store.install(&mut self.ordnet, content.clone(), &mut stats)?;
        assert_eq!(slot, rs, "the first install takes slot 1");
        sizes.ordnet_policy = content.len();
        sizes.ordnet_blocks = store.blocks_in_use();

        self.install_floor(&content, &mut sizes)?;
        self.install_classes(&content, classes, &mut sizes)?;
        // Probes.
        {
            let pl = probe_layout(&content, rs);
            sizes.probe_entries = pl.entries.len();
            let mut meta: Array<MapData, ProbeMeta> = self.map_mut("PRB_META")?;
            meta.set(rs, pl.meta, 0)?;
            let policy: BpfHashMap<MapData, PolicyKey, PolicyValue> = self.map_mut("PRB_POLICY")?;
            let (k, v): (Vec<PolicyKey>, Vec<PolicyValue>) = pl.entries.into_iter().unzip();
            batch_result(
                "PRB_POLICY",
                sys::update_batch(policy.map().fd().as_fd(), &k, &v),
            )?;
        }
        // LPM (no batch operations on LPM tries).
        {
            let ll = lpm_layout(&content, rs);
            sizes.lpm_entries = ll.entries.len();
            let mut trie: LpmTrie<MapData, LpmPolicyData, PolicyValue> =
                self.map_mut("LPM_POLICY")?;
            for (len, data, v) in ll.entries {
                trie.insert(&Key::new(len, data), v, 0)?;
            }
        }
        // Cilium.
        {
            let cl = cilium_layout(ms, false);
            sizes.cilium_entries = cl.entries.len();
            let mut trie: LpmTrie<MapData, CiliumData, CiliumValue> = self.map_mut("CIL_POLICY")?;
            for (len, data, v) in cl.entries {
                trie.insert(&Key::new(len, data), v, 0)?;
            }
        }
        Ok(sizes)
    }

    /// The floor: the identity keys, exact.
    fn install_floor(
        &mut self,
        content: &RuleSetContent,
        sizes: &mut LayoutSizes,
    ) -> Result<(), DatapathError> {
        let rs = BENCH_RULESET;
        {
            let floor: BpfHashMap<MapData, PolicyKey, PolicyValue> = self.map_mut("FLOOR")?;
            let (k, v): (Vec<PolicyKey>, Vec<PolicyValue>) = content
                .specific
                .iter()
                .map(|(&(identity, prefix), &v)| {
                    (
                        PolicyKey {
                            ruleset: rs,
                            identity,
                            prefix,
                        },
                        v,
                    )
                })
                .unzip();
            sizes.floor = k.len();
            batch_result("FLOOR", sys::update_batch(floor.map().fd().as_fd(), &k, &v))?;
        }
        Ok(())
    }

    /// The port-class layout (installed only when asked for; its sizes always).
    fn install_classes(
        &mut self,
        content: &RuleSetContent,
        classes: Option<ClassLayout>,
        sizes: &mut LayoutSizes,
    ) -> Result<(), DatapathError> {
        let rs = BENCH_RULESET;
        if let Some(cl) = classes {
            sizes.classes_installed = true;
            sizes.classes = cl.classes;
            sizes.class_entries = cl.entries.len();
            sizes.class_blocks = cl.blocks.len() as u32 / BLOCK_WORDS;
            let cells: Array<MapData, u32> = self.map_mut("CLS_CELLS")?;
            let blocks: Array<MapData, u32> = self.map_mut("CLS_BLOCKS")?;
            let policy: BpfHashMap<MapData, ClassKey, PolicyValue> = self.map_mut("CLS_POLICY")?;
            let base = rs * CELLS_PER_RULESET;
            let idx: Vec<u32> = (0..cl.l1.len() as u32).map(|i| base + i).collect();
            batch_result(
                "CLS_CELLS",
                sys::update_batch(cells.map().fd().as_fd(), &idx, &cl.l1),
            )?;
            let bidx: Vec<u32> = (0..cl.blocks.len() as u32).collect();
            batch_result(
                "CLS_BLOCKS",
                sys::update_batch(blocks.map().fd().as_fd(), &bidx, &cl.blocks),
            )?;
            let (k, v): (Vec<ClassKey>, Vec<PolicyValue>) = cl.entries.into_iter().unzip();
            batch_result(
                "CLS_POLICY",
                sys::update_batch(policy.map().fd().as_fd(), &k, &v),
            )?;
        } else {
            let cl = class_layout(content, rs);
            sizes.classes = cl.classes;
            sizes.class_entries = cl.entries.len();
            sizes.class_blocks = cl.blocks.len() as u32 / BLOCK_WORDS;
        }
        Ok(())
    }

    fn map_mut<T>(&mut self, name: &'static str) -> Result<T, DatapathError>
    where
        T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
    {
        take(&mut self.ebpf, name)
    }

    /// Attaches a layout's program to interface `iface` of the calling thread's network
    /// namespace (native XDP, as the datapath attaches to veths), to measure it on real packets
    /// ([`BenchObject::run_stats`]); detached when the object is dropped.
    pub fn attach(&mut self, layout: Layout, iface: &str) -> Result<(), DatapathError> {
        program_mut::<Xdp>(&mut self.ebpf, layout.program())?
            .attach(iface, aya::programs::XdpMode::Driver)?;
        Ok(())
    }

    /// Attaches the programs that do nothing (`bench_pass` natively at `xdp_iface`'s XDP hook,
    /// `bench_tc_pass` at `tc_iface`'s tcx egress): what two program runs cost a packet by
    /// themselves. Their statistics: [`BenchObject::empty_stats`].
    pub fn attach_empty(&mut self, xdp_iface: &str, tc_iface: &str) -> Result<(), DatapathError> {
        let x = program_mut::<Xdp>(&mut self.ebpf, EMPTY_XDP)?;
        x.load()?;
        x.attach(xdp_iface, aya::programs::XdpMode::Driver)?;
        let t = program_mut::<SchedClassifier>(&mut self.ebpf, EMPTY_TC)?;
        t.load()?;
        t.attach_with_options(
            tc_iface,
            TcAttachType::Egress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )?;
        Ok(())
    }

    /// The empty XDP and TC programs' total run time and number of runs so far (counted while
    /// `bpf_stats` is enabled).
    pub fn empty_stats(&self) -> Result<[(std::time::Duration, u64); 2], DatapathError> {
        Ok([self.stats(EMPTY_XDP)?, self.stats(EMPTY_TC)?])
    }

    /// A layout program's total run time and number of runs so far (the kernel's statistics:
    /// counted only while `bpf_stats` is enabled).
    pub fn run_stats(&self, layout: Layout) -> Result<(std::time::Duration, u64), DatapathError> {
        self.stats(layout.program())
    }

    /// Program `name`'s total run time and number of runs so far.
    fn stats(&self, name: &'static str) -> Result<(std::time::Duration, u64), DatapathError> {
        let info = (self.ebpf.program(name))
            .ok_or(DatapathError::Missing(name))?
            .info()?;
        Ok((info.run_time(), info.run_count()))
    }

    /// Runs a layout's program `repeat` times on `frame`.
    pub fn run(
        &self,
        layout: Layout,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutcome, DatapathError> {
        let p: &Xdp = self
            .ebpf
            .program(layout.program())
            .ok_or(DatapathError::Missing(layout.program()))?
            .try_into()?;
        Ok(test_run_program(p, frame, repeat)?)
    }
}

/// The benchmark object's program `name`, as its kind `T` (`Xdp`, `SchedClassifier`).
fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    Ok(ebpf
        .program_mut(name)
        .ok_or(DatapathError::Missing(name))?
        .try_into()?)
}

/// Ports of `SLOT_PROTOCOLS`, for tests that sweep protocols.
pub const BENCH_PROTOCOLS: [u8; 3] = SLOT_PROTOCOLS;
