//! `ordnet lab`: the pods of the manifests as network namespaces on this machine, enforced by
//! the XDP datapath exactly as the agent programs it, and (with `--probe`) real connections
//! between every ordered pair compared with what `ordnet matrix` computes. See `docs/lab.md`.
//!
//! Exit codes: 0 done (with `--probe`: every pair observed as expected); 1 invalid manifests;
//! 2 usage; 3 some pair observed differently from the expected verdict; 4 the lab could not be
//! built or run (not root, another lab active, a system or probe error); 128 + signal when a
//! `--probe` run is interrupted (an interactive lab ends normally on Ctrl-C: 0).

mod probe;
mod sctp;
mod sys;
mod topo;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ordnet::program::NodeProgram;
use ordnet_datapath::{Datapath, DatapathConfig};
use ordnet_engine::{Engine, IpFamily, Matrix};
use ordnet_mapstate::Verdict;

use crate::cli::load;
use crate::cli::{LabArgs, Source, TableOrJson};
use ordnet::render::{self, Style};
use probe::{End, Method, Outcome};
use topo::Topology;

/// How long a probe waits for an answer before it counts as denied (a TCP SYN is retransmitted
/// after 1 s; UDP requests and SCTP INITs every 300 ms).
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);

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

fn lab_err(msg: impl Into<String>) -> Fail {
    fail(EXIT_LAB, msg)
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
    engine: Engine,
    expected: Matrix,
    family: IpFamily,
    externals: Vec<IpAddr>,
    method: Method,
}

fn plan(args: &LabArgs) -> Result<Plan, Fail> {
    let family = match args.family {
        4 => IpFamily::V4,
        6 => IpFamily::V6,
        other => return Err(fail(2, format!("--family must be 4 or 6, not {other}"))),
    };
    if args.probe && args.port == 0 {
        return Err(fail(2, "--port 0 cannot be probed (use 1-65535)"));
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
    let source = Source {
        files: args.files.clone(),
        agent: None,
    };
    let loaded = load::load_engine("lab", &source).map_err(|code| Fail {
        // load_engine printed the problems; its exit code is CLI.md's.
        code: if code == ExitCode::from(1) { 1 } else { 2 },
        msg: String::new(),
    })?;
    // The lab builds only valid input (rules enforced fail-closed are for the agent and for
    // `matrix`, which say so and exit 1).
    if loaded.exit != ExitCode::SUCCESS {
        return Err(fail(1, "the manifests have errors; nothing built"));
    }
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
    for ip in &externals {
        if let Some(pod) = owner.get(ip) {
            return Err(fail(
                2,
                format!("--external {ip} is the address of pod {pod}"),
            ));
        }
    }
    let proto = load::protocol(args.protocol);
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
    Ok(Plan {
        engine,
        expected,
        family,
        externals,
        method,
    })
}

/// Everything a running lab holds, released in field order: servers, then the datapath
/// (detaching XDP), then the namespaces, then the lock.
struct Running {
    servers: Option<probe::Servers>,
    datapath: Option<Datapath>,
    topo: Topology,
    _lock: sys::LabLock,
}

impl Running {
    fn shutdown(&mut self) -> Result<(), String> {
        self.servers = None;
        self.datapath = None;
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
        datapath: None,
        topo: Topology::new(&run_id),
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

    // The datapath is created and attached from inside the node namespace (interface names
    // resolve there); its maps and program are global.
    let node = sys::Netns::open(&lab.topo.node).map_err(lab_err)?;
    let ifaces = lab.topo.xdp_interfaces();
    let defaults = DatapathConfig::default();
    let rulesets = (plan.engine.shared_mapstates() as u32 * 2 + 16).max(defaults.max_rulesets);
    let config = DatapathConfig {
        max_rulesets: rulesets,
        max_blocks: (rulesets * 4).max(defaults.max_blocks),
        ..defaults
    };
    let dp = sys::in_netns(&node, || {
        let mut dp =
            Datapath::create(config).map_err(|e| format!("loading the XDP datapath: {e}"))?;
        for iface in &ifaces {
            dp.attach(iface, Default::default())
                .map_err(|e| format!("attaching XDP to {iface} in {}: {e}", node.name))?;
        }
        Ok(dp)
    })
    .map_err(lab_err)?;
    lab.datapath = Some(dp);
    interrupted()?;

    // Probed ends, in the expected matrix's order.
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
    let method = plan.method;
    lab.servers = Some(probe::start_servers(&ends, method, args.port).map_err(lab_err)?);
    let pairs: Vec<(usize, usize)> = plan
        .expected
        .results
        .iter()
        .map(|r| (index[&r.from], index[&r.to]))
        .collect();

    // Wiring check: with the program attached and no endpoint programmed, every packet passes
    // (no local endpoint), so every pair must connect.
    let baseline = probe::probe_all(&ends, &pairs, method, args.port, PROBE_TIMEOUT);
    interrupted()?;
    for (r, o) in plan.expected.results.iter().zip(&baseline) {
        if !matches!(o, Outcome::Connected { .. }) {
            return Err(lab_err(format!(
                "wiring check failed: {} -> {} does not connect with no policy programmed: {}",
                r.from,
                r.to,
                describe(o)
            )));
        }
    }
    let dp = lab.datapath.as_mut().expect("datapath");
    dp.ct_clear()
        .map_err(|e| lab_err(format!("clearing connection tracking: {e}")))?;
    // The agent's code path: every pod is a local endpoint of this node.
    NodeProgram::new()
        .program_full(&plan.engine, dp)
        .map_err(|e| lab_err(format!("programming the datapath: {e}")))?;
    eprintln!(
        "ordnet lab: run {} up in {} ms: XDP on {} interfaces of namespace {}",
        lab.topo.run_id,
        started.elapsed().as_millis(),
        ifaces.len(),
        lab.topo.node
    );
    interrupted()?;

    if !args.probe {
        print_guide(args, plan, lab);
        while sys::interrupted().is_none() {
            std::thread::sleep(Duration::from_millis(100));
        }
        return Ok(ExitCode::SUCCESS);
    }

    eprintln!(
        "ordnet lab: probing {} pairs on {}/{} by {} (timeout {} ms)",
        pairs.len(),
        load::protocol(args.protocol),
        args.port,
        method.describe(),
        PROBE_TIMEOUT.as_millis()
    );
    let t = Instant::now();
    let outcomes = probe::probe_all(&ends, &pairs, method, args.port, PROBE_TIMEOUT);
    interrupted()?;
    eprintln!("ordnet lab: probed in {} ms", t.elapsed().as_millis());
    let mut observed = Vec::with_capacity(outcomes.len());
    for (r, o) in plan.expected.results.iter().zip(&outcomes) {
        observed.push(match o {
            Outcome::Connected { .. } => Verdict::Allow,
            Outcome::TimedOut => Verdict::Deny,
            Outcome::Failed(e) => {
                return Err(lab_err(format!("probe {} -> {}: {e}", r.from, r.to)));
            }
        });
    }
    // Every answered pair between two different namespaces went through XDP: the program
    // tracked it. (A pod with itself talks over its loopback.)
    let dp = lab.datapath.as_ref().expect("datapath");
    let tracked = tracked_flows(dp).map_err(lab_err)?;
    for ((r, o), &(s, d)) in plan.expected.results.iter().zip(&outcomes).zip(&pairs) {
        if let Outcome::Connected { local } = o
            && s != d
        {
            let server = SocketAddr::new(ends[d].addr, args.port);
            if !tracked.contains(&flow_key(method.ip_protocol(), *local, server)) {
                return Err(lab_err(format!(
                    "{} -> {} connected ({local} -> {server}) but the XDP program has no \
                     connection-tracking entry for it: the packets did not pass the datapath",
                    r.from, r.to
                )));
            }
        }
    }
    report(args, plan, &observed)
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
fn tracked_flows(dp: &Datapath) -> Result<HashSet<FlowKey>, String> {
    let entries = dp
        .ct_entries()
        .map_err(|e| format!("reading connection tracking: {e}"))?;
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
fn report(args: &LabArgs, plan: &Plan, observed: &[Verdict]) -> Result<ExitCode, Fail> {
    let m = &plan.expected;
    let mismatches: Vec<(usize, Verdict, Verdict)> = m
        .results
        .iter()
        .zip(observed)
        .enumerate()
        .filter(|(_, (r, o))| r.verdict != **o)
        .map(|(i, (r, o))| (i, *o, r.verdict))
        .collect();
    match args.output {
        TableOrJson::Json => {
            let mut v = serde_json::to_value(m).expect("the matrix serializes");
            if let Some(results) = v.get_mut("results").and_then(|r| r.as_array_mut()) {
                for ((entry, r), o) in results.iter_mut().zip(&m.results).zip(observed) {
                    entry["verdict"] = serde_json::Value::from(o.as_str());
                    entry["expected"] = serde_json::Value::from(r.verdict.as_str());
                }
            }
            println!(
                "{}",
                serde_json::to_string_pretty(&v).expect("JSON serializes")
            );
        }
        TableOrJson::Table => {
            let style = Style::new(render::color_wanted());
            let max_width = std::env::var("COLUMNS")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(160);
            let proto = load::protocol(args.protocol);
            let grid = |title: &str, verdicts: BTreeMap<(String, String), Verdict>| {
                render::verdict_grid(
                    &format!("{title} {proto}/{}", args.port),
                    &m.endpoints,
                    &verdicts,
                    style,
                    max_width,
                )
            };
            let obs = m
                .results
                .iter()
                .zip(observed)
                .map(|(r, o)| ((r.from.clone(), r.to.clone()), *o))
                .collect();
            let exp = m
                .results
                .iter()
                .map(|r| ((r.from.clone(), r.to.clone()), r.verdict))
                .collect();
            print!("{}\n{}\n", grid("observed", obs), grid("expected", exp));
            if mismatches.is_empty() {
                println!(
                    "{}",
                    style.green(&format!(
                        "observed = expected for all {} pairs",
                        m.results.len()
                    ))
                );
            } else {
                println!(
                    "{}",
                    style.red(&format!(
                        "{} of {} pairs differ:",
                        mismatches.len(),
                        m.results.len()
                    ))
                );
                for (i, o, e) in &mismatches {
                    let r = &m.results[*i];
                    println!(
                        "  {} -> {}: observed {}, expected {}",
                        r.from,
                        r.to,
                        o.as_str(),
                        e.as_str()
                    );
                }
            }
        }
    }
    if mismatches.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "ordnet lab: {} of {} pairs observed differently from the expected verdict",
            mismatches.len(),
            m.results.len()
        );
        Ok(ExitCode::from(EXIT_MISMATCH))
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
    println!(
        "ordnet lab run {} is up; XDP on {} in namespace {}.",
        topo.run_id,
        topo.xdp_interfaces().join(", "),
        topo.node
    );
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
    println!(
        "  ip netns exec {} ip -d link show         # the XDP program on the node's interfaces",
        topo.node
    );
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
            &verdicts,
            Style::new(render::color_wanted()),
            160
        )
    );
    println!("Press Ctrl-C to remove the lab.");
}
