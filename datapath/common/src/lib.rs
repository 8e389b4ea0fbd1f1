//! Types and code shared by the ordnet XDP program (`ordnet-datapath-ebpf`) and userspace.
//!
//! * [`PortKey`] and the `ACTION_*` values: the layout of the program's single map,
//!   `PORT_VERDICTS` (a BPF hash map `PortKey -> u8`). This is the "foundation" layout; a later
//!   change replaces it with the flattened policy maps.
//! * [`parse()`]: the packet parser. It is generic over [`Frame`], so the *same* code runs in the
//!   kernel (over the XDP packet, bounds-checked against `data_end`) and on the host (over a
//!   byte slice), and [`verdict()`] turns its result plus a map lookup into PASS/DROP. Host
//!   tools and tests that call these functions therefore compute exactly the verdict the
//!   kernel computes: there is no second implementation that could drift.
//! * [`craft`] (feature `std`): builders for well-formed and deliberately broken frames.
//!
//! The crate is `#![no_std]`; the `user` feature adds the `aya::Pod` impls that userspace needs
//! to read and write the map.
#![no_std]

#[cfg(any(test, feature = "std"))]
extern crate std;

#[cfg(any(test, feature = "std"))]
pub mod craft;
mod parse;
mod verdict;

pub use parse::{
    ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, Fragment, Frame,
    IPPROTO_AH, IPPROTO_DSTOPTS, IPPROTO_ESP, IPPROTO_FRAGMENT, IPPROTO_HIP, IPPROTO_HOPOPTS,
    IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_MH, IPPROTO_NONE, IPPROTO_ROUTING, IPPROTO_SCTP,
    IPPROTO_SHIM6, IPPROTO_TCP, IPPROTO_UDP, IpPacket, MAX_HEADER_BYTES, MAX_IPV6_EXT_HEADERS,
    MAX_VLAN_TAGS, ParseError, Parsed, ipv4_in_16, parse,
};
pub use verdict::{Verdict, verdict};

/// Name of the XDP program in the eBPF object.
pub const PROGRAM_NAME: &str = "ordnet_xdp";
/// Name of the verdict map in the eBPF object.
pub const PORT_VERDICTS_MAP: &str = "PORT_VERDICTS";
/// Capacity of [`PORT_VERDICTS_MAP`].
pub const PORT_VERDICTS_MAX_ENTRIES: u32 = 4096;

/// Map value: let the packet through.
pub const ACTION_ALLOW: u8 = 0;
/// Map value: drop the packet.
pub const ACTION_DENY: u8 = 1;

/// Key of [`PORT_VERDICTS_MAP`]: (IP version, L4 protocol, destination port).
///
/// `port` is in host byte order (the program converts from network order); it is 0 for
/// protocols without ports (ICMP, ...). The struct is 4 bytes with no padding, so every byte
/// of the key the kernel hashes is defined.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    /// 4 or 6.
    pub ip_version: u8,
    /// IANA protocol number of the upper-layer protocol (6 TCP, 17 UDP, 132 SCTP, ...).
    pub protocol: u8,
    /// Destination port in host byte order, 0 for protocols without ports.
    pub port: u16,
}

const _: () = assert!(core::mem::size_of::<PortKey>() == 4);

impl PortKey {
    pub const fn new(ip_version: u8, protocol: u8, port: u16) -> Self {
        Self {
            ip_version,
            protocol,
            port,
        }
    }
}

// SAFETY: `PortKey` is `repr(C)`, `Copy`, made only of integers and has no padding (size
// asserted above), so any byte pattern is a valid value and all bytes are initialised.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PortKey {}

#[cfg(test)]
mod tests;
