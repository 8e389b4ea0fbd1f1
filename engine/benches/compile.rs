//! `cargo bench -p ordnet-engine`: compile one node's endpoints of a generated cluster and
//! time incremental changes. Prints numbers; asserts nothing about time.
//!
//! Cluster: 2,000 pods in 100 namespaces (20 nodes of 100 pods), 500 NetworkPolicies and 500
//! OrderedNetworkPolicies (plus a few ClusterOrderedNetworkPolicies) with mixed selectors, CIDRs,
//! port ranges and named ports.

use std::time::{Duration, Instant};

use ordnet_crds::ClusterObjects;
use ordnet_crds::Loaded;
use ordnet_engine::{Engine, Object, ObjectChange};
use serde_json::{Value, json};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

const NAMESPACES: usize = 100;
const PODS_PER_NS: usize = 20;
const NODES: usize = 20;
const ENVS: [&str; 3] = ["prod", "staging", "dev"];
const APPS: [&str; 5] = ["web", "api", "db", "cache", "worker"];
const TEAMS: [&str; 10] = ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9"];
const CIDRS: [(&str, &[&str]); 6] = [
    ("10.0.0.0/8", &["10.1.0.0/16"]),
    ("0.0.0.0/0", &["10.0.0.0/8", "192.168.0.0/16"]),
    ("192.0.2.0/24", &[]),
    ("198.51.100.0/24", &["198.51.100.128/25"]),
    ("10.1.2.0/24", &[]),
    ("172.16.0.0/12", &[]),
];

fn ns_name(i: usize) -> String {
    format!("ns-{i:03}")
}

fn pod(r: &mut Rng, ns: usize, i: usize, app: &str) -> Value {
    let grpc = if r.below(2) == 0 { 50051 } else { 50052 };
    let mut ports = vec![
        json!({"name": "http", "containerPort": 8080, "protocol": "TCP"}),
        json!({"name": "metrics", "containerPort": 9090, "protocol": "TCP"}),
        json!({"name": "grpc", "containerPort": grpc, "protocol": "TCP"}),
    ];
    if r.below(4) == 0 {
        ports.push(json!({"name": "dns", "containerPort": 53, "protocol": "UDP"}));
    }
    let global = ns * PODS_PER_NS + i;
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i:02}"), "namespace": ns_name(ns), "labels": {
            "app": app,
            "tier": if r.below(2) == 0 { "frontend" } else { "backend" },
            "version": if r.below(3) == 0 { "v2" } else { "v1" },
        }},
        "spec": {"nodeName": format!("node-{:02}", global % NODES),
                 "containers": [{"name": "c", "image": "i", "ports": ports}]},
        "status": {"podIP": format!("10.{}.{}.{}", 1 + global / 62500, (global / 250) % 250, global % 250 + 1)}
    })
}

fn peer(r: &mut Rng) -> Value {
    match r.below(6) {
        0 | 1 => json!({"podSelector": {"matchLabels": {"app": r.pick(&APPS)}}}),
        2 => json!({"namespaceSelector": {"matchLabels": {"team": r.pick(&TEAMS)}}}),
        3 => json!({"namespaceSelector": {"matchLabels": {"team": r.pick(&TEAMS)}},
                    "podSelector": {"matchLabels": {"app": r.pick(&APPS)}}}),
        4 => json!({"namespaceSelector": {}}),
        _ => {
            let (c, e) = r.pick(&CIDRS);
            json!({"ipBlock": {"cidr": c, "except": e}})
        }
    }
}

fn port(r: &mut Rng) -> Value {
    match r.below(6) {
        0 => json!({"port": 8080}),
        1 => json!({"port": "http"}),
        2 => json!({"port": "grpc"}),
        3 => json!({"port": 9000, "endPort": 9100}),
        4 => json!({"protocol": "UDP", "port": "dns"}),
        _ => json!({"protocol": "TCP", "port": 443}),
    }
}

fn peers(r: &mut Rng) -> Value {
    Value::Array((0..1 + r.below(2)).map(|_| peer(r)).collect())
}
fn ports(r: &mut Rng) -> Value {
    Value::Array((0..1 + r.below(2)).map(|_| port(r)).collect())
}

fn network_policy(r: &mut Rng, ns: usize, i: usize) -> Value {
    let app = r.pick(&APPS);
    let mut spec = json!({"podSelector": {"matchLabels": {"app": app}},
        "ingress": [{"from": peers(r), "ports": ports(r)}, {"from": peers(r)}]});
    if r.below(3) == 0 {
        spec["policyTypes"] = json!(["Ingress", "Egress"]);
        spec["egress"] = json!([{"to": peers(r), "ports": ports(r)}]);
    }
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": format!("np-{i}"), "namespace": ns_name(ns)}, "spec": spec})
}

fn ordered_policy(r: &mut Rng, ns: usize, i: usize, priority: i64) -> Value {
    let app = r.pick(&APPS);
    let action = |r: &mut Rng| if r.below(3) == 0 { "Deny" } else { "Allow" };
    let ingress: Vec<Value> = (0..1 + r.below(3))
        .map(|_| json!({"action": action(r), "from": peers(r), "ports": ports(r)}))
        .collect();
    let egress: Vec<Value> = (0..r.below(3))
        .map(|_| json!({"action": action(r), "to": peers(r), "ports": ports(r)}))
        .collect();
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
           "metadata": {"name": format!("onp-{i}"), "namespace": ns_name(ns)},
           "spec": {"priority": priority, "podSelector": {"matchLabels": {"app": app}},
                    "ingress": ingress, "egress": egress}})
}

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Loaded<T> {
    Loaded {
        object: serde_json::from_value(v).expect("generated object"),
        source: None,
    }
}

fn cluster() -> (ClusterObjects, Vec<Value>, Vec<Value>) {
    let mut r = Rng(42);
    let mut objects = ClusterObjects::default();
    let mut pods = Vec::new();
    let mut onps = Vec::new();
    for ns in 0..NAMESPACES {
        objects
            .namespaces
            .push(typed(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns_name(ns), "labels": {
                "team": TEAMS[ns % TEAMS.len()],
                "env": ENVS[ns % 3],
                "kubernetes.io/metadata.name": ns_name(ns)}}})));
        for i in 0..PODS_PER_NS {
            let app = APPS[i % APPS.len()];
            let p = pod(&mut r, ns, i, app);
            pods.push(p.clone());
            objects.pods.push(typed(p));
        }
        for i in 0..5 {
            objects
                .network_policies
                .push(typed(network_policy(&mut r, ns, i)));
            let prio = r.below(1000) as i64;
            let o = ordered_policy(&mut r, ns, i, prio);
            onps.push(o.clone());
            objects.ordered_policies.push(typed(o));
        }
    }
    for (i, team) in TEAMS.iter().enumerate().take(5) {
        objects.cluster_ordered_policies.push(typed(json!({
            "apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
            "metadata": {"name": format!("guard-{i}")},
            "spec": {"priority": -10 + i as i64,
                     "namespaceSelector": {"matchLabels": {"env": "prod"}},
                     "ingress": [{"action": "Deny", "from": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]}],
                     "egress": [{"action": "Deny", "to": [{"namespaceSelector": {"matchLabels": {"team": team}}}],
                                 "ports": [{"port": 5432}]}]}})));
    }
    (objects, pods, onps)
}

fn vm_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let med = v[v.len() / 2];
    let max = v[v.len() - 1];
    format!(
        "median {:.3} ms, max {:.3} ms over {}",
        ms(med),
        ms(max),
        v.len()
    )
}

fn main() {
    let (objects, pods, onps) = cluster();
    println!(
        "cluster: {} namespaces, {} pods, {} NetworkPolicies, {} OrderedNetworkPolicies, {} ClusterOrderedNetworkPolicies",
        objects.namespaces.len(),
        objects.pods.len(),
        objects.network_policies.len(),
        objects.ordered_policies.len(),
        objects.cluster_ordered_policies.len()
    );
    let hwm_before = vm_hwm_kib();

    let node = "node-00";
    let t = Instant::now();
    let mut engine = Engine::build_for_node(&objects, node);
    let mut best = t.elapsed();
    println!(
        "peak memory (VmHWM) with one node engine: {} KiB (before building: {} KiB)",
        vm_hwm_kib().unwrap_or(0),
        hwm_before.unwrap_or(0)
    );
    for _ in 0..2 {
        let t = Instant::now();
        let e = Engine::build_for_node(&objects, node);
        best = best.min(t.elapsed());
        engine = e;
    }
    assert!(engine.errors().is_empty(), "{:?}", engine.errors());
    let n = engine.endpoints().len();
    let keys: usize = engine
        .endpoints()
        .iter()
        .map(|ep| {
            engine
                .policy(ep, ordnet_mapstate::Direction::Ingress)
                .mapstate
                .len()
                + engine
                    .policy(ep, ordnet_mapstate::Direction::Egress)
                    .mapstate
                    .len()
        })
        .sum();
    println!(
        "full compile of {node}: {:.1} ms total for {n} endpoints ({:.3} ms per endpoint); {} identities, {} selectors, {} shared MapStates, {keys} MapState keys over all endpoints",
        ms(best),
        ms(best) / n as f64,
        engine.identities().count(),
        engine.selector_count(),
        engine.shared_mapstates(),
    );
    // The shadowed-rule report (cluster-wide, from the node engine; engine/src/shadow.rs).
    let mut shadow_times = Vec::new();
    let mut shadowed = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        shadowed = engine.shadowed_rules();
        shadow_times.push(t.elapsed());
    }
    let ordered_rules: usize = engine
        .policies()
        .filter(|p| p.id.kind != ordnet_engine::PolicyKind::NetworkPolicy)
        .map(|p| p.rules[0].len() + p.rules[1].len())
        .sum();
    println!(
        "shadowed rules (whole cluster, from the node engine): {} of {ordered_rules} ordered rules; {}",
        shadowed.len(),
        stats(shadow_times)
    );
    if std::env::var_os("ORDNET_BENCH_SKIP_FULL").is_none() {
        let t = Instant::now();
        let full = Engine::build(&objects);
        println!(
            "full compile of every node ({} endpoints, {} shared MapStates): {:.1} ms",
            full.endpoints().len(),
            full.shared_mapstates(),
            ms(t.elapsed())
        );
        drop(full);
        println!(
            "peak memory (VmHWM) after the every-node compile: {} KiB",
            vm_hwm_kib().unwrap_or(0)
        );
    }

    // Incremental: relabel pods (on this node and elsewhere), flipping back and forth.
    let mut r = Rng(7);
    let mut on_node = Vec::new();
    let mut off_node = Vec::new();
    for round in 0..40 {
        let idx = r.below(pods.len());
        let mut p = pods[idx].clone();
        p["metadata"]["labels"]["app"] = json!(APPS[(round + 1) % APPS.len()]);
        p["metadata"]["labels"]["version"] = json!(format!("v{}", round % 4));
        let local = p["spec"]["nodeName"] == json!(node);
        let change = ObjectChange::Upsert(Object::Pod(serde_json::from_value(p).unwrap()));
        let t = Instant::now();
        let d = engine.apply(change);
        let el = t.elapsed();
        assert!(d.errors.is_empty());
        if local {
            on_node.push(el)
        } else {
            off_node.push(el)
        }
        // And back.
        let change = ObjectChange::Upsert(Object::Pod(
            serde_json::from_value(pods[idx].clone()).unwrap(),
        ));
        let t = Instant::now();
        engine.apply(change);
        let el = t.elapsed();
        if local {
            on_node.push(el)
        } else {
            off_node.push(el)
        }
    }
    // Force some local relabels.
    let local_pods: Vec<usize> = (0..pods.len())
        .filter(|i| pods[*i]["spec"]["nodeName"] == json!(node))
        .collect();
    for round in 0..20 {
        let idx = local_pods[round % local_pods.len()];
        let mut p = pods[idx].clone();
        p["metadata"]["labels"]["app"] = json!(APPS[(round + 2) % APPS.len()]);
        let t = Instant::now();
        engine.apply(ObjectChange::Upsert(Object::Pod(
            serde_json::from_value(p).unwrap(),
        )));
        on_node.push(t.elapsed());
        let t = Instant::now();
        engine.apply(ObjectChange::Upsert(Object::Pod(
            serde_json::from_value(pods[idx].clone()).unwrap(),
        )));
        on_node.push(t.elapsed());
    }
    println!(
        "incremental: one pod relabelled (pod on another node): {}",
        stats(off_node)
    );
    println!(
        "incremental: one pod relabelled (pod on this node): {}",
        stats(on_node)
    );

    // Incremental: edit one ordered policy (change a port and an action), and back.
    let mut edits = Vec::new();
    for round in 0..40 {
        let idx = r.below(onps.len());
        let mut p = onps[idx].clone();
        if let Some(rule) = p["spec"]["ingress"].get_mut(0) {
            rule["ports"] = json!([{"port": 7000 + round}]);
            rule["action"] = json!(if round % 2 == 0 { "Deny" } else { "Allow" });
        }
        let t = Instant::now();
        engine.apply(ObjectChange::Upsert(Object::OrderedNetworkPolicy(
            serde_json::from_value(p).unwrap(),
        )));
        edits.push(t.elapsed());
        let t = Instant::now();
        engine.apply(ObjectChange::Upsert(Object::OrderedNetworkPolicy(
            serde_json::from_value(onps[idx].clone()).unwrap(),
        )));
        edits.push(t.elapsed());
    }
    println!(
        "incremental: one OrderedNetworkPolicy edited: {}",
        stats(edits)
    );
    println!(
        "peak memory (VmHWM) at the end: {} KiB",
        vm_hwm_kib().unwrap_or(0)
    );
}
