//! The per-packet decision: parse result + ipcache + connection tracking + policy lookups ->
//! PASS or DROP. The XDP program and userspace run this same function over their own
//! implementation of [`DatapathMaps`].
//!
//! Rules (`docs/datapath.md` §3, §5):
//! * not IP -> PASS; malformed (possibly) IP -> DROP; later fragment -> PASS without lookups;
//! * IPv6 Neighbor Discovery ([`neighbor_discovery`]) -> PASS without lookups;
//! * [`Hook::Tc`] with `ingress_ifindex` 0, the node's own packet -> PASS, and a flow it opens
//!   to a local endpoint is tracked (so the endpoint's replies pass, `conntrack::node_flow`);
//! * neither address is a local endpoint -> PASS (not ours to judge);
//! * the source belongs to this node (at XDP: its packets never pass this hook, so only a
//!   spoofed one, which the kernel's source validation drops) -> PASS; a packet *to* the node
//!   is judged by the sender's egress like any other (the node address's identity), except the
//!   replies of the node's own flows (tracked at TC);
//! * source and destination are the same local endpoint -> PASS;
//! * [`Hook::Tc`]: a packet XDP passed as a tracked flow's and tagged (`handoff`), with the
//!   same addresses, ports and policy revision -> PASS without lookups;
//! * TCP/UDP/SCTP: a tracked flow (either direction) stamped with the current policy revision
//!   passes (this is checked first: one lookup); a stale one is re-checked in its original
//!   direction (allowed: restamped and passed; denied: entry deleted, packet dropped). A TCP
//!   packet with SYN and without ACK is a new connection attempt and checked, except at
//!   [`Hook::Tc`] when an entry of its own direction carries the current stamp (XDP just
//!   allowed the same tuple under the same policy);
//! * [`Hook::Xdp`] only: a new TCP/UDP/SCTP flow to a Service frontend ([`MAP_SVC`]: kube-proxy
//!   translates it after XDP) passes unjudged and is tracked as deferred ([`CT_SERVICE`]); its
//!   translated packets are judged at [`Hook::Tc`], where the destination is the backend. A
//!   deferred entry passes the flow's own packets and the translated replies (source: the
//!   frontend), nothing else, and is never re-checked. A destination with an exact ipcache
//!   entry is only looked up in [`MAP_SVC`] when the entry is marked as a frontend's
//!   (`IP_FLAG_FRONTEND`);
//! * [`Hook::Tc`] only: a packet whose source address is not a local endpoint but that came in
//!   on a local endpoint's interface ([`MAP_IFACE`]: kube-proxy masqueraded it, e.g. hairpin) is
//!   that endpoint's; a pod reaching itself (a hairpin through a Service: nothing else brings
//!   a pod's traffic to itself out of it) is judged like any flow to that backend, where XDP
//!   exempts a pod with itself; a source address of this node is exempt only for the node's own traffic
//!   (the caller passes locally generated packets before calling), so a forwarded packet whose
//!   source was rewritten to a node address is judged with that address's identity;
//! * otherwise the policy decides: egress of the source when it is a local endpoint, ingress of
//!   the destination when it is a local endpoint, both must allow. An allowed TCP/UDP/SCTP packet
//!   creates (or refreshes) the tracking entry; a denied one creates nothing.
//!
//! Connection tracking (steps 1 and 4) is in `conntrack.rs`.

use crate::{
    Fragment, ICMPV6_REDIRECT, ICMPV6_ROUTER_SOLICITATION, IPPROTO_ICMPV6, Icmp, IpPacket,
    ND_HOP_LIMIT, ParseError, Parsed,
    conntrack::{Track, node_flow, related_flow},
    handoff,
    layout::{
        CtEntry, CtKey, FAMILY_V4, IFACE_HAS_V4, IFACE_HAS_V6, IfaceInfo, IpInfo, IpKey, PolicyRef,
        SPACE_EGRESS, SPACE_INGRESS, State, SvcKey,
    },
    lookup::{PolicyDecision, PolicyMaps, policy_lookup},
};

#[allow(unused_imports)]
use crate::layout::{MAP_COUNTERS, MAP_IFACE, MAP_SVC};

/// Where a packet is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    /// XDP on a local endpoint's host-side interface or the uplink: before netfilter, so a
    /// Service frontend is still the destination (such a new flow is deferred to [`Hook::Tc`]).
    Xdp,
    /// TC (tcx) egress of the interface the packet leaves by: after netfilter, so Service
    /// translation and source NAT are done. `ingress_ifindex` is the interface the packet came
    /// in on; index 0 is the node's own packet, which always passes (its flows to local
    /// endpoints are tracked).
    Tc {
        /// `skb->ingress_ifindex`: the interface the packet came in on (0: the node's own).
        ingress_ifindex: u32,
        /// The tag XDP left in the packet's metadata (`handoff`), 0 for none.
        handoff: u64,
    },
}

/// What the XDP program returns for a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// `XDP_PASS`.
    Pass,
    /// `XDP_DROP`.
    Drop,
}

/// TCP flag bits (byte 13 of the TCP header): FIN.
pub const TCP_FIN: u8 = 0x01;
/// SYN.
pub const TCP_SYN: u8 = 0x02;
/// RST.
pub const TCP_RST: u8 = 0x04;
/// ACK.
pub const TCP_ACK: u8 = 0x10;

/// Everything the decision reads and writes besides the packet.
pub trait DatapathMaps: PolicyMaps {
    /// The global state (policy revision, clock parameters).
    fn state(&self) -> Option<&State>;
    /// ipcache, exact part. (A reference: in the kernel the map value itself, which stays
    /// valid for the program run; copies would not fit the 512-byte stack.)
    fn ipcache(&self, key: &IpKey) -> Option<&IpInfo>;
    /// ipcache, prefix part: what the policy lookups probe with for the longest prefix
    /// matching the full address ([`IpInfo::peer`] of its entry).
    fn ipcidr(&self, key: &IpKey) -> Option<[u32; 2]>;
    /// The tracking entry of a flow (canonical 5-tuple), if any.
    fn ct_lookup(&self, key: &CtKey) -> Option<CtEntry>;
    /// Insert or replace a tracking entry (errors, e.g. a full map, are ignored: the packet's
    /// verdict does not depend on them).
    fn ct_store(&self, key: &CtKey, entry: &CtEntry);
    /// Forget a tracking entry (a flow the policy no longer allows).
    fn ct_delete(&self, key: &CtKey);
    /// Adds one to event counter `counter` ([`MAP_COUNTERS`], a `COUNTER_*` index). Userspace
    /// counts nothing (the default).
    fn count(&self, _counter: u32) {}
    /// Notes a policy lookup about to decide a packet in direction `egress` (else ingress):
    /// its rule set and what it probed for the peer (its identity, or its class). With the decision's code and prefix they
    /// name the deciding key, whose rule counter the kernel's observer counts in
    /// ([`crate::event::Summary::rule_counter`]). The kernel keeps them in this CPU's
    /// `event::EventCpu` (map memory: not on the programs' full stacks, and not tracked by
    /// the verifier, so its states do not multiply); userspace counts nothing (the default).
    fn judged(&self, _egress: bool, _ruleset: u32, _peer: u32) {}
    /// Monotonic clock in ticks of `State::hz` (the kernel's `bpf_jiffies64`).
    fn now(&self) -> u64;
    /// Whether a Service frontend is there ([`MAP_SVC`]).
    fn service(&self, key: &SvcKey) -> bool;
    /// The local endpoint behind an interface ([`MAP_IFACE`]).
    fn interface(&self, ifindex: u32) -> Option<IfaceInfo>;
    /// The key of the XDP-to-TC handoff tags (`handoff`): drawn at random when the programs
    /// are loaded; 0 (the default) means no handoff.
    fn handoff_key(&self) -> u64 {
        0
    }
}

/// Why a packet got its verdict. The discriminants are stable: the event code of a reason
/// ([`Reason::code`], `event::FlowEvent::reason`); those that emit verdict events are 1..=5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reason {
    /// Not IPv4/IPv6 (PASS).
    NotIp = 6,
    /// Truncated or invalid headers (DROP).
    Malformed(ParseError) = 7,
    /// A non-first IP fragment (PASS, no lookups).
    LaterFragment = 8,
    /// An IPv6 Neighbor Discovery message (PASS, no lookups): see [`neighbor_discovery`].
    NeighborDiscovery = 9,
    /// Neither address is a local endpoint (PASS).
    NotLocal = 10,
    /// The node's own packet (at TC), or a packet from a node address (PASS).
    Host = 11,
    /// Source and destination are the same local endpoint (PASS).
    SameEndpoint = 12,
    /// A packet of a tracked flow from its initiator, revision current (PASS).
    Established = 13,
    /// A packet of a tracked flow towards its initiator, revision current (PASS).
    Reply = 14,
    /// At TC: XDP passed this very packet (same addresses, ports, revision) as
    /// [`Reason::Established`] or [`Reason::Reply`] and said so in its metadata (PASS, no
    /// lookup; `handoff`).
    HandedOff = 15,
    /// A new flow to a Service frontend, deferred to the TC program (XDP only; PASS, tracked
    /// as deferred).
    ServiceFrontend = 16,
    /// A packet of a deferred flow to a Service frontend, either direction (PASS).
    ServiceFlow = 17,
    /// An ICMP/ICMPv6 error about a tracked flow of its destination, revision current (PASS).
    Related = 18,
    /// A tracked flow with an older revision whose original direction is still allowed
    /// (PASS, restamped).
    Rechecked = 2,
    /// A tracked flow with an older revision that the policy no longer allows (DROP, entry
    /// deleted).
    RecheckDenied = 5,
    /// Allowed by policy (PASS; a TCP/UDP/SCTP flow is now tracked).
    Allowed = 1,
    /// Denied by the source endpoint's egress policy (DROP).
    EgressDenied = 3,
    /// Denied by the destination endpoint's ingress policy (DROP).
    IngressDenied = 4,
}

impl Reason {
    /// The reason's code (its discriminant), read without a branch: the verifier then does not
    /// tell the decision's paths apart by their reason where the event code only stores it.
    #[inline(always)]
    pub fn code(&self) -> u8 {
        // SAFETY: `Reason` is `repr(u8)`: its first byte is the discriminant.
        unsafe { *(self as *const Reason).cast::<u8>() }
    }
}

/// The verdict of one packet and how it came about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Decision {
    /// What happens to the packet.
    pub verdict: Verdict,
    /// Why.
    pub reason: Reason,
    /// The egress lookup of the (original-direction) source, when it was made.
    pub egress: Option<PolicyDecision>,
    /// The ingress lookup of the (original-direction) destination, when it was made.
    pub ingress: Option<PolicyDecision>,
    /// What decided the lookups, for the verdict event: the egress lookup's
    /// [`PolicyDecision::code`] in bits 0..8, the ingress one's in bits 8..16 (0: not made).
    /// Plain integers set where the lookups are made, so the event code reads them without
    /// branching on the `Option`s above.
    pub codes: u32,
    /// The lookups' [`PolicyDecision::prefix`]: egress in the low half, ingress in the high.
    pub prefixes: u64,
}

impl Decision {
    #[inline(always)]
    pub(crate) const fn simple(verdict: Verdict, reason: Reason) -> Self {
        Self {
            verdict,
            reason,
            egress: None,
            ingress: None,
            codes: 0,
            prefixes: 0,
        }
    }
}

/// One direction of a flow as the policy sees it. Plain values with flags instead of `Option`s
/// of structs: LLVM may copy the undefined payload of a `None` through merged paths, and the
/// verifier rejects reading uninitialised registers.
#[derive(Clone, Copy)]
struct Flow {
    /// The sender is a local endpoint, whose egress policy is `from`.
    from_local: bool,
    from: PolicyRef,
    /// What `to`'s ingress policy probes for the sender: its identity, or its class of the
    /// ingress space (only needed, and only computed, when `to` is local).
    from_id: u32,
    /// The receiver is a local endpoint, whose ingress policy is `to`.
    to_local: bool,
    to: PolicyRef,
    /// What `from`'s egress policy probes for the receiver (its class of the egress space).
    to_id: u32,
    protocol: u8,
    dport: u16,
}

/// Both policy checks of one direction; egress first.
#[inline(always)]
fn evaluate<M: DatapathMaps + ?Sized>(maps: &M, flow: &Flow) -> Decision {
    let mut d = Decision::simple(Verdict::Pass, Reason::Allowed);
    if flow.from_local {
        let e = policy_lookup(maps, flow.from, flow.to_id, flow.protocol, flow.dport);
        d.egress = Some(e);
        d.codes = u32::from(e.code);
        d.prefixes = u64::from(e.prefix);
        maps.judged(true, flow.from.ruleset, flow.to_id);
        if !e.allow {
            d.verdict = Verdict::Drop;
            d.reason = Reason::EgressDenied;
            return d;
        }
    }
    if flow.to_local {
        let i = policy_lookup(maps, flow.to, flow.from_id, flow.protocol, flow.dport);
        d.ingress = Some(i);
        d.codes |= u32::from(i.code) << 8;
        d.prefixes |= u64::from(i.prefix) << 32;
        maps.judged(false, flow.to.ruleset, flow.from_id);
        if !i.allow {
            d.verdict = Verdict::Drop;
            d.reason = Reason::IngressDenied;
        }
    }
    d
}

/// What the policy lookups of each space probe with for an address as a peer
/// ([`IpInfo::peer`]): its exact ipcache entry's, else (no entry, or an entry without an
/// identity: a node address) the longest CIDR entry's, else 0 (only the wildcard applies).
#[inline(always)]
fn peer_of<M: DatapathMaps + ?Sized>(
    maps: &M,
    exact: Option<&IpInfo>,
    family: u8,
    addr: &[u32; 4],
) -> [u32; 2] {
    match exact {
        Some(info) if info.identity != 0 => info.peer(),
        _ => maps.ipcidr(&IpKey::new(family, *addr)).unwrap_or([0; 2]),
    }
}

/// The ipcache record of the endpoint behind interface `ifindex`, for an address of `family`.
#[inline(always)]
fn interface_endpoint<M: DatapathMaps + ?Sized>(
    maps: &M,
    ifindex: u32,
    family: u8,
) -> Option<&IpInfo> {
    let iface = maps.interface(ifindex)?;
    let addr = if family == FAMILY_V4 {
        if iface.flags & IFACE_HAS_V4 == 0 {
            return None;
        }
        [iface.addr4, 0, 0, 0]
    } else {
        if iface.flags & IFACE_HAS_V6 == 0 {
            return None;
        }
        iface.addr6
    };
    maps.ipcache(&IpKey::new(family, addr))
        .filter(|i| i.is_endpoint() && i.endpoint == iface.endpoint)
}

/// Whether a packet is IPv6 Neighbor Discovery, which passes without policy like ARP, its IPv4
/// counterpart (a non-IP frame): ICMPv6 Router Solicitation/Advertisement, Neighbor
/// Solicitation/Advertisement or Redirect (types 133-137), hop limit 255, not fragmented.
///
/// Without this, a pod whose egress (or ingress) is isolated could not resolve or answer for
/// its neighbours (its Neighbor Advertisements from its global address to a router's link-local
/// address are traffic to an unknown peer) and would lose IPv6 entirely.
///
/// The hop limit and fragment conditions are checks every receiver makes (RFC 4861 §6.1.1,
/// §6.1.2, §7.1.1, §7.1.2, §8.1: hop limit != 255 is discarded; RFC 6980: fragmented ND is
/// ignored). Requiring them keeps the exemption from becoming a bypass: a packet with hop
/// limit 255 was not forwarded by any router, so the exemption cannot carry routed traffic,
/// and what passes is handled by the receiver as ND or not at all. A packet of these types
/// that fails them is not ND to anyone and is judged by policy like any other ICMPv6.
#[inline(always)]
pub fn neighbor_discovery(p: &IpPacket) -> bool {
    p.ip_version == 6
        && p.protocol == IPPROTO_ICMPV6
        && p.fragment == Fragment::No
        && p.hop_limit == ND_HOP_LIMIT
        && p.icmp6_type >= ICMPV6_ROUTER_SOLICITATION
        && p.icmp6_type <= ICMPV6_REDIRECT
}

/// The decision of the XDP program for a parsed frame ([`decide_at`] at [`Hook::Xdp`]).
#[inline(always)]
pub fn decide<M: DatapathMaps + ?Sized>(parsed: &Result<Parsed, ParseError>, maps: &M) -> Decision {
    decide_at(parsed, maps, Hook::Xdp)
}

/// The decision for a parsed frame at `hook`.
#[inline(always)]
pub fn decide_at<M: DatapathMaps + ?Sized>(
    parsed: &Result<Parsed, ParseError>,
    maps: &M,
    hook: Hook,
) -> Decision {
    // The node's own packet (TC, no interface it came in on) always passes; a flow it opens to
    // a local endpoint is tracked (`conntrack::node_flow`). It shares steps 1 and 4 with every
    // other packet: one copy of the tracking code keeps the TC program within its stack.
    let node = matches!(
        hook,
        Hook::Tc {
            ingress_ifindex: 0,
            ..
        }
    );
    let host = Decision::simple(Verdict::Pass, Reason::Host);
    let p = match parsed {
        Ok(Parsed::Ip(p)) => p,
        _ if node => return host,
        Err(e) => return Decision::simple(Verdict::Drop, Reason::Malformed(*e)),
        Ok(Parsed::NotIp { .. }) => return Decision::simple(Verdict::Pass, Reason::NotIp),
    };
    if node {
        if !node_flow(p, maps) {
            return host;
        }
    } else {
        // 0. At TC, a packet XDP passed as a tracked flow's, unchanged since (`handoff`).
        if let Hook::Tc { handoff, .. } = hook
            && let Some(d) = handoff::at_tc(p, maps, handoff)
        {
            return d;
        }
        if p.fragment == Fragment::Subsequent {
            return Decision::simple(Verdict::Pass, Reason::LaterFragment);
        }
        if neighbor_discovery(p) {
            return Decision::simple(Verdict::Pass, Reason::NeighborDiscovery);
        }
        // 0. An ICMP error about a tracked flow of its destination passes, whoever sends it.
        if p.icmp == Icmp::Error && related_flow(p, maps) {
            return Decision::simple(Verdict::Pass, Reason::Related);
        }
    }
    // 1. Connection tracking first.
    let mut t = match Track::lookup(p, maps, hook) {
        Ok(t) => t,
        Err(d) => return d,
    };
    let d = if node {
        // A stale entry of the endpoint's own flow (the node answering) is left to the
        // endpoint's next packet, which re-checks the endpoint's direction; a new flow of the
        // node's is tracked and a stale one restamped (allowed under any policy) below.
        if t.live && !t.by_initiator() {
            return host;
        }
        host
    } else {
        // 1b. A new flow to a Service frontend (XDP only): the destination's ipcache entry
        // first, which says whether its address can be one.
        let dst = maps.ipcache(&IpKey::new(p.ip_version, p.dst));
        let ingress_ifindex = match hook {
            Hook::Xdp => {
                if let Some(d) = t.defer_service(p, maps, dst) {
                    return d;
                }
                0
            }
            Hook::Tc {
                ingress_ifindex, ..
            } => ingress_ifindex,
        };
        // 2. Who the two ends are.
        let ends = match Ends::resolve(p, maps, dst, ingress_ifindex) {
            Ok(e) => e,
            Err(d) => return d,
        };
        // 3. The policy: of the packet's own direction, or, for a live entry with an older
        // stamp, of the flow's original direction (one `evaluate` call site keeps the program
        // small).
        evaluate(maps, &ends.flow(p, maps, &t))
    };
    // 4. Tracking.
    t.record(p, maps, d)
}

/// The two ends of a packet, as the ipcache (and at TC the interface) knows them (step 2 of
/// [`decide_at`]).
struct Ends<'m> {
    src: Option<&'m IpInfo>,
    dst: Option<&'m IpInfo>,
    src_local: bool,
    dst_local: bool,
}

impl<'m> Ends<'m> {
    /// At the TC hook a packet that came in on a local endpoint's interface is that
    /// endpoint's, whatever its source address says (source NAT). The exemptions end the
    /// decision here (`Err`): neither end local, a node source at XDP (at TC a node source on a
    /// forwarded packet was rewritten: it is judged), a pod with itself (at XDP only: at TC it
    /// is a hairpin through a Service, judged). A packet to a node address is not exempt: the
    /// sender's egress decides, with the address's identity (a node's, else its CIDR's).
    /// `dst`: the destination's exact ipcache entry, looked up by the caller.
    #[inline(always)]
    fn resolve<M: DatapathMaps + ?Sized>(
        p: &IpPacket,
        maps: &'m M,
        dst: Option<&'m IpInfo>,
        ingress_ifindex: u32,
    ) -> Result<Ends<'m>, Decision> {
        let mut src = maps.ipcache(&IpKey::new(p.ip_version, p.src));
        let mut attributed = false;
        if ingress_ifindex != 0
            && !src.is_some_and(|i| i.is_endpoint())
            && let Some(ep) = interface_endpoint(maps, ingress_ifindex, p.ip_version)
        {
            src = Some(ep);
            attributed = true;
        }
        let src_local = src.is_some_and(|i| i.is_endpoint());
        let dst_local = dst.is_some_and(|i| i.is_endpoint());
        if !src_local && !dst_local {
            return Err(Decision::simple(Verdict::Pass, Reason::NotLocal));
        }
        if !attributed && ingress_ifindex == 0 && src.is_some_and(|i| i.is_host()) {
            return Err(Decision::simple(Verdict::Pass, Reason::Host));
        }
        // A pod with itself is exempt at XDP. At TC a packet whose two ends are one endpoint is
        // a hairpin through a Service (a pod's traffic to its own address never leaves it; the
        // source is the pod's own address or, masqueraded, attributed to it by its interface):
        // judged like any flow to that backend (SEMANTICS.md §2, upstream ClusterNetworkPolicy).
        let endpoint = |i: Option<&IpInfo>| i.map_or(0, |i| i.endpoint);
        if ingress_ifindex == 0 && src_local && dst_local && endpoint(src) == endpoint(dst) {
            return Err(Decision::simple(Verdict::Pass, Reason::SameEndpoint));
        }
        Ok(Ends {
            src,
            dst,
            src_local,
            dst_local,
        })
    }

    /// The flow to judge: the packet's own direction, or for a reply on a live entry with an
    /// older stamp the flow's original direction (the initiator's egress, the responder's
    /// ingress, the original destination port; a flow the node opened is allowed whatever the
    /// responder's ingress says). A side's identity (or classes) is only needed to check the
    /// other side's policy: an ingress policy probes with the sender's ingress-space value, an
    /// egress policy with the receiver's egress-space value.
    #[inline(always)]
    fn flow<M: DatapathMaps + ?Sized>(&self, p: &IpPacket, maps: &M, t: &Track) -> Flow {
        let (src, dst, src_local, dst_local) = (self.src, self.dst, self.src_local, self.dst_local);
        let src_id = if dst_local {
            peer_of(maps, src, p.ip_version, &p.src)
        } else {
            [0; 2]
        };
        let dst_id = if src_local {
            peer_of(maps, dst, p.ip_version, &p.dst)
        } else {
            [0; 2]
        };
        let policy = |i: Option<&IpInfo>, egress: bool| {
            i.map_or(PolicyRef::default(), |i| {
                if egress { i.egress } else { i.ingress }
            })
        };
        if t.live && !t.by_initiator() {
            Flow {
                from_local: dst_local,
                from: policy(dst, true),
                from_id: dst_id[SPACE_INGRESS],
                to_local: src_local && !dst.is_some_and(|i| i.is_host()),
                to: policy(src, false),
                to_id: src_id[SPACE_EGRESS],
                protocol: p.protocol,
                dport: p.sport,
            }
        } else {
            Flow {
                from_local: src_local,
                from: policy(src, true),
                from_id: src_id[SPACE_INGRESS],
                to_local: dst_local,
                to: policy(dst, false),
                to_id: dst_id[SPACE_EGRESS],
                protocol: p.protocol,
                dport: p.dport,
            }
        }
    }
}
