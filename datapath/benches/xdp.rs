//! `cargo bench -p ordnet-datapath` (as root): the per-packet cost of the policy layouts, of
//! the full XDP program and of the TC program (after Service translation), and the time to apply rule sets, all measured in one run on this
//! machine and printed with their ratios (`docs/datapath.md` §8). Nothing timed is asserted;
//! every program's verdict on every measured packet is checked against `MapState::lookup`.
//!
//! Environment: `ORDNET_BENCH_REPEAT` (default 1 000 000 runs per measurement),
//! `ORDNET_BENCH_ROUNDS` (default 5; the median is reported), `ORDNET_BENCH_SIZES`
//! (default `10,1000,16384,100000` policy entries).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use ordnet_datapath::{
    ControlPlane as _, Datapath, DatapathConfig, EndpointSpec, IpNet, XdpAction,
    bench::{BenchObject, Layout},
    common::{TCP_ACK, TCP_SYN, craft, craft::L4},
    flatten,
};
use ordnet_mapstate::{
    Direction, EntryId, L4Match, MapState, OrderKey, Origin, PolicyEntry, Protocol, Selector,
    Verdict,
};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn entry(
    id: u64,
    order: OrderKey,
    verdict: Verdict,
    selector: Selector,
    l4: L4Match,
) -> PolicyEntry {
    PolicyEntry {
        id: EntryId(id),
        order,
        action: verdict.into(),
        selector,
        l4,
        origin: Arc::new(Origin {
            kind: "Bench".into(),
            namespace: None,
            name: format!("e{id}"),
            direction: Direction::Egress,
            rule_index: order.index,
            rule_name: None,
            priority: order.priority,
            action: verdict.into(),
            tier: ordnet_mapstate::Tier::Ordnet,
            passed_by: None,
        }),
    }
}

/// Identities used by the rule set: `1..=identities(n)`.
fn identities(n: usize) -> u32 {
    (n as u32 / 8).max(1)
}

/// Port of the `j`-th key of identity `i` (spread over the TCP port space).
fn port(i: u32, j: u32) -> u16 {
    (1024 + (i.wrapping_mul(7919) + j * 4099) % 60000) as u16
}

/// Rule set shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Shape {
    /// Identity keys are single ports only.
    Narrow,
    /// Also a protocol-wide TCP allow for every 16th identity: cells hold keys of several
    /// lengths, and the class layout multiplies (identity x class).
    Mixed,
}

/// A rule set of about `n` keys: 8 single-port TCP allows per identity, a few wildcard keys
/// (deny TCP/22 for everyone first, allow UDP/53, allow TCP 8080-8095 for everyone), in the
/// mixed shape a protocol-wide TCP allow for every 16th identity; isolation default deny.
fn ruleset(n: usize, shape: Shape) -> (MapState, Vec<PolicyEntry>) {
    let ids = identities(n);
    let mut entries = vec![
        entry(
            0,
            OrderKey::new(-1, 0),
            Verdict::Deny,
            Selector::Any,
            L4Match::port(Protocol::Tcp, 22),
        ),
        entry(
            1,
            OrderKey::new(0, 0),
            Verdict::Allow,
            Selector::Any,
            L4Match::port(Protocol::Udp, 53),
        ),
        entry(
            2,
            OrderKey::new(0, 1),
            Verdict::Allow,
            Selector::Any,
            L4Match::Ports {
                proto: Protocol::Tcp,
                first: 8080,
                last: 8095,
            },
        ),
    ];
    let per = if n < 8 { n as u32 } else { 8 };
    let mut next = 3;
    for i in 1..=ids {
        for j in 0..per {
            entries.push(entry(
                next,
                OrderKey::new(10, j),
                Verdict::Allow,
                Selector::ids([i]),
                L4Match::port(Protocol::Tcp, port(i, j)),
            ));
            next += 1;
        }
        if shape == Shape::Mixed && i % 16 == 0 {
            entries.push(entry(
                next,
                OrderKey::new(20, 0),
                Verdict::Allow,
                Selector::ids([i]),
                L4Match::Proto(Protocol::Tcp),
            ));
            next += 1;
        }
    }
    let ms = MapState::build(Direction::Egress, Verdict::Deny, entries.iter().cloned()).unwrap();
    (ms, entries)
}

/// The identity whose packets are measured: the middle one.
fn probe_identity(n: usize) -> u32 {
    identities(n) / 2 + 1
}

fn v4(identity: u32) -> [u8; 4] {
    [
        10,
        (identity >> 16) as u8,
        (identity >> 8) as u8,
        identity as u8,
    ]
}

/// A 64-byte IPv4 TCP frame (54 bytes of headers, zero padding).
fn frame64(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut f = craft::ipv4_frame_between(
        src,
        dst,
        L4::TcpFlags {
            sport,
            dport,
            flags,
        },
    );
    f.resize(64, 0);
    f
}

/// `frame` grown to `len` bytes of the same flow (IP length and checksum updated).
fn sized(frame: Vec<u8>, len: usize) -> Vec<u8> {
    let mut f = frame;
    f.truncate(54);
    craft::with_payload(&f, len).expect("an IPv4 TCP frame")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

struct Probe {
    name: &'static str,
    frame: Vec<u8>,
    want: XdpAction,
}

fn probes(ms: &MapState, n: usize) -> Vec<Probe> {
    let id = probe_identity(n);
    let want = |identity: u32, port: u16| {
        if ms.lookup(Some(identity), 6, port).verdict() == Verdict::Allow {
            XdpAction::Pass
        } else {
            XdpAction::Drop
        }
    };
    // Identity 0xabcdef has no keys: decided by `*` or the default.
    let none = 0x00ab_cdef;
    vec![
        Probe {
            name: "SYN, identity's own /24 allow",
            frame: frame64(v4(id), [10, 200, 0, 1], 40000, port(id, 3), TCP_SYN),
            want: want(id, port(id, 3)),
        },
        Probe {
            name: "SYN, wildcard allow (TCP/8085)",
            frame: frame64(v4(none), [10, 200, 0, 1], 40000, 8085, TCP_SYN),
            want: want(none, 8085),
        },
        Probe {
            name: "SYN, no key: default deny",
            frame: frame64(v4(none), [10, 200, 0, 1], 40000, 7, TCP_SYN),
            want: want(none, 7),
        },
    ]
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: the XDP benchmark needs root (BPF_PROG_TEST_RUN)");
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let repeat = env("ORDNET_BENCH_REPEAT", 1_000_000) as u32;
    let rounds = env("ORDNET_BENCH_ROUNDS", 5) as usize;
    let sizes: Vec<usize> = std::env::var("ORDNET_BENCH_SIZES")
        .unwrap_or_else(|_| "10,1000,16384,100000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    println!(
        "ordnet XDP benchmark: BPF_PROG_TEST_RUN, repeat {repeat}, median of {rounds} rounds, \
         kernel-reported ns/packet (64-byte IPv4 TCP frames)\n"
    );
    // `ORDNET_BENCH_ONLY=events`: the verdict events' table alone (at the first size).
    if std::env::var("ORDNET_BENCH_ONLY").is_ok_and(|v| v == "events") {
        events_overhead(sizes[0], &ruleset(sizes[0], Shape::Mixed).0, repeat, rounds);
        return;
    }
    // `ORDNET_BENCH_ONLY=real`: the whole path with real packets alone.
    if std::env::var("ORDNET_BENCH_ONLY").is_ok_and(|v| v == "real") {
        real_path(&BTreeMap::new());
        return;
    }
    // `ORDNET_BENCH_ONLY=full`: the full program's rows alone (no layouts, no floor), and with
    // `ORDNET_BENCH_ROW=<text>` only the XDP rows whose name contains it: a few seconds per
    // run, to compare two builds run after run.
    if std::env::var("ORDNET_BENCH_ONLY").is_ok_and(|v| v == "full") {
        let mut full_ns: BTreeMap<(usize, &'static str), f64> = BTreeMap::new();
        for &n in &sizes {
            let (ms, _) = ruleset(n, Shape::Mixed);
            full_program(n, &ms, repeat, rounds, &mut full_ns);
        }
        println!("Full ordnet program, Mixed rule set (ns/packet):");
        for ((n, name), v) in &full_ns {
            println!("{name:>50} {n:>8} entries {v:8.1}");
        }
        return;
    }
    let shapes = [Shape::Narrow, Shape::Mixed];
    let mut varied_ns: BTreeMap<(Shape, usize, Layout), f64> = BTreeMap::new();
    let mut layout_ns: BTreeMap<(Shape, usize, Layout, usize), f64> = BTreeMap::new();
    let mut full_ns: BTreeMap<(usize, &'static str), f64> = BTreeMap::new();
    let mut floor_ns: BTreeMap<usize, f64> = BTreeMap::new();
    for &n in &sizes {
        for shape in shapes {
            let t = Instant::now();
            let (ms, _) = ruleset(n, shape);
            let build = t.elapsed();
            layouts(
                n,
                shape,
                &ms,
                repeat,
                rounds,
                &mut layout_ns,
                &mut varied_ns,
                build,
            );
            if shape == Shape::Mixed {
                floor_ns.insert(n, layout_ns[&(shape, n, Layout::Floor, 0)]);
                full_program(n, &ms, repeat, rounds, &mut full_ns);
            }
        }
    }

    let probe_names = ["own /24 allow", "wildcard allow", "default deny"];
    let (first, last) = (sizes[0], *sizes.last().unwrap());
    for shape in shapes {
        for (pi, pname) in probe_names.iter().enumerate() {
            println!(
                "\nPolicy part only (parse + one policy decision), {shape:?} rule set, SYN \
                 decided by: {pname}"
            );
            print!("{:>28}", "layout \\ entries");
            for n in &sizes {
                print!("{n:>10}");
            }
            println!("{:>12}", format!("{last}/{first}"));
            for l in Layout::ALL {
                if matches!(l, Layout::Floor | Layout::Parse) && pi > 0 {
                    continue;
                }
                print!("{:>28}", l.name());
                for n in &sizes {
                    match layout_ns.get(&(shape, *n, l, pi)) {
                        Some(v) => print!("{v:>10.1}"),
                        None => print!("{:>10}", "-"),
                    }
                }
                match (
                    layout_ns.get(&(shape, last, l, pi)),
                    layout_ns.get(&(shape, first, l, pi)),
                ) {
                    (Some(a), Some(b)) => println!("{:>12.2}", a / b),
                    _ => println!("{:>12}", "-"),
                }
            }
        }
        println!(
            "\nRatios, {shape:?} rule set, SYN decided by the identity's own key (\"net\": \
             minus the parse-only baseline, i.e. the policy decision alone):"
        );
        for n in &sizes {
            let get = |l| layout_ns.get(&(shape, *n, l, 0)).copied();
            let floor = get(Layout::Floor).unwrap();
            let ord = get(Layout::Ordnet).unwrap();
            let base = get(Layout::Parse).unwrap();
            let cil = get(Layout::Cilium).unwrap();
            let ratio = |l| get(l).map_or("-".to_string(), |v| format!("{:.2}", v / floor));
            println!(
                "{n:>8} entries: ordnet/floor {:.2}; classes/floor {}; probes/floor {}; \
                 2xLPM/floor {}; Cilium/ordnet {:.2} (net {:.1}/{:.1} ns = {:.2})",
                ord / floor,
                ratio(Layout::Classes),
                ratio(Layout::Probes),
                ratio(Layout::Lpm),
                cil / ord,
                cil - base,
                ord - base,
                (cil - base) / (ord - base),
            );
        }
    }

    for shape in shapes {
        println!(
            "\nVaried packets, {shape:?} rule set: {VARIED} SYNs of distinct identities and \
             ports (each allowed by the identity's own key), each run once; mean of the \
             kernel-reported per-run times, median of {rounds} passes"
        );
        print!("{:>28}", "layout \\ entries");
        for n in &sizes {
            print!("{n:>10}");
        }
        println!("{:>12}", format!("{last}/{first}"));
        for l in Layout::ALL {
            print!("{:>28}", l.name());
            for n in &sizes {
                match varied_ns.get(&(shape, *n, l)) {
                    Some(v) => print!("{v:>10.1}"),
                    None => print!("{:>10}", "-"),
                }
            }
            match (
                varied_ns.get(&(shape, last, l)),
                varied_ns.get(&(shape, first, l)),
            ) {
                (Some(a), Some(b)) => println!("{:>12.2}", a / b),
                _ => println!("{:>12}", "-"),
            }
        }
    }

    println!("\nFull ordnet program (parse, ipcache x2, conntrack, policy), Mixed rule set:");
    let names: Vec<&'static str> = full_ns
        .keys()
        .map(|(_, name)| *name)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    print!("{:>46}", "packet \\ entries");
    for n in &sizes {
        print!("{n:>10}");
    }
    println!("{:>12}{:>12}", format!("{last}/{first}"), "max/floor");
    for name in names {
        print!("{name:>46}");
        let mut worst: f64 = 0.0;
        for n in &sizes {
            let v = full_ns[&(*n, name)];
            worst = worst.max(v / floor_ns[n]);
            print!("{v:>10.1}");
        }
        println!(
            "{:>12.2}{:>12.2}",
            full_ns[&(last, name)] / full_ns[&(first, name)],
            worst
        );
    }
    print!("{:>46}", "floor (parse + 1 hash lookup, same run)");
    for n in &sizes {
        print!("{:>10.1}", floor_ns[n]);
    }
    println!();
    println!(
        "\nA new connection, both hooks (first SYN: XDP on the sender's interface + TC on the \
         interface it leaves by; each run once on {VARIED} distinct connections, so these include \
         the test-run set-up a repeated run spreads out):"
    );
    for n in &sizes {
        let get = |k: &str| full_ns[&(*n, k)];
        let direct = get("first SYN B->A at XDP (direct)")
            + get("first SYN B->A at TC (direct: XDP's entry)");
        let service = get("first SYN B->ClusterIP at XDP (deferred)")
            + get("first SYN B->A at TC after DNAT (judged)");
        println!(
            "{n:>8} entries: direct B->A {direct:.1} ns, through a Service {service:.1} ns \
             (extra {:+.1} ns); an established packet {:.1} (XDP) + {:.1} (TC) ns",
            service - direct,
            get("established ACK R->A (tracked flow)"),
            get("TC: established ACK R->A (tracked flow)"),
        );
    }

    let at = sizes
        .iter()
        .copied()
        .find(|n| *n >= 1000)
        .unwrap_or(sizes[0]);
    events_overhead(at, &ruleset(at, Shape::Mixed).0, repeat, rounds);
    real_path(&floor_ns);
    apply_times();
    attach_times();
}

/// The whole path with real packets: one UDP flow from pod A to pod B on routed veths, both
/// programs attached to both host sides, `ORDNET_BENCH_PACKETS` (default 200 000) 64-byte
/// frames; the kernel's own run-time statistics (`bpf_stats`) per program run: XDP at A's veth
/// (an established packet: one conntrack lookup, and the tag) and TC at B's (with the handoff:
/// the tag checked, no lookup; without: the lookup). Three alternating runs each, medians.
fn real_path(floor_ns: &BTreeMap<usize, f64>) {
    let packets = env("ORDNET_BENCH_PACKETS", 200_000) as usize;
    // Per run: XDP and TC nanoseconds (the floor: XDP only). Three runs of each, in turn.
    let mut runs: BTreeMap<Run, Vec<(f64, f64)>> = BTreeMap::new();
    for round in 0..12 {
        let run = [Run::Without, Run::Handoff, Run::Floor, Run::Empty][round % 4];
        let r = ordnet_datapath::pods::in_own_netns(move || one_flow(run, packets));
        runs.entry(run).or_default().push(r);
    }
    let floor = floor_ns.values().copied().fold(f64::INFINITY, f64::min);
    let real_floor = median(runs[&Run::Floor].iter().map(|r| r.0).collect());
    println!(
        "\nWhole path with real packets (one UDP flow A->B on veths, {packets} 64-byte frames, \
         kernel run time per program run, median of 3 runs of each, in turn; the floor program \
         (parse + 1 hash lookup) on A's interface with the same packets: {real_floor:.1} ns{}):",
        if floor.is_finite() {
            format!("; the smallest test-run floor above: {floor:.1} ns")
        } else {
            String::new()
        }
    );
    let empty = |i: usize| median(runs[&Run::Empty].iter().map(|r| [r.0, r.1][i]).collect());
    let (empty_xdp, empty_tc) = (empty(0), empty(1));
    for (run, v) in runs
        .iter()
        .filter(|(r, _)| matches!(r, Run::Without | Run::Handoff))
    {
        let xdp = median(v.iter().map(|r| r.0).collect());
        let tc = median(v.iter().map(|r| r.1).collect());
        println!(
            "{:>30}: XDP {xdp:.1} + TC {tc:.1} = {:.1} ns = {:.2}x the real-packet floor \
             (less the empty runs: {:.1} ns = {:.2}x the floor's {:.1})",
            if *run == Run::Handoff {
                "with the handoff"
            } else {
                "without (TC looks it up)"
            },
            xdp + tc,
            (xdp + tc) / real_floor,
            xdp + tc - empty_xdp - empty_tc,
            (xdp + tc - empty_xdp - empty_tc) / (real_floor - empty_xdp),
            real_floor - empty_xdp,
        );
    }
    println!(
        "{:>30}: XDP {empty_xdp:.1} + TC {empty_tc:.1} = {:.1} ns = {:.2}x the real-packet floor",
        "programs that do nothing",
        empty_xdp + empty_tc,
        (empty_xdp + empty_tc) / real_floor
    );
}

/// What a run of [`real_path`] measures: both programs without or with the handoff, the
/// floor program alone on the sender's interface, or programs that do nothing at both hooks
/// (what two program runs cost by themselves).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Run {
    Without,
    Handoff,
    Floor,
    Empty,
}

/// One run of [`real_path`] in the current (fresh) network namespace: per-run nanoseconds of
/// the XDP and the TC program over the flow's packets (the floor: its program's, and 0).
fn one_flow(run: Run, packets: usize) -> (f64, f64) {
    use ordnet_datapath::pods::TwoPods;
    use std::net::{SocketAddr, UdpSocket};
    let pods = TwoPods::new("hb");
    let b = SocketAddr::from((TwoPods::ADDRS[1], 9000));
    let sink = pods.in_pod(1, move || UdpSocket::bind(b).unwrap());
    let send = || {
        pods.in_pod(0, move || {
            // On the last CPU, every run: both programs run in the sender's softirq on its CPU,
            // and a sender that moves between CPUs (or shares one with the sink) varies the
            // runs' times by ±10 %.
            pin_to_last_cpu();
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(b).unwrap();
            // 14 + 20 + 8 + 22 = a 64-byte frame.
            let payload = [0u8; 22];
            for _ in 0..packets {
                let _ = s.send(&payload);
            }
        })
    };
    let per = |before: (Duration, u64), after: (Duration, u64)| {
        let runs = after.1 - before.1;
        assert!(runs >= packets as u64 * 9 / 10, "runs: {runs}");
        (after.0 - before.0).as_nanos() as f64 / runs as f64
    };
    let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).unwrap();
    let out = if run == Run::Empty {
        let ms = MapState::new(Direction::Egress, Verdict::Allow);
        let (mut obj, _) = BenchObject::load(&ms).unwrap();
        obj.attach_empty(TwoPods::HOSTS[0], TwoPods::HOSTS[1])
            .unwrap();
        let before = obj.empty_stats().unwrap();
        send();
        let after = obj.empty_stats().unwrap();
        (per(before[0], after[0]), per(before[1], after[1]))
    } else if run == Run::Floor {
        // The floor program with A's identity allowed to UDP/9000 (a hit), on A's interface.
        let id = u32::from(TwoPods::ADDRS[0]) & 0x00ff_ffff;
        let allow = entry(
            0,
            OrderKey::new(0, 0),
            Verdict::Allow,
            Selector::ids([id]),
            L4Match::port(Protocol::Udp, 9000),
        );
        let ms = MapState::build(Direction::Egress, Verdict::Deny, [allow]).unwrap();
        let (mut obj, _) = BenchObject::load(&ms).unwrap();
        obj.attach(Layout::Floor, TwoPods::HOSTS[0]).unwrap();
        let before = obj.run_stats(Layout::Floor).unwrap();
        send();
        (per(before, obj.run_stats(Layout::Floor).unwrap()), 0.0)
    } else {
        let mut dp = Datapath::create(DatapathConfig {
            handoff: run == Run::Handoff,
            ct4_entries: 4096,
            ct6_entries: 4096,
            ..DatapathConfig::default()
        })
        .unwrap();
        let deny_in = MapState::new(Direction::Ingress, Verdict::Deny);
        let open_in = MapState::new(Direction::Ingress, Verdict::Allow);
        let open_out = MapState::new(Direction::Egress, Verdict::Allow);
        pods.enforce(
            &mut dp,
            [(2, &deny_in, &open_out), (3, &open_in, &open_out)],
        )
        .unwrap();
        let read = |dp: &Datapath| {
            let x = dp.program().unwrap().info().unwrap();
            let t = dp.tc_program().unwrap().info().unwrap();
            [(x.run_time(), x.run_count()), (t.run_time(), t.run_count())]
        };
        let before = read(&dp);
        send();
        let after = read(&dp);
        (per(before[0], after[0]), per(before[1], after[1]))
    };
    drop(stats);
    drop(sink);
    out
}

/// Pins the calling thread to the machine's last CPU (nothing to do on one CPU).
fn pin_to_last_cpu() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: a zeroed `cpu_set_t` with one bit set, passed with its size, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus - 1, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Distinct packets of the varied measurement.
const VARIED: usize = 4096;

/// Measures every layout's program on the three probe packets, and on many distinct ones.
#[allow(clippy::too_many_arguments)]
fn layouts(
    n: usize,
    shape: Shape,
    ms: &MapState,
    repeat: u32,
    rounds: usize,
    layout_ns: &mut BTreeMap<(Shape, usize, Layout, usize), f64>,
    varied_ns: &mut BTreeMap<(Shape, usize, Layout), f64>,
    build: Duration,
) {
    let probes = probes(ms, n);
    let (obj, sizes) = BenchObject::load(ms).unwrap();
    let measured: Vec<Layout> = Layout::ALL
        .into_iter()
        .filter(|l| *l != Layout::Classes || sizes.classes_installed)
        .collect();
    for (pi, p) in probes.iter().enumerate() {
        for &l in &measured {
            let got = obj.run(l, &p.frame, 1).unwrap().action;
            // The floor holds the exact identity keys only; parse-only always passes.
            let floor_ok = (l == Layout::Floor && pi > 0) || l == Layout::Parse;
            assert!(
                got == p.want || floor_ok,
                "{n} entries ({shape:?}), {}: {} returned {got:?}, MapState says {:?}",
                p.name,
                l.name(),
                p.want
            );
        }
    }
    for (pi, p) in probes.iter().enumerate() {
        let mut samples: BTreeMap<Layout, Vec<f64>> = BTreeMap::new();
        for _ in 0..rounds {
            for &l in &measured {
                if matches!(l, Layout::Floor | Layout::Parse) && pi > 0 {
                    continue;
                }
                let r = obj.run(l, &p.frame, repeat).unwrap();
                samples.entry(l).or_default().push(ns(r.avg_duration));
            }
        }
        for (l, v) in samples {
            layout_ns.insert((shape, n, l, pi), median(v));
        }
    }
    // Varied packets: identity i's own port j, over many identities.
    let ids = identities(n);
    let per = if n < 8 { n as u32 } else { 8 };
    let mut seed = 0x9e37_79b9_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let frames: Vec<Vec<u8>> = (0..VARIED)
        .map(|_| {
            let i = 1 + (next() % u64::from(ids)) as u32;
            let j = (next() % u64::from(per.max(1))) as u32;
            frame64(v4(i), [10, 200, 0, 1], 40000, port(i, j), TCP_SYN)
        })
        .collect();
    for f in frames.iter().take(64) {
        for &l in &measured {
            assert_eq!(
                obj.run(l, f, 1).unwrap().action,
                XdpAction::Pass,
                "{}",
                l.name()
            );
        }
    }
    let mut passes: BTreeMap<Layout, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        for &l in &measured {
            let total: f64 = frames
                .iter()
                .map(|f| ns(obj.run(l, f, 1).unwrap().avg_duration))
                .sum();
            passes
                .entry(l)
                .or_default()
                .push(total / frames.len() as f64);
        }
    }
    for (l, v) in passes {
        varied_ns.insert((shape, n, l), median(v));
    }
    println!(
        "{n:>6} requested, {shape:?}: MapState {} keys (built in {:.1} ms); entries: floor {}, \
         ordnet {} keys + {} refined blocks, classes {}{} ({} classes, {} blocks), probes {}, \
         LPM {}, Cilium {}",
        ms.len(),
        build.as_secs_f64() * 1e3,
        sizes.floor,
        sizes.ordnet_policy,
        sizes.ordnet_blocks,
        sizes.class_entries,
        if sizes.classes_installed {
            ""
        } else {
            " (too many: not installed)"
        },
        sizes.classes,
        sizes.class_blocks,
        sizes.probe_entries,
        sizes.lpm_entries,
        sizes.cilium_entries
    );
}

/// Measures the full program with `ms` as a local endpoint's egress and ingress rule set.
/// The full program's datapath (`config` with the rule set's sizes) and its frames: A
/// (10.0.0.2) has the rule set as egress and ingress; R is a remote pod of the measured
/// identity; B a local pod of that identity with open policies. Also the identity and the
/// allowed port.
#[allow(clippy::type_complexity)]
fn full_setup(
    n: usize,
    ms: &MapState,
    config: DatapathConfig,
) -> (Datapath, Vec<(&'static str, Vec<u8>, XdpAction)>, u32, u16) {
    let config = DatapathConfig {
        policy_entries: ((2 * ms.len()) as u32 + 1024).next_power_of_two(),
        max_rulesets: 8,
        max_blocks: 1024,
        ..config
    };
    let mut dp = Datapath::create(config).unwrap();
    let id = probe_identity(n);
    let a: IpAddr = [10, 0, 0, 2].into();
    let b: IpAddr = [10, 0, 0, 3].into();
    let r: IpAddr = v4(id).into();
    dp.set_identity(IpNet::from(r), id).unwrap();
    let ingress = MapState::build(Direction::Ingress, Verdict::Deny, ms.policy_entries()).unwrap();
    dp.upsert_endpoint(
        1,
        EndpointSpec {
            ips: &[a],
            identity: 77,
            identities: &[],
            ingress: &ingress,
            egress: ms,
        },
    )
    .unwrap();
    let open_in = MapState::new(Direction::Ingress, Verdict::Allow);
    let open_out = MapState::new(Direction::Egress, Verdict::Allow);
    dp.upsert_endpoint(
        2,
        EndpointSpec {
            ips: &[b],
            identity: id,
            identities: &[],
            ingress: &open_in,
            egress: &open_out,
        },
    )
    .unwrap();
    let p = port(id, 3);
    let full: Vec<(&'static str, Vec<u8>, XdpAction)> = vec![
        (
            "pod egress SYN A->R (allowed, new flow)",
            frame64([10, 0, 0, 2], v4(id), 40000, p, TCP_SYN),
            XdpAction::Pass,
        ),
        (
            "uplink ingress SYN R->A (allowed, new flow)",
            frame64(v4(id), [10, 0, 0, 2], 40001, p, TCP_SYN),
            XdpAction::Pass,
        ),
        (
            "local B->A SYN (egress B + ingress A)",
            frame64([10, 0, 0, 3], [10, 0, 0, 2], 40002, p, TCP_SYN),
            XdpAction::Pass,
        ),
        (
            "pod egress SYN A->R denied (default)",
            frame64([10, 0, 0, 2], v4(id), 40003, 7, TCP_SYN),
            XdpAction::Drop,
        ),
        (
            "established ACK R->A (tracked flow)",
            frame64(v4(id), [10, 0, 0, 2], p, 40000, TCP_ACK),
            XdpAction::Pass,
        ),
        (
            "established R->A, 1500-byte frame",
            sized(frame64(v4(id), [10, 0, 0, 2], p, 40000, TCP_ACK), 1500),
            XdpAction::Pass,
        ),
        (
            "established R->A, 9000-byte frame (multi-buffer)",
            sized(frame64(v4(id), [10, 0, 0, 2], p, 40000, TCP_ACK), 9000),
            XdpAction::Pass,
        ),
    ];
    (dp, full, id, p)
}

fn full_program(
    n: usize,
    ms: &MapState,
    repeat: u32,
    rounds: usize,
    full_ns: &mut BTreeMap<(usize, &'static str), f64>,
) {
    // `ORDNET_BENCH_OBSERVE=off`: without the verdict events and the rule counters (both on
    // by default), to compare the decision itself with builds that had neither.
    let config = if std::env::var("ORDNET_BENCH_OBSERVE").is_ok_and(|v| v == "off") {
        DatapathConfig {
            events_per_sec: 0,
            rule_counters: false,
            ..DatapathConfig::default()
        }
    } else {
        DatapathConfig::default()
    };
    let (mut dp, full, id, p) = full_setup(n, ms, config);
    // Userspace follows the same packet sequence with its own tracking table (the SYN A->R
    // creates the flow the last packet belongs to).
    let ct = ordnet_datapath::UserCt::default();
    for (name, f, want) in &full {
        let got = dp.test_run(f).unwrap().action;
        let user = XdpAction::from(dp.decide_with(f, &ct).verdict);
        assert_eq!(
            (got, user),
            (*want, *want),
            "{n}: {name} (kernel, userspace)"
        );
    }
    let mut samples: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    // `ORDNET_BENCH_ROW` (see `main`): these rows only, and not the TC hook's.
    let row = std::env::var("ORDNET_BENCH_ROW").ok();
    for _ in 0..rounds {
        for (name, f, want) in &full {
            if row.as_ref().is_some_and(|r| !name.contains(r.as_str())) {
                continue;
            }
            let r = dp.test_run_repeat(f, repeat).unwrap();
            assert_eq!(r.action, *want);
            samples.entry(name).or_default().push(ns(r.avg_duration));
        }
    }
    for (name, v) in samples {
        full_ns.insert((n, name), median(v));
    }
    if row.is_none() {
        tc_program(n, &mut dp, id, p, repeat, rounds, full_ns);
    }
}

/// The verdict events' and the per-rule counters' cost per packet (`common::event`,
/// docs/observe.md): the full program's established, new-flow and denied packets with both
/// off, with the counters only, with both on at the default rate (a repeated packet is a
/// flood: a new flow's events are then refused by the rate limit, a denied flow's packets
/// counted in its record), and on with every event emitted (a rate no test run reaches, and a
/// thread draining the ring buffer as a reader would). The datapaths are measured in turn
/// within each round (same run); medians. `on/off` compares events on with the counters-only
/// column (events on vs off); `counters/none` the counters with nothing.
fn events_overhead(n: usize, ms: &MapState, repeat: u32, rounds: usize) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let rows = [
        "established ACK R->A (tracked flow)",
        "pod egress SYN A->R (allowed, new flow)",
        "pod egress SYN A->R denied (default)",
    ];
    let configs: [(&str, u64, bool); 4] = [
        ("none", 0, false),
        ("counters", 0, true),
        (
            "on, 5000/s",
            ordnet_datapath::common::event::DEFAULT_EVENTS_PER_SEC,
            true,
        ),
        ("on, every event", u64::MAX, true),
    ];
    let every = configs.len() - 1;
    type Frames = Vec<(&'static str, Vec<u8>, XdpAction)>;
    let mut dps: Vec<(Datapath, Frames)> = configs
        .iter()
        .map(|(_, rate, counters)| {
            let config = DatapathConfig {
                events_per_sec: *rate,
                rule_counters: *counters,
                ..DatapathConfig::default()
            };
            let (dp, full, _, _) = full_setup(n, ms, config);
            (dp, full)
        })
        .collect();
    // The reader of the last one drains while it runs.
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let drained = std::sync::Arc::new(AtomicU64::new(0));
    let mut reader = dps[every].0.events().unwrap().expect("the ring buffer");
    let drainer = {
        let (stop, drained) = (stop.clone(), drained.clone());
        std::thread::spawn(move || {
            let mut v = Vec::with_capacity(4096);
            while !stop.load(Ordering::Relaxed) {
                v.clear();
                drained.fetch_add(reader.drain(&mut v) as u64, Ordering::Relaxed);
            }
        })
    };
    let mut samples: BTreeMap<(usize, &'static str), Vec<f64>> = BTreeMap::new();
    for (dp, full) in &dps {
        // The SYN A->R first: the established ACK belongs to its flow.
        for (_, f, want) in full {
            assert_eq!(dp.test_run(f).unwrap().action, *want);
        }
    }
    for _ in 0..rounds {
        for (i, (dp, full)) in dps.iter_mut().enumerate() {
            for row in rows {
                let (_, f, want) = full.iter().find(|(name, _, _)| *name == row).unwrap();
                let r = dp.test_run_repeat(f, repeat).unwrap();
                assert_eq!(r.action, *want);
                samples
                    .entry((i, row))
                    .or_default()
                    .push(ns(r.avg_duration));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    drainer.join().unwrap();
    println!(
        "\nVerdict events (docs/observe.md), full program, {n} entries, ns/packet (same run, \
         median of {rounds} rounds of {repeat}):"
    );
    print!("{:>46}", "packet \\ events");
    for (name, _, _) in configs {
        print!("{name:>18}");
    }
    println!("{:>15}{:>12}{:>12}", "counters/none", "on/off", "every/off");
    for row in rows {
        print!("{row:>46}");
        let v: Vec<f64> = (0..configs.len())
            .map(|i| median(samples[&(i, row)].clone()))
            .collect();
        for x in &v {
            print!("{x:>18.1}");
        }
        println!(
            "{:>15.3}{:>12.3}{:>12.3}",
            v[1] / v[0],
            v[2] / v[1],
            v[3] / v[1]
        );
    }
    for (i, (name, _, _)) in configs.iter().enumerate() {
        let c = dps[i].0.counters().unwrap();
        println!(
            "{name:>46}: {} emitted, {} suppressed, {} lost{}",
            c.events,
            c.events_suppressed,
            c.events_lost,
            if i == every {
                format!(
                    ", {} read by the draining thread",
                    drained.load(Ordering::Relaxed)
                )
            } else {
                String::new()
            }
        );
    }
}

/// The TC hook (after kube-proxy's translation) next to XDP on the same maps: B's interface is
/// `IF_B`, A's `IF_A`, the uplink is not an endpoint's; `10.96.0.10:p` is a Service frontend
/// whose backend is A.
///
/// Repeated runs of one frame measure packets of a known flow (after the first run its entry
/// exists). A connection's *first* packet at each hook is measured on distinct connections
/// instead ([`VARIED`] SYNs with distinct source ports, each run once, mean of the
/// kernel-reported times, tracking table cleared before each pass): a direct connection B->A is
/// judged at XDP and passes TC with one lookup (the entry XDP just made); a connection through
/// the Service is deferred at XDP and judged at TC.
fn tc_program(
    n: usize,
    dp: &mut Datapath,
    id: u32,
    p: u16,
    repeat: u32,
    rounds: usize,
    full_ns: &mut BTreeMap<(usize, &'static str), f64>,
) {
    use ordnet_datapath::common::Verdict as V;
    const IF_A: u32 = 10;
    const IF_B: u32 = 11;
    const IF_UPLINK: u32 = 2;
    let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 2].into(), [10, 0, 0, 3].into());
    dp.set_interface(IF_A, 1, Some(&[a])).unwrap();
    dp.set_interface(IF_B, 2, Some(&[b])).unwrap();
    dp.set_service_frontends(&[([10, 96, 0, 10].into(), 6, p)])
        .unwrap();
    let (vip, ab, bb) = ([10, 96, 0, 10], [10, 0, 0, 2], [10, 0, 0, 3]);
    let run = |dp: &Datapath, f: &[u8], hook: Option<u32>, repeat: u32| -> (V, f64) {
        match hook {
            None => {
                let r = dp.test_run_repeat(f, repeat).unwrap();
                let v = if r.action == XdpAction::Pass {
                    V::Pass
                } else {
                    V::Drop
                };
                (v, ns(r.avg_duration))
            }
            Some(ifindex) => {
                let (v, d) = dp.test_run_tc(f, ifindex, repeat).unwrap();
                (v, ns(d))
            }
        }
    };
    // Packets of known flows (repeated).
    let repeated: Vec<(&'static str, Vec<u8>, Option<u32>, V)> = vec![
        (
            "TC: established ACK R->A (tracked flow)",
            frame64(v4(id), ab, p, 40000, TCP_ACK),
            Some(IF_UPLINK),
            V::Pass,
        ),
        (
            "TC: SYN B->A after DNAT, denied port",
            frame64(bb, ab, 40011, 7, TCP_SYN),
            Some(IF_B),
            V::Drop,
        ),
    ];
    let mut samples: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        for (name, f, hook, want) in &repeated {
            let (v, t) = run(dp, f, *hook, repeat);
            assert_eq!(v, *want, "{n}: {name}");
            samples.entry(name).or_default().push(t);
        }
    }
    // First packets of distinct connections: (name, hook, frame of connection i, verdict).
    type Make = fn([u8; 4], [u8; 4], [u8; 4], u16, u16) -> Vec<u8>;
    let firsts: [(&'static str, Option<u32>, Make); 4] = [
        ("first SYN B->A at XDP (direct)", None, |_, a, b, sp, p| {
            frame64(b, a, sp, p, TCP_SYN)
        }),
        (
            "first SYN B->A at TC (direct: XDP's entry)",
            Some(IF_B),
            |_, a, b, sp, p| frame64(b, a, sp, p, TCP_SYN),
        ),
        (
            "first SYN B->ClusterIP at XDP (deferred)",
            None,
            |vip, _, b, sp, p| frame64(b, vip, sp, p, TCP_SYN),
        ),
        (
            "first SYN B->A at TC after DNAT (judged)",
            Some(IF_B),
            |_, a, b, sp, p| frame64(b, a, sp + 20_000, p, TCP_SYN),
        ),
    ];
    for _ in 0..rounds {
        dp.ct_clear().unwrap();
        let mut sum = [0f64; 4];
        for i in 0..VARIED {
            let sport = 10_000 + i as u16;
            // In packet order: XDP then TC of the direct connection, XDP then TC of the
            // Service connection (its translated tuple has another source port: a fresh flow).
            for (k, (name, hook, make)) in firsts.iter().enumerate() {
                let f = make(vip, ab, bb, sport, p);
                let (v, t) = run(dp, &f, *hook, 1);
                assert_eq!(v, V::Pass, "{n}: {name}");
                sum[k] += t;
            }
        }
        for (k, (name, ..)) in firsts.iter().enumerate() {
            samples
                .entry(name)
                .or_default()
                .push(sum[k] / VARIED as f64);
        }
    }
    for (name, v) in samples {
        full_ns.insert((n, name), median(v));
    }
}

/// Time to attach both programs to a pod's interface (the XDP link natively, with the generic
/// fallback the agent uses, then the tcx link), on fresh veth pairs of MTU 1500 and 9001.
fn attach_times() {
    const PAIRS: usize = 32;
    println!("\nAttaching to a pod's interface (wall clock, {PAIRS} fresh veth pairs each):");
    let mut dp = Datapath::create(DatapathConfig::default()).unwrap();
    for mtu in [1500, 9001] {
        let names: Vec<String> = (0..PAIRS).map(|i| format!("obench{i}")).collect();
        let ip = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        for n in &names {
            let peer = format!("{n}p");
            let mtu = mtu.to_string();
            assert!(ip(&[
                "link", "add", n, "type", "veth", "peer", "name", &peer
            ]));
            assert!(ip(&["link", "set", &peer, "mtu", &mtu, "up"]));
            assert!(ip(&["link", "set", n, "mtu", &mtu, "up"]));
        }
        let mut took = Vec::new();
        for n in &names {
            let t = Instant::now();
            let mode = dp.attach_native_or_generic(n).unwrap();
            dp.attach_tc(n).unwrap();
            took.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(mode, ordnet_datapath::XdpAttached::Native, "{n}");
        }
        for n in &names {
            dp.detach(n).unwrap();
            dp.detach_tc(n).unwrap();
            ip(&["link", "del", n]);
        }
        let max = took.iter().copied().fold(0.0, f64::max);
        println!(
            "  MTU {mtu}: XDP (native) + TC per interface: median {:.0} us, max {max:.0} us",
            median(took)
        );
    }
}

/// Time to apply a 16k-key rule set to the kernel, and a one-rule change.
fn apply_times() {
    println!("\nApplying rule sets to the kernel (wall clock, this process):");
    let n = 16_384;
    let (ms, mut entries) = ruleset(n, Shape::Mixed);
    let config = DatapathConfig {
        policy_entries: 1 << 16,
        max_rulesets: 8,
        max_blocks: 1024,
        ..DatapathConfig::default()
    };
    let mut dp = Datapath::create(config).unwrap();
    let a: IpAddr = [10, 0, 0, 2].into();
    let open = MapState::new(Direction::Ingress, Verdict::Allow);
    let t = Instant::now();
    let (content, _) = flatten(&ms).unwrap();
    let flat = t.elapsed();
    let t = Instant::now();
    let stats = dp
        .upsert_endpoint(
            1,
            EndpointSpec {
                ips: &[a],
                identity: 5,
                identities: &[],
                ingress: &open,
                egress: &ms,
            },
        )
        .unwrap();
    let install = t.elapsed();
    println!(
        "  install a {}-key rule set: {:.2} ms (flatten alone {:.2} ms); {} policy writes, {} \
         cell + {} block words, {} batches",
        content.len(),
        install.as_secs_f64() * 1e3,
        flat.as_secs_f64() * 1e3,
        stats.policy_writes,
        stats.cell_writes,
        stats.block_writes,
        stats.batches
    );
    // A 1-rule change, applied two ways: the whole new MapState (the datapath flattens and
    // diffs it), and the ChangeSet of `MapState::apply` (cost of the change only).
    let mut full = Vec::new();
    for k in 0..5u32 {
        let id = entries.len() as u64 + 10;
        entries.push(entry(
            id,
            OrderKey::new(5, k),
            Verdict::Allow,
            Selector::ids([3 + k]),
            L4Match::port(Protocol::Tcp, 50_000 + k as u16),
        ));
        let ms2 =
            MapState::build(Direction::Egress, Verdict::Deny, entries.iter().cloned()).unwrap();
        let t = Instant::now();
        let stats = dp
            .upsert_endpoint(
                1,
                EndpointSpec {
                    ips: &[a],
                    identity: 5,
                    identities: &[],
                    ingress: &open,
                    egress: &ms2,
                },
            )
            .unwrap();
        full.push((t.elapsed(), stats));
    }
    let (apply, stats) = &full[full.len() / 2];
    println!(
        "  a 1-rule change, whole MapState given: {:.3} ms (median of {}; flatten + diff of all \
         keys), {} policy writes, {} cell + {} block words, {} batches",
        apply.as_secs_f64() * 1e3,
        full.len(),
        stats.policy_writes,
        stats.cell_writes,
        stats.block_writes,
        stats.batches
    );
    let mut ms3 =
        MapState::build(Direction::Egress, Verdict::Deny, entries.iter().cloned()).unwrap();
    let mut incremental = Vec::new();
    for k in 0..21u32 {
        let id = entries.len() as u64 + 100;
        let e = entry(
            id,
            OrderKey::new(6, k),
            if k % 2 == 0 {
                Verdict::Allow
            } else {
                Verdict::Deny
            },
            Selector::ids([20 + k]),
            L4Match::port(Protocol::Tcp, 51_000 + k as u16),
        );
        entries.push(e.clone());
        let t = Instant::now();
        let changes = ms3.apply([ordnet_mapstate::Update::AddEntry(e)]).unwrap();
        let mapstate = t.elapsed();
        let t = Instant::now();
        let stats = dp
            .apply_changes(&[(1, Direction::Egress, changes.view(), Verdict::Deny)])
            .unwrap();
        incremental.push((t.elapsed(), mapstate, stats));
    }
    incremental.sort_by_key(|(d, _, _)| *d);
    let (apply, mapstate, stats) = &incremental[incremental.len() / 2];
    println!(
        "  a 1-rule change as a ChangeSet: {:.1} us apply (median of {}), {} policy writes, {} \
         cell + {} block words, {} batches; MapState::apply itself {:.1} us",
        apply.as_secs_f64() * 1e6,
        incremental.len(),
        stats.policy_writes,
        stats.cell_writes,
        stats.block_writes,
        stats.batches,
        mapstate.as_secs_f64() * 1e6
    );
    assert_eq!(dp.verify().unwrap(), Vec::<String>::new());
}
