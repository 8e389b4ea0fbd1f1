//! Where a local pod's traffic enters and leaves the node: the node's network as the kernel
//! holds it (links, routes of every table a rule reaches, neighbours, bridge forwarding
//! entries), read with one netlink dump each, and the host-side interface of a pod address
//! found in it (`--datapath bpf`; docs/agent.md, "Finding a pod's interface").
//!
//! The order, for each address of a local endpoint: the interface the chained CNI plugin named
//! for the pod ([`NetView::cni_interface`]), if it did; then
//! 1. the **main table**'s longest-prefix route (lowest metric on ties), if it is a route to a
//!    pod interface: not only the default route, not `lo`, not the uplink (routed CNIs: Calico,
//!    Cilium in routing mode, the `ptp` plugin);
//! 2. otherwise the longest-prefix route of any **other table an `ip rule` looks up**, on the
//!    same terms (policy-routed CNIs that keep per-pod routes in their own tables);
//! 3. a route to a **bridge** is not the pod's interface (every pod on the bridge shares it):
//!    the pod's port is where the bridge's forwarding database puts the pod's MAC address, known
//!    from the bridge's neighbour entry for the address. With no such entry the caller asks the
//!    kernel to resolve it (a *managed* neighbour entry, [`add_managed_neighbour`]) and looks
//!    again when the answer arrives (neighbour events wake the upkeep).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::link::{
    InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage, LinkXdp, XdpAttached,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
use netlink_packet_route::rule::{RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// The main routing table's id.
const MAIN: u32 = 254;
/// The local table (the node's own addresses): never a pod's.
const LOCAL: u32 = 255;
/// `NDA_FLAGS_EXT` and its `NTF_EXT_MANAGED` bit (linux/neighbour.h): the kernel resolves and
/// keeps resolving a managed entry by itself.
const NDA_FLAGS_EXT: u16 = 15;
const NTF_EXT_MANAGED: u32 = 1;

/// One interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub name: String,
    /// A bridge device.
    pub bridge: bool,
    /// A tunnel (VXLAN, Geneve, GRETAP; or a layer-3 one, [`Link::l3`]): it delivers other
    /// nodes' pods' packets, and sends this node's to them.
    pub tunnel: bool,
    /// A layer-3 tunnel (IPIP, SIT, GRE, ip6gre, ip6tnl, WireGuard): its packets have no
    /// Ethernet header.
    pub l3: bool,
    /// The bridge (or other master) this interface is a port of.
    pub master: Option<u32>,
    /// An XDP program runs on it in generic (skb) mode.
    pub xdp_generic: bool,
}

/// One unicast route with an output interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    pub net: IpNet,
    pub table: u32,
    pub metric: u32,
    pub oif: u32,
}

/// A neighbour entry with a link-layer address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Neighbour {
    pub ip: IpAddr,
    pub ifindex: u32,
    pub mac: Vec<u8>,
}

/// A learned (not local) bridge forwarding entry: `mac` is behind `port` of `bridge`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Forwarding {
    pub mac: Vec<u8>,
    pub port: u32,
    pub bridge: u32,
}

/// The node's network, as one set of dumps.
#[derive(Debug, Default, Clone)]
pub(crate) struct NetView {
    pub links: BTreeMap<u32, Link>,
    pub routes: Vec<Route>,
    /// Tables some rule looks up (besides main).
    pub rule_tables: BTreeSet<u32>,
    pub neighbours: Vec<Neighbour>,
    pub forwarding: Vec<Forwarding>,
}

/// Why no pod interface was found for an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unfound {
    /// Nothing usable: the reason, for the report.
    No(String),
    /// The address is behind bridge `bridge` (ifindex), whose neighbour entry for it has no
    /// link-layer address yet: resolve it and look again.
    Unresolved { bridge: u32, why: String },
}

impl NetView {
    /// Reads links, routes, rules, neighbours and bridge forwarding entries.
    pub fn read() -> io::Result<NetView> {
        let mut nl = Netlink::open()?;
        let mut view = NetView::default();
        for m in nl.dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))? {
            if let RouteNetlinkMessage::NewLink(l) = m {
                view.add_link(&l);
            }
        }
        for m in nl.dump(RouteNetlinkMessage::GetRoute(RouteMessage::default()))? {
            if let RouteNetlinkMessage::NewRoute(r) = m {
                view.add_route(&r);
            }
        }
        for m in nl.dump(RouteNetlinkMessage::GetRule(RuleMessage::default()))? {
            if let RouteNetlinkMessage::NewRule(r) = m {
                let table = r
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        RuleAttribute::Table(t) => Some(*t),
                        _ => None,
                    })
                    .unwrap_or(u32::from(r.header.table));
                if table != 0 && table != MAIN && table != LOCAL {
                    view.rule_tables.insert(table);
                }
            }
        }
        for m in nl.dump(RouteNetlinkMessage::GetNeighbour(
            NeighbourMessage::default(),
        ))? {
            if let RouteNetlinkMessage::NewNeighbour(n) = m {
                view.add_neighbour(&n);
            }
        }
        let mut fdb = NeighbourMessage::default();
        fdb.header.family = AddressFamily::Bridge;
        for m in nl.dump(RouteNetlinkMessage::GetNeighbour(fdb))? {
            if let RouteNetlinkMessage::NewNeighbour(n) = m {
                view.add_forwarding(&n);
            }
        }
        Ok(view)
    }

    fn add_link(&mut self, l: &LinkMessage) {
        // A layer-3 tunnel: one of these kinds, with a link type without Ethernet header (a
        // TUN device is layer 3, a TAP device — a VM's interface — is not).
        let mut l3_kind = false;
        let l3_type = matches!(
            l.header.link_layer_type,
            LinkLayerType::None
                | LinkLayerType::Tunnel
                | LinkLayerType::Tunnel6
                | LinkLayerType::Sit
                | LinkLayerType::Ipgre
                | LinkLayerType::Ip6gre
        );
        let mut link = Link {
            name: String::new(),
            bridge: false,
            tunnel: false,
            l3: false,
            master: None,
            xdp_generic: false,
        };
        for a in &l.attributes {
            match a {
                LinkAttribute::IfName(n) => link.name = n.clone(),
                LinkAttribute::Controller(m) => link.master = Some(*m),
                LinkAttribute::Xdp(xdp) => {
                    link.xdp_generic = xdp
                        .iter()
                        .any(|x| matches!(x, LinkXdp::Attached(XdpAttached::SocketBuffer)));
                }
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        match i {
                            LinkInfo::Kind(InfoKind::Bridge) => link.bridge = true,
                            LinkInfo::Kind(
                                InfoKind::Vxlan
                                | InfoKind::Geneve
                                | InfoKind::GreTap
                                | InfoKind::GreTap6,
                            ) => link.tunnel = true,
                            LinkInfo::Kind(
                                InfoKind::IpTun
                                | InfoKind::SitTun
                                | InfoKind::GreTun
                                | InfoKind::GreTun6
                                | InfoKind::Wireguard
                                | InfoKind::Tun,
                            ) => l3_kind = true,
                            LinkInfo::Kind(InfoKind::Other(kind)) if kind == "ip6tnl" => {
                                l3_kind = true
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if l3_kind && l3_type {
            link.tunnel = true;
            link.l3 = true;
        }
        self.links.insert(l.header.index, link);
    }

    fn add_route(&mut self, r: &RouteMessage) {
        if r.header.kind != RouteType::Unicast {
            return;
        }
        let (mut dst, mut table, mut metric, mut oif) = (None, u32::from(r.header.table), 0, 0);
        for a in &r.attributes {
            match a {
                RouteAttribute::Destination(RouteAddress::Inet(v4)) => dst = Some(IpAddr::V4(*v4)),
                RouteAttribute::Destination(RouteAddress::Inet6(v6)) => dst = Some(IpAddr::V6(*v6)),
                RouteAttribute::Table(t) => table = *t,
                RouteAttribute::Priority(p) => metric = *p,
                RouteAttribute::Oif(o) => oif = *o,
                _ => {}
            }
        }
        let dst = dst.unwrap_or(match r.header.address_family {
            AddressFamily::Inet6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        });
        let Ok(net) = IpNet::new(dst, r.header.destination_prefix_length) else {
            return;
        };
        if oif != 0 {
            self.routes.push(Route {
                net: net.trunc(),
                table,
                metric,
                oif,
            });
        }
    }

    fn add_neighbour(&mut self, n: &NeighbourMessage) {
        if matches!(
            n.header.state,
            NeighbourState::Failed | NeighbourState::Incomplete
        ) {
            return;
        }
        let mut ip = None;
        let mut mac = None;
        for a in &n.attributes {
            match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                    ip = Some(IpAddr::V4(*v4))
                }
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                    ip = Some(IpAddr::V6(*v6))
                }
                NeighbourAttribute::LinkLocalAddress(m) if !m.is_empty() => mac = Some(m.clone()),
                _ => {}
            }
        }
        if let (Some(ip), Some(mac)) = (ip, mac) {
            self.neighbours.push(Neighbour {
                ip,
                ifindex: n.header.ifindex,
                mac,
            });
        }
    }

    fn add_forwarding(&mut self, n: &NeighbourMessage) {
        // Local entries (the bridge's and its ports' own addresses) are permanent.
        if n.header.state == NeighbourState::Permanent {
            return;
        }
        let mut mac = None;
        let mut bridge = None;
        for a in &n.attributes {
            match a {
                NeighbourAttribute::LinkLocalAddress(m) if m.len() == 6 => mac = Some(m.clone()),
                NeighbourAttribute::Controller(b) => bridge = Some(*b),
                _ => {}
            }
        }
        if let (Some(mac), Some(bridge)) = (mac, bridge) {
            self.forwarding.push(Forwarding {
                mac,
                port: n.header.ifindex,
                bridge,
            });
        }
    }

    /// The interface called `name`.
    pub fn link_named(&self, name: &str) -> Option<&Link> {
        self.links.values().find(|l| l.name == name)
    }

    /// The name of interface `ifindex`.
    pub fn name(&self, ifindex: u32) -> Option<&str> {
        self.links.get(&ifindex).map(|l| l.name.as_str())
    }

    /// The longest-prefix route to `ip` among `tables` (lowest metric on ties).
    fn lookup(&self, ip: IpAddr, tables: impl Fn(u32) -> bool) -> Option<&Route> {
        self.routes
            .iter()
            .filter(|r| tables(r.table) && r.net.contains(&ip))
            .min_by_key(|r| (std::cmp::Reverse(r.net.prefix_len()), r.metric))
    }

    /// The uplinks: interfaces whose name matches one of `patterns` ([`glob_match`]), and
    /// every tunnel device; a pattern without wildcards is named even when no such
    /// interface exists (it is then reported as missing).
    pub fn uplinks(&self, patterns: &[String]) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = self
            .links
            .values()
            .filter(|l| l.tunnel || patterns.iter().any(|p| glob_match(p, &l.name)))
            .map(|l| l.name.clone())
            .collect();
        out.extend(patterns.iter().filter(|p| !p.contains(['*', '?'])).cloned());
        out
    }

    /// The first of the host-side interfaces a CNI plugin named for a pod (its `prevResult`)
    /// that is a pod interface here: it exists and is no bridge (the `bridge` plugin names the
    /// bridge and the pod's port), no tunnel, no uplink, not `lo`.
    pub fn cni_interface(&self, named: &[String], uplinks: &BTreeSet<String>) -> Option<String> {
        named
            .iter()
            .find(|n| {
                self.link_named(n)
                    .is_some_and(|l| !l.bridge && !l.tunnel && l.name != "lo")
                    && !uplinks.contains(*n)
            })
            .cloned()
    }

    /// The host-side interface of the local pod at `ip` (module docs for the order), given the
    /// uplinks' names.
    pub fn pod_interface(&self, ip: IpAddr, uplinks: &BTreeSet<String>) -> Result<String, Unfound> {
        let usable = |r: &Route| -> Result<u32, String> {
            let name = self.name(r.oif).unwrap_or("?");
            if r.net.prefix_len() == 0 {
                Err(format!(
                    "{ip}: only the default route ({name}) leads there, no pod interface"
                ))
            } else if name == "lo" || uplinks.contains(name) {
                Err(format!("{ip} is routed to {name}, not to a pod interface"))
            } else {
                Ok(r.oif)
            }
        };
        let main = self.lookup(ip, |t| t == MAIN);
        let oif = match main.map(usable) {
            Some(Ok(oif)) => oif,
            main_says => {
                let other = self.lookup(ip, |t| self.rule_tables.contains(&t));
                match other.map(|r| (r.table, usable(r))) {
                    Some((_, Ok(oif))) => oif,
                    Some((table, Err(why))) => {
                        return Err(Unfound::No(format!("{why} (table {table})")));
                    }
                    None => {
                        return Err(Unfound::No(match main_says {
                            Some(Err(why)) => why,
                            _ => format!("no route to {ip}"),
                        }));
                    }
                }
            }
        };
        let Some(link) = self.links.get(&oif) else {
            return Err(Unfound::No(format!(
                "{ip}: route to unknown interface {oif}"
            )));
        };
        if !link.bridge {
            return Ok(link.name.clone());
        }
        self.bridge_port(ip, oif, &link.name)
    }

    /// The port of bridge `bridge` behind which `ip` is.
    fn bridge_port(&self, ip: IpAddr, bridge: u32, bridge_name: &str) -> Result<String, Unfound> {
        let Some(n) = self
            .neighbours
            .iter()
            .find(|n| n.ip == ip && n.ifindex == bridge)
        else {
            return Err(Unfound::Unresolved {
                bridge,
                why: format!(
                    "{ip} is behind bridge {bridge_name}: resolving its port (no neighbour entry yet)"
                ),
            });
        };
        let port = self
            .forwarding
            .iter()
            .find(|f| f.bridge == bridge && f.mac == n.mac)
            .map(|f| f.port);
        match port.and_then(|p| self.links.get(&p).map(|l| (p, l))) {
            Some((_, l)) if l.master == Some(bridge) => Ok(l.name.clone()),
            _ => Err(Unfound::Unresolved {
                bridge,
                why: format!(
                    "{ip} is behind bridge {bridge_name}: its address {} is on no port of it yet",
                    mac_text(&n.mac)
                ),
            }),
        }
    }
}

/// Whether `name` matches the glob `pattern`: `*` any run of characters, `?` one character,
/// everything else itself (interface names: no classes or escapes needed).
pub(crate) fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic two-pointer match with one backtrack point (the last `*`).
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

fn mac_text(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Asks the kernel to resolve `ip` on interface `ifindex` and keep it resolved (a managed
/// neighbour entry, Linux 5.16+): the bridge then learns which port the address is behind.
pub(crate) fn add_managed_neighbour(ifindex: u32, ip: IpAddr) -> io::Result<()> {
    let mut m = neighbour(ifindex, ip);
    m.header.state = NeighbourState::None;
    m.attributes.push(NeighbourAttribute::Other(
        netlink_packet_core::DefaultNla::new(NDA_FLAGS_EXT, NTF_EXT_MANAGED.to_ne_bytes().to_vec()),
    ));
    Netlink::open()?.request(
        RouteNetlinkMessage::NewNeighbour(m),
        NLM_F_CREATE | NLM_F_REPLACE,
    )
}

/// Whether a neighbour message is about a *managed* entry (only [`add_managed_neighbour`] makes
/// them here): its resolution is what the agent waits for when it looks for a bridged pod.
pub(crate) fn is_managed(n: &NeighbourMessage) -> bool {
    use netlink_packet_core::Nla as _;
    n.attributes.iter().any(|a| match a {
        NeighbourAttribute::Other(nla) if nla.kind() == NDA_FLAGS_EXT && nla.value_len() == 4 => {
            let mut v = [0u8; 4];
            nla.emit_value(&mut v);
            u32::from_ne_bytes(v) & NTF_EXT_MANAGED != 0
        }
        _ => false,
    })
}

/// Removes the neighbour entry for `ip` on `ifindex` (one [`add_managed_neighbour`] made).
pub(crate) fn remove_neighbour(ifindex: u32, ip: IpAddr) -> io::Result<()> {
    Netlink::open()?.request(RouteNetlinkMessage::DelNeighbour(neighbour(ifindex, ip)), 0)
}

fn neighbour(ifindex: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = ifindex;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }));
    m
}

/// A synchronous rtnetlink socket (dumps and acknowledged requests).
struct Netlink {
    socket: Socket,
    seq: u32,
}

impl Netlink {
    fn open() -> io::Result<Netlink> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Netlink { socket, seq: 0 })
    }

    fn send(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<u32> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        Ok(self.seq)
    }

    /// Every message of a dump.
    fn dump(&mut self, msg: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
        let seq = self.send(msg, NLM_F_DUMP)?;
        let mut out = Vec::new();
        self.receive(seq, |m| out.push(m))?;
        Ok(out)
    }

    /// A request answered by an acknowledgement (its error, if any).
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        let seq = self.send(msg, NLM_F_ACK | flags)?;
        self.receive(seq, |_| {})
    }

    /// Reads the answers to request `seq` until its end (`Done`, or the acknowledgement).
    fn receive(&mut self, seq: u32, mut each: impl FnMut(RouteNetlinkMessage)) -> io::Result<()> {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = self.socket.recv(&mut &mut buf[..], 0)?;
            let mut at = 0;
            while at < n {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = msg.header.length as usize;
                if msg.header.sequence_number == seq {
                    match msg.payload {
                        NetlinkPayload::Done(_) => return Ok(()),
                        NetlinkPayload::Error(e) => {
                            return match e.code {
                                None => Ok(()),
                                Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                            };
                        }
                        NetlinkPayload::InnerMessage(m) => each(m),
                        _ => {}
                    }
                }
                if len == 0 {
                    break;
                }
                at += len;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> NetView {
        let mut v = NetView::default();
        let link = |name: &str, bridge: bool, master: Option<u32>| Link {
            name: name.into(),
            bridge,
            tunnel: name.starts_with("flannel") || name.starts_with("tunl"),
            l3: name.starts_with("tunl"),
            master,
            xdp_generic: false,
        };
        v.links.insert(1, link("lo", false, None));
        v.links.insert(2, link("eth0", false, None));
        v.links.insert(3, link("cali1", false, None));
        v.links.insert(4, link("cni0", true, None));
        v.links.insert(5, link("veth5", false, Some(4)));
        v.links.insert(6, link("eni7", false, None));
        v.links.insert(7, link("flannel.1", false, None));
        let route = |net: &str, table, metric, oif| Route {
            net: net.parse().unwrap(),
            table,
            metric,
            oif,
        };
        v.routes = vec![
            route("0.0.0.0/0", MAIN, 0, 2),
            route("10.1.0.3/32", MAIN, 0, 3),
            route("10.2.0.0/24", MAIN, 0, 4),
            route("10.3.0.9/32", 100, 0, 6),
            route("10.3.0.10/32", 101, 0, 6),
            route("10.4.0.0/16", MAIN, 0, 2),
        ];
        v.rule_tables.insert(100);
        v.neighbours = vec![Neighbour {
            ip: "10.2.0.5".parse().unwrap(),
            ifindex: 4,
            mac: vec![2, 0, 0, 0, 0, 5],
        }];
        v.forwarding = vec![Forwarding {
            mac: vec![2, 0, 0, 0, 0, 5],
            port: 5,
            bridge: 4,
        }];
        v
    }

    #[test]
    fn routed_policy_routed_and_bridged_pods_are_found() {
        let v = view();
        let uplinks = v.uplinks(&["eth0".to_string()]);
        let at = |ip: &str| v.pod_interface(ip.parse().unwrap(), &uplinks);
        // Main table, per-pod route.
        assert_eq!(at("10.1.0.3"), Ok("cali1".into()));
        // A table a rule looks up (100), not one nobody looks up (101).
        assert_eq!(at("10.3.0.9"), Ok("eni7".into()));
        assert!(matches!(at("10.3.0.10"), Err(Unfound::No(w)) if w.contains("default route")));
        // Behind a bridge: the port the pod's MAC is on, never the bridge.
        assert_eq!(at("10.2.0.5"), Ok("veth5".into()));
        assert!(matches!(
            at("10.2.0.6"),
            Err(Unfound::Unresolved { bridge: 4, .. })
        ));
        // The uplink is no pod interface.
        assert!(matches!(at("10.4.0.1"), Err(Unfound::No(w)) if w.contains("routed to eth0")));
        assert!(matches!(
            v.pod_interface("fd00::1".parse().unwrap(), &uplinks),
            Err(Unfound::No(w)) if w.contains("no route")
        ));
    }

    #[test]
    fn a_stale_forwarding_entry_on_another_bridge_is_not_the_port() {
        let mut v = view();
        v.forwarding[0].bridge = 9;
        assert!(matches!(
            v.pod_interface("10.2.0.5".parse().unwrap(), &BTreeSet::new()),
            Err(Unfound::Unresolved { .. })
        ));
    }

    #[test]
    fn uplinks_by_name_pattern_and_tunnel_kind() {
        let v = view();
        let names = |p: &[&str]| {
            v.uplinks(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .into_iter()
                .collect::<Vec<_>>()
        };
        // The VXLAN device always; a literal name even when missing; patterns match.
        assert_eq!(names(&[]), ["flannel.1"]);
        assert_eq!(names(&["eth0", "bond9"]), ["bond9", "eth0", "flannel.1"]);
        assert_eq!(names(&["e*"]), ["eni7", "eth0", "flannel.1"]);
        assert_eq!(names(&["eth?"]), ["eth0", "flannel.1"]);
    }

    /// Which links are tunnels, and which of them layer-3 ones: by kind and link type, as the
    /// kernel reports them (a TAP device, e.g. a VM's interface, is Ethernet: no tunnel).
    #[test]
    fn tunnels_by_kind_and_link_type() {
        let link = |index: u32, kind: InfoKind, ty: LinkLayerType| {
            let mut m = LinkMessage::default();
            m.header.index = index;
            m.header.link_layer_type = ty;
            m.attributes = vec![
                LinkAttribute::IfName(format!("{kind}{index}")),
                LinkAttribute::LinkInfo(vec![LinkInfo::Kind(kind)]),
            ];
            m
        };
        let mut v = NetView::default();
        for m in [
            link(1, InfoKind::Vxlan, LinkLayerType::Ether),
            link(2, InfoKind::IpTun, LinkLayerType::Tunnel),
            link(3, InfoKind::Wireguard, LinkLayerType::None),
            link(4, InfoKind::Tun, LinkLayerType::None),
            link(5, InfoKind::Tun, LinkLayerType::Ether),
            link(6, InfoKind::GreTap, LinkLayerType::Ether),
            link(7, InfoKind::Other("ip6tnl".into()), LinkLayerType::Tunnel6),
            link(8, InfoKind::Veth, LinkLayerType::Ether),
            link(9, InfoKind::IpTun, LinkLayerType::Ether),
        ] {
            v.add_link(&m);
        }
        let got: Vec<(u32, bool, bool)> =
            v.links.iter().map(|(i, l)| (*i, l.tunnel, l.l3)).collect();
        assert_eq!(
            got,
            [
                (1, true, false),
                (2, true, true),
                (3, true, true),
                (4, true, true),
                (5, false, false),
                (6, true, false),
                (7, true, true),
                (8, false, false),
                (9, false, false),
            ]
        );
    }

    #[test]
    fn the_cni_plugins_interface_comes_first_unless_it_is_a_bridge_or_uplink() {
        let v = view();
        let uplinks = v.uplinks(&["eth0".to_string()]);
        let named = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // The bridge plugin names the bridge and the port.
        assert_eq!(
            v.cni_interface(&named(&["cni0", "veth5"]), &uplinks),
            Some("veth5".into())
        );
        assert_eq!(
            v.cni_interface(&named(&["cali1"]), &uplinks),
            Some("cali1".into())
        );
        assert_eq!(v.cni_interface(&named(&["eth0", "gone9"]), &uplinks), None);
        assert_eq!(v.cni_interface(&named(&["flannel.1"]), &uplinks), None);
    }

    #[test]
    fn managed_entries_are_recognised() {
        let mut n = neighbour(4, "10.2.0.5".parse().unwrap());
        assert!(!is_managed(&n));
        n.attributes.push(NeighbourAttribute::Other(
            netlink_packet_core::DefaultNla::new(NDA_FLAGS_EXT, 1u32.to_ne_bytes().to_vec()),
        ));
        assert!(is_managed(&n));
    }

    #[test]
    fn globs() {
        for (p, n, want) in [
            ("eth0", "eth0", true),
            ("eth0", "eth01", false),
            ("eth*", "eth", true),
            ("eth*", "eth12", true),
            ("*", "", true),
            ("", "", true),
            ("", "a", false),
            ("e?h*1", "eth1", true),
            ("e?h*1", "eth12", false),
            ("*ab*ab", "xabyabab", true),
            ("*ab*ab", "xabyaba", false),
            ("a*b*c", "abbbc", true),
            ("vxlan.?", "vxlan.12", false),
        ] {
            assert_eq!(glob_match(p, n), want, "{p} ~ {n}");
        }
    }

    /// This namespace (the test's) reads without error and has a loopback.
    #[test]
    fn this_namespace_reads() {
        let v = NetView::read().unwrap();
        assert!(v.links.values().any(|l| l.name == "lo"), "{v:?}");
    }
}
