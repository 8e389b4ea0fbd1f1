//! `--datapath bpf`: the eBPF datapath (`ordnet_datapath::Datapath`), programmed from the engine
//! through [`NodeProgram`] and attached to every local pod's host-side interface and to the
//! uplink (`docs/agent.md`, "The bpf datapath").
//!
//! * **Pins**: maps, program and links are pinned in [`DEFAULT_PIN_DIR`] (or `$ORDNET_PIN_DIR`).
//!   [`BpfDatapath::open`] adopts pins that exist (the running program keeps enforcing the last
//!   state) and writes nothing until the agent's initial sync is done; the first
//!   [`program_full`](Enforcer::program_full) then converges the adopted state to the engine
//!   (endpoints keep their ids by address, only differences are written). Dropping a
//!   `BpfDatapath` (SIGTERM, SIGINT) leaves the pins and the attachments in place.
//! * **Host addresses**: every address of every interface of the agent's network namespace
//!   (the node's, since the agent runs with host networking), re-read at every maintenance.
//! * **Interfaces**: each local endpoint's interface is found in the node's network
//!   ([`super::netview`]: the main table's route to its address, else a route of a table an
//!   `ip rule` looks up; behind a bridge, the bridge port its MAC address is on), never the
//!   uplink, `lo`, a default route or a bridge device. An endpoint without one is reported
//!   (log, `/readyz`, `ordnet_datapath_unattached_endpoints`) and retried at every batch and
//!   upkeep (which runs on every netlink route, link and address event and on neighbour and
//!   bridge forwarding events: `super::follow_netlink`).
//!   Attachments of interfaces no local endpoint (or the uplink) uses are removed; an
//!   attachment whose interface was re-created (a new index under the same name) is renewed.
//! * **Both hooks** on each of those interfaces: XDP and TC (tcx egress, after kube-proxy's
//!   translation: `docs/datapath.md` §14); the datapath learns each endpoint's interface index
//!   ([`NodeProgram::set_interface`]) and the Service frontends from the engine (NodePorts on
//!   every host address).
//! * **What the debug API sees**: `programmed()` is what was written (the engine's MapStates of
//!   every endpoint written successfully, updated only after the kernel write succeeded);
//!   `ipcache()` is read back from the datapath's control state, i.e. what the maps hold
//!   (including `0.0.0.0/0` and `::/0` with the world identity); `plane()` is the kernel
//!   datapath, whose decisions run over its userspace mirror of the maps (exactly what was
//!   written to the kernel; `Datapath::verify` compares the two).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use ordnet_datapath::{
    ControlPlane, CtSweep, Datapath as Kernel, DatapathConfig, DatapathCounters, RuleTotals,
    XdpAttached,
};
use ordnet_engine::{Engine, EngineDelta};
use ordnet_mapstate::Identity;

use super::AgentError;
use super::datapath::{Enforcer, MAP_PRESSURE_PERCENT, ProgrammedEndpoint, Programmer};
use super::netview::{self, NetView, Unfound};
use crate::program::NodeProgram;

/// Where the pins live unless `$ORDNET_PIN_DIR` says otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/ordnet";
/// The environment variable that overrides [`DEFAULT_PIN_DIR`].
pub const PIN_DIR_ENV: &str = "ORDNET_PIN_DIR";

/// The pin directory: `$ORDNET_PIN_DIR` if set and not empty, else [`DEFAULT_PIN_DIR`].
pub fn pin_dir_from_env() -> PathBuf {
    match std::env::var_os(PIN_DIR_ENV) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_PIN_DIR),
    }
}

/// What the agent's bpf datapath did at start.
#[derive(Debug, Clone)]
pub enum Opened {
    /// No pins: fresh maps, nothing attached yet.
    Created,
    /// Pins adopted: the earlier state keeps being enforced until the initial sync.
    Adopted {
        /// Number of endpoints found in the pinned maps.
        endpoints: usize,
        /// Number of rule set slots in use.
        rulesets: usize,
        /// Interfaces with an adopted pinned link (`tc:IFACE` for the TC program).
        links: Vec<String>,
    },
}

/// The XDP datapath as the agent drives it.
pub struct BpfDatapath {
    dp: Kernel,
    /// The engine → datapath mapping, and what was written as MapStates (answers
    /// `programmed()`).
    programmer: Programmer,
    /// The identities the datapath holds (answers `ipcache()`), read from the control plane
    /// when first asked for after they changed: only the tests read them whole (the metrics
    /// count them, `ipcache_len`), and reading them again after every change of identities
    /// cost ~1.6 ms at 10,000 pods.
    ipcache: OnceLock<BTreeMap<IpNet, Identity>>,
    /// The control plane's version of the identities (`Control::identities_version`) when
    /// `ipcache` was last emptied.
    ipcache_version: u64,
    /// `--uplink` names and patterns (the interfaces are found at every upkeep:
    /// [`NetView::uplinks`]).
    uplinks: Vec<String>,
    /// Interface index of every attachment, as last verified.
    ifindex: BTreeMap<String, u32>,
    /// Endpoints (`ns/name`, or `uplink IFACE`) that are not attached, and why.
    unattached: BTreeMap<String, String>,
    /// The host-side interfaces the chained CNI plugin named, per endpoint (`ns/name`), and
    /// whether the engine has had the endpoint since.
    cni_hints: BTreeMap<String, (Vec<String>, bool)>,
    /// A CNI hint changed since the interfaces were last looked for: the next batch looks.
    hints_changed: bool,
    /// The bridge port each bridged pod address was last found on.
    bridge_ports: BTreeMap<IpAddr, String>,
    /// Bridged addresses (bridge ifindex, address) with a managed neighbour entry of ours.
    resolving: BTreeSet<(u32, IpAddr)>,
    /// Ports of bridges with a pod still being looked for: their attachments are kept.
    held: BTreeSet<String>,
    /// The uplinks of the last look at the node's network.
    uplinks_found: BTreeSet<String>,
    /// Tunnel devices among them: the TC hook only ([`BpfDatapath::attach_tc_only`]), and
    /// whether each is a layer-3 device (no Ethernet header: the layer-3 TC program).
    tc_only: BTreeMap<String, bool>,
    /// Interfaces whose driver refused native XDP, so the program runs in generic mode there
    /// (enforced, at a higher cost per packet), with the refusal.
    generic: BTreeMap<String, String>,
    /// A full programming is owed (an earlier one failed).
    needs_full: bool,
    /// The first full programming succeeded: interfaces are managed from then on.
    synced: bool,
    /// Pin directories of older map layouts whose attachments the first full programming
    /// takes over.
    migrate_from: Vec<PathBuf>,
    hosts: Vec<IpAddr>,
    attach_errors: u64,
    attaches: u64,
    detaches: u64,
    opened: Opened,
    options: ProgramOptions,
    /// The pin root (the layouts' directories are in it).
    root: PathBuf,
    /// The maps' sizes now (the policy map's grows up to `sizes.policy_entries_max`).
    sizes: MapSizes,
    /// Times the policy map grew.
    grown: u64,
    /// When a growth of the policy map last failed (tried again after [`GROW_RETRY_AFTER`]).
    grow_failed: Option<Instant>,
    /// The last look at the policy map's fill: (full, endpoints denied) then (a growth is
    /// tried once per change of it: a growth that ends the denials but leaves the map full is
    /// followed by another).
    pressure: (bool, bool),
    /// The last connection-tracking sweep: when, and what it found.
    last_sweep: Option<(Instant, CtSweep)>,
    /// Expired entries removed by sweeps, per family.
    ct_removed: [u64; 2],
    ct_sweep_errors: u64,
    /// The programs' event counters as of the last sweep.
    counters: DatapathCounters,
    /// The per-rule counters' totals since the agent started (read at every upkeep, and from
    /// the old programs before grown maps replace them).
    rule_totals: RuleTotals,
}

/// Capacities of the maps that grow with the cluster (`ordnet agent --policy-map-entries`,
/// `--ipcache-entries`, `--max-rulesets`). Maps pinned with other sizes are replaced at start
/// by new ones of these sizes, without a moment unenforced: the old pins keep enforcing until
/// the new maps hold the whole state, then each attachment moves to the new programs in place
/// (the layout migration, [`Kernel::take_over_links`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// Policy keys (all rule sets of the node).
    pub policy_entries: u32,
    /// What the policy map may grow to (doubling) while endpoints are denied for lack of room
    /// or it is [`MAP_PRESSURE_PERCENT`] full; `policy_entries` or less: it does not grow.
    pub policy_entries_max: u32,
    /// Addresses per family (endpoints, pods of the cluster, nodes).
    pub ipcache_entries: u32,
    /// Rule set slots (distinct policies of the node's endpoints, and replacements).
    pub max_rulesets: u32,
    /// Connection-tracking flows, IPv4 and IPv6. Pinned tables smaller than this are replaced
    /// at start (their entries carried over); larger ones are kept (never shrunk under live
    /// flows).
    pub ct_entries: [u32; 2],
}

impl Default for MapSizes {
    fn default() -> Self {
        let d = DatapathConfig::default();
        MapSizes {
            policy_entries: d.policy_entries,
            policy_entries_max: DEFAULT_POLICY_ENTRIES_MAX,
            ipcache_entries: d.ipcache_entries,
            max_rulesets: d.max_rulesets,
            ct_entries: [d.ct4_entries, d.ct6_entries],
        }
    }
}

/// What the policy map may grow to by default: 4× its default size (a no-prealloc hash map
/// costs its bucket array, 16 bytes per entry of capacity, plus its elements).
pub const DEFAULT_POLICY_ENTRIES_MAX: u32 =
    4 * ordnet_datapath::common::layout::DEFAULT_POLICY_ENTRIES;

impl MapSizes {
    /// The sizes of the maps pinned in `dir` (`None` if they cannot be read).
    fn pinned(dir: &Path) -> Option<MapSizes> {
        let c = Kernel::pinned_sizes(dir)?;
        Some(MapSizes {
            policy_entries: c.policy_entries,
            policy_entries_max: 0,
            ipcache_entries: c.ipcache_entries,
            max_rulesets: c.max_rulesets,
            ct_entries: [c.ct4_entries, c.ct6_entries],
        })
    }

    /// The sizes to run with when `pinned` are the pinned maps' (`None`: no pins): these, but a
    /// policy map grown at run time beyond `policy_entries` (within `policy_entries_max`)
    /// keeps its size, and so does a connection-tracking table larger than configured.
    fn effective(self, pinned: Option<MapSizes>) -> MapSizes {
        let Some(p) = pinned else {
            return self;
        };
        let mut out = self;
        if p.policy_entries > self.policy_entries && p.policy_entries <= self.policy_entries_max {
            out.policy_entries = p.policy_entries;
        }
        for i in 0..2 {
            out.ct_entries[i] = self.ct_entries[i].max(p.ct_entries[i]);
        }
        out
    }

    /// Whether maps of sizes `pinned` serve for these.
    fn served_by(&self, pinned: &MapSizes) -> bool {
        (
            pinned.policy_entries,
            pinned.ipcache_entries,
            pinned.max_rulesets,
            pinned.ct_entries,
        ) == (
            self.policy_entries,
            self.ipcache_entries,
            self.max_rulesets,
            self.ct_entries,
        )
    }
}

/// The policy keys the engine's local endpoints need (every distinct MapState's keys: the
/// datapath writes a MapState's keys as they are, and equal MapStates share one rule set).
fn estimated_policy_keys(engine: &Engine) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut keys = 0;
    for ep in engine.endpoints() {
        for dir in ordnet_mapstate::Direction::ALL {
            let ms = &engine.policy(ep, dir).mapstate;
            if seen.insert(std::ptr::from_ref(ms) as usize) {
                keys += ms.len();
            }
        }
    }
    keys
}

/// The datapath configuration of the agent's maps and connection tracking.
fn config_of(pin_dir: &Path, sizes: MapSizes, options: ProgramOptions) -> DatapathConfig {
    let conntrack = options.conntrack;
    DatapathConfig {
        pin_dir: Some(pin_dir.to_path_buf()),
        policy_entries: sizes.policy_entries,
        ipcache_entries: sizes.ipcache_entries,
        max_rulesets: sizes.max_rulesets,
        ct4_entries: sizes.ct_entries[0],
        ct6_entries: sizes.ct_entries[1],
        ct_tcp_lifetime: conntrack.tcp,
        ct_syn_lifetime: conntrack.syn,
        ct_close_lifetime: conntrack.close,
        ct_other_lifetime: conntrack.other,
        events_per_sec: options.events_per_sec,
        rule_counters: options.rule_counters,
        classes: options.classes,
        ..DatapathConfig::default()
    }
}

/// What the programs are loaded with besides the map sizes (`ordnet agent --conntrack-*`,
/// `--events-per-sec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramOptions {
    /// Connection tracking's lifetimes.
    pub conntrack: ConntrackOptions,
    /// The verdict events' rate limit per node (0: no events; `docs/observe.md`).
    pub events_per_sec: u64,
    /// The per-rule counters (`docs/observe.md` §8; `--rule-counters=false` turns them off).
    pub rule_counters: bool,
    /// Node-local identity classes in the policy map (`--policy-classes`,
    /// `docs/datapath.md` §13).
    pub classes: bool,
}

impl Default for ProgramOptions {
    fn default() -> Self {
        ProgramOptions {
            conntrack: ConntrackOptions::default(),
            events_per_sec: DatapathConfig::default().events_per_sec,
            rule_counters: true,
            classes: true,
        }
    }
}

/// Connection tracking of the bpf datapath (`ordnet agent --conntrack-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackOptions {
    /// Idle lifetime of an established TCP flow.
    pub tcp: Duration,
    /// Idle lifetime of a TCP flow that never got past its SYN.
    pub syn: Duration,
    /// Idle lifetime of a closed TCP flow (an RST, or a FIN each way).
    pub close: Duration,
    /// Idle lifetime of a UDP, SCTP or ICMP echo flow.
    pub other: Duration,
}

impl Default for ConntrackOptions {
    fn default() -> Self {
        let d = DatapathConfig::default();
        ConntrackOptions {
            tcp: d.ct_tcp_lifetime,
            syn: d.ct_syn_lifetime,
            close: d.ct_close_lifetime,
            other: d.ct_other_lifetime,
        }
    }
}

/// How often at most expired connection-tracking entries are swept (at upkeep).
const CT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// How long after a failed growth of the policy map the next is tried.
const GROW_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A table this full of live flows is reported (log, `/readyz`): the LRU evicts live flows
/// when it is completely full.
const CT_PRESSURE_PERCENT: u64 = 90;

impl BpfDatapath {
    /// Opens the datapath pinned under the pin root `root`, in this layout's directory
    /// ([`ordnet_datapath::layout_dir`]): adopts what is there (writing nothing) or creates it.
    /// Pins of an older layout beside it are kept enforcing until the first full programming,
    /// which takes their attachments over onto the new programs and removes them. The bpffs is
    /// mounted at `root` if it is not on one. Needs root (CAP_BPF, CAP_NET_ADMIN,
    /// CAP_SYS_ADMIN for the mount).
    pub fn open(
        root: &Path,
        uplinks: Vec<String>,
        options: ProgramOptions,
        sizes: MapSizes,
    ) -> Result<BpfDatapath, AgentError> {
        mount_bpffs(root)?;
        let pin_dir = &ordnet_datapath::layout_dir(root);
        let sizes = sizes.effective(MapSizes::pinned(pin_dir));
        resize_aside(pin_dir, &sizes)?;
        std::fs::create_dir_all(pin_dir).map_err(|source| AgentError::Bpffs {
            what: "creating the layout's pin directory",
            path: pin_dir.clone(),
            source,
        })?;
        let older = older_layouts(root, pin_dir);
        let config = config_of(pin_dir, sizes, options);
        let pinned = ordnet_datapath::MAP_NAMES
            .iter()
            .all(|m| pin_dir.join(m).exists());
        let (mut dp, opened) = if pinned {
            let (dp, report) = Kernel::adopt(config).map_err(|source| AgentError::Open {
                what: "adopting the pins",
                pin_dir: pin_dir.to_path_buf(),
                source: Box::new(source),
            })?;
            (
                dp,
                Opened::Adopted {
                    endpoints: report.endpoints,
                    rulesets: report.rulesets,
                    links: report.links,
                },
            )
        } else {
            let dp = Kernel::create(config).map_err(|source| AgentError::Open {
                what: "creating the datapath",
                pin_dir: pin_dir.to_path_buf(),
                source: Box::new(source),
            })?;
            (dp, Opened::Created)
        };
        // The rule set store has every policy key; the userspace copy of the maps keeps none.
        dp.keep_keys_in_store();
        if let Some(why) = dp.handoff_refused() {
            tracing::warn!(
                kernel = why,
                "the kernel refuses XDP metadata (bpf_xdp_adjust_meta): the XDP-to-TC handoff \
                 is off, the TC hook looks every forwarded packet up itself"
            );
        }
        if let Ok(memory) = dp.memory() {
            for (map, bytes) in memory
                .maps
                .iter()
                .filter(|(m, _)| m.starts_with("ORDNET_CT"))
            {
                tracing::info!(map, bytes, "connection-tracking table (kernel memory)");
            }
        }
        let ipcache_version = dp.control().identities_version();
        Ok(BpfDatapath {
            dp,
            programmer: Programmer::default(),
            ipcache: OnceLock::new(),
            ipcache_version,
            uplinks,
            ifindex: BTreeMap::new(),
            unattached: BTreeMap::new(),
            cni_hints: BTreeMap::new(),
            hints_changed: false,
            bridge_ports: BTreeMap::new(),
            resolving: BTreeSet::new(),
            held: BTreeSet::new(),
            uplinks_found: BTreeSet::new(),
            tc_only: BTreeMap::new(),
            generic: BTreeMap::new(),
            needs_full: false,
            synced: false,
            migrate_from: older,
            hosts: Vec::new(),
            attach_errors: 0,
            attaches: 0,
            detaches: 0,
            opened,
            options,
            root: root.to_path_buf(),
            sizes,
            grown: 0,
            grow_failed: None,
            pressure: (false, false),
            last_sweep: None,
            ct_removed: [0; 2],
            ct_sweep_errors: 0,
            counters: DatapathCounters::default(),
            rule_totals: RuleTotals::default(),
        })
    }

    /// Copies the tracked flows of the tables pinned in `old` into the current ones (see
    /// [`BpfDatapath::take_over_older_layouts`]); a failure is logged (those flows are judged
    /// as new at their next packet) and counted as none.
    fn carry_conntrack(&mut self, old: &Path) -> [u64; 2] {
        match self.dp.ct_carry_from(old) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(from = %old.display(), error = %e, "carrying tracked flows over failed: their next packets are judged as new flows");
                [0, 0]
            }
        }
    }

    /// Removes expired connection-tracking entries (at most every [`CT_SWEEP_INTERVAL`]) and
    /// reports a table whose live flows come near its capacity.
    fn sweep_conntrack(&mut self) {
        if self
            .last_sweep
            .is_some_and(|(at, _)| at.elapsed() < CT_SWEEP_INTERVAL)
        {
            return;
        }
        let before = self.counters;
        match self.dp.counters() {
            Ok(c) => self.counters = c,
            Err(e) => tracing::warn!(error = %e, "reading the datapath's counters"),
        }
        // Packets of TCP flows without an entry, denied since the last sweep: with a full table,
        // the connections whose entries the LRU evicted.
        let untracked_denied = self
            .counters
            .untracked_denied
            .saturating_sub(before.untracked_denied);
        match self.dp.ct_sweep() {
            Ok(sweep) => {
                for (i, family) in ["IPv4", "IPv6"].into_iter().enumerate() {
                    self.ct_removed[i] += sweep.removed[i];
                    let capacity = u64::from(sweep.capacity[i]);
                    if capacity > 0 && sweep.live[i] * 100 >= capacity * CT_PRESSURE_PERCENT {
                        tracing::warn!(
                            family,
                            live = sweep.live[i],
                            capacity,
                            untracked_denied,
                            "the connection-tracking table is nearly full of live flows: when it \
                             is full the least recently used flows lose their entries (their next \
                             packet is judged as a new flow); raise --conntrack-entries-v4/v6"
                        );
                    }
                }
                self.last_sweep = Some((Instant::now(), sweep));
            }
            Err(e) => {
                self.ct_sweep_errors += 1;
                // Retried at the next interval.
                self.last_sweep = Some((
                    Instant::now(),
                    self.last_sweep.map(|(_, s)| s).unwrap_or_default(),
                ));
                tracing::warn!(error = %e, "sweeping the connection-tracking tables");
            }
        }
    }

    /// Lines for `/readyz` about the datapath's state: endpoints not enforced (and why),
    /// interfaces where XDP runs in generic mode, connection-tracking tables near their
    /// capacity.
    pub fn health_notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (who, why) in &self.unattached {
            out.push(format!("not enforced: {who}: {why}"));
        }
        out.extend(super::datapath::capacity_notes(
            &self.programmer.program,
            &self.dp,
        ));
        if self.synced && self.uplinks_found.is_empty() {
            out.push(
                "no uplink (--uplink, or a VXLAN/Geneve device): a pod's egress through a \
                 Service to a backend on another node is not judged on this node"
                    .to_string(),
            );
        }
        for (iface, why) in &self.generic {
            out.push(format!(
                "XDP in generic mode on {iface} (enforced, slower): {why}"
            ));
        }
        let Some((_, sweep)) = self.last_sweep else {
            return out;
        };
        for (i, family) in ["IPv4", "IPv6"].into_iter().enumerate() {
            let capacity = u64::from(sweep.capacity[i]);
            if capacity > 0 && sweep.live[i] * 100 >= capacity * CT_PRESSURE_PERCENT {
                out.push(format!(
                    "conntrack {family}: {} of {capacity} entries hold live flows (>= {CT_PRESSURE_PERCENT} %): \
                     when full, the least recently used flows lose their entries",
                    sweep.live[i]
                ));
            }
        }
        out
    }

    /// What [`BpfDatapath::open`] found.
    pub fn opened(&self) -> &Opened {
        &self.opened
    }

    /// The kernel datapath (tests: `verify`, `attached`).
    pub fn kernel(&self) -> &Kernel {
        &self.dp
    }

    /// The engine → datapath mapping (ids, write statistics).
    pub fn node_program(&self) -> &NodeProgram {
        &self.programmer.program
    }

    /// Endpoints that are not attached, and why.
    pub fn unattached(&self) -> &BTreeMap<String, String> {
        &self.unattached
    }

    fn refresh_hosts(&mut self) -> Result<(), AgentError> {
        let hosts = host_addresses().map_err(AgentError::HostAddresses)?;
        if hosts != self.hosts || !self.synced {
            self.programmer
                .program
                .set_host_addresses(&mut self.dp, &hosts)?;
            self.hosts = hosts;
        }
        Ok(())
    }

    fn full(&mut self, engine: &Engine) -> Result<(), AgentError> {
        self.needs_full = true;
        self.refresh_hosts()?;
        self.programmer.program_full(engine, &mut self.dp)?;
        self.needs_full = false;
        self.synced = true;
        self.take_over_older_layouts();
        self.forget_changed_ipcache();
        self.reconcile_links(engine);
        Ok(())
    }

    /// [`BpfDatapath::full`] into a policy map large enough for the engine's keys (with a
    /// quarter of headroom, within `policy_entries_max`: the map is grown first if it is not),
    /// then growth of the policy map if it still needs to.
    fn full_and_grow(&mut self, engine: &Engine) -> Result<(), AgentError> {
        if self.dp.classes().is_some() {
            // The engine's keys are identities': classes need a fraction of them, known
            // only once programmed. Growth follows the fill.
            self.full(engine)?;
            return self.grow_if_needed(engine);
        }
        let needed = estimated_policy_keys(engine);
        let target = u32::try_from(needed.saturating_mul(5) / 4)
            .unwrap_or(u32::MAX)
            .checked_next_power_of_two()
            .unwrap_or(u32::MAX)
            .min(self.sizes.policy_entries_max);
        if target > self.sizes.policy_entries {
            tracing::info!(
                keys = needed,
                from = self.sizes.policy_entries,
                to = target,
                "sizing the policy map for this node's policies"
            );
            if let Err(e) = self.grow_to(engine, target) {
                // The current maps then: what does not fit is denied, and reported.
                tracing::error!(error = %e, "growing the policy map failed; programming the current maps");
                self.full(engine)?;
            }
        } else {
            self.full(engine)?;
        }
        self.grow_if_needed(engine)
    }

    /// Grows the policy map while endpoints are denied for lack of room or it is
    /// [`MAP_PRESSURE_PERCENT`] full, doubling it up to `policy_entries_max`: new maps of the
    /// new size are created beside the current ones (whose pins are set aside and keep
    /// enforcing), programmed in full, and take every attachment over in place (the layout
    /// migration): no moment unenforced. Connection tracking starts empty in the new maps
    /// (established flows are judged again). Tried once per change of the pressure.
    fn grow_if_needed(&mut self, engine: &Engine) -> Result<(), AgentError> {
        loop {
            // In keys of the map (class keys with classes).
            let (held, capacity) = (
                self.dp.policy_map_keys(),
                self.sizes.policy_entries as usize,
            );
            let full =
                held.saturating_mul(100) >= capacity.saturating_mul(MAP_PRESSURE_PERCENT as usize);
            let denied = !self.programmer.program.denied().is_empty();
            let changed = (full, denied) != self.pressure;
            self.pressure = (full, denied);
            let pressure = full || denied;
            let room = self.sizes.policy_entries < self.sizes.policy_entries_max;
            let backoff = self
                .grow_failed
                .is_some_and(|at| at.elapsed() < GROW_RETRY_AFTER);
            if !pressure || !room || (!changed && !denied) || backoff {
                return Ok(());
            }
            if let Err(e) = self.grow(engine) {
                // Tried again after GROW_RETRY_AFTER; the maps in use keep enforcing, denied
                // endpoints stay denied (and reported).
                tracing::error!(error = %e, "growing the policy map failed");
                self.grow_failed = Some(Instant::now());
                return Ok(());
            }
            self.grow_failed = None;
        }
    }

    /// One growth step of [`BpfDatapath::grow_if_needed`]: twice the size.
    fn grow(&mut self, engine: &Engine) -> Result<(), AgentError> {
        let to = self
            .sizes
            .policy_entries
            .saturating_mul(2)
            .min(self.sizes.policy_entries_max);
        tracing::warn!(
            from = self.sizes.policy_entries,
            to,
            denied = self.programmer.program.denied().len(),
            "the policy map is too small: growing it (new maps take the attachments over once programmed)"
        );
        self.grow_to(engine, to)
    }

    /// Replaces the maps by ones whose policy map holds `policy_entries` keys (see
    /// [`BpfDatapath::grow_if_needed`]) and programs them in full.
    fn grow_to(&mut self, engine: &Engine, policy_entries: u32) -> Result<(), AgentError> {
        let sizes = MapSizes {
            policy_entries,
            ..self.sizes
        };
        let pin_dir = ordnet_datapath::layout_dir(&self.root);
        let Some(aside) = resize_aside(&pin_dir, &sizes)? else {
            return Ok(());
        };
        let created = Kernel::create(config_of(&pin_dir, sizes, self.options)).map_err(|source| {
            AgentError::Open {
                what: "creating grown maps",
                pin_dir: pin_dir.clone(),
                source: Box::new(source),
            }
        });
        let mut dp = match created {
            Ok(dp) => dp,
            Err(e) => {
                // Back as it was: the current maps keep enforcing.
                let _ = Kernel::remove_pins(&pin_dir);
                let _ = std::fs::remove_dir(&pin_dir);
                let _ = std::fs::rename(&aside, &pin_dir);
                return Err(e);
            }
        };
        dp.keep_keys_in_store();
        // What the old programs counted is read before they go; the new ones count from zero.
        self.collect_rule_counts();
        self.rule_totals.reloaded();
        // The current maps stay pinned (set aside) and enforcing until the takeover.
        drop(std::mem::replace(&mut self.dp, dp));
        let keys = self.programmer.record.keeps_keys();
        self.programmer = Programmer::default();
        if keys {
            self.programmer.record.keep_keys();
        }
        self.migrate_from.push(aside);
        self.sizes = sizes;
        self.grown += 1;
        self.full(engine)
    }

    /// Once the new maps hold the whole state: the attachments of an older layout's pins move
    /// onto the new programs (in place, per interface: no moment without a program), then the
    /// older pins go. The tracked flows come along: the old tables' entries are copied before
    /// the programs switch and once more after (what the old programs tracked meanwhile), each
    /// made stale so that its flow is re-checked under the new maps at its next packet.
    fn take_over_older_layouts(&mut self) {
        for old in std::mem::take(&mut self.migrate_from) {
            let mut carried = self.carry_conntrack(&old);
            let moved = self.dp.take_over_links(&old);
            let again = self.carry_conntrack(&old);
            carried = [carried[0] + again[0], carried[1] + again[1]];
            tracing::info!(
                from = %old.display(),
                ipv4 = carried[0],
                ipv6 = carried[1],
                "carried tracked flows over to the new maps"
            );
            match moved {
                Ok(moved) => tracing::info!(
                    from = %old.display(),
                    interfaces = %moved.join(","),
                    "took the attachments of an older map layout over"
                ),
                Err(e) => {
                    // Its links stay attached to the old programs: keep them for the next try.
                    tracing::error!(from = %old.display(), error = %e, "taking an older layout's attachments over failed");
                    self.migrate_from.push(old);
                    continue;
                }
            }
            if let Err(e) = Kernel::remove_pins(&old) {
                tracing::warn!(from = %old.display(), error = %e, "removing an older layout's pins");
            }
            if old
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('v'))
            {
                let _ = std::fs::remove_dir(&old);
            }
        }
    }

    /// Attaches the program to every interface a local endpoint (or the uplink) needs and
    /// removes the attachments nobody needs.
    fn reconcile_links(&mut self, engine: &Engine) {
        self.hints_changed = false;
        let (wanted, mut unattached) = self.wanted_interfaces(engine);
        // Attachments nobody needs go (pods that went away).
        let attached: BTreeSet<String> = self
            .dp
            .attached()
            .chain(self.dp.tc_attached())
            .map(str::to_string)
            .collect();
        let unneeded: Vec<&String> = attached
            .iter()
            .filter(|i| !wanted.contains_key(*i) && !self.held.contains(*i))
            .collect();
        for iface in unneeded {
            self.detach(iface);
        }
        for (iface, owners) in &wanted {
            let current = ifindex_of(iface);
            if current == 0 {
                if attached.contains(iface) {
                    // Its interface is gone: the link is defunct.
                    self.detach(iface);
                }
                for o in owners {
                    unattached.insert(o.clone(), format!("interface {iface} does not exist"));
                }
                continue;
            }
            if self.tc_only.contains_key(iface) {
                if let Err(e) = self.attach_tc_only(iface, current) {
                    for o in owners {
                        unattached.insert(o.clone(), e.clone());
                    }
                }
                continue;
            }
            if self.dp.attached().any(|a| a == iface) {
                let known = match self.ifindex.get(iface) {
                    Some(i) => Some(*i),
                    None => self.dp.link_ifindex(iface).ok().flatten(),
                };
                if known == Some(current) {
                    self.ifindex.insert(iface.clone(), current);
                    // Pins of an older agent may hold the XDP link only.
                    if !self.dp.tc_attached().any(|a| a == iface)
                        && let Err(e) = self.dp.attach_tc(iface)
                    {
                        self.attach_errors += 1;
                        for o in owners {
                            unattached.insert(o.clone(), format!("attaching TC to {iface}: {e}"));
                        }
                    }
                    continue;
                }
                // A new interface under the same name: the old link is not on it.
                self.detach(iface);
            }
            // Both hooks: XDP (before netfilter) and TC (after kube-proxy's translation).
            // Natively where the driver allows it, else in generic mode (said, not hidden).
            let attached = self
                .dp
                .attach_native_or_generic(iface)
                .map_err(|e| e.to_string())
                .map(|mode| match mode {
                    XdpAttached::Native => {
                        self.generic.remove(iface);
                    }
                    XdpAttached::Generic { native_refused } => {
                        tracing::warn!(
                            interface = %iface,
                            native_refused = %native_refused,
                            "XDP runs in generic mode here: enforced, at a higher cost per packet"
                        );
                        self.generic.insert(iface.clone(), native_refused);
                    }
                })
                .and_then(|()| {
                    self.dp
                        .attach_tc(iface)
                        .map_err(|e| format!("attaching TC to {iface}: {e}"))
                });
            match attached {
                Ok(()) => {
                    self.attaches += 1;
                    self.ifindex.insert(iface.clone(), current);
                }
                Err(e) => {
                    self.attach_errors += 1;
                    for o in owners {
                        unattached.insert(o.clone(), e.clone());
                    }
                }
            }
        }
        self.record_interfaces(&wanted, &unattached);
        for (who, why) in &unattached {
            if self.unattached.get(who) != Some(why) {
                tracing::warn!(endpoint = %who, reason = %why, "not enforced yet (retrying)");
            }
        }
        for who in self.unattached.keys() {
            if !unattached.contains_key(who) {
                tracing::info!(endpoint = %who, "attached");
            }
        }
        self.unattached = unattached;
    }

    /// The interfaces the programs must be attached to, with who needs each (`ns/name`, or
    /// `uplink IFACE`), and the endpoints that have no usable interface, with why
    /// ([`netview`](super::netview) finds them). Addresses behind a bridge whose port is not
    /// known yet get a managed neighbour entry (the kernel resolves them; the bridge learns
    /// the port; the neighbour event wakes the upkeep), removed once the port is found or the
    /// endpoint is gone; a port found earlier stays the endpoint's while it is still a port of
    /// that bridge (a silent pod's forwarding entry ages out).
    fn wanted_interfaces(
        &mut self,
        engine: &Engine,
    ) -> (BTreeMap<String, Vec<String>>, BTreeMap<String, String>) {
        let mut unattached = BTreeMap::new();
        // Interface → who needs it.
        let mut wanted: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let view = match NetView::read() {
            Ok(view) => view,
            Err(e) => {
                // Nothing is known of the node's network: every attachment stays (detaching
                // would leave its pods unenforced), every endpoint is reported, and the next
                // upkeep looks again.
                self.held = self
                    .dp
                    .attached()
                    .chain(self.dp.tc_attached())
                    .map(str::to_string)
                    .collect();
                for u in self.uplinks.iter().filter(|u| !u.contains(['*', '?'])) {
                    wanted
                        .entry(u.clone())
                        .or_default()
                        .push(format!("uplink {u}"));
                }
                for ep in engine.endpoints() {
                    unattached.insert(ep.id(), format!("reading the node's network: {e}"));
                }
                return (wanted, unattached);
            }
        };
        self.note_generic_modes(&view);
        let uplinks = view.uplinks(&self.uplinks);
        self.uplinks_found = uplinks.clone();
        self.tc_only = view
            .links
            .values()
            .filter(|l| l.tunnel)
            .map(|l| (l.name.clone(), l.l3))
            .collect();
        for u in &uplinks {
            wanted
                .entry(u.clone())
                .or_default()
                .push(format!("uplink {u}"));
        }
        let mut resolving = BTreeSet::new();
        let mut ports = BTreeMap::new();
        // The names of a pod that was an endpoint and is none any more (deleted while no DEL
        // reached us) go; a pod the engine has not made an endpoint yet keeps them (its ADD
        // arrives before the batch that programs it).
        let endpoints: BTreeSet<String> = engine.endpoints().iter().map(|e| e.id()).collect();
        self.cni_hints.retain(|name, (_, seen)| {
            *seen |= endpoints.contains(name);
            !*seen || endpoints.contains(name)
        });
        for ep in engine.endpoints() {
            let name = ep.id();
            // The interface the chained CNI plugin named, when it is one here.
            let named = self.cni_hints.get(&name).map(|(n, _)| n.as_slice());
            if let Some(iface) = named.and_then(|n| view.cni_interface(n, &uplinks)) {
                wanted.entry(iface).or_default().push(name.clone());
                continue;
            }
            for ip in &ep.ips {
                let found = match view.pod_interface(*ip, &uplinks) {
                    Ok(iface) => {
                        if view.link_named(&iface).is_some_and(|l| l.master.is_some()) {
                            ports.insert(*ip, iface.clone());
                        }
                        Ok(iface)
                    }
                    Err(Unfound::Unresolved { bridge, why }) => {
                        let earlier = self.bridge_ports.get(ip).filter(|port| {
                            view.link_named(port)
                                .is_some_and(|l| l.master == Some(bridge))
                        });
                        match earlier {
                            Some(port) => {
                                ports.insert(*ip, port.clone());
                                Ok(port.clone())
                            }
                            None => {
                                resolving.insert((bridge, *ip));
                                Err(why)
                            }
                        }
                    }
                    Err(Unfound::No(why)) => Err(why),
                };
                match found {
                    Ok(iface) => wanted.entry(iface).or_default().push(name.clone()),
                    Err(why) => {
                        unattached.insert(name.clone(), why);
                    }
                }
            }
        }
        self.bridge_ports = ports;
        // Until every pod of a bridge is found again (after a restart, or a silent pod's
        // forwarding entry aged out), that bridge's ports keep their attachments: detaching
        // one would leave its pod unenforced while it is being looked for.
        let unresolved: BTreeSet<u32> = resolving.iter().map(|(bridge, _)| *bridge).collect();
        self.held = view
            .links
            .values()
            .filter(|l| l.master.is_some_and(|m| unresolved.contains(&m)))
            .map(|l| l.name.clone())
            .collect();
        self.resolve_neighbours(resolving);
        (wanted, unattached)
    }

    /// Generic-mode XDP as the kernel reports it (`IFLA_XDP_ATTACHED`), so links an earlier
    /// agent attached are counted too.
    fn note_generic_modes(&mut self, view: &NetView) {
        for l in view.links.values() {
            let ours = self.dp.attached().any(|a| a == l.name);
            if ours && l.xdp_generic {
                self.generic.entry(l.name.clone()).or_insert_with(|| {
                    "found in generic mode (attached by an earlier agent)".to_string()
                });
            } else if ours {
                self.generic.remove(&l.name);
            }
        }
    }

    /// Keeps a managed neighbour entry for exactly the bridged addresses in `wanted`.
    fn resolve_neighbours(&mut self, wanted: BTreeSet<(u32, IpAddr)>) {
        for &(bridge, ip) in self.resolving.difference(&wanted) {
            if let Err(e) = netview::remove_neighbour(bridge, ip) {
                tracing::debug!(%ip, error = %e, "removing a managed neighbour entry");
            }
        }
        for &(bridge, ip) in wanted.difference(&self.resolving) {
            if let Err(e) = netview::add_managed_neighbour(bridge, ip) {
                tracing::warn!(%ip, error = %e, "asking the kernel to resolve a bridged pod");
            }
        }
        self.resolving = wanted;
    }

    /// A tunnel device (VXLAN, Geneve, GRETAP; IPIP, SIT, GRE, ip6gre, ip6tnl, WireGuard with
    /// the layer-3 TC program, their packets having no Ethernet header) gets the TC hook only:
    /// it judges a local
    /// pod's egress to a backend on another node after kube-proxy's translation, which leaves
    /// through the tunnel. No XDP: the kernel refuses XDP on a device whose upper device has a
    /// program and vice versa (a VXLAN device is an upper device of its underlay, typically the
    /// uplink: `Cannot attach when an upper device already has a program`), and packets from
    /// other nodes are judged again at the receiving pod's interface anyway. A re-created
    /// device (new index) gets a new link.
    fn attach_tc_only(&mut self, iface: &str, current: u32) -> Result<(), String> {
        let l3 = self.tc_only.get(iface).copied().unwrap_or(false);
        // Attached, and with the program of its kind.
        let on = self.dp.tc_attached().any(|a| a == iface) && self.dp.tc_is_l3(iface) == l3;
        let known = match self.ifindex.get(iface) {
            Some(i) => Some(*i),
            None => self.dp.tc_link_ifindex(iface).ok().flatten(),
        };
        if on && known == Some(current) {
            self.ifindex.insert(iface.to_string(), current);
            return Ok(());
        }
        if self.dp.tc_attached().any(|a| a == iface) {
            self.detach(iface);
        }
        if self.dp.attached().any(|a| a == iface) {
            // An XDP link from before it counted as a tunnel.
            self.detach(iface);
        }
        let attached = if l3 {
            self.dp.attach_tc_l3(iface)
        } else {
            self.dp.attach_tc(iface)
        };
        match attached {
            Ok(()) => {
                self.attaches += 1;
                self.ifindex.insert(iface.to_string(), current);
                Ok(())
            }
            Err(e) => {
                self.attach_errors += 1;
                Err(format!("attaching TC to {iface}: {e}"))
            }
        }
    }

    fn detach(&mut self, iface: &str) {
        self.ifindex.remove(iface);
        self.generic.remove(iface);
        if self.dp.attached().any(|a| a == iface) {
            match self.dp.detach(iface) {
                Ok(()) => self.detaches += 1,
                Err(e) => tracing::warn!(interface = %iface, error = %e, "detaching XDP failed"),
            }
        }
        if self.dp.tc_attached().any(|a| a == iface)
            && let Err(e) = self.dp.detach_tc(iface)
        {
            tracing::warn!(interface = %iface, error = %e, "detaching TC failed");
        }
    }

    /// Tells the datapath which interface belongs to which attached endpoint (the TC hook
    /// attributes masqueraded packets by it) and forgets the others.
    fn record_interfaces(
        &mut self,
        wanted: &BTreeMap<String, Vec<String>>,
        unattached: &BTreeMap<String, String>,
    ) {
        let mut by_endpoint: BTreeMap<String, u32> = BTreeMap::new();
        for (iface, owners) in wanted {
            let Some(&index) = self.ifindex.get(iface) else {
                continue;
            };
            for o in owners {
                if !o.starts_with("uplink ") && !unattached.contains_key(o) {
                    by_endpoint.insert(o.clone(), index);
                }
            }
        }
        let program = &mut self.programmer.program;
        let gone: Vec<String> = program
            .interface_names()
            .filter(|n| !by_endpoint.contains_key(*n))
            .map(str::to_string)
            .collect();
        let changes = gone
            .into_iter()
            .map(|n| (n, None))
            .chain(by_endpoint.into_iter().map(|(n, i)| (n, Some(i))));
        for (name, index) in changes {
            if let Err(e) = program.set_interface(&mut self.dp, &name, index) {
                tracing::warn!(endpoint = %name, error = %e, "recording the interface failed");
            }
        }
    }
}

impl BpfDatapath {
    /// The connection-tracking part of [`Enforcer::metrics`].
    fn conntrack_metrics(&self, out: &mut Vec<super::metrics::Sample>) {
        use super::metrics::Sample;
        // Read whenever the agent records its metrics (after programming and upkeep; a per-CPU
        // array read); the last sweep's values if that fails.
        let counters = self.dp.counters().unwrap_or(self.counters);
        for (verdict, n) in [
            ("denied", counters.untracked_denied),
            ("allowed", counters.untracked_allowed),
        ] {
            out.push(Sample {
                name: "ordnet_conntrack_untracked_tcp_packets",
                help: "TCP packets past the handshake (no SYN, no RST) of a local endpoint's flow \
                       that the connection-tracking table had no live entry for, by the policy's \
                       verdict: denied ones are flows evicted from a full table (a broken \
                       connection towards an isolated side), expired, lost in a restart, or \
                       scans; allowed ones were tracked again. Counted since the programs were \
                       loaded.",
                counter: true,
                labels: vec![("verdict", verdict.to_string())],
                value: n,
            });
        }
        out.push(Sample {
            name: "ordnet_datapath_handed_off_packets",
            help: "Packets the TC hook passed on the tag the XDP program left in their metadata \
                   (a tracked flow's packet XDP had just passed, unchanged since), without a \
                   second connection-tracking lookup. Stays 0 where a driver drops XDP metadata. \
                   Counted since the programs were loaded.",
            counter: true,
            labels: vec![],
            value: counters.handed_off,
        });
        out.push(Sample {
            name: "ordnet_datapath_handoff",
            help: "Whether the XDP-to-TC handoff is on (1) or off (0: turned off, or the kernel \
                   refused the XDP metadata helper at load, which the agent's log says): off, \
                   the TC hook looks every forwarded packet up itself.",
            counter: false,
            labels: vec![],
            value: u64::from(self.dp.handoff_key() != 0),
        });
        for (outcome, n) in [
            ("emitted", counters.events),
            ("suppressed", counters.events_suppressed),
            ("lost", counters.events_lost),
        ] {
            out.push(Sample {
                name: "ordnet_datapath_verdict_events",
                help: "Verdict events of the programs (new flows and denied packets, \
                       docs/observe.md), by outcome: emitted into the ring buffer, suppressed \
                       by the rate limit (a denied flow's packets are reported by its next \
                       event), lost to a full ring buffer (the agent did not keep up). Counted \
                       since the programs were loaded.",
                counter: true,
                labels: vec![("outcome", outcome.to_string())],
                value: n,
            });
        }
        out.push(Sample {
            name: "ordnet_conntrack_sweep_errors",
            help: "Connection-tracking sweeps that failed.",
            counter: true,
            labels: Vec::new(),
            value: self.ct_sweep_errors,
        });
        if let Some((_, sweep)) = self.last_sweep {
            for (i, family) in ["ipv4", "ipv6"].into_iter().enumerate() {
                let labels = vec![("family", family.to_string())];
                out.push(Sample {
                    name: "ordnet_conntrack_entries",
                    help: "Live connection-tracking entries (flows), as of the last sweep.",
                    counter: false,
                    labels: labels.clone(),
                    value: sweep.live[i],
                });
                out.push(Sample {
                    name: "ordnet_conntrack_capacity",
                    help: "Capacity of the connection-tracking table (flows).",
                    counter: false,
                    labels: labels.clone(),
                    value: u64::from(sweep.capacity[i]),
                });
                out.push(Sample {
                    name: "ordnet_conntrack_expired_removed",
                    help: "Expired connection-tracking entries removed by sweeps.",
                    counter: true,
                    labels,
                    value: self.ct_removed[i],
                });
            }
        }
    }

    /// Empties the copy of the identities the datapath holds if they changed (it is read
    /// again when next asked for).
    fn forget_changed_ipcache(&mut self) {
        let version = self.dp.control().identities_version();
        if version != self.ipcache_version {
            self.ipcache = OnceLock::new();
            self.ipcache_version = version;
        }
    }
}

impl Enforcer for BpfDatapath {
    fn program_full(&mut self, engine: &Engine) -> Result<(), AgentError> {
        self.full_and_grow(engine)
    }

    fn apply(&mut self, engine: &Engine, deltas: &[EngineDelta]) -> Result<(), AgentError> {
        if self.needs_full {
            return self.full_and_grow(engine);
        }
        if let Err(e) = self.programmer.apply(engine, deltas, &mut self.dp) {
            self.needs_full = true;
            return Err(e);
        }
        self.forget_changed_ipcache();
        // Which interfaces are wanted follows the local endpoints, their addresses and the CNI
        // plugin's hints, not the identities: an address that appears or goes may be a local
        // endpoint's, one that changes identity (every pod relabel in the cluster) is not a
        // reason to dump the node's links, routes and neighbours again (~1 ms a batch on an
        // idle test machine, more with a node's hundred pods). An endpoint left unattached
        // waits for its interface, route or neighbour to appear: the netlink events that say so
        // run the upkeep (`maintain`), which looks again; other batches do not.
        let endpoints_moved = deltas.iter().any(|d| {
            !d.endpoints_added.is_empty()
                || !d.endpoints_removed.is_empty()
                || d.ipcache.iter().any(|c| c.old.is_none() || c.new.is_none())
        });
        if endpoints_moved || self.hints_changed {
            self.reconcile_links(engine);
        }
        self.grow_if_needed(engine)
    }

    fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint> {
        self.programmer.record.programmed()
    }

    fn record_keys(&mut self) {
        self.programmer.record.keep_keys();
    }

    fn ipcache(&self) -> &BTreeMap<IpNet, Identity> {
        self.ipcache
            .get_or_init(|| self.dp.control().identities().into_iter().collect())
    }

    fn ipcache_len(&self) -> usize {
        self.dp.control().identity_count()
    }

    fn plane(&self) -> &dyn ControlPlane {
        &self.dp
    }

    fn take_events(&mut self) -> Option<ordnet_datapath::EventReader> {
        self.dp.events().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the datapath's verdict events cannot be read");
            None
        })
    }

    fn endpoint_ready(&self, endpoint: &str) -> Result<(), String> {
        if !self.programmed().contains_key(endpoint) {
            return Err(format!("{endpoint} is not programmed"));
        }
        match self.unattached.get(endpoint) {
            None => Ok(()),
            Some(why) => Err(format!("{endpoint} is not attached: {why}")),
        }
    }

    fn maintain(&mut self, engine: &Engine) -> Result<(), AgentError> {
        if self.needs_full {
            return self.full_and_grow(engine);
        }
        if !self.synced {
            return Ok(());
        }
        self.refresh_hosts()?;
        self.programmer.retry_denied(engine, &mut self.dp)?;
        self.grow_if_needed(engine)?;
        self.reconcile_links(engine);
        self.sweep_conntrack();
        self.collect_rule_counts();
        Ok(())
    }

    fn reclaim_due(&self) -> Option<std::time::Instant> {
        (self.synced && !self.needs_full)
            .then(|| self.dp.reclaim_due())
            .flatten()
    }

    fn reclaim(&mut self) -> Result<(), AgentError> {
        if !self.synced {
            return Ok(());
        }
        self.programmer.reclaim(&mut self.dp, &mut self.needs_full)
    }

    fn rule_totals(&self) -> Option<&RuleTotals> {
        self.options.rule_counters.then_some(&self.rule_totals)
    }

    /// Adds what the kernel's per-rule counters counted since the last read to the totals (a
    /// failure is logged: the counts stay in the kernel for the next read).
    fn collect_rule_counts(&mut self) {
        if !self.options.rule_counters {
            return;
        }
        if let Err(e) = self.dp.collect_rule_counts(&mut self.rule_totals) {
            tracing::warn!(error = %e, "reading the per-rule counters failed");
        }
    }

    fn denied(&self) -> &BTreeMap<String, String> {
        self.programmer.program.denied()
    }

    fn health(&self) -> Vec<String> {
        self.health_notes()
    }

    fn cni_interfaces(&mut self, endpoint: &str, interfaces: Option<&[String]>) {
        match interfaces {
            Some(named) => {
                let before = self
                    .cni_hints
                    .insert(endpoint.to_string(), (named.to_vec(), false));
                self.hints_changed |= before.is_none_or(|(n, _)| n != named);
            }
            None => {
                self.hints_changed |= self.cni_hints.remove(endpoint).is_some();
            }
        }
    }

    fn metrics(&self) -> Vec<super::metrics::Sample> {
        use super::metrics::Sample;
        let stats = self.programmer.program.stats();
        let w = &stats.writes;
        let one = |name, help, counter, value: u64| Sample {
            name,
            help,
            counter,
            labels: Vec::new(),
            value,
        };
        let mut out = super::datapath::capacity_samples(&self.programmer.program, &self.dp);
        out.extend(crate::rule_counters::samples(&self.rule_totals));
        out.extend([
            one(
                "ordnet_datapath_attached_interfaces",
                "Interfaces the XDP program is attached to.",
                false,
                self.dp.attached().count() as u64,
            ),
            one(
                "ordnet_datapath_unattached_endpoints",
                "Local endpoints (and the uplink) whose interface is not found or not attached yet.",
                false,
                self.unattached.len() as u64,
            ),
            one(
                "ordnet_datapath_generic_xdp_interfaces",
                "Interfaces whose driver refused native XDP: the program runs in generic mode there.",
                false,
                self.generic.len() as u64,
            ),
            one(
                "ordnet_datapath_attach_errors",
                "Failed XDP attachments.",
                true,
                self.attach_errors,
            ),
            one(
                "ordnet_datapath_attaches",
                "XDP attachments made.",
                true,
                self.attaches,
            ),
            one(
                "ordnet_datapath_detaches",
                "XDP attachments removed.",
                true,
                self.detaches,
            ),
            one(
                "ordnet_datapath_policy_map_growths",
                "Times the policy map grew (new maps took the attachments over).",
                true,
                self.grown,
            ),
            one(
                "ordnet_datapath_fallbacks",
                "Change sets that did not fit and became a full endpoint update.",
                true,
                stats.fallbacks,
            ),
        ]);
        for (kind, n) in [
            ("ruleset_installed", w.rulesets_installed),
            ("ruleset_updated", w.rulesets_updated),
            ("ruleset_released", w.rulesets_released),
            ("policy", w.policy_writes),
            ("cell", w.cell_writes),
            ("block", w.block_writes),
            ("ipcache", w.ip_writes),
        ] {
            out.push(Sample {
                name: "ordnet_datapath_writes",
                help: "Writes to the BPF maps, by kind.",
                counter: true,
                labels: vec![("kind", kind.to_string())],
                value: u64::from(n),
            });
        }
        self.conntrack_metrics(&mut out);
        out
    }
}

/// `ordnet agent --uninstall`: removes every pin of this node's datapath in `pin_dir` (maps,
/// programs, and the links, which detaches the XDP and TC programs from every interface), then
/// the directory itself. Run it when no agent runs on the node any more (a running agent holds
/// its links open and they would stay attached until it exits). Nothing there: nothing done.
pub fn uninstall(root: &Path) -> Result<ordnet_datapath::RemovedPins, AgentError> {
    let mut removed = ordnet_datapath::RemovedPins::default();
    if !root.exists() {
        return Ok(removed);
    }
    // Every layout's directory, and pins directly in the root (before layouts had one).
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_layout_dir(p))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.push(root.to_path_buf());
    for dir in dirs {
        let r = Kernel::remove_pins(&dir).map_err(|source| AgentError::Open {
            what: "removing the pins",
            pin_dir: dir.clone(),
            source: Box::new(source),
        })?;
        if dir != root {
            let _ = std::fs::remove_dir(&dir);
            removed.layouts.push(dir);
        }
        removed.objects += r.objects;
        removed.xdp_links.extend(r.xdp_links);
        removed.tc_links.extend(r.tc_links);
    }
    // The root goes too when nothing else is in it (a bpffs mounted on it stays mounted,
    // empty).
    let _ = std::fs::remove_dir(root);
    Ok(removed)
}

/// `ROOT/vN`: a layout's pin directory; `ROOT/vN-resized-T`: one set aside to be replaced by
/// maps of other sizes ([`resize_aside`]).
fn is_layout_dir(p: &Path) -> bool {
    p.is_dir()
        && p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix('v'))
            .map(|v| v.split_once("-resized-").map_or(v, |(n, _)| n))
            .is_some_and(|v| v.parse::<u32>().is_ok())
}

/// When the maps pinned in `pin_dir` have other sizes than `sizes`: renames the directory to
/// `vN-resized-T` (a bpffs rename: the pins, links included, stay valid and keep enforcing),
/// so that new maps are created in `pin_dir` and the set-aside directory is taken over like an
/// older layout's after the first full programming.
fn resize_aside(pin_dir: &Path, sizes: &MapSizes) -> Result<Option<PathBuf>, AgentError> {
    let Some(pinned) = MapSizes::pinned(pin_dir) else {
        return Ok(None);
    };
    if sizes.served_by(&pinned) {
        return Ok(None);
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = format!(
        "{}-resized-{stamp}",
        pin_dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    );
    let aside = pin_dir.with_file_name(name);
    tracing::info!(
        pinned = ?pinned,
        wanted = ?sizes,
        aside = %aside.display(),
        "the pinned maps have other sizes: new maps are created and take over once programmed"
    );
    std::fs::rename(pin_dir, &aside).map_err(|source| AgentError::Bpffs {
        what: "setting the pins of other sizes aside",
        path: pin_dir.to_path_buf(),
        source,
    })?;
    Ok(Some(aside))
}

/// The pins of other layouts under `root`: other `ROOT/vN` directories with pins, and pins
/// directly in the root (before layouts had a directory).
fn older_layouts(root: &Path, current: &Path) -> Vec<PathBuf> {
    let has_pins = |d: &Path| {
        ordnet_datapath::MAP_NAMES
            .iter()
            .any(|m| d.join(m).exists())
            || d.join("links").exists()
            || d.join("tc-links").exists()
    };
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_layout_dir(p) && p != current && has_pins(p))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    if has_pins(root) {
        out.push(root.to_path_buf());
    }
    out
}

/// Makes sure `pin_dir` is on a bpffs: the conventional `/sys/fs/bpf` is mounted if it is not
/// one yet (as on a host where nothing uses BPF pins), any other directory is mounted itself.
fn mount_bpffs(pin_dir: &Path) -> Result<(), AgentError> {
    use ordnet_datapath::sys::{ensure_bpffs, is_bpffs};
    let conventional = Path::new("/sys/fs/bpf");
    if pin_dir.parent() == Some(conventional) && !is_bpffs(conventional) {
        ensure_bpffs(conventional).map_err(|source| AgentError::Bpffs {
            what: "mounting a bpffs",
            path: conventional.to_path_buf(),
            source,
        })?;
    }
    ensure_bpffs(pin_dir).map_err(|source| AgentError::Bpffs {
        what: "a bpffs",
        path: pin_dir.to_path_buf(),
        source,
    })
}

/// The index of an interface in this thread's network namespace (0: no such interface).
fn ifindex_of(iface: &str) -> u32 {
    let Ok(c) = CString::new(iface) else {
        return 0;
    };
    // SAFETY: a valid C string.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

/// Every address of every interface of this thread's network namespace, sorted.
fn host_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates the list; it is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: the family says which sockaddr it is.
            match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
                libc::AF_INET => {
                    let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                    out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))));
                }
                libc::AF_INET6 => {
                    let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                    out.push(IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)));
                }
                _ => {}
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_namespace_has_addresses_and_interfaces() {
        let hosts = host_addresses().unwrap();
        assert!(hosts.contains(&"127.0.0.1".parse().unwrap()), "{hosts:?}");
        assert_eq!(ifindex_of("no-such-iface0"), 0);
        assert_ne!(ifindex_of("lo"), 0);
    }
}
