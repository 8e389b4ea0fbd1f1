//! kube-proxy, as the lab needs it: the Services of the manifests become DNAT rules in the node
//! namespace, written like kube-proxy's nftables mode (one table per family named
//! `kube-proxy`, a `service-ips` verdict map keyed on address . protocol . port, one chain per
//! Service port and one per endpoint, `nat` hooks at prerouting and output, masquerading at
//! postrouting for what is marked `0x4000`: hairpin, and NodePort/external traffic with
//! `externalTrafficPolicy: Cluster`), loaded with `nft -f -` (Debian's `nftables`).
//!
//! One difference, on purpose: kube-proxy picks a backend at random (`numgen random`); the lab
//! must observe *every* backend's verdict, so a Service chain first steers by the client's
//! source port: backend `i` for source ports `STEER_BASE + i * STEER_STRIDE ..` (a range per
//! backend, so that every attempt can use a fresh port), and only other source ports fall
//! through to the random choice.

use std::fmt::Write as _;
use std::net::IpAddr;

use ordnet_mapstate::Protocol;

/// The first source port of backend 0's steering range.
pub const STEER_BASE: u16 = 20_000;
/// Source ports per backend.
pub const STEER_STRIDE: u16 = 64;
/// The most backends a Service port may have in the lab (ranges stay below the kernel's
/// ephemeral ports, 32768 and up).
pub const MAX_BACKENDS: usize = ((32_768 - STEER_BASE as usize) / STEER_STRIDE as usize) - 1;

/// The source port that steers attempt `attempt` of a probe to backend `i`.
pub fn steer_port(backend: usize, attempt: u16) -> u16 {
    STEER_BASE + backend as u16 * STEER_STRIDE + attempt % STEER_STRIDE
}

/// One Service port of one family as kube-proxy programs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// `namespace/name`.
    pub service: String,
    pub protocol: Protocol,
    /// ClusterIP and external IPs of the family, on `port`.
    pub addresses: Vec<IpAddr>,
    pub port: u16,
    /// The NodePort (on every node address of the family).
    pub node_port: Option<u16>,
    /// `externalTrafficPolicy: Local`: NodePort/external traffic keeps the client address.
    pub local: bool,
    /// `(address, port)` of every backend, in the order the steering ranges follow.
    pub backends: Vec<(IpAddr, u16)>,
}

fn proto(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// `addr:port` for `dnat to` (an IPv6 address in brackets: without them nft reads
/// `fd00::2:8080` as an address).
fn endpoint(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// The nft script for one family (`v6`): the `kube-proxy` table, replaced atomically when it
/// exists, with the Service ports of that family. `node` are the node's addresses of the family
/// (NodePort destinations).
pub fn ruleset(v6: bool, ports: &[ServicePort], node: &[IpAddr]) -> String {
    let (fam, addr_t, ipx) = if v6 {
        ("ip6", "ipv6_addr", "ip6")
    } else {
        ("ip", "ipv4_addr", "ip")
    };
    let mut s = String::new();
    // `table X` then `delete table X`: a reload replaces the table in one transaction.
    let _ = writeln!(s, "table {fam} kube-proxy\ndelete table {fam} kube-proxy");
    let _ = writeln!(s, "table {fam} kube-proxy {{");
    let _ = writeln!(
        s,
        "\tcomment \"kube-proxy nftables mode, emulated by ordnet lab\"\n\
         \tset nodeport-ips {{ type {addr_t}; }}\n\
         \tmap service-ips {{ type {addr_t} . inet_proto . inet_service : verdict; }}\n\
         \tmap service-nodeports {{ type inet_proto . inet_service : verdict; }}\n\
         \tchain nat-prerouting {{ type nat hook prerouting priority -100; jump services; }}\n\
         \tchain nat-output {{ type nat hook output priority -100; jump services; }}\n\
         \tchain nat-postrouting {{ type nat hook postrouting priority 100; jump masquerading; }}\n\
         \tchain mark-for-masquerade {{ meta mark set meta mark or 0x4000; }}\n\
         \tchain masquerading {{\n\
         \t\tmeta mark & 0x4000 == 0 return\n\
         \t\tmeta mark set meta mark xor 0x4000\n\
         \t\tmasquerade fully-random\n\
         \t}}\n\
         \tchain services {{\n\
         \t\t{ipx} daddr . meta l4proto . th dport vmap @service-ips\n\
         \t\t{ipx} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports\n\
         \t}}"
    );
    let mut elements = String::new();
    for (n, sp) in ports.iter().enumerate() {
        if sp.backends.is_empty() || sp.addresses.first().is_none_or(|a| a.is_ipv6() != v6) {
            continue;
        }
        let p = proto(sp.protocol);
        let svc = format!("service-{n}");
        let mut steer = Vec::new();
        let mut random = Vec::new();
        for (i, (addr, port)) in sp.backends.iter().enumerate() {
            let ep = format!("endpoint-{n}-{i}");
            let _ = writeln!(
                s,
                "\tchain {ep} {{\n\
                 \t\t{ipx} saddr {addr} jump mark-for-masquerade\n\
                 \t\tmeta l4proto {p} dnat to {} comment \"{} {p}/{}\"\n\
                 \t}}",
                endpoint(*addr, *port),
                sp.service,
                sp.port
            );
            let first = steer_port(i, 0);
            steer.push(format!("{first}-{} : goto {ep}", first + STEER_STRIDE - 1));
            random.push(format!("{i} : goto {ep}"));
        }
        let _ = writeln!(
            s,
            "\tchain {svc} {{\n\
             \t\tth sport vmap {{ {} }}\n\
             \t\tnumgen random mod {} vmap {{ {} }}\n\
             \t}}",
            steer.join(", "),
            random.len(),
            random.join(", ")
        );
        // NodePorts and external IPs: masqueraded (Cluster) or with the client kept (Local;
        // the lab is one node: every backend is local).
        let external = format!("external-{n}");
        if sp.local {
            let _ = writeln!(s, "\tchain {external} {{ goto {svc}; }}");
        } else {
            let _ = writeln!(
                s,
                "\tchain {external} {{\n\t\tjump mark-for-masquerade\n\t\tgoto {svc}\n\t}}"
            );
        }
        for (k, addr) in sp.addresses.iter().enumerate() {
            // The first address is the ClusterIP; the others are external IPs.
            let target = if k == 0 { &svc } else { &external };
            let _ = writeln!(
                elements,
                "add element {fam} kube-proxy service-ips {{ {addr} . {p} . {} : goto {target} }}",
                sp.port
            );
        }
        if let Some(np) = sp.node_port {
            let _ = writeln!(
                elements,
                "add element {fam} kube-proxy service-nodeports {{ {p} . {np} : goto {external} }}"
            );
        }
    }
    s.push_str("}\n");
    for addr in node {
        let _ = writeln!(
            elements,
            "add element {fam} kube-proxy nodeport-ips {{ {addr} }}"
        );
    }
    s.push_str(&elements);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_service_with_two_backends_and_a_node_port() {
        let sp = ServicePort {
            service: "y/s".into(),
            protocol: Protocol::Tcp,
            addresses: vec!["10.96.0.10".parse().unwrap()],
            port: 80,
            node_port: Some(30080),
            local: false,
            backends: vec![
                ("10.244.2.1".parse().unwrap(), 8080),
                ("10.244.2.2".parse().unwrap(), 8081),
            ],
        };
        let s = ruleset(false, &[sp], &["169.254.3.1".parse().unwrap()]);
        for want in [
            "table ip kube-proxy {",
            "\t\tth sport vmap { 20000-20063 : goto endpoint-0-0, 20064-20127 : goto endpoint-0-1 }",
            "\t\tnumgen random mod 2 vmap { 0 : goto endpoint-0-0, 1 : goto endpoint-0-1 }",
            "\t\tmeta l4proto tcp dnat to 10.244.2.2:8081",
            "\t\tip saddr 10.244.2.1 jump mark-for-masquerade",
            "add element ip kube-proxy service-ips { 10.96.0.10 . tcp . 80 : goto service-0 }",
            "add element ip kube-proxy service-nodeports { tcp . 30080 : goto external-0 }",
            "add element ip kube-proxy nodeport-ips { 169.254.3.1 }",
        ] {
            assert!(s.contains(want), "{want:?} missing from\n{s}");
        }
        assert_eq!(steer_port(1, 3), 20067);
        let v6 = ruleset(
            true,
            &[ServicePort {
                service: "y/s".into(),
                protocol: Protocol::Udp,
                addresses: vec!["fd96::10".parse().unwrap()],
                port: 53,
                node_port: None,
                local: true,
                backends: vec![("fd00::2".parse().unwrap(), 5353)],
            }],
            &[],
        );
        assert!(
            v6.contains("meta l4proto udp dnat to [fd00::2]:5353"),
            "{v6}"
        );
        assert!(v6.contains("chain external-0 { goto service-0; }"), "{v6}");
    }
}
