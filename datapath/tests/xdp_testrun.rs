//! Loads the real XDP program with aya and checks its verdicts with `BPF_PROG_TEST_RUN` on
//! crafted frames. Every kernel verdict is compared with (1) the expected verdict written in
//! the case table and (2) the verdict userspace computes with the shared parser against the
//! same live map, so a drift between kernel and userspace fails the test too.
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN). Without root it skips with a message, except when the
//! `CI` environment variable is set: then it fails, so CI can never pass without running it.
//! Run with `--nocapture` to see how many packets were checked.

use ordnet_datapath::{
    Datapath, XdpAction,
    common::{
        ACTION_ALLOW, ACTION_DENY, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6,
        IPPROTO_AH, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_ICMP,
        IPPROTO_ICMPV6, IPPROTO_ROUTING, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, PortKey, craft,
        craft::L4,
    },
};

const PASS: XdpAction = XdpAction::Pass;
const DROP: XdpAction = XdpAction::Drop;

/// True when the test may run; false (after saying so) when it must skip. Panics when it would
/// skip under CI.
fn privileged() -> bool {
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

fn load() -> Datapath {
    Datapath::load().unwrap_or_else(|e| panic!("loading the XDP program failed: {e}"))
}

struct Case {
    name: &'static str,
    frame: Vec<u8>,
    entries: Vec<(PortKey, u8)>,
    expect: XdpAction,
}

fn case(name: &'static str, frame: Vec<u8>, entries: &[(PortKey, u8)], expect: XdpAction) -> Case {
    Case {
        name,
        frame,
        entries: entries.to_vec(),
        expect,
    }
}

fn deny(v: u8, proto: u8, port: u16) -> (PortKey, u8) {
    (PortKey::new(v, proto, port), ACTION_DENY)
}

fn allow(v: u8, proto: u8, port: u16) -> (PortKey, u8) {
    (PortKey::new(v, proto, port), ACTION_ALLOW)
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

    // Map entry present/absent flips the verdict, for each IP version and L4 protocol.
    for (v, ipv6) in [(4u8, false), (6u8, true)] {
        let frame = |l4: L4| {
            if ipv6 {
                craft::ipv6_frame(l4)
            } else {
                craft::ipv4_frame(l4)
            }
        };
        for (l4, proto, other_proto) in [
            (tcp(80), IPPROTO_TCP, IPPROTO_UDP),
            (udp(53), IPPROTO_UDP, IPPROTO_TCP),
            (sctp(3868), IPPROTO_SCTP, IPPROTO_TCP),
        ] {
            let port = match l4 {
                L4::Tcp { dport, .. } | L4::Udp { dport, .. } | L4::Sctp { dport, .. } => dport,
                _ => unreachable!(),
            };
            let other_v = if v == 4 { 6 } else { 4 };
            c.push(case("no entry", frame(l4), &[], PASS));
            c.push(case("deny entry", frame(l4), &[deny(v, proto, port)], DROP));
            c.push(case(
                "allow entry",
                frame(l4),
                &[allow(v, proto, port)],
                PASS,
            ));
            c.push(case(
                "deny other port",
                frame(l4),
                &[deny(v, proto, port + 1)],
                PASS,
            ));
            c.push(case(
                "deny same port, other protocol",
                frame(l4),
                &[deny(v, other_proto, port)],
                PASS,
            ));
            c.push(case(
                "deny same port, other IP version",
                frame(l4),
                &[deny(other_v, proto, port)],
                PASS,
            ));
            c.push(case(
                "unknown map value fails closed",
                frame(l4),
                &[(PortKey::new(v, proto, port), 9)],
                DROP,
            ));
        }
    }
    c.push(case(
        "ICMP echo, no entry",
        craft::ipv4_frame(L4::Echo),
        &[deny(4, IPPROTO_TCP, 0)],
        PASS,
    ));
    c.push(case(
        "ICMP echo, deny (4, ICMP, 0)",
        craft::ipv4_frame(L4::Echo),
        &[deny(4, IPPROTO_ICMP, 0)],
        DROP,
    ));
    c.push(case(
        "ICMPv6 echo, deny (6, ICMPv6, 0)",
        craft::ipv6_frame(L4::Echo),
        &[deny(6, IPPROTO_ICMPV6, 0)],
        DROP,
    ));
    c.push(case(
        "high port 65535",
        craft::ipv4_frame(tcp(65535)),
        &[deny(4, IPPROTO_TCP, 65535)],
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
        &[deny(4, IPPROTO_UDP, 4789)],
        DROP,
    ));
    c.push(case(
        "Ethernet padding after the IP packet",
        with(craft::ipv4_frame(udp(53)), |f| f.resize(60, 0xff)),
        &[deny(4, IPPROTO_UDP, 53)],
        DROP,
    ));

    // VLAN.
    let v4 = craft::ipv4_frame(tcp(80));
    let v6 = craft::ipv6_frame(udp(53));
    c.push(case(
        "802.1Q IPv4 TCP, deny",
        craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, &v4[14..]),
        &[deny(4, IPPROTO_TCP, 80)],
        DROP,
    ));
    c.push(case(
        "802.1Q IPv4 TCP, no entry",
        craft::ethernet(&[(ETH_P_8021Q, 100)], ETH_P_IP, &v4[14..]),
        &[],
        PASS,
    ));
    c.push(case(
        "802.1Q IPv6 UDP, deny",
        craft::ethernet(&[(ETH_P_8021Q, 7)], ETH_P_IPV6, &v6[14..]),
        &[deny(6, IPPROTO_UDP, 53)],
        DROP,
    ));
    c.push(case(
        "QinQ (802.1ad + 802.1Q) IPv4 TCP, deny",
        craft::ethernet(
            &[(ETH_P_8021AD, 10), (ETH_P_8021Q, 20)],
            ETH_P_IP,
            &v4[14..],
        ),
        &[deny(4, IPPROTO_TCP, 80)],
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
        &[deny(4, 0, 0)],
        PASS,
    ));

    // Not IP.
    c.push(case(
        "ARP",
        craft::ethernet(&[], ETH_P_ARP, &[0; 28]),
        &[deny(4, IPPROTO_TCP, 80)],
        PASS,
    ));
    c.push(case(
        "LLDP, bare 14-byte header",
        craft::ethernet(&[], 0x88cc, &[]),
        &[],
        PASS,
    ));

    // Malformed IP: fail closed, whatever the map says.
    c.push(case(
        "Ethernet header only, EtherType IPv4",
        craft::ethernet(&[], ETH_P_IP, &[]),
        &[],
        DROP,
    ));
    c.push(case(
        "truncated IPv4 header (19 bytes)",
        v4[..14 + 19].to_vec(),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv4 IHL 4",
        with(v4.clone(), |f| f[14] = 0x44),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv4 IHL 0",
        with(v4.clone(), |f| f[14] = 0x40),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv4 IHL 15 beyond total length",
        with(v4.clone(), |f| f[14] = 0x4f),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv4 total length beyond the frame",
        with(v4.clone(), |f| {
            f[16..18].copy_from_slice(&200u16.to_be_bytes())
        }),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv4 version nibble 6",
        with(v4.clone(), |f| f[14] = 0x65),
        &[],
        DROP,
    ));
    c.push(case(
        "truncated TCP header (10 of 20 bytes)",
        ipv4_raw(IPPROTO_TCP, false, 0, &craft::tcp(1, 80)[..10]),
        &[],
        DROP,
    ));
    c.push(case(
        "TCP header cut by IPv4 total length, frame padded",
        with(v4.clone(), |f| {
            f[16..18].copy_from_slice(&30u16.to_be_bytes());
            craft::fix_ipv4_checksum(f, 14);
        }),
        &[],
        DROP,
    ));
    c.push(case(
        "TCP data offset 4",
        with(v4.clone(), |f| f[14 + 20 + 12] = 4 << 4),
        &[],
        DROP,
    ));
    c.push(case(
        "TCP data offset beyond the segment",
        with(v4.clone(), |f| f[14 + 20 + 12] = 15 << 4),
        &[],
        DROP,
    ));
    c.push(case(
        "truncated UDP header",
        ipv6_raw(IPPROTO_UDP, &craft::udp(1, 53, &[])[..6]),
        &[],
        DROP,
    ));
    c.push(case(
        "UDP length 4",
        with(craft::ipv4_frame(udp(53)), |f| {
            f[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&4u16.to_be_bytes());
        }),
        &[],
        DROP,
    ));
    c.push(case(
        "truncated SCTP common header",
        ipv4_raw(IPPROTO_SCTP, false, 0, &craft::sctp(1, 3868)[..11]),
        &[],
        DROP,
    ));
    c.push(case(
        "truncated IPv6 header (39 bytes)",
        craft::ipv6_frame(tcp(80))[..14 + 39].to_vec(),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv6 payload length beyond the frame",
        with(craft::ipv6_frame(tcp(80)), |f| {
            f[18..20].copy_from_slice(&1000u16.to_be_bytes());
        }),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv6 with truncated extension header",
        ipv6_raw(IPPROTO_HOPOPTS, &craft::ipv6_ext(IPPROTO_TCP, 16)[..12]),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv6 extension header longer than the payload",
        ipv6_raw(IPPROTO_ROUTING, &craft::ipv6_ext(IPPROTO_TCP, 24)[..16]),
        &[],
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
        &[deny(6, IPPROTO_TCP, 443)],
        DROP,
    ));
    c.push(case(
        "IPv6 8 extension headers, deny",
        ipv6_ext_chain(8, 8, 80),
        &[deny(6, IPPROTO_TCP, 80)],
        DROP,
    ));
    c.push(case(
        "IPv6 8 extension headers, no entry",
        ipv6_ext_chain(8, 8, 80),
        &[],
        PASS,
    ));
    c.push(case(
        "IPv6 9 extension headers: too many",
        ipv6_ext_chain(9, 8, 80),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv6 headers end at byte 2042 (inside the 2048 bound), no entry",
        craft::ipv6_frame_with_ext(
            IPPROTO_DSTOPTS,
            &[
                craft::ipv6_ext(IPPROTO_DSTOPTS, 1024),
                craft::ipv6_ext(IPPROTO_TCP, 936),
            ],
            tcp(80),
        ),
        &[],
        PASS,
    ));
    c.push(case(
        "IPv6 headers end at byte 2042 (inside the 2048 bound), deny",
        craft::ipv6_frame_with_ext(
            IPPROTO_DSTOPTS,
            &[
                craft::ipv6_ext(IPPROTO_DSTOPTS, 1024),
                craft::ipv6_ext(IPPROTO_TCP, 936),
            ],
            tcp(80),
        ),
        &[deny(6, IPPROTO_TCP, 80)],
        DROP,
    ));
    c.push(case(
        "IPv6 headers past the 2048-byte bound",
        ipv6_ext_chain(2, 1024, 80),
        &[],
        DROP,
    ));

    // Fragments.
    let all_tcp_denied = [
        deny(4, IPPROTO_TCP, 80),
        deny(4, IPPROTO_TCP, 0),
        deny(6, IPPROTO_TCP, 80),
        deny(6, IPPROTO_TCP, 0),
    ];
    c.push(case(
        "IPv4 first fragment, deny",
        with(v4.clone(), |f| craft::set_ipv4_fragment(f, 14, true, 0)),
        &all_tcp_denied,
        DROP,
    ));
    c.push(case(
        "IPv4 first fragment, no entry",
        with(v4.clone(), |f| craft::set_ipv4_fragment(f, 14, true, 0)),
        &[],
        PASS,
    ));
    c.push(case(
        "IPv4 non-first fragment: passes without lookup",
        ipv4_raw(IPPROTO_TCP, true, 185, &[0; 64]),
        &all_tcp_denied,
        PASS,
    ));
    c.push(case(
        "IPv4 last fragment: passes without lookup",
        ipv4_raw(IPPROTO_TCP, false, 3, &[0; 3]),
        &all_tcp_denied,
        PASS,
    ));
    c.push(case(
        "IPv4 tiny first fragment (8 bytes of TCP)",
        ipv4_raw(IPPROTO_TCP, true, 0, &craft::tcp(1, 80)[..8]),
        &[],
        DROP,
    ));
    c.push(case(
        "IPv6 first fragment, deny",
        craft::ipv6_frame_with_ext(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_TCP, 0, true, 1)],
            tcp(80),
        ),
        &all_tcp_denied,
        DROP,
    ));
    c.push(case(
        "IPv6 non-first fragment: passes without lookup",
        ipv6_raw(
            IPPROTO_FRAGMENT,
            &[craft::ipv6_fragment(IPPROTO_TCP, 1, true, 1), vec![0; 32]].concat(),
        ),
        &all_tcp_denied,
        PASS,
    ));
    c
}

#[test]
fn verdicts_of_crafted_frames() {
    if !privileged() {
        return;
    }
    let mut dp = load();
    let cases = cases();
    let mut checked = 0usize;
    let mut failures = Vec::new();
    for Case {
        name,
        frame,
        entries,
        expect,
    } in &cases
    {
        dp.clear_port_verdicts().expect("clear map");
        for (key, action) in entries {
            dp.set_port_verdict(*key, *action).expect("map insert");
        }
        let kernel = dp
            .test_run(frame)
            .unwrap_or_else(|e| panic!("{name}: test run failed: {e}"))
            .action;
        let userspace = XdpAction::from(dp.userspace_verdict(frame).expect("map read"));
        checked += 1;
        if kernel != *expect || userspace != *expect {
            failures.push(format!(
                "{name}: expected {expect:?}, kernel {kernel:?}, userspace {userspace:?} \
                 ({} bytes: {frame:02x?})",
                frame.len()
            ));
        }
    }

    // The kernel refuses XDP test input shorter than an Ethernet header, so a runt can only be
    // checked on the host (ParseError::TruncatedEthernet -> DROP, see the common crate tests).
    dp.clear_port_verdicts().expect("clear map");
    let runt = &craft::ipv4_frame(tcp(80))[..13];
    match dp.test_run(runt) {
        Err(e) => eprintln!("13-byte frame: kernel refused the test input as expected ({e})"),
        Ok(run) => {
            checked += 1;
            if run.action != DROP {
                failures.push(format!(
                    "13-byte frame: expected Drop, got {:?}",
                    run.action
                ));
            }
        }
    }
    assert_eq!(
        dp.userspace_verdict(runt).expect("map read"),
        ordnet_datapath::common::Verdict::Drop
    );

    println!(
        "xdp_testrun: {checked} crafted packets checked against the kernel program ({} cases)",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} wrong verdicts:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Small deterministic PRNG (xorshift64*), so failures are reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Random mutations of valid frames: the kernel program and the userspace computation (same
/// parser, same map) must agree on every one of them, and the mutations must produce both
/// verdicts plenty of times.
#[test]
fn kernel_and_userspace_agree_on_mutated_frames() {
    if !privileged() {
        return;
    }
    let mut dp = load();
    let ports: [u16; 6] = [22, 53, 80, 443, 3868, 8080];
    for (i, &port) in ports.iter().enumerate() {
        for v in [4, 6] {
            for proto in [IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP] {
                let action = if (i + usize::from(v) + usize::from(proto)) % 2 == 0 {
                    ACTION_DENY
                } else {
                    ACTION_ALLOW
                };
                dp.set_port_verdict(PortKey::new(v, proto, port), action)
                    .expect("map insert");
            }
        }
    }
    dp.set_port_verdict(PortKey::new(4, IPPROTO_ICMP, 0), ACTION_DENY)
        .expect("map insert");

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

    const SEED: u64 = 0x0bd_e7a7_a9a7;
    const N: usize = 20_000;
    let mut rng = Rng(SEED);
    let (mut pass, mut drop, mut disagreements) = (0usize, 0usize, Vec::new());
    for i in 0..N {
        let mut f = bases[rng.below(bases.len())].clone();
        match rng.below(4) {
            // Overwrite a few header bytes (mostly L2..L4).
            0 | 1 => {
                for _ in 0..=rng.below(3) {
                    let at = rng.below(f.len().min(96));
                    f[at] = rng.next() as u8;
                }
            }
            // Truncate (the kernel needs at least 14 bytes).
            2 => {
                let len = 14 + rng.below(f.len() - 13);
                f.truncate(len);
            }
            // Append trailing bytes and touch one byte anywhere.
            _ => {
                f.extend((0..rng.below(64)).map(|_| rng.next() as u8));
                let at = rng.below(f.len());
                f[at] ^= 1 << rng.below(8);
            }
        }
        let kernel = dp.test_run(&f).expect("test run").action;
        let userspace = XdpAction::from(dp.userspace_verdict(&f).expect("map read"));
        match kernel {
            XdpAction::Pass => pass += 1,
            XdpAction::Drop => drop += 1,
            _ => {}
        }
        if kernel != userspace && disagreements.len() < 10 {
            disagreements.push(format!(
                "#{i}: kernel {kernel:?}, userspace {userspace:?}, parse {:?}, frame {f:02x?}",
                ordnet_datapath::common::parse(&f[..])
            ));
        }
    }
    println!(
        "xdp_testrun: {N} mutated packets checked against the userspace verdict (seed {SEED:#x}; \
         kernel: {pass} PASS, {drop} DROP; {} disagreements shown)",
        disagreements.len()
    );
    assert!(
        disagreements.is_empty(),
        "kernel and userspace disagree:\n{}",
        disagreements.join("\n")
    );
    assert_eq!(
        pass + drop,
        N,
        "the program returned something other than PASS/DROP"
    );
    assert!(
        pass > N / 10 && drop > N / 10,
        "mutations too one-sided: {pass} PASS, {drop} DROP"
    );
}

/// Kernel-measured cost per packet (BPF_PROG_TEST_RUN with repeat). Printed, not asserted:
/// timings depend on the machine; the test only checks the verdicts stay right under repeat.
#[test]
fn ns_per_packet() {
    if !privileged() {
        return;
    }
    let started = std::time::Instant::now();
    let mut dp = load();
    println!(
        "xdp_testrun: object load + verification took {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    dp.set_port_verdict(PortKey::new(4, IPPROTO_TCP, 80), ACTION_DENY)
        .expect("map insert");
    const REPEAT: u32 = 1_000_000;
    let runs = [
        ("IPv4 TCP, map hit, DROP", craft::ipv4_frame(tcp(80)), DROP),
        ("IPv4 TCP, map miss, PASS", craft::ipv4_frame(tcp(81)), PASS),
        (
            "IPv6 HBH+frag+UDP, map miss, PASS",
            craft::ipv6_frame_with_ext(
                IPPROTO_HOPOPTS,
                &[
                    craft::ipv6_ext(IPPROTO_FRAGMENT, 8),
                    craft::ipv6_fragment(IPPROTO_UDP, 0, true, 1),
                ],
                udp(53),
            ),
            PASS,
        ),
        (
            "ARP, no lookup, PASS",
            craft::ethernet(&[], ETH_P_ARP, &[0; 28]),
            PASS,
        ),
    ];
    for (name, frame, expect) in runs {
        let run = dp.test_run_repeat(&frame, REPEAT).expect("test run");
        assert_eq!(run.action, expect, "{name}");
        println!(
            "xdp_testrun: {name}: {} ns/packet (kernel average over {REPEAT} runs)",
            run.avg_duration.as_nanos()
        );
    }
}
