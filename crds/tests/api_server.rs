//! The CEL cost budget a real API server applies to a CRD (docs/api.md, "CEL cost budget").
//!
//! * Every rule of every CRD we ship (ours as `ordnet crd` generates them, and the upstream
//!   ClusterNetworkPolicy under `deploy/crds/upstream/`) stays at or below a quarter of the
//!   per-expression budget, and each CRD's total at or below a quarter of the CRD budget; the
//!   largest estimates are printed.
//! * The estimator is checked against the API server itself on a frozen input: the CRD that a
//!   real kube-apiserver v1.36 refused (`tests/data/ordnet.io_crds.refused-by-1.36.yaml`) — the
//!   estimate of every one of its rules equals the figure the API server computed for it, and the
//!   four rules it refused come out over budget by its factor, 1.105920×.

mod celcost;

use std::path::Path;

use celcost::{CRD_LIMIT, PER_EXPRESSION_LIMIT, RuleCost, crd_rule_costs, crd_total};
use serde_json::Value;

fn repo(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The CRDs of a multi-document YAML file, as JSON.
fn crds_in(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.split("\n---")
        .filter(|doc| doc.contains("kind: CustomResourceDefinition"))
        .map(|doc| yaml_serde::from_str::<Value>(doc).expect("CRD YAML"))
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
        let total = crd_total(&costs);
        println!(
            "{}: {} rules, total {} ({:.1}% of the CRD budget); the largest:",
            crd["metadata"]["name"].as_str().unwrap_or("?"),
            costs.len(),
            total,
            100.0 * total as f64 / CRD_LIMIT as f64
        );
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
        if total > CRD_LIMIT / 4 {
            over.push(format!(
                "{}: total {total} > a quarter of {CRD_LIMIT}",
                crd["metadata"]["name"]
            ));
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
    let differ: Vec<String> = expected
        .iter()
        .zip(&got)
        .filter(|(e, g)| e != g)
        .map(|(e, g)| format!("API server {e:?}\nestimate   {g:?}"))
        .collect();
    assert_eq!(expected.len(), got.len(), "rule counts differ");
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
