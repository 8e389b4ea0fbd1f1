//! `ordnet-cni` as a container runtime runs it: Debian's `containernetworking-plugins`
//! (`/usr/lib/cni/ptp` with `host-local` IPAM) create each pod's network namespace side, then
//! `ordnet-cni` gets ptp's result as `prevResult` and asks the agent (the real binary with
//! `--datapath bpf`, in a "node" network namespace, against the fake API server) to enforce the
//! pod. Root only (CI runs it as root).
//!
//! The pods are in the API (scheduled to the node, no address yet, as when the kubelet runs the
//! CNI chain); the policies: `srv` takes connections only from `app=good`, `app=bad` may not
//! send anything, `open` takes everything.
//!
//! * With the agent running, the first probe after ADD returns already sees the pod's policy:
//!   `bad` reaches nothing, `good` reaches `srv` (which needs `good`'s identity, known only
//!   through the ADD: the API has no address for it yet). CHECK and STATUS succeed.
//! * The kubelet then reports the addresses; nothing changes. DEL (and the pod's deletion)
//!   leaves no attachment, no pin and no endpoint behind.
//! * With the agent stopped, ADD fails with code 11 and the pod's host-side interface is down:
//!   the first probe, even to the node itself, is dropped.

mod support;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ordnet_testsuite::fakeapi::FakeApi;
use serde_json::{Value, json};
use support::{in_netns, root_or_skip, run, serve_greeting};

const NODE: &str = "node-1";
const PORT: u16 = 8080;
const LIMIT: Duration = Duration::from_secs(20);
const PTP: &str = "/usr/lib/cni/ptp";

struct Node {
    id: String,
    ns: String,
    root_veth: String,
    api_ip: Ipv4Addr,
    mgmt_ip: Ipv4Addr,
    subnet: String,
    dir: PathBuf,
    bpffs: PathBuf,
    pin_dir: PathBuf,
    socket: PathBuf,
    /// The node's CNI configuration directory (the main plugin's conflist; the agent chains
    /// ordnet-cni into it) and the bin directory the agent installs ordnet-cni into.
    conf_dir: PathBuf,
    bin_dir: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Node {
    fn new() -> Node {
        let pid = std::process::id();
        let id = format!("oc{pid}");
        let sub = (pid % 16384) * 4;
        let dir = std::env::temp_dir().join(format!("ordnet-cni-{pid}"));
        let bpffs = dir.join("bpffs");
        std::fs::create_dir_all(&bpffs).unwrap();
        ordnet_datapath::sys::ensure_bpffs(&bpffs).unwrap();
        let node = Node {
            ns: format!("{id}n"),
            root_veth: format!("{id}r"),
            api_ip: Ipv4Addr::new(10, 216, (sub >> 8) as u8, (sub & 0xff) as u8 + 1),
            mgmt_ip: Ipv4Addr::new(10, 216, (sub >> 8) as u8, (sub & 0xff) as u8 + 2),
            subnet: format!("10.217.{}.0/24", pid % 250),
            socket: dir.join("run/cni.sock"),
            conf_dir: dir.join("net.d"),
            bin_dir: dir.join("bin"),
            pin_dir: bpffs.join("ordnet"),
            bpffs,
            dir,
            id,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let _ = Command::new("ip")
            .args(["link", "del", &node.root_veth])
            .output();
        let n = &node.ns;
        run(&format!("ip netns add {n}"));
        run(&format!("ip -n {n} link set lo up"));
        run(&format!(
            "ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"
        ));
        let (r, m) = (&node.root_veth, format!("{}m", node.id));
        run(&format!(
            "ip link add {r} type veth peer name {m} netns {n}"
        ));
        run(&format!("ip addr add {}/30 dev {r}", node.api_ip));
        run(&format!("ip link set {r} up"));
        run(&format!("ip -n {n} addr add {}/30 dev {m}", node.mgmt_ip));
        run(&format!("ip -n {n} link set {m} up"));
        std::fs::create_dir_all(&node.conf_dir).unwrap();
        std::fs::write(
            node.conf_dir.join("10-ptp.conflist"),
            node.main_conflist().to_string(),
        )
        .unwrap();
        node
    }

    /// The main plugin's conflist, as the node had it before ordnet.
    fn main_conflist(&self) -> Value {
        json!({"cniVersion": "1.0.0", "name": "ordnet-test", "plugins": [
            {"type": "ptp", "mtu": 1500,
             "ipam": {"type": "host-local", "subnet": self.subnet,
                      "dataDir": self.dir.join("ipam").to_string_lossy()}}]})
    }

    /// The conflist the runtime reads now.
    fn conflist(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.conf_dir.join("10-ptp.conflist")).unwrap())
            .unwrap()
    }

    /// The plugin configurations of the conflist, as the runtime passes them (the list's
    /// version and name added to each).
    fn chain(&self) -> Vec<Value> {
        let list = self.conflist();
        list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let mut c = p.clone();
                c["cniVersion"] = list["cniVersion"].clone();
                c["name"] = list["name"].clone();
                c
            })
            .collect()
    }

    /// A plugin's binary, found in CNI_PATH as the runtime does.
    fn binary(&self, plugin: &str) -> PathBuf {
        [self.bin_dir.as_path(), Path::new("/usr/lib/cni")]
            .iter()
            .map(|d| d.join(plugin))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no {plugin} in the CNI path"))
    }

    fn pod_ns(&self, pod: &str) -> String {
        format!("{}-{pod}", self.id)
    }

    /// The CNI environment of `pod` for `command`.
    fn cni_env(&self, command: &str, pod: &str) -> Vec<(String, String)> {
        [
            ("CNI_COMMAND", command.to_string()),
            ("CNI_CONTAINERID", format!("{}-{pod}", self.id)),
            ("CNI_NETNS", format!("/var/run/netns/{}", self.pod_ns(pod))),
            ("CNI_IFNAME", "eth0".to_string()),
            (
                "CNI_PATH",
                format!("{}:/usr/lib/cni", self.bin_dir.display()),
            ),
            (
                "CNI_ARGS",
                format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={pod}"),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Runs a CNI plugin in the node's network namespace, as the runtime does: (exit status
    /// success, stdout as JSON).
    fn plugin(&self, binary: &Path, command: &str, pod: &str, conf: &Value) -> (bool, Value) {
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", self.ns))
            .arg(binary)
            .envs(self.cni_env(command, pod))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let value = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(text.trim()).unwrap_or_else(|e| {
                panic!(
                    "{} {command} {pod}: {e}: {text}; stderr {}",
                    binary.display(),
                    String::from_utf8_lossy(&out.stderr)
                )
            })
        };
        (out.status.success(), value)
    }

    /// The runtime's ADD of the chain, each plugin with the previous one's result: the main
    /// plugin's result, and the last plugin's (success, output).
    fn add(&self, pod: &str) -> (Value, (bool, Value)) {
        run(&format!("ip netns add {}", self.pod_ns(pod)));
        run(&format!("ip -n {} link set lo up", self.pod_ns(pod)));
        let chain = self.chain();
        let (mut main, mut last) = (Value::Null, (true, Value::Null));
        for (i, conf) in chain.iter().enumerate() {
            let mut conf = conf.clone();
            if i > 0 {
                conf["prevResult"] = last.1.clone();
            }
            let ty = conf["type"].as_str().unwrap().to_string();
            last = self.plugin(&self.binary(&ty), "ADD", pod, &conf);
            if i == 0 {
                assert!(last.0, "{ty} ADD {pod}: {}", last.1);
                main = last.1.clone();
            }
            if !last.0 {
                break;
            }
        }
        (main, last)
    }

    /// The runtime's DEL of the chain, in reverse order.
    fn del(&self, pod: &str, main: &Value) {
        for conf in self.chain().iter().rev() {
            let mut conf = conf.clone();
            conf["prevResult"] = main.clone();
            let ty = conf["type"].as_str().unwrap().to_string();
            let (ok, out) = self.plugin(&self.binary(&ty), "DEL", pod, &conf);
            assert!(ok, "{ty} DEL {pod}: {out}");
        }
        run(&format!("ip netns del {}", self.pod_ns(pod)));
    }

    /// The ordnet-cni entry of the chain with `prev` as prevResult.
    fn ordnet_conf(&self, prev: Option<&Value>) -> Value {
        let mut c = self
            .chain()
            .into_iter()
            .find(|c| c["type"] == "ordnet-cni")
            .unwrap_or_else(|| panic!("ordnet-cni is not chained: {}", self.conflist()));
        if let Some(p) = prev {
            c["prevResult"] = p.clone();
        }
        c
    }

    fn ordnet_cni(&self) -> PathBuf {
        self.bin_dir.join("ordnet-cni")
    }

    /// A TCP server on `ip:PORT` inside network namespace `ns`.
    fn serve(&self, ns: &str, ip: Ipv4Addr) {
        let listener = in_netns(ns, move || {
            TcpListener::bind(SocketAddr::from((ip, PORT))).unwrap()
        });
        serve_greeting(listener, self.stop.clone(), b"hi".to_vec());
    }

    /// Whether a TCP connection from pod `from` to `to:PORT` is answered within 500 ms.
    fn connects(&self, from: &str, to: Ipv4Addr) -> bool {
        in_netns(&self.pod_ns(from), move || {
            let Ok(mut s) = TcpStream::connect_timeout(
                &SocketAddr::from((to, PORT)),
                Duration::from_millis(500),
            ) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            let mut got = String::new();
            let _ = s.read_to_string(&mut got);
            got == "hi"
        })
    }

    fn links(&self) -> Vec<String> {
        support::pinned_links(&self.pin_dir, "links")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = ordnet_datapath::Datapath::remove_pins(&self.pin_dir);
        let _ = Command::new("umount").arg(&self.bpffs).output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_veth])
            .output();
        if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let ns = line.split_whitespace().next().unwrap_or_default();
                if ns.starts_with(&self.id) {
                    let _ = Command::new("ip").args(["netns", "del", ns]).output();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The agent binary in the node's namespace, serving the CNI socket.
struct Agent(Child);

impl Agent {
    fn start(node: &Node, kubeconfig: &Path) -> Agent {
        let child = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", node.ns))
            .arg(env!("CARGO_BIN_EXE_ordnet"))
            .args(["agent", "--node", NODE, "--datapath", "bpf"])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--debug-addr")
            .arg(format!("{}:0", node.mgmt_ip))
            .args(["--metrics-addr", "none"])
            .arg("--cni-socket")
            .arg(&node.socket)
            .arg("--cni-bin-dir")
            .arg(&node.bin_dir)
            .arg("--cni-conf-dir")
            .arg(&node.conf_dir)
            .env("ORDNET_PIN_DIR", &node.pin_dir)
            .env("POD_NAMESPACE", "ordnet-system")
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let agent = Agent(child);
        // Ready when it installed and chained the plugin and the plugin's STATUS says so.
        let deadline = Instant::now() + LIMIT;
        loop {
            if !node.ordnet_cni().exists()
                || !node.chain().iter().any(|c| c["type"] == "ordnet-cni")
            {
                assert!(
                    Instant::now() < deadline,
                    "the agent did not chain ordnet-cni"
                );
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let (ok, _) = node.plugin(
                &node.ordnet_cni(),
                "STATUS",
                "none",
                &node.ordnet_conf(None),
            );
            if ok {
                return agent;
            }
            assert!(Instant::now() < deadline, "the agent did not get ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pod(name: &str, app: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "shop", "name": name, "labels": {"app": app}},
           "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "i"}]},
           "status": {"phase": "Pending"}})
}

/// The pod's address in ptp's result.
fn address(result: &Value) -> Ipv4Addr {
    result["ips"][0]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The host-side interface in ptp's result.
fn host_iface(result: &Value) -> String {
    result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i.get("sandbox").is_none())
        .unwrap()["name"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn cni_chain_enforces_from_the_first_packet_and_fails_closed() {
    if !root_or_skip("cni") {
        return;
    }
    assert!(
        Path::new(PTP).exists(),
        "{PTP} missing: scripts/setup installs containernetworking-plugins"
    );
    let node = Node::new();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime
        .block_on(FakeApi::start_on(SocketAddr::from((node.api_ip, 0))))
        .unwrap();
    let kubeconfig = node.dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig_yaml()).unwrap();
    api.create(json!({"apiVersion": "v1", "kind": "Namespace",
                      "metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop"}}}))
        .unwrap();
    for (name, app) in [
        ("srv", "srv"),
        ("open", "open"),
        ("good", "good"),
        ("bad", "bad"),
        ("late", "good"),
    ] {
        api.create(pod(name, app)).unwrap();
    }
    api.create(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": "srv-from-good"},
        "spec": {"podSelector": {"matchLabels": {"app": "srv"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "good"}}}]}]}}),
    )
    .unwrap();
    api.create(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": "bad-sends-nothing"},
        "spec": {"podSelector": {"matchLabels": {"app": "bad"}}, "policyTypes": ["Egress"]}}),
    )
    .unwrap();
    let agent = Agent::start(&node, &kubeconfig);

    // The main CNI rewrites its conflist (as many do when they restart): the agent puts
    // ordnet-cni back (on the inotify event: its periodic check, every 30 s, would come after
    // this wait's limit).
    std::fs::write(
        node.conf_dir.join("10-ptp.conflist"),
        node.main_conflist().to_string(),
    )
    .unwrap();
    let deadline = Instant::now() + LIMIT;
    while !node.chain().iter().any(|c| c["type"] == "ordnet-cni") {
        assert!(
            Instant::now() < deadline,
            "ordnet-cni was not chained again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The servers.
    let mut results = std::collections::BTreeMap::new();
    for name in ["srv", "open"] {
        let (ptp, (ok, out)) = node.add(name);
        assert!(ok, "ADD {name}: {out}");
        assert_eq!(
            out,
            {
                let mut p = ptp.clone();
                p["cniVersion"] = json!("1.0.0");
                p
            },
            "ordnet-cni passes ptp's result on"
        );
        node.serve(&node.pod_ns(name), address(&ptp));
        results.insert(name, ptp);
    }
    let (srv, open) = (address(&results["srv"]), address(&results["open"]));

    // The first probe after ADD returns sees the pod's policy.
    let (ptp, (ok, out)) = node.add("bad");
    assert!(ok, "ADD bad: {out}");
    for n in 0..5 {
        assert!(!node.connects("bad", open), "bad reached open (probe {n})");
        assert!(!node.connects("bad", srv), "bad reached srv (probe {n})");
    }
    results.insert("bad", ptp);
    let (ptp, (ok, out)) = node.add("good");
    assert!(ok, "ADD good: {out}");
    assert!(
        node.connects("good", srv),
        "good's first probe to srv was dropped"
    );
    assert!(node.connects("good", open));
    let (ok, out) = node.plugin(
        &node.ordnet_cni(),
        "CHECK",
        "good",
        &node.ordnet_conf(Some(&ptp)),
    );
    assert!(ok, "CHECK good: {out}");
    results.insert("good", ptp);
    for name in ["srv", "open", "good", "bad"] {
        assert!(
            node.links().contains(&host_iface(&results[name])),
            "{name}'s interface has no pinned link: {:?}",
            node.links()
        );
    }

    // The kubelet reports the addresses: nothing changes.
    for (name, result) in &results {
        let mut p = api.get("v1", "Pod", "shop", name).unwrap();
        let ip = address(result).to_string();
        p["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
        api.update(p).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(node.connects("good", srv));
    assert!(!node.connects("bad", open));

    // The interface ptp's result names is the pod's, whatever the node's routes say: without
    // srv's host route (a route event: the agent looks again) srv keeps its attachment.
    let srv_iface = host_iface(&results["srv"]);
    run(&format!(
        "ip -n {} route del {srv}/32 dev {srv_iface}",
        node.ns
    ));
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        node.links().contains(&srv_iface),
        "srv lost its link when its route went: {:?}",
        node.links()
    );
    run(&format!(
        "ip -n {} route add {srv}/32 dev {srv_iface}",
        node.ns
    ));
    assert!(node.connects("good", srv));

    // DEL, and the pod deleted: no attachment, no pin, no endpoint left.
    let bad_iface = host_iface(&results["bad"]);
    node.del("bad", &results["bad"]);
    api.delete("v1", "Pod", "shop", "bad").unwrap();
    let deadline = Instant::now() + LIMIT;
    while node.links().contains(&bad_iface) {
        assert!(
            Instant::now() < deadline,
            "bad's link was not removed: {:?}",
            node.links()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = Command::new("ip")
        .args(["-n", &node.ns, "link", "show", &bad_iface])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{bad_iface} still exists");

    // The agent stopped: ADD fails closed, the first probe (even to the node) is dropped.
    agent.stop();
    let (ptp, (ok, out)) = node.add("late");
    assert!(!ok, "ADD without the agent succeeded: {out}");
    assert_eq!(out["code"], 11, "{out}");
    assert!(
        out["msg"].as_str().unwrap().contains("failing closed"),
        "{out}"
    );
    let gateway: Ipv4Addr = ptp["ips"][0]["gateway"].as_str().unwrap().parse().unwrap();
    node.serve(&node.ns, gateway);
    assert!(
        !node.connects("late", gateway),
        "late reached the node without the agent"
    );
    assert!(
        !node.connects("late", open),
        "late reached open without the agent"
    );
    // The probe target is reachable at all: from a pod enforced earlier.
    assert!(node.connects("good", gateway));
    node.del("late", &ptp);

    // Uninstall: the conflist is the main plugin's again, the plugin and the pins are gone.
    let out = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", node.ns))
        .arg(env!("CARGO_BIN_EXE_ordnet"))
        .args(["agent", "--uninstall", "--cni-conf-dir"])
        .arg(&node.conf_dir)
        .arg("--cni-bin-dir")
        .arg(&node.bin_dir)
        .env("ORDNET_PIN_DIR", &node.pin_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(node.conflist(), node.main_conflist());
    assert!(!node.ordnet_cni().exists());
    assert!(!node.pin_dir.exists());
    node.stop.store(true, Ordering::SeqCst);
    drop(api);
    drop(runtime);
}
