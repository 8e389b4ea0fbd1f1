//! Alternative policy layouts, kept for the layout benchmark (`cargo bench -p ordnet-datapath`,
//! `docs/datapath.md` §4.3). None of them is used for enforcement; each has the same lookup
//! contract as [`crate::lookup::policy_lookup`] (own identity's longest match, `*` on a miss,
//! else the default), except [`cilium_lookup`], which is Cilium's layout and lookup (two LPM
//! lookups and a precedence comparison, `bpf/lib/policy.h`).
//!
//! | layout | per-packet work |
//! |---|---|
//! | [`class_lookup`] | cell arrays give the rule set's port class; hash (rule set, identity, class), on a miss hash (rule set, 0, class) |
//! | [`probe_lookup`] | hash probes at every prefix length the rule set's identity keys use, then at every length its `*` keys use |
//! | [`lpm_lookup`] | LPM trie (rule set, identity, proto/port prefix), on a miss the same with identity 0 |
//! | [`cilium_lookup`] | Cilium: LPM (identity, direction, proto/port prefix) and LPM (0, ...), higher precedence wins |

use crate::{
    layout::{PolicyKey, PolicyValue, V_ALLOW, prefix_bits},
    lookup::{MAX_PROBES, PolicyMaps, cell_word_of, highest_bit},
};

/// Key of the class layout's hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ClassKey {
    /// Rule set slot.
    pub ruleset: u32,
    /// 0 = the wildcard.
    pub identity: u32,
    /// Port class of the rule set (from the cell words).
    pub class: u32,
}

/// Map access of the class layout. The cell arrays have the shape of the enforcing layout's
/// (`PolicyMaps::cell`, `block_word`), but a word is a class number.
pub trait ClassMaps: PolicyMaps {
    /// The value of a key of the class layout's hash map.
    fn class_policy(&self, key: &ClassKey) -> Option<PolicyValue>;
}

/// Class layout: port class from the cell arrays, then (identity, class), then (0, class).
#[inline(always)]
pub fn class_lookup<M: ClassMaps + ?Sized>(
    maps: &M,
    ruleset: u32,
    default: u8,
    identity: u32,
    protocol: u8,
    port: u16,
) -> bool {
    let Some(class) = cell_word_of(maps, ruleset, protocol, port) else {
        return false;
    };
    if identity != 0 {
        let key = ClassKey {
            ruleset,
            identity,
            class,
        };
        if let Some(v) = maps.class_policy(&key) {
            return v.verdict == V_ALLOW;
        }
    }
    let key = ClassKey {
        ruleset,
        identity: 0,
        class,
    };
    match maps.class_policy(&key) {
        Some(v) => v.verdict == V_ALLOW,
        None => default == V_ALLOW,
    }
}

/// Per rule set metadata of the probe layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ProbeMeta {
    /// Bit L set: some identity key of the rule set has prefix length L.
    pub specific_lengths: u32,
    /// Bit L set: some `*` key has prefix length L.
    pub wildcard_lengths: u32,
}

/// Map access of the probe layout: the policy hash holds identity keys and `*` keys (identity
/// 0) in [`PolicyKey`] form.
pub trait ProbeMaps {
    /// The metadata of rule set `ruleset`.
    fn meta(&self, ruleset: u32) -> Option<ProbeMeta>;
    /// The value of a key of the policy hash map (identity 0 = `*`).
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue>;
}

#[inline(always)]
fn probe_lengths<M: ProbeMaps + ?Sized>(
    maps: &M,
    ruleset: u32,
    identity: u32,
    mut mask: u32,
    protocol: u8,
    port: u16,
) -> Option<bool> {
    for _ in 0..MAX_PROBES {
        if mask == 0 {
            break;
        }
        let len = highest_bit(mask);
        mask &= !(1 << len);
        let key = PolicyKey {
            ruleset,
            identity,
            prefix: prefix_bits(protocol, port, len),
        };
        if let Some(v) = maps.policy(&key) {
            return Some(v.verdict == V_ALLOW);
        }
    }
    None
}

/// Probe layout: probes at every length the rule set uses, identity first, then `*`.
#[inline(always)]
pub fn probe_lookup<M: ProbeMaps + ?Sized>(
    maps: &M,
    ruleset: u32,
    default: u8,
    identity: u32,
    protocol: u8,
    port: u16,
) -> bool {
    let Some(meta) = maps.meta(ruleset) else {
        return false;
    };
    if identity != 0
        && let Some(v) = probe_lengths(
            maps,
            ruleset,
            identity,
            meta.specific_lengths,
            protocol,
            port,
        )
    {
        return v;
    }
    match probe_lengths(maps, ruleset, 0, meta.wildcard_lengths, protocol, port) {
        Some(v) => v,
        None => default == V_ALLOW,
    }
}

/// Data part of the LPM layout's key (`prefix_len` = 64 + the proto/port prefix length).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct LpmPolicyData {
    /// Rule set slot, network byte order.
    pub ruleset: [u8; 4],
    /// Identity (0 = `*`), network byte order.
    pub identity: [u8; 4],
    /// Protocol, port (network byte order).
    pub l4: [u8; 3],
}

/// Bits of [`LpmPolicyData`] before the proto/port prefix (always matched).
pub const LPM_POLICY_FIXED_BITS: u32 = 64;

impl LpmPolicyData {
    /// The key data of a packet of `identity` to `(protocol, port)` in rule set `ruleset`.
    #[inline(always)]
    pub fn new(ruleset: u32, identity: u32, protocol: u8, port: u16) -> Self {
        let p = port.to_be_bytes();
        Self {
            ruleset: ruleset.to_be_bytes(),
            identity: identity.to_be_bytes(),
            l4: [protocol, p[0], p[1]],
        }
    }
}

/// Map access of the LPM layout.
pub trait LpmMaps {
    /// The value of the longest stored prefix that matches the first `prefix_len` bits of `data`.
    fn lpm(&self, prefix_len: u32, data: &LpmPolicyData) -> Option<PolicyValue>;
}

/// LPM layout: identity's longest match, else `*`'s longest match, else the default.
#[inline(always)]
pub fn lpm_lookup<M: LpmMaps + ?Sized>(
    maps: &M,
    ruleset: u32,
    default: u8,
    identity: u32,
    protocol: u8,
    port: u16,
) -> bool {
    let full = LPM_POLICY_FIXED_BITS + 24;
    if identity != 0
        && let Some(v) = maps.lpm(full, &LpmPolicyData::new(ruleset, identity, protocol, port))
    {
        return v.verdict == V_ALLOW;
    }
    match maps.lpm(full, &LpmPolicyData::new(ruleset, 0, protocol, port)) {
        Some(v) => v.verdict == V_ALLOW,
        None => default == V_ALLOW,
    }
}

/// Data part of Cilium's policy map key (`struct policy_key` without `lpm_key`;
/// `prefix_len` = 40 + proto/port prefix length).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CiliumData {
    /// Identity (0 = any), host byte order as in Cilium.
    pub sec_label: [u8; 4],
    /// Direction: 1 = egress.
    pub egress: u8,
    /// IP protocol number.
    pub protocol: u8,
    /// Destination port, network byte order.
    pub dport: [u8; 2],
}

/// Bits of [`CiliumData`] before the proto/port prefix (identity + direction).
pub const CILIUM_FIXED_BITS: u32 = 40;

impl CiliumData {
    /// The key data of a packet of `identity` to `(protocol, port)` in the given direction.
    #[inline(always)]
    pub fn new(identity: u32, egress: bool, protocol: u8, port: u16) -> Self {
        Self {
            sec_label: identity.to_ne_bytes(),
            egress: u8::from(egress),
            protocol,
            dport: port.to_be_bytes(),
        }
    }
}

/// Value of Cilium's policy map (`struct policy_entry`, reduced to what the verdict needs).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CiliumValue {
    /// Higher wins.
    pub precedence: u32,
    /// Non-zero: a deny entry.
    pub deny: u8,
    /// Proto/port prefix length of the entry (the LPM lookup does not return the matched key).
    pub prefix_len: u8,
    /// Padding; always zero.
    pub _pad: [u8; 2],
}

/// Cilium's `MAX_PRECEDENCE`: a deny with it ends the lookup after the first probe.
pub const CILIUM_MAX_PRECEDENCE: u32 = u32::MAX;

/// Map access of the Cilium layout.
pub trait CiliumMaps {
    /// The value of the longest stored prefix that matches the first `prefix_len` bits of `data`.
    fn cilium(&self, prefix_len: u32, data: &CiliumData) -> Option<CiliumValue>;
}

/// Cilium's `__policy_can_access`: lookup #1 with the identity; stop on a deny of maximum
/// precedence; lookup #2 with identity 0; take #2 if there is no #1, or if #2 has the higher
/// precedence, or the same precedence and a longer proto/port prefix; else #1; nothing found:
/// the default.
#[inline(always)]
pub fn cilium_lookup<M: CiliumMaps + ?Sized>(
    maps: &M,
    default: u8,
    egress: bool,
    identity: u32,
    protocol: u8,
    port: u16,
) -> bool {
    let full = CILIUM_FIXED_BITS + 24;
    let first = maps.cilium(full, &CiliumData::new(identity, egress, protocol, port));
    if let Some(v) = first
        && v.deny != 0
        && v.precedence == CILIUM_MAX_PRECEDENCE
    {
        return false;
    }
    let second = maps.cilium(full, &CiliumData::new(0, egress, protocol, port));
    let chosen = match (first, second) {
        (None, None) => return default == V_ALLOW,
        (Some(a), None) => a,
        (None, Some(b)) => b,
        (Some(a), Some(b)) => {
            if b.precedence > a.precedence
                || (b.precedence == a.precedence && b.prefix_len > a.prefix_len)
            {
                b
            } else {
                a
            }
        }
    };
    chosen.deny == 0
}

const _: () = {
    assert!(core::mem::size_of::<ClassKey>() == 12);
    assert!(core::mem::size_of::<ProbeMeta>() == 8);
    assert!(core::mem::size_of::<LpmPolicyData>() == 11);
    assert!(core::mem::size_of::<CiliumData>() == 8);
    assert!(core::mem::size_of::<CiliumValue>() == 8);
};

// SAFETY: repr(C), integers and byte arrays only, no implicit padding (sizes asserted above).
#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for ClassKey {}
    unsafe impl aya::Pod for ProbeMeta {}
    unsafe impl aya::Pod for LpmPolicyData {}
    unsafe impl aya::Pod for CiliumData {}
    unsafe impl aya::Pod for CiliumValue {}
}
