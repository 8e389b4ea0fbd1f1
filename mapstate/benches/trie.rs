//! Trie crate comparison on the MapState's real key (run with `cargo bench -p ordnet-mapstate
//! --bench trie`): `prefix-trie` 0.10 (what the MapState uses) against `radix_trie` 0.3 (what the
//! design first named).
//!
//! Key: per peer, the 24-bit (protocol, port-prefix) block, one trie per peer as in the
//! MapState. The keys are every (peer, block) of the 10k-rule benchmark workload. `radix_trie`
//! is nibble-granular; to express bit prefixes exactly each bit is encoded as one nibble (0 or 1),
//! so a block of length `n` is a key of `n` nibbles and a stored key is an ancestor of a probe
//! exactly when the block contains it. (Padding to whole nibbles would instead need up to 8
//! expanded keys per block and lose "is an ancestor present".)
//!
//! Operations, each timed over the same inputs for both crates and cross-checked:
//! - insert every key;
//! - longest-prefix match of random packets (the datapath lookup);
//! - "is any ancestor-or-equal present" for random blocks (the covered test of an insertion);
//! - enumerate the descendants of random blocks (dirty-region recomputation).

mod common;

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use ordnet_mapstate::*;
use prefix_trie::PrefixMap;
use radix_trie::{NibbleVec, Trie, TrieCommon, TrieKey};

/// A block as a radix_trie key: one nibble per prefix bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BitKey(L4Prefix);

impl TrieKey for BitKey {
    fn encode(&self) -> NibbleVec<[u8; 64]> {
        let mut v = NibbleVec::new();
        let raw = self.0.raw();
        for i in 0..u32::from(self.0.len()) {
            v.push(((raw >> (31 - i)) & 1) as u8);
        }
        v
    }
}

fn best(reps: usize, mut f: impl FnMut() -> u64) -> (Duration, u64) {
    let mut out = (Duration::MAX, 0);
    for _ in 0..reps {
        let t = Instant::now();
        let r = black_box(f());
        out = (out.0.min(t.elapsed()), r);
    }
    out
}

fn random_block(rng: &mut common::Rng, min_len: u8, max_len: u8) -> L4Prefix {
    let proto = [6u8, 17, 132][rng.below(3) as usize];
    let len = min_len + rng.below(u64::from(max_len - min_len) + 1) as u8;
    L4Prefix::new(proto, rng.below(65_536) as u16, len)
}

fn main() {
    let entries = common::workload(10_000, 1000, 0x6f72_646e_6574);
    let mut keys: Vec<(Peer, L4Prefix)> = Vec::new();
    for e in &entries {
        let blocks = e.l4.blocks();
        let peers: Vec<Peer> = match &e.selector {
            Selector::Any => vec![Peer::Any],
            Selector::Ids(s) => s.iter().map(Peer::Id).collect(),
        };
        for p in peers {
            for b in &blocks {
                keys.push((p, *b));
            }
        }
    }
    keys.sort();
    keys.dedup();
    let peers: Vec<Peer> = {
        let mut p: Vec<Peer> = keys.iter().map(|k| k.0).collect();
        p.dedup();
        p
    };
    let mut rng = common::Rng::new(42);
    let packets: Vec<(Peer, L4Prefix)> = (0..1_000_000)
        .map(|_| {
            let peer = peers[rng.below(peers.len() as u64) as usize];
            (peer, random_block(&mut rng, 24, 24))
        })
        .collect();
    let blocks: Vec<(Peer, L4Prefix)> = (0..500_000)
        .map(|_| {
            let peer = peers[rng.below(peers.len() as u64) as usize];
            (peer, random_block(&mut rng, 8, 24))
        })
        .collect();
    let regions: Vec<(Peer, L4Prefix)> = (0..200_000)
        .map(|_| {
            let peer = peers[rng.below(peers.len() as u64) as usize];
            (peer, random_block(&mut rng, 8, 16))
        })
        .collect();
    let reps = 3;

    // prefix-trie
    let build_pt = || {
        let mut m: HashMap<Peer, PrefixMap<L4Prefix, u32>> = HashMap::new();
        for (i, (p, b)) in keys.iter().enumerate() {
            m.entry(*p).or_default().insert(*b, i as u32);
        }
        m
    };
    let (pt_insert, _) = best(reps, || build_pt().len() as u64);
    let pt = build_pt();
    let (pt_lpm, pt_lpm_sum) = best(reps, || {
        packets
            .iter()
            .filter_map(|(p, b)| pt.get(p)?.get_lpm(b).map(|(_, v)| u64::from(*v)))
            .sum()
    });
    let (pt_anc, pt_anc_n) = best(reps, || {
        blocks
            .iter()
            .filter(|(p, b)| pt.get(p).is_some_and(|t| t.get_spm(b).is_some()))
            .count() as u64
    });
    let (pt_desc, pt_desc_n) = best(reps, || {
        regions
            .iter()
            .map(|(p, b)| pt.get(p).map_or(0, |t| t.children(b).count() as u64))
            .sum()
    });

    // radix_trie
    let build_rt = || {
        let mut m: HashMap<Peer, Trie<BitKey, u32>> = HashMap::new();
        for (i, (p, b)) in keys.iter().enumerate() {
            m.entry(*p).or_default().insert(BitKey(*b), i as u32);
        }
        m
    };
    let (rt_insert, _) = best(reps, || build_rt().len() as u64);
    let rt = build_rt();
    let (rt_lpm, rt_lpm_sum) = best(reps, || {
        packets
            .iter()
            .filter_map(|(p, b)| {
                rt.get(p)?
                    .get_ancestor_value(&BitKey(*b))
                    .map(|v| u64::from(*v))
            })
            .sum()
    });
    let (rt_anc, rt_anc_n) = best(reps, || {
        blocks
            .iter()
            .filter(|(p, b)| {
                rt.get(p)
                    .is_some_and(|t| t.get_ancestor(&BitKey(*b)).is_some())
            })
            .count() as u64
    });
    let (rt_desc, rt_desc_n) = best(reps, || {
        regions
            .iter()
            .map(|(p, b)| {
                rt.get(p)
                    .and_then(|t| t.get_raw_descendant(&BitKey(*b)))
                    .map_or(0, |s| s.iter().count() as u64)
            })
            .sum()
    });
    assert_eq!(pt_lpm_sum, rt_lpm_sum, "longest-prefix match disagrees");
    assert_eq!(pt_anc_n, rt_anc_n, "ancestor test disagrees");
    assert_eq!(pt_desc_n, rt_desc_n, "descendant enumeration disagrees");

    let ns = |d: Duration, n: usize| d.as_nanos() as f64 / n as f64;
    println!(
        "trie comparison: {} keys in {} per-peer tries (10k-rule workload); best of {reps}",
        keys.len(),
        peers.len()
    );
    println!(
        "{:<36} {:>14} {:>14} {:>8}",
        "operation (ns/op)", "prefix-trie", "radix_trie", "ratio"
    );
    for (name, a, b, n) in [
        ("insert", pt_insert, rt_insert, keys.len()),
        (
            "longest-prefix match (1M packets)",
            pt_lpm,
            rt_lpm,
            packets.len(),
        ),
        (
            "ancestor-or-equal present (500k)",
            pt_anc,
            rt_anc,
            blocks.len(),
        ),
        (
            "enumerate descendants (200k)",
            pt_desc,
            rt_desc,
            regions.len(),
        ),
    ] {
        println!(
            "{:<36} {:>14.1} {:>14.1} {:>7.2}x",
            name,
            ns(a, n),
            ns(b, n),
            ns(b, n) / ns(a, n)
        );
    }
    println!(
        "(answers agree: {pt_lpm_sum} LPM value sum, {pt_anc_n} covered blocks, {pt_desc_n} descendants)"
    );
}
