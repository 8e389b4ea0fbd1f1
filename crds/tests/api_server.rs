//! What a real API server checks when our CRDs are created, which the fake API server of the
//! agent's tests never sees (docs/api.md, "CEL cost budget" and "Validation").
//!
//! * Every rule of every CRD we ship (ours as `ordnet crd` generates them, and the upstream
//!   ClusterNetworkPolicy under `deploy/crds/upstream/`) stays at or below a quarter of the
//!   per-expression budget, and each version's total at or below a quarter of its budget; the
//!   largest estimates are printed.
//! * The estimator is checked against the API server itself on a frozen input: the CRD that a
//!   real kube-apiserver v1.36 refused (`tests/data/ordnet.io_crds.refused-by-1.36.yaml`) — the
//!   estimate of every one of its rules equals the figure the API server computed for it, and the
//!   four rules it refused come out over budget by its factor, 1.105920×.
//! * The rest of what creation checks: the `api-approved.kubernetes.io` annotation, the
//!   structural-schema rules and defaults, rule messages and field paths, the status subresource
//!   and the printer columns.

mod celcost;

use std::path::Path;

use celcost::{CRD_LIMIT, PER_EXPRESSION_LIMIT, RuleCost, crd_rule_costs, items, version_totals};
use serde::Deserialize;
use serde_json::Value;

fn repo(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The CRDs of a multi-document YAML file, as JSON.
fn crds_in(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|doc| doc["kind"] == "CustomResourceDefinition")
        .collect()
}

/// The CRDs we ship: ours as generated (the committed copy is checked against them elsewhere)
/// and the upstream one as committed.
fn shipped() -> Vec<Value> {
    let mut crds: Vec<Value> = ordnet_crds::crds()
        .iter()
        .map(|c| serde_json::to_value(c).expect("json"))
        .collect();
    crds.extend(crds_in(&repo(
        "deploy/crds/upstream/policy.networking.k8s.io_clusternetworkpolicies.yaml",
    )));
    crds
}

fn print_largest(costs: &[RuleCost], n: usize) {
    let mut sorted: Vec<&RuleCost> = costs.iter().collect();
    sorted.sort_by_key(|c| std::cmp::Reverse(c.total));
    for c in sorted.into_iter().take(n) {
        let card = c
            .cardinality
            .map_or("unbounded".to_string(), |n| n.to_string());
        let rule: String = c.rule.chars().take(90).collect();
        println!(
            "{:>11} = {:>5} x {:>6} ({:5.1}% of the budget)  {} {}  `{}`",
            c.total,
            c.per_call,
            card,
            100.0 * c.total as f64 / PER_EXPRESSION_LIMIT as f64,
            c.crd,
            c.path,
            rule
        );
    }
}

#[test]
fn every_shipped_rule_is_within_a_quarter_of_the_budget() {
    let mut over = Vec::new();
    for crd in shipped() {
        let costs = crd_rule_costs(&crd).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !costs.is_empty(),
            "{}: no rules found",
            crd["metadata"]["name"]
        );
        let totals = version_totals(&costs);
        for (version, total) in &totals {
            println!(
                "{version}: total {total} ({:.1}% of the budget of one version's schema)",
                100.0 * *total as f64 / CRD_LIMIT as f64
            );
        }
        println!("{} rules, the largest:", costs.len());
        print_largest(&costs, 8);
        for c in &costs {
            if c.cardinality.is_none() {
                over.push(format!(
                    "{} {}: unbounded cardinality (`{}`)",
                    c.crd, c.path, c.rule
                ));
            }
            if c.total > PER_EXPRESSION_LIMIT / 4 {
                over.push(format!(
                    "{} {}: {} > a quarter of {} (`{}`)",
                    c.crd, c.path, c.total, PER_EXPRESSION_LIMIT, c.rule
                ));
            }
        }
        for (version, total) in totals {
            if total > CRD_LIMIT / 4 {
                over.push(format!(
                    "{version}: total {total} > a quarter of {CRD_LIMIT}"
                ));
            }
        }
    }
    assert!(
        over.is_empty(),
        "over the cost margin:\n{}",
        over.join("\n")
    );
}

/// The API server's own figures (`crd\tpath\tcost of one evaluation\tcardinality\trule`),
/// computed by apiextensions-apiserver v1.36.2's CEL compilation (by hand, on our side) for every
/// rule of `file`, compared with the estimate of the same rule.
fn check_against_api_server(file: &Path, figures: &str) -> Vec<RuleCost> {
    let mut estimates = Vec::new();
    for crd in crds_in(file) {
        estimates.extend(crd_rule_costs(&crd).unwrap_or_else(|e| panic!("{e}")));
    }
    let mut expected: Vec<(String, String, u64, u64, String)> = figures
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.splitn(5, '\t').collect();
            assert_eq!(f.len(), 5, "figure line {l:?}");
            let n = |s: &str| s.parse::<u64>().expect("number");
            (f[0].into(), f[1].into(), n(f[2]), n(f[3]), f[4].into())
        })
        .collect();
    let mut got: Vec<(String, String, u64, u64, String)> = estimates
        .iter()
        .map(|c| {
            let card = c.cardinality.expect("every rule of these CRDs is bounded");
            (
                c.crd.clone(),
                c.path.clone(),
                c.per_call,
                card,
                c.rule.clone(),
            )
        })
        .collect();
    expected.sort();
    got.sort();
    assert_eq!(expected.len(), got.len(), "rule counts differ");
    let differ: Vec<String> = expected
        .iter()
        .zip(&got)
        .filter(|(e, g)| e != g)
        .map(|(e, g)| format!("API server {e:?}\nestimate   {g:?}"))
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    estimates
}

#[test]
fn the_estimate_equals_the_api_servers_on_the_refused_crd() {
    let estimates = check_against_api_server(
        &repo("crds/tests/data/ordnet.io_crds.refused-by-1.36.yaml"),
        include_str!("data/api-server-costs.refused-by-1.36.tsv"),
    );
    // What the API server said when it refused it: the ipBlock `except` rule, in ingress and
    // egress of both CRDs, "exceeds budget by factor of 1.105920x".
    let refused: Vec<&RuleCost> = estimates
        .iter()
        .filter(|c| c.total > PER_EXPRESSION_LIMIT)
        .collect();
    assert_eq!(refused.len(), 4, "{refused:#?}");
    for c in refused {
        assert!(c.path.ends_with(".ipBlock"), "{c:?}");
        assert_eq!(
            format!("{:.6}", c.total as f64 / PER_EXPRESSION_LIMIT as f64),
            "1.105920"
        );
    }
}

#[test]
fn the_estimate_equals_the_api_servers_on_the_upstream_crd() {
    check_against_api_server(
        &repo("deploy/crds/upstream/policy.networking.k8s.io_clusternetworkpolicies.yaml"),
        include_str!("data/api-server-costs.upstream-cnp.tsv"),
    );
}

// What else a real API server checks when a CRD is created, that the fake one in our tests does
// not (it serves the custom resources without ever seeing a CRD). Each check below would have
// made `kubectl apply -k deploy/` fail.

/// Every schema node of `crd`, with its path.
fn nodes(crd: &Value) -> Vec<(String, Value)> {
    fn walk(path: String, node: &Value, out: &mut Vec<(String, Value)>) {
        out.push((path.clone(), node.clone()));
        if let Some(props) = node["properties"].as_object() {
            for (name, prop) in props {
                walk(format!("{path}.{name}"), prop, out);
            }
        }
        if node["items"].is_object() {
            walk(format!("{path}[]"), &node["items"], out);
        }
        if node["additionalProperties"].is_object() {
            walk(format!("{path}{{}}"), &node["additionalProperties"], out);
        }
        for key in ["allOf", "anyOf", "oneOf"] {
            for (i, sub) in items(&node[key]).enumerate() {
                walk(format!("{path}({key}[{i}])"), sub, out);
            }
        }
    }
    let mut out = Vec::new();
    for version in items(&crd["spec"]["versions"]) {
        let name = version["name"].as_str().unwrap_or("?");
        walk(
            name.to_string(),
            &version["schema"]["openAPIV3Schema"],
            &mut out,
        );
    }
    out
}

fn crd_name(crd: &Value) -> &str {
    crd["metadata"]["name"].as_str().unwrap_or("?")
}

/// A CRD in a `*.k8s.io` or `*.kubernetes.io` group is refused without the
/// `api-approved.kubernetes.io` annotation (a URL, or a text starting with `unapproved`).
#[test]
fn protected_groups_carry_the_api_approval_annotation() {
    for crd in shipped() {
        let group = crd["spec"]["group"].as_str().expect("group");
        let protected = ["k8s.io", "kubernetes.io"]
            .iter()
            .any(|g| group == *g || group.ends_with(&format!(".{g}")));
        let note = crd["metadata"]["annotations"]["api-approved.kubernetes.io"].as_str();
        if protected {
            let note =
                note.unwrap_or_else(|| panic!("{}: no api-approved annotation", crd_name(&crd)));
            assert!(
                note.starts_with("https://") || note.starts_with("unapproved"),
                "{}: api-approved annotation {note:?}",
                crd_name(&crd)
            );
        } else {
            assert!(
                note.is_none(),
                "{}: api-approved outside a protected group",
                crd_name(&crd)
            );
        }
    }
}

/// The structural-schema rules the API server enforces (apiextensions `NewStructural` and its
/// validation), and that every `default` is a value of its own schema (it is validated and
/// pruned at creation).
#[test]
fn schemas_are_structural_and_defaults_valid() {
    let mut problems = Vec::new();
    for crd in shipped() {
        for (path, node) in nodes(&crd) {
            let at = format!("{} {path}", crd_name(&crd));
            let in_junction = path.ends_with(')');
            let int_or_string = node["x-kubernetes-int-or-string"] == Value::Bool(true);
            let preserve = node["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
            if !in_junction && !int_or_string && !preserve && node["type"].as_str().is_none() {
                problems.push(format!("{at}: no type"));
            }
            if node["properties"].is_object() && node["additionalProperties"].is_object() {
                problems.push(format!(
                    "{at}: properties and additionalProperties together"
                ));
            }
            if node["type"] == "array" && !node["items"].is_object() {
                problems.push(format!("{at}: an array without an items schema"));
            }
            match node["x-kubernetes-list-type"].as_str() {
                None | Some("atomic") => {}
                Some("set") => {
                    if matches!(node["items"]["type"].as_str(), Some("object" | "array")) {
                        problems.push(format!("{at}: a set of non-scalars"));
                    }
                }
                Some("map") => {
                    let keys = node["x-kubernetes-list-map-keys"].as_array();
                    let required = node["items"]["required"].as_array();
                    for key in keys.into_iter().flatten() {
                        let has_default = !node["items"]["properties"][key.as_str().unwrap_or("")]
                            ["default"]
                            .is_null();
                        if !required.is_some_and(|r| r.contains(key)) && !has_default {
                            problems.push(format!(
                                "{at}: list-map key {key} neither required nor defaulted"
                            ));
                        }
                    }
                    if keys.is_none_or(|k| k.is_empty()) {
                        problems.push(format!("{at}: a list-map without keys"));
                    }
                }
                Some(other) => problems.push(format!("{at}: x-kubernetes-list-type {other:?}")),
            }
            if let Some(default) = node.get("default") {
                let fits = match node["type"].as_str() {
                    Some("string") => default.is_string(),
                    Some("integer") => default.is_i64() || default.is_u64(),
                    Some("number") => default.is_number(),
                    Some("boolean") => default.is_boolean(),
                    Some("array") => default.is_array(),
                    Some("object") => default.is_object(),
                    _ => true,
                };
                let in_enum = node["enum"].as_array().is_none_or(|e| e.contains(default));
                if !fits || !in_enum {
                    problems.push(format!(
                        "{at}: default {default} is not a value of the schema"
                    ));
                }
            }
            for rule in items(&node["x-kubernetes-validations"]) {
                let text = rule["rule"].as_str().unwrap_or_default();
                if text.contains('\n') && rule["message"].as_str().is_none_or(str::is_empty) {
                    problems.push(format!("{at}: a multi-line rule without a message"));
                }
                if rule["message"].as_str().is_some_and(|m| m.contains('\n')) {
                    problems.push(format!("{at}: a message with a line break"));
                }
                if let Some(field) = rule["fieldPath"].as_str() {
                    // `.a.b`: each step a property of the node (the API server's pathValid).
                    let mut at_node = &node;
                    for step in field.trim_start_matches('.').split('.') {
                        at_node = &at_node["properties"][step];
                    }
                    if at_node.is_null() {
                        problems.push(format!("{at}: fieldPath {field} names no field"));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A version whose schema has `status` serves it as a subresource (the agent writes status
/// through `/status`, which a CRD without the subresource answers with 404), and every printer
/// column reads a field the schema has, with a type the API server accepts.
#[test]
fn status_subresource_and_printer_columns() {
    let mut problems = Vec::new();
    for crd in shipped() {
        for version in items(&crd["spec"]["versions"]) {
            let at = format!(
                "{} {}",
                crd_name(&crd),
                version["name"].as_str().unwrap_or("?")
            );
            let schema = &version["schema"]["openAPIV3Schema"];
            if schema["properties"]["status"].is_object()
                && !version["subresources"]["status"].is_object()
            {
                problems.push(format!(
                    "{at}: status in the schema but no status subresource"
                ));
            }
            for column in items(&version["additionalPrinterColumns"]) {
                let path = column["jsonPath"].as_str().unwrap_or_default();
                if !matches!(
                    column["type"].as_str(),
                    Some("integer" | "number" | "string" | "boolean" | "date")
                ) {
                    problems.push(format!("{at}: column {path} of type {}", column["type"]));
                }
                if path.starts_with(".metadata.") {
                    continue;
                }
                // `.a.b[?(@.type=="X")].c`: follow the names, a filter steps into the items.
                let mut node = schema;
                for step in path.trim_start_matches('.').split('.') {
                    let (name, filter) = match step.split_once('[') {
                        Some((name, _)) => (name, true),
                        None => (step, false),
                    };
                    if name.is_empty() || name.ends_with(')') || name.starts_with("type==") {
                        continue;
                    }
                    node = &node["properties"][name];
                    if filter {
                        node = &node["items"];
                    }
                }
                if node.is_null() {
                    problems.push(format!("{at}: printer column {path} reads no field"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
