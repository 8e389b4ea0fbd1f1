//! The kernel-backed [`TableWriter`]: the program's maps, written in batches
//! (`BPF_MAP_UPDATE_BATCH` / `BPF_MAP_DELETE_BATCH`), with a [`MemTables`] mirror of exactly
//! what was written.

use std::os::fd::AsFd as _;

use aya::maps::{Array, HashMap, IterableMap, MapData, lpm_trie::Key, lpm_trie::LpmTrie};
use ordnet_datapath_common::layout::{
    CT_SERVICE, Ct4Key, CtEntry, CtKey, FAMILY_V4, IfaceInfo, IpInfo, IpKey, MAP_CT4, MAP_CT6,
    MAP_IFACE, MAP_IP4, MAP_IP6, MAP_IPCIDR, MAP_POLICY, MAP_STATE, MAP_SVC, PolicyKey,
    PolicyValue, SVC_FRONTEND, SvcKey, SvcValue,
};

use crate::{
    classes::{ClassWrite, Classes, IdentityKeys},
    sys,
    tables::{MemTables, TableWriter, Write, WriteError},
};

/// The class translation between the control plane and the maps (`DatapathConfig::classes`,
/// `docs/datapath.md` §13): the control plane writes identity-level tables, the maps get the
/// class-level writes [`Classes`] translates them into.
#[derive(Debug)]
pub(crate) struct ClassLayer {
    pub(crate) classes: Classes,
    /// What the control plane wrote: what [`TableWriter::tables`] returns, so decisions,
    /// traces and dumps see identities.
    pub(crate) identity: MemTables,
    out: Vec<ClassWrite>,
}

impl ClassLayer {
    /// The layer of maps holding `mirror` (class-level, keys kept): the classes rebuilt from
    /// them, and the writes that repair a batch left half done.
    pub(crate) fn adopt(
        mirror: &MemTables,
        grace: std::time::Duration,
        keys_in_store: bool,
        keys: Option<IdentityKeys>,
    ) -> (ClassLayer, Vec<Write>) {
        let a = Classes::adopt_with(mirror, grace, keys);
        let mut identity = a.identity;
        if keys_in_store {
            identity.keep_keys_in_store();
        }
        let repairs = a.repairs.iter().map(ClassWrite::write).collect();
        let layer = ClassLayer {
            classes: a.classes,
            identity,
            out: Vec::new(),
        };
        (layer, repairs)
    }
}

/// Handles of the enforcing program's maps.
pub struct KernelTables {
    pub(crate) ip4: HashMap<MapData, u32, IpInfo>,
    pub(crate) ip6: HashMap<MapData, [u32; 4], IpInfo>,
    pub(crate) cidr: LpmTrie<MapData, IpKey, IpInfo>,
    pub(crate) cells: Array<MapData, u64>,
    pub(crate) blocks: Array<MapData, u64>,
    /// The two arrays, mapped: their words are written with atomic stores, no syscall.
    pub(crate) cells_mem: sys::MappedWords,
    pub(crate) blocks_mem: sys::MappedWords,
    pub(crate) policy: HashMap<MapData, PolicyKey, PolicyValue>,
    pub(crate) ct4: HashMap<MapData, Ct4Key, CtEntry>,
    pub(crate) ct6: HashMap<MapData, CtKey, CtEntry>,
    pub(crate) state: Array<MapData, ordnet_datapath_common::layout::State>,
    pub(crate) svc: HashMap<MapData, SvcKey, SvcValue>,
    pub(crate) iface: HashMap<MapData, u32, IfaceInfo>,
    /// Exactly what the maps hold (class-level with [`KernelTables::layer`]).
    pub(crate) mirror: MemTables,
    /// The class translation, when the maps hold classes.
    pub(crate) layer: Option<Box<ClassLayer>>,
    /// The policy map's capacity (the class translation counts its room).
    pub(crate) policy_capacity: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cell,
    Block,
    PolicyUpsert,
    PolicyDelete,
    IpUpsert,
    IpDelete,
    Cidr,
    State,
    Svc,
    Iface,
}

/// The length of the longest prefix of `run` that was certainly applied when the writes
/// matching `failed_family` stopped after `done` of them (the other family's run was either
/// complete or not started; only the prefix before the first unapplied write counts).
fn positions(run: &[Write], failed_family: impl Fn(&&Write) -> bool, done: usize) -> usize {
    let mut seen = 0;
    for (i, w) in run.iter().enumerate() {
        if failed_family(&w) {
            if seen == done {
                return i;
            }
            seen += 1;
        }
    }
    run.len()
}

fn kind(w: &Write) -> Kind {
    match w {
        Write::Cell(..) => Kind::Cell,
        Write::Block(..) => Kind::Block,
        Write::PolicyUpsert(..) => Kind::PolicyUpsert,
        Write::PolicyDelete(..) => Kind::PolicyDelete,
        Write::IpUpsert(..) => Kind::IpUpsert,
        Write::IpDelete(..) => Kind::IpDelete,
        Write::CidrUpsert(..) | Write::CidrDelete(..) => Kind::Cidr,
        Write::State(..) => Kind::State,
        Write::SvcUpsert(..) | Write::SvcDelete(..) => Kind::Svc,
        Write::IfaceUpsert(..) | Write::IfaceDelete(..) => Kind::Iface,
    }
}

fn syscall_error(
    map: &'static str,
    op: &'static str,
    total: usize,
) -> impl FnOnce((usize, std::io::Error)) -> (usize, WriteError) {
    move |(done, source)| {
        (
            done,
            WriteError::Syscall {
                map,
                op,
                done,
                total,
                source,
            },
        )
    }
}

impl KernelTables {
    /// Writes one run of same-kind writes; on error, how many were applied.
    fn write_run(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        match kind(&run[0]) {
            Kind::Cell | Kind::Block => {
                self.write_words(run);
                Ok(())
            }
            Kind::PolicyUpsert => self.write_policy_upserts(run),
            Kind::PolicyDelete => self.write_policy_deletes(run),
            Kind::IpUpsert | Kind::IpDelete => self.write_ips(run),
            Kind::Cidr => self.write_cidrs(run),
            Kind::Svc | Kind::Iface => self.write_singles(run),
            Kind::State => self.write_state(run),
        }
    }

    /// Plain (release) stores into the mapped arrays.
    fn write_words(&mut self, run: &[Write]) {
        // Plain (release) stores into the mapped arrays, in order: a block's words are
        // visible before a cell word that points to the block.
        let mem = if kind(&run[0]) == Kind::Cell {
            &self.cells_mem
        } else {
            &self.blocks_mem
        };
        for w in run {
            match *w {
                Write::Cell(i, v) | Write::Block(i, v) => mem.set(i as usize, v),
                _ => unreachable!(),
            }
        }
    }

    /// Policy keys added or changed, in one batch.
    fn write_policy_upserts(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        let n = run.len();
        let (keys, values): (Vec<PolicyKey>, Vec<PolicyValue>) = run
            .iter()
            .map(|w| match *w {
                Write::PolicyUpsert(k, v) => (k, v),
                _ => unreachable!(),
            })
            .unzip();
        sys::update_batch(self.policy.map().fd().as_fd(), &keys, &values).map_err(syscall_error(
            MAP_POLICY,
            "update batch",
            n,
        ))
    }

    /// Policy keys removed, in one batch.
    fn write_policy_deletes(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        let n = run.len();
        let keys: Vec<PolicyKey> = run
            .iter()
            .map(|w| match *w {
                Write::PolicyDelete(k) => k,
                _ => unreachable!(),
            })
            .collect();
        sys::delete_batch(self.policy.map().fd().as_fd(), &keys).map_err(syscall_error(
            MAP_POLICY,
            "delete batch",
            n,
        ))
    }

    /// ipcache records, one batch per family.
    fn write_ips(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        let n = run.len();
        // One run per family (the order between the two families does not matter:
        // different keys), each in its original order.
        let v4 = |w: &&Write| match w {
            Write::IpUpsert(k, _) | Write::IpDelete(k) => k.family == u32::from(FAMILY_V4),
            _ => unreachable!(),
        };
        let (run4, run6): (Vec<&Write>, Vec<&Write>) = run.iter().partition(v4);
        let upsert = kind(&run[0]) == Kind::IpUpsert;
        let (op, name4, name6) = if upsert {
            ("update batch", MAP_IP4, MAP_IP6)
        } else {
            ("delete batch", MAP_IP4, MAP_IP6)
        };
        let pairs4: Vec<(u32, IpInfo)> = run4
            .iter()
            .map(|w| match **w {
                Write::IpUpsert(k, v) => (k.addr[0], v),
                Write::IpDelete(k) => (k.addr[0], IpInfo::default()),
                _ => unreachable!(),
            })
            .collect();
        let pairs6: Vec<([u32; 4], IpInfo)> = run6
            .iter()
            .map(|w| match **w {
                Write::IpUpsert(k, v) => (k.addr, v),
                Write::IpDelete(k) => (k.addr, IpInfo::default()),
                _ => unreachable!(),
            })
            .collect();
        let r4 = if upsert {
            let (ks, vs): (Vec<u32>, Vec<IpInfo>) = pairs4.into_iter().unzip();
            sys::update_batch(self.ip4.map().fd().as_fd(), &ks, &vs)
        } else {
            let ks: Vec<u32> = pairs4.into_iter().map(|(k, _)| k).collect();
            sys::delete_batch(self.ip4.map().fd().as_fd(), &ks)
        };
        // On a failure, count only the writes known to be applied (those of the
        // failing family before the failure); the mirror then under-reports, never
        // over-reports.
        if let Err((done, source)) = r4 {
            let applied = positions(run, v4, done);
            return Err((
                applied,
                WriteError::Syscall {
                    map: name4,
                    op,
                    done,
                    total: n,
                    source,
                },
            ));
        }
        let r6 = if upsert {
            let (ks, vs): (Vec<[u32; 4]>, Vec<IpInfo>) = pairs6.into_iter().unzip();
            sys::update_batch(self.ip6.map().fd().as_fd(), &ks, &vs)
        } else {
            let ks: Vec<[u32; 4]> = pairs6.into_iter().map(|(k, _)| k).collect();
            sys::delete_batch(self.ip6.map().fd().as_fd(), &ks)
        };
        if let Err((done, source)) = r6 {
            let applied = positions(run, |w| !v4(w), done);
            return Err((
                applied,
                WriteError::Syscall {
                    map: name6,
                    op,
                    done,
                    total: n,
                    source,
                },
            ));
        }
        Ok(())
    }

    /// CIDR identities (the LPM trie has no batch operations).
    fn write_cidrs(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        for (done, w) in run.iter().enumerate() {
            let r = match *w {
                Write::CidrUpsert(k, len, v) => {
                    self.cidr
                        .insert(&Key::new(IpKey::LPM_FIXED_BITS + len, k), v, 0)
                }
                Write::CidrDelete(k, len) => {
                    self.cidr.remove(&Key::new(IpKey::LPM_FIXED_BITS + len, k))
                }
                _ => unreachable!(),
            };
            r.map_err(|source| {
                (
                    done,
                    WriteError::Map {
                        map: MAP_IPCIDR,
                        source,
                    },
                )
            })?;
        }
        Ok(())
    }

    /// Service frontends and interfaces: few and rare, one element at a time.
    fn write_singles(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        // Few and rare: one element at a time.
        for (done, w) in run.iter().enumerate() {
            let (map, r) = match *w {
                Write::SvcUpsert(k) => (
                    MAP_SVC,
                    self.svc.insert(
                        k,
                        SvcValue {
                            flags: SVC_FRONTEND,
                        },
                        0,
                    ),
                ),
                Write::SvcDelete(k) => (MAP_SVC, self.svc.remove(&k)),
                Write::IfaceUpsert(i, v) => (MAP_IFACE, self.iface.insert(i, v, 0)),
                Write::IfaceDelete(i) => (MAP_IFACE, self.iface.remove(&i)),
                _ => unreachable!(),
            };
            match r {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(source) => return Err((done, WriteError::Map { map, source })),
            }
        }
        Ok(())
    }

    /// The state record (revision, lifetimes).
    fn write_state(&mut self, run: &[Write]) -> Result<(), (usize, WriteError)> {
        for (done, w) in run.iter().enumerate() {
            let Write::State(state) = *w else {
                unreachable!()
            };
            self.state.set(0, state, 0).map_err(|source| {
                (
                    done,
                    WriteError::Map {
                        map: MAP_STATE,
                        source,
                    },
                )
            })?;
        }
        Ok(())
    }

    /// Reads every map into a [`MemTables`] (the connection-tracking table is not part of it).
    pub fn read_all(&self) -> Result<MemTables, WriteError> {
        let read = |map: &'static str, e: std::io::Error| WriteError::Syscall {
            map,
            op: "lookup batch",
            done: 0,
            total: 0,
            source: e,
        };
        let mut t = MemTables::new(self.cells_mem.len() as u32, self.blocks_mem.len() as u32);
        for (a, v) in sys::lookup_all::<u32, IpInfo>(self.ip4.map().fd().as_fd())
            .map_err(|e| read(MAP_IP4, e))?
        {
            t.apply(&Write::IpUpsert(IpKey::new(FAMILY_V4, [a, 0, 0, 0]), v));
        }
        for (a, v) in sys::lookup_all::<[u32; 4], IpInfo>(self.ip6.map().fd().as_fd())
            .map_err(|e| read(MAP_IP6, e))?
        {
            t.apply(&Write::IpUpsert(
                IpKey::new(ordnet_datapath_common::layout::FAMILY_V6, a),
                v,
            ));
        }
        for item in self.cidr.iter() {
            let (k, v) = item.map_err(|source| WriteError::Map {
                map: MAP_IPCIDR,
                source,
            })?;
            t.apply(&Write::CidrUpsert(
                k.data(),
                k.prefix_len() - IpKey::LPM_FIXED_BITS,
                v,
            ));
        }
        for i in 0..t.cells.len() {
            t.cells.set(i, self.cells_mem.get(i));
        }
        for i in 0..t.blocks.len() {
            t.blocks.set(i, self.blocks_mem.get(i));
        }
        for (k, v) in sys::lookup_all::<PolicyKey, PolicyValue>(self.policy.map().fd().as_fd())
            .map_err(|e| read(MAP_POLICY, e))?
        {
            t.policy.insert(k, v);
        }
        t.state = self.state.get(&0, 0).map_err(|source| WriteError::Map {
            map: MAP_STATE,
            source,
        })?;
        for (k, _) in sys::lookup_all::<SvcKey, SvcValue>(self.svc.map().fd().as_fd())
            .map_err(|e| read(MAP_SVC, e))?
        {
            t.apply(&Write::SvcUpsert(k));
        }
        for (i, v) in sys::lookup_all::<u32, IfaceInfo>(self.iface.map().fd().as_fd())
            .map_err(|e| read(MAP_IFACE, e))?
        {
            t.apply(&Write::IfaceUpsert(i, v));
        }
        Ok(t)
    }

    /// Every connection-tracking entry (both families).
    pub fn ct_entries(&self) -> Result<Vec<(CtKey, CtEntry)>, WriteError> {
        let err = lookup_batch_failed;
        let mut out: Vec<(CtKey, CtEntry)> =
            sys::lookup_all::<Ct4Key, CtEntry>(self.ct4.map().fd().as_fd())
                .map_err(err(MAP_CT4))?
                .into_iter()
                .map(|(k, v)| (k.full(), v))
                .collect();
        out.extend(
            sys::lookup_all::<CtKey, CtEntry>(self.ct6.map().fd().as_fd()).map_err(err(MAP_CT6))?,
        );
        Ok(out)
    }

    /// Deletes every connection-tracking entry.
    pub fn ct_clear(&mut self) -> Result<(), WriteError> {
        for (k, _) in self.ct_entries()? {
            let r = if k.family == FAMILY_V4 {
                self.ct4.remove(&Ct4Key::of(&k))
            } else {
                self.ct6.remove(&k)
            };
            match r {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(source) => {
                    let map = if k.family == FAMILY_V4 {
                        MAP_CT4
                    } else {
                        MAP_CT6
                    };
                    return Err(WriteError::Map { map, source });
                }
            }
        }
        Ok(())
    }

    /// Copies the connection-tracking entries of the tables pinned in `dir` (another
    /// datapath's: maps set aside to grow, or an older layout's) into these, so that the flows
    /// they track survive the switch to these maps' programs (without it, a connection into a
    /// pod isolated for ingress breaks at its peer's next packet). An entry these tables
    /// already hold wins (the new programs judged a packet of it since). Every copied entry is
    /// made stale (revision 0, never current: the first write of a datapath makes it 1), so
    /// its flow's next packet re-checks the flow under these maps' policy, which may differ; a
    /// Service-deferred entry passes regardless, as it did. Tables with another key or entry
    /// layout, or missing, are skipped. Returns the entries copied per family; a full table
    /// evicts (LRU) as the program's inserts do.
    pub fn ct_carry_from(&mut self, dir: &std::path::Path) -> Result<[u64; 2], WriteError> {
        let open = |map: &'static str, key_size: usize| -> Option<std::os::fd::OwnedFd> {
            let path = dir.join(map);
            let info = aya::maps::MapInfo::from_pin(&path).ok()?;
            let fits = info.key_size() as usize == key_size
                && info.value_size() as usize == std::mem::size_of::<CtEntry>();
            fits.then(|| sys::obj_get(&path).ok()).flatten()
        };
        let stale = |e: CtEntry| {
            if e.flags & CT_SERVICE != 0 {
                e
            } else {
                CtEntry { revision: 0, ..e }
            }
        };
        let outcome = |map, r: Result<(), aya::maps::MapError>| match r {
            Ok(()) => Ok(1),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(0)
            }
            Err(source) => Err(WriteError::Map { map, source }),
        };
        // BPF_NOEXIST: an entry the new programs wrote stays.
        const NOEXIST: u64 = 1;
        let mut copied = [0u64; 2];
        if let Some(fd) = open(MAP_CT4, std::mem::size_of::<Ct4Key>()) {
            for (k, e) in sys::lookup_all::<Ct4Key, CtEntry>(fd.as_fd())
                .map_err(lookup_batch_failed(MAP_CT4))?
            {
                copied[0] += outcome(MAP_CT4, self.ct4.insert(k, stale(e), NOEXIST))?;
            }
        }
        if let Some(fd) = open(MAP_CT6, std::mem::size_of::<CtKey>()) {
            for (k, e) in sys::lookup_all::<CtKey, CtEntry>(fd.as_fd())
                .map_err(lookup_batch_failed(MAP_CT6))?
            {
                copied[1] += outcome(MAP_CT6, self.ct6.insert(k, stale(e), NOEXIST))?;
            }
        }
        Ok(copied)
    }

    /// Removes the expired connection-tracking entries at kernel time `now` (jiffies; `state`
    /// gives the lifetimes) and counts what is left.
    ///
    /// The tables are read in batches; each expired entry is looked up again just before it
    /// is deleted and kept if it changed (a packet that arrived meanwhile found it expired and
    /// tracked its flow afresh), so a sweep cannot remove a flow that was just allowed.
    pub fn ct_sweep(
        &mut self,
        state: &ordnet_datapath_common::layout::State,
        now: u64,
    ) -> Result<CtSweep, WriteError> {
        use ordnet_datapath_common::ct_lifetime;
        let read = lookup_batch_failed;
        let expired = |k: &CtKey, e: &CtEntry| {
            now.saturating_sub(e.last_seen) > ct_lifetime(state, k.protocol, e.flags)
        };
        let mut sweep = CtSweep::default();
        let capacity = |m: &MapData, map| {
            m.info()
                .map(|i| i.max_entries())
                .map_err(|source| WriteError::Map { map, source })
        };
        sweep.capacity = [
            capacity(self.ct4.map(), MAP_CT4)?,
            capacity(self.ct6.map(), MAP_CT6)?,
        ];
        for (k4, e) in sys::lookup_all::<Ct4Key, CtEntry>(self.ct4.map().fd().as_fd())
            .map_err(read(MAP_CT4))?
        {
            if !expired(&k4.full(), &e) {
                sweep.live[0] += 1;
            } else if self.ct4.get(&k4, 0).ok() == Some(e) && self.ct4.remove(&k4).is_ok() {
                sweep.removed[0] += 1;
            }
        }
        for (k, e) in
            sys::lookup_all::<CtKey, CtEntry>(self.ct6.map().fd().as_fd()).map_err(read(MAP_CT6))?
        {
            if !expired(&k, &e) {
                sweep.live[1] += 1;
            } else if self.ct6.get(&k, 0).ok() == Some(e) && self.ct6.remove(&k).is_ok() {
                sweep.removed[1] += 1;
            }
        }
        Ok(sweep)
    }
}

/// The error of a failed `BPF_MAP_LOOKUP_BATCH` over `map`.
fn lookup_batch_failed(map: &'static str) -> impl Fn(std::io::Error) -> WriteError {
    move |source| WriteError::Syscall {
        map,
        op: "lookup batch",
        done: 0,
        total: 0,
        source,
    }
}

/// What one connection-tracking sweep ([`KernelTables::ct_sweep`]) found, per family (index 0
/// IPv4, 1 IPv6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtSweep {
    /// Live entries (not expired) after the sweep.
    pub live: [u64; 2],
    /// Expired entries the sweep removed.
    pub removed: [u64; 2],
    /// The tables' capacities.
    pub capacity: [u32; 2],
}

impl KernelTables {
    /// Writes one batch into the maps as it is, and into the mirror as far as it was applied.
    fn write_maps(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        let mut i = 0;
        while i < writes.len() {
            let k = kind(&writes[i]);
            let len = writes[i..].iter().take_while(|w| kind(w) == k).count();
            let run = &writes[i..i + len];
            let result = self.write_run(run);
            let done = match &result {
                Ok(()) => len,
                Err((done, _)) => *done,
            };
            for w in &run[..done] {
                self.mirror.apply(w);
            }
            result.map_err(|(_, e)| e)?;
            i += len;
        }
        Ok(())
    }

    /// Translates one identity-level batch (`writes`; empty: only what is due after the grace
    /// period) and writes the class-level batch. The policy map's room is counted first, in
    /// class keys: a batch that would overfill it at any point is refused before anything is
    /// written ([`WriteError::Full`], a capacity error: the control plane denies what does
    /// not fit). A refused or failed batch leaves the identity-level keys as they were before
    /// it and the classes rebuilt from what the maps hold ([`KernelTables::resync_classes`]):
    /// the control plane reads the rule sets' keys back ([`TableWriter::slot_keys`]) as after
    /// any failed write.
    fn write_classes(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        let layer = self.layer.as_mut().expect("a class layer");
        let mut out = std::mem::take(&mut layer.out);
        if writes.is_empty() {
            layer.classes.reclaim(std::time::Instant::now(), &mut out);
        } else {
            // Infallible: in memory.
            let _ = layer.identity.write(writes);
            layer.classes.translate(writes, &mut out);
        }
        let class_writes: Vec<Write> = out.drain(..).map(|w| w.write()).collect();
        // Kept for the next batch, but not a full programming's worth of it.
        out.shrink_to(1 << 12);
        layer.out = out;
        let result = if self.policy_fits(&class_writes) {
            self.write_maps(&class_writes)
        } else {
            Err(WriteError::Full(MAP_POLICY, self.policy_capacity as u32))
        };
        let layer = self.layer.as_mut().expect("a class layer");
        if result.is_err() {
            let keys = layer.classes.keys_before();
            self.resync_classes(Some(keys));
        } else {
            layer.classes.commit();
        }
        // Cell and block words pass unchanged: the mirror and the identity level keep one copy
        // of them (after a refused batch the layer was rebuilt from the mirror: the same).
        if let Some(layer) = &self.layer {
            self.mirror.share_words_from(&layer.identity, writes);
        }
        result
    }

    /// Whether the policy map has room for `writes` applied in order, at every point of them.
    /// The keys it holds plus every upsert bound the peak (a delete only lowers it), and when
    /// that fits, as it does below a full map, the peak is not counted: counting it looks every
    /// written key up in the mirror and in a set of the keys written before, and a relabel's
    /// class keys, spread over hundreds of rule sets, made that ~2 % of the agent's samples at
    /// 10k pods / 5k policies with the bpf datapath.
    fn policy_fits(&self, writes: &[Write]) -> bool {
        let upserts = writes
            .iter()
            .filter(|w| matches!(w, Write::PolicyUpsert(..)))
            .count();
        self.mirror.policy.len() + upserts <= self.policy_capacity
            || self.policy_peak(writes) <= self.policy_capacity
    }

    /// The most policy keys the map holds at any point of `writes` applied in order.
    fn policy_peak(&self, writes: &[Write]) -> usize {
        let mut held = self.mirror.policy.len();
        let mut peak = held;
        let mut changed: std::collections::HashMap<PolicyKey, bool> = Default::default();
        for w in writes {
            let (k, present) = match *w {
                Write::PolicyUpsert(k, _) => (k, true),
                Write::PolicyDelete(k) => (k, false),
                _ => continue,
            };
            let was = changed
                .get(&k)
                .copied()
                .unwrap_or_else(|| self.mirror.policy.contains_key(&k));
            match (was, present) {
                (false, true) => held += 1,
                (true, false) => held -= 1,
                _ => {}
            }
            changed.insert(k, present);
            peak = peak.max(held);
        }
        peak
    }

    /// Rebuilds the class layer from what the maps hold (the mirror) and the identity-level
    /// keys (`keys`; `None`: those the classes stand for), and writes its repairs (a few
    /// attempts: each rebuild starts from what the maps then hold, so the layer always
    /// describes them).
    pub(crate) fn resync_classes(&mut self, keys: Option<IdentityKeys>) {
        let Some(layer) = self.layer.as_ref() else {
            return;
        };
        let (grace, keys_in_store) = (layer.classes.grace(), layer.identity.keys_in_store);
        self.adopt_classes(grace, keys_in_store, keys);
    }

    /// Sets up the class layer of the maps as the mirror holds them ([`Classes::adopt`]) and
    /// writes its repairs (see [`KernelTables::resync_classes`]).
    pub(crate) fn adopt_classes(
        &mut self,
        grace: std::time::Duration,
        keys_in_store: bool,
        keys: Option<IdentityKeys>,
    ) {
        for _ in 0..3 {
            let (layer, repairs) =
                ClassLayer::adopt(&self.mirror, grace, keys_in_store, keys.clone());
            self.layer = Some(Box::new(layer));
            if self.policy_fits(&repairs) && self.write_maps(&repairs).is_ok() {
                return;
            }
        }
        let (layer, _) = ClassLayer::adopt(&self.mirror, grace, keys_in_store, keys);
        self.layer = Some(Box::new(layer));
    }

    /// The class translation, when the maps hold classes.
    pub(crate) fn classes(&self) -> Option<&Classes> {
        self.layer.as_ref().map(|l| &l.classes)
    }
}

impl TableWriter for KernelTables {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        if self.layer.is_none() {
            return self.write_maps(writes);
        }
        if writes.is_empty() {
            return Ok(());
        }
        self.write_classes(writes)
    }

    fn tables(&self) -> &MemTables {
        match &self.layer {
            Some(layer) => &layer.identity,
            None => &self.mirror,
        }
    }

    fn reclaim_below(&mut self) -> Result<(), WriteError> {
        if self.layer.is_none() {
            return Ok(());
        }
        self.write_classes(&[])
    }

    fn reclaim_due_below(&self) -> Option<std::time::Instant> {
        self.layer.as_ref().and_then(|l| l.classes.reclaim_due())
    }

    fn identity_keys(&self, slot: u32) -> Option<crate::leafmap::LeafMap<(u32, u32), PolicyValue>> {
        self.layer
            .as_ref()
            .map(|layer| layer.classes.identity_keys(slot))
    }

    fn slot_keys(&self, slot: u32) -> Result<Vec<(PolicyKey, PolicyValue)>, WriteError> {
        if let Some(layer) = &self.layer {
            // The wildcard keys as the maps hold them, the identities' from the classes.
            let mut keys: Vec<_> = self
                .mirror
                .policy_of(slot)
                .into_iter()
                .filter(|(k, _)| k.identity == 0)
                .collect();
            keys.extend(layer.classes.slot_keys(slot));
            return Ok(keys);
        }
        if !self.mirror.keys_in_store {
            return Ok(self.mirror.policy_of(slot));
        }
        let keys = sys::lookup_all::<PolicyKey, PolicyValue>(self.policy.map().fd().as_fd())
            .map_err(|source| WriteError::Syscall {
                map: MAP_POLICY,
                op: "lookup batch",
                done: 0,
                total: 0,
                source,
            })?;
        Ok(keys
            .into_iter()
            .filter(|(k, _)| k.ruleset == slot)
            .collect())
    }
}
