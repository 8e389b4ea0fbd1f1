//! # ordnet MapState: a precedence-aware longest-prefix-match trie
//!
//! A MapState holds, for one endpoint and one direction, the state that a datapath reads
//! **without ever comparing priorities**. Its keys are `(peer, protocol/port prefix)` where the
//! peer is one numeric identity or the wildcard `*`; see [`L4Prefix`] for the prefix layout.
//!
//! | module | what |
//! |---|---|
//! | `types` | identities, peers, verdicts, order keys, origins, policy entries, L4 matches |
//! | `prefix` | [`L4Prefix`]: the 24-bit protocol/port prefix and its aligned blocks |
//! | `state` | the core of [`MapState`]: build, lookup, incremental [`Update`]s over entries that decide by themselves |
//! | `tiers` | [`MapState`]: tiers and `Pass` resolved into those entries (copies under a Pass), dormant Baseline entries |
//! | `changes` | [`ChangeSet`] and its safe write order |
//! | [`reference`](mod@reference) | the reference evaluator (test oracle) and the reference state |
//!
//! Everything but `reference` is re-exported here; the human rendering of a MapState lives with
//! the CLI's renderers (`controller/src/render/trie.rs`).
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
//! ## How the state is computed (one walk, no scratch trie)
//! The ordered insertion above is the *definition* ([`reference::state`] implements it
//! literally and is the test oracle). [`MapState`] computes the same result without sorting
//! contributions or building a scratch trie, from a closed form of the insertion:
//!
//! > a block `B` with contributions becomes a key iff the strongest rank at `B` is strictly
//! > stronger than every rank on `B`'s strict ancestor chain (a broader block of equal rank was
//! > inserted first and covers it); the key holds the contributions of that rank at `B`.
//!
//! (Induction over the insertion order: when `B`'s best contribution comes, a covering key is
//! present iff some strictly broader block, or `B` itself with a stronger rank, already got a
//! key; a broader block that did not get one is itself under a key at least as strong.)
//! So every key is strictly stronger than every key above it, and the "covered by" key of a
//! skipped contribution is the broadest key on its chain that is stronger (or of equal rank and
//! strictly broader) — the one that was present first when it came.
//!
//! Each peer's keys inside a region are one pre-order walk (parents before children) down the
//! blocks that can matter, with a stack of `(block, strongest rank at or above it)`:
//! - for `*`: the wildcard candidate blocks on the region's chain and inside it;
//! - for an identity: its own candidate blocks there, merged with the **`*` keys** (not the
//!   wildcard candidates) that are ancestors of, or lie inside, one of its own blocks. Using the
//!   `*` keys is exact: a wildcard candidate that is not a `*` key sits under a `*` key at least
//!   as strong, which is also on the identity's chain, so it changes no minimum and can never
//!   be a key of the identity; a wildcard-only key of the full materialization is always a `*`
//!   key (its chain has no more wildcard blocks than in `*`, only more own ones). `*` keys that
//!   are comparable with no own block can neither become keys of the identity nor bound one.
//!
//! Inside an own block `S` only the `*` keys **stronger** than `S`'s strongest own contribution
//! are visited: a weaker one can neither become a key there (everything under `S` is bounded by
//! that rank) nor lower a bound. For a broad `S` (up to 12 bits: every protocol, one protocol, a
//! /4 of its ports) they are found through a per-protocol index of the `*` keys by rank, so the
//! work is proportional to the `*` keys that actually get copied, not to the size of `S`'s
//! subtree; for a narrower `S` its subtree is enumerated.
//!
//! A key of an identity is kept when it holds an own contribution (at the key's rank) or lies
//! under such a key (then it is a copy of the `*` key: **synthesized**). The cost of a region is
//! the number of blocks walked (plus one sort of them), instead of a sort and a trie insertion
//! per contribution; `*` is computed first, then each identity from it.
//!
//! **Dead keys.** The definition can produce a key whose block is entirely covered by stronger
//! keys nested in it (for example `TCP/*` of an identity under two synthesized halves
//! `TCP/0-32767` and `TCP/32768-65535`). It never decides a packet; it is kept because the
//! state is, by definition, the ordered insertion (see docs/mapstate.md, open items).
//!
//! ## Incremental updates
//! A contribution at block `B` can only change keys inside `B`: whether a key is inserted depends
//! only on the keys on its ancestor chain. So every update marks `(peer, B)` regions dirty — the
//! entry's own identities, or for a wildcard entry `*` plus every identity with own keys
//! comparable with `B` — and each dirty region is recomputed (the walk above: the result of an
//! ordered insertion, in order-key order as in the CFP, of exactly the contributions that can
//! influence it, i.e. its ancestor chain and its subtree). `*` regions are recomputed before
//! identity regions, since those read the `*` keys; a change of `*` keys inside `B` can only
//! matter to identities with own blocks comparable with `B`, which are the ones marked. Removal
//! therefore re-exposes what the removed entry covered, and after any sequence of updates the
//! state equals the state built from scratch and [`reference::state`], entry for entry
//! (property tested). Each batch returns the exact [`ChangeSet`]; [`ChangeSet::safe_order`] gives a write
//! order that never opens a transient allow.

//! ## Tiers and Pass
//! Entries carry a tier ([`Tier`]: Admin, ordnet, Baseline; SEMANTICS.md §8) and an
//! [`Action`]: Allow, Deny, or `Pass` (Admin and Baseline only). The lookup contract above does
//! not change: tiers and Pass are resolved into the order keys of entries that decide by
//! themselves, and the ordered insertion above runs on those (`tiers.rs`):
//!
//! - the order key compares the tier first, so every Admin entry ranks before every ordnet
//!   entry, and those before every Baseline entry; at an equal `(tier, priority, index)` Deny
//!   ranks before Pass before Allow ([`Step`]);
//! - the isolation default sits between the ordnet and the Baseline tiers. While it is deny,
//!   no packet reaches the Baseline tier, and Baseline entries are left out; while it is allow
//!   they are inserted after everything else, and "nothing matched" is the final allow;
//! - a Baseline Pass skips the rest of its tier, i.e. reaches the final allow: it is an allow;
//! - an Admin Pass P skips the weaker Admin entries for the traffic it matches, and lets the
//!   weaker tiers decide it. So for every entry S of a weaker tier, the traffic both match is
//!   decided by S right after P: a **copy** of S with the selector `P ∩ S`, the L4 match
//!   `P ∩ S`, P's key with step `Passed(S's rank)` (copies rank among themselves as their
//!   originals do), S's verdict. After the copies comes P's own entry with the default's
//!   verdict (what no weaker tier decides gets it). A weaker Admin entry inside P's match is
//!   covered by P's own key or by a copy, exactly as by any stronger entry.
//!
//! Why that equals the tiered evaluation ([`reference::evaluate`], which walks the tiers): for a
//! packet P matches, the best-ranked matching entry among the stronger Admin entries, P's
//! copies and P's end is either a stronger Admin entry (it decides, as in the tiered walk), or a
//! copy of the best-ranked matching weaker-tier entry (copies keep their originals' order), or
//! P's end when no weaker-tier entry matches (the default). For a packet no Admin Pass matches,
//! the copies do not match either, and the entries rank exactly as the tiers walk them.
//! Incremental updates keep the copies in step (a selection change of P or S changes the copy
//! by the identities the other side also selects), and a change of the default moves the
//! Baseline entries in or out and rewrites the Pass ends ([`MapState::set_default`] returns the
//! keys that change). The property tests generate Admin and Baseline entries and Pass, against
//! [`reference::evaluate`] and from-scratch builds.

mod changes;
mod idset;
mod prefix;
pub mod reference;
mod state;
mod tiers;
mod types;

pub use changes::{ChangeSet, Changes, Op};
pub use idset::{IdSet, Iter as IdSetIter};
pub use prefix::L4Prefix;
pub use state::{Covered, Decision, Key, StateEntry, Update, UpdateError};
pub use tiers::{COPY_BASE, MapState};
pub use types::{
    Action, Direction, EntryId, FastHash, FastMap, FastSet, Identity, L4Match, OrderKey, Origin,
    Peer, PolicyEntry, Protocol, Selector, Step, Tier, Verdict, Via,
};
