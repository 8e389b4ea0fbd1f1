use super::*;
use crate::types::{Action, PolicyMode, Protocol};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

fn load(text: &str) -> LoadOutcome {
    load_str(Path::new("m.yaml"), text)
}

fn errors(outcome: &LoadOutcome) -> Vec<String> {
    outcome
        .problems
        .iter()
        .filter(|p| p.is_error())
        .map(|p| p.to_string())
        .collect()
}

fn warnings(outcome: &LoadOutcome) -> Vec<String> {
    outcome
        .problems
        .iter()
        .filter(|p| !p.is_error())
        .map(|p| p.to_string())
        .collect()
}

const ALL_KINDS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {ns: x}}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {pod: a}}
spec:
  containers:
  - name: c
    image: i
    ports: [{name: serve-80-tcp, containerPort: 80}]
status: {podIP: 10.244.1.1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: y, labels: {pod: b}}
status: {podIP: 10.244.2.2, podIPs: [{ip: 10.244.2.2}, {ip: "fd00::2"}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny, namespace: x}
spec: {podSelector: {}, policyTypes: [Ingress]}
---
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: web, namespace: x}
spec:
  priority: 10
  podSelector: {matchLabels: {pod: a}}
  defaultDeny: {ingress: true}
  ingress:
  - action: Deny
    from: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}}]
    ports: [{protocol: UDP, port: 53}, {port: serve-80-tcp}, {port: 8000, endPort: 8080}]
  - action: Allow
  egress:
  - action: Allow
    to: [{namespaceSelector: {}, podSelector: {matchLabels: {pod: b}}}]
---
apiVersion: ordnet.io/v1alpha1
kind: ClusterOrderedNetworkPolicy
metadata: {name: guard}
spec:
  priority: -5
  ingress:
  - action: Deny
    from: [{namespaceSelector: {matchLabels: {ns: y}}}]
"#;

#[test]
fn loads_every_kind_with_sources_and_defaults() {
    let out = load(ALL_KINDS);
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    let o = &out.objects;
    assert_eq!(o.pods.len(), 2);
    assert_eq!(o.network_policies.len(), 1);
    assert_eq!(o.ordered_policies.len(), 1);
    assert_eq!(o.cluster_ordered_policies.len(), 1);
    assert_eq!(o.loaded_count(), 6);

    // The given namespace gets the name label; y is implied with only that label.
    assert_eq!(o.namespaces.len(), 2);
    let x = o.namespace("x").unwrap();
    assert_eq!(x.source.as_ref().unwrap().document, 1);
    assert_eq!(
        x.object.metadata.labels.as_ref().unwrap(),
        &BTreeMap::from([
            ("ns".to_string(), "x".to_string()),
            (NAMESPACE_NAME_LABEL.to_string(), "x".to_string()),
        ])
    );
    let y = o.namespace("y").unwrap();
    assert!(y.source.is_none());
    assert_eq!(
        o.namespace_labels("y"),
        BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), "y".to_string())])
    );

    let b = o.pod("y", "b").unwrap();
    assert_eq!(b.source.as_ref().unwrap().document, 3);
    assert_eq!(b.source.as_ref().unwrap().file, Path::new("m.yaml"));

    let onp = &o.ordered_policies[0];
    assert_eq!(onp.source.as_ref().unwrap().document, 5);
    let spec = &onp.object.spec;
    assert_eq!(spec.priority, 10);
    assert_eq!(spec.ingress.len(), 2);
    assert_eq!(spec.ingress[0].action, Action::Deny);
    let ports = &spec.ingress[0].ports;
    assert_eq!(ports[0].protocol, Protocol::Udp);
    assert_eq!(ports[0].port, Some(IntOrString::Int(53)));
    assert_eq!(ports[1].protocol, Protocol::Tcp, "protocol defaults to TCP");
    assert_eq!(
        ports[1].port,
        Some(IntOrString::String("serve-80-tcp".into()))
    );
    assert_eq!(ports[2].end_port, Some(8080));
    assert!(spec.ingress[1].from.is_empty() && spec.ingress[1].ports.is_empty());

    let conp = &o.cluster_ordered_policies[0];
    assert_eq!(conp.object.spec.priority, -5);
    assert_eq!(conp.object.spec.pod_selector, Default::default());
    assert_eq!(conp.object.spec.namespace_selector, Default::default());
    assert!(conp.object.metadata.namespace.is_none());
}

#[test]
fn lists_are_unpacked_and_items_are_located() {
    let out = load(
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Namespace, metadata: {name: a}}
- {apiVersion: v1, kind: Pod, metadata: {namespace: a}}
- {apiVersion: v1, kind: Namespace, metadata: {name: b}}
"#,
    );
    assert_eq!(out.objects.namespaces.len(), 2);
    assert_eq!(
        out.objects
            .namespace("b")
            .unwrap()
            .source
            .as_ref()
            .unwrap()
            .item,
        Some(2)
    );
    assert_eq!(
        errors(&out),
        [
            "m.yaml: document 1 items[1]: metadata.name: required: every object needs a name (kind Pod)"
        ]
    );
}

#[test]
fn nested_lists_are_rejected() {
    let out =
        load("{apiVersion: v1, kind: List, items: [{apiVersion: v1, kind: List, items: []}]}");
    assert_eq!(errors(&out).len(), 1);
    assert!(errors(&out)[0].contains("inside a List"));
}

#[test]
fn other_kinds_are_ignored_with_a_warning() {
    let out = load(
        "{apiVersion: apps/v1, kind: Deployment, metadata: {name: web}}\n---\n{apiVersion: v1, kind: Namespace, metadata: {name: x}}",
    );
    assert!(errors(&out).is_empty());
    assert_eq!(
        warnings(&out),
        [
            "m.yaml: document 1: warning: ignored Deployment web (apps/v1): ordnet does not use this kind"
        ]
    );
    assert_eq!(out.objects.namespaces.len(), 1);
}

#[test]
fn known_kind_under_another_api_version_is_an_error() {
    let out = load(
        "{apiVersion: extensions/v1beta1, kind: NetworkPolicy, metadata: {name: np, namespace: x}}",
    );
    assert_eq!(
        errors(&out),
        [
            "m.yaml: document 1: apiVersion: NetworkPolicy must have apiVersion networking.k8s.io/v1, not \"extensions/v1beta1\""
        ]
    );
}

#[test]
fn malformed_yaml_names_file_document_and_line() {
    let out = load("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\nkind: [unclosed\n");
    assert_eq!(
        out.objects.namespaces.len(),
        1,
        "the good document still loads"
    );
    let e = errors(&out);
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("m.yaml: document 2: invalid YAML: "),
        "{}",
        e[0]
    );
    assert!(e[0].contains("line"), "{}", e[0]);
}

#[test]
fn missing_api_version_kind_or_name() {
    let out = load("kind: Pod\nmetadata: {name: a}");
    assert_eq!(
        errors(&out),
        ["m.yaml: document 1: apiVersion: required: every object needs apiVersion and kind"]
    );
    let out = load("apiVersion: v1\nmetadata: {name: a}");
    assert_eq!(
        errors(&out),
        ["m.yaml: document 1: kind: required: every object needs apiVersion and kind"]
    );
    let out = load("apiVersion: v1\nkind: Pod\nmetadata: {generateName: a-}");
    assert!(errors(&out)[0].contains("metadata.name: required"));
    assert!(errors(&out)[0].contains("generateName"));
    let out = load("apiVersion: v1\nkind: 7\n");
    assert_eq!(
        errors(&out),
        ["m.yaml: document 1: kind: must be a string, found the number 7"]
    );
    let out = load("- a\n- b\n");
    assert!(errors(&out)[0].contains("expected a Kubernetes object"));
}

#[test]
fn type_errors_name_the_field() {
    let cases = [
        (
            "{priority: ten, podSelector: {}}",
            "spec.priority: invalid type: string \"ten\", expected i32",
        ),
        (
            "{priority: 1, podSelector: {}, ingress: [{from: []}]}",
            "spec.ingress[0].action: required field is missing",
        ),
        (
            "{priority: 1, podSelector: {}, ingress: [{action: Alow}]}",
            "spec.ingress[0].action: unknown variant `Alow`, expected `Allow` or `Deny`",
        ),
        (
            "{priority: 1, podSelector: {}, egress: [{action: Deny, ports: [{protocol: ICMP}]}]}",
            "spec.egress[0].ports[0].protocol: unknown variant `ICMP`, expected one of `TCP`, `UDP`, `SCTP`",
        ),
        (
            "{priority: 1}",
            "spec.podSelector: required field is missing",
        ),
        (
            "{priority: 3000000000, podSelector: {}}",
            "spec.priority: invalid value: integer `3000000000`, expected i32",
        ),
    ];
    for (spec, want) in cases {
        let text = format!(
            "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {{name: p, namespace: q}}\nspec: {spec}\n"
        );
        let out = load(&text);
        assert_eq!(
            errors(&out),
            [format!("m.yaml: OrderedNetworkPolicy q/p: {want}")],
            "{spec}"
        );
        assert!(out.objects.ordered_policies.is_empty());
    }
}

#[test]
fn unknown_fields_are_errors_for_policies_and_warnings_otherwise() {
    let out = load(
        r#"
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: p, namespace: q, creationTimestamp: null}
spec:
  priority: 1
  podSelector: {}
  ingress:
  - action: Allow
    ports: [{port: 80, endport: 90}]
    form: [{podSelector: {}}]
    empty: []
"#,
    );
    assert_eq!(
        errors(&out),
        [
            "m.yaml: OrderedNetworkPolicy q/p: spec.ingress[0].form: unknown field (misspelled?)",
            "m.yaml: OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].endport: unknown field (misspelled?)",
        ]
    );
    assert!(out.objects.ordered_policies.is_empty());

    let out = load(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: x}\nstatus: {podIp: 1.2.3.4}\n",
    );
    assert!(errors(&out).is_empty());
    assert_eq!(
        warnings(&out),
        ["m.yaml: Pod x/a: status.podIp: warning: unknown field, ignored"]
    );
    assert_eq!(out.objects.pods.len(), 1);
}

/// `spec.mode` is a known field with either value, and `Enforce` (what an API server stores
/// after defaulting) is kept too (a serialization that left the default out once made the
/// loader call it unknown and drop the policy).
#[test]
fn mode_is_read_with_either_value() {
    for (mode, want) in [
        ("Enforce", PolicyMode::Enforce),
        ("Staged", PolicyMode::Staged),
    ] {
        let out = load(&format!(
            "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\n\
             metadata: {{name: p, namespace: q}}\n\
             spec: {{mode: {mode}, priority: 1, podSelector: {{}}}}\n"
        ));
        assert!(out.problems.is_empty(), "{mode}: {:?}", out.problems);
        assert_eq!(out.objects.ordered_policies[0].object.spec.mode, want);
    }
    let out = load(
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\n\
         metadata: {name: p, namespace: q}\nspec: {priority: 1, podSelector: {}}\n",
    );
    assert_eq!(
        out.objects.ordered_policies[0].object.spec.mode,
        PolicyMode::Enforce
    );
}

#[test]
fn duplicates_are_errors_naming_the_first() {
    let out = load(
        "{apiVersion: v1, kind: Pod, metadata: {name: a, namespace: x}}\n---\n{apiVersion: v1, kind: Pod, metadata: {name: a, namespace: x}}\n---\n{apiVersion: v1, kind: Pod, metadata: {name: a, namespace: y}}",
    );
    assert_eq!(
        errors(&out),
        ["m.yaml: Pod x/a: duplicate object: already defined in m.yaml (document 1)"]
    );
    assert_eq!(out.objects.pods.len(), 2);
}

#[test]
fn namespaces_default_and_cluster_objects_drop_theirs() {
    let out = load(
        "{apiVersion: v1, kind: Pod, metadata: {name: a}}\n---\n{apiVersion: ordnet.io/v1alpha1, kind: ClusterOrderedNetworkPolicy, metadata: {name: c, namespace: x}, spec: {priority: 1, defaultDeny: {ingress: true}}}",
    );
    assert!(errors(&out).is_empty());
    assert_eq!(
        out.objects.pods[0].object.metadata.namespace.as_deref(),
        Some(DEFAULT_NAMESPACE)
    );
    assert!(out.objects.namespace(DEFAULT_NAMESPACE).is_some());
    assert!(
        out.objects.namespace("x").is_none(),
        "x is not used by anything"
    );
    assert_eq!(
        warnings(&out),
        [
            "m.yaml: ClusterOrderedNetworkPolicy c: metadata.namespace: warning: \"x\" ignored: ClusterOrderedNetworkPolicy is cluster-scoped"
        ]
    );
}

#[test]
fn namespace_name_label_is_enforced() {
    let out = load(
        "{apiVersion: v1, kind: Namespace, metadata: {name: x, labels: {kubernetes.io/metadata.name: y}}}",
    );
    assert_eq!(out.objects.namespace_labels("x")[NAMESPACE_NAME_LABEL], "x");
    assert_eq!(warnings(&out).len(), 1);
    assert!(warnings(&out)[0].contains("metadata.labels.kubernetes.io/metadata.name"));
}

#[test]
fn nulls_read_as_absent() {
    let out = load(
        r#"
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: p, namespace: q}
spec:
  priority: 1
  podSelector: {}
  defaultDeny: null
  egress: null
  ingress:
  - action: Allow
    from: null
    ports: [{protocol: null, port: 80, endPort: null}]
"#,
    );
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    let spec = &out.objects.ordered_policies[0].object.spec;
    assert_eq!(spec.ingress[0].ports[0].protocol, Protocol::Tcp);
    assert!(spec.egress.is_empty());
}

#[test]
fn yaml_features_convert_like_kubernetes() {
    // Anchors, merge keys and numeric label keys work; tags and complex keys do not.
    let out = load(
        r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Namespace
  metadata:
    name: x
    labels: &l {a: b, 1: c}
- apiVersion: v1
  kind: Namespace
  metadata:
    name: y
    labels:
      <<: *l
      d: e
"#,
    );
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    assert_eq!(out.objects.namespace_labels("x")["1"], "c");
    assert_eq!(out.objects.namespace_labels("y")["a"], "b");
    assert_eq!(out.objects.namespace_labels("y")["d"], "e");

    let out = load("apiVersion: v1\nkind: Namespace\nmetadata: {name: !custom x}\n");
    assert!(errors(&out)[0].contains("tag"), "{:?}", errors(&out));
    let out = load("apiVersion: v1\nkind: Namespace\nmetadata: {name: x, labels: {[a]: b}}\n");
    assert!(
        errors(&out)[0].contains("keys must be strings"),
        "{:?}",
        errors(&out)
    );
    let out = load("apiVersion: v1\nkind: Namespace\nmetadata: {name: x, labels: {a: .nan}}\n");
    assert!(
        errors(&out)[0].contains("not a finite number"),
        "{:?}",
        errors(&out)
    );
}

#[test]
fn json_streams_and_bytes() {
    let out = load_str(
        Path::new("m.json"),
        r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"}}
           {"apiVersion":"v1","kind":"Namespace","metadata":{"name":"b"}} {"#,
    );
    assert_eq!(out.objects.namespaces.len(), 2);
    let e = errors(&out);
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("m.json: document 3: invalid JSON"),
        "{}",
        e[0]
    );

    let out = load_str(
        Path::new("m.json"),
        r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"},"metadata":{"name":"b"}}"#,
    );
    assert_eq!(errors(&out).len(), 1);
    assert!(
        errors(&out)[0].contains("duplicate field \"metadata\""),
        "{:?}",
        errors(&out)
    );
    let out = load_str(
        Path::new("m.json"),
        "[1.5, -2, 18446744073709551615, null, true]",
    );
    assert!(errors(&out)[0].contains("expected a Kubernetes object"));

    let out = load_bytes(Path::new("m.yaml"), b"apiVersion: v1\xff\xfe");
    assert!(errors(&out)[0].contains("not UTF-8"));
}

#[test]
fn directories_are_read_recursively_in_sorted_order() {
    let dir = std::env::temp_dir().join(format!("ordnet-crds-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    let ns = |n: &str| format!("{{apiVersion: v1, kind: Namespace, metadata: {{name: {n}}}}}");
    std::fs::write(dir.join("b.yaml"), ns("b")).unwrap();
    std::fs::write(dir.join("a.YML"), ns("a")).unwrap();
    std::fs::write(
        dir.join("sub/c.json"),
        r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"c"}}"#,
    )
    .unwrap();
    std::fs::write(dir.join("sub/deeper/d.yaml"), ns("a")).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a manifest: [").unwrap();
    std::fs::create_dir_all(dir.join("empty")).unwrap();

    // The directory and one of its files: the file is read once.
    let out = load_paths(&[dir.clone(), dir.join("b.yaml"), dir.join("missing.yaml")]);
    let names: Vec<_> = out
        .objects
        .namespaces
        .iter()
        .map(|n| n.object.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    let e = errors(&out);
    assert_eq!(e.len(), 2, "{e:?}");
    // Sorted order: a.YML comes before sub/deeper/d.yaml, so d.yaml is the duplicate.
    assert!(e[0].contains("d.yaml: Namespace a: duplicate object: already defined in"));
    assert!(e[0].contains("a.YML (document 1)"));
    assert!(e[1].contains("missing.yaml: cannot read"));
    assert!(warnings(&out).is_empty(), "{:?}", warnings(&out));
    let out = load_paths(&[dir.join("empty")]);
    let w = warnings(&out);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("empty: warning: no .yaml, .yml or .json files"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let out = load(&deep);
    assert_eq!(errors(&out).len(), 1);
    let out = load_str(Path::new("m.json"), &deep);
    assert_eq!(errors(&out).len(), 1);
}
