//! # ordnet MapState: a precedence-aware longest-prefix-match trie
//!
//! A MapState holds, for one endpoint and one direction, the state that a datapath reads
//! **without ever comparing priorities**. Its keys are `(peer, protocol/port prefix)` where the
//! peer is one numeric identity or the wildcard `*`; see [`L4Prefix`] for the prefix layout.
//!
//! ## Lookup contract
//! For a packet from/to identity `I`, protocol `P`, port `N`:
//! 1. the longest key of `I` that matches `(P, N)` decides;
//! 2. only if `I` has no matching key, the longest key of `*` that matches decides;
//! 3. if nothing matches, the endpoint's isolation default applies.
//!
//! ## Why the state makes that contract equal to the rule semantics
//! Policy entries are ranked by `(order key, deny before allow)`; the verdict of a packet is the
//! verdict of its best-ranked matching entry (SEMANTICS.md §2). Sort all contributions by rank
//! (broader blocks first at equal rank, so the result is canonical) and insert them one by one
//! into a trie, **skipping a block if an equal or broader key is already present**. Then the
//! longest key matching a packet is always the block of its best-ranked matching entry: that
//! entry's block was not skipped (anything covering it would also match the packet and be
//! better ranked), every key inserted later that also matches is either broader (loses the
//! longest-prefix match) or narrower (and was skipped because the block covered it). Skipped
//! contributions are recorded as **covered**, with the key that covers them.
//!
//! Doing that per identity with every wildcard entry copied in (the "full materialization") is
//! correct but costs `identities × wildcard entries`. The MapState instead keeps the wildcard
//! entries once under `*`, and under an identity only:
//! - the identity's own (specific) keys, and
//! - **synthesized covering entries**: wildcard keys that lie strictly inside one of the
//!   identity's own keys and are stronger than it (they were inserted before it, so the broader
//!   specific key did not hide them in the full materialization). Without the copy, rule 1 of the
//!   lookup would stop at the broader specific key and skip the stronger wildcard entry.
//!
//! **Weaker wildcard entries never need copying.** Take a wildcard entry `W` weaker than a
//! specific key `S` of identity `I`, overlapping it (prefixes overlap only by containment):
//! - if `W` lies inside `S`, `S` covered it when it came (later) in the ordered insertion: for
//!   identity `I` the packets of `W` are decided by `S` or by stronger keys inside `S`, all of
//!   which are already under `I`;
//! - if `W` contains `S`, the packets of `W` outside `S` find no key of `I` (or only other keys
//!   that are themselves correct), fall through to `*`, and find `W` there; the packets inside `S`
//!   are decided by `S` or stronger keys under it, which is right since `S` is stronger.
//!
//! In both cases the specific-first lookup already gives the full materialization's answer.
//! (A wildcard entry that overlaps no key of `I` is reached through `*` unchanged.)
//!
//! ## Incremental updates
//! A contribution at block `B` can only change keys inside `B`: whether a key is inserted depends
//! only on the keys on its ancestor chain. So every update marks `(peer, B)` regions dirty — the
//! entry's own identities, or for a wildcard entry `*` plus every identity with own keys
//! comparable with `B` — and each dirty region is recomputed by an ordered insertion (in order-key
//! order, as in the CFP) of exactly the contributions that can influence it (its ancestor chain
//! and its subtree). Removal therefore re-exposes what the removed entry covered, and after any
//! sequence of updates the state equals the state built from scratch, entry for entry (property
//! tested). Each batch returns the exact [`ChangeSet`]; [`ChangeSet::safe_order`] gives a write
//! order that never opens a transient allow.

pub mod changes;
pub mod dump;
pub mod prefix;
pub mod reference;
pub mod state;
pub mod types;

pub use changes::{ChangeSet, Op};
pub use prefix::L4Prefix;
pub use state::{Covered, Decision, Key, MapState, StateEntry, Update, UpdateError};
pub use types::{
    Direction, EntryId, Identity, L4Match, OrderKey, Origin, Peer, PolicyEntry, Protocol, Selector,
    Verdict,
};
