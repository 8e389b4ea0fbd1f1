//! The lab's network: one namespace per pod, one for "the node" (the datapath's namespace), one
//! for "the world" behind the node's uplink, and one per external address. Nothing is created
//! in the namespace the lab is started from.
//!
//! ```text
//!  pod ns (eth0: pod IPs /32 /128)          node ns (forwarding)              world ns        ext ns
//!   eth0 ───────────────────── veth ──────── lxcN   [XDP]
//!                                            uplink [XDP] ─── veth ─── node     extJ ─── eth0
//! ```
//!
//! Routing is static: a pod's default route goes to a link-local gateway (`169.254.1.1`,
//! `fe80::1`) whose neighbour entry is the MAC of its host-side veth; the node has a host route
//! and a permanent neighbour entry per pod address and a default route to the world over the
//! uplink; the world routes each external address to its namespace. No ARP or neighbour
//! discovery is needed on any path the probes take.
//!
//! `--cni flannel` builds two nodes (`…-node`, `…-node2`), each with its own uplink to the
//! world, a bridge of its pods and a VXLAN device `flannel.1` over its uplink; pods alternate
//! between the nodes and a node reaches the other node's pods through the overlay, as flannel's
//! VXLAN backend does (a route and a permanent neighbour entry per remote address on
//! `flannel.1`, a forwarding entry for the remote VTEP). `--uplinks N` gives node 0 more
//! uplinks, over which the world reaches its pods (their replies leave by `uplink`).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::error::LabError;
use super::sys::{self, Netns};
use crate::cli::CniShape;

/// Every namespace of a lab is named `ordlab-<run id>-...`: a crashed lab's leftovers are
/// recognised by this prefix.
pub const PREFIX: &str = "ordlab-";

/// The pods' (and the externals') gateway, a neighbour entry on their `eth0`.
const GW4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
const GW6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The node's and the world's next hops on the uplink.
const NODE_UPLINK4: Ipv4Addr = Ipv4Addr::new(169, 254, 2, 1);
const NODE_UPLINK6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const WORLD_UPLINK4: Ipv4Addr = Ipv4Addr::new(169, 254, 2, 2);
const WORLD_UPLINK6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);

/// The node's uplink interface (in the node namespace).
pub const UPLINK: &str = "uplink";

/// Each node's own addresses (on its uplink), by node: kube-proxy masquerades to them (hairpin,
/// NodePort with `externalTrafficPolicy: Cluster`), NodePorts are reached on them, the datapath
/// of that node knows them as the node's, and the overlay's tunnels end at them. Global scope
/// (IPv6 masquerade needs a global address). Only `--cni flannel` builds the second node.
pub const NODE_ADDRESSES: [[IpAddr; 2]; 2] = [
    [
        IpAddr::V4(Ipv4Addr::new(169, 254, 3, 1)),
        IpAddr::V6(Ipv6Addr::new(0xfd6f, 0x726e, 0x6574, 0, 0, 0, 0, 1)),
    ],
    [
        IpAddr::V4(Ipv4Addr::new(169, 254, 3, 2)),
        IpAddr::V6(Ipv6Addr::new(0xfd6f, 0x726e, 0x6574, 0, 0, 0, 0, 2)),
    ],
];

/// `--cni flannel`: the overlay device of each node (flannel's name), its VXLAN id and port,
/// and what it takes from the MTU (the outer IPv4, UDP, VXLAN and Ethernet headers).
pub const OVERLAY: &str = "flannel.1";
const VXLAN_ID: u32 = 1;
const VXLAN_PORT: u16 = 8472;
pub const VXLAN_OVERHEAD: u32 = 50;

/// The node a pod is built on: with `--cni flannel` pods alternate between the two nodes (in
/// the engine's endpoint order), otherwise there is one node.
pub fn node_of(shape: CniShape, pod_index: usize) -> usize {
    match shape {
        CniShape::Flannel => pod_index % 2,
        _ => 0,
    }
}

/// How many nodes a shape builds.
pub fn node_count(shape: CniShape) -> usize {
    match shape {
        CniShape::Flannel => 2,
        _ => 1,
    }
}

/// One pod or external address as built.
#[derive(Debug)]
pub struct Member {
    /// `namespace/name` or the external IP text.
    pub label: String,
    pub external: bool,
    /// Every address it owns (a pod: all of its `podIPs`).
    pub ips: Vec<IpAddr>,
    /// Its namespace.
    pub netns: String,
    /// Its side of its veth pair in the node namespace (pods) or the world namespace.
    pub host_if: String,
    /// The node it is built on (index into [`Topology::nodes`]; externals: 0).
    pub node: usize,
}

/// The lab's namespaces; [`Topology::teardown`] (also on drop) deletes every one it created.
#[derive(Debug)]
pub struct Topology {
    pub run_id: String,
    /// The node namespaces (one; two with `--cni flannel`).
    pub nodes: Vec<String>,
    pub world: String,
    pub members: Vec<Member>,
    /// How the pods are wired (`--cni`) and the links' MTU (`--mtu`).
    pub shape: CniShape,
    pub mtu: u32,
    /// Node 0's uplinks (`--uplinks`): `uplink`, then `uplink2`, ...
    pub uplinks: usize,
    created: Vec<String>,
}

/// The bridge of `--cni bridge` (in the node namespace), and the table of
/// `--cni policy-routing`.
pub const BRIDGE: &str = "cni0";
const POD_TABLE: u32 = 100;

/// Why an address cannot be given to a lab namespace, if it cannot.
pub fn unusable(ip: IpAddr) -> Option<&'static str> {
    let reserved = [
        IpAddr::V4(GW4),
        IpAddr::V4(NODE_UPLINK4),
        IpAddr::V4(WORLD_UPLINK4),
    ];
    if reserved.contains(&ip) || NODE_ADDRESSES.iter().flatten().any(|a| *a == ip) {
        return Some("it is one of the lab's own addresses");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_unspecified() || v4.is_loopback() || v4.is_multicast() => {
            Some("it is not a unicast address")
        }
        IpAddr::V4(v4) if v4.is_broadcast() => Some("it is not a unicast address"),
        IpAddr::V6(v6) if v6.is_unspecified() || v6.is_loopback() || v6.is_multicast() => {
            Some("it is not a unicast address")
        }
        IpAddr::V6(v6) if v6.is_unicast_link_local() => {
            Some("IPv6 link-local addresses are used by the lab's routing")
        }
        _ => None,
    }
}

fn mac(kind: u8, i: usize) -> String {
    format!(
        "02:6f:6c:{kind:02x}:{:02x}:{:02x}",
        (i >> 8) & 0xff,
        i & 0xff
    )
}

fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

/// Permanent neighbour entries for the next hops `hops` (IPv4, IPv6) at `mac` on `dev`, and
/// with `default` the default routes of both families through them.
fn next_hops(cfg: &mut String, hops: (IpAddr, IpAddr), mac: &str, dev: &str, default: bool) {
    for hop in [hops.0, hops.1] {
        let _ = writeln!(cfg, "neigh add {hop} lladdr {mac} dev {dev} nud permanent");
        if default {
            let _ = writeln!(cfg, "route add default via {hop} dev {dev} onlink");
        }
    }
}

/// Namespace name of a pod: `ordlab-<id>-<ns>_<name>` (`_` cannot occur in Kubernetes names),
/// by index when that would be too long for a file name.
fn pod_netns(run_id: &str, index: usize, label: &str) -> String {
    let name = format!("{PREFIX}{run_id}-{}", label.replacen('/', "_", 1));
    if name.len() <= 200 {
        name
    } else {
        format!("{PREFIX}{run_id}-pod{index}")
    }
}

/// The lines that give a leaf namespace (pod or external) its addresses and its default routes
/// through the gateway whose MAC is `gw_mac`, and on-link routes to `neighbours` (address, MAC:
/// the other pods of a bridge, reached switched, not routed).
fn leaf_config(ips: &[IpAddr], gw_mac: &str, neighbours: &[(IpAddr, String)]) -> String {
    let mut b = String::new();
    b.push_str("link set lo up\nlink set eth0 up\n");
    for (ip, mac) in neighbours {
        let _ = writeln!(
            b,
            "neigh add {ip} lladdr {mac} dev eth0 nud permanent\nroute add {} dev eth0",
            host_prefix(*ip)
        );
    }
    for ip in ips {
        let nodad = if ip.is_ipv6() { " nodad" } else { "" };
        let _ = writeln!(b, "addr add {} dev eth0{nodad}", host_prefix(*ip));
    }
    let _ = writeln!(
        b,
        "neigh add {GW4} lladdr {gw_mac} dev eth0 nud permanent\n\
         route add default via {GW4} dev eth0 onlink\n\
         neigh add {GW6} lladdr {gw_mac} dev eth0 nud permanent\n\
         route add default via {GW6} dev eth0 onlink"
    );
    b
}

impl Topology {
    /// An empty lab for run `run_id` (nothing created yet).
    pub fn new(run_id: &str, shape: CniShape, mtu: u32, uplinks: usize) -> Topology {
        Topology {
            run_id: run_id.to_string(),
            nodes: (0..node_count(shape))
                .map(|n| match n {
                    0 => format!("{PREFIX}{run_id}-node"),
                    n => format!("{PREFIX}{run_id}-node{}", n + 1),
                })
                .collect(),
            world: format!("{PREFIX}{run_id}-world"),
            members: Vec::new(),
            shape,
            mtu,
            uplinks: uplinks.max(1),
            created: Vec::new(),
        }
    }

    /// Builds everything: pods (`label`, all addresses) and external addresses. On error, what
    /// was created is still recorded and removed by [`Topology::teardown`].
    pub fn build(
        &mut self,
        pods: &[(String, Vec<IpAddr>)],
        externals: &[IpAddr],
    ) -> Result<(), LabError> {
        if pods.len() + externals.len() > 0xffff {
            return Err(LabError::Topology(
                "more than 65535 pods and external addresses",
            ));
        }
        self.add_members(pods, externals);
        self.create_namespaces()?;
        self.create_veths()?;
        self.configure_routers()?;
        self.configure_leaves()
    }

    /// Records the members (pods, then externals) with their namespaces and interfaces.
    fn add_members(&mut self, pods: &[(String, Vec<IpAddr>)], externals: &[IpAddr]) {
        for (i, (label, ips)) in pods.iter().enumerate() {
            self.members.push(Member {
                label: label.clone(),
                external: false,
                ips: ips.clone(),
                netns: pod_netns(&self.run_id, i, label),
                host_if: format!("lxc{i}"),
                node: node_of(self.shape, i),
            });
        }
        for (j, ip) in externals.iter().enumerate() {
            self.members.push(Member {
                label: ip.to_string(),
                external: true,
                ips: vec![*ip],
                netns: format!("{PREFIX}{}-ext-{ip}", self.run_id),
                host_if: format!("ext{j}"),
                node: 0,
            });
        }
    }

    /// Every namespace, and the routers' sysctls: forwarding on, no reverse-path filter (set
    /// before the interfaces exist, so theirs come from `default`).
    fn create_namespaces(&mut self) -> Result<(), LabError> {
        let mut names = self.nodes.clone();
        names.push(self.world.clone());
        names.extend(self.members.iter().map(|m| m.netns.clone()));
        for name in &names {
            sys::ip(&["netns", "add", name], None)?;
            self.created.push(name.clone());
        }
        for router in self.nodes.iter().chain([&self.world]) {
            let ns = Netns::open(router)?;
            sys::in_netns(&ns, || {
                for (k, v) in [
                    ("net.ipv4.conf.all.rp_filter", "0"),
                    ("net.ipv4.conf.default.rp_filter", "0"),
                    ("net.ipv4.ip_forward", "1"),
                    ("net.ipv6.conf.all.forwarding", "1"),
                ] {
                    sys::sysctl(k, v)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Whether the pods are ports of a bridge (`bridge`, and each node's with `flannel`).
    fn bridged(&self) -> bool {
        matches!(self.shape, CniShape::Bridge | CniShape::Flannel)
    }

    /// The MTU of the pods' links, the bridges and the overlay: `--mtu`, less the VXLAN
    /// headers with `--cni flannel` (as flannel sets it; the uplinks keep `--mtu`).
    pub fn pod_mtu(&self) -> u32 {
        match self.shape {
            CniShape::Flannel => self.mtu - VXLAN_OVERHEAD,
            _ => self.mtu,
        }
    }

    /// Node `n`'s uplink MAC and the world's side of it; the world's link to node `n`.
    fn uplink_macs(n: usize) -> (String, String) {
        (mac(2, 2 * n), mac(2, 2 * n + 1))
    }

    /// Node 0's extra uplink `k` (1-based after `uplink`: `uplink2` is 1), its MACs (node
    /// side, world side) and the world's side of it.
    fn extra_uplink(k: usize) -> (String, String, String, String) {
        (
            format!("{UPLINK}{}", k + 1),
            mac(7, 2 * k),
            mac(7, 2 * k + 1),
            format!("node-u{}", k + 1),
        )
    }

    fn world_link(n: usize) -> String {
        match n {
            0 => "node".to_string(),
            n => format!("node{}", n + 1),
        }
    }

    /// Every veth pair, created directly in its two namespaces.
    fn create_veths(&self) -> Result<(), LabError> {
        let mut links = String::new();
        let world = &self.world;
        for (n, node) in self.nodes.iter().enumerate() {
            let (up, w) = Self::uplink_macs(n);
            let _ = writeln!(
                links,
                "link add {UPLINK} address {up} mtu {mtu} netns {node} type veth peer name {} address {w} mtu {mtu} netns {world}",
                Self::world_link(n),
                mtu = self.mtu
            );
        }
        for k in 1..self.uplinks {
            let (name, up, w, peer) = Self::extra_uplink(k);
            let _ = writeln!(
                links,
                "link add {name} address {up} mtu {mtu} netns {} type veth peer name {peer} address {w} mtu {mtu} netns {world}",
                self.nodes[0],
                mtu = self.mtu
            );
        }
        let mut ext_index = 0;
        let mut pod_index = 0;
        for m in &self.members {
            if m.external {
                let _ = writeln!(
                    links,
                    "link add {} address {} mtu {mtu} netns {world} type veth peer name eth0 address {} mtu {mtu} netns {}",
                    m.host_if,
                    mac(3, ext_index),
                    mac(4, ext_index),
                    m.netns,
                    mtu = self.mtu
                );
                ext_index += 1;
            } else {
                let _ = writeln!(
                    links,
                    "link add {} address {} mtu {mtu} netns {} type veth peer name eth0 address {} mtu {mtu} netns {}",
                    m.host_if,
                    mac(0, pod_index),
                    self.nodes[m.node],
                    mac(1, pod_index),
                    m.netns,
                    mtu = self.pod_mtu()
                );
                pod_index += 1;
            }
        }
        sys::ip(&["-batch", "-"], Some(&links))?;
        Ok(())
    }

    /// The nodes and the world: a host route and a permanent neighbour per member address on its
    /// interface, each node's own addresses on its uplink, default routes across the uplinks;
    /// with `--cni flannel` the overlay between the nodes.
    fn configure_routers(&self) -> Result<(), LabError> {
        let mut node_cfg: Vec<String> = (0..self.nodes.len())
            .map(|n| self.node_devices(n))
            .collect();
        let mut world_cfg = String::from("link set lo up\n");
        for n in 0..self.nodes.len() {
            let _ = writeln!(world_cfg, "link set {} up", Self::world_link(n));
        }
        for k in 1..self.uplinks {
            let (name, _, _, peer) = Self::extra_uplink(k);
            let _ = writeln!(world_cfg, "link set {peer} up");
            let _ = writeln!(node_cfg[0], "link set {name} up");
        }
        let (mut pi, mut ei) = (0, 0);
        for m in &self.members {
            let (cfg, leaf_mac) = if m.external {
                ei += 1;
                (&mut world_cfg, mac(4, ei - 1))
            } else {
                pi += 1;
                (&mut node_cfg[m.node], mac(1, pi - 1))
            };
            let _ = writeln!(cfg, "link set {} up", m.host_if);
            // Where the node reaches the member: its veth, or (bridge) the bridge it is a port
            // of; its routes in the main table, or (policy routing) in the rule's table.
            let (dev, table) = match (m.external, self.shape) {
                (false, CniShape::Bridge | CniShape::Flannel) => {
                    let _ = writeln!(
                        cfg,
                        "link set {} master {BRIDGE}\nlink set {} type bridge_slave hairpin on",
                        m.host_if, m.host_if
                    );
                    (BRIDGE, String::new())
                }
                (false, CniShape::PolicyRouting) => {
                    (m.host_if.as_str(), format!(" table {POD_TABLE}"))
                }
                _ => (m.host_if.as_str(), String::new()),
            };
            for ip in &m.ips {
                let _ = writeln!(
                    cfg,
                    "neigh add {ip} lladdr {leaf_mac} dev {dev} nud permanent\n\
                     route add {} dev {dev}{table}",
                    host_prefix(*ip),
                );
            }
            if !m.external && self.nodes.len() > 1 {
                self.route_remote_pod(m, &mut node_cfg, &mut world_cfg);
            }
            if !m.external && m.node == 0 && self.uplinks > 1 {
                // From outside, node 0's pods are reached over its extra uplinks (spread by
                // pod); their replies leave by `uplink`, the node's default route.
                let (_, up, _, peer) = Self::extra_uplink(1 + (pi - 1) % (self.uplinks - 1));
                for ip in &m.ips {
                    let _ = writeln!(
                        world_cfg,
                        "neigh add {ip} lladdr {up} dev {peer} nud permanent\nroute add {} dev {peer}",
                        host_prefix(*ip),
                    );
                }
            }
        }
        for (n, cfg) in node_cfg.iter_mut().enumerate() {
            self.configure_uplink(n, cfg, &mut world_cfg);
        }
        for (node, cfg) in self.nodes.iter().zip(&node_cfg) {
            sys::ip(&["-n", node, "-batch", "-"], Some(cfg))?;
        }
        sys::ip(&["-n", &self.world, "-batch", "-"], Some(&world_cfg))?;
        if self.shape == CniShape::PolicyRouting {
            // Every destination looks in the pods' table first, then (no match) in main.
            let table = POD_TABLE.to_string();
            for family in ["-4", "-6"] {
                sys::ip(
                    &[
                        "-n",
                        &self.nodes[0],
                        family,
                        "rule",
                        "add",
                        "pref",
                        "100",
                        "lookup",
                        &table,
                    ],
                    None,
                )?;
            }
        }
        if self.shape == CniShape::Flannel {
            self.overlay_forwarding()?;
        }
        Ok(())
    }

    /// `--cni flannel`: pod `m` as the other nodes and the world reach it. The other nodes
    /// route its addresses into their overlay device, with a permanent neighbour entry naming
    /// the VTEP MAC of `m`'s node (flannel's VXLAN backend); the world routes them to `m`'s
    /// node's uplink (node 0 is the world's default).
    fn route_remote_pod(&self, m: &Member, node_cfg: &mut [String], world_cfg: &mut String) {
        for (n, cfg) in node_cfg.iter_mut().enumerate() {
            if n == m.node {
                continue;
            }
            for ip in &m.ips {
                let _ = writeln!(
                    cfg,
                    "neigh add {ip} lladdr {} dev {OVERLAY} nud permanent\n\
                     route add {} dev {OVERLAY}",
                    mac(6, m.node),
                    host_prefix(*ip),
                );
            }
        }
        if m.node != 0 {
            let link = Self::world_link(m.node);
            for ip in &m.ips {
                let _ = writeln!(
                    world_cfg,
                    "neigh add {ip} lladdr {} dev {link} nud permanent\nroute add {} dev {link}",
                    Self::uplink_macs(m.node).0,
                    host_prefix(*ip),
                );
            }
        }
    }

    /// The first lines of node `n`'s configuration: its own addresses on its uplink, the bridge
    /// (bridged shapes) and with `--cni flannel` the overlay device over the uplink (after the
    /// address its tunnels start from).
    fn node_devices(&self, n: usize) -> String {
        let mut cfg = String::from("link set lo up\n");
        for addr in NODE_ADDRESSES[n] {
            let nodad = if addr.is_ipv6() { " nodad" } else { "" };
            let _ = writeln!(cfg, "addr add {} dev {UPLINK}{nodad}", host_prefix(addr));
        }
        let _ = writeln!(cfg, "link set {UPLINK} up");
        if self.bridged() {
            let _ = writeln!(
                cfg,
                "link add {BRIDGE} address {} mtu {} type bridge\nlink set {BRIDGE} up",
                mac(5, n),
                self.pod_mtu()
            );
        }
        if self.shape == CniShape::Flannel {
            let _ = writeln!(
                cfg,
                "link add {OVERLAY} address {} mtu {} type vxlan id {VXLAN_ID} local {} dstport {VXLAN_PORT} nolearning dev {UPLINK}\n\
                 link set {OVERLAY} up",
                mac(6, n),
                self.pod_mtu(),
                NODE_ADDRESSES[n][0]
            );
        }
        cfg
    }

    /// Node `n`'s routes out: its default routes to the world (with `--cni flannel`, node 0's
    /// for the other nodes), the world's routes back (node 0 is the world's default route).
    fn configure_uplink(&self, n: usize, cfg: &mut String, world_cfg: &mut String) {
        let (up, w) = Self::uplink_macs(n);
        let link = Self::world_link(n);
        let world_hops = (WORLD_UPLINK4.into(), WORLD_UPLINK6.into());
        next_hops(cfg, world_hops, &w, UPLINK, n == 0);
        if n != 0 {
            // The tunnels to node 0 over the uplink; everything else (the world) through node
            // 0 over the overlay, so a reply of a Service flow node 0 translated passes node 0's
            // connection tracking again (kube-proxy's un-DNAT) whatever node its backend is on.
            let _ = writeln!(
                cfg,
                "route add {} via {WORLD_UPLINK4} dev {UPLINK} onlink",
                host_prefix(NODE_ADDRESSES[0][0]),
            );
            next_hops(cfg, (GW4.into(), GW6.into()), &mac(6, 0), OVERLAY, true);
        }
        let node_hops = (NODE_UPLINK4.into(), NODE_UPLINK6.into());
        next_hops(world_cfg, node_hops, &up, &link, n == 0);
        if n != 0 {
            for addr in NODE_ADDRESSES[n] {
                let via = if addr.is_ipv6() {
                    NODE_UPLINK6.to_string()
                } else {
                    NODE_UPLINK4.to_string()
                };
                let _ = writeln!(
                    world_cfg,
                    "route add {} via {via} dev {link} onlink",
                    host_prefix(addr)
                );
            }
        }
    }

    /// `--cni flannel`: each node's overlay sends what is for another node's VTEP MAC to that
    /// node's address (a permanent forwarding entry, as flannel writes one per node).
    fn overlay_forwarding(&self) -> Result<(), LabError> {
        for (n, node) in self.nodes.iter().enumerate() {
            let mut fdb = String::new();
            for other in (0..self.nodes.len()).filter(|o| *o != n) {
                let _ = writeln!(
                    fdb,
                    "fdb append {} dev {OVERLAY} dst {} self permanent",
                    mac(6, other),
                    NODE_ADDRESSES[other][0]
                );
            }
            sys::bridge(&["-n", node, "-batch", "-"], Some(&fdb))?;
        }
        Ok(())
    }

    /// Each member's namespace: its addresses and routes via its gateway.
    fn configure_leaves(&self) -> Result<(), LabError> {
        let bridged = self.bridged();
        // On a bridge, every pod reaches the others of its node directly (their addresses and
        // MACs); the other node's pods through the gateway.
        let pods: Vec<(usize, IpAddr, String)> = self
            .members
            .iter()
            .filter(|m| !m.external)
            .enumerate()
            .flat_map(|(i, m)| m.ips.iter().map(move |ip| (m.node, *ip, mac(1, i))))
            .collect();
        let (mut pi, mut ei) = (0, 0);
        for m in &self.members {
            let gw_mac = if m.external {
                ei += 1;
                mac(3, ei - 1)
            } else if bridged {
                pi += 1;
                mac(5, m.node)
            } else {
                pi += 1;
                mac(0, pi - 1)
            };
            let neighbours: Vec<(IpAddr, String)> = if bridged && !m.external {
                pods.iter()
                    .filter(|(node, ip, _)| *node == m.node && !m.ips.contains(ip))
                    .map(|(_, ip, mac)| (*ip, mac.clone()))
                    .collect()
            } else {
                Vec::new()
            };
            sys::ip(
                &["-n", &m.netns, "-batch", "-"],
                Some(&leaf_config(&m.ips, &gw_mac, &neighbours)),
            )?;
        }
        Ok(())
    }

    /// The interfaces of node `n`'s namespace the XDP and TC programs are attached to: every
    /// pod's host-side veth there (on a bridge, its port; never the bridge) and the uplinks.
    pub fn xdp_interfaces(&self, n: usize) -> Vec<String> {
        let mut v: Vec<String> = self
            .members
            .iter()
            .filter(|m| !m.external && m.node == n)
            .map(|m| m.host_if.clone())
            .collect();
        v.push(UPLINK.to_string());
        if n == 0 {
            v.extend((1..self.uplinks).map(|k| Self::extra_uplink(k).0));
        }
        v
    }

    /// The interfaces of node `n` with the TC program only: the overlay device (the kernel
    /// refuses XDP on a VXLAN device and on its underlay at once; what leaves through the
    /// tunnel is judged at its TC hook, as the agent does).
    pub fn tc_only_interfaces(&self, n: usize) -> Vec<String> {
        match self.shape {
            CniShape::Flannel if n < self.nodes.len() => vec![OVERLAY.to_string()],
            _ => Vec::new(),
        }
    }

    /// Deletes every namespace this lab created (their interfaces go with them). Idempotent.
    pub fn teardown(&mut self) -> Result<(), LabError> {
        if self.created.is_empty() {
            return Ok(());
        }
        let names = std::mem::take(&mut self.created);
        delete_netns(&names)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("ordnet lab: cleanup: {e}");
        }
    }
}

/// Deletes named namespaces (all of them, even when one fails).
fn delete_netns(names: &[String]) -> Result<(), LabError> {
    let script: String = names.iter().map(|n| format!("netns del {n}\n")).collect();
    sys::ip(&["-force", "-batch", "-"], Some(&script))
}

/// Deletes the namespaces an earlier lab left behind (it crashed or was killed). Only call
/// with the lab lock held: a running lab's namespaces are never touched.
pub fn remove_leftovers() -> Result<Vec<String>, LabError> {
    let mut stale: Vec<String> = sys::netns_names()
        .into_iter()
        .filter(|n| n.starts_with(PREFIX))
        .collect();
    stale.sort();
    if !stale.is_empty() {
        delete_netns(&stale)?;
    }
    Ok(stale)
}
