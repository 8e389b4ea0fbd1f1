//! Hand cases of `Engine::shadowed_rules` (the brute-force check against the reference
//! evaluator on random clusters is `testsuite/tests/shadow_reference.rs`).

mod common;

use ordnet_engine::{Engine, ShadowedRule};

const PODS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {env: prod}}
---
apiVersion: v1
kind: Namespace
metadata: {name: y, labels: {env: dev}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: x, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: i, ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: x, labels: {app: db}}
spec: {nodeName: n2, containers: [{name: c, image: i}]}
status: {podIP: 10.0.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: y, labels: {app: web}}
spec: {nodeName: n2, containers: [{name: c, image: i}]}
status: {podIP: 10.0.1.1}
"#;

/// The engine of `PODS` plus the given policy documents (each ending in `---`).
fn engine(policies: &[String]) -> Engine {
    let text = format!("{PODS}\n---\n{}", policies.concat());
    let objects = common::manifest::objects(&text);
    let e = common::manifest::build(&objects);
    // A node-scoped engine (here: a node without pods) must give the same answer.
    let node = Engine::build_for_node(&objects, "elsewhere");
    assert_eq!(e.shadowed_rules(), node.shadowed_rules());
    e
}

/// `(policy name, direction, index, [shadowing "name[index]"])`.
type Row = (String, String, u32, Vec<String>);

fn row(name: &str, direction: &str, index: u32, by: &[&str]) -> Row {
    (
        name.to_string(),
        direction.to_string(),
        index,
        by.iter().map(|b| b.to_string()).collect(),
    )
}

fn report(e: &Engine) -> Vec<Row> {
    e.shadowed_rules()
        .iter()
        .map(|s: &ShadowedRule| {
            (
                s.policy.name.clone(),
                match s.direction {
                    ordnet_mapstate::Direction::Ingress => "Ingress".to_string(),
                    ordnet_mapstate::Direction::Egress => "Egress".to_string(),
                },
                s.index,
                s.shadowed_by
                    .iter()
                    .map(|o| format!("{}[{}]", o.name, o.rule_index))
                    .collect(),
            )
        })
        .collect()
}

/// An OrderedNetworkPolicy in namespace `x`.
fn onp(name: &str, priority: i32, selector: &str, ingress: &str) -> String {
    format!(
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec:\n  priority: {priority}\n  podSelector: {selector}\n  ingress: {ingress}\n---\n"
    )
}

fn conp(name: &str, priority: i32, ns_selector: &str, ingress: &str) -> String {
    format!(
        "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\nmetadata: {{name: {name}}}\nspec:\n  priority: {priority}\n  namespaceSelector: {ns_selector}\n  ingress: {ingress}\n---\n"
    )
}

#[test]
fn deny_all_at_10_shadows_an_allow_at_20() {
    let e = engine(&[
        onp("guard", 10, "{matchLabels: {app: web}}", "[{action: Deny}]"),
        onp(
            "late",
            20,
            "{matchLabels: {app: web}}",
            "[{action: Allow, from: [{podSelector: {}}], ports: [{port: 80}]}]",
        ),
    ]);
    assert_eq!(report(&e), [row("late", "Ingress", 0, &["guard[0]"])]);
}

#[test]
fn a_wider_subject_is_not_shadowed() {
    // `late` also selects x/db, which `guard` does not cover.
    let e = engine(&[
        onp("guard", 10, "{matchLabels: {app: web}}", "[{action: Deny}]"),
        onp("late", 20, "{}", "[{action: Allow}]"),
    ]);
    assert!(report(&e).is_empty(), "{:?}", report(&e));
}

#[test]
fn partial_overlap_is_not_shadowed_but_a_union_is() {
    let partial = engine(&[
        onp(
            "guard",
            10,
            "{}",
            "[{action: Deny, ports: [{port: 80, endPort: 85}]}]",
        ),
        onp(
            "late",
            20,
            "{}",
            "[{action: Allow, ports: [{port: 80, endPort: 90}]}]",
        ),
    ]);
    assert!(report(&partial).is_empty(), "{:?}", report(&partial));
    // Two rules of two policies together cover 80-90; a third stronger rule on UDP does not
    // touch it and is not named.
    let union = engine(&[
        onp(
            "a",
            10,
            "{}",
            "[{action: Deny, ports: [{port: 80, endPort: 85}]}, {action: Deny, ports: [{protocol: UDP}]}]",
        ),
        onp(
            "b",
            15,
            "{}",
            "[{action: Allow, ports: [{port: 84, endPort: 95}]}]",
        ),
        onp(
            "late",
            20,
            "{}",
            "[{action: Allow, ports: [{port: 80, endPort: 90}]}]",
        ),
    ]);
    assert_eq!(
        report(&union),
        [row("late", "Ingress", 0, &["a[0]", "b[0]"])]
    );
}

#[test]
fn equal_order_keys_deny_wins() {
    // (5, 0) Deny in a cluster policy and (5, 0) Allow in a namespaced one: the allow never
    // decides; the deny does.
    let e = engine(&[
        conp("c", 5, "{matchLabels: {env: prod}}", "[{action: Deny}]"),
        onp("n", 5, "{}", "[{action: Allow}]"),
    ]);
    assert_eq!(report(&e), [row("n", "Ingress", 0, &["c[0]"])]);
    // Two allows at one key both decide: nothing is shadowed.
    let e = engine(&[
        conp("c", 5, "{matchLabels: {env: prod}}", "[{action: Allow}]"),
        onp("n", 5, "{}", "[{action: Allow}]"),
    ]);
    assert!(report(&e).is_empty(), "{:?}", report(&e));
    // Two denies at one key both decide too.
    let e = engine(&[
        conp("c", 5, "{matchLabels: {env: prod}}", "[{action: Deny}]"),
        onp("n", 5, "{}", "[{action: Deny}]"),
    ]);
    assert!(report(&e).is_empty(), "{:?}", report(&e));
}

#[test]
fn within_one_policy_the_earlier_rule_wins() {
    let e = engine(&[onp(
        "p",
        3,
        "{}",
        "[{action: Allow, from: [{namespaceSelector: {}}]}, {action: Deny, from: [{podSelector: {matchLabels: {app: db}}}], ports: [{port: 5432}]}]",
    )]);
    assert_eq!(report(&e), [row("p", "Ingress", 1, &["p[0]"])]);
}

#[test]
fn only_the_rules_that_take_the_traffic_are_named() {
    // g (-10) takes everything; `mid` (10) would overlap `late` but is itself pre-empted.
    let e = engine(&[
        conp("g", -10, "{}", "[{action: Deny}]"),
        onp("mid", 10, "{}", "[{action: Allow}]"),
        onp("late", 20, "{}", "[{action: Allow, ports: [{port: 80}]}]"),
    ]);
    assert_eq!(
        report(&e),
        [
            row("late", "Ingress", 0, &["g[0]"]),
            row("mid", "Ingress", 0, &["g[0]"]),
        ]
    );
}

#[test]
fn network_policy_rules_shadow_but_are_not_reported() {
    let np = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: np, namespace: x}
spec:
  podSelector: {}
  ingress: [{from: [{namespaceSelector: {}}]}, {from: [{podSelector: {}}]}]
---
"#;
    let e = engine(&[
        np.to_string(),
        onp(
            "later",
            1,
            "{}",
            "[{action: Deny, from: [{podSelector: {matchLabels: {app: web}}}]}, {action: Deny, from: [{ipBlock: {cidr: 192.0.2.0/24}}]}]",
        ),
    ]);
    assert_eq!(
        report(&e),
        // Both NetworkPolicy rules rank ((0, 0), Allow): both decide.
        [row("later", "Ingress", 0, &["np[0]", "np[1]"])]
    );
    assert_eq!(
        e.shadowed_rules()[0].shadowed_by[0].kind,
        "NetworkPolicy",
        "the shadowing rule is named by kind too"
    );
    // At priority 0, index 0 a Deny ranks before the NetworkPolicy's allows.
    let e = engine(&[
        np.to_string(),
        onp(
            "zero",
            0,
            "{}",
            "[{action: Deny, from: [{podSelector: {}}]}, {action: Allow, from: [{podSelector: {matchLabels: {app: web}}}]}]",
        ),
    ]);
    assert_eq!(report(&e), [row("zero", "Ingress", 1, &["zero[0]"])]);
}

#[test]
fn rules_that_match_nothing_are_not_reported() {
    let e = engine(&[
        conp("g", -10, "{}", "[{action: Deny}]"),
        // Selects no pod.
        onp(
            "nobody",
            10,
            "{matchLabels: {app: nope}}",
            "[{action: Allow}]",
        ),
        // Its peer selects no pod; its named port is not served.
        onp(
            "empty",
            10,
            "{}",
            "[{action: Allow, from: [{podSelector: {matchLabels: {app: nope}}}]}, {action: Allow, ports: [{port: nope}]}]",
        ),
    ]);
    assert!(report(&e).is_empty(), "{:?}", report(&e));
}

#[test]
fn named_ports_resolve_per_endpoint_and_per_peer() {
    // Ingress: `http` resolves to 8080 on x/web only; a deny of 8080 covers it there.
    let e = engine(&[
        onp(
            "deny8080",
            1,
            "{}",
            "[{action: Deny, ports: [{port: 8080}]}]",
        ),
        onp("http", 2, "{}", "[{action: Allow, ports: [{port: http}]}]"),
    ]);
    assert_eq!(report(&e), [row("http", "Ingress", 0, &["deny8080[0]"])]);
    // Egress: `http` to x/web is 8080; a deny of 8080 to app=web pods covers it, a deny of 80
    // does not.
    let egress = |port: u16| {
        format!(
            "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\nmetadata: {{name: out}}\nspec:\n  priority: 1\n  egress:\n  - {{action: Deny, to: [{{podSelector: {{matchLabels: {{app: web}}}}}}], ports: [{{port: {port}}}]}}\n  - {{action: Allow, to: [{{podSelector: {{matchLabels: {{app: web}}}}}}], ports: [{{port: http}}]}}\n---\n"
        )
    };
    let e = engine(&[egress(8080)]);
    assert_eq!(report(&e), [row("out", "Egress", 1, &["out[0]"])]);
    assert!(report(&engine(&[egress(80)])).is_empty());
}
