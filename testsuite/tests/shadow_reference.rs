//! `Engine::shadowed_rules` against brute force with the reference evaluator on random
//! clusters: for every endpoint, direction, peer address and probe packet, the reference says
//! which rules match and which decide (SEMANTICS.md §2).
//!
//! * A rule reported shadowed must decide no probe, must match some probe (when the probes are
//!   exhaustive, below), and its shadowing rules must be rules that decide probes it matches.
//! * When the probes are exhaustive — an address for every identity the engine has, and the
//!   ports around every boundary used (numbers, range ends, named port numbers) for TCP, UDP,
//!   SCTP plus ICMP — the report must be exact: every ordered rule that matches some probe and
//!   decides none is reported, with exactly the rules that decide the probes it matches.

#[path = "../../engine/tests/common/cluster_gen.rs"]
mod cluster_gen;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use cluster_gen::{EXTERNALS, Rng, World, random_change};
use ipnet::IpNet;
use ordnet_engine::{Engine, IdentityKind};
use ordnet_mapstate::Direction;
use ordnet_testsuite::reference::{Dir, Reference, RuleName};

/// Every port number the generator uses (rule ports, range ends, container ports).
const NUMBERS: [u16; 8] = [53, 80, 81, 85, 90, 7000, 8080, 9090];

fn probe_packets() -> Vec<(u8, u16)> {
    let mut ports: BTreeSet<u16> = [0, 1, 65535].into();
    for n in NUMBERS {
        ports.extend([n - 1, n, n + 1]);
    }
    let mut out: Vec<(u8, u16)> = Vec::new();
    for proto in [6, 17, 132] {
        out.extend(ports.iter().map(|p| (proto, *p)));
    }
    out.push((1, 0));
    out
}

/// Addresses to probe: every pod address, the fixed externals, and one address per CIDR
/// identity and for `world` when one can be found. Returns them and whether every identity of
/// the engine has one.
fn probe_peers(engine: &Engine) -> (Vec<IpAddr>, bool) {
    let mut peers: BTreeSet<IpAddr> = engine
        .endpoints()
        .iter()
        .flat_map(|e| e.ips.iter().copied())
        .collect();
    peers.extend(EXTERNALS.iter().map(|s| s.parse::<IpAddr>().unwrap()));
    for extra in ["203.0.113.9", "8.8.8.8", "2001:db8::77", "fe80::1"] {
        peers.insert(extra.parse().unwrap());
    }
    for info in engine.identities() {
        if let IdentityKind::Cidr(net) = info.kind
            && let Some(ip) = inside(engine, net, info.id)
        {
            peers.insert(ip);
        }
    }
    let have: BTreeSet<u32> = peers.iter().map(|ip| engine.identity_of(*ip)).collect();
    let exhaustive = engine.identities().all(|i| have.contains(&i.id));
    (peers.into_iter().collect(), exhaustive)
}

/// An address of `net` whose identity is `id` (not in a longer prefix, not a pod's).
fn inside(engine: &Engine, net: IpNet, id: u32) -> Option<IpAddr> {
    let candidates: Vec<IpAddr> = match net {
        IpNet::V4(n) => {
            let base = u32::from(n.network());
            let last = u32::from(n.broadcast());
            let step = ((last - base) / 37).max(1);
            (0..40u32)
                .map(|i| base.saturating_add(i.saturating_mul(step)).min(last))
                .chain([last, last.saturating_sub(1), base + 1])
                .filter(|a| n.contains(&std::net::Ipv4Addr::from(*a)))
                .map(|a| IpAddr::from(std::net::Ipv4Addr::from(a)))
                .collect()
        }
        IpNet::V6(n) => {
            let base = u128::from(n.network());
            let last = u128::from(n.broadcast());
            let step = ((last - base) / 37).max(1);
            (0..40u128)
                .map(|i| base.saturating_add(i.saturating_mul(step)).min(last))
                .chain([last, base + 1])
                .filter(|a| n.contains(&std::net::Ipv6Addr::from(*a)))
                .map(|a| IpAddr::from(std::net::Ipv6Addr::from(a)))
                .collect()
        }
    };
    candidates
        .into_iter()
        .find(|ip| engine.identity_of(*ip) == id)
}

fn rule_of(s: &ordnet_engine::ShadowedRule) -> RuleName {
    RuleName {
        kind: match s.policy.kind {
            ordnet_engine::PolicyKind::Ordered => "OrderedNetworkPolicy",
            ordnet_engine::PolicyKind::ClusterOrdered => "ClusterOrderedNetworkPolicy",
            ordnet_engine::PolicyKind::NetworkPolicy => "NetworkPolicy",
            ordnet_engine::PolicyKind::ClusterNetwork => "ClusterNetworkPolicy",
        },
        namespace: s.policy.namespace.clone(),
        name: s.policy.name.clone(),
        direction: match s.direction {
            Direction::Ingress => Dir::Ingress,
            Direction::Egress => Dir::Egress,
        },
        index: s.index as usize,
    }
}

#[derive(Default)]
struct Counts {
    worlds: usize,
    exhaustive: usize,
    reported: usize,
    ordered_rules_matching: usize,
}

/// Checks one cluster; returns an error describing the first disagreement.
fn check(world: &World, counts: &mut Counts) -> Result<(), String> {
    let objects = world.objects();
    let engine = Engine::build(&objects);
    if !engine.errors().is_empty() {
        return Err(format!("engine errors: {:?}", engine.errors()));
    }
    // The report of a node-scoped engine must be the same.
    let node = Engine::build_for_node(&objects, "n1");
    let report = engine.shadowed_rules();
    if node.shadowed_rules() != report {
        return Err("the node-scoped engine reports differently".into());
    }
    let reference = Reference::new(&objects)?;
    let (peers, exhaustive) = probe_peers(&engine);
    let packets = probe_packets();
    // Per rule: whether it matched some probe, decided some probe, and who decided the probes
    // it matched.
    let mut matched: BTreeSet<RuleName> = BTreeSet::new();
    let mut decided: BTreeSet<RuleName> = BTreeSet::new();
    let mut takers: BTreeMap<RuleName, BTreeSet<RuleName>> = BTreeMap::new();
    for (ns, name) in reference.endpoints() {
        for d in [Dir::Ingress, Dir::Egress] {
            for peer in &peers {
                for &(proto, port) in &packets {
                    let side = reference
                        .side_rules(&ns, &name, d, *peer, proto, port)
                        .ok_or("an endpoint without address")?;
                    for m in &side.matching {
                        matched.insert(m.clone());
                        takers
                            .entry(m.clone())
                            .or_default()
                            .extend(side.deciding.iter().cloned());
                    }
                    decided.extend(side.deciding.iter().cloned());
                }
            }
        }
    }
    counts.worlds += 1;
    counts.reported += report.len();
    counts.ordered_rules_matching += matched.iter().filter(|r| r.kind != "NetworkPolicy").count();
    let reported: BTreeMap<RuleName, BTreeSet<RuleName>> = report
        .iter()
        .map(|s| {
            let by = s
                .shadowed_by
                .iter()
                .map(|o| RuleName {
                    kind: match o.kind.as_str() {
                        "NetworkPolicy" => "NetworkPolicy",
                        "OrderedNetworkPolicy" => "OrderedNetworkPolicy",
                        "ClusterNetworkPolicy" => "ClusterNetworkPolicy",
                        _ => "ClusterOrderedNetworkPolicy",
                    },
                    namespace: o.namespace.clone(),
                    name: o.name.clone(),
                    direction: match o.direction {
                        Direction::Ingress => Dir::Ingress,
                        Direction::Egress => Dir::Egress,
                    },
                    index: o.rule_index as usize,
                })
                .collect();
            (rule_of(s), by)
        })
        .collect();
    for (r, by) in &reported {
        if r.kind == "NetworkPolicy" || r.kind == "ClusterNetworkPolicy" {
            return Err(format!("a {} rule is reported: {r:?}", r.kind));
        }
        if decided.contains(r) {
            return Err(format!("{r:?} is reported shadowed but decides a probe"));
        }
        if by.is_empty() {
            return Err(format!("{r:?} is reported without shadowing rules"));
        }
        let took = takers.get(r).cloned().unwrap_or_default();
        if !by.is_subset(&took) {
            return Err(format!(
                "{r:?}: reported shadowed by {by:?}, but only {took:?} decide probes it matches"
            ));
        }
        if exhaustive && !matched.contains(r) {
            return Err(format!("{r:?} is reported but matches no probe"));
        }
        if exhaustive && *by != took {
            return Err(format!(
                "{r:?}: reported shadowed by {by:?}, the probes it matches are decided by {took:?}"
            ));
        }
    }
    if exhaustive {
        counts.exhaustive += 1;
        for r in &matched {
            // Only the ordnet kinds' rules are analysed (NetworkPolicy rules are never
            // shadowed reports, ClusterNetworkPolicy rules are not analysed).
            let analysed = r.kind != "NetworkPolicy" && r.kind != "ClusterNetworkPolicy";
            if analysed && !decided.contains(r) && !reported.contains_key(r) {
                return Err(format!(
                    "{r:?} matches probes and decides none, but is not reported (decided by {:?})",
                    takers.get(r)
                ));
            }
        }
    }
    Ok(())
}

fn describe(world: &World) -> String {
    world
        .pods
        .values()
        .chain(world.nps.values())
        .chain(world.onps.values())
        .chain(world.conps.values())
        .chain(world.cnps.values())
        .chain(world.nodes.values())
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn shadowed_rules_agree_with_brute_force() {
    let seeds: u64 = std::env::var("ORDNET_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut counts = Counts::default();
    for seed in 0..seeds {
        let mut r = Rng::new(seed.wrapping_mul(104_729));
        let mut world = World::random(&mut r);
        // Denser policies than the generator's default make shadowing likely.
        let mut counter = 0;
        for _ in 0..6 {
            let _ = random_change(&mut r, &mut world, &mut counter);
        }
        if let Err(e) = check(&world, &mut counts) {
            panic!("seed {seed}: {e}\n{}", describe(&world));
        }
    }
    eprintln!(
        "{} clusters ({} with exhaustive probes): {} shadowed rules reported, {} ordered rules matching probes",
        counts.worlds, counts.exhaustive, counts.reported, counts.ordered_rules_matching
    );
    // The check must not be vacuous.
    assert!(
        counts.exhaustive * 2 >= counts.worlds,
        "too few exhaustive probe sets"
    );
    assert!(
        counts.reported >= seeds as usize / 10,
        "too few shadowed rules to mean anything"
    );
}
