//! The policy lookup on the flattened maps: one rule set, one identity, one (protocol, port).
//!
//! Layout (see `docs/datapath.md` §4): a rule set is the MapState of an endpoint and direction
//! with its keys kept as they are. The identity-specific keys live in a hash map keyed by
//! (rule set, identity, prefix). The port space of a rule set is cut into **cells**: the
//! coarsest partition such that every key's block either contains a cell or is disjoint from
//! it. Each cell has one 32-bit word in an array (two levels: per high port byte, refined per
//! low byte only where a key boundary falls inside the 256-port block) holding
//!
//! * the set of prefix lengths at which *some* identity has a key covering the cell, and
//! * the wildcard (`*`) verdict of the cell (the verdict of the longest `*` key covering it, or
//!   "none").
//!
//! A lookup reads the cell word (one or two inlined array reads), probes the hash map for the
//! packet's identity only at the lengths in the word, longest first (the first hit is the
//! identity's longest matching key), and otherwise takes the wildcard verdict, or the
//! endpoint's default when there is none. That is exactly the MapState lookup contract: own
//! identity's longest match first, `*` only on a miss, else the isolation default. The number
//! of probes is the number of distinct key lengths covering the cell (at most 18, in practice
//! 0-2), independent of how many keys, identities or endpoints there are.

use crate::event::{BY_ALLOWED, BY_DEFAULT, BY_INVALID, BY_KEY, BY_WILDCARD};
use crate::layout::{
    BLOCK_WORDS, CELL_HINT_SHIFT, CELL_MASK_BITS, CELL_REFINED, CELL_WILD_SHIFT, CELLS_PER_RULESET,
    OTHER_SLOT_CELL, PolicyKey, PolicyRef, PolicyValue, V_ALLOW, WILD_ALLOW, WILD_NONE, bit_length,
    default_counter, length_bit, prefix_bits, proto_slot, wild_length,
};

/// Read access to the three policy maps. The kernel implements it over the BPF maps, userspace
/// over its in-memory copy of a rule set (or over the live maps).
pub trait PolicyMaps {
    /// Word `index` of the cell array (`None` if out of range).
    fn cell(&self, index: u32) -> Option<u32>;
    /// Word `index` of the refined-block array (`None` if out of range).
    fn block_word(&self, index: u32) -> Option<u32>;
    /// The value of a key of the policy hash map.
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue>;

    /// The identity's longest key among the lengths to probe: `len` first, then the lengths
    /// of `mask`'s bits, longest first. Returns the value and the key's prefix. The kernel
    /// runs the same steps in `bpf_loop` (its verifier then walks them once, not once per
    /// state and iteration).
    #[inline(always)]
    fn probe(
        &self,
        ruleset: u32,
        identity: u32,
        protocol: u8,
        port: u16,
        len: u32,
        mask: u32,
    ) -> Option<(PolicyValue, u32)> {
        let (mut len, mut mask) = (len, mask);
        for _ in 0..MAX_PROBES {
            let prefix = prefix_bits(protocol, port, len);
            let key = PolicyKey {
                ruleset,
                identity,
                prefix,
            };
            if let Some(v) = self.policy(&key) {
                return Some((v, prefix));
            }
            match next_length(&mut mask) {
                Some(l) => len = l,
                None => break,
            }
        }
        None
    }
}

/// What decided a policy lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Match {
    /// The identity's own key of this prefix length (`prefix_bits` form in `prefix`).
    Specific {
        /// The matched key's prefix, in [`prefix_bits`] form.
        prefix: u32,
    },
    /// The wildcard verdict of the cell.
    Wildcard,
    /// No key matched: the endpoint's isolation default.
    Default,
    /// A map read failed or held an invalid value (fail closed: deny).
    Invalid,
}

/// Result of [`policy_lookup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyDecision {
    /// Whether the packet is allowed.
    pub allow: bool,
    /// What decided.
    pub by: Match,
    /// The same as a verdict event's code (`event::BY_*`, with `event::BY_ALLOWED` when it
    /// allows): a constant where each outcome is decided, so the event code stores it without
    /// branching on [`Match`].
    pub code: u8,
    /// The matched key's prefix ([`prefix_bits`] form) when an identity's key decided, else 0.
    pub prefix: u32,
}

/// Upper bound of hash probes per lookup: one per possible key length (0 and 8..=24).
pub const MAX_PROBES: u32 = 18;

/// Index of the cell word of `(protocol, port)` in rule set `ruleset`.
#[inline(always)]
pub fn cell_index(ruleset: u32, protocol: u8, port: u16) -> Option<u32> {
    let base = ruleset.checked_mul(CELLS_PER_RULESET)?;
    let within = match proto_slot(protocol) {
        Some(slot) => slot * 256 + u32::from(port >> 8),
        None => OTHER_SLOT_CELL,
    };
    base.checked_add(within)
}

/// The cell word (never a refinement reference) of `(protocol, port)` in `ruleset`.
#[inline(always)]
pub fn cell_word_of<M: PolicyMaps + ?Sized>(
    maps: &M,
    ruleset: u32,
    protocol: u8,
    port: u16,
) -> Option<u32> {
    let word = maps.cell(cell_index(ruleset, protocol, port)?)?;
    if word & CELL_REFINED == 0 {
        return Some(word);
    }
    // Other protocols have one word only; it is never refined.
    proto_slot(protocol)?;
    let block = word & !CELL_REFINED;
    let index = block
        .checked_mul(BLOCK_WORDS)?
        .checked_add(u32::from(port & 0xff))?;
    let word = maps.block_word(index)?;
    (word & CELL_REFINED == 0).then_some(word)
}

/// The next length to probe: the longest of `mask`'s (compressed) lengths, taken out of it;
/// `None` when none is left. One step of [`PolicyMaps::probe`] (the kernel's `bpf_loop`
/// callback too).
#[inline(always)]
pub fn next_length(mask: &mut u32) -> Option<u32> {
    if *mask == 0 {
        return None;
    }
    let bit = highest_bit(*mask);
    *mask &= !(1 << bit);
    Some(bit_length(bit))
}

/// The index of the highest set bit of a non-zero `v`. On BPF, LLVM expands `ctlz` into a
/// branch-free sequence, so the verifier sees one symbolic result per loop iteration instead of
/// a constant per branch (a branchy version multiplies the verifier's states per probe).
#[inline(always)]
pub fn highest_bit(v: u32) -> u32 {
    31 - v.leading_zeros()
}

/// The verdict of rule set `policy.ruleset` for a packet of `identity` (0 = none: only the
/// wildcard applies) to `(protocol, port)`, with `policy.default` as the isolation default.
#[inline(always)]
pub fn policy_lookup<M: PolicyMaps + ?Sized>(
    maps: &M,
    policy: PolicyRef,
    identity: u32,
    protocol: u8,
    port: u16,
) -> PolicyDecision {
    let Some(word) = cell_word_of(maps, policy.ruleset, protocol, port) else {
        return PolicyDecision {
            allow: false,
            by: Match::Invalid,
            code: BY_INVALID,
            prefix: 0,
        };
    };
    let mut mask = word & CELL_MASK_BITS;
    if identity != 0 && mask != 0 {
        // The longest length is in the word; the others (rare) come from a bit scan.
        let len = (word >> CELL_HINT_SHIFT) & 31;
        mask &= !length_bit(len);
        if let Some((v, prefix)) = maps.probe(policy.ruleset, identity, protocol, port, len, mask) {
            let allow = v.verdict == V_ALLOW;
            return PolicyDecision {
                allow,
                by: Match::Specific { prefix },
                code: BY_KEY | if allow { BY_ALLOWED } else { 0 },
                prefix,
            };
        }
    }
    match (word >> CELL_WILD_SHIFT) & 3 {
        WILD_NONE => {
            let allow = policy.default == V_ALLOW;
            PolicyDecision {
                allow,
                by: Match::Default,
                code: BY_DEFAULT | if allow { BY_ALLOWED } else { 0 },
                prefix: 0,
            }
        }
        WILD_ALLOW => PolicyDecision {
            allow: true,
            by: Match::Wildcard,
            code: BY_WILDCARD | BY_ALLOWED,
            prefix: prefix_bits(protocol, port, wild_length(word)),
        },
        _ => PolicyDecision {
            allow: false,
            by: Match::Wildcard,
            code: BY_WILDCARD,
            prefix: prefix_bits(protocol, port, wild_length(word)),
        },
    }
}

/// Where a lookup's decision counts ([`crate::layout::MAP_RULE_COUNTERS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterSite {
    /// The peer's own key decided: its [`PolicyValue::counter`].
    Key(PolicyKey),
    /// The `*` key (identity 0) decided: its [`PolicyValue::counter`].
    Wildcard(PolicyKey),
    /// The isolation default decided: its fixed element ([`default_counter`]).
    Default(u16),
}

/// Where the decision of a lookup counts, if anywhere: its code and prefix
/// (`PolicyDecision`), the rule set it was made in and the peer identity it was for, its
/// direction, and whether the packet was denied. `None` for a lookup not made (`BY_NONE`), an
/// invalid read, or a lookup that allowed a packet the other direction denied (a denied packet
/// counts for the lookup that denied it only).
///
/// The kernel's observer program runs it after the decision; the lookup does not carry the
/// counter out of its probe loop (that multiplied the verifier's states past its limit:
/// docs/datapath.md, verifier note 11), so the deciding key is found again from these.
#[inline(always)]
pub fn counter_site(
    code: u8,
    ruleset: u32,
    peer: u32,
    prefix: u32,
    egress: bool,
    packet_denied: bool,
) -> Option<CounterSite> {
    let allowed = code & BY_ALLOWED != 0;
    if packet_denied && allowed {
        return None;
    }
    let key = |identity| PolicyKey {
        ruleset,
        identity,
        prefix,
    };
    match code & !BY_ALLOWED {
        BY_KEY => Some(CounterSite::Key(key(peer))),
        BY_WILDCARD => Some(CounterSite::Wildcard(key(0))),
        BY_DEFAULT => Some(CounterSite::Default(default_counter(egress, allowed))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `counter_site` against the rule it implements, for every code byte.
    #[test]
    fn counter_site_for_every_code() {
        for code in 0..=u8::MAX {
            for egress in [false, true] {
                for denied in [false, true] {
                    let site = counter_site(code, 9, 7, 0x0600_5018, egress, denied);
                    let allowed = code & BY_ALLOWED != 0;
                    let kind = code & !BY_ALLOWED;
                    let counts =
                        matches!(kind, BY_KEY | BY_WILDCARD | BY_DEFAULT) && !(denied && allowed);
                    let what = std::format!("code {code:#x} egress {egress} denied {denied}");
                    assert_eq!(site.is_some(), counts, "{what}");
                    let key = |identity| PolicyKey {
                        ruleset: 9,
                        identity,
                        prefix: 0x0600_5018,
                    };
                    let want = match kind {
                        BY_KEY => CounterSite::Key(key(7)),
                        BY_WILDCARD => CounterSite::Wildcard(key(0)),
                        _ => CounterSite::Default(default_counter(egress, allowed)),
                    };
                    if counts {
                        assert_eq!(site, Some(want), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn highest_bit_of_every_single_and_double_bit() {
        for i in 0..32 {
            assert_eq!(highest_bit(1 << i), i);
            for j in 0..i {
                assert_eq!(highest_bit((1 << i) | (1 << j)), i);
            }
        }
        assert_eq!(highest_bit(u32::MAX), 31);
    }

    #[test]
    fn prefix_bits_masks_and_tags_the_length() {
        assert_eq!(prefix_bits(6, 80, 24), (6 << 24) | (80 << 8) | 24);
        assert_eq!(prefix_bits(6, 80, 8), (6 << 24) | 8);
        assert_eq!(prefix_bits(6, 80, 0), 0);
        assert_eq!(prefix_bits(6, 0x1234, 16), (6 << 24) | (0x12 << 16) | 16);
    }

    #[test]
    fn cell_index_bounds() {
        assert_eq!(cell_index(0, 6, 0), Some(0));
        assert_eq!(cell_index(1, 17, 0x0100), Some(769 + 256 + 1));
        assert_eq!(cell_index(2, 1, 0), Some(2 * 769 + 768));
        assert_eq!(cell_index(u32::MAX, 6, 0), None);
    }
}
