//! The per-packet decision: parse result + ipcache + connection tracking + policy lookups ->
//! PASS or DROP. The XDP program and userspace run this same function over their own
//! implementation of [`DatapathMaps`].
//!
//! Rules (`docs/datapath.md` §3, §5):
//! * not IP -> PASS; malformed (possibly) IP -> DROP; later fragment -> PASS without lookups;
//! * IPv6 Neighbor Discovery ([`neighbor_discovery`]) -> PASS without lookups;
//! * neither address is a local endpoint -> PASS (not ours to judge);
//! * either address belongs to this node -> PASS (traffic between a pod and its own node);
//! * source and destination are the same local endpoint -> PASS;
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
//!   frontend), nothing else, and is never re-checked;
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

use crate::{
    Fragment, ICMPV6_REDIRECT, ICMPV6_ROUTER_SOLICITATION, IPPROTO_ICMPV6, IPPROTO_SCTP,
    IPPROTO_TCP, IPPROTO_UDP, Icmp, IpPacket, ND_HOP_LIMIT, ParseError, Parsed,
    layout::{
        CT_FIN_INITIATOR, CT_FIN_RESPONDER, CT_INITIATOR_A, CT_REPLIED, CT_RESET, CT_SERVICE,
        CtEntry, CtKey, FAMILY_V4, IFACE_HAS_V4, IFACE_HAS_V6, IfaceInfo, IpInfo, IpKey, PolicyRef,
        State, SvcKey, ct_closed,
    },
    lookup::{PolicyDecision, PolicyMaps, policy_lookup},
};

#[allow(unused_imports)]
use crate::layout::{MAP_IFACE, MAP_SVC};

/// Where a packet is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    /// XDP on a local endpoint's host-side interface or the uplink: before netfilter, so a
    /// Service frontend is still the destination (such a new flow is deferred to [`Hook::Tc`]).
    Xdp,
    /// TC (tcx) egress of the interface the packet leaves by: after netfilter, so Service
    /// translation and source NAT are done. `ingress_ifindex` is the interface the packet came
    /// in on; the node's own packets (index 0) never reach the decision.
    Tc {
        /// `skb->ingress_ifindex`: the interface the packet came in on (0: the node's own).
        ingress_ifindex: u32,
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
    /// ipcache, prefix part: the identity of the longest prefix matching the full address.
    fn ipcidr(&self, key: &IpKey) -> Option<u32>;
    /// The tracking entry of a flow (canonical 5-tuple), if any.
    fn ct_lookup(&self, key: &CtKey) -> Option<CtEntry>;
    /// Insert or replace a tracking entry (errors, e.g. a full map, are ignored: the packet's
    /// verdict does not depend on them).
    fn ct_store(&self, key: &CtKey, entry: &CtEntry);
    /// Forget a tracking entry (a flow the policy no longer allows).
    fn ct_delete(&self, key: &CtKey);
    /// Monotonic clock in ticks of `State::hz` (the kernel's `bpf_jiffies64`).
    fn now(&self) -> u64;
    /// Whether a Service frontend is there ([`MAP_SVC`]).
    fn service(&self, key: &SvcKey) -> bool;
    /// The local endpoint behind an interface ([`MAP_IFACE`]).
    fn interface(&self, ifindex: u32) -> Option<IfaceInfo>;
}

/// Why a packet got its verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Not IPv4/IPv6 (PASS).
    NotIp,
    /// Truncated or invalid headers (DROP).
    Malformed(ParseError),
    /// A non-first IP fragment (PASS, no lookups).
    LaterFragment,
    /// An IPv6 Neighbor Discovery message (PASS, no lookups): see [`neighbor_discovery`].
    NeighborDiscovery,
    /// Neither address is a local endpoint (PASS).
    NotLocal,
    /// One address belongs to this node (PASS).
    Host,
    /// Source and destination are the same local endpoint (PASS).
    SameEndpoint,
    /// A packet of a tracked flow from its initiator, revision current (PASS).
    Established,
    /// A packet of a tracked flow towards its initiator, revision current (PASS).
    Reply,
    /// A new flow to a Service frontend, deferred to the TC program (XDP only; PASS, tracked
    /// as deferred).
    ServiceFrontend,
    /// A packet of a deferred flow to a Service frontend, either direction (PASS).
    ServiceFlow,
    /// An ICMP/ICMPv6 error about a tracked flow of its destination, revision current (PASS).
    Related,
    /// A tracked flow with an older revision whose original direction is still allowed
    /// (PASS, restamped).
    Rechecked,
    /// A tracked flow with an older revision that the policy no longer allows (DROP, entry
    /// deleted).
    RecheckDenied,
    /// Allowed by policy (PASS; a TCP/UDP/SCTP flow is now tracked).
    Allowed,
    /// Denied by the source endpoint's egress policy (DROP).
    EgressDenied,
    /// Denied by the destination endpoint's ingress policy (DROP).
    IngressDenied,
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
}

impl Decision {
    #[inline(always)]
    const fn simple(verdict: Verdict, reason: Reason) -> Self {
        Self {
            verdict,
            reason,
            egress: None,
            ingress: None,
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
    /// The sender's identity (only needed, and only computed, when `to` is local).
    from_id: u32,
    /// The receiver is a local endpoint, whose ingress policy is `to`.
    to_local: bool,
    to: PolicyRef,
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
        if !e.allow {
            d.verdict = Verdict::Drop;
            d.reason = Reason::EgressDenied;
            return d;
        }
    }
    if flow.to_local {
        let i = policy_lookup(maps, flow.to, flow.from_id, flow.protocol, flow.dport);
        d.ingress = Some(i);
        if !i.allow {
            d.verdict = Verdict::Drop;
            d.reason = Reason::IngressDenied;
        }
    }
    d
}

/// The identity of an address: its exact ipcache entry's, else (no entry, or an entry without
/// an identity: a node address) the longest CIDR entry's, else 0.
#[inline(always)]
fn identity_of<M: DatapathMaps + ?Sized>(
    maps: &M,
    exact: Option<&IpInfo>,
    family: u8,
    addr: &[u32; 4],
) -> u32 {
    match exact {
        Some(info) if info.identity != 0 => info.identity,
        _ => maps.ipcidr(&IpKey::new(family, *addr)).unwrap_or(0),
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

/// The canonical tracking key of a packet's flow, and whether the packet's source is side `a`.
#[inline(always)]
pub fn ct_key(p: &IpPacket) -> (CtKey, bool) {
    ct_key_of(p.ip_version, p.protocol, &p.src, p.sport, &p.dst, p.dport)
}

/// The canonical tracking key of the flow of a packet `src:sport -> dst:dport`, and whether
/// `src` is side `a`.
#[inline(always)]
pub fn ct_key_of(
    family: u8,
    protocol: u8,
    src: &[u32; 4],
    sport: u16,
    dst: &[u32; 4],
    dport: u16,
) -> (CtKey, bool) {
    // Any total order does, as long as kernel and userspace use the same: the raw words.
    let (s, d) = (src, dst);
    let src_is_a = (s[0], s[1], s[2], s[3], sport) <= (d[0], d[1], d[2], d[3], dport);
    let key = if src_is_a {
        CtKey {
            family,
            protocol,
            _pad: 0,
            port_a: sport,
            port_b: dport,
            addr_a: *src,
            addr_b: *dst,
        }
    } else {
        CtKey {
            family,
            protocol,
            _pad: 0,
            port_a: dport,
            port_b: sport,
            addr_a: *dst,
            addr_b: *src,
        }
    };
    (key, src_is_a)
}

/// Whether a packet belongs to a trackable flow: TCP, UDP, SCTP, or an ICMP/ICMPv6 echo
/// request or reply (keyed by its identifier). ICMP errors are judged by the flow they quote,
/// other ICMP per packet.
#[inline(always)]
pub fn has_flow(p: &IpPacket) -> bool {
    matches!(p.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)
        || matches!(p.icmp, Icmp::EchoRequest | Icmp::EchoReply)
}

/// The idle lifetime, in ticks, of a tracked flow of `protocol` whose entry has `flags`: a TCP
/// flow's depends on its state (only a SYN seen; established; closed by an RST or a FIN each
/// way).
#[inline(always)]
pub fn ct_lifetime(state: &State, protocol: u8, flags: u32) -> u64 {
    if protocol != IPPROTO_TCP {
        state.ct_other_ticks
    } else if ct_closed(flags) {
        u64::from(state.ct_close_ticks)
    } else if flags & CT_REPLIED == 0 {
        u64::from(state.ct_syn_ticks)
    } else {
        state.ct_tcp_ticks
    }
}

/// A TCP flow's state after one of its packets: the responder's first packet means the flow got
/// past its SYN; an RST closes it; a FIN marks its sender's half closed.
#[inline(always)]
pub fn ct_tcp_progress(flags: u32, from_initiator: bool, tcp_flags: u8) -> u32 {
    let mut f = flags;
    if !from_initiator {
        f |= CT_REPLIED;
    }
    if tcp_flags & TCP_RST != 0 {
        f |= CT_RESET;
    }
    if tcp_flags & TCP_FIN != 0 {
        f |= if from_initiator {
            CT_FIN_INITIATOR
        } else {
            CT_FIN_RESPONDER
        };
    }
    f
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
    let p = match parsed {
        Err(e) => return Decision::simple(Verdict::Drop, Reason::Malformed(*e)),
        Ok(Parsed::NotIp { .. }) => return Decision::simple(Verdict::Pass, Reason::NotIp),
        Ok(Parsed::Ip(p)) => p,
    };
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
    // 1. Connection tracking first.
    let mut t = match Track::lookup(p, maps, hook) {
        Ok(t) => t,
        Err(d) => return d,
    };
    // 1b. A new flow to a Service frontend (XDP only).
    let ingress_ifindex = match hook {
        Hook::Xdp => {
            if let Some(d) = t.defer_service(p, maps) {
                return d;
            }
            0
        }
        Hook::Tc { ingress_ifindex } => ingress_ifindex,
    };
    // 2. Who the two ends are.
    let ends = match Ends::resolve(p, maps, ingress_ifindex) {
        Ok(e) => e,
        Err(d) => return d,
    };
    // 3. The policy: of the packet's own direction, or, for a live entry with an older stamp,
    // of the flow's original direction (one `evaluate` call site keeps the program small).
    let d = evaluate(maps, &ends.flow(p, maps, &t));
    // 4. Tracking.
    t.record(p, maps, d)
}

/// Whether an ICMP error is about a live tracked flow, stamped with the current revision (or
/// deferred to a Service), that its destination sent: the quoted packet (source: the error's
/// destination, checked by the parser) is looked up like a packet of that flow. An error about
/// a flow that is not tracked, expired, or awaiting a re-check is judged as ICMP by policy; it
/// never creates or refreshes state.
#[inline(always)]
fn related_flow<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M) -> bool {
    let protocol = p.quote_protocol;
    let (key, _) = ct_key_of(
        p.ip_version,
        protocol,
        &p.dst,
        p.sport,
        &p.quote_peer,
        p.dport,
    );
    let (Some(e), Some(s)) = (maps.ct_lookup(&key), maps.state()) else {
        return false;
    };
    maps.now().saturating_sub(e.last_seen) <= ct_lifetime(s, protocol, e.flags)
        && (e.revision == s.revision || e.flags & CT_SERVICE != 0)
}

/// A packet's connection-tracking state (step 1 of [`decide_at`]).
///
/// Only what the packet and the state cannot give again is kept: every field lives across the
/// ipcache and policy lookups, and in the kernel each one more is a register spilled to the
/// 512-byte stack.
struct Track {
    key: CtKey,
    /// `CT_INITIATOR_A` when the packet's source is side `a` of the key.
    initiator: u32,
    /// The clock, once read (0: not yet).
    now: u64,
    /// A live (not expired) entry of this flow was found.
    live: bool,
    entry: CtEntry,
}

impl Track {
    /// Looks the flow up: a packet of a tracked flow whose stamp is current passes after this
    /// one lookup (no ipcache, no policy): `Err` with that decision. Entries exist only for
    /// flows that involve a local endpoint and were allowed; the revision changes whenever an
    /// endpoint, an identity or a policy changes, so a current stamp means the decision still
    /// holds. A pure SYN is a new connection attempt: at XDP it is checked below, and looks at
    /// the tracking table only once the policy has allowed it ([`Track::record`]). At the TC
    /// hook a pure SYN was usually just judged by XDP on its way in, which tracked it: an entry
    /// of the same direction with the current stamp (not a deferred one) means the same policy
    /// allowed this very tuple, so it passes after the one lookup too.
    #[inline(always)]
    fn lookup<M: DatapathMaps + ?Sized>(
        p: &IpPacket,
        maps: &M,
        hook: Hook,
    ) -> Result<Track, Decision> {
        let is_tracked = has_flow(p);
        let tcp = p.protocol == IPPROTO_TCP;
        let syn = tcp && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        // Without a state (impossible once userspace initialised the map) every entry is
        // expired and the revision 0: flows are checked as new.
        let state = maps.state();
        let (revision, refresh) = match state {
            Some(s) => (s.revision, s.ct_refresh_ticks),
            None => (0, 0),
        };
        let (key, src_is_a) = ct_key(p);
        let initiator = if src_is_a { CT_INITIATOR_A } else { 0 };
        let mut now: u64 = 0;
        let mut live = false;
        let mut entry = CtEntry::default();
        let tc = matches!(hook, Hook::Tc { .. });
        if is_tracked && (!syn || tc) {
            if let Some(e) = maps.ct_lookup(&key) {
                now = maps.now();
                // An entry from the future (clock reset) counts as fresh.
                live = match state {
                    Some(s) => {
                        now.saturating_sub(e.last_seen) <= ct_lifetime(s, p.protocol, e.flags)
                    }
                    None => false,
                };
                entry = e;
            }
            let deferred = entry.flags & CT_SERVICE != 0;
            let same_direction = entry.flags & CT_INITIATOR_A == initiator;
            // A new connection attempt is only covered by a fresh entry of its own direction
            // that XDP just wrote (TC), and an echo message only by an entry in which it plays
            // its part (a request from the flow's initiator, a reply towards it): any other
            // entry says nothing about it and the packet is judged as new.
            let wrong_role = if syn {
                !same_direction || deferred || entry.revision != revision || ct_closed(entry.flags)
            } else {
                match p.icmp {
                    Icmp::EchoRequest => !same_direction,
                    Icmp::EchoReply => same_direction,
                    _ => false,
                }
            };
            if wrong_role {
                live = false;
                entry = CtEntry::default();
            }
            if live && (entry.revision == revision || deferred) {
                let flags = if tcp {
                    ct_tcp_progress(entry.flags, same_direction, p.tcp_flags)
                } else {
                    entry.flags
                };
                if flags != entry.flags || now.saturating_sub(entry.last_seen) > refresh {
                    maps.ct_store(
                        &key,
                        &CtEntry {
                            last_seen: now,
                            flags,
                            ..entry
                        },
                    );
                }
                let reason = if deferred {
                    Reason::ServiceFlow
                } else if same_direction {
                    Reason::Established
                } else {
                    Reason::Reply
                };
                return Err(Decision::simple(Verdict::Pass, reason));
            }
        }
        Ok(Track {
            key,
            initiator,
            now,
            live,
            entry,
        })
    }

    /// At XDP, a new flow to a Service frontend: kube-proxy translates it after this hook, so
    /// it is judged at the TC hook once the destination is the backend. Tracked as deferred, so
    /// the translated replies (source: the frontend) find it there.
    #[inline(always)]
    fn defer_service<M: DatapathMaps + ?Sized>(
        &mut self,
        p: &IpPacket,
        maps: &M,
    ) -> Option<Decision> {
        if !has_flow(p)
            || !maps.service(&SvcKey {
                family: p.ip_version,
                protocol: p.protocol,
                port: p.dport,
                addr: p.dst,
            })
        {
            return None;
        }
        self.track_new(maps, self.initiator | CT_SERVICE);
        Some(Decision::simple(Verdict::Pass, Reason::ServiceFrontend))
    }

    /// Tracks the flow from now on, with `flags`, at the current revision.
    #[inline(always)]
    fn track_new<M: DatapathMaps + ?Sized>(&mut self, maps: &M, flags: u32) {
        if self.now == 0 {
            self.now = maps.now();
        }
        maps.ct_store(
            &self.key,
            &CtEntry {
                revision: revision_of(maps),
                last_seen: self.now,
                flags,
                _pad: 0,
            },
        );
    }

    /// Whether the packet comes from the side that opened the tracked flow (or there is none).
    #[inline(always)]
    fn by_initiator(&self) -> bool {
        self.entry.flags & CT_INITIATOR_A == self.initiator
    }

    /// Step 4: a re-check restamps the entry (allowed) or deletes it (denied); an allowed new
    /// flow is tracked (an echo reply opens nothing), unless (a repeated SYN) an identical fresh
    /// entry exists; a denied packet creates no state.
    #[inline(always)]
    fn record<M: DatapathMaps + ?Sized>(
        mut self,
        p: &IpPacket,
        maps: &M,
        mut d: Decision,
    ) -> Decision {
        if !has_flow(p) {
            return d;
        }
        let tcp = p.protocol == IPPROTO_TCP;
        if self.live {
            if d.verdict == Verdict::Pass {
                let from_initiator = self.by_initiator();
                maps.ct_store(
                    &self.key,
                    &CtEntry {
                        revision: revision_of(maps),
                        last_seen: self.now,
                        flags: if tcp {
                            ct_tcp_progress(self.entry.flags, from_initiator, p.tcp_flags)
                        } else {
                            self.entry.flags
                        },
                        ..self.entry
                    },
                );
                d.reason = Reason::Rechecked;
            } else {
                maps.ct_delete(&self.key);
                d.reason = Reason::RecheckDenied;
            }
            return d;
        }
        if d.verdict == Verdict::Pass && p.icmp != Icmp::EchoReply {
            let syn = tcp && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
            let mut fresh = false;
            if syn
                && let Some(e) = maps.ct_lookup(&self.key)
                && let Some(s) = maps.state()
            {
                self.now = maps.now();
                fresh = e.revision == s.revision
                    && e.flags == self.initiator
                    && self.now.saturating_sub(e.last_seen) <= s.ct_refresh_ticks;
            }
            if !fresh {
                // A TCP flow first seen after its SYN (an agent restart, an evicted entry) is
                // past it; its FIN or RST counts as for any tracked flow.
                let flags = if tcp && !syn {
                    ct_tcp_progress(self.initiator | CT_REPLIED, true, p.tcp_flags)
                } else {
                    self.initiator
                };
                self.track_new(maps, flags);
            }
        }
        d
    }
}

/// The current policy revision (0 without a state: every entry is then stale).
#[inline(always)]
fn revision_of<M: DatapathMaps + ?Sized>(maps: &M) -> u64 {
    maps.state().map_or(0, |s| s.revision)
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
    /// decision here (`Err`): neither end local, traffic between a pod and its node (at TC a
    /// node source on a forwarded packet was rewritten: it is judged), a pod with itself (at
    /// XDP only: at TC it is a hairpin through a Service, judged).
    #[inline(always)]
    fn resolve<M: DatapathMaps + ?Sized>(
        p: &IpPacket,
        maps: &'m M,
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
        let dst = maps.ipcache(&IpKey::new(p.ip_version, p.dst));
        let src_local = src.is_some_and(|i| i.is_endpoint());
        let dst_local = dst.is_some_and(|i| i.is_endpoint());
        if !src_local && !dst_local {
            return Err(Decision::simple(Verdict::Pass, Reason::NotLocal));
        }
        let src_host = !attributed && ingress_ifindex == 0 && src.is_some_and(|i| i.is_host());
        if src_host || dst.is_some_and(|i| i.is_host()) {
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
    /// ingress, the original destination port). A side's identity is only needed to check the
    /// other side's policy.
    #[inline(always)]
    fn flow<M: DatapathMaps + ?Sized>(&self, p: &IpPacket, maps: &M, t: &Track) -> Flow {
        let (src, dst, src_local, dst_local) = (self.src, self.dst, self.src_local, self.dst_local);
        let src_id = if dst_local {
            identity_of(maps, src, p.ip_version, &p.src)
        } else {
            0
        };
        let dst_id = if src_local {
            identity_of(maps, dst, p.ip_version, &p.dst)
        } else {
            0
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
                from_id: dst_id,
                to_local: src_local,
                to: policy(src, false),
                to_id: src_id,
                protocol: p.protocol,
                dport: p.sport,
            }
        } else {
            Flow {
                from_local: src_local,
                from: policy(src, true),
                from_id: src_id,
                to_local: dst_local,
                to: policy(dst, false),
                to_id: dst_id,
                protocol: p.protocol,
                dport: p.dport,
            }
        }
    }
}
