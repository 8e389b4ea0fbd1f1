//! Random small clusters and change sequences for property tests. Small value pools make
//! collisions (shared labels, overlapping CIDRs, pod addresses inside ipBlocks, named ports with
//! several numbers) likely. Used by the engine's incremental test and, through `#[path]`, by the
//! testsuite's reference test.

#![allow(dead_code)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use ordnet_crds::Loaded;
use ordnet_crds::{ClusterObjects, ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};
use serde_json::{Value, json};

/// SplitMix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
pub const POD_NAMES: [&str; 4] = ["a", "b", "c", "d"];
pub const CIDRS: [(&str, &[&str]); 9] = [
    ("10.0.0.0/8", &["10.1.0.0/16", "10.2.2.0/24"]),
    ("10.1.0.0/16", &["10.1.1.0/24", "10.1.2.3/32"]),
    ("10.1.2.0/24", &["10.1.2.3/32"]),
    ("10.2.0.0/16", &["10.2.2.2/32"]),
    ("0.0.0.0/0", &["10.0.0.0/8", "192.0.2.0/24"]),
    ("192.0.2.0/24", &["192.0.2.10/32"]),
    ("10.3.3.3/32", &[]),
    ("fd00::/16", &["fd00:1::/32"]),
    ("::/0", &["fd00::/16"]),
];
pub const EXTERNALS: [&str; 6] = [
    "192.0.2.10",
    "192.0.2.77",
    "10.9.9.9",
    "198.51.100.5",
    "fd00:9::9",
    "2001:db8::1",
];
/// (name, protocol, number) pool for container ports.
pub const CONTAINER_PORTS: [(&str, &str, i32); 7] = [
    ("http", "TCP", 80),
    ("http", "TCP", 8080),
    ("dns", "UDP", 53),
    ("dns", "TCP", 53),
    ("metrics", "TCP", 9090),
    ("web", "SCTP", 80),
    ("web", "TCP", 81),
];
pub const PORT_NAMES: [&str; 5] = ["http", "dns", "metrics", "web", "none"];
pub const PROTOCOLS: [&str; 3] = ["TCP", "UDP", "SCTP"];
/// Ports worth probing (cover every number used above and neighbours).
pub const PROBE_PORTS: [u16; 8] = [53, 79, 80, 81, 85, 90, 8080, 9090];

/// A generated object, kept as JSON so that it can be mutated and re-typed.
#[derive(Clone, Debug)]
pub struct World {
    pub namespaces: BTreeMap<String, Value>,
    pub pods: BTreeMap<(String, String), Value>,
    pub nps: BTreeMap<(String, String), Value>,
    pub onps: BTreeMap<(String, String), Value>,
    pub conps: BTreeMap<String, Value>,
    /// Upstream ClusterNetworkPolicies.
    pub cnps: BTreeMap<String, Value>,
    /// Nodes (their addresses are some of [`EXTERNALS`]).
    pub nodes: BTreeMap<String, Value>,
}

fn labels(r: &mut Rng, keys: &[(&str, &[&str])]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, vs) in keys {
        if r.chance(70) {
            m.insert(k.to_string(), json!(r.pick(vs)));
        }
    }
    Value::Object(m)
}

pub fn namespace(r: &mut Rng, name: &str) -> Value {
    let mut l = labels(r, &[("team", &["red", "blue"]), ("env", &["prod", "dev"])]);
    l["ns"] = json!(name);
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": l}})
}

/// A pod; `slot` makes its addresses unique (10.<ns+1>.<slot/250>.<slot%250+1>).
pub fn pod(r: &mut Rng, ns_index: usize, name: &str, slot: usize) -> Value {
    let ns = NAMESPACES[ns_index];
    let l = labels(r, &[("pod", &["a", "b", "c"]), ("app", &["web", "db"])]);
    let mut ports = Vec::new();
    for (n, p, num) in CONTAINER_PORTS {
        if r.chance(30) {
            ports.push(json!({"name": n, "protocol": p, "containerPort": num}));
        }
    }
    if r.chance(20) {
        ports.push(json!({"containerPort": 7000}));
    }
    // Addresses sometimes fall into the CIDR pool's interesting spots.
    let v4 = match r.below(6) {
        0 => format!("10.1.2.{}", 3 + slot * 7 % 200),
        1 => format!("10.2.2.{}", 2 + slot),
        2 => format!("10.3.3.{}", 3 + slot),
        _ => format!("10.{}.{}.{}", ns_index + 1, slot / 250, slot % 250 + 1),
    };
    let mut status = json!({});
    match r.below(10) {
        0 => {} // no address yet
        1 | 2 => {
            let v6 = if r.chance(50) {
                format!("fd00:1::{:x}", slot + 1)
            } else {
                format!("fd00:{:x}::{:x}", ns_index + 2, slot + 1)
            };
            status = json!({"podIP": v4.clone(), "podIPs": [{"ip": v4}, {"ip": v6}]});
        }
        _ => status = json!({"podIP": v4}),
    }
    // Sometimes terminated: not an endpoint, and its addresses may be reused by a live pod.
    if r.chance(10) {
        status["phase"] = json!(if r.chance(50) { "Succeeded" } else { "Failed" });
    }
    let host_network = r.chance(5);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": l},
        "spec": {
            "nodeName": if r.chance(50) { "n1" } else { "n2" },
            "hostNetwork": host_network,
            "containers": [{"name": "c", "image": "i", "ports": ports}]
        },
        "status": status
    })
}

fn selector(r: &mut Rng, keys: &[(&str, &[&str])]) -> Value {
    match r.below(5) {
        0 => json!({}),
        1 | 2 => {
            let (k, vs) = r.pick(keys);
            json!({"matchLabels": {*k: r.pick(vs)}})
        }
        3 => {
            let (k, vs) = r.pick(keys);
            let op = *r.pick(&["In", "NotIn"]);
            json!({"matchExpressions": [{"key": k, "operator": op, "values": [r.pick(vs), r.pick(vs)]}]})
        }
        _ => {
            let (k, _) = r.pick(keys);
            let op = *r.pick(&["Exists", "DoesNotExist"]);
            json!({"matchExpressions": [{"key": k, "operator": op}]})
        }
    }
}

const POD_KEYS: [(&str, &[&str]); 2] = [("pod", &["a", "b", "c"]), ("app", &["web", "db"])];
const NS_KEYS: [(&str, &[&str]); 3] = [
    ("ns", &["x", "y", "z"]),
    ("team", &["red", "blue"]),
    ("kubernetes.io/metadata.name", &["x", "y", "z"]),
];

fn peer(r: &mut Rng) -> Value {
    match r.below(7) {
        0 | 1 => json!({"podSelector": selector(r, &POD_KEYS)}),
        2 => json!({"namespaceSelector": selector(r, &NS_KEYS)}),
        3 => {
            json!({"podSelector": selector(r, &POD_KEYS), "namespaceSelector": selector(r, &NS_KEYS)})
        }
        _ => {
            let (cidr, except) = r.pick(&CIDRS);
            let ex: Vec<&str> = except.iter().copied().filter(|_| r.chance(50)).collect();
            if ex.is_empty() {
                json!({"ipBlock": {"cidr": cidr}})
            } else {
                json!({"ipBlock": {"cidr": cidr, "except": ex}})
            }
        }
    }
}

fn port(r: &mut Rng, default_protocol_absent: bool) -> Value {
    let mut p = match r.below(7) {
        0 => json!({}),
        1 | 2 => json!({"port": *r.pick(&[53, 80, 81, 85, 8080, 9090])}),
        3 => json!({"port": 80, "endPort": *r.pick(&[80, 85, 90])}),
        _ => json!({"port": *r.pick(&PORT_NAMES)}),
    };
    if !(default_protocol_absent && r.chance(40)) {
        p["protocol"] = json!(r.pick(&PROTOCOLS));
    }
    p
}

fn list<F: FnMut(&mut Rng) -> Value>(r: &mut Rng, max: usize, mut f: F) -> Option<Value> {
    match r.below(4) {
        0 => None,
        1 => Some(json!([])),
        _ => {
            let n = 1 + r.below(max);
            Some(Value::Array((0..n).map(|_| f(r)).collect()))
        }
    }
}

fn np_rule(r: &mut Rng, peers_field: &str) -> Value {
    let mut rule = json!({});
    if let Some(peers) = list(r, 2, peer) {
        rule[peers_field] = peers;
    }
    if let Some(ports) = list(r, 2, |r| port(r, true)) {
        rule["ports"] = ports;
    }
    rule
}

pub fn network_policy(r: &mut Rng, ns: &str, name: &str) -> Value {
    let mut spec = json!({"podSelector": selector(r, &POD_KEYS)});
    match r.below(5) {
        0 => {}
        1 => spec["policyTypes"] = json!(["Ingress"]),
        2 => spec["policyTypes"] = json!(["Egress"]),
        3 => spec["policyTypes"] = json!(["Ingress", "Egress"]),
        _ => spec["policyTypes"] = json!([]),
    }
    if let Some(rules) = list(r, 2, |r| np_rule(r, "from")) {
        spec["ingress"] = rules;
    }
    if let Some(rules) = list(r, 2, |r| np_rule(r, "to")) {
        spec["egress"] = rules;
    }
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

fn ordered_rule(r: &mut Rng, peers_field: &str) -> Value {
    let mut rule = json!({"action": if r.chance(50) { "Allow" } else { "Deny" }});
    if let Some(peers) = list(r, 2, peer) {
        rule[peers_field] = peers;
    }
    if let Some(ports) = list(r, 2, |r| port(r, true)) {
        rule["ports"] = ports;
    }
    rule
}

fn ordered_spec(r: &mut Rng, priority: i64) -> Value {
    let mut spec = json!({"priority": priority, "podSelector": selector(r, &POD_KEYS)});
    if r.chance(30) {
        let mut dd = json!({});
        if r.chance(60) {
            dd["ingress"] = json!(r.chance(50));
        }
        if r.chance(60) {
            dd["egress"] = json!(r.chance(50));
        }
        spec["defaultDeny"] = dd;
    }
    if let Some(rules) = list(r, 3, |r| ordered_rule(r, "from")) {
        spec["ingress"] = rules;
    }
    if let Some(rules) = list(r, 3, |r| ordered_rule(r, "to")) {
        spec["egress"] = rules;
    }
    spec
}

pub fn ordered_policy(r: &mut Rng, ns: &str, name: &str) -> Value {
    let priority = r.below(3) as i64;
    let spec = ordered_spec(r, priority);
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

pub fn cluster_policy(r: &mut Rng, name: &str) -> Value {
    let priority = r.below(5) as i64 - 2;
    let mut spec = ordered_spec(r, priority);
    if r.chance(70) {
        spec["namespaceSelector"] = selector(r, &NS_KEYS);
    }
    if r.chance(30) {
        spec.as_object_mut().map(|m| m.remove("podSelector"));
    }
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
           "metadata": {"name": name}, "spec": spec})
}

/// Node names and their addresses (external addresses of the matrix).
pub const NODES: [(&str, &[&str]); 2] = [
    ("n1", &["192.0.2.77", "fd00:9::9"]),
    ("n2", &["198.51.100.5"]),
];
const NODE_KEYS: [(&str, &[&str]); 1] = [("role", &["infra", "worker"])];

pub fn node(r: &mut Rng, i: usize) -> Value {
    let (name, addrs) = NODES[i];
    let addresses: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"type": "InternalIP", "address": a}))
        .chain([json!({"type": "Hostname", "address": name})])
        .collect();
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "labels": labels(r, &NODE_KEYS)},
           "status": {"addresses": addresses}})
}

fn cnp_peer(r: &mut Rng, egress: bool) -> Value {
    match r.below(if egress { 10 } else { 5 }) {
        0 | 1 => json!({"namespaces": selector(r, &NS_KEYS)}),
        2..=4 => {
            let mut p = json!({"podSelector": selector(r, &POD_KEYS)});
            if r.chance(60) {
                p["namespaceSelector"] = selector(r, &NS_KEYS);
            }
            json!({"pods": p})
        }
        5..=7 => {
            let n = 1 + r.below(2);
            let nets: Vec<&str> = (0..n).map(|_| r.pick(&CIDRS).0).collect();
            let mut nets: Vec<&str> = nets.into_iter().collect();
            nets.sort();
            nets.dedup();
            json!({"networks": nets})
        }
        8 => json!({"nodes": selector(r, &NODE_KEYS)}),
        _ => json!({"domainNames": ["www.example.com"]}),
    }
}

fn cnp_protocol(r: &mut Rng, named: bool) -> Value {
    let proto = *r.pick(&["tcp", "udp", "sctp"]);
    match r.below(if named { 5 } else { 3 }) {
        0 | 1 => {
            json!({proto: {"destinationPort": {"number": *r.pick(&[53, 80, 81, 85, 8080, 9090])}}})
        }
        2 => {
            json!({proto: {"destinationPort": {"range": {"start": 80, "end": *r.pick(&[81, 85, 90])}}}})
        }
        _ => json!({"destinationNamedPort": *r.pick(&PORT_NAMES)}),
    }
}

fn cnp_rule(r: &mut Rng, egress: bool) -> Value {
    let action = *r.pick(&["Accept", "Deny", "Pass"]);
    let n = 1 + r.below(2);
    let peers: Vec<Value> = (0..n).map(|_| cnp_peer(r, egress)).collect();
    // Named ports only towards pods (upstream's CRD refuses them with address peers).
    let named = peers
        .iter()
        .all(|p| p.get("namespaces").is_some() || p.get("pods").is_some());
    let mut rule = json!({"action": action, (if egress { "to" } else { "from" }): peers});
    if r.chance(60) {
        let n = 1 + r.below(2);
        rule["protocols"] = Value::Array((0..n).map(|_| cnp_protocol(r, named)).collect());
    }
    if r.chance(30) {
        rule["name"] = json!(format!("r{}", r.below(10)));
    }
    rule
}

pub fn cluster_network_policy(r: &mut Rng, name: &str) -> Value {
    let subject = if r.chance(50) {
        json!({"namespaces": selector(r, &NS_KEYS)})
    } else {
        let mut p = json!({"podSelector": selector(r, &POD_KEYS)});
        if r.chance(60) {
            p["namespaceSelector"] = selector(r, &NS_KEYS);
        }
        json!({"pods": p})
    };
    let mut spec = json!({
        "tier": if r.chance(50) { "Admin" } else { "Baseline" },
        "priority": r.below(3),
        "subject": subject,
    });
    for (field, egress) in [("ingress", false), ("egress", true)] {
        let n = r.below(4);
        if n > 0 {
            spec[field] = Value::Array((0..n).map(|_| cnp_rule(r, egress)).collect());
        }
    }
    json!({"apiVersion": "policy.networking.k8s.io/v1beta1", "kind": "ClusterNetworkPolicy",
           "metadata": {"name": name}, "spec": spec})
}

impl World {
    pub fn random(r: &mut Rng) -> World {
        let mut w = World {
            namespaces: BTreeMap::new(),
            pods: BTreeMap::new(),
            nps: BTreeMap::new(),
            onps: BTreeMap::new(),
            conps: BTreeMap::new(),
            cnps: BTreeMap::new(),
            nodes: BTreeMap::new(),
        };
        for ns in NAMESPACES {
            if r.chance(85) {
                w.namespaces.insert(ns.to_string(), namespace(r, ns));
            }
        }
        let n = 2 + r.below(6);
        for slot in 0..n {
            let ni = r.below(3);
            let name = POD_NAMES[slot % POD_NAMES.len()];
            w.pods.insert(
                (NAMESPACES[ni].to_string(), name.to_string()),
                pod(r, ni, name, slot),
            );
        }
        for i in 0..r.below(3) {
            let ns = *r.pick(&NAMESPACES);
            w.nps.insert(
                (ns.into(), format!("np{i}")),
                network_policy(r, ns, &format!("np{i}")),
            );
        }
        for i in 0..r.below(3) {
            let ns = *r.pick(&NAMESPACES);
            w.onps.insert(
                (ns.into(), format!("onp{i}")),
                ordered_policy(r, ns, &format!("onp{i}")),
            );
        }
        for i in 0..r.below(3) {
            w.conps
                .insert(format!("conp{i}"), cluster_policy(r, &format!("conp{i}")));
        }
        for i in 0..r.below(4) {
            w.cnps.insert(
                format!("cnp{i}"),
                cluster_network_policy(r, &format!("cnp{i}")),
            );
        }
        for (i, (name, _)) in NODES.iter().enumerate() {
            if r.chance(80) {
                w.nodes.insert(name.to_string(), node(r, i));
            }
        }
        w
    }

    /// The typed objects, as the loader would hand them over.
    pub fn objects(&self) -> ClusterObjects {
        fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> Loaded<T> {
            Loaded {
                object: serde_json::from_value(v.clone())
                    .unwrap_or_else(|e| panic!("generated object does not parse: {e}\n{v}")),
                source: None,
            }
        }
        ClusterObjects {
            namespaces: self.namespaces.values().map(typed::<Namespace>).collect(),
            pods: self.pods.values().map(typed::<Pod>).collect(),
            network_policies: self.nps.values().map(typed::<NetworkPolicy>).collect(),
            ordered_policies: self
                .onps
                .values()
                .map(typed::<OrderedNetworkPolicy>)
                .collect(),
            cluster_ordered_policies: self
                .conps
                .values()
                .map(typed::<ClusterOrderedNetworkPolicy>)
                .collect(),
            services: Vec::new(),
            cluster_network_policies: self.cnps.values().map(typed).collect(),
            nodes: self.nodes.values().map(typed).collect(),
        }
    }

    /// The addresses of all pods (to keep new ones unique).
    fn used_slots(&self) -> usize {
        self.pods.len() + 40
    }
}

/// One random change, applied to `w`; returns it as the engine's input.
/// Every fourth change that writes an ordered policy writes it staged (`spec.mode: Staged`):
/// a policy goes from enforced to staged and back as later changes replace it. Decided by the
/// change counter, not the random stream, so that the changes of a seed stay what they were.
fn stage_some(v: &mut Value, counter: usize) {
    if counter.is_multiple_of(4) {
        v["spec"]["mode"] = json!("Staged");
    }
}

pub fn random_change(
    r: &mut Rng,
    w: &mut World,
    counter: &mut usize,
) -> ordnet_engine::ObjectChange {
    use ordnet_engine::{Object, ObjectChange, ObjectKind};
    *counter += 1;
    let typed = |v: &Value| v.clone();
    loop {
        match r.below(15) {
            12 => {
                let name = format!("cnp{}", r.below(3));
                let v = cluster_network_policy(r, &name);
                w.cnps.insert(name, v.clone());
                return ObjectChange::Upsert(Object::ClusterNetworkPolicy(
                    serde_json::from_value(v).unwrap(),
                ));
            }
            13 => {
                let i = r.below(NODES.len());
                let v = node(r, i);
                w.nodes.insert(NODES[i].0.to_string(), v.clone());
                return ObjectChange::Upsert(Object::Node(serde_json::from_value(v).unwrap()));
            }
            14 => {
                let i = r.below(NODES.len());
                if w.nodes.remove(NODES[i].0).is_none() {
                    continue;
                }
                return ObjectChange::Delete {
                    kind: ObjectKind::Node,
                    namespace: None,
                    name: NODES[i].0.to_string(),
                };
            }
            // New or replaced pod (relabel, re-IP, new ports, node move).
            0..=2 => {
                let ni = r.below(3);
                let name = *r.pick(&POD_NAMES);
                let slot = w.used_slots() + *counter * 3;
                let k = (NAMESPACES[ni].to_string(), name.to_string());
                let mut v = pod(r, ni, name, slot);
                if let Some(old) = w.pods.get(&k)
                    && r.chance(50)
                {
                    // Keep the addresses, change labels/ports only (or terminate).
                    v["status"] = old["status"].clone();
                    if r.chance(15) {
                        v["status"]["phase"] = json!("Succeeded");
                    }
                } else if r.chance(30)
                    && let Some(dead) = w.pods.values().find(|o| {
                        matches!(o["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
                            && !o["status"]["podIP"].is_null()
                    })
                {
                    // A live pod reusing a terminated pod's addresses.
                    v["status"] = dead["status"].clone();
                    v["status"]["phase"] = json!("Running");
                }
                // Keep the addresses of live pods unique: drop a live pod that has the address
                // of another live pod (a terminated pod's address may be reused).
                let live = |o: &Value| {
                    !matches!(o["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
                };
                let ip = v["status"]["podIP"].clone();
                if live(&v)
                    && !ip.is_null()
                    && w.pods
                        .iter()
                        .any(|(ok, o)| *ok != k && live(o) && o["status"]["podIP"] == ip)
                {
                    continue;
                }
                let v6 = v["status"]["podIPs"][1]["ip"].clone();
                if live(&v)
                    && !v6.is_null()
                    && w.pods
                        .iter()
                        .any(|(ok, o)| *ok != k && live(o) && o["status"]["podIPs"][1]["ip"] == v6)
                {
                    continue;
                }
                w.pods.insert(k, v.clone());
                return ObjectChange::Upsert(Object::Pod(
                    serde_json::from_value(typed(&v)).unwrap(),
                ));
            }
            3 => {
                let Some(k) = w.pods.keys().nth(r.below(w.pods.len().max(1))).cloned() else {
                    continue;
                };
                w.pods.remove(&k);
                return ObjectChange::Delete {
                    kind: ObjectKind::Pod,
                    namespace: Some(k.0),
                    name: k.1,
                };
            }
            4 => {
                let ns = *r.pick(&NAMESPACES);
                let v = namespace(r, ns);
                w.namespaces.insert(ns.to_string(), v.clone());
                return ObjectChange::Upsert(Object::Namespace(serde_json::from_value(v).unwrap()));
            }
            5 => {
                let ns = *r.pick(&NAMESPACES);
                w.namespaces.remove(ns);
                return ObjectChange::Delete {
                    kind: ObjectKind::Namespace,
                    namespace: None,
                    name: ns.to_string(),
                };
            }
            6 | 7 => {
                let ns = *r.pick(&NAMESPACES);
                let name = format!("np{}", r.below(3));
                let v = network_policy(r, ns, &name);
                w.nps.insert((ns.into(), name), v.clone());
                return ObjectChange::Upsert(Object::NetworkPolicy(
                    serde_json::from_value(v).unwrap(),
                ));
            }
            8 => {
                let ns = *r.pick(&NAMESPACES);
                let name = format!("onp{}", r.below(3));
                let mut v = ordered_policy(r, ns, &name);
                stage_some(&mut v, *counter);
                w.onps.insert((ns.into(), name), v.clone());
                return ObjectChange::Upsert(Object::OrderedNetworkPolicy(
                    serde_json::from_value(v).unwrap(),
                ));
            }
            9 => {
                let name = format!("conp{}", r.below(3));
                let mut v = cluster_policy(r, &name);
                stage_some(&mut v, *counter);
                w.conps.insert(name, v.clone());
                return ObjectChange::Upsert(Object::ClusterOrderedNetworkPolicy(
                    serde_json::from_value(v).unwrap(),
                ));
            }
            10 => {
                let all: Vec<(ObjectKind, Option<String>, String)> = w
                    .nps
                    .keys()
                    .map(|(ns, n)| (ObjectKind::NetworkPolicy, Some(ns.clone()), n.clone()))
                    .chain(w.onps.keys().map(|(ns, n)| {
                        (
                            ObjectKind::OrderedNetworkPolicy,
                            Some(ns.clone()),
                            n.clone(),
                        )
                    }))
                    .chain(
                        w.conps
                            .keys()
                            .map(|n| (ObjectKind::ClusterOrderedNetworkPolicy, None, n.clone())),
                    )
                    .chain(
                        w.cnps
                            .keys()
                            .map(|n| (ObjectKind::ClusterNetworkPolicy, None, n.clone())),
                    )
                    .collect();
                if all.is_empty() {
                    continue;
                }
                let (kind, namespace, name) = r.pick(&all).clone();
                match kind {
                    ObjectKind::NetworkPolicy => {
                        w.nps.remove(&(namespace.clone().unwrap(), name.clone()));
                    }
                    ObjectKind::OrderedNetworkPolicy => {
                        w.onps.remove(&(namespace.clone().unwrap(), name.clone()));
                    }
                    ObjectKind::ClusterNetworkPolicy => {
                        w.cnps.remove(&name);
                    }
                    _ => {
                        w.conps.remove(&name);
                    }
                }
                return ObjectChange::Delete {
                    kind,
                    namespace,
                    name,
                };
            }
            _ => {
                // Re-apply an unchanged pod (must be a no-op).
                let Some((_, v)) = w.pods.iter().nth(r.below(w.pods.len().max(1))) else {
                    continue;
                };
                return ObjectChange::Upsert(Object::Pod(
                    serde_json::from_value(v.clone()).unwrap(),
                ));
            }
        }
    }
}
