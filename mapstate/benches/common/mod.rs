//! The synthetic workload shared by the benchmarks: a deterministic mix of wildcard and specific
//! selectors over a fixed identity space, with 30% port ranges.

#![allow(dead_code)]

use std::sync::Arc;

use ordnet_mapstate::*;

/// splitmix64: small, deterministic, good enough for workload generation.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `pct` percent.
    pub fn pct(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// Ports that real policies name, so that rules overlap as they do in practice.
const COMMON_PORTS: [u16; 24] = [
    22, 25, 53, 80, 110, 123, 143, 389, 443, 445, 636, 993, 1433, 2379, 3306, 5432, 5672, 6379,
    8080, 8443, 9090, 9200, 9300, 27017,
];

fn l4(rng: &mut Rng) -> L4Match {
    let proto = match rng.below(10) {
        0..=6 => Protocol::Tcp,
        7..=8 => Protocol::Udp,
        _ => Protocol::Sctp,
    };
    match rng.below(100) {
        // 30%: a port range, of small, medium or large width.
        0..=29 => {
            let width = match rng.below(3) {
                0 => 1 + rng.below(16),
                1 => 100 + rng.below(900),
                _ => 1000 + rng.below(20_000),
            } as u32;
            let first = 1 + rng.below(60_000) as u32;
            let last = (first + width).min(65_535);
            L4Match::Ports {
                proto,
                first: first as u16,
                last: last as u16,
            }
        }
        // 50%: one port, mostly a common one.
        30..=79 => {
            let port = if rng.pct(70) {
                COMMON_PORTS[rng.below(COMMON_PORTS.len() as u64) as usize]
            } else {
                1 + rng.below(65_535) as u16
            };
            L4Match::port(proto, port)
        }
        // 12%: a whole protocol.
        80..=91 => L4Match::Proto(proto),
        // 8%: everything.
        _ => L4Match::Any,
    }
}

/// `rules` policy entries over identities `1..=identities`, shaped like the rules of every policy
/// that selects one busy endpoint:
/// - selectors: 25% wildcard; of the specific ones 85% select 1-4 identities (a pod selector)
///   and 15% select 10-100 identities (a namespace selector);
/// - L4: 30% port ranges, 50% single ports, 12% whole protocols, 8% any;
/// - order: 60% standard NetworkPolicy rules (priority 0, index 0, allow); 40% ordered rules
///   with priorities -5..=10 and rule index 0..=4 (so order keys tie often), 40% of them deny;
/// - a wildcard rule for a whole protocol or for everything is a baseline rule (priority 100..=103):
///   a strong "deny everything from everyone" would leave nothing to measure.
pub fn workload(rules: usize, identities: u32, seed: u64) -> Vec<PolicyEntry> {
    let mut rng = Rng::new(seed);
    (0..rules as u64)
        .map(|i| {
            let selector = if rng.pct(25) {
                Selector::Any
            } else {
                let n = if rng.pct(85) {
                    1 + rng.below(4)
                } else {
                    10 + rng.below(91)
                };
                Selector::ids((0..n).map(|_| 1 + rng.below(u64::from(identities)) as u32))
            };
            let l4 = l4(&mut rng);
            let (mut order, verdict) = if rng.pct(60) {
                (OrderKey::new(0, 0), Verdict::Allow)
            } else {
                let v = if rng.pct(40) {
                    Verdict::Deny
                } else {
                    Verdict::Allow
                };
                (
                    OrderKey::new(rng.below(16) as i32 - 5, rng.below(5) as u32),
                    v,
                )
            };
            if selector == Selector::Any && matches!(l4, L4Match::Any | L4Match::Proto(_)) {
                order.priority = 100 + rng.below(4) as i32;
            }
            PolicyEntry {
                id: EntryId(i),
                order,
                action: verdict.into(),
                selector,
                l4,
                origin: Arc::new(Origin {
                    kind: "OrderedNetworkPolicy".into(),
                    namespace: Some(format!("ns{}", i % 50)),
                    name: format!("pol{}", i / 5),
                    direction: Direction::Ingress,
                    rule_index: order.index,
                    rule_name: None,
                    priority: order.priority,
                    action: verdict.into(),
                    tier: Tier::Ordnet,
                    passed_by: None,
                }),
            }
        })
        .collect()
}
