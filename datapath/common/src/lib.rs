//! Types and code shared by the ordnet XDP program (`ordnet-datapath-ebpf`) and userspace.
//!
//! * [`layout`]: map names, key and value layouts of the enforcing datapath (ipcache, rule set
//!   cells, policy keys, connection tracking, global state).
//! * [`parse()`]: the packet parser. It is generic over [`Frame`], so the *same* code runs in the
//!   kernel (over the XDP packet, bounds-checked against `data_end`) and on the host (over a
//!   byte slice).
//! * [`lookup::policy_lookup`]: the policy lookup on the flattened maps, and [`decide_at`]: the
//!   whole per-packet decision (ipcache, exemptions, connection tracking, Service frontends,
//!   egress and ingress policy) at either hook ([`Hook::Xdp`] before netfilter, [`Hook::Tc`]
//!   after it; [`decide`] is the XDP one). Both are generic over the map access traits ([`lookup::PolicyMaps`],
//!   [`DatapathMaps`]); the kernel implements them over its BPF maps, userspace over its
//!   in-memory copy or the live maps. Host tools and tests that call these functions therefore
//!   compute exactly the verdict the kernel computes: there is no second implementation that
//!   could drift.
//! * [`handoff`]: the tag XDP leaves in a tracked packet's metadata so that the TC hook of the
//!   same packet passes it without a second conntrack lookup.
//! * [`event`]: the verdict events the programs emit for new flows and denied packets (with
//!   what decided each direction), their per-flow aggregation and rate limit.
//! * `alt` (feature `bench`): the alternative policy layouts the benchmark compares (not used
//!   for enforcement).
//! * [`craft`] (feature `std`): builders for well-formed and deliberately broken frames.
//!
//! The crate is `#![no_std]`; the `user` feature adds the `aya::Pod` impls that userspace needs
//! to read and write the maps.
#![no_std]

#[cfg(any(test, feature = "std"))]
extern crate std;

#[cfg(feature = "bench")]
pub mod alt;
mod conntrack;
#[cfg(any(test, feature = "std"))]
pub mod craft;
pub mod event;
pub mod handoff;
pub mod layout;
pub mod lookup;
mod parse;
mod verdict;

pub use conntrack::{ct_key, ct_key_of, ct_lifetime, ct_tcp_progress, established, has_flow};
pub use layout::PROGRAM_NAME;
pub use parse::{
    ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, Fragment, Frame,
    ICMP_DEST_UNREACHABLE, ICMP_ECHO_REPLY, ICMP_ECHO_REQUEST, ICMP_PARAMETER_PROBLEM,
    ICMP_TIME_EXCEEDED, ICMPV6_DEST_UNREACHABLE, ICMPV6_ECHO_REPLY, ICMPV6_ECHO_REQUEST,
    ICMPV6_NEIGHBOR_ADVERTISEMENT, ICMPV6_NEIGHBOR_SOLICITATION, ICMPV6_PACKET_TOO_BIG,
    ICMPV6_PARAMETER_PROBLEM, ICMPV6_REDIRECT, ICMPV6_ROUTER_ADVERTISEMENT,
    ICMPV6_ROUTER_SOLICITATION, ICMPV6_TIME_EXCEEDED, IPPROTO_AH, IPPROTO_DSTOPTS, IPPROTO_ESP,
    IPPROTO_FRAGMENT, IPPROTO_HIP, IPPROTO_HOPOPTS, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_MH,
    IPPROTO_NONE, IPPROTO_ROUTING, IPPROTO_SCTP, IPPROTO_SHIM6, IPPROTO_TCP, IPPROTO_UDP, Icmp,
    IpPacket, MAX_HEADER_BYTES, MAX_IPV6_EXT_HEADERS, MAX_VLAN_TAGS, ND_HOP_LIMIT, ParseError,
    Parsed, addr_bytes, addr_words, ipv4_in_16, parse, parse_l3, parse_simple,
};
pub use verdict::{
    DatapathMaps, Decision, Hook, Reason, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, Verdict, decide,
    decide_at, neighbor_discovery,
};

#[cfg(test)]
mod tests;
