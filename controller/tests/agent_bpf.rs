//! `ordnet agent --datapath bpf` end to end, with real TCP connections.
//!
//! A minimal topology of network namespaces (all names carry this process's id): a "node"
//! namespace; three local pod namespaces each joined to it by a veth pair (routed: a /32 route
//! per pod on the node side, as Calico-style CNIs do); a pod of "another node" behind the node's
//! uplink veth; and a management veth pair from the test's own namespace into the node, on whose
//! far side the fake API server listens. The agent binary runs in the node namespace
//! (`nsenter --net`; its pins go to a private bpffs) with `--datapath bpf --uplink`; the test
//! opens TCP connections between the pods and checks which connect and which are dropped,
//! through a policy change, a SIGTERM (pins and enforcement stay), a restart (the pins are
//! adopted: nothing re-attached, no rule set rewritten, no wrong verdict while it happens), a
//! change after the restart, and a pod going away (its attachment is removed). A Service
//! (`shop/db`, ClusterIP DNATed to the db pod by a kube-proxy-style nftables rule in the node
//! namespace) is reached exactly by the sources db's ingress policy admits, at every step.
//!
//! Needs root (bpf, XDP, netns): skipped otherwise, but fails when `CI` is set.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod support;

use ordnet_testsuite::fakeapi::FakeApi;
use serde_json::{Value, json};
use support::{in_netns, root_or_skip, run, serve_greeting};

const NODE: &str = "node-1";
const PORT: u16 = 80;
const LIMIT: Duration = Duration::from_secs(20);
/// The local pods: name, app label, last byte of the address.
const PODS: [(&str, &str, u8); 3] = [("web", "web", 2), ("db", "db", 3), ("client", "client", 4)];
/// The connection-tracking tables of the tests' agents (unless a test sizes them).
const SMALL_CT: [&str; 4] = [
    "--conntrack-entries-v4",
    "2048",
    "--conntrack-entries-v6",
    "1024",
];
/// The node's address on every pod link (the pods' gateway), and a port the node serves there.
const POD_GW: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const NODE_PORT: u16 = 8081;
/// A pod of another node (app `web`), behind the node's uplink.
const FAR: &str = "far";
const FAR_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 9, 9);
const LATE_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 7);
/// A host behind the far pod, which routes to it over a link of MTU [`NARROW_MTU`] (both ends
/// of the path have 1500): a TCP transfer to it needs path MTU discovery, i.e. the far pod's
/// "fragmentation needed" must reach the sender.
const FAR2: &str = "far2";
const FAR2_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 9, 10);
const NARROW_MTU: u32 = 1280;
/// Pods whose links have a jumbo MTU (EKS's 9001, both sides of their veths): native XDP on a
/// veth whose peer's MTU exceeds a page needs a multi-buffer-aware program.
const JUMBO: [&str; 2] = ["web", "client"];
const JUMBO_MTU: u32 = 9001;

/// The CNI shapes test: pods wired by Debian's `bridge` plugin on this bridge (host-local
/// addresses of [`BRIDGE_NET`], MTU [`JUMBO_MTU`]), and one pod whose route is only in a table
/// an `ip rule` chooses.
const BRIDGE: &str = "cni0";
const BRIDGE_NET: &str = "10.216.0.0/24";
const BRIDGED: [&str; 3] = ["b1", "b2", "b3"];
const ROUTED_BY_RULE: &str = "pr";
const PR_IP: Ipv4Addr = Ipv4Addr::new(10, 217, 0, 5);
const PR_TABLE: u32 = 100;
/// The Service of the shapes test: b2 behind it.
const B2_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// The overlay device between the shapes test's two nodes, and a pod of the second node.
const OVERLAY: &str = "flannel.1";
const REMOTE: &str = "r1";
const REMOTE_IP: Ipv4Addr = Ipv4Addr::new(10, 216, 1, 2);
/// An address outside the cluster behind the shapes test's second uplink.
const EXT2: &str = "ext2";
const EXT2_IP: Ipv4Addr = Ipv4Addr::new(10, 219, 1, 2);
/// A Service whose backend is [`REMOTE`] (reached through the overlay).
const R1_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 21);
/// A layer-3 tunnel between the shapes test's two nodes (packets without an Ethernet header, as
/// on IPIP, GRE and WireGuard devices — which this kernel does not have; a TUN device on each
/// node, the test relaying packets between them as a userspace VPN does), a pod of the second
/// node reached only through it, and a Service whose backend it is.
const TUNNEL: &str = "tun-n2";
const REMOTE_TUN: &str = "r2";
const REMOTE_TUN_IP: Ipv4Addr = Ipv4Addr::new(10, 216, 2, 2);
const R2_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 22);
/// IPv6 addresses of db, far and far2 (the node's side of each link is [`GW6`]): path MTU
/// discovery is checked over IPv6 too (1280 is IPv6's minimum MTU).
const DB6: Ipv6Addr = Ipv6Addr::new(0xfd13, 0, 0, 0, 0, 0, 0, 3);
const FAR6: Ipv6Addr = Ipv6Addr::new(0xfd13, 9, 0, 0, 0, 0, 0, 9);
const FAR2_6: Ipv6Addr = Ipv6Addr::new(0xfd13, 9, 0, 0, 0, 0, 0, 0x10);
const GW6: Ipv6Addr = Ipv6Addr::new(0xfd13, 0, 0, 0, 0, 0, 0, 1);
/// The ClusterIP of Service `shop/db` (backend: the db pod), DNATed in the node namespace by a
/// kube-proxy-style nftables rule.
const DB_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// The namespaces and interfaces of one test; removed on drop.
struct Lab {
    /// The start of every name this lab creates.
    prefix: String,
    node: String,
    pods: BTreeMap<String, (String, Ipv4Addr)>,
    /// Pods of this node (the matrix's rows and columns) and of other nodes (rows only).
    locals: Vec<String>,
    remotes: Vec<String>,
    /// More namespaces to delete (other nodes).
    others: Vec<String>,
    root_veth: String,
    api_ip: Ipv4Addr,
    /// The node's side of the management link (the debug API listens there).
    mgmt_ip: Ipv4Addr,
    uplink: String,
    /// The agent's `--uplink` (a name or a pattern).
    uplink_flag: String,
    /// A private bpffs mount (the agent mounts it, it is unmounted on drop).
    bpffs: PathBuf,
    pin_dir: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Lab {
    /// The standard topology: [`PODS`] routed on this node, [`FAR`] behind the uplink (and
    /// [`FAR2`] behind it).
    fn new() -> Lab {
        let mut lab = Lab::base("onb", 214);
        let p = lab.prefix.clone();
        // Local pods behind their host-side veths, and the pod of "another node" behind the
        // uplink: each a /32 route on the node, a gateway route in the pod.
        let members = PODS
            .iter()
            .map(|(name, _, last)| {
                (
                    *name,
                    format!("{p}{}", &name[..1]),
                    Ipv4Addr::new(10, 213, 0, *last),
                )
            })
            .chain([(FAR, lab.uplink.clone(), FAR_IP)]);
        for (name, host, ip) in members {
            lab.plumb(name, &host, ip);
        }
        lab.narrow_link_behind_far();
        lab.ipv6_for_db_far_far2();
        lab.locals = PODS.iter().map(|p| p.0.to_string()).collect();
        lab.remotes = vec![FAR.to_string()];
        lab
    }

    /// The node namespace, its bpffs and the management link to this namespace (where the
    /// fake API server listens); no pods yet. Names start with `tag` and the process id (each
    /// test of this binary has its own tag: they run at once), the management link is a /30 of
    /// `10.NET.0.0/16`.
    fn base(tag: &str, net: u8) -> Lab {
        let id = std::process::id();
        let p = format!("{tag}{id}");
        // A /30 from the process id (the only addresses outside this test's own namespaces).
        let sub = (id % 16384) * 4;
        let api_ip = Ipv4Addr::new(10, net, (sub >> 8) as u8, (sub & 0xff) as u8 + 1);
        let mgmt_ip = Ipv4Addr::new(10, net, (sub >> 8) as u8, (sub & 0xff) as u8 + 2);
        let bpffs = std::env::temp_dir().join(format!("ordnet-agent-bpf-{p}-fs"));
        std::fs::create_dir_all(&bpffs).unwrap();
        ordnet_datapath::sys::ensure_bpffs(&bpffs).unwrap();
        let lab = Lab {
            prefix: p.clone(),
            node: format!("{p}n"),
            pods: BTreeMap::new(),
            locals: Vec::new(),
            remotes: Vec::new(),
            others: Vec::new(),
            root_veth: format!("{p}r"),
            api_ip,
            mgmt_ip,
            uplink: format!("{p}u"),
            uplink_flag: format!("{p}u"),
            pin_dir: bpffs.join("ordnet"),
            bpffs,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let _ = Command::new("ip")
            .args(["link", "del", &lab.root_veth])
            .output();
        let n = lab.node.clone();
        run(&format!("ip netns add {n}"));
        run(&format!("ip -n {n} link set lo up"));
        run(&format!(
            "ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"
        ));
        // The management link: the fake API server listens on its side in this namespace.
        let (r, m) = (&lab.root_veth, format!("{p}m"));
        run(&format!(
            "ip link add {r} type veth peer name {m} netns {n}"
        ));
        run(&format!("ip addr add {api_ip}/30 dev {r}"));
        run(&format!("ip link set {r} up"));
        run(&format!("ip -n {n} addr add {mgmt_ip}/30 dev {m}"));
        run(&format!("ip -n {n} link set {m} up"));
        lab
    }

    /// The CNI shapes topology ([`BRIDGE`], [`BRIDGED`], [`ROUTED_BY_RULE`]); the node's
    /// default route leads to the uplink (a namespace standing for the network outside).
    fn shapes() -> Lab {
        let mut lab = Lab::base("ons", 215);
        let (p, n) = (lab.prefix.clone(), lab.node.clone());
        let outside = format!("{p}o");
        run(&format!("ip netns add {outside}"));
        run(&format!("ip -n {outside} link set lo up"));
        let u = lab.uplink.clone();
        run(&format!(
            "ip -n {n} link add {u} type veth peer name eth0 netns {outside}"
        ));
        run(&format!("ip -n {n} addr add 10.218.0.1/30 dev {u}"));
        run(&format!("ip -n {n} link set {u} up"));
        run(&format!("ip -n {outside} addr add 10.218.0.2/30 dev eth0"));
        run(&format!("ip -n {outside} link set eth0 up"));
        run(&format!("ip -n {n} route add default via 10.218.0.2"));
        lab.overlay_to(&outside);
        lab.tunnel_to(&outside);
        lab.second_uplink();
        let _ = std::fs::remove_dir_all(lab.ipam_dir());
        for name in BRIDGED {
            lab.bridged(name);
        }
        lab.routed_by_rule();
        lab.locals = BRIDGED
            .iter()
            .chain([&ROUTED_BY_RULE])
            .map(|p| p.to_string())
            .collect();
        lab.remotes = vec![REMOTE.to_string(), EXT2.to_string()];
        lab
    }

    /// A flannel-style VXLAN overlay (VNI 1, UDP 8472) to `other`, a second node: each node's
    /// `flannel.1` has its pod network's `.0` address, and the other's pod network is routed
    /// via that address on-link. [`REMOTE`] is a pod address of the second node (on its
    /// `flannel.1`: the test serves it there).
    fn overlay_to(&mut self, other: &str) {
        let n = self.node.clone();
        for (ns, local, remote, own, theirs) in [
            (&n, "10.218.0.1", "10.218.0.2", "10.216.0.0", "10.216.1.0"),
            (
                &other.to_string(),
                "10.218.0.2",
                "10.218.0.1",
                "10.216.1.0",
                "10.216.0.0",
            ),
        ] {
            let dev = if ns == &n {
                self.uplink.clone()
            } else {
                "eth0".into()
            };
            run(&format!(
                "ip -n {ns} link add {OVERLAY} type vxlan id 1 local {local} remote {remote} \
                 dstport 8472 dev {dev}"
            ));
            run(&format!("ip -n {ns} addr add {own}/32 dev {OVERLAY}"));
            run(&format!("ip -n {ns} link set {OVERLAY} up"));
            run(&format!(
                "ip -n {ns} route add {theirs}/24 via {theirs} dev {OVERLAY} onlink"
            ));
        }
        // The second node reaches the rule-routed pod's network through the overlay too.
        run(&format!(
            "ip -n {other} route add 10.217.0.0/24 via 10.216.0.0 dev {OVERLAY} onlink"
        ));
        // [`REMOTE`]: a routed pod of the second node.
        let (ns, host) = (format!("{}r", self.prefix), format!("{}rh", self.prefix));
        run(&format!(
            "ip netns exec {other} sysctl -qw net.ipv4.ip_forward=1"
        ));
        let gw = Ipv4Addr::new(10, 216, 1, 1);
        routed_pod(other, &ns, &host, REMOTE_IP, gw, "", None);
        self.pods.insert(REMOTE.to_string(), (ns, REMOTE_IP));
        self.others.push(other.to_string());
        // Node 2's management link: it reaches the fake API server at [`Lab::api_ip`] in the
        // test's namespace (which owns that address) over its own pair.
        let (root, m) = (format!("{}s", self.prefix), format!("{}m2", self.prefix));
        let (a2, m2) = node2_mgmt(self.api_ip);
        let _ = Command::new("ip").args(["link", "del", &root]).output();
        run(&format!(
            "ip link add {root} type veth peer name {m} netns {other}"
        ));
        run(&format!("ip addr add {a2}/30 dev {root}"));
        run(&format!("ip link set {root} up"));
        run(&format!("ip -n {other} addr add {m2}/30 dev {m}"));
        run(&format!("ip -n {other} link set {m} up"));
        run(&format!(
            "ip -n {other} route add {}/32 via {a2}",
            self.api_ip
        ));
    }

    /// A layer-3 tunnel ([`TUNNEL`]) to `other`: a TUN device on each node, the test relaying
    /// packets between them; [`REMOTE_TUN`], a routed pod of `other`, is reached through it
    /// both ways (its replies are routed back by source).
    fn tunnel_to(&mut self, other: &str) {
        let n = self.node.clone();
        let mut ends = Vec::new();
        for ns in [n.as_str(), other] {
            run(&format!("ip -n {ns} tuntap add mode tun name {TUNNEL}"));
            let ns_owned = ns.to_string();
            ends.push(in_netns(&ns_owned, || open_tun(TUNNEL)));
            run(&format!("ip -n {ns} link set {TUNNEL} up"));
            run(&format!(
                "ip netns exec {ns} sysctl -qw net.ipv4.conf.all.rp_filter=0 \
                 net.ipv4.conf.{TUNNEL}.rp_filter=0"
            ));
        }
        let (a, b) = (ends.remove(0), ends.remove(0));
        relay(a.try_clone().unwrap(), b.try_clone().unwrap());
        relay(b, a);
        run(&format!("ip -n {n} route add 10.216.2.0/24 dev {TUNNEL}"));
        run(&format!(
            "ip -n {other} rule add from 10.216.2.0/24 table 220"
        ));
        for net in ["10.216.0.0/24", "10.217.0.0/24"] {
            run(&format!(
                "ip -n {other} route add {net} dev {TUNNEL} table 220"
            ));
        }
        let (ns, host) = (format!("{}t", self.prefix), format!("{}th", self.prefix));
        let gw = Ipv4Addr::new(10, 216, 2, 1);
        routed_pod(other, &ns, &host, REMOTE_TUN_IP, gw, "", None);
        self.pods
            .insert(REMOTE_TUN.to_string(), (ns, REMOTE_TUN_IP));
    }

    /// The fake API server on the management link (served by `runtime`), a kubeconfig for it,
    /// and the namespace `shop`.
    fn api(&self, runtime: &tokio::runtime::Runtime) -> (FakeApi, PathBuf) {
        let api = runtime
            .block_on(FakeApi::start_on(SocketAddr::from((self.api_ip, 0))))
            .unwrap();
        let kubeconfig = self.bpffs.with_extension("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig_yaml()).unwrap();
        api.create(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "shop", "labels": {"name": "shop"}}}))
            .unwrap();
        (api, kubeconfig)
    }

    /// A second uplink, `<uplink>2`, to one more namespace owning [`EXT2_IP`] (an address
    /// outside the cluster reached through it); the agent is given `--uplink <uplink>*`, a
    /// pattern matching both.
    fn second_uplink(&mut self) {
        let (n, u2) = (self.node.clone(), format!("{}2", self.uplink));
        let ns = format!("{}e", self.prefix);
        run(&format!("ip netns add {ns}"));
        run(&format!("ip -n {ns} link set lo up"));
        run(&format!(
            "ip -n {n} link add {u2} type veth peer name eth0 netns {ns}"
        ));
        run(&format!("ip -n {n} addr add 10.219.0.1/30 dev {u2}"));
        run(&format!("ip -n {n} link set {u2} up"));
        run(&format!("ip -n {ns} addr add 10.219.0.2/30 dev eth0"));
        run(&format!("ip -n {ns} addr add {EXT2_IP}/32 dev eth0"));
        run(&format!("ip -n {ns} link set eth0 up"));
        run(&format!(
            "ip -n {ns} route add default via 10.219.0.1 src {EXT2_IP}"
        ));
        run(&format!("ip -n {n} route add {EXT2_IP}/32 via 10.219.0.2"));
        self.pods.insert(EXT2.to_string(), (ns, EXT2_IP));
        // A third "uplink" whose driver has no native XDP (ifb): generic mode, reported.
        run(&format!("ip -n {n} link add {}3 type ifb", self.uplink));
        run(&format!("ip -n {n} link set {}3 up", self.uplink));
        self.uplink_flag = format!("{}*", self.uplink);
    }

    /// Where host-local keeps the shapes test's address leases.
    fn ipam_dir(&self) -> PathBuf {
        self.bpffs.with_extension("ipam")
    }

    /// A pod attached to [`BRIDGE`] by Debian's `bridge` CNI plugin (run in the node
    /// namespace, as a runtime would); returns its host-side port.
    fn bridged(&mut self, name: &str) -> String {
        let id = std::process::id();
        let ns = format!("{}{name}", self.prefix);
        run(&format!("ip netns add {ns}"));
        run(&format!("ip -n {ns} link set lo up"));
        let conf = json!({"cniVersion": "1.0.0", "name": "ordnet-shapes", "type": "bridge",
            "bridge": BRIDGE, "isDefaultGateway": true, "ipMasq": false, "hairpinMode": true,
            "mtu": JUMBO_MTU,
            "ipam": {"type": "host-local", "dataDir": self.ipam_dir(),
                "ranges": [[{"subnet": BRIDGE_NET}]]}});
        let mut plugin = Command::new("ip")
            .args(["netns", "exec", &self.node, "/usr/lib/cni/bridge"])
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", format!("ordnet-test-{id}-{name}"))
            .env("CNI_NETNS", format!("/var/run/netns/{ns}"))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/usr/lib/cni")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("/usr/lib/cni/bridge (containernetworking-plugins; scripts/setup installs it)");
        plugin
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        let out = plugin.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "bridge plugin ADD {name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let result: Value = serde_json::from_slice(&out.stdout).unwrap();
        let ip: Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {result}"));
        let port = result["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["sandbox"].is_null() && i["name"] != BRIDGE)
            .and_then(|i| i["name"].as_str())
            .unwrap_or_else(|| panic!("no host-side veth in {result}"))
            .to_string();
        self.pods.insert(name.to_string(), (ns, ip));
        port
    }

    /// [`ROUTED_BY_RULE`]: a routed veth whose /32 route is only in table [`PR_TABLE`],
    /// which an `ip rule` looks up for its address (the main table has only the default route
    /// to it).
    fn routed_by_rule(&mut self) {
        let (p, n) = (self.prefix.clone(), self.node.clone());
        let (ns, host) = (format!("{p}q"), format!("{p}p"));
        let gw = Ipv4Addr::new(10, 217, 0, 1);
        routed_pod(
            &n,
            &ns,
            &host,
            PR_IP,
            gw,
            &format!(" table {PR_TABLE}"),
            None,
        );
        run(&format!(
            "ip -n {n} rule add to {PR_IP}/32 lookup {PR_TABLE} priority 100"
        ));
        self.pods.insert(ROUTED_BY_RULE.to_string(), (ns, PR_IP));
    }

    /// A pod's namespace behind its host-side veth `host`: a /32 route on the node, a gateway
    /// route in the pod.
    fn plumb(&mut self, name: &str, host: &str, ip: Ipv4Addr) {
        let ns = format!("{}{}", self.prefix, &name[..1]);
        self.pods.insert(name.to_string(), (ns.clone(), ip));
        let gw = POD_GW;
        let mtu = JUMBO.contains(&name).then_some(JUMBO_MTU);
        routed_pod(&self.node, &ns, host, ip, gw, "", mtu);
    }

    /// [`FAR2`] behind the far pod, which forwards to it over a veth of MTU [`NARROW_MTU`]
    /// (far2's own side has 1500, so it announces a 1460-byte MSS).
    fn narrow_link_behind_far(&mut self) {
        let ns = format!("{}x", self.prefix);
        let far = self.pods[FAR].0.clone();
        self.pods.insert(FAR2.to_string(), (ns.clone(), FAR2_IP));
        run(&format!("ip netns add {ns}"));
        run(&format!("ip -n {ns} link set lo up"));
        run(&format!(
            "ip netns exec {far} sysctl -qw net.ipv4.ip_forward=1"
        ));
        run(&format!(
            "ip -n {far} link add narrow type veth peer name eth0 netns {ns}"
        ));
        run(&format!("ip -n {far} link set narrow mtu {NARROW_MTU} up"));
        run(&format!("ip -n {far} route add {FAR2_IP}/32 dev narrow"));
        run(&format!("ip -n {ns} addr add {FAR2_IP}/32 dev eth0"));
        run(&format!("ip -n {ns} link set eth0 up"));
        run(&format!("ip -n {ns} route add {FAR_IP}/32 dev eth0"));
        run(&format!("ip -n {ns} route add default via {FAR_IP}"));
        run(&format!(
            "ip -n {} route add {FAR2_IP}/32 via {FAR_IP} dev {} onlink",
            self.node, self.uplink
        ));
    }

    /// IPv6 beside IPv4 for db, far and far2, on the same links and routes (addresses without
    /// duplicate address detection: usable at once).
    fn ipv6_for_db_far_far2(&mut self) {
        let n = self.node.clone();
        let [db, far, far2] = ["db", FAR, FAR2].map(|p| self.pods[p].0.clone());
        let db_host = format!("{}d", self.prefix);
        for ns in [&n, &far] {
            run(&format!(
                "ip netns exec {ns} sysctl -qw net.ipv6.conf.all.forwarding=1"
            ));
        }
        for (ns, host, ip) in [(&db, &db_host, DB6), (&far, &self.uplink, FAR6)] {
            run(&format!("ip -n {n} addr add {GW6}/128 dev {host} nodad"));
            run(&format!("ip -n {n} -6 route add {ip}/128 dev {host}"));
            run(&format!("ip -n {ns} addr add {ip}/128 dev eth0 nodad"));
            run(&format!("ip -n {ns} -6 route add {GW6}/128 dev eth0"));
            run(&format!(
                "ip -n {ns} -6 route add default via {GW6} dev eth0"
            ));
        }
        // far answers far2's neighbour solicitations for its address on the narrow link too
        // (IPv6 neighbour discovery answers only for the interface's own addresses).
        run(&format!("ip -n {far} addr add {FAR6}/128 dev narrow nodad"));
        run(&format!("ip -n {far} -6 route add {FAR2_6}/128 dev narrow"));
        run(&format!(
            "ip -n {far2} addr add {FAR2_6}/128 dev eth0 nodad"
        ));
        run(&format!("ip -n {far2} -6 route add {FAR6}/128 dev eth0"));
        run(&format!(
            "ip -n {far2} -6 route add default via {FAR6} dev eth0"
        ));
        run(&format!(
            "ip -n {n} -6 route add {FAR2_6}/128 via {FAR6} dev {}",
            self.uplink
        ));
    }

    /// Sends a TCP ACK of no connection (a raw socket; the checksum is left 0: the datapath
    /// decides before anyone checks it) from `from` to `to`:`port`.
    fn send_stray_ack(&self, from: &str, to: &str, port: u16) {
        use socket2::{Domain, Protocol, Socket, Type};
        let (from_ns, _) = self.pods[from].clone();
        let (_, to_ip) = self.pods[to].clone();
        in_netns(&from_ns, move || {
            let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::TCP)).unwrap();
            let mut tcp = [0u8; 20];
            tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
            tcp[2..4].copy_from_slice(&port.to_be_bytes());
            tcp[12] = 5 << 4;
            tcp[13] = 0x10;
            tcp[14..16].copy_from_slice(&1024u16.to_be_bytes());
            s.send_to(&tcp, &SocketAddr::from((to_ip, 0)).into())
                .unwrap();
        });
    }

    /// Whether `from` gets the reply of an ICMP echo request to `to` (a ping socket) within 1 s.
    fn pings(&self, from: &str, to: Ipv4Addr) -> bool {
        let (ns, _) = self.pods[from].clone();
        ping_from(&ns, to)
    }

    /// Traffic between client (isolated for egress: pods only) and its node: the node's
    /// connections and pings reach client and are answered (the node's own flows are tracked
    /// at TC: only their replies are exempt from client's egress policy); client's own
    /// connection to the node is denied by its egress policy; web's (not isolated) connects.
    fn expect_node(&self, step: &str) {
        let retry = |what: &str, check: &dyn Fn() -> bool| {
            assert!((0..3).any(|_| check()), "{step}: {what} (3 attempts)");
        };
        retry("the node connects to client", &|| {
            self.node_connects("client")
        });
        retry("the node's ping of client is answered", &|| {
            ping_from(&self.node, self.pods["client"].1)
        });
        retry("control: web connects to its node", &|| {
            self.connects_to_node("web")
        });
        assert!(
            !self.connects_to_node("client"),
            "{step}: client (egress to pods only) connected to its node"
        );
    }

    /// A TCP connection from `from` to a server in `to` on `port` (this test's own listener),
    /// accepted and idle: [`Held::pushed`] later sends from the server's side unasked.
    fn hold(&self, from: &str, to: &str, port: u16) -> Held {
        let (from_ns, _) = self.pods[from].clone();
        let (to_ns, to_ip) = self.pods[to].clone();
        let listener = in_netns(&to_ns, move || {
            TcpListener::bind(SocketAddrV4::new(to_ip, port)).unwrap()
        });
        let client = in_netns(&from_ns, move || {
            TcpStream::connect_timeout(&SocketAddr::from((to_ip, port)), Duration::from_secs(2))
                .unwrap()
        });
        let (server, _) = listener.accept().unwrap();
        client
            .set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        Held { client, server }
    }

    /// Whether the node connects to `to`'s port 80 (and reads its name) within 700 ms.
    fn node_connects(&self, to: &str) -> bool {
        let (_, ip) = self.pods[to];
        let want = to.to_string();
        in_netns(&self.node, move || {
            let Ok(mut s) = TcpStream::connect_timeout(
                &SocketAddr::from((ip, PORT)),
                Duration::from_millis(700),
            ) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(700)));
            let mut got = String::new();
            let _ = s.read_to_string(&mut got);
            got == want
        })
    }

    /// Whether `from` connects to the node's [`NODE_PORT`] (on the pods' gateway address) and
    /// reads "node" within 700 ms.
    fn connects_to_node(&self, from: &str) -> bool {
        let (ns, _) = self.pods[from].clone();
        in_netns(&ns, move || {
            let addr = SocketAddr::from((POD_GW, NODE_PORT));
            let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(700)) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(700)));
            let mut got = String::new();
            let _ = s.read_to_string(&mut got);
            got == "node"
        })
    }

    /// Whether an echo reply nobody asked for (identifier 0x4242, from a raw socket in `from`)
    /// reaches a raw ICMP socket in `to` within 700 ms.
    fn unsolicited_reply_arrives(&self, from: &str, to: &str) -> bool {
        use socket2::{Domain, Protocol, Socket, Type};
        let (from_ns, _) = self.pods[from].clone();
        let (to_ns, to_ip) = self.pods[to].clone();
        let listener = in_netns(&to_ns, || {
            let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            s
        });
        in_netns(&from_ns, move || {
            let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4)).unwrap();
            let mut reply = [0u8, 0, 0, 0, 0x42, 0x42, 0, 1, b'o', b'r', b'd', 0];
            let sum = ordnet_datapath::common::craft::internet_checksum(&reply);
            reply[2..4].copy_from_slice(&sum.to_be_bytes());
            s.send_to(&reply, &SocketAddr::from((to_ip, 0)).into())
                .unwrap();
        });
        let deadline = Instant::now() + Duration::from_millis(700);
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 256];
        while Instant::now() < deadline {
            let Ok(n) = listener.recv(&mut buf) else {
                continue;
            };
            // SAFETY: `recv` initialised the first `n` bytes.
            let got: Vec<u8> = buf[..n]
                .iter()
                .map(|b| unsafe { b.assume_init() })
                .collect();
            let ihl = usize::from(got.first().copied().unwrap_or(0) & 0x0f) * 4;
            if got.len() >= ihl + 8 && got[ihl] == 0 && got[ihl + 4..ihl + 6] == [0x42, 0x42] {
                return true;
            }
        }
        false
    }

    /// Whether a UDP datagram from `from` to a closed port of `to` comes back refused (the
    /// peer's ICMP port unreachable reached the sender) within 2 s, rather than unanswered.
    fn udp_refused(&self, from: &str, to: Ipv4Addr) -> bool {
        let (ns, _) = self.pods[from].clone();
        in_netns(&ns, move || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(SocketAddr::from((to, 9))).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let _ = s.send(b"ordnet");
            matches!(s.recv(&mut [0u8; 16]), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
        })
    }

    /// Sends `bytes` from `from` to `to` (at `to_ip`:`port`) over TCP and returns what the
    /// receiver counted and the sender's maximum segment size at the end, or why it failed (a
    /// transfer whose path MTU is never learned stalls).
    fn transfer(
        &self,
        from: &str,
        to: &str,
        to_ip: IpAddr,
        port: u16,
        bytes: usize,
    ) -> Result<(usize, u32), String> {
        let (to_ns, _) = self.pods[to].clone();
        let listener = in_netns(&to_ns, move || TcpListener::bind((to_ip, port)).unwrap());
        let server = std::thread::spawn(move || -> std::io::Result<()> {
            // Not forever: a client that never connects must fail the test, not hang it.
            listener.set_nonblocking(true)?;
            let deadline = std::time::Instant::now() + Duration::from_secs(15);
            let mut s = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if std::time::Instant::now() > deadline {
                            return Err(e);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(e),
                }
            };
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(Duration::from_secs(15)))?;
            let mut total = 0usize;
            let mut buf = vec![0u8; 65536];
            loop {
                match s.read(&mut buf)? {
                    0 => break,
                    n => total += n,
                }
            }
            s.write_all(total.to_string().as_bytes())
        });
        let (ns, _) = self.pods[from].clone();
        let sent = in_netns(&ns, move || -> std::io::Result<(String, u32)> {
            let mut s = TcpStream::connect_timeout(
                &SocketAddr::from((to_ip, port)),
                Duration::from_secs(2),
            )?;
            s.set_write_timeout(Some(Duration::from_secs(10)))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(&vec![0x5a; bytes])?;
            s.shutdown(std::net::Shutdown::Write)?;
            let mut got = String::new();
            s.read_to_string(&mut got)?;
            Ok((got, send_mss(&s)))
        });
        let _ = server.join();
        let (got, mss) = sent.map_err(|e| format!("{from} -> {to}: {e}"))?;
        let n = got
            .parse()
            .map_err(|_| format!("{from} -> {to}: it answered {got:?}"))?;
        Ok((n, mss))
    }

    /// A transfer of a few MB between two pods whose links have MTU [`JUMBO_MTU`], where
    /// policy allows it (web -> client; client is not isolated), goes at full size: segments
    /// of the link's MTU, no path MTU learned below it.
    fn expect_jumbo(&self, step: &str) {
        let (_, client) = self.pods["client"];
        let bytes = 8 << 20;
        let (got, mss) = self
            .transfer("web", "client", client.into(), 5002, bytes)
            .unwrap_or_else(|e| panic!("{step}: jumbo transfer: {e}"));
        assert_eq!(got, bytes, "{step}: jumbo transfer");
        assert!(
            mss > 8800,
            "{step}: web sent segments of {mss} bytes to client over MTU {JUMBO_MTU} links"
        );
        let (web_ns, _) = &self.pods["web"];
        let route = Command::new("ip")
            .args(["-n", web_ns, "route", "get", &client.to_string()])
            .output()
            .unwrap();
        let route = String::from_utf8_lossy(&route.stdout);
        assert!(
            !route.contains(" mtu "),
            "{step}: web learned a smaller path MTU to client: {route}"
        );
    }

    /// ICMP into db, isolated for ingress (TCP/80 from web only, so no ICMP from anyone):
    /// replies and errors that belong to db's own flows pass, everything else does not.
    fn expect_icmp(&self, step: &str) {
        let (_, db) = self.pods["db"];
        let retry = |what: &str, check: &dyn Fn() -> bool| {
            assert!((0..3).any(|_| check()), "{step}: {what} (3 attempts)");
        };
        retry("db's ping of far is answered", &|| self.pings("db", FAR_IP));
        assert!(
            !self.pings("far", db),
            "{step}: far's ping of db is answered"
        );
        retry(
            "control: an unsolicited echo reply reaches web (not isolated)",
            &|| self.unsolicited_reply_arrives("far", "web"),
        );
        assert!(
            !self.unsolicited_reply_arrives("far", "db"),
            "{step}: an unsolicited echo reply reached db"
        );
        retry("db's UDP to a closed port of far is refused", &|| {
            self.udp_refused("db", FAR_IP)
        });
        let bytes = 4 << 20;
        for to in [IpAddr::from(FAR2_IP), IpAddr::from(FAR2_6)] {
            assert_eq!(
                self.transfer("db", FAR2, to, 5001, bytes).map(|(n, _)| n),
                Ok(bytes),
                "{step}: a transfer from db to {to} through a {NARROW_MTU}-byte link (path MTU \
                 discovery)"
            );
            // It needed the far pod's "fragmentation needed" / "packet too big": db's kernel
            // learned the path MTU.
            let (db_ns, _) = &self.pods["db"];
            let route = Command::new("ip")
                .args(["-n", db_ns, "route", "get", &to.to_string()])
                .output()
                .unwrap();
            let route = String::from_utf8_lossy(&route.stdout);
            assert!(
                route.contains(&format!("mtu {NARROW_MTU}")),
                "{step}: db did not learn the path MTU to {to}: {route}"
            );
        }
    }

    /// DNAT at prerouting (pod and uplink traffic) and output (the node's own).
    fn kube_proxy(&self) {
        let (_, db) = self.pods["db"];
        let rules = format!(
            "table ip kube-proxy {{\n\
             chain services {{ ip daddr {DB_VIP} tcp dport {PORT} dnat to {db}:{PORT}; }}\n\
             chain nat-prerouting {{ type nat hook prerouting priority dstnat; jump services; }}\n\
             chain nat-output {{ type nat hook output priority -100; jump services; }}\n\
             }}\n"
        );
        self.nft(&rules);
    }

    /// Loads an nftables ruleset in the node namespace.
    fn nft(&self, rules: &str) {
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &self.node, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("nft (scripts/setup installs nftables)");
        nft.stdin
            .take()
            .unwrap()
            .write_all(rules.as_bytes())
            .unwrap();
        assert!(nft.wait().unwrap().success(), "nft -f: {rules}");
    }

    /// Whether `from` reaches the db Service at its ClusterIP (and the db pod answers).
    fn connects_to_service(&self, from: &str) -> bool {
        self.reaches(from, DB_VIP, "db")
    }

    /// Whether `from` connects to `vip`'s port 80 and pod `want` answers, within 700 ms.
    fn reaches(&self, from: &str, vip: Ipv4Addr, want: &str) -> bool {
        let (ns, _) = self.pods[from].clone();
        let want = want.to_string();
        in_netns(&ns, move || {
            let addr = SocketAddr::from((vip, PORT));
            let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(700)) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(700)));
            let mut got = String::new();
            let _ = s.read_to_string(&mut got);
            got == want
        })
    }

    /// Waits until exactly `allowed` of the bridged pods connect to [`REMOTE`] (on the other
    /// node).
    fn expect_to_remote(&self, step: &str, allowed: &[&str]) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let got: Vec<&str> = BRIDGED
                .iter()
                .copied()
                .filter(|f| self.connects(f, REMOTE))
                .collect();
            if got == allowed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{step}: to {REMOTE} on node 2 from {got:?}, want {allowed:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until exactly `allowed` of `sources` reach `vip` (answered by `want`).
    fn expect_reach(
        &self,
        step: &str,
        sources: &[&str],
        vip: Ipv4Addr,
        want: &str,
        allowed: &[&str],
    ) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let got: Vec<&str> = sources
                .iter()
                .copied()
                .filter(|f| self.reaches(f, vip, want))
                .collect();
            if got == allowed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{step}: through {vip} reached {want} from {got:?}, want {allowed:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until exactly the sources in `allowed` (of web, client, far) reach the Service.
    fn expect_service(&self, step: &str, allowed: &[&str]) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let got: Vec<&str> = ["client", "far", "web"]
                .into_iter()
                .filter(|f| self.connects_to_service(f))
                .collect();
            if got == allowed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{step}: through svc shop/db ({DB_VIP}) reached from {got:?}, want {allowed:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `name`'s host-side interface in the node namespace.
    fn host_iface(&self, pod: &str) -> String {
        format!("{}{}", self.prefix, &pod[..1])
    }

    /// A TCP server on port 80 in every pod: it answers each connection with the pod's name;
    /// and one on the node's [`NODE_PORT`] (every address) answering "node".
    fn serve(&self) {
        let listener = in_netns(&self.node, || {
            TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, NODE_PORT)).unwrap()
        });
        serve_greeting(listener, self.stop.clone(), b"node".to_vec());
        for (name, (ns, ip)) in &self.pods {
            let ip = *ip;
            let listener = in_netns(ns, move || {
                TcpListener::bind(SocketAddrV4::new(ip, PORT)).unwrap()
            });
            serve_greeting(listener, self.stop.clone(), name.as_bytes().to_vec());
        }
    }

    /// Whether `from` connects to `to`'s port 80 (and reads its name) within 700 ms.
    fn connects(&self, from: &str, to: &str) -> bool {
        let (ns, _) = self.pods[from].clone();
        let (_, ip) = self.pods[to];
        let want = to.to_string();
        in_netns(&ns, move || {
            let addr = SocketAddr::from((ip, PORT));
            let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(700)) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(700)));
            let mut got = String::new();
            let _ = s.read_to_string(&mut got);
            got == want
        })
    }

    /// Every pair of [`Lab::matrix_keys`]: whether it connects.
    fn matrix(&self) -> BTreeMap<(String, String), bool> {
        self.matrix_keys()
            .into_iter()
            .map(|(from, to)| {
                let ok = self.connects(&from, &to);
                ((from, to), ok)
            })
            .collect()
    }

    /// Waits until the pairs in `denied` are dropped and every other pair of
    /// [`Lab::matrix_keys`] connects.
    fn expect(&self, step: &str, denied: &[(&str, &str)]) {
        let want: BTreeMap<(String, String), bool> = self
            .matrix_keys()
            .into_iter()
            .map(|k| {
                let d = denied.iter().any(|(a, b)| k.0 == *a && k.1 == *b);
                (k, !d)
            })
            .collect();
        let deadline = Instant::now() + LIMIT;
        loop {
            let got = self.matrix();
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{step}: connectivity\n  got  {got:?}\n  want {want:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every ordered pair of local pods, and each remote pod to each local pod.
    fn matrix_keys(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for from in self.locals.iter().chain(&self.remotes) {
            for to in self.locals.iter().filter(|t| *t != from) {
                out.push((from.clone(), to.clone()));
            }
        }
        out
    }

    fn pinned_links(&self) -> Vec<String> {
        self.pinned("links")
    }

    fn pinned(&self, dir: &str) -> Vec<String> {
        support::pinned_links(&self.pin_dir, dir)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        if self.pin_dir.exists() {
            let _ = ordnet_datapath::Datapath::remove_pins(&self.pin_dir);
        }
        if let Ok(c) = std::ffi::CString::new(self.bpffs.as_os_str().as_encoded_bytes()) {
            // SAFETY: a valid C string.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.bpffs);
        let _ = std::fs::remove_dir_all(self.ipam_dir());
        let _ = std::fs::remove_file(self.bpffs.with_extension("kubeconfig"));
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_veth])
            .output();
        for ns in self.pods.values().map(|(ns, _)| ns).chain(&self.others) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.node])
            .output();
    }
}

/// An idle TCP connection ([`Lab::hold`]).
struct Held {
    client: TcpStream,
    server: TcpStream,
}

impl Held {
    /// Whether a byte the server sends unasked reaches the client within 1.5 s (its tracking
    /// entry is there: the client's side may be isolated for ingress).
    fn pushed(&mut self) -> bool {
        if self.server.write_all(b"p").is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        matches!(self.client.read(&mut b), Ok(1))
    }
}

/// The agent binary in the node namespace.
struct Agent {
    child: Child,
    debug: SocketAddr,
    lines: mpsc::Receiver<String>,
}

/// Where an agent runs: its node's namespace and name, `--uplink`, the address of its debug API,
/// its pin root.
struct Spot<'a> {
    netns: &'a str,
    node: &'a str,
    uplink: &'a str,
    debug_ip: Ipv4Addr,
    pin_dir: &'a Path,
    /// More arguments.
    extra: &'a [&'a str],
}

impl Agent {
    fn start(lab: &Lab, kubeconfig: &Path) -> Agent {
        Agent::start_with(lab, kubeconfig, &[])
    }

    /// [`Agent::start`] with more arguments.
    fn start_with(lab: &Lab, kubeconfig: &Path, extra: &[&str]) -> Agent {
        // Small connection-tracking tables unless `extra` sizes them.
        let mut args: Vec<&str> = extra.to_vec();
        if !extra.contains(&"--conntrack-entries-v4") {
            args.extend(SMALL_CT);
        }
        let spot = Spot {
            netns: &lab.node,
            node: NODE,
            uplink: &lab.uplink_flag,
            debug_ip: lab.mgmt_ip,
            pin_dir: &lab.pin_dir,
            extra: &args,
        };
        Agent::start_at(&spot, kubeconfig)
    }

    fn start_at(spot: &Spot, kubeconfig: &Path) -> Agent {
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", spot.netns))
            .arg(env!("CARGO_BIN_EXE_ordnet"))
            .args([
                "agent",
                "--node",
                spot.node,
                "--datapath",
                "bpf",
                "--uplink",
            ])
            .arg(spot.uplink)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--debug-addr")
            .arg(format!("{}:0", spot.debug_ip))
            .args(["--metrics-addr", "none", "--cni-socket", "none"])
            // Upkeep only on netlink events (and hourly): the test sees them work.
            .args(["--upkeep-interval", "3600"])
            .args(spot.extra)
            .env("ORDNET_PIN_DIR", spot.pin_dir)
            .env("POD_NAMESPACE", "ordnet-system")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[agent] {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + LIMIT;
        let debug = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = lines
                .recv_timeout(left)
                .expect("the agent printed its debug address");
            // The `agent started` log line: `... debug_api=http://ADDR ...`.
            if let Some(rest) = line.split("debug_api=http://").nth(1) {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        Agent {
            child,
            debug,
            lines,
        }
    }

    /// [`Agent::start`], then waits until it is ready.
    fn start_ready(lab: &Lab, kubeconfig: &Path) -> Agent {
        let agent = Agent::start(lab, kubeconfig);
        agent.wait_ready();
        agent
    }

    fn get(&self, path: &str) -> (u16, String) {
        let Ok(mut s) = TcpStream::connect_timeout(&self.debug, Duration::from_secs(2)) else {
            return (0, String::new());
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"
        );
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (code, body)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + LIMIT;
        while self.get("/readyz").0 != 200 {
            assert!(Instant::now() < deadline, "the agent did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A metric's value (the first sample whose line starts with `name`) as of the agent's last
    /// programming or upkeep, including one under way: `/metrics` answers at once, so it is read
    /// after a `/v1/matrix`, which reads the engine and the datapath and so waits for them (an
    /// attachment the test saw may belong to a batch that has not recorded its sizes yet).
    fn metric(&self, name: &str) -> f64 {
        let _ = self.get("/v1/matrix");
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
    }

    /// SIGTERM; waits for exit 0.
    fn terminate(mut self) {
        // SAFETY: a child of this process.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "agent exit: {status}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        while self.lines.try_recv().is_ok() {}
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The agent's matrix (decided over the kernel datapath's userspace mirror of its maps) says
/// what the connections saw: every pair of [`Lab::matrix_keys`] is allowed unless `denied`
/// (the remote pod is asked for by address: the ingress side of its flows is this node's).
fn agent_matrix_agrees(lab: &Lab, agent: &Agent, step: &str, denied: &[(&str, &str)]) {
    let (code, m) = agent.get(&format!("/v1/matrix?port={PORT}&external={FAR_IP}"));
    assert_eq!(code, 200, "{step}: {m}");
    let m: Value = serde_json::from_str(&m).unwrap();
    let name = |pod: &str| {
        if pod == FAR {
            FAR_IP.to_string()
        } else {
            format!("shop/{pod}")
        }
    };
    for (from, to) in lab.matrix_keys() {
        let got = m["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["from"] == name(&from) && r["to"] == name(&to))
            .unwrap_or_else(|| panic!("{step}: no {from} -> {to} in {m}"))["verdict"]
            .clone();
        let want = if denied.iter().any(|(a, b)| *a == from && *b == to) {
            "deny"
        } else {
            "allow"
        };
        assert_eq!(got, want, "{step}: the agent's matrix, {from} -> {to}");
    }
    // The Service column: judged by its backend, db.
    for (from, _, _) in PODS.iter().chain([&(FAR, "", 0)]) {
        if *from == "db" {
            continue;
        }
        let got = m["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["from"] == name(from) && r["to"] == "svc:shop/db")
            .unwrap_or_else(|| panic!("{step}: no {from} -> svc:shop/db in {m}"))["verdict"]
            .clone();
        let want = if denied.iter().any(|(a, b)| a == from && *b == "db") {
            "deny"
        } else {
            "allow"
        };
        assert_eq!(
            got, want,
            "{step}: the agent's matrix, {from} -> svc:shop/db"
        );
    }
}

/// The agent's verdict events (`/v1/observe`) for the probes of `pairs` (local pods, TCP
/// `PORT`, allowed or not): each pair's flows are there, with the verdict the probe saw, and
/// each judged side names exactly what `/v1/trace` names for that flow (the key and its rules,
/// or the default and the policies that isolate), attributed at the revision the kernel
/// judged with.
fn agent_observe_agrees(agent: &Agent, step: &str, pairs: &[(&str, &str, bool)]) {
    for (from, to, allowed) in pairs {
        let (src, dst) = (format!("shop/{from}"), format!("shop/{to}"));
        let verdict = if *allowed { "allow" } else { "deny" };
        let mut found = None;
        for _ in 0..100 {
            let (code, page) = agent.get(&format!(
                "/v1/observe?last=1000&output=json&pod={src}&verdict={verdict}&port={PORT}&protocol=TCP"
            ));
            assert_eq!(code, 200, "{step}: {page}");
            let page: Value = serde_json::from_str(&page).unwrap();
            found = page["records"]
                .as_array()
                .unwrap()
                .iter()
                .rev()
                .find(|r| r["srcPod"] == src && r["dstPod"] == dst)
                .cloned();
            if found.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let r = found.unwrap_or_else(|| panic!("{step}: no {verdict} event {src} -> {dst}"));
        assert_eq!(r["event"]["allowed"], *allowed, "{step}: {r:#}");
        assert_eq!(r["attribution"], "exact", "{step}: {src} -> {dst}: {r:#}");
        let (code, t) = agent.get(&format!(
            "/v1/trace?from={src}&to={dst}&port={PORT}&output=json"
        ));
        assert_eq!(code, 200, "{step}: {t}");
        let t: Value = serde_json::from_str(&t).unwrap();
        for side in ["egress", "ingress"] {
            assert_eq!(
                r[side], t[side],
                "{step}: {src} -> {dst}: the event's {side} vs trace's"
            );
        }
    }
}

/// The per-rule counters (`/v1/counters`, `ordnet observe --counters`) after `client -> db`
/// was allowed by db-ingress's rule and `web -> db` denied by db's ingress default: both
/// counted, in JSON and in the text.
fn agent_counters_agree(agent: &Agent, step: &str) {
    let (code, body) = agent.get("/v1/counters?output=json");
    assert_eq!(code, 200, "{step}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let rules = v["rules"].as_array().expect("rules");
    let find = |pred: &dyn Fn(&Value) -> bool| {
        rules
            .iter()
            .find(|r| pred(&r["rule"]))
            .cloned()
            .unwrap_or_else(|| panic!("{step}: not in {body}"))
    };
    let allow = find(&|r| {
        r["kind"] == "rule"
            && r["name"] == "db-ingress"
            && r["direction"] == "ingress"
            && r["index"] == 0
    });
    assert!(
        allow["flowsAllowed"].as_u64().unwrap() >= 1,
        "{step}: {allow}"
    );
    let deny =
        find(&|r| r["kind"] == "default" && r["direction"] == "ingress" && r["allow"] == false);
    let (flows, packets) = (
        deny["flowsDenied"].as_u64().unwrap(),
        deny["packetsDenied"].as_u64().unwrap(),
    );
    assert!(flows >= 1 && packets >= flows, "{step}: {deny}");
    let (code, text) = agent.get("/v1/counters?output=text&policy=shop/db-ingress");
    assert_eq!(code, 200, "{step}: {text}");
    assert!(
        text.contains("NetworkPolicy shop/db-ingress ingress rule 0") && !text.contains("default"),
        "{step}: {text}"
    );
}

/// The node's traffic report (its ConfigMap) counts what client-not-to-web's rule denied since
/// the agent started, and the status writer (this agent) sums it into the policy's
/// `status.traffic`: probing `client -> web` again and again, the rule's denials of a window show
/// there, from one node.
fn traffic_in_status(lab: &Lab, api: &FakeApi, step: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut report, mut traffic, mut staged) = (Value::Null, Value::Null, Value::Null);
    while Instant::now() < deadline {
        assert!(!lab.connects("client", "web"), "{step}: client -> web");
        // The staged lockdown of web decides nothing.
        assert!(lab.connects("far", "web"), "{step}: far -> web");
        staged = api
            .get(
                "ordnet.io/v1alpha1",
                "ClusterOrderedNetworkPolicy",
                "",
                "staged-web-lockdown",
            )
            .unwrap()["status"]["staged"]
            .clone();
        report = api
            .get(
                "v1",
                "ConfigMap",
                "ordnet-system",
                &format!("ordnet-traffic-{NODE}"),
            )
            .map(|cm| serde_json::from_str(cm["data"]["report.json"].as_str().unwrap()).unwrap())
            .unwrap_or(Value::Null);
        traffic = api
            .get(
                "ordnet.io/v1alpha1",
                "ClusterOrderedNetworkPolicy",
                "",
                "client-not-to-web",
            )
            .unwrap()["status"]["traffic"]
            .clone();
        let denied = traffic["rules"].as_array().into_iter().flatten().any(|r| {
            r["direction"] == "Ingress" && r["index"] == 0 && r["flowsDenied"].as_u64() >= Some(1)
        });
        let would = staged["rules"].as_array().into_iter().flatten().any(|r| {
            r["direction"] == "Ingress"
                && r.get("index").is_none()
                && r["flowsWouldDeny"].as_u64() >= Some(1)
        });
        if denied && would && report != Value::Null {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(traffic["nodes"], 1, "{step}: {traffic}");
    // What the staged policy would change: far's flows to web denied by its isolation, with
    // examples; counted on this node (its report) and summed into its status.
    assert_eq!(staged["nodes"], 1, "{step}: {staged}");
    assert!(
        staged["examples"].as_array().is_some_and(|e| e
            .iter()
            .any(|x| x.as_str().unwrap().contains("-> shop/web TCP/"))),
        "{step}: {staged}"
    );
    assert!(
        report["staged"].as_array().is_some_and(|r| r
            .iter()
            .any(|x| x["name"] == "staged-web-lockdown" && x["total"][0].as_u64() >= Some(1))),
        "{step}: {report}"
    );
    assert_eq!(traffic["windowSeconds"], 2, "{step}: {traffic}");
    assert!(
        traffic["rules"].as_array().is_some_and(|r| r.len() == 1)
            && traffic["rules"][0]["flowsDenied"].as_u64() >= Some(1)
            && traffic["rules"][0]["packetsDenied"].as_u64()
                >= traffic["rules"][0]["flowsDenied"].as_u64(),
        "{step}: {traffic}"
    );
    // Its one rule decided: none is unmatched.
    assert_eq!(traffic["unmatchedRules"], json!([]), "{step}: {traffic}");
    assert_eq!(report["node"], NODE, "{step}: {report}");
    let rule = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "client-not-to-web")
        .unwrap_or_else(|| panic!("{step}: {report}"));
    assert_eq!(rule["kind"], "ClusterOrderedNetworkPolicy");
    assert!(rule["total"][1].as_u64() >= Some(1), "{step}: {rule}");
    // NetworkPolicies have no status to sum into: their rules are not reported.
    assert!(
        report["rules"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["kind"] != "NetworkPolicy"),
        "{step}: {report}"
    );
}

/// `ordnet whatif --agent`: the agent's own flow history against its objects plus a proposed
/// policy closing db, staged policies enforced: client's allowed flows to db would be denied
/// by the proposal's rule, far's to web by the staged lockdown's isolation; the denied
/// `web -> db` stays denied (not listed).
fn whatif_on_the_agents_history(agent: &Agent, step: &str) {
    let proposed = std::env::temp_dir().join(format!("ordnet-whatif-{}.yaml", std::process::id()));
    std::fs::write(
        &proposed,
        "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\n\
         metadata: {name: db-closed}\n\
         spec: {priority: -30, podSelector: {matchLabels: {app: db}},\n\
         ingress: [{action: Deny, from: [{namespaceSelector: {}}]}]}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ordnet"))
        .args([
            "whatif",
            "--agent",
            &agent.debug.to_string(),
            "-o",
            "json",
            "-f",
        ])
        .arg(&proposed)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&proposed);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{step}: whatif: {said}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let changed = v["changed"].as_array().expect("changed");
    let between = |from: &str, to: &str| {
        changed
            .iter()
            .filter(|c| {
                c["trace"]["egress"]["endpoint"] == from && c["trace"]["ingress"]["endpoint"] == to
            })
            .collect::<Vec<_>>()
    };
    let to_db = between("shop/client", "shop/db");
    assert!(
        !to_db.is_empty()
            && to_db.iter().all(|c| c["flow"]["allowed"] == true
                && c["trace"]["ingress"]["decision"]["entry"]["origins"][0]["name"] == "db-closed"),
        "{step}: {v:#}"
    );
    assert!(
        !between("shop/far", "shop/web").is_empty()
            || changed.iter().any(|c| {
                c["trace"]["ingress"]["endpoint"] == "shop/web" && c["flow"]["allowed"] == true
            }),
        "{step}: {v:#}"
    );
    assert!(between("shop/web", "shop/db").is_empty(), "{step}: {v:#}");
    assert!(
        v["flows"].as_u64() > Some(changed.len() as u64),
        "{step}: {v:#}"
    );
}

/// Runs `during` while every pair of `pairs` is probed again and again (from 300 ms before to
/// 500 ms after it): each probe must see the given verdict.
fn probe_through<T>(
    lab: &Arc<Lab>,
    step: &'static str,
    pairs: &[(&'static str, &'static str, bool)],
    during: impl FnOnce() -> T,
) -> T {
    let probing = Arc::new(AtomicBool::new(true));
    let probes: Vec<_> = pairs
        .iter()
        .map(|&(from, to, allowed)| {
            let (lab, probing) = (lab.clone(), probing.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while probing.load(Ordering::SeqCst) {
                    assert_eq!(
                        lab.connects(from, to),
                        allowed,
                        "{from} -> {to} during {step} (probe {n})"
                    );
                    n += 1;
                }
                n
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let out = during();
    std::thread::sleep(Duration::from_millis(500));
    probing.store(false, Ordering::SeqCst);
    for p in probes {
        let n = p.join().expect("a probe saw a wrong verdict");
        assert!(n >= 2, "only {n} probes during {step}");
    }
    out
}

/// A pod object; db and far are dual-stack (their IPv6 addresses: [`DB6`], [`FAR6`]).
fn pod(name: &str, app: &str, node: &str, ip: Ipv4Addr) -> Value {
    let mut ips = vec![json!({"ip": ip.to_string()})];
    match name {
        "db" => ips.push(json!({"ip": DB6.to_string()})),
        FAR => ips.push(json!({"ip": FAR6.to_string()})),
        _ => {}
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "shop", "name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
        "status": {"podIP": ip.to_string(), "podIPs": ips}})
}

/// The NetworkPolicy `shop/db-ingress` as the API server holds it.
fn db_ingress(api: &FakeApi) -> Value {
    api.get(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        "shop",
        "db-ingress",
    )
    .unwrap()
}

fn db_policy(from_app: &str) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": "db-ingress"},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": from_app}}}],
                "ports": [{"protocol": "TCP", "port": PORT}]}]}})
}

/// Sends UDP to `to`:9999 from namespace `ns` through a raw socket as fast as one thread can,
/// from one source port or (`distinct`) 50,000 in turn, until `stop`; the packets sent go to
/// `sent`.
fn flood(
    ns: &str,
    to: Ipv4Addr,
    distinct: bool,
    stop: Arc<AtomicBool>,
    sent: Arc<std::sync::atomic::AtomicU64>,
) -> std::thread::JoinHandle<()> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        in_netns(&ns, move || {
            use socket2::{Domain, Protocol, Socket, Type};
            let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP)).unwrap();
            let to = SocketAddr::from((to, 0)).into();
            let mut udp = [0u8; 16];
            udp[2..4].copy_from_slice(&9999u16.to_be_bytes());
            udp[4..6].copy_from_slice(&16u16.to_be_bytes());
            let mut n: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                let sport = if distinct {
                    10_000 + (n % 50_000) as u16
                } else {
                    40_000
                };
                udp[0..2].copy_from_slice(&sport.to_be_bytes());
                if s.send_to(&udp, &to).is_ok() {
                    n += 1;
                }
            }
            sent.store(n, Ordering::Relaxed);
        })
    })
}

/// Verdict events under a flood of denied packets (issue 26). Ignored: it floods for seconds
/// and prints what it measured (`cargo test -p ordnet --test agent_bpf observe_flood --
/// --ignored --nocapture`, as root); nothing timed is asserted. `client` floods `db` (isolated
/// for ingress: only `web` on TCP/80) with UDP from a raw socket, as fast as one thread sends:
/// first one flow (aggregated in its record), then a new flow per packet (50,000 source ports
/// in turn, more than the record map holds: each packet a new denied flow, its event refused
/// by the rate limit beyond 5,000/s). For each: packets sent, the events emitted, suppressed
/// and lost, the events the agent attributed, the agent's CPU, and the time from a policy
/// change to the datapath programmed with it during the flood against without one.
#[test]
#[ignore]
fn observe_flood() {
    use std::sync::atomic::AtomicU64;
    if !root_or_skip("agent_bpf") {
        return;
    }
    let lab = Lab::new();
    lab.serve();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, kubeconfig) = lab.api(&runtime);
    for (name, app, last) in PODS {
        api.create(pod(name, app, NODE, Ipv4Addr::new(10, 213, 0, last)))
            .unwrap();
    }
    api.create(db_policy("web")).unwrap();
    let agent = Agent::start_ready(&lab, &kubeconfig);
    let pid = agent.child.id();
    let cpu = || -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        // utime and stime (fields 14 and 15), in clock ticks.
        let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
        // SAFETY: sysconf has no preconditions.
        ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
    };
    // A policy change and back: the time until the agent's datapath answers with each.
    let change = || -> (Duration, Duration) {
        let mut times = Vec::new();
        for (from, want) in [("client", "allow"), ("web", "deny")] {
            let mut p = db_ingress(&api);
            p["spec"] = db_policy(from)["spec"].clone();
            let t = Instant::now();
            api.update(p).unwrap();
            loop {
                let (_, body) = agent.get(&format!(
                    "/v1/trace?from=shop/client&to=shop/db&port={PORT}"
                ));
                if serde_json::from_str::<Value>(&body).is_ok_and(|v| v["verdict"] == want) {
                    break;
                }
                assert!(t.elapsed() < LIMIT, "the change did not arrive");
                std::thread::sleep(Duration::from_millis(2));
            }
            times.push(t.elapsed());
        }
        (times[0], times[1])
    };
    let counters = || -> [f64; 4] {
        let m = |o: &str| {
            agent.metric(&format!(
                "ordnet_datapath_verdict_events_total{{outcome=\"{o}\"}}"
            ))
        };
        let attributed: f64 = ["exact", "current", "changed"]
            .iter()
            .map(|a| {
                agent.metric(&format!(
                    "ordnet_observed_events_total{{attribution=\"{a}\"}}"
                ))
            })
            .sum();
        [m("emitted"), m("suppressed"), m("lost"), attributed]
    };
    let quiet = change();
    println!(
        "no flood: policy change -> programmed {:.1} ms, and back {:.1} ms",
        quiet.0.as_secs_f64() * 1e3,
        quiet.1.as_secs_f64() * 1e3
    );
    let (client_ns, _) = lab.pods["client"].clone();
    let (_, db_ip) = lab.pods["db"].clone();
    for (what, distinct) in [("one flow", false), ("a new flow per packet", true)] {
        // The metrics of the datapath are taken at programming: a change refreshes them.
        let _ = change();
        let before = counters();
        let cpu0 = cpu();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let sender = flood(&client_ns, db_ip, distinct, stop.clone(), sent.clone());
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs(2));
        let during = change();
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        sender.join().unwrap();
        let secs = t.elapsed().as_secs_f64();
        let cpu1 = cpu();
        let _ = change();
        let after = counters();
        let d: Vec<f64> = (0..4).map(|i| after[i] - before[i]).collect();
        let n = sent.load(Ordering::Relaxed) as f64;
        println!(
            "flood, {what}: {:.0} packets/s for {secs:.1} s; events emitted {:.0} ({:.0}/s), \
             suppressed {:.0}, lost {:.0}, attributed by the agent {:.0}; agent CPU {:.1} % \
             of one core; policy change -> programmed {:.1} ms, and back {:.1} ms (no flood: \
             {:.1}, {:.1})",
            n / secs,
            d[0],
            d[0] / secs,
            d[1],
            d[2],
            d[3],
            (cpu1 - cpu0) / secs * 100.0,
            during.0.as_secs_f64() * 1e3,
            during.1.as_secs_f64() * 1e3,
            quiet.0.as_secs_f64() * 1e3,
            quiet.1.as_secs_f64() * 1e3,
        );
        assert_eq!(d[2], 0.0, "events lost: the agent did not keep up");
    }
}

#[test]
fn bpf_agent_enforces_with_real_connections_and_survives_restart() {
    if !root_or_skip("agent_bpf") {
        return;
    }
    let lab = Lab::new();
    lab.serve();
    // Without the agent the topology routes every pair.
    lab.expect("no agent", &[]);

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, kubeconfig) = lab.api(&runtime);
    for (name, app, last) in PODS {
        api.create(pod(name, app, NODE, Ipv4Addr::new(10, 213, 0, last)))
            .unwrap();
    }
    // A pod of another node: only the ipcache.
    api.create(pod(FAR, "web", "node-2", FAR_IP)).unwrap();
    api.create(db_policy("web")).unwrap();
    // client's egress: pods of its namespace only (so not its node).
    api.create(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": "client-egress"},
        "spec": {"podSelector": {"matchLabels": {"app": "client"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {}}]}]}}),
    )
    .unwrap();
    api.create(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "shop", "name": "db"},
        "spec": {"selector": {"app": "db"}, "clusterIP": DB_VIP.to_string(),
            "clusterIPs": [DB_VIP.to_string()],
            "ports": [{"name": "pg", "protocol": "TCP", "port": PORT, "targetPort": PORT}]}}))
        .unwrap();
    // A staged lockdown of web: it decides nothing, and the agent reports what it would.
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
        "metadata": {"name": "staged-web-lockdown"},
        "spec": {"mode": "Staged", "priority": -20,
            "namespaceSelector": {"matchLabels": {"name": "shop"}},
            "podSelector": {"matchLabels": {"app": "web"}},
            "defaultDeny": {"ingress": true}}}),
    )
    .unwrap();
    // kube-proxy's DNAT: before the agent, the Service reaches db from everywhere.
    lab.kube_proxy();
    lab.expect_service("no agent", &["client", "far", "web"]);
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
        "metadata": {"name": "client-not-to-web"},
        "spec": {"priority": -10,
            "namespaceSelector": {"matchLabels": {"name": "shop"}},
            "podSelector": {"matchLabels": {"app": "web"}},
            "defaultDeny": {"ingress": false},
            "ingress": [{"action": "Deny", "from": [{
                "namespaceSelector": {"matchLabels": {"name": "shop"}},
                "podSelector": {"matchLabels": {"app": "client"}}}]}]}}),
    )
    .unwrap();

    // 1. Start: fresh pins, every pod's veth and the uplink attached; a flow log.
    let flow_log =
        std::env::temp_dir().join(format!("ordnet-flowlog-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&flow_log);
    let agent = Agent::start_with(
        &lab,
        &kubeconfig,
        &[
            "--flow-log",
            flow_log.to_str().unwrap(),
            "--traffic-window",
            "2",
        ],
    );
    agent.wait_ready();
    lab.expect("initial", &[("client", "db"), ("client", "web")]);
    // Through the Service, db's ingress decides (judged after the DNAT, at TC).
    lab.expect_service("initial", &["far", "web"]);
    agent_matrix_agrees(
        &lab,
        &agent,
        "initial",
        &[("client", "db"), ("client", "web")],
    );
    agent_observe_agrees(
        &agent,
        "initial",
        &[
            ("client", "db", false),
            ("client", "web", false),
            ("web", "db", true),
        ],
    );
    // ICMP into isolated db: its ping answered, its path MTU learned, its UDP refused.
    lab.expect_icmp("initial");
    lab.expect_node("initial");
    lab.expect_jumbo("initial");
    let mut links = vec![
        lab.host_iface("client"),
        lab.host_iface("db"),
        lab.host_iface("web"),
        lab.uplink.clone(),
    ];
    links.sort();
    assert_eq!(lab.pinned_links(), links);
    assert_eq!(
        lab.pinned("tc-links"),
        links,
        "the TC hook on every interface"
    );
    assert_eq!(agent.metric("ordnet_datapath_attached_interfaces"), 4.0);
    assert_eq!(agent.metric("ordnet_datapath_unattached_endpoints"), 0.0);
    assert_eq!(
        agent.metric("ordnet_datapath_generic_xdp_interfaces"),
        0.0,
        "native XDP on every veth, the MTU {JUMBO_MTU} ones too"
    );
    assert_eq!(agent.metric("ordnet_endpoints"), 3.0);
    let (_, dump) = agent.get("/v1/trace?from=shop/client&to=shop/db&port=80");
    assert!(dump.contains("Deny") || dump.contains("deny"), "{dump}");

    // 2. A policy change reaches the kernel.
    let mut p = db_ingress(&api);
    p["spec"] = db_policy("client")["spec"].clone();
    api.update(p).unwrap();
    lab.expect(
        "db takes client",
        &[("web", "db"), ("far", "db"), ("client", "web")],
    );
    lab.expect_service("db takes client", &["client"]);
    agent_matrix_agrees(
        &lab,
        &agent,
        "db takes client",
        &[("web", "db"), ("far", "db"), ("client", "web")],
    );
    agent_observe_agrees(
        &agent,
        "db takes client",
        &[("web", "db", false), ("client", "db", true)],
    );
    let emitted = agent.metric("ordnet_datapath_verdict_events_total{outcome=\"emitted\"}");
    assert!(emitted > 0.0, "verdict events counted: {emitted}");
    agent_counters_agree(&agent, "db takes client");
    traffic_in_status(&lab, &api, "db takes client");
    whatif_on_the_agents_history(&agent, "db takes client");

    // 3. SIGTERM: pins and attachments stay, enforcement continues.
    agent.terminate();
    assert_eq!(lab.pinned_links(), links);
    for m in ordnet_datapath::MAP_NAMES {
        assert!(
            ordnet_datapath::layout_dir(&lab.pin_dir).join(m).exists(),
            "{m} is not pinned any more"
        );
    }
    lab.expect(
        "agent stopped",
        &[("web", "db"), ("far", "db"), ("client", "web")],
    );
    lab.expect_service("agent stopped", &["client"]);
    assert_eq!(lab.pinned("tc-links"), links);

    // 4. Restart: the pins are adopted; nothing is re-attached and no rule set rewritten, and
    // probes all through the restart never see a wrong verdict.
    let lab = Arc::new(lab);
    let agent = probe_through(
        &lab,
        "the restart",
        &[("web", "db", false), ("client", "db", true)],
        || Agent::start_ready(&lab, &kubeconfig),
    );
    lab.expect(
        "restarted",
        &[("web", "db"), ("far", "db"), ("client", "web")],
    );
    lab.expect_service("restarted", &["client"]);
    lab.expect_node("restarted");
    assert_eq!(lab.pinned_links(), links);
    // A TCP packet past the handshake with no tracking entry, into isolated db (far may reach
    // it on TCP/80 only): denied and counted, as the packets of an evicted flow would be (the
    // programs count from their load, here the restart; the metrics are recorded at the next
    // programming: checked at the end).
    let stray_before =
        agent.metric("ordnet_conntrack_untracked_tcp_packets_total{verdict=\"denied\"}");
    lab.send_stray_ack("far", "db", PORT + 1);
    assert_eq!(agent.metric("ordnet_datapath_attaches_total"), 0.0);
    for kind in [
        "ruleset_installed",
        "ruleset_updated",
        "policy",
        "cell",
        "block",
    ] {
        assert_eq!(
            agent.metric(&format!("ordnet_datapath_writes_total{{kind=\"{kind}\"}}")),
            0.0,
            "{kind} writes after adoption"
        );
    }

    // 5. The adopted datapath follows changes.
    api.delete(
        "ordnet.io/v1alpha1",
        "ClusterOrderedNetworkPolicy",
        "",
        "client-not-to-web",
    )
    .unwrap();
    lab.expect("guardrail deleted", &[("web", "db"), ("far", "db")]);
    // The per-rule counters of the restarted agent (the probes through the restart counted in
    // the adopted links' new programs), and in the metrics (recorded as `/v1/counters` read
    // them).
    agent_counters_agree(&agent, "restarted");
    let series = "ordnet_rule_flows_allowed_total{kind=\"NetworkPolicy\",namespace=\"shop\",\
                  policy=\"db-ingress\",direction=\"ingress\",rule=\"0\"}";
    assert!(agent.metric(series) >= 1.0, "{series}");

    // 6. The Service's backend set changes: its selector moves to web, whose ingress is open.
    let mut svc = api.get("v1", "Service", "shop", "db").unwrap();
    svc["spec"]["selector"] = json!({"app": "web"});
    api.update(svc).unwrap();
    // (The DNAT still goes to db: kube-proxy's rules are the test's; the datapath judges the
    // backend the packet actually reaches, whatever the Service object says.)
    lab.expect_service("selector changed, rules not", &["client"]);

    // 6b. A pod the agent knows before its interface and route exist (as when the CNI plugin is
    // not chained): attached on the netlink route event, not at an upkeep (hourly here).
    api.create(pod("late", "late", NODE, LATE_IP)).unwrap();
    let deadline = Instant::now() + LIMIT;
    while agent.metric("ordnet_datapath_unattached_endpoints") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "late was not reported unattached"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let late_iface = lab.host_iface("late");
    let mut lab = Arc::into_inner(lab).expect("the probes are done");
    lab.plumb("late", &late_iface, LATE_IP);
    let deadline = Instant::now() + LIMIT;
    while !lab.pinned_links().contains(&late_iface) {
        assert!(
            Instant::now() < deadline,
            "late's interface was not attached on its route event"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    api.delete("v1", "Pod", "shop", "late").unwrap();

    // 7. A pod that goes away loses its attachment.
    api.delete("v1", "Pod", "shop", "client").unwrap();
    let deadline = Instant::now() + LIMIT;
    while lab.pinned_links().contains(&lab.host_iface("client")) {
        assert!(Instant::now() < deadline, "client's link was not removed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(agent.metric("ordnet_endpoints"), 2.0);
    assert_eq!(agent.metric("ordnet_datapath_attached_interfaces"), 3.0);
    // The connection-tracking tables have the configured sizes and are swept at upkeep (the
    // route and link events of the steps above ran it).
    let deadline = Instant::now() + LIMIT;
    while !agent
        .get("/metrics")
        .1
        .contains("ordnet_conntrack_capacity{")
    {
        assert!(Instant::now() < deadline, "no conntrack sweep reported");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        agent.metric("ordnet_conntrack_capacity{family=\"ipv4\"}"),
        2048.0
    );
    assert_eq!(
        agent.metric("ordnet_conntrack_capacity{family=\"ipv6\"}"),
        1024.0
    );
    assert_eq!(agent.metric("ordnet_conntrack_sweep_errors_total"), 0.0);
    assert!(
        agent.metric("ordnet_conntrack_untracked_tcp_packets_total{verdict=\"denied\"}")
            > stray_before,
        "the stray ACK into db was not counted as an untracked TCP packet denied"
    );
    // The probes' established packets between pods crossed both hooks: the TC hook passed
    // them on XDP's tag (veth keeps XDP metadata), without a second lookup — unless the
    // kernel refused the metadata helper (the handoff is off: every packet looked up).
    let handoff = agent.metric("ordnet_datapath_handoff");
    if handoff == 0.0 {
        eprintln!("the handoff is off (the kernel refused XDP metadata): nothing handed off");
    }
    assert!(
        (agent.metric("ordnet_datapath_handed_off_packets_total") > 0.0) == (handoff == 1.0),
        "no packet was handed off from XDP to TC: {}",
        agent
            .get("/metrics")
            .1
            .lines()
            .filter(|l| l.contains("handed") || l.contains("untracked") || l.contains("xdp"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    agent.terminate();
    let links = lab.pinned_links();

    // 8. A new map layout: the next agent finds the pins of an older layout beside its own
    // directory (the layouts are equal here; the older agent's directory is what differs). It
    // programs new maps, then moves every attachment onto its programs in place: probes all
    // through the switch see no wrong verdict, nothing is attached anew, the older pins go.
    let layout = ordnet_datapath::layout_dir(&lab.pin_dir);
    let older = lab.pin_dir.join("v0");
    std::fs::rename(&layout, &older).unwrap();
    let lab = Arc::new(lab);
    let agent = probe_through(
        &lab,
        "the layout change",
        &[("web", "db", false), ("db", "web", true)],
        || Agent::start_ready(&lab, &kubeconfig),
    );
    assert!(!older.exists(), "the older layout's pins are still there");
    assert_eq!(lab.pinned_links(), links);
    assert_eq!(agent.metric("ordnet_datapath_attaches_total"), 0.0);
    agent.terminate();
    let mut lab = Arc::into_inner(lab).expect("the probes are done");
    lab.locals.retain(|p| p != "client");

    // 8b, 8c. Policy maps too small, and growing.
    map_capacity_steps(&lab, &api, &kubeconfig, &links);

    // 9. Uninstall: every program detached, every pin removed; nothing is enforced any more.
    let out = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", lab.node))
        .arg(env!("CARGO_BIN_EXE_ordnet"))
        .args(["agent", "--uninstall"])
        .env("ORDNET_PIN_DIR", &lab.pin_dir)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("uninstalled"), "{said}");
    assert!(!lab.pin_dir.exists(), "the pin directory is still there");
    lab.expect("uninstalled", &[]);
    lab.expect_service("uninstalled", &["client", "far", "web"]);
    let _ = std::fs::remove_file(&flow_log);
    drop(api);
    drop(runtime);
}

/// Opens the TUN device `name` of this thread's network namespace (`IFF_TUN | IFF_NO_PI`:
/// bare IP packets).
fn open_tun(name: &str) -> std::fs::File {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .unwrap();
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an `ifreq`, which `IfReq` lays out.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
    assert_eq!(
        rc,
        0,
        "TUNSETIFF {name}: {}",
        std::io::Error::last_os_error()
    );
    file
}

/// Copies every packet read from `from` to `to` (a thread; it ends when a device goes).
fn relay(mut from: std::fs::File, mut to: std::fs::File) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
}

/// The sender's current maximum segment size (`TCP_INFO`'s `tcpi_snd_mss`).
fn send_mss(s: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd as _;
    // SAFETY: an all-zero `tcp_info` is valid; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_snd_mss
}

/// The CNI shapes the agent must find interfaces in ([`Lab::shapes`]): pods on a bridge
/// (Debian's `bridge` plugin, MTU 9001) are enforced on their bridge ports (never on the bridge
/// device, which every pod shares), both directions, also between two pods of the same bridge
/// (switched, never routed) and through a Service whose backend is on the bridge; the pod whose
/// route is only in a table an `ip rule` chooses is found there. The node's neighbour cache is
/// flushed before each start, so the agent has to have the kernel resolve the bridged pods
/// (managed neighbour entries) to learn their ports. A flannel-style VXLAN device to a second
/// node is attached without being named (generic XDP: VXLAN has no native mode): a pod of the
/// other node is judged by the local pods' ingress, and a local pod's egress to a Service whose
/// backend is on the other node is judged after the DNAT, at the overlay device. Two uplinks,
/// both matched by one `--uplink` pattern, each with traffic from outside behind it.
#[test]
fn bpf_agent_enforces_bridged_and_policy_routed_pods() {
    if !root_or_skip("agent_bpf shapes") {
        return;
    }
    if !Path::new("/usr/lib/cni/bridge").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "/usr/lib/cni/bridge is missing (scripts/setup installs containernetworking-plugins)"
        );
        eprintln!("SKIPPED: no /usr/lib/cni/bridge");
        return;
    }
    let lab = Lab::shapes();
    lab.serve();
    lab.expect("no agent", &[]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, kubeconfig) = lab.api(&runtime);
    shapes_objects(&lab, &api);
    let denied = [
        ("b1", "b2"),
        ("b1", "pr"),
        ("b3", "pr"),
        ("b3", "b1"),
        (REMOTE, "b2"),
        (REMOTE, "pr"),
        (EXT2, "b2"),
        (EXT2, "pr"),
    ];
    let sources = ["b1", "b3", "pr"];
    lab.expect_reach("no agent", &sources, B2_VIP, "b2", &sources);
    lab.expect_reach("no agent", &["b1", "b3"], R1_VIP, REMOTE, &["b1", "b3"]);
    lab.expect_reach("no agent", &["b1", "b3"], R2_VIP, REMOTE_TUN, &["b1", "b3"]);
    lab.expect_to_remote("no agent", &["b1", "b2", "b3"]);

    // Node 2's own agent: its pod r1, its underlay as uplink, the overlay found by itself.
    let node2 = lab.others[0].clone();
    let (_, m2) = node2_mgmt(lab.api_ip);
    let node2_pins = lab.bpffs.join("node2");
    let agent2 = Agent::start_at(
        &Spot {
            netns: &node2,
            node: "node-2",
            uplink: "eth0",
            debug_ip: m2,
            pin_dir: &node2_pins,
            extra: &SMALL_CT,
        },
        &kubeconfig,
    );
    agent2.wait_ready();
    // Only node 2 enforces yet: r1's ingress drops b2.
    lab.expect_to_remote("node 2's agent", &["b1", "b3"]);

    let mut links: Vec<String> = lab
        .locals
        .iter()
        .map(|name| {
            if name == ROUTED_BY_RULE {
                format!("{}p", lab.prefix)
            } else {
                bridge_port(&lab, name)
            }
        })
        .chain([1, 2, 3].map(|i| {
            format!(
                "{}{}",
                lab.uplink,
                if i == 1 { String::new() } else { i.to_string() }
            )
        }))
        .collect();
    links.sort();
    // The overlay gets the TC hook only (no XDP: the kernel refuses XDP on a VXLAN device and
    // on its underlay at once).
    let mut tc_links = links.clone();
    tc_links.push(OVERLAY.to_string());
    tc_links.sort();
    let lab = Arc::new(lab);
    for step in ["start", "restart"] {
        run(&format!("ip -n {} neigh flush dev {BRIDGE}", lab.node));
        let agent = if step == "start" {
            Agent::start_ready(&lab, &kubeconfig)
        } else {
            // The pinned links stay through the restart while the agent learns the bridged
            // pods' ports again: never detached, never re-attached, no packet judged wrongly.
            let agent = probe_through(
                &lab,
                "the restart of the shapes agent",
                &[("b1", "b2", false), ("b3", "b2", true), ("b1", "pr", false)],
                || Agent::start_ready(&lab, &kubeconfig),
            );
            lab.expect(step, &denied);
            assert_eq!(
                agent.metric("ordnet_datapath_attaches_total"),
                0.0,
                "{step}"
            );
            assert_eq!(
                agent.metric("ordnet_datapath_detaches_total"),
                0.0,
                "{step}"
            );
            agent
        };
        expect_shapes(&lab, &agent, step, &denied, &links, &tc_links);
        agent.terminate();
    }
    assert_eq!(
        agent2.metric("ordnet_datapath_unattached_endpoints"),
        0.0,
        "node 2: {}",
        agent2.get("/readyz").1
    );
    agent2.terminate();
}

/// The shapes test's pods, policies and Services (and kube-proxy's DNAT for them).
fn shapes_objects(lab: &Lab, api: &FakeApi) {
    for name in &lab.locals {
        api.create(pod(name, name, NODE, lab.pods[name].1)).unwrap();
    }
    api.create(pod(REMOTE, REMOTE, "node-2", REMOTE_IP))
        .unwrap();
    api.create(pod(REMOTE_TUN, REMOTE_TUN, "node-2", REMOTE_TUN_IP))
        .unwrap();
    let ingress_from = |to: &str, from: &[&str], ports: Value| {
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": "shop", "name": format!("{to}-ingress")},
            "spec": {"podSelector": {"matchLabels": {"app": to}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": from.iter().map(|f| json!({"podSelector": {"matchLabels": {"app": f}}})).collect::<Vec<_>>(),
                    "ports": ports}]}})
    };
    api.create(ingress_from(
        "b2",
        &["pr", "b3"],
        json!([{"protocol": "TCP", "port": PORT}]),
    ))
    .unwrap();
    api.create(ingress_from("pr", &["b2"], Value::Null))
        .unwrap();
    // Node 2's pod takes b1 and b3 only: node 2's agent must drop b2 (b3 is dropped by its own
    // egress policy, on node 1).
    api.create(ingress_from(REMOTE, &["b1", "b3"], Value::Null))
        .unwrap();
    api.create(ingress_from(REMOTE_TUN, &["b1", "b3"], Value::Null))
        .unwrap();
    api.create(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": "b3-egress"},
        "spec": {"podSelector": {"matchLabels": {"app": "b3"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "b2"}}},
                               {"podSelector": {"matchLabels": {"app": "pr"}}}]}]}}),
    )
    .unwrap();
    // kube-proxy's DNAT of a Service to b2; b3's connections through it come back over the
    // bridge, un-translated by br_netfilter (bridge-nf-call-iptables, 1 by default).
    let (_, b2) = lab.pods["b2"];
    lab.nft(&format!(
        "table ip kube-proxy {{\n\
         chain nat-prerouting {{ type nat hook prerouting priority dstnat; \
         ip daddr {B2_VIP} tcp dport {PORT} dnat to {b2}:{PORT}; \
         ip daddr {R1_VIP} tcp dport {PORT} dnat to {REMOTE_IP}:{PORT}; \
         ip daddr {R2_VIP} tcp dport {PORT} dnat to {REMOTE_TUN_IP}:{PORT}; }}\n\
         }}\n"
    ));
    for (name, vip) in [("b2", B2_VIP), (REMOTE, R1_VIP), (REMOTE_TUN, R2_VIP)] {
        api.create(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": name},
            "spec": {"selector": {"app": name}, "clusterIP": vip.to_string(),
                "clusterIPs": [vip.to_string()],
                "ports": [{"protocol": "TCP", "port": PORT, "targetPort": PORT}]}}))
            .unwrap();
    }
}

/// What the shapes test checks with the agent running (after `lab.expect(step, denied)`).
fn expect_shapes(
    lab: &Lab,
    agent: &Agent,
    step: &str,
    denied: &[(&str, &str)],
    links: &[String],
    tc_links: &[String],
) {
    lab.expect(step, denied);
    lab.expect_reach(step, &["b1", "b3", "pr"], B2_VIP, "b2", &["b3", "pr"]);
    // b3's egress to the other node's pod, behind a Service: judged after the DNAT.
    lab.expect_reach(step, &["b1", "b3"], R1_VIP, REMOTE, &["b1"]);
    // The same through the layer-3 tunnel: judged by the layer-3 TC program on it (node 2 lets b3
    // in: only node 1's egress judgment drops it).
    lab.expect_reach(step, &["b1", "b3"], R2_VIP, REMOTE_TUN, &["b1"]);
    // To the other node's pod directly: b2 dropped by node 2, b3 by node 1.
    lab.expect_to_remote(step, &["b1"]);
    assert_eq!(
        agent.metric("ordnet_datapath_unattached_endpoints"),
        0.0,
        "{step}: {}",
        agent.get("/readyz").1
    );
    assert_eq!(
        lab.pinned_links(),
        links,
        "{step}: XDP on the bridge ports, the rule-routed pod's veth and both uplinks (one \
         --uplink pattern); never {BRIDGE}"
    );
    assert_eq!(
        lab.pinned("tc-links"),
        tc_links,
        "{step}: TC there and on {OVERLAY}"
    );
    assert_eq!(
        lab.pinned("tc-l3-links"),
        [TUNNEL],
        "{step}: the layer-3 TC program on the tunnel"
    );
    let (_, readyz) = agent.get("/readyz");
    assert!(!readyz.contains("not enforced"), "{step}: {readyz}");
    // The ifb uplink runs XDP in generic mode; after the restart the agent finds that in
    // the kernel's report of the adopted link.
    assert_eq!(
        agent.metric("ordnet_datapath_generic_xdp_interfaces"),
        1.0,
        "{step}: {readyz}"
    );
    assert!(
        readyz.contains(&format!("XDP in generic mode on {}3", lab.uplink)),
        "{step}: {readyz}"
    );
    // Jumbo frames between two pods of the bridge, where policy allows (b2 -> b1).
    let (_, b1) = lab.pods["b1"];
    let (got, mss) = lab
        .transfer("b2", "b1", b1.into(), 5002, 8 << 20)
        .unwrap_or_else(|e| panic!("{step}: jumbo transfer over the bridge: {e}"));
    assert_eq!(got, 8 << 20);
    assert!(
        mss > 8800,
        "{step}: segments of {mss} bytes over MTU {JUMBO_MTU}"
    );
}

/// A routed pod: namespace `ns` with `ip` on its `eth0`, the other end `host` in namespace
/// `node` with the gateway address `gw`, a /32 route to the pod on the node (`route_extra`:
/// more words for that route, e.g. a table), and in the pod a route to the gateway and the
/// default route through it; `mtu` on both ends when given.
fn routed_pod(
    node: &str,
    ns: &str,
    host: &str,
    ip: Ipv4Addr,
    gw: Ipv4Addr,
    route_extra: &str,
    mtu: Option<u32>,
) {
    run(&format!("ip netns add {ns}"));
    run(&format!("ip -n {ns} link set lo up"));
    run(&format!(
        "ip -n {node} link add {host} type veth peer name eth0 netns {ns}"
    ));
    run(&format!("ip -n {node} addr add {gw}/32 dev {host}"));
    if let Some(mtu) = mtu {
        run(&format!("ip -n {node} link set {host} mtu {mtu}"));
        run(&format!("ip -n {ns} link set eth0 mtu {mtu}"));
    }
    run(&format!("ip -n {node} link set {host} up"));
    run(&format!(
        "ip -n {node} route add {ip}/32 dev {host}{route_extra}"
    ));
    run(&format!("ip -n {ns} addr add {ip}/32 dev eth0"));
    run(&format!("ip -n {ns} link set eth0 up"));
    run(&format!("ip -n {ns} route add {gw}/32 dev eth0"));
    run(&format!("ip -n {ns} route add default via {gw}"));
}

/// The second node's management pair (this namespace's side, the node's side): the /30 after
/// the first node's.
fn node2_mgmt(api_ip: Ipv4Addr) -> (Ipv4Addr, Ipv4Addr) {
    let first = u32::from(api_ip) - 1;
    // The /30 before it when the first is the last of its /16.
    let base = if first & 0xffff == 0xfffc {
        first - 4
    } else {
        first + 4
    };
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

/// The bridge port of a bridged pod: the veth in the node namespace whose peer is the pod's
/// `eth0` (read from `ip -d link`, the test's own view, not the agent's).
fn bridge_port(lab: &Lab, pod: &str) -> String {
    let (ns, _) = &lab.pods[pod];
    let out = Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", "eth0"])
        .output()
        .unwrap();
    // `2: eth0@if7: ...`: the peer's index in the node namespace.
    let text = String::from_utf8_lossy(&out.stdout);
    let peer: u32 = text
        .split("@if")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("{pod}: no peer index in {text}"));
    let out = Command::new("ip")
        .args(["-n", &lab.node, "-o", "link", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with(&format!("{peer}: ")))
        .and_then(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_string())
        .unwrap_or_else(|| panic!("{pod}: no interface {peer} in the node namespace"))
}

/// Steps 8b and 8c of [`bpf_agent_enforces_with_real_connections_and_survives_restart`]: the
/// agent with a policy map too small for db's rule set (denied both ways, reported), with the
/// default size again, and with a map allowed to grow. `links` are the pinned attachments (they
/// never change). Ends with no agent running.
fn map_capacity_steps(lab: &Lab, api: &FakeApi, kubeconfig: &Path, links: &[String]) {
    // 8b. A policy map too small for db's rule set (two keys; the map holds one): started with
    // it, the agent replaces the pinned maps by smaller ones (the migration of step 8) and db
    // gets a deny-all policy in both directions, reported; web is enforced as before. Started
    // again with the default size, db is enforced by its own rules.
    let mut p = db_ingress(api);
    p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app"] = json!("web");
    p["spec"]["ingress"][0]["ports"] = json!([
        {"protocol": "TCP", "port": PORT}, {"protocol": "TCP", "port": PORT + 1}]);
    api.update(p).unwrap();
    let tiny = ["--policy-map-entries", "1", "--policy-map-max-entries", "1"];
    let agent = Agent::start_with(lab, kubeconfig, &tiny);
    agent.wait_ready();
    lab.expect(
        "db does not fit",
        &[("web", "db"), ("far", "db"), ("db", "web")],
    );
    assert_eq!(
        lab.pinned_links(),
        links,
        "the attachments were moved, not made anew"
    );
    assert_eq!(agent.metric("ordnet_datapath_attaches_total"), 0.0);
    assert_eq!(agent.metric("ordnet_datapath_denied_endpoints"), 1.0);
    assert_eq!(
        agent.metric("ordnet_datapath_map_capacity{map=\"ORDNET_POLICY\"}"),
        1.0
    );
    let (code, ready) = agent.get("/readyz");
    assert_eq!(code, 200, "{ready}");
    assert!(
        ready.contains("denied in both directions (its policy does not fit the maps): shop/db"),
        "{ready}"
    );
    let (code, why) = agent.get(&format!(
        "/v1/trace?from=shop/web&to=shop/db&port={PORT}&output=text"
    ));
    assert_eq!(code, 200, "{why}");
    assert!(why.starts_with("verdict: DENY"), "{why}");
    assert!(
        why.contains("shop/db is denied in both directions"),
        "{why}"
    );
    let (code, why) = agent.get("/v1/dump?pod=shop/db");
    assert_eq!(code, 409, "{why}");
    assert!(why.contains("do not fit"), "{why}");
    assert_eq!(aside(lab), 0, "the pins of the old size are still there");
    // Warning Events on the pod and on the policy that isolates it.
    for (kind, name) in [("Pod", "db"), ("NetworkPolicy", "db-ingress")] {
        let deadline = Instant::now() + LIMIT;
        while !api.events().iter().any(|e| {
            e["reason"] == "PolicyDoesNotFit"
                && e["type"] == "Warning"
                && e["regarding"]["kind"] == kind
                && e["regarding"]["name"] == name
                && e["note"]
                    .as_str()
                    .is_some_and(|n| n.contains("denied in both directions"))
        }) {
            assert!(
                Instant::now() < deadline,
                "no event on {kind} {name}: {:#?}",
                api.events()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    agent.terminate();
    let agent = Agent::start_ready(lab, kubeconfig);
    lab.expect("db fits again", &[]);
    assert_eq!(agent.metric("ordnet_datapath_denied_endpoints"), 0.0);
    assert_eq!(aside(lab), 0, "the pins of the old size are still there");
    assert_eq!(lab.pinned_links(), links);
    agent.terminate();

    map_growth_step(lab, api, kubeconfig, links);
}

/// Pin directories set aside for maps of other sizes (`vN-resized-T`) still in the pin root.
fn aside(lab: &Lab) -> usize {
    std::fs::read_dir(&lab.pin_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("-resized-"))
        .count()
}

/// Step 8c (see [`map_capacity_steps`]).
fn map_growth_step(lab: &Lab, api: &FakeApi, kubeconfig: &Path, links: &[String]) {
    // 8c. The same small map allowed to grow (to 8): db's two class keys do not fit one, so db
    // is denied and the map doubles (2: classes are counted once programmed, not sized
    // before), then doubles again while 90 % full (4); a policy
    // that needs 6 keys does not fit 4: db is denied for a moment and the map doubles again (8),
    // with no restart and no new attachment.
    let agent = Agent::start_with(
        lab,
        kubeconfig,
        &["--policy-map-entries", "1", "--policy-map-max-entries", "8"],
    );
    agent.wait_ready();
    lab.expect("the policy map grew", &[]);
    // A connection db (isolated for ingress) opened to far, idle: far's unasked bytes reach db
    // only through its tracking entry, which must come along to every new set of maps.
    let mut held = lab.hold("db", FAR, 7001);
    assert!(held.pushed(), "far's push on db's connection (control)");
    let capacity = "ordnet_datapath_map_capacity{map=\"ORDNET_POLICY\"}";
    assert_eq!(agent.metric(capacity), 4.0);
    assert_eq!(
        agent.metric("ordnet_datapath_policy_map_growths_total"),
        2.0
    );
    let mut p = db_ingress(api);
    p["spec"]["ingress"][0]["ports"] = json!(
        (0..6)
            .map(|i| json!({"protocol": "TCP", "port": PORT + 10 * i}))
            .collect::<Vec<_>>()
    );
    api.update(p).unwrap();
    let deadline = Instant::now() + LIMIT;
    while agent.metric(capacity) < 8.0 {
        assert!(
            Instant::now() < deadline,
            "the policy map did not grow to 8"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    lab.expect("grown for six keys", &[]);
    assert_eq!(
        agent.metric("ordnet_datapath_policy_map_growths_total"),
        3.0
    );
    assert_eq!(agent.metric("ordnet_datapath_denied_endpoints"), 0.0);
    assert_eq!(agent.metric("ordnet_datapath_attaches_total"), 0.0);
    assert_eq!(lab.pinned_links(), links);
    assert_eq!(
        aside(lab),
        0,
        "the pins of the smaller maps are still there"
    );
    assert!(
        held.pushed(),
        "db's connection to far broke when the policy map grew (tracking entry not carried)"
    );
    agent.terminate();

    // 8d. Larger connection-tracking tables than the pinned ones: replaced at start, the
    // tracked flows carried over (db's connection lives on), nothing re-attached.
    let agent = Agent::start_with(
        lab,
        kubeconfig,
        &[
            "--policy-map-entries",
            "1",
            "--policy-map-max-entries",
            "8",
            "--conntrack-entries-v4",
            "4096",
            "--conntrack-entries-v6",
            "1024",
        ],
    );
    agent.wait_ready();
    let deadline = Instant::now() + LIMIT;
    while aside(lab) != 0 {
        assert!(Instant::now() < deadline, "the smaller tables' pins stayed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pinned =
        ordnet_datapath::Datapath::pinned_sizes(&ordnet_datapath::layout_dir(&lab.pin_dir))
            .expect("the pinned maps' sizes");
    assert_eq!((pinned.ct4_entries, pinned.ct6_entries), (4096, 1024));
    assert_eq!(agent.metric("ordnet_datapath_attaches_total"), 0.0);
    assert_eq!(lab.pinned_links(), links);
    assert!(
        held.pushed(),
        "db's connection to far broke when the conntrack table grew"
    );
    agent.terminate();
}

/// Whether namespace `ns` gets the reply of an ICMP echo request to `to` (a ping socket)
/// within 1 s.
fn ping_from(ns: &str, to: Ipv4Addr) -> bool {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-qw"])
        .arg("net.ipv4.ping_group_range=0 2147483647")
        .output()
        .unwrap();
    assert!(out.status.success(), "ping_group_range in {ns}");
    in_netns(ns, move || {
        use socket2::{Domain, Protocol, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::ICMPV4)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        // Type 8 (echo request); the kernel sets the identifier and the checksum.
        let request = [8u8, 0, 0, 0, 0, 0, 0, 1, b'o', b'r', b'd'];
        s.send_to(&request, &SocketAddr::from((to, 0)).into())
            .unwrap();
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 256];
        match s.recv(&mut buf) {
            // SAFETY: `recv` initialised the first `n` bytes.
            Ok(n) if n >= 8 => (unsafe { buf[0].assume_init() }) == 0,
            _ => false,
        }
    })
}
