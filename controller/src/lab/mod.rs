//! `ordnet lab`: the pods of the manifests as network namespaces on this machine, enforced by
//! the XDP datapath exactly as the agent programs it, and (with `--probe`) real connections
//! between every ordered pair compared with what `ordnet matrix` computes. See `docs/lab.md`.
//!
//! Exit codes: 0 done (with `--probe`: every pair observed as expected); 1 invalid manifests;
//! 2 usage; 3 some pair observed differently from the expected verdict; 4 the lab could not be
//! built or run (not root, another lab active, a system or probe error); 128 + signal when a
//! `--probe` run is interrupted (an interactive lab ends normally on Ctrl-C: 0).

mod error;
mod kubeproxy;
mod observe;
mod probe;
mod sctp;
mod sys;
mod topo;

use error::LabError;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ordnet::observe::FlowRecord;
use ordnet::program::NodeProgram;
use ordnet_datapath::{Datapath, DatapathConfig};
use ordnet_engine::{Engine, IpFamily, Matrix, MatrixVerdict};
use ordnet_mapstate::{Protocol, Verdict};

use crate::cli::load;
use crate::cli::{LabArgs, Source, TableOrJson};
use ordnet::render::{self, Style};
use probe::{End, Method, Outcome, Probe};
use topo::Topology;

/// How long a probe waits for an answer before it counts as denied (a TCP SYN is retransmitted
/// after 1 s; UDP requests and SCTP INITs every 300 ms).
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// The probe rounds of a run: the wiring check, then the measured run. Each uses fresh source
/// ports towards Services (kernel conntrack keeps a translated flow's backend for a while).
const WIRING: u16 = 0;
const RUN: u16 = 1;
const ATTEMPTS: u16 = 2;

/// Exit code: some pair was observed differently from the expected verdict.
pub const EXIT_MISMATCH: u8 = 3;
/// Exit code: the lab could not be built or run.
pub const EXIT_LAB: u8 = 4;

/// A failure with its exit code.
struct Fail {
    code: u8,
    msg: String,
}

fn fail(code: u8, msg: impl Into<String>) -> Fail {
    Fail {
        code,
        msg: msg.into(),
    }
}

fn lab_err(msg: impl std::fmt::Display) -> Fail {
    fail(EXIT_LAB, msg.to_string())
}

impl From<LabError> for Fail {
    fn from(e: LabError) -> Fail {
        lab_err(e)
    }
}

/// Runs `ordnet lab`.
pub fn run(args: &LabArgs) -> ExitCode {
    match run_checked(args) {
        Ok(code) => code,
        Err(f) => {
            if !f.msg.is_empty() {
                eprintln!("ordnet lab: {}", f.msg);
            }
            ExitCode::from(f.code)
        }
    }
}

/// What the command line asks for, checked.
struct Plan {
    /// The whole cluster with every pod a local endpoint (the expected matrix, kube-proxy's
    /// rules, and the one node of every shape but `flannel`).
    engine: Engine,
    /// `--cni flannel`: each node's engine (its pods local), as that node's agent builds it.
    nodes: Vec<Engine>,
    /// The manifests have staged policies: the engine that enforces them too, and its matrix.
    staged: Option<(Engine, Matrix)>,
    expected: Matrix,
    family: IpFamily,
    externals: Vec<IpAddr>,
    method: Method,
    /// Every Service port of every family, as kube-proxy programs it in the node namespace.
    kube_proxy: Vec<kubeproxy::ServicePort>,
    /// NodePort flows from every external address (probed besides the matrix), with their
    /// expected verdicts.
    node_ports: Vec<NodePortCheck>,
}

/// A flow from an external address to a Service's NodePort on the lab node, towards one
/// backend: kube-proxy keeps the client address (`externalTrafficPolicy: Local`) or rewrites it
/// to the node's (`Cluster`), and the backend's ingress policy judges what it sees.
#[derive(Debug, Clone)]
struct NodePortCheck {
    /// The external address.
    from: String,
    /// `svc:ns/name`.
    service: String,
    /// `nodeAddress:nodePort`.
    dest: SocketAddr,
    /// The backend (`ns/name`) and its index in the kube-proxy rules' steering order.
    backend: String,
    steer: usize,
    local: bool,
    expected: Verdict,
}

fn plan(args: &LabArgs) -> Result<Plan, Fail> {
    let (family, externals) = checked_flags(args)?;
    let (engine, staged, objects) = buildable_engine(args, &externals)?;
    // The node each pod is built on (the topology places them in the same order).
    let node_of: HashMap<String, usize> = engine
        .endpoints()
        .iter()
        .enumerate()
        .map(|(i, ep)| (ep.id(), topo::node_of(args.cni, i)))
        .collect();
    let nodes = node_engines(args.cni, &node_of, objects);
    let proto = load::protocol(args.protocol);
    // With staged policies: what `ordnet matrix --staged` prints, for `--observe` to check the
    // staged verdicts of the events against.
    let staged = match staged {
        Some(view) => {
            let offline = ordnet::offline::OfflineDatapath::build(&view)
                .map_err(|e| fail(1, format!("programming the in-memory datapath: {e}")))?;
            let m = ordnet::offline::matrix(
                &view,
                offline.plane(),
                proto,
                args.port,
                &externals,
                family,
            );
            Some((view, m))
        }
        None => None,
    };
    // Exactly what `ordnet matrix` prints.
    let offline = ordnet::offline::OfflineDatapath::build(&engine)
        .map_err(|e| fail(1, format!("programming the in-memory datapath: {e}")))?;
    let expected = ordnet::offline::matrix(
        &engine,
        offline.plane(),
        proto,
        args.port,
        &externals,
        family,
    );
    let method = match args.protocol {
        crate::cli::ProtocolArg::Tcp => Method::Tcp,
        crate::cli::ProtocolArg::Udp => Method::Udp,
        crate::cli::ProtocolArg::Sctp => probe::sctp_method(),
    };
    let kube_proxy = kube_proxy_ports(&engine);
    if let Some(sp) = kube_proxy
        .iter()
        .find(|sp| sp.backends.len() > kubeproxy::MAX_BACKENDS)
    {
        return Err(fail(
            2,
            format!(
                "Service {} has {} backends: the lab steers at most {}",
                sp.service,
                sp.backends.len(),
                kubeproxy::MAX_BACKENDS
            ),
        ));
    }
    // Each node's addresses are that node's in the expectation too (a NodePort's masqueraded
    // traffic comes from one of them): one in-memory datapath per node, told its own.
    let mut offlines = vec![offline];
    for _ in 1..topo::node_count(args.cni) {
        offlines.push(
            ordnet::offline::OfflineDatapath::build(&engine)
                .map_err(|e| fail(1, format!("programming the in-memory datapath: {e}")))?,
        );
    }
    for (n, o) in offlines.iter_mut().enumerate() {
        o.program
            .set_host_addresses(&mut o.datapath, &topo::NODE_ADDRESSES[n])
            .map_err(|e| fail(1, format!("programming the in-memory datapath: {e}")))?;
    }
    let node_ports = node_port_checks(
        &engine,
        &offlines,
        &node_of,
        &kube_proxy,
        &externals,
        family,
        proto,
        args.port,
        &expected,
    );
    Ok(Plan {
        engine,
        nodes,
        staged,
        expected,
        family,
        externals,
        method,
        kube_proxy,
        node_ports,
    })
}

impl Plan {
    /// The engine node `n`'s datapath is programmed from.
    fn node_engine(&self, n: usize) -> &Engine {
        self.nodes.get(n).unwrap_or(&self.engine)
    }
}

/// With `--cni flannel`, each node's engine: every pod placed on the node the topology builds
/// it on ([`topo::node_of`]: any `spec.nodeName` of the manifests is replaced), MapStates for
/// that node's pods only, the identities and the ipcache of the whole cluster — what the agent
/// of that node builds. Empty for one-node shapes (the cluster-wide engine is the node's).
fn node_engines(
    shape: crate::cli::CniShape,
    placed: &HashMap<String, usize>,
    mut objects: ordnet_crds::ClusterObjects,
) -> Vec<Engine> {
    let count = topo::node_count(shape);
    if count == 1 {
        return Vec::new();
    }
    let node_name = |n: usize| format!("ordlab-node{}", n + 1);
    for pod in &mut objects.pods {
        let meta = &pod.object.metadata;
        let id = format!(
            "{}/{}",
            meta.namespace
                .as_deref()
                .unwrap_or(ordnet_crds::DEFAULT_NAMESPACE),
            meta.name.as_deref().unwrap_or_default()
        );
        let node = placed.get(&id).map(|n| node_name(*n));
        pod.object
            .spec
            .get_or_insert_with(Default::default)
            .node_name = node;
    }
    (0..count)
        .map(|n| Engine::build_for_node(&objects, &node_name(n)))
        .collect()
}

/// The address family and the `--external` addresses (deduplicated), checked: usage errors
/// exit 2.
fn checked_flags(args: &LabArgs) -> Result<(IpFamily, Vec<IpAddr>), Fail> {
    let family = match args.family {
        4 => IpFamily::V4,
        6 => IpFamily::V6,
        other => return Err(fail(2, format!("--family must be 4 or 6, not {other}"))),
    };
    if args.probe && args.port == 0 {
        return Err(fail(2, "--port 0 cannot be probed (use 1-65535)"));
    }
    // The pods' links lose the VXLAN headers; IPv6 needs 1280 on them.
    let least = 1280 + topo::VXLAN_OVERHEAD;
    if args.cni == crate::cli::CniShape::Flannel && args.mtu < least {
        return Err(fail(
            2,
            format!(
                "--cni flannel needs --mtu {least} or more (the pods' links get {} less, and IPv6 needs 1280)",
                topo::VXLAN_OVERHEAD
            ),
        ));
    }
    let mut externals: Vec<IpAddr> = Vec::new();
    for ip in &args.external {
        if !family.contains(*ip) {
            return Err(fail(
                2,
                format!(
                    "--external {ip} is not an IPv{} address (--family {})",
                    args.family, args.family
                ),
            ));
        }
        if let Some(why) = topo::unusable(*ip) {
            return Err(fail(2, format!("--external {ip} cannot be used: {why}")));
        }
        if !externals.contains(ip) {
            externals.push(*ip);
        }
    }
    Ok((family, externals))
}

/// The engine of the manifests, if the lab can build them: no errors, every pod address
/// buildable, no `--external` that is a pod's address.
fn buildable_engine(
    args: &LabArgs,
    externals: &[IpAddr],
) -> Result<(Engine, Option<Engine>, ordnet_crds::ClusterObjects), Fail> {
    let source = Source {
        files: args.files.clone(),
        agent: None,
        staged: false,
    };
    let (loaded, objects) = load::load_engine_and_objects("lab", &source).map_err(|code| Fail {
        // load_engine printed the problems; its exit code is CLI.md's.
        code: if code == ExitCode::from(1) { 1 } else { 2 },
        msg: String::new(),
    })?;
    // The lab builds only valid input (rules enforced fail-closed are for the agent and for
    // `matrix`, which say so and exit 1).
    if loaded.exit != ExitCode::SUCCESS {
        return Err(fail(1, "the manifests have errors; nothing built"));
    }
    let staged = loaded.staged_view();
    let engine = loaded.engine;
    // Every address is given to exactly one namespace (validation already refused two pods
    // with one address).
    let mut owner: HashMap<IpAddr, String> = HashMap::new();
    for ep in engine.endpoints() {
        for ip in &ep.ips {
            if let Some(why) = topo::unusable(*ip) {
                return Err(fail(
                    1,
                    format!(
                        "Pod {}: status.podIPs: {ip} cannot be built: {why}",
                        ep.id()
                    ),
                ));
            }
            owner.insert(*ip, ep.id());
        }
    }
    for ip in externals {
        if let Some(pod) = owner.get(ip) {
            return Err(fail(
                2,
                format!("--external {ip} is the address of pod {pod}"),
            ));
        }
    }
    Ok((engine, staged, objects))
}

/// Every Service port of every family of `engine` with its backends (pods of the family, in the
/// engine's order), as kube-proxy programs it.
fn kube_proxy_ports(engine: &Engine) -> Vec<kubeproxy::ServicePort> {
    let mut out = Vec::new();
    for ((ns, name), svc) in engine.services() {
        for family in [IpFamily::V4, IpFamily::V6] {
            let Some(cluster_ip) = svc.cluster_ip(family) else {
                continue;
            };
            for sp in &svc.ports {
                let backends = engine
                    .service_backends(ns, name, sp.protocol, sp.port)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|b| {
                        let (bns, bname) = b.pod.split_once('/')?;
                        let addr = engine.endpoint(bns, bname)?.address(family)?;
                        Some((addr, b.port))
                    })
                    .collect();
                let mut addresses = vec![cluster_ip];
                addresses.extend(svc.external_ips.iter().filter(|ip| family.contains(**ip)));
                out.push(kubeproxy::ServicePort {
                    service: format!("{ns}/{name}"),
                    protocol: sp.protocol,
                    addresses,
                    port: sp.port,
                    node_port: sp.node_port,
                    local: svc.external_local,
                    backends,
                });
            }
        }
    }
    out
}

/// The NodePort flows the lab probes besides the matrix: from every external address to every
/// NodePort of a Service port on (`proto`, `port`) of `family`, towards each backend. Expected:
/// with `externalTrafficPolicy: Local` the client address is kept, so the verdict is the
/// matrix's towards that backend; with `Cluster` kube-proxy masquerades to the node's address,
/// and the verdict is the datapath's of the backend's node for a flow from that address
/// (forwarded: judged, not exempt; from another node: an address like any other) to the backend.
/// A `Cluster` NodePort is probed on node 0 (with `--cni flannel` its backends on the other node
/// are reached through the overlay), a `Local` one on the backend's node (kube-proxy sends a
/// `Local` NodePort's traffic to the node's own backends only). `offlines` are the nodes'
/// in-memory datapaths (each knowing its node's addresses), `node_of` each pod's node.
#[allow(clippy::too_many_arguments)]
fn node_port_checks(
    engine: &Engine,
    offlines: &[ordnet::offline::OfflineDatapath],
    node_of: &HashMap<String, usize>,
    kube_proxy: &[kubeproxy::ServicePort],
    externals: &[IpAddr],
    family: IpFamily,
    proto: Protocol,
    port: u16,
    expected: &Matrix,
) -> Vec<NodePortCheck> {
    let node_address = |n: usize| {
        topo::NODE_ADDRESSES[n]
            .iter()
            .copied()
            .find(|ip| family.contains(*ip))
            .expect("a node address of each family")
    };
    let node = node_address(0);
    let mut out = Vec::new();
    for sp in kube_proxy {
        let Some(np) = sp.node_port else {
            continue;
        };
        if sp.protocol != proto || sp.port != port || !family.contains(sp.addresses[0]) {
            continue;
        }
        let service = format!("svc:{}", sp.service);
        let (ns, name) = sp.service.split_once('/').unwrap_or(("", &sp.service));
        let pods = engine
            .service_backends(ns, name, proto, port)
            .unwrap_or_default();
        for ext in externals {
            for (steer, (addr, bport)) in sp.backends.iter().enumerate() {
                let Some(backend) = pods.iter().map(|b| b.pod.clone()).find(|pod| {
                    let (bns, bname) = pod.split_once('/').unwrap_or(("", pod));
                    engine
                        .endpoint(bns, bname)
                        .and_then(|ep| ep.address(family))
                        == Some(*addr)
                }) else {
                    continue;
                };
                let on = node_of.get(&backend).copied().unwrap_or(0);
                let (expected, at) = if sp.local {
                    let v = expected
                        .results
                        .iter()
                        .find(|r| r.from == ext.to_string() && r.to == service)
                        .and_then(|r| r.backends.iter().find(|b| b.to == backend))
                        .map_or(Verdict::Deny, |b| b.verdict);
                    (v, node_address(on))
                } else {
                    let plane = offlines[on].plane();
                    let v = ordnet::offline::decide_translated(plane, node, *addr, proto, *bport)
                        .unwrap_or(Verdict::Deny);
                    (v, node)
                };
                out.push(NodePortCheck {
                    from: ext.to_string(),
                    service: service.clone(),
                    dest: SocketAddr::new(at, np),
                    backend,
                    steer,
                    local: sp.local,
                    expected,
                });
            }
        }
    }
    out
}

/// Everything a running lab holds, released in field order: servers, then the datapath
/// (detaching XDP), then the namespaces, then the lock.
/// How often an interactive lab sweeps its connection-tracking tables (as the agent does at
/// upkeep).
const CT_SWEEP_EVERY: Duration = Duration::from_secs(10);

struct Running {
    servers: Option<probe::Servers>,
    /// Each node's datapath (one per node namespace).
    datapaths: Vec<Datapath>,
    /// The datapaths' verdict events (`--observe`), by node.
    events: Vec<ordnet_datapath::EventReader>,
    topo: Topology,
    _lock: sys::LabLock,
}

impl Running {
    fn shutdown(&mut self) -> Result<(), LabError> {
        self.servers = None;
        self.events.clear();
        self.datapaths.clear();
        self.topo.teardown()
    }
}

fn run_checked(args: &LabArgs) -> Result<ExitCode, Fail> {
    let plan = plan(args)?;
    if !sys::is_root() {
        return Err(lab_err(
            "needs root (network namespaces, veth pairs, the XDP program and its maps)",
        ));
    }
    sys::catch_signals().map_err(lab_err)?;
    let run_id = format!(
        "{:04x}",
        (std::process::id()
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0))
            & 0xffff
    );
    let lock = sys::lock(&run_id).map_err(lab_err)?;
    let stale = topo::remove_leftovers().map_err(lab_err)?;
    if !stale.is_empty() {
        eprintln!(
            "ordnet lab: removed {} namespace{} left by an earlier lab that did not clean up: {}",
            stale.len(),
            if stale.len() == 1 { "" } else { "s" },
            stale.join(" ")
        );
    }
    let mut lab = Running {
        servers: None,
        datapaths: Vec::new(),
        events: Vec::new(),
        topo: Topology::new(&run_id, args.cni, args.mtu, usize::from(args.uplinks)),
        _lock: lock,
    };
    let outcome = drive(args, &plan, &mut lab);
    let cleanup = lab.shutdown();
    if let Err(e) = &cleanup {
        eprintln!("ordnet lab: cleanup: {e}");
    }
    let code = outcome?;
    if cleanup.is_err() {
        return Err(lab_err(""));
    }
    Ok(code)
}

fn interrupted() -> Result<(), Fail> {
    match sys::interrupted() {
        Some(sig) => Err(fail(128 + sig as u8, "")),
        None => Ok(()),
    }
}

/// Builds the lab and runs it (probes, or waits for Ctrl-C). Cleanup is the caller's.
fn drive(args: &LabArgs, plan: &Plan, lab: &mut Running) -> Result<ExitCode, Fail> {
    let started = Instant::now();
    build_network(plan, lab)?;
    interrupted()?;
    let ifindex = attach_datapaths(args, plan, lab)?;
    interrupted()?;
    let (ends, index) = probed_ends(plan, lab)?;
    let checks = probe_plan(args, plan, &ends, &index)?;
    let probes = |attempt: u16| -> Vec<Probe> { checks.iter().map(|c| c.probe(attempt)).collect() };
    start_servers_and_check_wiring(plan, lab, &ends, &checks, &probes(WIRING))?;
    program_datapaths(plan, lab, &ifindex)?;
    eprintln!(
        "ordnet lab: run {} up in {} ms: {}{}",
        lab.topo.run_id,
        started.elapsed().as_millis(),
        lab.topo
            .nodes
            .iter()
            .enumerate()
            .map(|(n, node)| {
                let tc = lab.topo.tc_only_interfaces(n);
                format!(
                    "XDP and TC on {} interfaces{} of namespace {node}",
                    lab.topo.xdp_interfaces(n).len(),
                    if tc.is_empty() {
                        String::new()
                    } else {
                        format!(", TC on {}", tc.join(", "))
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        if plan.kube_proxy.is_empty() {
            String::new()
        } else {
            format!(
                ", kube-proxy rules for {} Service port{}",
                plan.kube_proxy.len(),
                if plan.kube_proxy.len() == 1 { "" } else { "s" }
            )
        }
    );
    interrupted()?;
    if !args.probe {
        print_guide(args, plan, lab);
        sweep_until_interrupted(lab);
        return Ok(ExitCode::SUCCESS);
    }
    let outcomes = probe_and_verify(args, plan, lab, &ends, &checks, &probes(RUN))?;
    let mut counters_disagree = false;
    let events = match lab.events.is_empty() {
        false => {
            let mut sources: Vec<observe::Source<'_>> = lab
                .datapaths
                .iter_mut()
                .zip(lab.events.iter_mut())
                .enumerate()
                .map(|(n, (dp, reader))| observe::Source {
                    datapath: dp,
                    reader,
                    engine: plan.node_engine(n),
                })
                .collect();
            let mut events = observe::gather(&mut sources);
            eprintln!("{}", events.summary());
            counters_disagree = events.counters_disagree();
            if let Some((view, staged)) = &plan.staged {
                events.judge_staged(view);
                let wrong = staged_mismatches(plan, staged, &checks, &ends, &events);
                counters_disagree |= !wrong.is_empty();
            }
            let flows: Vec<Vec<&FlowRecord>> = checks
                .iter()
                .map(|c| {
                    let dst = c
                        .server
                        .map_or(c.dest, |(end, port)| SocketAddr::new(ends[end].addr, port));
                    let label = c
                        .backend
                        .map(|_| plan.expected.endpoints[c.source].as_str());
                    events.of_flow(plan.method.ip_protocol(), ends[c.source].addr, label, dst)
                })
                .collect();
            Some((
                events.text(Style::new(render::color_wanted())),
                json_events(&flows),
            ))
        }
        true => None,
    };
    let code = report(args, plan, &checks, &outcomes, events)?;
    if counters_disagree && code == ExitCode::SUCCESS {
        return Ok(ExitCode::from(EXIT_MISMATCH));
    }
    Ok(code)
}

/// An interactive lab, until Ctrl-C: like the agent, sweeps the expired connection-tracking
/// entries now and then, and says how full each node's tables are, and how many TCP packets of
/// flows the tables had lost (evicted, expired) its policy denied, whenever either changes.
fn sweep_until_interrupted(lab: &mut Running) {
    let mut swept = Instant::now();
    let mut shown = vec![None; lab.datapaths.len()];
    while sys::interrupted().is_none() {
        std::thread::sleep(Duration::from_millis(100));
        if swept.elapsed() < CT_SWEEP_EVERY {
            continue;
        }
        swept = Instant::now();
        for (n, dp) in lab.datapaths.iter_mut().enumerate() {
            let sweep = dp.ct_sweep().and_then(|s| Ok((s, dp.counters()?)));
            match sweep {
                Ok((s, c)) => {
                    let now = Some((s.live, c.untracked_denied, c.untracked_allowed));
                    if shown[n] == now {
                        continue;
                    }
                    shown[n] = now;
                    eprintln!(
                        "ordnet lab: conntrack of {}: IPv4 {} of {} entries live ({} expired \
                         removed), IPv6 {} of {} ({} removed); TCP packets of untracked flows \
                         past the handshake: {} denied, {} allowed",
                        lab.topo.nodes[n],
                        s.live[0],
                        s.capacity[0],
                        s.removed[0],
                        s.live[1],
                        s.capacity[1],
                        s.removed[1],
                        c.untracked_denied,
                        c.untracked_allowed
                    );
                }
                Err(e) => eprintln!("ordnet lab: sweeping the conntrack tables: {e}"),
            }
        }
    }
}

/// With staged policies (`--observe`): the probed pod-to-pod flows whose events the staged view
/// judged differently must be exactly those whose cell differs between `matrix --staged` and
/// `matrix` (Services are mixed cells: left out). Prints the comparison and every mismatch.
fn staged_mismatches(
    plan: &Plan,
    staged: &Matrix,
    checks: &[Check],
    ends: &[End],
    events: &observe::LabEvents,
) -> Vec<String> {
    let (mut would, mut want, mut wrong) = (0, 0, Vec::new());
    for c in checks
        .iter()
        .filter(|c| c.backend.is_none() && c.node_port.is_none())
    {
        let r = &plan.expected.results[c.result];
        let Some(now) = staged.verdict(&r.from, &r.to) else {
            continue;
        };
        let differs = now != r.verdict;
        let seen = events
            .of_flow(plan.method.ip_protocol(), ends[c.source].addr, None, c.dest)
            .iter()
            .any(|e| e.staged.is_some());
        would += usize::from(seen);
        want += usize::from(differs);
        if seen != differs {
            wrong.push(format!(
                "{}: matrix --staged {} it, the staged view of its events {}",
                c.describe(plan),
                if differs {
                    "changes"
                } else {
                    "does not change"
                },
                if seen { "does" } else { "does not" }
            ));
        }
    }
    eprintln!(
        "ordnet lab: staged policies would change {would} probed flow{} (matrix --staged differs at {want})",
        if would == 1 { "" } else { "s" }
    );
    for w in &wrong {
        eprintln!("ordnet lab: staged: {w}");
    }
    wrong
}

/// Each check's events as JSON (`--observe -o json`).
fn json_events(flows: &[Vec<&FlowRecord>]) -> Vec<serde_json::Value> {
    flows
        .iter()
        .map(|f| serde_json::to_value(f).expect("the events serialize"))
        .collect()
}

/// The pod and external namespaces, and kube-proxy's rules in the node namespace (before any
/// probe: flows that start before a NAT table exists keep a null binding).
fn build_network(plan: &Plan, lab: &mut Running) -> Result<(), Fail> {
    let pods: Vec<(String, Vec<IpAddr>)> = plan
        .engine
        .endpoints()
        .iter()
        .map(|ep| (ep.id(), ep.ips.clone()))
        .collect();
    eprintln!(
        "ordnet lab: run {}: building {} pod namespace{} and {} external{}",
        lab.topo.run_id,
        pods.len(),
        if pods.len() == 1 { "" } else { "s" },
        plan.externals.len(),
        if plan.externals.len() == 1 { "" } else { "s" }
    );
    lab.topo.build(&pods, &plan.externals).map_err(lab_err)?;
    interrupted()?;
    for (n, netns) in lab.topo.nodes.iter().enumerate() {
        for v6 in [false, true] {
            let node: Vec<IpAddr> = topo::NODE_ADDRESSES[n]
                .iter()
                .copied()
                .filter(|ip| ip.is_ipv6() == v6)
                .collect();
            sys::nft(netns, &kubeproxy::ruleset(v6, &plan.kube_proxy, &node))
                .map_err(|e| lab_err(format!("loading kube-proxy's rules: {e}")))?;
        }
    }
    Ok(())
}

/// Creates each node's datapath and attaches both programs to every interface of its node
/// (the TC program alone to the overlay), from inside the node's namespace (interface names
/// resolve there; the maps and programs are global). Returns the index of every interface, by
/// node.
fn attach_datapaths(
    args: &LabArgs,
    plan: &Plan,
    lab: &mut Running,
) -> Result<Vec<HashMap<String, u32>>, Fail> {
    let mut out = Vec::new();
    for n in 0..lab.topo.nodes.len() {
        let (dp, ifindex) = attach_datapath(args, plan.node_engine(n), &lab.topo, n)?;
        let mut dp = dp;
        if args.observe
            && let Some(reader) = dp
                .events()
                .map_err(|e| lab_err(format!("the datapath's verdict events: {e}")))?
        {
            lab.events.push(reader);
        }
        lab.datapaths.push(dp);
        out.push(ifindex);
    }
    Ok(out)
}

/// Node `n`'s datapath, attached.
fn attach_datapath(
    args: &LabArgs,
    engine: &Engine,
    topo: &Topology,
    n: usize,
) -> Result<(Datapath, HashMap<String, u32>), Fail> {
    let node = sys::Netns::open(&topo.nodes[n]).map_err(lab_err)?;
    let ifaces = topo.xdp_interfaces(n);
    let tc_only = topo.tc_only_interfaces(n);
    let defaults = DatapathConfig::default();
    let rulesets = (engine.shared_mapstates() as u32 * 2 + 16).max(defaults.max_rulesets);
    let config = DatapathConfig {
        max_rulesets: rulesets,
        max_blocks: (rulesets * 4).max(defaults.max_blocks),
        // `--observe`: every event of the probes (a lab run is far below a million a second).
        events_per_sec: if args.observe { 1_000_000 } else { 0 },
        // As the agent programs its nodes (`--policy-classes`, on by default): the real
        // packets are judged by class keys, traces and matrices still by identities.
        classes: true,
        ..defaults
    };
    sys::in_netns(&node, || -> Result<_, LabError> {
        let datapath = |what: String| {
            move |source| LabError::Datapath {
                what,
                source: Box::new(source),
            }
        };
        let mut dp = Datapath::create(config).map_err(datapath("loading the datapath".into()))?;
        let mut ifindex = HashMap::new();
        for iface in ifaces.iter().chain(&tc_only) {
            if !tc_only.contains(iface) {
                dp.attach(iface, Default::default())
                    .map_err(datapath(format!(
                        "attaching XDP to {iface} in {}",
                        node.name
                    )))?;
            }
            dp.attach_tc(iface).map_err(datapath(format!(
                "attaching TC to {iface} in {}",
                node.name
            )))?;
            ifindex.insert(iface.clone(), sys::ifindex(iface)?);
        }
        Ok((dp, ifindex))
    })
    .map_err(lab_err)
}

/// The probed ends, in the expected matrix's order, and their index by name.
fn probed_ends(plan: &Plan, lab: &Running) -> Result<(Vec<End>, HashMap<String, usize>), Fail> {
    let mut ends: Vec<End> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut opened: HashMap<String, Arc<sys::Netns>> = HashMap::new();
    for label in &plan.expected.endpoints {
        let member = lab
            .topo
            .members
            .iter()
            .find(|m| &m.label == label)
            .ok_or_else(|| lab_err(format!("{label} was not built")))?;
        let addr = if member.external {
            member.ips[0]
        } else {
            member
                .ips
                .iter()
                .copied()
                .find(|ip| plan.family.contains(*ip))
                .ok_or_else(|| lab_err(format!("{label} has no address of the family")))?
        };
        let ns = match opened.get(&member.netns) {
            Some(ns) => ns.clone(),
            None => {
                let ns = Arc::new(sys::Netns::open(&member.netns).map_err(lab_err)?);
                opened.insert(member.netns.clone(), ns.clone());
                ns
            }
        };
        index.insert(label.clone(), ends.len());
        ends.push(End { netns: ns, addr });
    }
    Ok((ends, index))
}

/// Starts the servers, then the wiring check: with the programs attached and no endpoint
/// programmed every packet passes (no local endpoint), so every probe must connect
/// (kube-proxy's rules are in place).
fn start_servers_and_check_wiring(
    plan: &Plan,
    lab: &mut Running,
    ends: &[End],
    checks: &[Check],
    probes: &[Probe],
) -> Result<(), Fail> {
    let method = plan.method;
    let mut listeners: Vec<(End, u16)> = Vec::new();
    for c in checks {
        if let Some((end, port)) = &c.server
            && !listeners
                .iter()
                .any(|(e, p)| e.addr == ends[*end].addr && p == port)
        {
            listeners.push((ends[*end].clone(), *port));
        }
    }
    lab.servers = Some(probe::start_servers(&listeners, method).map_err(lab_err)?);

    let baseline = probe::probe_all(ends, probes, method, PROBE_TIMEOUT);
    interrupted()?;
    for (c, o) in checks.iter().zip(&baseline) {
        if !matches!(o, Outcome::Connected { .. }) {
            return Err(lab_err(format!(
                "wiring check failed: {} does not connect with no policy programmed: {}",
                c.describe(plan),
                describe(o)
            )));
        }
    }
    Ok(())
}

/// Programs each node's datapath as its agent does: the node's pods its local endpoints, its
/// addresses the node's; the TC hook knows each local pod's interface.
fn program_datapaths(
    plan: &Plan,
    lab: &mut Running,
    ifindex: &[HashMap<String, u32>],
) -> Result<(), Fail> {
    for (n, dp) in lab.datapaths.iter_mut().enumerate() {
        dp.ct_clear()
            .map_err(|e| lab_err(format!("clearing connection tracking: {e}")))?;
        let mut program = NodeProgram::new();
        program
            .set_host_addresses(dp, &topo::NODE_ADDRESSES[n])
            .and_then(|()| program.program_full(plan.node_engine(n), dp))
            .map_err(|e| lab_err(format!("programming the datapath: {e}")))?;
        for m in lab
            .topo
            .members
            .iter()
            .filter(|m| !m.external && m.node == n)
        {
            program
                .set_interface(dp, &m.label, ifindex[n].get(&m.host_if).copied())
                .map_err(|e| lab_err(format!("programming the datapath: {e}")))?;
        }
    }
    Ok(())
}

/// The measured run: probes every check and proves that every answered flow between two
/// namespaces went through the datapath (a program tracked it; the TC program the translated
/// flow of a Service). Returns the observed verdicts.
fn probe_and_verify(
    args: &LabArgs,
    plan: &Plan,
    lab: &Running,
    ends: &[End],
    checks: &[Check],
    probes: &[Probe],
) -> Result<Vec<Verdict>, Fail> {
    let method = plan.method;
    eprintln!(
        "ordnet lab: probing {} flows on {}/{} by {} (timeout {} ms)",
        checks.len(),
        load::protocol(args.protocol),
        args.port,
        method.describe(),
        PROBE_TIMEOUT.as_millis()
    );
    let t = Instant::now();
    let outcomes = probe::probe_all(ends, probes, method, PROBE_TIMEOUT);
    interrupted()?;
    eprintln!("ordnet lab: probed in {} ms", t.elapsed().as_millis());
    let mut observed = Vec::with_capacity(outcomes.len());
    for (c, o) in checks.iter().zip(&outcomes) {
        observed.push(match o {
            Outcome::Connected { .. } => Verdict::Allow,
            Outcome::TimedOut => Verdict::Deny,
            Outcome::Failed(e) => {
                return Err(lab_err(format!("probe {}: {e}", c.describe(plan))));
            }
        });
    }
    let mut tracked = HashSet::new();
    for dp in &lab.datapaths {
        tracked.extend(tracked_flows(dp).map_err(lab_err)?);
    }
    for (c, o) in checks.iter().zip(&outcomes) {
        if let Outcome::Connected { local } = o
            && let Some(server) = c.tracked_as
            && !tracked.contains(&flow_key(method.ip_protocol(), *local, server))
        {
            return Err(lab_err(format!(
                "{} connected ({local} -> {server}) but the datapath has no connection-tracking \
                 entry for it: the packets did not pass the datapath",
                c.describe(plan)
            )));
        }
    }
    Ok(observed)
}

/// One probed flow of a run and what it checks.
struct Check {
    /// Index into the expected matrix's results.
    result: usize,
    /// Towards a Service: the backend's index in the result's backends (and its steering
    /// index in kube-proxy's rules).
    backend: Option<(usize, usize)>,
    /// Distinguishes the Service probes of one source steered to the same range (several
    /// Services at once): each gets its own source ports, so no two flows share a tuple.
    slot: u16,
    /// A NodePort check (index into `Plan::node_ports`) instead of a matrix result.
    node_port: Option<usize>,
    source: usize,
    dest: SocketAddr,
    /// The server the flow reaches: (end, port).
    server: Option<(usize, u16)>,
    /// The flow as the datapath tracks it when allowed (`None`: not checked, e.g. a pod with
    /// itself, or a masqueraded hairpin).
    tracked_as: Option<SocketAddr>,
    expected: Verdict,
}

impl Check {
    /// The probe of attempt `attempt` (`< ATTEMPTS`; a Service probe gets a fresh steering port
    /// per attempt and slot).
    fn probe(&self, attempt: u16) -> Probe {
        Probe {
            source: self.source,
            dest: self.dest,
            sport: self.backend.map_or(0, |(_, steer)| {
                kubeproxy::steer_port(steer, self.slot * ATTEMPTS + attempt)
            }),
        }
    }

    fn describe(&self, plan: &Plan) -> String {
        if let Some(i) = self.node_port {
            let n = &plan.node_ports[i];
            return format!(
                "{} -> {} (NodePort {}, to {})",
                n.from, n.service, n.dest, n.backend
            );
        }
        let r = &plan.expected.results[self.result];
        match self.backend {
            Some((b, _)) => format!("{} -> {} (to {})", r.from, r.to, r.backends[b].to),
            None => format!("{} -> {}", r.from, r.to),
        }
    }
}

/// Every flow of a run: one per matrix pair, one per backend towards a Service (steered by its
/// source port), and the NodePort checks.
fn probe_plan(
    args: &LabArgs,
    plan: &Plan,
    ends: &[End],
    index: &HashMap<String, usize>,
) -> Result<Vec<Check>, Fail> {
    let port = args.port;
    let proto = load::protocol(args.protocol);
    let services = plan.engine.service_destinations(proto, port, plan.family);
    let kube = |svc: &str| {
        plan.kube_proxy.iter().find(|sp| {
            format!("svc:{}", sp.service) == svc
                && sp.protocol == proto
                && sp.port == port
                && plan.family.contains(sp.addresses[0])
        })
    };
    let mut out = Vec::new();
    for (i, r) in plan.expected.results.iter().enumerate() {
        let source = index[&r.from];
        if let Some(&d) = index.get(&r.to) {
            let dest = SocketAddr::new(ends[d].addr, port);
            out.push(Check {
                result: i,
                backend: None,
                slot: 0,
                node_port: None,
                source,
                dest,
                server: Some((d, port)),
                tracked_as: (source != d).then_some(dest),
                expected: if r.verdict == MatrixVerdict::Allow {
                    Verdict::Allow
                } else {
                    Verdict::Deny
                },
            });
            continue;
        }
        let svc = services
            .iter()
            .find(|s| s.name == r.to)
            .ok_or_else(|| lab_err(format!("{} is not a Service of the manifests", r.to)))?;
        let rules =
            kube(&r.to).ok_or_else(|| lab_err(format!("kube-proxy has no rules for {}", r.to)))?;
        for (b, bv) in r.backends.iter().enumerate() {
            let (_, addr, bport) = svc
                .backends
                .iter()
                .find(|(pod, _, _)| *pod == bv.to)
                .ok_or_else(|| lab_err(format!("{} has no backend {}", r.to, bv.to)))?;
            let steer = rules
                .backends
                .iter()
                .position(|be| *be == (*addr, *bport))
                .ok_or_else(|| lab_err(format!("kube-proxy's rules miss {} of {}", bv.to, r.to)))?;
            let d = index[&bv.to];
            out.push(Check {
                result: i,
                backend: Some((b, steer)),
                slot: 0,
                node_port: None,
                source,
                dest: SocketAddr::new(svc.frontend, port),
                server: Some((d, *bport)),
                tracked_as: (source != d).then_some(SocketAddr::new(*addr, *bport)),
                expected: bv.verdict,
            });
        }
    }
    for (n, np) in plan.node_ports.iter().enumerate() {
        let d = index[&np.backend];
        let bport = plan
            .kube_proxy
            .iter()
            .find(|sp| format!("svc:{}", sp.service) == np.service && sp.node_port.is_some())
            .and_then(|sp| sp.backends.get(np.steer))
            .map(|(_, p)| *p)
            .unwrap_or(port);
        out.push(Check {
            result: usize::MAX,
            backend: Some((0, np.steer)),
            slot: 0,
            node_port: Some(n),
            source: index[&np.from],
            dest: np.dest,
            server: Some((d, bport)),
            // Masqueraded (Cluster) to a random port: not checked.
            tracked_as: np.local.then_some(SocketAddr::new(ends[d].addr, bport)),
            expected: np.expected,
        });
    }
    // Source ports: the n-th Service probe of a source in a steering range gets slot n.
    let mut slots: HashMap<(usize, usize), u16> = HashMap::new();
    for c in &mut out {
        if let Some((_, steer)) = c.backend {
            let n = slots.entry((c.source, steer)).or_default();
            if (*n + 1) * ATTEMPTS > kubeproxy::STEER_STRIDE {
                return Err(lab_err(format!(
                    "{} probes more than {} Services from one end; the lab's source-port \
                     steering has room for that many",
                    plan.expected
                        .results
                        .get(c.result)
                        .map_or("a NodePort check", |r| &r.from),
                    kubeproxy::STEER_STRIDE / ATTEMPTS
                )));
            }
            c.slot = *n;
            *n += 1;
        }
    }
    Ok(out)
}

fn describe(o: &Outcome) -> String {
    match o {
        Outcome::Connected { local } => format!("connected from {local}"),
        Outcome::TimedOut => format!("no answer within {} ms", PROBE_TIMEOUT.as_millis()),
        Outcome::Failed(e) => e.clone(),
    }
}

type FlowKey = (u8, (IpAddr, u16), (IpAddr, u16));

fn flow_key(proto: u8, a: SocketAddr, b: SocketAddr) -> FlowKey {
    let (a, b) = ((a.ip(), a.port()), (b.ip(), b.port()));
    if a <= b { (proto, a, b) } else { (proto, b, a) }
}

/// The flows in the datapath's connection-tracking maps.
fn tracked_flows(dp: &Datapath) -> Result<HashSet<FlowKey>, LabError> {
    let entries = dp.ct_entries().map_err(|source| LabError::Datapath {
        what: "reading connection tracking".into(),
        source: Box::new(source),
    })?;
    let ip = |family: u8, w: [u32; 4]| -> IpAddr {
        let key = ordnet_datapath::common::layout::IpKey::new(family, w);
        ordnet_datapath::key_ip(&key)
    };
    Ok(entries
        .iter()
        .map(|(k, _)| {
            flow_key(
                k.protocol,
                SocketAddr::new(ip(k.family, k.addr_a), k.port_a),
                SocketAddr::new(ip(k.family, k.addr_b), k.port_b),
            )
        })
        .collect())
}

/// Prints observed against expected (table or JSON) and returns the exit code.
fn report(
    args: &LabArgs,
    plan: &Plan,
    checks: &[Check],
    observed: &[Verdict],
    events: Option<(String, Vec<serde_json::Value>)>,
) -> Result<ExitCode, Fail> {
    let seen = Observed::new(plan, checks, observed);
    match args.output {
        TableOrJson::Json => print_json(
            plan,
            checks,
            &seen,
            events.as_ref().map(|(_, j)| j.as_slice()),
        ),
        TableOrJson::Table => {
            print_table(args, plan, checks, &seen);
            if let Some((text, _)) = &events {
                print!("{text}");
            }
        }
    }
    if seen.mismatches.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "ordnet lab: {} of {} flows observed differently from the expected verdict",
            seen.mismatches.len(),
            checks.len()
        );
        Ok(ExitCode::from(EXIT_MISMATCH))
    }
}

/// What the probes saw, arranged for the report.
struct Observed<'a> {
    /// Checks whose observed verdict is not the expected one.
    mismatches: Vec<(&'a Check, Verdict)>,
    /// Per matrix result: (backend index for a Service, observed verdict) of its checks.
    per_result: BTreeMap<usize, Vec<(Option<usize>, Verdict)>>,
    /// The NodePort checks with their observed verdicts.
    node_port_rows: Vec<(&'a NodePortCheck, Verdict)>,
}

impl<'a> Observed<'a> {
    fn new(plan: &'a Plan, checks: &'a [Check], observed: &[Verdict]) -> Observed<'a> {
        let mismatches = checks
            .iter()
            .zip(observed)
            .filter(|(c, o)| c.expected != **o)
            .map(|(c, o)| (c, *o))
            .collect();
        let mut per_result: BTreeMap<usize, Vec<(Option<usize>, Verdict)>> = BTreeMap::new();
        for (c, o) in checks.iter().zip(observed) {
            if c.node_port.is_none() {
                per_result
                    .entry(c.result)
                    .or_default()
                    .push((c.backend.map(|(b, _)| b), *o));
            }
        }
        let node_port_rows = checks
            .iter()
            .zip(observed)
            .filter_map(|(c, o)| c.node_port.map(|n| (&plan.node_ports[n], *o)))
            .collect();
        Observed {
            mismatches,
            per_result,
            node_port_rows,
        }
    }

    /// The observed verdict of matrix result `i` (a Service: of all its backends).
    fn of(&self, i: usize) -> MatrixVerdict {
        MatrixVerdict::of(
            self.per_result
                .get(&i)
                .into_iter()
                .flatten()
                .map(|(_, v)| *v),
        )
    }
}

/// `-o json`: the matrix object with every verdict observed, plus `expected` (and a mixed
/// Service's backends, and the NodePort rows).
fn print_json(
    plan: &Plan,
    checks: &[Check],
    seen: &Observed<'_>,
    events: Option<&[serde_json::Value]>,
) {
    let m = &plan.expected;
    // `--observe`: the events of the checks of result `i` (and backend `b`), concatenated.
    let events_of = |i: usize, b: Option<usize>| -> Option<serde_json::Value> {
        let events = events?;
        let all: Vec<serde_json::Value> = checks
            .iter()
            .zip(events)
            .filter(|(c, _)| {
                c.node_port.is_none() && c.result == i && c.backend.map(|(b, _)| b) == b
            })
            .flat_map(|(_, e)| e.as_array().cloned().unwrap_or_default())
            .collect();
        Some(serde_json::Value::from(all))
    };
    let (per_result, node_port_rows) = (&seen.per_result, &seen.node_port_rows);
    let observed_of = |i: usize| seen.of(i);
    let mut v = serde_json::to_value(m).expect("the matrix serializes");
    if let Some(results) = v.get_mut("results").and_then(|r| r.as_array_mut()) {
        for (i, (entry, r)) in results.iter_mut().zip(&m.results).enumerate() {
            entry["verdict"] = serde_json::Value::from(observed_of(i).as_str());
            entry["expected"] = serde_json::Value::from(r.verdict.as_str());
            if r.backends.is_empty()
                && let Some(e) = events_of(i, None)
            {
                entry["events"] = e;
            }
            if !r.backends.is_empty() {
                let backends: Vec<serde_json::Value> = r
                    .backends
                    .iter()
                    .enumerate()
                    .map(|(b, bv)| {
                        let seen = per_result
                            .get(&i)
                            .and_then(|v| v.iter().find(|(k, _)| *k == Some(b)))
                            .map_or("deny", |(_, v)| v.as_str());
                        let mut j = serde_json::json!({
                            "to": bv.to,
                            "verdict": seen,
                            "expected": bv.verdict.as_str(),
                        });
                        if let Some(e) = events_of(i, Some(b)) {
                            j["events"] = e;
                        }
                        j
                    })
                    .collect();
                entry["backends"] = serde_json::Value::from(backends);
            }
        }
    }
    if !node_port_rows.is_empty() {
        v["nodePorts"] = node_port_rows
            .iter()
            .map(|(n, o)| {
                serde_json::json!({
                    "from": n.from,
                    "to": n.service,
                    "nodePort": n.dest.to_string(),
                    "externalTrafficPolicy": if n.local { "Local" } else { "Cluster" },
                    "backend": n.backend,
                    "verdict": o.as_str(),
                    "expected": n.expected.as_str(),
                })
            })
            .collect();
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&v).expect("JSON serializes")
    );
}

/// `-o table`: the observed and expected grids, the NodePort rows, and the differences.
fn print_table(args: &LabArgs, plan: &Plan, checks: &[Check], seen: &Observed<'_>) {
    let m = &plan.expected;
    let (mismatches, node_port_rows) = (&seen.mismatches, &seen.node_port_rows);
    let observed_of = |i: usize| seen.of(i);
    let style = Style::new(render::color_wanted());
    let max_width = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(160);
    let proto = load::protocol(args.protocol);
    let grid = |title: &str, verdicts: BTreeMap<(String, String), MatrixVerdict>| {
        render::verdict_grid(
            &format!("{title} {proto}/{}", args.port),
            &m.endpoints,
            &m.services,
            &verdicts,
            style,
            max_width,
        )
    };
    let obs = m
        .results
        .iter()
        .enumerate()
        .map(|(i, r)| ((r.from.clone(), r.to.clone()), observed_of(i)))
        .collect();
    let exp = m
        .results
        .iter()
        .map(|r| ((r.from.clone(), r.to.clone()), r.verdict))
        .collect();
    print!("{}\n{}\n", grid("observed", obs), grid("expected", exp));
    if !node_port_rows.is_empty() {
        println!("NodePorts from the external addresses (one flow per backend):");
        for (n, o) in node_port_rows {
            println!(
                "  {} -> {} via {} ({}) to {}: observed {}, expected {}",
                n.from,
                n.service,
                n.dest,
                if n.local {
                    "Local: client address kept"
                } else {
                    "Cluster: masqueraded to the node"
                },
                n.backend,
                o.as_str(),
                n.expected.as_str()
            );
        }
        println!();
    }
    if mismatches.is_empty() {
        println!(
            "{}",
            style.green(&format!(
                "observed = expected for all {} flows",
                checks.len()
            ))
        );
    } else {
        println!(
            "{}",
            style.red(&format!(
                "{} of {} flows differ:",
                mismatches.len(),
                checks.len()
            ))
        );
        for (c, o) in mismatches {
            println!(
                "  {}: observed {}, expected {}",
                c.describe(plan),
                o.as_str(),
                c.expected.as_str()
            );
        }
    }
}

/// How to poke at an interactive lab.
fn print_guide(args: &LabArgs, plan: &Plan, lab: &Running) {
    let topo = &lab.topo;
    let mut rows = vec![vec![
        render::Cell::plain("endpoint"),
        render::Cell::plain("namespace"),
        render::Cell::plain("addresses"),
        render::Cell::plain("veth (node side)"),
    ]];
    for m in &topo.members {
        let ips: Vec<String> = m.ips.iter().map(|ip| ip.to_string()).collect();
        let veth = if m.external {
            format!("{} in {} (via uplink)", m.host_if, topo.world)
        } else if topo.nodes.len() > 1 {
            format!("{} in {}", m.host_if, topo.nodes[m.node])
        } else {
            m.host_if.clone()
        };
        rows.push(vec![
            render::Cell::plain(m.label.clone()),
            render::Cell::plain(m.netns.clone()),
            render::Cell::plain(ips.join(",")),
            render::Cell::plain(veth),
        ]);
    }
    let proto = load::protocol(args.protocol);
    for (n, node) in topo.nodes.iter().enumerate() {
        let tc = topo.tc_only_interfaces(n);
        println!(
            "ordnet lab run {} is up; XDP on {} in namespace {node}{}.",
            topo.run_id,
            topo.xdp_interfaces(n).join(", "),
            if tc.is_empty() {
                String::new()
            } else {
                format!(" (TC only on {})", tc.join(", "))
            }
        );
    }
    print!("{}", render::table(&rows, &[], 2));
    println!(
        "\nEvery endpoint serves {proto} port {} at its {} address.",
        args.port,
        match plan.family {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    );
    if let (Some(a), Some(b)) = (topo.members.first(), topo.members.get(1)) {
        let dst = b
            .ips
            .iter()
            .find(|ip| plan.family.contains(**ip))
            .or(b.ips.first());
        println!("Try:");
        println!(
            "  ip netns exec {} bash                # a shell as {}",
            a.netns, a.label
        );
        if let Some(dst) = dst {
            let probe_cmd = match plan.method {
                Method::Tcp => Some(format!("nc -vz -w 2 {dst} {}", args.port)),
                Method::Udp => Some(format!("nc -vu -w 2 {dst} {}", args.port)),
                Method::SctpSocket => Some(format!("ncat --sctp -w 2 {dst} {}", args.port)),
                Method::SctpRaw => None,
            };
            match probe_cmd {
                Some(cmd) => println!(
                    "  ip netns exec {} {cmd}   # {} -> {}",
                    a.netns, a.label, b.label
                ),
                None => println!(
                    "  (SCTP: this kernel has no SCTP sockets; the servers answer an INIT with an \
                     INIT-ACK over raw sockets, which `ordnet lab --probe --protocol SCTP` uses)"
                ),
            }
        }
    }
    for node in &topo.nodes {
        println!(
            "  ip netns exec {node} ip -d link show         # the XDP program on the node's interfaces"
        );
    }
    println!("Expected verdicts (ordnet matrix):");
    let verdicts = plan
        .expected
        .results
        .iter()
        .map(|r| ((r.from.clone(), r.to.clone()), r.verdict))
        .collect();
    print!(
        "{}",
        render::verdict_grid(
            &format!("{proto}/{}", args.port),
            &plan.expected.endpoints,
            &plan.expected.services,
            &verdicts,
            Style::new(render::color_wanted()),
            160
        )
    );
    println!("Press Ctrl-C to remove the lab.");
}
