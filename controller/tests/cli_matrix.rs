//! `ordnet matrix`, `trace` and `dump`, run as the real binary.
//!
//! - `matrix -o json` on a handful of conformance scenarios equals the scenario's expectation;
//! - the built-in example `examples/qa-prod` tells its story (the demo runs exactly these
//!   commands, so it cannot rot silently);
//! - `trace` names the deciding rule or the default, `dump` renders tree/json/dot;
//! - error cases: unknown pod, bad --from, invalid manifests, an unreachable `--agent` (exit 1),
//!   usage errors (exit 2); no colour when stdout is not a terminal.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ordnet_testsuite::scenario::{self, Scenario};

const BIN: &str = env!("CARGO_BIN_EXE_ordnet");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn example() -> String {
    repo().join("examples/qa-prod").display().to_string()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ordnet-cli-matrix-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .expect("run ordnet")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs and requires exit code `code`; returns stdout.
fn run_ok(args: &[&str], code: i32) -> String {
    let out = run(args);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert_eq!(
        out.status.code(),
        Some(code),
        "{args:?}: exit {:?}\nstdout:\n{}\nstderr:\n{stderr}",
        out.status.code(),
        text(&out.stdout)
    );
    text(&out.stdout)
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}):\n{s}"))
}

/// A `matrix -o json` output's results as (from, to, verdict), in their order.
fn results(out: &serde_json::Value) -> Vec<(String, String, String)> {
    let field = |r: &serde_json::Value, f: &str| r[f].as_str().unwrap().to_string();
    out["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| (field(r, "from"), field(r, "to"), field(r, "verdict")))
        .collect()
}

// ----- matrix -o json against conformance scenarios ------------------------------------------

/// Writes a conformance scenario's objects (ours included) to a manifest file; returns (file,
/// scenario).
fn scenario(name: &str, dir: &Path) -> (PathBuf, Scenario) {
    manifest_of(&scenario::find(name), dir)
}

/// [`scenario`] for a scenario of `testsuite/data/<sub>`.
fn scenario_in(sub: &str, name: &str, dir: &Path) -> (PathBuf, Scenario) {
    manifest_of(&scenario::path(sub, name), dir)
}

fn manifest_of(path: &Path, dir: &Path) -> (PathBuf, Scenario) {
    let sc = Scenario::load(path).unwrap_or_else(|e| panic!("{e}"));
    let name = &sc.name;
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, sc.manifest()).unwrap();
    (file, sc)
}

/// Runs `matrix -o json` for every probe of a scenario file and compares every pair with the
/// scenario's expectation; `code` is the exit code every run must have. Returns the probes run.
fn check_scenario_matrix(file: &Path, sc: &Scenario, code: i32) -> usize {
    let name = &sc.name;
    let pods = sc.pods(4);
    let externals = sc.external_names();
    let mut probes = 0;
    for probe in &sc.expect {
        let proto = probe.protocol.as_str();
        let port = probe.port.to_string();
        let mut args = vec![
            "matrix",
            "-f",
            file.to_str().unwrap(),
            "--protocol",
            proto,
            "--port",
            &port,
            "-o",
            "json",
        ];
        for e in &externals {
            args.extend(["--external", e.as_str()]);
        }
        let out = json(&run_ok(&args, code));
        assert_eq!(out["protocol"], proto, "{name}");
        assert_eq!(out["port"].to_string(), port, "{name}");
        let mut want = BTreeMap::new();
        for a in pods.iter().chain(&externals) {
            for b in pods.iter().chain(&externals) {
                if !pods.contains(a) && !pods.contains(b) {
                    continue;
                }
                let v = if probe.allows(a, b).unwrap() {
                    "allow"
                } else {
                    "deny"
                };
                want.insert(format!("{a} -> {b}"), v.to_string());
            }
        }
        let results = results(&out);
        let got: BTreeMap<String, String> = results
            .iter()
            .map(|(from, to, verdict)| (format!("{from} -> {to}"), verdict.clone()))
            .collect();
        assert_eq!(results.len(), got.len(), "{name}: duplicate pairs");
        assert_eq!(got, want, "{name} {proto}/{port}");
        probes += 1;
    }
    probes
}

#[test]
fn matrix_json_equals_the_scenario_expectations() {
    let dir = scratch("scenarios");
    let names = [
        "np-e2e-01-default-deny-ingress",
        "np-e2e-14-ports",
        "np-e2e-35-egress-cidr-except",
        "np-e2e-38-sctp-not-treated-as-tcp",
        "np-e2e-44-ports-udp",
        "onp-03-rule-order-within-policy",
        "onp-08-ipblock-except-with-ordered-deny",
        "onp-10-port-range-with-deny-hole",
        "onp-13-allow-then-deny-same-traffic",
        "onp-14-deny-then-allow-same-traffic",
    ];
    let mut probes = 0;
    for name in names {
        let (file, sc) = scenario(name, &dir);
        probes += check_scenario_matrix(&file, &sc, 0);
    }
    assert!(probes >= 19, "only {probes} probes ran");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rule that repeats an earlier rule's traffic with the other action never decides a packet:
/// the first one wins (matrix above), and the repeat is only a warning (exit 0) that says so.
#[test]
fn repeated_rule_is_a_warning_and_the_first_rule_wins() {
    let dir = scratch("repeated");
    for (name, warning) in [
        (
            "onp-13-allow-then-deny-same-traffic",
            "ClusterOrderedNetworkPolicy allow-then-deny-y: spec.ingress[1]: warning: matches exactly the same traffic as spec.ingress[0] (Allow), which always matches first, so this Deny can never decide a packet",
        ),
        (
            "onp-14-deny-then-allow-same-traffic",
            "OrderedNetworkPolicy x/deny-then-allow: spec.ingress[1]: warning: matches exactly the same traffic as spec.ingress[0] (Deny), which always matches first, so this Allow can never decide a packet",
        ),
    ] {
        let (file, _) = scenario(name, &dir);
        let out = run(&["matrix", "-f", file.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(0), "{name}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(&format!("{}: {warning}", file.display())),
            "{name}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rules the engine cannot enforce as written (what an older CRD let the API server store) fail
/// closed: an `Allow` rule matches nothing, a `Deny` rule denies everything in its direction at
/// its place in the order, and the rest of each object is enforced. `matrix` computes exactly
/// that, prints every problem, and exits 1 (invalid input).
#[test]
fn unenforceable_rules_fail_closed_and_exit_1() {
    let dir = scratch("fail-closed");
    let (file, sc) = scenario_in("invalid", "rules-fail-closed", &dir);
    assert_eq!(check_scenario_matrix(&file, &sc, 1), 2);
    let out = run(&["matrix", "-f", file.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    for want in [
        "OrderedNetworkPolicy x/allow-broken-port: spec.ingress[0] (Allow) matches nothing: spec.ingress[0].ports[0].port",
        "ClusterOrderedNetworkPolicy deny-broken-cidr: spec.egress[1] (Deny) denies all egress: spec.egress[1].to[0].ipBlock.cidr",
        "ordnet matrix: 2 errors in the manifests; computed with every rule that cannot be enforced failing closed, exit code 1",
    ] {
        assert!(stderr.contains(want), "{want}\n{stderr}");
    }
    // `validate` reports the same problems as errors.
    let out = run(&["validate", "-f", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ----- the built-in example ------------------------------------------------------------------

/// The example's story on TCP 8081 (matrix JSON, every pair), as examples/qa-prod/README.md
/// tells it.
#[test]
fn example_tells_its_story() {
    let ex = example();
    let verdicts = |port: &str| -> BTreeMap<(String, String), String> {
        let out = json(&run_ok(
            &[
                "matrix",
                "-f",
                &ex,
                "--port",
                port,
                "--external",
                "203.0.113.7",
                "-o",
                "json",
            ],
            0,
        ));
        results(&out)
            .into_iter()
            .map(|(from, to, verdict)| ((from, to), verdict))
            .collect()
    };
    let eps = [
        "prod/api",
        "prod/artifacts",
        "prod/db",
        "qa/grafana",
        "qa/tester",
        "203.0.113.7",
    ];
    // (port, denied pairs); every other pair is allowed.
    let story: [(&str, &[(&str, &str)]); 3] = [
        (
            "8081",
            &[
                // the guardrail: qa never reaches prod ...
                ("qa/tester", "prod/artifacts"),
                ("qa/tester", "prod/api"),
                ("qa/grafana", "prod/api"),
                // ... (qa/grafana -> prod/artifacts is the cluster exception at -20)
                // the artifact server is isolated: only pods, on 8000-8999
                ("203.0.113.7", "prod/artifacts"),
                // the database takes only the API, only on 5432
                ("prod/api", "prod/db"),
                ("prod/artifacts", "prod/db"),
                ("qa/grafana", "prod/db"),
                ("qa/tester", "prod/db"),
                ("203.0.113.7", "prod/db"),
            ],
        ),
        (
            "8080",
            &[
                // the hole in the port range: 8080 is denied to everyone but the pod itself,
                // grafana included (its exception is for 8081 only)
                ("prod/api", "prod/artifacts"),
                ("prod/db", "prod/artifacts"),
                ("qa/grafana", "prod/artifacts"),
                ("qa/tester", "prod/artifacts"),
                ("203.0.113.7", "prod/artifacts"),
                ("qa/grafana", "prod/api"),
                ("qa/tester", "prod/api"),
                ("prod/api", "prod/db"),
                ("prod/artifacts", "prod/db"),
                ("qa/grafana", "prod/db"),
                ("qa/tester", "prod/db"),
                ("203.0.113.7", "prod/db"),
            ],
        ),
        (
            "5432",
            &[
                ("prod/artifacts", "prod/db"),
                ("qa/grafana", "prod/db"),
                ("qa/tester", "prod/db"),
                ("203.0.113.7", "prod/db"),
                ("qa/grafana", "prod/api"),
                ("qa/tester", "prod/api"),
                ("prod/api", "prod/artifacts"),
                ("prod/db", "prod/artifacts"),
                ("qa/grafana", "prod/artifacts"),
                ("qa/tester", "prod/artifacts"),
                ("203.0.113.7", "prod/artifacts"),
            ],
        ),
    ];
    for (port, denied) in story {
        let got = verdicts(port);
        let mut want = BTreeMap::new();
        for a in eps {
            for b in eps {
                if a.starts_with("203") && b.starts_with("203") {
                    continue;
                }
                let v = if denied.contains(&(a, b)) {
                    "deny"
                } else {
                    "allow"
                };
                want.insert((a.to_string(), b.to_string()), v.to_string());
            }
        }
        assert_eq!(got, want, "TCP/{port}");
    }
}

#[test]
fn trace_names_the_deciding_rule() {
    let ex = example();
    // Allowed: the cluster exception (-20) beats the guardrail (-10).
    let out = run_ok(
        &[
            "trace",
            "-f",
            &ex,
            "--from",
            "qa/grafana",
            "--to",
            "prod/artifacts",
            "--port",
            "8081",
        ],
        0,
    );
    assert!(
        out.starts_with(
            "trace TCP/8081 from qa/grafana (10.244.1.10) to prod/artifacts (10.244.2.10): ALLOW\n"
        ),
        "{out}"
    );
    assert!(out.contains(
        "rule      ClusterOrderedNetworkPolicy grafana-reads-artifacts, ingress rule 0, priority -20, action Allow"
    ), "{out}");
    assert!(
        !out.contains('\x1b'),
        "colour although stdout is a pipe:\n{out}"
    );

    // Denied: the guardrail beats the prod team's own allow at priority 0, which is covered.
    let out = run_ok(
        &[
            "trace",
            "-f",
            &ex,
            "--from",
            "qa/tester",
            "--to",
            "prod/api",
            "--port",
            "8081",
        ],
        0,
    );
    assert!(out.contains("): DENY\n"), "{out}");
    assert!(out.contains("denied on the ingress side"), "{out}");
    assert!(out.contains(
        "rule      ClusterOrderedNetworkPolicy qa-must-not-reach-prod, ingress rule 0, priority -10, action Deny"
    ), "{out}");
    let covered = out
        .lines()
        .find(|l| l.contains("OrderedNetworkPolicy prod/api-lets-qa-tester-in ingress[0]"))
        .unwrap_or_else(|| panic!("the covered namespaced allow is not on the path:\n{out}"));
    assert!(covered.contains("covered by ["), "{covered}");
    assert!(covered.ends_with("◀ would match, covered"), "{covered}");

    // The port-range hole: rule 0 (deny 8080) beats rule 1 (allow 8000-8999) of one policy.
    let out = run_ok(
        &[
            "trace",
            "-f",
            &ex,
            "--from",
            "prod/api",
            "--to",
            "prod/artifacts",
            "--port",
            "8080",
        ],
        0,
    );
    assert!(out.contains("): DENY\n"), "{out}");
    assert!(
        out.contains(
            "OrderedNetworkPolicy prod/artifacts-ports, ingress rule 0, priority 100, action Deny"
        ),
        "{out}"
    );

    // The default: an external address to the isolated artifact server.
    let out = run_ok(
        &[
            "trace",
            "-f",
            &ex,
            "--from",
            "203.0.113.7",
            "--to",
            "prod/artifacts",
            "--port",
            "8081",
        ],
        0,
    );
    assert!(out.contains("egress of 203.0.113.7: not a pod"), "{out}");
    assert!(out.contains(
        "default   deny: prod/artifacts is isolated for ingress by OrderedNetworkPolicy prod/artifacts-ports"
    ), "{out}");

    // A pod to itself.
    let out = run_ok(
        &[
            "trace", "-f", &ex, "--from", "prod/db", "--to", "prod/db", "--port", "8081",
        ],
        0,
    );
    assert!(
        out.contains("ALLOW\n  a pod talking to itself is always allowed"),
        "{out}"
    );

    // JSON: the verdict and both sides.
    let out = json(&run_ok(
        &[
            "trace",
            "-f",
            &ex,
            "--from",
            "qa/tester",
            "--to",
            "prod/api",
            "--port",
            "8081",
            "-o",
            "json",
        ],
        0,
    ));
    assert_eq!(out["verdict"], "deny");
    assert_eq!(out["egress"]["endpoint"], "qa/tester");
    assert_eq!(out["egress"]["verdict"], "allow");
    assert_eq!(out["ingress"]["endpoint"], "prod/api");
    assert_eq!(out["ingress"]["verdict"], "deny");
    assert_eq!(
        out["ingress"]["decision"]["entry"]["origins"][0]["name"],
        "qa-must-not-reach-prod"
    );
}

#[test]
fn dump_renders_tree_json_and_dot() {
    let ex = example();
    let tree = run_ok(&["dump", "-f", &ex, "--pod", "prod/api"], 0);
    assert!(
        tree.starts_with("endpoint prod/api: 10.244.2.11 = identity "),
        "{tree}"
    );
    for want in [
        "prod/api ingress: 2 keys, 1 covered entry\n",
        "  default when no key matches: allow (prod/api is not isolated for ingress)\n",
        "ClusterOrderedNetworkPolicy qa-must-not-reach-prod ingress[0]",
        "OrderedNetworkPolicy prod/api-lets-qa-tester-in ingress[0]",
        "prod/api egress: 0 keys, 0 covered entries\n",
        "\nlegend:\n",
    ] {
        assert!(tree.contains(want), "missing {want:?} in:\n{tree}");
    }
    let covered_line = tree
        .lines()
        .find(|l| l.contains("api-lets-qa-tester-in"))
        .unwrap();
    assert!(covered_line.contains("covered by ["), "{covered_line}");

    let doc = json(&run_ok(
        &[
            "dump",
            "-f",
            &ex,
            "--pod",
            "prod/api",
            "--direction",
            "ingress",
            "-o",
            "json",
        ],
        0,
    ));
    assert_eq!(doc["endpoint"], "prod/api");
    let dirs = doc["directions"].as_array().unwrap();
    assert_eq!(dirs.len(), 1);
    assert_eq!(dirs[0]["direction"], "ingress");
    assert_eq!(dirs[0]["keyCount"], 2);
    assert_eq!(dirs[0]["coveredCount"], 1);
    let labels: Vec<&str> = dirs[0]["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["label"].as_str())
        .collect();
    assert!(
        labels.contains(&"qa/app=tester [qa/tester]"),
        "identity labels from the engine: {labels:?}"
    );

    let dot = run_ok(
        &["dump", "-f", &ex, "--pod", "prod/artifacts", "-o", "dot"],
        0,
    );
    assert!(
        dot.starts_with("digraph \"mapstate prod/artifacts\" {\n"),
        "{dot}"
    );
    assert!(dot.ends_with("}\n"), "{dot}");
    assert_eq!(dot.matches('{').count(), dot.matches('}').count(), "{dot}");
    assert!(dot.contains("subgraph \"cluster_ingress\""));
    assert!(dot.contains("subgraph \"cluster_egress\""));
    assert!(dot.contains("label=\"covered by\""));
}

// ----- errors --------------------------------------------------------------------------------

#[test]
fn errors_have_the_documented_exit_codes() {
    let ex = example();
    // Unknown pod, unparsable end: exit 1 with a message that names it.
    let out = run(&[
        "trace",
        "-f",
        &ex,
        "--from",
        "prod/nope",
        "--to",
        "prod/api",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--from prod/nope: no pod prod/nope"),
        "{}",
        text(&out.stderr)
    );
    assert!(out.stdout.is_empty());
    let out = run(&[
        "trace",
        "-f",
        &ex,
        "--from",
        "prod/api",
        "--to",
        "not-a-pod",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--to not-a-pod:"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&["dump", "-f", &ex, "--pod", "qa/nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--pod qa/nope: no pod qa/nope"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&["dump", "-f", &ex, "--pod", "grafana"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("expected NAMESPACE/NAME"));

    // Usage errors: exit 2.
    for args in [
        &["matrix"][..],
        &["trace", "--from", "qa/grafana", "--to", "prod/api"],
        &["dump", "--pod", "prod/api"],
        &["matrix", "-f", &ex, "--protocol", "ICMP"],
        &["matrix", "-f", &ex, "--family", "5"],
        &["matrix", "-f", &ex, "--external", "not-an-ip"],
        &["dump", "-f", &ex, "--pod", "prod/api", "-o", "yaml"],
    ] {
        let out = run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = run(&["matrix", "-f", &ex, "--external", "2001:db8::1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("is not an IPv4 address"));

    // --agent with every output format: an agent that is not there is exit 1, no output, and
    // a message naming its address.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let agent = format!("127.0.0.1:{port}");
    for cmd in ["matrix", "trace", "dump"] {
        let mut args = vec![cmd, "--agent", &agent];
        match cmd {
            "trace" => args.extend(["--from", "qa/grafana", "--to", "prod/api"]),
            "dump" => args.extend(["--pod", "prod/api"]),
            _ => {}
        }
        let out = run(&args);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        assert!(out.stdout.is_empty(), "{cmd}");
        assert!(
            text(&out.stderr).contains(&format!("ordnet {cmd}: agent {agent}: ")),
            "{cmd}: {}",
            text(&out.stderr)
        );
    }

    // Invalid manifests: exit 1, every error names the file, the object and the field.
    let dir = scratch("invalid");
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: ordnet.io/v1alpha1\nkind: OrderedNetworkPolicy\nmetadata: {name: p, namespace: q}\n\
         spec: {priority: -1, podSelector: {}, ingress: [{action: Allow}]}\n",
    )
    .unwrap();
    let out = run(&["matrix", "-f", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{}: OrderedNetworkPolicy q/p: spec.priority: -1 is negative",
            bad.display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("ordnet matrix: 1 object cannot be used; nothing computed"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn table_output_is_aligned_and_plain_when_piped() {
    let ex = example();
    let out = run_ok(&["matrix", "-f", &ex, "--port", "8081"], 0);
    let want = "\
TCP/8081        prod/api  prod/artifacts  prod/db  qa/grafana  qa/tester
prod/api           .            .            X         .           .
prod/artifacts     .            .            X         .           .
prod/db            .            .            .         .           .
qa/grafana         X            .            X         .           .
qa/tester          X            X            X         .           .

. allow  X deny  - not probed (two external addresses)   rows: source, columns: destination
7 of 25 pairs denied
";
    assert_eq!(out, want);
}

/// Colour needs a terminal: run under `script(1)` (util-linux) for a pseudo-terminal.
#[test]
fn colour_on_a_terminal_unless_no_color() {
    if Command::new("script").arg("--version").output().is_err() {
        println!("note: script(1) is not installed; the terminal colour check is skipped");
        return;
    }
    let ex = example();
    let cmd = format!("{BIN} matrix -f {ex} --port 8081");
    let on_tty = |no_color: Option<&str>| {
        let mut c = Command::new("script");
        c.args(["-qec", &cmd, "/dev/null"]).env_remove("NO_COLOR");
        if let Some(v) = no_color {
            c.env("NO_COLOR", v);
        }
        let out = c.output().expect("run script");
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let coloured = on_tty(None);
    assert!(coloured.contains("\x1b[1;31mX\x1b[0m"), "{coloured:?}");
    assert!(coloured.contains("\x1b[32m.\x1b[0m"), "{coloured:?}");
    assert!(!on_tty(Some("1")).contains('\x1b'));
    // An empty NO_COLOR does not disable colour (no-color.org).
    assert!(on_tty(Some("")).contains('\x1b'));
}

#[test]
fn family_6_probes_ipv6_addresses() {
    let dir = scratch("v6");
    let file = dir.join("dual.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {pod: a}}
status: {podIP: 10.244.1.1, podIPs: [{ip: 10.244.1.1}, {ip: "fd00::1"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {pod: b}}
status: {podIP: 10.244.1.2, podIPs: [{ip: 10.244.1.2}, {ip: "fd00::2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: x, labels: {pod: c}}
status: {podIP: 10.244.1.3}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: only-b-v6, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from:
    - ipBlock: {cidr: "fd00::2/128"}
"#,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let pairs = |args: &[&str]| -> Vec<String> {
        let out = json(&run_ok(args, 0));
        results(&out)
            .into_iter()
            .map(|(from, to, verdict)| format!("{from} -> {to} {verdict}"))
            .collect()
    };
    // IPv6: x/c has no IPv6 address and is skipped; only x/b's IPv6 address may reach x/a.
    assert_eq!(
        pairs(&[
            "matrix",
            "-f",
            f,
            "--family",
            "6",
            "--external",
            "fd00::99",
            "-o",
            "json"
        ]),
        [
            "x/a -> x/a allow",
            "x/a -> x/b allow",
            "x/a -> fd00::99 allow",
            "x/b -> x/a allow",
            "x/b -> x/b allow",
            "x/b -> fd00::99 allow",
            "fd00::99 -> x/a deny",
            "fd00::99 -> x/b allow",
        ]
    );
    // IPv4: the /128 selects nothing, x/a is isolated.
    assert_eq!(
        pairs(&["matrix", "-f", f, "-o", "json"]),
        [
            "x/a -> x/a allow",
            "x/a -> x/b allow",
            "x/a -> x/c allow",
            "x/b -> x/a deny",
            "x/b -> x/b allow",
            "x/b -> x/c allow",
            "x/c -> x/a deny",
            "x/c -> x/b allow",
            "x/c -> x/c allow",
        ]
    );
    // trace from a pod's IPv6 address: that pod's egress, named in the heading.
    let out = run_ok(&["trace", "-f", f, "--from", "fd00::2", "--to", "x/a"], 0);
    assert!(
        out.starts_with("trace TCP/80 from fd00::2 (x/b) to x/a (fd00::1): ALLOW\n"),
        "{out}"
    );
    assert!(out.contains("egress of x/b: allow"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `matrix` computes its verdicts with the datapath (every pod programmed into an in-memory
/// datapath, crafted frames decided by the XDP program's function); on every protocol, both
/// families and with external addresses they equal the engine's own MapState lookups
/// (`ordnet_engine::matrix`, computed here in the test). `trace` agrees too, and a flow whose
/// ends are of two families is refused.
#[test]
fn datapath_verdicts_equal_the_engine_on_every_protocol_and_family() {
    let dir = scratch("protocols");
    let file = dir.join("protocols.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {team: x}}
---
apiVersion: v1
kind: Namespace
metadata: {name: y, labels: {team: y}}
---
apiVersion: v1
kind: Pod
metadata: {name: dns, namespace: x, labels: {app: dns}}
spec:
  containers: [{name: c, image: i, ports: [{name: dns, containerPort: 53, protocol: UDP}, {name: sig, containerPort: 3868, protocol: SCTP}]}]
status: {podIP: 10.1.0.1, podIPs: [{ip: 10.1.0.1}, {ip: "fd00:1::1"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: x, labels: {app: web}}
status: {podIP: 10.1.0.2, podIPs: [{ip: 10.1.0.2}, {ip: "fd00:1::2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: y, labels: {app: client}}
status: {podIP: 10.2.0.1, podIPs: [{ip: 10.2.0.1}, {ip: "fd00:2::1"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: v4only, namespace: y, labels: {app: client}}
status: {podIP: 10.2.0.2}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: dns-in, namespace: x}
spec:
  podSelector: {matchLabels: {app: dns}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: y}}}]
    ports: [{port: dns, protocol: UDP}, {port: sig, protocol: SCTP}]
  - from: [{ipBlock: {cidr: "fd00:2::/64"}}, {ipBlock: {cidr: 203.0.113.0/24, except: [203.0.113.128/25]}}]
    ports: [{port: 53, protocol: TCP}]
---
apiVersion: ordnet.io/v1alpha1
kind: OrderedNetworkPolicy
metadata: {name: web-out, namespace: x}
spec:
  priority: 10
  podSelector: {matchLabels: {app: web}}
  egress:
  - action: Deny
    to: [{podSelector: {matchLabels: {app: dns}}}]
    ports: [{port: 53, protocol: UDP}]
  - action: Allow
    to: [{ipBlock: {cidr: 0.0.0.0/0}}]
---
apiVersion: ordnet.io/v1alpha1
kind: ClusterOrderedNetworkPolicy
metadata: {name: no-sctp-from-y}
spec:
  priority: -5
  namespaceSelector: {matchLabels: {team: x}}
  ingress:
  - action: Deny
    from: [{namespaceSelector: {matchLabels: {team: y}}, podSelector: {matchLabels: {app: client}}}]
    ports: [{port: 3868, protocol: SCTP}]
"#,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let outcome = ordnet_crds::load_and_validate(std::slice::from_ref(&file));
    assert!(
        !outcome.problems.iter().any(|p| p.is_error()),
        "{:?}",
        outcome.problems
    );
    let engine = ordnet_engine::Engine::build(&outcome.objects);
    let mut denied = 0;
    for (family, fam, externals) in [
        (
            ordnet_engine::IpFamily::V4,
            "4",
            vec!["203.0.113.7", "203.0.113.200", "198.51.100.1"],
        ),
        (
            ordnet_engine::IpFamily::V6,
            "6",
            vec!["fd00:2::99", "2001:db8::1"],
        ),
    ] {
        for (proto, name) in [
            (ordnet_mapstate::Protocol::Tcp, "TCP"),
            (ordnet_mapstate::Protocol::Udp, "UDP"),
            (ordnet_mapstate::Protocol::Sctp, "SCTP"),
        ] {
            for port in [53u16, 80, 3868] {
                let port_s = port.to_string();
                let mut args = vec![
                    "matrix",
                    "-f",
                    f,
                    "--protocol",
                    name,
                    "--port",
                    &port_s,
                    "--family",
                    fam,
                    "-o",
                    "json",
                ];
                for e in &externals {
                    args.extend(["--external", e]);
                }
                let got = json(&run_ok(&args, 0));
                let ips: Vec<std::net::IpAddr> =
                    externals.iter().map(|e| e.parse().unwrap()).collect();
                let want = ordnet_engine::matrix(&engine, proto, port, &ips, family);
                assert_eq!(
                    got,
                    serde_json::to_value(&want).unwrap(),
                    "{name}/{port} IPv{fam}"
                );
                denied += want
                    .results
                    .iter()
                    .filter(|r| r.verdict == ordnet_mapstate::Verdict::Deny)
                    .count();
            }
        }
    }
    assert!(
        denied > 40,
        "only {denied} denied pairs: the policies do not bite"
    );
    // trace: the datapath's verdict, with the engine's explanation.
    let out = run_ok(
        &[
            "trace",
            "-f",
            f,
            "--from",
            "y/client",
            "--to",
            "x/dns",
            "--protocol",
            "SCTP",
            "--port",
            "3868",
        ],
        0,
    );
    assert!(out.contains(": DENY\n"), "{out}");
    assert!(out.contains("no-sctp-from-y"), "{out}");
    let out = run_ok(
        &[
            "trace",
            "-f",
            f,
            "--from",
            "fd00:2::1",
            "--to",
            "x/dns",
            "--protocol",
            "UDP",
            "--port",
            "53",
        ],
        0,
    );
    assert!(
        out.starts_with("trace UDP/53 from fd00:2::1 (y/client) to x/dns (fd00:1::1): ALLOW"),
        "{out}"
    );
    // y/v4only has no IPv6 address: no flow to an IPv6 address can be built.
    let out = run(&["trace", "-f", f, "--from", "y/v4only", "--to", "fd00:1::1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("a flow needs two addresses of one IP family"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every `$ ordnet ...` sample in docs/cli.md and the matrix in examples/qa-prod/README.md is
/// what the binary prints today (samples elided with `...` are checked up to the elision).
#[test]
fn documented_output_is_current() {
    let docs = std::fs::read_to_string(repo().join("docs/cli.md")).unwrap();
    let mut checked = 0;
    for block in docs.split("```\n").skip(1).step_by(2) {
        let Some(rest) = block.strip_prefix("$ ordnet ") else {
            continue;
        };
        let (cmd, want) = rest.split_once('\n').unwrap();
        if cmd.contains("bad.yaml") {
            continue;
        }
        let args: Vec<String> = std::iter::once(cmd.split(' ').next().unwrap().to_string())
            .chain(cmd.split(' ').skip(1).map(|a| {
                if a.starts_with("examples/") {
                    repo().join(a).display().to_string()
                } else {
                    a.to_string()
                }
            }))
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let got = run_ok(&args, 0);
        match want.find("    ...\n") {
            Some(cut) => assert!(
                got.starts_with(&want[..cut]),
                "docs/cli.md: `ordnet {cmd}` changed:\n{got}"
            ),
            None => assert_eq!(got, want, "docs/cli.md: `ordnet {cmd}` changed"),
        }
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} samples found in docs/cli.md");
    let readme = std::fs::read_to_string(repo().join("examples/qa-prod/README.md")).unwrap();
    let got = run_ok(
        &[
            "matrix",
            "-f",
            &example(),
            "--port",
            "8081",
            "--external",
            "203.0.113.7",
        ],
        0,
    );
    let table: String = got.split("\n\n").next().unwrap().to_string() + "\n";
    assert!(
        readme.contains(&format!("```\n{table}```\n")),
        "README matrix changed:\n{table}"
    );
}
