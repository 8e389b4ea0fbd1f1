//! Map names, key and value layouts of the enforcing datapath (`docs/datapath.md` §4).
//!
//! Every type here is `#[repr(C)]`, made of integers and byte arrays only, with explicit padding
//! fields, so every byte the kernel hashes or compares is defined and the kernel and userspace
//! see the same bytes.
//!
//! | map | kind | key → value |
//! |---|---|---|
//! | [`MAP_IP4`], [`MAP_IP6`] | hash, no prealloc | one address (`u32` / `[u32; 4]`) → [`IpInfo`] |
//! | [`MAP_IPCIDR`] | LPM trie | [`IpKey`] prefix → [`IpInfo`] |
//! | [`MAP_CELLS`] | array | rule set × protocol slot × high port byte → cell word |
//! | [`MAP_BLOCKS`] | array | block × low port byte → cell word |
//! | [`MAP_POLICY`] | hash, no prealloc | [`PolicyKey`] (rule set, identity, prefix) → [`PolicyValue`] |
//! | [`MAP_CT4`], [`MAP_CT6`] | LRU hash | canonical 5-tuple ([`Ct4Key`] / [`CtKey`]) → [`CtEntry`] |
//! | [`MAP_STATE`] | array, 1 entry | 0 → [`State`] (global policy revision) |
//! | [`MAP_SVC`] | hash, no prealloc | [`SvcKey`] (Service frontend: address, protocol, port) → [`SvcValue`] |
//! | [`MAP_IFACE`] | hash, no prealloc | interface index (a local endpoint's host-side interface) → [`IfaceInfo`] |

/// Name of the XDP program in the eBPF object.
pub const PROGRAM_NAME: &str = "ordnet_xdp";
/// Name of the TC (tcx egress) program in the eBPF object: the post-translation hook, on every
/// local endpoint's host-side interface and on the uplink (`docs/datapath.md` §14).
pub const TC_PROGRAM_NAME: &str = "ordnet_tc";
/// The TC program of layer-3 devices (tunnels without an Ethernet header).
pub const TC_L3_PROGRAM_NAME: &str = "ordnet_tc_l3";
/// The XDP observer: the XDP program tail-calls it ([`MAP_XDP_OBSERVER`]) for a packet that is
/// counted or reported (a new flow, a denied packet); it counts the rules, emits the verdict
/// event and returns the XDP program's verdict. In a program of its own the observing code is
/// verified once, not once for every path of the decision (docs/datapath.md, note 11).
pub const XDP_OBSERVER_NAME: &str = "ordnet_xdp_observe";
/// The TC observer ([`MAP_TC_OBSERVER`]), for both TC programs.
pub const TC_OBSERVER_NAME: &str = "ordnet_tc_observe";
/// The program array (one slot) holding [`XDP_OBSERVER_NAME`]: private to one load of the
/// programs. (A program array serves programs of one type only: XDP and TC have one each.)
pub const MAP_XDP_OBSERVER: &str = "ORDNET_XDP_OBSERVER";
/// The program array (one slot) holding [`TC_OBSERVER_NAME`].
pub const MAP_TC_OBSERVER: &str = "ORDNET_TC_OBSERVER";

/// ipcache, exact part, IPv4: one address (every /32: pods, nodes, local endpoints). Keyed by
/// the address word alone: a 4-byte key hashes and compares much faster than an [`IpKey`].
pub const MAP_IP4: &str = "ORDNET_IP4";
/// ipcache, exact part, IPv6 (every /128), keyed by the four address words.
pub const MAP_IP6: &str = "ORDNET_IP6";
/// ipcache, prefix part: CIDR identities (longest prefix match), consulted on an exact miss.
pub const MAP_IPCIDR: &str = "ORDNET_IPCIDR";
/// Cell words per rule set (first level of the port classification).
pub const MAP_CELLS: &str = "ORDNET_CELLS";
/// Refined cell blocks (second level: one word per low port byte).
pub const MAP_BLOCKS: &str = "ORDNET_BLOCKS";
/// The identity-specific keys of every rule set (and, for userspace only, the wildcard keys).
pub const MAP_POLICY: &str = "ORDNET_POLICY";
/// Connection tracking, IPv4 flows ([`Ct4Key`], 16 bytes).
pub const MAP_CT4: &str = "ORDNET_CT4";
/// Connection tracking, IPv6 flows ([`CtKey`], 40 bytes).
pub const MAP_CT6: &str = "ORDNET_CT6";
/// Global state: the policy revision.
pub const MAP_STATE: &str = "ORDNET_STATE";
/// Service frontends (ClusterIPs, external and load-balancer IPs, node addresses with a
/// NodePort): a new flow to one is not judged by the XDP program (kube-proxy translates it after
/// XDP) but tracked as deferred; the TC program judges it once translated.
pub const MAP_SVC: &str = "ORDNET_SVC";
/// Host-side interfaces of local endpoints: the TC program attributes a forwarded packet whose
/// source address was rewritten (kube-proxy's masquerade: hairpin, `masqueradeAll`) to the
/// endpoint it came from.
pub const MAP_IFACE: &str = "ORDNET_IFACE";
/// Event counters of the programs (a per-CPU array of `u64`, indexed by `COUNTER_*`; private to
/// one loaded program pair and never pinned: they count from the program's load).
pub const MAP_COUNTERS: &str = "ORDNET_COUNTERS";

/// Verdict events (`event::FlowEvent`): a BPF ring buffer, private to one loaded program pair.
pub const MAP_EVENTS: &str = "ORDNET_EVENTS";
/// Denied flows' unreported packets (`event::DenyRecord`), keyed by `event::flow_key`: an LRU
/// hash private to one loaded program pair.
pub const MAP_DENIED: &str = "ORDNET_DENIED";
/// The per-CPU token bucket of the verdict events (`event::Bucket`, one element).
pub const MAP_EVENT_BUCKET: &str = "ORDNET_EVENT_BUCKET";
/// Default size of [`MAP_EVENTS`] in bytes (a power of two): 11,915 events of 88 bytes (plus
/// the ring's 8-byte record headers), over two seconds of the default rate.
pub const DEFAULT_EVENT_RING_BYTES: u32 = 1 << 20;
/// Default capacity of [`MAP_DENIED`]: denied flows whose packets are being aggregated.
pub const DEFAULT_DENIED_ENTRIES: u32 = 16_384;

/// [`MAP_COUNTERS`]: TCP packets past the handshake (neither SYN nor RST) of a flow with a local
/// endpoint that the tracking table had no live entry for, which the policy then denied: a flow
/// whose entry was evicted from a full table (its connection is now broken towards an isolated
/// side), expired while idle, or lost in a restart; or packets of no connection at all (a scan).
pub const COUNTER_UNTRACKED_DENIED: u32 = 0;
/// [`MAP_COUNTERS`]: the same packets, allowed by the policy: the flow is tracked again (an
/// eviction the connection survived).
pub const COUNTER_UNTRACKED_ALLOWED: u32 = 1;
/// [`MAP_COUNTERS`]: packets the TC hook passed on the tag the XDP program left in their
/// metadata, without a conntrack lookup (`handoff`). Stays 0 where a driver does not keep XDP
/// metadata (the TC hook then looks every packet up itself).
pub const COUNTER_HANDED_OFF: u32 = 2;
/// [`MAP_COUNTERS`]: verdict events written into [`MAP_EVENTS`] (`event`).
pub const COUNTER_EVENTS: u32 = 3;
/// [`MAP_COUNTERS`]: verdict events the rate limit refused (for a denied flow its packets are
/// reported by the flow's next event).
pub const COUNTER_EVENTS_SUPPRESSED: u32 = 4;
/// [`MAP_COUNTERS`]: verdict events the ring buffer had no room for (userspace did not keep up).
pub const COUNTER_EVENTS_LOST: u32 = 5;
/// The number of counters in [`MAP_COUNTERS`].
pub const COUNTERS: u32 = 6;

/// Per-rule counters ([`RuleCount`], a per-CPU array): element `i` counts the flows and denied
/// packets decided by the keys whose value names counter `i` ([`PolicyValue::counter`];
/// userspace assigns one per set of rules a key comes from), and by the isolation defaults
/// ([`default_counter`]). Element 0 counts what names no counter. Private to one loaded
/// program pair.
pub const MAP_RULE_COUNTERS: &str = "ORDNET_RULE_COUNTERS";
/// Default number of elements of [`MAP_RULE_COUNTERS`] (at most 65,536: the index is a `u16`).
pub const DEFAULT_RULE_COUNTERS: u32 = 8_192;

/// Element of [`MAP_RULE_COUNTERS`] (one per CPU; userspace sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RuleCount {
    /// New flows allowed (first packet, or a tracked flow re-checked and still allowed), in
    /// every direction that judged them.
    pub flows_allowed: u64,
    /// Denied flows: first denied packets of a flow not denied recently (`event::DenyRecord`),
    /// in the direction(s) that denied them.
    pub flows_denied: u64,
    /// Denied packets, in the direction(s) that denied them.
    pub packets_denied: u64,
}

impl RuleCount {
    /// The sum of two counts.
    pub const fn plus(self, o: RuleCount) -> RuleCount {
        RuleCount {
            flows_allowed: self.flows_allowed.wrapping_add(o.flows_allowed),
            flows_denied: self.flows_denied.wrapping_add(o.flows_denied),
            packets_denied: self.packets_denied.wrapping_add(o.packets_denied),
        }
    }

    /// Whether nothing was counted.
    pub const fn is_zero(&self) -> bool {
        self.flows_allowed == 0 && self.flows_denied == 0 && self.packets_denied == 0
    }
}

/// The element of [`MAP_RULE_COUNTERS`] of what names no counter (a value written before
/// counters existed, a set of rules that found the array full).
pub const COUNTER_UNATTRIBUTED: u16 = 0;
/// The first element of a set of rules; those before it are the defaults'
/// ([`default_counter`]).
pub const FIRST_RULE_COUNTER: u16 = 5;

/// The element of [`MAP_RULE_COUNTERS`] of an isolation default: one per direction and
/// verdict (1 and 2: ingress deny and allow; 3 and 4: egress deny and allow).
#[inline(always)]
pub const fn default_counter(egress: bool, allow: bool) -> u16 {
    1 + if egress { 2 } else { 0 } + if allow { 1 } else { 0 }
}

/// Default capacities (userspace can override them at load time).
pub const DEFAULT_IPCACHE_ENTRIES: u32 = 65_536;
/// Default capacity of [`MAP_IPCIDR`].
pub const DEFAULT_IPCIDR_ENTRIES: u32 = 16_384;
/// Default number of rule set slots: [`MAP_CELLS`] holds this many × [`CELLS_PER_RULESET`] words.
pub const DEFAULT_MAX_RULESETS: u32 = 512;
/// Default number of refined blocks in [`MAP_BLOCKS`] ([`BLOCK_WORDS`] words each).
pub const DEFAULT_MAX_BLOCKS: u32 = 2_048;
/// Default capacity of [`MAP_POLICY`].
pub const DEFAULT_POLICY_ENTRIES: u32 = 262_144;
/// Default capacity of the IPv4 connection-tracking map ([`MAP_CT4`]): flows, LRU. About
/// 54.5 MB of kernel memory (104 bytes a flow, preallocated); Cilium's default TCP table has as
/// many.
pub const DEFAULT_CT4_ENTRIES: u32 = 524_288;
/// Default capacity of the IPv6 connection-tracking map ([`MAP_CT6`]): 33.6 MB (128 bytes a flow).
pub const DEFAULT_CT6_ENTRIES: u32 = 262_144;
/// Default capacity of [`MAP_SVC`].
pub const DEFAULT_SVC_ENTRIES: u32 = 65_536;
/// Default capacity of [`MAP_IFACE`].
pub const DEFAULT_IFACE_ENTRIES: u32 = 4_096;

/// Verdict encoding in [`PolicyValue::verdict`] and [`PolicyRef::default`]. Zero (what an
/// unwritten value holds) and every other value mean deny: fail closed.
pub const V_ALLOW: u8 = 1;
/// Deny verdict (see [`V_ALLOW`]).
pub const V_DENY: u8 = 2;

/// [`IpKey::family`] values.
pub const FAMILY_V4: u8 = 4;
/// [`IpKey::family`] of an IPv6 address.
pub const FAMILY_V6: u8 = 6;

/// One address of either family as a hash key, and the data part of the LPM key
/// (`prefix_len` = 32 + the address prefix length: family and padding are always matched).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct IpKey {
    /// [`FAMILY_V4`] or [`FAMILY_V6`] (a `u32`, not a byte plus padding: LLVM turns the
    /// zeroing of a 3-byte pad into a `memset` call).
    pub family: u32,
    /// The address bytes as memory-order words (`addr_words`): an IPv6 address, or an IPv4
    /// address in word 0 and zeros after (as the parser stores it). In memory this is exactly
    /// the 16 address bytes, so the LPM trie matches prefixes of the address.
    pub addr: [u32; 4],
}

impl IpKey {
    /// A key of family `family` ([`FAMILY_V4`] or [`FAMILY_V6`]) and address words `addr`.
    #[inline(always)]
    pub const fn new(family: u8, addr: [u32; 4]) -> Self {
        Self {
            family: family as u32,
            addr,
        }
    }

    /// Bits of the key before the address (family + padding), always fully matched in the
    /// LPM trie.
    pub const LPM_FIXED_BITS: u32 = 32;
}

/// [`IpInfo::flags`]: the address is a local endpoint (`endpoint`, `ingress`, `egress` valid).
pub const IP_FLAG_ENDPOINT: u32 = 1;
/// [`IpInfo::flags`]: the address belongs to this node (its own traffic is never filtered).
pub const IP_FLAG_HOST: u32 = 2;
/// [`IpInfo::flags`]: the address is also a Service frontend's (some [`MAP_SVC`] key has it,
/// e.g. a node address with NodePorts). A new flow to an address with an exact ipcache entry
/// is looked up in [`MAP_SVC`] only when its entry has this flag: one hash lookup fewer for a
/// new flow to a pod or a node. The control plane keeps it equal to the Service map.
pub const IP_FLAG_FRONTEND: u32 = 4;
/// [`IpInfo::flags`]: [`IpInfo::classes`] hold the address's node-local identity classes
/// (`docs/datapath.md` §13), written by the class translation together with policy keys per
/// class: the policy lookups probe with the class of the lookup's space. Without it they
/// probe with [`IpInfo::identity`] in both directions (keys per identity).
pub const IP_FLAG_CLASSES: u32 = 8;
/// [`IpInfo::classes`] index of the class ingress policies probe with (the address as a
/// packet's source).
pub const SPACE_INGRESS: usize = 0;
/// [`IpInfo::classes`] index of the class egress policies probe with (the address as a
/// packet's destination).
pub const SPACE_EGRESS: usize = 1;

/// The policy of one endpoint in one direction: which rule set, and the isolation default.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PolicyRef {
    /// Rule set slot (0 = the permanent empty rule set).
    pub ruleset: u32,
    /// [`V_ALLOW`] or [`V_DENY`]: the verdict when no key matches.
    pub default: u8,
    /// Padding; always zero.
    pub _pad: [u8; 3],
}

impl PolicyRef {
    /// A reference to rule set slot `ruleset` with isolation default `default` ([`V_ALLOW`] or
    /// [`V_DENY`]).
    pub const fn new(ruleset: u32, default: u8) -> Self {
        Self {
            ruleset,
            default,
            _pad: [0; 3],
        }
    }

    /// The default as a verdict.
    #[inline(always)]
    pub const fn default_allows(&self) -> bool {
        self.default == V_ALLOW
    }
}

/// ipcache value: what an address is. For a local endpoint it also carries the endpoint's
/// policy references, so one lookup yields everything (and switching an endpoint to another
/// rule set is one atomic value replacement in a no-prealloc hash map).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IpInfo {
    /// Security identity (0 = none: only wildcard keys apply).
    pub identity: u32,
    /// `IP_FLAG_*`.
    pub flags: u32,
    /// Local endpoint id (non-zero) when `flags` has [`IP_FLAG_ENDPOINT`].
    pub endpoint: u32,
    /// Ingress policy of the endpoint (valid for a local endpoint only).
    pub ingress: PolicyRef,
    /// Egress policy of the endpoint (valid for a local endpoint only).
    pub egress: PolicyRef,
    /// With [`IP_FLAG_CLASSES`]: the address's class in each space ([`SPACE_INGRESS`],
    /// [`SPACE_EGRESS`]; 0: no key of that space's rule sets names it). Else zero.
    pub classes: [u32; 2],
}

impl IpInfo {
    /// Whether the address is a local endpoint: [`IP_FLAG_ENDPOINT`] set and `endpoint` non-zero.
    #[inline(always)]
    pub fn is_endpoint(&self) -> bool {
        self.flags & IP_FLAG_ENDPOINT != 0 && self.endpoint != 0
    }

    /// Whether the address belongs to this node ([`IP_FLAG_HOST`]).
    #[inline(always)]
    pub fn is_host(&self) -> bool {
        self.flags & IP_FLAG_HOST != 0
    }

    /// Whether the address is also a Service frontend's ([`IP_FLAG_FRONTEND`]).
    #[inline(always)]
    pub fn is_frontend(&self) -> bool {
        self.flags & IP_FLAG_FRONTEND != 0
    }

    /// What the policy lookups of each space probe with when this address is the peer:
    /// [`IpInfo::classes`] with [`IP_FLAG_CLASSES`], else the identity in both.
    #[inline(always)]
    pub fn peer(&self) -> [u32; 2] {
        if self.flags & IP_FLAG_CLASSES != 0 {
            self.classes
        } else {
            [self.identity, self.identity]
        }
    }
}

/// Cell words per rule set in [`MAP_CELLS`]: 3 protocol slots (TCP, UDP, SCTP) × 256 high port
/// bytes, plus one word for every other protocol (which only length-0 keys can match).
pub const CELLS_PER_RULESET: u32 = 3 * 256 + 1;
/// Index of the "other protocol" word inside a rule set's cells.
pub const OTHER_SLOT_CELL: u32 = 3 * 256;
/// Words per refined block in [`MAP_BLOCKS`] (one per low port byte).
pub const BLOCK_WORDS: u32 = 256;

/// [`MAP_CELLS`] and [`MAP_BLOCKS`] are arrays of `u64` elements holding two 32-bit words each
/// (word `2i` in the low half, `2i + 1` in the high half): the kernel pads array elements to 8
/// bytes, so `u32` elements would waste half of the memory (and cache). Userspace maps the
/// arrays (`BPF_F_MMAPABLE`) and sees a plain `u32` array.
#[inline(always)]
pub const fn pair_index(word: u32) -> u32 {
    word >> 1
}

/// Word `word` out of its element `pair` (see [`pair_index`]).
#[inline(always)]
pub const fn pair_word(pair: u64, word: u32) -> u32 {
    (pair >> ((word & 1) * 32)) as u32
}

/// Elements needed for `words` words.
pub const fn pairs(words: u32) -> u32 {
    words.div_ceil(2)
}

/// Cell word, bits 0..18: the key lengths at which *some* identity of the rule set has a key
/// covering this cell, compressed: bit 0 = length 0, bit `L - 7` = length `L` (8..=24; lengths
/// 1..7 do not exist: a key fixes all protocol bits or none).
pub const CELL_MASK_BITS: u32 = (1 << 18) - 1;
/// Cell word, bits 18..23: the longest of those lengths (the first probe, without a bit scan).
pub const CELL_HINT_SHIFT: u32 = 18;
/// Cell word: the wildcard (`*`) verdict of the cell, 2 bits at [`CELL_WILD_SHIFT`]:
/// [`WILD_NONE`] (no wildcard key covers it: the endpoint's default applies), [`WILD_ALLOW`],
/// [`WILD_DENY`] (3 = invalid, treated as deny).
pub const CELL_WILD_SHIFT: u32 = 25;
/// Wildcard verdict: no `*` key covers the cell (the endpoint's default applies).
pub const WILD_NONE: u32 = 0;
/// Wildcard verdict: allow.
pub const WILD_ALLOW: u32 = 1;
/// Wildcard verdict: deny.
pub const WILD_DENY: u32 = 2;
/// Cell word: the length of the `*` key that gives the cell its wildcard verdict (when one
/// does), as its compressed mask bit ([`length_bit`]'s index, 0..18) in two parts: bits 0..2 of
/// it at [`CELL_WILD_LEN_LO_SHIFT`] (bits 23..25 of the word), bits 2..5 at
/// [`CELL_WILD_LEN_HI_SHIFT`] (bits 27..30). Only read to find that key's rule counter
/// ([`wild_length`]), never to decide.
pub const CELL_WILD_LEN_LO_SHIFT: u32 = 23;
/// See [`CELL_WILD_LEN_LO_SHIFT`].
pub const CELL_WILD_LEN_HI_SHIFT: u32 = 27;
/// Cell word in [`MAP_CELLS`] only: the cell is refined; bits 0..31 hold the block number in
/// [`MAP_BLOCKS`]. Never set in a block word.
pub const CELL_REFINED: u32 = 1 << 31;

/// The compressed mask bit of key length `len` (0 or 8..=24).
#[inline(always)]
pub const fn length_bit(len: u32) -> u32 {
    if len == 0 { 1 } else { 1 << (len - 7) }
}

/// The key length of compressed mask bit `bit` (inverse of [`length_bit`]).
#[inline(always)]
pub const fn bit_length(bit: u32) -> u32 {
    if bit == 0 { 0 } else { bit + 7 }
}

/// The bits of a cell word that say the wildcard key's length `len` (0 or 8..=24; see
/// [`CELL_WILD_LEN_LO_SHIFT`]).
#[inline(always)]
pub const fn wild_length_bits(len: u32) -> u32 {
    let index = if len == 0 { 0 } else { len - 7 };
    ((index & 3) << CELL_WILD_LEN_LO_SHIFT) | ((index >> 2) << CELL_WILD_LEN_HI_SHIFT)
}

/// The wildcard key's length a cell word says (inverse of [`wild_length_bits`]).
#[inline(always)]
pub const fn wild_length(word: u32) -> u32 {
    let index =
        ((word >> CELL_WILD_LEN_LO_SHIFT) & 3) | (((word >> CELL_WILD_LEN_HI_SHIFT) & 7) << 2);
    bit_length(index)
}

/// A cell word from the set of key lengths (bit L set = length L, L in {0} and 8..=24) and the
/// wildcard verdict.
#[inline(always)]
pub const fn cell_word(lengths: u32, wild: u32) -> u32 {
    let compressed = (lengths & 1) | ((lengths >> 7) & !1 & CELL_MASK_BITS);
    let longest = if lengths == 0 {
        0
    } else {
        31 - lengths.leading_zeros()
    };
    compressed | (longest << CELL_HINT_SHIFT) | ((wild & 3) << CELL_WILD_SHIFT)
}

/// Protocol slot of the cell table: TCP 0, UDP 1, SCTP 2, anything else `None` (the "other"
/// word).
#[inline(always)]
pub const fn proto_slot(protocol: u8) -> Option<u32> {
    match protocol {
        6 => Some(0),
        17 => Some(1),
        132 => Some(2),
        _ => None,
    }
}

/// Protocol number of a slot (inverse of [`proto_slot`]).
pub const SLOT_PROTOCOLS: [u8; 3] = [6, 17, 132];

/// The (protocol, port) prefix of a key: bits 31..24 protocol, 23..8 port, 7..0 the prefix
/// length (0..=24). The top bits beyond the length are zero. This is `L4Prefix::raw() | len`.
#[inline(always)]
pub const fn prefix_bits(protocol: u8, port: u16, len: u32) -> u32 {
    let raw = ((protocol as u32) << 24) | ((port as u32) << 8);
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    (raw & mask) | len
}

/// Key of [`MAP_POLICY`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PolicyKey {
    /// Rule set slot (as in [`PolicyRef::ruleset`]).
    pub ruleset: u32,
    /// Identity; 0 = the wildcard `*` (stored for userspace bookkeeping only: the program folds
    /// the wildcard keys into the cell words and never probes identity 0).
    pub identity: u32,
    /// [`prefix_bits`].
    pub prefix: u32,
}

/// Value of [`MAP_POLICY`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PolicyValue {
    /// [`V_ALLOW`] or [`V_DENY`].
    pub verdict: u8,
    /// Padding; always zero.
    pub _pad: u8,
    /// The key's element of [`MAP_RULE_COUNTERS`] (0: counted as unattributed).
    pub counter: u16,
}

impl PolicyValue {
    /// A value of verdict `verdict` ([`V_ALLOW`] or [`V_DENY`]) without a rule counter.
    pub const fn new(verdict: u8) -> Self {
        Self::counted(verdict, 0)
    }

    /// A value of verdict `verdict` counted in element `counter` of [`MAP_RULE_COUNTERS`].
    pub const fn counted(verdict: u8, counter: u16) -> Self {
        Self {
            verdict,
            _pad: 0,
            counter,
        }
    }
}

/// Key of [`MAP_CT4`]/[`MAP_CT6`]: the 5-tuple in canonical order (the endpoint `(addr, port)` that sorts
/// first is `a`), so both directions of a flow find the same entry with one lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CtKey {
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// IP protocol number.
    pub protocol: u8,
    /// Padding; always zero.
    pub _pad: u16,
    /// Port of side `a` (host byte order).
    pub port_a: u16,
    /// Port of side `b` (host byte order).
    pub port_b: u16,
    /// Memory-order address words, as in [`IpKey::addr`].
    pub addr_a: [u32; 4],
    /// Address of side `b`, same form as `addr_a`.
    pub addr_b: [u32; 4],
}

/// Key of [`MAP_CT4`]: a [`CtKey`] of family 4 without the unused address words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Ct4Key {
    /// IP protocol number.
    pub protocol: u8,
    /// Padding; always zero.
    pub _pad: u8,
    /// Padding; always zero.
    pub _pad2: u16,
    /// Port of side `a` (host byte order).
    pub port_a: u16,
    /// Port of side `b` (host byte order).
    pub port_b: u16,
    /// IPv4 address of side `a` (memory-order word, as in [`IpKey::addr`]).
    pub addr_a: u32,
    /// IPv4 address of side `b` (memory-order word).
    pub addr_b: u32,
}

impl Ct4Key {
    /// The IPv4 key of a family-4 [`CtKey`].
    #[inline(always)]
    pub const fn of(k: &CtKey) -> Ct4Key {
        Ct4Key {
            protocol: k.protocol,
            _pad: 0,
            _pad2: 0,
            port_a: k.port_a,
            port_b: k.port_b,
            addr_a: k.addr_a[0],
            addr_b: k.addr_b[0],
        }
    }

    /// The [`CtKey`] it stands for.
    pub const fn full(&self) -> CtKey {
        CtKey {
            family: FAMILY_V4,
            protocol: self.protocol,
            _pad: 0,
            port_a: self.port_a,
            port_b: self.port_b,
            addr_a: [self.addr_a, 0, 0, 0],
            addr_b: [self.addr_b, 0, 0, 0],
        }
    }
}

/// [`CtEntry::flags`]: the flow was opened by side `a` (else by side `b`).
pub const CT_INITIATOR_A: u32 = 1;
/// [`CtEntry::flags`]: a flow to a Service frontend, passed by the XDP program without a
/// verdict (the TC program judges it after kube-proxy's translation, under its own entry for
/// the translated tuple). Such an entry only lets the flow's packets reach that judgement and
/// the translated replies (source: the frontend) reach the client; it is never re-checked
/// against policy.
pub const CT_SERVICE: u32 = 2;

/// [`CtEntry::flags`] (TCP): the responder has sent a packet (the flow got past its SYN).
pub const CT_REPLIED: u32 = 4;
/// [`CtEntry::flags`] (TCP): the initiator has sent a FIN.
pub const CT_FIN_INITIATOR: u32 = 8;
/// [`CtEntry::flags`] (TCP): the responder has sent a FIN.
pub const CT_FIN_RESPONDER: u32 = 16;
/// [`CtEntry::flags`] (TCP): an RST was seen.
pub const CT_RESET: u32 = 32;
/// The [`CtEntry::flags`] of a TCP flow's state (the rest says who opened it and how it is
/// judged).
pub const CT_TCP_STATE: u32 = CT_REPLIED | CT_FIN_INITIATOR | CT_FIN_RESPONDER | CT_RESET;

/// Whether a TCP flow with these [`CtEntry::flags`] is closed: an RST, or a FIN each way.
#[inline(always)]
pub const fn ct_closed(flags: u32) -> bool {
    flags & CT_RESET != 0
        || flags & (CT_FIN_INITIATOR | CT_FIN_RESPONDER) == CT_FIN_INITIATOR | CT_FIN_RESPONDER
}

/// Key of [`MAP_SVC`]: one Service frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SvcKey {
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// IP protocol (TCP, UDP, SCTP).
    pub protocol: u8,
    /// The frontend port (host order).
    pub port: u16,
    /// Memory-order address words, as in [`IpKey::addr`].
    pub addr: [u32; 4],
}

/// Value of [`MAP_SVC`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SvcValue {
    /// `SVC_*` flags (non-zero: a frontend).
    pub flags: u32,
}

/// [`SvcValue::flags`]: a frontend.
pub const SVC_FRONTEND: u32 = 1;

/// Value of [`MAP_IFACE`]: the endpoint behind an interface and its addresses (the TC program
/// reads the endpoint's record from the ipcache by the address of the packet's family).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IfaceInfo {
    /// The local endpoint's id (non-zero).
    pub endpoint: u32,
    /// `IFACE_HAS_V4` / `IFACE_HAS_V6`.
    pub flags: u32,
    /// The endpoint's IPv4 address (memory-order word), when it has one.
    pub addr4: u32,
    /// The endpoint's IPv6 address (memory-order words), when it has one.
    pub addr6: [u32; 4],
}

/// [`IfaceInfo::flags`]: `addr4` is set.
pub const IFACE_HAS_V4: u32 = 1;
/// [`IfaceInfo::flags`]: `addr6` is set.
pub const IFACE_HAS_V6: u32 = 2;

/// Value of [`MAP_CT4`]/[`MAP_CT6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtEntry {
    /// The global policy revision the flow was last checked against.
    pub revision: u64,
    /// Clock ticks (`bpf_jiffies64`) of the last refresh.
    pub last_seen: u64,
    /// `CT_*` flags.
    pub flags: u32,
    /// Padding; always zero.
    pub _pad: u32,
}

/// Value of [`MAP_STATE`] (one entry, index 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct State {
    /// Bumped by userspace after every completed change of policy, endpoints or ipcache; a
    /// connection-tracking entry stamped with an older revision is re-checked.
    pub revision: u64,
    /// Clock ticks per second (the kernel's `HZ`: the program's clock is `bpf_jiffies64`, an
    /// inlined load; `bpf_ktime_get_ns` is a helper call that cost ~30 ns per packet here).
    pub hz: u64,
    /// Idle lifetime of a tracked TCP flow, in ticks.
    pub ct_tcp_ticks: u64,
    /// Idle lifetime of a tracked UDP, SCTP or ICMP echo flow, in ticks.
    pub ct_other_ticks: u64,
    /// A flow's `last_seen` is rewritten at most this often (saves a write per packet).
    pub ct_refresh_ticks: u64,
    /// Idle lifetime of a TCP flow whose responder has not answered yet (only its SYN was
    /// seen), in ticks. (The two short lifetimes are 32-bit: they took the place of a reserved
    /// word, so the value keeps its size and pinned maps stay compatible.)
    pub ct_syn_ticks: u32,
    /// Idle lifetime of a closed TCP flow (an RST, or a FIN each way), in ticks.
    pub ct_close_ticks: u32,
}

/// Default idle lifetime of a tracked TCP flow (seconds).
pub const CT_LIFETIME_TCP_SECS: u64 = 6 * 3600;
/// Default idle lifetime of a tracked UDP or SCTP flow (seconds).
pub const CT_LIFETIME_OTHER_SECS: u64 = 120;
/// Default idle lifetime of a TCP flow that never got past its SYN (seconds; the kernel's
/// `nf_conntrack_tcp_timeout_syn_sent` is 120, Cilium's 60).
pub const CT_LIFETIME_SYN_SECS: u64 = 60;
/// Default idle lifetime of a closed TCP flow (seconds; the kernel's
/// `nf_conntrack_tcp_timeout_close` is 10, Cilium's close timeout 10).
pub const CT_LIFETIME_CLOSE_SECS: u64 = 10;
/// Default refresh interval of `last_seen` (seconds).
pub const CT_REFRESH_SECS: u64 = 1;

const _: () = {
    assert!(core::mem::size_of::<IpKey>() == 20);
    assert!(core::mem::align_of::<IpKey>() == 4);
    assert!(core::mem::size_of::<PolicyRef>() == 8);
    assert!(core::mem::size_of::<IpInfo>() == 36);
    assert!(core::mem::size_of::<PolicyKey>() == 12);
    assert!(core::mem::size_of::<PolicyValue>() == 4);
    assert!(core::mem::size_of::<RuleCount>() == 24);
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<Ct4Key>() == 16);
    assert!(core::mem::size_of::<CtEntry>() == 24);
    assert!(core::mem::size_of::<State>() == 48);
    assert!(core::mem::size_of::<SvcKey>() == 20);
    assert!(core::mem::size_of::<SvcValue>() == 4);
    assert!(core::mem::size_of::<IfaceInfo>() == 28);
};

// SAFETY: all of these are `repr(C)`, `Copy`, made only of integers and integer arrays, with
// every padding byte an explicit field (sizes asserted above), so any byte pattern is valid and
// all bytes are initialised.
#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for IpKey {}
    unsafe impl aya::Pod for IpInfo {}
    unsafe impl aya::Pod for PolicyRef {}
    unsafe impl aya::Pod for PolicyKey {}
    unsafe impl aya::Pod for PolicyValue {}
    unsafe impl aya::Pod for RuleCount {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for Ct4Key {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for State {}
    unsafe impl aya::Pod for SvcKey {}
    unsafe impl aya::Pod for SvcValue {}
    unsafe impl aya::Pod for IfaceInfo {}
}
