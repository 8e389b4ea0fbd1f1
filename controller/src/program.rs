//! Engine → datapath: the one code path that turns what the engine computed into datapath
//! maps. The agent (`--datapath bpf`), `ordnet lab` and the offline CLI (`matrix`, `trace`) all
//! program through it, onto the kernel datapath (`ordnet_datapath::Datapath`) or the in-memory
//! one (`ordnet_datapath::MemDatapath`); both implement
//! [`ControlPlane`], so this module is generic over them.
//!
//! ```no_run
//! use ordnet::program::NodeProgram;
//! use ordnet_datapath::{ControlPlane as _, MemDatapath};
//! # fn demo(objects: &ordnet_crds::ClusterObjects, change: ordnet_engine::ObjectChange) -> Result<(), ordnet::program::ProgramError> {
//! let mut engine = ordnet_engine::Engine::build(objects);
//! let mut dp = MemDatapath::default();
//! let mut program = NodeProgram::new();
//! program.set_host_addresses(&mut dp, &["10.0.0.254".parse().unwrap()])?; // the node's own
//! program.program_full(&engine, &mut dp)?;             // everything, from scratch
//! let delta = engine.apply(change);
//! program.apply(&engine, &[delta], &mut dp)?;           // incrementally
//! let id = program.endpoint_id("prod/api");             // the datapath's endpoint id of a pod
//! let frame: Vec<u8> = Vec::new();
//! let verdict = dp.decide(&frame).verdict;               // what the XDP program would do
//! # Ok(()) }
//! ```
//!
//! What is programmed, from an [`Engine`]:
//!
//! * **endpoints**: every `engine.endpoints()` entry (for a node-scoped engine, the pods of that
//!   node; for `Engine::build`, every pod with an address) becomes a local endpoint with a
//!   stable `u32` id per `ns/name` ([`NodeProgram::endpoint_id`]; ids are never reused by one
//!   `NodeProgram`), its addresses with the identity of each address (a dual-stack pod's two
//!   addresses may have different identities), both MapStates and their isolation defaults;
//! * **the ipcache**: `engine.ipcache()` (every pod address as a /32 or /128, every CIDR prefix
//!   in use), plus `0.0.0.0/0` and `::/0` with the `world` identity unless a policy uses those
//!   prefixes itself, so an address outside every prefix has the identity the engine gives it
//!   (not the datapath's "no identity");
//! * **host addresses**: given by the caller ([`NodeProgram::set_host_addresses`]; the engine
//!   does not know the node's addresses).
//!
//! [`NodeProgram::apply`] writes [`EngineDelta`]s incrementally, in an order that is safe for
//! packets in flight (`docs/datapath.md` §6):
//!
//! 1. removed endpoints go (so an address can move to a new endpoint in the same batch);
//! 2. new endpoints are created with empty, deny-by-default rule sets;
//! 3. the added and changed keys of every endpoint update (the engine's exact `ChangeSet`s),
//!    with a default that becomes deny written now;
//! 4. the ipcache changes, and the addresses and identities of endpoints whose ones changed
//!    (a pod that got a new identity, a re-addressed pod);
//! 5. the removed keys, with a default that becomes allow written now.
//!
//! Between steps 3 and 5 every rule set holds the union of its old and new keys; a packet's
//! longest match is then either its old or its new one, so no packet is allowed that neither
//! the old nor the new policy allows, also while an identity moves from one address to another
//! (the old and the new identity both have their keys during the switch).
//!
//! A change set that does not fit what the datapath holds (`ControlError::StaleChanges`: it was
//! computed against another state) is not written; that endpoint gets a full update from the
//! engine's current MapStates instead, at the end of the batch. This is logged on stderr and
//! counted ([`ProgramStats::fallbacks`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_datapath::common::layout::V_DENY;
use ordnet_datapath::{
    ControlError, ControlPlane, DatapathError, EndpointAddresses, EndpointSpec, WriteStats,
};
use ordnet_engine::{Endpoint, EndpointPolicy, Engine, EngineDelta};
use ordnet_mapstate::{ChangeSet, Changes, Direction, MapState, Protocol, Verdict};

/// Why programming failed. The datapath is left consistent (every datapath operation either
/// completes or writes nothing), but it may not reflect the engine yet: program it again with
/// [`NodeProgram::program_full`].
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    /// An operation on one endpoint (`ns/name`) failed.
    #[error("endpoint {endpoint}: {source}")]
    Endpoint {
        /// `ns/name` of the endpoint.
        endpoint: String,
        /// The datapath's error.
        #[source]
        source: Box<DatapathError>,
    },
    /// Another datapath operation failed (`what` names it).
    #[error("{what}: {source}")]
    Datapath {
        /// The operation, e.g. `ipcache` or `host addresses`.
        what: &'static str,
        /// The datapath's error.
        #[source]
        source: Box<DatapathError>,
    },
    /// Two endpoints have the same address (`first` and `second` are `ns/name`).
    #[error("endpoint {second}: address {ip} is also the address of endpoint {first}")]
    DuplicateAddress {
        /// The shared address.
        ip: IpAddr,
        /// The first endpoint with it, in `Engine::endpoints` order.
        first: String,
        /// The next endpoint with it.
        second: String,
    },
    /// 2^32 - 1 endpoint ids were handed out.
    #[error("no endpoint id left")]
    IdsExhausted,
}

/// What a [`NodeProgram`] has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgramStats {
    /// [`NodeProgram::program_full`] calls.
    pub full_programs: u64,
    /// Deltas applied by [`NodeProgram::apply`].
    pub deltas: u64,
    /// Change sets written (one endpoint and direction, steps 3 and 5 counted once).
    pub change_sets: u64,
    /// Endpoints created.
    pub endpoints_added: u64,
    /// Endpoints removed.
    pub endpoints_removed: u64,
    /// Endpoints re-addressed (addresses or identities changed).
    pub endpoints_readdressed: u64,
    /// Endpoints whose change set did not fit and that got a full update instead.
    pub fallbacks: u64,
    /// Times an endpoint got a deny-all policy because its own did not fit the tables.
    pub denied: u64,
    /// Every write to the datapath, summed.
    pub writes: WriteStats,
}

fn add_stats(total: &mut WriteStats, s: WriteStats) {
    total.rulesets_installed += s.rulesets_installed;
    total.rulesets_updated += s.rulesets_updated;
    total.rulesets_released += s.rulesets_released;
    total.policy_writes += s.policy_writes;
    total.cell_writes += s.cell_writes;
    total.block_writes += s.block_writes;
    total.ip_writes += s.ip_writes;
    total.batches += s.batches;
}

/// The verdict of an isolation flag.
fn default_of(isolated: bool) -> Verdict {
    if isolated {
        Verdict::Deny
    } else {
        Verdict::Allow
    }
}

/// The prefixes that stand for "everything": they get the `world` identity unless the engine
/// has its own identity for them.
fn default_routes() -> [IpNet; 2] {
    [
        "0.0.0.0/0".parse().expect("prefix"),
        "::/0".parse().expect("prefix"),
    ]
}

/// Splits `ns/name`.
fn split(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("", name))
}

/// An endpoint's `(address, identity)` pairs, sorted, as the datapath holds them.
fn addresses_of(ep: &Endpoint) -> Vec<(IpAddr, u32)> {
    let mut v: Vec<(IpAddr, u32)> = ep
        .ips
        .iter()
        .zip(&ep.identities)
        .map(|(ip, id)| (*ip, *id))
        .collect();
    v.sort_by_key(|(ip, _)| *ip);
    v.dedup_by_key(|(ip, _)| *ip);
    v
}

/// One endpoint's change: its upserts in step 3, its removals in step 5 (views of the engine's
/// ChangeSet, which every endpoint of one shared MapState is given: the datapath sees the same
/// views for each, and computes their steps once).
struct Split {
    id: u32,
    name: String,
    dir: Direction,
    changes: Arc<ChangeSet>,
    /// The default before, during step 3 and after step 5.
    current: Verdict,
    first: Verdict,
    last: Verdict,
}

/// The endpoint behind a host-side interface: its datapath id and addresses.
type InterfaceOwner = (u32, Vec<IpAddr>);

/// The engine → datapath mapping of one node (see the module documentation).
#[derive(Debug, Clone)]
pub struct NodeProgram {
    /// `ns/name` → endpoint id, for the endpoints programmed.
    ids: BTreeMap<String, u32>,
    names: BTreeMap<u32, String>,
    next_id: u32,
    /// Addresses of programmed endpoints → `ns/name`.
    addrs: HashMap<IpAddr, String>,
    hosts: Vec<IpAddr>,
    /// The identity programmed for the default routes the engine has no identity of.
    world: Option<u32>,
    /// The Service frontends of the engine last programmed (without the node ports on the
    /// node's addresses, which [`NodeProgram::frontends`] adds).
    service_frontends: BTreeSet<(IpAddr, Protocol, u16)>,
    node_ports: BTreeSet<(Protocol, u16)>,
    /// `ns/name` → the host-side interface index of the endpoint (for the TC hook's
    /// attribution of rewritten source addresses).
    interfaces: BTreeMap<String, u32>,
    /// Endpoints (`ns/name`) whose rule sets did not fit the datapath's tables: they hold a
    /// deny-all policy in both directions, with why.
    denied: BTreeMap<String, String>,
    stats: ProgramStats,
}

impl Default for NodeProgram {
    fn default() -> Self {
        NodeProgram::new()
    }
}

impl NodeProgram {
    /// Nothing programmed yet.
    pub fn new() -> NodeProgram {
        NodeProgram {
            ids: BTreeMap::new(),
            names: BTreeMap::new(),
            next_id: 1,
            addrs: HashMap::new(),
            hosts: Vec::new(),
            world: None,
            service_frontends: BTreeSet::new(),
            node_ports: BTreeSet::new(),
            interfaces: BTreeMap::new(),
            denied: BTreeMap::new(),
            stats: ProgramStats::default(),
        }
    }

    /// Endpoints (`ns/name`) whose rule sets do not fit the datapath's tables, with why: each
    /// holds a deny-all policy in both directions (its traffic fails closed) until
    /// [`NodeProgram::retry_denied`] (or any change of its policy) finds room.
    pub fn denied(&self) -> &BTreeMap<String, String> {
        &self.denied
    }

    /// Programs the denied endpoints ([`NodeProgram::denied`]) with their own policies again;
    /// those that still do not fit stay denied.
    pub fn retry_denied<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        if self.denied.is_empty() {
            return Ok(());
        }
        let names: BTreeSet<String> = self.denied.keys().cloned().collect();
        self.full_update(engine, &names, dp)
    }

    /// Records the outcome of an update of the endpoints `ids`: those in `denied` are denied,
    /// the others are not.
    fn note_denied(&mut self, ids: &[u32], denied: Vec<(u32, ControlError)>) {
        for id in ids {
            if let Some(name) = self.names.get(id) {
                self.denied.remove(name);
            }
        }
        for (id, why) in denied {
            if let Some(name) = self.names.get(&id) {
                self.stats.denied += 1;
                self.denied.insert(name.clone(), why.to_string());
            }
        }
    }

    /// The datapath endpoint id of `ns/name`, if it is programmed.
    pub fn endpoint_id(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The `ns/name` of a datapath endpoint id.
    pub fn endpoint_name(&self, id: u32) -> Option<&str> {
        self.names.get(&id).map(String::as_str)
    }

    /// Every programmed endpoint: `ns/name` → id.
    pub fn endpoint_ids(&self) -> &BTreeMap<String, u32> {
        &self.ids
    }

    /// What was done so far.
    pub fn stats(&self) -> &ProgramStats {
        &self.stats
    }

    /// Clears the rule sets released (and, with identity classes, the classes retired) at
    /// least the grace period ago ([`ControlPlane::reclaim`]; every update does it first too).
    pub fn reclaim<D: ControlPlane + ?Sized>(&mut self, dp: &mut D) -> Result<(), ProgramError> {
        let s = dp.reclaim().map_err(|e| ProgramError::Datapath {
            what: "clearing released rule sets",
            source: Box::new(e),
        })?;
        add_stats(&mut self.stats.writes, s);
        Ok(())
    }

    /// Sets this node's own addresses (traffic between them and local endpoints is never
    /// filtered) and writes them now; [`NodeProgram::program_full`] writes them again.
    pub fn set_host_addresses<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        ips: &[IpAddr],
    ) -> Result<(), ProgramError> {
        let mut ips = ips.to_vec();
        ips.sort();
        ips.dedup();
        self.hosts = ips;
        self.write_hosts(dp)?;
        // The node ports are frontends on every node address.
        self.write_frontends(dp)
    }

    /// Every Service frontend: the engine's ClusterIPs, external and load-balancer IPs with
    /// their ports, and every node address with every NodePort.
    fn frontends(&self) -> Vec<(IpAddr, u8, u16)> {
        let mut out: Vec<(IpAddr, u8, u16)> = self
            .service_frontends
            .iter()
            .map(|(ip, p, port)| (*ip, p.number(), *port))
            .collect();
        for host in &self.hosts {
            for (p, port) in &self.node_ports {
                out.push((*host, p.number(), *port));
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Writes the frontends if the datapath holds others.
    fn write_frontends<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        let want = self.frontends();
        if dp.service_frontends() != want {
            let s = dp
                .set_service_frontends(&want)
                .map_err(datapath_error("service frontends"))?;
            add_stats(&mut self.stats.writes, s);
        }
        Ok(())
    }

    /// Takes the engine's Service frontends and NodePorts and writes them.
    fn program_services<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        self.service_frontends = engine.service_frontends();
        self.node_ports = engine.node_ports();
        self.write_frontends(dp)
    }

    /// The endpoints whose host-side interface is recorded ([`NodeProgram::set_interface`]).
    pub fn interface_names(&self) -> impl Iterator<Item = &str> {
        self.interfaces.keys().map(String::as_str)
    }

    /// Records (`Some`) or forgets (`None`) the host-side interface of endpoint `ns/name`: the
    /// TC hook then attributes a packet that came in on it to the endpoint even when its
    /// source address was rewritten (kube-proxy's masquerade: hairpin). Kept across
    /// programming: written again when the endpoint's id or addresses change, removed with it.
    pub fn set_interface<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        name: &str,
        ifindex: Option<u32>,
    ) -> Result<(), ProgramError> {
        if let Some(old) = self.interfaces.get(name).copied()
            && Some(old) != ifindex
        {
            self.interfaces.remove(name);
            self.write_interface(dp, old, None)?;
        }
        if let Some(ifindex) = ifindex {
            self.interfaces.insert(name.to_string(), ifindex);
            let ep = self.ids.get(name).copied().map(|id| {
                let ips: Vec<IpAddr> = dp
                    .endpoints()
                    .get(&id)
                    .map(|st| st.ips.clone())
                    .unwrap_or_default();
                (id, ips)
            });
            self.write_interface(dp, ifindex, ep)?;
        }
        Ok(())
    }

    fn write_interface<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        ifindex: u32,
        endpoint: Option<InterfaceOwner>,
    ) -> Result<(), ProgramError> {
        let s = match &endpoint {
            Some((id, ips)) if !ips.is_empty() => dp.set_interface(ifindex, *id, Some(ips)),
            _ => dp.set_interface(ifindex, 0, None),
        }
        .map_err(datapath_error("interfaces"))?;
        add_stats(&mut self.stats.writes, s);
        Ok(())
    }

    /// Writes the interface entries again from the current endpoints (ids and addresses).
    fn refresh_interfaces<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        let entries: Vec<(u32, Option<InterfaceOwner>)> = self
            .interfaces
            .iter()
            .map(|(name, ifindex)| {
                let ep = self
                    .ids
                    .get(name)
                    .and_then(|id| dp.endpoints().get(id).map(|st| (*id, st.ips.clone())));
                (*ifindex, ep)
            })
            .collect();
        // The datapath writes an entry only when it changes.
        for (ifindex, ep) in entries {
            self.write_interface(dp, ifindex, ep)?;
        }
        Ok(())
    }

    fn write_hosts<D: ControlPlane + ?Sized>(&mut self, dp: &mut D) -> Result<(), ProgramError> {
        let mut have = dp.host_addresses();
        have.sort();
        if have != self.hosts {
            let s = dp
                .set_host_addresses(&self.hosts)
                .map_err(datapath_error("host addresses"))?;
            add_stats(&mut self.stats.writes, s);
        }
        Ok(())
    }

    fn fresh_id<D: ControlPlane + ?Sized>(&mut self, dp: &D) -> Result<u32, ProgramError> {
        // Skip ids the datapath holds that this program does not know (adopted state).
        while self.next_id != 0
            && (self.names.contains_key(&self.next_id)
                || dp.endpoints().contains_key(&self.next_id))
        {
            self.next_id = self.next_id.wrapping_add(1);
        }
        if self.next_id == 0 {
            return Err(ProgramError::IdsExhausted);
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        Ok(id)
    }

    fn remember(&mut self, name: &str, id: u32, ep: &Endpoint) {
        self.ids.insert(name.to_string(), id);
        self.names.insert(id, name.to_string());
        for ip in &ep.ips {
            self.addrs.insert(*ip, name.to_string());
        }
    }

    fn forget(&mut self, name: &str) -> Option<u32> {
        self.denied.remove(name);
        let id = self.ids.remove(name)?;
        self.names.remove(&id);
        self.addrs.retain(|_, n| n != name);
        Some(id)
    }

    /// Removes endpoints from the datapath (their names are forgotten already) and counts them.
    fn remove_ids<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        gone: &[u32],
    ) -> Result<(), ProgramError> {
        if gone.is_empty() {
            return Ok(());
        }
        let s = dp
            .remove_endpoints(gone)
            .map_err(datapath_error("removing endpoints"))?;
        self.stats.endpoints_removed += gone.len() as u64;
        add_stats(&mut self.stats.writes, s);
        Ok(())
    }

    /// The ipcache the engine wants: its prefixes plus the default routes with `world`.
    fn wanted_identities(engine: &Engine) -> BTreeMap<IpNet, u32> {
        let mut want: BTreeMap<IpNet, u32> = engine.ipcache().into_iter().collect();
        for net in default_routes() {
            want.entry(net).or_insert(engine.world_identity());
        }
        want
    }

    /// Programs everything from scratch: host addresses, the ipcache, and every endpoint with
    /// its full MapStates; endpoints and identities the datapath holds that the engine does not
    /// have are removed. Works on an empty datapath and on one that holds state (e.g. adopted
    /// after a restart: an endpoint there that owns the first address of an engine endpoint
    /// keeps its id, so its traffic never sees a gap).
    pub fn program_full<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        self.stats.full_programs += 1;
        check_unique_addresses(engine)?;
        self.write_hosts(dp)?;
        // 1. Identities that are new or change.
        let want = Self::wanted_identities(engine);
        let have: BTreeMap<IpNet, u32> = dp.control().identities().into_iter().collect();
        let upserts: Vec<(IpNet, Option<u32>)> = want
            .iter()
            .filter(|(n, id)| have.get(n) != Some(id))
            .map(|(n, id)| (*n, Some(*id)))
            .collect();
        self.set_identities(dp, &upserts)?;
        self.world = Some(engine.world_identity());

        // 2. Endpoints: ids (kept, adopted by address, or new), then one batch.
        let (batch_ids, claimed) = self.assign_ids(engine, dp)?;
        // Endpoints the datapath holds that are not the engine's go first (their addresses
        // may belong to another endpoint now).
        let gone: Vec<u32> = dp
            .endpoints()
            .keys()
            .copied()
            .filter(|id| !claimed.contains(id))
            .collect();
        self.remove_ids(dp, &gone)?;
        let eps = engine.endpoints();
        let addrs: Vec<(Vec<IpAddr>, Vec<u32>)> = eps
            .iter()
            .map(|ep| addresses_of(ep).into_iter().unzip())
            .collect();
        let policies: Vec<[&EndpointPolicy; 2]> = eps
            .iter()
            .map(|ep| Direction::ALL.map(|d| engine.policy(ep, d)))
            .collect();
        let batch: Vec<(u32, EndpointSpec<'_>)> = batch_ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                (
                    *id,
                    EndpointSpec {
                        ips: &addrs[i].0,
                        identity: 0,
                        identities: &addrs[i].1,
                        ingress: &policies[i][0].mapstate,
                        egress: &policies[i][1].mapstate,
                    },
                )
            })
            .collect();
        let (s, denied) = dp
            .update_endpoints_or_deny(&batch)
            .map_err(|source| self.endpoint_error(source))?;
        add_stats(&mut self.stats.writes, s);
        self.stats.endpoints_added += batch_ids.len() as u64;
        self.denied.clear();
        self.note_denied(&batch_ids, denied);

        // 3. Identities the engine no longer has.
        let removals: Vec<(IpNet, Option<u32>)> = have
            .keys()
            .filter(|n| !want.contains_key(*n))
            .map(|n| (*n, None))
            .collect();
        self.set_identities(dp, &removals)?;
        // 4. Service frontends and the interfaces of endpoints (their ids may be new).
        self.program_services(engine, dp)?;
        self.refresh_interfaces(dp)
    }

    /// Step 2 of [`NodeProgram::program_full`]: the id of every engine endpoint (kept, adopted
    /// from the datapath endpoint that owns its first address, or new), in the engine's order,
    /// and the set of ids in use.
    fn assign_ids<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(Vec<u32>, BTreeSet<u32>), ProgramError> {
        let known: BTreeSet<String> = engine.endpoints().iter().map(Endpoint::id).collect();
        let stale: Vec<String> = self
            .ids
            .keys()
            .filter(|n| !known.contains(*n))
            .cloned()
            .collect();
        for n in &stale {
            self.forget(n);
        }
        let mut owner: HashMap<IpAddr, u32> = HashMap::new();
        for (id, st) in dp.endpoints() {
            for ip in &st.ips {
                owner.insert(*ip, *id);
            }
        }
        let mut claimed: BTreeSet<u32> = self.names.keys().copied().collect();
        let mut batch_ids = Vec::new();
        for ep in engine.endpoints() {
            let name = ep.id();
            let id = match self.ids.get(&name) {
                Some(id) => *id,
                None => {
                    let adopted = ep
                        .ips
                        .first()
                        .and_then(|ip| owner.get(ip))
                        .copied()
                        .filter(|id| !claimed.contains(id));
                    match adopted {
                        Some(id) => id,
                        None => self.fresh_id(dp)?,
                    }
                }
            };
            claimed.insert(id);
            self.remember(&name, id, ep);
            batch_ids.push(id);
        }
        Ok((batch_ids, claimed))
    }

    /// Attributes a datapath error to the endpoint it names, if any.
    fn endpoint_error(&self, source: DatapathError) -> ProgramError {
        let id = match &source {
            DatapathError::Control(
                ControlError::Flatten { endpoint, .. }
                | ControlError::StaleChanges { endpoint, .. }
                | ControlError::IdentityCount { endpoint, .. }
                | ControlError::UnknownEndpoint(endpoint),
            ) => Some(*endpoint),
            DatapathError::Control(ControlError::AddressInUse { owner, .. }) => Some(*owner),
            _ => None,
        };
        match id.and_then(|id| self.names.get(&id)) {
            Some(name) => ProgramError::Endpoint {
                endpoint: name.clone(),
                source: Box::new(source),
            },
            None => ProgramError::Datapath {
                what: "endpoints",
                source: Box::new(source),
            },
        }
    }

    fn set_identities<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        entries: &[(IpNet, Option<u32>)],
    ) -> Result<(), ProgramError> {
        if entries.is_empty() {
            return Ok(());
        }
        let s = dp
            .set_identities(entries)
            .map_err(datapath_error("ipcache"))?;
        add_stats(&mut self.stats.writes, s);
        Ok(())
    }

    /// Applies the deltas of a batch of engine changes, in order (see the module documentation
    /// for the order of the writes). `engine` is the engine after all of them: endpoints are
    /// created with, and re-addressed to, its current addresses; an endpoint that a later delta
    /// of the batch removes again is never created.
    pub fn apply<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        deltas: &[EngineDelta],
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        // Endpoints that get a full update at the end (their change sets did not fit).
        let mut full: BTreeSet<String> = BTreeSet::new();
        for delta in deltas {
            self.apply_one(engine, delta, dp, &mut full)?;
            self.stats.deltas += 1;
        }
        // The world identity (fixed in practice; checked rather than assumed).
        if self.world != Some(engine.world_identity()) {
            let mine: BTreeMap<IpNet, u32> = engine.ipcache().into_iter().collect();
            let entries: Vec<(IpNet, Option<u32>)> = default_routes()
                .into_iter()
                .filter(|n| !mine.contains_key(n))
                .map(|n| (n, Some(engine.world_identity())))
                .collect();
            self.set_identities(dp, &entries)?;
            self.world = Some(engine.world_identity());
        }
        if !full.is_empty() {
            self.full_update(engine, &full, dp)?;
        }
        if deltas.iter().any(|d| d.services_changed) {
            self.program_services(engine, dp)?;
        }
        if deltas.iter().any(|d| {
            !d.endpoints_added.is_empty()
                || !d.endpoints_removed.is_empty()
                || !d.ipcache.is_empty()
        }) {
            self.refresh_interfaces(dp)?;
        }
        Ok(())
    }

    /// Full update of endpoints from the engine's current state (the change-set fallback).
    fn full_update<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        names: &BTreeSet<String>,
        dp: &mut D,
    ) -> Result<(), ProgramError> {
        let mut eps: Vec<(u32, &Endpoint)> = Vec::new();
        let mut gone = Vec::new();
        for name in names {
            let (ns, n) = split(name);
            match engine.endpoint(ns, n) {
                Some(ep) => {
                    let id = match self.ids.get(name) {
                        Some(id) => *id,
                        None => {
                            let id = self.fresh_id(dp)?;
                            self.remember(name, id, ep);
                            id
                        }
                    };
                    eps.push((id, ep));
                }
                None => {
                    if let Some(id) = self.forget(name)
                        && dp.endpoints().contains_key(&id)
                    {
                        gone.push(id);
                    }
                }
            }
        }
        self.remove_ids(dp, &gone)?;
        let addrs: Vec<(Vec<IpAddr>, Vec<u32>)> = eps
            .iter()
            .map(|(_, ep)| addresses_of(ep).into_iter().unzip())
            .collect();
        let policies: Vec<[&EndpointPolicy; 2]> = eps
            .iter()
            .map(|(_, ep)| Direction::ALL.map(|d| engine.policy(ep, d)))
            .collect();
        let batch: Vec<(u32, EndpointSpec<'_>)> = eps
            .iter()
            .enumerate()
            .map(|(i, (id, _))| {
                (
                    *id,
                    EndpointSpec {
                        ips: &addrs[i].0,
                        identity: 0,
                        identities: &addrs[i].1,
                        ingress: &policies[i][0].mapstate,
                        egress: &policies[i][1].mapstate,
                    },
                )
            })
            .collect();
        for (_, ep) in &eps {
            let name = ep.id();
            self.addrs.retain(|_, n| *n != name);
            for ip in &ep.ips {
                self.addrs.insert(*ip, name.clone());
            }
        }
        let (s, denied) = dp
            .update_endpoints_or_deny(&batch)
            .map_err(|source| self.endpoint_error(source))?;
        add_stats(&mut self.stats.writes, s);
        let ids: Vec<u32> = eps.iter().map(|(id, _)| *id).collect();
        self.note_denied(&ids, denied);
        Ok(())
    }

    fn note_fallback(&mut self, name: &str, why: &DatapathError, full: &mut BTreeSet<String>) {
        eprintln!("ordnet: programming {name}: {why}; it gets a full update");
        self.stats.fallbacks += 1;
        full.insert(name.to_string());
    }

    /// `apply_changes` of a batch; an item whose change set does not fit is taken out (its
    /// endpoint gets a full update) and the rest is retried.
    fn apply_changes<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        mut items: Vec<(u32, String, Direction, Changes<'_>, Verdict)>,
        full: &mut BTreeSet<String>,
    ) -> Result<(), ProgramError> {
        items.retain(|it| !full.contains(&it.1));
        loop {
            if items.is_empty() {
                return Ok(());
            }
            let batch: Vec<(u32, Direction, Changes<'_>, Verdict)> =
                items.iter().map(|it| (it.0, it.2, it.3, it.4)).collect();
            match dp.apply_changes(&batch) {
                Ok(s) => {
                    add_stats(&mut self.stats.writes, s);
                    return Ok(());
                }
                // The changes do not fit the tables (nothing was written): these endpoints get
                // their whole policies, or a deny-all one where those do not fit either.
                Err(DatapathError::Control(e)) if e.is_capacity() => {
                    let e = DatapathError::Control(e);
                    for it in &items {
                        self.note_fallback(&it.1, &e, full);
                    }
                    return Ok(());
                }
                Err(e) => {
                    let stale = match &e {
                        DatapathError::Control(ControlError::StaleChanges { endpoint, .. }) => {
                            self.names.get(endpoint).cloned().map(|n| (*endpoint, n))
                        }
                        _ => None,
                    };
                    let Some((id, name)) = stale else {
                        return Err(self.endpoint_error(e));
                    };
                    self.note_fallback(&name, &e, full);
                    items.retain(|it| it.0 != id);
                }
            }
        }
    }

    fn apply_one<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        delta: &EngineDelta,
        dp: &mut D,
        full: &mut BTreeSet<String>,
    ) -> Result<(), ProgramError> {
        self.remove_endpoints(delta, dp, full)?;
        self.create_endpoints(engine, delta, dp, full)?;
        let splits = self.split_updates(delta, dp, full);
        // 3. Added and changed keys, tightening defaults.
        let step3 = splits
            .iter()
            .filter(|s| !s.changes.upserts().is_empty() || s.first != s.current)
            .map(|s| (s.id, s.name.clone(), s.dir, s.changes.upserts(), s.first))
            .collect();
        self.apply_changes(dp, step3, full)?;
        // 4. The ipcache, and endpoints whose addresses or identities changed.
        let touched = self.write_ipcache_changes(engine, delta, dp)?;
        self.readdress(engine, &touched, dp, full)?;
        // 5. Removed keys, loosening defaults.
        let step5 = splits
            .iter()
            .filter(|s| !s.changes.removed.is_empty() || s.first != s.last)
            .map(|s| (s.id, s.name.clone(), s.dir, s.changes.removals(), s.last))
            .collect();
        self.apply_changes(dp, step5, full)
    }

    /// Step 1: endpoints the delta removes.
    fn remove_endpoints<D: ControlPlane + ?Sized>(
        &mut self,
        delta: &EngineDelta,
        dp: &mut D,
        full: &mut BTreeSet<String>,
    ) -> Result<(), ProgramError> {
        let mut gone = Vec::new();
        for name in &delta.endpoints_removed {
            full.remove(name);
            if let Some(id) = self.forget(name)
                && dp.endpoints().contains_key(&id)
            {
                gone.push(id);
            }
        }
        self.remove_ids(dp, &gone)?;
        Ok(())
    }

    /// Step 2: new endpoints, with their current addresses and empty deny-all rule sets (their
    /// keys come as change sets in step 3). One the engine no longer has is skipped: a later
    /// delta of the batch removes it.
    fn create_endpoints<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        delta: &EngineDelta,
        dp: &mut D,
        full: &mut BTreeSet<String>,
    ) -> Result<(), ProgramError> {
        let empty = Direction::ALL.map(|d| MapState::new(d, Verdict::Deny));
        let mut created: Vec<(u32, String, Vec<IpAddr>, Vec<u32>)> = Vec::new();
        for name in &delta.endpoints_added {
            let (ns, n) = split(name);
            let Some(ep) = engine.endpoint(ns, n) else {
                continue;
            };
            if self.ids.contains_key(name) {
                // Programmed already (re-added in one batch): start over from the engine.
                full.insert(name.clone());
                continue;
            }
            let id = self.fresh_id(dp)?;
            self.remember(name, id, ep);
            let (ips, ids) = addresses_of(ep).into_iter().unzip();
            created.push((id, name.clone(), ips, ids));
        }
        if !created.is_empty() {
            let batch: Vec<(u32, EndpointSpec<'_>)> = created
                .iter()
                .map(|(id, _, ips, ids)| {
                    (
                        *id,
                        EndpointSpec {
                            ips,
                            identity: 0,
                            identities: ids,
                            ingress: &empty[0],
                            egress: &empty[1],
                        },
                    )
                })
                .collect();
            match dp.update_endpoints(&batch) {
                Ok(s) => {
                    add_stats(&mut self.stats.writes, s);
                    self.stats.endpoints_added += created.len() as u64;
                }
                // An address still held by an endpoint a later delta removes, ...: create
                // them from the engine's final state at the end.
                Err(e @ DatapathError::Control(ControlError::AddressInUse { .. })) => {
                    for (id, name, _, _) in &created {
                        self.names.remove(id);
                        self.ids.remove(name);
                        self.addrs.retain(|_, n| n != name);
                        self.note_fallback(name, &e, full);
                    }
                }
                Err(e) => return Err(self.endpoint_error(e)),
            }
        }
        Ok(())
    }

    /// Each update of the delta split into its upserts (step 3) and removals (step 5), with the
    /// defaults before, between and after.
    fn split_updates<D: ControlPlane + ?Sized>(
        &mut self,
        delta: &EngineDelta,
        dp: &D,
        full: &mut BTreeSet<String>,
    ) -> Vec<Split> {
        let mut splits: Vec<Split> = Vec::new();
        for u in &delta.updates {
            let Some(&id) = self.ids.get(&u.endpoint) else {
                continue;
            };
            if full.contains(&u.endpoint) {
                continue;
            }
            if self.denied.contains_key(&u.endpoint) {
                // It holds a deny-all policy, not the one this change is relative to.
                full.insert(u.endpoint.clone());
                continue;
            }
            let Some(state) = dp.endpoints().get(&id) else {
                continue;
            };
            let current = if state.policy(u.direction).default == V_DENY {
                Verdict::Deny
            } else {
                Verdict::Allow
            };
            let last = u.isolated.map_or(current, default_of);
            let first = if last == Verdict::Deny {
                Verdict::Deny
            } else {
                current
            };
            splits.push(Split {
                id,
                name: u.endpoint.clone(),
                dir: u.direction,
                changes: Arc::clone(&u.changes),
                current,
                first,
                last,
            });
            self.stats.change_sets += 1;
        }
        splits
    }

    /// Step 4a: the ipcache changes. Returns the endpoints whose addresses or identities may
    /// have changed with them (and every endpoint with an update).
    fn write_ipcache_changes<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        delta: &EngineDelta,
        dp: &mut D,
    ) -> Result<BTreeSet<String>, ProgramError> {
        let mut entries: Vec<(IpNet, Option<u32>)> = Vec::new();
        let mut touched: BTreeSet<String> =
            delta.updates.iter().map(|u| u.endpoint.clone()).collect();
        let routes = default_routes();
        for c in &delta.ipcache {
            let new = match c.new {
                None if routes.contains(&c.prefix) => Some(engine.world_identity()),
                other => other,
            };
            entries.push((c.prefix, new));
            if c.prefix.prefix_len() == c.prefix.max_prefix_len() {
                if let Some(name) = self.addrs.get(&c.prefix.addr()) {
                    touched.insert(name.clone());
                }
                if let Some(info) = c.new.and_then(|id| engine.identity_info(id)) {
                    touched.extend(
                        info.members
                            .iter()
                            .filter(|m| self.ids.contains_key(*m))
                            .cloned(),
                    );
                }
            }
        }
        self.set_identities(dp, &entries)?;
        Ok(touched)
    }

    /// Step 4b: endpoints whose addresses or identities differ from the engine's get them.
    fn readdress<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        touched: &BTreeSet<String>,
        dp: &mut D,
        full: &mut BTreeSet<String>,
    ) -> Result<(), ProgramError> {
        let mut moved: Vec<(u32, String, Vec<IpAddr>, Vec<u32>)> = Vec::new();
        for name in touched {
            let (Some(&id), (ns, n)) = (self.ids.get(name), split(name)) else {
                continue;
            };
            let (Some(ep), Some(state)) = (engine.endpoint(ns, n), dp.endpoints().get(&id)) else {
                continue;
            };
            if full.contains(name) {
                continue;
            }
            let want = addresses_of(ep);
            let have: Vec<(IpAddr, u32)> = state.addresses().collect();
            if want != have {
                let (ips, ids) = want.into_iter().unzip();
                moved.push((id, name.clone(), ips, ids));
            }
        }
        if !moved.is_empty() {
            let batch: Vec<(u32, EndpointAddresses<'_>)> = moved
                .iter()
                .map(|(id, _, ips, ids)| {
                    (
                        *id,
                        EndpointAddresses {
                            ips,
                            identity: 0,
                            identities: ids,
                        },
                    )
                })
                .collect();
            match dp.set_endpoint_addresses(&batch) {
                Ok(s) => {
                    add_stats(&mut self.stats.writes, s);
                    self.stats.endpoints_readdressed += moved.len() as u64;
                    for (_, name, ips, _) in &moved {
                        self.addrs.retain(|_, n| n != name);
                        for ip in ips {
                            self.addrs.insert(*ip, name.clone());
                        }
                    }
                }
                Err(e @ DatapathError::Control(ControlError::AddressInUse { .. })) => {
                    for (_, name, _, _) in &moved {
                        self.note_fallback(name, &e, full);
                    }
                }
                Err(e) => return Err(self.endpoint_error(e)),
            }
        }
        Ok(())
    }
}

/// Maps a datapath error of operation `what` to a [`ProgramError`].
fn datapath_error(what: &'static str) -> impl FnOnce(DatapathError) -> ProgramError {
    move |source| ProgramError::Datapath {
        what,
        source: Box::new(source),
    }
}

/// Two endpoints of the engine must not share an address.
fn check_unique_addresses(engine: &Engine) -> Result<(), ProgramError> {
    let mut seen: HashMap<IpAddr, String> = HashMap::new();
    for ep in engine.endpoints() {
        for ip in &ep.ips {
            if let Some(first) = seen.insert(*ip, ep.id())
                && first != ep.id()
            {
                return Err(ProgramError::DuplicateAddress {
                    ip: *ip,
                    first,
                    second: ep.id(),
                });
            }
        }
    }
    Ok(())
}
