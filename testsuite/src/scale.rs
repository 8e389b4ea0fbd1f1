//! A generated cluster at scale, for the scale benchmark and the 10k-pod consistency test.
//!
//! The shape (issue 13, comparable with the numbers measured against a real kube-apiserver):
//! 100 pods per node, 20 pods per namespace (4 Deployments of 5 replicas: `web`, `api`,
//! `worker`, `db`), one Service per namespace (in front of `web`, named target port); policies
//! spread over the namespaces, half NetworkPolicies and half ordered (one in 20 of the ordered
//! ones cluster-wide), with mixed pod/namespace selectors, `namespaceSelector: {}`, CIDRs with
//! `except`, port ranges and named ports.
//!
//! Pods look like what a real API server stores for a Deployment's pod after defaulting and the
//! kubelet's first status report (owner reference, `managedFields`, the service account token
//! volume, tolerations, conditions, container statuses): about 4 KiB of JSON each, so the memory
//! an agent keeps per watched pod is measured against realistic objects, not minimal ones.
//!
//! Everything is deterministic (a fixed seed): two runs generate the same cluster.

use serde_json::{Value, json};

use crate::fakeapi::FakeApi;

/// Pods per node.
pub const PODS_PER_NODE: usize = 100;
/// Pods per namespace.
pub const PODS_PER_NAMESPACE: usize = 20;
/// The Deployments of every namespace (each with `PODS_PER_NAMESPACE / 4` replicas).
pub const APPS: [&str; 4] = ["web", "api", "worker", "db"];
const TEAMS: usize = 25;
const ENVS: [&str; 3] = ["prod", "staging", "dev"];
const CIDRS: [(&str, &[&str]); 5] = [
    (
        "0.0.0.0/0",
        &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"],
    ),
    ("192.0.2.0/24", &[]),
    ("198.51.100.0/24", &["198.51.100.128/25"]),
    ("203.0.113.0/24", &["203.0.113.8/29"]),
    ("172.16.0.0/12", &["172.16.5.0/24"]),
];

/// A deterministic pseudo-random sequence (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (> 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// One element of `v` (not empty).
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// The size of a generated cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Pods in the cluster (a multiple of [`PODS_PER_NAMESPACE`] is exact; others round up).
    pub pods: usize,
    /// Policies in the cluster (NetworkPolicies + OrderedNetworkPolicies +
    /// ClusterOrderedNetworkPolicies).
    pub policies: usize,
}

impl Shape {
    /// Namespaces.
    pub fn namespaces(&self) -> usize {
        self.pods.div_ceil(PODS_PER_NAMESPACE)
    }

    /// Nodes.
    pub fn nodes(&self) -> usize {
        self.pods.div_ceil(PODS_PER_NODE)
    }

    /// The cluster-wide (ClusterOrderedNetworkPolicy) share of the policies: one in 40.
    pub fn cluster_policies(&self) -> usize {
        self.policies / 40
    }

    /// The objects, in an order an API server accepts them (namespaces first).
    pub fn objects(&self) -> Vec<Value> {
        let mut out = Vec::with_capacity(self.pods + self.policies + 2 * self.namespaces());
        out.extend((0..self.namespaces()).map(namespace));
        out.extend((0..self.namespaces()).map(service));
        out.extend((0..self.pods).map(|i| self.pod(i)));
        out.extend(self.policy_objects());
        out
    }

    /// The policies: `policies / 2` NetworkPolicies, the rest ordered, spread round-robin over
    /// the namespaces.
    pub fn policy_objects(&self) -> Vec<Value> {
        let mut r = Rng(0x5ca1e ^ self.pods as u64 ^ ((self.policies as u64) << 32));
        let nps = self.policies / 2;
        let conps = self.cluster_policies();
        let onps = self.policies - nps - conps;
        let namespaces = self.namespaces();
        let mut out = Vec::with_capacity(self.policies);
        for i in 0..nps {
            out.push(network_policy(&mut r, i % namespaces, i));
        }
        for i in 0..onps {
            let priority = 1 + r.below(1000) as i64;
            out.push(ordered_policy(&mut r, i % namespaces, i, priority));
        }
        for i in 0..conps {
            out.push(cluster_policy(&mut r, i));
        }
        out
    }

    /// The node of pod `i`: pods are spread round-robin, so every node runs pods of many
    /// namespaces (as a scheduler spreading Deployments does).
    pub fn node_of(&self, i: usize) -> String {
        node_name(i % self.nodes())
    }

    /// Pod `i` (namespace `i / 20`, Deployment `APPS[(i % 20) / 5]`).
    pub fn pod(&self, i: usize) -> Value {
        let ns = i / PODS_PER_NAMESPACE;
        let a = (i % PODS_PER_NAMESPACE) * APPS.len() / PODS_PER_NAMESPACE;
        let app = APPS[a];
        let rs = (ns * APPS.len() + a) as u64;
        let hash = format!("{:09x}", rs.wrapping_mul(0x9e37_79b9) % (1 << 36));
        let suffix = format!("{:05x}", i as u64 * 2_654_435_761 % 0xf_ffff);
        let name = format!("{app}-{hash}-{suffix}");
        let ip = pod_ip(i);
        let node = self.node_of(i);
        let host_ip = format!(
            "192.168.{}.{}",
            (i % self.nodes()) / 250,
            (i % self.nodes()) % 250 + 1
        );
        let pod_uid = uid(0x90d, i as u64);
        let ports = match app {
            "web" => json!([{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                            {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]),
            "api" => json!([{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                            {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                            {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]),
            "db" => json!([{"name": "postgres", "containerPort": 5432, "protocol": "TCP"},
                           {"name": "metrics", "containerPort": 9187, "protocol": "TCP"}]),
            _ => json!([{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]),
        };
        let t = "2026-11-20T08:15:42Z";
        let volume = format!("kube-api-access-{}", &suffix[..5]);
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "generateName": format!("{app}-{hash}-"), "namespace": ns_name(ns),
                "uid": pod_uid, "creationTimestamp": t,
                "labels": {"app": app, "pod-template-hash": hash,
                           "tier": if app == "web" { "frontend" } else { "backend" }},
                "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-19T17:02:11Z"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": format!("{app}-{hash}"), "uid": uid(0x75, rs),
                    "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [
                    {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                     "time": t, "fieldsType": "FieldsV1", "fieldsV1": {
                        "f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {},
                            "f:pod-template-hash": {}, "f:tier": {}},
                            "f:ownerReferences": {".": {}, format!("k:{{\"uid\":\"{}\"}}", uid(0x75, rs)): {}}},
                        "f:spec": {"f:containers": {format!("k:{{\"name\":\"{app}\"}}"): {".": {},
                            "f:image": {}, "f:imagePullPolicy": {}, "f:name": {}, "f:ports": {},
                            "f:resources": {}, "f:terminationMessagePath": {},
                            "f:terminationMessagePolicy": {}}},
                            "f:dnsPolicy": {}, "f:enableServiceLinks": {}, "f:restartPolicy": {},
                            "f:schedulerName": {}, "f:securityContext": {},
                            "f:terminationGracePeriodSeconds": {}}}},
                    {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": t,
                     "fieldsType": "FieldsV1", "subresource": "status", "fieldsV1": {
                        "f:status": {"f:conditions": {}, "f:containerStatuses": {}, "f:hostIP": {},
                            "f:hostIPs": {}, "f:phase": {}, "f:podIP": {}, "f:podIPs": {},
                            "f:startTime": {}}}}
                ]
            },
            "spec": {
                "containers": [{
                    "name": app, "image": format!("registry.example.com/shop/{app}:1.24.3"),
                    "ports": ports,
                    "env": [{"name": "LOG_LEVEL", "value": "info"},
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}],
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080, "scheme": "HTTP"},
                        "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3},
                    "volumeMounts": [{"name": volume, "readOnly": true,
                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"
                }],
                "volumes": [{"name": volume, "projected": {"defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
                "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
                "dnsPolicy": "ClusterFirst", "serviceAccountName": "default", "serviceAccount": "default",
                "nodeName": node, "securityContext": {}, "schedulerName": "default-scheduler",
                "tolerations": [
                    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
                "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
            },
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": t},
                    {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                    {"type": "Ready", "status": "True", "lastTransitionTime": t},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": t},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": t}],
                "hostIP": host_ip, "hostIPs": [{"ip": host_ip}],
                "podIP": ip, "podIPs": [{"ip": ip}], "startTime": t,
                "containerStatuses": [{"name": app, "state": {"running": {"startedAt": t}},
                    "lastState": {}, "ready": true, "restartCount": 0, "started": true,
                    "image": format!("registry.example.com/shop/{app}:1.24.3"),
                    "imageID": format!("registry.example.com/shop/{app}@sha256:{:016x}{:016x}{:016x}{:016x}", i, ns, 7, 9),
                    "containerID": format!("containerd://{:016x}{:016x}{:016x}{:016x}", i, ns, 3, 5)}],
                "qosClass": "Burstable"
            }
        })
    }
}

/// The name of node `n`.
pub fn node_name(n: usize) -> String {
    format!("node-{n:04}")
}

/// The name of namespace `n`.
pub fn ns_name(n: usize) -> String {
    format!("ns-{n:05}")
}

/// The address of pod `i` (10.0.0.0/8, unique up to 16 million pods).
pub fn pod_ip(i: usize) -> String {
    let i = i + 1;
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn uid(kind: u64, n: u64) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        kind as u32,
        (n >> 32) & 0xffff,
        (n >> 20) & 0xfff,
        (n >> 8) & 0xfff,
        n
    )
}

/// The labels of namespace `n`: a team (one in 25), an environment, the name label.
pub fn namespace(n: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns_name(n), "uid": uid(0x45, n as u64), "labels": {
            "team": format!("team-{}", n % TEAMS), "env": ENVS[n % ENVS.len()],
            "kubernetes.io/metadata.name": ns_name(n)}},
        "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}})
}

/// The Service of namespace `n`: `web`, port 80 to the named port `http`.
pub fn service(n: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": ns_name(n), "uid": uid(0x5e, n as u64)},
        "spec": {"type": "ClusterIP", "selector": {"app": "web"},
            "clusterIP": format!("10.96.{}.{}", n / 250, n % 250 + 1),
            "clusterIPs": [format!("10.96.{}.{}", n / 250, n % 250 + 1)],
            "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "sessionAffinity": "None",
            "internalTrafficPolicy": "Cluster",
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"}]},
        "status": {"loadBalancer": {}}})
}

fn peer(r: &mut Rng) -> Value {
    match r.below(8) {
        0 | 1 => json!({"podSelector": {"matchLabels": {"app": r.pick(&APPS)}}}),
        2 => {
            json!({"namespaceSelector": {"matchLabels": {"team": format!("team-{}", r.below(TEAMS))}}})
        }
        3 => json!({"namespaceSelector": {"matchLabels": {"env": r.pick(&ENVS)}},
                    "podSelector": {"matchLabels": {"app": r.pick(&APPS)}}}),
        4 => json!({"namespaceSelector": {}}),
        5 => json!({"namespaceSelector": {},
                    "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["frontend"]}]}}),
        _ => {
            let (c, e) = r.pick(&CIDRS);
            json!({"ipBlock": {"cidr": c, "except": e}})
        }
    }
}

fn port(r: &mut Rng) -> Value {
    match r.below(6) {
        0 => json!({"protocol": "TCP", "port": 8080}),
        1 => json!({"protocol": "TCP", "port": "http"}),
        2 => json!({"protocol": "TCP", "port": "metrics"}),
        3 => json!({"protocol": "TCP", "port": 9000, "endPort": 9100}),
        4 => json!({"protocol": "UDP", "port": 53}),
        _ => json!({"protocol": "TCP", "port": 5432}),
    }
}

fn list(r: &mut Rng, max: usize, f: fn(&mut Rng) -> Value) -> Value {
    Value::Array((0..1 + r.below(max)).map(|_| f(r)).collect())
}

fn subject(r: &mut Rng) -> Value {
    match r.below(6) {
        0 => json!({}),
        1 => json!({"matchLabels": {"tier": "backend"}}),
        _ => json!({"matchLabels": {"app": r.pick(&APPS)}}),
    }
}

fn network_policy(r: &mut Rng, ns: usize, i: usize) -> Value {
    let mut spec = json!({"podSelector": subject(r), "policyTypes": ["Ingress"],
        "ingress": [{"from": list(r, 2, peer), "ports": list(r, 2, port)}]});
    if r.below(2) == 0 {
        spec["ingress"]
            .as_array_mut()
            .expect("list")
            .push(json!({"from": list(r, 2, peer)}));
    }
    if r.below(3) == 0 {
        spec["policyTypes"] = json!(["Ingress", "Egress"]);
        spec["egress"] = json!([{"to": list(r, 2, peer), "ports": list(r, 2, port)},
                                {"to": [{"namespaceSelector": {}}], "ports": [{"protocol": "UDP", "port": 53}]}]);
    }
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": format!("np-{i}"), "namespace": ns_name(ns), "uid": uid(0x4e, i as u64)},
           "spec": spec})
}

fn action(r: &mut Rng) -> &'static str {
    if r.below(3) == 0 { "Deny" } else { "Allow" }
}

fn ordered_policy(r: &mut Rng, ns: usize, i: usize, priority: i64) -> Value {
    let ingress: Vec<Value> = (0..1 + r.below(3))
        .map(|_| json!({"action": action(r), "from": list(r, 2, peer), "ports": list(r, 2, port)}))
        .collect();
    let egress: Vec<Value> = (0..r.below(3))
        .map(|_| json!({"action": action(r), "to": list(r, 2, peer), "ports": list(r, 2, port)}))
        .collect();
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
           "metadata": {"name": format!("onp-{i}"), "namespace": ns_name(ns), "uid": uid(0x0e, i as u64)},
           "spec": {"priority": priority, "podSelector": subject(r),
                    "ingress": ingress, "egress": egress}})
}

fn cluster_policy(r: &mut Rng, i: usize) -> Value {
    let env = r.pick(&ENVS);
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
           "metadata": {"name": format!("conp-{i}"), "uid": uid(0xc0, i as u64)},
           "spec": {"priority": -1000 + i as i64,
                    "namespaceSelector": {"matchLabels": {"env": env}},
                    "ingress": [{"action": action(r), "from": list(r, 2, peer), "ports": list(r, 2, port)}],
                    "egress": [{"action": "Deny", "to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]}]}})
}

/// The kinds of change of the scale benchmark and the 10k-pod consistency test: a pod of node 0
/// (the agent's) or of node 1 flips its `tier` label, a namespace gets the next team, a
/// NetworkPolicy's first ingress peer list is replaced, an OrderedNetworkPolicy's priority moves.
pub const CHANGE_KINDS: [&str; 5] = [
    "local pod relabel",
    "remote pod relabel",
    "namespace relabel",
    "NetworkPolicy edit",
    "OrderedNetworkPolicy edit",
];

/// One change of kind `k` (index into [`CHANGE_KINDS`]), the `n`-th of its kind, written to the
/// fake API server: always a real change of the object. Returns the object as written.
pub fn change(api: &FakeApi, shape: &Shape, k: usize, n: usize) -> Value {
    api.update(next_change(api, shape, k, n)).unwrap()
}

/// The object [`change`] writes: read from the fake API server and changed, not written yet
/// (the scale benchmark times a change from its write).
pub fn next_change(api: &FakeApi, shape: &Shape, k: usize, n: usize) -> Value {
    let nodes = shape.nodes();
    match k {
        0 | 1 => {
            // A pod on the agent's node (0) or on node 1: flip its tier.
            let candidates = shape.pods / nodes;
            let i = ((n * 7919) % candidates) * nodes + (k % nodes.max(1));
            let pod = shape.pod(i);
            let (ns, name) = (&pod["metadata"]["namespace"], &pod["metadata"]["name"]);
            let mut o = api
                .get("v1", "Pod", ns.as_str().unwrap(), name.as_str().unwrap())
                .unwrap();
            let tier = &mut o["metadata"]["labels"]["tier"];
            *tier = json!(if tier == "frontend" {
                "backend"
            } else {
                "frontend"
            });
            o
        }
        2 => {
            let ns = (n * 31) % shape.namespaces();
            let mut o = api.get("v1", "Namespace", "", &ns_name(ns)).unwrap();
            // The next team: always a real change (an unchanged object is no event).
            let team = &mut o["metadata"]["labels"]["team"];
            let t: usize = team
                .as_str()
                .and_then(|t| t.strip_prefix("team-"))
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            *team = json!(format!("team-{}", (t + 1 + n % 7) % 25));
            o
        }
        3 => {
            let i = (n * 13) % (shape.policies / 2);
            let ns = ns_name(i % shape.namespaces());
            let mut o = api
                .get(
                    "networking.k8s.io/v1",
                    "NetworkPolicy",
                    &ns,
                    &format!("np-{i}"),
                )
                .unwrap();
            let apps = APPS;
            // Never what the generator wrote, never the previous edit.
            o["spec"]["ingress"][0]["from"] = json!([
                {"podSelector": {"matchLabels": {"app": apps[n % apps.len()]}}},
                {"namespaceSelector": {"matchLabels": {"team": format!("team-{}", n % 25)}},
                 "podSelector": {"matchLabels": {"edit": n.to_string()}}}]);
            o
        }
        _ => {
            let onps = shape.policies - shape.policies / 2 - shape.cluster_policies();
            let i = (n * 17) % onps;
            let ns = ns_name(i % shape.namespaces());
            let mut o = api
                .get(
                    "ordnet.io/v1alpha1",
                    "OrderedNetworkPolicy",
                    &ns,
                    &format!("onp-{i}"),
                )
                .unwrap();
            o["spec"]["priority"] = json!(1001 + n as i64);
            o
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_of_a_small_cluster() {
        let s = Shape {
            pods: 2000,
            policies: 1000,
        };
        let objects = s.objects();
        let count = |kind: &str| objects.iter().filter(|o| o["kind"] == kind).count();
        assert_eq!(count("Namespace"), 100);
        assert_eq!(count("Service"), 100);
        assert_eq!(count("Pod"), 2000);
        assert_eq!(count("NetworkPolicy"), 500);
        assert_eq!(
            count("OrderedNetworkPolicy") + count("ClusterOrderedNetworkPolicy"),
            500
        );
        assert_eq!(count("ClusterOrderedNetworkPolicy"), 25);
        assert_eq!(s.nodes(), 20);
        let on_node0 = objects
            .iter()
            .filter(|o| o["spec"]["nodeName"] == "node-0000")
            .count();
        assert_eq!(on_node0, 100);
        let mut ips: Vec<&str> = objects
            .iter()
            .filter_map(|o| o["status"]["podIP"].as_str())
            .collect();
        ips.sort();
        ips.dedup();
        assert_eq!(ips.len(), 2000);
        let bytes = serde_json::to_vec(&s.pod(7)).unwrap().len();
        assert!(
            (3000..6000).contains(&bytes),
            "a pod is {bytes} bytes of JSON"
        );
        // Deterministic.
        assert_eq!(s.objects(), objects);
    }
}
