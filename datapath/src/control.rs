//! The control plane of the datapath maps: endpoints, ipcache and rule set sharing, written
//! through a [`TableWriter`]. The kernel-backed `Datapath` and the tests use this same code.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use ordnet_datapath_common::{
    addr_bytes, addr_words,
    layout::{
        FAMILY_V4, FAMILY_V6, IP_FLAG_ENDPOINT, IP_FLAG_FRONTEND, IP_FLAG_HOST, IfaceInfo, IpInfo,
        IpKey, PolicyRef, State, SvcKey, V_ALLOW, V_DENY,
    },
};
use ordnet_mapstate::{Changes, Direction, FastSet, MapState, Verdict};

use crate::{
    counters::RuleCounters,
    flat::{
        ContentDiff, FlattenError, RuleSetContent, flatten_counted, meet, meet_steps,
        same_verdicts, verdict_code,
    },
    store::{Store, StoreError, WriteStats, added_keys},
    tables::{MemTables, TableWriter, Write, WriteError},
};

/// A local endpoint (pod) as the caller describes it.
#[derive(Debug, Clone, Copy)]
pub struct EndpointSpec<'a> {
    /// Its addresses (any number, both families).
    pub ips: &'a [IpAddr],
    /// Its security identity (what peers' policies see), for every address unless
    /// `identities` is given.
    pub identity: u32,
    /// Per-address identities, in the order of `ips` (a dual-stack pod's two addresses may
    /// have different identities); empty: every address has `identity`.
    pub identities: &'a [u32],
    /// Its ingress MapState (its isolation default is the endpoint's ingress default).
    pub ingress: &'a MapState,
    /// Its egress MapState.
    pub egress: &'a MapState,
}

/// New addresses of an existing endpoint ([`Control::set_endpoint_addresses`]).
#[derive(Debug, Clone, Copy)]
pub struct EndpointAddresses<'a> {
    /// Its addresses (any number, both families).
    pub ips: &'a [IpAddr],
    /// The identity of every address unless `identities` is given.
    pub identity: u32,
    /// Per-address identities (same order as `ips`), or empty.
    pub identities: &'a [u32],
}

/// A local endpoint as the datapath holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointState {
    /// Its addresses, sorted.
    pub ips: Vec<IpAddr>,
    /// The identity of each address (same order as `ips`).
    pub identities: Vec<u32>,
    /// Its ingress rule set slot and default.
    pub ingress: PolicyRef,
    /// Its egress rule set slot and default.
    pub egress: PolicyRef,
}

impl EndpointState {
    /// The identity of one of its addresses.
    pub fn identity_of(&self, ip: IpAddr) -> Option<u32> {
        let i = self.ips.iter().position(|a| *a == ip)?;
        self.identities.get(i).copied()
    }

    /// `(address, identity)` pairs, sorted by address.
    pub fn addresses(&self) -> impl Iterator<Item = (IpAddr, u32)> + '_ {
        self.ips
            .iter()
            .copied()
            .zip(self.identities.iter().copied())
    }

    /// The rule set reference of one direction.
    pub fn policy(&self, dir: Direction) -> PolicyRef {
        match dir {
            Direction::Ingress => self.ingress,
            Direction::Egress => self.egress,
        }
    }
}

/// Errors of control-plane operations. Validation errors leave everything unchanged.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Endpoint id 0 means "no endpoint" in the maps.
    #[error("endpoint id 0 is reserved")]
    ZeroEndpointId,
    /// A MapState the datapath cannot hold.
    #[error("endpoint {endpoint} {direction}: {source}")]
    Flatten {
        /// The endpoint id.
        endpoint: u32,
        /// The direction of the MapState.
        direction: Direction,
        /// Why.
        #[source]
        source: FlattenError,
    },
    /// An address another endpoint (not in the batch) holds.
    #[error("address {ip} belongs to endpoint {owner}")]
    AddressInUse {
        /// The address.
        ip: IpAddr,
        /// The endpoint that holds it.
        owner: u32,
    },
    /// An operation on an endpoint id the datapath does not hold.
    #[error("unknown endpoint {0}")]
    UnknownEndpoint(u32),
    /// Per-address identities whose number is not the number of addresses.
    #[error("endpoint {endpoint}: {identities} identities given for {ips} addresses")]
    IdentityCount {
        /// The endpoint id.
        endpoint: u32,
        /// Number of addresses.
        ips: usize,
        /// Number of identities.
        identities: usize,
    },
    /// A change set computed against other keys than the datapath holds (nothing written).
    #[error(
        "endpoint {endpoint} {direction}: the change set does not fit the datapath's keys \
         ({detail}); apply the full MapState instead"
    )]
    StaleChanges {
        /// The endpoint id.
        endpoint: u32,
        /// The direction.
        direction: Direction,
        /// The first key that does not fit.
        detail: String,
    },
    /// Rule set slots or blocks ran out.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A map write failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}

impl ControlError {
    /// Whether the error says the policy tables are full (policy keys, rule set slots, cell
    /// blocks): the endpoint's rule sets do not fit, a smaller policy (deny-all) does.
    pub fn is_capacity(&self) -> bool {
        match self {
            ControlError::Store(StoreError::Write(w)) | ControlError::Write(w) => {
                w.is_policy_capacity()
            }
            ControlError::Store(e) => e.is_capacity(),
            _ => false,
        }
    }
}

/// Whether `diff` fits `content`: removals of existing keys with their verdicts, and upserts
/// that change something.
fn check_diff(content: &RuleSetContent, diff: &ContentDiff) -> Result<(), String> {
    let mut keys = content.specific.finger();
    for (k, v) in &diff.specific_removes {
        if keys.get(k) != Some(v) {
            return Err(format!(
                "no identity key {k:?} with verdict {v:?} to remove"
            ));
        }
    }
    for (p, v) in &diff.wildcard_removes {
        if content.wildcard.get(p) != Some(v) {
            return Err(format!(
                "no wildcard key {p:#x} with verdict {v:?} to remove"
            ));
        }
    }
    let mut keys = content.specific.finger();
    for (k, v) in &diff.specific_upserts {
        if keys.get(k) == Some(v) {
            return Err(format!("identity key {k:?} already has verdict {v:?}"));
        }
    }
    for (p, v) in &diff.wildcard_upserts {
        if content.wildcard.get(p) == Some(v) {
            return Err(format!("wildcard key {p:#x} already has verdict {v:?}"));
        }
    }
    Ok(())
}

/// The ipcache key of an address.
pub fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&v4.octets());
            IpKey::new(FAMILY_V4, addr_words(a))
        }
        IpAddr::V6(v6) => IpKey::new(FAMILY_V6, addr_words(v6.octets())),
    }
}

/// The address of an ipcache key.
pub fn key_ip(key: &IpKey) -> IpAddr {
    let b = addr_bytes(key.addr);
    if key.family == u32::from(FAMILY_V4) {
        IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(b))
    }
}

/// The addresses of a set of Service frontends, as ipcache keys.
fn frontend_addresses(services: &BTreeSet<SvcKey>) -> BTreeSet<IpKey> {
    services
        .iter()
        .map(|k| IpKey::new(k.family, k.addr))
        .collect()
}

/// The CIDR key (masked address) and address prefix length of a network.
pub fn net_key(net: IpNet) -> (IpKey, u32) {
    let net = net.trunc();
    (ip_key(net.addr()), u32::from(net.prefix_len()))
}

/// An endpoint's addresses with their identities, sorted by address (a repeated address keeps
/// its first identity).
fn addresses(
    endpoint: u32,
    ips: &[IpAddr],
    identity: u32,
    identities: &[u32],
) -> Result<(Vec<IpAddr>, Vec<u32>), ControlError> {
    if !identities.is_empty() && identities.len() != ips.len() {
        return Err(ControlError::IdentityCount {
            endpoint,
            ips: ips.len(),
            identities: identities.len(),
        });
    }
    let mut pairs: Vec<(IpAddr, u32)> = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| (*ip, identities.get(i).copied().unwrap_or(identity)))
        .collect();
    pairs.sort_by_key(|(ip, _)| *ip);
    pairs.dedup_by_key(|(ip, _)| *ip);
    Ok(pairs.into_iter().unzip())
}

fn is_host_prefix(net: &IpNet) -> bool {
    net.prefix_len() == net.max_prefix_len()
}

/// How full one map is ([`Control::fill`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapFill {
    /// The map's name (`ORDNET_POLICY`, ...).
    pub map: &'static str,
    /// Entries it holds.
    pub entries: u64,
    /// Entries it can hold.
    pub capacity: u64,
}

impl MapFill {
    /// `entries` in percent of `capacity`.
    pub fn percent(&self) -> u64 {
        (self.entries * 100).checked_div(self.capacity).unwrap_or(0)
    }
}

/// Endpoints, ipcache and rule sets.
#[derive(Debug)]
pub struct Control {
    pub(crate) store: Store,
    endpoints: BTreeMap<u32, EndpointState>,
    ip_owner: HashMap<IpKey, u32>,
    /// Identities of single addresses that are not local endpoints (remote pods, nodes, ...).
    remote: HashMap<IpKey, u32>,
    hosts: BTreeSet<IpKey>,
    cidr: BTreeMap<(IpKey, u32), u32>,
    /// Changes whenever `remote` or `cidr` may have ([`Control::identities_version`]).
    identities_version: u64,
    /// Capacities of the exact ipcache (per family) and the CIDR ipcache.
    ip_capacity: (u32, u32),
    /// Service frontends.
    services: BTreeSet<SvcKey>,
    /// Their addresses: an exact ipcache record of one carries `IP_FLAG_FRONTEND`.
    frontends: BTreeSet<IpKey>,
    /// Host-side interfaces of local endpoints.
    ifaces: BTreeMap<u32, IfaceInfo>,
    /// The state written on every revision bump (revision, clock parameters).
    state: State,
    /// The rule counter of each set of rules the keys come from.
    counters: RuleCounters,
}

struct Planned {
    id: u32,
    ips: Vec<IpAddr>,
    identities: Vec<u32>,
    /// [ingress, egress]: (content, default).
    dirs: [(RuleSetContent, u8); 2],
}

/// Where a changed rule set of [`Control::apply_items`] goes.
enum Target {
    /// It stays (no key change, or changed in place).
    Keep,
    /// To an existing rule set with the new content (slot 0: the empty one).
    Share(u32),
    /// To a fresh copy with this content.
    Copy(RuleSetContent),
}

/// One endpoint side's change: (endpoint, direction, its current policy, key changes, new
/// default).
type ChangeItem = (u32, Direction, PolicyRef, ContentDiff, u8);

/// The state a changing side takes first when both sides of some flow change: the [`meet`] of
/// old and new, or, when that is equivalent to one of them, that one (a side that only
/// tightens goes to its new state at once, one that only loosens waits for the second write).
fn meet_side(old: (&RuleSetContent, u8), new: (&RuleSetContent, u8)) -> (RuleSetContent, u8) {
    let m = meet(old, new);
    if same_verdicts((&m.0, m.1), new) {
        (new.0.clone(), new.1)
    } else if same_verdicts((&m.0, m.1), old) {
        (old.0.clone(), old.1)
    } else {
        m
    }
}

fn with_dir(state: &EndpointState, dir: usize, r: PolicyRef) -> EndpointState {
    let mut s = state.clone();
    if dir == 0 {
        s.ingress = r;
    } else {
        s.egress = r;
    }
    s
}

/// A version of [`Control::identities`] no `Control` of this process has had yet.
fn next_identities_version() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Control {
    /// A control plane for empty tables. `state` gives the clock parameters (its revision is
    /// the starting point; the first operation writes revision + 1).
    pub fn new(store: Store, state: State) -> Control {
        Control {
            store,
            endpoints: BTreeMap::new(),
            ip_owner: HashMap::new(),
            remote: HashMap::new(),
            hosts: BTreeSet::new(),
            cidr: BTreeMap::new(),
            identities_version: next_identities_version(),
            ip_capacity: (u32::MAX, u32::MAX),
            services: BTreeSet::new(),
            frontends: BTreeSet::new(),
            ifaces: BTreeMap::new(),
            state,
            counters: RuleCounters::default(),
        }
    }

    /// The rule counter of each set of rules the keys come from.
    pub fn rule_counters(&self) -> &RuleCounters {
        &self.counters
    }

    /// Frees the rule counters no key of any rule set names any more (O(keys)); how many. The
    /// caller reads the kernel's counts first (`RuleTotals::add`).
    pub fn retain_rule_counters(&mut self) -> usize {
        let live: FastSet<u16> = self.store.policy_keys().map(|(_, v)| v.counter).collect();
        self.counters.retain(&live)
    }

    /// Sets the capacities the fill report ([`Control::fill`]) compares with: the exact
    /// ipcache's (per family) and the CIDR ipcache's.
    pub fn set_ip_capacities(&mut self, ipcache: u32, cidr: u32) {
        self.ip_capacity = (ipcache, cidr);
    }

    /// How full the maps that grow with the cluster are: the policy keys, rule set slots and
    /// cell blocks (of the rule set store) and the ipcache (per family, and CIDRs), whose
    /// records `tables` holds (counted as they are written: read after every batch, this
    /// walks no table).
    pub fn fill(&self, tables: &MemTables) -> Vec<MapFill> {
        use ordnet_datapath_common::layout::{
            MAP_BLOCKS, MAP_CELLS, MAP_IP4, MAP_IP6, MAP_IPCIDR, MAP_POLICY,
        };
        let ip = tables.ip_records().map(|n| n as u64);
        let cap = |n: usize| n as u64;
        vec![
            MapFill {
                map: MAP_POLICY,
                entries: self.store.policy_keys_held() as u64,
                capacity: cap(self.store.policy_capacity()),
            },
            MapFill {
                map: MAP_CELLS,
                entries: self.store.slots_in_use().len() as u64 + 1,
                capacity: u64::from(self.store.max_rulesets()),
            },
            MapFill {
                map: MAP_BLOCKS,
                entries: u64::from(self.store.blocks_in_use()),
                capacity: u64::from(self.store.max_blocks()),
            },
            MapFill {
                map: MAP_IP4,
                entries: ip[0],
                capacity: u64::from(self.ip_capacity.0),
            },
            MapFill {
                map: MAP_IP6,
                entries: ip[1],
                capacity: u64::from(self.ip_capacity.0),
            },
            MapFill {
                map: MAP_IPCIDR,
                entries: tables.cidr.len() as u64,
                capacity: u64::from(self.ip_capacity.1),
            },
        ]
    }

    /// The policy revision last written (tracked flows older than it are re-checked).
    pub fn revision(&self) -> u64 {
        self.state.revision
    }

    /// The state (revision, clock parameters) last written.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The local endpoints, by id.
    pub fn endpoints(&self) -> &BTreeMap<u32, EndpointState> {
        &self.endpoints
    }

    /// The rule set store, writable (its capacities).
    pub(crate) fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    /// The rule set store (slots, blocks, sharing).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The exact ipcache record an address should have: its endpoint's, else the host record,
    /// else its identity, else none; marked as a Service frontend's when it is one.
    fn record(&self, key: &IpKey, overrides: &HashMap<u32, EndpointState>) -> Option<IpInfo> {
        let mut info = self.bare_record(key, overrides)?;
        if self.frontends.contains(key) {
            info.flags |= IP_FLAG_FRONTEND;
        }
        Some(info)
    }

    /// [`Control::record`] without the frontend mark.
    fn bare_record(&self, key: &IpKey, overrides: &HashMap<u32, EndpointState>) -> Option<IpInfo> {
        if let Some(id) = self.ip_owner.get(key) {
            let ep = overrides.get(id).or_else(|| self.endpoints.get(id))?;
            return Some(IpInfo {
                identity: ep.identity_of(key_ip(key)).unwrap_or(0),
                flags: IP_FLAG_ENDPOINT,
                endpoint: *id,
                ingress: ep.ingress,
                egress: ep.egress,
                classes: [0; 2],
            });
        }
        if self.hosts.contains(key) {
            return Some(IpInfo {
                identity: self.remote.get(key).copied().unwrap_or(0),
                flags: IP_FLAG_HOST,
                ..IpInfo::default()
            });
        }
        self.remote.get(key).map(|&identity| IpInfo {
            identity,
            ..IpInfo::default()
        })
    }

    /// Writes the records of `keys` (only those that differ from the tables).
    fn write_records<W: TableWriter + ?Sized>(
        &self,
        w: &mut W,
        keys: impl IntoIterator<Item = IpKey>,
        overrides: &HashMap<u32, EndpointState>,
        stats: &mut WriteStats,
    ) -> Result<(), WriteError> {
        let mut batch = Vec::new();
        let mut seen = BTreeSet::new();
        for key in keys {
            if !seen.insert(key) {
                continue;
            }
            let want = self.record(&key, overrides);
            let have = w.tables().ipcache.get(&key).copied();
            match want {
                Some(v) if have != Some(v) => batch.push(Write::IpUpsert(key, v)),
                None if have.is_some() => batch.push(Write::IpDelete(key)),
                _ => {}
            }
        }
        stats.write(w, &batch)
    }

    /// Bumps the policy revision: tracked flows are re-checked against the new state.
    fn bump<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        stats: &mut WriteStats,
    ) -> Result<(), WriteError> {
        self.state.revision += 1;
        stats.write(w, &[Write::State(self.state)])
    }

    /// Validates that endpoint `id` of a batch (`batch_ids`) may hold `ips`: no address belongs
    /// to an endpoint outside the batch, and no two endpoints of the batch claim one address
    /// (`new_owner` collects the batch's claims).
    fn claim_addresses(
        &self,
        id: u32,
        ips: &[IpAddr],
        batch_ids: &BTreeSet<u32>,
        new_owner: &mut HashMap<IpKey, u32>,
    ) -> Result<(), ControlError> {
        for ip in ips {
            let key = ip_key(*ip);
            if let Some(&owner) = self.ip_owner.get(&key)
                && owner != id
                && !batch_ids.contains(&owner)
            {
                return Err(ControlError::AddressInUse { ip: *ip, owner });
            }
            if let Some(other) = new_owner.insert(key, id)
                && other != id
            {
                return Err(ControlError::AddressInUse {
                    ip: *ip,
                    owner: other,
                });
            }
        }
        Ok(())
    }

    /// Creates or changes endpoints. Rule sets are shared by content; a rule set used only by
    /// endpoints of this batch that all move to the same new content is changed in place
    /// (only the differing keys are written, in the safe order); otherwise the new content is
    /// installed beside the old one (or an existing identical rule set is reused) and each
    /// endpoint is switched with one record write per address.
    pub fn update_endpoints<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        batch: &[(u32, EndpointSpec<'_>)],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        self.store.reclaim(w, &mut stats)?;
        let planned = self.plan(batch)?;
        // Both sides of some flow change (an egress and an ingress rule set or default): the
        // meet of old and new goes first, so that no mix of old and new records the datapath
        // may see allows what neither state allows.
        if let Some(meet) = self.meet_plan(&planned) {
            self.write_planned(w, &meet, &mut stats)?;
        }
        self.write_planned(w, &planned, &mut stats)?;
        Ok(stats)
    }

    /// [`Control::update_endpoints`], except that an endpoint whose rule sets do not fit the
    /// tables (policy keys, rule set slots, cell blocks: [`ControlError::is_capacity`]) gets a
    /// **deny-all policy in both directions** instead of its own, so that it is never left
    /// unenforced, and the others get theirs. Returns the statistics and the endpoints denied,
    /// with why.
    ///
    /// When the whole batch does not fit, it is written one endpoint at a time, which is safe
    /// as long as no flow has two changing sides (each step then changes one side of any
    /// flow); when some flow has two (an egress and another endpoint's ingress), every
    /// changing endpoint first goes to deny-all (which allows less than any state), so that
    /// every later mix allows at most what the new state allows.
    pub fn update_endpoints_or_deny<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        batch: &[(u32, EndpointSpec<'_>)],
    ) -> Result<(WriteStats, Vec<(u32, ControlError)>), ControlError> {
        let mut stats = WriteStats::default();
        self.store.reclaim(w, &mut stats)?;
        let planned = self.plan(batch)?;
        let meet = self.meet_plan(&planned);
        let two_sides = meet.is_some();
        let whole = match &meet {
            Some(meet) => self
                .write_planned(w, meet, &mut stats)
                .and_then(|()| self.write_planned(w, &planned, &mut stats)),
            None => self.write_planned(w, &planned, &mut stats),
        };
        match whole {
            Ok(()) => return Ok((stats, Vec::new())),
            Err(e) if e.is_capacity() => {}
            Err(e) => return Err(e),
        }
        let deny_all = |p: &Planned| Planned {
            id: p.id,
            ips: p.ips.clone(),
            identities: p.identities.clone(),
            dirs: [
                (RuleSetContent::default(), V_DENY),
                (RuleSetContent::default(), V_DENY),
            ],
        };
        if two_sides {
            let changing: Vec<Planned> = planned
                .iter()
                .filter(|p| {
                    self.endpoints.get(&p.id).is_some_and(|o| {
                        (0..2).any(|d| {
                            let r = o.policy(Direction::ALL[d]);
                            self.store.content(r.ruleset) != Some(&p.dirs[d].0)
                                || r.default != p.dirs[d].1
                        })
                    })
                })
                .map(deny_all)
                .collect();
            self.write_planned(w, &changing, &mut stats)?;
        }
        let mut denied = Vec::new();
        for p in &planned {
            match self.write_planned(w, std::slice::from_ref(p), &mut stats) {
                Ok(()) => {}
                Err(e) if e.is_capacity() => {
                    self.write_planned(w, &[deny_all(p)], &mut stats)?;
                    denied.push((p.id, e));
                }
                Err(e) => return Err(e),
            }
        }
        Ok((stats, denied))
    }

    /// Step 1 of an update: validates and flattens the batch; nothing is written.
    fn plan(&mut self, batch: &[(u32, EndpointSpec<'_>)]) -> Result<Vec<Planned>, ControlError> {
        let batch_ids: BTreeSet<u32> = batch.iter().map(|(id, _)| *id).collect();
        let mut new_owner: HashMap<IpKey, u32> = HashMap::new();
        let mut planned = Vec::with_capacity(batch.len());
        for (id, spec) in batch {
            if *id == 0 {
                return Err(ControlError::ZeroEndpointId);
            }
            self.claim_addresses(*id, spec.ips, &batch_ids, &mut new_owner)?;
            let counters = &mut self.counters;
            let mut flat = |dir: Direction, ms: &MapState| {
                flatten_counted(ms, counters).map_err(|source| ControlError::Flatten {
                    endpoint: *id,
                    direction: dir,
                    source,
                })
            };
            let (ips, identities) = addresses(*id, spec.ips, spec.identity, spec.identities)?;
            planned.push(Planned {
                id: *id,
                ips,
                identities,
                dirs: [
                    flat(Direction::Ingress, spec.ingress)?,
                    flat(Direction::Egress, spec.egress)?,
                ],
            });
        }
        Ok(planned)
    }

    /// For a batch that changes both sides of some flow — one endpoint's egress and another
    /// endpoint's ingress (rule set or default) — the same batch with each changed side at
    /// [`meet_side`] of its old and new state; `None` when no flow has two changing sides.
    /// Endpoints new in the batch get their new state (they are not judged as local endpoints
    /// before, which lets more through than any state of theirs).
    fn meet_plan(&self, planned: &[Planned]) -> Option<Vec<Planned>> {
        let empty = RuleSetContent::default();
        let old_side = |p: &Planned, d: usize| -> Option<(&RuleSetContent, u8)> {
            let r = self.endpoints.get(&p.id)?.policy(Direction::ALL[d]);
            Some((self.store.content(r.ruleset).unwrap_or(&empty), r.default))
        };
        let changed = |p: &Planned, d: usize| {
            old_side(p, d).is_some_and(|(c, def)| (c, def) != (&p.dirs[d].0, p.dirs[d].1))
        };
        let ingress: Vec<u32> = planned
            .iter()
            .filter(|p| changed(p, 0))
            .map(|p| p.id)
            .collect();
        let two_sides = planned
            .iter()
            .filter(|p| changed(p, 1))
            .any(|p| ingress.iter().any(|id| *id != p.id));
        if !two_sides {
            return None;
        }
        Some(
            planned
                .iter()
                .map(|p| Planned {
                    id: p.id,
                    ips: p.ips.clone(),
                    identities: p.identities.clone(),
                    dirs: [0, 1].map(|d| match old_side(p, d) {
                        Some(old) if changed(p, d) => {
                            meet_side((old.0, old.1), (&p.dirs[d].0, p.dirs[d].1))
                        }
                        _ => p.dirs[d].clone(),
                    }),
                })
                .collect(),
        )
    }

    /// Writes planned endpoint states (validated) in the safe order: rule sets changed in place
    /// or installed beside, then one record write per address, then releases; bumps the
    /// revision.
    fn write_planned<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        planned: &[Planned],
        stats: &mut WriteStats,
    ) -> Result<(), ControlError> {
        let old: Vec<Option<EndpointState>> = planned
            .iter()
            .map(|p| self.endpoints.get(&p.id).cloned())
            .collect();
        // 2. Which rule sets change in place.
        let in_place = self.in_place_changes(planned, &old);
        let is_in_place = |i: usize, d: usize| {
            old[i]
                .as_ref()
                .is_some_and(|o| in_place.contains_key(&o.policy(Direction::ALL[d]).ruleset))
        };
        // Room for every key the plan adds, before anything is written.
        let needed = self.room_needed(planned, &in_place, &is_in_place);
        self.store.ensure_room(w, needed, stats)?;
        // 3. Install new contents (invisible until a record points at them).
        let targets = self.install_targets(w, planned, &old, &in_place, &is_in_place, stats)?;
        // 4. Defaults that tighten on a rule set changed in place go first (a default is the
        // weakest wildcard key: deny upserts first, allow upserts last).
        self.tighten_in_place_defaults(w, planned, &old, &is_in_place, stats)?;
        // 5. In-place changes (each slot's phases in order; the slots go through them
        // together).
        let diffs: Vec<(u32, ContentDiff)> = in_place
            .iter()
            .map(|(&slot, new)| {
                let old = self.store.content(slot).expect("a slot in use");
                (slot, ContentDiff::between(old, new))
            })
            .collect();
        let diffs: Vec<(u32, &ContentDiff)> = diffs.iter().map(|(s, d)| (*s, d)).collect();
        self.store.update_with_diffs(w, &diffs, stats)?;
        // 6. Switch: the final records (one atomic write per address).
        self.switch_records(w, planned, &old, &targets, stats)?;
        // 7. Release what is no longer used (cleared after the grace period).
        for (i, o) in old.iter().enumerate() {
            if let Some(o) = o {
                for (d, dir) in Direction::ALL.into_iter().enumerate() {
                    let before = o.policy(dir).ruleset;
                    if before != targets[i][d] {
                        self.store.release(before, stats);
                    }
                }
            }
        }
        self.bump(w, stats)?;
        Ok(())
    }

    /// Policy keys a plan adds: the new keys of rule sets changed in place, and every key of
    /// each distinct content installed beside (one no slot holds yet).
    fn room_needed(
        &self,
        planned: &[Planned],
        in_place: &BTreeMap<u32, RuleSetContent>,
        is_in_place: &dyn Fn(usize, usize) -> bool,
    ) -> usize {
        let mut needed = 0;
        for (&slot, new) in in_place {
            if let Some(current) = self.store.content(slot) {
                needed += new
                    .specific
                    .keys()
                    .filter(|k| !current.specific.contains_key(k))
                    .count()
                    + new
                        .wildcard
                        .keys()
                        .filter(|p| !current.wildcard.contains_key(p))
                        .count();
            }
        }
        let mut counted: HashMap<u64, Vec<&RuleSetContent>> = HashMap::new();
        for (i, p) in planned.iter().enumerate() {
            for d in 0..2 {
                let content = &p.dirs[d].0;
                if is_in_place(i, d)
                    || content.is_empty()
                    || in_place.values().any(|c| c == content)
                    || self.store.find(content).is_some()
                {
                    continue;
                }
                let same = counted.entry(content.content_hash()).or_default();
                if !same.contains(&content) {
                    same.push(content);
                    needed += content.len();
                }
            }
        }
        needed
    }

    /// The rule sets that change in place: every user of the slot is in this batch and all of
    /// them want the same new content, which exists nowhere yet (slot -> new content).
    fn in_place_changes(
        &self,
        planned: &[Planned],
        old: &[Option<EndpointState>],
    ) -> BTreeMap<u32, RuleSetContent> {
        let mut users: BTreeMap<u32, Vec<(usize, usize)>> = BTreeMap::new();
        for (i, o) in old.iter().enumerate() {
            if let Some(o) = o {
                for (d, dir) in Direction::ALL.iter().enumerate() {
                    let slot = o.policy(*dir).ruleset;
                    if slot != 0 {
                        users.entry(slot).or_default().push((i, d));
                    }
                }
            }
        }
        let mut in_place: BTreeMap<u32, RuleSetContent> = BTreeMap::new();
        for (&slot, us) in &users {
            let first = &planned[us[0].0].dirs[us[0].1].0;
            let current = self.store.content(slot);
            if us.len() as u32 == self.store.refs(slot)
                && us.iter().all(|&(i, d)| &planned[i].dirs[d].0 == first)
                && !first.is_empty()
                && current != Some(first)
                && self.store.find(first).is_none()
                && !in_place.values().any(|c| c == first)
                // Nobody in the batch may want the slot's current content.
                && !planned.iter().any(|p| p.dirs.iter().any(|(c, _)| Some(c) == current))
            {
                in_place.insert(slot, first.clone());
            }
        }
        in_place
    }

    /// The target slot of every side of the batch: the current one (changed in place), one
    /// sharing the content, or a fresh install. On a failure nothing stays referenced.
    fn install_targets<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        planned: &[Planned],
        old: &[Option<EndpointState>],
        in_place: &BTreeMap<u32, RuleSetContent>,
        is_in_place: &dyn Fn(usize, usize) -> bool,
        stats: &mut WriteStats,
    ) -> Result<Vec<[u32; 2]>, ControlError> {
        let mut targets = vec![[0u32; 2]; planned.len()];
        let mut installed = Vec::new();
        let mut added_refs = Vec::new();
        let mut result = Ok(());
        'plan: for (i, p) in planned.iter().enumerate() {
            for (d, dir) in Direction::ALL.into_iter().enumerate() {
                let old_slot = old[i].as_ref().map(|o| o.policy(dir).ruleset);
                if is_in_place(i, d) {
                    targets[i][d] = old_slot.unwrap_or(0);
                    continue;
                }
                let content = &p.dirs[d].0;
                // A content some rule set gets by an in-place change is shared with it.
                let after_update = in_place
                    .iter()
                    .find(|(_, c)| *c == content)
                    .map(|(s, _)| *s);
                let slot = match after_update.or_else(|| self.store.find(content)) {
                    Some(s) => {
                        if Some(s) != old_slot {
                            self.store.add_ref(s);
                            added_refs.push(s);
                        }
                        s
                    }
                    None => match self.store.install(w, content.clone(), stats) {
                        Ok(s) => {
                            installed.push(s);
                            s
                        }
                        Err(e) => {
                            result = Err(e);
                            break 'plan;
                        }
                    },
                };
                targets[i][d] = slot;
            }
        }
        if let Err(e) = result {
            for s in installed.into_iter().chain(added_refs) {
                self.store.release(s, stats);
            }
            return Err(e.into());
        }
        Ok(targets)
    }

    /// Writes, before in-place key changes, the records whose default tightens (allow to deny)
    /// on a rule set changed in place.
    fn tighten_in_place_defaults<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        planned: &[Planned],
        old: &[Option<EndpointState>],
        is_in_place: &dyn Fn(usize, usize) -> bool,
        stats: &mut WriteStats,
    ) -> Result<(), ControlError> {
        let mut pre = HashMap::new();
        for (i, p) in planned.iter().enumerate() {
            let Some(o) = &old[i] else { continue };
            let mut s = o.clone();
            for (d, dir) in Direction::ALL.iter().enumerate() {
                let r = o.policy(*dir);
                if is_in_place(i, d) && r.default == V_ALLOW && p.dirs[d].1 == V_DENY {
                    s = with_dir(&s, d, PolicyRef::new(r.ruleset, V_DENY));
                }
            }
            if &s != o {
                pre.insert(p.id, s);
            }
        }
        if !pre.is_empty() {
            let keys: Vec<IpKey> = pre
                .values()
                .flat_map(|s| s.ips.iter().map(|ip| ip_key(*ip)))
                .collect();
            self.write_records(w, keys, &pre, stats)?;
        }
        Ok(())
    }

    /// The endpoints' final states and one record write per address: new addresses first,
    /// then the ones an endpoint gave up.
    fn switch_records<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        planned: &[Planned],
        old: &[Option<EndpointState>],
        targets: &[[u32; 2]],
        stats: &mut WriteStats,
    ) -> Result<(), ControlError> {
        let mut touched = Vec::new();
        for (i, p) in planned.iter().enumerate() {
            let state = EndpointState {
                ips: p.ips.clone(),
                identities: p.identities.clone(),
                ingress: PolicyRef::new(targets[i][0], p.dirs[0].1),
                egress: PolicyRef::new(targets[i][1], p.dirs[1].1),
            };
            if let Some(o) = &old[i] {
                for ip in &o.ips {
                    let key = ip_key(*ip);
                    if self.ip_owner.get(&key) == Some(&p.id) {
                        self.ip_owner.remove(&key);
                    }
                    touched.push(key);
                }
            }
            self.endpoints.insert(p.id, state);
        }
        for p in planned {
            for ip in &p.ips {
                let key = ip_key(*ip);
                self.ip_owner.insert(key, p.id);
                touched.push(key);
            }
        }
        // New addresses first, then the ones an endpoint gave up.
        touched.sort_by_key(|k| !self.ip_owner.contains_key(k));
        self.write_records(w, touched, &HashMap::new(), stats)?;
        Ok(())
    }

    /// Applies MapState change sets (what `MapState::apply` returned) to endpoints' rule sets,
    /// with the new isolation defaults: O(size of the changes) when a rule set changes in
    /// place. As in [`Control::update_endpoints`], a rule set is changed in place when every
    /// endpoint using it is in the batch with the same key changes; otherwise the changed
    /// content is shared with an identical rule set if one exists, or installed beside the old
    /// one (a copy: O(keys)).
    pub fn apply_changes<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        batch: &[(u32, Direction, Changes<'_>, Verdict)],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        self.store.reclaim(w, &mut stats)?;
        // 1. Validate: endpoints exist, changes convert and fit the current keys.
        let mut items = Vec::with_capacity(batch.len());
        // The endpoints of one rule set given the same changes (the users of one shared
        // MapState) convert and check them once.
        let mut checked: HashMap<([usize; 6], u32), ContentDiff> = HashMap::new();
        for &(id, dir, changes, default) in batch {
            let ep = self
                .endpoints
                .get(&id)
                .ok_or(ControlError::UnknownEndpoint(id))?;
            let old = ep.policy(dir);
            let memo = (changes.place(), old.ruleset);
            let diff = match checked.get(&memo) {
                Some(diff) => diff.clone(),
                None => {
                    let diff = ContentDiff::from_changeset(changes, &mut self.counters).map_err(
                        |source| ControlError::Flatten {
                            endpoint: id,
                            direction: dir,
                            source,
                        },
                    )?;
                    let empty = RuleSetContent::default();
                    let content = self.store.content(old.ruleset).unwrap_or(&empty);
                    check_diff(content, &diff).map_err(|detail| ControlError::StaleChanges {
                        endpoint: id,
                        direction: dir,
                        detail,
                    })?;
                    checked.insert(memo, diff.clone());
                    diff
                }
            };
            items.push((id, dir, old, diff, verdict_code(default)));
        }
        // Both sides of some flow change: the meet of old and new goes first (see
        // `update_endpoints`).
        if !self.two_sides(&items) {
            self.apply_items(w, items, &mut stats)?;
            return Ok(stats);
        }
        /// The second step of an item: to the final content, or by a diff from the meet.
        enum Final {
            Content(RuleSetContent),
            Diff(ContentDiff),
        }
        let empty = RuleSetContent::default();
        let mut finals = Vec::with_capacity(items.len());
        let mut meets = Vec::with_capacity(items.len());
        // Endpoints that share a rule set and get the same change set (the engine gives every
        // user of a shared MapState the same one) share the steps.
        let mut memo: HashMap<(u32, u8, [usize; 6]), (ContentDiff, ContentDiff)> = HashMap::new();
        for (i, (id, dir, old, diff, default)) in items.into_iter().enumerate() {
            let current = self.store.content(old.ruleset).unwrap_or(&empty);
            if old.default == default {
                // Only identity keys change: the steps cost the size of the change.
                let key = (old.ruleset, default, batch[i].2.place());
                let steps = match memo.get(&key) {
                    Some(steps) => Some(steps.clone()),
                    None => meet_steps(current, default, &diff),
                };
                if let Some((to_meet, to_after)) = steps {
                    memo.insert(key, (to_meet.clone(), to_after.clone()));
                    meets.push((id, dir, old, to_meet, default));
                    finals.push((id, dir, Final::Diff(to_after), default));
                    continue;
                }
            }
            let mut after = current.clone();
            after.apply(&diff);
            let (m, m_default) = meet_side((current, old.default), (&after, default));
            meets.push((id, dir, old, ContentDiff::between(current, &m), m_default));
            finals.push((id, dir, Final::Content(after), default));
        }
        self.apply_items(w, meets, &mut stats)?;
        let items = finals
            .into_iter()
            .map(|(id, dir, after, default)| {
                let now = self.endpoints[&id].policy(dir);
                let diff = match after {
                    Final::Diff(d) => d,
                    Final::Content(after) => {
                        let current = self.store.content(now.ruleset).unwrap_or(&empty);
                        ContentDiff::between(current, &after)
                    }
                };
                (id, dir, now, diff, default)
            })
            .collect();
        self.apply_items(w, items, &mut stats)?;
        Ok(stats)
    }

    /// Whether a batch of [`Control::apply_changes`] changes some endpoint's egress and another
    /// one's ingress in a way a packet can see. Keys of an identity that no record carries (a
    /// relabelled pod's new identity before its records switch, its old one after) change no
    /// verdict, whatever the order of their writes: an item that changes only such keys does
    /// not count.
    fn two_sides(&self, items: &[ChangeItem]) -> bool {
        let changes = |it: &ChangeItem| !it.3.is_empty() || it.2.default != it.4;
        let paired = |items: &[&ChangeItem]| {
            items.iter().filter(|e| e.1 == Direction::Egress).any(|e| {
                items
                    .iter()
                    .any(|i| i.1 == Direction::Ingress && i.0 != e.0)
            })
        };
        let changing: Vec<&ChangeItem> = items.iter().filter(|it| changes(it)).collect();
        if !paired(&changing) {
            return false;
        }
        let carried: FastSet<u32> = self
            .endpoints
            .values()
            .flat_map(|ep| ep.identities.iter().copied())
            .chain(self.remote.values().copied())
            .chain(self.cidr.values().copied())
            .collect();
        let visible: Vec<&ChangeItem> = changing
            .into_iter()
            .filter(|it| {
                let d = &it.3;
                it.2.default != it.4
                    || !d.wildcard_upserts.is_empty()
                    || !d.wildcard_removes.is_empty()
                    || d.specific_upserts
                        .iter()
                        .chain(&d.specific_removes)
                        .any(|((id, _), _)| carried.contains(id))
            })
            .collect();
        paired(&visible)
    }

    /// Writes validated rule set changes of endpoints (`(endpoint, direction, its current
    /// policy, key changes, new default)`) in the safe order, then bumps the revision.
    fn apply_items<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        items: Vec<ChangeItem>,
        stats: &mut WriteStats,
    ) -> Result<(), ControlError> {
        let d_index = |dir: Direction| usize::from(dir == Direction::Egress);

        // 2. Rule sets changed in place (see `Control::choose_in_place`).
        let (in_place, stays) = self.choose_in_place(&items);

        // 3. The other changed rule sets: an identical one, or a fresh copy. A rule set changed
        // in place is no candidate: its current content is about to change. Decided first, so
        // that the room for every key the changes add (in place, and the distinct copies) is
        // checked before anything is written.
        let (plan, needed) = self.plan_targets(&items, &in_place, &stays);
        self.store.ensure_room(w, needed, stats)?;
        let mut targets: Vec<u32> = items.iter().map(|it| it.2.ruleset).collect();
        for (i, target) in plan.into_iter().enumerate() {
            let t = match target {
                Target::Keep => continue,
                Target::Share(t) => {
                    self.store.add_ref(t);
                    t
                }
                // A copy an earlier item of the batch installed already is shared (never a
                // rule set about to change in place).
                Target::Copy(content) => match self
                    .store
                    .find(&content)
                    .filter(|t| !in_place.contains_key(t))
                {
                    Some(t) => {
                        self.store.add_ref(t);
                        t
                    }
                    None => match self.store.install(w, content, stats) {
                        Ok(s) => s,
                        Err(e) => {
                            for (j, t) in targets.iter().enumerate().take(i) {
                                if *t != items[j].2.ruleset {
                                    self.store.release(*t, stats);
                                }
                            }
                            return Err(e.into());
                        }
                    },
                },
            };
            targets[i] = t;
        }

        // 4. Users leaving a rule set about to change in place take their new rule sets first
        // (they must never see it changed), then the tightening defaults of in-place rule sets.
        let moved_early = self.move_off_in_place(w, &items, &in_place, &stays, &targets, stats)?;
        let mut pre: HashMap<u32, EndpointState> = HashMap::new();
        for (i, it) in items.iter().enumerate() {
            if stays[i]
                && in_place.contains_key(&it.2.ruleset)
                && it.2.default == V_ALLOW
                && it.4 == V_DENY
            {
                let base = pre
                    .get(&it.0)
                    .cloned()
                    .unwrap_or_else(|| self.endpoints[&it.0].clone());
                let s = with_dir(&base, d_index(it.1), PolicyRef::new(it.2.ruleset, V_DENY));
                pre.insert(it.0, s);
            }
        }
        if !pre.is_empty() {
            let keys: Vec<IpKey> = pre
                .values()
                .flat_map(|s| s.ips.iter().map(|ip| ip_key(*ip)))
                .collect();
            self.write_records(w, keys, &pre, stats)?;
        }

        // 5. In-place changes (each slot's phases in order; the slots go through them
        // together).
        let diffs: Vec<(u32, &ContentDiff)> = in_place
            .iter()
            .map(|(&slot, &i)| (slot, &items[i].3))
            .collect();
        self.store.update_with_diffs(w, &diffs, stats)?;

        // 6. Final records, then release what is no longer used.
        self.point_records(w, &items, &targets, |_| true, stats)?;
        for (i, it) in items.iter().enumerate() {
            if targets[i] != it.2.ruleset && !moved_early[i] {
                self.store.release(it.2.ruleset, stats);
            }
        }
        self.bump(w, stats)?;
        Ok(())
    }

    /// Points the endpoints of the `selected` items of [`Control::apply_items`] to their targets
    /// (with their new defaults) and writes their records.
    fn point_records<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        items: &[ChangeItem],
        targets: &[u32],
        selected: impl Fn(usize) -> bool,
        stats: &mut WriteStats,
    ) -> Result<(), WriteError> {
        let mut touched = Vec::new();
        for (i, it) in items.iter().enumerate().filter(|(i, _)| selected(*i)) {
            let ep = self.endpoints.get_mut(&it.0).expect("validated");
            let r = PolicyRef::new(targets[i], it.4);
            match it.1 {
                Direction::Ingress => ep.ingress = r,
                Direction::Egress => ep.egress = r,
            }
            touched.extend(ep.ips.iter().map(|ip| ip_key(*ip)));
        }
        self.write_records(w, touched, &HashMap::new(), stats)
    }

    /// Step 2 of [`Control::apply_items`]: the rule sets changed in place, each with the item
    /// whose changes it takes, and whether each item stays on its rule set (unchanged or
    /// changed in place with it).
    ///
    /// A rule set changes in place when every user is in the batch with changes, the users of
    /// the largest group with equal changes stay (the first such group on a tie), and the
    /// result exists nowhere else; users with other changes move to their own targets before it
    /// changes ([`Control::move_off_in_place`]). (A relabelled pod that leaves a rule set it
    /// shared, while the others gain its new identity, would otherwise make them a fresh copy of
    /// the whole rule set.)
    fn choose_in_place(&self, items: &[ChangeItem]) -> (BTreeMap<u32, usize>, Vec<bool>) {
        let mut users: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, it) in items.iter().enumerate() {
            if it.2.ruleset != 0 && !it.3.is_empty() {
                users.entry(it.2.ruleset).or_default().push(i);
            }
        }
        let mut in_place: BTreeMap<u32, usize> = BTreeMap::new();
        let mut stays: Vec<bool> = items.iter().map(|it| it.3.is_empty()).collect();
        for (&slot, us) in &users {
            if us.len() as u32 != self.store.refs(slot) {
                continue;
            }
            // Groups of equal changes, in the order of their first user.
            let mut groups: Vec<Vec<usize>> = Vec::new();
            for &i in us {
                match groups.iter_mut().find(|g| items[g[0]].3 == items[i].3) {
                    Some(g) => g.push(i),
                    None => groups.push(vec![i]),
                }
            }
            let largest = groups
                .iter()
                .enumerate()
                .max_by_key(|&(n, g)| (g.len(), std::cmp::Reverse(n)))
                .map(|(n, _)| n)
                .expect("a user");
            let first = groups[largest][0];
            // (`existing_after` is `Some(0)` when the result is empty: the users then move to
            // slot 0 instead.)
            if self
                .existing_after(slot, &items[first].3, &BTreeMap::<u32, ()>::new())
                .is_none()
            {
                in_place.insert(slot, first);
                for &i in &groups[largest] {
                    stays[i] = true;
                }
            }
        }
        (in_place, stays)
    }

    /// Step 4 of [`Control::apply_items`], first part: the items leaving a rule set that changes
    /// in place take their targets now (records written, the old rule set released), so that no
    /// packet of theirs is judged by it after it starts changing. Returns which items moved.
    fn move_off_in_place<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        items: &[ChangeItem],
        in_place: &BTreeMap<u32, usize>,
        stays: &[bool],
        targets: &[u32],
        stats: &mut WriteStats,
    ) -> Result<Vec<bool>, ControlError> {
        let moved: Vec<bool> = items
            .iter()
            .enumerate()
            .map(|(i, it)| !stays[i] && in_place.contains_key(&it.2.ruleset))
            .collect();
        if !moved.contains(&true) {
            return Ok(moved);
        }
        self.point_records(w, items, targets, |i| moved[i], stats)?;
        for (i, it) in items.iter().enumerate() {
            if moved[i] {
                self.store.release(it.2.ruleset, stats);
            }
        }
        Ok(moved)
    }

    /// Step 3's decision for each item of [`Control::apply_items`] — keep its rule set (no
    /// change, or changed in place), share an existing one, or install a copy — and the policy
    /// keys the changes add: the new keys of the rule sets changed in place and every key of
    /// each distinct copy.
    fn plan_targets(
        &self,
        items: &[ChangeItem],
        in_place: &BTreeMap<u32, usize>,
        stays: &[bool],
    ) -> (Vec<Target>, usize) {
        let empty = RuleSetContent::default();
        let mut needed: usize = in_place
            .iter()
            .map(|(&slot, &i)| added_keys(self.store.content(slot).unwrap_or(&empty), &items[i].3))
            .sum();
        let mut counted: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut plan: Vec<Target> = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            let slot = it.2.ruleset;
            if stays[i] {
                plan.push(Target::Keep);
                continue;
            }
            if let Some(t) = self.existing_after(slot, &it.3, in_place) {
                plan.push(Target::Share(t));
                continue;
            }
            let current = self.store.content(slot).unwrap_or(&empty);
            let hash = current.hash_after(self.store.hash(slot).unwrap_or(0), &it.3);
            let mut after = current.clone();
            after.apply(&it.3);
            let same = counted.entry(hash).or_default();
            if !same
                .iter()
                .any(|&j| matches!(&plan[j], Target::Copy(c) if *c == after))
            {
                needed += after.len();
                same.push(plan.len());
            }
            plan.push(Target::Copy(after));
        }
        (plan, needed)
    }

    /// A slot other than `slot` (and not in `exclude`) whose content equals `slot`'s content
    /// with `diff` applied (0 for the empty content). The full comparison only runs on a hash
    /// match.
    fn existing_after<V>(
        &self,
        slot: u32,
        diff: &ContentDiff,
        exclude: &BTreeMap<u32, V>,
    ) -> Option<u32> {
        let empty = RuleSetContent::default();
        let content = self.store.content(slot).unwrap_or(&empty);
        // Empty after the diff: it removes every key (its removals are keys of the content)
        // and upserts none (an upserted key is there after it).
        let removed = diff.specific_removes.len() + diff.wildcard_removes.len();
        let upserts = diff.specific_upserts.len() + diff.wildcard_upserts.len();
        if upserts == 0 && content.len() == removed {
            return Some(0);
        }
        let hash = content.hash_after(self.store.hash(slot).unwrap_or(0), diff);
        let candidates: Vec<u32> = self
            .store
            .slots_with_hash(hash)
            .iter()
            .copied()
            .filter(|s| *s != slot && !exclude.contains_key(s))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let mut after = content.clone();
        after.apply(diff);
        candidates
            .into_iter()
            .find(|s| self.store.content(*s) == Some(&after))
    }

    /// Changes the addresses and identities of existing endpoints, keeping their rule sets
    /// (a pod whose labels changed gets a new identity; a pod re-addressed). `identities` is
    /// per address (same order as `ips`) or empty (every address has `identity`). New addresses
    /// are written first, then the ones an endpoint gave up lose its record.
    pub fn set_endpoint_addresses<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        batch: &[(u32, EndpointAddresses<'_>)],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        // 1. Validate everything before changing anything.
        let batch_ids: BTreeSet<u32> = batch.iter().map(|(id, _)| *id).collect();
        let mut new_owner: HashMap<IpKey, u32> = HashMap::new();
        let mut planned = Vec::with_capacity(batch.len());
        for (id, a) in batch {
            if !self.endpoints.contains_key(id) {
                return Err(ControlError::UnknownEndpoint(*id));
            }
            let (ips, identities) = addresses(*id, a.ips, a.identity, a.identities)?;
            self.claim_addresses(*id, &ips, &batch_ids, &mut new_owner)?;
            planned.push((*id, ips, identities));
        }
        // 2. New state, then the records: new addresses first, then the ones given up.
        let mut touched = Vec::new();
        for (id, ips, identities) in planned {
            let ep = self.endpoints.get_mut(&id).expect("validated");
            for ip in &ep.ips {
                let key = ip_key(*ip);
                if self.ip_owner.get(&key) == Some(&id) {
                    self.ip_owner.remove(&key);
                }
                touched.push(key);
            }
            ep.ips = ips;
            ep.identities = identities;
            for ip in &ep.ips {
                touched.push(ip_key(*ip));
            }
        }
        for (id, a) in batch {
            for ip in a.ips {
                self.ip_owner.insert(ip_key(*ip), *id);
            }
        }
        touched.sort_by_key(|k| !self.ip_owner.contains_key(k));
        self.write_records(w, touched, &HashMap::new(), &mut stats)?;
        self.bump(w, &mut stats)?;
        Ok(stats)
    }

    /// Removes endpoints: their addresses lose the endpoint record (falling back to a host or
    /// identity record if one was set), their rule sets lose a user.
    pub fn remove_endpoints<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        ids: &[u32],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        for id in ids {
            if !self.endpoints.contains_key(id) {
                return Err(ControlError::UnknownEndpoint(*id));
            }
        }
        let mut keys = Vec::new();
        let mut slots = Vec::new();
        for id in ids {
            if let Some(ep) = self.endpoints.remove(id) {
                for ip in &ep.ips {
                    let key = ip_key(*ip);
                    if self.ip_owner.get(&key) == Some(id) {
                        self.ip_owner.remove(&key);
                    }
                    keys.push(key);
                }
                slots.push(ep.ingress.ruleset);
                slots.push(ep.egress.ruleset);
            }
        }
        self.write_records(w, keys, &HashMap::new(), &mut stats)?;
        for s in slots {
            self.store.release(s, &mut stats);
        }
        self.bump(w, &mut stats)?;
        self.store.reclaim(w, &mut stats)?;
        Ok(stats)
    }

    /// Sets (`Some`) or removes (`None`) the identity of networks: single addresses go to the
    /// exact ipcache, shorter prefixes to the CIDR trie. A network given more than once takes
    /// its last entry, and only where it ends differing from where it started is written (a
    /// record set and removed again in one batch would otherwise exist half-way through it).
    pub fn set_identities<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        entries: &[(IpNet, Option<u32>)],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        if !entries.is_empty() {
            self.identities_version = next_identities_version();
        }
        let mut exact = Vec::new();
        // CIDR entries: each prefix's identity before the batch.
        let mut cidr_before: BTreeMap<(IpKey, u32), Option<u32>> = BTreeMap::new();
        for (net, identity) in entries {
            if is_host_prefix(net) {
                let key = ip_key(net.addr());
                match identity {
                    Some(id) => self.remote.insert(key, *id),
                    None => self.remote.remove(&key),
                };
                exact.push(key);
            } else {
                let k = net_key(*net);
                let before = self.cidr.get(&k).copied();
                cidr_before.entry(k).or_insert(before);
                match identity {
                    Some(id) => self.cidr.insert(k, *id),
                    None => self.cidr.remove(&k),
                };
            }
        }
        let cidr_writes: Vec<Write> = cidr_before
            .into_iter()
            .filter_map(|((key, len), before)| {
                match (before, self.cidr.get(&(key, len)).copied()) {
                    (b, a) if b == a => None,
                    (_, Some(identity)) => Some(Write::CidrUpsert(
                        key,
                        len,
                        IpInfo {
                            identity,
                            ..IpInfo::default()
                        },
                    )),
                    (_, None) => Some(Write::CidrDelete(key, len)),
                }
            })
            .collect();
        self.write_records(w, exact, &HashMap::new(), &mut stats)?;
        stats.write(w, &cidr_writes)?;
        self.bump(w, &mut stats)?;
        Ok(stats)
    }

    /// Replaces the set of this node's own addresses.
    pub fn set_hosts<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        ips: &[IpAddr],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        let new: BTreeSet<IpKey> = ips.iter().map(|ip| ip_key(*ip)).collect();
        let keys: Vec<IpKey> = self.hosts.union(&new).copied().collect();
        self.hosts = new;
        self.write_records(w, keys, &HashMap::new(), &mut stats)?;
        self.bump(w, &mut stats)?;
        Ok(stats)
    }

    /// Writes the clock parameters of `clock` (tick rate and connection-tracking lifetimes; its
    /// revision is ignored, the current one is kept). Used when adopting maps pinned by an
    /// earlier process, so that the configured lifetimes apply after a restart (and lifetimes
    /// an older program version did not know, zero in its pinned state, get their values).
    pub fn set_clock<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        clock: &State,
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        let state = State {
            revision: self.state.revision,
            ..*clock
        };
        if state != self.state {
            self.state = state;
            stats.write(w, &[Write::State(self.state)])?;
        }
        Ok(stats)
    }

    /// A number that changes whenever [`Control::identities`] may have: equal numbers (from
    /// any `Control` of the process) mean equal identities, so a copy of them is read again
    /// only when it changed (the agent keeps one for its debug API; rebuilding it after every
    /// change cost ~1.5 ms at 10,000 pods).
    pub fn identities_version(&self) -> u64 {
        self.identities_version
    }

    /// The number of [`Control::identities`], without listing them.
    pub fn identity_count(&self) -> usize {
        self.remote.len() + self.cidr.len()
    }

    /// The identities set with [`Control::set_identities`]: single addresses (as /32 or /128)
    /// and CIDRs, sorted.
    pub fn identities(&self) -> Vec<(IpNet, u32)> {
        let mut out: Vec<(IpNet, u32)> = self
            .remote
            .iter()
            .map(|(k, id)| (IpNet::from(key_ip(k)), *id))
            .chain(self.cidr.iter().filter_map(|((k, len), id)| {
                let len = u8::try_from(*len).ok()?;
                IpNet::new(key_ip(k), len).ok().map(|n| (n, *id))
            }))
            .collect();
        out.sort();
        out
    }

    /// This node's addresses.
    pub fn hosts(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.hosts.iter().map(key_ip)
    }

    /// Replaces the set of Service frontends. New ones are written before old ones go, and
    /// the frontend mark of the exact ipcache records of their addresses in between; no
    /// revision bump: a frontend only decides whether a *new* flow is judged at the XDP or at
    /// the TC hook, and the TC hook judges every translated flow whatever the XDP hook did.
    /// (For the same reason the order of the three writes is free: a packet that sees a
    /// Service and a record that disagree is decided as before or as after the change.)
    pub fn set_services<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        keys: &[SvcKey],
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        let new: BTreeSet<SvcKey> = keys.iter().copied().collect();
        let adds: Vec<Write> = new
            .difference(&self.services)
            .map(|k| Write::SvcUpsert(*k))
            .collect();
        let removes: Vec<Write> = self
            .services
            .difference(&new)
            .map(|k| Write::SvcDelete(*k))
            .collect();
        stats.write(w, &adds)?;
        // The marks of every address of the old and the new frontends (`write_records` writes
        // only records that differ from the tables, so a call after a failed one repairs what
        // that one left). The frontends are recorded only once written, so that a caller
        // comparing them with what it wants retries after a failure.
        let frontends = frontend_addresses(&new);
        let candidates: Vec<IpKey> = frontends.union(&self.frontends).copied().collect();
        let old = std::mem::replace(&mut self.frontends, frontends);
        let marked = self.write_records(w, candidates, &HashMap::new(), &mut stats);
        if marked.is_err() {
            self.frontends = old;
        }
        marked?;
        stats.write(w, &removes)?;
        self.services = new;
        Ok(stats)
    }

    /// The Service frontends.
    pub fn services(&self) -> &BTreeSet<SvcKey> {
        &self.services
    }

    /// Sets (`Some`) or removes (`None`) the local endpoint behind an interface.
    pub fn set_interface<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
        ifindex: u32,
        info: Option<IfaceInfo>,
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        match info {
            Some(i) if self.ifaces.get(&ifindex) != Some(&i) => {
                stats.write(w, &[Write::IfaceUpsert(ifindex, i)])?;
                self.ifaces.insert(ifindex, i);
            }
            None if self.ifaces.remove(&ifindex).is_some() => {
                stats.write(w, &[Write::IfaceDelete(ifindex)])?;
            }
            _ => {}
        }
        Ok(stats)
    }

    /// The interfaces of local endpoints.
    pub fn interfaces(&self) -> &BTreeMap<u32, IfaceInfo> {
        &self.ifaces
    }

    /// When [`Control::reclaim`] next has something to clear (a released rule set, or below
    /// the identity level a retired class, whose grace period is over): `None` when nothing
    /// waits. Every update reclaims what is due first; a caller with idle time between
    /// updates (the agent) reclaims then, so that the next update does not pay for it.
    pub fn reclaim_due(&self, w: &dyn TableWriter) -> Option<Instant> {
        self.store
            .reclaim_due()
            .into_iter()
            .chain(w.reclaim_due_below())
            .min()
    }

    /// Clears released rule sets whose grace period is over.
    pub fn reclaim<W: TableWriter + ?Sized>(
        &mut self,
        w: &mut W,
    ) -> Result<WriteStats, ControlError> {
        let mut stats = WriteStats::default();
        self.store.reclaim(w, &mut stats)?;
        w.reclaim_below()?;
        Ok(stats)
    }

    /// Rebuilds the control state from the tables (agent restart): endpoints, hosts and
    /// identities from the ipcache, rule sets from the policy keys. In the normal case nothing
    /// is written; see [`Store::adopt`] for the repairs after an interrupted operation.
    pub fn adopt<W: TableWriter + ?Sized>(
        w: &mut W,
        max_rulesets: u32,
        max_blocks: u32,
        grace: Duration,
    ) -> Result<(Control, WriteStats), ControlError> {
        let mut stats = WriteStats::default();
        let mut endpoints: BTreeMap<u32, EndpointState> = BTreeMap::new();
        let mut ip_owner = HashMap::new();
        let mut remote = HashMap::new();
        let mut hosts = BTreeSet::new();
        let mut inconsistent = BTreeSet::new();
        let mut records: Vec<(IpKey, IpInfo)> =
            w.tables().ipcache.iter().map(|(k, v)| (*k, *v)).collect();
        records.sort_by_key(|(k, _)| *k);
        for (key, info) in records {
            if info.is_endpoint() {
                let ep = endpoints
                    .entry(info.endpoint)
                    .or_insert_with(|| EndpointState {
                        ips: Vec::new(),
                        identities: Vec::new(),
                        ingress: info.ingress,
                        egress: info.egress,
                    });
                if (ep.ingress, ep.egress) != (info.ingress, info.egress) {
                    inconsistent.insert(info.endpoint);
                }
                ep.ips.push(key_ip(&key));
                ep.identities.push(info.identity);
                ip_owner.insert(key, info.endpoint);
            } else {
                if info.is_host() {
                    hosts.insert(key);
                }
                if !info.is_host() || info.identity != 0 {
                    remote.insert(key, info.identity);
                }
            }
        }
        let mut refs: BTreeMap<u32, u32> = BTreeMap::new();
        for ep in endpoints.values() {
            *refs.entry(ep.ingress.ruleset).or_default() += 1;
            *refs.entry(ep.egress.ruleset).or_default() += 1;
        }
        let store = Store::adopt(w, max_rulesets, max_blocks, grace, &refs, &mut stats)?;
        let cidr = w
            .tables()
            .cidr
            .iter()
            .map(|((k, len), v)| ((*k, *len), v.identity))
            .collect();
        let services = w.tables().services.clone();
        let frontends = frontend_addresses(&services);
        // Records whose frontend mark disagrees with the Service map (tables of a version
        // without the mark, an interrupted `set_services`) are rewritten below.
        let marks: Vec<IpKey> = w
            .tables()
            .ipcache
            .iter()
            .filter(|(k, v)| v.is_frontend() != frontends.contains(k))
            .map(|(k, _)| *k)
            .collect();
        let control = Control {
            store,
            endpoints,
            ip_owner,
            remote,
            hosts,
            cidr,
            identities_version: next_identities_version(),
            ip_capacity: (u32::MAX, u32::MAX),
            services,
            frontends,
            ifaces: w.tables().ifaces.clone(),
            state: w.tables().state,
            // The adopted keys name the previous process's counters: they are counted as
            // whatever those elements now stand for until the first programming rewrites them.
            counters: RuleCounters::default(),
        };
        if !inconsistent.is_empty() {
            // Records of one endpoint disagree (interrupted switch): make them all say what the
            // first address says.
            let keys: Vec<IpKey> = inconsistent
                .iter()
                .flat_map(|id| control.endpoints[id].ips.iter().map(|ip| ip_key(*ip)))
                .collect();
            control.write_records(w, keys, &HashMap::new(), &mut stats)?;
        }
        control.write_records(w, marks, &HashMap::new(), &mut stats)?;
        Ok((control, stats))
    }
}
