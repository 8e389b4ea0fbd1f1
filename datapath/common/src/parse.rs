//! The packet parser shared by the XDP program and the host.
//!
//! Everything here is `#[inline(always)]` and free of recursion, allocation, panics and
//! unbounded loops, so that it compiles into one verifiable BPF function. All packet reads go
//! through [`Frame::load`], which on the kernel side compares `data + offset + N` with
//! `data_end` immediately before the read (the pattern the verifier understands) and on the
//! host side is a checked slice access. Header offsets are additionally capped at
//! [`MAX_HEADER_BYTES`] so that the verifier always sees a bounded offset; the same cap applies
//! on the host, so both sides reach the same result for every input.

/// Length of an Ethernet header (destination MAC, source MAC, EtherType).
pub const ETH_HLEN: usize = 14;
/// EtherType of IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// EtherType of ARP.
pub const ETH_P_ARP: u16 = 0x0806;
/// TPID of an IEEE 802.1Q VLAN tag.
pub const ETH_P_8021Q: u16 = 0x8100;
/// TPID of an IEEE 802.1ad (QinQ service) VLAN tag.
pub const ETH_P_8021AD: u16 = 0x88a8;

/// IPv6 Hop-by-Hop Options extension header.
pub const IPPROTO_HOPOPTS: u8 = 0;
/// ICMP (IPv4).
pub const IPPROTO_ICMP: u8 = 1;
/// TCP.
pub const IPPROTO_TCP: u8 = 6;
/// UDP.
pub const IPPROTO_UDP: u8 = 17;
/// IPv6 Routing extension header.
pub const IPPROTO_ROUTING: u8 = 43;
/// IPv6 Fragment extension header.
pub const IPPROTO_FRAGMENT: u8 = 44;
/// Encapsulating Security Payload: ends an IPv6 header chain (not skipped, no ports).
pub const IPPROTO_ESP: u8 = 50;
/// Authentication Header (skipped as an IPv6 extension header).
pub const IPPROTO_AH: u8 = 51;
/// ICMPv6.
pub const IPPROTO_ICMPV6: u8 = 58;
/// IPv6 No Next Header: ends the header chain (no ports).
pub const IPPROTO_NONE: u8 = 59;
/// IPv6 Destination Options extension header.
pub const IPPROTO_DSTOPTS: u8 = 60;
/// SCTP.
pub const IPPROTO_SCTP: u8 = 132;
/// Mobility Header (skipped as an IPv6 extension header).
pub const IPPROTO_MH: u8 = 135;
/// Host Identity Protocol (skipped as an IPv6 extension header).
pub const IPPROTO_HIP: u8 = 139;
/// Shim6 (skipped as an IPv6 extension header).
pub const IPPROTO_SHIM6: u8 = 140;

/// ICMPv6 Neighbor Discovery message types (RFC 4861 §4): Router Solicitation, Router
/// Advertisement, Neighbor Solicitation, Neighbor Advertisement, Redirect. See
/// [`crate::decide_at`] for how they are treated.
pub const ICMPV6_ROUTER_SOLICITATION: u8 = 133;
/// ICMPv6 Router Advertisement (type 134).
pub const ICMPV6_ROUTER_ADVERTISEMENT: u8 = 134;
/// ICMPv6 Neighbor Solicitation (type 135).
pub const ICMPV6_NEIGHBOR_SOLICITATION: u8 = 135;
/// ICMPv6 Neighbor Advertisement (type 136).
pub const ICMPV6_NEIGHBOR_ADVERTISEMENT: u8 = 136;
/// ICMPv6 Redirect (type 137).
pub const ICMPV6_REDIRECT: u8 = 137;
/// The hop limit every Neighbor Discovery message is sent with and must arrive with
/// (RFC 4861: receivers discard ND messages with any other hop limit).
pub const ND_HOP_LIMIT: u8 = 255;

/// At most this many VLAN tags (802.1Q or 802.1ad, in any order) are skipped.
pub const MAX_VLAN_TAGS: usize = 2;
/// At most this many IPv6 extension headers are skipped before the upper-layer header.
pub const MAX_IPV6_EXT_HEADERS: usize = 8;
/// The parser never reads a byte at or after this offset from the start of the frame: a packet
/// whose L2..L4 headers do not end within the first `MAX_HEADER_BYTES` bytes cannot be
/// classified ([`ParseError::HeadersTooLong`]). Only very long IPv6 extension header chains
/// can get there (Ethernet + 2 VLAN tags + IPv4 with options + TCP is 86 bytes). The bound
/// exists for the verifier, which must see a bounded offset on every packet access.
pub const MAX_HEADER_BYTES: usize = 2048;

/// A packet the parser can read: the XDP packet in the kernel, a byte slice on the host.
pub trait Frame {
    /// The `N` bytes at `offset..offset + N`, or `None` when the frame is shorter than
    /// `offset + N`. The parser only calls this with `offset + N <= MAX_HEADER_BYTES`, and
    /// only with `N >= 2`: for a 1-byte read LLVM turns `data + offset + 1 > data_end` into
    /// `data + offset >= data_end`, a comparison from which the verifier learns no packet
    /// range when the pointer's constant offset is 0.
    fn load<const N: usize>(&self, offset: usize) -> Option<[u8; N]>;

    /// The 4 bytes at `offset..offset + 4` as one `u32` in memory order
    /// (`u32::from_ne_bytes`), or `None` when the frame is shorter. Used for addresses: four
    /// words keep register pressure low where sixteen separately loaded bytes would be spilled
    /// to the 512-byte BPF stack.
    fn load_word(&self, offset: usize) -> Option<u32>;

    /// The `K` words at `offset..offset + 4 * K`, each as [`Frame::load_word`] reads it, or
    /// `None` when the frame is shorter: one bounds check for all of them (the kernel's frame
    /// reads each with one 32-bit load). Only called with `offset + 4 * K <= MAX_HEADER_BYTES`.
    fn load_words<const K: usize>(&self, offset: usize) -> Option<[u32; K]> {
        let mut w = [0u32; K];
        for (i, word) in w.iter_mut().enumerate() {
            *word = self.load_word(offset + 4 * i)?;
        }
        Some(w)
    }

    /// Whether the frame is at least `len` bytes long (`len` may be up to 65 597: an IP
    /// packet's end according to its length field).
    fn holds(&self, len: usize) -> bool;
}

impl Frame for [u8] {
    #[inline(always)]
    fn load<const N: usize>(&self, offset: usize) -> Option<[u8; N]> {
        let end = offset.checked_add(N)?;
        let bytes = self.get(offset..end)?;
        bytes.try_into().ok()
    }

    #[inline(always)]
    fn load_word(&self, offset: usize) -> Option<u32> {
        self.load::<4>(offset).map(u32::from_ne_bytes)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        len <= self.len()
    }
}

/// Where an IP packet sits in a fragmented datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fragment {
    /// Not a fragment (IPv4 MF = 0 and offset 0; IPv6 without a fragment header, or an
    /// "atomic" fragment header with M = 0 and offset 0).
    No,
    /// First fragment (offset 0, more fragments follow): carries the L4 header.
    First,
    /// Any later fragment (offset != 0): carries no L4 header, so no ports.
    Subsequent,
}

/// ICMP echo request type (IPv4, RFC 792).
pub const ICMP_ECHO_REQUEST: u8 = 8;
/// ICMP echo reply type (IPv4).
pub const ICMP_ECHO_REPLY: u8 = 0;
/// ICMP destination unreachable (IPv4; code 4 is "fragmentation needed").
pub const ICMP_DEST_UNREACHABLE: u8 = 3;
/// ICMP time exceeded (IPv4).
pub const ICMP_TIME_EXCEEDED: u8 = 11;
/// ICMP parameter problem (IPv4).
pub const ICMP_PARAMETER_PROBLEM: u8 = 12;
/// ICMPv6 destination unreachable (RFC 4443).
pub const ICMPV6_DEST_UNREACHABLE: u8 = 1;
/// ICMPv6 packet too big.
pub const ICMPV6_PACKET_TOO_BIG: u8 = 2;
/// ICMPv6 time exceeded.
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;
/// ICMPv6 parameter problem.
pub const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
/// ICMPv6 echo request.
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
/// ICMPv6 echo reply.
pub const ICMPV6_ECHO_REPLY: u8 = 129;

/// What kind of ICMP/ICMPv6 message a packet is, as far as connection tracking cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Icmp {
    /// Not ICMP, a later fragment, or a message connection tracking does not follow.
    Other,
    /// An echo request: its identifier is [`IpPacket::sport`] (`dport` 0), so the request and
    /// its reply share a tracking key like a UDP flow's two directions.
    EchoRequest,
    /// An echo reply: its identifier is [`IpPacket::dport`] (`sport` 0).
    EchoReply,
    /// An error message (destination unreachable incl. fragmentation needed / packet too big,
    /// time exceeded, parameter problem) about a packet its destination sent that may belong
    /// to a tracked flow: the quoted packet has ports (TCP, UDP, SCTP, or an ICMP echo's
    /// identifier), is not a later fragment, and its source is the error's destination. The
    /// quoted flow is in [`IpPacket::sport`] (the quoted source port), [`IpPacket::dport`],
    /// [`IpPacket::quote_protocol`] and [`IpPacket::quote_peer`]. (Errors whose quote cannot
    /// belong to a tracked flow are [`Icmp::Other`]: judged by policy like any ICMP.)
    Error,
}

/// What the parser found in an IP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpPacket {
    /// 4 or 6.
    pub ip_version: u8,
    /// Source address as four words in memory order ([`addr_words`] of the 16 address bytes);
    /// an IPv4 address is word 0, the other words are zero.
    pub src: [u32; 4],
    /// Destination address, same convention as `src`.
    pub dst: [u32; 4],
    /// Upper-layer protocol: the IPv4 protocol field, or for IPv6 the first next-header value
    /// that is not a skipped extension header. For a later fragment: the protocol the fragment
    /// header (IPv6) or IP header (IPv4) names.
    pub protocol: u8,
    /// Source port (host byte order); 0 when `protocol` has no ports or for a later fragment.
    /// An ICMP/ICMPv6 echo request's identifier (see [`Icmp::EchoRequest`]); for an
    /// [`Icmp::Error`] the quoted packet's source port.
    pub sport: u16,
    /// Destination port (host byte order); 0 when `protocol` has no ports or for a later fragment.
    /// An ICMP/ICMPv6 echo reply's identifier (see [`Icmp::EchoReply`]); for an
    /// [`Icmp::Error`] the quoted packet's destination port.
    pub dport: u16,
    /// TCP flags (byte 13 of the TCP header: FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10, ...);
    /// 0 for other protocols and later fragments.
    pub tcp_flags: u8,
    /// The ICMPv6 message type (first byte of the ICMPv6 header); 0 for other protocols
    /// (ICMPv4 included: nothing depends on its type) and later fragments.
    pub icmp6_type: u8,
    /// The IPv4 TTL or the IPv6 hop limit, as received.
    pub hop_limit: u8,
    /// Fragmentation state.
    pub fragment: Fragment,
    /// The ICMP/ICMPv6 message kind connection tracking follows ([`Icmp::Other`] otherwise).
    pub icmp: Icmp,
    /// For an [`Icmp::Error`]: the quoted packet's protocol (else 0).
    pub quote_protocol: u8,
    /// For an [`Icmp::Error`]: the quoted packet's destination, the flow's other end (words as
    /// in `src`; else zero). (The quote's source is `dst`.)
    pub quote_peer: [u32; 4],
}

/// A frame the parser could classify.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Parsed {
    /// An Ethernet frame whose EtherType (after at most [`MAX_VLAN_TAGS`] VLAN tags) is neither
    /// IPv4 nor IPv6, e.g. ARP or LLDP.
    NotIp {
        /// The inner-most EtherType.
        ethertype: u16,
    },
    /// An IPv4 or IPv6 packet whose headers are well formed as far as the policy reads them.
    Ip(IpPacket),
}

/// Why a frame could not be classified. Every variant is a frame that is, or may be, an IP
/// packet whose headers are truncated or invalid; [`crate::decide_at`] drops all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ParseError {
    /// Shorter than an Ethernet header: the EtherType cannot be read.
    TruncatedEthernet = 1,
    /// The frame ends inside a VLAN tag.
    TruncatedVlan,
    /// More than [`MAX_VLAN_TAGS`] VLAN tags.
    TooManyVlanTags,
    /// EtherType IPv4 but fewer than 20 bytes of IPv4 header.
    TruncatedIpv4Header,
    /// EtherType IPv4/IPv6 but the version nibble disagrees.
    BadIpVersion,
    /// IPv4 IHL below 5 (20 bytes).
    BadIpv4HeaderLength,
    /// IPv4 total length smaller than the header length.
    BadIpv4TotalLength,
    /// The IP length field (IPv4 total length, IPv6 40 + payload length) goes past the end of
    /// the frame. This also covers an IHL larger than the packet.
    TruncatedIpPacket,
    /// EtherType IPv6 but fewer than 40 bytes of IPv6 header.
    TruncatedIpv6Header,
    /// An IPv6 extension header goes past the end of the IPv6 payload.
    TruncatedExtensionHeader,
    /// More than [`MAX_IPV6_EXT_HEADERS`] IPv6 extension headers.
    TooManyExtensionHeaders,
    /// The TCP/UDP/SCTP header or the 4-byte ICMPv6 header (type, code, checksum) goes past
    /// the end of the IP payload (or, for TCP, the data offset does: an unfragmented packet
    /// must hold its whole TCP header).
    TruncatedL4Header,
    /// TCP data offset below 5 (20 bytes).
    BadTcpDataOffset,
    /// UDP length field below 8 or past the end of the IP payload.
    BadUdpLength,
    /// An ICMP/ICMPv6 error (unfragmented) whose quoted packet is truncated or malformed: its
    /// IP header (version, length) or the first 8 bytes after it are not there.
    BadIcmpQuote,
    /// The headers the policy needs do not end within [`MAX_HEADER_BYTES`].
    HeadersTooLong,
}

#[inline(always)]
fn be16(hi: u8, lo: u8) -> u16 {
    u16::from_be_bytes([hi, lo])
}

/// An IPv4 address in 16 address bytes (bytes 0..4, rest zero).
#[inline(always)]
pub fn ipv4_in_16(a: [u8; 4]) -> [u8; 16] {
    [a[0], a[1], a[2], a[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

/// 16 address bytes as the four memory-order words [`IpPacket`] and the map keys use.
#[inline(always)]
pub fn addr_words(b: [u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
        u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
        u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
    ]
}

/// The inverse of [`addr_words`].
#[inline(always)]
pub fn addr_bytes(w: [u32; 4]) -> [u8; 16] {
    let mut b = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    b
}

/// Bounded word load.
#[inline(always)]
fn load_word<F: Frame + ?Sized>(frame: &F, offset: usize) -> Option<u32> {
    if offset > MAX_HEADER_BYTES - 4 {
        return None;
    }
    frame.load_word(offset)
}

/// Bounded load: every packet read of the parser goes through here.
#[inline(always)]
fn load<F: Frame + ?Sized, const N: usize>(frame: &F, offset: usize) -> Option<[u8; N]> {
    if offset > MAX_HEADER_BYTES - N {
        return None;
    }
    frame.load::<N>(offset)
}

/// Parses an Ethernet frame (optionally VLAN-tagged) down to the L4 ports.
///
/// See `docs/datapath.md` for what is validated; in short: everything the verdict depends on
/// must be present and self-consistent, checksums are not verified (the kernel does that).
#[inline(always)]
pub fn parse<F: Frame + ?Sized>(frame: &F) -> Result<Parsed, ParseError> {
    let Some(eth) = load::<F, ETH_HLEN>(frame, 0) else {
        return Err(ParseError::TruncatedEthernet);
    };
    let mut ethertype = be16(eth[12], eth[13]);
    let mut l3 = ETH_HLEN;
    for _ in 0..MAX_VLAN_TAGS {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        // TCI (2 bytes) then the encapsulated EtherType.
        let Some(tag) = load::<F, 4>(frame, l3) else {
            return Err(ParseError::TruncatedVlan);
        };
        ethertype = be16(tag[2], tag[3]);
        l3 += 4;
    }
    match ethertype {
        ETH_P_IP => parse_ipv4(frame, l3).map(Parsed::Ip),
        ETH_P_IPV6 => parse_ipv6(frame, l3).map(Parsed::Ip),
        ETH_P_8021Q | ETH_P_8021AD => Err(ParseError::TooManyVlanTags),
        other => Ok(Parsed::NotIp { ethertype: other }),
    }
}

/// The frame [`parse`] sees most, read at fixed offsets: untagged Ethernet, IPv4 without
/// options, not a fragment, TCP or UDP with a well-formed header, at least 50 bytes in the
/// first buffer. Returns exactly what [`parse`] returns for such a frame
/// (`parse(frame) == Ok(Parsed::Ip(p))`, a property test checks it on random frames), and
/// `None` for every other frame, which [`parse`] then decides. It reads ten words after one
/// bounds check, where [`parse`] checks every header's bounds on its own: the established
/// packet's cheaper path (`docs/datapath.md` §3).
#[inline(always)]
pub fn parse_simple<F: Frame + ?Sized>(frame: &F) -> Option<IpPacket> {
    // Words at 10 + 4k: MAC tail + EtherType, version/IHL + TOS + total length, ID + flags and
    // fragment offset, TTL + protocol + checksum, source, destination, ports, UDP length /
    // TCP sequence, TCP acknowledgement, TCP data offset + flags + window.
    let [
        eth,
        ver_len,
        frag,
        ttl_proto,
        src,
        dst,
        ports,
        udp_len,
        _,
        tcp,
    ] = frame.load_words::<10>(10)?;
    let [_, _, et0, et1] = eth.to_ne_bytes();
    let [ver_ihl, _, len0, len1] = ver_len.to_ne_bytes();
    let [_, _, frag0, frag1] = frag.to_ne_bytes();
    let [ttl, protocol, _, _] = ttl_proto.to_ne_bytes();
    let [sport0, sport1, dport0, dport1] = ports.to_ne_bytes();
    if be16(et0, et1) != ETH_P_IP
        || ver_ihl != 0x45
        || be16(frag0, frag1) & 0x3fff != 0
        || (protocol != IPPROTO_TCP && protocol != IPPROTO_UDP)
    {
        return None;
    }
    let l4 = ETH_HLEN + 20;
    let ip_end = ETH_HLEN + usize::from(be16(len0, len1));
    // The L4 header's length: TCP's data offset, UDP's length field.
    let [doff, flags, _, _] = tcp.to_ne_bytes();
    let [ulen0, ulen1, _, _] = udp_len.to_ne_bytes();
    let (l4_len, min, tcp_flags) = if protocol == IPPROTO_TCP {
        (usize::from(doff >> 4) * 4, 20, flags)
    } else {
        (usize::from(be16(ulen0, ulen1)), 8, 0)
    };
    if l4_len < min || l4 + l4_len > ip_end || !frame.holds(ip_end) {
        return None;
    }
    Some(IpPacket {
        ip_version: 4,
        src: [src, 0, 0, 0],
        dst: [dst, 0, 0, 0],
        protocol,
        sport: be16(sport0, sport1),
        dport: be16(dport0, dport1),
        tcp_flags,
        icmp6_type: 0,
        hop_limit: ttl,
        fragment: Fragment::No,
        icmp: Icmp::Other,
        quote_protocol: 0,
        quote_peer: [0; 4],
    })
}

/// Parses a packet that starts at its IP header (a layer-3 device: IPIP, GRE, SIT, ip6tnl,
/// WireGuard, where no Ethernet header precedes it); `protocol` is its EtherType as the
/// kernel has it (`skb->protocol`, host order). Anything else than IPv4 and IPv6 is
/// [`Parsed::NotIp`].
#[inline(always)]
pub fn parse_l3<F: Frame + ?Sized>(frame: &F, protocol: u16) -> Result<Parsed, ParseError> {
    match protocol {
        ETH_P_IP => parse_ipv4(frame, 0).map(Parsed::Ip),
        ETH_P_IPV6 => parse_ipv6(frame, 0).map(Parsed::Ip),
        other => Ok(Parsed::NotIp { ethertype: other }),
    }
}

#[inline(always)]
fn parse_ipv4<F: Frame + ?Sized>(frame: &F, l3: usize) -> Result<IpPacket, ParseError> {
    let Some(h) = load::<F, 20>(frame, l3) else {
        return Err(ParseError::TruncatedIpv4Header);
    };
    if h[0] >> 4 != 4 {
        return Err(ParseError::BadIpVersion);
    }
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err(ParseError::BadIpv4HeaderLength);
    }
    let total_len = usize::from(be16(h[2], h[3]));
    if total_len < ihl {
        return Err(ParseError::BadIpv4TotalLength);
    }
    let ip_end = l3 + total_len;
    if !frame.holds(ip_end) {
        return Err(ParseError::TruncatedIpPacket);
    }
    let frag = be16(h[6], h[7]);
    let fragment = if frag & 0x1fff != 0 {
        Fragment::Subsequent
    } else if frag & 0x2000 != 0 {
        Fragment::First
    } else {
        Fragment::No
    };
    // The header was loaded whole, so these cannot fail; the word loads keep the address out
    // of sixteen single-byte registers.
    let (Some(s), Some(d)) = (load_word(frame, l3 + 12), load_word(frame, l3 + 16)) else {
        return Err(ParseError::TruncatedIpv4Header);
    };
    let src = [s, 0, 0, 0];
    let dst = [d, 0, 0, 0];
    let protocol = h[9];
    let l4 = if fragment == Fragment::Subsequent {
        L4Fields::NONE
    } else {
        parse_l4::<F, false>(frame, protocol, l3 + ihl, ip_end, fragment, &dst)?
    };
    Ok(IpPacket {
        ip_version: 4,
        src,
        dst,
        protocol,
        sport: l4.sport,
        dport: l4.dport,
        tcp_flags: l4.tcp_flags,
        icmp6_type: 0,
        hop_limit: h[8],
        fragment,
        icmp: l4.icmp,
        quote_protocol: l4.quote_protocol,
        quote_peer: l4.quote_peer,
    })
}

#[inline(always)]
fn is_ipv6_ext_header(next_header: u8) -> bool {
    matches!(
        next_header,
        IPPROTO_HOPOPTS
            | IPPROTO_ROUTING
            | IPPROTO_FRAGMENT
            | IPPROTO_AH
            | IPPROTO_DSTOPTS
            | IPPROTO_MH
            | IPPROTO_HIP
            | IPPROTO_SHIM6
    )
}

#[inline(always)]
fn parse_ipv6<F: Frame + ?Sized>(frame: &F, l3: usize) -> Result<IpPacket, ParseError> {
    let Some(h) = load::<F, 8>(frame, l3) else {
        return Err(ParseError::TruncatedIpv6Header);
    };
    let mut src = [0u32; 4];
    let mut dst = [0u32; 4];
    for i in 0..4 {
        let (Some(s), Some(d)) = (
            load_word(frame, l3 + 8 + 4 * i),
            load_word(frame, l3 + 24 + 4 * i),
        ) else {
            return Err(ParseError::TruncatedIpv6Header);
        };
        src[i] = s;
        dst[i] = d;
    }
    if h[0] >> 4 != 6 {
        return Err(ParseError::BadIpVersion);
    }
    // A payload length of 0 (jumbogram) is not special-cased: it leaves no room for an
    // upper-layer header, so TCP/UDP/SCTP packets claiming it fail as truncated.
    let ip_end = l3 + 40 + usize::from(be16(h[4], h[5]));
    if !frame.holds(ip_end) {
        return Err(ParseError::TruncatedIpPacket);
    }
    let mut next_header = h[6];
    let mut off = l3 + 40;
    let mut fragment = Fragment::No;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        if !is_ipv6_ext_header(next_header) {
            break;
        }
        // Every extension header is at least 8 bytes long.
        if off + 8 > ip_end {
            return Err(ParseError::TruncatedExtensionHeader);
        }
        if off + 8 > MAX_HEADER_BYTES {
            return Err(ParseError::HeadersTooLong);
        }
        let Some(ext) = load::<F, 8>(frame, off) else {
            return Err(ParseError::TruncatedExtensionHeader);
        };
        let len = match next_header {
            IPPROTO_FRAGMENT => 8,
            // RFC 4302: AH length is in 4-octet units, minus 2.
            IPPROTO_AH => (usize::from(ext[1]) + 2) * 4,
            // RFC 8200 generic format: length in 8-octet units, not counting the first 8.
            _ => (usize::from(ext[1]) + 1) * 8,
        };
        if off + len > ip_end {
            return Err(ParseError::TruncatedExtensionHeader);
        }
        if next_header == IPPROTO_FRAGMENT {
            let offset_and_m = be16(ext[2], ext[3]);
            if offset_and_m & 0xfff8 != 0 {
                // Later fragment: the rest is a piece of the fragmentable part, unparsable.
                return Ok(IpPacket {
                    ip_version: 6,
                    src,
                    dst,
                    protocol: ext[0],
                    sport: 0,
                    dport: 0,
                    tcp_flags: 0,
                    icmp6_type: 0,
                    hop_limit: h[7],
                    fragment: Fragment::Subsequent,
                    icmp: Icmp::Other,
                    quote_protocol: 0,
                    quote_peer: [0; 4],
                });
            }
            if offset_and_m & 1 != 0 {
                fragment = Fragment::First;
            }
        }
        next_header = ext[0];
        off += len;
    }
    if is_ipv6_ext_header(next_header) {
        return Err(ParseError::TooManyExtensionHeaders);
    }
    let l4 = parse_l4::<F, true>(frame, next_header, off, ip_end, fragment, &dst)?;
    Ok(IpPacket {
        ip_version: 6,
        src,
        dst,
        protocol: next_header,
        sport: l4.sport,
        dport: l4.dport,
        tcp_flags: l4.tcp_flags,
        icmp6_type: l4.icmp6_type,
        hop_limit: h[7],
        fragment,
        icmp: l4.icmp,
        quote_protocol: l4.quote_protocol,
        quote_peer: l4.quote_peer,
    })
}

/// What [`parse_l4`] reads from an upper-layer header.
#[derive(Clone, Copy)]
struct L4Fields {
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    icmp6_type: u8,
    icmp: Icmp,
    quote_protocol: u8,
    quote_peer: [u32; 4],
}

impl L4Fields {
    const NONE: Self = Self {
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        icmp6_type: 0,
        icmp: Icmp::Other,
        quote_protocol: 0,
        quote_peer: [0; 4],
    };
}

/// The kind of an ICMP (`V6` false) or ICMPv6 message type.
#[inline(always)]
fn icmp_kind<const V6: bool>(kind: u8) -> Icmp {
    if V6 {
        match kind {
            ICMPV6_ECHO_REQUEST => Icmp::EchoRequest,
            ICMPV6_ECHO_REPLY => Icmp::EchoReply,
            ICMPV6_DEST_UNREACHABLE
            | ICMPV6_PACKET_TOO_BIG
            | ICMPV6_TIME_EXCEEDED
            | ICMPV6_PARAMETER_PROBLEM => Icmp::Error,
            _ => Icmp::Other,
        }
    } else {
        match kind {
            ICMP_ECHO_REQUEST => Icmp::EchoRequest,
            ICMP_ECHO_REPLY => Icmp::EchoReply,
            ICMP_DEST_UNREACHABLE | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM => Icmp::Error,
            _ => Icmp::Other,
        }
    }
}

/// The ports connection tracking keys an echo message by: a request's identifier is its
/// source port, a reply's its destination port, so a request and its reply share one key (the
/// reply's source is the request's destination) like the two directions of a UDP flow.
#[inline(always)]
fn echo_ports(kind: Icmp, id: u16) -> (u16, u16) {
    if kind == Icmp::EchoRequest {
        (id, 0)
    } else {
        (0, id)
    }
}

/// Reads the ports of TCP, UDP and SCTP (and the TCP flags), and of ICMP/ICMPv6 the type, an
/// echo's identifier and an error's quoted flow; other protocols have none of these (all 0).
///
/// `l4` is the offset of the upper-layer header, `ip_end` the end of the IP packet according to
/// its length field (already known to be inside the frame), `dst` the packet's destination.
#[inline(always)]
fn parse_l4<F: Frame + ?Sized, const V6: bool>(
    frame: &F,
    protocol: u8,
    l4: usize,
    ip_end: usize,
    fragment: Fragment,
    dst: &[u32; 4],
) -> Result<L4Fields, ParseError> {
    let fixed_len = match protocol {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        // Common header: ports, verification tag, checksum.
        IPPROTO_SCTP => 12,
        // Type, code, checksum (RFC 792, RFC 4443 §2.1).
        IPPROTO_ICMPV6 if V6 => 4,
        IPPROTO_ICMP if !V6 => 4,
        _ => return Ok(L4Fields::NONE),
    };
    if l4 + fixed_len > ip_end {
        return Err(ParseError::TruncatedL4Header);
    }
    if l4 + fixed_len > MAX_HEADER_BYTES {
        return Err(ParseError::HeadersTooLong);
    }
    if fixed_len == 4 {
        // Type and code (2 bytes: see `Frame::load` on why no 1-byte loads).
        let Some(t) = load::<F, 2>(frame, l4) else {
            return Err(ParseError::TruncatedL4Header);
        };
        let kind = icmp_kind::<V6>(t[0]);
        let icmp6_type = if V6 { t[0] } else { 0 };
        // An error is only followed when it is whole (errors are small; a fragmented one is
        // judged like any ICMP).
        if kind == Icmp::Other || (kind == Icmp::Error && fragment != Fragment::No) {
            return Ok(L4Fields {
                icmp6_type,
                ..L4Fields::NONE
            });
        }
        // Echo: identifier and sequence number; error: the unused/MTU word. Both 8 bytes.
        if l4 + 8 > ip_end {
            return Err(ParseError::TruncatedL4Header);
        }
        let Some(h) = load::<F, 8>(frame, l4) else {
            return Err(ParseError::TruncatedL4Header);
        };
        if kind == Icmp::Error {
            let mut fields = L4Fields {
                icmp6_type,
                ..L4Fields::NONE
            };
            parse_quote::<F, V6>(frame, l4 + 8, ip_end, dst, &mut fields)?;
            return Ok(fields);
        }
        let (sport, dport) = echo_ports(kind, be16(h[4], h[5]));
        return Ok(L4Fields {
            sport,
            dport,
            icmp6_type,
            icmp: kind,
            ..L4Fields::NONE
        });
    }
    // 8 bytes cover the ports of all three and the UDP length.
    let Some(p) = load::<F, 8>(frame, l4) else {
        return Err(ParseError::TruncatedL4Header);
    };
    let sport = be16(p[0], p[1]);
    let dport = be16(p[2], p[3]);
    // Lengths can only be checked against the IP payload when the datagram is not fragmented.
    let whole = fragment == Fragment::No;
    let mut tcp_flags = 0;
    match protocol {
        IPPROTO_TCP => {
            // Data offset and flags (2 bytes: see `Frame::load` on why no 1-byte loads).
            let Some(doff) = load::<F, 2>(frame, l4 + 12) else {
                return Err(ParseError::TruncatedL4Header);
            };
            let header_len = usize::from(doff[0] >> 4) * 4;
            if header_len < 20 {
                return Err(ParseError::BadTcpDataOffset);
            }
            if whole && l4 + header_len > ip_end {
                return Err(ParseError::TruncatedL4Header);
            }
            tcp_flags = doff[1];
        }
        IPPROTO_UDP if whole => {
            let udp_len = usize::from(be16(p[4], p[5]));
            if udp_len < 8 || l4 + udp_len > ip_end {
                return Err(ParseError::BadUdpLength);
            }
        }
        _ => {}
    }
    Ok(L4Fields {
        sport,
        dport,
        tcp_flags,
        ..L4Fields::NONE
    })
}

/// The flow an ICMP/ICMPv6 error quotes, at offset `q` (after the 8-byte ICMP header): the
/// quoted packet's IP header (IPv4 with options, or the 40-byte IPv6 header) and the first 8
/// bytes after it (RFC 792 requires them; RFC 4443 quotes as much as fits) must lie within the
/// error (`ip_end`), and the IP version must be the error's own: otherwise the error is
/// malformed ([`ParseError::BadIcmpQuote`]). A well-formed quote whose packet can belong to a
/// tracked flow of the error's destination `dst` makes `fields` an [`Icmp::Error`] with the
/// quoted flow; any other (a later fragment, an IPv6 extension header before the upper layer, a
/// protocol without ports, an ICMP message other than an echo, a source other than `dst`)
/// leaves it [`Icmp::Other`]: judged by policy like any ICMP.
///
/// Straight-line code: a fixed number of bounded loads, no loop that the compiler keeps.
#[inline(always)]
fn parse_quote<F: Frame + ?Sized, const V6: bool>(
    frame: &F,
    q: usize,
    ip_end: usize,
    dst: &[u32; 4],
    fields: &mut L4Fields,
) -> Result<(), ParseError> {
    let (ip_len, protocol, fragment_offset, src_at, dst_at, words) = if V6 {
        // Version/class/flow (4), payload length (2), next header, hop limit.
        let Some(h) = load::<F, 8>(frame, q) else {
            return Err(ParseError::BadIcmpQuote);
        };
        if h[0] >> 4 != 6 {
            return Err(ParseError::BadIcmpQuote);
        }
        (40, h[6], 0, q + 8, q + 24, 4)
    } else {
        let Some(h) = load::<F, 20>(frame, q) else {
            return Err(ParseError::BadIcmpQuote);
        };
        let ihl = usize::from(h[0] & 0x0f) * 4;
        if h[0] >> 4 != 4 || ihl < 20 {
            return Err(ParseError::BadIcmpQuote);
        }
        (ihl, h[9], be16(h[6], h[7]) & 0x1fff, q + 12, q + 16, 1)
    };
    let l4 = q + ip_len;
    if l4 + 8 > ip_end {
        return Err(ParseError::BadIcmpQuote);
    }
    let Some(ports) = load::<F, 8>(frame, l4) else {
        return Err(ParseError::BadIcmpQuote);
    };
    let mut related = fragment_offset == 0;
    let mut peer = [0u32; 4];
    for i in 0..4 {
        if i < words {
            let (Some(s), Some(d)) = (
                load_word(frame, src_at + 4 * i),
                load_word(frame, dst_at + 4 * i),
            ) else {
                return Err(ParseError::BadIcmpQuote);
            };
            related &= s == dst[i];
            peer[i] = d;
        }
    }
    let (sport, dport) = match protocol {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            (be16(ports[0], ports[1]), be16(ports[2], ports[3]))
        }
        IPPROTO_ICMPV6 | IPPROTO_ICMP if (protocol == IPPROTO_ICMPV6) == V6 => {
            let kind = icmp_kind::<V6>(ports[0]);
            related &= kind == Icmp::EchoRequest || kind == Icmp::EchoReply;
            echo_ports(kind, be16(ports[4], ports[5]))
        }
        _ => {
            related = false;
            (0, 0)
        }
    };
    if related {
        fields.icmp = Icmp::Error;
        fields.sport = sport;
        fields.dport = dport;
        fields.quote_protocol = protocol;
        fields.quote_peer = peer;
    }
    Ok(())
}
