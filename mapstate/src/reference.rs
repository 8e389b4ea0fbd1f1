//! The reference evaluator: SEMANTICS.md §2 applied directly to an entry list (no trie). It is
//! the test oracle that the MapState lookup, and the datapath, must agree with.

use crate::types::{Identity, PolicyEntry, Verdict};

/// The verdict for a packet of identity `id` (None = an address no selector knows),
/// protocol `proto` and port `port`: the matching entries with the smallest order key decide,
/// deny wins ties; with no match, `default`.
pub fn evaluate(
    entries: &[PolicyEntry],
    default: Verdict,
    id: Option<Identity>,
    proto: u8,
    port: u16,
) -> Verdict {
    decide(entries, id, proto, port)
        .map(|e| e.verdict)
        .unwrap_or(default)
}

/// The deciding entry (one of them when several of equal rank decide), if any matches.
pub fn decide<'a>(
    entries: &'a [PolicyEntry],
    id: Option<Identity>,
    proto: u8,
    port: u16,
) -> Option<&'a PolicyEntry> {
    entries
        .iter()
        .filter(|e| match id {
            Some(id) => e.selector.selects(id),
            None => e.selector == crate::types::Selector::Any,
        })
        .filter(|e| e.l4.matches(proto, port))
        .min_by_key(|e| e.rank())
}
