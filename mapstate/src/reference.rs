//! The reference evaluator: SEMANTICS.md §2, §3 and §8 applied directly to an entry list (no
//! trie, no resolution of tiers into keys). It is the test oracle that the MapState lookup, and
//! the datapath, must agree with.

use crate::prefix::L4Prefix;
use crate::state::{Covered, Key, StateEntry};
use crate::types::{
    Action, EntryId, Identity, OrderKey, Peer, PolicyEntry, Selector, Tier, Verdict,
};

/// The verdict for a packet of identity `id` (None = an address no selector knows), protocol
/// `proto` and port `port`, `default` being the endpoint's isolation default: tier by tier
/// (Admin, ordnet, Baseline) the matching entries with the smallest order key decide (deny,
/// then pass, then allow at equal keys); a Pass goes on with the next tier; after the ordnet
/// tier an isolated endpoint (`default` deny) is denied; after the Baseline tier, allow.
pub fn evaluate(
    entries: &[PolicyEntry],
    default: Verdict,
    id: Option<Identity>,
    proto: u8,
    port: u16,
) -> Verdict {
    decide(entries, default, id, proto, port).0
}

/// The verdict of [`evaluate`] and the entry that decided it (one of them when several of
/// equal rank decide); `None` when a default decided (the isolation default, or the final
/// allow), possibly after Pass entries.
pub fn decide(
    entries: &[PolicyEntry],
    default: Verdict,
    id: Option<Identity>,
    proto: u8,
    port: u16,
) -> (Verdict, Option<&PolicyEntry>) {
    let best = |tier: Tier| {
        entries
            .iter()
            .filter(|e| e.order.tier() == tier)
            .filter(|e| match id {
                Some(id) => e.selector.selects(id),
                None => e.selector == Selector::Any,
            })
            .filter(|e| e.l4.matches(proto, port))
            .min_by_key(|e| e.rank())
    };
    for tier in [Tier::Admin, Tier::Ordnet] {
        match best(tier) {
            Some(e) if e.action == Action::Deny => return (Verdict::Deny, Some(e)),
            Some(e) if e.action == Action::Allow => return (Verdict::Allow, Some(e)),
            _ => {}
        }
    }
    if default == Verdict::Deny {
        return (Verdict::Deny, None);
    }
    match best(Tier::Baseline) {
        Some(e) if e.action == Action::Deny => (Verdict::Deny, Some(e)),
        Some(e) => (Verdict::Allow, Some(e)),
        None => (Verdict::Allow, None),
    }
}

/// A key of [`state`]'s scratch trie: prefix, rank, entries, whether it holds an own entry.
type RefKey = (L4Prefix, (OrderKey, Verdict), Vec<EntryId>, bool);

/// The MapState by its definition (crate documentation), computed the slow, obvious way: no
/// index, no trie, no incremental step. `entries` decide by themselves (Allow or Deny: the
/// entries a MapState resolves its input into, `MapState::resolved_entries`). It is the test oracle of [`crate::MapState`]'s keys,
/// values and covered notes, entry for entry.
///
/// - `*`: every wildcard contribution, inserted one by one in rank order (broader first at equal
///   rank); a contribution is skipped when an equal or broader key is present, except that one
///   of equal rank at an equal key merges into it.
/// - every identity that some selector names: the same ordered insertion of the wildcard
///   contributions and its own (the full materialization); of the result it keeps the keys that
///   hold one of its own contributions, and the others (wildcard keys) only when a key holding
///   one of its own contributions strictly contains them (flagged synthesized).
/// - covered notes: each skipped own contribution (for `*`: each skipped wildcard contribution),
///   with the broadest key present when it was skipped; that key's peer is the identity when the
///   identity keeps it, else `*`.
pub fn state(entries: &[PolicyEntry]) -> (Vec<(Key, StateEntry)>, Vec<Covered>) {
    let mut ids: Vec<Identity> = entries
        .iter()
        .filter_map(|e| match &e.selector {
            Selector::Ids(s) => Some(s.iter()),
            Selector::Any => None,
        })
        .flatten()
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let mut keys = Vec::new();
    let mut covered = Vec::new();
    for peer in std::iter::once(Peer::Any).chain(ids.into_iter().map(Peer::Id)) {
        // (rank, prefix length, prefix, own, entry)
        let mut items = Vec::new();
        for e in entries {
            let own = match (&e.selector, peer) {
                (Selector::Any, _) => false,
                (Selector::Ids(s), Peer::Id(id)) if s.contains(id) => true,
                _ => continue,
            };
            for b in e.l4.blocks() {
                items.push(((e.order, e.verdict()), b.len(), b, own, e.id));
            }
        }
        items.sort_by_key(|&(rank, len, b, own, id)| (rank, len, b.sort_key(), own, id));
        // (prefix, rank, entries, holds an own contribution)
        let mut trie: Vec<RefKey> = Vec::new();
        let mut skipped = Vec::new();
        for (rank, _, b, own, id) in items {
            if let Some(k) = trie.iter_mut().find(|k| k.0 == b && k.1 == rank) {
                k.2.push(id);
                k.3 |= own;
                continue;
            }
            let by = trie
                .iter()
                .filter(|k| k.0.covers(&b))
                .min_by_key(|k| k.0.len())
                .map(|k| k.0);
            match by {
                Some(by) => skipped.push((b, own, id, by)),
                None => trie.push((b, rank, vec![id], own)),
            }
        }
        let kept = |p: &L4Prefix, own: bool| {
            peer == Peer::Any || own || trie.iter().any(|k| k.3 && k.0 != *p && k.0.covers(p))
        };
        for (prefix, (order, verdict), mut ids, own) in trie.iter().cloned() {
            if !kept(&prefix, own) {
                continue;
            }
            ids.sort_unstable();
            ids.dedup();
            let mut origins: Vec<_> = ids
                .iter()
                .map(|id| {
                    entries
                        .iter()
                        .find(|e| e.id == *id)
                        .expect("listed")
                        .origin
                        .clone()
                })
                .collect();
            origins.sort();
            origins.dedup();
            keys.push((
                Key { peer, prefix },
                StateEntry {
                    verdict,
                    order,
                    entries: ids.into(),
                    origins: origins.into(),
                    synthesized: peer != Peer::Any && !own,
                },
            ));
        }
        for (b, own, id, by) in skipped {
            if peer != Peer::Any && !own {
                continue;
            }
            let by_own = trie.iter().find(|k| k.0 == by).is_some_and(|k| k.3);
            covered.push(Covered {
                entry: id,
                key: Key { peer, prefix: b },
                covered_by: Key {
                    peer: if kept(&by, by_own) { peer } else { Peer::Any },
                    prefix: by,
                },
            });
        }
    }
    keys.sort_by_key(|k| k.0);
    covered.sort();
    (keys, covered)
}
