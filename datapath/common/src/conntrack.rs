//! Connection tracking as the per-packet decision uses it: the canonical key of a flow, which
//! packets belong to one, entry lifetimes and TCP state, ICMP errors about a tracked flow, and
//! [`Track`]: step 1 (the lookup that passes an established packet at once) and step 4
//! (recording the verdict) of [`crate::decide_at`]. `docs/datapath.md` §7.

use crate::{
    Fragment, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, Icmp, IpPacket,
    layout::{
        COUNTER_UNTRACKED_ALLOWED, COUNTER_UNTRACKED_DENIED, CT_FIN_INITIATOR, CT_FIN_RESPONDER,
        CT_INITIATOR_A, CT_REPLIED, CT_RESET, CT_SERVICE, CtEntry, CtKey, IpInfo, IpKey, State,
        SvcKey, ct_closed,
    },
    verdict::{DatapathMaps, Decision, Hook, Reason, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, Verdict},
};

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

/// Whether an ICMP error is about a live tracked flow, stamped with the current revision (or
/// deferred to a Service), that its destination sent: the quoted packet (source: the error's
/// destination, checked by the parser) is looked up like a packet of that flow. An error about
/// a flow that is not tracked, expired, or awaiting a re-check is judged as ICMP by policy; it
/// never creates or refreshes state.
#[inline(always)]
pub(crate) fn related_flow<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M) -> bool {
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

/// Whether the node's own packet (locally generated, seen at the TC hook of the interface it
/// leaves by) belongs to a flow to track: a trackable flow to a local endpoint. Such a packet
/// always passes (traffic from a pod's own node to the pod is always allowed, SEMANTICS.md
/// §2); its flow is tracked with the node as the initiator, so that the endpoint's replies
/// pass its egress policy — and only they: the endpoint's own new traffic to the node is
/// judged like any egress. Costs one ipcache lookup for a packet to anything else (the node's
/// traffic out of the uplink), and the conntrack lookup of [`Track`] for a flow to a local
/// endpoint.
#[inline(always)]
pub(crate) fn node_flow<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M) -> bool {
    p.fragment != Fragment::Subsequent
        && has_flow(p)
        && maps
            .ipcache(&IpKey::new(p.ip_version, p.dst))
            .is_some_and(|i| i.is_endpoint())
}

/// The XDP program's short cut for the packet it sees most, an established flow's: the first
/// steps of [`crate::decide`] for a parsed IP packet, up to the tracking lookup — `Some` with
/// the decision exactly when [`crate::decide`] returns it there (a live entry with the current
/// stamp: `Established`, `Reply` or `ServiceFlow`, the entry refreshed as there), `None` when
/// the rest of the decision has to run. Of the packets a step before the lookup decides, a
/// later fragment is left to it here (its lookup would use ports 0); Neighbor Discovery and ICMP
/// errors are no tracked flow, which the lookup never passes. A pure SYN, which that step never
/// looks up, is left to it at once.
#[inline(always)]
pub fn established<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M) -> Option<Decision> {
    if p.fragment == Fragment::Subsequent
        || (p.protocol == IPPROTO_TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN)
    {
        return None;
    }
    Track::lookup(p, maps, Hook::Xdp).err()
}

/// A packet's connection-tracking state (step 1 of [`decide_at`]).
///
/// Only what the packet and the state cannot give again is kept: every field lives across the
/// ipcache and policy lookups, and in the kernel each one more is a register spilled to the
/// 512-byte stack.
pub(crate) struct Track {
    key: CtKey,
    /// `CT_INITIATOR_A` when the packet's source is side `a` of the key.
    initiator: u32,
    /// The clock, once read (0: not yet).
    now: u64,
    /// A live (not expired) entry of this flow was found.
    pub(crate) live: bool,
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
    pub(crate) fn lookup<M: DatapathMaps + ?Sized>(
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
    /// the translated replies (source: the frontend) find it there. `dst` is the destination's
    /// exact ipcache entry: an address that has one is only a frontend when the entry says so
    /// ([`IpInfo::is_frontend`]), so a new flow to a pod or a node costs no Service lookup.
    #[inline(always)]
    pub(crate) fn defer_service<M: DatapathMaps + ?Sized>(
        &mut self,
        p: &IpPacket,
        maps: &M,
        dst: Option<&IpInfo>,
    ) -> Option<Decision> {
        if !has_flow(p)
            || dst.is_some_and(|i| !i.is_frontend())
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
        self.entry = CtEntry {
            revision: revision_of(maps),
            last_seen: self.now,
            flags,
            _pad: 0,
        };
        self.store(maps);
    }

    /// Writes the entry to the table.
    #[inline(always)]
    fn store<M: DatapathMaps + ?Sized>(&self, maps: &M) {
        maps.ct_store(&self.key, &self.entry);
    }

    /// Whether the packet comes from the side that opened the tracked flow (or there is none).
    #[inline(always)]
    pub(crate) fn by_initiator(&self) -> bool {
        self.entry.flags & CT_INITIATOR_A == self.initiator
    }

    /// Step 4: a re-check restamps the entry (allowed) or deletes it (denied); an allowed new
    /// flow is tracked (an echo reply opens nothing), unless (a repeated SYN) an identical fresh
    /// entry exists; a denied packet creates no state.
    #[inline(always)]
    pub(crate) fn record<M: DatapathMaps + ?Sized>(
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
                if tcp {
                    self.entry.flags =
                        ct_tcp_progress(self.entry.flags, self.by_initiator(), p.tcp_flags);
                }
                self.entry.revision = revision_of(maps);
                self.entry.last_seen = self.now;
                self.store(maps);
                d.reason = Reason::Rechecked;
            } else {
                maps.ct_delete(&self.key);
                d.reason = Reason::RecheckDenied;
            }
            return d;
        }
        // A TCP packet past the handshake without a live entry: its flow's entry is gone
        // (evicted from a full table, expired, a restart) or there never was one (a scan).
        if tcp && p.tcp_flags & (TCP_SYN | TCP_RST) == 0 {
            maps.count(if d.verdict == Verdict::Pass {
                COUNTER_UNTRACKED_ALLOWED
            } else {
                COUNTER_UNTRACKED_DENIED
            });
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
