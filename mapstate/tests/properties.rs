//! Property tests of the MapState: against the reference evaluator (SEMANTICS.md §2), against its
//! definition computed the slow way (`reference::state`), incremental against from-scratch,
//! insertion-order independence, entry counts against the full materialization, and the write
//! order of change sets.

mod common;

use std::collections::BTreeSet;

use common::*;
use ordnet_mapstate::reference;
use ordnet_mapstate::*;
use quickcheck::{Arbitrary, Gen, QuickCheck, TestResult};

/// Identities named by selectors; `IDS + 1` and `IDS + 2` are only ever added by updates or
/// selected by wildcards.
const IDS: u32 = 5;

#[derive(Debug, Clone)]
struct Input {
    entries: Vec<PolicyEntry>,
    default: Verdict,
}

fn arb_port(g: &mut Gen) -> u16 {
    // Mostly a small set of ports so that rules overlap, including the edges; sometimes any port.
    if u8::arbitrary(g) % 5 == 0 {
        return u16::arbitrary(g);
    }
    *g.choose(&[
        0, 1, 53, 79, 80, 81, 85, 90, 91, 1023, 1024, 8080, 65534, 65535,
    ])
    .unwrap()
}

fn arb_l4(g: &mut Gen) -> L4Match {
    let proto = *g.choose(&Protocol::ALL).unwrap();
    match u8::arbitrary(g) % 6 {
        0 => L4Match::Any,
        1 => L4Match::Proto(proto),
        2 => L4Match::port(proto, arb_port(g)),
        3 => L4Match::Ports {
            proto,
            first: 0,
            last: 65535,
        },
        // An empty range (first > last): a selector without any block.
        5 if bool::arbitrary(g) => {
            let a = arb_port(g);
            L4Match::Ports {
                proto,
                first: a.saturating_add(1).max(1),
                last: a.saturating_add(1).max(1) - 1,
            }
        }
        _ => {
            let a = arb_port(g);
            let b = arb_port(g);
            L4Match::Ports {
                proto,
                first: a.min(b),
                last: a.max(b),
            }
        }
    }
}

fn arb_verdict(g: &mut Gen) -> Verdict {
    if bool::arbitrary(g) {
        Verdict::Allow
    } else {
        Verdict::Deny
    }
}

fn arb_entry(g: &mut Gen, id: u64) -> PolicyEntry {
    let selector = if u8::arbitrary(g) % 3 == 0 {
        Selector::Any
    } else {
        let n = u8::arbitrary(g) % 3;
        Selector::Ids((0..n).map(|_| 1 + u32::arbitrary(g) % IDS).collect())
    };
    // Few distinct order keys, so ties are frequent.
    let (priority, index) = (
        i32::from(i8::arbitrary(g) % 4),
        u32::from(u8::arbitrary(g) % 3),
    );
    // A third of the entries in the Admin or Baseline tier, where a third of them pass.
    let tier = match u8::arbitrary(g) % 6 {
        0 => Tier::Admin,
        1 => Tier::Baseline,
        _ => Tier::Ordnet,
    };
    let action = if tier != Tier::Ordnet && u8::arbitrary(g) % 3 == 0 {
        Action::Pass
    } else {
        arb_verdict(g).into()
    };
    tiered_entry(id, tier, priority, index, action, selector, arb_l4(g))
}

impl Arbitrary for Input {
    fn arbitrary(g: &mut Gen) -> Input {
        let n = usize::arbitrary(g) % 14;
        Input {
            entries: (0..n as u64).map(|i| arb_entry(g, i)).collect(),
            default: arb_verdict(g),
        }
    }

    fn shrink(&self) -> Box<dyn Iterator<Item = Input>> {
        let default = self.default;
        let entries = self.entries.clone();
        Box::new((0..entries.len()).map(move |i| {
            let mut entries = entries.clone();
            entries.remove(i);
            Input { entries, default }
        }))
    }
}

fn entry_ranges(entries: &[PolicyEntry]) -> Vec<(u16, u16)> {
    entries
        .iter()
        .filter_map(|e| match e.l4 {
            L4Match::Ports { first, last, .. } => Some((first, last)),
            _ => None,
        })
        .collect()
}

/// Boundary probes (0, 65535, the ends of every entry's range and of every key's block, ±1)
/// plus `random` ports.
fn probes(entries: &[PolicyEntry], states: &[&MapState], random: &[u16]) -> Vec<(u8, u16)> {
    let mut ranges = entry_ranges(entries);
    for ms in states {
        ranges.extend(key_ranges(ms));
    }
    let mut ports = probe_ports(ranges);
    ports.extend(random);
    probes_at(&ports)
}

fn all_ids() -> Vec<Option<Identity>> {
    (1..=IDS + 2).map(Some).chain([None]).collect()
}

fn check_lookup(
    entries: &[PolicyEntry],
    default: Verdict,
    ms: &MapState,
    random: &[u16],
) -> Result<(), String> {
    for id in all_ids() {
        for (proto, port) in probes(entries, &[ms], random) {
            let want = reference::evaluate(entries, default, id, proto, port);
            let got = ms.lookup(id, proto, port).verdict();
            if want != got {
                return Err(format!(
                    "id {id:?} proto {proto} port {port}: reference {want}, mapstate {got}\nstate: {:#?}",
                    ms.iter()
                ));
            }
        }
    }
    Ok(())
}

fn build(entries: &[PolicyEntry], default: Verdict) -> MapState {
    MapState::build(Direction::Ingress, default, entries.iter().cloned()).unwrap()
}

/// The state equals its definition and a from-scratch build of the same entries, and it holds
/// exactly those entries.
fn check_state(ms: &MapState, entries: &[PolicyEntry], default: Verdict) -> Result<(), String> {
    let mut given = entries.to_vec();
    given.sort_by_key(|e| e.id);
    if ms.policy_entries() != given {
        return Err(format!(
            "entries differ\nstate: {:#?}\nwant: {given:#?}",
            ms.policy_entries()
        ));
    }
    let got = snapshot(ms);
    let want = reference::state(&ms.resolved_entries());
    if got != want {
        return Err(format!(
            "state != definition\nstate: {got:#?}\ndefinition: {want:#?}"
        ));
    }
    if got != snapshot(&build(entries, default)) {
        return Err("state != from-scratch build".into());
    }
    Ok(())
}

/// The number of random cases: as written in release builds (`cargo test --release`, the
/// intended way to run these); a sixth in unoptimized builds, where the same cases run about ten
/// times slower (`cargo test --workspace` in CI).
fn runs(release: u64) -> u64 {
    if cfg!(debug_assertions) {
        release / 6
    } else {
        release
    }
}

fn result(r: Result<(), String>) -> TestResult {
    match r {
        Ok(()) => TestResult::passed(),
        Err(e) => TestResult::error(e),
    }
}

#[test]
fn lookup_equals_reference() {
    fn prop(input: Input, random: Vec<u16>) -> TestResult {
        let ms = build(&input.entries, input.default);
        result(check_lookup(&input.entries, input.default, &ms, &random))
    }
    QuickCheck::new()
        .tests(runs(3000))
        .quickcheck(prop as fn(Input, Vec<u16>) -> TestResult);
}

#[test]
fn build_equals_definition() {
    fn prop(input: Input) -> TestResult {
        let ms = build(&input.entries, input.default);
        let got = snapshot(&ms);
        let want = reference::state(&ms.resolved_entries());
        if got != want {
            return TestResult::error(format!(
                "state != definition\nstate: {got:#?}\ndefinition: {want:#?}"
            ));
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(3000))
        .quickcheck(prop as fn(Input) -> TestResult);
}

#[test]
fn incremental_equals_from_scratch() {
    // Build from a random first half, then add the second half and remove random entries one
    // batch at a time; after each batch compare with a from-scratch build.
    fn prop(input: Input, seed: Vec<u8>) -> TestResult {
        let half = input.entries.len() / 2;
        let mut live: Vec<PolicyEntry> = input.entries[..half].to_vec();
        let mut ms = build(&live, input.default);
        let mut rest = input.entries[half..].to_vec();
        let mut seed = seed.into_iter().chain([1, 2, 0]).cycle();
        while !rest.is_empty() || !live.is_empty() {
            let mut batch = Vec::new();
            let k = seed.next().unwrap_or(0);
            if !k.is_multiple_of(3) && !rest.is_empty() {
                let e = rest.remove(0);
                live.push(e.clone());
                batch.push(Update::AddEntry(e));
            } else if !live.is_empty() {
                let i = usize::from(k) % live.len();
                let e = live.remove(i);
                batch.push(Update::RemoveEntry(e.id));
            } else {
                let e = rest.remove(0);
                live.push(e.clone());
                batch.push(Update::AddEntry(e));
            }
            let before = ms.clone();
            let changes = ms.apply(batch).unwrap();
            if let Err(e) = check_state(&ms, &live, input.default)
                .and_then(|()| check_change_set(&before, &ms, &changes))
            {
                return TestResult::error(e);
            }
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Input, Vec<u8>) -> TestResult);
}

#[test]
fn identity_selection_changes_equal_from_scratch() {
    fn prop(input: Input, picks: Vec<(u8, u8, bool)>) -> TestResult {
        let mut entries = input.entries.clone();
        let mut ms = MapState::build(Direction::Egress, input.default, entries.clone()).unwrap();
        for (which, id, add) in picks.into_iter().take(12) {
            if entries.is_empty() {
                break;
            }
            let i = usize::from(which) % entries.len();
            let id = 1 + u32::from(id) % IDS;
            let Selector::Ids(set) = &mut entries[i].selector else {
                continue;
            };
            let update = if add {
                set.insert(id);
                Update::Select {
                    entry: entries[i].id,
                    ids: vec![id],
                }
            } else {
                set.remove(id);
                Update::Deselect {
                    entry: entries[i].id,
                    ids: vec![id],
                }
            };
            ms.apply([update]).unwrap();
            if let Err(e) = check_state(&ms, &entries, input.default) {
                return TestResult::error(format!("selection change: {e}"));
            }
        }
        // Removing an identity altogether.
        let gone = 1;
        ms.apply([Update::RemoveIdentity(gone)]).unwrap();
        for e in &mut entries {
            if let Selector::Ids(s) = &mut e.selector {
                s.remove(gone);
            }
        }
        if let Err(e) = check_state(&ms, &entries, input.default) {
            return TestResult::error(format!("identity removal: {e}"));
        }
        result(check_lookup(&entries, input.default, &ms, &[]))
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Input, Vec<(u8, u8, bool)>) -> TestResult);
}

/// One update of a mixed batch, with entries and identities named by index into the live state
/// at the moment the update is generated.
#[derive(Debug, Clone)]
enum Step {
    Add(PolicyEntry),
    Remove(u8),
    /// Remove an entry and add a different one under the same id, in the same batch.
    Replace(u8, PolicyEntry),
    Select(u8, Vec<u8>),
    Deselect(u8, Vec<u8>),
    AddIdentity(u8, Vec<u8>),
    RemoveIdentity(u8),
}

#[derive(Debug, Clone)]
struct Scenario {
    input: Input,
    batches: Vec<Vec<Step>>,
}

impl Arbitrary for Scenario {
    fn arbitrary(g: &mut Gen) -> Scenario {
        let input = Input::arbitrary(g);
        let nb = 1 + usize::arbitrary(g) % 4;
        let mut next = 1000u64;
        let batches = (0..nb)
            .map(|_| {
                let n = 1 + usize::arbitrary(g) % 6;
                (0..n)
                    .map(|_| {
                        let small = |g: &mut Gen| {
                            (0..1 + u8::arbitrary(g) % 3)
                                .map(|_| u8::arbitrary(g))
                                .collect()
                        };
                        match u8::arbitrary(g) % 7 {
                            0 => {
                                next += 1;
                                Step::Add(arb_entry(g, next))
                            }
                            1 => Step::Remove(u8::arbitrary(g)),
                            2 => Step::Replace(u8::arbitrary(g), arb_entry(g, 0)),
                            3 => Step::Select(u8::arbitrary(g), small(g)),
                            4 => Step::Deselect(u8::arbitrary(g), small(g)),
                            5 => Step::AddIdentity(u8::arbitrary(g), small(g)),
                            _ => Step::RemoveIdentity(u8::arbitrary(g)),
                        }
                    })
                    .collect()
            })
            .collect();
        Scenario { input, batches }
    }

    fn shrink(&self) -> Box<dyn Iterator<Item = Scenario>> {
        let me = self.clone();
        let fewer_batches = (0..self.batches.len()).map({
            let me = me.clone();
            move |i| {
                let mut s = me.clone();
                s.batches.remove(i);
                s
            }
        });
        let fewer_entries = self.input.shrink().map(move |input| Scenario {
            input,
            batches: me.batches.clone(),
        });
        Box::new(fewer_batches.chain(fewer_entries))
    }
}

fn specific_index(live: &[PolicyEntry], i: u8) -> Option<usize> {
    let specific: Vec<usize> = (0..live.len())
        .filter(|&k| matches!(live[k].selector, Selector::Ids(_)))
        .collect();
    (!specific.is_empty()).then(|| specific[usize::from(i) % specific.len()])
}

/// Turns the steps of one batch into updates, applying each to `live` (the model).
fn resolve(steps: &[Step], live: &mut Vec<PolicyEntry>) -> Vec<Update> {
    let id_of = |b: u8| 1 + u32::from(b) % (IDS + 2);
    let mut out = Vec::new();
    for step in steps {
        match step {
            Step::Add(e) => {
                live.push(e.clone());
                out.push(Update::AddEntry(e.clone()));
            }
            Step::Remove(i) if !live.is_empty() => {
                let e = live.remove(usize::from(*i) % live.len());
                out.push(Update::RemoveEntry(e.id));
            }
            Step::Replace(i, new) if !live.is_empty() => {
                let k = usize::from(*i) % live.len();
                let mut new = new.clone();
                new.id = live[k].id;
                out.push(Update::RemoveEntry(new.id));
                out.push(Update::AddEntry(new.clone()));
                live[k] = new;
            }
            Step::Select(i, ids) | Step::Deselect(i, ids) => {
                let Some(k) = specific_index(live, *i) else {
                    continue;
                };
                let ids: Vec<Identity> = ids.iter().map(|b| id_of(*b)).collect();
                let entry = live[k].id;
                let Selector::Ids(set) = &mut live[k].selector else {
                    unreachable!()
                };
                if matches!(step, Step::Select(..)) {
                    set.extend(ids.iter().copied());
                    out.push(Update::Select { entry, ids });
                } else {
                    for id in &ids {
                        set.remove(*id);
                    }
                    out.push(Update::Deselect { entry, ids });
                }
            }
            Step::AddIdentity(id, by) => {
                let id = id_of(*id);
                let mut selected_by = Vec::new();
                for b in by {
                    if let Some(k) = specific_index(live, *b)
                        && let Selector::Ids(set) = &mut live[k].selector
                    {
                        set.insert(id);
                        selected_by.push(live[k].id);
                    }
                }
                out.push(Update::AddIdentity { id, selected_by });
            }
            Step::RemoveIdentity(id) => {
                let id = id_of(*id);
                for e in live.iter_mut() {
                    if let Selector::Ids(set) = &mut e.selector {
                        set.remove(id);
                    }
                }
                out.push(Update::RemoveIdentity(id));
            }
            Step::Remove(_) | Step::Replace(..) => {}
        }
    }
    out
}

#[test]
fn mixed_batches_equal_from_scratch() {
    // Batches mixing AddIdentity, RemoveIdentity, Select, Deselect, AddEntry and RemoveEntry
    // (including the removal and re-addition of one id) in one `apply` each.
    fn prop(s: Scenario) -> TestResult {
        let default = s.input.default;
        let mut live = s.input.entries.clone();
        let mut ms = build(&live, default);
        for steps in &s.batches {
            let updates = resolve(steps, &mut live);
            let before = ms.clone();
            let changes = match ms.apply(updates.clone()) {
                Ok(c) => c,
                Err(e) => return TestResult::error(format!("{e}: {updates:#?}")),
            };
            if let Err(e) = check_state(&ms, &live, default)
                .and_then(|()| check_change_set(&before, &ms, &changes))
            {
                return TestResult::error(format!("{e}\nbatch: {updates:#?}"));
            }
        }
        result(check_lookup(&live, default, &ms, &[]))
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Scenario) -> TestResult);
}

#[test]
fn default_changes_equal_from_scratch() {
    // The isolation default flips (Baseline entries go dormant or come back, Admin Pass ends
    // change), between batches of updates: state, change set and lookup stay exact.
    fn prop(s: Scenario) -> TestResult {
        let mut default = s.input.default;
        let mut live = s.input.entries.clone();
        let mut ms = build(&live, default);
        for steps in &s.batches {
            default = match default {
                Verdict::Allow => Verdict::Deny,
                Verdict::Deny => Verdict::Allow,
            };
            let before = ms.clone();
            let changes = ms.set_default(default);
            if let Err(e) = check_state(&ms, &live, default)
                .and_then(|()| check_change_set(&before, &ms, &changes))
                .and_then(|()| check_lookup(&live, default, &ms, &[]))
            {
                return TestResult::error(format!("after the default became {default}: {e}"));
            }
            let updates = resolve(steps, &mut live);
            let before = ms.clone();
            let changes = ms.apply(updates).unwrap();
            if let Err(e) = check_state(&ms, &live, default)
                .and_then(|()| check_change_set(&before, &ms, &changes))
            {
                return TestResult::error(e);
            }
        }
        result(check_lookup(&live, default, &ms, &[]))
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Scenario) -> TestResult);
}

#[test]
fn failed_batch_changes_nothing() {
    // A valid batch followed by one invalid update: the whole batch is refused.
    fn prop(s: Scenario, which: u8) -> TestResult {
        let mut live = s.input.entries.clone();
        let mut ms = build(&live, s.input.default);
        let Some(steps) = s.batches.first() else {
            return TestResult::discard();
        };
        let mut updates = resolve(steps, &mut live);
        let bad = match which % 3 {
            0 => Update::RemoveEntry(EntryId(999_999)),
            1 => Update::AddEntry(entry(
                live.first().map_or(0, |e| e.id.0),
                0,
                0,
                Verdict::Allow,
                Selector::Any,
                L4Match::Any,
            )),
            _ => Update::Select {
                entry: EntryId(999_999),
                ids: vec![1],
            },
        };
        if which % 3 == 1 && live.is_empty() {
            return TestResult::discard();
        }
        updates.push(bad);
        let before = snapshot(&ms);
        if ms.apply(updates).is_ok() {
            return TestResult::error("invalid batch accepted");
        }
        if snapshot(&ms) != before {
            return TestResult::error("refused batch changed the state");
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(500))
        .quickcheck(prop as fn(Scenario, u8) -> TestResult);
}

#[test]
fn insertion_order_independent() {
    // Entries of equal order key (frequent with this generator) in any input order, built at
    // once or added one by one: the same state, entry for entry. The entry ids stay with their
    // entries (they are part of the state); only the order of the input list changes.
    fn prop(input: Input, seed: Vec<u64>) -> TestResult {
        let base = snapshot(&build(&input.entries, input.default));
        let mut perm = input.entries.clone();
        let mut seed = seed.into_iter().chain([7, 3, 11]).cycle();
        for i in (1..perm.len()).rev() {
            let j = (seed.next().unwrap() % (i as u64 + 1)) as usize;
            perm.swap(i, j);
        }
        if snapshot(&build(&perm, input.default)) != base {
            return TestResult::error("permuted input gives another state");
        }
        let mut ms = MapState::new(Direction::Ingress, input.default);
        for e in perm.iter().rev() {
            ms.apply([Update::AddEntry(e.clone())]).unwrap();
        }
        if snapshot(&ms) != base {
            return TestResult::error("one-by-one additions in another order give another state");
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Input, Vec<u64>) -> TestResult);
}

#[test]
fn no_entry_needed_twice() {
    // Against the full per-identity materialization (every entry that selects the identity,
    // wildcard or not, in one trie): each identity keeps a subset of its materialization, the
    // wildcard keys are stored once, and every synthesized key is a copy of a `*` key that is
    // stronger than the nearest own key containing it.
    fn prop(input: Input) -> TestResult {
        let ms = build(&input.entries, input.default);
        let keys = ms.iter();
        let star: Vec<_> = keys.iter().filter(|(k, _)| k.peer == Peer::Any).collect();
        // What the keys come from: the entries resolved (tiers, copies under a Pass).
        let resolved = ms.resolved_entries();
        let is_wild = |id: &EntryId| {
            resolved
                .iter()
                .any(|e| e.id == *id && e.selector == Selector::Any)
        };
        let mut total_materialized = 0;
        for id in 1..=IDS + 1 {
            // An independent materialization: the entries that select `id`, all made specific.
            let only: Vec<PolicyEntry> = input
                .entries
                .iter()
                .filter(|e| e.selector.selects(id))
                .map(|e| PolicyEntry {
                    selector: Selector::ids([id]),
                    ..e.clone()
                })
                .collect();
            let full = build(&only, input.default);
            if full.len() != ms.materialized_len(id) {
                return TestResult::error(format!("materialized_len({id}) is wrong"));
            }
            if let Err(e) = check_lookup(&only, input.default, &full, &[]) {
                return TestResult::error(format!("materialization of {id} is wrong: {e}"));
            }
            total_materialized += full.len();
            let mine: Vec<_> = keys
                .iter()
                .filter(|(k, _)| k.peer == Peer::Id(id))
                .collect();
            if mine.len() > full.len() {
                return TestResult::error(format!("identity {id}: more keys than materialized"));
            }
            for (k, e) in &mine {
                let Some(m) = full.get(k) else {
                    return TestResult::error(format!("{k:?} is not in the materialization"));
                };
                if (m.verdict, m.order, &m.entries) != (e.verdict, e.order, &e.entries) {
                    return TestResult::error(format!("{k:?} differs from the materialization"));
                }
                if !e.synthesized {
                    // An own key holds an entry that selects this identity by name.
                    if !e.entries.iter().any(|x| {
                        resolved
                            .iter()
                            .any(|p| p.id == *x && p.selector != Selector::Any)
                    }) {
                        return TestResult::error(format!("{k:?}: own key without own entry"));
                    }
                    continue;
                }
                if !e.entries.iter().all(is_wild) {
                    return TestResult::error(format!("{k:?}: synthesized from a specific entry"));
                }
                let copy_of = star.iter().find(|(s, _)| s.prefix == k.prefix);
                match copy_of {
                    Some((_, s))
                        if StateEntry {
                            synthesized: true,
                            ..(*s).clone()
                        } == **e => {}
                    _ => return TestResult::error(format!("{k:?}: not a copy of a `*` key")),
                }
                let ancestor = mine
                    .iter()
                    .filter(|(a, ae)| {
                        !ae.synthesized && a.prefix != k.prefix && a.prefix.covers(&k.prefix)
                    })
                    .max_by_key(|(a, _)| a.prefix.len());
                match ancestor {
                    Some((_, a)) if (e.order, e.verdict) < (a.order, a.verdict) => {}
                    _ => {
                        return TestResult::error(format!(
                            "{k:?}: no weaker own key contains the synthesized key"
                        ));
                    }
                }
            }
        }
        // Identity IDS + 1 is selected by wildcards only: its materialization is the `*` trie.
        if ms.materialized_len(IDS + 1) != star.len() {
            return TestResult::error("an identity without keys does not materialize to `*`");
        }
        if ms.len() > total_materialized {
            return TestResult::error(format!(
                "{} keys > {} materialized",
                ms.len(),
                total_materialized
            ));
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(1500))
        .quickcheck(prop as fn(Input) -> TestResult);
}

#[test]
fn safe_order_never_opens_a_transient_allow() {
    // Random before/after states, through real change sets: one mixed batch, and the change
    // between two unrelated entry lists. Writing the ops of `safe_order` one by one into a model
    // of the datapath maps never allows a probe that both states deny, and ends in the new state.
    fn prop(s: Scenario, other: Input, mut random: Vec<u16>) -> TestResult {
        random.truncate(8);
        let default = s.input.default;
        let mut live = s.input.entries.clone();
        let before = build(&live, default);
        let mut cases = Vec::new();
        if let Some(steps) = s.batches.first() {
            let updates = resolve(steps, &mut live);
            let mut after = before.clone();
            let changes = after.apply(updates).unwrap();
            cases.push((after, changes, live.clone()));
        }
        // Everything replaced: remove the old entries, add unrelated ones (ids shifted apart).
        let mut after = before.clone();
        let fresh: Vec<PolicyEntry> = other
            .entries
            .iter()
            .map(|e| PolicyEntry {
                id: EntryId(e.id.0 + 10_000),
                ..e.clone()
            })
            .collect();
        let changes = after
            .apply(
                s.input
                    .entries
                    .iter()
                    .map(|e| Update::RemoveEntry(e.id))
                    .chain(fresh.iter().cloned().map(Update::AddEntry)),
            )
            .unwrap();
        cases.push((after, changes, fresh));
        for (after, changes, after_entries) in cases {
            let mut all = s.input.entries.clone();
            all.extend(after_entries);
            let probes = probes(&all, &[&before, &after], &random);
            if let Err(e) =
                check_write_order(&before, &after, &changes.safe_order(), &all_ids(), &probes)
            {
                return TestResult::error(e);
            }
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(500))
        .quickcheck(prop as fn(Scenario, Input, Vec<u16>) -> TestResult);
}

/// Whether the keys of `peer` strictly inside `prefix` cover all of it: then the key at `prefix`
/// never decides a packet (a "dead" key; the definition keeps it, see docs/mapstate.md).
fn shadowed(ms: &MapState, peer: Peer, prefix: L4Prefix) -> bool {
    let inner: Vec<L4Prefix> = ms
        .iter()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.peer == peer && k.prefix != prefix && prefix.covers(&k.prefix))
        .map(|k| k.prefix)
        .collect();
    let size = |p: &L4Prefix| 1u64 << (24 - u32::from(p.len()));
    let maximal: u64 = inner
        .iter()
        .filter(|p| !inner.iter().any(|q| q != *p && q.covers(p)))
        .map(size)
        .sum();
    maximal == size(&prefix)
}

#[test]
fn probes_reach_every_key() {
    // Guard for the probe sets above: every key of a state that can decide a packet is the
    // deciding key of some probe of `probes`, so a wrong key cannot hide between probes.
    fn prop(input: Input) -> TestResult {
        let ms = build(&input.entries, input.default);
        let probes = probes(&input.entries, &[&ms], &[]);
        let ids: BTreeSet<Option<Identity>> = all_ids().into_iter().collect();
        for (k, _) in ms.iter() {
            let id = match k.peer {
                Peer::Any => None,
                Peer::Id(id) => Some(id),
            };
            let reached = ids.contains(&id)
                && probes.iter().any(|&(proto, port)| {
                    matches!(ms.lookup(id, proto, port), Decision::Matched { key, .. } if key == k)
                });
            if !reached && !shadowed(&ms, k.peer, k.prefix) {
                return TestResult::error(format!(
                    "no probe reaches {k:?}\nstate: {:#?}\nentries: {:#?}",
                    ms.iter(),
                    input.entries
                ));
            }
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(runs(1000))
        .quickcheck(prop as fn(Input) -> TestResult);
}
