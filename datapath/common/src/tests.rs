//! Host unit tests of the shared parser and verdict function.

use std::{
    cell::{Cell, RefCell},
    collections::HashMap,
    vec,
    vec::Vec,
};

use quickcheck::{QuickCheck, TestResult};

use crate::{
    DatapathMaps, Decision, ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6,
    Fragment, Hook, ICMPV6_NEIGHBOR_ADVERTISEMENT, ICMPV6_NEIGHBOR_SOLICITATION, ICMPV6_REDIRECT,
    ICMPV6_ROUTER_ADVERTISEMENT, ICMPV6_ROUTER_SOLICITATION, IPPROTO_AH, IPPROTO_DSTOPTS,
    IPPROTO_ESP, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_NONE,
    IPPROTO_ROUTING, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, IpPacket, MAX_HEADER_BYTES,
    ParseError, Parsed, Reason, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, Verdict, addr_bytes,
    addr_words, craft,
    craft::L4,
    ct_key, decide, decide_at, established, handoff, ipv4_in_16,
    layout::*,
    lookup::{Match, PolicyMaps},
    parse, parse_l3, parse_simple,
};

fn p(frame: &[u8]) -> Result<Parsed, ParseError> {
    parse(frame)
}

fn ip(frame: &[u8]) -> IpPacket {
    match parse(frame) {
        Ok(Parsed::Ip(ip)) => ip,
        other => panic!("expected an IP packet, got {other:?} for {frame:02x?}"),
    }
}

const TCP80: L4 = L4::Tcp {
    sport: 40000,
    dport: 80,
};

/// A frame typed out by hand, independently of `craft`: Ethernet, a commonly quoted IPv4
/// checksum example header (172.16.10.99 -> 172.16.10.12, TCP, checksum 0xb1e6, total length
/// 60) and a 40-byte TCP SYN header (20 bytes of options) from port 41102 to 443.
#[rustfmt::skip]
const HAND_TCP: [u8; 74] = [
    // Ethernet
    0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00,
    // IPv4: v4 IHL 5, len 60, id 0x1c46, DF, ttl 64, TCP, csum, src, dst
    0x45, 0x00, 0x00, 0x3c, 0x1c, 0x46, 0x40, 0x00, 0x40, 0x06, 0xb1, 0xe6,
    0xac, 0x10, 0x0a, 0x63, 0xac, 0x10, 0x0a, 0x0c,
    // TCP: sport 41102, dport 443, seq, ack, doff 10 (40 bytes), SYN, window, csum, urg
    0xa0, 0x8e, 0x01, 0xbb, 0, 0, 0, 1, 0, 0, 0, 0, 0xa0, 0x02, 0xfa, 0xf0, 0, 0, 0, 0,
    // TCP options: MSS 1460, SACK permitted, timestamps, NOP, window scale 7
    0x02, 0x04, 0x05, 0xb4, 0x04, 0x02, 0x08, 0x0a, 0, 0, 0, 1, 0, 0, 0, 0,
    0x01, 0x03, 0x03, 0x07,
];

#[test]
fn hand_written_frame_and_checksum() {
    assert_eq!(
        craft::internet_checksum(&HAND_TCP[14..34]),
        0,
        "header checksum must verify"
    );
    let mut zeroed = HAND_TCP;
    zeroed[24..26].copy_from_slice(&[0, 0]);
    assert_eq!(craft::internet_checksum(&zeroed[14..34]), 0xb1e6);
    assert_eq!(
        p(&HAND_TCP),
        Ok(Parsed::Ip(IpPacket {
            ip_version: 4,
            src: addr_words(ipv4_in_16([172, 16, 10, 99])),
            dst: addr_words(ipv4_in_16([172, 16, 10, 12])),
            protocol: IPPROTO_TCP,
            sport: 41102,
            dport: 443,
            tcp_flags: 0x02,
            icmp6_type: 0,
            hop_limit: 64,
            fragment: Fragment::No,
            icmp: crate::Icmp::Other,
            quote_protocol: 0,
            quote_peer: [0; 4],
        }))
    );
    // The builder produces the same bytes for the same header fields.
    let mut built = craft::Ipv4::new([172, 16, 10, 99], [172, 16, 10, 12], IPPROTO_TCP);
    built.identification = 0x1c46;
    let built = built.build(&HAND_TCP[34..]);
    // Builder sets DF = 0; the hand frame has DF set. Compare everything else.
    assert_eq!(built[..6], HAND_TCP[14..20]);
    assert_eq!(built[8..10], HAND_TCP[22..24]);
    assert_eq!(built[12..], HAND_TCP[26..]);
    // Cutting one byte off the TCP options makes the IPv4 total length lie.
    assert_eq!(
        p(&HAND_TCP[..73]),
        Err(ParseError::TruncatedIpPacket),
        "one byte short"
    );
}

#[test]
fn all_l4_protocols_both_versions() {
    for (l4, proto, sport, dport) in [
        (TCP80, IPPROTO_TCP, 40000, 80),
        (
            L4::Udp {
                sport: 5353,
                dport: 53,
            },
            IPPROTO_UDP,
            5353,
            53,
        ),
        (
            L4::Sctp {
                sport: 1111,
                dport: 2222,
            },
            IPPROTO_SCTP,
            1111,
            2222,
        ),
    ] {
        let v4 = ip(&craft::ipv4_frame(l4));
        assert_eq!(
            (v4.ip_version, v4.protocol, v4.sport, v4.dport),
            (4, proto, sport, dport)
        );
        assert_eq!(v4.src, addr_words(ipv4_in_16(craft::V4_SRC)));
        assert_eq!(v4.dst, addr_words(ipv4_in_16(craft::V4_DST)));
        assert_eq!(v4.fragment, Fragment::No);
        let v6 = ip(&craft::ipv6_frame(l4));
        assert_eq!(
            (v6.ip_version, v6.protocol, v6.sport, v6.dport),
            (6, proto, sport, dport)
        );
        assert_eq!(
            (v6.src, v6.dst),
            (addr_words(craft::V6_SRC), addr_words(craft::V6_DST))
        );
    }
    // An echo request's identifier (0x1234) is its source port, a reply's its destination port.
    let icmp = ip(&craft::ipv4_frame(L4::Echo));
    assert_eq!(
        (icmp.protocol, icmp.sport, icmp.dport, icmp.icmp),
        (IPPROTO_ICMP, 0x1234, 0, crate::Icmp::EchoRequest)
    );
    let icmp6 = ip(&craft::ipv6_frame(L4::Echo));
    assert_eq!(
        (icmp6.protocol, icmp6.sport, icmp6.dport, icmp6.icmp),
        (IPPROTO_ICMPV6, 0x1234, 0, crate::Icmp::EchoRequest)
    );
    for v6 in [false, true] {
        let f = if v6 {
            craft::ipv6_frame
        } else {
            craft::ipv4_frame
        };
        let reply = ip(&f(L4::EchoId { id: 7, reply: true }));
        assert_eq!(
            (reply.sport, reply.dport, reply.icmp),
            (0, 7, crate::Icmp::EchoReply)
        );
    }
    let gre = ip(&craft::ipv4_frame(L4::Raw { protocol: 47 }));
    assert_eq!((gre.protocol, gre.dport), (47, 0));
    // The ICMPv6 type and the hop limit are read; the ICMPv4 type is not (nothing uses it).
    assert_eq!((icmp6.icmp6_type, icmp6.hop_limit), (128, 64));
    assert_eq!((icmp.icmp6_type, icmp.hop_limit), (0, 64));
    let na = ip(&craft::icmpv6_frame(
        craft::V6_SRC,
        craft::V6_DST,
        ICMPV6_NEIGHBOR_ADVERTISEMENT,
        255,
    ));
    assert_eq!(
        (na.protocol, na.icmp6_type, na.hop_limit, na.sport, na.dport),
        (IPPROTO_ICMPV6, 136, 255, 0, 0)
    );
    let icmp4_135 = ip(&craft::ipv4_frame(L4::Icmp { kind: 135 }));
    assert_eq!(
        (icmp4_135.protocol, icmp4_135.icmp6_type),
        (IPPROTO_ICMP, 0)
    );
    // Behind extension headers, and in a first fragment.
    let behind = ip(&craft::ipv6_frame_with_ext(
        IPPROTO_HOPOPTS,
        &[
            craft::ipv6_ext(IPPROTO_FRAGMENT, 8),
            craft::ipv6_fragment(IPPROTO_ICMPV6, 0, true, 3),
        ],
        L4::Icmp { kind: 135 },
    ));
    assert_eq!((behind.icmp6_type, behind.fragment), (135, Fragment::First));
}

#[test]
fn vlan_tags() {
    let ipv4 = craft::ipv4_frame(TCP80);
    let inner = &ipv4[14..];
    let one = craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, inner);
    assert_eq!(ip(&one).dport, 80);
    let qinq = craft::ethernet(&[(ETH_P_8021AD, 10), (ETH_P_8021Q, 20)], ETH_P_IP, inner);
    assert_eq!(ip(&qinq).dport, 80);
    let three = craft::ethernet(
        &[(ETH_P_8021AD, 10), (ETH_P_8021Q, 20), (ETH_P_8021Q, 30)],
        ETH_P_IP,
        inner,
    );
    assert_eq!(p(&three), Err(ParseError::TooManyVlanTags));
    let arp_in_vlan = craft::ethernet(&[(ETH_P_8021Q, 5)], ETH_P_ARP, &[0; 28]);
    assert_eq!(
        p(&arp_in_vlan),
        Ok(Parsed::NotIp {
            ethertype: ETH_P_ARP
        })
    );
    // Frame ends inside the tag.
    let cut = &one[..16];
    assert_eq!(p(cut), Err(ParseError::TruncatedVlan));
    // Tag complete, nothing after it: truncated IPv4.
    assert_eq!(p(&one[..18]), Err(ParseError::TruncatedIpv4Header));
}

#[test]
fn ethernet_edge_cases() {
    assert_eq!(p(&[]), Err(ParseError::TruncatedEthernet));
    assert_eq!(p(&[0; 13]), Err(ParseError::TruncatedEthernet));
    let arp = craft::ethernet(&[], ETH_P_ARP, &[0; 28]);
    assert_eq!(
        p(&arp),
        Ok(Parsed::NotIp {
            ethertype: ETH_P_ARP
        })
    );
    assert_eq!(
        p(&arp[..14]),
        Ok(Parsed::NotIp {
            ethertype: ETH_P_ARP
        })
    );
    let v4 = craft::ipv4_frame(TCP80);
    assert_eq!(p(&v4[..14]), Err(ParseError::TruncatedIpv4Header));
    let v6 = craft::ipv6_frame(TCP80);
    assert_eq!(p(&v6[..14]), Err(ParseError::TruncatedIpv6Header));
    assert_eq!(p(&v6[..53]), Err(ParseError::TruncatedIpv6Header));
    // An IPv6 packet behind the IPv4 EtherType and vice versa.
    let mut swapped = v6.clone();
    swapped[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    assert_eq!(p(&swapped), Err(ParseError::BadIpVersion));
    let mut swapped = v4.clone();
    swapped[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
    assert_eq!(p(&swapped), Err(ParseError::BadIpVersion));
}

#[test]
fn ipv4_header_validation() {
    let good = craft::ipv4_frame(TCP80);
    assert_eq!(p(&good[..33]), Err(ParseError::TruncatedIpv4Header));
    for ihl in 0..5u8 {
        let mut f = good.clone();
        f[14] = 0x40 | ihl;
        assert_eq!(p(&f), Err(ParseError::BadIpv4HeaderLength), "ihl {ihl}");
    }
    // IHL 15 (60 bytes) but total length 40.
    let mut f = good.clone();
    f[14] = 0x4f;
    assert_eq!(p(&f), Err(ParseError::BadIpv4TotalLength));
    // IHL 15 and total length claiming 80 bytes in a 54-byte frame.
    f[16..18].copy_from_slice(&80u16.to_be_bytes());
    assert_eq!(p(&f), Err(ParseError::TruncatedIpPacket));
    // Total length below 20.
    let mut f = good.clone();
    f[16..18].copy_from_slice(&19u16.to_be_bytes());
    assert_eq!(p(&f), Err(ParseError::BadIpv4TotalLength));
    // Total length says the TCP header is cut (frame padded, as Ethernet does).
    let mut f = good.clone();
    f[16..18].copy_from_slice(&30u16.to_be_bytes());
    assert_eq!(p(&f), Err(ParseError::TruncatedL4Header));
    // Ethernet padding after a complete packet is fine.
    let mut padded = craft::ipv4_frame(L4::Udp { sport: 1, dport: 7 });
    padded.resize(60.max(padded.len() + 10), 0xee);
    assert_eq!(ip(&padded).dport, 7);
    // IP options are skipped.
    let mut with_opts = craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_UDP);
    with_opts.options = vec![0x94, 0x04, 0, 0, 1, 1, 1, 0]; // Router Alert, NOPs, EOL
    let f = craft::ethernet(
        &[],
        ETH_P_IP,
        &with_opts.build(&craft::udp(9, 8472, &[0; 8])),
    );
    assert_eq!(ip(&f).dport, 8472);
    with_opts.options = vec![1; 40];
    let f = craft::ethernet(&[], ETH_P_IP, &with_opts.build(&craft::udp(9, 4789, &[])));
    assert_eq!(ip(&f).dport, 4789);
}

#[test]
fn l4_header_validation() {
    for (l4, fixed) in [
        (TCP80, 20),
        (L4::Udp { sport: 1, dport: 2 }, 8),
        (L4::Sctp { sport: 1, dport: 2 }, 12),
    ] {
        let proto = l4.protocol(false);
        let full = l4.bytes(false);
        for cut in 0..fixed {
            let v4 = craft::ethernet(
                &[],
                ETH_P_IP,
                &craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, proto).build(&full[..cut]),
            );
            let got = p(&v4);
            // A cut UDP header also cuts below its own length field: either error is right,
            // the parser must report the header as truncated first.
            assert_eq!(
                got,
                Err(ParseError::TruncatedL4Header),
                "v4 {l4:?} cut {cut}"
            );
            let v6 = craft::ethernet(
                &[],
                ETH_P_IPV6,
                &craft::ipv6(craft::V6_SRC, craft::V6_DST, proto, &full[..cut]),
            );
            assert_eq!(
                p(&v6),
                Err(ParseError::TruncatedL4Header),
                "v6 {l4:?} cut {cut}"
            );
        }
    }
    // The ICMP/ICMPv6 header (type, code, checksum) must be whole, an echo's 8 bytes too.
    for v6 in [false, true] {
        let echo = L4::Echo.bytes(v6);
        for cut in 0..8 {
            let f = if v6 {
                craft::ethernet(
                    &[],
                    ETH_P_IPV6,
                    &craft::ipv6(craft::V6_SRC, craft::V6_DST, IPPROTO_ICMPV6, &echo[..cut]),
                )
            } else {
                craft::ethernet(
                    &[],
                    ETH_P_IP,
                    &craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_ICMP)
                        .build(&echo[..cut]),
                )
            };
            assert_eq!(
                p(&f),
                Err(ParseError::TruncatedL4Header),
                "echo v6={v6} cut {cut}"
            );
        }
    }
    let na = L4::Icmp { kind: 136 }.bytes(true);
    for cut in 0..4 {
        let v6 = craft::ethernet(
            &[],
            ETH_P_IPV6,
            &craft::ipv6(craft::V6_SRC, craft::V6_DST, IPPROTO_ICMPV6, &na[..cut]),
        );
        assert_eq!(
            p(&v6),
            Err(ParseError::TruncatedL4Header),
            "ICMPv6 cut {cut}"
        );
    }
    let v6 = craft::ethernet(
        &[],
        ETH_P_IPV6,
        &craft::ipv6(craft::V6_SRC, craft::V6_DST, IPPROTO_ICMPV6, &na[..4]),
    );
    assert_eq!(ip(&v6).icmp6_type, 136, "the 4-byte header alone suffices");
    let v4 = craft::ethernet(
        &[],
        ETH_P_IP,
        &craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_ICMP).build(&[13, 0, 0, 0]),
    );
    assert_eq!(
        ip(&v4).protocol,
        IPPROTO_ICMP,
        "a 4-byte ICMPv4 timestamp header parses"
    );
    // TCP data offset.
    let good = craft::ipv4_frame(TCP80);
    for doff in 0..5u8 {
        let mut f = good.clone();
        f[34 + 12] = doff << 4;
        assert_eq!(p(&f), Err(ParseError::BadTcpDataOffset));
    }
    let mut f = good.clone();
    f[34 + 12] = 6 << 4; // 24 bytes of TCP header in a 20-byte segment
    assert_eq!(p(&f), Err(ParseError::TruncatedL4Header));
    // UDP length field.
    let udp = craft::ipv6_frame(L4::Udp {
        sport: 1,
        dport: 53,
    });
    let ulen_at = 14 + 40 + 4;
    for bad in [0u16, 7, 13] {
        let mut f = udp.clone();
        f[ulen_at..ulen_at + 2].copy_from_slice(&bad.to_be_bytes());
        assert_eq!(p(&f), Err(ParseError::BadUdpLength), "udp len {bad}");
    }
    let mut f = udp.clone();
    f[ulen_at..ulen_at + 2].copy_from_slice(&8u16.to_be_bytes()); // shorter than IP payload: ok
    assert_eq!(ip(&f).dport, 53);
}

#[test]
fn ipv4_fragments() {
    let mut first = craft::ipv4_frame(TCP80);
    craft::set_ipv4_fragment(&mut first, 14, true, 0);
    let got = ip(&first);
    assert_eq!((got.fragment, got.dport), (Fragment::First, 80));
    // A later fragment: no L4 header is read, whatever its bytes are.
    let mut later = craft::ipv4_frame(TCP80);
    craft::set_ipv4_fragment(&mut later, 14, false, 185);
    later[34 + 12] = 0; // would be a bad data offset if it were parsed as TCP
    let got = ip(&later);
    assert_eq!(
        (got.fragment, got.protocol, got.sport, got.dport),
        (Fragment::Subsequent, IPPROTO_TCP, 0, 0)
    );
    // Later fragment with 1 byte of payload.
    let tiny = craft::Ipv4 {
        fragment_offset: 1,
        more_fragments: true,
        ..craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_TCP)
    }
    .build(&[0]);
    let got = ip(&craft::ethernet(&[], ETH_P_IP, &tiny));
    assert_eq!(got.fragment, Fragment::Subsequent);
    // A first fragment must still carry the fixed TCP header (RFC 1858 tiny fragments).
    let tiny_first = craft::Ipv4 {
        more_fragments: true,
        ..craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_TCP)
    }
    .build(&craft::tcp(1, 80)[..8]);
    assert_eq!(
        p(&craft::ethernet(&[], ETH_P_IP, &tiny_first)),
        Err(ParseError::TruncatedL4Header)
    );
    // ... but the UDP length is not checked against a first fragment's payload.
    let udp_first = craft::Ipv4 {
        more_fragments: true,
        ..craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_UDP)
    }
    .build(&craft::udp(1, 53, &[0; 2000])[..16]);
    let got = ip(&craft::ethernet(&[], ETH_P_IP, &udp_first));
    assert_eq!((got.fragment, got.dport), (Fragment::First, 53));
}

#[test]
fn ipv6_extension_headers() {
    let udp53 = L4::Udp {
        sport: 9,
        dport: 53,
    };
    // HBH -> routing -> dstopts -> AH -> UDP.
    let f = craft::ipv6_frame_with_ext(
        IPPROTO_HOPOPTS,
        &[
            craft::ipv6_ext(IPPROTO_ROUTING, 8),
            craft::ipv6_ext(IPPROTO_DSTOPTS, 24),
            craft::ipv6_ext(IPPROTO_AH, 16),
            craft::ipv6_ah(IPPROTO_UDP, 4),
        ],
        udp53,
    );
    let got = ip(&f);
    assert_eq!(
        (got.protocol, got.dport, got.fragment),
        (IPPROTO_UDP, 53, Fragment::No)
    );
    // First fragment, atomic fragment, later fragment.
    let first = craft::ipv6_frame_with_ext(
        IPPROTO_FRAGMENT,
        &[craft::ipv6_fragment(IPPROTO_TCP, 0, true, 7)],
        TCP80,
    );
    let got = ip(&first);
    assert_eq!((got.fragment, got.dport), (Fragment::First, 80));
    let atomic = craft::ipv6_frame_with_ext(
        IPPROTO_FRAGMENT,
        &[craft::ipv6_fragment(IPPROTO_TCP, 0, false, 7)],
        TCP80,
    );
    assert_eq!(ip(&atomic).fragment, Fragment::No);
    let later = craft::ipv6_frame_with_ext(
        IPPROTO_DSTOPTS,
        &[
            craft::ipv6_ext(IPPROTO_FRAGMENT, 8),
            craft::ipv6_fragment(IPPROTO_TCP, 100, true, 7),
        ],
        L4::Raw { protocol: 0 },
    );
    let got = ip(&later);
    assert_eq!(
        (got.fragment, got.protocol, got.dport),
        (Fragment::Subsequent, IPPROTO_TCP, 0)
    );
    // Offset 1 (8 bytes), the smallest later fragment, with and without M.
    for more in [true, false] {
        let f = craft::ipv6_frame_with_ext(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_UDP, 1, more, 9)],
            L4::Raw { protocol: 0 },
        );
        assert_eq!(ip(&f).fragment, Fragment::Subsequent, "more {more}");
    }
    // ESP and No Next Header end the chain without ports.
    for proto in [IPPROTO_ESP, IPPROTO_NONE] {
        let f = craft::ipv6_frame_with_ext(
            IPPROTO_HOPOPTS,
            &[craft::ipv6_ext(proto, 8)],
            L4::Raw { protocol: proto },
        );
        let got = ip(&f);
        assert_eq!((got.protocol, got.dport), (proto, 0));
    }
}

#[test]
fn ipv6_extension_header_errors() {
    // Extension header cut by the payload length.
    let f = craft::ipv6_frame_with_ext(IPPROTO_HOPOPTS, &[craft::ipv6_ext(IPPROTO_TCP, 16)], TCP80);
    for payload_len in [0u16, 7, 8, 15] {
        let mut g = f.clone();
        g[18..20].copy_from_slice(&payload_len.to_be_bytes());
        assert_eq!(
            p(&g),
            Err(ParseError::TruncatedExtensionHeader),
            "payload len {payload_len}"
        );
    }
    // Payload length says 16 bytes of extension header but no TCP.
    let mut g = f.clone();
    g[18..20].copy_from_slice(&16u16.to_be_bytes());
    assert_eq!(p(&g), Err(ParseError::TruncatedL4Header));
    // Payload length beyond the frame.
    let mut g = f.clone();
    g[18..20].copy_from_slice(&500u16.to_be_bytes());
    assert_eq!(p(&g), Err(ParseError::TruncatedIpPacket));
    // Frame cut inside the extension header (payload length consistent).
    let cut = craft::ethernet(
        &[],
        ETH_P_IPV6,
        &craft::ipv6(
            craft::V6_SRC,
            craft::V6_DST,
            IPPROTO_HOPOPTS,
            &craft::ipv6_ext(IPPROTO_TCP, 16)[..12],
        ),
    );
    assert_eq!(p(&cut), Err(ParseError::TruncatedExtensionHeader));
    // 8 extension headers are fine, 9 are too many.
    let chain = |n: usize| {
        let mut hdrs: Vec<Vec<u8>> = (1..n)
            .map(|_| craft::ipv6_ext(IPPROTO_DSTOPTS, 8))
            .collect();
        hdrs.push(craft::ipv6_ext(IPPROTO_TCP, 8));
        craft::ipv6_frame_with_ext(IPPROTO_DSTOPTS, &hdrs, TCP80)
    };
    assert_eq!(ip(&chain(8)).dport, 80);
    assert_eq!(p(&chain(9)), Err(ParseError::TooManyExtensionHeaders));
    // Headers ending past MAX_HEADER_BYTES: two 1 KiB destination options headers.
    let long = craft::ipv6_frame_with_ext(
        IPPROTO_DSTOPTS,
        &[
            craft::ipv6_ext(IPPROTO_DSTOPTS, 1024),
            craft::ipv6_ext(IPPROTO_TCP, 1024),
        ],
        TCP80,
    );
    assert_eq!(p(&long), Err(ParseError::HeadersTooLong));
    // Just inside the bound: 14 + 40 + 1960 + 20 + 8 = 2042 bytes of headers.
    let inside = craft::ipv6_frame_with_ext(
        IPPROTO_DSTOPTS,
        &[
            craft::ipv6_ext(IPPROTO_DSTOPTS, 1024),
            craft::ipv6_ext(IPPROTO_TCP, 936),
        ],
        TCP80,
    );
    const { assert!(14 + 40 + 1960 + 20 <= MAX_HEADER_BYTES) };
    assert_eq!(ip(&inside).dport, 80);
}

/// In-memory maps for `decide`, counting every read.
#[derive(Default)]
struct Mock {
    state: State,
    ipcache: HashMap<IpKey, IpInfo>,
    /// (key, address prefix length) -> info, searched linearly (longest wins).
    cidr: Vec<(IpKey, u32, IpInfo)>,
    cells: Vec<u32>,
    blocks: Vec<u32>,
    policy: HashMap<PolicyKey, PolicyValue>,
    ct: RefCell<HashMap<CtKey, CtEntry>>,
    /// Event counters (`COUNTER_*` -> count).
    counts: RefCell<HashMap<u32, u64>>,
    now: Cell<u64>,
    reads: Cell<usize>,
    services: std::collections::HashSet<SvcKey>,
    ifaces: HashMap<u32, IfaceInfo>,
    /// The handoff key (0: none).
    handoff_key: u64,
}

impl Mock {
    fn read(&self) {
        self.reads.set(self.reads.get() + 1);
    }
}

impl PolicyMaps for Mock {
    fn cell(&self, index: u32) -> Option<u32> {
        self.read();
        self.cells.get(index as usize).copied()
    }
    fn block_word(&self, index: u32) -> Option<u32> {
        self.read();
        self.blocks.get(index as usize).copied()
    }
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        self.read();
        self.policy.get(key).copied()
    }
}

impl DatapathMaps for Mock {
    fn state(&self) -> Option<&State> {
        Some(&self.state)
    }
    fn ipcache(&self, key: &IpKey) -> Option<&IpInfo> {
        self.read();
        self.ipcache.get(key)
    }
    fn ipcidr(&self, key: &IpKey) -> Option<[u32; 2]> {
        self.read();
        let bits = |a: &[u32; 4]| u128::from_be_bytes(addr_bytes(*a));
        self.cidr
            .iter()
            .filter(|(k, len, _)| {
                let mask = if *len == 0 {
                    0
                } else {
                    u128::MAX << (128 - len)
                };
                k.family == key.family && bits(&k.addr) & mask == bits(&key.addr) & mask
            })
            .max_by_key(|(_, len, _)| *len)
            .map(|(_, _, info)| info.peer())
    }
    fn ct_lookup(&self, key: &CtKey) -> Option<CtEntry> {
        self.ct.borrow().get(key).copied()
    }
    fn ct_store(&self, key: &CtKey, entry: &CtEntry) {
        self.ct.borrow_mut().insert(*key, *entry);
    }
    fn ct_delete(&self, key: &CtKey) {
        self.ct.borrow_mut().remove(key);
    }
    fn count(&self, counter: u32) {
        *self.counts.borrow_mut().entry(counter).or_default() += 1;
    }
    fn now(&self) -> u64 {
        self.now.get()
    }
    fn service(&self, key: &SvcKey) -> bool {
        self.read();
        self.services.contains(key)
    }
    fn interface(&self, ifindex: u32) -> Option<IfaceInfo> {
        self.read();
        self.ifaces.get(&ifindex).copied()
    }
    fn handoff_key(&self) -> u64 {
        self.handoff_key
    }
}

const A: [u8; 4] = [10, 0, 0, 1];
const B: [u8; 4] = [10, 0, 0, 2];
const REMOTE: [u8; 4] = [10, 9, 0, 7];
const WORLD: [u8; 4] = [192, 0, 2, 1];
const NODE: [u8; 4] = [10, 0, 0, 254];
const C: [u8; 4] = [10, 0, 0, 3];

fn key4(a: [u8; 4]) -> IpKey {
    IpKey::new(FAMILY_V4, addr_words(ipv4_in_16(a)))
}

fn endpoint(id: u32, identity: u32, ingress: PolicyRef, egress: PolicyRef) -> IpInfo {
    IpInfo {
        identity,
        flags: IP_FLAG_ENDPOINT,
        endpoint: id,
        ingress,
        egress,
        classes: [0; 2],
    }
}

fn tcp(sport: u16, dport: u16, flags: u8) -> L4 {
    L4::TcpFlags {
        sport,
        dport,
        flags,
    }
}

/// Rule set 1: identity 7 may reach TCP/80 (allow, /24), identity 8 is denied TCP/* (/8),
/// `*` is denied TCP/22 and allowed UDP/*. Rule set 0 is empty.
fn mock() -> Mock {
    let mut m = Mock {
        state: State {
            revision: 1,
            hz: 1000,
            ct_tcp_ticks: 3_600_000,
            ct_other_ticks: 60_000,
            ct_refresh_ticks: 1000,
            ct_syn_ticks: 60_000,
            ct_close_ticks: 10_000,
        },
        ..Mock::default()
    };
    m.cells = vec![0; 2 * CELLS_PER_RULESET as usize];
    m.blocks = vec![0; 256];
    let rs = CELLS_PER_RULESET as usize;
    // TCP: every high byte has identity 8's /8 key; high byte 0 is refined for 22 and 80.
    for hi in 0..256 {
        m.cells[rs + hi] = cell_word(1 << 8, WILD_NONE);
    }
    m.cells[rs] = CELL_REFINED; // block 0
    for lo in 0..256 {
        m.blocks[lo] = cell_word(1 << 8, WILD_NONE);
    }
    m.blocks[22] = cell_word(1 << 8, WILD_DENY);
    m.blocks[80] = cell_word((1 << 8) | (1 << 24), WILD_NONE);
    // UDP: wildcard allow everywhere.
    for hi in 0..256 {
        m.cells[rs + 256 + hi] = cell_word(0, WILD_ALLOW);
    }
    let pk = |identity, prefix| PolicyKey {
        ruleset: 1,
        identity,
        prefix,
    };
    m.policy
        .insert(pk(7, prefix_bits(6, 80, 24)), PolicyValue::new(V_ALLOW));
    m.policy
        .insert(pk(8, prefix_bits(6, 0, 8)), PolicyValue::new(V_DENY));
    // A: ingress isolated by rule set 1 (default deny), egress unrestricted.
    // B: ingress unrestricted, egress rule set 1 with default allow.
    m.ipcache.insert(
        key4(A),
        endpoint(1, 7, PolicyRef::new(1, V_DENY), PolicyRef::new(0, V_ALLOW)),
    );
    m.ipcache.insert(
        key4(B),
        endpoint(2, 8, PolicyRef::new(0, V_ALLOW), PolicyRef::new(1, V_ALLOW)),
    );
    m.ipcache.insert(
        key4(REMOTE),
        IpInfo {
            identity: 7,
            ..IpInfo::default()
        },
    );
    m.ipcache.insert(
        key4(NODE),
        IpInfo {
            flags: IP_FLAG_HOST,
            ..IpInfo::default()
        },
    );
    m.cidr.push((
        key4([192, 0, 2, 0]),
        24,
        IpInfo {
            identity: 8,
            ..IpInfo::default()
        },
    ));
    m
}

/// `decide` on the frame `src -> dst` with `l4` (checked by [`decide_checked`]).
fn run(m: &Mock, src: [u8; 4], dst: [u8; 4], l4: L4) -> Decision {
    decide_checked(m, &craft::ipv4_frame_between(src, dst, l4))
}

/// `decide` on `frame`, after checking the XDP program's short cut (`established`) against
/// it: where the short cut decides, it makes the same decision with the same writes to the
/// tracking table and counters (run first, on the same maps, then undone).
fn decide_checked(m: &Mock, frame: &[u8]) -> Decision {
    let (table, counts, reads) = (
        m.ct.borrow().clone(),
        m.counts.borrow().clone(),
        m.reads.get(),
    );
    let parsed = parse(frame);
    let fast = match &parsed {
        Ok(Parsed::Ip(p)) => established(p, m),
        _ => None,
    };
    let fast_table = core::mem::replace(&mut *m.ct.borrow_mut(), table);
    let fast_counts = core::mem::replace(&mut *m.counts.borrow_mut(), counts);
    m.reads.set(reads);
    let d = decide(&parsed, m);
    if let Some(f) = fast {
        assert_eq!(f, d, "the short cut decided otherwise: {frame:02x?}");
        assert!(
            fast_table == *m.ct.borrow() && fast_counts == *m.counts.borrow(),
            "the short cut wrote otherwise: {frame:02x?}"
        );
    }
    d
}

/// The short cut leaves the packets that a step before the tracking lookup decides to
/// `decide`, even where a tracked flow's key would match them: a later fragment (no ports), an
/// ICMP error about the flow.
#[test]
fn short_cut_leaves_the_steps_before_tracking() {
    let m = mock();
    // A tracked UDP flow with both ports 0: the key a later fragment's lookup would build.
    let udp0 = L4::Udp { sport: 0, dport: 0 };
    assert_eq!(run(&m, A, REMOTE, udp0).reason, Reason::Allowed);
    assert_eq!(run(&m, REMOTE, A, udp0).reason, Reason::Reply);
    let mut later = craft::ipv4_frame_between(REMOTE, A, udp0);
    craft::set_ipv4_fragment(&mut later, 14, false, 3);
    assert_eq!(decide_checked(&m, &later).reason, Reason::LaterFragment);
    let q = quoted(A, REMOTE, udp0);
    let error = icmp_error(REMOTE, A, 3, &q);
    assert_eq!(decide_checked(&m, &error).reason, Reason::Related);
}

#[test]
fn decide_without_lookups() {
    let m = mock();
    assert_eq!(
        decide(&Err(ParseError::TruncatedEthernet), &m).verdict,
        Verdict::Drop
    );
    let arp = craft::ethernet(&[], ETH_P_ARP, &[0; 28]);
    assert_eq!(decide(&p(&arp), &m).reason, Reason::NotIp);
    let mut later = craft::ipv4_frame_between(REMOTE, A, L4::Udp { sport: 1, dport: 9 });
    craft::set_ipv4_fragment(&mut later, 14, false, 3);
    assert_eq!(decide(&p(&later), &m).reason, Reason::LaterFragment);
    assert_eq!(m.reads.get(), 0, "no map read for these");
    // Neither side local: the Service frontend lookup (a new TCP flow at XDP) and two ipcache
    // reads, nothing else.
    assert_eq!(
        run(&m, REMOTE, WORLD, tcp(1, 22, TCP_SYN)).reason,
        Reason::NotLocal
    );
    assert_eq!(m.reads.get(), 3);
    assert!(m.ct.borrow().is_empty());
}

#[test]
fn decide_exemptions() {
    let m = mock();
    // A is ingress-isolated, but itself may always talk to it; a packet from a node address at
    // XDP (spoofed: the node's own never pass that hook) is not judged either.
    assert_eq!(run(&m, NODE, A, tcp(1, 9, TCP_SYN)).reason, Reason::Host);
    assert_eq!(
        run(&m, A, A, tcp(1, 9, TCP_SYN)).reason,
        Reason::SameEndpoint
    );
    assert!(m.ct.borrow().is_empty(), "exempt traffic is not tracked");
}

/// The node's own packets: TC with no interface they came in on.
const NODE_HOOK: Hook = Hook::Tc {
    ingress_ifindex: 0,
    handoff: 0,
};

/// The node's own packet to `dst`.
fn from_node(m: &Mock, dst: [u8; 4], l4: L4) -> Decision {
    decide_at(
        &parse(&craft::ipv4_frame_between(NODE, dst, l4)[..]),
        m,
        NODE_HOOK,
    )
}

/// C, isolated both ways (rule set 0 with default deny), with NODE (identity 9) as its node.
fn mock_with_isolated_c() -> Mock {
    let mut m = mock();
    m.ipcache.insert(
        key4(C),
        endpoint(3, 10, PolicyRef::new(0, V_DENY), PolicyRef::new(0, V_DENY)),
    );
    m.ipcache.get_mut(&key4(NODE)).unwrap().identity = 9;
    m
}

/// The node's own packets (TC, `ingress_ifindex` 0) always pass, and the flows they open to a
/// local endpoint are tracked: the endpoint's replies pass its egress policy, its own new
/// traffic to the node does not. A stale entry of the node's flow is restamped (allowed under
/// any policy); a stale entry of the endpoint's flow is left to the endpoint's next packet.
#[test]
fn node_opened_flows_are_tracked_at_tc() {
    let mut m = mock_with_isolated_c();
    // C's egress denies everything, its node too (identity 9, no rule).
    assert_eq!(
        run(&m, C, NODE, tcp(2000, 22, TCP_SYN)).reason,
        Reason::EgressDenied
    );
    assert!(m.ct.borrow().is_empty());
    // The node connects to C: tracked, C's answers pass.
    assert_eq!(
        from_node(&m, C, tcp(3000, 80, TCP_SYN)).reason,
        Reason::Host
    );
    assert_eq!(m.ct.borrow().len(), 1, "the node's flow is tracked");
    assert_eq!(
        run(&m, C, NODE, tcp(80, 3000, TCP_SYN | TCP_ACK)).reason,
        Reason::Reply
    );
    assert_eq!(
        from_node(&m, C, tcp(3000, 80, TCP_ACK)).reason,
        Reason::Established
    );
    // After a policy change the node's flow is still allowed (restamped by C's next packet).
    m.state.revision = 2;
    assert_eq!(
        run(&m, C, NODE, tcp(80, 3000, TCP_ACK)).reason,
        Reason::Rechecked
    );
    assert_eq!(
        run(&m, C, NODE, tcp(80, 3000, TCP_ACK)).reason,
        Reason::Reply
    );
    // ... or by the node's next packet.
    assert_eq!(
        from_node(&m, C, tcp(3001, 80, TCP_SYN)).reason,
        Reason::Host
    );
    m.state.revision = 3;
    assert_eq!(
        from_node(&m, C, tcp(3001, 80, TCP_ACK)).reason,
        Reason::Rechecked
    );
    assert_eq!(
        run(&m, C, NODE, tcp(80, 3001, TCP_ACK)).reason,
        Reason::Reply
    );
}

/// The node's UDP flows and pings to an egress-isolated endpoint: only the replies pass, an
/// echo reply opens nothing; the node's packets to anything else cost one ipcache read; an
/// endpoint's own flow to the node is judged and its stale entry is not restamped by the
/// node's answer.
#[test]
fn node_opened_udp_echo_and_endpoint_flows() {
    let mut m = mock_with_isolated_c();
    m.state.revision = 3;
    assert_eq!(
        from_node(
            &m,
            C,
            L4::Udp {
                sport: 53,
                dport: 5353
            }
        )
        .reason,
        Reason::Host
    );
    assert_eq!(
        run(
            &m,
            C,
            NODE,
            L4::Udp {
                sport: 5353,
                dport: 53
            }
        )
        .reason,
        Reason::Reply
    );
    assert_eq!(
        run(
            &m,
            C,
            NODE,
            L4::Udp {
                sport: 5354,
                dport: 53
            }
        )
        .reason,
        Reason::EgressDenied
    );
    assert_eq!(
        from_node(
            &m,
            C,
            L4::EchoId {
                id: 7,
                reply: false
            }
        )
        .reason,
        Reason::Host
    );
    assert_eq!(
        run(&m, C, NODE, L4::EchoId { id: 7, reply: true }).reason,
        Reason::Reply
    );
    assert_eq!(
        run(&m, C, NODE, L4::EchoId { id: 8, reply: true }).reason,
        Reason::EgressDenied,
        "an echo reply nobody asked for"
    );
    let entries = m.ct.borrow().len();
    assert_eq!(
        from_node(&m, C, L4::EchoId { id: 9, reply: true }).reason,
        Reason::Host
    );
    assert_eq!(
        m.ct.borrow().len(),
        entries,
        "the node's echo reply opens nothing"
    );
    // The node's packet to anything but a local endpoint: one ipcache read, nothing tracked.
    let reads = m.reads.get();
    assert_eq!(
        from_node(&m, REMOTE, tcp(3002, 80, TCP_SYN)).reason,
        Reason::Host
    );
    assert_eq!(m.reads.get(), reads + 1);
    assert_eq!(m.ct.borrow().len(), entries);
    // A (egress open) connects to its node: judged, tracked; the node's answer refreshes the
    // entry; after a policy change the node's answer leaves the stale entry to A's next
    // packet, which re-checks A's egress.
    assert_eq!(
        run(&m, A, NODE, tcp(4000, 22, TCP_SYN)).reason,
        Reason::Allowed
    );
    assert_eq!(
        from_node(&m, A, tcp(22, 4000, TCP_SYN | TCP_ACK)).reason,
        Reason::Reply
    );
    m.state.revision = 4;
    assert_eq!(
        from_node(&m, A, tcp(22, 4000, TCP_ACK)).reason,
        Reason::Host
    );
    let (key, _) = ct_key(&ip(&craft::ipv4_frame_between(
        A,
        NODE,
        tcp(4000, 22, TCP_ACK),
    )));
    assert_eq!(m.ct.borrow()[&key].revision, 3, "not restamped by the node");
    assert_eq!(
        run(&m, A, NODE, tcp(4000, 22, TCP_ACK)).reason,
        Reason::Rechecked
    );
    // Malformed or fragmented, the node's packets pass untouched.
    assert_eq!(
        decide_at(&Err(ParseError::TruncatedEthernet), &m, NODE_HOOK).verdict,
        Verdict::Pass
    );
}

/// IPv6 Neighbor Discovery passes without lookups, like ARP, for a pod isolated both ways;
/// anything that is not valid ND to a receiver (hop limit != 255, fragmented, other types,
/// ICMPv4) is judged by policy.
#[test]
fn decide_neighbor_discovery() {
    let mut m = mock();
    let pod = craft::V6_SRC;
    let router_ll: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let solicited: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0, 0, 1];
    // Isolated in both directions: rule set 0 is empty, both defaults deny.
    m.ipcache.insert(
        IpKey::new(FAMILY_V6, addr_words(pod)),
        endpoint(3, 9, PolicyRef::new(0, V_DENY), PolicyRef::new(0, V_DENY)),
    );
    for kind in [
        ICMPV6_ROUTER_SOLICITATION,
        ICMPV6_ROUTER_ADVERTISEMENT,
        ICMPV6_NEIGHBOR_SOLICITATION,
        ICMPV6_NEIGHBOR_ADVERTISEMENT,
        ICMPV6_REDIRECT,
    ] {
        for (src, dst) in [(pod, router_ll), (pod, solicited), (router_ll, pod)] {
            let f = craft::icmpv6_frame(src, dst, kind, 255);
            assert_eq!(
                decide(&p(&f), &m),
                Decision {
                    verdict: Verdict::Pass,
                    reason: Reason::NeighborDiscovery,
                    egress: None,
                    ingress: None,
                    codes: 0,
                    prefixes: 0,
                },
                "type {kind}"
            );
        }
    }
    assert_eq!(m.reads.get(), 0, "ND passes without any map read");
    // The same message with another hop limit was routed (or forged off-link): policy.
    for hop_limit in [254, 64, 1, 0] {
        let f = craft::icmpv6_frame(pod, router_ll, ICMPV6_NEIGHBOR_ADVERTISEMENT, hop_limit);
        assert_eq!(
            decide(&p(&f), &m).reason,
            Reason::EgressDenied,
            "hop limit {hop_limit}"
        );
        let f = craft::icmpv6_frame(router_ll, pod, ICMPV6_NEIGHBOR_SOLICITATION, hop_limit);
        assert_eq!(
            decide(&p(&f), &m).reason,
            Reason::IngressDenied,
            "hop limit {hop_limit}"
        );
    }
    // Neighbouring types (132, 138: MLD done, router renumbering), echo: policy.
    for kind in [128, 132, 138, 0, 255] {
        let f = craft::icmpv6_frame(pod, router_ll, kind, 255);
        assert_eq!(
            decide(&p(&f), &m).reason,
            Reason::EgressDenied,
            "type {kind}"
        );
    }
    // ND in a first fragment (RFC 6980: not ND to a receiver): policy.
    let mut frag = craft::ipv6_frame_with_ext(
        IPPROTO_FRAGMENT,
        &[craft::ipv6_fragment(IPPROTO_ICMPV6, 0, true, 5)],
        L4::Icmp {
            kind: ICMPV6_NEIGHBOR_ADVERTISEMENT,
        },
    );
    craft::set_ipv6_hop_limit(&mut frag, 14, 255);
    assert_eq!(decide(&p(&frag), &m).reason, Reason::EgressDenied);
    // Behind an extension header (not a fragment header), it is still ND.
    let mut behind = craft::ipv6_frame_with_ext(
        IPPROTO_DSTOPTS,
        &[craft::ipv6_ext(IPPROTO_ICMPV6, 8)],
        L4::Icmp {
            kind: ICMPV6_NEIGHBOR_SOLICITATION,
        },
    );
    craft::set_ipv6_hop_limit(&mut behind, 14, 255);
    assert_eq!(decide(&p(&behind), &m).reason, Reason::NeighborDiscovery);
    // ICMPv4 of the same type number and TTL 255 is just ICMP: A's ingress denies it.
    let mut v4 = craft::ipv4_frame_between(REMOTE, A, L4::Icmp { kind: 135 });
    v4[14 + 8] = 255;
    craft::fix_ipv4_checksum(&mut v4, 14);
    assert_eq!(decide(&p(&v4), &m).reason, Reason::IngressDenied);
    assert!(m.ct.borrow().is_empty(), "ICMPv6 is never tracked");
}

#[test]
fn decide_policy_both_sides() {
    let m = mock();
    // REMOTE (identity 7) -> A: ingress of A, rule set 1: TCP/80 allowed for 7 only.
    let d = run(&m, REMOTE, A, tcp(1, 80, TCP_SYN));
    assert_eq!(d.verdict, Verdict::Pass);
    assert_eq!(
        d.ingress.map(|i| i.by),
        Some(Match::Specific {
            prefix: prefix_bits(6, 80, 24)
        })
    );
    assert_eq!(d.egress, None, "the remote source has no egress check here");
    let d = run(&m, REMOTE, A, tcp(1, 81, TCP_SYN));
    assert_eq!(
        (d.verdict, d.reason),
        (Verdict::Drop, Reason::IngressDenied)
    );
    assert_eq!(d.ingress.map(|i| i.by), Some(Match::Default));
    // Wildcard deny of TCP/22 beats A's default even for identity 7.
    let d = run(&m, REMOTE, A, tcp(1, 22, TCP_SYN));
    assert_eq!(
        d.ingress.map(|i| (i.allow, i.by)),
        Some((false, Match::Wildcard))
    );
    // Unknown address (no identity): only `*` applies; UDP is allowed for everyone.
    let d = run(
        &m,
        [203, 0, 113, 5],
        A,
        L4::Udp {
            sport: 5,
            dport: 53,
        },
    );
    assert_eq!(d.verdict, Verdict::Pass);
    // B (identity 8) -> A on TCP/80: egress of B (rule set 1, identity of A = 7: allowed),
    // ingress of A (identity of B = 8: TCP/* denied). Both checked at the sender.
    let d = run(&m, B, A, tcp(1, 80, TCP_SYN));
    assert_eq!(d.egress.map(|e| e.allow), Some(true));
    assert_eq!(
        (d.verdict, d.reason),
        (Verdict::Drop, Reason::IngressDenied)
    );
    // B -> WORLD (CIDR identity 8) TCP/443: B's egress denies identity 8 TCP/*.
    let d = run(&m, B, WORLD, tcp(1, 443, TCP_SYN));
    assert_eq!((d.verdict, d.reason), (Verdict::Drop, Reason::EgressDenied));
    // ICMP only sees length-0 keys: none in rule set 1, so A's default (deny) applies.
    let d = run(&m, REMOTE, A, L4::Echo);
    assert_eq!(d.reason, Reason::IngressDenied);
    assert_eq!(
        m.ct.borrow().len(),
        2,
        "tracked: the allowed TCP/80 SYN and the UDP datagram; nothing for denials and ICMP"
    );
}

#[test]
fn decide_connection_tracking() {
    let mut m = mock();
    // REMOTE:1000 -> A:80 SYN allowed by A's ingress.
    let syn = run(&m, REMOTE, A, tcp(1000, 80, TCP_SYN));
    assert_eq!(syn.reason, Reason::Allowed);
    assert_eq!(m.ct.borrow().len(), 1);
    // The reply from A passes through tracking, no policy lookup.
    let reads = m.reads.get();
    let reply = run(&m, A, REMOTE, tcp(80, 1000, TCP_SYN | TCP_ACK));
    assert_eq!(reply.reason, Reason::Reply);
    assert_eq!(
        m.reads.get(),
        reads,
        "no ipcache or policy read: tracking decides alone"
    );
    // A flow whose reverse direction is isolated: A -> B passes (A's egress and B's ingress
    // are unrestricted), while B -> A as a new flow is denied by A's ingress (default deny).
    let a_to_b = run(&m, A, B, tcp(2000, 5432, TCP_SYN));
    assert_eq!(a_to_b.verdict, Verdict::Pass);
    let b_to_a_new = run(&m, B, A, tcp(5432, 2000, TCP_SYN));
    assert_eq!(
        b_to_a_new.verdict,
        Verdict::Drop,
        "a new SYN from B is checked"
    );
    let b_to_a_reply = run(&m, B, A, tcp(5432, 2000, TCP_SYN | TCP_ACK));
    assert_eq!(b_to_a_reply.reason, Reason::Reply);
    // A denied SYN creates no state.
    let before = m.ct.borrow().len();
    assert_eq!(
        run(&m, REMOTE, A, tcp(1001, 81, TCP_SYN)).verdict,
        Verdict::Drop
    );
    assert_eq!(m.ct.borrow().len(), before);
    // A policy change (revision bump) that no longer allows REMOTE -> A:80: the established
    // flow is re-checked on its next packet, in either direction, and dropped.
    m.state.revision = 2;
    m.policy.remove(&PolicyKey {
        ruleset: 1,
        identity: 7,
        prefix: prefix_bits(6, 80, 24),
    });
    let d = run(&m, A, REMOTE, tcp(80, 1000, TCP_ACK));
    assert_eq!(
        (d.verdict, d.reason),
        (Verdict::Drop, Reason::RecheckDenied)
    );
    assert_eq!(m.ct.borrow().len(), before - 1, "the entry is gone");
    // The A -> B flow is still allowed: re-checked, restamped, and the reply passes again.
    let d = run(&m, B, A, tcp(5432, 2000, TCP_ACK));
    assert_eq!(d.reason, Reason::Rechecked);
    let d = run(&m, B, A, tcp(5432, 2000, TCP_ACK));
    assert_eq!(d.reason, Reason::Reply);
    // Idle entries expire.
    m.now.set(m.state.ct_tcp_ticks + 10);
    let d = run(&m, B, A, tcp(5432, 2000, TCP_ACK));
    assert_eq!(
        d.verdict,
        Verdict::Drop,
        "expired: checked as new, and B -> A is denied"
    );
}

fn valid_frames() -> Vec<Vec<u8>> {
    let l4s = [
        TCP80,
        L4::Udp {
            sport: 1,
            dport: 53,
        },
        L4::Sctp {
            sport: 2,
            dport: 3868,
        },
        L4::Echo,
        L4::Icmp {
            kind: ICMPV6_NEIGHBOR_ADVERTISEMENT,
        },
    ];
    let mut frames = vec![craft::icmpv6_frame(
        craft::V6_SRC,
        craft::V6_DST,
        ICMPV6_NEIGHBOR_SOLICITATION,
        255,
    )];
    for l4 in l4s {
        frames.push(craft::ipv4_frame(l4));
        frames.push(craft::ipv6_frame(l4));
        frames.push(craft::ipv6_frame_with_ext(
            IPPROTO_HOPOPTS,
            &[
                craft::ipv6_ext(IPPROTO_FRAGMENT, 16),
                craft::ipv6_fragment(l4.protocol(true), 0, true, 1),
            ],
            l4,
        ));
        let v4 = craft::ipv4_frame(l4);
        frames.push(craft::ethernet(&[(ETH_P_8021Q, 7)], ETH_P_IP, &v4[14..]));
    }
    frames
}

/// Bytes after the end of the IP packet (Ethernet padding, garbage) never change the result,
/// and every strict prefix that cuts the headers is an error, never a different packet.
#[test]
fn prefixes_and_trailers() {
    for frame in valid_frames() {
        let full = p(&frame);
        assert!(matches!(full, Ok(Parsed::Ip(_))), "{frame:02x?}");
        for extra in [1usize, 7, 100] {
            let mut longer = frame.clone();
            longer.extend((0..extra).map(|i| (i * 37) as u8));
            assert_eq!(p(&longer), full);
        }
        for cut in 0..frame.len() {
            assert!(p(&frame[..cut]).is_err(), "prefix {cut} of {frame:02x?}");
        }
    }
}

#[test]
fn quickcheck_never_panics_and_is_deterministic() {
    fn prop(bytes: Vec<u8>) -> bool {
        let a = p(&bytes);
        a == p(&bytes)
    }
    QuickCheck::new()
        .tests(20_000)
        .quickcheck(prop as fn(Vec<u8>) -> bool);
}

/// An untagged IPv4 TCP or UDP frame with `extra` payload bytes appended (`craft::with_payload`).
fn with_ipv4_payload(f: Vec<u8>, extra: usize) -> Vec<u8> {
    craft::with_payload(&f, f.len() + extra).expect("an IPv4 TCP or UDP frame")
}

/// `parse_simple` reads untagged IPv4 TCP and UDP frames without options or fragmentation, and
/// nothing else.
#[test]
fn parse_simple_reads_the_common_frames() {
    let simple = |f: &[u8]| parse_simple(f).map(Parsed::Ip);
    for l4 in [
        tcp(40000, 443, TCP_ACK),
        tcp(1, 2, TCP_SYN),
        L4::Udp {
            sport: 53,
            dport: 9,
        },
    ] {
        let f = with_ipv4_payload(craft::ipv4_frame_between(A, REMOTE, l4), 16);
        assert_eq!(simple(&f), Some(p(&f).unwrap()), "{l4:?}");
        // Shorter than 50 bytes: the full parser's.
        let small = craft::ipv4_frame_between(A, REMOTE, L4::Udp { sport: 1, dport: 2 });
        assert_eq!(parse_simple(&small[..]), None);
        // Tagged, fragmented, with options, IPv6: the full parser's.
        let tagged = craft::ethernet(&[(ETH_P_8021Q, 3)], ETH_P_IP, &f[14..]);
        let mut first = f.clone();
        craft::set_ipv4_fragment(&mut first, 14, true, 0);
        let mut options = f.clone();
        options[14] = 0x46;
        for other in [tagged, first, options, craft::ipv6_frame(l4)] {
            assert_eq!(parse_simple(&other[..]), None, "{other:02x?}");
        }
    }
    for l4 in [L4::Echo, L4::Sctp { sport: 1, dport: 2 }] {
        assert_eq!(parse_simple(&craft::ipv4_frame(l4)[..]), None, "{l4:?}");
    }
}

/// Random changes to the headers of common frames (and truncations, and bytes appended):
/// whenever `parse_simple` reads a frame, `parse` reads the same packet from it — also for the
/// frames `parse` refuses as malformed, which `parse_simple` must leave to it.
#[test]
fn quickcheck_parse_simple_is_parse() {
    fn prop(which: u8, flips: Vec<(u8, u8)>, cut: Option<u8>) -> TestResult {
        let l4 = match which % 4 {
            0 => tcp(40000, 443, TCP_ACK),
            1 => tcp(443, 40000, TCP_FIN | TCP_ACK),
            2 => L4::Udp {
                sport: 53,
                dport: 5353,
            },
            _ => L4::Udp { sport: 1, dport: 2 },
        };
        let mut f = craft::ipv4_frame_between(A, REMOTE, l4);
        if which & 4 != 0 {
            f = with_ipv4_payload(f, usize::from(which >> 3));
        }
        // The header bytes the checks read: EtherType, version and lengths, fragment field,
        // protocol, ports, UDP length, TCP data offset and flags.
        for (pos, val) in flips {
            let i = 12 + usize::from(pos) % 36;
            if i < f.len() {
                f[i] = val;
            }
        }
        if let Some(c) = cut {
            let len = usize::from(c) % (f.len() + 8);
            if len <= f.len() {
                f.truncate(len);
            } else {
                f.resize(len, 0xa5);
            }
        }
        match parse_simple(&f[..]) {
            Some(ip) => TestResult::from_bool(p(&f) == Ok(Parsed::Ip(ip))),
            None => TestResult::passed(),
        }
    }
    QuickCheck::new()
        .tests(30_000)
        .quickcheck(prop as fn(u8, Vec<(u8, u8)>, Option<u8>) -> TestResult);
}

/// Random byte overwrites in valid frames: parse never panics, an IP result has version 4 or
/// 6, and a non-IP result never carries an IP or VLAN EtherType.
#[test]
fn quickcheck_mutations() {
    fn prop(which: usize, flips: Vec<(u16, u8)>) -> TestResult {
        let frames = valid_frames();
        let mut f = frames[which % frames.len()].clone();
        for (pos, val) in flips {
            let i = usize::from(pos) % f.len();
            f[i] = val;
        }
        match p(&f) {
            Ok(Parsed::Ip(ip)) => TestResult::from_bool(ip.ip_version == 4 || ip.ip_version == 6),
            Ok(Parsed::NotIp { ethertype }) => TestResult::from_bool(
                ethertype != ETH_P_IP
                    && ethertype != ETH_P_IPV6
                    && ethertype != ETH_P_8021Q
                    && ethertype != ETH_P_8021AD,
            ),
            Err(_) => TestResult::passed(),
        }
    }
    QuickCheck::new()
        .tests(20_000)
        .quickcheck(prop as fn(usize, Vec<(u16, u8)>) -> TestResult);
}

/// An ICMP error from `from` to `to` quoting the packet `quoted_src -> quoted_dst` with `l4`.
fn icmp_error(from: [u8; 4], to: [u8; 4], kind: u8, quoted: &[u8]) -> Vec<u8> {
    craft::icmp_error(from.into(), to.into(), kind, 4, 1400, quoted).unwrap()
}

fn quoted(src: [u8; 4], dst: [u8; 4], l4: L4) -> Vec<u8> {
    craft::ip_packet(src.into(), dst.into(), l4).unwrap()
}

const ROUTER: [u8; 4] = [198, 51, 100, 1];

#[test]
fn decide_icmp_echo_tracking() {
    let m = mock();
    let echo = |id, reply| L4::EchoId { id, reply };
    // A (egress open, ingress isolated) pings REMOTE: the request is allowed and tracked, the
    // reply with the same identifier passes without a policy lookup.
    assert_eq!(run(&m, A, REMOTE, echo(7, false)).reason, Reason::Allowed);
    let reads = m.reads.get();
    assert_eq!(run(&m, REMOTE, A, echo(7, true)).reason, Reason::Reply);
    assert_eq!(
        m.reads.get(),
        reads,
        "the reply is decided by tracking alone"
    );
    // The next request of the same ping is established.
    assert_eq!(
        run(&m, A, REMOTE, echo(7, false)).reason,
        Reason::Established
    );
    // An unsolicited reply (another identifier) is judged by A's ingress: denied.
    assert_eq!(
        run(&m, REMOTE, A, echo(8, true)).reason,
        Reason::IngressDenied
    );
    // A request from REMOTE is new ingress, even with the identifier of A's ping.
    assert_eq!(
        run(&m, REMOTE, A, echo(7, false)).reason,
        Reason::IngressDenied
    );
    // Identifier 0: A's request and REMOTE's request share a key; the entry only passes
    // the packets that play their part in A's ping.
    assert_eq!(run(&m, A, REMOTE, echo(0, false)).reason, Reason::Allowed);
    assert_eq!(
        run(&m, REMOTE, A, echo(0, false)).reason,
        Reason::IngressDenied
    );
    assert_eq!(run(&m, REMOTE, A, echo(0, true)).reason, Reason::Reply);
    // A reply from A (its own ping's direction) is not a reply to anything: judged (A's egress
    // is open, so it passes as allowed, and it opens nothing).
    let before = m.ct.borrow().len();
    assert_eq!(run(&m, A, REMOTE, echo(0, true)).reason, Reason::Allowed);
    assert_eq!(
        m.ct.borrow().len(),
        before,
        "an echo reply never opens a flow"
    );
    // Expired after the UDP/ICMP lifetime.
    m.now.set(m.now.get() + m.state.ct_other_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, echo(7, true)).reason,
        Reason::IngressDenied
    );
}

#[test]
fn decide_icmp_errors_follow_the_quoted_flow() {
    let m = mock();
    let udp = L4::Udp {
        sport: 4000,
        dport: 53,
    };
    // A's UDP flow to REMOTE is allowed by A's egress and tracked.
    assert_eq!(run(&m, A, REMOTE, udp).reason, Reason::Allowed);
    let q = quoted(A, REMOTE, udp);
    // Port unreachable from the peer, fragmentation needed / time exceeded from a router:
    // about A's tracked flow, so they pass into A although its ingress is isolated.
    for (from, kind) in [(REMOTE, 3), (ROUTER, 3), (ROUTER, 11), (ROUTER, 12)] {
        let d = decide(&p(&icmp_error(from, A, kind, &q)), &m);
        assert_eq!(d.reason, Reason::Related, "from {from:?} type {kind}");
    }
    // Quoting only the header and 8 bytes is enough (RFC 792).
    let d = decide(&p(&icmp_error(ROUTER, A, 3, &q[..28])), &m);
    assert_eq!(d.reason, Reason::Related);
    // An error about a flow that is not tracked, or that A did not send, is judged as ICMP.
    let other = quoted(
        A,
        REMOTE,
        L4::Udp {
            sport: 4001,
            dport: 53,
        },
    );
    let d = decide(&p(&icmp_error(ROUTER, A, 3, &other)), &m);
    assert_eq!(d.reason, Reason::IngressDenied);
    let not_sent_by_a = quoted(
        REMOTE,
        A,
        L4::Udp {
            sport: 53,
            dport: 4000,
        },
    );
    let d = decide(&p(&icmp_error(ROUTER, A, 3, &not_sent_by_a)), &m);
    assert_eq!(d.reason, Reason::IngressDenied);
    // An error whose quote is cut inside the IP header or the 8 bytes after it, or is not
    // IPv4, is malformed: dropped.
    for cut in [0, 1, 19, 20, 27] {
        let d = decide(&p(&icmp_error(ROUTER, A, 3, &q[..cut])), &m);
        assert_eq!(
            d.reason,
            Reason::Malformed(ParseError::BadIcmpQuote),
            "cut at {cut}"
        );
    }
    let mut bad_version = q.clone();
    bad_version[0] = 0x65;
    let d = decide(&p(&icmp_error(ROUTER, A, 3, &bad_version)), &m);
    assert_eq!(d.reason, Reason::Malformed(ParseError::BadIcmpQuote));
    // Other ICMP types are not errors: no quote is read (a redirect is judged by policy).
    let d = decide(&p(&icmp_error(ROUTER, A, 5, &q[..4])), &m);
    assert_eq!(d.reason, Reason::IngressDenied);
    // Time exceeded about A's ping (traceroute with ICMP).
    let echo = L4::EchoId {
        id: 9,
        reply: false,
    };
    assert_eq!(run(&m, A, REMOTE, echo).reason, Reason::Allowed);
    let d = decide(&p(&icmp_error(ROUTER, A, 11, &quoted(A, REMOTE, echo))), &m);
    assert_eq!(d.reason, Reason::Related);
    // Errors never create or refresh state; after the flow expires they are judged again.
    let before = m.ct.borrow().clone();
    let _ = decide(&p(&icmp_error(ROUTER, A, 3, &q)), &m);
    assert_eq!(*m.ct.borrow(), before);
    m.now.set(m.now.get() + m.state.ct_other_ticks + 1);
    let d = decide(&p(&icmp_error(ROUTER, A, 3, &q)), &m);
    assert_eq!(d.reason, Reason::IngressDenied);
}

#[test]
fn icmp_error_quotes_parse_in_both_families() {
    let a6: std::net::IpAddr = "fd00::1".parse().unwrap();
    let b6: std::net::IpAddr = "fd00::2".parse().unwrap();
    let r6: std::net::IpAddr = "fd00::99".parse().unwrap();
    let tcp = L4::TcpFlags {
        sport: 40000,
        dport: 443,
        flags: TCP_ACK,
    };
    let q6 = craft::ip_packet(a6, b6, tcp).unwrap();
    let ptb = craft::icmp_error(r6, a6, 2, 0, 1280, &q6).unwrap();
    let e = ip(&ptb);
    assert_eq!(
        (e.icmp, e.quote_protocol, e.sport, e.dport),
        (crate::Icmp::Error, IPPROTO_TCP, 40000, 443)
    );
    assert_eq!(e.quote_peer, addr_words(craft::V6_DST));
    // 40 + 8 bytes are required; the IPv6 quote of an IPv4 packet is malformed.
    assert_eq!(
        p(&craft::icmp_error(r6, a6, 2, 0, 1280, &q6[..47]).unwrap()),
        Err(ParseError::BadIcmpQuote)
    );
    let q4 = quoted(A, B, tcp);
    assert_eq!(
        p(&craft::icmp_error(r6, a6, 1, 0, 0, &q4).unwrap()),
        Err(ParseError::BadIcmpQuote)
    );
    // A quoted extension header is not followed: well formed, not related.
    let frag = craft::ipv6(
        craft::V6_SRC,
        craft::V6_DST,
        IPPROTO_FRAGMENT,
        &[
            craft::ipv6_fragment(IPPROTO_UDP, 0, true, 1),
            craft::udp(1, 2, &[]),
        ]
        .concat(),
    );
    let e = ip(&craft::icmp_error(r6, a6, 2, 0, 1280, &frag).unwrap());
    assert_eq!(e.icmp, crate::Icmp::Other);
    // An IPv4 quote of a later fragment is not related either; an IPv4 header with options is
    // skipped by its IHL.
    let mut later = q4.clone();
    later[7] = 1;
    let e = ip(&icmp_error(ROUTER, A, 3, &later));
    assert_eq!(e.icmp, crate::Icmp::Other);
    let mut opts = craft::Ipv4::new(A, B, IPPROTO_UDP);
    opts.options = vec![1, 1, 1, 1];
    let with_options = opts.build(&craft::udp(7, 8, &[]));
    let e = ip(&icmp_error(ROUTER, A, 3, &with_options));
    assert_eq!((e.icmp, e.sport, e.dport), (crate::Icmp::Error, 7, 8));
    // A fragmented error is judged like any ICMP: its quote is not read.
    let mut fragmented = icmp_error(ROUTER, A, 3, &q4);
    craft::set_ipv4_fragment(&mut fragmented, 14, true, 0);
    let e = ip(&fragmented);
    assert_eq!(e.icmp, crate::Icmp::Other);
}

#[test]
fn decide_tcp_state_shortens_lifetimes() {
    let m = mock();
    let syn = |sport| tcp(sport, 443, TCP_SYN);
    let reply = |dport, flags| tcp(443, dport, flags);
    let advance = |ticks: u64| m.now.set(m.now.get() + ticks);
    let syn_ticks = u64::from(m.state.ct_syn_ticks);
    let close_ticks = u64::from(m.state.ct_close_ticks);
    // A flow that never got past its SYN expires after the SYN lifetime: the late SYN-ACK into
    // ingress-isolated A is judged as new and denied.
    assert_eq!(run(&m, A, REMOTE, syn(2001)).reason, Reason::Allowed);
    advance(syn_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2001, TCP_SYN | TCP_ACK)).reason,
        Reason::IngressDenied
    );
    // Answered, it lives the established lifetime.
    assert_eq!(run(&m, A, REMOTE, syn(2002)).reason, Reason::Allowed);
    assert_eq!(
        run(&m, REMOTE, A, reply(2002, TCP_SYN | TCP_ACK)).reason,
        Reason::Reply
    );
    advance(syn_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2002, TCP_ACK)).reason,
        Reason::Reply
    );
    // A FIN each way closes it: the close lifetime.
    assert_eq!(
        run(&m, A, REMOTE, tcp(2002, 443, TCP_FIN | TCP_ACK)).reason,
        Reason::Established
    );
    advance(close_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2002, TCP_ACK)).reason,
        Reason::Reply,
        "one FIN only half-closes"
    );
    assert_eq!(
        run(&m, REMOTE, A, reply(2002, TCP_FIN | TCP_ACK)).reason,
        Reason::Reply
    );
    assert_eq!(
        run(&m, A, REMOTE, tcp(2002, 443, TCP_ACK)).reason,
        Reason::Established
    );
    advance(close_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2002, TCP_ACK)).reason,
        Reason::IngressDenied,
        "closed and expired"
    );
    // An RST closes it too.
    assert_eq!(run(&m, A, REMOTE, syn(2003)).reason, Reason::Allowed);
    assert_eq!(
        run(&m, REMOTE, A, reply(2003, TCP_SYN | TCP_ACK)).reason,
        Reason::Reply
    );
    assert_eq!(
        run(&m, REMOTE, A, reply(2003, TCP_RST)).reason,
        Reason::Reply
    );
    advance(close_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2003, TCP_ACK)).reason,
        Reason::IngressDenied
    );
    // At TC, a SYN on the tuple of a closed flow is judged as a new connection and starts a
    // fresh entry; on a fresh one it passes after the lookup.
    let tc = Hook::Tc {
        ingress_ifindex: 77,
        handoff: 0,
    };
    let at_tc = |l4| {
        decide_at(
            &parse(&craft::ipv4_frame_between(A, REMOTE, l4)[..]),
            &m,
            tc,
        )
    };
    assert_eq!(run(&m, A, REMOTE, syn(2004)).reason, Reason::Allowed);
    assert_eq!(at_tc(syn(2004)).reason, Reason::Established);
    assert_eq!(
        run(&m, A, REMOTE, tcp(2004, 443, TCP_RST)).reason,
        Reason::Established
    );
    assert_eq!(at_tc(syn(2004)).reason, Reason::Allowed);
    let (key, _) = ct_key(&ip(&craft::ipv4_frame_between(A, REMOTE, syn(2004))));
    let flags = m.ct.borrow()[&key].flags;
    assert_eq!(
        flags & CT_TCP_STATE,
        0,
        "a new connection starts a fresh state"
    );
    // A flow first seen after its SYN (a restart, an evicted entry) is established.
    assert_eq!(
        run(&m, A, REMOTE, tcp(2005, 443, TCP_ACK)).reason,
        Reason::Allowed
    );
    advance(syn_ticks + 1);
    assert_eq!(
        run(&m, REMOTE, A, reply(2005, TCP_ACK)).reason,
        Reason::Reply
    );
}

/// The TCP connection-tracking state machine against a model: random sequences of packets of
/// one connection between A (ingress isolated, egress open) and REMOTE (which A's ingress
/// denies on A's port), with the clock advancing between them, decided by `decide` over the
/// in-memory maps; every verdict must be the model's. (The kernel program is compared with
/// the same userspace decision on random sequences in `xdp_testrun`.)
#[test]
fn quickcheck_tcp_state_machine_matches_the_model() {
    #[derive(Clone, Copy, Debug, Default)]
    struct Model {
        replied: bool,
        fin_a: bool,
        fin_r: bool,
        rst: bool,
        last: u64,
    }
    const FLAGS: [u8; 6] = [
        TCP_SYN,
        TCP_SYN | TCP_ACK,
        TCP_ACK,
        TCP_FIN | TCP_ACK,
        TCP_RST,
        TCP_RST | TCP_ACK,
    ];
    const ADVANCE: [u64; 6] = [0, 500, 1_500, 11_000, 61_000, 3_700_000];
    fn prop(steps: Vec<(bool, u8, u8)>) -> TestResult {
        let m = mock();
        let s = m.state;
        let lifetime = |e: &Model| {
            if e.rst || (e.fin_a && e.fin_r) {
                u64::from(s.ct_close_ticks)
            } else if !e.replied {
                u64::from(s.ct_syn_ticks)
            } else {
                s.ct_tcp_ticks
            }
        };
        let mut model: Option<Model> = None;
        let mut now = 0u64;
        for (i, (from_a, f, adv)) in steps.into_iter().enumerate() {
            let flags = FLAGS[usize::from(f) % FLAGS.len()];
            now += ADVANCE[usize::from(adv) % ADVANCE.len()];
            m.now.set(now);
            let syn = flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
            let (fin, rst) = (flags & TCP_FIN != 0, flags & TCP_RST != 0);
            let alive = model.filter(|e| now - e.last <= lifetime(e));
            let want = if from_a {
                if syn {
                    let fresh = model.is_some_and(|e| {
                        !e.replied && !e.fin_a && !e.fin_r && !e.rst && now - e.last <= 1000
                    });
                    if !fresh {
                        model = Some(Model {
                            last: now,
                            ..Model::default()
                        });
                    }
                } else if let Some(mut e) = alive {
                    let before = e;
                    e.fin_a |= fin;
                    e.rst |= rst;
                    let changed = (e.fin_a, e.rst) != (before.fin_a, before.rst);
                    if changed || now - e.last > 1000 {
                        e.last = now;
                    }
                    model = Some(e);
                } else {
                    model = Some(Model {
                        replied: true,
                        fin_a: fin,
                        rst,
                        last: now,
                        ..Model::default()
                    });
                }
                Verdict::Pass
            } else if syn {
                Verdict::Drop
            } else if let Some(mut e) = alive {
                let before = e;
                e.replied = true;
                e.fin_r |= fin;
                e.rst |= rst;
                let changed =
                    (e.replied, e.fin_r, e.rst) != (before.replied, before.fin_r, before.rst);
                if changed || now - e.last > 1000 {
                    e.last = now;
                }
                model = Some(e);
                Verdict::Pass
            } else {
                Verdict::Drop
            };
            let got = if from_a {
                run(&m, A, REMOTE, tcp(2000, 443, flags))
            } else {
                run(&m, REMOTE, A, tcp(443, 2000, flags))
            };
            if got.verdict != want {
                return TestResult::error(std::format!(
                    "step {i}: {} flags {flags:#04x} at {now}: got {got:?}, model {want:?} \
                     ({model:?})",
                    if from_a { "A -> R" } else { "R -> A" }
                ));
            }
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(3_000)
        .quickcheck(prop as fn(Vec<(bool, u8, u8)>) -> TestResult);
}

/// TCP packets past the handshake that find no live entry are counted, by verdict: the signal
/// of flows evicted from a full table (or expired, or never tracked).
#[test]
fn untracked_tcp_packets_are_counted_by_verdict() {
    let m = mock();
    let count = |c| m.counts.borrow().get(&c).copied().unwrap_or(0);
    // A -> REMOTE:443 is allowed (A's egress is open), its reply tracked.
    assert_eq!(
        run(&m, A, REMOTE, tcp(2000, 443, TCP_SYN)).reason,
        Reason::Allowed
    );
    assert_eq!(
        run(&m, REMOTE, A, tcp(443, 2000, TCP_ACK)).reason,
        Reason::Reply
    );
    assert_eq!(
        (
            count(COUNTER_UNTRACKED_DENIED),
            count(COUNTER_UNTRACKED_ALLOWED)
        ),
        (0, 0)
    );
    // The entry is evicted: the server's next packet into isolated A is dropped and counted;
    // A's next packet is allowed, tracked again, and counted as such.
    m.ct.borrow_mut().clear();
    assert_eq!(
        run(&m, REMOTE, A, tcp(443, 2000, TCP_ACK)).reason,
        Reason::IngressDenied
    );
    assert_eq!(count(COUNTER_UNTRACKED_DENIED), 1);
    assert_eq!(
        run(&m, A, REMOTE, tcp(2000, 443, TCP_ACK)).reason,
        Reason::Allowed
    );
    assert_eq!(count(COUNTER_UNTRACKED_ALLOWED), 1);
    // SYNs and RSTs are not counted: a SYN opens a flow, an RST for a forgotten flow is common.
    m.ct.borrow_mut().clear();
    run(&m, REMOTE, A, tcp(443, 2001, TCP_SYN));
    run(&m, REMOTE, A, tcp(443, 2002, TCP_RST));
    assert_eq!(
        (
            count(COUNTER_UNTRACKED_DENIED),
            count(COUNTER_UNTRACKED_ALLOWED)
        ),
        (1, 1)
    );
}

/// A packet of a layer-3 device (no Ethernet header) parses exactly as the same packet behind
/// an Ethernet header does, in both families; the device's protocol decides the family, and a
/// header of the other family, or a protocol that is neither, is not taken for one.
#[test]
fn layer3_packets_parse_like_their_ethernet_frames() {
    let l4 = L4::Tcp {
        sport: 40000,
        dport: 443,
    };
    let v4 = craft::ipv4_frame_between([10, 0, 0, 1], [10, 0, 0, 2], l4);
    let v6 = craft::ipv6_frame_between([0xfd; 16], [0xfe; 16], l4);
    for (frame, protocol) in [(&v4, ETH_P_IP), (&v6, ETH_P_IPV6)] {
        let bare = &frame[ETH_HLEN..];
        assert_eq!(parse_l3(bare, protocol), parse(&frame[..]));
        assert!(matches!(parse_l3(bare, protocol), Ok(Parsed::Ip(_))));
    }
    assert_eq!(
        parse_l3(&v4[ETH_HLEN..], ETH_P_IPV6),
        Err(ParseError::BadIpVersion)
    );
    assert_eq!(
        parse_l3(&v4[ETH_HLEN..], 0x8847),
        Ok(Parsed::NotIp { ethertype: 0x8847 })
    );
    assert!(parse_l3(&v4[ETH_HLEN..ETH_HLEN + 10], ETH_P_IP).is_err());
}

/// The XDP-to-TC handoff: XDP tags the packets it passes as a tracked flow's; the TC hook
/// passes a packet whose tag matches without a lookup, and only then.
#[test]
fn handoff_tags_tracked_packets_and_nothing_else() {
    let mut m = mock();
    m.handoff_key = 0x5eed_1234_abcd_0042;
    let syn = |sport| tcp(sport, 443, TCP_SYN);
    let back = |dport, flags| tcp(443, dport, flags);
    let hook = |handoff| Hook::Tc {
        ingress_ifindex: 77,
        handoff,
    };
    let xdp = |m: &Mock, src, dst, l4| {
        let parsed = parse(&craft::ipv4_frame_between(src, dst, l4)[..]);
        let d = decide(&parsed, m);
        let Ok(Parsed::Ip(p)) = parsed else {
            unreachable!()
        };
        (d, handoff::after_xdp(&p, &d, m))
    };
    let tc = |m: &Mock, src, dst, l4, handoff| {
        decide_at(
            &parse(&craft::ipv4_frame_between(src, dst, l4)[..]),
            m,
            hook(handoff),
        )
    };
    // A new flow is not tagged (the TC hook finds XDP's entry itself); its replies and later
    // packets are.
    let (d, tag) = xdp(&m, A, REMOTE, syn(3000));
    assert_eq!((d.reason, tag), (Reason::Allowed, None));
    let (d, reply) = xdp(&m, REMOTE, A, back(3000, TCP_SYN | TCP_ACK));
    assert_eq!(d.reason, Reason::Reply);
    let reply = reply.expect("a reply is tagged");
    let (d, est) = xdp(&m, A, REMOTE, tcp(3000, 443, TCP_ACK));
    assert_eq!(d.reason, Reason::Established);
    let est = est.expect("an established packet is tagged");
    assert_ne!(reply, est, "the tag is the packet's");
    // The tag passes its own packet at TC without a read, even with the entry gone.
    m.ct.borrow_mut().clear();
    let reads = m.reads.get();
    assert_eq!(
        tc(&m, REMOTE, A, back(3000, TCP_ACK), reply).reason,
        Reason::HandedOff
    );
    assert_eq!(m.reads.get(), reads, "no lookup");
    // Not another packet's tag, not a translated packet, not a forged tag, not after a policy
    // change: those are judged (here: no entry any more, A's ingress is isolated).
    for (what, src, dst, sport, t) in [
        ("another packet's tag", REMOTE, A, 443, est),
        ("another port", REMOTE, A, 444, reply),
        ("another source (SNAT)", WORLD, A, 443, reply),
        ("a forged tag", REMOTE, A, 443, reply ^ 1),
    ] {
        assert_eq!(
            tc(&m, src, dst, tcp(sport, 3000, TCP_ACK), t).reason,
            Reason::IngressDenied,
            "{what}"
        );
    }
    m.state.revision += 1;
    assert_eq!(
        tc(&m, REMOTE, A, back(3000, TCP_ACK), reply).reason,
        Reason::IngressDenied,
        "a tag of an older revision"
    );
    // The node's own packets never use it; without a key nothing is tagged or honoured.
    assert_eq!(
        decide_at(
            &parse(&craft::ipv4_frame_between(REMOTE, A, back(3000, TCP_ACK))[..]),
            &m,
            Hook::Tc {
                ingress_ifindex: 0,
                handoff: reply,
            },
        )
        .reason,
        Reason::Host
    );
    let key = m.handoff_key;
    m.handoff_key = 0;
    let (d, none) = xdp(&m, A, REMOTE, syn(3001));
    assert_eq!(d.reason, Reason::Allowed);
    let (d, none2) = xdp(&m, REMOTE, A, back(3001, TCP_ACK));
    assert_eq!((d.reason, none, none2), (Reason::Reply, None, None));
    m.handoff_key = key;
    let (_, Some(t)) = xdp(&m, REMOTE, A, back(3001, TCP_ACK)) else {
        panic!("tagged again with the key");
    };
    m.handoff_key = 0;
    assert_eq!(
        tc(&m, REMOTE, A, back(3001, TCP_ACK), t).reason,
        Reason::Reply,
        "without a key a tag is not honoured (the entry is looked up)"
    );
}

/// The handoff changes nothing: for random packets between local endpoints, a remote pod and
/// the world, with random policy changes (also between XDP and TC) and clock steps, the TC hook's decision of a
/// packet with the tag XDP left is the decision it makes without it (verdict and tracking
/// table alike), and a random tag is ignored; and the TC program's short cut (`parse_simple`,
/// then `handoff::at_tc` alone) passes only what the full decision passes, as the same decision.
#[test]
fn quickcheck_handoff_changes_no_decision() {
    const ENDS: [[u8; 4]; 5] = [A, B, REMOTE, WORLD, C];
    const FLAGS: [u8; 5] = [
        TCP_SYN,
        TCP_SYN | TCP_ACK,
        TCP_ACK,
        TCP_FIN | TCP_ACK,
        TCP_RST,
    ];
    use std::sync::atomic::{AtomicUsize, Ordering};
    static TAGGED: AtomicUsize = AtomicUsize::new(0);
    static SHORT: AtomicUsize = AtomicUsize::new(0);
    fn prop(steps: Vec<(u8, u8, u8, u8, u16, u64)>) -> TestResult {
        let mut m = mock_with_isolated_c();
        m.handoff_key = 0x0123_4567_89ab_cdef;
        let mut last: Option<([u8; 4], [u8; 4], u16, u16)> = None;
        for (i, (from, to, kind, f, port, random)) in steps.into_iter().enumerate() {
            // A third of the packets continue the previous packet's flow, a third answer it.
            let (src, dst, sport, dport) = match (last, port % 3) {
                (Some(l), 0) => l,
                (Some((s, d, sp, dp)), 1) => (d, s, dp, sp),
                _ => (
                    ENDS[usize::from(from) % ENDS.len()],
                    ENDS[usize::from(to) % ENDS.len()],
                    2000 + port % 2,
                    [443, 80, 22][usize::from(f) % 3],
                ),
            };
            last = Some((src, dst, sport, dport));
            let l4 = match kind % 4 {
                0 | 1 => tcp(sport, dport, FLAGS[usize::from(f) % FLAGS.len()]),
                2 => L4::Udp { sport, dport },
                _ => L4::EchoId {
                    id: sport,
                    reply: f % 2 == 0,
                },
            };
            let frame = craft::ipv4_frame_between(src, dst, l4);
            let parsed = parse(&frame[..]);
            m.now.set(m.now.get() + random % 5_000);
            let d = decide(&parsed, &m);
            let tag = match &parsed {
                Ok(Parsed::Ip(p)) => handoff::after_xdp(p, &d, &m),
                _ => None,
            };
            if tag.is_some() {
                TAGGED.fetch_add(1, Ordering::Relaxed);
            }
            // A policy change may land between the two hooks (the clock does not move: they
            // are microseconds apart).
            if random % 7 == 0 {
                m.state.revision += 1;
            }
            let before = m.ct.borrow().clone();
            let hook = |handoff| Hook::Tc {
                ingress_ifindex: 77,
                handoff,
            };
            let plain = decide_at(&parsed, &m, hook(0));
            let after_plain = core::mem::replace(&mut *m.ct.borrow_mut(), before.clone());
            for t in [tag.unwrap_or(0), random | 1] {
                let with = decide_at(&parsed, &m, hook(t));
                if with.verdict != plain.verdict || *m.ct.borrow() != after_plain {
                    return TestResult::error(std::format!(
                        "step {i}: {src:?} -> {dst:?} {l4:?}: with tag {t:#x} {with:?}, \
                         without {plain:?}"
                    ));
                }
                // The TC program's short cut (the packet read at fixed offsets, then step 0
                // alone) decides only what the full decision decides, and as it does.
                if let Some(p) = parse_simple(&frame[..])
                    && let Some(short) = handoff::at_tc(&p, &m, t)
                {
                    if short != with {
                        return TestResult::error(std::format!(
                            "step {i}: {src:?} -> {dst:?} {l4:?}: with tag {t:#x} the short \
                             cut {short:?}, the full decision {with:?}"
                        ));
                    }
                    SHORT.fetch_add(1, Ordering::Relaxed);
                }
                *m.ct.borrow_mut() = before.clone();
            }
            *m.ct.borrow_mut() = after_plain;
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(1_000)
        .quickcheck(prop as fn(Vec<(u8, u8, u8, u8, u16, u64)>) -> TestResult);
    let tagged = TAGGED.load(Ordering::Relaxed);
    std::println!("{tagged} tagged packets");
    assert!(tagged > 1_000, "the property saw tagged packets ({tagged})");
    let short = SHORT.load(Ordering::Relaxed);
    std::println!("{short} packets passed by the TC short cut");
    assert!(short > 500, "the short cut passed packets ({short})");
}
