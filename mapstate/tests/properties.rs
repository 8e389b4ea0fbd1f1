//! Property tests of the MapState against the reference evaluator (SEMANTICS.md §2).

use std::collections::BTreeSet;
use std::sync::Arc;

use ordnet_mapstate::reference;
use ordnet_mapstate::*;
use quickcheck::{Arbitrary, Gen, QuickCheck, TestResult};

const IDS: u32 = 5;

#[derive(Debug, Clone)]
struct Input {
    entries: Vec<PolicyEntry>,
    default: Verdict,
}

fn arb_port(g: &mut Gen) -> u16 {
    // Mostly a small set of ports so that rules overlap, sometimes the edges.
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

fn arb_entry(g: &mut Gen, id: u64) -> PolicyEntry {
    let selector = if u8::arbitrary(g) % 3 == 0 {
        Selector::Any
    } else {
        let n = u8::arbitrary(g) % 3;
        Selector::Ids((0..n).map(|_| 1 + u32::arbitrary(g) % IDS).collect())
    };
    let verdict = if bool::arbitrary(g) {
        Verdict::Allow
    } else {
        Verdict::Deny
    };
    // Few distinct order keys, so ties are frequent.
    let order = OrderKey::new(
        i32::from(i8::arbitrary(g) % 4),
        u32::from(u8::arbitrary(g) % 3),
    );
    PolicyEntry {
        id: EntryId(id),
        order,
        verdict,
        selector,
        l4: arb_l4(g),
        origin: Arc::new(Origin {
            kind: "Test".into(),
            namespace: None,
            name: format!("e{id}"),
            direction: Direction::Ingress,
            rule_index: order.index,
            priority: order.priority,
            action: verdict,
        }),
    }
}

impl Arbitrary for Input {
    fn arbitrary(g: &mut Gen) -> Input {
        let n = usize::arbitrary(g) % 14;
        Input {
            entries: (0..n as u64).map(|i| arb_entry(g, i)).collect(),
            default: if bool::arbitrary(g) {
                Verdict::Allow
            } else {
                Verdict::Deny
            },
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

fn probes(entries: &[PolicyEntry]) -> Vec<(u8, u16)> {
    let mut ports: BTreeSet<u16> = [0u16, 1, 80, 8080, 65535].into_iter().collect();
    for e in entries {
        if let L4Match::Ports { first, last, .. } = e.l4 {
            for p in [first, last] {
                ports.insert(p);
                ports.insert(p.saturating_sub(1));
                ports.insert(p.saturating_add(1));
            }
        }
    }
    let mut out = Vec::new();
    for proto in [6u8, 17, 132, 1] {
        for &p in &ports {
            out.push((proto, if proto == 1 { 0 } else { p }));
        }
    }
    out
}

fn check_lookup(input: &Input, ms: &MapState) -> Result<(), String> {
    for id in (1..=IDS + 1).map(Some).chain([None]) {
        for &(proto, port) in &probes(&input.entries) {
            let want = reference::evaluate(&input.entries, input.default, id, proto, port);
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

fn snapshot(ms: &MapState) -> (Vec<(Key, StateEntry)>, Vec<Covered>) {
    (
        ms.iter().into_iter().map(|(k, e)| (k, e.clone())).collect(),
        ms.covered().into_iter().cloned().collect(),
    )
}

#[test]
fn lookup_equals_reference() {
    fn prop(input: Input) -> TestResult {
        let ms = MapState::build(Direction::Ingress, input.default, input.entries.clone()).unwrap();
        match check_lookup(&input, &ms) {
            Ok(()) => TestResult::passed(),
            Err(e) => TestResult::error(e),
        }
    }
    QuickCheck::new()
        .tests(3000)
        .quickcheck(prop as fn(Input) -> TestResult);
}

#[test]
fn incremental_equals_from_scratch() {
    // Build from a random first half, then add the second half and remove random entries one
    // batch at a time; after each batch compare with a from-scratch build.
    fn prop(input: Input, seed: Vec<u8>) -> TestResult {
        let half = input.entries.len() / 2;
        let mut live: Vec<PolicyEntry> = input.entries[..half].to_vec();
        let mut ms = MapState::build(Direction::Ingress, input.default, live.clone()).unwrap();
        let mut rest = input.entries[half..].to_vec();
        let mut seed = seed.into_iter().chain([1, 2, 0]).cycle();
        while !rest.is_empty() || !live.is_empty() {
            let mut batch = Vec::new();
            let k = seed.next().unwrap_or(0);
            if k % 3 != 0 && !rest.is_empty() {
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
            let scratch = MapState::build(Direction::Ingress, input.default, live.clone()).unwrap();
            if snapshot(&ms) != snapshot(&scratch) {
                return TestResult::error(format!(
                    "incremental != scratch\nincremental: {:#?}\nscratch: {:#?}",
                    snapshot(&ms),
                    snapshot(&scratch)
                ));
            }
            // The change set is exactly the difference.
            let mut replay = snapshot(&before).0;
            replay.retain(|(k, _)| {
                !changes.removed.iter().any(|(r, _)| r == k)
                    && !changes.changed.iter().any(|(c, _, _)| c == k)
            });
            replay.extend(changes.added.iter().cloned());
            replay.extend(changes.changed.iter().map(|(k, _, n)| (*k, n.clone())));
            replay.sort_by(|a, b| a.0.cmp(&b.0));
            if replay != snapshot(&ms).0 {
                return TestResult::error("change set does not describe the difference");
            }
        }
        TestResult::passed()
    }
    QuickCheck::new()
        .tests(1500)
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
                set.remove(&id);
                Update::Deselect {
                    entry: entries[i].id,
                    ids: vec![id],
                }
            };
            ms.apply([update]).unwrap();
            let scratch =
                MapState::build(Direction::Egress, input.default, entries.clone()).unwrap();
            if snapshot(&ms) != snapshot(&scratch) {
                return TestResult::error("selection change: incremental != scratch");
            }
        }
        // Removing an identity altogether.
        let gone = 1;
        ms.apply([Update::RemoveIdentity(gone)]).unwrap();
        for e in &mut entries {
            if let Selector::Ids(s) = &mut e.selector {
                s.remove(&gone);
            }
        }
        let scratch = MapState::build(Direction::Egress, input.default, entries.clone()).unwrap();
        if snapshot(&ms) != snapshot(&scratch) {
            return TestResult::error("identity removal: incremental != scratch");
        }
        let probe = Input {
            entries,
            default: input.default,
        };
        match check_lookup(&probe, &ms) {
            Ok(()) => TestResult::passed(),
            Err(e) => TestResult::error(e),
        }
    }
    QuickCheck::new()
        .tests(1500)
        .quickcheck(prop as fn(Input, Vec<(u8, u8, bool)>) -> TestResult);
}
