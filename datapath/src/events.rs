//! The programs' verdict events in userspace (`common::event`, `docs/observe.md`): the reader
//! of the ring buffer, and the decoded event.
//!
//! The programs write a [`FlowEvent`] for the first packet of every new flow the policy judged
//! and for denied packets (aggregated per flow), within a per-CPU rate limit. [`EventReader`]
//! takes them out of the ring buffer; [`Observed`] is one of them decoded (addresses, names
//! of the reason and of what decided each direction), knowing nothing of Kubernetes: naming the
//! rule is the caller's (the agent resolves it against the engine's MapStates).

use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use aya::maps::{MapData, RingBuf};
use ordnet_datapath_common::{
    addr_bytes,
    event::{
        BY_ALLOWED, BY_DEFAULT, BY_INVALID, BY_KEY, BY_NONE, BY_WILDCARD, FlowEvent, HOOK_TC,
        reason_name,
    },
};
use serde::Serialize;

/// The reader of the programs' event ring buffer ([`Datapath::events`](crate::Datapath::events)).
/// Poll its file descriptor for readability (e.g. with tokio's `AsyncFd`), then
/// [`EventReader::drain`].
pub struct EventReader {
    ring: RingBuf<MapData>,
}

impl EventReader {
    pub(crate) fn new(ring: RingBuf<MapData>) -> EventReader {
        EventReader { ring }
    }

    /// Appends every event waiting in the ring buffer to `out` (in the order the programs
    /// wrote them); the number appended. Records of another size (none are written) are
    /// skipped.
    pub fn drain(&mut self, out: &mut Vec<FlowEvent>) -> usize {
        let before = out.len();
        while let Some(item) = self.ring.next() {
            if item.len() == size_of::<FlowEvent>() {
                // SAFETY: the record is exactly a `FlowEvent` (plain integers, any bit pattern
                // valid); read unaligned from the ring's memory.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent>()) });
            }
        }
        out.len() - before
    }
}

impl AsFd for EventReader {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ring.as_fd()
    }
}

impl AsRawFd for EventReader {
    fn as_raw_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }
}

/// What decided one direction's lookup ([`FlowEvent::egress`]/`ingress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(
    tag = "kind",
    rename_all = "lowercase",
    rename_all_fields = "camelCase"
)]
pub enum DecidedBy {
    /// The direction was not judged.
    None,
    /// The peer identity's own key, of this prefix (protocol, port, length).
    Key {
        /// Protocol fixed by the key (0 = any).
        protocol: u8,
        /// Port of the key (its first).
        port: u16,
        /// Prefix length of the key (0, 8 = the protocol, 24 = one port).
        length: u8,
    },
    /// The rule set's wildcard (`*`) key covering the port, of this prefix.
    Wildcard {
        /// Protocol fixed by the key (0 = any).
        protocol: u8,
        /// Port of the key (its first).
        port: u16,
        /// Prefix length of the key.
        length: u8,
    },
    /// The endpoint's isolation default.
    Default,
    /// A map read failed (denied: fail closed).
    Invalid,
}

impl DecidedBy {
    /// Decodes a `BY_*` code (without [`BY_ALLOWED`]) and the key prefix.
    pub fn of(code: u8, prefix: u32) -> DecidedBy {
        match code & !BY_ALLOWED {
            BY_NONE => DecidedBy::None,
            BY_KEY => DecidedBy::Key {
                protocol: (prefix >> 24) as u8,
                port: (prefix >> 8) as u16,
                length: prefix as u8,
            },
            BY_WILDCARD => DecidedBy::Wildcard {
                protocol: (prefix >> 24) as u8,
                port: (prefix >> 8) as u16,
                length: prefix as u8,
            },
            BY_DEFAULT => DecidedBy::Default,
            BY_INVALID => DecidedBy::Invalid,
            _ => DecidedBy::Invalid,
        }
    }
}

/// One verdict event, decoded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Observed {
    /// When it was emitted (`CLOCK_MONOTONIC`, ns; [`crate::monotonic_ns`] is the same clock).
    pub time_ns: u64,
    /// The first packet it stands for.
    pub first_ns: u64,
    /// The policy revision the packet was judged with.
    pub revision: u64,
    /// Packets it stands for (aggregated denials: more than 1).
    pub packets: u32,
    /// `"xdp"` or `"tc"`.
    pub hook: &'static str,
    /// The interface the packet came in on (0: the node's own).
    pub ifindex: u32,
    /// Whether the packet passed.
    pub allowed: bool,
    /// The decision's reason (`allowed`, `rechecked`, `egress-denied`, `ingress-denied`,
    /// `recheck-denied`).
    pub reason: &'static str,
    /// IP protocol number.
    pub protocol: u8,
    /// Source address.
    pub src: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination address.
    pub dst: IpAddr,
    /// Destination port.
    pub dport: u16,
    /// What decided the sender's egress, and whether it allowed.
    pub egress: (DecidedBy, bool),
    /// What decided the receiver's ingress, and whether it allowed.
    pub ingress: (DecidedBy, bool),
}

impl Observed {
    /// Decodes a raw event.
    pub fn of(e: &FlowEvent) -> Observed {
        let addr = |w: [u32; 4]| -> IpAddr {
            let b = addr_bytes(w);
            if e.family == 4 {
                IpAddr::from([b[0], b[1], b[2], b[3]])
            } else {
                IpAddr::from(b)
            }
        };
        Observed {
            time_ns: e.time_ns,
            first_ns: e.first_ns,
            revision: e.revision,
            packets: e.packets,
            hook: if e.hook == HOOK_TC { "tc" } else { "xdp" },
            ifindex: e.ifindex,
            allowed: e.verdict == 1,
            reason: reason_name(e.reason),
            protocol: e.protocol,
            src: addr(e.src),
            sport: e.sport,
            dst: addr(e.dst),
            dport: e.dport,
            egress: (
                DecidedBy::of(e.egress, e.egress_prefix),
                e.egress & BY_ALLOWED != 0,
            ),
            ingress: (
                DecidedBy::of(e.ingress, e.ingress_prefix),
                e.ingress & BY_ALLOWED != 0,
            ),
        }
    }

    /// Whether the flow judged was the packet's reverse direction: a reply re-checked after a
    /// policy change is judged as its flow's original direction (the initiator's egress, the
    /// responder's ingress, the original destination port).
    pub fn rechecked(&self) -> bool {
        matches!(self.reason, "rechecked" | "recheck-denied")
    }
}
