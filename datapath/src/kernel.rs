//! The kernel-backed [`TableWriter`]: the program's maps, written in batches
//! (`BPF_MAP_UPDATE_BATCH` / `BPF_MAP_DELETE_BATCH`), with a [`MemTables`] mirror of exactly
//! what was written.

use std::os::fd::AsFd as _;

use aya::maps::{Array, HashMap, IterableMap, MapData, lpm_trie::Key, lpm_trie::LpmTrie};
use ordnet_datapath_common::layout::{
    CtEntry, CtKey, IpInfo, IpKey, MAP_BLOCKS, MAP_CELLS, MAP_CT, MAP_IPCACHE, MAP_IPCIDR,
    MAP_POLICY, MAP_STATE, PolicyKey, PolicyValue, State,
};

use crate::{
    sys,
    tables::{MemTables, TableWriter, Write, WriteError},
};

/// Handles of the enforcing program's maps.
pub struct KernelTables {
    pub(crate) ipcache: HashMap<MapData, IpKey, IpInfo>,
    pub(crate) cidr: LpmTrie<MapData, IpKey, IpInfo>,
    pub(crate) cells: Array<MapData, u32>,
    pub(crate) blocks: Array<MapData, u32>,
    pub(crate) policy: HashMap<MapData, PolicyKey, PolicyValue>,
    pub(crate) ct: HashMap<MapData, CtKey, CtEntry>,
    pub(crate) state: Array<MapData, State>,
    pub(crate) mirror: MemTables,
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
        let n = run.len();
        match kind(&run[0]) {
            Kind::Cell | Kind::Block => {
                let (map, name) = if kind(&run[0]) == Kind::Cell {
                    (&self.cells, MAP_CELLS)
                } else {
                    (&self.blocks, MAP_BLOCKS)
                };
                let (keys, values): (Vec<u32>, Vec<u32>) = run
                    .iter()
                    .map(|w| match *w {
                        Write::Cell(i, v) | Write::Block(i, v) => (i, v),
                        _ => unreachable!(),
                    })
                    .unzip();
                sys::update_batch(map.map().fd().as_fd(), &keys, &values).map_err(syscall_error(
                    name,
                    "update batch",
                    n,
                ))
            }
            Kind::PolicyUpsert => {
                let (keys, values): (Vec<PolicyKey>, Vec<PolicyValue>) = run
                    .iter()
                    .map(|w| match *w {
                        Write::PolicyUpsert(k, v) => (k, v),
                        _ => unreachable!(),
                    })
                    .unzip();
                sys::update_batch(self.policy.map().fd().as_fd(), &keys, &values)
                    .map_err(syscall_error(MAP_POLICY, "update batch", n))
            }
            Kind::PolicyDelete => {
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
            Kind::IpUpsert => {
                let (keys, values): (Vec<IpKey>, Vec<IpInfo>) = run
                    .iter()
                    .map(|w| match *w {
                        Write::IpUpsert(k, v) => (k, v),
                        _ => unreachable!(),
                    })
                    .unzip();
                sys::update_batch(self.ipcache.map().fd().as_fd(), &keys, &values)
                    .map_err(syscall_error(MAP_IPCACHE, "update batch", n))
            }
            Kind::IpDelete => {
                let keys: Vec<IpKey> = run
                    .iter()
                    .map(|w| match *w {
                        Write::IpDelete(k) => k,
                        _ => unreachable!(),
                    })
                    .collect();
                sys::delete_batch(self.ipcache.map().fd().as_fd(), &keys).map_err(syscall_error(
                    MAP_IPCACHE,
                    "delete batch",
                    n,
                ))
            }
            Kind::Cidr => {
                // The LPM trie has no batch operations.
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
            Kind::State => {
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
        }
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
        let mut t = MemTables::new(self.cells.len(), self.blocks.len());
        for (k, v) in sys::lookup_all::<IpKey, IpInfo>(self.ipcache.map().fd().as_fd())
            .map_err(|e| read(MAP_IPCACHE, e))?
        {
            t.apply(&Write::IpUpsert(k, v));
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
        for (i, v) in sys::lookup_all::<u32, u32>(self.cells.map().fd().as_fd())
            .map_err(|e| read(MAP_CELLS, e))?
        {
            t.cells[i as usize] = v;
        }
        for (i, v) in sys::lookup_all::<u32, u32>(self.blocks.map().fd().as_fd())
            .map_err(|e| read(MAP_BLOCKS, e))?
        {
            t.blocks[i as usize] = v;
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
        Ok(t)
    }

    /// Every connection-tracking entry.
    pub fn ct_entries(&self) -> Result<Vec<(CtKey, CtEntry)>, WriteError> {
        sys::lookup_all::<CtKey, CtEntry>(self.ct.map().fd().as_fd()).map_err(|source| {
            WriteError::Syscall {
                map: MAP_CT,
                op: "lookup batch",
                done: 0,
                total: 0,
                source,
            }
        })
    }

    /// Deletes every connection-tracking entry.
    pub fn ct_clear(&mut self) -> Result<(), WriteError> {
        let keys: Vec<CtKey> = self.ct_entries()?.into_iter().map(|(k, _)| k).collect();
        for k in keys {
            match self.ct.remove(&k) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(source) => {
                    return Err(WriteError::Map {
                        map: MAP_CT,
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

impl TableWriter for KernelTables {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
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

    fn tables(&self) -> &MemTables {
        &self.mirror
    }
}
