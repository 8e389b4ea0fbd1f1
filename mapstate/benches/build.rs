//! Build and update benchmark of the MapState (run with `cargo bench -p ordnet-mapstate --bench
//! build`). A plain program (`harness = false`) that prints a table; see docs/mapstate.md for
//! the numbers and what they mean.
//!
//! For 1k and 10k rules over 1k identities it measures:
//! - the full build (`MapState::build`) and its emitted entries (`MapState::len`);
//! - the **floor**: the naive expansion with no precedence logic. For each policy entry in input
//!   order, for each peer of its selector (the one `*` peer for a wildcard selector, else each
//!   selected identity) and each aligned block of its L4 match (`L4Match::blocks`), insert
//!   `(Key { peer, block }, value)` into a `HashMap<Key, _>` (a later entry at the same key
//!   overwrites an earlier one). Two variants: the value is the `StateEntry` the MapState emits
//!   (verdict, order key, one entry id, one origin: the same allocations per entry), and a bare
//!   `(Verdict, OrderKey)`. Both maps are pre-sized for nothing, like the MapState's tries;
//! - ns per emitted entry for each, and the ratio build / floor;
//! - the time to add one identity to the 10k-rule state (`Update::AddIdentity` through `apply`)
//!   against a full rebuild;
//! - the state's entries against the full per-identity materialization
//!   (`MapState::materialized_len` summed over every identity).

mod common;

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use ordnet_mapstate::*;

const IDENTITIES: u32 = 1000;

/// Runs `f` `reps` times and returns the fastest run and its result.
fn best<T>(reps: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best: Option<(Duration, T)> = None;
    for _ in 0..reps {
        let t = Instant::now();
        let out = black_box(f());
        let d = t.elapsed();
        if best.as_ref().is_none_or(|(b, _)| d < *b) {
            best = Some((d, out));
        }
    }
    best.expect("reps > 0")
}

fn peers(e: &PolicyEntry) -> Vec<Peer> {
    match &e.selector {
        Selector::Any => vec![Peer::Any],
        Selector::Ids(ids) => ids.iter().map(Peer::Id).collect(),
    }
}

/// The floor with the MapState's own value type.
fn floor_entries(entries: &[PolicyEntry]) -> HashMap<Key, StateEntry> {
    let mut map = HashMap::new();
    for e in entries {
        let blocks = e.l4.blocks();
        for peer in peers(e) {
            for &prefix in &blocks {
                map.insert(
                    Key { peer, prefix },
                    StateEntry {
                        verdict: e.verdict(),
                        order: e.order,
                        entries: vec![e.id].into(),
                        origins: vec![e.origin.clone()].into(),
                        synthesized: false,
                    },
                );
            }
        }
    }
    map
}

/// The floor with a bare value.
fn floor_bare(entries: &[PolicyEntry]) -> HashMap<Key, (Verdict, OrderKey)> {
    let mut map = HashMap::new();
    for e in entries {
        let blocks = e.l4.blocks();
        for peer in peers(e) {
            for &prefix in &blocks {
                map.insert(Key { peer, prefix }, (e.verdict(), e.order));
            }
        }
    }
    map
}

fn ns_per(d: Duration, n: usize) -> f64 {
    d.as_nanos() as f64 / n.max(1) as f64
}

fn main() {
    // `cargo bench` passes `--bench`. A number argument (`-- 1000`) runs only that row, for
    // profiling; the identity and materialization figures need the 10k row.
    let only: Option<usize> = std::env::args().skip(1).find_map(|a| a.parse().ok());
    println!(
        "MapState build benchmark: {IDENTITIES} identities, 25% wildcard selectors, 30% port ranges"
    );
    println!(
        "{:>6} {:>10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>10} {:>9} {:>7} {:>7}",
        "rules",
        "contribs",
        "build ms",
        "entries",
        "ns/entry",
        "floor ms",
        "entries",
        "ns/entry",
        "bare ns/e",
        "ratio",
        "ratio b"
    );
    let mut state_10k = None;
    let mut composition: Vec<(&str, MapState)> = Vec::new();
    let mut build_10k = Duration::ZERO;
    for (rules, reps) in [(1_000usize, 15usize), (10_000, 5)] {
        if only.is_some_and(|n| n != rules) {
            continue;
        }
        let entries = common::workload(rules, IDENTITIES, workload_seed());
        let contribs: usize = entries
            .iter()
            .map(|e| peers(e).len() * e.l4.blocks().len())
            .sum();
        // Interleaved, best of `reps` each: the machine is shared, so the floor and the build
        // should see the same load.
        let mut floor_t = Duration::MAX;
        let mut bare_t = Duration::MAX;
        let mut build_t = Duration::MAX;
        let mut clone_t = Duration::MAX;
        let (mut floor, mut bare, mut ms) = (HashMap::new(), HashMap::new(), None);
        for _ in 0..reps {
            let (t, f) = best(1, || floor_entries(&entries));
            floor_t = floor_t.min(t);
            floor = f;
            let (t, b) = best(1, || floor_bare(&entries));
            bare_t = bare_t.min(t);
            bare = b;
            // The clone of the input is part of what `build` consumes; it is measured separately
            // and subtracted.
            let (t, _) = best(1, || entries.clone());
            clone_t = clone_t.min(t);
            let (t, m) = best(1, || {
                MapState::build(Direction::Ingress, Verdict::Deny, entries.iter().cloned())
                    .expect("unique ids")
            });
            build_t = build_t.min(t);
            ms = Some(m);
        }
        let ms = ms.expect("reps > 0");
        let build_t = build_t.saturating_sub(clone_t);
        let build_ns = ns_per(build_t, ms.len());
        let floor_ns = ns_per(floor_t, floor.len());
        let bare_ns = ns_per(bare_t, bare.len());
        println!(
            "{:>6} {:>10} {:>10.1} {:>9} {:>10.1} {:>9.1} {:>9} {:>10.1} {:>9.1} {:>7.2} {:>7.2}",
            rules,
            contribs,
            build_t.as_secs_f64() * 1e3,
            ms.len(),
            build_ns,
            floor_t.as_secs_f64() * 1e3,
            floor.len(),
            floor_ns,
            bare_ns,
            build_ns / floor_ns,
            build_ns / bare_ns,
        );
        if rules == 10_000 {
            composition.push(("10k", ms.clone()));
            state_10k = Some((entries, ms));
            build_10k = build_t;
        } else {
            composition.push(("1k", ms));
        }
    }

    let Some((entries, mut ms)) = state_10k else {
        return;
    };
    println!();

    // Adding one identity: selected by as many specific entries as an average identity.
    let specific: Vec<&PolicyEntry> = entries
        .iter()
        .filter(|e| matches!(e.selector, Selector::Ids(_)))
        .collect();
    let selections: usize = specific
        .iter()
        .map(|e| match &e.selector {
            Selector::Ids(s) => s.len(),
            Selector::Any => 0,
        })
        .sum();
    let per_identity = selections / IDENTITIES as usize;
    let mut rng = common::Rng::new(7);
    let mut add_times = Vec::new();
    let mut remove_times = Vec::new();
    let mut keys_added = 0usize;
    let rounds = 31;
    for k in 0..rounds {
        let id = IDENTITIES + 1 + k;
        let selected_by: Vec<EntryId> = (0..per_identity)
            .map(|_| specific[rng.below(specific.len() as u64) as usize].id)
            .collect();
        let t = Instant::now();
        let changes = ms
            .apply([Update::AddIdentity { id, selected_by }])
            .expect("valid update");
        add_times.push(t.elapsed());
        keys_added += changes.added.len();
        let t = Instant::now();
        let removed = ms
            .apply([Update::RemoveIdentity(id)])
            .expect("valid update");
        remove_times.push(t.elapsed());
        assert_eq!(removed.removed.len(), changes.added.len());
    }
    add_times.sort();
    remove_times.sort();
    let add = add_times[add_times.len() / 2];
    let remove = remove_times[remove_times.len() / 2];
    println!(
        "add one identity to the 10k-rule state (selected by {per_identity} entries, {:.1} keys on average): \
         median {:.1} us, remove it again: median {:.1} us",
        keys_added as f64 / f64::from(rounds),
        add.as_secs_f64() * 1e6,
        remove.as_secs_f64() * 1e6,
    );
    println!(
        "full rebuild / add identity = {:.0}x (target >= 100x)",
        build_10k.as_secs_f64() / add.as_secs_f64()
    );
    println!();

    // Entries against the full per-identity materialization, with a variant of the 10k workload
    // in which no identity-specific rule covers a whole protocol or everything (each such rule
    // names one TCP port instead): broad own keys are what make wildcard keys get copied.
    let narrow: Vec<PolicyEntry> = entries
        .iter()
        .map(|e| match (&e.selector, e.l4) {
            (Selector::Ids(_), L4Match::Any | L4Match::Proto(_)) => PolicyEntry {
                l4: L4Match::port(Protocol::Tcp, 8000 + (e.id.0 % 100) as u16),
                ..e.clone()
            },
            _ => e.clone(),
        })
        .collect();
    composition.push((
        "10k narrow",
        MapState::build(Direction::Ingress, Verdict::Deny, narrow).expect("unique ids"),
    ));
    println!(
        "{:<11} {:>8} {:>9} {:>12} {:>9} {:>13} {:>8} {:>11}",
        "workload",
        "`*` keys",
        "own keys",
        "synthesized",
        "total",
        "materialized",
        "saving",
        "ids w/ keys"
    );
    for (name, ms) in &composition {
        let keys = ms.iter();
        let star = keys.iter().filter(|(k, _)| k.peer == Peer::Any).count();
        let synthesized = keys.iter().filter(|(_, e)| e.synthesized).count();
        let materialized: usize = (1..=IDENTITIES).map(|id| ms.materialized_len(id)).sum();
        println!(
            "{:<11} {:>8} {:>9} {:>12} {:>9} {:>13} {:>7.2}x {:>11}",
            name,
            star,
            keys.len() - star - synthesized,
            synthesized,
            keys.len(),
            materialized,
            materialized as f64 / keys.len() as f64,
            ms.identities_with_keys().len()
        );
    }
    println!(
        "(materialized: the sum over the {IDENTITIES} identities of MapState::materialized_len, \
         the keys a datapath with one lookup and no `*` key would need)"
    );
}

/// The workload seed (fixed so that runs are comparable).
const fn workload_seed() -> u64 {
    0x6f72_646e_6574
}
