//! Loads the real XDP program with aya and checks its verdicts with `BPF_PROG_TEST_RUN`.
//! Every kernel verdict is compared with the verdict userspace computes with the same decision
//! code over its copy of the maps, and with an expectation derived independently from the
//! MapStates (`MapState::lookup`) or written in a case table.
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN). Without root it skips with a message, except when the
//! `CI` environment variable is set: then it fails, so CI can never pass without running it.
//! Run with `--nocapture` to see what was checked.

mod common;

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use common::*;
use ordnet_datapath::{
    ControlPlane as _, Datapath, DatapathConfig, EndpointSpec, IpNet, UserCt, XdpAction,
    common::{
        ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, ICMPV6_NEIGHBOR_ADVERTISEMENT,
        ICMPV6_NEIGHBOR_SOLICITATION, ICMPV6_REDIRECT, ICMPV6_ROUTER_ADVERTISEMENT,
        ICMPV6_ROUTER_SOLICITATION, IPPROTO_AH, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS,
        IPPROTO_ICMPV6, IPPROTO_ROUTING, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, ND_HOP_LIMIT,
        ParseError, Parsed, Reason, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, craft, craft::L4, handoff,
        layout::PROGRAM_NAME, parse,
    },
    pods::{self, TwoPods},
    sys,
};
use ordnet_mapstate::{
    Direction, EntryId, L4Match, MapState, OrderKey, Origin, PolicyEntry, Protocol, Selector,
    Verdict,
};

const PASS: XdpAction = XdpAction::Pass;
const DROP: XdpAction = XdpAction::Drop;

/// True when the test may run; false (after saying so) when it must skip. Panics when it would
/// skip under CI.
fn privileged() -> bool {
    // scripts/test runs this binary in a step of its own (with its output shown) before the
    // workspace's tests, and sets this for the second run of the same binary.
    if std::env::var_os("ORDNET_XDP_TESTRUN_DONE").is_some() {
        eprintln!("skipped: ran in scripts/test's XDP step (ORDNET_XDP_TESTRUN_DONE is set)");
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return true;
    }
    let ci = std::env::var_os("CI").is_some();
    assert!(
        !ci,
        "CI is set but the XDP test-run needs root (euid is {euid}); refusing to skip"
    );
    eprintln!(
        "SKIPPED: BPF_PROG_TEST_RUN needs root (euid {euid}); with CI set this fails instead"
    );
    false
}

fn small_config() -> DatapathConfig {
    DatapathConfig {
        max_rulesets: 64,
        max_blocks: 256,
        policy_entries: 16_384,
        ipcache_entries: 4096,
        cidr_entries: 1024,
        ct4_entries: 4096,
        ct6_entries: 4096,
        ..DatapathConfig::default()
    }
}

fn create() -> Datapath {
    Datapath::create(small_config()).unwrap_or_else(|e| panic!("loading the XDP program: {e}"))
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// A MapState from `(selector, L4, verdict)` rules in order (rule i has order key (0, i)).
fn ms(dir: Direction, default: Verdict, rules: &[(Selector, L4Match, Verdict)]) -> MapState {
    let entries = rules
        .iter()
        .enumerate()
        .map(|(i, (sel, l4, v))| PolicyEntry {
            id: EntryId(i as u64),
            order: OrderKey::new(0, i as u32),
            action: (*v).into(),
            selector: sel.clone(),
            l4: *l4,
            origin: Arc::new(Origin {
                kind: "Test".into(),
                namespace: None,
                name: format!("r{i}"),
                direction: dir,
                rule_index: i as u32,
                rule_name: None,
                priority: 0,
                action: (*v).into(),
                tier: ordnet_mapstate::Tier::Ordnet,
                passed_by: None,
            }),
        });
    MapState::build(dir, default, entries).unwrap()
}

fn open(dir: Direction) -> MapState {
    MapState::new(dir, Verdict::Allow)
}

// ------------------------------------------------------------------ crafted frames

/// The destination of crafted frames (10.0.0.2 / fd00::2) is local endpoint 1 (identity 2);
/// the source (10.0.0.1 / fd00::1) is a remote pod of identity 7.
fn crafted_setup(dp: &mut Datapath) {
    dp.set_identity(net("10.0.0.1/32"), 7).unwrap();
    dp.set_identity(net("fd00::1/128"), 7).unwrap();
}

fn set_ingress(dp: &mut Datapath, ingress: &MapState) {
    let ips = [ip("10.0.0.2"), ip("fd00::2")];
    dp.upsert_endpoint(
        1,
        EndpointSpec {
            ips: &ips,
            identity: 2,
            identities: &[],
            ingress,
            egress: &open(Direction::Egress),
        },
    )
    .unwrap();
}

struct Case {
    name: &'static str,
    frame: Vec<u8>,
    /// Ingress rules of the destination (any peer), default allow.
    rules: Vec<(L4Match, Verdict)>,
    expect: XdpAction,
}

fn case(
    name: &'static str,
    frame: Vec<u8>,
    rules: &[(L4Match, Verdict)],
    expect: XdpAction,
) -> Case {
    Case {
        name,
        frame,
        rules: rules.to_vec(),
        expect,
    }
}

fn deny(proto: Protocol, port: u16) -> (L4Match, Verdict) {
    (L4Match::port(proto, port), Verdict::Deny)
}

fn allow(proto: Protocol, port: u16) -> (L4Match, Verdict) {
    (L4Match::port(proto, port), Verdict::Allow)
}

fn tcp(dport: u16) -> L4 {
    L4::Tcp {
        sport: 40000,
        dport,
    }
}

fn udp(dport: u16) -> L4 {
    L4::Udp { sport: 5000, dport }
}

fn sctp(dport: u16) -> L4 {
    L4::Sctp { sport: 6000, dport }
}

fn ipv4_raw(proto: u8, more_fragments: bool, fragment_offset: u16, payload: &[u8]) -> Vec<u8> {
    let ip = craft::Ipv4 {
        more_fragments,
        fragment_offset,
        ..craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, proto)
    }
    .build(payload);
    craft::ethernet(&[], ETH_P_IP, &ip)
}

fn ipv6_raw(next_header: u8, payload: &[u8]) -> Vec<u8> {
    craft::ethernet(
        &[],
        ETH_P_IPV6,
        &craft::ipv6(craft::V6_SRC, craft::V6_DST, next_header, payload),
    )
}

/// IPv6 + `n` destination-options headers of `len` bytes each + TCP to `dport`.
fn ipv6_ext_chain(n: usize, len: usize, dport: u16) -> Vec<u8> {
    let mut hdrs: Vec<Vec<u8>> = (1..n)
        .map(|_| craft::ipv6_ext(IPPROTO_DSTOPTS, len))
        .collect();
    hdrs.push(craft::ipv6_ext(IPPROTO_TCP, len));
    craft::ipv6_frame_with_ext(IPPROTO_DSTOPTS, &hdrs, tcp(dport))
}

fn with<F: FnOnce(&mut Vec<u8>)>(mut frame: Vec<u8>, edit: F) -> Vec<u8> {
    edit(&mut frame);
    frame
}

fn cases() -> Vec<Case> {
    let mut c = Vec::new();
    for ipv6 in [false, true] {
        let frame = |l4: L4| {
            if ipv6 {
                craft::ipv6_frame(l4)
            } else {
                craft::ipv4_frame(l4)
            }
        };
        for (l4, proto, other) in [
            (tcp(80), Protocol::Tcp, Protocol::Udp),
            (udp(53), Protocol::Udp, Protocol::Tcp),
            (sctp(3868), Protocol::Sctp, Protocol::Tcp),
        ] {
            let port = match l4 {
                L4::Tcp { dport, .. } | L4::Udp { dport, .. } | L4::Sctp { dport, .. } => dport,
                _ => unreachable!(),
            };
            c.push(case("no rule", frame(l4), &[], PASS));
            c.push(case("deny rule", frame(l4), &[deny(proto, port)], DROP));
            c.push(case("allow rule", frame(l4), &[allow(proto, port)], PASS));
            c.push(case(
                "deny other port",
                frame(l4),
                &[deny(proto, port + 1)],
                PASS,
            ));
            c.push(case(
                "deny same port, other protocol",
                frame(l4),
                &[deny(other, port)],
                PASS,
            ));
            c.push(case(
                "deny the protocol",
                frame(l4),
                &[(L4Match::Proto(proto), Verdict::Deny)],
                DROP,
            ));
            c.push(case(
                "allow the port before denying the protocol",
                frame(l4),
                &[allow(proto, port), (L4Match::Proto(proto), Verdict::Deny)],
                PASS,
            ));
            c.push(case(
                "deny a range around the port",
                frame(l4),
                &[(
                    L4Match::Ports {
                        proto,
                        first: port - 3,
                        last: port + 9,
                    },
                    Verdict::Deny,
                )],
                DROP,
            ));
        }
    }
    c.push(case(
        "ICMP echo, TCP denied",
        craft::ipv4_frame(L4::Echo),
        &[(L4Match::Proto(Protocol::Tcp), Verdict::Deny)],
        PASS,
    ));
    c.push(case(
        "ICMP echo, everything denied",
        craft::ipv4_frame(L4::Echo),
        &[(L4Match::Any, Verdict::Deny)],
        DROP,
    ));
    c.push(case(
        "ICMPv6 echo, everything denied",
        craft::ipv6_frame(L4::Echo),
        &[(L4Match::Any, Verdict::Deny)],
        DROP,
    ));

    // IPv6 Neighbor Discovery: passes like ARP when it is valid ND for a receiver (hop limit
    // 255, not fragmented), is judged like any ICMPv6 otherwise.
    let nd = |kind: u8, hop_limit: u8| {
        craft::icmpv6_frame(craft::V6_SRC, craft::V6_DST, kind, hop_limit)
    };
    let none = [(L4Match::Any, Verdict::Deny)];
    for (name, kind) in [
        (
            "ND Router Solicitation, hop limit 255, everything denied",
            ICMPV6_ROUTER_SOLICITATION,
        ),
        (
            "ND Router Advertisement, hop limit 255, everything denied",
            ICMPV6_ROUTER_ADVERTISEMENT,
        ),
        (
            "ND Neighbor Solicitation, hop limit 255, everything denied",
            ICMPV6_NEIGHBOR_SOLICITATION,
        ),
        (
            "ND Neighbor Advertisement, hop limit 255, everything denied",
            ICMPV6_NEIGHBOR_ADVERTISEMENT,
        ),
        (
            "ND Redirect, hop limit 255, everything denied",
            ICMPV6_REDIRECT,
        ),
    ] {
        c.push(case(name, nd(kind, ND_HOP_LIMIT), &none, PASS));
    }
    for (name, frame) in [
        (
            "ND Neighbor Advertisement, hop limit 254, everything denied",
            nd(ICMPV6_NEIGHBOR_ADVERTISEMENT, 254),
        ),
        (
            "ND Neighbor Solicitation, hop limit 64, everything denied",
            nd(ICMPV6_NEIGHBOR_SOLICITATION, 64),
        ),
        (
            "ICMPv6 type 132 (MLD done), hop limit 255, everything denied",
            nd(132, ND_HOP_LIMIT),
        ),
        (
            "ICMPv6 type 138, hop limit 255, everything denied",
            nd(138, ND_HOP_LIMIT),
        ),
        (
            "ICMPv6 echo, hop limit 255, everything denied",
            nd(128, ND_HOP_LIMIT),
        ),
        (
            "ND Neighbor Solicitation in a first fragment, hop limit 255, everything denied",
            with(
                craft::ipv6_frame_with_ext(
                    IPPROTO_FRAGMENT,
                    &[craft::ipv6_fragment(IPPROTO_ICMPV6, 0, true, 4)],
                    L4::Icmp {
                        kind: ICMPV6_NEIGHBOR_SOLICITATION,
                    },
                ),
                |f| craft::set_ipv6_hop_limit(f, 14, ND_HOP_LIMIT),
            ),
        ),
        (
            "ICMPv4 type 135, TTL 255, everything denied",
            with(craft::ipv4_frame(L4::Icmp { kind: 135 }), |f| {
                f[14 + 8] = 255;
                craft::fix_ipv4_checksum(f, 14);
            }),
        ),
    ] {
        c.push(case(name, frame, &none, DROP));
    }
    c.push(case(
        "ND Neighbor Advertisement, hop limit 64, no rule",
        nd(ICMPV6_NEIGHBOR_ADVERTISEMENT, 64),
        &[],
        PASS,
    ));
    c.push(case(
        "ND Neighbor Solicitation behind a destination-options header, everything denied",
        with(
            craft::ipv6_frame_with_ext(
                IPPROTO_DSTOPTS,
                &[craft::ipv6_ext(IPPROTO_ICMPV6, 8)],
                L4::Icmp {
                    kind: ICMPV6_NEIGHBOR_SOLICITATION,
                },
            ),
            |f| craft::set_ipv6_hop_limit(f, 14, ND_HOP_LIMIT),
        ),
        &none,
        PASS,
    ));
    c.push(case(
        "ND Neighbor Advertisement in 802.1Q, everything denied",
        craft::ethernet(
            &[(ETH_P_8021Q, 7)],
            ETH_P_IPV6,
            &nd(ICMPV6_NEIGHBOR_ADVERTISEMENT, ND_HOP_LIMIT)[14..],
        ),
        &none,
        PASS,
    ));
    c.push(case(
        "truncated ICMPv6 header (3 bytes), type 136, hop limit 255",
        with(
            ipv6_raw(
                IPPROTO_ICMPV6,
                &L4::Icmp {
                    kind: ICMPV6_NEIGHBOR_ADVERTISEMENT,
                }
                .bytes(true)[..3],
            ),
            |f| craft::set_ipv6_hop_limit(f, 14, ND_HOP_LIMIT),
        ),
        &[(L4Match::Any, Verdict::Allow)],
        DROP,
    ));
    c.push(case(
        "GRE, everything but TCP denied",
        craft::ipv4_frame(L4::Raw { protocol: 47 }),
        &[
            (L4Match::Proto(Protocol::Tcp), Verdict::Allow),
            (L4Match::Any, Verdict::Deny),
        ],
        DROP,
    ));
    c.push(case(
        "high port 65535",
        craft::ipv4_frame(tcp(65535)),
        &[deny(Protocol::Tcp, 65535)],
        DROP,
    ));
    c.push(case(
        "port 0",
        craft::ipv4_frame(tcp(0)),
        &[deny(Protocol::Tcp, 0)],
        DROP,
    ));
    c.push(case(
        "IPv4 with 40 bytes of options",
        craft::ethernet(
            &[],
            ETH_P_IP,
            &craft::Ipv4 {
                options: vec![1; 40],
                ..craft::Ipv4::new(craft::V4_SRC, craft::V4_DST, IPPROTO_UDP)
            }
            .build(&craft::udp(1, 4789, &[0; 8])),
        ),
        &[deny(Protocol::Udp, 4789)],
        DROP,
    ));
    c.push(case(
        "Ethernet padding after the IP packet",
        with(craft::ipv4_frame(udp(53)), |f| f.resize(60, 0xff)),
        &[deny(Protocol::Udp, 53)],
        DROP,
    ));

    // VLAN.
    let v4 = craft::ipv4_frame(tcp(80));
    let v6 = craft::ipv6_frame(udp(53));
    c.push(case(
        "802.1Q IPv4 TCP, deny",
        craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, &v4[14..]),
        &[deny(Protocol::Tcp, 80)],
        DROP,
    ));
    c.push(case(
        "802.1Q IPv4 TCP, no rule",
        craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, &v4[14..]),
        &[],
        PASS,
    ));
    c.push(case(
        "802.1Q IPv6 UDP, deny",
        craft::ethernet(&[(ETH_P_8021Q, 7)], ETH_P_IPV6, &v6[14..]),
        &[deny(Protocol::Udp, 53)],
        DROP,
    ));
    c.push(case(
        "QinQ (802.1ad + 802.1Q) IPv4 TCP, deny",
        craft::ethernet(
            &[(ETH_P_8021AD, 10), (ETH_P_8021Q, 20)],
            ETH_P_IP,
            &v4[14..],
        ),
        &[deny(Protocol::Tcp, 80)],
        DROP,
    ));
    c.push(case(
        "three VLAN tags: unclassifiable",
        craft::ethernet(
            &[(ETH_P_8021AD, 10), (ETH_P_8021Q, 20), (ETH_P_8021Q, 30)],
            ETH_P_IP,
            &v4[14..],
        ),
        &[],
        DROP,
    ));
    c.push(case(
        "frame ends inside the VLAN tag",
        craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, &[])[..16].to_vec(),
        &[],
        DROP,
    ));
    c.push(case(
        "ARP in 802.1Q",
        craft::ethernet(&[(ETH_P_8021Q, 5)], ETH_P_ARP, &[0; 28]),
        &[(L4Match::Any, Verdict::Deny)],
        PASS,
    ));
    c.push(case(
        "ARP",
        craft::ethernet(&[], ETH_P_ARP, &[0; 28]),
        &[(L4Match::Any, Verdict::Deny)],
        PASS,
    ));
    c.push(case(
        "LLDP, bare 14-byte header",
        craft::ethernet(&[], 0x88cc, &[]),
        &[],
        PASS,
    ));

    // Malformed IP: fail closed, whatever the policy says.
    let all = [(L4Match::Any, Verdict::Allow)];
    c.push(case(
        "Ethernet header only, EtherType IPv4",
        craft::ethernet(&[], ETH_P_IP, &[]),
        &all,
        DROP,
    ));
    c.push(case(
        "truncated IPv4 header (19 bytes)",
        v4[..14 + 19].to_vec(),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv4 IHL 4",
        with(v4.clone(), |f| f[14] = 0x44),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv4 IHL 15 beyond total length",
        with(v4.clone(), |f| f[14] = 0x4f),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv4 total length beyond the frame",
        with(v4.clone(), |f| {
            f[16..18].copy_from_slice(&200u16.to_be_bytes())
        }),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv4 version nibble 6",
        with(v4.clone(), |f| f[14] = 0x65),
        &all,
        DROP,
    ));
    c.push(case(
        "truncated TCP header (10 of 20 bytes)",
        ipv4_raw(IPPROTO_TCP, false, 0, &craft::tcp(1, 80)[..10]),
        &all,
        DROP,
    ));
    c.push(case(
        "TCP data offset 4",
        with(v4.clone(), |f| f[14 + 20 + 12] = 4 << 4),
        &all,
        DROP,
    ));
    c.push(case(
        "truncated UDP header",
        ipv6_raw(IPPROTO_UDP, &craft::udp(1, 53, &[])[..6]),
        &all,
        DROP,
    ));
    c.push(case(
        "UDP length 4",
        with(craft::ipv4_frame(udp(53)), |f| {
            f[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&4u16.to_be_bytes());
        }),
        &all,
        DROP,
    ));
    c.push(case(
        "truncated SCTP common header",
        ipv4_raw(IPPROTO_SCTP, false, 0, &craft::sctp(1, 3868)[..11]),
        &all,
        DROP,
    ));
    c.push(case(
        "truncated IPv6 header (39 bytes)",
        craft::ipv6_frame(tcp(80))[..14 + 39].to_vec(),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv6 with truncated extension header",
        ipv6_raw(IPPROTO_HOPOPTS, &craft::ipv6_ext(IPPROTO_TCP, 16)[..12]),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv6 HBH + routing + AH + TCP, deny",
        craft::ipv6_frame_with_ext(
            IPPROTO_HOPOPTS,
            &[
                craft::ipv6_ext(IPPROTO_ROUTING, 8),
                craft::ipv6_ext(IPPROTO_AH, 16),
                craft::ipv6_ah(IPPROTO_TCP, 4),
            ],
            tcp(443),
        ),
        &[deny(Protocol::Tcp, 443)],
        DROP,
    ));
    c.push(case(
        "IPv6 8 extension headers, deny",
        ipv6_ext_chain(8, 8, 80),
        &[deny(Protocol::Tcp, 80)],
        DROP,
    ));
    c.push(case(
        "IPv6 8 extension headers, no rule",
        ipv6_ext_chain(8, 8, 80),
        &[],
        PASS,
    ));
    c.push(case(
        "IPv6 9 extension headers: too many",
        ipv6_ext_chain(9, 8, 80),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv6 headers past the 2048-byte bound",
        ipv6_ext_chain(2, 1024, 80),
        &all,
        DROP,
    ));

    // Fragments.
    let tcp_denied = [(L4Match::Proto(Protocol::Tcp), Verdict::Deny)];
    c.push(case(
        "IPv4 first fragment, deny",
        with(v4.clone(), |f| craft::set_ipv4_fragment(f, 14, true, 0)),
        &tcp_denied,
        DROP,
    ));
    c.push(case(
        "IPv4 first fragment, no rule",
        with(v4.clone(), |f| craft::set_ipv4_fragment(f, 14, true, 0)),
        &[],
        PASS,
    ));
    c.push(case(
        "IPv4 non-first fragment: passes without lookup",
        ipv4_raw(IPPROTO_TCP, true, 185, &[0; 64]),
        &tcp_denied,
        PASS,
    ));
    c.push(case(
        "IPv4 tiny first fragment (8 bytes of TCP)",
        ipv4_raw(IPPROTO_TCP, true, 0, &craft::tcp(1, 80)[..8]),
        &all,
        DROP,
    ));
    c.push(case(
        "IPv6 first fragment, deny",
        craft::ipv6_frame_with_ext(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_TCP, 0, true, 1)],
            tcp(80),
        ),
        &tcp_denied,
        DROP,
    ));
    c.push(case(
        "IPv6 non-first fragment: passes without lookup",
        ipv6_raw(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_TCP, 1, true, 1), vec![0; 32]].concat(),
        ),
        &tcp_denied,
        PASS,
    ));
    c
}

#[test]
fn verdicts_of_crafted_frames() {
    if !privileged() {
        return;
    }
    let mut dp = create();
    crafted_setup(&mut dp);
    let cases = cases();
    let mut failures = Vec::new();
    for Case {
        name,
        frame,
        rules,
        expect,
    } in &cases
    {
        let rules: Vec<_> = rules
            .iter()
            .map(|(l4, v)| (Selector::Any, *l4, *v))
            .collect();
        set_ingress(&mut dp, &ms(Direction::Ingress, Verdict::Allow, &rules));
        dp.ct_clear().unwrap();
        let kernel = dp
            .test_run(frame)
            .unwrap_or_else(|e| panic!("{name}: test run failed: {e}"))
            .action;
        let userspace = XdpAction::from(dp.decide(frame).verdict);
        if kernel != *expect || userspace != *expect {
            failures.push(format!(
                "{name}: expected {expect:?}, kernel {kernel:?}, userspace {userspace:?} \
                 ({} bytes: {frame:02x?})",
                frame.len()
            ));
        }
    }
    // The kernel refuses XDP test input shorter than an Ethernet header; the host verdict of a
    // runt is DROP.
    let runt = &craft::ipv4_frame(tcp(80))[..13];
    assert!(
        dp.test_run(runt).is_err(),
        "the kernel refuses a 13-byte frame"
    );
    assert_eq!(
        dp.decide(runt).verdict,
        ordnet_datapath::common::Verdict::Drop
    );
    assert_eq!(dp.verify().unwrap(), Vec::<String>::new());
    println!(
        "xdp_testrun: {} crafted frames checked (kernel == userspace == expected)",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} wrong verdicts:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Random mutations of valid frames: kernel and userspace (same decision code, same maps, same
/// connection-tracking sequence) agree on every one, and both verdicts occur often.
#[test]
fn kernel_and_userspace_agree_on_mutated_frames() {
    if !privileged() {
        return;
    }
    let mut dp = create();
    crafted_setup(&mut dp);
    let ports: [u16; 6] = [22, 53, 80, 443, 3868, 8080];
    let mut rules = Vec::new();
    for (i, &port) in ports.iter().enumerate() {
        for (j, proto) in Protocol::ALL.into_iter().enumerate() {
            let v = if (i + j) % 2 == 0 {
                Verdict::Deny
            } else {
                Verdict::Allow
            };
            rules.push((Selector::Any, L4Match::port(proto, port), v));
        }
    }
    rules.push((Selector::ids([7]), L4Match::Any, Verdict::Allow));
    set_ingress(&mut dp, &ms(Direction::Ingress, Verdict::Deny, &rules));

    let mut bases = Vec::new();
    for &port in &ports {
        for l4 in [tcp(port), udp(port), sctp(port), L4::Echo] {
            let v4 = craft::ipv4_frame(l4);
            bases.push(craft::ethernet(&[(ETH_P_8021Q, 3)], ETH_P_IP, &v4[14..]));
            bases.push(v4);
            bases.push(craft::ipv6_frame(l4));
            bases.push(craft::ipv6_frame_with_ext(
                IPPROTO_HOPOPTS,
                &[
                    craft::ipv6_ext(IPPROTO_FRAGMENT, 16),
                    craft::ipv6_fragment(l4.protocol(true), 0, true, 9),
                ],
                l4,
            ));
        }
    }
    for kind in [
        ICMPV6_NEIGHBOR_SOLICITATION,
        ICMPV6_NEIGHBOR_ADVERTISEMENT,
        ICMPV6_ROUTER_ADVERTISEMENT,
    ] {
        for hop_limit in [ND_HOP_LIMIT, 64] {
            bases.push(craft::icmpv6_frame(
                craft::V6_SRC,
                craft::V6_DST,
                kind,
                hop_limit,
            ));
        }
    }
    const SEED: u64 = 0x0bd_e7a7_a9a7;
    const N: usize = 20_000;
    let mut rng = Rng::new(SEED);
    let ct = UserCt::default();
    let (mut pass, mut drop, mut disagreements) = (0usize, 0usize, Vec::new());
    for i in 0..N {
        let mut f = bases[rng.below(bases.len())].clone();
        match rng.below(4) {
            0 | 1 => {
                for _ in 0..=rng.below(3) {
                    let at = rng.below(f.len().min(96));
                    f[at] = rng.next() as u8;
                }
            }
            2 => {
                let len = 14 + rng.below(f.len() - 13);
                f.truncate(len);
            }
            _ => {
                f.extend((0..rng.below(64)).map(|_| rng.next() as u8));
                let at = rng.below(f.len());
                f[at] ^= 1 << rng.below(8);
            }
        }
        let kernel = dp.test_run(&f).expect("test run").action;
        let userspace = XdpAction::from(dp.decide_with(&f, &ct).verdict);
        match kernel {
            XdpAction::Pass => pass += 1,
            XdpAction::Drop => drop += 1,
            _ => {}
        }
        if kernel != userspace && disagreements.len() < 10 {
            disagreements.push(format!(
                "#{i}: kernel {kernel:?}, userspace {userspace:?}, parse {:?}, frame {f:02x?}",
                parse(&f[..])
            ));
        }
    }
    let kernel_flows = dp.ct_entries().unwrap().len();
    let user_flows = ct.entries.borrow().len();
    println!(
        "xdp_testrun: {N} mutated frames, kernel == userspace (seed {SEED:#x}; {pass} PASS, \
         {drop} DROP; {kernel_flows} tracked flows in both)"
    );
    assert!(
        disagreements.is_empty(),
        "kernel and userspace disagree:\n{}",
        disagreements.join("\n")
    );
    assert_eq!(kernel_flows, user_flows, "tracking tables diverged");
    assert_eq!(pass + drop, N, "the program returned something else");
    assert!(
        pass > N / 10 && drop > N / 10,
        "mutations too one-sided: {pass} PASS, {drop} DROP"
    );
}

// ------------------------------------------------------------------ differential

/// A node: local endpoints A (identity 2) and B (identity 4) with random MapStates, remote pods
/// of identities 1..=7, two CIDR identities, unknown addresses and the node's own address.
struct World {
    a: [MapState; 2],
    b: [MapState; 2],
}

const A4: &str = "10.0.0.2";
const A6: &str = "fd00::2";
const B4: &str = "10.0.0.3";
const B6: &str = "fd00::3";
const HOST4: &str = "10.0.0.254";
const HOST6: &str = "fd00::fe";

fn remote(i: u32, v6: bool) -> IpAddr {
    if v6 {
        ip(&format!("fd09::{i}"))
    } else {
        ip(&format!("10.9.0.{i}"))
    }
}

/// The identity the world gives an address (independently of the datapath's ipcache).
fn world_identity(addr: IpAddr) -> Option<u32> {
    let s = addr.to_string();
    match s.as_str() {
        A4 | A6 => return Some(2),
        B4 | B6 => return Some(4),
        _ => {}
    }
    for i in 1..=7 {
        if addr == remote(i, false) || addr == remote(i, true) {
            return Some(i);
        }
    }
    if s.starts_with("192.0.2.") {
        return Some(3);
    }
    if s.starts_with("2001:db8:") {
        return Some(5);
    }
    if s.starts_with("198.51.100.") {
        return Some(6);
    }
    None
}

fn world_setup(dp: &mut Datapath) {
    dp.set_host_addresses(&[ip(HOST4), ip(HOST6)]).unwrap();
    let mut ids: Vec<(IpNet, Option<u32>)> = Vec::new();
    for i in 1..=7 {
        ids.push((IpNet::from(remote(i, false)), Some(i)));
        ids.push((IpNet::from(remote(i, true)), Some(i)));
    }
    ids.push((net("192.0.2.0/24"), Some(3)));
    ids.push((net("2001:db8::/32"), Some(5)));
    ids.push((net("198.51.100.0/24"), Some(6)));
    dp.set_identities(&ids).unwrap();
}

fn world_endpoints(dp: &mut Datapath, w: &World) {
    let a_ips = [ip(A4), ip(A6)];
    let b_ips = [ip(B4), ip(B6)];
    dp.update_endpoints(&[
        (
            1,
            EndpointSpec {
                ips: &a_ips,
                identity: 2,
                identities: &[],
                ingress: &w.a[0],
                egress: &w.a[1],
            },
        ),
        (
            2,
            EndpointSpec {
                ips: &b_ips,
                identity: 4,
                identities: &[],
                ingress: &w.b[0],
                egress: &w.b[1],
            },
        ),
    ])
    .unwrap();
}

fn local_states(w: &World, addr: IpAddr) -> Option<&[MapState; 2]> {
    match addr.to_string().as_str() {
        A4 | A6 => Some(&w.a),
        B4 | B6 => Some(&w.b),
        _ => None,
    }
}

/// SEMANTICS §2 on the MapStates, for a parsed packet (not from the datapath's code), at XDP.
fn world_expect(w: &World, frame: &[u8]) -> XdpAction {
    world_expect_at(w, frame, None)
}

/// Interface indexes of the TC differential test: A's and B's host-side interfaces (in the
/// interface map) and an uplink (not in it).
const IF_A: u32 = 11;
const IF_B: u32 = 12;
const IF_UPLINK: u32 = 13;

/// The TC hook's verdict for a frame that came in on `ifindex`, derived from the MapStates
/// independently of the datapath (docs/datapath.md §14): like [`world_expect`], except that a
/// packet whose source is not a local endpoint but that came in on A's or B's interface is that
/// endpoint's, and a node source address (rewritten: the node's own packets never reach the
/// hook) is not exempt but judged with the identity the world gives it.
fn world_expect_tc(w: &World, frame: &[u8], ifindex: u32) -> XdpAction {
    world_expect_at(w, frame, Some(ifindex))
}

/// The expectation at XDP (`tc` = `None`) or at TC (`Some(ingress ifindex)`).
fn world_expect_at(w: &World, frame: &[u8], tc: Option<u32>) -> XdpAction {
    let p = match parse(frame) {
        Err(_) => return DROP,
        Ok(Parsed::NotIp { .. }) => return PASS,
        Ok(Parsed::Ip(p)) => p,
    };
    if p.fragment == ordnet_datapath::common::Fragment::Subsequent {
        return PASS;
    }
    // IPv6 Neighbor Discovery that a receiver would accept as such (docs/datapath.md §3):
    // unfragmented ICMPv6 of types 133..=137 with hop limit 255.
    if p.ip_version == 6
        && p.protocol == 58
        && p.fragment == ordnet_datapath::common::Fragment::No
        && p.hop_limit == 255
        && (133..=137).contains(&p.icmp6_type)
    {
        return PASS;
    }
    let addr = |a: [u32; 4]| -> IpAddr {
        let a = ordnet_datapath::common::addr_bytes(a);
        if p.ip_version == 4 {
            IpAddr::from([a[0], a[1], a[2], a[3]])
        } else {
            IpAddr::from(a)
        }
    };
    let (mut src, dst) = (addr(p.src), addr(p.dst));
    if let Some(ifindex) = tc
        && local_states(w, src).is_none()
    {
        let v6 = p.ip_version == 6;
        match ifindex {
            IF_A => src = ip(if v6 { A6 } else { A4 }),
            IF_B => src = ip(if v6 { B6 } else { B4 }),
            _ => {}
        }
    }
    let (ls, ld) = (local_states(w, src), local_states(w, dst));
    if ls.is_none() && ld.is_none() {
        return PASS;
    }
    // A node source at XDP (spoofed: the node's own packets never pass it) is not judged; a
    // packet to the node is judged by the sender's egress like any other.
    let host = |a: IpAddr| a == ip(HOST4) || a == ip(HOST6);
    if tc.is_none() && host(src) {
        return PASS;
    }
    // A pod with itself: exempt at XDP; at TC it is a hairpin through a Service, judged.
    if tc.is_none()
        && let (Some(s), Some(d)) = (ls, ld)
        && std::ptr::eq(s, d)
    {
        return PASS;
    }
    if let Some(s) = ls
        && s[1]
            .lookup(world_identity(dst), p.protocol, p.dport)
            .verdict()
            == Verdict::Deny
    {
        return DROP;
    }
    if let Some(d) = ld
        && d[0]
            .lookup(world_identity(src), p.protocol, p.dport)
            .verdict()
            == Verdict::Deny
    {
        return DROP;
    }
    PASS
}

fn random_address(rng: &mut Rng, v6: bool) -> IpAddr {
    let pool4 = [
        A4,
        A4,
        A4,
        B4,
        B4,
        HOST4,
        "192.0.2.77",
        "198.51.100.1",
        "203.0.113.9",
        "10.0.0.99",
    ];
    let pool6 = [
        A6,
        A6,
        A6,
        B6,
        B6,
        HOST6,
        "2001:db8::77",
        "2001:db9::1",
        "fd00::99",
        "fd00::98",
    ];
    if rng.chance(3) {
        remote(1 + rng.below(7) as u32, v6)
    } else if v6 {
        ip(rng.pick(&pool6))
    } else {
        ip(rng.pick(&pool4))
    }
}

fn random_frame(rng: &mut Rng, points: &[(u8, u16)]) -> Vec<u8> {
    let v6 = rng.chance(2);
    let src = random_address(rng, v6);
    let dst = random_address(rng, v6);
    let (proto, port) = rng.pick(points);
    let sport = rng.pick(&PORTS);
    let l4 = match proto {
        6 => L4::TcpFlags {
            sport,
            dport: port,
            flags: TCP_SYN,
        },
        17 => L4::Udp { sport, dport: port },
        132 => L4::Sctp { sport, dport: port },
        1 | 58 => L4::Echo,
        p => L4::Raw { protocol: p },
    };
    let mut f = frame(src, dst, l4);
    if v6 && rng.chance(6) {
        f = random_nd_frame(rng, src, dst);
    }
    match rng.below(12) {
        // Truncated somewhere (at least the Ethernet header).
        0 => {
            let len = 14 + rng.below(f.len() - 13);
            f.truncate(len);
        }
        // A later IPv4 fragment / IPv4 first fragment.
        1 if !v6 => craft::set_ipv4_fragment(&mut f, 14, rng.chance(2), rng.below(4) as u16),
        // VLAN-tagged.
        2 => {
            let et = if v6 { ETH_P_IPV6 } else { ETH_P_IP };
            f = craft::ethernet(&[(ETH_P_8021Q, 9)], et, &f[14..]);
        }
        _ => {}
    }
    f
}

/// An ICMPv6 message of a Neighbor Discovery type or a neighbouring one, with hop limit 255 or
/// not, sometimes from or to a link-local or solicited-node multicast address, sometimes in a
/// first fragment.
fn random_nd_frame(rng: &mut Rng, src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let v6 = |a: IpAddr| match a {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(_) => unreachable!("an IPv6 address"),
    };
    let (mut src, mut dst) = (v6(src), v6(dst));
    if rng.chance(3) {
        dst = v6(ip(rng.pick(&[
            "fe80::1",
            "ff02::1:ff00:2",
            "ff02::1",
            "ff02::2",
        ])));
    } else if rng.chance(4) {
        src = v6(ip("fe80::1"));
    }
    let kind = rng.pick(&[128, 132, 133, 134, 135, 136, 137, 137, 138]);
    let hop_limit = rng.pick(&[ND_HOP_LIMIT, ND_HOP_LIMIT, ND_HOP_LIMIT, 254, 64]);
    if rng.chance(5) {
        let mut f = craft::ipv6_frame_with_ext(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_ICMPV6, 0, true, 2)],
            L4::Icmp { kind },
        );
        f[14 + 8..14 + 24].copy_from_slice(&src);
        f[14 + 24..14 + 40].copy_from_slice(&dst);
        craft::set_ipv6_hop_limit(&mut f, 14, hop_limit);
        f
    } else {
        craft::icmpv6_frame(src, dst, kind, hop_limit)
    }
}

#[test]
fn differential_random_mapstates() {
    differential(small_config(), 0xd1ff_5eed);
}

/// The same with node-local identity classes (`DatapathConfig::classes`): the kernel probes
/// class keys with the peers' classes, userspace decides per identity, both must give the
/// MapStates' verdicts; the maps hold exactly the class-level writes.
#[test]
fn differential_random_mapstates_with_classes() {
    let config = DatapathConfig {
        classes: true,
        ..small_config()
    };
    differential(config, 0x0c1a_55e5);
}

fn differential(config: DatapathConfig, seed: u64) {
    if !privileged() {
        return;
    }
    let classes = config.classes;
    let mut dp = Datapath::create(config).expect("loading the programs");
    world_setup(&mut dp);
    // Classes seen, and scenarios where they hold fewer keys than the identities.
    let (mut max_classes, mut fewer) = (0usize, 0usize);
    dp.set_interface(IF_A, 1, Some(&[ip(A4), ip(A6)])).unwrap();
    dp.set_interface(IF_B, 2, Some(&[ip(B4), ip(B6)])).unwrap();
    let mut rng = Rng::new(seed);
    const SCENARIOS: usize = 30;
    const PACKETS: usize = 800;
    let (mut total, mut passed, mut tc_total, mut tc_refused) = (0usize, 0usize, 0usize, 0usize);
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    let mut tc_reasons = std::collections::BTreeMap::<String, usize>::new();
    for scenario in 0..SCENARIOS {
        // The second half as the agent runs: no copy of the policy keys in the userspace
        // tables, the userspace decisions and `verify` read them in the rule set store.
        if scenario == SCENARIOS / 2 {
            dp.keep_keys_in_store();
        }
        let world = World {
            a: [
                arb_mapstate(&mut rng, Direction::Ingress, 14),
                arb_mapstate(&mut rng, Direction::Egress, 14),
            ],
            b: [
                arb_mapstate(&mut rng, Direction::Ingress, 14),
                arb_mapstate(&mut rng, Direction::Egress, 14),
            ],
        };
        world_endpoints(&mut dp, &world);
        let points = probe_points(&[&world.a[0], &world.a[1], &world.b[0], &world.b[1]]);
        for i in 0..PACKETS {
            let f = random_frame(&mut rng, &points);
            let kernel = dp.test_run(&f).expect("test run").action;
            let d = dp.decide(&f);
            let want = world_expect(&world, &f);
            total += 1;
            if kernel == PASS {
                passed += 1;
            }
            *reasons.entry(format!("{:?}", d.reason)).or_default() += 1;
            assert!(
                kernel == want && XdpAction::from(d.verdict) == want,
                "scenario {scenario} packet {i}: expected {want:?}, kernel {kernel:?}, userspace \
                 {d:?}\nparse {:?}\nA {:?}\nB {:?}",
                parse(&f[..]),
                [world.a[0].iter(), world.a[1].iter()],
                [world.b[0].iter(), world.b[1].iter()],
            );
            // The same frame at the TC hook, as come in on A's, B's or an unknown interface.
            // The kernel refuses (EINVAL) to make a sk_buff of a frame whose IP header is cut
            // short; the stack never hands such a packet to the TC hook either.
            dp.ct_clear().unwrap();
            let ifindex = rng.pick(&[IF_A, IF_B, IF_UPLINK]);
            let tc_kernel = match dp.test_run_tc(&f, ifindex, 1) {
                Ok((v, _)) => v,
                Err(e) if format!("{e:?}").contains("InvalidInput") => {
                    tc_refused += 1;
                    continue;
                }
                Err(e) => panic!("tc test run of {} bytes {f:02x?}: {e:?}", f.len()),
            };
            let tc_user = dp.decide_tc(&f, ifindex);
            let tc_want = world_expect_tc(&world, &f, ifindex);
            tc_total += 1;
            assert!(
                XdpAction::from(tc_kernel) == tc_want
                    && XdpAction::from(tc_user.verdict) == tc_want,
                "scenario {scenario} packet {i} at TC (ifindex {ifindex}): expected {tc_want:?}, \
                 kernel {tc_kernel:?}, userspace {tc_user:?}\nparse {:?}",
                parse(&f[..]),
            );
            *tc_reasons
                .entry(format!("{:?}", tc_user.reason))
                .or_default() += 1;
            dp.ct_clear().unwrap();
            // Allowed UDP/SCTP creates tracking state that would make a later reverse packet a
            // reply: start every packet from an empty table.
            if kernel == PASS
                && matches!(
                    parse(&f[..]),
                    Ok(Parsed::Ip(p)) if p.protocol == IPPROTO_UDP || p.protocol == IPPROTO_SCTP
                )
            {
                dp.ct_clear().unwrap();
            }
        }
        assert_eq!(dp.verify().unwrap(), Vec::<String>::new(), "maps == mirror");
        if let Some(c) = dp.classes() {
            c.check()
                .unwrap_or_else(|e| panic!("scenario {scenario}: {e}"));
            let s = c.stats();
            max_classes = max_classes.max(s.classes[0] + s.classes[1]);
            if dp.policy_map_keys() < dp.control().store().policy_keys_held() {
                fewer += 1;
            }
        }
    }
    println!(
        "xdp_testrun: differential (classes: {classes}): {total} packets over {SCENARIOS} random \
         MapState sets, kernel == userspace == MapState ({passed} PASS); reasons {reasons:?}"
    );
    if classes {
        println!(
            "xdp_testrun: classes: at most {max_classes} at once; fewer keys than identities \
             in {fewer} of {SCENARIOS} scenarios"
        );
        assert!(
            max_classes >= 2 && fewer > 0,
            "{max_classes} classes, {fewer} fewer"
        );
    }
    println!(
        "xdp_testrun: differential at the TC hook: {tc_total} packets, kernel == userspace == \
         MapState ({tc_refused} truncated frames the kernel refuses as a sk_buff); reasons \
         {tc_reasons:?}"
    );
    assert!(tc_refused < tc_total / 10, "{tc_refused} refused");
    for reason in ["Allowed", "EgressDenied", "IngressDenied", "NotLocal"] {
        assert!(
            tc_reasons.contains_key(reason),
            "no {reason} at TC: {tc_reasons:?}"
        );
    }
    // At TC a pod with itself is a hairpin through a Service: judged, never exempt.
    assert!(
        !tc_reasons.contains_key("SameEndpoint"),
        "SameEndpoint at TC: {tc_reasons:?}"
    );
    assert!(
        passed > total / 5 && passed < total * 4 / 5,
        "{passed} of {total}"
    );
}

/// With classes, the policy map's room is counted in class keys, by the map itself: an
/// endpoint whose keys do not fit is denied both ways (the classes rebuilt from what the map
/// holds after the refused write), the others are enforced, the kernel and userspace agree;
/// a policy that needs more identity keys than the map holds but few class keys fits.
#[test]
fn with_classes_an_endpoint_whose_keys_do_not_fit_is_denied_both_ways() {
    if !privileged() {
        return;
    }
    let mut dp = Datapath::create(DatapathConfig {
        classes: true,
        policy_entries: 4,
        ..small_config()
    })
    .unwrap();
    let remote = |i: u32| ip(&format!("10.0.1.{i}"));
    let ids: Vec<(IpNet, Option<u32>)> = (7..=12)
        .map(|i| (IpNet::from(remote(i)), Some(i)))
        .collect();
    dp.set_identities(&ids).unwrap();
    let rule = |i: u32, port: u16| {
        (
            Selector::ids([i]),
            L4Match::port(Protocol::Tcp, port),
            Verdict::Allow,
        )
    };
    // Six peers told apart (a port each): six classes, six keys.
    let apart: Vec<_> = (7..=12).map(|i| rule(i, 80 + i as u16)).collect();
    let apart = ms(Direction::Ingress, Verdict::Deny, &apart);
    // Six peers alike (one rule: one rule counter): six identity keys, one class key.
    let alike = (
        Selector::ids(7..=12),
        L4Match::port(Protocol::Tcp, 80),
        Verdict::Allow,
    );
    let alike = ms(Direction::Ingress, Verdict::Deny, &[alike]);
    let small = ms(Direction::Ingress, Verdict::Deny, &[rule(7, 80)]);
    let out = open(Direction::Egress);
    let (a, b) = ([ip("10.0.0.1")], [ip("10.0.0.2")]);
    let spec = |ips, ingress| EndpointSpec {
        ips,
        identity: 20,
        identities: &[],
        ingress,
        egress: &out,
    };
    let check = |dp: &Datapath, want: &[(IpAddr, IpAddr, u16, XdpAction)]| {
        for &(src, dst, port, verdict) in want {
            let f = frame(src, dst, tcp_flags(40000, port, TCP_SYN));
            let user = XdpAction::from(dp.decide(&f).verdict);
            let kernel = dp.test_run(&f).unwrap().action;
            assert_eq!((kernel, user), (verdict, verdict), "{src} -> {dst}:{port}");
        }
        assert_eq!(dp.verify().unwrap(), Vec::<String>::new(), "maps == mirror");
        dp.classes().unwrap().check().unwrap();
        assert!(dp.policy_map_keys() <= 4);
    };
    let (_, denied) = dp
        .update_endpoints_or_deny(&[(1, spec(&a, &apart)), (2, spec(&b, &small))])
        .unwrap();
    assert_eq!(
        denied.iter().map(|d| d.0).collect::<Vec<_>>(),
        [1],
        "{denied:?}"
    );
    assert!(denied[0].1.is_capacity(), "{}", denied[0].1);
    let (ep1, ep2) = (a[0], b[0]);
    check(
        &dp,
        &[
            (remote(7), ep1, 87, XdpAction::Drop),
            (ep1, remote(8), 443, XdpAction::Drop),
            (remote(7), ep2, 80, XdpAction::Pass),
            (remote(8), ep2, 80, XdpAction::Drop),
            (ep2, remote(8), 443, XdpAction::Pass),
        ],
    );
    // Alike peers fit: 2 class keys (peer 7's class, the others'), where identities need 7.
    let (_, denied) = dp
        .update_endpoints_or_deny(&[(1, spec(&a, &alike))])
        .unwrap();
    assert!(denied.is_empty(), "{denied:?}");
    check(
        &dp,
        &[
            (remote(9), ep1, 80, XdpAction::Pass),
            (remote(9), ep1, 81, XdpAction::Drop),
            (ep1, remote(8), 443, XdpAction::Pass),
            (remote(8), ep2, 80, XdpAction::Drop),
            (remote(7), ep2, 80, XdpAction::Pass),
        ],
    );
    // The refused rule set's slot is cleared after the grace period.
    std::thread::sleep(Duration::from_millis(50));
    dp.reclaim().unwrap();
    assert_eq!(dp.control().store().policy_keys_held(), 7);
    assert_eq!(dp.policy_map_keys(), 3, "7's class: 2 keys, the others': 1");
    println!(
        "xdp_testrun: classes: a rule set of 6 identity keys does not fit a 4-key map (denied \
         both ways), one of 6 identity keys in 1 class key does"
    );
}

// ------------------------------------------------------------------ connection tracking

/// Endpoint 1 (A, both families): ingress isolated (nothing allowed), the given egress.
fn upsert_isolated_a(dp: &mut Datapath, egress: &MapState) {
    dp.upsert_endpoint(
        1,
        EndpointSpec {
            ips: &[ip(A4), ip(A6)],
            identity: 2,
            identities: &[],
            ingress: &MapState::new(Direction::Ingress, Verdict::Deny),
            egress,
        },
    )
    .unwrap();
}

/// A datapath of `config` with the world's identities and A isolated for ingress (egress
/// open): the set-up of the connection-tracking tests.
fn isolated_a(config: DatapathConfig) -> Datapath {
    let mut dp = Datapath::create(config).unwrap_or_else(|e| panic!("loading: {e}"));
    world_setup(&mut dp);
    upsert_isolated_a(&mut dp, &open(Direction::Egress));
    dp
}

/// The kernel's verdict on `f` at XDP and the userspace decision's reason (with its own table
/// `ct`); their verdicts must agree.
fn kernel_and_user(dp: &Datapath, ct: &UserCt, f: &[u8]) -> (XdpAction, Reason) {
    let kernel = dp.test_run(f).unwrap().action;
    let user = dp.decide_with(f, ct);
    assert_eq!(
        kernel,
        XdpAction::from(user.verdict),
        "kernel vs userspace: {user:?}"
    );
    (kernel, user.reason)
}

/// A and remote 7, IPv4 then IPv6.
fn a_and_remote() -> [(IpAddr, IpAddr); 2] {
    [(ip(A4), remote(7, false)), (ip(A6), remote(7, true))]
}

/// An Ethernet frame from `src` to `dst` carrying `l4`.
fn frame(src: IpAddr, dst: IpAddr, l4: L4) -> Vec<u8> {
    craft::frame_between(src, dst, l4).unwrap()
}

fn tcp_flags(sport: u16, dport: u16, flags: u8) -> L4 {
    L4::TcpFlags {
        sport,
        dport,
        flags,
    }
}

fn udp_ports(sport: u16, dport: u16) -> L4 {
    L4::Udp { sport, dport }
}

fn sctp_ports(sport: u16, dport: u16) -> L4 {
    L4::Sctp { sport, dport }
}

#[test]
fn conntrack_replies_and_policy_changes() {
    if !privileged() {
        return;
    }
    let mut dp = create();
    world_setup(&mut dp);
    // A: ingress isolated (nothing allowed), egress allows everything.
    upsert_isolated_a(&mut dp, &open(Direction::Egress));
    let ct = UserCt::default();
    let mut checked = 0;
    let mut check = |dp: &Datapath, what: &str, f: Vec<u8>, want: XdpAction, reason: Reason| {
        let kernel = dp.test_run(&f).unwrap().action;
        let user = dp.decide_with(&f, &ct);
        assert_eq!(
            (kernel, XdpAction::from(user.verdict), user.reason),
            (want, want, reason),
            "{what}"
        );
        checked += 1;
    };
    for (a, r) in a_and_remote() {
        let flows = dp.ct_entries().unwrap().len();
        check(
            &dp,
            "A -> R SYN",
            frame(a, r, tcp_flags(40000, 80, TCP_SYN)),
            PASS,
            Reason::Allowed,
        );
        assert_eq!(
            dp.ct_entries().unwrap().len(),
            flows + 1,
            "the SYN is tracked"
        );
        check(
            &dp,
            "R -> A SYN-ACK from the isolated side",
            frame(r, a, tcp_flags(80, 40000, TCP_SYN | TCP_ACK)),
            PASS,
            Reason::Reply,
        );
        check(
            &dp,
            "R -> A ACK",
            frame(r, a, tcp_flags(80, 40000, TCP_ACK)),
            PASS,
            Reason::Reply,
        );
        check(
            &dp,
            "A -> R ACK",
            frame(a, r, tcp_flags(40000, 80, TCP_ACK)),
            PASS,
            Reason::Established,
        );
        check(
            &dp,
            "R -> A pure SYN on the same 5-tuple is a new attempt",
            frame(r, a, tcp_flags(80, 40000, TCP_SYN)),
            DROP,
            Reason::IngressDenied,
        );
        let flows = dp.ct_entries().unwrap().len();
        check(
            &dp,
            "R -> A SYN to 22: denied",
            frame(r, a, tcp_flags(5555, 22, TCP_SYN)),
            DROP,
            Reason::IngressDenied,
        );
        check(
            &dp,
            "R -> A ACK of an unknown flow: denied",
            frame(r, a, tcp_flags(5556, 22, TCP_ACK)),
            DROP,
            Reason::IngressDenied,
        );
        assert_eq!(
            dp.ct_entries().unwrap().len(),
            flows,
            "a denied packet creates no state"
        );
        check(
            &dp,
            "A -> R UDP 53",
            frame(a, r, udp_ports(3333, 53)),
            PASS,
            Reason::Allowed,
        );
        check(
            &dp,
            "R -> A UDP reply",
            frame(r, a, udp_ports(53, 3333)),
            PASS,
            Reason::Reply,
        );
        check(
            &dp,
            "R -> A UDP from another port",
            frame(r, a, udp_ports(54, 3333)),
            DROP,
            Reason::IngressDenied,
        );
        check(
            &dp,
            "A -> R SCTP",
            frame(a, r, sctp_ports(7000, 3868)),
            PASS,
            Reason::Allowed,
        );
        check(
            &dp,
            "R -> A SCTP reply",
            frame(r, a, sctp_ports(3868, 7000)),
            PASS,
            Reason::Reply,
        );
        check(
            &dp,
            "ICMP is not tracked: R -> A echo is denied",
            frame(r, a, L4::Echo),
            DROP,
            Reason::IngressDenied,
        );
    }
    // Policy change: A may no longer reach TCP/80. The established flows are dropped on their
    // next packet (either direction) and forgotten; the UDP flow is still allowed.
    let no80 = ms(
        Direction::Egress,
        Verdict::Allow,
        &[(
            Selector::Any,
            L4Match::port(Protocol::Tcp, 80),
            Verdict::Deny,
        )],
    );
    upsert_isolated_a(&mut dp, &no80);
    for (a, r) in a_and_remote() {
        let flows = dp.ct_entries().unwrap().len();
        check(
            &dp,
            "after the change: R -> A ACK of the TCP/80 flow",
            frame(r, a, tcp_flags(80, 40000, TCP_ACK)),
            DROP,
            Reason::RecheckDenied,
        );
        assert_eq!(
            dp.ct_entries().unwrap().len(),
            flows - 1,
            "the entry is deleted"
        );
        check(
            &dp,
            "after the change: A -> R ACK of the TCP/80 flow",
            frame(a, r, tcp_flags(40000, 80, TCP_ACK)),
            DROP,
            Reason::EgressDenied,
        );
        check(
            &dp,
            "after the change: the UDP flow is re-checked and still allowed",
            frame(r, a, udp_ports(53, 3333)),
            PASS,
            Reason::Rechecked,
        );
        check(
            &dp,
            "after the re-check: a plain reply again",
            frame(r, a, udp_ports(53, 3333)),
            PASS,
            Reason::Reply,
        );
    }
    println!("xdp_testrun: conntrack: {checked} packets checked (kernel == userspace == expected)");
}

/// The XDP-to-TC handoff in the kernel: the XDP program tags exactly the packets userspace says
/// it should (a tracked flow's, passed by its entry), with the tag userspace computes, which
/// changes with the revision. (The TC side needs metadata on a socket buffer, which the
/// kernel's test run cannot give: `agent_bpf` checks it with real packets, and the decision
/// with and without a tag is compared in `ordnet-datapath-common`'s tests.)
#[test]
fn handoff_tags_kernel_equals_userspace() {
    if !privileged() {
        return;
    }
    let mut dp = isolated_a(small_config());
    let ct = UserCt::default();
    let expected = |dp: &Datapath, f: &[u8]| {
        let Ok(Parsed::Ip(p)) = parse(f) else {
            unreachable!()
        };
        handoff::tag(dp.handoff_key(), &p, dp.control().revision())
    };
    // The kernel's tag of `f` at XDP (its verdict and tag checked against userspace's).
    let xdp = |dp: &Datapath, f: &[u8]| {
        let out = dp.test_run(f).unwrap();
        let user = dp.decide_with(f, &ct);
        assert_eq!(out.action, XdpAction::from(user.verdict), "{user:?}");
        let tagged =
            dp.handoff_key() != 0 && matches!(user.reason, Reason::Established | Reason::Reply);
        assert_eq!(
            out.handoff.is_some(),
            tagged,
            "tagged iff {:?} (and the handoff is on)",
            user.reason
        );
        if let Some(t) = out.handoff {
            assert_eq!(t, expected(dp, f), "the kernel's tag is userspace's");
        }
        out.handoff
    };
    if let Some(why) = dp.handoff_refused() {
        // A kernel that refuses the XDP metadata helper: the programs were loaded without the
        // handoff (key 0), decide as userspace does and tag nothing.
        eprintln!("the kernel refuses XDP metadata ({why}): checked without the handoff");
        assert_eq!(dp.handoff_key(), 0);
        for (a, r) in a_and_remote() {
            let syn = frame(a, r, tcp_flags(41000, 80, TCP_SYN));
            let reply = frame(r, a, tcp_flags(80, 41000, TCP_SYN | TCP_ACK));
            assert_eq!(xdp(&dp, &syn), None);
            assert_eq!(xdp(&dp, &reply), None, "a reply passes, untagged");
        }
        return;
    }
    assert_ne!(dp.handoff_key(), 0);
    for (a, r) in a_and_remote() {
        let syn = frame(a, r, tcp_flags(41000, 80, TCP_SYN));
        let reply = frame(r, a, tcp_flags(80, 41000, TCP_SYN | TCP_ACK));
        let ack = frame(r, a, tcp_flags(80, 41000, TCP_ACK));
        let est = frame(a, r, tcp_flags(41000, 80, TCP_ACK));
        assert_eq!(xdp(&dp, &syn), None, "a new flow is not tagged");
        xdp(&dp, &reply).expect("a reply is tagged");
        let ack_tag = xdp(&dp, &ack).expect("a reply is tagged");
        let est_tag = xdp(&dp, &est).expect("an established packet is tagged");
        assert_ne!(ack_tag, est_tag, "each direction its own tag");
        assert_eq!(
            xdp(&dp, &frame(r, a, tcp_flags(80, 41001, TCP_ACK))),
            None,
            "an untracked packet is judged (dropped), not tagged"
        );
        // Echo: the request opens the flow, its reply is tagged.
        let ping = frame(
            a,
            r,
            L4::EchoId {
                id: 9,
                reply: false,
            },
        );
        let pong = frame(r, a, L4::EchoId { id: 9, reply: true });
        assert_eq!(xdp(&dp, &ping), None);
        assert!(xdp(&dp, &pong).is_some());
        // A policy change: the entry is re-checked (not tagged), then tagged anew.
        let before = dp.control().revision();
        upsert_isolated_a(&mut dp, &MapState::new(Direction::Egress, Verdict::Deny));
        upsert_isolated_a(&mut dp, &open(Direction::Egress));
        assert!(dp.control().revision() > before);
        assert_eq!(xdp(&dp, &ack), None, "re-checked");
        let again = xdp(&dp, &ack).expect("tagged at the new revision");
        assert_ne!(again, ack_tag, "a new revision, a new tag");
    }
}

/// Idle tracked flows expire on the program's clock (jiffies, lifetimes in ticks of the
/// calibrated HZ), and a refreshed flow does not.
#[test]
fn conntrack_entries_expire() {
    if !privileged() {
        return;
    }
    let dp = isolated_a(DatapathConfig {
        ct_other_lifetime: Duration::from_millis(1500),
        ct_refresh: Duration::from_millis(20),
        ..small_config()
    });
    let state = dp.tables().state;
    assert!(
        [100, 250, 300, 1000].contains(&state.hz),
        "calibrated HZ {}",
        state.hz
    );
    let (a, r) = (ip(A4), remote(7, false));
    let udp = |s, d, sport, dport| frame(s, d, udp_ports(sport, dport));
    let run = |dp: &Datapath, f: &[u8]| dp.test_run(f).unwrap().action;
    // Two flows; only the first keeps sending.
    assert_eq!(run(&dp, &udp(a, r, 1111, 53)), PASS);
    assert_eq!(run(&dp, &udp(a, r, 2222, 53)), PASS);
    assert_eq!(run(&dp, &udp(r, a, 53, 2222)), PASS, "reply while fresh");
    // The first flow is refreshed every 100 ms (well inside its 1.5 s lifetime even on a
    // loaded machine); the second stays idle for over twice its lifetime.
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_millis(3200) {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            run(&dp, &udp(r, a, 53, 1111)),
            PASS,
            "refreshed by its replies"
        );
    }
    assert_eq!(
        run(&dp, &udp(r, a, 53, 2222)),
        DROP,
        "an expired flow is a new one, and A's ingress is isolated"
    );
    assert_eq!(run(&dp, &udp(r, a, 53, 1111)), PASS);
    println!(
        "xdp_testrun: conntrack expiry: HZ {}, UDP lifetime {} ticks, refresh {} ticks",
        state.hz, state.ct_other_ticks, state.ct_refresh_ticks
    );
}

/// ICMP in connection tracking, in the kernel and in userspace: an allowed echo request lets
/// its reply into ingress-isolated A, an unsolicited reply or request does not; an error about
/// one of A's tracked flows passes whoever sends it, an error about nothing tracked is judged as
/// ICMP, a malformed quote is dropped.
#[test]
fn conntrack_icmp_echo_and_errors() {
    if !privileged() {
        return;
    }
    let dp = isolated_a(small_config());
    let ct = UserCt::default();
    let mut checked = 0;
    let mut check = |what: &str, f: Vec<u8>, want: XdpAction, reason: Reason| {
        assert_eq!(kernel_and_user(&dp, &ct, &f), (want, reason), "{what}");
        checked += 1;
    };
    let echo = |id, reply| L4::EchoId { id, reply };
    for (a, r) in a_and_remote() {
        let v6 = a.is_ipv6();
        let router = remote(42, v6);
        check(
            "A -> R echo request",
            frame(a, r, echo(5, false)),
            PASS,
            Reason::Allowed,
        );
        check(
            "R -> A echo reply",
            frame(r, a, echo(5, true)),
            PASS,
            Reason::Reply,
        );
        check(
            "A -> R next request",
            frame(a, r, echo(5, false)),
            PASS,
            Reason::Established,
        );
        check(
            "R -> A unsolicited reply",
            frame(r, a, echo(6, true)),
            DROP,
            Reason::IngressDenied,
        );
        check(
            "R -> A request with A's identifier",
            frame(r, a, echo(5, false)),
            DROP,
            Reason::IngressDenied,
        );
        // Errors about A's UDP flow and A's TCP connection.
        let udp = udp_ports(4000, 53);
        check("A -> R UDP", frame(a, r, udp), PASS, Reason::Allowed);
        let tcp = tcp_flags(40000, 443, TCP_SYN);
        check("A -> R SYN", frame(a, r, tcp), PASS, Reason::Allowed);
        let quoted = |l4| craft::ip_packet(a, r, l4).unwrap();
        let error =
            |from, kind, code, q: &[u8]| craft::icmp_error(from, a, kind, code, 1280, q).unwrap();
        let (unreachable, too_big, port_unreachable) = if v6 { (1, 2, 4) } else { (3, 3, 3) };
        let (frag_code, port_code) = if v6 { (0, 4) } else { (4, 3) };
        check(
            "port unreachable from R about A's UDP flow",
            error(r, unreachable, port_code, &quoted(udp)),
            PASS,
            Reason::Related,
        );
        check(
            "fragmentation needed / packet too big from a router about A's TCP connection",
            error(router, too_big, frag_code, &quoted(tcp)),
            PASS,
            Reason::Related,
        );
        let time_exceeded = if v6 { 3 } else { 11 };
        check(
            "time exceeded from a router about A's ping",
            error(router, time_exceeded, 0, &quoted(echo(5, false))),
            PASS,
            Reason::Related,
        );
        check(
            "an error about a flow nobody tracks: judged as ICMP",
            error(
                router,
                port_unreachable,
                port_code,
                &quoted(udp_ports(4001, 53)),
            ),
            DROP,
            Reason::IngressDenied,
        );
        let q = quoted(udp);
        let header = if v6 { 40 } else { 20 };
        for cut in [0, header - 1, header + 7] {
            check(
                "a quote cut short is malformed",
                error(router, unreachable, 0, &q[..cut]),
                DROP,
                Reason::Malformed(ParseError::BadIcmpQuote),
            );
        }
        check(
            "the header and 8 bytes are enough",
            error(router, unreachable, 0, &q[..header + 8]),
            PASS,
            Reason::Related,
        );
    }
    println!(
        "xdp_testrun: ICMP tracking: {checked} packets checked (kernel == userspace == expected)"
    );
}

/// Random sequences of TCP packets (any flags, both directions, at XDP and at TC), ICMP echoes
/// and ICMP errors quoting them, on a few tuples between ingress-isolated A and a remote: the
/// kernel's verdict and the userspace decision's (verdict and reason, each with its own
/// tracking table) agree on every packet. The userspace decision itself is checked against a
/// model of the state machine (`quickcheck_tcp_state_machine_matches_the_model` in
/// `datapath/common`).
#[test]
fn conntrack_state_machine_kernel_equals_userspace() {
    if !privileged() {
        return;
    }
    let dp = isolated_a(small_config());
    let ct = UserCt::default();
    let mut rng = Rng::new(0x23);
    let flags = [
        TCP_SYN,
        TCP_SYN | TCP_ACK,
        TCP_ACK,
        TCP_FIN | TCP_ACK,
        TCP_RST,
        TCP_RST | TCP_ACK,
        TCP_FIN,
    ];
    let mut checked = 0;
    for (a, r) in a_and_remote() {
        let v6 = a.is_ipv6();
        for _ in 0..3000 {
            let port = rng.pick(&[2000u16, 2001, 2002]);
            let from_a = rng.chance(2);
            let l4 = match rng.below(8) {
                0 => L4::EchoId {
                    id: port,
                    reply: rng.chance(2),
                },
                1 => {
                    // An error about one of the tuples, from the remote to A.
                    let quoted = craft::ip_packet(a, r, tcp_flags(port, 443, TCP_ACK)).unwrap();
                    let kind = if v6 { 2 } else { 3 };
                    let f = craft::icmp_error(r, a, kind, 4, 1280, &quoted).unwrap();
                    kernel_and_user(&dp, &ct, &f);
                    checked += 1;
                    continue;
                }
                _ => tcp_flags(port, 443, rng.pick(&flags)),
            };
            let l4 = match (from_a, l4) {
                (true, l4) => l4,
                (false, L4::TcpFlags { flags, .. }) => tcp_flags(443, port, flags),
                (false, other) => other,
            };
            let f = if from_a {
                frame(a, r, l4)
            } else {
                frame(r, a, l4)
            };
            let at_tc = rng.chance(3);
            let (kernel, user) = if at_tc {
                let (v, _) = dp.test_run_tc(&f, 0x7777, 1).unwrap();
                let user = dp.decide_at(
                    &f,
                    ordnet_datapath::common::Hook::Tc {
                        ingress_ifindex: 0x7777,
                        handoff: 0,
                    },
                    &ct,
                );
                (XdpAction::from(v), user)
            } else {
                (dp.test_run(&f).unwrap().action, dp.decide_with(&f, &ct))
            };
            assert_eq!(
                kernel,
                XdpAction::from(user.verdict),
                "{} {l4:?} at {}: userspace {user:?}",
                if from_a { "A -> R" } else { "R -> A" },
                if at_tc { "TC" } else { "XDP" }
            );
            checked += 1;
        }
    }
    println!("xdp_testrun: conntrack state machine: {checked} packets, kernel == userspace");
}

/// The node's own packet `f` at TC (`ingress_ifindex` 0) in the kernel and in userspace: both
/// pass it; the userspace reason.
fn node_tc(dp: &Datapath, ct: &UserCt, f: &[u8]) -> Reason {
    let (v, _) = dp.test_run_tc(f, 0, 1).unwrap();
    let user = dp.decide_at(
        f,
        ordnet_datapath::common::Hook::Tc {
            ingress_ifindex: 0,
            handoff: 0,
        },
        ct,
    );
    assert_eq!(
        XdpAction::from(v),
        XdpAction::from(user.verdict),
        "{user:?}"
    );
    assert_eq!(XdpAction::from(v), PASS, "the node's own packet");
    user.reason
}

/// Flows the node opens to a pod are tracked at TC (the node's own packets, `ingress_ifindex`
/// 0): A, isolated both ways, answers the node's connections, pings and UDP, while its own new
/// traffic to the node is denied by its egress policy. Then random packets between A and the
/// node (the node's at TC, A's at XDP, policy changes in between): kernel == userspace.
#[test]
fn node_opened_flows_kernel_equals_userspace() {
    if !privileged() {
        return;
    }
    let mut dp = isolated_a(small_config());
    upsert_isolated_a(&mut dp, &MapState::new(Direction::Egress, Verdict::Deny));
    let ct = UserCt::default();
    for (a, n) in [(ip(A4), ip(HOST4)), (ip(A6), ip(HOST6))] {
        assert_eq!(
            kernel_and_user(&dp, &ct, &frame(a, n, tcp_flags(2000, 22, TCP_SYN))),
            (DROP, Reason::EgressDenied),
            "A's own connection to its node"
        );
        assert_eq!(
            node_tc(&dp, &ct, &frame(n, a, tcp_flags(3000, 80, TCP_SYN))),
            Reason::Host
        );
        assert_eq!(
            kernel_and_user(
                &dp,
                &ct,
                &frame(a, n, tcp_flags(80, 3000, TCP_SYN | TCP_ACK))
            ),
            (PASS, Reason::Reply),
            "A answers the node"
        );
        assert_eq!(
            node_tc(&dp, &ct, &frame(n, a, udp_ports(53, 5353))),
            Reason::Host
        );
        assert_eq!(
            kernel_and_user(&dp, &ct, &frame(a, n, udp_ports(5353, 53))),
            (PASS, Reason::Reply)
        );
        assert_eq!(
            node_tc(
                &dp,
                &ct,
                &frame(
                    n,
                    a,
                    L4::EchoId {
                        id: 7,
                        reply: false
                    }
                )
            ),
            Reason::Host
        );
        assert_eq!(
            kernel_and_user(&dp, &ct, &frame(a, n, L4::EchoId { id: 7, reply: true })),
            (PASS, Reason::Reply),
            "A answers the node's ping"
        );
        assert_eq!(
            kernel_and_user(&dp, &ct, &frame(a, n, L4::EchoId { id: 8, reply: true })).0,
            DROP,
            "an echo reply nobody asked for"
        );
    }
    let mut rng = Rng::new(0x28);
    let flags = [
        TCP_SYN,
        TCP_SYN | TCP_ACK,
        TCP_ACK,
        TCP_FIN | TCP_ACK,
        TCP_RST,
    ];
    let (mut passed, mut dropped) = (0, 0);
    for (a, n) in [(ip(A4), ip(HOST4)), (ip(A6), ip(HOST6))] {
        for i in 0..1500 {
            if i % 200 == 199 {
                // A policy change (a new revision): stale entries are re-checked or restamped.
                let egress = if rng.chance(2) {
                    open(Direction::Egress)
                } else {
                    MapState::new(Direction::Egress, Verdict::Deny)
                };
                upsert_isolated_a(&mut dp, &egress);
            }
            let port = rng.pick(&[3000u16, 3001]);
            let l4 = match rng.below(4) {
                0 => L4::EchoId {
                    id: port,
                    reply: rng.chance(2),
                },
                1 => udp_ports(port, 80),
                _ => tcp_flags(port, 80, rng.pick(&flags)),
            };
            if rng.chance(2) {
                node_tc(&dp, &ct, &frame(n, a, l4));
                continue;
            }
            let l4 = match l4 {
                L4::TcpFlags { flags, .. } => tcp_flags(80, port, flags),
                L4::Udp { .. } => udp_ports(80, port),
                other => other,
            };
            match kernel_and_user(&dp, &ct, &frame(a, n, l4)).0 {
                PASS => passed += 1,
                _ => dropped += 1,
            }
        }
    }
    assert!(
        passed > 100 && dropped > 100,
        "{passed} passed, {dropped} dropped"
    );
    println!(
        "xdp_testrun: node-opened flows: A's packets to the node {passed} passed, {dropped} \
         dropped, kernel == userspace"
    );
}

/// TCP state in connection tracking, in the kernel and in userspace: a flow that never got past
/// its SYN and a closed one (a FIN each way, or an RST) expire after their short lifetimes; an
/// established one does not.
#[test]
fn conntrack_tcp_state_lifetimes() {
    if !privileged() {
        return;
    }
    let mut dp = isolated_a(DatapathConfig {
        ct_syn_lifetime: Duration::from_millis(1000),
        ct_close_lifetime: Duration::from_millis(1000),
        ct_refresh: Duration::from_millis(20),
        ..small_config()
    });
    let ct = UserCt::default();
    let run = |f: Vec<u8>| kernel_and_user(&dp, &ct, &f).0;
    for (a, r) in a_and_remote() {
        let out = |sport, flags| frame(a, r, tcp_flags(sport, 443, flags));
        let back = |dport, flags| frame(r, a, tcp_flags(443, dport, flags));
        // 1: only a SYN. 2: answered, then a FIN each way. 3: answered, then an RST.
        // 4: answered, one FIN (half-closed). 5: answered.
        for sport in 1..=5 {
            assert_eq!(run(out(sport, TCP_SYN)), PASS);
        }
        for sport in 2..=5 {
            assert_eq!(run(back(sport, TCP_SYN | TCP_ACK)), PASS);
        }
        assert_eq!(run(out(2, TCP_FIN | TCP_ACK)), PASS);
        assert_eq!(run(back(2, TCP_FIN | TCP_ACK)), PASS);
        assert_eq!(run(out(2, TCP_ACK)), PASS, "the last ACK");
        assert_eq!(run(back(3, TCP_RST)), PASS, "the RST itself");
        assert_eq!(run(out(4, TCP_FIN | TCP_ACK)), PASS);
    }
    std::thread::sleep(Duration::from_millis(2300));
    // A sweep removes exactly the expired entries (flows 1-3 of each family) and keeps the
    // live ones (4 and 5).
    let sweep = dp.ct_sweep().unwrap();
    assert_eq!((sweep.live, sweep.removed), ([2, 2], [3, 3]), "{sweep:?}");
    assert_eq!(sweep.capacity, [4096, 4096]);
    assert_eq!(dp.ct_entries().unwrap().len(), 4);
    let run = |f: Vec<u8>| kernel_and_user(&dp, &ct, &f).0;
    for (a, r) in a_and_remote() {
        let back = |dport, flags| frame(r, a, tcp_flags(443, dport, flags));
        for (sport, want, what) in [
            (1, DROP, "never past its SYN: expired"),
            (2, DROP, "closed by FINs: expired"),
            (3, DROP, "closed by an RST: expired"),
            (4, PASS, "half-closed: established lifetime"),
            (5, PASS, "established"),
        ] {
            assert_eq!(run(back(sport, TCP_ACK)), want, "{a}: flow {sport}: {what}");
        }
        // A new connection on the tuple of a closed flow is judged and tracked afresh.
        assert_eq!(run(frame(a, r, tcp_flags(3, 443, TCP_SYN))), PASS);
        assert_eq!(run(back(3, TCP_SYN | TCP_ACK)), PASS);
    }
}

// ------------------------------------------------------------------ update safety

/// A probe frame: bytes, whether it is A's ingress (else egress), peer identity, protocol, port.
type Probe = (Vec<u8>, bool, Option<u32>, u8, u16);

/// The verdicts a state gives the probe frames (A's egress and ingress).
fn expected_verdicts(a: &[MapState; 2], frames: &[Probe]) -> Vec<bool> {
    frames
        .iter()
        .map(|(_, ingress, id, proto, port)| {
            let ms = if *ingress { &a[0] } else { &a[1] };
            ms.lookup(*id, *proto, *port).verdict() == Verdict::Allow
        })
        .collect()
}

#[test]
fn no_transient_allow_while_rule_sets_are_replaced() {
    if !privileged() {
        return;
    }
    let mut dp = create();
    world_setup(&mut dp);
    let mut rng = Rng::new(0x05af_e0bd);
    let a_ips = [ip(A4), ip(A6)];
    let b_ips = [ip(B4), ip(B6)];
    let initial = [
        arb_mapstate(&mut rng, Direction::Ingress, 14),
        arb_mapstate(&mut rng, Direction::Egress, 14),
    ];
    let mut states = vec![initial.clone()];
    for _ in 0..60 {
        states.push([
            arb_mapstate(&mut rng, Direction::Ingress, 14),
            arb_mapstate(&mut rng, Direction::Egress, 14),
        ]);
    }
    // Probe frames: pure SYNs and ICMP (their verdict never depends on tracking state), from
    // remote identities to A (ingress) and from A to them (egress).
    let all: Vec<&MapState> = states.iter().flatten().collect();
    let points: Vec<(u8, u16)> = probe_points(&all)
        .into_iter()
        .filter(|(p, _)| matches!(p, 1 | 6))
        .collect();
    let mut frames = Vec::new();
    for (proto, port) in points {
        for i in [1u32, 3, 5, 7] {
            for ingress in [true, false] {
                let r = remote(i, false);
                let l4 = if proto == 6 {
                    L4::Tcp {
                        sport: 999,
                        dport: port,
                    }
                } else {
                    L4::Echo
                };
                let (s, d) = if ingress { (r, ip(A4)) } else { (ip(A4), r) };
                frames.push((frame(s, d, l4), ingress, Some(i), proto, port));
            }
        }
    }
    let expected: Vec<Vec<bool>> = states
        .iter()
        .map(|s| expected_verdicts(s, &frames))
        .collect();
    fn spec<'a>(ips: &'a [IpAddr], s: &'a [MapState; 2]) -> EndpointSpec<'a> {
        EndpointSpec {
            ips,
            identity: 2,
            identities: &[],
            ingress: &s[0],
            egress: &s[1],
        }
    }
    dp.upsert_endpoint(1, spec(&a_ips, &states[0])).unwrap();

    // The checker runs the pinned-less program through its own handle.
    let done = Arc::new(AtomicBool::new(false));
    let generation = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let frames = Arc::new(frames);
    let expected = Arc::new(expected);
    let program_fd = {
        use std::os::fd::AsFd as _;
        dp.program()
            .unwrap()
            .fd()
            .unwrap()
            .as_fd()
            .try_clone_to_owned()
            .unwrap()
    };
    let checker = {
        let (done, generation, violations, runs, frames, expected) = (
            done.clone(),
            generation.clone(),
            violations.clone(),
            runs.clone(),
            frames.clone(),
            expected.clone(),
        );
        std::thread::spawn(move || {
            let mut i = 0usize;
            while !done.load(Ordering::SeqCst) {
                let (frame, ..) = &frames[i % frames.len()];
                let g1 = generation.load(Ordering::SeqCst);
                let pass = sys_test_run(&program_fd, frame) == PASS;
                let g2 = generation.load(Ordering::SeqCst);
                // Transition g (states[g] -> states[g + 1]) may have been in progress.
                let last = (g2 + 1).min(expected.len() - 1);
                if pass && !(g1..=last).any(|g| expected[g][i % frames.len()]) {
                    violations.lock().unwrap().push(format!(
                        "frame {} allowed during transitions {g1}..={g2}",
                        i % frames.len()
                    ));
                }
                runs.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    let mut in_place = 0;
    let mut switched = 0;
    for g in 0..states.len() - 1 {
        let next = &states[g + 1];
        let stats = if g % 5 == 4 {
            // B shares A's current rule sets, so A's change must leave them alone
            // (copy-on-write), then B follows.
            dp.upsert_endpoint(
                2,
                EndpointSpec {
                    ips: &b_ips,
                    identity: 4,
                    identities: &[],
                    ingress: &states[g][0],
                    egress: &states[g][1],
                },
            )
            .unwrap();
            let s = dp.upsert_endpoint(1, spec(&a_ips, next)).unwrap();
            dp.remove_endpoint(2).unwrap();
            s
        } else {
            dp.upsert_endpoint(1, spec(&a_ips, next)).unwrap()
        };
        in_place += stats.rulesets_updated;
        switched += stats.rulesets_installed;
        generation.store(g + 1, Ordering::SeqCst);
        // Let packets run on the settled state for a moment.
        std::thread::sleep(Duration::from_millis(2));
    }
    done.store(true, Ordering::SeqCst);
    checker.join().unwrap();
    // The final state is exactly the last policy.
    let last = states.last().unwrap();
    for (i, (f, ..)) in frames.iter().enumerate() {
        let want = expected[states.len() - 1][i];
        assert_eq!(
            dp.test_run(f).unwrap().action == PASS,
            want,
            "final frame {i}"
        );
    }
    let _ = last;
    let violations = violations.lock().unwrap();
    println!(
        "xdp_testrun: update safety: {} transitions ({in_place} in place, {switched} installs \
         beside the old rule set), {} packets run concurrently over {} probe frames, {} \
         violations",
        states.len() - 1,
        runs.load(Ordering::Relaxed),
        frames.len(),
        violations.len()
    );
    assert!(violations.is_empty(), "{}", violations.join("\n"));
    assert!(runs.load(Ordering::Relaxed) > 10 * frames.len());
}

/// `BPF_PROG_TEST_RUN` on a raw program fd (for a thread that does not own the program).
fn sys_test_run(fd: &std::os::fd::OwnedFd, frame: &[u8]) -> XdpAction {
    XdpAction::from(sys_test_run_ctx(fd, frame, None))
}

/// The TC program's verdict (`TC_ACT_OK` 0 passes) for a frame that came in on
/// `ingress_ifindex`, on a raw program fd.
fn sys_test_run_tc(fd: &std::os::fd::OwnedFd, frame: &[u8], ingress_ifindex: u32) -> XdpAction {
    // `struct __sk_buff` with only `ingress_ifindex` (offset 36) set.
    let mut ctx = [0u8; 192];
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    if sys_test_run_ctx(fd, frame, Some(&ctx)) == 0 {
        PASS
    } else {
        DROP
    }
}

/// `BPF_PROG_TEST_RUN` once; returns the program's return value.
fn sys_test_run_ctx(fd: &std::os::fd::OwnedFd, frame: &[u8], ctx: Option<&[u8]>) -> u32 {
    use std::os::fd::AsRawFd as _;
    #[repr(C)]
    #[derive(Default)]
    struct Attr {
        prog_fd: u32,
        retval: u32,
        data_size_in: u32,
        data_size_out: u32,
        data_in: u64,
        data_out: u64,
        repeat: u32,
        duration: u32,
        ctx_size_in: u32,
        ctx_size_out: u32,
        ctx_in: u64,
        ctx_out: u64,
        flags: u32,
        cpu: u32,
        batch_size: u32,
        _pad: u32,
    }
    let mut attr = Attr {
        prog_fd: fd.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_in: frame.as_ptr() as u64,
        repeat: 1,
        ctx_size_in: ctx.map_or(0, |c| c.len() as u32),
        ctx_in: ctx.map_or(0, |c| c.as_ptr() as u64),
        ..Attr::default()
    };
    // SAFETY: a valid BPF_PROG_TEST_RUN attribute over live buffers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            10 as libc::c_long,
            &mut attr as *mut Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    assert_eq!(
        r,
        0,
        "BPF_PROG_TEST_RUN: {}",
        std::io::Error::last_os_error()
    );
    attr.retval
}

// ------------------------------------------------------------------ restart

/// A private bpffs mount for the pins, unmounted on drop.
struct Bpffs(PathBuf);

impl Bpffs {
    /// A mount of its own (tests run side by side).
    fn named(suffix: &str) -> Bpffs {
        let dir = std::env::temp_dir().join(format!("ordnet-bpffs-{}{suffix}", std::process::id()));
        sys::ensure_bpffs(&dir).expect("mount a bpffs");
        assert!(sys::is_bpffs(&dir));
        Bpffs(dir)
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Datapath::remove_pins(&self.0.join("ordnet"));
        let c = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deletes the test veth pair on drop (also when the test fails).
struct Veth(&'static str);

impl Drop for Veth {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", self.0])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn veth_pair(a: &str, b: &str) -> bool {
    // A pair left behind by an earlier, interrupted run.
    let _ = std::process::Command::new("ip")
        .args(["link", "del", a])
        .stderr(std::process::Stdio::null())
        .status();
    std::process::Command::new("ip")
        .args(["link", "add", a, "type", "veth", "peer", "name", b])
        .status()
        .is_ok_and(|s| s.success())
        && std::process::Command::new("ip")
            .args(["link", "set", a, "up"])
            .status()
            .is_ok_and(|s| s.success())
}

fn link_prog_id(iface: &str) -> Option<u32> {
    let out = std::process::Command::new("ip")
        .args(["-d", "link", "show", iface])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let at = text.find("prog/xdp id ")?;
    text[at + 12..].split_whitespace().next()?.parse().ok()
}

#[test]
fn restart_adopts_pins_without_changing_verdicts() {
    restart(false, ["ordnet-t0", "ordnet-t1"]);
}

/// The same with classes: the classes are rebuilt from the pinned maps, nothing is written.
#[test]
fn restart_with_classes_adopts_them_without_changing_verdicts() {
    restart(true, ["ordnet-c0", "ordnet-c1"]);
}

fn restart(classes: bool, [if0, if1]: [&'static str; 2]) {
    if !privileged() {
        return;
    }
    // A mount of its own: the two variants run side by side.
    let fs = Bpffs::named(if0);
    let pin_dir = fs.0.join("ordnet");
    let config = DatapathConfig {
        pin_dir: Some(pin_dir.clone()),
        classes,
        ..small_config()
    };
    let mut rng = Rng::new(0x02e5_7a27);
    let world = World {
        a: [
            arb_mapstate(&mut rng, Direction::Ingress, 14),
            arb_mapstate(&mut rng, Direction::Egress, 14),
        ],
        b: [
            arb_mapstate(&mut rng, Direction::Ingress, 14),
            arb_mapstate(&mut rng, Direction::Egress, 14),
        ],
    };
    let mut dp = Datapath::create(config.clone()).unwrap();
    assert!(matches!(
        Datapath::create(config.clone()),
        Err(ordnet_datapath::DatapathError::AlreadyPinned(_))
    ));
    world_setup(&mut dp);
    world_endpoints(&mut dp, &world);
    let veth = veth_pair(if0, if1);
    let _veth_guard = Veth(if0);
    if veth {
        dp.attach(if0, aya::programs::XdpMode::default()).unwrap();
    } else {
        eprintln!("no veth pair (ip link add failed): link adoption not tested");
    }
    let first_prog = link_prog_id(if0);
    let points = probe_points(&[&world.a[0], &world.a[1], &world.b[0], &world.b[1]]);
    let frames: Vec<Vec<u8>> = (0..400).map(|_| random_frame(&mut rng, &points)).collect();
    // Tracking state would change verdicts of later frames: keep it out of this test.
    let frames: Vec<Vec<u8>> = frames
        .into_iter()
        .filter(|f| !matches!(parse(&f[..]), Ok(Parsed::Ip(p)) if p.protocol == IPPROTO_UDP || p.protocol == IPPROTO_SCTP))
        .collect();
    let expected: Vec<XdpAction> = frames.iter().map(|f| world_expect(&world, f)).collect();
    for (f, want) in frames.iter().zip(&expected) {
        assert_eq!(dp.test_run(f).unwrap().action, *want);
    }
    let before = dp.tables().clone();

    // A checker on the pinned program keeps running while the process "restarts".
    let done = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));
    let wrong = Arc::new(AtomicUsize::new(0));
    let checker = {
        let (done, runs, wrong) = (done.clone(), runs.clone(), wrong.clone());
        let (frames, expected) = (frames.clone(), expected.clone());
        let prog_pin = pin_dir.join(PROGRAM_NAME);
        std::thread::spawn(move || {
            let prog = sys::obj_get(&prog_pin).unwrap();
            let mut i = 0;
            while !done.load(Ordering::SeqCst) {
                let k = i % frames.len();
                if sys_test_run(&prog, &frames[k]) != expected[k] {
                    wrong.fetch_add(1, Ordering::SeqCst);
                }
                runs.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(30));
    drop(dp);
    let runs_without_process = {
        let r0 = runs.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        runs.load(Ordering::SeqCst) - r0
    };
    let started = Instant::now();
    let (mut dp, report) = Datapath::adopt(config.clone()).unwrap();
    let adopt_time = started.elapsed();
    std::thread::sleep(Duration::from_millis(30));
    done.store(true, Ordering::SeqCst);
    checker.join().unwrap();

    assert_eq!(
        report.repairs.batches, 0,
        "nothing written on adoption: {report:?}"
    );
    assert_eq!(report.endpoints, 2);
    assert_eq!(dp.classes().is_some(), classes, "classes kept");
    let map_keys = dp.policy_map_keys();
    let after = dp.tables();
    assert_eq!(after.ipcache, before.ipcache);
    assert_eq!(after.cidr, before.cidr);
    assert_eq!(after.cells, before.cells);
    assert_eq!(after.policy, before.policy);
    assert_eq!(after.state, before.state);
    assert_eq!(dp.verify().unwrap(), Vec::<String>::new());
    for (f, want) in frames.iter().zip(&expected) {
        assert_eq!(
            dp.test_run(f).unwrap().action,
            *want,
            "new program instance"
        );
    }
    assert_eq!(
        wrong.load(Ordering::SeqCst),
        0,
        "a verdict changed during the restart"
    );
    assert!(
        runs_without_process > 0,
        "the checker ran while no process held the maps"
    );
    if veth {
        assert_eq!(report.links, vec![if0.to_string()]);
        let second_prog = link_prog_id(if0);
        assert!(first_prog.is_some() && second_prog.is_some());
        assert_ne!(
            first_prog, second_prog,
            "the link now runs the adopted program"
        );
    }

    // The adopted control state is complete: a change is applied as a diff of it.
    let changed = World {
        a: [
            world.a[0].clone(),
            ms(
                Direction::Egress,
                Verdict::Deny,
                &[(
                    Selector::ids([4]),
                    L4Match::Proto(Protocol::Udp),
                    Verdict::Allow,
                )],
            ),
        ],
        b: world.b.clone(),
    };
    world_endpoints(&mut dp, &changed);
    for f in &frames {
        let want = world_expect(&changed, f);
        assert_eq!(dp.test_run(f).unwrap().action, want);
        assert_eq!(XdpAction::from(dp.decide(f).verdict), want);
    }
    assert_eq!(dp.verify().unwrap(), Vec::<String>::new());
    if veth {
        dp.detach(if0).unwrap();
        assert_eq!(link_prog_id(if0), None, "detached");
    }
    println!(
        "xdp_testrun: restart (classes: {classes}, {map_keys} keys in the map): adopted {} endpoints, {} rule sets, links {:?} in {:.1} ms with \
         0 writes; {} packets checked on the pinned program during the restart ({} while no \
         process held the maps), none changed",
        report.endpoints,
        report.rulesets,
        report.links,
        adopt_time.as_secs_f64() * 1e3,
        runs.load(Ordering::SeqCst),
        runs_without_process
    );
}

// ------------------------------------------------------------------ memory

#[test]
fn memory_grows_with_distinct_policies_not_endpoints() {
    if !privileged() {
        return;
    }
    let mut dp = Datapath::create(DatapathConfig::default()).unwrap();
    // A 1000-key rule set (ingress) and an open egress.
    let rules: Vec<(Selector, L4Match, Verdict)> = (0..1000u32)
        .map(|i| {
            (
                Selector::ids([100 + i]),
                L4Match::port(Protocol::Tcp, 1000 + (i % 50) as u16),
                Verdict::Allow,
            )
        })
        .collect();
    let ingress = ms(Direction::Ingress, Verdict::Deny, &rules);
    let egress = open(Direction::Egress);
    let ips: Vec<[IpAddr; 1]> = (0..1000u32)
        .map(|i| [IpAddr::from([10, 2, (i >> 8) as u8, i as u8])])
        .collect();
    let spec = |i: usize| EndpointSpec {
        ips: &ips[i],
        identity: 9,
        identities: &[],
        ingress: &ingress,
        egress: &egress,
    };
    let empty = dp.memory().unwrap();
    dp.upsert_endpoint(1, spec(0)).unwrap();
    let one = dp.memory().unwrap();
    let batch: Vec<(u32, EndpointSpec)> = (1..1000).map(|i| (i as u32 + 1, spec(i))).collect();
    dp.update_endpoints(&batch).unwrap();
    let thousand = dp.memory().unwrap();
    let get = |r: &ordnet_datapath::MemoryReport, m: &str| {
        r.maps.iter().find(|(n, _)| *n == m).unwrap().1
    };
    println!("xdp_testrun: memory (kernel memlock, bytes):");
    for (name, _) in &one.maps {
        println!(
            "  {name:16} empty {:>10}  1 endpoint {:>10}  1000 endpoints {:>10}",
            get(&empty, name),
            get(&one, name),
            get(&thousand, name)
        );
    }
    let dynamic = |r: &ordnet_datapath::MemoryReport| {
        get(r, "ORDNET_POLICY")
            + get(r, "ORDNET_IP4")
            + get(r, "ORDNET_IP6")
            + get(r, "ORDNET_IPCIDR")
    };
    println!(
        "  total: 1 endpoint {} B/endpoint ({} B of them preallocated arrays/LRU); 1000 \
         endpoints {} B/endpoint; marginal {} B per additional endpoint; rule sets {} -> {}",
        one.total,
        one.total - dynamic(&one),
        thousand.total / 1000,
        (thousand.total - one.total) / 999,
        one.rulesets,
        thousand.rulesets
    );
    assert_eq!(one.rulesets, 1);
    assert_eq!(
        thousand.rulesets, 1,
        "identical MapStates share one rule set"
    );
    assert_eq!(
        get(&thousand, "ORDNET_POLICY"),
        get(&one, "ORDNET_POLICY"),
        "the policy map does not grow with endpoints"
    );
    assert!(get(&one, "ORDNET_POLICY") > get(&empty, "ORDNET_POLICY"));
    // What does grow: one ipcache record per address.
    assert!(get(&thousand, "ORDNET_IP4") > get(&one, "ORDNET_IP4"));
    assert!((thousand.total - one.total) / 999 < 512);
}

// ------------------------------------------------------------------ Service translation

/// A flow to a Service frontend as kube-proxy translates it, packet by packet through both
/// hooks (kernel programs through BPF_PROG_TEST_RUN and userspace with its own tracking table,
/// which must agree on every packet): the XDP hook defers the untranslated packets, the TC hook
/// judges the translated ones with the backend as the destination, the replies pass both ways,
/// a masqueraded hairpin is the pod's own traffic, a source rewritten to the node's address is
/// judged (not exempt), and without the frontend the XDP hook judges the untranslated packet.
#[test]
fn service_flows_are_judged_after_translation() {
    if !privileged() {
        return;
    }
    const IF_C: u32 = 14;
    for v6 in [false, true] {
        let mut dp = create();
        world_setup(&mut dp);
        let a = ip(if v6 { A6 } else { A4 });
        let b = ip(if v6 { B6 } else { B4 });
        let c = ip(if v6 { "fd00::4" } else { "10.0.0.4" });
        let host = ip(if v6 { HOST6 } else { HOST4 });
        let vip = |i: u8| {
            ip(&if v6 {
                format!("fd96::{i}")
            } else {
                format!("10.96.0.{i}")
            })
        };
        let (vip_b, vip_c, vip_a) = (vip(10), vip(20), vip(30));
        let tcp8080 = L4Match::port(Protocol::Tcp, 8080);
        // A: ingress open, egress only TCP 8080 to B (identity 4). B: ingress only A (identity
        // 2) on TCP 8080, egress open. C: ingress isolated (nothing), egress open.
        let a_egress = ms(
            Direction::Egress,
            Verdict::Deny,
            &[(Selector::ids([4]), tcp8080, Verdict::Allow)],
        );
        let b_ingress = ms(
            Direction::Ingress,
            Verdict::Deny,
            &[(Selector::ids([2]), tcp8080, Verdict::Allow)],
        );
        let isolated = MapState::new(Direction::Ingress, Verdict::Deny);
        let (a_ips, b_ips, c_ips) = ([a], [b], [c]);
        dp.update_endpoints(&[
            (
                1,
                EndpointSpec {
                    ips: &a_ips,
                    identity: 2,
                    identities: &[],
                    ingress: &open(Direction::Ingress),
                    egress: &a_egress,
                },
            ),
            (
                2,
                EndpointSpec {
                    ips: &b_ips,
                    identity: 4,
                    identities: &[],
                    ingress: &b_ingress,
                    egress: &open(Direction::Egress),
                },
            ),
            (
                3,
                EndpointSpec {
                    ips: &c_ips,
                    identity: 5,
                    identities: &[],
                    ingress: &isolated,
                    egress: &open(Direction::Egress),
                },
            ),
        ])
        .unwrap();
        dp.set_interface(IF_A, 1, Some(&a_ips)).unwrap();
        dp.set_interface(IF_B, 2, Some(&b_ips)).unwrap();
        dp.set_interface(IF_C, 3, Some(&c_ips)).unwrap();
        dp.set_service_frontends(&[(vip_b, 6, 80), (vip_c, 6, 80), (vip_a, 6, 80)])
            .unwrap();
        let ct = UserCt::default();
        let mut steps = 0;
        // One packet at one hook (None = XDP, Some(ifindex) = TC): kernel, userspace and the
        // expectation agree.
        let mut step = |dp: &Datapath,
                        what: &str,
                        hook: Option<u32>,
                        f: Vec<u8>,
                        want: XdpAction,
                        reason: Reason| {
            let (kernel, user) = match hook {
                None => (
                    dp.test_run(&f).unwrap().action,
                    dp.decide_at(&f, ordnet_datapath::common::Hook::Xdp, &ct),
                ),
                Some(ingress_ifindex) => (
                    XdpAction::from(dp.test_run_tc(&f, ingress_ifindex, 1).unwrap().0),
                    dp.decide_at(
                        &f,
                        ordnet_datapath::common::Hook::Tc {
                            ingress_ifindex,
                            handoff: 0,
                        },
                        &ct,
                    ),
                ),
            };
            assert_eq!(
                (kernel, XdpAction::from(user.verdict), user.reason),
                (want, want, reason),
                "IPv{} {what}",
                if v6 { 6 } else { 4 }
            );
            steps += 1;
        };
        let syn = |sport, dport| tcp_flags(sport, dport, TCP_SYN);
        let synack = |sport, dport| tcp_flags(sport, dport, TCP_SYN | TCP_ACK);
        let ack = |sport, dport| tcp_flags(sport, dport, TCP_ACK);
        // A -> VIP_B:80, translated to B:8080: egress of A and ingress of B, on the backend.
        step(
            &dp,
            "A -> VIP_B SYN at XDP: deferred",
            None,
            frame(a, vip_b, syn(40000, 80)),
            PASS,
            Reason::ServiceFrontend,
        );
        step(
            &dp,
            "A -> B:8080 SYN at TC: judged",
            Some(IF_A),
            frame(a, b, syn(40000, 8080)),
            PASS,
            Reason::Allowed,
        );
        step(
            &dp,
            "B -> A SYN-ACK at XDP (B's interface): a reply",
            None,
            frame(b, a, synack(8080, 40000)),
            PASS,
            Reason::Reply,
        );
        step(
            &dp,
            "VIP_B -> A SYN-ACK at TC (A's interface): the deferred flow",
            Some(IF_B),
            frame(vip_b, a, synack(80, 40000)),
            PASS,
            Reason::ServiceFlow,
        );
        step(
            &dp,
            "A -> VIP_B ACK at XDP",
            None,
            frame(a, vip_b, ack(40000, 80)),
            PASS,
            Reason::ServiceFlow,
        );
        step(
            &dp,
            "A -> B:8080 ACK at TC",
            Some(IF_A),
            frame(a, b, ack(40000, 8080)),
            PASS,
            Reason::Established,
        );
        // The ingress bypass of issue 11: B -> VIP_C:80, translated to the isolated C.
        step(
            &dp,
            "B -> VIP_C SYN at XDP: deferred",
            None,
            frame(b, vip_c, syn(40001, 80)),
            PASS,
            Reason::ServiceFrontend,
        );
        step(
            &dp,
            "B -> C:80 SYN at TC: C's ingress denies",
            Some(IF_B),
            frame(b, c, syn(40001, 80)),
            DROP,
            Reason::IngressDenied,
        );
        // Hairpin: A -> VIP_A:80 back to A, masqueraded to the node's address.
        step(
            &dp,
            "A -> VIP_A SYN at XDP: deferred",
            None,
            frame(a, vip_a, syn(40002, 80)),
            PASS,
            Reason::ServiceFrontend,
        );
        step(
            &dp,
            "node(masq) -> A:80 at TC from A's interface: a hairpin, judged (A's egress allows only B)",
            Some(IF_A),
            frame(host, a, syn(40002, 80)),
            DROP,
            Reason::EgressDenied,
        );
        // A NodePort (externalTrafficPolicy Cluster) from outside: source rewritten to the node.
        step(
            &dp,
            "node(masq) -> B:8080 at TC from the uplink: judged, B denies",
            Some(IF_UPLINK),
            frame(host, b, syn(50000, 8080)),
            DROP,
            Reason::IngressDenied,
        );
        // ... with the client address kept (Local): judged with the client's identity.
        step(
            &dp,
            "remote 1 -> B:8080 at TC from the uplink",
            Some(IF_UPLINK),
            frame(remote(1, v6), b, syn(50001, 8080)),
            DROP,
            Reason::IngressDenied,
        );
        step(
            &dp,
            "A -> B:8080 at TC, source rewritten to the node, from A's interface",
            Some(IF_A),
            frame(host, b, syn(40003, 8080)),
            PASS,
            Reason::Allowed,
        );
        // The node's own connection to C (ingress_ifindex 0): passes, tracked.
        step(
            &dp,
            "the node -> C at TC",
            Some(0),
            frame(host, c, syn(50002, 80)),
            PASS,
            Reason::Host,
        );
        // Without the frontend, the XDP hook judges the untranslated packet (A may not send to
        // the VIP's "world" identity): fail closed.
        dp.set_service_frontends(&[(vip_c, 6, 80), (vip_a, 6, 80)])
            .unwrap();
        step(
            &dp,
            "A -> VIP_B SYN at XDP without the frontend: A's egress denies",
            None,
            frame(a, vip_b, syn(40004, 80)),
            DROP,
            Reason::EgressDenied,
        );
        // UDP and SCTP frontends are keyed by their protocol.
        step(
            &dp,
            "A -> VIP_C UDP at XDP: not a frontend of UDP",
            None,
            frame(a, vip_c, udp_ports(40005, 80)),
            DROP,
            Reason::EgressDenied,
        );
        // A direct flow is judged once: XDP tracks the allowed SYN, TC finds the entry of the
        // same direction and stamp (one lookup). The reverse SYN on that tuple is no such
        // entry: judged as new at TC (as a reply of C's flow it would pass), and A's egress
        // denies it.
        step(
            &dp,
            "C -> A SYN at XDP: allowed, tracked",
            None,
            frame(c, a, syn(40006, 8080)),
            PASS,
            Reason::Allowed,
        );
        step(
            &dp,
            "C -> A SYN at TC: the entry XDP just made",
            Some(IF_C),
            frame(c, a, syn(40006, 8080)),
            PASS,
            Reason::Established,
        );
        step(
            &dp,
            "A -> C SYN at TC on that tuple: judged as new",
            Some(IF_A),
            frame(a, c, syn(8080, 40006)),
            DROP,
            Reason::EgressDenied,
        );
        // Frontends on addresses the ipcache knows (a NodePort on the node's address, an
        // external IP that is C's): only their records' frontend mark makes the XDP hook look
        // the Service map up, so the mark must follow the frontends both ways.
        dp.set_service_frontends(&[
            (vip_c, 6, 80),
            (vip_a, 6, 80),
            (host, 6, 30080),
            (c, 6, 9090),
        ])
        .unwrap();
        assert_eq!(dp.verify().unwrap(), Vec::<String>::new(), "maps == mirror");
        for (what, f, want, reason) in [
            (
                "A -> node:30080 SYN at XDP: a NodePort, deferred",
                frame(a, host, syn(40007, 30080)),
                PASS,
                Reason::ServiceFrontend,
            ),
            (
                "A -> node:30081 SYN at XDP: no frontend there, A's egress denies",
                frame(a, host, syn(40008, 30081)),
                DROP,
                Reason::EgressDenied,
            ),
            (
                "A -> C:9090 SYN at XDP: C's address is a frontend there, deferred",
                frame(a, c, syn(40009, 9090)),
                PASS,
                Reason::ServiceFrontend,
            ),
            (
                "A -> C:9091 SYN at XDP: no frontend there, A's egress denies",
                frame(a, c, syn(40010, 9091)),
                DROP,
                Reason::EgressDenied,
            ),
        ] {
            step(&dp, what, None, f, want, reason);
        }
        dp.set_service_frontends(&[(vip_c, 6, 80), (vip_a, 6, 80)])
            .unwrap();
        for (what, f) in [
            (
                "A -> node:30080 SYN at XDP, the NodePort gone: judged",
                frame(a, host, syn(40011, 30080)),
            ),
            (
                "A -> C:9090 SYN at XDP, the frontend gone: judged",
                frame(a, c, syn(40012, 9090)),
            ),
        ] {
            step(&dp, what, None, f, DROP, Reason::EgressDenied);
        }
        assert_eq!(dp.service_frontends().len(), 2);
        assert_eq!(dp.verify().unwrap(), Vec::<String>::new(), "maps == mirror");
        println!(
            "xdp_testrun: Service flows IPv{}: {steps} packets through XDP and TC, kernel == userspace",
            if v6 { 6 } else { 4 }
        );
    }
}

/// One state of the Service safety test: the client's egress, the two backends' ingress, where
/// kube-proxy sends the Service (backend 0 or 1), and whether the frontend exists.
struct SvcState {
    a_egress: MapState,
    ingress: [MapState; 2],
    backend: usize,
    frontend: bool,
}

/// Packets keep flowing to a Service (XDP on the way in, TC after a modelled kube-proxy
/// translation) while its backend, its frontend and the policies of client and backends change:
/// no packet at the TC hook — new connection or established — is ever allowed that neither the
/// state before nor the state after the change in progress allows, and at the end every flow
/// has the last state's verdict. The translation itself is kube-proxy's (modelled here as the
/// state's backend; `controller/tests/lab.rs` runs it in nftables); what is under test is that
/// the datapath's verdicts follow the policies through every write.
#[test]
fn service_flows_never_allowed_by_neither_state() {
    if !privileged() {
        return;
    }
    const IF_C: u32 = 14;
    const SVC_PORT: u16 = 80;
    const BACKEND_PORT: u16 = 8080;
    let mut dp = create();
    world_setup(&mut dp);
    let (a, b, c) = (ip(A4), ip(B4), ip("10.0.0.4"));
    let vip = ip("10.96.0.10");
    let backends = [(b, 4u32, IF_B), (c, 5u32, IF_C)];
    // Sources: A (local, identity 2, its interface) and two remote clients at the uplink.
    let sources = [
        (a, 2u32, IF_A),
        (remote(3, false), 3, IF_UPLINK),
        (remote(7, false), 7, IF_UPLINK),
    ];
    let port8080 = L4Match::port(Protocol::Tcp, BACKEND_PORT);
    let egress_choices = [
        ms(Direction::Egress, Verdict::Allow, &[]),
        ms(Direction::Egress, Verdict::Deny, &[]),
        ms(
            Direction::Egress,
            Verdict::Deny,
            &[(Selector::ids([4]), port8080, Verdict::Allow)],
        ),
        ms(
            Direction::Egress,
            Verdict::Deny,
            &[(Selector::ids([5]), port8080, Verdict::Allow)],
        ),
    ];
    let ingress_choices = [
        ms(Direction::Ingress, Verdict::Allow, &[]),
        ms(Direction::Ingress, Verdict::Deny, &[]),
        ms(
            Direction::Ingress,
            Verdict::Deny,
            &[(Selector::ids([2]), port8080, Verdict::Allow)],
        ),
        ms(
            Direction::Ingress,
            Verdict::Deny,
            &[(Selector::ids([3, 7]), port8080, Verdict::Allow)],
        ),
        ms(
            Direction::Ingress,
            Verdict::Allow,
            &[(Selector::ids([7]), port8080, Verdict::Deny)],
        ),
    ];
    let mut rng = Rng::new(0x5e7c_1ce5);
    let states: Vec<SvcState> = (0..80)
        .map(|_| SvcState {
            a_egress: egress_choices[rng.below(egress_choices.len())].clone(),
            ingress: [
                ingress_choices[rng.below(ingress_choices.len())].clone(),
                ingress_choices[rng.below(ingress_choices.len())].clone(),
            ],
            backend: rng.below(2),
            frontend: rng.below(5) != 0,
        })
        .collect();
    // allowed[g][source][backend]: the flow source -> backend:8080 under state g.
    let allowed: Vec<Vec<[bool; 2]>> = states
        .iter()
        .map(|st| {
            sources
                .iter()
                .map(|(_, sid, _)| {
                    let mut v = [false; 2];
                    for (k, (_, bid, _)) in backends.iter().enumerate() {
                        let egress = *sid != 2
                            || st.a_egress.lookup(Some(*bid), 6, BACKEND_PORT).verdict()
                                == Verdict::Allow;
                        let ingress = st.ingress[k].lookup(Some(*sid), 6, BACKEND_PORT).verdict()
                            == Verdict::Allow;
                        v[k] = egress && ingress;
                    }
                    v
                })
                .collect()
        })
        .collect();
    let open_egress = open(Direction::Egress);
    let apply = |dp: &mut Datapath, st: &SvcState| {
        let (a_ips, b_ips, c_ips) = ([a], [b], [c]);
        let open_ingress = open(Direction::Ingress);
        dp.update_endpoints(&[
            (
                1,
                EndpointSpec {
                    ips: &a_ips,
                    identity: 2,
                    identities: &[],
                    ingress: &open_ingress,
                    egress: &st.a_egress,
                },
            ),
            (
                2,
                EndpointSpec {
                    ips: &b_ips,
                    identity: 4,
                    identities: &[],
                    ingress: &st.ingress[0],
                    egress: &open_egress,
                },
            ),
            (
                3,
                EndpointSpec {
                    ips: &c_ips,
                    identity: 5,
                    identities: &[],
                    ingress: &st.ingress[1],
                    egress: &open_egress,
                },
            ),
        ])
        .unwrap();
        let frontends: Vec<(IpAddr, u8, u16)> = if st.frontend {
            vec![(vip, 6, SVC_PORT)]
        } else {
            Vec::new()
        };
        dp.set_service_frontends(&frontends).unwrap();
    };
    apply(&mut dp, &states[0]);
    dp.set_interface(IF_A, 1, Some(&[a])).unwrap();
    dp.set_interface(IF_B, 2, Some(&[b])).unwrap();
    dp.set_interface(IF_C, 3, Some(&[c])).unwrap();
    let fd = |p: &dyn std::os::fd::AsFd| p.as_fd().try_clone_to_owned().unwrap();
    let xdp_fd = fd(dp.program().unwrap().fd().unwrap());
    let tc_fd = fd(dp.tc_program().unwrap().fd().unwrap());

    let done = Arc::new(AtomicBool::new(false));
    let generation = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let counts = Arc::new(Mutex::new([0usize; 4])); // new allowed/denied, established allowed/denied
    let allowed = Arc::new(allowed);
    let mapping: Arc<Vec<usize>> = Arc::new(states.iter().map(|s| s.backend).collect());
    let checker = {
        let (done, generation, violations, counts, allowed, mapping) = (
            done.clone(),
            generation.clone(),
            violations.clone(),
            counts.clone(),
            allowed.clone(),
            mapping.clone(),
        );
        std::thread::spawn(move || {
            // Connections opened so far: (source, backend, source port).
            let mut open_flows: Vec<(usize, usize, u16)> = Vec::new();
            let mut sport: u16 = 10_000;
            let mut i = 0usize;
            let last_state = allowed.len() - 1;
            let syn = |sport, dport| tcp_flags(sport, dport, TCP_SYN);
            let ack = |sport, dport| tcp_flags(sport, dport, TCP_ACK);
            while !done.load(Ordering::SeqCst) {
                let si = i % sources.len();
                let (src, _, ifindex) = sources[si];
                let g1 = generation.load(Ordering::SeqCst);
                // kube-proxy's choice at about this time (it may lag or lead: any backend is
                // judged on its own policy).
                let k = mapping[g1];
                let (backend, _, _) = backends[k];
                sport = if sport >= 60_000 { 10_000 } else { sport + 1 };
                // The new connection: at XDP towards the frontend, then translated at TC.
                let _ = sys_test_run(&xdp_fd, &frame(src, vip, syn(sport, SVC_PORT)));
                let new = sys_test_run_tc(
                    &tc_fd,
                    &frame(src, backend, syn(sport, BACKEND_PORT)),
                    ifindex,
                );
                // An established connection opened earlier, at TC.
                let old = open_flows
                    .get(i.wrapping_mul(7919) % open_flows.len().max(1))
                    .copied();
                let old_verdict = old.map(|(os, ok, op)| {
                    let (osrc, _, oif) = sources[os];
                    sys_test_run_tc(
                        &tc_fd,
                        &frame(osrc, backends[ok].0, ack(op, BACKEND_PORT)),
                        oif,
                    )
                });
                let g2 = generation.load(Ordering::SeqCst);
                let states = g1..=(g2 + 1).min(last_state);
                let mut c = counts.lock().unwrap();
                if new == PASS {
                    c[0] += 1;
                    if !states.clone().any(|g| allowed[g][si][k]) {
                        violations.lock().unwrap().push(format!(
                            "new flow source {si} -> backend {k} allowed during states {g1}..={g2}"
                        ));
                    }
                    if open_flows.len() < 512 {
                        open_flows.push((si, k, sport));
                    } else {
                        open_flows[i % 512] = (si, k, sport);
                    }
                } else {
                    c[1] += 1;
                }
                if let (Some((os, ok, _)), Some(v)) = (old, old_verdict) {
                    if v == PASS {
                        c[2] += 1;
                        if !states.clone().any(|g| allowed[g][os][ok]) {
                            violations.lock().unwrap().push(format!(
                                "established flow source {os} -> backend {ok} passed during \
                                 states {g1}..={g2}"
                            ));
                        }
                    } else {
                        c[3] += 1;
                    }
                }
                i += 1;
            }
        })
    };
    for (g, st) in states.iter().enumerate().skip(1) {
        apply(&mut dp, st);
        generation.store(g, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(3));
    }
    done.store(true, Ordering::SeqCst);
    checker.join().unwrap();
    // Settled: every source to every backend has the last state's verdict, new or established.
    let last = states.len() - 1;
    for (si, (src, _, ifindex)) in sources.iter().enumerate() {
        for (k, (backend, _, _)) in backends.iter().enumerate() {
            let want = if allowed[last][si][k] { PASS } else { DROP };
            let f = frame(
                *src,
                *backend,
                tcp_flags(65_000 + k as u16, BACKEND_PORT, TCP_SYN),
            );
            assert_eq!(
                XdpAction::from(dp.test_run_tc(&f, *ifindex, 1).unwrap().0),
                want,
                "final {si} -> {k}"
            );
        }
    }
    let c = *counts.lock().unwrap();
    let violations = violations.lock().unwrap();
    println!(
        "xdp_testrun: Service safety: {} states, new flows {} allowed / {} denied, established \
         packets {} passed / {} dropped, {} violations",
        states.len(),
        c[0],
        c[1],
        c[2],
        c[3],
        violations.len()
    );
    assert!(violations.is_empty(), "{}", violations.join("\n"));
    // Both outcomes happened for both kinds of packet, or the test checked nothing.
    assert!(c.iter().all(|n| *n > 0), "{c:?}");
}

/// The programs' counters: a TCP packet past the handshake that finds no entry is counted by
/// verdict (the kernel's LRU evictions show as these), a SYN or a packet of a tracked flow is
/// not.
#[test]
fn untracked_tcp_packets_are_counted_in_the_kernel() {
    if !privileged() {
        return;
    }
    let dp = isolated_a(small_config());
    let ct = UserCt::default();
    let counted = |dp: &Datapath| {
        let c = dp.counters().unwrap();
        (c.untracked_denied, c.untracked_allowed)
    };
    assert_eq!(counted(&dp), (0, 0));
    for (n, (a, r)) in a_and_remote().into_iter().enumerate() {
        let n = n as u64;
        // A's connection out and its reply: tracked, not counted.
        let out = |flags| frame(a, r, tcp_flags(3000, 443, flags));
        let back = |flags| frame(r, a, tcp_flags(443, 3000, flags));
        assert_eq!(kernel_and_user(&dp, &ct, &out(TCP_SYN)).0, PASS);
        assert_eq!(kernel_and_user(&dp, &ct, &back(TCP_SYN | TCP_ACK)).0, PASS);
        assert_eq!(counted(&dp), (n, n));
        // An ACK into isolated A of no flow: denied, counted; A's own stray ACK out: allowed
        // (A's egress is open), tracked again, counted.
        let stray = frame(r, a, tcp_flags(444, 3001, TCP_ACK));
        assert_eq!(kernel_and_user(&dp, &ct, &stray).0, DROP);
        assert_eq!(counted(&dp), (n + 1, n));
        let again = frame(a, r, tcp_flags(3002, 443, TCP_ACK));
        assert_eq!(kernel_and_user(&dp, &ct, &again).0, PASS);
        assert_eq!(counted(&dp), (n + 1, n + 1));
        // An RST of no flow is not counted.
        let rst = frame(r, a, tcp_flags(444, 3003, TCP_RST));
        assert_eq!(kernel_and_user(&dp, &ct, &rst).0, DROP);
        assert_eq!(counted(&dp), (n + 1, n + 1));
    }
}

/// Verdict events (`common::event`), through the test run: a new flow's first packet is one
/// event naming what decided each direction (the identity's key with its prefix, the
/// wildcard, the default); its later packets and its replies emit nothing; the denied packets
/// of one flow are one event at once, then counted in the flow's record and reported by its
/// next event after a second, all of them; the rate limit refuses events and counts them.
#[test]
fn verdict_events_name_what_decided() {
    if !privileged() {
        return;
    }
    use ordnet_datapath::{DecidedBy, Observed};
    let mut dp = Datapath::create(small_config()).unwrap();
    world_setup(&mut dp);
    upsert_isolated_a(&mut dp, &egress_443_and_80());
    let mut reader = dp.events().unwrap().expect("the ring buffer");
    assert!(dp.events().unwrap().is_none(), "handed out once");
    let mut drain = || {
        let mut raw = Vec::new();
        reader.drain(&mut raw);
        raw.iter().map(Observed::of).collect::<Vec<_>>()
    };
    let revision = dp.revision();
    let key443 = DecidedBy::Key {
        protocol: 6,
        port: 443,
        length: 24,
    };
    let wild80 = DecidedBy::Wildcard {
        protocol: 6,
        port: 80,
        length: 24,
    };
    for (a, r) in a_and_remote() {
        // A new flow out, its reply and its next packet: one event.
        for f in [
            frame(a, r, tcp_flags(3000, 443, TCP_SYN)),
            frame(r, a, tcp_flags(443, 3000, TCP_SYN | TCP_ACK)),
            frame(a, r, tcp_flags(3000, 443, TCP_ACK)),
        ] {
            assert_eq!(dp.test_run(&f).unwrap().action, PASS);
        }
        let got = drain();
        assert_eq!(got.len(), 1, "{got:#?}");
        let e = &got[0];
        assert!(
            e.allowed && e.reason == "allowed" && e.hook == "xdp",
            "{e:?}"
        );
        assert_eq!(
            (e.src, e.sport, e.dst, e.dport, e.protocol),
            (a, 3000, r, 443, 6)
        );
        assert_eq!(e.egress, (key443, true));
        assert_eq!(
            e.ingress,
            (DecidedBy::None, false),
            "the remote end is not judged"
        );
        assert_eq!((e.packets, e.revision), (1, revision));
        // A's flows the wildcard and the default deny.
        assert_eq!(
            dp.test_run(&frame(a, r, tcp_flags(3001, 80, TCP_SYN)))
                .unwrap()
                .action,
            DROP
        );
        assert_eq!(
            dp.test_run(&frame(a, r, tcp_flags(3002, 22, TCP_SYN)))
                .unwrap()
                .action,
            DROP
        );
        let got = drain();
        assert_eq!(got.len(), 2, "{got:#?}");
        assert_eq!(
            (got[0].reason, got[0].egress),
            ("egress-denied", (wild80, false))
        );
        assert_eq!(
            (got[1].reason, got[1].egress),
            ("egress-denied", (DecidedBy::Default, false))
        );
        // Ten unasked packets of one flow into isolated A: one event now.
        let unasked = frame(r, a, udp_ports(53, 4000));
        for _ in 0..10 {
            assert_eq!(dp.test_run(&unasked).unwrap().action, DROP);
        }
        let got = drain();
        assert_eq!(got.len(), 1, "{got:#?}");
        assert_eq!(got[0].reason, "ingress-denied");
        assert_eq!(got[0].ingress, (DecidedBy::Default, false));
        assert_eq!(got[0].egress, (DecidedBy::None, false));
        assert_eq!(got[0].packets, 1);
        // A second later the flow's next denied packet reports the nine before it and itself.
        std::thread::sleep(Duration::from_millis(1_050));
        assert_eq!(dp.test_run(&unasked).unwrap().action, DROP);
        let got = drain();
        assert_eq!(got.len(), 1, "{got:#?}");
        assert_eq!(got[0].packets, 10);
        assert!(
            got[0].first_ns < got[0].time_ns - 1_000_000_000,
            "{:?}",
            got[0]
        );
    }
    let c = dp.counters().unwrap();
    assert_eq!((c.events, c.events_suppressed, c.events_lost), (10, 0, 0));
    eprintln!("events: 10 emitted, with what decided each direction");
    // The rule counters, per rule: per family, one flow allowed by the TCP/443 rule (r0), one
    // flow (one packet) denied by the TCP/80 rule (r1) and one by the egress default, one flow
    // of eleven packets denied by the ingress default.
    rule_totals_are(
        &mut dp,
        [(0, [2, 0, 0]), (1, [0, 2, 2])],
        [
            (Direction::Egress, [0, 2, 2]),
            (Direction::Ingress, [0, 2, 22]),
        ],
    );
}

/// A's egress in [`verdict_events_name_what_decided`]: TCP/443 to identity 7 allowed (its own
/// key, rule `r0`), TCP/80 to anyone denied (the wildcard, `r1`), everything else denied by the
/// default.
fn egress_443_and_80() -> MapState {
    ms(
        Direction::Egress,
        Verdict::Deny,
        &[
            (
                Selector::ids([7]),
                L4Match::port(Protocol::Tcp, 443),
                Verdict::Allow,
            ),
            (
                Selector::Any,
                L4Match::port(Protocol::Tcp, 80),
                Verdict::Deny,
            ),
        ],
    )
}

/// The totals per rule after [`verdict_events_name_what_decided`]'s packets: (flows allowed,
/// flows denied, packets denied) of the egress rules `r{i}` (kind `Test`), and of the deny
/// defaults per direction; nothing else counted.
fn rule_totals_are(
    dp: &mut Datapath,
    rules: [(u32, [u64; 3]); 2],
    defaults: [(Direction, [u64; 3]); 2],
) {
    use ordnet_datapath::{RuleId, RuleTotals};
    let mut totals = RuleTotals::default();
    dp.collect_rule_counts(&mut totals).unwrap();
    let got: Vec<(RuleId, [u64; 3])> = totals
        .totals()
        .iter()
        .map(|(id, c)| {
            (
                id.clone(),
                [c.flows_allowed, c.flows_denied, c.packets_denied],
            )
        })
        .collect();
    let rule = |i: u32| RuleId::Rule {
        policy_kind: "Test".into(),
        namespace: None,
        name: format!("r{i}"),
        direction: Direction::Egress,
        index: i,
    };
    let default = |direction| RuleId::Default {
        direction,
        allow: false,
    };
    let mut want: Vec<(RuleId, [u64; 3])> = rules
        .into_iter()
        .map(|(i, c)| (rule(i), c))
        .chain(defaults.into_iter().map(|(d, c)| (default(d), c)))
        .collect();
    want.sort();
    assert_eq!(got, want);
}

/// The verdict events' rate limit refuses events beyond it and counts them (emitted +
/// suppressed = the flows); events off emit and count nothing.
#[test]
fn verdict_events_rate_limit_and_off() {
    if !privileged() {
        return;
    }
    // 1 event per second (each CPU's burst is 256), 600 new flows.
    let config = DatapathConfig {
        events_per_sec: 1,
        ..small_config()
    };
    let mut dp = isolated_a(config);
    let mut reader = dp.events().unwrap().unwrap();
    let (a, r) = a_and_remote()[0];
    for port in 0..600u16 {
        let f = frame(a, r, tcp_flags(10_000 + port, 443, TCP_SYN));
        assert_eq!(dp.test_run(&f).unwrap().action, PASS);
    }
    let mut raw = Vec::new();
    reader.drain(&mut raw);
    let c = dp.counters().unwrap();
    eprintln!(
        "rate limit 1/s: {} emitted, {} suppressed of 600 new flows",
        c.events, c.events_suppressed
    );
    assert_eq!(c.events, raw.len() as u64);
    assert_eq!(c.events + c.events_suppressed, 600);
    assert!(c.events_suppressed > 0 && c.events >= 256, "{c:?}");

    // Off: no event, nothing counted.
    let mut dp = isolated_a(DatapathConfig {
        events_per_sec: 0,
        ..small_config()
    });
    let mut reader = dp.events().unwrap().unwrap();
    assert_eq!(
        dp.test_run(&frame(a, r, tcp_flags(3000, 443, TCP_SYN)))
            .unwrap()
            .action,
        PASS
    );
    let mut raw = Vec::new();
    assert_eq!(reader.drain(&mut raw), 0);
    let c = dp.counters().unwrap();
    assert_eq!((c.events, c.events_suppressed), (0, 0));
    // The rule counters count with the events off.
    let mut totals = ordnet_datapath::RuleTotals::default();
    dp.collect_rule_counts(&mut totals).unwrap();
    let allowed: u64 = totals.totals().values().map(|c| c.flows_allowed).sum();
    assert_eq!(allowed, 1, "{:?}", totals.totals());

    // Counters off too: the verdicts are the same (the programs hand nothing to the
    // observer), nothing is counted.
    let mut dp = isolated_a(DatapathConfig {
        events_per_sec: 0,
        rule_counters: false,
        ..small_config()
    });
    let out = frame(a, r, tcp_flags(3000, 443, TCP_SYN));
    let unasked = frame(r, a, tcp_flags(443, 3001, TCP_SYN));
    assert_eq!(dp.test_run(&out).unwrap().action, PASS);
    assert_eq!(dp.test_run(&unasked).unwrap().action, DROP);
    let mut totals = ordnet_datapath::RuleTotals::default();
    dp.collect_rule_counts(&mut totals).unwrap();
    assert!(
        totals.totals().values().all(|c| c.is_zero()),
        "{:?}",
        totals.totals()
    );
    // And on, the same two packets: one flow allowed, one denied.
    let mut dp = isolated_a(DatapathConfig {
        events_per_sec: 0,
        ..small_config()
    });
    assert_eq!(dp.test_run(&out).unwrap().action, PASS);
    assert_eq!(dp.test_run(&unasked).unwrap().action, DROP);
    let mut totals = ordnet_datapath::RuleTotals::default();
    dp.collect_rule_counts(&mut totals).unwrap();
    let sum = |f: fn(&ordnet_datapath::common::layout::RuleCount) -> u64| -> u64 {
        totals.totals().values().map(f).sum()
    };
    assert_eq!(
        (
            sum(|c| c.flows_allowed),
            sum(|c| c.flows_denied),
            sum(|c| c.packets_denied)
        ),
        (1, 1, 1),
        "{:?}",
        totals.totals()
    );
}

/// Full-size and jumbo frames (1,500 and 9,000 bytes; the kernel's test run puts what does not
/// fit a page into fragments, as a veth does for a multi-buffer-aware program, so the IP packet
/// ends beyond `data_end`) are judged like the same flow's small packets: a new flow out of A and
/// its replies pass, unasked packets into isolated A are dropped, and an IP length beyond the
/// frame is still a truncated packet (dropped).
#[test]
fn full_size_and_jumbo_frames_are_judged_whole() {
    if !privileged() {
        return;
    }
    let dp = isolated_a(small_config());
    let ct = UserCt::default();
    for (a, r) in a_and_remote() {
        for size in [1500, 9000] {
            let big = |f: Vec<u8>| craft::with_payload(&f, size).unwrap();
            let port = 3000 + size as u16 / 100;
            let out = big(frame(a, r, tcp_flags(port, 443, TCP_SYN)));
            let back = big(frame(r, a, tcp_flags(443, port, TCP_SYN | TCP_ACK)));
            let data = big(frame(r, a, tcp_flags(443, port, TCP_ACK)));
            let unasked = frame(r, a, tcp_flags(443, port + 1, TCP_SYN));
            assert_eq!(kernel_and_user(&dp, &ct, &out).0, PASS, "{size} {a} out");
            assert_eq!(kernel_and_user(&dp, &ct, &back).0, PASS, "{size} {a} reply");
            assert_eq!(kernel_and_user(&dp, &ct, &data).0, PASS, "{size} {a} data");
            assert_eq!(
                kernel_and_user(&dp, &ct, &unasked).0,
                DROP,
                "{size} {a} small"
            );
            assert_eq!(
                kernel_and_user(&dp, &ct, &big(unasked.clone())).0,
                DROP,
                "{size} {a} unasked"
            );
            // The IP length says 100 bytes more than the frame has.
            let mut cut = out.clone();
            let (at, by) = if a.is_ipv4() { (16, 0) } else { (18, 40) };
            let len = u16::try_from(size - 14 - by + 100).unwrap();
            cut[at..at + 2].copy_from_slice(&len.to_be_bytes());
            if a.is_ipv4() {
                craft::fix_ipv4_checksum(&mut cut, 14);
            }
            let (verdict, reason) = kernel_and_user(&dp, &ct, &cut);
            assert_eq!(verdict, DROP, "{size} {a} cut: {reason:?}");
        }
    }
}

/// A driver that refuses native XDP does not leave the interface unenforced: the refusal names
/// the kernel's reason, and the program runs in generic mode instead (a VXLAN device has no
/// native XDP). A jumbo MTU on a veth's peer is no refusal: the program is multi-buffer aware.
#[test]
fn refused_native_xdp_falls_back_to_generic_with_the_kernels_reason() {
    if !privileged() {
        return;
    }
    let host = "ordnet-q0";
    let made = std::process::Command::new("ip")
        .args([
            "link", "add", host, "type", "vxlan", "id", "42", "dstport", "4789",
        ])
        .status()
        .is_ok_and(|s| s.success());
    let _guard = Veth(host);
    assert!(made, "ip link add {host} type vxlan");
    let mut dp = Datapath::create(small_config()).unwrap();
    let refused = dp
        .attach(host, aya::programs::XdpMode::Driver)
        .expect_err("native XDP on a VXLAN device");
    let text = refused.to_string();
    assert!(
        matches!(&refused, ordnet_datapath::DatapathError::XdpRefused { reason: Some(r), .. } if r.contains("native")),
        "the kernel's reason is named: {text}"
    );
    assert!(text.contains(host) && text.contains("native"), "{text}");
    match dp.attach_native_or_generic(host).unwrap() {
        ordnet_datapath::XdpAttached::Generic { native_refused } => {
            assert!(native_refused.contains("kernel: "), "{native_refused}");
        }
        other => panic!("expected generic mode, got {other:?}"),
    }
    let shown = std::process::Command::new("ip")
        .args(["-d", "link", "show", host])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("xdpgeneric"), "{shown}");
    dp.detach(host).unwrap();

    // Jumbo frames: native on a veth whose peer has MTU 9001.
    let (host, peer) = ("ordnet-j0", "ordnet-j1");
    let made = veth_pair(host, peer)
        && std::process::Command::new("ip")
            .args(["link", "set", peer, "mtu", "9001"])
            .status()
            .is_ok_and(|s| s.success());
    let _guard = Veth(host);
    assert!(made, "veth pair with MTU 9001");
    assert_eq!(
        dp.attach_native_or_generic(host).unwrap(),
        ordnet_datapath::XdpAttached::Native
    );
}

/// The XDP-to-TC handoff with real packets: two pods on routed veths (native XDP and the TC
/// hook on both host sides), A isolated for ingress, B's egress closed. A connects to B: every
/// answer and established packet crosses XDP (its sender's veth) and TC (its receiver's veth),
/// and the TC hook passes it on XDP's tag (the counter rises); B's connections to A fail
/// (nothing of them handed off). The same after a restart (adopted links, new programs, a new
/// key). In a network namespace of its own.
#[test]
fn handoff_with_real_packets() {
    if !privileged() {
        return;
    }
    pods::in_own_netns(|| {
        let pods = TwoPods::new("ho");
        let fs = Bpffs::named("-handoff");
        let config = DatapathConfig {
            pin_dir: Some(fs.0.join("ordnet")),
            ..small_config()
        };
        let mut dp = Datapath::create(config.clone()).unwrap();
        let deny_in = MapState::new(Direction::Ingress, Verdict::Deny);
        let deny_out = MapState::new(Direction::Egress, Verdict::Deny);
        let (open_in, open_out) = (open(Direction::Ingress), open(Direction::Egress));
        pods.enforce(
            &mut dp,
            [(2, &deny_in, &open_out), (4, &open_in, &deny_out)],
        )
        .unwrap();
        handoff_traffic(&dp, &pods);
        let key = dp.handoff_key();
        drop(dp);
        let (dp, _) = Datapath::adopt(config).unwrap();
        if key == 0 {
            // Refused by the kernel (`handoff_refused`): refused again after the restart.
            assert!(dp.handoff_refused().is_some() && dp.handoff_key() == 0);
        } else {
            assert_ne!(dp.handoff_key(), key);
        }
        handoff_traffic(&dp, &pods);
    });
}

/// [`handoff_with_real_packets`]' traffic: A connects to B three times, B fails to connect to
/// isolated A, and the handoff counter moves accordingly.
fn handoff_traffic(dp: &Datapath, pods: &TwoPods) {
    let before = dp.counters().unwrap().handed_off;
    let b = SocketAddr::from((TwoPods::ADDRS[1], 7000));
    let listener = pods.in_pod(1, move || TcpListener::bind(b).unwrap());
    let server = std::thread::spawn(move || {
        for _ in 0..3 {
            let (mut c, _) = listener.accept().unwrap();
            c.write_all(b"hello").unwrap();
        }
    });
    for _ in 0..3 {
        let got = pods.in_pod(0, move || {
            let mut c = TcpStream::connect_timeout(&b, Duration::from_secs(2)).expect("A -> B");
            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut s = String::new();
            c.read_to_string(&mut s).unwrap();
            s
        });
        assert_eq!(got, "hello", "A -> B");
    }
    server.join().unwrap();
    let handed = dp.counters().unwrap().handed_off;
    if let Some(why) = dp.handoff_refused() {
        // The kernel refused the metadata helper: the same traffic, every packet looked up.
        eprintln!("the kernel refuses XDP metadata ({why}): the traffic without the handoff");
        assert_eq!(dp.handoff_key(), 0);
        assert_eq!(handed, before, "nothing handed off without the handoff");
    } else {
        // About 7 tagged packets per connection (SYN-ACK, ACKs, the greeting, FINs) cross a
        // TC hook. With an 8-byte tag right before the frame only ~4 per connection survived:
        // the kernel's cached Ethernet header write clobbered it once the neighbour was known.
        assert!(
            handed >= before + 3 * 5,
            "TCP answers and established packets handed off: {before} -> {handed}"
        );
    }
    // B cannot connect to A (its egress denies it, A's ingress too).
    let a = SocketAddr::from((TwoPods::ADDRS[0], 7000));
    let _l = pods.in_pod(0, move || TcpListener::bind(a).unwrap());
    let reached = pods.in_pod(1, move || {
        TcpStream::connect_timeout(&a, Duration::from_millis(700)).is_ok()
    });
    assert!(!reached, "B reached isolated A");
    assert_eq!(dp.counters().unwrap().handed_off, handed);
}

/// How many instructions the kernel's verifier walked to load each program (`verified_insns`,
/// limit 1,000,000): printed, and failed above 950,000, so that code creeping towards the limit
/// is seen before a change crosses it (a few more instructions in the decision or event code
/// can multiply the verifier's states: docs/datapath.md, verifier note 11).
#[test]
fn verifier_budget() {
    if !privileged() {
        return;
    }
    let mut dp = Datapath::create(small_config()).unwrap();
    // The layer-3 TC program is loaded at its first attachment (any device will do here).
    assert!(veth_pair("ovb0", "ovb1"), "ip link add");
    let _veth = Veth("ovb0");
    dp.attach_tc_l3("ovb1").unwrap();
    let counts = dp.verified_instructions();
    eprintln!("verified instructions: {counts:?}");
    assert_eq!(
        counts.len(),
        5,
        "every program (the observers too): {counts:?}"
    );
    for (name, n) in counts {
        assert!(
            n < 950_000,
            "{name}: {n} verified instructions, within 5 % of the verifier's limit"
        );
    }
}
