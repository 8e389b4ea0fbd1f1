//! The input model of a MapState: resolved, ordered policy entries.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use crate::idset::IdSet;
use crate::prefix::L4Prefix;

/// The hasher of the workspace's hash maps (the MapState's per-peer maps, the engine's maps, the
/// datapath's in-memory map copies): their keys are looked up on every change or inserted by
/// the million, so a fast non-cryptographic hash (foldhash, seeded per process; the keys are
/// identities, lists and names the engine computes, not chosen by an adversary). SipHash was
/// ~13 % of a relabel's engine time at 10k pods / 5k policies and half of programming a node.
pub type FastHash = foldhash::fast::RandomState;
/// A `HashMap` with [`FastHash`].
pub type FastMap<K, V> = std::collections::HashMap<K, V, FastHash>;
/// A `HashSet` with [`FastHash`].
pub type FastSet<T> = std::collections::HashSet<T, FastHash>;

/// A numeric security identity. The engine allocates them; `0` is never a valid identity
/// (it is the wildcard in the flattened datapath maps).
pub type Identity = u32;

/// The peer part of a MapState key: one identity, or the wildcard "any identity".
/// Serializes as the identity number, or the string `"*"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Peer {
    /// The wildcard: consulted only when the packet's identity has no matching key.
    Any,
    /// One specific identity.
    Id(Identity),
}

impl Serialize for Peer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Peer::Any => s.serialize_str("*"),
            Peer::Id(id) => s.serialize_u32(*id),
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Any => f.write_str("*"),
            Peer::Id(id) => write!(f, "{id}"),
        }
    }
}

/// Traffic direction, seen from the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Traffic that reaches the endpoint; the peer is the source.
    Ingress,
    /// Traffic that leaves the endpoint; the peer is the destination.
    Egress,
}

impl Direction {
    /// Both directions, ingress first: the order of every per-direction array.
    pub const ALL: [Direction; 2] = [Direction::Ingress, Direction::Egress];

    /// The position in [`Direction::ALL`] (ingress 0, egress 1).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The lowercase name (`ingress`, `egress`), as in the serialized form.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a rule does with the traffic it matches. `Deny` sorts before `Allow`: at an equal order
/// key deny wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Drop the traffic.
    Deny,
    /// Let the traffic through.
    Allow,
}

impl Verdict {
    /// The lowercase name (`allow`, `deny`), as in the serialized form.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The IP protocols a policy can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Protocol {
    /// TCP (IP protocol 6).
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP (IP protocol 17).
    #[serde(rename = "UDP")]
    Udp,
    /// SCTP (IP protocol 132).
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    /// Every protocol, in `number` order.
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IANA protocol number, as in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The protocol of an IANA protocol number; `None` for any other protocol.
    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The API name (`TCP`, `UDP`, `SCTP`), as in the serialized form.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The L4 part of a policy entry. Serializes as its display text (`any`, `TCP`, `TCP/80-90`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L4Match {
    /// Every IP protocol (ICMP included) and every port.
    Any,
    /// One protocol, every port.
    Proto(Protocol),
    /// One protocol, an inclusive port range (`first <= last`).
    Ports {
        /// The protocol the ports belong to.
        proto: Protocol,
        /// First port of the range.
        first: u16,
        /// Last port of the range (inclusive).
        last: u16,
    },
}

impl L4Match {
    /// One port of one protocol.
    pub fn port(proto: Protocol, port: u16) -> L4Match {
        L4Match::Ports {
            proto,
            first: port,
            last: port,
        }
    }

    /// The aligned prefix blocks that together cover exactly this match.
    pub fn blocks(&self) -> Vec<L4Prefix> {
        match *self {
            L4Match::Any => vec![L4Prefix::ANY],
            L4Match::Proto(p) => vec![L4Prefix::proto(p.number())],
            L4Match::Ports { proto, first, last } => {
                if first > last {
                    return Vec::new();
                }
                crate::prefix::range_blocks(proto.number(), first, last)
            }
        }
    }

    /// Whether a packet of IP protocol `proto` to port `port` matches.
    pub fn matches(&self, proto: u8, port: u16) -> bool {
        match *self {
            L4Match::Any => true,
            L4Match::Proto(p) => p.number() == proto,
            L4Match::Ports {
                proto: p,
                first,
                last,
            } => p.number() == proto && first <= port && port <= last,
        }
    }
}

impl Serialize for L4Match {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for L4Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            L4Match::Any => f.write_str("any"),
            L4Match::Proto(p) => write!(f, "{p}"),
            L4Match::Ports { proto, first, last } if first == last => write!(f, "{proto}/{first}"),
            L4Match::Ports { proto, first, last } => write!(f, "{proto}/{first}-{last}"),
        }
    }
}

/// The tiers of the order (SEMANTICS.md §8), strongest first: the upstream
/// `ClusterNetworkPolicy` rules of tier `Admin`, then the ordnet rules (ClusterOrderedNetworkPolicy,
/// OrderedNetworkPolicy, NetworkPolicy) and the isolation default, then the `Baseline` rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// ClusterNetworkPolicy `tier: Admin`: before everything else.
    Admin,
    /// The ordnet kinds and NetworkPolicy, then the isolation default.
    #[default]
    Ordnet,
    /// ClusterNetworkPolicy `tier: Baseline`: only where the tiers above leave the default open.
    Baseline,
}

impl Tier {
    /// Every tier, strongest first.
    pub const ALL: [Tier; 3] = [Tier::Admin, Tier::Ordnet, Tier::Baseline];

    /// The lowercase name (`admin`, `ordnet`, `baseline`), as in the serialized form.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Admin => "admin",
            Tier::Ordnet => "ordnet",
            Tier::Baseline => "baseline",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a rule does with the traffic it matches. `Pass` (upstream ClusterNetworkPolicy) skips
/// the weaker rules of its own tier and lets the next tier decide. At an equal order key Deny
/// wins over Pass, and Pass over Allow (the declaration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Drop the traffic.
    Deny,
    /// Go on with the next tier.
    Pass,
    /// Let the traffic through.
    Allow,
}

impl Action {
    /// The lowercase name (`allow`, `deny`, `pass`).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
            Action::Pass => "pass",
        }
    }
}

impl From<Verdict> for Action {
    fn from(v: Verdict) -> Action {
        match v {
            Verdict::Allow => Action::Allow,
            Verdict::Deny => Action::Deny,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a MapState entry ranks among the entries of an equal `(tier, priority, index)`.
/// Callers build every order key with [`Step::Rule`]; the MapState sets the others when it
/// resolves tiers and `Pass` (crate documentation, "Tiers and Pass").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub enum Step {
    /// An ordinary rule (Deny before Allow at an equal key, by the verdict).
    #[default]
    Rule,
    /// A rule of a weaker tier copied in place of the `Pass` rule whose key this is, restricted
    /// to the traffic both match: under the Pass, it decides before anything weaker of the
    /// Pass's tier. Copies rank among themselves as their rules do.
    Passed(Via),
    /// A `Pass` rule's own key, after its copies: what no weaker tier decides gets the default.
    PassEnd,
    /// An `Allow` of a tiered (ClusterNetworkPolicy) rule: after Deny and Pass at an equal key.
    Accept,
}

/// The rule a [`Step::Passed`] copy comes from: its key and verdict, in rank order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Via {
    /// The copied rule's tier.
    pub tier: Tier,
    /// Its priority.
    pub priority: i32,
    /// Its rule index (kept up to 65,535: a policy has at most 256 rules per direction).
    pub index: u32,
    /// Its step (never `Passed`): 0 rule, 1 pass end, 2 accept.
    pub step: u8,
    /// Its verdict (deny first at an equal step).
    pub verdict: Verdict,
}

fn is_ordnet(t: &Tier) -> bool {
    *t == Tier::Ordnet
}

const TIER_SHIFT: u32 = 62;
const STEP_SHIFT: u32 = 60;
const LOW_BITS: u64 = (1 << STEP_SHIFT) - 1;

fn tier_code(t: Tier) -> u64 {
    match t {
        Tier::Admin => 0,
        Tier::Ordnet => 1,
        Tier::Baseline => 2,
    }
}

fn tier_of(code: u64) -> Tier {
    match code & 3 {
        0 => Tier::Admin,
        1 => Tier::Ordnet,
        _ => Tier::Baseline,
    }
}

impl Via {
    /// The 60 bits of a [`Step::Passed`] in [`OrderKey`], ordered as `Via` is: tier, priority,
    /// index (saturated at 65,535), step, verdict.
    fn pack(self) -> u64 {
        tier_code(self.tier) << 57
            | u64::from((self.priority as u32) ^ 0x8000_0000) << 25
            | u64::from(self.index.min(0xFFFF)) << 9
            | u64::from(self.step & 3) << 7
            | u64::from(self.verdict == Verdict::Allow) << 6
    }

    fn unpack(bits: u64) -> Via {
        Via {
            tier: tier_of(bits >> 57),
            priority: (((bits >> 25) & 0xFFFF_FFFF) as u32 ^ 0x8000_0000) as i32,
            index: ((bits >> 9) & 0xFFFF) as u32,
            step: ((bits >> 7) & 3) as u8,
            verdict: if (bits >> 6) & 1 == 1 {
                Verdict::Allow
            } else {
                Verdict::Deny
            },
        }
    }
}

/// `(tier, priority, rule index, step)`: lower is stronger (SEMANTICS.md §2, §8). 16 bytes: the
/// tier and the step (with, for a copy under a Pass, the copied rule's rank) share one word;
/// every MapState key and candidate carries one.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OrderKey {
    /// Policy priority; lower is stronger.
    pub priority: i32,
    /// Tie-breaker at equal priority: the rule's index in its policy (the engine gives every
    /// NetworkPolicy rule 0); lower is stronger.
    pub index: u32,
    /// Bits 62-63 the tier, 60-61 the step's kind, 0-59 a `Passed` step's [`Via`].
    packed: u64,
}

impl Ord for OrderKey {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (
            self.packed >> TIER_SHIFT,
            self.priority,
            self.index,
            self.packed & !(3 << TIER_SHIFT),
        )
            .cmp(&(
                o.packed >> TIER_SHIFT,
                o.priority,
                o.index,
                o.packed & !(3 << TIER_SHIFT),
            ))
    }
}

impl PartialOrd for OrderKey {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl fmt::Debug for OrderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrderKey")
            .field("tier", &self.tier())
            .field("priority", &self.priority)
            .field("index", &self.index)
            .field("step", &self.step())
            .finish()
    }
}

impl Serialize for OrderKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let (tier, step) = (self.tier(), self.step());
        let mut st = s.serialize_struct("OrderKey", 4)?;
        if tier != Tier::Ordnet {
            st.serialize_field("tier", &tier)?;
        }
        st.serialize_field("priority", &self.priority)?;
        st.serialize_field("index", &self.index)?;
        if step != Step::Rule {
            st.serialize_field("step", &step)?;
        }
        st.end()
    }
}

impl OrderKey {
    /// The order key of rule `index` of an ordnet-tier policy of priority `priority`.
    pub fn new(priority: i32, index: u32) -> Self {
        OrderKey::tiered(Tier::Ordnet, priority, index)
    }

    /// The order key of rule `index` of a policy of tier `tier` and priority `priority`.
    pub fn tiered(tier: Tier, priority: i32, index: u32) -> Self {
        OrderKey {
            priority,
            index,
            packed: tier_code(tier) << TIER_SHIFT,
        }
    }

    /// The tier; every tier is weaker than the ones before it.
    pub fn tier(&self) -> Tier {
        tier_of(self.packed >> TIER_SHIFT)
    }

    /// Rank among entries of the same tier, priority and index.
    pub fn step(&self) -> Step {
        match (self.packed >> STEP_SHIFT) & 3 {
            0 => Step::Rule,
            1 => Step::Passed(Via::unpack(self.packed & LOW_BITS)),
            2 => Step::PassEnd,
            _ => Step::Accept,
        }
    }

    /// The same key with another step.
    pub fn with_step(self, step: Step) -> Self {
        let bits = match step {
            Step::Rule => 0,
            Step::Passed(v) => 1 << STEP_SHIFT | v.pack(),
            Step::PassEnd => 2 << STEP_SHIFT,
            Step::Accept => 3 << STEP_SHIFT,
        };
        OrderKey {
            packed: self.packed & (3 << TIER_SHIFT) | bits,
            ..self
        }
    }
}

impl fmt::Display for OrderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.tier() != Tier::Ordnet {
            write!(f, "{} ", self.tier())?;
        }
        write!(f, "({}, {})", self.priority, self.index)?;
        match self.step() {
            Step::Rule | Step::Accept => Ok(()),
            Step::PassEnd => f.write_str(" pass"),
            Step::Passed(v) => {
                f.write_str(" pass → ")?;
                if v.tier != Tier::Ordnet {
                    write!(f, "{} ", v.tier)?;
                }
                write!(f, "({}, {})", v.priority, v.index)
            }
        }
    }
}

/// Where an entry comes from, so `trace` and `dump` can name the deciding rule. The strings are
/// opaque to this crate (the engine fills in Kubernetes kinds and names).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Origin {
    /// Kind of the policy (the engine puts the Kubernetes kind, e.g. `NetworkPolicy`).
    pub kind: String,
    /// Namespace of the policy; `None` for a cluster-scoped policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name of the policy.
    pub name: String,
    /// Direction the rule applies to.
    pub direction: Direction,
    /// Index of the rule within the policy's rules for `direction`.
    pub rule_index: u32,
    /// The rule's own name, for kinds whose rules have one (ClusterNetworkPolicy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule_name: Option<String>,
    /// Priority of the policy; lower is stronger.
    pub priority: i32,
    /// What the rule does with the traffic it matches.
    pub action: Action,
    /// The tier of the policy.
    #[serde(skip_serializing_if = "is_ordnet")]
    pub tier: Tier,
    /// For a rule of a weaker tier copied under a `Pass` rule: the Pass rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passed_by: Option<Arc<Origin>>,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {}/{}", self.kind, ns, self.name)?,
            None => write!(f, "{} {}", self.kind, self.name)?,
        }
        if self.tier != Tier::Ordnet {
            write!(f, " {}", self.tier)?;
        }
        write!(f, " {}[{}]", self.direction, self.rule_index)?;
        if let Some(n) = &self.rule_name {
            write!(f, " {n:?}")?;
        }
        write!(f, " prio {} {}", self.priority, self.action)?;
        if let Some(p) = &self.passed_by {
            write!(f, " (after the pass of {p})")?;
        }
        Ok(())
    }
}

/// Caller-chosen unique id of a policy entry (used to remove it or change its selection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct EntryId(pub u64);

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Which peers an entry applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Selector {
    /// Every identity (and addresses without one).
    Any,
    /// Exactly these identities (possibly none, for a selector that currently selects nothing).
    Ids(IdSet),
}

impl Selector {
    /// A selector of exactly these identities.
    pub fn ids(ids: impl IntoIterator<Item = Identity>) -> Selector {
        Selector::Ids(ids.into_iter().collect())
    }

    /// Whether identity `id` is selected.
    pub fn selects(&self, id: Identity) -> bool {
        match self {
            Selector::Any => true,
            Selector::Ids(s) => s.contains(id),
        }
    }
}

/// One resolved policy entry for one endpoint and direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyEntry {
    /// Caller-chosen id; unique within one MapState.
    pub id: EntryId,
    /// Where the entry ranks (lower is stronger; deny wins a tie).
    pub order: OrderKey,
    /// What the entry does with the traffic it matches.
    pub action: Action,
    /// The peers the entry applies to.
    pub selector: Selector,
    /// The protocols and ports the entry applies to.
    pub l4: L4Match,
    /// The policy rule the entry comes from (for `trace` and `dump`).
    pub origin: Arc<Origin>,
}

impl PolicyEntry {
    /// The verdict of an entry that decides by itself (`Pass` counts as allow: it is only ever
    /// one in the MapState's own resolved entries as a Baseline Pass, which allows).
    pub fn verdict(&self) -> Verdict {
        match self.action {
            Action::Deny => Verdict::Deny,
            Action::Allow | Action::Pass => Verdict::Allow,
        }
    }

    /// The rank of this entry among the entries of its tier: order key, then deny before pass
    /// before allow.
    pub fn rank(&self) -> (OrderKey, Action) {
        (self.order, self.action)
    }
}
