//! Unit tests of translation, defaulting, identities and isolation on small hand-written
//! clusters.

mod common;

use std::net::IpAddr;
use std::path::Path;

use ordnet_engine::{Engine, FlowEnd, IdentityKind, IpFamily, PolicyKind, SideDecision};
use ordnet_mapstate::{Direction, Protocol, Verdict};

const BASE: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {ns: x}}
---
apiVersion: v1
kind: Namespace
metadata: {name: y, labels: {ns: y}}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: web}}
spec: {containers: [{name: c, image: i, ports: [{name: http, containerPort: 80}, {name: dns, containerPort: 53, protocol: UDP}]}]}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: web}}
spec: {containers: [{name: c, image: i, ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.0.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: y, labels: {app: db}}
spec: {containers: [{name: c, image: i}]}
status: {podIP: 10.0.1.3, podIPs: [{ip: 10.0.1.3}, {ip: "fd00::3"}]}
"#;

fn engine(extra: &str) -> Engine {
    common::manifest::build(&common::manifest::objects(&format!("{BASE}\n---\n{extra}")))
}

/// A NetworkPolicy named `p` in namespace `ns` with the given flow-style `spec`.
fn network_policy(ns: &str, spec: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p, namespace: {ns}}}\nspec: {spec}"
    )
}

fn pod(ns: &str, n: &str) -> FlowEnd {
    FlowEnd::Pod {
        namespace: ns.into(),
        name: n.into(),
    }
}

fn ip(s: &str) -> FlowEnd {
    FlowEnd::Ip(s.parse().unwrap())
}

/// Asserts, row by row, whether each IPv4 flow `(allowed, from, to, protocol, port)` is allowed.
#[track_caller]
fn assert_flows(e: &Engine, flows: &[(bool, FlowEnd, FlowEnd, Protocol, u16)]) {
    for (want, from, to, proto, port) in flows {
        let verdict = e.flow(from, to, IpFamily::V4, *proto, *port).verdict;
        assert_eq!(
            verdict == Verdict::Allow,
            *want,
            "{from:?} -> {to:?} {proto:?}/{port}: {verdict:?}"
        );
    }
}

fn isolated(e: &Engine, ns: &str, n: &str, d: Direction) -> bool {
    e.policy(e.endpoint(ns, n).unwrap(), d).isolated
}

#[test]
fn policy_types_defaulting() {
    // Only an egress section, no policyTypes: isolated both ways.
    let e = engine(&network_policy(
        "x",
        "{podSelector: {}, egress: [{to: [{podSelector: {}}]}]}",
    ));
    assert!(isolated(&e, "x", "a", Direction::Ingress));
    assert!(isolated(&e, "x", "a", Direction::Egress));
    assert!(!isolated(&e, "y", "c", Direction::Ingress));
    // x/a's egress allows x/b, but x/b's ingress is isolated with no ingress rule.
    let t = e.flow(
        &pod("x", "a"),
        &pod("x", "b"),
        IpFamily::V4,
        Protocol::Tcp,
        80,
    );
    assert_eq!(t.egress.unwrap().verdict, Verdict::Allow);
    assert_eq!(t.ingress.unwrap().verdict, Verdict::Deny);
    assert_eq!(t.verdict, Verdict::Deny);
    assert_flows(
        &e,
        &[
            (false, pod("x", "a"), pod("y", "c"), Protocol::Tcp, 80),
            (false, pod("y", "c"), pod("x", "a"), Protocol::Tcp, 80),
        ],
    );
    // `egress: []` adds no Egress.
    let e = engine(&network_policy("x", "{podSelector: {}, egress: []}"));
    assert!(isolated(&e, "x", "a", Direction::Ingress));
    assert!(!isolated(&e, "x", "a", Direction::Egress));
    // Ingress rules with policyTypes [Egress] are ignored, and ingress is not isolated.
    let e = engine(&network_policy(
        "x",
        "{podSelector: {}, policyTypes: [Egress], ingress: [{from: [{podSelector: {}}]}]}",
    ));
    assert!(!isolated(&e, "x", "a", Direction::Ingress));
    assert!(isolated(&e, "x", "a", Direction::Egress));
    let p = e.policies().next().unwrap();
    assert_eq!(p.id.kind, PolicyKind::NetworkPolicy);
    assert!(p.rules[0].is_empty());
    // policyTypes [Ingress, Egress] without rules: deny both.
    let e = engine(&network_policy(
        "x",
        "{podSelector: {matchLabels: {app: web}}, policyTypes: [Ingress, Egress]}",
    ));
    assert_flows(
        &e,
        &[
            (false, pod("x", "a"), pod("x", "b"), Protocol::Udp, 53),
            (true, pod("y", "c"), ip("192.0.2.1"), Protocol::Tcp, 1),
        ],
    );
}

#[test]
fn empty_port_item_is_tcp_only_and_rules_are_index_zero() {
    let e = engine(&network_policy(
        "x",
        "{podSelector: {}, ingress: [{ports: [{}]}, {from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]}",
    ));
    assert_flows(
        &e,
        &[
            (true, pod("y", "c"), pod("x", "a"), Protocol::Udp, 9),
            (true, ip("192.0.2.1"), pod("x", "a"), Protocol::Tcp, 9),
            (false, ip("192.0.2.1"), pod("x", "a"), Protocol::Udp, 9),
        ],
    );
    for r in e.policies().flat_map(|p| p.rules[0].iter()) {
        assert_eq!((r.order.priority, r.order.index), (0, 0));
    }
    // The origins keep the real rule index for trace.
    let idx: Vec<u32> = e
        .policies()
        .flat_map(|p| p.rules[0].iter().map(|r| r.origin.rule_index))
        .collect();
    assert_eq!(idx, [0, 1]);
}

#[test]
fn identities_split_only_where_a_selector_distinguishes() {
    // No selector distinguishes x/a and x/b: one identity.
    let e = engine(&network_policy(
        "y",
        "{podSelector: {}, ingress: [{ports: [{port: http}]}]}",
    ));
    let a = e.endpoint("x", "a").unwrap().identities.clone();
    let b = e.endpoint("x", "b").unwrap().identities.clone();
    assert_eq!(
        a, b,
        "an ingress named port resolves on the subject and splits nothing"
    );
    // An ipBlock containing only x/a's address splits them.
    let e = engine(&network_policy(
        "y",
        "{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/24, except: [10.0.0.2/32]}}]}]}",
    ));
    let a = e.endpoint("x", "a").unwrap().identities[0];
    let b = e.endpoint("x", "b").unwrap().identities[0];
    assert_ne!(a, b);
    assert_flows(
        &e,
        &[
            (true, pod("x", "a"), pod("y", "c"), Protocol::Tcp, 80),
            (false, pod("x", "b"), pod("y", "c"), Protocol::Tcp, 80),
            (true, ip("10.0.0.77"), pod("y", "c"), Protocol::Tcp, 80),
            (false, ip("10.0.1.77"), pod("y", "c"), Protocol::Tcp, 80),
        ],
    );
    // CIDR identities: one per prefix in use (cidr and except), world for the rest.
    let cidr = e.identity_of("10.0.0.77".parse().unwrap());
    assert_eq!(
        e.identity_info(cidr).unwrap().kind,
        IdentityKind::Cidr("10.0.0.0/24".parse().unwrap())
    );
    assert_eq!(
        e.identity_of("198.51.100.1".parse().unwrap()),
        e.world_identity()
    );
    assert_ne!(
        e.identity_of("10.0.0.2".parse().unwrap()),
        e.identity_of("10.0.0.200".parse().unwrap())
    );
    // The dual-stack pod gets one identity per address; they differ only if a selector says so.
    let c = &e.endpoint("y", "c").unwrap().identities;
    assert_eq!(c.len(), 2);
    assert_eq!(c[0], c[1]);
    // An egress named port resolving differently splits x/a (80) and x/b (8080).
    let e = engine(&network_policy(
        "y",
        "{podSelector: {}, policyTypes: [Egress], egress: [{ports: [{port: http}]}]}",
    ));
    let a = e.endpoint("x", "a").unwrap().identities[0];
    let b = e.endpoint("x", "b").unwrap().identities[0];
    assert_ne!(a, b);
    assert_ne!(a, 0);
    assert_flows(
        &e,
        &[
            (true, pod("y", "c"), pod("x", "a"), Protocol::Tcp, 80),
            (false, pod("y", "c"), pod("x", "a"), Protocol::Tcp, 8080),
            (true, pod("y", "c"), pod("x", "b"), Protocol::Tcp, 8080),
            (false, pod("y", "c"), pod("x", "b"), Protocol::Tcp, 80),
            // `to` empty: the named port still never matches a non-pod destination.
            (false, pod("y", "c"), ip("192.0.2.1"), Protocol::Tcp, 80),
            // ... and a name with another protocol does not match.
            (false, pod("y", "c"), pod("x", "a"), Protocol::Udp, 80),
        ],
    );
}

#[test]
fn cluster_policy_subject_and_peers() {
    // A podSelector alone in a cluster policy's peer means any namespace.
    let e = engine(
        "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\nmetadata: {name: g}\n\
         spec: {priority: -1, namespaceSelector: {matchLabels: {ns: y}}, \
         ingress: [{action: Deny, from: [{podSelector: {matchLabels: {app: web}}}]}]}",
    );
    assert_flows(
        &e,
        &[
            (false, pod("x", "a"), pod("y", "c"), Protocol::Tcp, 80),
            (true, ip("192.0.2.1"), pod("y", "c"), Protocol::Tcp, 80),
        ],
    );
    // Deny-only: not isolating.
    assert!(!isolated(&e, "y", "c", Direction::Ingress));
    assert!(!isolated(&e, "x", "a", Direction::Ingress));
    // The same peer in an OrderedNetworkPolicy means the policy's namespace only.
    let e = engine(
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {name: o, namespace: y}\n\
         spec: {priority: 1, podSelector: {}, \
         ingress: [{action: Deny, from: [{podSelector: {matchLabels: {app: web}}}]}]}",
    );
    assert_flows(
        &e,
        &[(true, pod("x", "a"), pod("y", "c"), Protocol::Tcp, 80)],
    );
}

#[test]
fn trace_names_rules_and_isolating_policies() {
    let e = engine(
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {name: o, namespace: y}\n\
         spec: {priority: 7, podSelector: {}, \
         ingress: [{action: Allow, from: [{namespaceSelector: {matchLabels: {ns: x}}}], ports: [{port: 80}]}]}",
    );
    let t = e.flow(
        &pod("x", "a"),
        &pod("y", "c"),
        IpFamily::V4,
        Protocol::Tcp,
        80,
    );
    assert_eq!(t.verdict, Verdict::Allow);
    assert!(t.egress.is_some());
    let ing = t.ingress.unwrap();
    match ing.decision {
        SideDecision::Matched { entry, .. } => {
            assert_eq!(entry.origins[0].name, "o");
            assert_eq!(entry.origins[0].priority, 7);
        }
        other => panic!("{other:?}"),
    }
    let t = e.flow(
        &pod("x", "a"),
        &pod("y", "c"),
        IpFamily::V4,
        Protocol::Tcp,
        81,
    );
    assert_eq!(t.verdict, Verdict::Deny);
    match t.ingress.unwrap().decision {
        SideDecision::Default {
            isolated,
            isolated_by,
        } => {
            assert!(isolated);
            assert_eq!(isolated_by[0].name, "o");
        }
        other => panic!("{other:?}"),
    }
    // A pod to itself, by name or by its own address, is exempt.
    let t = e.flow(
        &pod("y", "c"),
        &ip("10.0.1.3"),
        IpFamily::V4,
        Protocol::Tcp,
        81,
    );
    assert_eq!(t.verdict, Verdict::Allow);
    assert!(t.exemption.is_some());
    // JSON uses lowercase verdicts.
    let j = serde_json::to_value(&t).unwrap();
    assert_eq!(j["verdict"], "allow");
    // IPv6 probes use the pod's IPv6 address.
    let t = e.flow(
        &pod("x", "a"),
        &pod("y", "c"),
        IpFamily::V6,
        Protocol::Tcp,
        80,
    );
    assert_eq!(
        t.ingress.unwrap().peer_address,
        "10.0.0.1".parse::<IpAddr>().unwrap(),
        "x/a has no IPv6 address: its first address is used"
    );
    assert!(e.resolve("x/nope").is_err());
    assert!(e.resolve("garbage").is_err());
}

#[test]
fn invalid_objects_are_reported_not_fatal() {
    let mut out = ordnet_crds::load_str(
        Path::new("t.yaml"),
        &format!(
            "{BASE}\n---\napiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\n\
             metadata: {{name: bad, namespace: x}}\n\
             spec: {{priority: 1, podSelector: {{matchLabels: {{pod: '-a-'}}}}, ingress: [{{action: Allow}}]}}"
        ),
    );
    // Skip crds validation on purpose: the engine must defend itself.
    out.problems.clear();
    let e = Engine::build(&out.objects);
    // A policy whose subject cannot be known is left out and reported.
    assert_eq!(e.errors().len(), 1);
    let err = &e.errors()[0];
    assert_eq!(err.object, "OrderedNetworkPolicy x/bad");
    assert_eq!(err.field, "spec.podSelector.matchLabels.pod");
    assert!(Engine::try_build(&out.objects).is_err());
    // Everything else still works.
    assert_eq!(e.endpoints().len(), 3);
    assert!(!isolated(&e, "x", "a", Direction::Ingress));
}

/// A rule the engine cannot enforce as written fails closed (SEMANTICS.md §7): an Allow rule
/// matches nothing (the policy still isolates: it has an Allow rule), a Deny rule matches
/// everything at its place in the order; the rest of the object is enforced.
#[test]
fn unenforceable_rules_fail_closed() {
    let mut out = ordnet_crds::load_str(
        Path::new("t.yaml"),
        &format!(
            "{BASE}\n---\napiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\n\
             metadata: {{name: bad-allow, namespace: x}}\n\
             spec: {{priority: 1, podSelector: {{matchLabels: {{app: web}}}}, ingress: [\
               {{action: Allow, from: [{{ipBlock: {{cidr: 10.0.0.0/8, except: [11.0.0.0/16]}}}}]}}]}}\n\
             ---\napiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\n\
             metadata: {{name: bad-deny}}\n\
             spec: {{priority: -1, podSelector: {{matchLabels: {{app: db}}}}, egress: [\
               {{action: Allow, ports: [{{port: 53, protocol: UDP}}]}},\
               {{action: Deny, to: [{{ipBlock: {{cidr: nope}}}}]}},\
               {{action: Allow}}]}}"
        ),
    );
    out.problems.clear();
    let e = Engine::build(&out.objects);
    assert!(e.errors().is_empty(), "{:?}", e.errors());
    let failed: Vec<String> = e.failed_rules().map(|(p, r)| format!("{p}: {r}")).collect();
    assert_eq!(
        failed,
        [
            "OrderedNetworkPolicy x/bad-allow: spec.ingress[0] (Allow) matches nothing: spec.ingress[0].from[0].ipBlock.except[0]: 11.0.0.0/16 must be a strict subset of 10.0.0.0/8",
            "ClusterOrderedNetworkPolicy bad-deny: spec.egress[1] (Deny) denies all egress: spec.egress[1].to[0].ipBlock.cidr: \"nope\" is not a CIDR: write address/prefix-length, e.g. 10.0.0.0/8 (a single address is 10.1.2.3/32)",
        ]
    );
    // x/a and x/b: isolated, and their only Allow matches nothing: nobody reaches them.
    assert!(isolated(&e, "x", "a", Direction::Ingress));
    assert_flows(
        &e,
        &[
            (false, pod("x", "b"), pod("x", "a"), Protocol::Tcp, 80),
            (false, pod("y", "c"), pod("x", "a"), Protocol::Udp, 53),
            // y/c: UDP 53 allowed by rule 0, everything else denied by the failed Deny (rule
            // 1), which comes before the Allow-everything rule 2.
            (
                true,
                pod("y", "c"),
                FlowEnd::Ip("192.0.2.1".parse().unwrap()),
                Protocol::Udp,
                53,
            ),
            (
                false,
                pod("y", "c"),
                FlowEnd::Ip("192.0.2.1".parse().unwrap()),
                Protocol::Tcp,
                80,
            ),
            (
                true,
                FlowEnd::Ip("192.0.2.1".parse().unwrap()),
                pod("y", "c"),
                Protocol::Tcp,
                80,
            ),
        ],
    );
}

/// A pod in phase Succeeded or Failed: not an endpoint, no identity, no ipcache entry; its
/// address may be reused by a live pod (no validation error), from scratch and incrementally.
#[test]
fn terminated_pods_are_not_endpoints() {
    use ordnet_engine::{Object, ObjectChange};
    let pod_yaml = |name: &str, ip: &str, phase: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, labels: {{app: web}}}}\n\
             spec: {{containers: [{{name: c, image: i}}]}}\nstatus: {{podIP: {ip}, phase: {phase}}}"
        )
    };
    let upsert = |yaml: &str| -> ObjectChange {
        ObjectChange::Upsert(Object::Pod(yaml_serde::from_str(yaml).expect("pod")))
    };
    let host = |s: &str| -> ipnet::IpNet { s.parse::<IpAddr>().unwrap().into() };
    let cached = |e: &Engine, s: &str| {
        e.ipcache()
            .into_iter()
            .find(|(n, _)| *n == host(s))
            .map(|(_, id)| id)
    };
    // BASE with b failed, plus `extra`.
    let full = |extra: &str| {
        let text = BASE.replace(
            "status: {podIP: 10.0.0.2}",
            "status: {podIP: 10.0.0.2, phase: Failed}",
        );
        Engine::build(&common::manifest::objects(&format!("{text}\n---\n{extra}")))
    };

    // From scratch: a finished job holding a's address is neither an error nor an endpoint.
    let done = pod_yaml("job", "10.0.0.1", "Succeeded");
    let e = engine(&done);
    assert!(e.endpoint("x", "job").is_none());
    assert_eq!(e.endpoints().len(), 3);
    let a = e.endpoint("x", "a").unwrap().identities[0];
    assert_eq!(cached(&e, "10.0.0.1"), Some(a));
    assert!(
        e.identities()
            .all(|i| !i.members.iter().any(|m| m == "x/job"))
    );

    // Incrementally: b fails -> its endpoint, identity and address go.
    let mut inc = engine("");
    let b = inc.endpoint("x", "b").unwrap().identities[0];
    let failed_b = pod_yaml("b", "10.0.0.2", "Failed");
    let d = inc.apply(upsert(&failed_b));
    assert!(d.errors.is_empty(), "{:?}", d.errors);
    assert_eq!(d.endpoints_removed, vec!["x/b".to_string()]);
    assert!(
        inc.identities()
            .all(|i| !i.members.iter().any(|m| m == "x/b"))
    );
    assert!(
        d.ipcache
            .iter()
            .any(|c| c.prefix == host("10.0.0.2") && c.old == Some(b))
    );
    assert_eq!(cached(&inc, "10.0.0.2"), None);
    // A live pod reuses the address.
    let reuse = pod_yaml("n", "10.0.0.2", "Running");
    let d = inc.apply(upsert(&reuse));
    assert_eq!(d.endpoints_added, vec!["x/n".to_string()]);
    let n = inc.endpoint("x", "n").unwrap().identities[0];
    assert_eq!(cached(&inc, "10.0.0.2"), Some(n));
    assert_eq!(inc.snapshot(), full(&reuse).snapshot());

    // The other order: the new pod's event comes before the old one's termination.
    let mut inc = engine("");
    let reuse2 = pod_yaml("m", "10.0.0.2", "Running");
    inc.apply(upsert(&reuse2));
    inc.apply(upsert(&failed_b));
    let m = inc.endpoint("x", "m").unwrap().identities[0];
    assert_eq!(cached(&inc, "10.0.0.2"), Some(m));
    assert_eq!(inc.snapshot(), full(&reuse2).snapshot());
}

/// Services: frontends (ClusterIPs of both families, external and load-balancer IPs, NodePorts),
/// backends (selector in the Service's namespace, ready pods with an address, named target
/// ports resolved per pod: a pod without that port is no backend), headless and selector-less
/// Services, and the matrix destinations.
#[test]
fn services_frontends_and_backends() {
    let e = engine(
        r#"
---
apiVersion: v1
kind: Pod
metadata: {name: d, namespace: x, labels: {app: web}}
spec: {containers: [{name: c, image: i, ports: [{name: http, containerPort: 9090}]}]}
status:
  podIP: 10.0.0.4
  conditions: [{type: Ready, status: "False"}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: x}
spec:
  selector: {app: web}
  clusterIP: 10.96.0.1
  clusterIPs: [10.96.0.1, "fd96::1"]
  externalIPs: [203.0.113.1]
  type: LoadBalancer
  ports:
  - {name: http, port: 80, targetPort: http, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: dns}
status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}
---
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: x}
spec: {clusterIP: None, selector: {app: web}, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: manual, namespace: y}
spec: {clusterIP: 10.96.0.2, ports: [{port: 5432, targetPort: 5432}]}
"#,
    );
    let tcp = |a: &str| (a.parse::<IpAddr>().unwrap(), Protocol::Tcp, 80);
    let fe = e.service_frontends();
    for want in [
        tcp("10.96.0.1"),
        tcp("fd96::1"),
        tcp("203.0.113.1"),
        tcp("198.51.100.1"),
    ] {
        assert!(fe.contains(&want), "{want:?} in {fe:?}");
    }
    assert!(fe.contains(&("10.96.0.1".parse().unwrap(), Protocol::Udp, 53)));
    assert!(fe.contains(&("10.96.0.2".parse().unwrap(), Protocol::Tcp, 5432)));
    // web: 4 addresses x 2 ports; manual: 1; headless: none at all.
    assert_eq!(fe.len(), 4 * 2 + 1, "{fe:?}");
    assert_eq!(
        e.node_ports().into_iter().collect::<Vec<_>>(),
        [(Protocol::Tcp, 30080)]
    );
    // x/a serves http on 80, x/b on 8080; x/d is not ready; y/c is in another namespace.
    let backends = |proto, port| -> Vec<(String, u16)> {
        e.service_backends("x", "web", proto, port)
            .unwrap()
            .into_iter()
            .map(|b| (b.pod, b.port))
            .collect()
    };
    assert_eq!(
        backends(Protocol::Tcp, 80),
        [("x/a".to_string(), 80), ("x/b".to_string(), 8080)]
    );
    // Only x/a has a container port named dns (UDP).
    assert_eq!(backends(Protocol::Udp, 53), [("x/a".to_string(), 53)]);
    assert!(e.service_backends("x", "web", Protocol::Tcp, 81).is_none());
    assert_eq!(
        e.service_backends("y", "manual", Protocol::Tcp, 5432),
        Some(Vec::new()),
        "no selector: the backends are unknown"
    );
    // Matrix destinations: web at its ClusterIP of the family; manual has no known backend.
    let d4 = e.service_destinations(Protocol::Tcp, 80, IpFamily::V4);
    assert_eq!(d4.len(), 1);
    assert_eq!(d4[0].name, "svc:x/web");
    assert_eq!(d4[0].frontend, "10.96.0.1".parse::<IpAddr>().unwrap());
    assert!(
        e.service_destinations(Protocol::Tcp, 5432, IpFamily::V4)
            .is_empty()
    );
    // IPv6: the ClusterIP exists, but no backend has an IPv6 address.
    assert!(
        e.service_destinations(Protocol::Tcp, 80, IpFamily::V6)
            .is_empty()
    );
}

/// A Service with an address that is not one is an error naming the object and the field.
#[test]
fn invalid_service_is_an_error_naming_the_field() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: x}
spec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}
"#;
    let out = ordnet_crds::validated(ordnet_crds::load_str(Path::new("t.yaml"), text));
    let errors: Vec<String> = out.problems.iter().map(|p| p.to_string()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("Service x/bad") && e.contains("spec.clusterIP")),
        "{errors:?}"
    );
    assert!(
        out.objects.services.is_empty(),
        "an invalid Service is not used"
    );
}

/// A change that moves every address of an identity to one new signature (a namespace
/// relabel, a pod relabel when the identity is the pod's alone) keeps the identity's number:
/// no address changes identity, and only the selectors that tell the old labels from the new
/// change keys. An identity that other pods keep, or a signature that has an identity already,
/// is a change of identity as before. Every step equals a fresh build.
#[test]
fn relabels_keep_the_identity_when_all_its_addresses_move() {
    use ordnet_engine::{EngineDelta, Object, ObjectChange};
    let policy = network_policy(
        "y",
        "{podSelector: {}, ingress: [\
         {from: [{namespaceSelector: {matchLabels: {team: blue}}}], ports: [{port: 80}]},\
         {from: [{namespaceSelector: {}}], ports: [{port: 443}]}]}",
    );
    let mut inc = engine(&policy);
    let mut objects = format!("{BASE}\n---\n{policy}");
    let mut apply = |inc: &mut Engine, yaml: String| -> EngineDelta {
        let change = if yaml.contains("kind: Namespace") {
            ObjectChange::Upsert(Object::Namespace(yaml_serde::from_str(&yaml).unwrap()))
        } else {
            ObjectChange::Upsert(Object::Pod(yaml_serde::from_str(&yaml).unwrap()))
        };
        let d = inc.apply(change);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        // The objects as they are now: the changed one replaces its earlier version.
        // `metadata: {name: N` or `metadata: {name: N, namespace: M`: the object's identity.
        let name = yaml.lines().find(|l| l.starts_with("metadata:")).unwrap();
        let name = name.split(", labels").next().unwrap().to_string();
        let docs: Vec<String> = objects
            .split("\n---\n")
            .filter(|doc| !doc.contains(&name))
            .map(str::to_string)
            .chain([yaml])
            .collect();
        objects = docs.join("\n---\n");
        let full = common::manifest::build(&common::manifest::objects(&objects));
        assert_eq!(inc.snapshot(), full.snapshot(), "after {:?}", d);
        d
    };
    let ns_x = |labels: &str| {
        format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: x, labels: {{ns: x{labels}}}}}")
    };
    let pod_a = |app: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: a, namespace: x, labels: {{app: {app}}}}}\n\
             spec: {{containers: [{{name: c, image: i, ports: [{{name: http, containerPort: 80}}, \
             {{name: dns, containerPort: 53, protocol: UDP}}]}}]}}\nstatus: {{podIP: 10.0.0.1}}"
        )
    };
    let id_of = |e: &Engine, pod: &str| e.endpoint("x", pod).unwrap().identities[0];
    let allowed = |e: &Engine, port: u16| {
        e.flow(
            &pod("x", "a"),
            &pod("y", "c"),
            IpFamily::V4,
            Protocol::Tcp,
            port,
        )
        .verdict
            == Verdict::Allow
    };
    let web = id_of(&inc, "a");
    assert_eq!(id_of(&inc, "b"), web);
    assert!(!allowed(&inc, 80) && allowed(&inc, 443));

    // A namespace label no selector reads: the identity keeps its number, nothing is written.
    let d = apply(&mut inc, ns_x(", owner: z"));
    assert_eq!(d.identities_relabelled, vec![web]);
    assert!(d.identities_added.is_empty() && d.identities_removed.is_empty());
    assert!(d.ipcache.is_empty() && d.updates.is_empty(), "{d:?}");
    assert_eq!(id_of(&inc, "a"), web);
    assert_eq!(
        inc.identity_info(web).unwrap().namespace_labels["owner"],
        "z"
    );

    // A label a selector reads: only c's ingress changes, by the keys of that selector.
    let d = apply(&mut inc, ns_x(", owner: z, team: blue"));
    assert_eq!(d.identities_relabelled, vec![web]);
    assert!(d.ipcache.is_empty());
    assert_eq!(d.updates.len(), 1, "{:?}", d.updates);
    assert_eq!(
        (d.updates[0].endpoint.as_str(), d.updates[0].direction),
        ("y/c", Direction::Ingress)
    );
    assert!(d.updates[0].changes.removed.is_empty());
    assert!(allowed(&inc, 80) && allowed(&inc, 443));
    // And back.
    let d = apply(&mut inc, ns_x(", owner: z"));
    assert_eq!(d.identities_relabelled, vec![web]);
    assert!(d.updates[0].changes.added.is_empty() && !d.updates[0].changes.removed.is_empty());
    assert!(!allowed(&inc, 80) && allowed(&inc, 443));

    // a leaves the identity it shares with b: a new identity, b keeps the old one.
    let d = apply(&mut inc, pod_a("api"));
    let api = id_of(&inc, "a");
    assert!(d.identities_relabelled.is_empty());
    assert_eq!(d.identities_added, vec![api]);
    assert_ne!(api, web);
    assert_eq!(id_of(&inc, "b"), web);
    // The identity is a's alone now: relabelled in place.
    let d = apply(&mut inc, pod_a("api2"));
    assert_eq!(d.identities_relabelled, vec![api]);
    assert!(d.ipcache.is_empty());
    assert_eq!(id_of(&inc, "a"), api);
    // Back to b's labels: that signature has an identity, which a joins; its own goes.
    let d = apply(&mut inc, pod_a("web"));
    assert!(d.identities_relabelled.is_empty());
    assert_eq!(d.identities_removed, vec![api]);
    assert_eq!(id_of(&inc, "a"), web);
}
