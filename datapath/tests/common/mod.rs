//! Shared helpers of the datapath tests: a seeded PRNG, random policy entries and MapStates
//! (shaped like `mapstate/tests/properties.rs`: few identities, few order keys, overlapping
//! port ranges, so ties, covering and synthesized keys are frequent), and probe points.
#![allow(dead_code)]

use std::{collections::BTreeSet, sync::Arc};

use ordnet_mapstate::{
    Direction, EntryId, L4Match, MapState, OrderKey, Origin, PolicyEntry, Protocol, Selector,
    Verdict,
};

/// xorshift64*: deterministic, so a failure is reproducible from its seed.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Identities used by the random entries (1..=IDS).
pub const IDS: u32 = 5;

pub const PORTS: [u16; 16] = [
    0, 1, 53, 79, 80, 81, 85, 90, 91, 255, 256, 1023, 1024, 8080, 65534, 65535,
];

fn arb_port(rng: &mut Rng) -> u16 {
    if rng.chance(8) {
        rng.next() as u16
    } else {
        rng.pick(&PORTS)
    }
}

pub fn arb_l4(rng: &mut Rng) -> L4Match {
    let proto = rng.pick(&Protocol::ALL);
    match rng.below(6) {
        0 => L4Match::Any,
        1 => L4Match::Proto(proto),
        2 => L4Match::port(proto, arb_port(rng)),
        3 => L4Match::Ports {
            proto,
            first: 0,
            last: 65535,
        },
        _ => {
            let a = arb_port(rng);
            let b = arb_port(rng);
            L4Match::Ports {
                proto,
                first: a.min(b),
                last: a.max(b),
            }
        }
    }
}

pub fn arb_entry(rng: &mut Rng, id: u64, ids: u32) -> PolicyEntry {
    let selector = if rng.chance(3) {
        Selector::Any
    } else {
        let n = rng.below(3);
        Selector::Ids((0..n).map(|_| 1 + rng.below(ids as usize) as u32).collect())
    };
    let verdict = if rng.chance(2) {
        Verdict::Allow
    } else {
        Verdict::Deny
    };
    let order = OrderKey::new(rng.below(4) as i32 - 1, rng.below(3) as u32);
    PolicyEntry {
        id: EntryId(id),
        order,
        action: verdict.into(),
        selector,
        l4: arb_l4(rng),
        origin: Arc::new(Origin {
            kind: "Test".into(),
            namespace: None,
            name: format!("e{id}"),
            direction: Direction::Ingress,
            rule_index: order.index,
            rule_name: None,
            priority: order.priority,
            action: verdict.into(),
            tier: ordnet_mapstate::Tier::Ordnet,
            passed_by: None,
        }),
    }
}

pub fn arb_entries(rng: &mut Rng, max: usize, ids: u32) -> Vec<PolicyEntry> {
    let n = rng.below(max + 1);
    (0..n as u64).map(|i| arb_entry(rng, i, ids)).collect()
}

pub fn arb_verdict(rng: &mut Rng) -> Verdict {
    if rng.chance(2) {
        Verdict::Allow
    } else {
        Verdict::Deny
    }
}

pub fn build(dir: Direction, default: Verdict, entries: &[PolicyEntry]) -> MapState {
    MapState::build(dir, default, entries.iter().cloned()).expect("unique entry ids")
}

/// A random MapState (up to `max` entries over identities 1..=IDS).
pub fn arb_mapstate(rng: &mut Rng, dir: Direction, max: usize) -> MapState {
    let default = arb_verdict(rng);
    let entries = arb_entries(rng, max, IDS);
    build(dir, default, &entries)
}

/// Protocols worth probing: the three with ports and some without.
pub const PROBE_PROTOCOLS: [u8; 6] = [6, 17, 132, 1, 58, 47];

/// (protocol, port) probes: every key block's edges ±1, the port space's edges, and a few
/// others, for each protocol with ports; port 0 for the others.
pub fn probe_points(states: &[&MapState]) -> Vec<(u8, u16)> {
    let mut ports: BTreeSet<u16> = PORTS.iter().copied().collect();
    for ms in states {
        for (key, _) in ms.iter() {
            if let Some((a, b)) = key.prefix.port_range() {
                for p in [a.wrapping_sub(1), a, b, b.wrapping_add(1)] {
                    ports.insert(p);
                }
            }
        }
    }
    let mut out = Vec::new();
    for proto in PROBE_PROTOCOLS {
        if matches!(proto, 6 | 17 | 132) {
            out.extend(ports.iter().map(|p| (proto, *p)));
        } else {
            out.push((proto, 0));
        }
    }
    out
}

/// Identities to probe: every identity that can have keys, two that cannot, and none.
pub fn probe_ids() -> Vec<Option<u32>> {
    (1..=IDS + 2).map(Some).chain([None]).collect()
}
