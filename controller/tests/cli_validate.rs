//! `ordnet validate` and `ordnet crd`, run as the real binary.
//!
//! A table of bad manifests: each must exit with 1 and print a line that names the file, the
//! object and the field. Every conformance scenario's objects must validate clean. Nothing may
//! panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ordnet");

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ordnet-cli-validate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run ordnet")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_no_panic(out: &Output, what: &str) {
    let stderr = text(&out.stderr);
    assert!(
        !stderr.contains("panicked") && out.status.code().is_some(),
        "{what}: ordnet crashed: {stderr}"
    );
}

const NS: &str = "apiVersion: v1\nkind: Namespace\nmetadata: {name: q}\n---\n";

fn onp(spec: &str) -> String {
    format!(
        "{NS}apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {{name: p, namespace: q}}\nspec: {spec}\n"
    )
}

fn conp(spec: &str) -> String {
    format!(
        "apiVersion: ordnet.io/v1alpha1\nkind: ClusterOrderedNetworkPolicy\nmetadata: {{name: c}}\nspec: {spec}\n"
    )
}

fn np(spec: &str) -> String {
    format!(
        "{NS}apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: n, namespace: q}}\nspec: {spec}\n"
    )
}

fn onp_ingress(rule: &str) -> String {
    onp(&format!(
        "{{priority: 1, podSelector: {{}}, ingress: [{rule}]}}"
    ))
}

/// (case name, file content, what a stdout line must contain after `FILE: `).
fn bad_cases() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let s = |v: String| v.into_bytes();
    vec![
        ("malformed-yaml", s("apiVersion: v1\nkind: [Namespace\n".into()), "document 1: invalid YAML: "),
        ("not-an-object", s("- just\n- a list\n".into()), "document 1: expected a Kubernetes object"),
        ("not-utf8", b"apiVersion: v1\nkind: Namespace\xff\n".to_vec(), "not UTF-8 text"),
        ("missing-api-version", s("kind: Namespace\nmetadata: {name: a}\n".into()), "document 1: apiVersion: required"),
        ("missing-kind", s("apiVersion: v1\nmetadata: {name: a}\n".into()), "document 1: kind: required"),
        ("missing-name", s("apiVersion: v1\nkind: Pod\nmetadata: {namespace: a}\n".into()), "document 1: metadata.name: required"),
        ("wrong-api-version", s("apiVersion: ordnet.io/v1\nkind: OrderedNetworkPolicy\nmetadata: {name: a}\n".into()), "document 1: apiVersion: OrderedNetworkPolicy must have apiVersion ordnet.io/v1alpha1"),
        ("duplicate-object", s(format!("{NS}{NS}")), "Namespace q: duplicate object: already defined in"),
        ("wrong-type-priority", s(onp("{priority: ten, podSelector: {}}")), "OrderedNetworkPolicy q/p: spec.priority: invalid type: string \"ten\""),
        ("wrong-type-labels", s(onp("{priority: 1, podSelector: {matchLabels: {a: [b]}}}")), "OrderedNetworkPolicy q/p: spec.podSelector.matchLabels.a: invalid type: sequence"),
        ("typo-kind", s("apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetwrokPolicy\nmetadata: {name: a, namespace: q}\nspec: {priority: 1, podSelector: {}}\n".into()), "document 1: kind: \"OrderedNetwrokPolicy\" is not a kind of ordnet.io: did you mean OrderedNetworkPolicy?"),
        ("unknown-ordnet-kind", s("apiVersion: ordnet.io/v1alpha1\nkind: Tier\nmetadata: {name: a}\n".into()), "document 1: kind: \"Tier\" is not a kind of ordnet.io (its kinds: OrderedNetworkPolicy, ClusterOrderedNetworkPolicy)"),
        ("typo-required-field", s(onp("{priority: 1, podSelecter: {matchLabels: {app: web}}}")), "OrderedNetworkPolicy q/p: spec.podSelecter: unknown field: probably a misspelling of \"podSelector\", which is required and missing"),
        ("missing-pod-selector", s(onp("{priority: 1}")), "OrderedNetworkPolicy q/p: spec.podSelector: required field is missing"),
        ("missing-action", s(onp_ingress("{from: [{podSelector: {}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].action: required field is missing"),
        ("unknown-action", s(onp_ingress("{action: Reject}")), "OrderedNetworkPolicy q/p: spec.ingress[0].action: unknown variant `Reject`"),
        ("unknown-field", s(onp_ingress("{action: Allow, ports: [{port: 80, end_port: 90}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].end_port: unknown field"),
        ("negative-priority", s(onp("{priority: -1, podSelector: {}, defaultDeny: {ingress: true}}")), "OrderedNetworkPolicy q/p: spec.priority: -1 is negative"),
        ("bad-protocol-onp", s(onp_ingress("{action: Allow, ports: [{protocol: ICMP}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].protocol: unknown variant `ICMP`"),
        ("bad-protocol-np", s(np("{podSelector: {}, ingress: [{ports: [{protocol: icmp}]}]}")), "NetworkPolicy q/n: spec.ingress[0].ports[0].protocol: \"icmp\" is not supported"),
        ("port-zero", s(onp_ingress("{action: Allow, ports: [{port: 0}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].port: 0 is not a valid port number"),
        ("port-too-big", s(np("{podSelector: {}, egress: [{ports: [{port: 65536}]}]}")), "NetworkPolicy q/n: spec.egress[0].ports[0].port: 65536 is not a valid port number"),
        ("end-port-without-port", s(onp_ingress("{action: Allow, ports: [{endPort: 90}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].endPort: not allowed without port"),
        ("end-port-with-named-port", s(onp_ingress("{action: Allow, ports: [{port: http, endPort: 90}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].endPort: not allowed with the named port"),
        ("end-port-below-port", s(onp_ingress("{action: Deny, ports: [{port: 90, endPort: 80}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].endPort: 80 must be greater than or equal to port (90)"),
        ("end-port-too-big", s(np("{podSelector: {}, ingress: [{ports: [{port: 90, endPort: 65536}]}]}")), "NetworkPolicy q/n: spec.ingress[0].ports[0].endPort: 65536 is not a valid port number"),
        ("bad-named-port", s(onp_ingress("{action: Allow, ports: [{port: serve_80}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].port: \"serve_80\" is not a valid port name"),
        ("quoted-number-port", s(onp_ingress("{action: Allow, ports: [{port: '80'}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].port: \"80\" is a string, not a number"),
        ("bad-cidr", s(onp_ingress("{action: Deny, from: [{ipBlock: {cidr: 10.0.0.300/8}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0].ipBlock.cidr: \"10.0.0.300/8\" is not a valid CIDR"),
        ("cidr-without-prefix", s(np("{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.0.0.1}}]}]}")), "NetworkPolicy q/n: spec.ingress[0].from[0].ipBlock.cidr: \"10.0.0.1\" is not a CIDR"),
        ("except-not-subset", s(onp_ingress("{action: Deny, from: [{ipBlock: {cidr: 10.0.0.0/16, except: [10.0.0.0/8]}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0].ipBlock.except[0]: \"10.0.0.0/8\" must be a strict subset of cidr 10.0.0.0/16"),
        ("except-equal", s(np("{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/16, except: [10.0.0.0/16]}}]}]}")), "NetworkPolicy q/n: spec.ingress[0].from[0].ipBlock.except[0]: \"10.0.0.0/16\" must be a strict subset"),
        ("except-other-family", s(onp_ingress("{action: Deny, from: [{ipBlock: {cidr: 10.0.0.0/8, except: ['fd00::/64']}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0].ipBlock.except[0]: \"fd00::/64\" is not of the same IP family"),
        ("ipblock-with-selector", s(onp_ingress("{action: Deny, from: [{ipBlock: {cidr: 10.0.0.0/8}, namespaceSelector: {}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0]: ipBlock may not be combined"),
        ("empty-peer", s(np("{podSelector: {}, ingress: [{from: [{}]}]}")), "NetworkPolicy q/n: spec.ingress[0].from[0]: an empty peer"),
        ("bad-operator", s(onp_ingress("{action: Allow, from: [{podSelector: {matchExpressions: [{key: a, operator: Equals, values: [b]}]}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0].podSelector.matchExpressions[0].operator: \"Equals\" is not a valid operator"),
        ("in-without-values", s(np("{podSelector: {matchExpressions: [{key: a, operator: In}]}}")), "NetworkPolicy q/n: spec.podSelector.matchExpressions[0].values: must not be empty when operator is In"),
        ("exists-with-values", s(conp("{priority: 1, namespaceSelector: {matchExpressions: [{key: a, operator: Exists, values: [b]}]}, defaultDeny: {ingress: true}}")), "ClusterOrderedNetworkPolicy c: spec.namespaceSelector.matchExpressions[0].values: must be empty when operator is Exists"),
        ("bad-label-key", s(onp_ingress("{action: Allow, from: [{namespaceSelector: {matchLabels: {'a/b/c': x}}}]}")), "OrderedNetworkPolicy q/p: spec.ingress[0].from[0].namespaceSelector.matchLabels.a/b/c: \"a/b/c\" is not a valid label key"),
        ("bad-label-value", s(conp("{priority: -2, podSelector: {matchLabels: {app: 'web server'}}, defaultDeny: {egress: true}}")), "ClusterOrderedNetworkPolicy c: spec.podSelector.matchLabels.app: \"web server\" is not a valid label value"),
        ("bad-policy-types", s(np("{podSelector: {}, policyTypes: [ingress]}")), "NetworkPolicy q/n: spec.policyTypes[0]: \"ingress\" is not supported"),
        ("bad-object-name", s(format!("{NS}apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: Deny_All, namespace: q}}\nspec: {{podSelector: {{}}}}\n")), "NetworkPolicy q/Deny_All: metadata.name: \"Deny_All\" is not a valid DNS-1123 subdomain"),
        ("bad-pod-ip", s("apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: q}\nstatus: {podIP: 10.0.0.256}\n".into()), "Pod q/a: status.podIP: \"10.0.0.256\" is not an IP address"),
        ("bad-container-port", s("apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: q}\nspec: {containers: [{name: c, ports: [{containerPort: 70000}]}]}\nstatus: {podIP: 10.0.0.1}\n".into()), "Pod q/a: spec.containers[0].ports[0].containerPort: 70000 is not a valid port number"),
        ("nested-too-deep", s(format!("{}{}", "[".repeat(400), "]".repeat(400))), "document 1: invalid YAML"),
    ]
}

#[test]
fn every_bad_manifest_exits_1_and_names_file_object_and_field() {
    let dir = scratch("bad");
    let mut failures = Vec::new();
    for (name, content, want) in bad_cases() {
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, &content).expect("write case");
        let out = run(&["validate", "-f", file.to_str().expect("utf-8 path")]);
        assert_no_panic(&out, name);
        let stdout = text(&out.stdout);
        let expected = format!("{}: {want}", file.display());
        let line_ok = stdout.lines().any(|l| l.starts_with(&expected));
        if out.status.code() != Some(1) || !line_ok {
            failures.push(format!(
                "{name}: exit {:?}, wanted a line starting with\n    {expected}\n  stdout:\n{stdout}  stderr:\n{}",
                out.status.code(),
                text(&out.stderr)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `-o json`: every problem as an object with file, kind, namespace, name, field, severity and
/// message; exit code as for text.
#[test]
fn json_output_lists_every_problem() {
    let dir = scratch("json");
    let file = dir.join("p.yaml");
    std::fs::write(
        &file,
        format!(
            "{}---\n{}",
            onp("{priority: 1, podSelector: {}, ingress: [{action: Deny, from: [{ipBlock: {cidr: 10.0.0.0/8, except: [11.0.0.0/16]}}]}, {action: Deny, from: [{ipBlock: {cidr: 10.0.0.0/8, except: [11.0.0.0/16]}}]}]}"),
            "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n"
        ),
    )
    .expect("write");
    let path = file.to_str().expect("utf-8 path");
    let out = run(&["validate", "-f", path, "-o", "json"]);
    assert_no_panic(&out, "json");
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let problems = v["problems"].as_array().expect("problems");
    let find = |field: &str| {
        problems
            .iter()
            .find(|p| p["field"] == field)
            .unwrap_or_else(|| panic!("no problem at {field}: {v}"))
    };
    let e = find("spec.ingress[0].from[0].ipBlock.except[0]");
    assert_eq!(e["file"], path);
    assert_eq!(e["kind"], "OrderedNetworkPolicy");
    assert_eq!(e["namespace"], "q");
    assert_eq!(e["name"], "p");
    assert_eq!(e["severity"], "error");
    assert!(e["message"].as_str().unwrap().contains("strict subset"));
    let w = find("spec.ingress[1]");
    assert_eq!(w["severity"], "warning");
    assert!(
        w["message"]
            .as_str()
            .unwrap()
            .starts_with("duplicate of spec.ingress[0]")
    );
    let ignored = problems
        .iter()
        .find(|p| p["message"].as_str().unwrap().contains("Widget"))
        .expect("the ignored kind");
    assert_eq!(ignored["severity"], "warning");
    assert!(ignored["kind"].is_null() && ignored["field"].is_null());
    // Clean input: an empty list, exit 0.
    std::fs::write(&file, NS).expect("write");
    let out = run(&["validate", "-f", path, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout).trim(), r#"{"problems":[]}"#);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rules that can never decide a packet (a duplicate, the same match with the other action,
/// anything after a match-everything rule) are valid: warnings on stderr, exit 0.
#[test]
fn rules_that_can_never_decide_are_warnings() {
    let dir = scratch("shadowed");
    let cases = [
        (
            onp(
                "{priority: 1, podSelector: {}, egress: [{action: Deny, ports: [{port: 25}]}, {action: Deny, ports: [{port: 25}]}]}",
            ),
            "OrderedNetworkPolicy q/p: spec.egress[1]: warning: duplicate of spec.egress[0]",
        ),
        (
            conp(
                "{priority: 1, ingress: [{action: Allow, from: [{podSelector: {}}]}, {action: Deny, from: [{podSelector: {}}]}]}",
            ),
            "ClusterOrderedNetworkPolicy c: spec.ingress[1]: warning: matches exactly the same traffic as spec.ingress[0] (Allow)",
        ),
        (
            conp(
                "{priority: 1, ingress: [{action: Deny}, {action: Allow, from: [{podSelector: {}}]}]}",
            ),
            "ClusterOrderedNetworkPolicy c: spec.ingress[1]: warning: can never decide a packet: spec.ingress[0] matches all traffic",
        ),
    ];
    for (i, (content, want)) in cases.iter().enumerate() {
        let file = dir.join(format!("case{i}.yaml"));
        std::fs::write(&file, content).expect("write case");
        let out = run(&["validate", "-f", file.to_str().expect("utf-8 path")]);
        assert_no_panic(&out, want);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{want}: {stderr}");
        assert!(text(&out.stdout).is_empty(), "{want}: errors printed");
        let expected = format!("{}: {want}", file.display());
        assert!(
            stderr.lines().any(|l| l.starts_with(&expected)),
            "wanted {expected}\n  stderr:\n{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn all_problems_are_reported_at_once() {
    let dir = scratch("many");
    let a = dir.join("a.yaml");
    let b = dir.join("b.json");
    std::fs::write(
        &a,
        onp("{priority: -1, podSelector: {}, ingress: [{action: Allow, ports: [{port: 0}, {endPort: 5}]}]}"),
    )
    .unwrap();
    std::fs::write(
        &b,
        r#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": 5}}"#,
    )
    .unwrap();
    let out = run(&[
        "validate",
        "-f",
        a.to_str().unwrap(),
        "-f",
        b.to_str().unwrap(),
    ]);
    assert_no_panic(&out, "many");
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let a = a.display();
    let b = b.display();
    assert_eq!(
        lines,
        [
            format!(
                "{b}: document 1: metadata.name: must be a string, found the number 5 (kind Pod)"
            ),
            format!(
                "{a}: OrderedNetworkPolicy q/p: spec.priority: -1 is negative: an OrderedNetworkPolicy needs priority >= 0 (only a ClusterOrderedNetworkPolicy may go below 0)"
            ),
            format!(
                "{a}: OrderedNetworkPolicy q/p: spec.ingress[0].ports[0].port: 0 is not a valid port number: must be between 1 and 65535"
            ),
            format!(
                "{a}: OrderedNetworkPolicy q/p: spec.ingress[0].ports[1].endPort: not allowed without port: a range needs a numeric port"
            ),
        ]
    );
    assert!(text(&out.stderr).contains("4 errors found"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn warnings_alone_do_not_fail() {
    let dir = scratch("warn");
    let f = dir.join("w.yaml");
    std::fs::write(
        &f,
        format!(
            "{NS}apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: web, namespace: q}}\n---\n{}",
            conp("{priority: 1, namespace: ignored}").replace("namespace: ignored", "defaultDeny: {ingress: true}")
        ),
    )
    .unwrap();
    let out = run(&["validate", "-f", f.to_str().unwrap()]);
    assert_no_panic(&out, "warn");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&format!(
        "{}: document 2: warning: ignored Deployment web (apps/v1)",
        f.display()
    )));
    assert!(stderr.ends_with("2 objects valid\n"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_path_exits_1_and_usage_errors_exit_2() {
    let out = run(&["validate", "-f", "/nonexistent/ordnet/manifests.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).starts_with("/nonexistent/ordnet/manifests.yaml: cannot read"));
    assert_eq!(run(&["validate"]).status.code(), Some(2));
    assert_eq!(run(&["validate", "--bogus"]).status.code(), Some(2));
    assert_eq!(run(&["crd", "extra"]).status.code(), Some(2));
}

#[test]
fn every_conformance_scenario_validates_clean() {
    // The repository's copy of the scenarios (testsuite keeps it in sync with the shared
    // original when that exists; a fresh clone has only the copy).
    let scenarios = ordnet_testsuite::scenario::conformance_files();
    assert!(
        scenarios.len() >= 70,
        "expected the conformance scenarios and our own"
    );
    let out_dir = scratch("conformance");
    let mut failures = Vec::new();
    for scenario in &scenarios {
        let doc: yaml_serde::Value =
            yaml_serde::from_str(&std::fs::read_to_string(scenario).unwrap()).unwrap();
        let objects = doc["objects"].as_sequence().expect("objects list");
        let count = objects.len();
        let manifest = out_dir.join(scenario.file_name().unwrap());
        let stream: String = objects
            .iter()
            .map(|o| format!("---\n{}", yaml_serde::to_string(o).unwrap()))
            .collect();
        std::fs::write(&manifest, stream).unwrap();
        let out = run(&["validate", "-f", manifest.to_str().unwrap()]);
        assert_no_panic(&out, &scenario.display().to_string());
        let stderr = text(&out.stderr);
        // Warnings are allowed (a scenario may show a rule that can never decide a packet);
        // errors are not.
        let want = format!("{count} objects valid");
        let lines: Vec<&str> = stderr.lines().collect();
        let clean = lines.last() == Some(&want.as_str())
            && lines[..lines.len() - 1]
                .iter()
                .all(|l| l.contains(": warning: "));
        if out.status.code() != Some(0) || !out.stdout.is_empty() || !clean {
            failures.push(format!(
                "{}: exit {:?}\nstdout:\n{}stderr:\n{stderr}",
                scenario.display(),
                out.status.code(),
                text(&out.stdout)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn crd_prints_the_committed_yaml() {
    let out = run(&["crd"]);
    assert_eq!(out.status.code(), Some(0));
    let committed =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds/ordnet.io_crds.yaml");
    let committed = std::fs::read_to_string(&committed).expect("committed CRD YAML");
    assert!(
        text(&out.stdout) == committed,
        "`ordnet crd` differs from deploy/crds/ordnet.io_crds.yaml; regenerate it with \
         `cargo run -q -p ordnet -- crd > deploy/crds/ordnet.io_crds.yaml`"
    );
    // Both CRDs are there, and the output reads back as YAML documents.
    let docs: Vec<yaml_serde::Value> = yaml_serde::Deserializer::from_str(&committed)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .collect();
    let names: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "orderednetworkpolicies.ordnet.io",
            "clusterorderednetworkpolicies.ordnet.io"
        ]
    );
}
