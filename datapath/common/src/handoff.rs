//! The XDP-to-TC handoff: one conntrack lookup per established packet on its whole path.
//!
//! A packet that reaches a local pod, or leaves one for another node, passes both programs: XDP
//! where it enters the node, the TC hook of the interface it leaves by (after netfilter). For a
//! packet of a tracked flow XDP has already decided everything the TC hook would: the TC hook's
//! judgment of a packet whose tuple is unchanged and whose flow has a live, current, not
//! deferred entry is PASS whatever the interface (`Track::lookup` does not depend on the hook
//! for such a packet). So XDP, when it passes a packet as [`Reason::Established`] or
//! [`Reason::Reply`], writes a **tag** into the packet's XDP metadata (`bpf_xdp_adjust_meta`);
//! the kernel keeps it with the packet up to the TC hook (`__sk_buff.data_meta`), where a
//! matching tag passes the packet as [`Reason::HandedOff`] without the conntrack lookup.
//!
//! The metadata is [`HANDOFF_META`] bytes: the tag first, then zeros. The end of the metadata
//! touches the packet's link-layer header, and the kernel may overwrite it when it forwards the
//! packet: a cached hardware header is copied in 16-byte units ending at the packet's start
//! (`neigh_hh_output`, `HH_DATA_MOD`), 2 bytes before a 14-byte Ethernet header, 14 before an
//! 18-byte VLAN-tagged one. Measured: an 8-byte tag right before the frame survived on a
//! node's first packets to a neighbour and was clobbered on every packet once the neighbour's
//! header was cached. The zeros keep GRO merging a flow's packets (it compares metadata).
//!
//! The tag is a keyed hash of the packet's addresses, ports, protocol and the policy revision
//! XDP judged with ([`tag`]):
//! * **it cannot be forged**: the key is drawn at random each time the programs are loaded and
//!   lives in the programs' read-only data (no map, no way for a pod to read it); metadata
//!   another program wrote (another XDP program, a NIC's hints) matches with probability 2^-64;
//! * **a translated packet is judged again**: DNAT, SNAT/masquerade, a decapsulated inner
//!   packet have other addresses or ports, so another tag;
//! * **a policy change in between is judged again**: the revision is part of the tag (the TC
//!   hook then finds the entry stale and re-checks it, as without the handoff);
//! * the node's own packets (TC, `ingress_ifindex` 0) never use it (their flows to local
//!   endpoints are tracked at TC: `conntrack::node_flow`).
//!
//! A key of 0 means "no handoff" on both sides (a program loaded without one).
//!
//! The one difference from looking the entry up again: the TC hook takes XDP's word as of
//! XDP's moment, microseconds earlier (an entry that expires or is evicted in between would
//! have made the TC hook judge the packet as new).

use crate::conntrack::has_flow;
use crate::layout::COUNTER_HANDED_OFF;
use crate::parse::IpPacket;
use crate::verdict::{DatapathMaps, Decision, Reason, Verdict};

/// Bytes of XDP metadata the handoff takes (the most the kernel allows): the 8-byte tag, then
/// 24 zero bytes the kernel may overwrite on the way (see the module documentation).
pub const HANDOFF_META: usize = 32;

/// One keyed mixing round (multiply and fold: every input bit reaches every output bit after
/// two rounds).
#[inline(always)]
fn mix(h: u64, v: u64) -> u64 {
    let x = (h ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// The tag of packet `p` judged at policy revision `revision`, under `key`; never 0. Three
/// rounds for IPv4 (both addresses in one word, the ports, protocol and family in another, and
/// a closing keyed round), six for IPv6: both hooks compute it for every tagged packet.
#[inline(always)]
pub fn tag(key: u64, p: &IpPacket, revision: u64) -> u64 {
    let word = |w: [u32; 4], i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
    let ports = (u64::from(p.sport) << 32)
        | (u64::from(p.dport) << 16)
        | (u64::from(p.protocol) << 8)
        | u64::from(p.ip_version);
    let mut h = key ^ revision;
    if p.ip_version == 4 {
        h = mix(h, u64::from(p.src[0]) | (u64::from(p.dst[0]) << 32));
    } else {
        h = mix(h, word(p.src, 0));
        h = mix(h, word(p.src, 2));
        h = mix(h, word(p.dst, 0));
        h = mix(h, word(p.dst, 2));
    }
    h = mix(h, ports);
    h = mix(h, key);
    if h == 0 { 1 } else { h }
}

/// The tag XDP hands to the TC hook for packet `p` it decided with `d`: only for a packet of a
/// tracked flow passed by its live entry at the current revision (`None` otherwise, and
/// without a key).
#[inline(always)]
pub fn after_xdp<M: DatapathMaps + ?Sized>(p: &IpPacket, d: &Decision, maps: &M) -> Option<u64> {
    let key = maps.handoff_key();
    if key == 0
        || d.verdict != Verdict::Pass
        || !matches!(d.reason, Reason::Established | Reason::Reply)
    {
        return None;
    }
    let s = maps.state()?;
    Some(tag(key, p, s.revision))
}

/// The TC hook's first step for a forwarded packet (`decide_at`'s step 0): PASS as
/// [`Reason::HandedOff`], counted, when `handoff` is this very packet's tag ([`handed_off`]),
/// else `None` (the packet is judged in full). The TC program also takes it before anything
/// else, on a packet read at fixed offsets (`parse_simple`): the same decision, made without
/// the full parse.
#[inline(always)]
pub fn at_tc<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M, handoff: u64) -> Option<Decision> {
    if !handed_off(p, maps, handoff) {
        return None;
    }
    maps.count(COUNTER_HANDED_OFF);
    Some(Decision::simple(Verdict::Pass, Reason::HandedOff))
}

/// Whether the TC hook may pass packet `p` on XDP's word: `handoff` (the metadata found on the
/// packet, 0 for none) is the tag of this very packet at the current revision.
#[inline(always)]
fn handed_off<M: DatapathMaps + ?Sized>(p: &IpPacket, maps: &M, handoff: u64) -> bool {
    let key = maps.handoff_key();
    if handoff == 0 || key == 0 || !has_flow(p) {
        return false;
    }
    match maps.state() {
        Some(s) => handoff == tag(key, p, s.revision),
        None => false,
    }
}
