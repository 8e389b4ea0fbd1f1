//! Host tests (no kernel needed) of the flattened layout: the userspace lookup over a flattened
//! rule set equals the MapState lookup; the alternative layouts of the benchmark do too; and
//! the control plane's writes never open a transient allow, write only changed keys, and share
//! rule sets between endpoints with identical MapStates.

mod common;

use std::{collections::HashMap, net::IpAddr, time::Duration};

use common::*;
use ordnet_datapath::{
    Control, EndpointSpec, FlatRuleSet, MemTables, Store, TableWriter, Write, WriteError,
    bench::{cilium_layout, class_layout, lpm_layout, probe_layout},
    common::{
        alt,
        layout::{CELL_REFINED, CELLS_PER_RULESET, PolicyRef, State},
        lookup::{cell_index, policy_lookup},
    },
    flatten, ip_key, meet, same_verdicts,
};
use ordnet_mapstate::{ChangeSet, Direction, MapState, Verdict, reference};

fn allow(v: Verdict) -> bool {
    v == Verdict::Allow
}

#[test]
fn flat_lookup_equals_mapstate_and_reference() {
    let mut rng = Rng::new(0x5eed_f1a7);
    let mut probes_checked = 0usize;
    for case in 0..2000 {
        let default = arb_verdict(&mut rng);
        let entries = arb_entries(&mut rng, 14, IDS);
        let ms = build(Direction::Ingress, default, &entries);
        let flat = FlatRuleSet::from_mapstate(&ms).expect("flatten");
        for id in probe_ids() {
            for (proto, port) in probe_points(&[&ms]) {
                let want = ms.lookup(id, proto, port).verdict();
                let reference = reference::evaluate(&entries, default, id, proto, port);
                let got = flat.verdict(id, proto, port);
                assert_eq!(
                    (got, want),
                    (reference, reference),
                    "case {case}: id {id:?} proto {proto} port {port}: flat {got}, mapstate \
                     {want}, reference {reference}\nkeys: {:#?}",
                    ms.iter()
                );
                probes_checked += 1;
            }
        }
    }
    println!("flatten: {probes_checked} probes agree (flat == MapState == reference)");
}

/// `meet(a, b)` allows exactly what both allow, for every identity (with keys or without) and
/// every probe point, through the kernel's own lookup function (`FlatRuleSet`).
#[test]
fn meet_allows_what_both_allow() {
    let mut rng = Rng::new(0x3ee7_a11b);
    let mut checked = 0usize;
    let mut equivalent = 0usize;
    for case in 0..1500 {
        let a = arb_mapstate(&mut rng, Direction::Ingress, 12);
        let b = arb_mapstate(&mut rng, Direction::Ingress, 12);
        let (ca, da) = flatten(&a).expect("flatten");
        let (cb, db) = flatten(&b).expect("flatten");
        let (cm, dm) = meet((&ca, da), (&cb, db));
        let flat = FlatRuleSet::new(cm.clone(), dm);
        let mut meet_is_b = true;
        for id in probe_ids() {
            for (proto, port) in probe_points(&[&a, &b]) {
                let want = allow(a.lookup(id, proto, port).verdict())
                    && allow(b.lookup(id, proto, port).verdict());
                let got = allow(flat.verdict(id, proto, port));
                meet_is_b &= got == allow(b.lookup(id, proto, port).verdict());
                assert_eq!(
                    got,
                    want,
                    "case {case}: id {id:?} proto {proto} port {port}\na: {:#?}\nb: {:#?}\nmeet: {cm:#?}",
                    a.iter(),
                    b.iter()
                );
                checked += 1;
            }
        }
        // `same_verdicts` never claims rule sets that differ on a probe agree (it may miss an
        // agreement: that only costs writes), and a rule set met with itself is itself.
        let same = same_verdicts((&cm, dm), (&cb, db));
        assert!(
            !same || meet_is_b,
            "case {case}: same_verdicts for differing rule sets"
        );
        equivalent += usize::from(same);
        let (ca2, da2) = meet((&ca, da), (&ca, da));
        assert!(same_verdicts((&ca2, da2), (&ca, da)), "case {case}");
    }
    assert!(
        equivalent > 10,
        "too few cases found where b only tightens a: {equivalent}"
    );
    println!("meet: {checked} probes (meet == a and b), {equivalent} cases meet == b");
}

#[test]
fn alternative_layouts_equal_mapstate() {
    let mut rng = Rng::new(0xa17_1a70);
    for case in 0..400 {
        let ms = arb_mapstate(&mut rng, Direction::Egress, 12);
        let (content, default) = flatten(&ms).expect("flatten");
        let classes = class_layout(&content, 3);
        let probes = probe_layout(&content, 3);
        let lpm = lpm_layout(&content, 3);
        let cilium = cilium_layout(&ms, true);
        for id in probe_ids() {
            let i = id.unwrap_or(0);
            for (proto, port) in probe_points(&[&ms]) {
                let want = allow(ms.lookup(id, proto, port).verdict());
                let got = [
                    alt::class_lookup(&classes, 3, default, i, proto, port),
                    alt::probe_lookup(&probes, 3, default, i, proto, port),
                    alt::lpm_lookup(&lpm, 3, default, i, proto, port),
                    alt::cilium_lookup(&cilium, default, true, i, proto, port),
                ];
                assert_eq!(
                    got,
                    [want; 4],
                    "case {case}: id {id:?} proto {proto} port {port} (classes, probes, lpm, \
                     cilium)\nkeys: {:#?}",
                    ms.iter()
                );
            }
        }
    }
}

/// A writer that applies every element on its own and checks the tables after each.
struct Checking<F: FnMut(&MemTables, &Write)> {
    t: MemTables,
    check: F,
    elements: usize,
}

impl<F: FnMut(&MemTables, &Write)> TableWriter for Checking<F> {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        for w in writes {
            self.t.apply(w);
            self.elements += 1;
            (self.check)(&self.t, w);
        }
        Ok(())
    }

    fn tables(&self) -> &MemTables {
        &self.t
    }
}

/// The probes a single write can affect: a cell word only its own cell, a block word only
/// its own port in cells that point to the block, a policy key only its identity; anything
/// else (an endpoint record) all of them. Probes outside that set keep their verdict, so
/// checking the affected ones after every write checks every intermediate state.
struct ProbeIndex {
    by_cell: HashMap<u32, Vec<usize>>,
    by_id: HashMap<u32, Vec<usize>>,
    all: Vec<usize>,
}

impl ProbeIndex {
    fn new(probes: &[(Option<u32>, u8, u16)]) -> ProbeIndex {
        let mut by_cell: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut by_id: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, &(id, proto, port)) in probes.iter().enumerate() {
            by_cell
                .entry(cell_index(0, proto, port).unwrap())
                .or_default()
                .push(i);
            by_id.entry(id.unwrap_or(0)).or_default().push(i);
        }
        ProbeIndex {
            by_cell,
            by_id,
            all: (0..probes.len()).collect(),
        }
    }

    fn affected(&self, t: &MemTables, w: &Write, probes: &[(Option<u32>, u8, u16)]) -> Vec<usize> {
        self.affected_at(t, EP_IP.parse().unwrap(), w, probes)
    }

    /// [`ProbeIndex::affected`] for the endpoint with address `ip`.
    fn affected_at(
        &self,
        t: &MemTables,
        ip: IpAddr,
        w: &Write,
        probes: &[(Option<u32>, u8, u16)],
    ) -> Vec<usize> {
        let record = t.ipcache[&ip_key(ip)];
        let slots = [record.ingress.ruleset, record.egress.ruleset];
        let empty = Vec::new();
        match *w {
            Write::Cell(i, _) => {
                let (slot, cell) = (i / CELLS_PER_RULESET, i % CELLS_PER_RULESET);
                if slots.contains(&slot) {
                    self.by_cell.get(&cell).unwrap_or(&empty).clone()
                } else {
                    Vec::new()
                }
            }
            Write::Block(i, _) => {
                let (block, lo) = (i / 256, i % 256);
                let mut out = Vec::new();
                for s in slots {
                    for cell in 0..CELLS_PER_RULESET {
                        if t.cells[(s * CELLS_PER_RULESET + cell) as usize] == CELL_REFINED | block
                        {
                            out.extend(
                                self.by_cell
                                    .get(&cell)
                                    .unwrap_or(&empty)
                                    .iter()
                                    .filter(|&&p| u32::from(probes[p].2 & 0xff) == lo),
                            );
                        }
                    }
                }
                out
            }
            Write::PolicyUpsert(k, _) | Write::PolicyDelete(k) => {
                if slots.contains(&k.ruleset) {
                    self.by_id.get(&k.identity).unwrap_or(&empty).clone()
                } else {
                    Vec::new()
                }
            }
            _ => self.all.clone(),
        }
    }
}

const EP_IP: &str = "10.0.0.9";

fn verdicts(t: &MemTables, probes: &[(Option<u32>, u8, u16)]) -> Vec<[bool; 2]> {
    verdicts_at(t, EP_IP.parse().unwrap(), probes)
}

/// [`verdicts`] of the endpoint with address `ip`.
fn verdicts_at(t: &MemTables, ip: IpAddr, probes: &[(Option<u32>, u8, u16)]) -> Vec<[bool; 2]> {
    let record = t.ipcache[&ip_key(ip)];
    probes
        .iter()
        .map(|&(id, proto, port)| {
            let v = |r: PolicyRef| policy_lookup(t, r, id.unwrap_or(0), proto, port).allow;
            [v(record.ingress), v(record.egress)]
        })
        .collect()
}

fn expected(ms: [&MapState; 2], probes: &[(Option<u32>, u8, u16)]) -> Vec<[bool; 2]> {
    probes
        .iter()
        .map(|&(id, proto, port)| {
            [
                allow(ms[0].lookup(id, proto, port).verdict()),
                allow(ms[1].lookup(id, proto, port).verdict()),
            ]
        })
        .collect()
}

fn probes_of(states: &[&MapState]) -> Vec<(Option<u32>, u8, u16)> {
    let points = probe_points(states);
    probe_ids()
        .into_iter()
        .flat_map(|id| points.iter().map(move |&(p, port)| (id, p, port)))
        .collect()
}

/// Key-level difference of two MapStates' flattened keys (what an in-place update must write).
/// An endpoint's spec: one identity for all its addresses.
fn spec<'a>(
    ips: &'a [IpAddr],
    identity: u32,
    ingress: &'a MapState,
    egress: &'a MapState,
) -> EndpointSpec<'a> {
    EndpointSpec {
        ips,
        identity,
        identities: &[],
        ingress,
        egress,
    }
}

/// Endpoints 1..=n, the i-th on `ips[i - 1]`, all with identity 100 and the same MapStates.
fn same_policy_batch<'a>(
    ips: &'a [Vec<IpAddr>],
    ms: &'a [MapState; 2],
) -> Vec<(u32, EndpointSpec<'a>)> {
    ips.iter()
        .enumerate()
        .map(|(i, ips)| (i as u32 + 1, spec(ips, 100, &ms[0], &ms[1])))
        .collect()
}

fn changed_keys(a: &MapState, b: &MapState) -> usize {
    // As the control plane counts them: a key whose rules change changes its rule counter.
    let mut counters = ordnet_datapath::RuleCounters::default();
    let (a, _) = ordnet_datapath::flatten_counted(a, &mut counters).unwrap();
    let (b, _) = ordnet_datapath::flatten_counted(b, &mut counters).unwrap();
    let spec = a
        .specific
        .iter()
        .filter(|(k, v)| b.specific.get(k) != Some(v))
        .count()
        + b.specific
            .keys()
            .filter(|k| !a.specific.contains_key(k))
            .count();
    let wild = a
        .wildcard
        .iter()
        .filter(|(k, v)| b.wildcard.get(k) != Some(v))
        .count()
        + b.wildcard
            .keys()
            .filter(|k| !a.wildcard.contains_key(k))
            .count();
    spec + wild
}

#[test]
fn in_place_updates_never_open_a_transient_allow() {
    let mut rng = Rng::new(0x00de_17a5);
    let ips: Vec<IpAddr> = vec![EP_IP.parse().unwrap()];
    let mut in_place = 0;
    let mut element_checks = 0usize;
    for case in 0..150 {
        let old = [
            arb_mapstate(&mut rng, Direction::Ingress, 10),
            arb_mapstate(&mut rng, Direction::Egress, 10),
        ];
        // The new state: a few entries added/removed/changed, or something unrelated.
        let new = [
            arb_mapstate(&mut rng, Direction::Ingress, 10),
            arb_mapstate(&mut rng, Direction::Egress, 10),
        ];
        let probes = probes_of(&[&old[0], &old[1], &new[0], &new[1]]);
        let want_old = expected([&old[0], &old[1]], &probes);
        let want_new = expected([&new[0], &new[1]], &probes);
        let mut control = Control::new(Store::new(8, 64, Duration::ZERO), State::default());
        let mut t = MemTables::new(8 * 769, 64 * 256);
        control
            .update_endpoints(&mut t, &[(1, spec(&ips, 42, &old[0], &old[1]))])
            .unwrap();
        assert_eq!(verdicts(&t, &probes), want_old, "case {case}: install");
        let index = ProbeIndex::new(&probes);
        let mut w = Checking {
            t,
            check: |t: &MemTables, write: &Write| {
                for i in index.affected(t, write, &probes) {
                    let probe = probes[i];
                    let now = verdicts(t, std::slice::from_ref(&probe))[0];
                    for d in 0..2 {
                        assert!(
                            !now[d] || want_old[i][d] || want_new[i][d],
                            "case {case}: transient allow for {probe:?} direction {d} after \
                             {write:?}"
                        );
                    }
                    element_checks += 1;
                }
            },
            elements: 0,
        };
        let stats = control
            .update_endpoints(&mut w, &[(1, spec(&ips, 42, &new[0], &new[1]))])
            .unwrap();
        let got = verdicts(&w.t, &probes);
        if got != want_new {
            let bad: Vec<_> = probes
                .iter()
                .zip(got.iter().zip(&want_new))
                .filter(|(_, (g, w))| g != w)
                .take(5)
                .collect();
            panic!(
                "case {case}: final verdicts differ, e.g. {bad:?}\nstats {stats:?}\nrecord {:?}\n\
                 old {:?}\nnew {:?}",
                w.t.ipcache[&ip_key(EP_IP.parse().unwrap())],
                [flatten(&old[0]).unwrap(), flatten(&old[1]).unwrap()],
                [flatten(&new[0]).unwrap(), flatten(&new[1]).unwrap()],
            );
        }
        if stats.rulesets_updated > 0 {
            in_place += 1;
        }
        // Only what changed is written: one policy write per changed key when every direction
        // was changed in place or left alone (a fresh install writes its keys once, invisibly;
        // a released rule set is cleared later).
        if stats.rulesets_installed == 0 && stats.rulesets_released == 0 {
            assert_eq!(
                stats.policy_writes as usize,
                changed_keys(&old[0], &new[0]) + changed_keys(&old[1], &new[1]),
                "case {case}"
            );
        }
    }
    assert!(in_place > 100, "too few in-place updates: {in_place}");
    println!(
        "in-place updates: {in_place} of 150 cases; {element_checks} (probe, intermediate state) \
         pairs checked"
    );
}

#[test]
fn identical_mapstates_share_one_ruleset() {
    let mut rng = Rng::new(0x5_4a2e);
    let a = [
        arb_mapstate(&mut rng, Direction::Ingress, 12),
        arb_mapstate(&mut rng, Direction::Egress, 12),
    ];
    let mut control = Control::new(Store::new(16, 256, Duration::ZERO), State::default());
    let mut t = MemTables::new(16 * 769, 256 * 256);
    let ips: Vec<Vec<IpAddr>> = (0..1000u32)
        .map(|i| vec![IpAddr::from([10, 1, (i >> 8) as u8, i as u8])])
        .collect();
    let batch = same_policy_batch(&ips, &a);
    control.update_endpoints(&mut t, &batch).unwrap();
    let distinct = usize::from(!flatten(&a[0]).unwrap().0.is_empty())
        + usize::from(!flatten(&a[1]).unwrap().0.is_empty())
        - usize::from(
            flatten(&a[0]).unwrap().0 == flatten(&a[1]).unwrap().0
                && !flatten(&a[0]).unwrap().0.is_empty(),
        );
    assert_eq!(control.store().slots_in_use().len(), distinct);

    // Everyone moves to the same new policy in one batch: changed in place.
    let mut b = a.clone();
    for (i, ms) in b.iter_mut().enumerate() {
        let mut entries: Vec<_> = ms.policy_entries();
        let mut e = arb_entry(&mut rng, 1000 + i as u64, IDS);
        e.action = ordnet_mapstate::Action::Deny;
        e.order = ordnet_mapstate::OrderKey::new(-5, 0);
        entries.push(e);
        *ms = build(ms.direction(), ms.default_verdict(), &entries);
    }
    let batch = same_policy_batch(&ips, &b);
    let stats = control.update_endpoints(&mut t, &batch).unwrap();
    assert_eq!(stats.rulesets_installed, 0, "{stats:?}");
    assert_eq!(
        stats.policy_writes as usize,
        changed_keys(&a[0], &b[0]) + changed_keys(&a[1], &b[1])
    );
    assert_eq!(stats.ip_writes, 0, "no endpoint record changes: same slots");

    // One endpoint diverges: it gets its own copy, the others keep theirs.
    let stats = control
        .update_endpoints(&mut t, &[(7, spec(&ips[6], 100, &a[0], &b[1]))])
        .unwrap();
    let ingress_changes = flatten(&a[0]).unwrap().0 != flatten(&b[0]).unwrap().0;
    assert_eq!(
        stats.ip_writes,
        u32::from(ingress_changes),
        "one record write, if any"
    );
    let ep7 = control.endpoints()[&7].clone();
    let ep8 = control.endpoints()[&8].clone();
    assert_eq!(ep7.egress, ep8.egress, "unchanged direction still shared");
    let v = |t: &MemTables, ep: u32, id, proto, port| {
        let r = t.ipcache[&ip_key(ips[ep as usize - 1][0])];
        policy_lookup(t, r.ingress, id, proto, port).allow
    };
    for id in probe_ids() {
        for (proto, port) in probe_points(&[&a[0], &b[0]]) {
            let i = id.unwrap_or(0);
            assert_eq!(
                v(&t, 7, i, proto, port),
                allow(a[0].lookup(id, proto, port).verdict())
            );
            assert_eq!(
                v(&t, 8, i, proto, port),
                allow(b[0].lookup(id, proto, port).verdict())
            );
        }
    }
}

/// A random update of a MapState built from `entries` (which it keeps in sync).
fn random_update(
    rng: &mut Rng,
    entries: &mut Vec<ordnet_mapstate::PolicyEntry>,
    next_id: &mut u64,
) -> ordnet_mapstate::Update {
    use ordnet_mapstate::{Selector, Update};
    loop {
        match rng.below(4) {
            0 | 1 => {
                let e = arb_entry(rng, *next_id, IDS);
                *next_id += 1;
                entries.push(e.clone());
                return Update::AddEntry(e);
            }
            2 if !entries.is_empty() => {
                let i = rng.below(entries.len());
                return Update::RemoveEntry(entries.remove(i).id);
            }
            _ => {
                let candidates: Vec<usize> = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| matches!(e.selector, Selector::Ids(_)))
                    .map(|(i, _)| i)
                    .collect();
                if candidates.is_empty() {
                    continue;
                }
                let i = rng.pick(&candidates);
                let id = 1 + rng.below(IDS as usize) as u32;
                let entry = entries[i].id;
                let Selector::Ids(set) = &mut entries[i].selector else {
                    unreachable!()
                };
                return if set.insert(id) {
                    Update::Select {
                        entry,
                        ids: vec![id],
                    }
                } else {
                    set.remove(id);
                    Update::Deselect {
                        entry,
                        ids: vec![id],
                    }
                };
            }
        }
    }
}

#[test]
fn change_sets_apply_in_place_safely() {
    let mut rng = Rng::new(0x0c4a_9e5e);
    let ips: Vec<IpAddr> = vec![EP_IP.parse().unwrap()];
    let other: Vec<IpAddr> = vec!["10.0.0.10".parse().unwrap()];
    let (mut in_place, mut copies, mut checks) = (0, 0, 0usize);
    for case in 0..150 {
        let mut entries = [
            arb_entries(&mut rng, 10, IDS),
            arb_entries(&mut rng, 10, IDS),
        ];
        let defaults = [arb_verdict(&mut rng), arb_verdict(&mut rng)];
        let dirs = [Direction::Ingress, Direction::Egress];
        let mut ms: Vec<MapState> = (0..2)
            .map(|d| build(dirs[d], defaults[d], &entries[d]))
            .collect();
        let mut control = Control::new(Store::new(16, 128, Duration::ZERO), State::default());
        let mut t = MemTables::new(16 * 769, 128 * 256);
        // A second endpoint shares the rule sets in half of the cases (then the change is a
        // copy unless both get it).
        let shared = case % 2 == 1;
        let mut batch = vec![(1, spec(&ips, 42, &ms[0], &ms[1]))];
        if shared {
            batch.push((2, spec(&other, 43, &ms[0], &ms[1])));
        }
        control.update_endpoints(&mut t, &batch).unwrap();
        let mut next_id = 1000;
        for step in 0..4 {
            let d = rng.below(2);
            let before = [ms[0].clone(), ms[1].clone()];
            let update = random_update(&mut rng, &mut entries[d], &mut next_id);
            let changes = ms[d].apply([update]).unwrap();
            let new_default = if rng.chance(4) {
                arb_verdict(&mut rng)
            } else {
                ms[d].default_verdict()
            };
            ms[d].set_default(new_default);
            // Released rule sets are cleared first (their writes are not this change's).
            control.reclaim(&mut t).unwrap();
            let probes = probes_of(&[&before[0], &before[1], &ms[0], &ms[1]]);
            let want_old = expected([&before[0], &before[1]], &probes);
            let want_new = expected([&ms[0], &ms[1]], &probes);
            let index = ProbeIndex::new(&probes);
            let mut w = Checking {
                t,
                check: |t: &MemTables, write: &Write| {
                    for i in index.affected(t, write, &probes) {
                        let now = verdicts(t, std::slice::from_ref(&probes[i]))[0];
                        for dd in 0..2 {
                            assert!(
                                !now[dd] || want_old[i][dd] || want_new[i][dd],
                                "case {case} step {step}: transient allow for {:?} after {write:?}",
                                probes[i]
                            );
                        }
                        checks += 1;
                    }
                },
                elements: 0,
            };
            // With a shared rule set, sometimes only endpoint 1 gets the change.
            let both = shared && rng.chance(2);
            let mut items = vec![(1, dirs[d], changes.view(), new_default)];
            if both {
                items.push((2, dirs[d], changes.view(), new_default));
            }
            let stats = control.apply_changes(&mut w, &items).unwrap();
            t = w.t;
            assert_eq!(
                verdicts(&t, &probes),
                want_new,
                "case {case} step {step}: final"
            );
            if stats.rulesets_updated > 0 {
                in_place += 1;
                let diff = ordnet_datapath::ContentDiff::from_changeset(
                    changes.view(),
                    &mut ordnet_datapath::RuleCounters::default(),
                )
                .unwrap();
                assert_eq!(
                    stats.policy_writes as usize,
                    diff.len(),
                    "only the changed keys"
                );
            }
            if stats.rulesets_installed > 0 {
                copies += 1;
            }
            if shared && !both {
                // Endpoint 2 keeps the old policy: catch up so the next step starts equal.
                let catch_up = spec(&other, 43, &ms[0], &ms[1]);
                control.update_endpoints(&mut t, &[(2, catch_up)]).unwrap();
            }
        }
    }
    assert!(
        in_place > 100 && copies > 20,
        "{in_place} in place, {copies} copies"
    );
    println!(
        "change sets: {in_place} in place, {copies} copies; {checks} (probe, intermediate state) \
         pairs checked"
    );
}

/// Several endpoints, each with rule sets of its own, changed in one batch: the rule sets that
/// change in place go through each phase of the safe order together (one batch per phase for
/// all of them, `Store::update_with_diffs`). At every single write, no endpoint allows, in
/// either direction, what neither its old nor its new policy allows; at the end each has its
/// new policy. Half the batches change one direction of every endpoint (only one side of any
/// flow changes), the others a random direction each (both sides: the meet goes first).
#[test]
fn rule_sets_changed_in_place_together_stay_safe() {
    const N: usize = 4;
    let mut rng = Rng::new(0x7a11_5e75);
    let ips: Vec<Vec<IpAddr>> = (1..=N)
        .map(|i| vec![format!("10.0.1.{i}").parse().unwrap()])
        .collect();
    let dirs = [Direction::Ingress, Direction::Egress];
    let (mut together, mut checks) = (0, 0usize);
    for case in 0..60 {
        let mut entries: Vec<[Vec<ordnet_mapstate::PolicyEntry>; 2]> = (0..N)
            .map(|_| [arb_entries(&mut rng, 8, IDS), arb_entries(&mut rng, 8, IDS)])
            .collect();
        let mut ms: Vec<Vec<MapState>> = entries
            .iter()
            .map(|e| {
                (0..2)
                    .map(|d| build(dirs[d], arb_verdict(&mut rng), &e[d]))
                    .collect()
            })
            .collect();
        let mut control = Control::new(Store::new(64, 512, Duration::ZERO), State::default());
        let mut t = MemTables::new(64 * 769, 512 * 256);
        let batch: Vec<(u32, EndpointSpec<'_>)> = (0..N)
            .map(|i| {
                (
                    i as u32 + 1,
                    spec(&ips[i], 50 + i as u32, &ms[i][0], &ms[i][1]),
                )
            })
            .collect();
        control.update_endpoints(&mut t, &batch).unwrap();
        let mut next_id = 1000;
        for step in 0..6 {
            let one_direction = rng.chance(2);
            let d_all = rng.below(2);
            let before = ms.clone();
            let mut changes = Vec::new();
            for (i, (entries, ms)) in entries.iter_mut().zip(&mut ms).enumerate() {
                if !rng.chance(4) {
                    let d = if one_direction { d_all } else { rng.below(2) };
                    let update = random_update(&mut rng, &mut entries[d], &mut next_id);
                    let ch = ms[d].apply([update]).unwrap();
                    changes.push((i, d, ch, ms[d].default_verdict()));
                }
            }
            control.reclaim(&mut t).unwrap();
            let all: Vec<&MapState> = before.iter().chain(&ms).flatten().collect();
            let probes = probes_of(&all);
            let want: Vec<[Vec<[bool; 2]>; 2]> = (0..N)
                .map(|i| {
                    [
                        expected([&before[i][0], &before[i][1]], &probes),
                        expected([&ms[i][0], &ms[i][1]], &probes),
                    ]
                })
                .collect();
            let index = ProbeIndex::new(&probes);
            let mut w = Checking {
                t,
                check: |t: &MemTables, write: &Write| {
                    for (i, want) in want.iter().enumerate() {
                        let ip = ips[i][0];
                        for p in index.affected_at(t, ip, write, &probes) {
                            let now = verdicts_at(t, ip, std::slice::from_ref(&probes[p]))[0];
                            for dd in 0..2 {
                                assert!(
                                    !now[dd] || want[0][p][dd] || want[1][p][dd],
                                    "case {case} step {step}: endpoint {i}: transient allow for \
                                     {:?} after {write:?}",
                                    probes[p]
                                );
                            }
                            checks += 1;
                        }
                    }
                },
                elements: 0,
            };
            let items: Vec<_> = changes
                .iter()
                .map(|(i, d, ch, default)| (*i as u32 + 1, dirs[*d], ch.view(), *default))
                .collect();
            let stats = control.apply_changes(&mut w, &items).unwrap();
            t = w.t;
            if stats.rulesets_updated >= 2 {
                together += 1;
            }
            for (i, want) in want.iter().enumerate() {
                assert_eq!(
                    verdicts_at(&t, ips[i][0], &probes),
                    want[1],
                    "case {case} step {step}: endpoint {i}: final"
                );
            }
        }
    }
    assert!(
        together > 100,
        "{together} batches changed several rule sets in place"
    );
    println!("{together} batches changed several rule sets in place; {checks} checks");
}

/// A rule set whose users get different changes in one batch (a relabelled pod leaving the rule
/// set it shared, while the others gain its new identity): the largest group of equal changes
/// keeps the rule set, changed in place, and the others move to their own first; no user sees
/// a state that neither its old nor its new policy allows, at any single write.
#[test]
fn a_user_leaving_a_shared_rule_set_does_not_copy_it() {
    let mut rng = Rng::new(0x1ea7_e5e7);
    let ips: [IpAddr; 3] = ["10.0.0.9", "10.0.0.10", "10.0.0.11"].map(|a| a.parse().unwrap());
    let (mut in_place, mut checks) = (0, 0usize);
    for case in 0..120 {
        let mut entries = [
            arb_entries(&mut rng, 10, IDS),
            arb_entries(&mut rng, 10, IDS),
        ];
        let defaults = [arb_verdict(&mut rng), arb_verdict(&mut rng)];
        let dirs = [Direction::Ingress, Direction::Egress];
        let ms: Vec<MapState> = (0..2)
            .map(|d| build(dirs[d], defaults[d], &entries[d]))
            .collect();
        let mut control = Control::new(Store::new(16, 128, Duration::ZERO), State::default());
        let mut t = MemTables::new(16 * 769, 128 * 256);
        let batch: Vec<_> = (0..3)
            .map(|i| {
                (
                    i as u32 + 1,
                    spec(&ips[i..=i], 42 + i as u32, &ms[0], &ms[1]),
                )
            })
            .collect();
        control.update_endpoints(&mut t, &batch).unwrap();
        let d = rng.below(2);
        let slot = |c: &Control, ep: u32| c.endpoints()[&ep].policy(dirs[d]).ruleset;
        let shared = slot(&control, 1);
        // Endpoints 1 and 3 get one change, endpoint 2 another (of the same old state).
        let (mut stay, mut leave) = (ms[d].clone(), ms[d].clone());
        let mut next_id = 1000;
        let mut other = entries[d].clone();
        let a = stay
            .apply([random_update(&mut rng, &mut entries[d], &mut next_id)])
            .unwrap();
        let b = leave
            .apply([random_update(&mut rng, &mut other, &mut next_id)])
            .unwrap();
        let states = |m: &MapState| {
            let mut s = [ms[0].clone(), ms[1].clone()];
            s[d] = m.clone();
            s
        };
        let (old, new_stay, new_leave) = (states(&ms[d]), states(&stay), states(&leave));
        let probes = probes_of(&[&old[0], &old[1], &new_stay[d], &new_leave[d]]);
        let want_old = expected([&old[0], &old[1]], &probes);
        let want = [
            expected([&new_stay[0], &new_stay[1]], &probes),
            expected([&new_leave[0], &new_leave[1]], &probes),
        ];
        let index = ProbeIndex::new(&probes);
        let mut w = Checking {
            t,
            check: |t: &MemTables, write: &Write| {
                for (e, ip) in ips.iter().enumerate() {
                    let new = &want[usize::from(e == 1)];
                    for i in index.affected_at(t, *ip, write, &probes) {
                        let now = verdicts_at(t, *ip, std::slice::from_ref(&probes[i]))[0];
                        for dd in 0..2 {
                            assert!(
                                !now[dd] || want_old[i][dd] || new[i][dd],
                                "case {case}: transient allow at endpoint {} for {:?} after {write:?}",
                                e + 1,
                                probes[i]
                            );
                            checks += 1;
                        }
                    }
                }
            },
            elements: 0,
        };
        let default = ms[d].default_verdict();
        let items = [
            (1, dirs[d], a.view(), default),
            (2, dirs[d], b.view(), default),
            (3, dirs[d], a.view(), default),
        ];
        let stats = control.apply_changes(&mut w, &items).unwrap();
        let t = w.t;
        for (e, ip) in ips.iter().enumerate() {
            let new = &want[usize::from(e == 1)];
            assert_eq!(
                &verdicts_at(&t, *ip, &probes),
                new,
                "case {case}: endpoint {}",
                e + 1
            );
        }
        let diff = |c: &ChangeSet| {
            ordnet_datapath::ContentDiff::from_changeset(
                c.view(),
                &mut ordnet_datapath::RuleCounters::default(),
            )
            .unwrap()
        };
        if !diff(&a).is_empty() && !diff(&b).is_empty() && diff(&a) != diff(&b) {
            // Both groups change: the pair keeps the rule set, changed in place, unless its new
            // content exists already; the leaver has its own.
            assert_ne!(slot(&control, 2), shared, "case {case}: endpoint 2 moved");
            assert_eq!(slot(&control, 1), slot(&control, 3), "case {case}");
            if slot(&control, 1) == shared {
                in_place += 1;
                assert_eq!(stats.rulesets_updated, 1, "case {case}");
                assert!(
                    stats.rulesets_installed <= 1,
                    "case {case}: the leaver's copy only"
                );
            }
        }
    }
    assert!(in_place > 30, "{in_place} rule sets changed in place");
    println!("{in_place} rule sets changed in place with a user leaving; {checks} checks");
}

/// One strong entry (priority -5, before anything `arb_entries` makes) for `ids` on TCP/`port`.
fn strong_entry(id: u64, ids: &[u32], verdict: Verdict, port: u16) -> ordnet_mapstate::PolicyEntry {
    let mut e = arb_entry(&mut Rng::new(id), id, IDS);
    e.order = ordnet_mapstate::OrderKey::new(-5, 0);
    e.selector = ordnet_mapstate::Selector::Ids(ids.iter().copied().collect());
    e.l4 = ordnet_mapstate::L4Match::port(ordnet_mapstate::Protocol::Tcp, port);
    e.action = verdict.into();
    e
}

/// A batch that changes one endpoint's egress and another's ingress needs the two-step write
/// (the meet first) only when a packet can see both changes: keys of an identity that no record
/// carries (a relabelled pod's new identity before its records switch) change no verdict, and
/// such a batch is written in one step (one revision). Once an address carries the identity,
/// the same kind of batch takes two.
#[test]
fn keys_of_an_identity_nobody_carries_need_no_meet() {
    let ips: [IpAddr; 2] = ["10.0.0.9", "10.0.0.10"].map(|a| a.parse().unwrap());
    let dirs = [Direction::Ingress, Direction::Egress];
    let mut ms: Vec<MapState> = (0..2).map(|d| build(dirs[d], Verdict::Deny, &[])).collect();
    let mut ms2: Vec<MapState> = ms.clone();
    let mut control = Control::new(Store::new(16, 128, Duration::ZERO), State::default());
    let mut t = MemTables::new(16 * 769, 128 * 256);
    let batch = [
        (1, spec(&ips[0..1], 42, &ms[0], &ms[1])),
        (2, spec(&ips[1..2], 43, &ms2[0], &ms2[1])),
    ];
    control.update_endpoints(&mut t, &batch).unwrap();
    let add = |m: &mut MapState, e| m.apply([ordnet_mapstate::Update::AddEntry(e)]).unwrap();
    let mut step = |control: &mut Control, t: &mut MemTables, n: u64, port: u16| {
        // Endpoint 1 may now reach 43 on `port`; endpoint 2 admits 77 on it.
        let a = add(&mut ms[1], strong_entry(n, &[43], Verdict::Allow, port));
        let b = add(
            &mut ms2[0],
            strong_entry(n + 1, &[77], Verdict::Allow, port),
        );
        let before = t.state.revision;
        let items = [
            (1, Direction::Egress, a.view(), Verdict::Deny),
            (2, Direction::Ingress, b.view(), Verdict::Deny),
        ];
        control.apply_changes(t, &items).unwrap();
        let r = t.ipcache[&ip_key(ips[1])];
        assert!(
            policy_lookup(t, r.ingress, 77, 6, port).allow,
            "77 admitted on {port}"
        );
        t.state.revision - before
    };
    assert_eq!(
        step(&mut control, &mut t, 100, 80),
        1,
        "77 is nobody's: one step"
    );
    control
        .set_identities(&mut t, &[("10.1.0.5/32".parse().unwrap(), Some(77))])
        .unwrap();
    assert_eq!(
        step(&mut control, &mut t, 200, 81),
        2,
        "77 is carried: the meet first"
    );
}

/// A network given twice in one batch takes its last entry, and is written only where it ends
/// differing from where it started: one set and removed again in one batch is not written at
/// all (its record would otherwise exist half-way through the batch, allowing what neither
/// end allows).
#[test]
fn a_network_given_twice_in_a_batch_takes_its_last_entry() {
    let mut control = Control::new(Store::new(16, 256, Duration::ZERO), State::default());
    let mut t = MemTables::new(16 * 769, 256 * 256);
    let net: ordnet_datapath::IpNet = "10.2.0.0/16".parse().unwrap();
    let cidrs = |t: &MemTables| t.cidr.values().map(|i| i.identity).collect::<Vec<_>>();
    let s = control
        .set_identities(&mut t, &[(net, Some(2)), (net, None)])
        .unwrap();
    assert_eq!((s.ip_writes, cidrs(&t)), (0, vec![]));
    let s = control
        .set_identities(&mut t, &[(net, Some(2)), (net, Some(3))])
        .unwrap();
    assert_eq!((s.ip_writes, cidrs(&t)), (1, vec![3]));
    let s = control
        .set_identities(&mut t, &[(net, None), (net, Some(3))])
        .unwrap();
    assert_eq!((s.ip_writes, cidrs(&t)), (0, vec![3]), "unchanged");
    let s = control.set_identities(&mut t, &[(net, None)]).unwrap();
    assert_eq!((s.ip_writes, cidrs(&t)), (1, vec![]));
}
