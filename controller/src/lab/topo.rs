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

/// The node's own addresses (on its uplink): kube-proxy masquerades to them (hairpin, NodePort
/// with `externalTrafficPolicy: Cluster`), NodePorts are reached on them, and the datapath
/// knows them as the node's. Global scope (IPv6 masquerade needs a global address).
pub const NODE_ADDRESSES: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 3, 1)),
    IpAddr::V6(Ipv6Addr::new(0xfd6f, 0x726e, 0x6574, 0, 0, 0, 0, 1)),
];

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
}

/// The lab's namespaces; [`Topology::teardown`] (also on drop) deletes every one it created.
#[derive(Debug)]
pub struct Topology {
    pub run_id: String,
    pub node: String,
    pub world: String,
    pub members: Vec<Member>,
    /// How the pods are wired (`--cni`) and the links' MTU (`--mtu`).
    pub shape: CniShape,
    pub mtu: u32,
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
        NODE_ADDRESSES[0],
        NODE_ADDRESSES[1],
    ];
    if reserved.contains(&ip) {
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
    pub fn new(run_id: &str, shape: CniShape, mtu: u32) -> Topology {
        Topology {
            run_id: run_id.to_string(),
            node: format!("{PREFIX}{run_id}-node"),
            world: format!("{PREFIX}{run_id}-world"),
            members: Vec::new(),
            shape,
            mtu,
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
            });
        }
        for (j, ip) in externals.iter().enumerate() {
            self.members.push(Member {
                label: ip.to_string(),
                external: true,
                ips: vec![*ip],
                netns: format!("{PREFIX}{}-ext-{ip}", self.run_id),
                host_if: format!("ext{j}"),
            });
        }
    }

    /// Every namespace, and the routers' sysctls: forwarding on, no reverse-path filter (set
    /// before the interfaces exist, so theirs come from `default`).
    fn create_namespaces(&mut self) -> Result<(), LabError> {
        let mut names = vec![self.node.clone(), self.world.clone()];
        names.extend(self.members.iter().map(|m| m.netns.clone()));
        for name in &names {
            sys::ip(&["netns", "add", name], None)?;
            self.created.push(name.clone());
        }
        for router in [&self.node, &self.world] {
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

    /// Every veth pair, created directly in its two namespaces.
    fn create_veths(&self) -> Result<(), LabError> {
        let mut links = String::new();
        let (node, world) = (&self.node, &self.world);
        let _ = writeln!(
            links,
            "link add {UPLINK} address {} mtu {mtu} netns {node} type veth peer name node address {} mtu {mtu} netns {world}",
            mac(2, 0),
            mac(2, 1),
            mtu = self.mtu
        );
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
                    "link add {} address {} mtu {mtu} netns {node} type veth peer name eth0 address {} mtu {mtu} netns {}",
                    m.host_if,
                    mac(0, pod_index),
                    mac(1, pod_index),
                    m.netns,
                    mtu = self.mtu
                );
                pod_index += 1;
            }
        }
        sys::ip(&["-batch", "-"], Some(&links))?;
        Ok(())
    }

    /// The node and the world: a host route and a permanent neighbour per member address on its
    /// interface, the node's own addresses on the uplink, default routes across the uplink.
    fn configure_routers(&self) -> Result<(), LabError> {
        let mut node_cfg = String::from("link set lo up\n");
        let mut world_cfg = String::from("link set lo up\n");
        if self.shape == CniShape::Bridge {
            let _ = writeln!(
                node_cfg,
                "link add {BRIDGE} address {} mtu {} type bridge\nlink set {BRIDGE} up",
                mac(5, 0),
                self.mtu
            );
        }
        let (mut pi, mut ei) = (0, 0);
        for m in &self.members {
            let (cfg, leaf_mac) = if m.external {
                ei += 1;
                (&mut world_cfg, mac(4, ei - 1))
            } else {
                pi += 1;
                (&mut node_cfg, mac(1, pi - 1))
            };
            let _ = writeln!(cfg, "link set {} up", m.host_if);
            // Where the node reaches the member: its veth, or (bridge) the bridge it is a port
            // of; its routes in the main table, or (policy routing) in the rule's table.
            let (dev, table) = match (m.external, self.shape) {
                (false, CniShape::Bridge) => {
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
        }

        for addr in NODE_ADDRESSES {
            let nodad = if addr.is_ipv6() { " nodad" } else { "" };
            let _ = writeln!(
                node_cfg,
                "addr add {} dev {UPLINK}{nodad}",
                host_prefix(addr)
            );
        }
        let _ = writeln!(
            node_cfg,
            "link set {UPLINK} up\n\
             neigh add {WORLD_UPLINK4} lladdr {w} dev {UPLINK} nud permanent\n\
             route add default via {WORLD_UPLINK4} dev {UPLINK} onlink\n\
             neigh add {WORLD_UPLINK6} lladdr {w} dev {UPLINK} nud permanent\n\
             route add default via {WORLD_UPLINK6} dev {UPLINK} onlink",
            w = mac(2, 1)
        );
        let _ = writeln!(
            world_cfg,
            "link set node up\n\
             neigh add {NODE_UPLINK4} lladdr {n} dev node nud permanent\n\
             route add default via {NODE_UPLINK4} dev node onlink\n\
             neigh add {NODE_UPLINK6} lladdr {n} dev node nud permanent\n\
             route add default via {NODE_UPLINK6} dev node onlink",
            n = mac(2, 0)
        );
        sys::ip(&["-n", &self.node, "-batch", "-"], Some(&node_cfg))?;
        sys::ip(&["-n", &self.world, "-batch", "-"], Some(&world_cfg))?;
        if self.shape == CniShape::PolicyRouting {
            // Every destination looks in the pods' table first, then (no match) in main.
            let table = POD_TABLE.to_string();
            for family in ["-4", "-6"] {
                sys::ip(
                    &[
                        "-n", &self.node, family, "rule", "add", "pref", "100", "lookup", &table,
                    ],
                    None,
                )?;
            }
        }
        Ok(())
    }

    /// Each member's namespace: its addresses and routes via its gateway.
    fn configure_leaves(&self) -> Result<(), LabError> {
        let bridged = self.shape == CniShape::Bridge;
        // On a bridge, every pod reaches the others directly (their addresses and MACs).
        let pods: Vec<(IpAddr, String)> = self
            .members
            .iter()
            .filter(|m| !m.external)
            .enumerate()
            .flat_map(|(i, m)| m.ips.iter().map(move |ip| (*ip, mac(1, i))))
            .collect();
        let (mut pi, mut ei) = (0, 0);
        for m in &self.members {
            let gw_mac = if m.external {
                ei += 1;
                mac(3, ei - 1)
            } else if bridged {
                pi += 1;
                mac(5, 0)
            } else {
                pi += 1;
                mac(0, pi - 1)
            };
            let neighbours: Vec<(IpAddr, String)> = if bridged && !m.external {
                pods.iter()
                    .filter(|(ip, _)| !m.ips.contains(ip))
                    .cloned()
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

    /// The interfaces of the node namespace the XDP program is attached to: every pod's
    /// host-side veth (with `--cni bridge`, its bridge port; never the bridge) and the uplink.
    pub fn xdp_interfaces(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .members
            .iter()
            .filter(|m| !m.external)
            .map(|m| m.host_if.clone())
            .collect();
        v.push(UPLINK.to_string());
        v
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
