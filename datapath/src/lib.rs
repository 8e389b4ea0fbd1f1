//! ordnet datapath (userspace side): loads the XDP program that `build.rs` built, programs its
//! maps from MapStates, attaches it to interfaces, survives restarts through bpffs pins, and
//! runs the kernel's own decision function in userspace over an exact copy of the maps.
//!
//! From an engine's MapStates to the maps, one name per layer:
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | `ordnet::program::NodeProgram` (controller crate) | | the engine's endpoints, identities and deltas as programming operations, in a safe order |
//! | [`ControlPlane`] | `plane` | the programming operations (endpoints, identities, hosts, Service frontends, interfaces), implemented by [`Datapath`] (the kernel) and [`MemDatapath`] (no kernel) |
//! | [`Control`] | `control` | what both implementations share: endpoint records, rule set sharing, the safe write order (in place, beside, meet) |
//! | [`Store`] | `store` | rule set slots and cell blocks, reference counts, deferred reuse |
//! | [`flatten`], [`RuleSetContent`] | `flat` | a MapState as the datapath's keys; cell words; the meet of two rule sets |
//! | [`TableWriter`] | `tables` | element writes: [`KernelTables`] (`kernel`, the BPF maps, batched) and [`MemTables`] (the in-memory copy) |
//! | [`EventReader`], [`Observed`] | `events` | the programs' verdict events: the ring buffer reader, the decoded event |
//! | [`sys`] | `sys` | the few system calls aya does not wrap (batch map operations, bpffs) |
//! | [`Datapath::attach_native_or_generic`] | `refusal` | the kernel's reason for a refused XDP attachment (netlink extended acknowledgement) |
//!
//! The programs themselves and the decision function are in [`common`] (`ordnet-datapath-common`,
//! `no_std`), shared by the kernel and userspace. The programming operations are the
//! [`ControlPlane`] trait, which [`MemDatapath`] (the same control plane over in-memory tables,
//! no kernel) implements too. The agent and `ordnet lab`
//! use the same API (through `ordnet::program::NodeProgram`, which maps the engine onto it):
//!
//! ```no_run
//! use std::net::IpAddr;
//! use ordnet_datapath::{ControlPlane as _, Datapath, DatapathConfig, EndpointSpec};
//! use ordnet_mapstate::{Direction, MapState, Verdict};
//!
//! // Needs root (CAP_BPF + CAP_NET_ADMIN). With `pin_dir`, maps, program and links are pinned
//! // there and a restarted process adopts them (`Datapath::open`).
//! let mut dp = Datapath::open(DatapathConfig::default())?;
//! dp.set_host_addresses(&["10.0.0.254".parse::<IpAddr>().unwrap()])?;
//! dp.set_identity("10.0.1.7/32".parse().unwrap(), 1234)?; // a remote pod
//! let ingress = MapState::new(Direction::Ingress, Verdict::Deny);
//! let egress = MapState::new(Direction::Egress, Verdict::Allow);
//! let ips = ["10.0.0.5".parse().unwrap()];
//! dp.upsert_endpoint(1, EndpointSpec { ips: &ips, identity: 99, identities: &[], ingress: &ingress, egress: &egress })?;
//! dp.attach("veth1234", aya::programs::XdpMode::default())?;
//! # Ok::<(), ordnet_datapath::DatapathError>(())
//! ```

#[cfg(feature = "bench")]
pub mod bench;
pub mod classes;
mod control;
mod counters;
mod events;
mod flat;
mod kernel;
pub mod leafmap;
mod plane;
#[cfg(feature = "bench")]
pub mod pods;
mod refusal;
mod store;
pub mod sys;
mod tables;
pub mod words;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader, TestRunOptions,
    maps::{Array, HashMap, MapData, MapError, MapType, lpm_trie::LpmTrie},
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TestRun as _, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, SchedClassifierLinkId, TcAttachOptions, TcAttachType},
        xdp::{XdpLink, XdpLinkId},
    },
};
use classes::Classes;
pub use control::{
    Control, ControlError, EndpointAddresses, EndpointSpec, EndpointState, MapFill, ip_key, key_ip,
    net_key,
};
pub use counters::{
    COUNTER_UNATTRIBUTED, CounterOwner, FIRST_RULE_COUNTER, RuleCounters, RuleId, RuleTotals,
    default_counter,
};
pub use events::{DecidedBy, EventReader, Observed};
pub use flat::{
    CellInputs, CellWords, ContentDiff, FlatRuleSet, FlattenError, RuleSetContent, cell_words,
    flatten, flatten_counted, key_hash, meet, same_verdicts, verdict_code,
};
pub use ipnet::IpNet;
pub use kernel::{CtSweep, KernelTables};
pub use ordnet_datapath_common as common;
use ordnet_datapath_common::{
    Verdict,
    layout::{
        BLOCK_WORDS, CELLS_PER_RULESET, COUNTER_EVENTS, COUNTER_EVENTS_LOST,
        COUNTER_EVENTS_SUPPRESSED, COUNTER_HANDED_OFF, COUNTER_UNTRACKED_ALLOWED,
        COUNTER_UNTRACKED_DENIED, CT_LIFETIME_CLOSE_SECS, CT_LIFETIME_OTHER_SECS,
        CT_LIFETIME_SYN_SECS, CT_LIFETIME_TCP_SECS, CT_REFRESH_SECS, Ct4Key, CtEntry, CtKey,
        DEFAULT_CT4_ENTRIES, DEFAULT_CT6_ENTRIES, DEFAULT_IFACE_ENTRIES, DEFAULT_IPCACHE_ENTRIES,
        DEFAULT_IPCIDR_ENTRIES, DEFAULT_MAX_BLOCKS, DEFAULT_MAX_RULESETS, DEFAULT_POLICY_ENTRIES,
        DEFAULT_SVC_ENTRIES, IfaceInfo, IpInfo, IpKey, MAP_BLOCKS, MAP_CELLS, MAP_COUNTERS,
        MAP_CT4, MAP_CT6, MAP_EVENTS, MAP_IFACE, MAP_IP4, MAP_IP6, MAP_IPCIDR, MAP_POLICY,
        MAP_RULE_COUNTERS, MAP_STATE, MAP_SVC, MAP_TC_OBSERVER, MAP_XDP_OBSERVER, PROGRAM_NAME,
        PolicyKey, PolicyValue, RuleCount, State, SvcKey, SvcValue, TC_L3_PROGRAM_NAME,
        TC_OBSERVER_NAME, TC_PROGRAM_NAME, XDP_OBSERVER_NAME, pairs,
    },
};
pub use plane::{ControlPlane, MemDatapath};
pub use store::{SlotInfo, Store, StoreError, WriteStats};
pub use tables::{
    CanonicalCell, CanonicalRecord, CanonicalRuleSet, CanonicalTables, MemTables, Mirror,
    TableWriter, UserCt, Write, WriteError, monotonic_ns,
};

/// The enforcing eBPF object (ELF) built by `build.rs` from `datapath/ebpf` (bin `ordnet-xdp`).
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ordnet-xdp"));

/// The benchmark eBPF object (bin `ordnet-xdp-bench`): floor, layout variants, Cilium reference.
#[cfg(feature = "bench")]
pub static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ordnet-xdp-bench"));

/// Every map of the enforcing programs, by name.
pub const MAP_NAMES: [&str; 11] = [
    MAP_IP4, MAP_IP6, MAP_IPCIDR, MAP_CELLS, MAP_BLOCKS, MAP_POLICY, MAP_CT4, MAP_CT6, MAP_STATE,
    MAP_SVC, MAP_IFACE,
];

/// The oldest kernel the datapath runs on: tcx links (the TC program's attachment) arrived in
/// 6.6; everything else it uses is older.
pub const MIN_KERNEL: (u32, u32) = (6, 6);

/// Errors of the datapath.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// Loading the eBPF object failed.
    #[error("loading the eBPF object: {0}")]
    Object(#[from] Box<aya::EbpfError>),
    /// Loading, attaching, detaching or test-running a program failed.
    #[error("XDP program {PROGRAM_NAME}: {0}")]
    Program(#[from] ProgramError),
    /// A map operation failed.
    #[error("map: {0}")]
    Map(#[from] MapError),
    /// The eBPF object lacks this map or program.
    #[error("the eBPF object has no {0}")]
    Missing(&'static str),
    /// A control-plane operation failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Writing the maps failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The rule set store failed (out of slots or blocks, or a write).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A file system or pin operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file, directory or interface concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel's random source could not give the handoff key (`common::handoff`).
    #[error("drawing the handoff key from the kernel's random source (getrandom): {0}")]
    Random(std::io::Error),
    /// [`Datapath::create`] found maps already pinned in the pin directory.
    #[error("pins already exist in {0}: adopt them (Datapath::adopt/open) or remove them")]
    AlreadyPinned(PathBuf),
    /// [`Datapath::adopt`] did not find every map pinned in the pin directory.
    #[error("no pinned ordnet maps in {0}")]
    NotPinned(PathBuf),
    /// A pinned map does not have the type, key or value size the program expects, or cannot
    /// be memory-mapped.
    #[error("pinned map {name} does not match this program: {detail}")]
    IncompatiblePin {
        /// Name of the map.
        name: &'static str,
        /// What does not match.
        detail: String,
    },
    /// The kernel refused to attach the XDP program to an interface.
    #[error("attaching XDP ({mode}) to {iface}: {cause}{}", kernel_says(.reason))]
    XdpRefused {
        /// The interface.
        iface: String,
        /// The mode asked for (`native`, `generic`, `kernel's choice`).
        mode: &'static str,
        /// The failed call and its errno.
        cause: String,
        /// The kernel's own explanation (the netlink extended acknowledgement), when it gives
        /// one.
        reason: Option<String>,
    },
    /// Nothing is attached to this interface (`tc:IFACE` for the TC program).
    #[error("{0} is not attached")]
    NotAttached(String),
    /// [`Datapath::adopt`] without [`DatapathConfig::pin_dir`].
    #[error("pinning needs a pin directory (DatapathConfig::pin_dir)")]
    NoPinDir,
    /// The running kernel is older than [`MIN_KERNEL`].
    #[error(
        "kernel {found} is too old: ordnet needs Linux {}.{} or newer (tcx links for its \
         post-translation TC program); nothing was loaded or attached",
        MIN_KERNEL.0,
        MIN_KERNEL.1
    )]
    KernelTooOld {
        /// The running kernel's version.
        found: String,
    },
}

fn kernel_says(reason: &Option<String>) -> String {
    reason
        .as_ref()
        .map(|r| format!(" (kernel: {r})"))
        .unwrap_or_default()
}

/// An interface's index, 0 when it does not exist.
fn iface_index(iface: &str) -> u32 {
    std::ffi::CString::new(iface)
        // SAFETY: a valid C string; if_nametoindex only reads it.
        .map(|c| unsafe { libc::if_nametoindex(c.as_ptr()) })
        .unwrap_or(0)
}

/// An error and its sources, `: `-joined (aya's errors put the errno in a source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

/// How the XDP program runs on an interface ([`Datapath::attach_native_or_generic`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XdpAttached {
    /// In the driver (native XDP): before any socket buffer is built.
    Native,
    /// In the kernel's generic (skb) mode, because the driver refused native mode; the refusal
    /// (with the kernel's reason) is kept for reports. Every packet is judged as in native mode,
    /// at a higher cost per packet.
    Generic {
        /// Why native mode was refused.
        native_refused: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DatapathError + '_ {
    move |source| DatapathError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Sizes and pinning of the datapath.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatapathConfig {
    /// A directory on a BPF filesystem for the pins (maps, program, links), e.g.
    /// `/sys/fs/bpf/ordnet`; `None`: nothing is pinned and everything disappears with the
    /// process.
    pub pin_dir: Option<PathBuf>,
    /// Rule set slots (distinct policies on the node, plus the ones being replaced).
    pub max_rulesets: u32,
    /// Refined 256-word cell blocks (port blocks in which some key boundary falls).
    pub max_blocks: u32,
    /// Policy hash capacity (identity keys + wildcard bookkeeping keys of all rule sets).
    pub policy_entries: u32,
    /// Exact ipcache capacity (addresses).
    pub ipcache_entries: u32,
    /// CIDR ipcache capacity (prefixes).
    pub cidr_entries: u32,
    /// IPv4 connection-tracking capacity (flows, LRU; preallocated). Pinned maps keep the size
    /// they were created with.
    pub ct4_entries: u32,
    /// IPv6 connection-tracking capacity.
    pub ct6_entries: u32,
    /// Service frontend capacity (address, protocol, port).
    pub svc_entries: u32,
    /// Local endpoint interface capacity.
    pub iface_entries: u32,
    /// How long a released rule set slot or cell block keeps its contents before reuse (a
    /// packet that read the old reference must still find them).
    pub grace: Duration,
    /// Idle lifetime of a tracked TCP flow.
    pub ct_tcp_lifetime: Duration,
    /// Idle lifetime of a tracked UDP, SCTP or ICMP echo flow.
    pub ct_other_lifetime: Duration,
    /// Idle lifetime of a TCP flow that never got past its SYN (no packet from the responder).
    pub ct_syn_lifetime: Duration,
    /// Idle lifetime of a closed TCP flow (an RST, or a FIN each way).
    pub ct_close_lifetime: Duration,
    /// How often at most a tracked flow's last-seen time is rewritten.
    pub ct_refresh: Duration,
    /// The XDP-to-TC handoff ([`common::handoff`]): on (the default), the TC hook passes a
    /// packet XDP has just passed as a tracked flow's without its own lookup; off, it looks
    /// every packet up (the benchmark's comparison, and a way out should a driver's metadata
    /// ever misbehave).
    pub handoff: bool,
    /// Verdict events ([`common::event`]) per second the node's programs may emit at most
    /// (shared equally by the CPUs); 0 turns them off. Default
    /// [`DEFAULT_EVENTS_PER_SEC`](common::event::DEFAULT_EVENTS_PER_SEC).
    pub events_per_sec: u64,
    /// The per-rule counters ([`Datapath::rule_counts`]): on (the default), every new flow
    /// and denied packet is counted for the rules that decided it. With them and the events
    /// off the programs hand nothing to the observer program (`docs/observe.md` §8: a new
    /// flow or a denied packet then costs what it did before either existed).
    pub rule_counters: bool,
    /// Node-local identity classes (`classes`, `docs/datapath.md` §13): the policy map holds
    /// keys per class of identities that no rule set of the node tells apart, not per identity
    /// (a fraction of the keys at scale). The control plane, the decisions of userspace and
    /// everything they show stay per identity. Maps pinned with classes are adopted with
    /// them whatever this says (and maps pinned without, without them).
    pub classes: bool,
}

impl DatapathConfig {
    /// The global state for a kernel clock of `hz` ticks per second (revision 0).
    pub fn clock_state(&self, hz: u64) -> State {
        let ticks = |d: Duration| (d.as_millis() as u64).saturating_mul(hz) / 1000;
        State {
            revision: 0,
            hz,
            ct_tcp_ticks: ticks(self.ct_tcp_lifetime),
            ct_other_ticks: ticks(self.ct_other_lifetime),
            ct_refresh_ticks: ticks(self.ct_refresh).max(1),
            ct_syn_ticks: u32::try_from(ticks(self.ct_syn_lifetime)).unwrap_or(u32::MAX),
            ct_close_ticks: u32::try_from(ticks(self.ct_close_lifetime)).unwrap_or(u32::MAX),
        }
    }
}

impl Default for DatapathConfig {
    fn default() -> Self {
        DatapathConfig {
            pin_dir: None,
            max_rulesets: DEFAULT_MAX_RULESETS,
            max_blocks: DEFAULT_MAX_BLOCKS,
            policy_entries: DEFAULT_POLICY_ENTRIES,
            ipcache_entries: DEFAULT_IPCACHE_ENTRIES,
            cidr_entries: DEFAULT_IPCIDR_ENTRIES,
            ct4_entries: DEFAULT_CT4_ENTRIES,
            ct6_entries: DEFAULT_CT6_ENTRIES,
            svc_entries: DEFAULT_SVC_ENTRIES,
            iface_entries: DEFAULT_IFACE_ENTRIES,
            grace: Duration::from_millis(20),
            ct_tcp_lifetime: Duration::from_secs(CT_LIFETIME_TCP_SECS),
            ct_other_lifetime: Duration::from_secs(CT_LIFETIME_OTHER_SECS),
            ct_syn_lifetime: Duration::from_secs(CT_LIFETIME_SYN_SECS),
            ct_close_lifetime: Duration::from_secs(CT_LIFETIME_CLOSE_SECS),
            ct_refresh: Duration::from_secs(CT_REFRESH_SECS),
            handoff: true,
            events_per_sec: common::event::DEFAULT_EVENTS_PER_SEC,
            rule_counters: true,
            classes: false,
        }
    }
}

/// Return value of an XDP program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XdpAction {
    /// `XDP_ABORTED` (0).
    Aborted,
    /// `XDP_DROP` (1).
    Drop,
    /// `XDP_PASS` (2).
    Pass,
    /// `XDP_TX` (3).
    Tx,
    /// `XDP_REDIRECT` (4).
    Redirect,
    /// A value outside the known actions.
    Other(u32),
}

impl From<u32> for XdpAction {
    fn from(v: u32) -> Self {
        match v {
            0 => Self::Aborted,
            1 => Self::Drop,
            2 => Self::Pass,
            3 => Self::Tx,
            4 => Self::Redirect,
            other => Self::Other(other),
        }
    }
}

impl From<Verdict> for XdpAction {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Pass => Self::Pass,
            Verdict::Drop => Self::Drop,
        }
    }
}

/// Pins a link as `dir/name` (creating `dir`).
/// The pin file name of interface `iface`'s link: bpffs refuses names with a `.` (`flannel.1`,
/// VLAN devices like `eth0.100`), so each `.` is written as `:`, which no interface name can
/// contain.
pub fn link_pin_name(iface: &str) -> String {
    iface.replace('.', ":")
}

/// The interface a link pin file name stands for ([`link_pin_name`] undone).
pub fn link_pin_iface(pin: &str) -> String {
    pin.replace(':', ".")
}

fn pin_link(fd: FdLink, dir: &Path, iface: &str) -> Result<PinnedLink, DatapathError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join(link_pin_name(iface));
    fd.pin(&path).map_err(|e| DatapathError::Io {
        path: path.clone(),
        source: std::io::Error::other(e),
    })
}

/// Runs the TC program on a frame `repeat` times, as come in on `ingress_ifindex`. (Without
/// metadata: the kernel's test run of a socket buffer program cannot give it any, so the
/// handoff of `common::handoff` is tested with real packets.)
pub fn test_run_tc_program(
    program: &SchedClassifier,
    frame: &[u8],
    ingress_ifindex: u32,
    repeat: u32,
) -> Result<(Verdict, Duration), DatapathError> {
    // `struct __sk_buff` up to and including `ingress_ifindex` (offset 36), zeros elsewhere: the
    // kernel accepts a context with only its settable fields non-zero.
    const SKB_CTX: usize = 192;
    let mut ctx = [0u8; SKB_CTX];
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(&ctx),
        repeat,
        ..TestRunOptions::default()
    })?;
    let verdict = match result.return_value {
        0 => Verdict::Pass,
        _ => Verdict::Drop,
    };
    Ok((verdict, result.duration))
}

/// Result of one `BPF_PROG_TEST_RUN` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestRunOutcome {
    /// What the program returned.
    pub action: XdpAction,
    /// Kernel-measured average duration of one run (total / repeat).
    pub avg_duration: Duration,
    /// The handoff tag the program left in the packet's metadata ([`common::handoff`]), if
    /// any (of the last run).
    pub handoff: Option<u64>,
}

/// Runs an XDP program on a frame `repeat` times (`BPF_PROG_TEST_RUN`).
pub fn test_run_program(
    program: &Xdp,
    frame: &[u8],
    repeat: u32,
) -> Result<TestRunOutcome, ProgramError> {
    // The output starts with the metadata the program left (the kernel copies from
    // `data_meta`): the handoff's worth more than the frame means a tag (its first 8 bytes).
    let meta = common::handoff::HANDOFF_META;
    let mut out = vec![0u8; frame.len() + 256];
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        repeat,
        ..TestRunOptions::default()
    })?;
    let handoff = (result.data_size_out as usize == frame.len() + meta)
        .then(|| u64::from_ne_bytes(out[..8].try_into().expect("8 bytes")));
    Ok(TestRunOutcome {
        action: XdpAction::from(result.return_value),
        avg_duration: result.duration,
        handoff,
    })
}

/// Kernel memory of the maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryReport {
    /// `memlock` of each map (fdinfo): preallocated maps count their full capacity, hash maps
    /// without preallocation and LPM tries what their elements use.
    pub maps: Vec<(&'static str, u64)>,
    /// Sum of `maps`, in bytes.
    pub total: u64,
    /// Number of endpoints programmed.
    pub endpoints: usize,
    /// Number of rule set slots in use.
    pub rulesets: usize,
}

/// What adopting pinned maps found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptReport {
    /// Number of endpoints found in the maps.
    pub endpoints: usize,
    /// Number of rule set slots in use.
    pub rulesets: usize,
    /// Interfaces with an adopted pinned link (`tc:IFACE` for the TC program).
    pub links: Vec<String>,
    /// Repair writes (zero after a clean shutdown).
    pub repairs: WriteStats,
}

/// The loaded XDP and TC programs, their maps and the control state that programs them.
pub struct Datapath {
    ebpf: Ebpf,
    tables: KernelTables,
    control: Control,
    config: DatapathConfig,
    /// The key of the XDP-to-TC handoff tags this load of the programs uses
    /// ([`common::handoff`]); 0 when the handoff is off.
    handoff_key: u64,
    /// Why the handoff is off though the configuration asked for it: the kernel refused the
    /// metadata helper (its verifier's words).
    handoff_refused: Option<String>,
    /// XDP attachments, by interface.
    links: BTreeMap<String, LinkHandle<XdpLinkId>>,
    /// TC (tcx egress) attachments, by interface.
    tc_links: BTreeMap<String, LinkHandle<SchedClassifierLinkId>>,
    /// The interfaces among them that are layer-3 devices (the program `ordnet_tc_l3`, links
    /// pinned under `tc-l3-links/`).
    tc_l3: BTreeSet<String>,
}

/// The programs' event counters ([`Datapath::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathCounters {
    /// TCP packets past the handshake of a flow the tracking table had no live entry for,
    /// denied by the policy (`COUNTER_UNTRACKED_DENIED`): flows evicted from a full table,
    /// expired while idle, lost in a restart, or no connection at all (a scan).
    pub untracked_denied: u64,
    /// The same packets, allowed and tracked again (`COUNTER_UNTRACKED_ALLOWED`).
    pub untracked_allowed: u64,
    /// Packets the TC hook passed on the XDP program's tag, without a lookup
    /// (`COUNTER_HANDED_OFF`, [`common::handoff`]).
    pub handed_off: u64,
    /// Verdict events written into the ring buffer (`COUNTER_EVENTS`).
    pub events: u64,
    /// Verdict events the rate limit refused (`COUNTER_EVENTS_SUPPRESSED`).
    pub events_suppressed: u64,
    /// Verdict events the full ring buffer had no room for (`COUNTER_EVENTS_LOST`).
    pub events_lost: u64,
}

impl DatapathCounters {
    /// Adds `other`'s counts (the counters of several datapaths, e.g. a lab's nodes).
    pub fn add(&mut self, other: &DatapathCounters) {
        self.untracked_denied += other.untracked_denied;
        self.untracked_allowed += other.untracked_allowed;
        self.handed_off += other.handed_off;
        self.events += other.events;
        self.events_suppressed += other.events_suppressed;
        self.events_lost += other.events_lost;
    }
}

/// An attachment: pinned (survives the process) or owned by the loaded program.
enum LinkHandle<Id> {
    Pinned(PinnedLink),
    Owned(Id),
}

/// The version of the maps' layout (their set, types, key and value layouts): bumped by every
/// change an older datapath's pins cannot be adopted across. Pins live in a directory per
/// layout ([`layout_dir`]), so a newer agent finds an older layout's pins beside its own and
/// takes their attachments over ([`Datapath::take_over_links`]) instead of adopting them.
/// Version 2: the ipcache value gained the address's classes (`IpInfo::classes`, 28 → 36 bytes).
pub const LAYOUT_VERSION: u32 = 2;

/// The programs' global holding the handoff key (`ORDNET_HANDOFF_KEY` in the eBPF crate).
const HANDOFF_KEY_GLOBAL: &str = "ORDNET_HANDOFF_KEY";

/// The verifier's line refusing the helper the handoff writes its tag with
/// (`bpf_xdp_adjust_meta`), if `log` has one: "program of this type cannot use helper …" (or
/// "unknown func …" from a kernel without it). Any other failure is not a refusal of the
/// handoff and is not retried without it.
fn refused_helper(log: &str) -> Option<&str> {
    log.lines().map(str::trim).find(|l| {
        l.contains("bpf_xdp_adjust_meta")
            && (l.contains("cannot use helper") || l.starts_with("unknown func"))
    })
}

/// The programs' global holding the per-CPU interval between verdict events
/// (`ORDNET_EVENT_INTERVAL` in the eBPF crate; 0: no events).
const EVENT_INTERVAL_GLOBAL: &str = "ORDNET_EVENT_INTERVAL";

/// The global variable that turns the per-rule counters on (1) or off (0)
/// (`ORDNET_COUNT_RULES` in the eBPF crate).
const RULE_COUNTERS_GLOBAL: &str = "ORDNET_COUNT_RULES";

/// A fresh random key for the handoff tags ([`common::handoff`]), never 0 (0 turns the
/// handoff off). From the kernel's random source: a pod must not be able to guess it.
fn random_handoff_key() -> Result<u64, DatapathError> {
    let mut b = [0u8; 8];
    loop {
        // SAFETY: `b` is a valid, writable buffer of its length.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        if n == b.len() as isize {
            let key = u64::from_ne_bytes(b);
            if key != 0 {
                return Ok(key);
            }
        } else if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            return Err(DatapathError::Random(std::io::Error::last_os_error()));
        }
    }
}

/// The pin directory of this layout under a pin root: `ROOT/vN`.
pub fn layout_dir(root: &Path) -> PathBuf {
    root.join(format!("v{LAYOUT_VERSION}"))
}

/// What [`Datapath::remove_pins`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemovedPins {
    /// The pin directories of layouts removed (empty for a remove_pins of one directory).
    pub layouts: Vec<PathBuf>,
    /// Maps and programs.
    pub objects: usize,
    /// Interfaces whose XDP link pin was removed (the program is detached from them).
    pub xdp_links: Vec<String>,
    /// Interfaces whose TC link pin was removed.
    pub tc_links: Vec<String>,
}

/// The pin directory of the XDP links (one pin per interface).
const XDP_LINKS: &str = "links";
/// The pin directory of the TC links (one pin per interface).
const TC_LINKS: &str = "tc-links";
/// The pin directory of the TC links of layer-3 devices (the program `ordnet_tc_l3`).
const TC_L3_LINKS: &str = "tc-l3-links";

/// The TC program and the pin directory of its links, for a layer-3 device or not.
fn tc_kind(l3: bool) -> (&'static str, &'static str) {
    if l3 {
        (TC_L3_PROGRAM_NAME, TC_L3_LINKS)
    } else {
        (TC_PROGRAM_NAME, TC_LINKS)
    }
}

/// The TC program `name` of `ebpf`, loaded into the kernel first if it is not yet.
fn loaded_classifier<'e>(
    ebpf: &'e mut Ebpf,
    name: &'static str,
) -> Result<&'e mut SchedClassifier, DatapathError> {
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or(DatapathError::Missing(name))?
        .try_into()?;
    if program.fd().is_err() {
        program.load()?;
    }
    Ok(program)
}

/// Loads the observer programs and puts each into its program array ([`MAP_XDP_OBSERVER`],
/// [`MAP_TC_OBSERVER`]), which the deciding programs tail-call for the packets they count or
/// report. The arrays are private to this load: emptied when the process closes them, so
/// pinned programs left running then return their verdicts without observing.
fn load_observers(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    let xdp: &mut Xdp = ebpf
        .program_mut(XDP_OBSERVER_NAME)
        .ok_or(DatapathError::Missing(XDP_OBSERVER_NAME))?
        .try_into()?;
    xdp.load()?;
    let clone = |fd: &aya::programs::ProgramFd| {
        fd.try_clone().map_err(|e| DatapathError::Program(e.into()))
    };
    let xdp = clone(xdp.fd()?)?;
    let tc = clone(loaded_classifier(ebpf, TC_OBSERVER_NAME)?.fd()?)?;
    for (name, fd) in [(MAP_XDP_OBSERVER, &xdp), (MAP_TC_OBSERVER, &tc)] {
        let map = ebpf.map_mut(name).ok_or(DatapathError::Missing(name))?;
        aya::maps::ProgramArray::try_from(map)?.set(0, fd, 0)?;
    }
    Ok(())
}

/// The handle of a new attachment: pinned as `<pin_dir>/<links_dir>/<iface>` (it then survives
/// the process), or owned by the program when there is no pin directory.
fn link_handle<Id, L>(
    pin_dir: Option<PathBuf>,
    links_dir: &str,
    iface: &str,
    id: Id,
    take: impl FnOnce(Id) -> Result<L, ProgramError>,
) -> Result<LinkHandle<Id>, DatapathError>
where
    FdLink: TryFrom<L>,
    <FdLink as TryFrom<L>>::Error: std::error::Error + Send + Sync + 'static,
{
    let Some(dir) = pin_dir else {
        return Ok(LinkHandle::Owned(id));
    };
    let fd = FdLink::try_from(take(id)?).map_err(|e| DatapathError::Io {
        path: dir.clone(),
        source: std::io::Error::other(e),
    })?;
    Ok(LinkHandle::Pinned(pin_link(
        fd,
        &dir.join(links_dir),
        iface,
    )?))
}

/// Removes a pinned attachment (the link detaches when its last reference goes).
fn unpin(pinned: PinnedLink, iface: &str) -> Result<(), DatapathError> {
    drop(pinned.unpin().map_err(|source| DatapathError::Io {
        path: PathBuf::from(iface),
        source,
    })?);
    Ok(())
}

/// Refuses a kernel without tcx (see [`MIN_KERNEL`]).
fn check_kernel() -> Result<(), DatapathError> {
    let v = aya::util::KernelVersion::current().map_err(|e| DatapathError::Io {
        path: PathBuf::from("/proc/sys/kernel/osrelease"),
        source: std::io::Error::other(e.to_string()),
    })?;
    if v < aya::util::KernelVersion::new(MIN_KERNEL.0 as u8, MIN_KERNEL.1 as u8, 0) {
        return Err(DatapathError::KernelTooOld {
            found: format!("{v:?}"),
        });
    }
    Ok(())
}

/// Opens every link pinned in `dir` and hands it to `adopt` (which swaps the new program in);
/// returns the interfaces with the re-opened pins.
fn adopt_links<Id>(
    dir: &Path,
    mut adopt: impl FnMut(FdLink, &Path) -> Result<(), DatapathError>,
) -> Result<BTreeMap<String, LinkHandle<Id>>, DatapathError> {
    let mut links = BTreeMap::new();
    if !dir.exists() {
        return Ok(links);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e| DatapathError::Io {
            path,
            source: std::io::Error::other(e),
        }
    };
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let path = entry.path();
        let name = link_pin_iface(&entry.file_name().to_string_lossy());
        let pinned = PinnedLink::from_pin(&path).map_err(io(&path))?;
        adopt(FdLink::from(pinned), &path)?;
        // The pin keeps the link (and the new program) attached; re-open it as our handle.
        let pinned = PinnedLink::from_pin(&path).map_err(io(&path))?;
        links.insert(name, LinkHandle::Pinned(pinned));
    }
    Ok(links)
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(DatapathError::Missing(name))?;
    Ok(T::try_from(map)?)
}

impl Datapath {
    /// Creates fresh maps (pinned if `config.pin_dir` is set; an existing pin is an error) and
    /// loads the program.
    pub fn create(config: DatapathConfig) -> Result<Datapath, DatapathError> {
        if let Some(dir) = &config.pin_dir
            && MAP_NAMES.iter().any(|m| dir.join(m).exists())
        {
            return Err(DatapathError::AlreadyPinned(dir.clone()));
        }
        let (ebpf, mut tables, handoff_key, handoff_refused) = Self::load(&config)?;
        if config.classes {
            // Of empty maps: no classes yet.
            tables.adopt_classes(config.grace, false, None);
        }
        // The program's clock is jiffies: lifetimes are written in ticks of the kernel's HZ.
        let hz = sys::kernel_hz().unwrap_or(sys::FALLBACK_HZ);
        let mut dp = Datapath {
            ebpf,
            control: Control::new(
                Store::new(config.max_rulesets, config.max_blocks, config.grace)
                    .with_policy_capacity(Self::store_capacity(&config)),
                config.clock_state(hz),
            ),
            tables,
            config,
            handoff_key,
            handoff_refused,
            links: BTreeMap::new(),
            tc_links: BTreeMap::new(),
            tc_l3: BTreeSet::new(),
        };
        dp.control
            .set_ip_capacities(dp.config.ipcache_entries, dp.config.cidr_entries);
        // Revision 1: connection-tracking entries start stamped with a real revision.
        dp.control.set_hosts(&mut dp.tables, &[])?;
        dp.pin_program()?;
        Ok(dp)
    }

    /// Adopts the maps pinned in `config.pin_dir` by an earlier process: loads a new program
    /// instance on them, swaps it into every pinned link (atomically: `bpf_link_update`),
    /// and rebuilds the control state from the maps. Nothing is written in the normal case
    /// (only connection-tracking lifetimes that differ from the configuration, before the swap),
    /// so traffic sees no change at all.
    pub fn adopt(mut config: DatapathConfig) -> Result<(Datapath, AdoptReport), DatapathError> {
        let dir = config.pin_dir.clone().ok_or(DatapathError::NoPinDir)?;
        if !MAP_NAMES.iter().all(|m| dir.join(m).exists()) {
            return Err(DatapathError::NotPinned(dir));
        }
        // The pinned maps keep their sizes: take them from the kernel.
        config = Self::with_pinned_sizes(&dir, config)?;
        let (mut ebpf, mut tables, handoff_key, handoff_refused) = Self::load(&config)?;
        Self::check_pins(&ebpf, &tables)?;
        tables.mirror = tables.read_all()?;
        // Maps with classes keep them, maps without keep none: a switch takes new maps.
        let holds_records = !tables.mirror.ipcache.is_empty() || !tables.mirror.cidr.is_empty();
        config.classes = Classes::classed(&tables.mirror) || (config.classes && !holds_records);
        if config.classes {
            // With the repairs of a batch left half done (none after a complete one).
            tables.adopt_classes(config.grace, false, None);
        }
        let (mut control, repairs) = Control::adopt(
            &mut tables,
            config.max_rulesets,
            config.max_blocks,
            config.grace,
        )?;
        control
            .store_mut()
            .set_policy_capacity(Self::store_capacity(&config));
        control.set_ip_capacities(config.ipcache_entries, config.cidr_entries);
        // The configured lifetimes apply from now on (with the pinned state's measured HZ), and
        // a state pinned by an older version gets the lifetimes it did not have, before the new
        // program is swapped in (the old one ignores them).
        let hz = match control.state().hz {
            0 => sys::kernel_hz().unwrap_or(sys::FALLBACK_HZ),
            hz => hz,
        };
        control.set_clock(&mut tables, &config.clock_state(hz))?;
        // Swap the new programs into the pinned links (atomically: bpf_link_update).
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |e| DatapathError::Io {
                path,
                source: std::io::Error::other(e),
            }
        };
        let links = adopt_links(&dir.join(XDP_LINKS), |fd, path| {
            let program: &mut Xdp = ebpf
                .program_mut(PROGRAM_NAME)
                .ok_or(DatapathError::Missing(PROGRAM_NAME))?
                .try_into()?;
            let id = program.attach_to_link(XdpLink::try_from(fd).map_err(io(path))?)?;
            // The pin keeps the link attached; this handle is not needed.
            drop(FdLink::try_from(program.take_link(id)?).map_err(io(path))?);
            Ok(())
        })?;
        let mut tc_links = BTreeMap::new();
        let mut tc_l3 = BTreeSet::new();
        for l3 in [false, true] {
            let (name, sub) = tc_kind(l3);
            let adopted = adopt_links(&dir.join(sub), |fd, path| {
                let program = loaded_classifier(&mut ebpf, name)?;
                let id =
                    program.attach_to_link(SchedClassifierLink::try_from(fd).map_err(io(path))?)?;
                drop(FdLink::try_from(program.take_link(id)?).map_err(io(path))?);
                Ok(())
            })?;
            if l3 {
                tc_l3.extend(adopted.keys().cloned());
            }
            tc_links.extend(adopted);
        }
        let report = AdoptReport {
            endpoints: control.endpoints().len(),
            rulesets: control.store().slots_in_use().len(),
            links: links
                .keys()
                .cloned()
                .chain(tc_links.keys().map(|k| format!("tc:{k}")))
                .collect(),
            repairs,
        };
        let mut dp = Datapath {
            ebpf,
            tables,
            control,
            config,
            handoff_key,
            handoff_refused,
            links,
            tc_links,
            tc_l3,
        };
        dp.pin_program()?;
        Ok((dp, report))
    }

    /// The policy keys the rule set store may hold: the policy map's capacity, or without
    /// limit with classes (the store's keys are identity-level; the map holds class keys, and
    /// refuses what does not fit itself).
    fn store_capacity(config: &DatapathConfig) -> u32 {
        if config.classes {
            u32::MAX
        } else {
            config.policy_entries
        }
    }

    /// The sizes of the maps pinned in `dir` (the capacities of [`DatapathConfig`]; the other
    /// fields are the defaults), `None` if they cannot all be read.
    pub fn pinned_sizes(dir: &Path) -> Option<DatapathConfig> {
        let config = DatapathConfig {
            pin_dir: Some(dir.to_path_buf()),
            ..DatapathConfig::default()
        };
        Self::with_pinned_sizes(dir, config).ok()
    }

    /// `config` with the capacities of the maps pinned in `dir` (pinned maps keep the size
    /// they were created with).
    fn with_pinned_sizes(
        dir: &Path,
        config: DatapathConfig,
    ) -> Result<DatapathConfig, DatapathError> {
        let size = |m: &str| -> Result<u32, DatapathError> {
            Ok(aya::maps::MapInfo::from_pin(dir.join(m))?.max_entries())
        };
        Ok(DatapathConfig {
            max_rulesets: size(MAP_CELLS)? * 2 / CELLS_PER_RULESET,
            max_blocks: size(MAP_BLOCKS)? * 2 / BLOCK_WORDS,
            policy_entries: size(MAP_POLICY)?,
            ipcache_entries: size(MAP_IP4)?,
            cidr_entries: size(MAP_IPCIDR)?,
            ct4_entries: size(MAP_CT4)?,
            ct6_entries: size(MAP_CT6)?,
            svc_entries: size(MAP_SVC)?,
            iface_entries: size(MAP_IFACE)?,
            ..config
        })
    }

    /// [`Datapath::adopt`] if `config.pin_dir` holds pinned maps, else [`Datapath::create`].
    pub fn open(config: DatapathConfig) -> Result<Datapath, DatapathError> {
        match &config.pin_dir {
            Some(dir) if MAP_NAMES.iter().all(|m| dir.join(m).exists()) => {
                Ok(Self::adopt(config)?.0)
            }
            _ => Self::create(config),
        }
    }

    /// Moves the attachments pinned in `old_dir` (another datapath's, e.g. one of an older map
    /// layout) onto this datapath's programs without detaching them: each link's program is
    /// replaced in place (`bpf_link_update`, atomic per interface), the link is pinned under this
    /// datapath's pin directory and its old pin removed. An interface this datapath is already
    /// attached to keeps its own link (the old one is only unpinned). The interfaces taken over
    /// (`tc:IFACE` for the TC program's).
    pub fn take_over_links(&mut self, old_dir: &Path) -> Result<Vec<String>, DatapathError> {
        let dir = self.config.pin_dir.clone().ok_or(DatapathError::NoPinDir)?;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |e| DatapathError::Io {
                path,
                source: std::io::Error::other(e),
            }
        };
        let mut moved = Vec::new();
        for (sub, xdp, l3) in [
            (XDP_LINKS, true, false),
            (TC_LINKS, false, false),
            (TC_L3_LINKS, false, true),
        ] {
            let old = old_dir.join(sub);
            if !old.exists() {
                continue;
            }
            let mut entries: Vec<PathBuf> = std::fs::read_dir(&old)
                .map_err(io_err(&old))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            entries.sort();
            for path in entries {
                let name = path
                    .file_name()
                    .map(|n| link_pin_iface(&n.to_string_lossy()))
                    .unwrap_or_default();
                let ours = if xdp {
                    self.links.contains_key(&name)
                } else {
                    self.tc_links.contains_key(&name)
                };
                if !ours {
                    let fd = FdLink::from(PinnedLink::from_pin(&path).map_err(io(&path))?);
                    if xdp {
                        let program: &mut Xdp = self
                            .ebpf
                            .program_mut(PROGRAM_NAME)
                            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
                            .try_into()?;
                        let id =
                            program.attach_to_link(XdpLink::try_from(fd).map_err(io(&path))?)?;
                        let handle = link_handle(Some(dir.clone()), XDP_LINKS, &name, id, |id| {
                            program.take_link(id)
                        })?;
                        self.links.insert(name.clone(), handle);
                        moved.push(name.clone());
                    } else {
                        let program = loaded_classifier(&mut self.ebpf, tc_kind(l3).0)?;
                        let id = program.attach_to_link(
                            SchedClassifierLink::try_from(fd).map_err(io(&path))?,
                        )?;
                        let handle = link_handle(Some(dir.clone()), sub, &name, id, |id| {
                            program.take_link(id)
                        })?;
                        self.tc_links.insert(name.clone(), handle);
                        if l3 {
                            self.tc_l3.insert(name.clone());
                        }
                        moved.push(format!("tc:{name}"));
                    }
                }
                // The new pin (or our own link) holds the attachment now.
                std::fs::remove_file(&path).map_err(io_err(&path))?;
            }
        }
        Ok(moved)
    }

    /// Removes every pin in `dir` (maps, programs, links): the maps disappear once no program
    /// or process uses them, and pinned links detach (unless a process still holds them, i.e.
    /// a running agent). Says what it removed.
    pub fn remove_pins(dir: &Path) -> Result<RemovedPins, DatapathError> {
        let mut removed = RemovedPins::default();
        for name in
            MAP_NAMES
                .iter()
                .copied()
                .chain([PROGRAM_NAME, TC_PROGRAM_NAME, TC_L3_PROGRAM_NAME])
        {
            let p = dir.join(name);
            if p.exists() {
                std::fs::remove_file(&p).map_err(io_err(&p))?;
                removed.objects += 1;
            }
        }
        for (sub, xdp) in [(XDP_LINKS, true), (TC_LINKS, false), (TC_L3_LINKS, false)] {
            let out = if xdp {
                &mut removed.xdp_links
            } else {
                &mut removed.tc_links
            };
            let links = dir.join(sub);
            if links.exists() {
                for e in std::fs::read_dir(&links).map_err(io_err(&links))? {
                    let e = e.map_err(io_err(&links))?;
                    out.push(link_pin_iface(&e.file_name().to_string_lossy()));
                }
                out.sort();
                std::fs::remove_dir_all(&links).map_err(io_err(&links))?;
            }
        }
        Ok(removed)
    }

    /// Loads the object and the programs with the handoff [`DatapathConfig::handoff`] asks for:
    /// if the kernel refuses the XDP metadata helper (`bpf_xdp_adjust_meta`: seen on a 6.18
    /// kernel that allows every other XDP helper the program uses), the programs are loaded
    /// again without the handoff (key 0: the verifier never reaches the helper) and the
    /// kernel's reason is returned with them (the TC hook then looks every forwarded packet up
    /// itself: correct, one lookup more per packet).
    fn load(
        config: &DatapathConfig,
    ) -> Result<(Ebpf, KernelTables, u64, Option<String>), DatapathError> {
        check_kernel()?;
        let key = if config.handoff {
            random_handoff_key()?
        } else {
            0
        };
        let err = match Self::load_with(config, key) {
            Ok((ebpf, tables)) => return Ok((ebpf, tables, key, None)),
            Err(e) => e,
        };
        let why = match &err {
            DatapathError::Program(ProgramError::LoadError { verifier_log, .. }) if key != 0 => {
                refused_helper(&verifier_log.to_string()).map(str::to_string)
            }
            _ => None,
        };
        let Some(why) = why else {
            return Err(err);
        };
        let (ebpf, tables) = Self::load_with(config, 0)?;
        Ok((ebpf, tables, 0, Some(why)))
    }

    fn load_with(
        config: &DatapathConfig,
        handoff_key: u64,
    ) -> Result<(Ebpf, KernelTables), DatapathError> {
        let cpus = aya::util::nr_cpus().map_or(1, |n| n as u64);
        let event_interval = common::event::interval_ns(config.events_per_sec, cpus);
        let rule_counters = u64::from(config.rule_counters);
        let mut loader = EbpfLoader::new();
        loader
            .override_global(HANDOFF_KEY_GLOBAL, &handoff_key, true)
            .override_global(EVENT_INTERVAL_GLOBAL, &event_interval, true)
            .override_global(RULE_COUNTERS_GLOBAL, &rule_counters, true)
            .map_max_entries(MAP_IP4, config.ipcache_entries)
            .map_max_entries(MAP_IP6, config.ipcache_entries)
            .map_max_entries(MAP_IPCIDR, config.cidr_entries)
            .map_max_entries(MAP_CELLS, pairs(config.max_rulesets * CELLS_PER_RULESET))
            .map_max_entries(MAP_BLOCKS, pairs(config.max_blocks * BLOCK_WORDS))
            .map_max_entries(MAP_POLICY, config.policy_entries)
            .map_max_entries(MAP_CT4, config.ct4_entries)
            .map_max_entries(MAP_CT6, config.ct6_entries)
            .map_max_entries(MAP_SVC, config.svc_entries)
            .map_max_entries(MAP_IFACE, config.iface_entries);
        if let Some(dir) = &config.pin_dir {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
            for name in MAP_NAMES {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader.load(EBPF_OBJECT).map_err(Box::new)?;
        let program: &mut Xdp = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?;
        program.load()?;
        // The layer-3 TC program is loaded when a layer-3 device needs it (`loaded_classifier`):
        // most nodes have none, and each program costs about a second of verification.
        loaded_classifier(&mut ebpf, TC_PROGRAM_NAME)?;
        load_observers(&mut ebpf)?;
        let cells: Array<MapData, u64> = take(&mut ebpf, MAP_CELLS)?;
        let blocks: Array<MapData, u64> = take(&mut ebpf, MAP_BLOCKS)?;
        let (cell_words, block_words) = (cells.len() * 2, blocks.len() * 2);
        let mirror = MemTables::new(cell_words, block_words);
        let map_err = |name: &'static str| {
            move |source| DatapathError::IncompatiblePin {
                name,
                detail: format!("cannot mmap it ({source}): not created with BPF_F_MMAPABLE?"),
            }
        };
        use aya::maps::IterableMap as _;
        use std::os::fd::AsFd as _;
        let cells_mem = sys::MappedWords::new(cells.map().fd().as_fd(), cell_words as usize)
            .map_err(map_err(MAP_CELLS))?;
        let blocks_mem = sys::MappedWords::new(blocks.map().fd().as_fd(), block_words as usize)
            .map_err(map_err(MAP_BLOCKS))?;
        let tables = KernelTables {
            cells_mem,
            blocks_mem,
            ip4: take(&mut ebpf, MAP_IP4)?,
            ip6: take(&mut ebpf, MAP_IP6)?,
            cidr: take::<LpmTrie<MapData, IpKey, IpInfo>>(&mut ebpf, MAP_IPCIDR)?,
            cells,
            blocks,
            policy: take::<HashMap<MapData, PolicyKey, PolicyValue>>(&mut ebpf, MAP_POLICY)?,
            ct4: take::<HashMap<MapData, Ct4Key, CtEntry>>(&mut ebpf, MAP_CT4)?,
            ct6: take::<HashMap<MapData, CtKey, CtEntry>>(&mut ebpf, MAP_CT6)?,
            state: take::<Array<MapData, State>>(&mut ebpf, MAP_STATE)?,
            svc: take::<HashMap<MapData, SvcKey, SvcValue>>(&mut ebpf, MAP_SVC)?,
            iface: take::<HashMap<MapData, u32, IfaceInfo>>(&mut ebpf, MAP_IFACE)?,
            mirror,
            layer: None,
            policy_capacity: config.policy_entries as usize,
        };
        Ok((ebpf, tables))
    }

    /// Pinned maps are opened by path without any check: make sure they are ours.
    fn check_pins(_ebpf: &Ebpf, t: &KernelTables) -> Result<(), DatapathError> {
        use aya::maps::IterableMap as _;
        let checks: [(&'static str, &MapData, MapType, usize, usize); 11] = [
            (MAP_IP4, t.ip4.map(), MapType::Hash, 4, size_of::<IpInfo>()),
            (MAP_IP6, t.ip6.map(), MapType::Hash, 16, size_of::<IpInfo>()),
            (
                MAP_IPCIDR,
                t.cidr.map(),
                MapType::LpmTrie,
                4 + size_of::<IpKey>(),
                size_of::<IpInfo>(),
            ),
            (MAP_CELLS, t.cells.map(), MapType::Array, 4, 8),
            (MAP_BLOCKS, t.blocks.map(), MapType::Array, 4, 8),
            (
                MAP_POLICY,
                t.policy.map(),
                MapType::Hash,
                size_of::<PolicyKey>(),
                size_of::<PolicyValue>(),
            ),
            (
                MAP_CT4,
                t.ct4.map(),
                MapType::LruHash,
                size_of::<Ct4Key>(),
                size_of::<CtEntry>(),
            ),
            (
                MAP_CT6,
                t.ct6.map(),
                MapType::LruHash,
                size_of::<CtKey>(),
                size_of::<CtEntry>(),
            ),
            (
                MAP_STATE,
                t.state.map(),
                MapType::Array,
                4,
                size_of::<State>(),
            ),
            (
                MAP_SVC,
                t.svc.map(),
                MapType::Hash,
                size_of::<SvcKey>(),
                size_of::<SvcValue>(),
            ),
            (
                MAP_IFACE,
                t.iface.map(),
                MapType::Hash,
                4,
                size_of::<IfaceInfo>(),
            ),
        ];
        for (name, map, ty, key, value) in checks {
            let info = map.info()?;
            let actual = (
                info.map_type()?,
                info.key_size() as usize,
                info.value_size() as usize,
            );
            if actual != (ty, key, value) {
                return Err(DatapathError::IncompatiblePin {
                    name,
                    detail: format!("type/key/value {actual:?}, expected {:?}", (ty, key, value)),
                });
            }
        }
        Ok(())
    }

    fn pin_program(&mut self) -> Result<(), DatapathError> {
        let Some(dir) = self.config.pin_dir.clone() else {
            return Ok(());
        };
        for name in [PROGRAM_NAME, TC_PROGRAM_NAME, TC_L3_PROGRAM_NAME] {
            let path = dir.join(name);
            if path.exists() {
                std::fs::remove_file(&path).map_err(io_err(&path))?;
            }
            // The layer-3 program is pinned once it is loaded (its first attachment).
            if self.ebpf.program(name).is_none_or(|p| p.fd().is_err()) {
                continue;
            }
            let pinned = if name == PROGRAM_NAME {
                self.program_mut()?.pin(&path)
            } else {
                self.classifier_mut(name)?.pin(&path)
            };
            pinned.map_err(|e| DatapathError::Io {
                path: path.clone(),
                source: std::io::Error::other(e),
            })?;
        }
        Ok(())
    }

    /// The effective configuration (after adoption: the pinned maps' sizes).
    pub fn config(&self) -> &DatapathConfig {
        &self.config
    }

    /// How many instructions the kernel's verifier walked to load each loaded program
    /// (`verified_insns`; its limit is 1,000,000), by program name.
    pub fn verified_instructions(&self) -> Vec<(&'static str, u32)> {
        [
            PROGRAM_NAME,
            TC_PROGRAM_NAME,
            TC_L3_PROGRAM_NAME,
            XDP_OBSERVER_NAME,
            TC_OBSERVER_NAME,
        ]
        .into_iter()
        .filter_map(|name| {
            let info = self.ebpf.program(name)?.info().ok()?;
            Some((name, info.verified_instruction_count()?))
        })
        .collect()
    }

    /// The loaded XDP program.
    pub fn program(&self) -> Result<&Xdp, DatapathError> {
        Ok(self
            .ebpf
            .program(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?)
    }

    fn program_mut(&mut self) -> Result<&mut Xdp, DatapathError> {
        Ok(self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?)
    }

    /// The loaded TC program.
    pub fn tc_program(&self) -> Result<&SchedClassifier, DatapathError> {
        Ok(self
            .ebpf
            .program(TC_PROGRAM_NAME)
            .ok_or(DatapathError::Missing(TC_PROGRAM_NAME))?
            .try_into()?)
    }

    fn classifier_mut(
        &mut self,
        name: &'static str,
    ) -> Result<&mut SchedClassifier, DatapathError> {
        Ok(self
            .ebpf
            .program_mut(name)
            .ok_or(DatapathError::Missing(name))?
            .try_into()?)
    }

    /// Attaches the TC program to an interface's egress (tcx, last in its chain): a local
    /// endpoint's host-side interface (packets delivered to the pod) or the uplink (packets
    /// leaving the node). Pinned as `<pin_dir>/tc-links/<iface>` like [`Datapath::attach`].
    pub fn attach_tc(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_tc_program(iface, false)
    }

    /// [`Datapath::attach_tc`] for a layer-3 device (IPIP, GRE, SIT, ip6tnl, WireGuard: packets
    /// without an Ethernet header): the program `ordnet_tc_l3`, pinned under `tc-l3-links/`.
    pub fn attach_tc_l3(&mut self, iface: &str) -> Result<(), DatapathError> {
        self.attach_tc_program(iface, true)
    }

    fn attach_tc_program(&mut self, iface: &str, l3: bool) -> Result<(), DatapathError> {
        let pin_dir = self.config.pin_dir.clone();
        let (name, sub) = tc_kind(l3);
        let loaded = self.ebpf.program(name).is_some_and(|p| p.fd().is_ok());
        loaded_classifier(&mut self.ebpf, name)?;
        if !loaded {
            self.pin_program()?;
        }
        let program = self.classifier_mut(name)?;
        let id = program.attach_with_options(
            iface,
            TcAttachType::Egress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )?;
        let handle = link_handle(pin_dir, sub, iface, id, |id| program.take_link(id))?;
        self.tc_links.insert(iface.to_string(), handle);
        if l3 {
            self.tc_l3.insert(iface.to_string());
        } else {
            self.tc_l3.remove(iface);
        }
        Ok(())
    }

    /// Whether the TC attachment of `iface` is the layer-3 program's.
    pub fn tc_is_l3(&self, iface: &str) -> bool {
        self.tc_l3.contains(iface)
    }

    /// Detaches the TC program from an interface (and removes the link's pin).
    pub fn detach_tc(&mut self, iface: &str) -> Result<(), DatapathError> {
        let l3 = self.tc_l3.remove(iface);
        match self.tc_links.remove(iface) {
            Some(LinkHandle::Pinned(pinned)) => unpin(pinned, iface),
            Some(LinkHandle::Owned(id)) => Ok(self.classifier_mut(tc_kind(l3).0)?.detach(id)?),
            None => Err(DatapathError::NotAttached(format!("tc:{iface}"))),
        }
    }

    /// Interfaces the TC program is attached to.
    pub fn tc_attached(&self) -> impl Iterator<Item = &str> {
        self.tc_links.keys().map(String::as_str)
    }

    /// Runs the TC program once on `frame` as if it had come in on interface
    /// `ingress_ifindex` (`BPF_PROG_TEST_RUN` with a `__sk_buff` context); returns its verdict
    /// (`Pass` = `TC_ACT_OK`, `Drop` = `TC_ACT_SHOT`) and the kernel's average duration.
    pub fn test_run_tc(
        &self,
        frame: &[u8],
        ingress_ifindex: u32,
        repeat: u32,
    ) -> Result<(Verdict, Duration), DatapathError> {
        test_run_tc_program(self.tc_program()?, frame, ingress_ifindex, repeat)
    }

    /// Attaches the program to an interface (a pod's host-side veth, or the node's uplink).
    /// With a pin directory the link is pinned (`<pin_dir>/links/<iface>`) and survives this
    /// process; without one it is detached when the `Datapath` is dropped.
    ///
    /// A refusal is [`DatapathError::XdpRefused`], with the kernel's reason where it gives one.
    pub fn attach(&mut self, iface: &str, mode: XdpMode) -> Result<(), DatapathError> {
        let pin_dir = self.config.pin_dir.clone();
        let program = self.program_mut()?;
        let id = match program.attach(iface, mode) {
            Ok(id) => id,
            Err(e @ ProgramError::UnknownInterface { .. }) => return Err(e.into()),
            Err(e) => {
                let flags = match mode {
                    XdpMode::Default => 0,
                    XdpMode::Skb => 2,
                    XdpMode::Driver => 4,
                    XdpMode::Hardware => 8,
                };
                let reason = program.fd().ok().and_then(|fd| {
                    use std::os::fd::AsFd as _;
                    refusal::xdp_refusal(iface_index(iface), fd.as_fd(), flags)
                });
                return Err(DatapathError::XdpRefused {
                    iface: iface.to_string(),
                    mode: match mode {
                        XdpMode::Default => "kernel's choice",
                        XdpMode::Skb => "generic",
                        XdpMode::Driver => "native",
                        XdpMode::Hardware => "offloaded",
                    },
                    cause: error_chain(&e),
                    reason,
                });
            }
        };
        let handle = link_handle(pin_dir, XDP_LINKS, iface, id, |id| program.take_link(id))?;
        self.links.insert(iface.to_string(), handle);
        Ok(())
    }

    /// Attaches the program natively (in the driver) where the driver allows it, else in
    /// generic mode, and says which: a driver that refuses native XDP (a queue layout it does
    /// not support, a device without XDP support) must not leave the interface unenforced.
    /// Fails only when both are refused (the message carries both reasons).
    pub fn attach_native_or_generic(&mut self, iface: &str) -> Result<XdpAttached, DatapathError> {
        let native = match self.attach(iface, XdpMode::Driver) {
            Ok(()) => return Ok(XdpAttached::Native),
            Err(e @ DatapathError::XdpRefused { .. }) => e,
            Err(e) => return Err(e),
        };
        match self.attach(iface, XdpMode::Skb) {
            Ok(()) => Ok(XdpAttached::Generic {
                native_refused: native.to_string(),
            }),
            Err(DatapathError::XdpRefused {
                iface,
                cause,
                reason,
                ..
            }) => Err(DatapathError::XdpRefused {
                iface,
                mode: "native, then generic",
                cause: format!("{native}; then {cause}"),
                reason,
            }),
            Err(e) => Err(e),
        }
    }

    /// Detaches the program from an interface (and removes the link's pin).
    pub fn detach(&mut self, iface: &str) -> Result<(), DatapathError> {
        match self.links.remove(iface) {
            Some(LinkHandle::Pinned(pinned)) => unpin(pinned, iface),
            Some(LinkHandle::Owned(id)) => Ok(self.program_mut()?.detach(id)?),
            None => Err(DatapathError::NotAttached(iface.to_string())),
        }
    }

    /// The interface index a pinned attachment is bound to: `Some(0)` when its interface was
    /// deleted (the link is defunct), `None` when `iface` is not attached or its link is not
    /// pinned. A new interface with the same name is a different index: the caller must detach
    /// and attach again.
    pub fn link_ifindex(&self, iface: &str) -> Result<Option<u32>, DatapathError> {
        self.pinned_link_ifindex(iface, XDP_LINKS)
    }

    /// [`Datapath::link_ifindex`] of the TC link.
    pub fn tc_link_ifindex(&self, iface: &str) -> Result<Option<u32>, DatapathError> {
        self.pinned_link_ifindex(iface, tc_kind(self.tc_l3.contains(iface)).1)
    }

    fn pinned_link_ifindex(&self, iface: &str, sub: &str) -> Result<Option<u32>, DatapathError> {
        let pinned = if sub == XDP_LINKS {
            matches!(self.links.get(iface), Some(LinkHandle::Pinned(_)))
        } else {
            matches!(self.tc_links.get(iface), Some(LinkHandle::Pinned(_)))
        };
        if !pinned {
            return Ok(None);
        }
        let Some(dir) = &self.config.pin_dir else {
            return Ok(None);
        };
        let path = dir.join(sub).join(link_pin_name(iface));
        let fd = sys::obj_get(&path).map_err(io_err(&path))?;
        use std::os::fd::AsFd as _;
        let index = sys::xdp_link_ifindex(fd.as_fd()).map_err(io_err(&path))?;
        Ok(Some(index))
    }

    /// Interfaces the program is attached to (by this process or adopted from pins).
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.links.keys().map(String::as_str)
    }

    // ---------------------------------------------------------------- verdicts

    /// Runs the program once on `frame` (at least 14 bytes: the kernel rejects shorter XDP
    /// test input with `EINVAL`).
    pub fn test_run(&self, frame: &[u8]) -> Result<TestRunOutcome, DatapathError> {
        self.test_run_repeat(frame, 1)
    }

    /// The key of the XDP-to-TC handoff tags of this load of the programs
    /// ([`common::handoff::tag`]).
    pub fn handoff_key(&self) -> u64 {
        self.handoff_key
    }

    /// Why the XDP-to-TC handoff is off though [`DatapathConfig::handoff`] asked for it (the
    /// kernel refused the XDP metadata helper), if it is.
    pub fn handoff_refused(&self) -> Option<&str> {
        self.handoff_refused.as_deref()
    }

    /// Runs the program `repeat` times on `frame`; `avg_duration` is the kernel's per-run
    /// average (program + test harness reset).
    pub fn test_run_repeat(
        &self,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutcome, DatapathError> {
        Ok(test_run_program(self.program()?, frame, repeat)?)
    }

    /// Keeps no copy of the policy keys in the userspace copy of the maps: the rule set store
    /// has them, decisions read them there ([`MemTables::keys_in_store`]). Call it after
    /// [`Datapath::adopt`] (which reads the keys back from the kernel).
    pub fn keep_keys_in_store(&mut self) {
        match &mut self.tables.layer {
            // The class-level mirror keeps its keys (few; the classes are rebuilt from them).
            Some(layer) => layer.identity.keep_keys_in_store(),
            None => self.tables.mirror.keep_keys_in_store(),
        }
    }

    /// The class translation, when the maps hold classes ([`DatapathConfig::classes`]).
    pub fn classes(&self) -> Option<&Classes> {
        self.tables.classes()
    }

    /// Compares the kernel maps with the userspace copy; returns the differences.
    pub fn verify(&self) -> Result<Vec<String>, DatapathError> {
        let kernel = self.tables.read_all()?;
        // With classes the maps hold the class-level writes: compare with their mirror.
        let mine = if self.tables.layer.is_some() {
            &self.tables.mirror
        } else {
            self.tables()
        };
        let mut diffs = Vec::new();
        if kernel.ipcache != mine.ipcache {
            diffs.push(format!(
                "ipcache: kernel {} entries, userspace {}",
                kernel.ipcache.len(),
                mine.ipcache.len()
            ));
        }
        if kernel.cidr != mine.cidr {
            diffs.push("cidr differs".into());
        }
        if kernel.cells != mine.cells {
            let n = kernel
                .cells
                .iter()
                .zip(mine.cells.iter())
                .filter(|(a, b)| a != b)
                .count();
            diffs.push(format!("cells: {n} words differ"));
        }
        // Blocks that no cell references may hold anything.
        let referenced: Vec<u32> = mine
            .cells
            .iter()
            .filter(|w| *w & ordnet_datapath_common::layout::CELL_REFINED != 0)
            .map(|w| w & !ordnet_datapath_common::layout::CELL_REFINED)
            .collect();
        for b in referenced {
            let r = (b * BLOCK_WORDS) as usize..((b + 1) * BLOCK_WORDS) as usize;
            if kernel.blocks[r.clone()] != mine.blocks[r] {
                diffs.push(format!("block {b} differs"));
            }
        }
        // Without a copy of the keys in the tables, the rule set store's are what was written.
        let from_store: BTreeMap<_, _>;
        let mine_policy = if mine.keys_in_store {
            from_store = self.control().store().policy_keys().collect();
            &from_store
        } else {
            &mine.policy
        };
        if &kernel.policy != mine_policy {
            diffs.push(format!(
                "policy: kernel {} keys, userspace {}",
                kernel.policy.len(),
                mine_policy.len()
            ));
        }
        if kernel.state != mine.state {
            diffs.push(format!(
                "state: kernel {:?}, userspace {:?}",
                kernel.state, mine.state
            ));
        }
        Ok(diffs)
    }

    /// Every connection-tracking entry.
    pub fn ct_entries(&self) -> Result<Vec<(CtKey, CtEntry)>, DatapathError> {
        Ok(self.tables.ct_entries()?)
    }

    /// Forgets every tracked flow.
    pub fn ct_clear(&mut self) -> Result<(), DatapathError> {
        Ok(self.tables.ct_clear()?)
    }

    /// Removes the connection-tracking entries that have expired (each by its own lifetime,
    /// `common::ct_lifetime`, on the program's clock: the kernel's jiffies now) and reports
    /// the tables' fill. Expired entries are ignored by the program anyway; removing them keeps
    /// them from taking the place of idle live flows when the LRU has to evict.
    pub fn ct_sweep(&mut self) -> Result<CtSweep, DatapathError> {
        let now = sys::kernel_jiffies().ok_or_else(|| DatapathError::Io {
            path: PathBuf::from("/proc/timer_list"),
            source: std::io::Error::other("the kernel's jiffies cannot be read"),
        })?;
        let state = *self.control.state();
        Ok(self.tables.ct_sweep(&state, now)?)
    }

    /// Copies the connection-tracking entries of the maps pinned in `old_dir` (another
    /// datapath's, e.g. maps set aside to grow or an older layout's) into this datapath's, made
    /// stale so each flow is re-checked under this datapath's policy at its next packet
    /// ([`KernelTables::ct_carry_from`]). Called before and after [`Datapath::take_over_links`]
    /// so that tracked flows survive the switch of programs. The entries copied per family.
    pub fn ct_carry_from(&mut self, old_dir: &Path) -> Result<[u64; 2], DatapathError> {
        Ok(self.tables.ct_carry_from(old_dir)?)
    }

    /// The programs' event counters, summed over CPUs, since this program pair was loaded
    /// (a restart or an adoption loads a new one: they start again from zero).
    pub fn counters(&self) -> Result<DatapathCounters, DatapathError> {
        let map = self
            .ebpf
            .map(MAP_COUNTERS)
            .ok_or(DatapathError::Missing(MAP_COUNTERS))?;
        let counters = aya::maps::PerCpuArray::<_, u64>::try_from(map)?;
        let sum = |index: u32| -> Result<u64, DatapathError> {
            Ok(counters.get(&index, 0)?.iter().sum())
        };
        Ok(DatapathCounters {
            untracked_denied: sum(COUNTER_UNTRACKED_DENIED)?,
            untracked_allowed: sum(COUNTER_UNTRACKED_ALLOWED)?,
            handed_off: sum(COUNTER_HANDED_OFF)?,
            events: sum(COUNTER_EVENTS)?,
            events_suppressed: sum(COUNTER_EVENTS_SUPPRESSED)?,
            events_lost: sum(COUNTER_EVENTS_LOST)?,
        })
    }

    /// The per-rule counters' sums over CPUs, per element of [`MAP_RULE_COUNTERS`] up to the
    /// highest one given out (the others have counted nothing), since this program pair was
    /// loaded.
    pub fn rule_counts(&self) -> Result<Vec<RuleCount>, DatapathError> {
        let map = self
            .ebpf
            .map(MAP_RULE_COUNTERS)
            .ok_or(DatapathError::Missing(MAP_RULE_COUNTERS))?;
        let counters = aya::maps::PerCpuArray::<_, RuleCount>::try_from(map)?;
        let end = self
            .control
            .rule_counters()
            .high_water()
            .min(counters.len());
        (0..end)
            .map(|i| {
                Ok(counters
                    .get(&i, 0)?
                    .iter()
                    .fold(RuleCount::default(), |a, c| a.plus(*c)))
            })
            .collect()
    }

    /// Adds what the rule counters counted since the last call to `totals`, then, when most
    /// elements are taken, frees those no key names any more (their counts are in `totals`
    /// by then) and forgets the totals of rules no element counts for any more.
    pub fn collect_rule_counts(&mut self, totals: &mut RuleTotals) -> Result<(), DatapathError> {
        let sums = self.rule_counts()?;
        totals.add(&sums, self.control.rule_counters());
        if self.control.rule_counters().nearly_full() && self.control.retain_rule_counters() > 0 {
            totals.forget_unowned(self.control.rule_counters());
        }
        Ok(())
    }

    /// The reader of the programs' verdict events ([`common::event`]): the ring buffer of this
    /// load of the programs, handed out once (`None` after that).
    pub fn events(&mut self) -> Result<Option<EventReader>, DatapathError> {
        let Some(map) = self.ebpf.take_map(MAP_EVENTS) else {
            return Ok(None);
        };
        Ok(Some(EventReader::new(aya::maps::RingBuf::try_from(map)?)))
    }

    /// Kernel memory of every map.
    pub fn memory(&self) -> Result<MemoryReport, DatapathError> {
        use aya::maps::IterableMap as _;
        use std::os::fd::AsFd as _;
        let t = &self.tables;
        let fds: [(&'static str, &MapData); 9] = [
            (MAP_IP4, t.ip4.map()),
            (MAP_IP6, t.ip6.map()),
            (MAP_IPCIDR, t.cidr.map()),
            (MAP_CELLS, t.cells.map()),
            (MAP_BLOCKS, t.blocks.map()),
            (MAP_POLICY, t.policy.map()),
            (MAP_CT4, t.ct4.map()),
            (MAP_CT6, t.ct6.map()),
            (MAP_STATE, t.state.map()),
        ];
        let mut maps = Vec::new();
        for (name, map) in fds {
            let bytes = sys::map_memlock(map.fd().as_fd()).map_err(|source| DatapathError::Io {
                path: PathBuf::from(name),
                source,
            })?;
            maps.push((name, bytes));
        }
        Ok(MemoryReport {
            total: maps.iter().map(|(_, b)| b).sum(),
            maps,
            endpoints: self.endpoints().len(),
            rulesets: self.rulesets().len(),
        })
    }
}

/// The programming operations (endpoints, identities, host addresses, change sets) and the
/// userspace decision, shared with [`MemDatapath`].
impl ControlPlane for Datapath {
    fn parts(&mut self) -> (&mut Control, &mut dyn TableWriter) {
        (&mut self.control, &mut self.tables)
    }

    fn control(&self) -> &Control {
        &self.control
    }

    fn tables(&self) -> &MemTables {
        self.tables.tables()
    }

    fn reclaim_due(&self) -> Option<std::time::Instant> {
        self.control.reclaim_due(&self.tables)
    }

    fn policy_map_keys(&self) -> usize {
        match &self.tables.layer {
            Some(_) => self.tables.mirror.policy.len(),
            None => self.control.store().policy_keys_held(),
        }
    }

    fn fill(&self) -> Vec<MapFill> {
        let mut fill = self.control.fill(self.tables());
        // The store counts identity keys and, with classes, has no limit: the map's own.
        for f in fill.iter_mut().filter(|f| f.map == MAP_POLICY) {
            f.entries = self.policy_map_keys() as u64;
            f.capacity = u64::from(self.config.policy_entries);
        }
        fill
    }
}

// The agent keeps the datapath in an async task: it must be `Send`.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Datapath>();
};

#[cfg(test)]
mod tests {
    use super::refused_helper;

    /// Only the verifier's refusal of the metadata helper turns the handoff off: not the
    /// helper's call in a log that failed for another reason.
    #[test]
    fn only_a_refused_metadata_helper_is_a_refusal() {
        let refused = "0: R1=ctx() R10=fp0\n2: (85) call bpf_xdp_adjust_meta#54\n\
                       program of this type cannot use helper bpf_xdp_adjust_meta#54\n\
                       processed 3 insns (limit 1000000)";
        assert_eq!(
            refused_helper(refused),
            Some("program of this type cannot use helper bpf_xdp_adjust_meta#54")
        );
        let unknown = "2: (85) call unknown#54\nunknown func bpf_xdp_adjust_meta#54\n";
        assert_eq!(
            refused_helper(unknown),
            Some("unknown func bpf_xdp_adjust_meta#54")
        );
        let other = "2: (85) call bpf_xdp_adjust_meta#54\n7: R2 invalid mem access 'scalar'\n";
        assert_eq!(refused_helper(other), None);
        assert_eq!(refused_helper(""), None);
    }
}
