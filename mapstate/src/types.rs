//! The input model of a MapState: resolved, ordered policy entries.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use crate::prefix::L4Prefix;

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
    Ingress,
    Egress,
}

impl Direction {
    /// Both directions, ingress first: the order of every per-direction array.
    pub const ALL: [Direction; 2] = [Direction::Ingress, Direction::Egress];

    /// The position in [`Direction::ALL`] (ingress 0, egress 1).
    pub fn index(self) -> usize {
        self as usize
    }

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
    Deny,
    Allow,
}

impl Verdict {
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
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IANA protocol number, as in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

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
        proto: Protocol,
        first: u16,
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

/// `(priority, rule index)`: lower is stronger (SEMANTICS.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct OrderKey {
    pub priority: i32,
    pub index: u32,
}

impl OrderKey {
    pub fn new(priority: i32, index: u32) -> Self {
        OrderKey { priority, index }
    }
}

impl fmt::Display for OrderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.priority, self.index)
    }
}

/// Where an entry comes from, so `trace` and `dump` can name the deciding rule. The strings are
/// opaque to this crate (the engine fills in Kubernetes kinds and names).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Origin {
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    pub direction: Direction,
    pub rule_index: u32,
    pub priority: i32,
    pub action: Verdict,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {}/{}", self.kind, ns, self.name)?,
            None => write!(f, "{} {}", self.kind, self.name)?,
        }
        write!(
            f,
            " {}[{}] prio {} {}",
            self.direction, self.rule_index, self.priority, self.action
        )
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
    Ids(BTreeSet<Identity>),
}

impl Selector {
    pub fn ids(ids: impl IntoIterator<Item = Identity>) -> Selector {
        Selector::Ids(ids.into_iter().collect())
    }

    pub fn selects(&self, id: Identity) -> bool {
        match self {
            Selector::Any => true,
            Selector::Ids(s) => s.contains(&id),
        }
    }
}

/// One resolved policy entry for one endpoint and direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyEntry {
    pub id: EntryId,
    pub order: OrderKey,
    pub verdict: Verdict,
    pub selector: Selector,
    pub l4: L4Match,
    pub origin: Arc<Origin>,
}

impl PolicyEntry {
    /// The rank of this entry: order key, then deny before allow.
    pub fn rank(&self) -> (OrderKey, Verdict) {
        (self.order, self.verdict)
    }
}
