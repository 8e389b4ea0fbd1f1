//! Builders for test frames (feature `std`): well-formed Ethernet/VLAN/IPv4/IPv6/TCP/UDP/SCTP
//! frames, plus the pieces needed to break them on purpose.
//!
//! The IPv4 header checksum is computed; L4 checksums are left zero because nothing in the
//! datapath verifies them (the kernel stack does, after XDP).

use std::vec::Vec;

use crate::{
    ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP,
};

/// Destination MAC of crafted frames (locally administered).
pub const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
/// Source MAC of crafted frames (locally administered).
pub const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
/// Default IPv4 source of [`ipv4_frame`].
pub const V4_SRC: [u8; 4] = [10, 0, 0, 1];
/// Default IPv4 destination of [`ipv4_frame`].
pub const V4_DST: [u8; 4] = [10, 0, 0, 2];
/// Default IPv6 source of [`ipv6_frame`] (fd00::1).
pub const V6_SRC: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
/// Default IPv6 destination of [`ipv6_frame`] (fd00::2).
pub const V6_DST: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// An upper-layer header to put in a crafted packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    /// A 20-byte TCP SYN.
    Tcp {
        /// Source port.
        sport: u16,
        /// Destination port.
        dport: u16,
    },
    /// A 20-byte TCP header with the given flags (`TCP_SYN | TCP_ACK`, ...).
    TcpFlags {
        /// Source port.
        sport: u16,
        /// Destination port.
        dport: u16,
        /// The flags byte (byte 13 of the TCP header).
        flags: u8,
    },
    /// A UDP header followed by 4 payload bytes.
    Udp {
        /// Source port.
        sport: u16,
        /// Destination port.
        dport: u16,
    },
    /// An SCTP common header followed by a minimal INIT chunk.
    Sctp {
        /// Source port.
        sport: u16,
        /// Destination port.
        dport: u16,
    },
    /// An ICMP (IPv4) or ICMPv6 (IPv6) echo request, identifier 0x1234.
    Echo,
    /// An ICMP (IPv4) or ICMPv6 (IPv6) echo request or reply with identifier `id`.
    EchoId {
        /// The identifier.
        id: u16,
        /// A reply (else a request).
        reply: bool,
    },
    /// An ICMP (IPv4) or ICMPv6 (IPv6) message of type `kind`, code 0, with 20 bytes of body
    /// (the reserved word and target address of a Neighbor Solicitation/Advertisement).
    Icmp {
        /// The message type.
        kind: u8,
    },
    /// 8 zero bytes under an arbitrary protocol number.
    Raw {
        /// The protocol number of the IP header.
        protocol: u8,
    },
}

impl L4 {
    /// The protocol number for the IP header (ICMP vs ICMPv6 depends on `ipv6`).
    pub fn protocol(self, ipv6: bool) -> u8 {
        match self {
            Self::Tcp { .. } | Self::TcpFlags { .. } => IPPROTO_TCP,
            Self::Udp { .. } => IPPROTO_UDP,
            Self::Sctp { .. } => IPPROTO_SCTP,
            Self::Echo | Self::EchoId { .. } | Self::Icmp { .. } if ipv6 => IPPROTO_ICMPV6,
            Self::Echo | Self::EchoId { .. } | Self::Icmp { .. } => IPPROTO_ICMP,
            Self::Raw { protocol } => protocol,
        }
    }

    /// The header bytes (and a little payload), for IPv4 or IPv6.
    pub fn bytes(self, ipv6: bool) -> Vec<u8> {
        match self {
            Self::Tcp { sport, dport } => tcp(sport, dport),
            Self::TcpFlags {
                sport,
                dport,
                flags,
            } => {
                let mut h = tcp(sport, dport);
                h[13] = flags;
                h
            }
            Self::Udp { sport, dport } => udp(sport, dport, &[1, 2, 3, 4]),
            Self::Sctp { sport, dport } => sctp(sport, dport),
            Self::Echo => {
                let kind = if ipv6 { 128 } else { 8 };
                std::vec![kind, 0, 0, 0, 0x12, 0x34, 0, 1]
            }
            Self::EchoId { id, reply } => {
                let kind = match (ipv6, reply) {
                    (true, false) => 128,
                    (true, true) => 129,
                    (false, false) => 8,
                    (false, true) => 0,
                };
                let [hi, lo] = id.to_be_bytes();
                std::vec![kind, 0, 0, 0, hi, lo, 0, 1]
            }
            Self::Icmp { kind } => {
                let mut h = std::vec![0u8; 24];
                h[0] = kind;
                h[8..24].copy_from_slice(&V6_DST);
                h
            }
            Self::Raw { .. } => std::vec![0; 8],
        }
    }
}

/// An Ethernet frame: MACs, then each `(tpid, vid)` VLAN tag, then `ethertype` and `payload`.
pub fn ethernet(vlans: &[(u16, u16)], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 4 * vlans.len() + payload.len());
    f.extend_from_slice(&MAC_DST);
    f.extend_from_slice(&MAC_SRC);
    for &(tpid, vid) in vlans {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An IPv4 header description; [`Ipv4::build`] fills in IHL, total length and checksum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4 {
    /// Source address.
    pub src: [u8; 4],
    /// Destination address.
    pub dst: [u8; 4],
    /// Protocol field (upper-layer protocol number).
    pub protocol: u8,
    /// IP options, padded with zeros (End of Options) to a multiple of 4 bytes by `build`.
    pub options: Vec<u8>,
    /// More Fragments flag.
    pub more_fragments: bool,
    /// Fragment offset in 8-byte units (13 bits).
    pub fragment_offset: u16,
    /// Identification field.
    pub identification: u16,
    /// Time to live.
    pub ttl: u8,
}

impl Ipv4 {
    /// A header without options, not fragmented, with identification 0x1234 and TTL 64.
    pub fn new(src: [u8; 4], dst: [u8; 4], protocol: u8) -> Self {
        Self {
            src,
            dst,
            protocol,
            options: Vec::new(),
            more_fragments: false,
            fragment_offset: 0,
            identification: 0x1234,
            ttl: 64,
        }
    }

    /// Header plus `payload`.
    pub fn build(&self, payload: &[u8]) -> Vec<u8> {
        let mut options = self.options.clone();
        while !options.len().is_multiple_of(4) {
            options.push(0);
        }
        let header_len = 20 + options.len();
        assert!(header_len <= 60, "IPv4 options longer than 40 bytes");
        let total_len = u16::try_from(header_len + payload.len()).expect("IPv4 packet too long");
        let flags_frag = (u16::from(self.more_fragments) << 13) | (self.fragment_offset & 0x1fff);
        let mut p = Vec::with_capacity(usize::from(total_len));
        p.push(0x40 | (header_len / 4) as u8);
        p.push(0);
        p.extend_from_slice(&total_len.to_be_bytes());
        p.extend_from_slice(&self.identification.to_be_bytes());
        p.extend_from_slice(&flags_frag.to_be_bytes());
        p.push(self.ttl);
        p.push(self.protocol);
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(&self.src);
        p.extend_from_slice(&self.dst);
        p.extend_from_slice(&options);
        let sum = internet_checksum(&p);
        p[10..12].copy_from_slice(&sum.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }
}

/// RFC 1071 checksum.
pub fn internet_checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in bytes.chunks(2) {
        let word = match *chunk {
            [hi, lo] => u16::from_be_bytes([hi, lo]),
            [hi] => u16::from_be_bytes([hi, 0]),
            _ => 0,
        };
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv6 packet: fixed header (payload length computed) plus `payload`, which starts with
/// whatever `next_header` names (an extension header or the upper-layer header).
pub fn ipv6(src: [u8; 16], dst: [u8; 16], next_header: u8, payload: &[u8]) -> Vec<u8> {
    let payload_len = u16::try_from(payload.len()).expect("IPv6 payload too long");
    let mut p = Vec::with_capacity(40 + payload.len());
    p.extend_from_slice(&[0x60, 0, 0, 0]);
    p.extend_from_slice(&payload_len.to_be_bytes());
    p.push(next_header);
    p.push(64);
    p.extend_from_slice(&src);
    p.extend_from_slice(&dst);
    p.extend_from_slice(payload);
    p
}

/// A generic-format IPv6 extension header (hop-by-hop, routing, destination options, ...)
/// of `len` bytes (a multiple of 8, at least 8), filled with a PadN option.
pub fn ipv6_ext(next_header: u8, len: usize) -> Vec<u8> {
    assert!(
        len >= 8 && len.is_multiple_of(8) && len <= 2048,
        "bad extension header length {len}"
    );
    let mut h = std::vec![0u8; len];
    h[0] = next_header;
    h[1] = (len / 8 - 1) as u8;
    h[2] = 1; // PadN
    h[3] = (len - 4) as u8;
    h
}

/// An IPv6 fragment header (offset in 8-byte units).
pub fn ipv6_fragment(next_header: u8, offset: u16, more: bool, id: u32) -> Vec<u8> {
    let offset_and_m = (offset << 3) | u16::from(more);
    let mut h = std::vec![next_header, 0];
    h.extend_from_slice(&offset_and_m.to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h
}

/// An IPv6 Authentication Header with `icv_words` 4-byte words of ICV (RFC 4302 length rule).
pub fn ipv6_ah(next_header: u8, icv_words: u8) -> Vec<u8> {
    let total = (usize::from(icv_words) + 3) * 4;
    let mut h = std::vec![0u8; total];
    h[0] = next_header;
    h[1] = icv_words + 1;
    h[4..8].copy_from_slice(&0x100u32.to_be_bytes()); // SPI
    h
}

/// A 20-byte TCP SYN header (data offset 5).
pub fn tcp(sport: u16, dport: u16) -> Vec<u8> {
    let mut h = std::vec![0u8; 20];
    h[0..2].copy_from_slice(&sport.to_be_bytes());
    h[2..4].copy_from_slice(&dport.to_be_bytes());
    h[4..8].copy_from_slice(&1u32.to_be_bytes());
    h[12] = 5 << 4;
    h[13] = 0x02; // SYN
    h[14..16].copy_from_slice(&64240u16.to_be_bytes());
    h
}

/// A UDP header (length computed) plus `payload`.
pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(8 + payload.len()).expect("UDP datagram too long");
    let mut h = Vec::with_capacity(usize::from(len));
    h.extend_from_slice(&sport.to_be_bytes());
    h.extend_from_slice(&dport.to_be_bytes());
    h.extend_from_slice(&len.to_be_bytes());
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(payload);
    h
}

/// An SCTP common header plus a 20-byte INIT chunk.
pub fn sctp(sport: u16, dport: u16) -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(&sport.to_be_bytes());
    h.extend_from_slice(&dport.to_be_bytes());
    h.extend_from_slice(&[0; 8]); // verification tag 0 (INIT), checksum
    h.extend_from_slice(&[1, 0, 0, 20]); // INIT chunk, flags, length 20
    h.extend_from_slice(&0xabcdu32.to_be_bytes()); // initiate tag
    h.extend_from_slice(&65535u32.to_be_bytes()); // a_rwnd
    h.extend_from_slice(&[0, 10, 0, 10]); // streams out/in
    h.extend_from_slice(&1u32.to_be_bytes()); // initial TSN
    h
}

/// Ethernet + IPv4 (10.0.0.1 -> 10.0.0.2) + `l4`, untagged.
pub fn ipv4_frame(l4: L4) -> Vec<u8> {
    ipv4_frame_between(V4_SRC, V4_DST, l4)
}

/// Ethernet + IPv6 (fd00::1 -> fd00::2) + `l4`, untagged.
pub fn ipv6_frame(l4: L4) -> Vec<u8> {
    ipv6_frame_between(V6_SRC, V6_DST, l4)
}

/// Ethernet + IPv4 from `src` to `dst` + `l4`, untagged.
pub fn ipv4_frame_between(src: [u8; 4], dst: [u8; 4], l4: L4) -> Vec<u8> {
    let ip = Ipv4::new(src, dst, l4.protocol(false)).build(&l4.bytes(false));
    ethernet(&[], ETH_P_IP, &ip)
}

/// Ethernet + IPv6 from `src` to `dst` + `l4`, untagged.
pub fn ipv6_frame_between(src: [u8; 16], dst: [u8; 16], l4: L4) -> Vec<u8> {
    let ip = ipv6(src, dst, l4.protocol(true), &l4.bytes(true));
    ethernet(&[], ETH_P_IPV6, &ip)
}

/// An IPv4 or IPv6 frame between two addresses of the same family (`None` if the families
/// differ).
pub fn frame_between(src: std::net::IpAddr, dst: std::net::IpAddr, l4: L4) -> Option<Vec<u8>> {
    use std::net::IpAddr;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Some(ipv4_frame_between(s.octets(), d.octets(), l4)),
        (IpAddr::V6(s), IpAddr::V6(d)) => Some(ipv6_frame_between(s.octets(), d.octets(), l4)),
        _ => None,
    }
}

/// Ethernet + IPv6 whose payload is `ext_headers` (each a complete extension header whose
/// next-header fields the caller set) followed by `l4`; the fixed header's next header is
/// `first`.
pub fn ipv6_frame_with_ext(first: u8, ext_headers: &[Vec<u8>], l4: L4) -> Vec<u8> {
    let mut payload: Vec<u8> = ext_headers.concat();
    payload.extend_from_slice(&l4.bytes(true));
    ethernet(&[], ETH_P_IPV6, &ipv6(V6_SRC, V6_DST, first, &payload))
}

/// Ethernet + IPv6 from `src` to `dst` carrying an ICMPv6 message of type `kind` (e.g. a
/// Neighbor Discovery type) with the given hop limit, untagged.
pub fn icmpv6_frame(src: [u8; 16], dst: [u8; 16], kind: u8, hop_limit: u8) -> Vec<u8> {
    let mut f = ipv6_frame_between(src, dst, L4::Icmp { kind });
    set_ipv6_hop_limit(&mut f, 14, hop_limit);
    f
}

/// Sets the hop limit of the IPv6 header that starts at `l3` in `frame`.
pub fn set_ipv6_hop_limit(frame: &mut [u8], l3: usize, hop_limit: u8) {
    frame[l3 + 7] = hop_limit;
}

/// Sets the IPv4 fragment fields of an IPv4 packet that starts at `l3` in `frame`, and fixes
/// the header checksum.
pub fn set_ipv4_fragment(frame: &mut [u8], l3: usize, more: bool, offset: u16) {
    let v = (u16::from(more) << 13) | (offset & 0x1fff);
    frame[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
    fix_ipv4_checksum(frame, l3);
}

/// Recomputes the header checksum of the IPv4 header at `l3` (using its IHL).
pub fn fix_ipv4_checksum(frame: &mut [u8], l3: usize) {
    let ihl = usize::from(frame[l3] & 0x0f) * 4;
    frame[l3 + 10..l3 + 12].copy_from_slice(&[0, 0]);
    let end = (l3 + ihl.max(20)).min(frame.len());
    let sum = internet_checksum(&frame[l3..end]);
    frame[l3 + 10..l3 + 12].copy_from_slice(&sum.to_be_bytes());
}

/// `frame` (Ethernet without VLAN tags, then IPv4 or IPv6 carrying TCP, or IPv4 carrying UDP)
/// grown to `total` bytes with zero payload after the L4 header, its IP length fields (and the
/// IPv4 header checksum, and the UDP length) updated: a full-size or jumbo segment of the same
/// flow. `None` when `frame` is not such a frame, is already longer, or `total` exceeds what an
/// IP length field can say.
pub fn with_payload(frame: &[u8], total: usize) -> Option<Vec<u8>> {
    let l3 = ETH_HLEN;
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    if total < frame.len() {
        return None;
    }
    let mut out = frame.to_vec();
    out.resize(total, 0);
    match ethertype {
        ETH_P_IP if out[l3 + 9] == IPPROTO_TCP || out[l3 + 9] == IPPROTO_UDP => {
            let len = u16::try_from(total - l3).ok()?;
            out[l3 + 2..l3 + 4].copy_from_slice(&len.to_be_bytes());
            fix_ipv4_checksum(&mut out, l3);
            if out[l3 + 9] == IPPROTO_UDP {
                let ihl = usize::from(out[l3] & 0x0f) * 4;
                let udp = u16::try_from(total - l3 - ihl).ok()?;
                out[l3 + ihl + 4..l3 + ihl + 6].copy_from_slice(&udp.to_be_bytes());
            }
        }
        ETH_P_IPV6 if out[l3 + 6] == IPPROTO_TCP => {
            let len = u16::try_from(total - l3 - 40).ok()?;
            out[l3 + 4..l3 + 6].copy_from_slice(&len.to_be_bytes());
        }
        _ => return None,
    }
    Some(out)
}

/// The IP packet (no Ethernet header) of an `ipv4_frame_between`/`ipv6_frame_between` frame:
/// what an ICMP error quotes.
pub fn ip_packet(src: std::net::IpAddr, dst: std::net::IpAddr, l4: L4) -> Option<Vec<u8>> {
    frame_between(src, dst, l4).map(|f| f[ETH_HLEN..].to_vec())
}

/// An ICMP (IPv4 addresses) or ICMPv6 (IPv6) error of type `kind` and code `code` from `src` to
/// `dst`, quoting `quoted` (an IP packet, possibly cut short; see [`ip_packet`]); the fifth to
/// eighth bytes of the ICMP header (unused, or the MTU of "fragmentation needed"/"packet too
/// big") are `word`. `None` when the two addresses are of different families.
pub fn icmp_error(
    src: std::net::IpAddr,
    dst: std::net::IpAddr,
    kind: u8,
    code: u8,
    word: u32,
    quoted: &[u8],
) -> Option<Vec<u8>> {
    let mut body = std::vec![kind, code, 0, 0];
    body.extend_from_slice(&word.to_be_bytes());
    body.extend_from_slice(quoted);
    match (src, dst) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => Some(ethernet(
            &[],
            ETH_P_IP,
            &Ipv4::new(s.octets(), d.octets(), IPPROTO_ICMP).build(&body),
        )),
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => Some(ethernet(
            &[],
            ETH_P_IPV6,
            &ipv6(s.octets(), d.octets(), IPPROTO_ICMPV6, &body),
        )),
        _ => None,
    }
}
