use crate::CNP_API_VERSIONS;
use std::path::Path;

use super::*;
use crate::manifest::load_str;
use crate::problem::Severity;

fn onp(spec: &str) -> OrderedNetworkPolicy {
    let text = format!(
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {{name: p, namespace: q}}\nspec: {spec}\n"
    );
    let out = load_str(Path::new("t.yaml"), &text);
    assert!(!out.has_errors(), "{:?}", out.problems);
    out.objects.ordered_policies[0].object.clone()
}

fn conp(spec: &str) -> ClusterOrderedNetworkPolicy {
    let text = format!(
        "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\nmetadata: {{name: c}}\nspec: {spec}\n"
    );
    let out = load_str(Path::new("t.yaml"), &text);
    assert!(!out.has_errors(), "{:?}", out.problems);
    out.objects.cluster_ordered_policies[0].object.clone()
}

fn np(spec: &str) -> NetworkPolicy {
    let text = format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: n, namespace: q}}\nspec: {spec}\n"
    );
    let out = load_str(Path::new("t.yaml"), &text);
    assert!(!out.has_errors(), "{:?}", out.problems);
    out.objects.network_policies[0].object.clone()
}

fn render(errors: &[FieldError], severity: Severity) -> Vec<String> {
    errors
        .iter()
        .filter(|e| e.severity == severity)
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect()
}

/// The fields of the errors (not warnings).
fn error_fields(errors: &[FieldError]) -> Vec<String> {
    errors
        .iter()
        .filter(|e| e.severity == Severity::Error)
        .map(|e| e.field.clone())
        .collect()
}

#[test]
fn valid_policies_have_no_problems() {
    let p = onp(
        "{priority: 0, podSelector: {matchExpressions: [{key: pod, operator: In, values: [a]}]}, ingress: [{action: Deny, from: [{podSelector: {}, namespaceSelector: {matchLabels: {ns: y}}}], ports: [{port: 80, endPort: 90}, {protocol: SCTP, port: serve-80-sctp}]}, {action: Allow, from: [{ipBlock: {cidr: 'fd00::/8', except: ['fd00:1::/32']}}]}]}",
    );
    assert_eq!(validate_ordered_network_policy(&p), []);
    let c = conp("{priority: -100, egress: [{action: Deny, to: [{ipBlock: {cidr: 0.0.0.0/0}}]}]}");
    assert_eq!(validate_cluster_ordered_network_policy(&c), []);
    let n = np(
        "{podSelector: {}, policyTypes: [Ingress, Egress], egress: [{ports: [{port: 53, protocol: UDP}]}]}",
    );
    assert_eq!(validate_network_policy(&n), []);
}

#[test]
fn namespaced_priority_must_not_be_negative() {
    let p = onp("{priority: -1, podSelector: {}, defaultDeny: {ingress: true}}");
    let e = validate_ordered_network_policy(&p);
    assert_eq!(error_fields(&e), ["spec.priority"]);
    assert!(e[0].message.contains("-1"));
    let c = conp("{priority: -1, defaultDeny: {ingress: true}}");
    assert_eq!(validate_cluster_ordered_network_policy(&c), []);
}

#[test]
fn port_rules() {
    let cases = [
        (
            "{port: 0}",
            "spec.ingress[0].ports[0].port",
            "between 1 and 65535",
        ),
        (
            "{port: 65536}",
            "spec.ingress[0].ports[0].port",
            "between 1 and 65535",
        ),
        (
            "{endPort: 90}",
            "spec.ingress[0].ports[0].endPort",
            "without port",
        ),
        (
            "{port: http, endPort: 90}",
            "spec.ingress[0].ports[0].endPort",
            "named port",
        ),
        (
            "{port: 90, endPort: 80}",
            "spec.ingress[0].ports[0].endPort",
            "greater than or equal to port (90)",
        ),
        (
            "{port: 90, endPort: 70000}",
            "spec.ingress[0].ports[0].endPort",
            "between 1 and 65535",
        ),
        ("{port: Http}", "spec.ingress[0].ports[0].port", "lowercase"),
        ("{port: http--alt}", "spec.ingress[0].ports[0].port", "--"),
        (
            "{port: -http}",
            "spec.ingress[0].ports[0].port",
            "start or end",
        ),
        (
            "{port: a-very-long-port-name}",
            "spec.ingress[0].ports[0].port",
            "longer than 15",
        ),
        (
            "{port: '8080'}",
            "spec.ingress[0].ports[0].port",
            "without quotes",
        ),
        (
            "{port: '123-456'}",
            "spec.ingress[0].ports[0].port",
            "at least one letter",
        ),
    ];
    for (port, field, message) in cases {
        let p = onp(&format!(
            "{{priority: 1, podSelector: {{}}, ingress: [{{action: Allow, ports: [{port}]}}]}}"
        ));
        let e = validate_ordered_network_policy(&p);
        assert_eq!(error_fields(&e), [field], "{port}: {e:?}");
        assert!(e[0].message.contains(message), "{port}: {}", e[0].message);
        // The same port in a NetworkPolicy gets the same verdict.
        let n = np(&format!(
            "{{podSelector: {{}}, ingress: [{{ports: [{port}]}}]}}"
        ));
        let e = validate_network_policy(&n);
        assert_eq!(error_fields(&e), [field], "NetworkPolicy {port}: {e:?}");
    }
}

#[test]
fn network_policy_protocol_and_policy_types() {
    let n = np("{podSelector: {}, ingress: [{ports: [{protocol: tcp}, {protocol: ICMP}]}]}");
    let e = validate_network_policy(&n);
    assert_eq!(
        error_fields(&e),
        [
            "spec.ingress[0].ports[0].protocol",
            "spec.ingress[0].ports[1].protocol"
        ]
    );
    assert!(e[0].message.contains("upper case"));
    let n = np("{podSelector: {}, policyTypes: [Ingress, Outgress]}");
    assert_eq!(
        error_fields(&validate_network_policy(&n)),
        ["spec.policyTypes[1]"]
    );
    let n = np("{podSelector: {}, policyTypes: [Ingress, Egress, Ingress]}");
    assert_eq!(
        error_fields(&validate_network_policy(&n)),
        ["spec.policyTypes"]
    );
    // Rules of a direction not in policyTypes are ignored upstream: a warning.
    let n = np("{podSelector: {}, policyTypes: [Ingress], egress: [{}]}");
    let e = validate_network_policy(&n);
    assert_eq!(
        render(&e, Severity::Warning),
        ["spec.egress: ignored: policyTypes does not include Egress"]
    );
    assert!(error_fields(&e).is_empty());
}

#[test]
fn peer_rules() {
    let cases: [(&str, &[&str]); 10] = [
        ("{}", &["spec.ingress[0].from[0]"]),
        (
            "{podSelector: {}, ipBlock: {cidr: 10.0.0.0/8}}",
            &["spec.ingress[0].from[0]"],
        ),
        (
            "{ipBlock: {cidr: 10.0.0.0}}",
            &["spec.ingress[0].from[0].ipBlock.cidr"],
        ),
        (
            "{ipBlock: {cidr: 10.0.0.0/33}}",
            &["spec.ingress[0].from[0].ipBlock.cidr"],
        ),
        (
            "{ipBlock: {cidr: 010.0.0.0/8}}",
            &["spec.ingress[0].from[0].ipBlock.cidr"],
        ),
        (
            "{ipBlock: {cidr: '::ffff:10.0.0.0/104'}}",
            &["spec.ingress[0].from[0].ipBlock.cidr"],
        ),
        (
            "{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/8, 11.0.0.0/16, 'fd00::/16', 10.1.0.0/16, bogus]}}",
            &[
                "spec.ingress[0].from[0].ipBlock.except[0]",
                "spec.ingress[0].from[0].ipBlock.except[1]",
                "spec.ingress[0].from[0].ipBlock.except[2]",
                "spec.ingress[0].from[0].ipBlock.except[4]",
            ],
        ),
        (
            "{podSelector: {matchExpressions: [{key: a, operator: In, values: []}, {key: b, operator: Exists, values: [x]}, {key: c, operator: Equals, values: [x]}]}}",
            &[
                "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
                "spec.ingress[0].from[0].podSelector.matchExpressions[1].values",
                "spec.ingress[0].from[0].podSelector.matchExpressions[2].operator",
            ],
        ),
        (
            "{namespaceSelector: {matchLabels: {'bad key': v, ok: 'bad value!'}}}",
            &[
                "spec.ingress[0].from[0].namespaceSelector.matchLabels.bad key",
                "spec.ingress[0].from[0].namespaceSelector.matchLabels.ok",
            ],
        ),
        (
            "{podSelector: {matchExpressions: [{key: -a, operator: NotIn, values: [-x]}]}}",
            &[
                "spec.ingress[0].from[0].podSelector.matchExpressions[0].key",
                "spec.ingress[0].from[0].podSelector.matchExpressions[0].values[0]",
            ],
        ),
    ];
    for (peer, fields) in cases {
        let p = onp(&format!(
            "{{priority: 1, podSelector: {{}}, ingress: [{{action: Allow, from: [{peer}]}}]}}"
        ));
        let e = validate_ordered_network_policy(&p);
        assert_eq!(error_fields(&e), fields, "{peer}: {e:?}");
        let n = np(&format!(
            "{{podSelector: {{}}, ingress: [{{from: [{peer}]}}]}}"
        ));
        assert_eq!(
            error_fields(&validate_network_policy(&n)),
            fields,
            "NetworkPolicy {peer}"
        );
    }
}

#[test]
fn cidrs() {
    let p = parse_cidr("10.1.2.3/8").unwrap();
    assert_eq!(p.net.to_string(), "10.0.0.0/8");
    assert!(p.host_bits_set);
    let p = parse_cidr("2001:db8::/32").unwrap();
    assert!(!p.host_bits_set);
    assert!(parse_cidr("0.0.0.0/0").is_ok());
    assert!(parse_cidr("::/0").is_ok());
    for bad in [
        "",
        "/8",
        "10.0.0.0/",
        "10.0.0.0/-1",
        "10.0.0.0/+8",
        "10.0.0.0/8/8",
        "1.2.3/8",
        "fe80::1%eth0/64",
        "::/129",
    ] {
        assert!(parse_cidr(bad).is_err(), "{bad}");
    }
    assert!(
        parse_cidr("01.2.3.4/32")
            .unwrap_err()
            .contains("leading zeros")
    );

    // Host bits: accepted (as the API server does) with a warning.
    let p = onp(
        "{priority: 1, podSelector: {}, ingress: [{action: Allow, from: [{ipBlock: {cidr: 10.1.2.3/8, except: [10.1.0.1/16]}}]}]}",
    );
    let e = validate_ordered_network_policy(&p);
    assert!(error_fields(&e).is_empty());
    assert_eq!(
        render(&e, Severity::Warning),
        [
            "spec.ingress[0].from[0].ipBlock.cidr: \"10.1.2.3/8\" has bits set after the prefix; it is used as 10.0.0.0/8",
            "spec.ingress[0].from[0].ipBlock.except[0]: \"10.1.0.1/16\" has bits set after the prefix; it is used as 10.1.0.0/16",
        ]
    );
}

#[test]
fn rules_that_can_never_decide() {
    let p = onp(
        "{priority: 1, podSelector: {}, ingress: [{action: Allow, ports: [{port: 80}]}, {action: Allow, ports: [{port: 80, protocol: TCP}]}, {action: Deny, ports: [{port: 80}]}, {action: Deny, ports: [{port: 81}]}]}",
    );
    // Valid (they are only unwise): warnings, the policy is enforced as written.
    let e = validate_ordered_network_policy(&p);
    assert!(error_fields(&e).is_empty());
    let warnings = render(&e, Severity::Warning);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].starts_with("spec.ingress[1]: duplicate of spec.ingress[0]"));
    assert!(warnings[1].starts_with(
        "spec.ingress[2]: matches exactly the same traffic as spec.ingress[0] (Allow)"
    ));

    let p = onp(
        "{priority: 1, podSelector: {}, egress: [{action: Deny}, {action: Allow, ports: [{port: 53}]}]}",
    );
    let e = validate_ordered_network_policy(&p);
    assert!(error_fields(&e).is_empty());
    assert_eq!(
        render(&e, Severity::Warning),
        [
            "spec.egress[1]: can never decide a packet: spec.egress[0] matches all traffic and comes first"
        ]
    );

    // Same rule in the other direction is fine; in a NetworkPolicy a duplicate only warns.
    let p = onp(
        "{priority: 1, podSelector: {}, ingress: [{action: Deny, ports: [{port: 1}]}], egress: [{action: Deny, ports: [{port: 1}]}]}",
    );
    assert_eq!(validate_ordered_network_policy(&p), []);
    let n = np("{podSelector: {}, ingress: [{ports: [{port: 1}]}, {ports: [{port: 1}]}]}");
    let e = validate_network_policy(&n);
    assert!(error_fields(&e).is_empty());
    assert_eq!(
        render(&e, Severity::Warning),
        ["spec.ingress[1]: duplicate of spec.ingress[0]"]
    );
}

#[test]
fn policy_without_effect_is_warned_about() {
    let p = onp("{priority: 1, podSelector: {}}");
    let e = validate_ordered_network_policy(&p);
    assert_eq!(
        render(&e, Severity::Warning),
        ["spec: no ingress or egress rules and no defaultDeny: this policy has no effect"]
    );
}

#[test]
fn subject_selectors_and_metadata() {
    let c = conp(
        "{priority: 1, namespaceSelector: {matchExpressions: [{key: ns, operator: in, values: [x]}]}, podSelector: {matchLabels: {a: -b}}, defaultDeny: {egress: true}}",
    );
    assert_eq!(
        error_fields(&validate_cluster_ordered_network_policy(&c)),
        [
            "spec.namespaceSelector.matchExpressions[0].operator",
            "spec.podSelector.matchLabels.a"
        ]
    );
    let mut p = onp("{priority: 1, podSelector: {}, defaultDeny: {ingress: true}}");
    p.metadata.name = Some("Bad_Name".into());
    p.metadata.labels = Some([("ok".to_string(), "-bad".to_string())].into());
    assert_eq!(
        error_fields(&validate_ordered_network_policy(&p)),
        ["metadata.name", "metadata.labels.ok"]
    );
}

#[test]
fn pods_and_namespaces() {
    let text = r#"
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {pod: a}}
spec:
  containers:
  - name: c
    image: i
    ports:
    - {name: serve-80-tcp, containerPort: 80}
    - {name: Bad, containerPort: 0, protocol: ICMP}
status: {podIP: 10.0.0.1, podIPs: [{ip: 10.0.0.2}, {ip: 10.0.0.3}, {ip: nope}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: x}
spec: {hostNetwork: true, containers: [{name: c, image: i}]}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: done, namespace: x}
status: {podIP: 10.0.0.1, phase: Succeeded}
---
apiVersion: v1
kind: Pod
metadata: {name: d, namespace: x}
---
apiVersion: v1
kind: Namespace
metadata: {name: Upper.case}
"#;
    let out = load_str(Path::new("t.yaml"), text);
    assert!(!out.has_errors(), "{:?}", out.problems);
    let problems: Vec<String> = validate_objects(&out.objects)
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert_eq!(
        problems,
        [
            "t.yaml: Namespace Upper.case: metadata.name: \"Upper.case\" is not a valid DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit",
            "t.yaml: Pod x/a: spec.containers[0].ports[1].containerPort: 0 is not a valid port number: must be between 1 and 65535",
            "t.yaml: Pod x/a: spec.containers[0].ports[1].protocol: \"ICMP\" is not supported: use TCP, UDP or SCTP",
            "t.yaml: Pod x/a: spec.containers[0].ports[1].name: \"Bad\" is not a valid port name: only lowercase letters, digits and '-' are allowed",
            "t.yaml: Pod x/a: status.podIPs[0].ip: 10.0.0.2 must equal status.podIP (10.0.0.1): the first pod IP is the primary one",
            "t.yaml: Pod x/a: status.podIPs[2].ip: \"nope\" is not an IP address",
            "t.yaml: Pod x/a: status.podIPs: at most one IPv4 and one IPv6 address",
            "t.yaml: Pod x/d: status.podIP: warning: not set: the pod has no address yet, so it is not an endpoint",
            "t.yaml: Pod x/b: status.podIP: 10.0.0.1 is also the address of pod x/a",
        ]
    );
}

#[test]
fn load_and_validate_drops_invalid_pods_and_keeps_policies_for_the_engine() {
    let text = r#"
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: bad, namespace: q}
spec: {priority: -3, podSelector: {}, defaultDeny: {ingress: true}}
---
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: good, namespace: q}
spec: {priority: 3, podSelector: {}, defaultDeny: {ingress: true}}
---
apiVersion: v1
kind: Pod
metadata: {name: bad, namespace: q}
status: {podIP: 10.0.0.300}
---
apiVersion: v1
kind: Pod
metadata: {name: good, namespace: q}
status: {podIP: 10.0.0.3}
"#;
    let out = crate::validated(load_str(Path::new("t.yaml"), text));
    assert!(out.has_errors());
    // Policies stay (the engine decides what it can enforce of them); the invalid pod goes.
    let names = |v: Vec<Option<String>>| v.into_iter().flatten().collect::<Vec<_>>();
    assert_eq!(
        names(
            out.objects
                .ordered_policies
                .iter()
                .map(|o| o.object.metadata.name.clone())
                .collect()
        ),
        ["bad", "good"]
    );
    assert_eq!(
        names(
            out.objects
                .pods
                .iter()
                .map(|o| o.object.metadata.name.clone())
                .collect()
        ),
        ["good"]
    );
    let rendered: Vec<String> = out.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(rendered.len(), 2, "{rendered:?}");
    assert!(rendered[0].starts_with("t.yaml: Pod q/bad: status.podIP:"));
    assert!(
        rendered[1]
            .starts_with("t.yaml: OrderedNetworkPolicy q/bad: spec.priority: -3 is negative")
    );
    assert!(out.kept(&out.problems[1]));
    assert!(!out.kept(&out.problems[0]));
}

#[test]
fn schema_list_limits_are_checked_too() {
    let ports: Vec<String> = (1..=101).map(|p| format!("{{port: {p}}}")).collect();
    let p = onp(&format!(
        "{{priority: 1, podSelector: {{}}, ingress: [{{action: Allow, ports: [{}]}}]}}",
        ports.join(", ")
    ));
    let e = validate_ordered_network_policy(&p);
    assert_eq!(error_fields(&e), ["spec.ingress[0].ports"]);
    assert_eq!(e[0].message, "101 entries: at most 16 are allowed");
    let rules: Vec<String> = (1..=257)
        .map(|p| format!("{{action: Deny, ports: [{{port: {}}}]}}", p % 65535 + 1))
        .collect();
    let p = onp(&format!(
        "{{priority: 1, podSelector: {{}}, egress: [{}]}}",
        rules.join(", ")
    ));
    assert_eq!(
        error_fields(&validate_ordered_network_policy(&p)),
        ["spec.egress"]
    );
}

#[test]
fn long_rule_lists_stay_linear() {
    use k8s_openapi::api::networking::v1::{NetworkPolicyIngressRule, NetworkPolicySpec};
    let n = NetworkPolicy {
        metadata: ObjectMeta {
            name: Some("n".into()),
            namespace: Some("q".into()),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            ingress: Some(vec![NetworkPolicyIngressRule::default(); 200_000]),
            ..Default::default()
        }),
    };
    let start = std::time::Instant::now();
    let e = validate_network_policy(&n);
    assert_eq!(e.len(), 199_999);
    assert_eq!(e[0].message, "duplicate of spec.ingress[0]");
    let mut p = onp("{priority: 1, podSelector: {}, defaultDeny: {ingress: true}}");
    p.spec.ingress = vec![
        crate::types::IngressRule {
            action: crate::types::Action::Deny,
            from: vec![],
            ports: vec![],
        };
        200_000
    ];
    let e = validate_ordered_network_policy(&p);
    assert_eq!(e.len(), 1 + 199_999, "the size limit and every duplicate");
    // A quadratic comparison of 2 x 200 000 rules would take minutes.
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

fn cnp(api_version: &str, spec: &str) -> ClusterNetworkPolicy {
    let text = format!(
        "apiVersion: {api_version}\nkind: ClusterNetworkPolicy\nmetadata: {{name: c}}\nspec: {spec}\n"
    );
    let out = load_str(Path::new("t.yaml"), &text);
    assert!(!out.has_errors(), "{:?}", out.problems);
    out.objects.cluster_network_policies[0].object.clone()
}

#[test]
fn cluster_network_policy_both_versions_load_and_validate() {
    let spec = "{tier: Admin, priority: 10, subject: {pods: {podSelector: {matchLabels: {app: a}}}}, ingress: [{name: r, action: Pass, from: [{namespaces: {}}], protocols: [{tcp: {destinationPort: {range: {start: 80, end: 90}}}}, {destinationNamedPort: web}]}], egress: [{action: Accept, to: [{networks: [10.0.0.0/8, 'fd00::/8']}, {nodes: {matchLabels: {role: infra}}}]}]}";
    for v in CNP_API_VERSIONS {
        let c = cnp(v, spec);
        assert_eq!(validate_cluster_network_policy(&c), [], "{v}");
    }
    // An unknown apiVersion of the group is refused by the loader.
    let out = load_str(
        Path::new("t.yaml"),
        "apiVersion: policy.networking.k8s.io/v9\nkind: ClusterNetworkPolicy\nmetadata: {name: c}\nspec: {tier: Admin, priority: 1, subject: {namespaces: {}}}\n",
    );
    assert!(out.has_errors());
}

#[test]
fn cluster_network_policy_errors_name_the_field() {
    let c = cnp(
        CNP_API_VERSIONS[0],
        "{tier: Baseline, priority: 1001, subject: {namespaces: {}, pods: {podSelector: {}}}, ingress: [{action: Deny, from: []}], egress: [{action: Deny, to: [{networks: [10.0.0.1/8]}, {namespaces: {}, networks: [10.0.0.0/8]}], protocols: [{tcp: {}}, {udp: {destinationPort: {range: {start: 90, end: 80}}}}, {destinationNamedPort: web}, {}]}]}",
    );
    let errors = validate_cluster_network_policy(&c);
    assert_eq!(
        render(&errors, Severity::Error),
        [
            "spec.priority: 1001 is out of range: 0-1000",
            "spec.subject: exactly one of namespaces or pods must be set",
            "spec.ingress[0].from: at least one peer is required",
            "spec.egress[0].to[0].networks[0]: \"10.0.0.1/8\" has bits set after the prefix: write 10.0.0.0/8",
            "spec.egress[0].to[1]: exactly one of namespaces, pods, nodes, networks or domainNames may be set",
            "spec.egress[0].protocols[0]: tcp.destinationPort: required",
            "spec.egress[0].protocols[1]: udp.destinationPort.range: start (90) must be less than end (80)",
            "spec.egress[0].protocols[2].destinationNamedPort: networks/nodes/domainNames peers cannot be combined with a named port: they have no named ports",
            "spec.egress[0].protocols[3]: an empty entry: set exactly one of tcp, udp, sctp or destinationNamedPort",
        ]
    );
}

#[test]
fn cluster_network_policy_unenforceable_peers_are_warnings() {
    let c = cnp(
        CNP_API_VERSIONS[0],
        "{tier: Admin, priority: 1, subject: {namespaces: {}}, egress: [{action: Accept, to: [{domainNames: [www.example.com]}]}, {action: Pass, to: [{futurePeer: {x: 1}}]}]}",
    );
    let errors = validate_cluster_network_policy(&c);
    assert_eq!(render(&errors, Severity::Error), Vec::<String>::new());
    assert_eq!(
        render(&errors, Severity::Warning),
        [
            "spec.egress[0].to[0].domainNames: domainNames peers are not supported by ordnet: this Accept rule is enforced fail-closed and matches nothing",
            "spec.egress[1].to[0]: unknown peer field futurePeer (a newer API version?): this Pass rule is enforced fail-closed and denies all egress",
        ]
    );
}
