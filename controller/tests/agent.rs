//! The node agent against the fake API server (the real kube client, list/watch over HTTP),
//! with `--datapath none`: after every scripted change the MapStates the agent programmed must
//! equal what the offline engine computes for the same objects.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use ordnet::agent::{self, AgentHandle};
use ordnet_testsuite::fakeapi::{FakeApi, Faults};
use ordnet_testsuite::scenario::{self, Scenario};
use serde_json::{Value, json};

mod support;
use support::*;

const NODE: &str = "node-1";
const LIMIT: Duration = Duration::from_secs(15);

/// What the offline engine computes: this node's endpoints, the whole ipcache, and every
/// Service frontend (`--datapath none` knows no node address, so no NodePort frontends).
fn offline(api: &FakeApi) -> State {
    offline_on(api, NODE)
}

/// At 10,000 pods and 1,000 policies (the scale benchmark's generated cluster), after changes
/// of every kind (local and remote pod relabels, namespace relabels, policy edits), a local
/// pod deleted and a policy deleted, the agent's incremental state equals a from-scratch build
/// of the same objects: every key of every local endpoint as programmed, the isolation, the
/// ipcache, the Service frontends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_state_at_10k_pods_equals_a_fresh_build() {
    use ordnet_testsuite::scale::{self, Shape};
    let shape = Shape {
        pods: 10_000,
        policies: 1_000,
    };
    let node = scale::node_name(0);
    let api = FakeApi::start().await.unwrap();
    for o in shape.objects() {
        api.create(o).unwrap();
    }
    let h = start_agent_within(&api, &node, Duration::from_secs(300)).await;
    for n in 0..3 {
        for k in 0..scale::CHANGE_KINDS.len() {
            let _ = scale::change(&api, &shape, k, n);
        }
    }
    let pod = shape.pod(0);
    api.delete(
        "v1",
        "Pod",
        pod["metadata"]["namespace"].as_str().unwrap(),
        pod["metadata"]["name"].as_str().unwrap(),
    )
    .unwrap();
    api.delete(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        &scale::ns_name(0),
        "np-0",
    )
    .unwrap();
    let want = offline_on(&api, &node);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        let got = programmed(&h);
        if got.as_ref() == Some(&want) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let got = got.unwrap_or_default();
            let differ: Vec<&String> = want
                .0
                .iter()
                .filter(|(ep, v)| got.0.get(*ep) != Some(*v))
                .map(|(ep, _)| ep)
                .collect();
            panic!(
                "the incremental state differs from a fresh build: endpoints {differ:?}, ipcache equal: {}, frontends equal: {}",
                got.1 == want.1,
                got.2 == want.2
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The status writer's Lease.
fn status_lease(api: &FakeApi) -> Value {
    get(
        api,
        "coordination.k8s.io/v1",
        "Lease",
        "kube-system",
        "ordnet-status-writer",
    )
}

/// Polls until the agent's programmed state equals the offline one.
async fn converges(api: &FakeApi, h: &AgentHandle, step: &str) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let want = offline(api);
        let got = programmed(h);
        if got.as_ref() == Some(&want) {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            let got = got
                .map(|g| format!("{g:#?}"))
                .unwrap_or_else(|| "not ready".into());
            panic!(
                "{step}: the agent did not converge in {LIMIT:?}\n--- agent:\n{got}\n--- offline:\n{want:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Loads every YAML document of `dir` into the fake server.
fn load_dir(api: &FakeApi, dir: &Path) {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            if v.is_object() {
                api.create(v).unwrap();
            }
        }
    }
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Waits until the policy's status has `Accepted` = `status` at `generation` (and a message
/// containing `message`).
async fn accepted(
    api: &FakeApi,
    kind: &str,
    ns: &str,
    name: &str,
    status: &str,
    generation: i64,
    message: &str,
) {
    let ok = |o: &Value| {
        o["metadata"]["generation"] == generation
            && o["status"]["observedGeneration"] == generation
            && o["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    c["type"] == "Accepted"
                        && c["status"] == status
                        && c["observedGeneration"] == generation
                        && c["message"].as_str().is_some_and(|m| m.contains(message))
                })
            })
    };
    let what = format!("Accepted {status} at generation {generation}, message with {message:?}");
    policy_status(api, kind, ns, name, &what, ok).await;
}

async fn start_agent(api: &FakeApi) -> AgentHandle {
    start_agent_on(api, NODE).await
}

async fn start_agent_on(api: &FakeApi, node: &str) -> AgentHandle {
    start_agent_within(api, node, LIMIT).await
}

fn get(api: &FakeApi, v: &str, k: &str, ns: &str, name: &str) -> Value {
    api.get(v, k, ns, name)
        .unwrap_or_else(|| panic!("{k} {ns}/{name}"))
}

/// Makes the OrderedNetworkPolicy prod/broken valid: its first ingress rule's ports become
/// 80-90.
fn fix_prod_broken(api: &FakeApi) {
    let mut b = get(
        api,
        "ordnet.io/v1alpha1",
        "OrderedNetworkPolicy",
        "prod",
        "broken",
    );
    b["spec"]["ingress"][0]["ports"] = json!([{"port": 80, "endPort": 90}]);
    api.update(b).unwrap();
}

/// Runs the `ordnet` binary on the fake server's objects.
fn offline_cli(api: &FakeApi, args: &[&str]) -> String {
    // One file per call: the tests of this file run in parallel in one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let file = std::env::temp_dir().join(format!(
        "ordnet-agent-test-{}-{call}.yaml",
        std::process::id()
    ));
    std::fs::write(&file, manifests(api)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ordnet"))
        .args(args)
        .arg("-f")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_follows_every_change_and_equals_the_offline_engine() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let h = start_agent(&api).await;
    converges(&api, &h, "initial sync").await;
    assert!(!programmed(&h).unwrap().0.is_empty());

    let addr = h.debug_addr();
    debug_api_answers_like_the_offline_cli(&api, addr).await;
    follows_relabels_and_edits(&api, &h, addr).await;
    reports_what_it_cannot_enforce(&api, &h, addr).await;
    follows_deletes_dropped_watches_and_a_restart(&api, &h).await;
    follows_a_cluster_network_policy_and_counts(&api, &h, addr).await;
}

/// The debug API answers like the offline CLI; `ordnet matrix|trace|dump --agent ADDR` print
/// what the offline CLI prints (the first phase of
/// [`the_agent_follows_every_change_and_equals_the_offline_engine`]).
async fn debug_api_answers_like_the_offline_cli(api: &FakeApi, addr: SocketAddr) {
    let matrix = [
        "matrix",
        "--protocol",
        "TCP",
        "--port",
        "8081",
        "--external",
        "192.0.2.1",
    ];
    let (code, m) = http_get(addr, "/v1/matrix?protocol=TCP&port=8081&external=192.0.2.1").await;
    assert_eq!(code, 200, "{m}");
    let cli = offline_cli(api, &[&matrix[..], &["-o", "json"]].concat());
    assert_eq!(m, cli);
    let (code, d) = http_get(addr, "/v1/dump?pod=prod/artifacts").await;
    assert_eq!(code, 200, "{d}");
    let cli = offline_cli(api, &["dump", "--pod", "prod/artifacts", "-o", "json"]);
    assert_eq!(d, cli);
    let (code, t) = http_get(
        addr,
        "/v1/trace?from=qa/grafana&to=prod/artifacts&protocol=TCP&port=8081",
    )
    .await;
    assert_eq!(code, 200, "{t}");
    let cli = offline_cli(
        api,
        &[
            "trace",
            "--from",
            "qa/grafana",
            "--to",
            "prod/artifacts",
            "--port",
            "8081",
            "-o",
            "json",
        ],
    );
    assert_eq!(
        serde_json::from_str::<Value>(&t).unwrap(),
        serde_json::from_str::<Value>(&cli).unwrap()
    );
    let (code, _) = http_get(addr, "/v1/dump?pod=prod/nope").await;
    assert_eq!(code, 400);
    // `ordnet matrix|trace|dump --agent ADDR` print the agent's answers, rendered by the
    // offline renderer: in every output format they equal the offline output byte for byte.
    let trace = [
        "trace",
        "--from",
        "qa/grafana",
        "--to",
        "10.244.2.10",
        "--port",
        "8081",
    ];
    let trace_denied = [
        "trace",
        "--from",
        "qa/tester",
        "--to",
        "prod/api",
        "--port",
        "8081",
    ];
    let dump = ["dump", "--pod", "prod/artifacts", "--direction", "ingress"];
    let dump_both = ["dump", "--pod", "prod/api"];
    let mut runs: Vec<Vec<&str>> = Vec::new();
    for (cmd, formats) in [
        (&matrix[..], &["table", "json"][..]),
        (&trace[..], &["text", "json"][..]),
        (&trace_denied[..], &["text", "json"][..]),
        (&dump[..], &["tree", "json", "dot"][..]),
        (&dump_both[..], &["tree", "json", "dot"][..]),
    ] {
        for f in formats {
            let mut args = cmd.to_vec();
            args.extend(["-o", f]);
            runs.push(args);
        }
        // The default format too.
        runs.push(cmd.to_vec());
    }
    for args in runs {
        let shown = args.join(" ");
        let offline = offline_cli(api, &args);
        assert_eq!(
            agent_ok(addr, &args).await,
            offline,
            "ordnet {shown} --agent"
        );
        assert!(!offline.is_empty());
    }
    // Colour is the client's decision (its terminal): the API renders it when asked.
    let (code, coloured) = http_get(
        addr,
        "/v1/matrix?protocol=TCP&port=8081&output=table&color=1",
    )
    .await;
    assert_eq!(code, 200, "{coloured}");
    assert!(coloured.contains("\x1b[1;31mX\x1b[0m"), "{coloured}");
    let (code, bad) = http_get(addr, "/v1/dump?pod=prod/api&output=svg").await;
    assert_eq!(
        (code, bad.trim()),
        (400, "output: \"svg\" is not tree, json or dot")
    );
    let out = agent_cli(addr, &["dump", "--pod", "prod/nope", "-o", "json"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("prod/nope"));
}

/// The Lease holder's statuses; pod and namespace relabels, a priority edit, a remote pod.
async fn follows_relabels_and_edits(api: &FakeApi, h: &AgentHandle, addr: SocketAddr) {
    // One agent holds the Lease and writes every ordered policy's status.
    assert!(agent::wait_until(LIMIT, || h.state.is_status_writer()).await);
    let lease = status_lease(api);
    assert_eq!(lease["spec"]["holderIdentity"], NODE);
    for name in ["qa-must-not-reach-prod", "grafana-reads-artifacts"] {
        accepted(api, "ClusterOrderedNetworkPolicy", "", name, "True", 1, "").await;
    }

    // Relabel a pod.
    let mut p = get(api, "v1", "Pod", "qa", "grafana");
    p["metadata"]["labels"]["app"] = json!("tester");
    api.update(p).unwrap();
    converges(api, h, "relabel pod").await;

    // Relabel a namespace: qa is no longer qa for the guardrail.
    let mut n = get(api, "v1", "Namespace", "", "qa");
    n["metadata"]["labels"]["env"] = json!("staging");
    api.update(n).unwrap();
    converges(api, h, "relabel namespace").await;
    let mut n = get(api, "v1", "Namespace", "", "qa");
    n["metadata"]["labels"]["env"] = json!("qa");
    api.update(n).unwrap();
    converges(api, h, "relabel namespace back").await;

    // Edit a priority: the exception loses against the guardrail.
    let mut c = get(
        api,
        "ordnet.io/v1alpha1",
        "ClusterOrderedNetworkPolicy",
        "",
        "grafana-reads-artifacts",
    );
    c["spec"]["priority"] = json!(-5);
    api.update(c).unwrap();
    converges(api, h, "edit priority").await;
    accepted(
        api,
        "ClusterOrderedNetworkPolicy",
        "",
        "grafana-reads-artifacts",
        "True",
        2,
        "",
    )
    .await;

    // A pod on another node only feeds the ipcache.
    api.create(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "qa", "name": "remote", "labels": {"app": "tester"}},
        "spec": {"nodeName": "node-2", "containers": [{"name": "c", "image": "i"}]},
        "status": {"podIP": "10.244.9.9"}}))
        .unwrap();
    converges(api, h, "remote pod").await;
    let (_, ipcache, _, _) = programmed(h).unwrap();
    assert!(ipcache.contains_key(&"10.244.9.9/32".parse::<IpNet>().unwrap()));
    assert!(!programmed(h).unwrap().0.contains_key("qa/remote"));
    let (code, msg) = http_get(addr, "/v1/trace?from=qa/remote&to=prod/artifacts").await;
    assert_eq!(code, 400);
    assert!(msg.contains("not an endpoint of this node"), "{msg}");
}

/// A policy with a rule failing closed and a policy not enforced at all: reported (problems,
/// statuses, Events), the rest enforced.
async fn reports_what_it_cannot_enforce(api: &FakeApi, h: &AgentHandle, addr: SocketAddr) {
    // A policy with a rule the engine cannot enforce as written is enforced with that rule
    // failing closed (an Allow rule matches nothing), and reported; a policy the engine cannot
    // use at all (an invalid subject selector) is not enforced, and reported. Everything else
    // keeps working.
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": "prod", "name": "unusable"},
        "spec": {"priority": 5, "podSelector": {"matchExpressions": [{"key": "app",
            "operator": "Equals", "values": ["db"]}]}, "egress": [{"action": "Deny"}]}}),
    )
    .unwrap();
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": "prod", "name": "broken"},
        "spec": {"priority": 5, "podSelector": {}, "ingress": [{"action": "Allow",
            "from": [{"ipBlock": {"cidr": "not-a-cidr"}}]}]}}),
    )
    .unwrap();
    let mut p = get(api, "v1", "Pod", "prod", "db");
    p["metadata"]["labels"]["tier"] = json!("data");
    api.update(p).unwrap();
    converges(api, h, "invalid object").await;
    assert!(
        agent::wait_until(LIMIT, || h
            .state
            .problems()
            .iter()
            .any(|p| p.name == "broken"))
        .await
    );
    let (_, problems) = http_get(addr, "/v1/problems").await;
    let problems: Value = serde_json::from_str(&problems).unwrap();
    let problem = |name: &str| {
        problems
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no problem of {name}: {problems}"))
            .clone()
    };
    let broken = problem("broken");
    assert_eq!(broken["enforced"], "partly", "{broken}");
    assert!(
        broken["failedClosedRules"][0]
            .as_str()
            .is_some_and(|r| r.starts_with(
                "spec.ingress[0] (Allow) matches nothing: spec.ingress[0].from[0].ipBlock.cidr"
            )),
        "{broken}"
    );
    let unusable = problem("unusable");
    assert_eq!(unusable["enforced"], "no", "{unusable}");
    assert!(unusable.to_string().contains("operator"), "{unusable}");
    accepted(
        api,
        "OrderedNetworkPolicy",
        "prod",
        "broken",
        "False",
        1,
        "spec.ingress[0] (Allow): spec.ingress[0].from[0].ipBlock.cidr",
    )
    .await;
    accepted(
        api,
        "OrderedNetworkPolicy",
        "prod",
        "unusable",
        "False",
        1,
        "not enforced: spec.podSelector.matchExpressions[0].operator",
    )
    .await;
    for (name, reason, note) in [
        ("broken", "RulesFailedClosed", "cidr"),
        ("unusable", "InvalidObject", "not enforced"),
    ] {
        assert!(
            agent::wait_until(LIMIT, || api.events().iter().any(|e| e["reason"] == reason
                && e["regarding"]["name"] == name
                && e["type"] == "Warning"
                && e["note"].as_str().is_some_and(|n| n.contains(note))))
            .await,
            "{name}: {:#?}",
            api.events()
        );
    }
}

/// Deletes (problems cleared), dropped watches, an API server restart with changes meanwhile.
async fn follows_deletes_dropped_watches_and_a_restart(api: &FakeApi, h: &AgentHandle) {
    // Delete a policy.
    api.delete(
        "ordnet.io/v1alpha1",
        "ClusterOrderedNetworkPolicy",
        "",
        "qa-must-not-reach-prod",
    )
    .unwrap();
    converges(api, h, "delete policy").await;
    // Deleting the objects with problems clears them.
    for name in ["broken", "unusable"] {
        api.delete("ordnet.io/v1alpha1", "OrderedNetworkPolicy", "prod", name)
            .unwrap();
    }
    assert!(agent::wait_until(LIMIT, || h.state.problems().is_empty()).await);

    // Dropped watches resume.
    api.drop_watches();
    let mut p = get(api, "v1", "Pod", "qa", "tester");
    p["metadata"]["labels"]["app"] = json!("grafana");
    api.update(p).unwrap();
    converges(api, h, "drop watches").await;

    // An API server restart: history gone, every watch gets 410 and re-lists; changes made
    // meanwhile (including a delete the agent never sees as an event) converge.
    let relists =
        |h: &AgentHandle| -> u64 { h.state.watch.all().iter().map(|(_, k)| k.relists).sum() };
    let before = relists(h);
    api.restart();
    api.delete("v1", "Pod", "prod", "api").unwrap();
    let mut n = get(api, "v1", "Namespace", "", "prod");
    n["metadata"]["labels"]["tier"] = json!("gold");
    api.update(n).unwrap();
    converges(api, h, "restart and re-list").await;
    assert!(agent::wait_until(LIMIT, || relists(h) >= before + 5).await);
    api.create(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "qa", "name": "deny-all"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}),
    )
    .unwrap();
    converges(api, h, "after the re-list").await;
}

/// An upstream ClusterNetworkPolicy and its status; the metrics, health and RBAC at the end.
async fn follows_a_cluster_network_policy_and_counts(
    api: &FakeApi,
    h: &AgentHandle,
    addr: SocketAddr,
) {
    // An upstream ClusterNetworkPolicy: a Baseline deny into prod under prod's own policies
    // (the pods they isolate are decided before it); its status is written.
    api.create(json!({
        "apiVersion": "policy.networking.k8s.io/v1beta1",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": "prod-baseline"},
        "spec": {
            "tier": "Baseline",
            "priority": 100,
            "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "prod"}}},
            "ingress": [{"name": "deny-the-rest", "action": "Deny", "from": [{"namespaces": {}}]}]
        }
    }))
    .unwrap();
    converges(api, h, "a ClusterNetworkPolicy").await;
    assert!(
        agent::wait_until(LIMIT, || cnp_accepted(api, "prod-baseline")
            .is_some_and(|c| c.0 == "True"))
        .await
    );

    let (code, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    for want in [
        "ordnet_ready 1",
        "ordnet_endpoints 4",
        "ordnet_invalid_objects 0",
        "ordnet_change_latency_seconds_count",
        "ordnet_compile_duration_seconds_bucket{le=\"+Inf\"}",
        "ordnet_watch_stale_seconds{kind=\"Pod\"} 0.0\n",
        "ordnet_build_info{version=\"",
        "process_resident_memory_bytes ",
        "ordnet_watch_relists_total{kind=\"NetworkPolicy\"} 1\n",
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    assert!(h.state.metrics.object_changes.get() >= 10);
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert_least_privilege(api, "kube-system");
}

/// Runs `ordnet ARGS --agent ADDR`.
async fn agent_cli(addr: SocketAddr, args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ordnet"))
            .args(&args)
            .args(["--agent", &addr.to_string()])
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// Runs `ordnet ARGS --agent ADDR`, which must succeed; its stdout.
async fn agent_ok(addr: SocketAddr, args: &[&str]) -> String {
    let out = agent_cli(addr, args).await;
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The agent's JSON matrix on port 8081 with one external address.
async fn agent_matrix(addr: SocketAddr, external: &str) -> Value {
    let args = [
        "matrix",
        "--port",
        "8081",
        "--external",
        external,
        "-o",
        "json",
    ];
    serde_json::from_str(&agent_ok(addr, &args).await).unwrap()
}

/// The verdict of one pair in a JSON matrix.
fn cell(m: &Value, from: &str, to: &str) -> String {
    m["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["from"] == from && r["to"] == to)
        .unwrap_or_else(|| panic!("no {from} -> {to} in {m}"))["verdict"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The ends of a JSON matrix (its sources, in order).
fn ends(m: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in m["results"].as_array().unwrap() {
        let from = r["from"].as_str().unwrap().to_string();
        if !out.contains(&from) {
            out.push(from);
        }
    }
    out
}

/// Two nodes: each agent answers for its own endpoints only, from its own datapath, which
/// judges only the side of a flow that is local to it (the other node enforces the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_agent_answers_for_its_own_endpoints_only() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    // The prod pods run on node-2; the qa pods (grafana 10.244.1.10, tester 10.244.1.11)
    // stay on node-1. Every policy of the example is an ingress policy of prod.
    for name in ["api", "artifacts", "db"] {
        let mut p = get(&api, "v1", "Pod", "prod", name);
        p["spec"]["nodeName"] = json!("node-2");
        api.update(p).unwrap();
    }
    let qa_node = start_agent_on(&api, "node-1").await;
    let prod_node = start_agent_on(&api, "node-2").await;
    let offline_m: Value = serde_json::from_str(&offline_cli(
        &api,
        &["matrix", "--port", "8081", "-o", "json"],
    ))
    .unwrap();
    assert_eq!(cell(&offline_m, "qa/tester", "prod/api"), "deny");
    assert_eq!(cell(&offline_m, "qa/grafana", "prod/artifacts"), "allow");

    // node-1: its two pods, and prod/api by address. Its datapath judges the qa pods' egress
    // (nothing restricts it); prod/api's ingress is node-2's to judge.
    let m = agent_matrix(qa_node.debug_addr(), "10.244.2.11").await;
    assert_eq!(ends(&m), ["qa/grafana", "qa/tester", "10.244.2.11"]);
    assert_eq!(cell(&m, "qa/tester", "10.244.2.11"), "allow");
    assert_eq!(cell(&m, "qa/grafana", "qa/tester"), "allow");

    // node-2: its three pods, and qa/tester by address: the ingress side is local here, so
    // the verdicts are the offline ones; so are those between its own pods.
    let m = agent_matrix(prod_node.debug_addr(), "10.244.1.11").await;
    assert_eq!(
        ends(&m),
        ["prod/api", "prod/artifacts", "prod/db", "10.244.1.11"]
    );
    assert_eq!(cell(&m, "10.244.1.11", "prod/api"), "deny");
    for from in ["prod/api", "prod/artifacts", "prod/db"] {
        for to in ["prod/api", "prod/artifacts", "prod/db"] {
            assert_eq!(
                cell(&m, from, to),
                cell(&offline_m, from, to),
                "{from} -> {to}"
            );
        }
    }

    // A flow with one end outside the cluster and the other local is judged the same way
    // offline and by the agent: byte for byte.
    for format in ["text", "json"] {
        let args = [
            "trace",
            "--from",
            "192.0.2.1",
            "--to",
            "prod/artifacts",
            "--port",
            "8081",
            "-o",
            format,
        ];
        assert_eq!(
            agent_ok(prod_node.debug_addr(), &args).await,
            offline_cli(&api, &args)
        );
    }

    // A pod of another node, by name or by address, is refused: ask the agent of its node.
    for (node, from, to) in [
        (&prod_node, "qa/tester", "prod/api"),
        (&prod_node, "10.244.1.11", "prod/api"),
        (&qa_node, "qa/tester", "prod/api"),
    ] {
        let out = agent_cli(node.debug_addr(), &["trace", "--from", from, "--to", to]).await;
        assert_eq!(out.status.code(), Some(1), "{from} -> {to}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("ask the agent of its node"), "{err}");
    }
    let out = agent_cli(qa_node.debug_addr(), &["dump", "--pod", "prod/api"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an endpoint of this node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_programmed_before_every_initial_list() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    // Compaction before the agent starts is harmless: its first watches start at the lists.
    api.compact();
    let h = start_agent(&api).await;
    // Ready means programmed from complete lists: the first programmed state is the full one.
    let (canon, _, _, _) = programmed(&h).unwrap();
    assert_eq!(canon, offline(&api).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenarios_converge() {
    let files = scenario::conformance_files();
    assert!(files.len() > 50);
    for f in files {
        let sc = Scenario::load(&f).unwrap_or_else(|e| panic!("{e}"));
        let api = FakeApi::start().await.unwrap();
        load_scenario(&api, &sc);
        let h = start_agent(&api).await;
        converges(&api, &h, &f.display().to_string()).await;
    }
}

/// Creates a scenario's objects in the fake server, every pod on this agent's node.
fn load_scenario(api: &FakeApi, sc: &Scenario) {
    for o in &sc.objects {
        let mut o: Value = serde_json::to_value(o).unwrap();
        if o["kind"] == "Pod" && o["spec"]["nodeName"].is_null() {
            o["spec"]["nodeName"] = json!(NODE);
        }
        api.create(o).unwrap();
    }
}

/// Every expectation of a scenario, checked on the agent's own matrix (`--agent`).
async fn agent_matches_scenario(addr: SocketAddr, sc: &Scenario) {
    let pods = sc.pods(4);
    for probe in &sc.expect {
        let port = probe.port.to_string();
        let args = [
            "matrix",
            "--protocol",
            probe.protocol.as_str(),
            "--port",
            &port,
            "-o",
            "json",
        ];
        let m: Value = serde_json::from_str(&agent_ok(addr, &args).await).unwrap();
        let mut dests = pods.clone();
        dests.extend(sc.services(probe.protocol.as_str(), probe.port, 4));
        for a in &pods {
            for b in &dests {
                let want = probe.verdict(a, b).unwrap();
                assert_eq!(
                    cell(&m, a, b),
                    want,
                    "{}: {a} -> {b} {}/{port}",
                    sc.name,
                    probe.protocol.as_str()
                );
            }
        }
    }
}

/// "Allow X, then Deny X" and "Deny X, then Allow X" (scenarios onp-13 and onp-14) through the
/// agent: the first rule decides, and the repeat is valid, enforced and reported as shadowed by
/// the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_rule_the_first_wins_and_the_repeat_is_reported_shadowed() {
    let cases = [
        (
            "onp-13-allow-then-deny-same-traffic",
            ("ClusterOrderedNetworkPolicy", "", "allow-then-deny-y"),
            "Allow",
        ),
        (
            "onp-14-deny-then-allow-same-traffic",
            ("OrderedNetworkPolicy", "x", "deny-then-allow"),
            "Deny",
        ),
    ];
    for (name, (kind, ns, policy), first) in cases {
        let sc = Scenario::load(&scenario::find(name)).unwrap();
        let api = FakeApi::start().await.unwrap();
        load_scenario(&api, &sc);
        let h = start_agent(&api).await;
        converges(&api, &h, name).await;
        agent_matches_scenario(h.debug_addr(), &sc).await;
        policy_status(
            &api,
            kind,
            ns,
            policy,
            "accepted, ingress[1] shadowed",
            |o| {
                condition(o, "Accepted", 1).is_some_and(|c| c.0 == "True")
                    && condition(o, "RulesShadowed", 1).is_some_and(|c| c.0 == "True")
                    && shadowed_rules(o).len() == 1
                    && shadowed_rules(o)[0]["direction"] == "Ingress"
                    && shadowed_rules(o)[0]["index"] == 1
                    && shadowed_rules(o)[0]["shadowedBy"]
                        .as_array()
                        .is_some_and(|by| {
                            by.iter().any(|r| {
                                r["name"] == policy && r["index"] == 0 && r["action"] == first
                            })
                        })
            },
        )
        .await;
    }
}

/// A Service's verdict follows its backends through the agent: svc-05i, then the selector
/// moves to another pod (svc-05), then a backend pod is deleted and the Service removed. After
/// each change the programmed frontends equal the offline engine's and the agent's matrix
/// (Service columns included) equals the scenario.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_follow_their_backends() {
    let initial = Scenario::load(&scenario::find(
        "svc-05i-service-backend-set-changes-initial",
    ))
    .unwrap();
    let fin = Scenario::load(&scenario::find("svc-05-service-backend-set-changes")).unwrap();
    let api = FakeApi::start().await.unwrap();
    load_scenario(&api, &initial);
    let h = start_agent(&api).await;
    converges(&api, &h, "svc-05i").await;
    assert!(
        !programmed(&h).unwrap().2.is_empty(),
        "no frontend programmed"
    );
    agent_matches_scenario(h.debug_addr(), &initial).await;

    let mut svc = api.get("v1", "Service", "y", "api").unwrap();
    svc["spec"]["selector"] = json!({"pod": "c"});
    api.update(svc).unwrap();
    converges(&api, &h, "svc-05 (selector changed)").await;
    agent_matches_scenario(h.debug_addr(), &fin).await;

    // With no backend left the frontend stays (kube-proxy rejects such traffic itself); once the
    // Service is deleted, so is its frontend.
    api.delete("v1", "Pod", "y", "c").unwrap();
    converges(&api, &h, "backend pod deleted").await;
    api.delete("v1", "Service", "y", "api").unwrap();
    converges(&api, &h, "Service deleted").await;
    assert!(
        programmed(&h).unwrap().2.is_empty(),
        "frontends left behind"
    );
}

/// Rules the engine cannot enforce as written fail closed in the agent exactly as in `ordnet
/// matrix` (testsuite/data/invalid/rules-fail-closed.yaml): the unenforceable Deny denies, the
/// unenforceable Allow allows nothing, the rest of each object is enforced, and the status
/// names the rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unenforceable_rules_fail_closed() {
    let sc = Scenario::load(&scenario::path("invalid", "rules-fail-closed")).unwrap();
    let api = FakeApi::start().await.unwrap();
    load_scenario(&api, &sc);
    let h = start_agent(&api).await;
    converges(&api, &h, "fail closed").await;
    agent_matches_scenario(h.debug_addr(), &sc).await;
    for (kind, ns, name, rule) in [
        (
            "OrderedNetworkPolicy",
            "x",
            "allow-broken-port",
            json!({"direction": "Ingress", "index": 0, "action": "Allow", "effect": "MatchesNothing"}),
        ),
        (
            "ClusterOrderedNetworkPolicy",
            "",
            "deny-broken-cidr",
            json!({"direction": "Egress", "index": 1, "action": "Deny", "effect": "DeniesAll"}),
        ),
    ] {
        policy_status(&api, kind, ns, name, "rules failed closed", |o| {
            let failed = o["status"]["failedClosedRules"].as_array();
            condition(o, "Accepted", 1)
                .is_some_and(|c| c.0 == "False" && c.1 == "RulesFailedClosed")
                && failed.is_some_and(|f| {
                    f.len() == 1
                        && ["direction", "index", "action", "effect"]
                            .iter()
                            .all(|k| f[0][k] == rule[k])
                })
                && o["status"]["subject"] != "not enforced"
        })
        .await;
    }
}

/// The `Accepted` condition of a ClusterNetworkPolicy (upstream's status: conditions only):
/// (status, reason, message).
fn cnp_accepted(api: &FakeApi, name: &str) -> Option<(String, String, String)> {
    let o = api.get(
        "policy.networking.k8s.io/v1beta1",
        "ClusterNetworkPolicy",
        "",
        name,
    )?;
    let generation = o["metadata"]["generation"].clone();
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Accepted" && c["observedGeneration"] == generation)
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
            (s("status"), s("reason"), s("message"))
        })
}

/// The upstream ClusterNetworkPolicy through the agent (cnp-admin-egress-node-peers: Admin
/// Accept, Pass and Deny rules with `nodes`, `pods` and `networks` peers):
/// - while the API server does not serve the kind (its CRD is not installed) the agent gets
///   ready and enforces everything else;
/// - once it is served, the agent finds it (within its 10 s poll) and converges to the offline
///   engine, its matrix equals the scenario, and the status says `Accepted`;
/// - a Node relabelled out of the `nodes` selector is re-resolved: its address is denied by the
///   `networks` rule instead of accepted by the `nodes` one;
/// - a `domainNames` rule fails closed and the status says so; the status holds nothing but
///   conditions (upstream's schema).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_network_policies_through_the_agent() {
    let sc = Scenario::load(&scenario::find("cnp-admin-egress-node-peers")).unwrap();
    let api = FakeApi::start().await.unwrap();
    api.set_faults(Faults {
        absent: vec!["clusternetworkpolicies"],
        ..Faults::default()
    });
    let (cnps, rest): (Vec<Value>, Vec<Value>) = sc
        .objects
        .iter()
        .map(|o| serde_json::to_value(o).unwrap())
        .partition(|o| o["kind"] == "ClusterNetworkPolicy");
    assert!(!cnps.is_empty());
    for mut o in rest {
        if o["kind"] == "Pod" && o["spec"]["nodeName"].is_null() {
            o["spec"]["nodeName"] = json!(NODE);
        }
        api.create(o).unwrap();
    }
    let h = start_agent(&api).await;
    converges(&api, &h, "without the ClusterNetworkPolicy CRD").await;

    api.set_faults(Faults::default());
    for o in cnps {
        api.create(o).unwrap();
    }
    converges(&api, &h, "the CRD installed").await;
    agent_matches_scenario(h.debug_addr(), &sc).await;
    let name = "node-and-cidr-as-peers-example";
    assert!(
        agent::wait_until(LIMIT, || cnp_accepted(&api, name)
            .is_some_and(|c| c.0 == "True" && c.1 == "Valid"))
        .await,
        "{:#?}",
        api.get(
            "policy.networking.k8s.io/v1beta1",
            "ClusterNetworkPolicy",
            "",
            name
        )
    );
    let status = api
        .get(
            "policy.networking.k8s.io/v1beta1",
            "ClusterNetworkPolicy",
            "",
            name,
        )
        .unwrap()["status"]
        .clone();
    assert_eq!(
        status.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["conditions"],
        "only upstream's status fields: {status}"
    );

    let probe = |m: &Value| cell(m, "gryffindor/harry-potter-0", "172.18.0.3");
    let args = [
        "matrix",
        "--port",
        "36363",
        "--external",
        "172.18.0.3",
        "-o",
        "json",
    ];
    let before: Value = serde_json::from_str(&agent_ok(h.debug_addr(), &args).await).unwrap();
    assert_eq!(probe(&before), "allow", "the nodes peer accepts TCP 36363");
    let mut node = api.get("v1", "Node", "", "kind-worker2").unwrap();
    node["metadata"]["labels"]["kubernetes.io/os"] = json!("windows");
    api.update(node).unwrap();
    converges(&api, &h, "a Node relabelled").await;
    let after: Value = serde_json::from_str(&agent_ok(h.debug_addr(), &args).await).unwrap();
    assert_eq!(
        probe(&after),
        "deny",
        "the relabelled Node is no longer a nodes peer; 0.0.0.0/0 denies it"
    );

    api.create(json!({
        "apiVersion": "policy.networking.k8s.io/v1beta1",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": "dns-names"},
        "spec": {
            "tier": "Admin",
            "priority": 5,
            "subject": {"namespaces": {"matchLabels": {"conformance-house": "ravenclaw"}}},
            "egress": [{"name": "no-example", "action": "Deny",
                        "to": [{"domainNames": ["www.example.com"]}]}]
        }
    }))
    .unwrap();
    converges(&api, &h, "a domainNames rule").await;
    assert!(
        agent::wait_until(LIMIT, || cnp_accepted(&api, "dns-names").is_some_and(|c| {
            c.0 == "False"
                && c.1 == "RulesFailedClosed"
                && c.2.contains("domainNames")
                && c.2.contains("denies all egress")
        }))
        .await,
        "{:#?}",
        cnp_accepted(&api, "dns-names")
    );
    let m: Value = serde_json::from_str(
        &agent_ok(h.debug_addr(), &["matrix", "--port", "80", "-o", "json"]).await,
    )
    .unwrap();
    assert_eq!(
        cell(
            &m,
            "ravenclaw/luna-lovegood-0",
            "hufflepuff/cedric-diggory-0"
        ),
        "deny",
        "the Deny with domainNames denies all egress of its subject"
    );
    assert_rbac(&api, "kube-system", false);
}

/// (group, resource or resource/subresource, verb, namespace) of one API request.
fn rbac_request(method: &str, uri: &str) -> (String, String, String, Option<String>) {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", _, rest @ ..] => (String::new(), rest.to_vec()),
        ["apis", g, _, rest @ ..] => (g.to_string(), rest.to_vec()),
        _ => panic!("unexpected path {uri}"),
    };
    let (ns, rest) = match rest.as_slice() {
        ["namespaces", ns, tail @ ..] if !tail.is_empty() => (Some(ns.to_string()), tail.to_vec()),
        _ => (None, rest),
    };
    let resource = match rest.as_slice() {
        [r] | [r, _] => r.to_string(),
        [r, _, sub] => format!("{r}/{sub}"),
        _ => panic!("unexpected path {uri}"),
    };
    let named = rest.len() >= 2;
    let verb = match method {
        "GET" if query.contains("watch=true") => "watch",
        "GET" if named => "get",
        "GET" => "list",
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" => "delete",
        other => panic!("unexpected method {other}"),
    };
    (group, resource, verb.to_string(), ns)
}

fn rule_allows(rule: &Value, group: &str, resource: &str, verb: &str) -> bool {
    let has = |field: &str, v: &str| {
        rule[field]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == v || x == "*"))
    };
    has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
}

/// Every request the agent made is allowed by deploy/rbac.yaml (the ClusterRole, or the
/// Role in the agent's own namespace), and the roles grant nothing the agent does not use.
fn assert_least_privilege(api: &FakeApi, agent_namespace: &str) {
    assert_rbac(api, agent_namespace, true)
}

/// Every request the agent made is allowed by deploy/rbac.yaml; with `all_used`, every grant
/// there was also used (tests that exercise every kind of request).
fn assert_rbac(api: &FakeApi, agent_namespace: &str, all_used: bool) {
    let text = std::fs::read_to_string(repo().join("deploy/rbac.yaml")).unwrap();
    let docs: Vec<Value> = yaml_serde::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let rules = |kind: &str| -> Vec<Value> {
        docs.iter()
            .filter(|d| d["kind"] == kind)
            .flat_map(|d| d["rules"].as_array().unwrap().clone())
            .collect()
    };
    let (cluster, ns_role) = (rules("ClusterRole"), rules("Role"));
    let mut used = std::collections::BTreeSet::new();
    for r in api.requests() {
        let (group, resource, verb, ns) = rbac_request(&r.method, &r.uri);
        let by_cluster = cluster
            .iter()
            .position(|x| rule_allows(x, &group, &resource, &verb));
        let by_role = (ns.as_deref() == Some(agent_namespace))
            .then(|| {
                ns_role
                    .iter()
                    .position(|x| rule_allows(x, &group, &resource, &verb))
            })
            .flatten();
        assert!(
            by_cluster.is_some() || by_role.is_some(),
            "{} {} ({verb} {group}/{resource}) is not allowed by deploy/rbac.yaml",
            r.method,
            r.uri
        );
        used.insert((group, resource, verb));
    }
    if !all_used {
        return;
    }
    // Nothing granted that is never used.
    for rule in cluster.iter().chain(&ns_role) {
        for g in rule["apiGroups"].as_array().unwrap() {
            for res in rule["resources"].as_array().unwrap() {
                for v in rule["verbs"].as_array().unwrap() {
                    let (g, res, v) = (
                        g.as_str().unwrap(),
                        res.as_str().unwrap(),
                        v.as_str().unwrap(),
                    );
                    // The kube Recorder patches an Event only when the same event repeats.
                    if (g, res, v) == ("events.k8s.io", "events", "patch") {
                        continue;
                    }
                    // Only an agent whose datapath counts per rule (the kernel's) writes its
                    // traffic report; server-side apply creates it with the patch verb, which
                    // the API server authorizes as create as well (agent_bpf.rs writes one).
                    if g.is_empty() && res == "configmaps" && ["create", "patch"].contains(&v) {
                        continue;
                    }
                    assert!(
                        used.contains(&(g.to_string(), res.to_string(), v.to_string())),
                        "deploy/rbac.yaml grants {v} on {g}/{res}, which the agent never used"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_agent_writes_status() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let a = start_agent(&api).await;
    let b = start_agent_on(&api, "node-2").await;
    assert!(
        agent::wait_until(LIMIT, || a.state.is_status_writer()
            || b.state.is_status_writer())
        .await
    );
    // Over many renewal rounds (100 ms each) the two never both hold the Lease.
    for _ in 0..100 {
        assert!(!(a.state.is_status_writer() && b.state.is_status_writer()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lease = status_lease(&api);
    assert_eq!(lease["spec"]["leaseTransitions"], 0);

    // The writer stops (SIGTERM): it releases the Lease and the other agent takes it at its
    // next try, long before the Lease (15 s) would have expired.
    let (mut writer, other) = if a.state.is_status_writer() {
        (a, b)
    } else {
        (b, a)
    };
    writer.stop(Duration::from_secs(2)).await;
    assert!(!writer.state.is_status_writer());
    assert!(
        agent::wait_until(Duration::from_secs(5), || other.state.is_status_writer()).await,
        "the other agent did not take the released Lease"
    );
    let lease = status_lease(&api);
    assert_eq!(lease["spec"]["holderIdentity"], other.state.node.as_str());
    assert_eq!(lease["spec"]["leaseTransitions"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_from_a_kubeconfig_and_exits_0_on_sigterm() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let dir = std::env::temp_dir().join(format!("ordnet-agent-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig_yaml()).unwrap();
    let free = || {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("127.0.0.1:{port}")
    };
    let (debug, metrics_at) = (free(), free());
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_ordnet"))
        .args([
            "agent",
            "--node",
            NODE,
            "--datapath",
            "none",
            "--debug-addr",
            &debug,
            "--log-format",
            "json",
            "--metrics-addr",
            &metrics_at,
            "--cni-socket",
            "none",
        ])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Kills the agent if the test fails before it exits.
    struct KillOnDrop(u32, bool);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if !self.1 {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &self.0.to_string()])
                    .status();
            }
        }
    }
    let mut guard = KillOnDrop(child.id(), false);
    let addr: SocketAddr = debug.parse().unwrap();
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let ready = match tokio::net::TcpStream::connect(addr).await {
            Ok(_) => http_get(addr, "/readyz").await.0 == 200,
            Err(_) => false,
        };
        if ready {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the agent binary was not ready in {LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, m) = http_get(addr, "/v1/matrix?port=8081").await;
    assert_eq!(
        m,
        offline_cli(&api, &["matrix", "--port", "8081", "-o", "json"])
    );
    let scraped = http_get(metrics_at.parse().unwrap(), "/metrics").await;
    assert_eq!(
        http_get(metrics_at.parse().unwrap(), "/v1/problems")
            .await
            .0,
        404
    );
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    guard.1 = true;
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // `--log-format json`: every line one JSON object with a level and a message.
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let started = lines
        .iter()
        .find(|l| l["level"] == "INFO" && l["message"] == "agent started" && l["node"] == NODE)
        .unwrap_or_else(|| panic!("no `agent started` line: {stderr}"));
    // The metrics listener (--metrics-addr) served while the agent ran.
    assert_eq!(started["metrics"], format!("http://{metrics_at}/metrics"));
    assert_eq!(scraped.0, 200);
    assert!(
        scraped.1.contains("ordnet_build_info{version=\""),
        "{}",
        scraped.1
    );
}

/// Waits until `check` holds for the stored policy; panics with the object otherwise.
async fn policy_status(
    api: &FakeApi,
    kind: &str,
    ns: &str,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) {
    let found = agent::wait_until(LIMIT, || {
        api.get("ordnet.io/v1alpha1", kind, ns, name)
            .is_some_and(|o| check(&o))
    })
    .await;
    assert!(
        found,
        "{kind} {ns}/{name}: {what}: {:#?}",
        api.get("ordnet.io/v1alpha1", kind, ns, name)
    );
}

/// The condition of type `type_` at `generation`: (status, reason, message).
fn condition(o: &Value, type_: &str, generation: i64) -> Option<(String, String, String)> {
    if o["status"]["observedGeneration"] != generation {
        return None;
    }
    o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_ && c["observedGeneration"] == generation)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
}

fn shadowed_rules(o: &Value) -> Vec<Value> {
    o["status"]["shadowedRules"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The qa-prod example and one agent, once it holds the status writer Lease.
async fn status_writer_on_qa_prod() -> (FakeApi, AgentHandle) {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let h = start_agent(&api).await;
    assert!(agent::wait_until(LIMIT, || h.state.is_status_writer()).await);
    (api, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadowed_rules_are_reported_in_status_and_events() {
    let (api, _agent) = status_writer_on_qa_prod().await;
    let conp = "ClusterOrderedNetworkPolicy";
    let onp = "OrderedNetworkPolicy";
    let guard = "qa-must-not-reach-prod";
    // Nothing in the example is shadowed.
    policy_status(&api, conp, "", guard, "not shadowed", |o| {
        condition(o, "Accepted", 1).is_some_and(|c| c.0 == "True")
            && condition(o, "RulesShadowed", 1)
                .is_some_and(|c| c.0 == "False" && c.1 == "NotShadowed")
            && shadowed_rules(o).is_empty()
    })
    .await;

    // prod admits qa on port 80 at priority 50: the guardrail (-10) denies every qa source for
    // every prod pod first, so the rule can never decide a packet.
    api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": onp,
        "metadata": {"namespace": "prod", "name": "qa-web"},
        "spec": {"priority": 50, "podSelector": {}, "ingress": [
            {"action": "Deny", "from": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]},
            {"action": "Allow", "from": [{"namespaceSelector": {"matchLabels": {"env": "qa"}}}],
             "ports": [{"port": 80}]}]}}))
        .unwrap();
    let expected = json!([{
        "direction": "Ingress",
        "index": 1,
        "shadowedBy": [{"kind": conp, "name": guard, "index": 0, "priority": -10,
                        "action": "Deny"}],
    }]);
    let shadowed_at = |generation: i64| {
        let expected = expected.clone();
        move |o: &Value| {
            let mut rules = shadowed_rules(o);
            for r in &mut rules {
                if let Some(m) = r.as_object_mut() {
                    m.remove("message");
                }
            }
            condition(o, "Accepted", generation).is_some_and(|c| c.0 == "True")
                && condition(o, "RulesShadowed", generation).is_some_and(|c| {
                    c.0 == "True"
                        && c.1 == "Shadowed"
                        && c.2.contains("spec.ingress[1] is shadowed by")
                        && c.2.contains(guard)
                })
                && Value::Array(rules) == expected
                && shadowed_rules(o)[0]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("never decides a packet"))
        }
    };
    policy_status(&api, onp, "prod", "qa-web", "shadowed", shadowed_at(1)).await;
    assert!(
        agent::wait_until(LIMIT, || api.events().iter().any(|e| e["reason"]
            == "RuleShadowed"
            && e["type"] == "Warning"
            && e["regarding"]["name"] == "qa-web"
            && e["note"]
                .as_str()
                .is_some_and(|n| n.contains("spec.ingress[1]") && n.contains(guard))))
        .await,
        "{:#?}",
        api.events()
    );

    // Edit the shadowing rule (the guardrail now only covers the database port): the report
    // goes away although qa-web itself did not change.
    let mut g = get(&api, "ordnet.io/v1alpha1", conp, "", guard);
    g["spec"]["ingress"][0]["ports"] = json!([{"port": 5432}]);
    api.update(g).unwrap();
    policy_status(&api, onp, "prod", "qa-web", "no longer shadowed", |o| {
        condition(o, "RulesShadowed", 1).is_some_and(|c| c.0 == "False" && c.1 == "NotShadowed")
            && shadowed_rules(o).is_empty()
    })
    .await;

    // Edit qa-web into the guardrail's port (generation 2): shadowed again; then delete the
    // guardrail: not shadowed at generation 2.
    let mut q = get(&api, "ordnet.io/v1alpha1", onp, "prod", "qa-web");
    q["spec"]["ingress"][1]["ports"] = json!([{"port": 5432}]);
    api.update(q).unwrap();
    policy_status(&api, onp, "prod", "qa-web", "shadowed at 2", shadowed_at(2)).await;
    api.delete("ordnet.io/v1alpha1", conp, "", guard).unwrap();
    policy_status(&api, onp, "prod", "qa-web", "not shadowed at 2", |o| {
        condition(o, "RulesShadowed", 2).is_some_and(|c| c.0 == "False")
            && shadowed_rules(o).is_empty()
    })
    .await;

    // A policy with a rule that cannot be enforced as written: Accepted=False with reason
    // RulesFailedClosed naming the field, the rule in status.failedClosedRules, and (it is
    // enforced) a shadow report.
    api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": onp,
        "metadata": {"namespace": "prod", "name": "broken"},
        "spec": {"priority": 5, "podSelector": {}, "ingress": [{"action": "Allow",
            "ports": [{"port": 90, "endPort": 80}]}]}}))
        .unwrap();
    policy_status(&api, onp, "prod", "broken", "rules failed closed", |o| {
        condition(o, "Accepted", 1).is_some_and(|c| {
            c.0 == "False" && c.1 == "RulesFailedClosed" && c.2.contains("endPort")
        }) && condition(o, "RulesShadowed", 1).is_some()
            && o["status"]["failedClosedRules"]
                == json!([{"direction": "Ingress", "index": 0, "action": "Allow",
                    "effect": "MatchesNothing",
                    "message": "spec.ingress[0].ports[0].endPort: 80 must be greater than or equal to port (90): the Allow rule matches nothing instead"}])
    })
    .await;
    // Fixing it makes it valid, with a shadow condition.
    fix_prod_broken(&api);
    policy_status(&api, onp, "prod", "broken", "fixed", |o| {
        condition(o, "Accepted", 2).is_some_and(|c| c.0 == "True")
            && condition(o, "RulesShadowed", 2).is_some_and(|c| c.0 == "False")
            && o["status"]
                .get("failedClosedRules")
                .is_none_or(|r| r == &json!([]))
    })
    .await;
}

/// `status.subject` and `status.rules` (printer columns Subject and Rules) of a policy.
fn columns(o: &Value) -> (String, String) {
    (
        o["status"]["subject"].as_str().unwrap_or("").to_string(),
        o["status"]["rules"].as_str().unwrap_or("").to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subject_and_rules_columns_follow_the_selected_pods() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    // A CIDR in use that covers the pod network: a dual-stack pod then has two identities (one
    // per address), and must still be counted once.
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": "qa", "name": "cidr-user"},
        "spec": {"priority": 1, "podSelector": {"matchLabels": {"app": "none"}},
            "egress": [{"action": "Deny", "to": [{"ipBlock": {"cidr": "10.244.0.0/16"}}]}]}}),
    )
    .unwrap();
    let h = start_agent(&api).await;
    assert!(agent::wait_until(LIMIT, || h.state.is_status_writer()).await);
    let conp = "ClusterOrderedNetworkPolicy";
    let onp = "OrderedNetworkPolicy";
    let guard = "qa-must-not-reach-prod";
    let exception = "grafana-reads-artifacts";
    let expect = |ns: &'static str, kind: &'static str, name: &'static str, subject: &str| {
        let subject = subject.to_string();
        let api = &api;
        async move {
            policy_status(api, kind, ns, name, &subject.clone(), move |o| {
                columns(o).0 == subject
            })
            .await
        }
    };
    // Every pod of prod; one pod; one rule count per direction and action.
    expect("", conp, guard, "3 pods in 1 namespace").await;
    expect("", conp, exception, "1 pod in 1 namespace").await;
    expect("prod", onp, "artifacts-ports", "1 pod").await;
    expect("qa", onp, "cidr-user", "0 pods").await;
    let rules = |kind, ns, name| columns(&get(&api, "ordnet.io/v1alpha1", kind, ns, name)).1;
    assert_eq!(rules(conp, "", guard), "in 0A/1D, out 0A/0D");
    assert_eq!(rules(conp, "", exception), "in 1A/0D, out 0A/0D");
    assert_eq!(rules(onp, "prod", "artifacts-ports"), "in 1A/1D, out 0A/0D");
    assert_eq!(rules(onp, "qa", "cidr-user"), "in 0A/0D, out 0A/1D");

    // Converged: nothing is written again (the analysis reruns after every status write the
    // watch shows, and finds the same answer).
    let rv = |kind, ns, name| {
        get(&api, "ordnet.io/v1alpha1", kind, ns, name)["metadata"]["resourceVersion"].clone()
    };
    let before = [rv(conp, "", guard), rv(onp, "prod", "artifacts-ports")];
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        before,
        [rv(conp, "", guard), rv(onp, "prod", "artifacts-ports")],
        "status rewritten although nothing changed"
    );

    // Relabel prod/api into the artifact servers: both policies that select them count it.
    let mut pod = get(&api, "v1", "Pod", "prod", "api");
    pod["metadata"]["labels"] = json!({"app": "artifacts"});
    api.update(pod).unwrap();
    expect("prod", onp, "artifacts-ports", "2 pods").await;
    expect("", conp, exception, "2 pods in 1 namespace").await;
    expect("", conp, guard, "3 pods in 1 namespace").await;

    // A new dual-stack artifact server counts once; a pod without an address (not started)
    // and a host-network pod are no endpoints and do not count.
    let pod = |name: &str, status: Value, host: bool| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "prod", "name": name, "labels": {"app": "artifacts"}},
            "spec": {"nodeName": "node-2", "hostNetwork": host,
                     "containers": [{"name": "c", "image": "x"}]},
            "status": status})
    };
    api.create(pod(
        "artifacts-2",
        json!({"podIP": "10.244.2.20",
               "podIPs": [{"ip": "10.244.2.20"}, {"ip": "fd00:244::20"}]}),
        false,
    ))
    .unwrap();
    api.create(pod("artifacts-pending", json!({}), false))
        .unwrap();
    api.create(pod(
        "artifacts-host",
        json!({"podIP": "192.168.0.2", "podIPs": [{"ip": "192.168.0.2"}]}),
        true,
    ))
    .unwrap();
    expect("prod", onp, "artifacts-ports", "3 pods").await;
    expect("", conp, exception, "3 pods in 1 namespace").await;
    expect("", conp, guard, "4 pods in 1 namespace").await;

    // qa becomes a prod namespace too: the guardrail now selects pods of two namespaces.
    let mut ns = get(&api, "v1", "Namespace", "", "qa");
    ns["metadata"]["labels"] = json!({"env": "prod"});
    api.update(ns).unwrap();
    expect("", conp, guard, "6 pods in 2 namespaces").await;
    // ... and a deleted pod leaves the count.
    api.delete("v1", "Pod", "prod", "artifacts-2").unwrap();
    expect("", conp, guard, "5 pods in 2 namespaces").await;
    expect("prod", onp, "artifacts-ports", "2 pods").await;

    columns_of_policies_not_or_partly_enforced(&api).await;
}

/// The Subject and Rules columns of a policy not enforced at all (its rules counted) and of one
/// with a rule failing closed (its pods counted), then fixed (the end of
/// [`subject_and_rules_columns_follow_the_selected_pods`]).
async fn columns_of_policies_not_or_partly_enforced(api: &FakeApi) {
    let onp = "OrderedNetworkPolicy";
    // A policy the engine cannot use at all is not enforced; its rules are still counted. A
    // policy with a rule failing closed is enforced: it counts its pods.
    api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": onp,
        "metadata": {"namespace": "prod", "name": "unusable"},
        "spec": {"priority": 5, "podSelector": {"matchLabels": {"app": "-bad-"}},
            "egress": [{"action": "Deny"}]}}))
        .unwrap();
    policy_status(api, onp, "prod", "unusable", "not enforced", |o| {
        condition(o, "Accepted", 1).is_some_and(|c| c.0 == "False" && c.1 == "Invalid")
            && columns(o) == ("not enforced".into(), "in 0A/0D, out 0A/1D".into())
    })
    .await;
    api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": onp,
        "metadata": {"namespace": "prod", "name": "broken"},
        "spec": {"priority": 5, "podSelector": {}, "ingress": [{"action": "Allow",
            "ports": [{"port": 90, "endPort": 80}]}], "egress": [{"action": "Deny"}]}}))
        .unwrap();
    policy_status(api, onp, "prod", "broken", "partly enforced", |o| {
        condition(o, "Accepted", 1).is_some_and(|c| c.0 == "False" && c.1 == "RulesFailedClosed")
            && columns(o) == ("3 pods".into(), "in 1A/0D, out 0A/1D".into())
    })
    .await;
    fix_prod_broken(api);
    policy_status(api, onp, "prod", "broken", "fixed", |o| {
        condition(o, "Accepted", 2).is_some_and(|c| c.0 == "True")
            && columns(o) == ("3 pods".into(), "in 1A/0D, out 0A/1D".into())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_pod_is_no_endpoint_and_its_address_can_be_reused() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let h = start_agent(&api).await;
    converges(&api, &h, "initial sync").await;
    let tester: IpNet = "10.244.1.11/32".parse().unwrap();
    assert!(programmed(&h).unwrap().0.contains_key("qa/tester"));

    // The pod succeeds: its endpoint and address go.
    let mut pod = get(&api, "v1", "Pod", "qa", "tester");
    pod["status"]["phase"] = json!("Succeeded");
    api.update(pod.clone()).unwrap();
    converges(&api, &h, "tester succeeded").await;
    let (eps, ipcache, _, _) = programmed(&h).unwrap();
    assert!(!eps.contains_key("qa/tester"));
    assert!(!ipcache.contains_key(&tester));
    assert!(h.state.problems().is_empty());

    // A new pod on the node gets the same address: no duplicate-address problem, it is the
    // address's owner.
    pod["metadata"] =
        json!({"namespace": "qa", "name": "tester-2", "labels": pod["metadata"]["labels"]});
    pod["status"]["phase"] = json!("Running");
    api.create(pod).unwrap();
    converges(&api, &h, "tester-2 reuses the address").await;
    let (eps, ipcache, _, _) = programmed(&h).unwrap();
    assert!(eps.contains_key("qa/tester-2"));
    assert!(ipcache.contains_key(&tester));
    assert!(h.state.problems().is_empty());
    let offline = offline_objects(&api);
    assert_eq!(offline.pods.len(), 6, "the validator keeps both pods");
}

/// Usage errors of `ordnet agent` exit 2 before anything starts, with clap's message.
#[test]
fn agent_usage_errors_exit_2() {
    for (args, needle) in [
        (
            vec!["--node", "n", "--datapath", "none", "--uplink", "eth0"],
            "--uplink only applies to --datapath bpf",
        ),
        (vec!["--node", ""], "--node"),
        (vec!["--node", "n", "--uplink", ""], "--uplink"),
        (
            vec!["--node", "n", "--debug-addr", "localhost"],
            "--debug-addr",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ordnet"))
            .arg("agent")
            .args(&args)
            .env_remove("NODE_NAME")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// A node's traffic report as its agent writes it (`agent::traffic`), for node `node`.
fn traffic_report(node: &str, end: u32, rules: Value) -> Value {
    let report = json!({"node": node, "windowSeconds": 10,
        "countingSince": "2026-11-27T00:00:00Z",
        "windowEnd": format!("2026-11-27T01:00:{end:02}Z"), "rules": rules});
    json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"namespace": "kube-system", "name": format!("ordnet-traffic-{node}"),
            "labels": {"ordnet.io/traffic-report": "true"}},
        "data": {"report.json": report.to_string()}})
}

fn reported(name: &str, direction: &str, index: u32, window: [u64; 3], total: [u64; 3]) -> Value {
    json!({"kind": "OrderedNetworkPolicy", "namespace": "qa", "name": name,
        "direction": direction, "index": index, "window": window, "total": total})
}

/// The status writer sums the nodes' traffic reports (ConfigMaps in its namespace) into
/// `status.traffic`: what each rule decided in the last window over all nodes, and the rules
/// that decided nothing anywhere; it follows new reports, and says `nodes: 0` when none is left.
/// ConfigMaps that are no report, or cannot be read, are left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_reports_are_summed_into_status() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    api.create(
        json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": "qa", "name": "counted"},
        "spec": {"priority": 1, "podSelector": {},
            "ingress": [{"action": "Allow", "from": [{"podSelector": {}}]},
                        {"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}],
            "egress": [{"action": "Deny", "to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]}]}}),
    )
    .unwrap();
    api.create(traffic_report(
        "n1",
        10,
        json!([reported("counted", "Ingress", 0, [3, 0, 0], [10, 0, 0])]),
    ))
    .unwrap();
    api.create(traffic_report(
        "n2",
        10,
        json!([
            reported("counted", "Ingress", 0, [1, 0, 0], [1, 0, 0]),
            reported("counted", "Egress", 0, [0, 0, 0], [0, 2, 4])
        ]),
    ))
    .unwrap();
    let mut unreadable = traffic_report("n3", 10, json!([]));
    unreadable["data"]["report.json"] = json!("{not json");
    api.create(unreadable).unwrap();
    let mut unlabelled = traffic_report("n4", 10, json!([]));
    unlabelled["metadata"]["labels"] = json!({});
    api.create(unlabelled).unwrap();
    let h = start_agent(&api).await;
    assert!(agent::wait_until(LIMIT, || h.state.is_status_writer()).await);
    let traffic = |want: Value| {
        let api = &api;
        async move {
            policy_status(
                api,
                "OrderedNetworkPolicy",
                "qa",
                "counted",
                &want.to_string(),
                |o| o["status"]["traffic"] == want,
            )
            .await
        }
    };
    traffic(json!({"nodes": 2, "windowSeconds": 10,
        "rules": [{"direction": "Ingress", "index": 0,
                   "flowsAllowed": 4, "flowsDenied": 0, "packetsDenied": 0}],
        "unmatchedRules": ["ingress[1]"]}))
    .await;
    // n1's next window: nothing decided; egress[0] denied again on n2.
    api.update(traffic_report(
        "n1",
        20,
        json!([reported("counted", "Ingress", 0, [0, 0, 0], [10, 0, 0])]),
    ))
    .unwrap();
    api.update(traffic_report(
        "n2",
        20,
        json!([
            reported("counted", "Ingress", 0, [0, 0, 0], [1, 0, 0]),
            reported("counted", "Egress", 0, [0, 1, 9], [0, 3, 13])
        ]),
    ))
    .unwrap();
    traffic(json!({"nodes": 2, "windowSeconds": 10,
        "rules": [{"direction": "Egress", "index": 0,
                   "flowsAllowed": 0, "flowsDenied": 1, "packetsDenied": 9}],
        "unmatchedRules": ["ingress[1]"]}))
    .await;
    // Other policies get theirs too: no rule of artifacts-ports decided anything.
    policy_status(
        &api,
        "OrderedNetworkPolicy",
        "prod",
        "artifacts-ports",
        "unmatched",
        |o| {
            o["status"]["traffic"]["nodes"] == 2
                && o["status"]["traffic"]["rules"] == json!([])
                && o["status"]["traffic"]["unmatchedRules"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
        },
    )
    .await;
    for node in ["n1", "n2"] {
        api.delete(
            "v1",
            "ConfigMap",
            "kube-system",
            &format!("ordnet-traffic-{node}"),
        )
        .unwrap();
    }
    // No report left: the status says so, and claims nothing.
    traffic(json!({"nodes": 0, "windowSeconds": 1, "rules": [], "unmatchedRules": []})).await;
    assert_rbac(&api, "kube-system", false);
}

/// A staged policy (`spec.mode: Staged`) decides nothing: the agent programs what it would
/// without the policy, and the status says `Staged` (no shadow analysis, subject `staged`).
/// Promoted to `Enforce`, the same rules decide, and the status says `Valid`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_policy_decides_nothing_until_promoted() {
    let api = FakeApi::start().await.unwrap();
    load_dir(&api, &repo().join("examples/qa-prod"));
    let mut lockdown = json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": "qa", "name": "lockdown"},
        "spec": {"mode": "Staged", "priority": 0, "podSelector": {},
            "defaultDeny": {"ingress": true},
            "ingress": [{"action": "Allow", "from": [{"podSelector": {}}]}]}});
    api.create(lockdown.clone()).unwrap();
    let h = start_agent(&api).await;
    converges(&api, &h, "staged").await;
    // What the agent programmed with the staged policy present is what it programs without
    // it: the same keys, isolation and ipcache (so the same maps, and the same cost per packet).
    let without = FakeApi::start().await.unwrap();
    load_dir(&without, &repo().join("examples/qa-prod"));
    assert!(
        programmed(&h).as_ref() == Some(&offline(&without)),
        "the staged policy changed what is programmed"
    );
    let m = agent_matrix(h.debug_addr(), "192.0.2.1").await;
    assert_eq!(cell(&m, "prod/api", "qa/grafana"), "allow", "staged: {m}");
    assert!(agent::wait_until(LIMIT, || h.state.is_status_writer()).await);
    policy_status(
        &api,
        "OrderedNetworkPolicy",
        "qa",
        "lockdown",
        "Staged",
        |o| {
            condition(o, "Accepted", 1).is_some_and(|(s, reason, msg)| {
                s == "True" && reason == "Staged" && msg.contains("decides no packet")
            }) && condition(o, "RulesShadowed", 1).is_none()
                && o["status"]["subject"] == "staged"
                && o["status"]["rules"] == "in 1A/0D, out 0A/0D"
        },
    )
    .await;

    // What the staged policy would flip, offline: the node's engine without and with it.
    let objects = offline_objects(&api);
    let engine = |staged| {
        ordnet_engine::Engine::build_with(
            &objects,
            &ordnet_engine::BuildOptions {
                node: Some(NODE.to_string()),
                staged,
            },
        )
    };
    let external: Vec<std::net::IpAddr> = vec!["192.0.2.1".parse().unwrap()];
    let cells = |staged| {
        ordnet_engine::matrix(
            &engine(staged),
            ordnet_mapstate::Protocol::Tcp,
            8081,
            &external,
            ordnet_engine::IpFamily::V4,
        )
    };
    let (without, with) = (cells(false), cells(true));
    let before = m;
    lockdown["spec"]["mode"] = json!("Enforce");
    api.update(lockdown).unwrap();
    converges(&api, &h, "promoted").await;
    let m = agent_matrix(h.debug_addr(), "192.0.2.1").await;
    // Promotion flips exactly the cells the staged policy would flip, and no other.
    let mut flipped = 0;
    for r in m["results"].as_array().unwrap() {
        let (from, to) = (r["from"].as_str().unwrap(), r["to"].as_str().unwrap());
        let (Some(a), Some(b)) = (without.verdict(from, to), with.verdict(from, to)) else {
            continue;
        };
        let agent_flipped = cell(&before, from, to) != cell(&m, from, to);
        assert_eq!(agent_flipped, a != b, "promoted: {from} -> {to}");
        flipped += usize::from(agent_flipped);
    }
    assert!(flipped >= 1, "promoted: nothing flipped");
    assert_eq!(cell(&m, "prod/api", "qa/grafana"), "deny", "promoted: {m}");
    assert_eq!(
        cell(&m, "qa/tester", "qa/grafana"),
        "allow",
        "promoted: {m}"
    );
    policy_status(
        &api,
        "OrderedNetworkPolicy",
        "qa",
        "lockdown",
        "Valid",
        |o| {
            condition(o, "Accepted", 2)
                .is_some_and(|(s, reason, _)| s == "True" && reason == "Valid")
                && condition(o, "RulesShadowed", 2).is_some()
                && o["status"]["subject"] == "2 pods"
        },
    )
    .await;
}

/// The watch's echo of a status write changes nothing the engine reads: no batch is programmed
/// for it. A status overwritten by someone else is written back by the status writer without a
/// change of the policy (it looks at every version the watch brings, echoes too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_echo_is_no_change_and_a_foreign_status_is_written_back() {
    use kube::api::{Api, Patch, PatchParams};
    let (api, h) = status_writer_on_qa_prod().await;
    let conp = "ClusterOrderedNetworkPolicy";
    let guard = "qa-must-not-reach-prod";
    let written = |o: &Value| {
        condition(o, "Accepted", 1).is_some_and(|c| c.0 == "True")
            && o["status"]["subject"]
                .as_str()
                .is_some_and(|s| s != "bogus")
    };
    policy_status(&api, conp, "", guard, "written", written).await;
    // Until no batch came for a while (the writer's first statuses, before this change their
    // echoes); bounded (the Lease renewals never stop moving the resource version).
    let mut batches = h.state.metrics.batches.get();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = h.state.metrics.batches.get();
        if now == batches {
            break;
        }
        batches = now;
    }
    let subject = get(&api, "ordnet.io/v1alpha1", conp, "", guard)["status"]["subject"].clone();

    let policies: Api<ordnet_crds::ClusterOrderedNetworkPolicy> = Api::all(api.client());
    policies
        .patch_status(
            guard,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"subject": "bogus"}})),
        )
        .await
        .unwrap();
    policy_status(&api, conp, "", guard, "written back", |o| {
        o["status"]["subject"] == subject
    })
    .await;
    assert_eq!(
        h.state.metrics.batches.get(),
        batches,
        "two status writes' echoes programmed a batch"
    );
    // A change of the spec still is one.
    let mut g = get(&api, "ordnet.io/v1alpha1", conp, "", guard);
    g["spec"]["ingress"][0]["ports"] = json!([{"port": 5432}]);
    api.update(g).unwrap();
    assert!(agent::wait_until(LIMIT, || h.state.metrics.batches.get() > batches).await);
}
