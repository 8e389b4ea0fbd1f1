//! Benchmark programs for the policy layout comparison (`docs/datapath.md` §4.3, run by
//! `cargo bench -p ordnet-datapath`). Each program parses the frame with the shared parser and
//! makes one policy decision for (rule set, identity, protocol, destination port); they differ
//! only in the map layout of that decision:
//!
//! | program | decision |
//! |---|---|
//! | `bench_pass`, `bench_tc_pass` | nothing: a program run's own cost (XDP, TC) |
//! | `bench_parse` | none (always PASS): the part every program shares |
//! | `bench_floor` | one hash lookup of the exact (rule set, identity, proto/port) key: the floor |
//! | `bench_ordnet` | [`policy_lookup`]: the enforcing layout (cell word + probes at the lengths in it) |
//! | `bench_classes` | [`alt::class_lookup`]: port classes, (identity, class) then (0, class) |
//! | `bench_probes` | [`alt::probe_lookup`]: probes at every length the rule set uses |
//! | `bench_lpm` | [`alt::lpm_lookup`]: two LPM lookups of MapState keys |
//! | `bench_cilium` | [`alt::cilium_lookup`]: Cilium's two LPM lookups with precedence comparison |
//!
//! The identity is taken from the source address (the low 24 bits of an IPv4 source) so that no
//! ipcache lookup dilutes the comparison; the rule set number and default come from the
//! one-entry array `BENCH_CFG`. The full enforcing program (ipcache, conntrack, ...) is measured
//! from the real object (`ordnet-xdp`).
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, xdp_action},
    macros::{classifier, map, xdp},
    maps::{Array, HashMap, LpmTrie, lpm_trie::Key},
    programs::{TcContext, XdpContext},
};
use ordnet_datapath_common::{
    IpPacket, Parsed,
    alt::{
        self, CiliumData, CiliumMaps, CiliumValue, ClassKey, ClassMaps, LpmMaps, LpmPolicyData,
        ProbeMaps, ProbeMeta,
    },
    layout::{
        BLOCK_WORDS, CELLS_PER_RULESET, PolicyKey, PolicyRef, PolicyValue, V_ALLOW, pair_index,
        pair_word, pairs, prefix_bits,
    },
    lookup::{PolicyMaps, policy_lookup},
    parse,
};
use ordnet_datapath_ebpf::XdpFrame;

const RULESETS: u32 = 4;
const BLOCKS_MAX: u32 = 2048;
const ENTRIES: u32 = 1 << 19;

/// Index 0: the rule set and default every program uses (a [`PolicyRef`]).
#[map(name = "BENCH_CFG")]
static BENCH_CFG: Array<PolicyRef> = Array::with_max_entries(1, 0);

#[map(name = "FLOOR")]
static FLOOR: HashMap<PolicyKey, PolicyValue> =
    HashMap::with_max_entries(ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "ORDNET_CELLS")]
static CELLS: Array<u64> =
    Array::with_max_entries(pairs(RULESETS * CELLS_PER_RULESET), BPF_F_MMAPABLE);
#[map(name = "ORDNET_BLOCKS")]
static BLOCKS: Array<u64> =
    Array::with_max_entries(pairs(BLOCKS_MAX * BLOCK_WORDS), BPF_F_MMAPABLE);
#[map(name = "ORDNET_POLICY")]
static POLICY: HashMap<PolicyKey, PolicyValue> =
    HashMap::with_max_entries(ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "CLS_CELLS")]
static CLS_CELLS: Array<u32> = Array::with_max_entries(RULESETS * CELLS_PER_RULESET, 0);
#[map(name = "CLS_BLOCKS")]
static CLS_BLOCKS: Array<u32> = Array::with_max_entries(BLOCKS_MAX * BLOCK_WORDS, 0);
#[map(name = "CLS_POLICY")]
static CLS_POLICY: HashMap<ClassKey, PolicyValue> =
    HashMap::with_max_entries(4 * ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "PRB_META")]
static PRB_META: Array<ProbeMeta> = Array::with_max_entries(RULESETS, 0);
#[map(name = "PRB_POLICY")]
static PRB_POLICY: HashMap<PolicyKey, PolicyValue> =
    HashMap::with_max_entries(ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "LPM_POLICY")]
static LPM_POLICY: LpmTrie<LpmPolicyData, PolicyValue> = LpmTrie::with_max_entries(ENTRIES, 0);

#[map(name = "CIL_POLICY")]
static CIL_POLICY: LpmTrie<CiliumData, CiliumValue> = LpmTrie::with_max_entries(ENTRIES, 0);

struct Ordnet;

impl PolicyMaps for Ordnet {
    #[inline(always)]
    fn cell(&self, index: u32) -> Option<u32> {
        CELLS.get(pair_index(index)).map(|p| pair_word(*p, index))
    }
    #[inline(always)]
    fn block_word(&self, index: u32) -> Option<u32> {
        BLOCKS.get(pair_index(index)).map(|p| pair_word(*p, index))
    }
    #[inline(always)]
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        // SAFETY: the value is copied out immediately.
        unsafe { POLICY.get(key) }.copied()
    }
}

struct Classes;

impl PolicyMaps for Classes {
    #[inline(always)]
    fn cell(&self, index: u32) -> Option<u32> {
        CLS_CELLS.get(index).copied()
    }
    #[inline(always)]
    fn block_word(&self, index: u32) -> Option<u32> {
        CLS_BLOCKS.get(index).copied()
    }
    #[inline(always)]
    fn policy(&self, _key: &PolicyKey) -> Option<PolicyValue> {
        None
    }
}

impl ClassMaps for Classes {
    #[inline(always)]
    fn class_policy(&self, key: &ClassKey) -> Option<PolicyValue> {
        // SAFETY: the value is copied out immediately.
        unsafe { CLS_POLICY.get(key) }.copied()
    }
}

struct Probes;

impl ProbeMaps for Probes {
    #[inline(always)]
    fn meta(&self, ruleset: u32) -> Option<ProbeMeta> {
        PRB_META.get(ruleset).copied()
    }
    #[inline(always)]
    fn policy(&self, key: &PolicyKey) -> Option<PolicyValue> {
        // SAFETY: the value is copied out immediately.
        unsafe { PRB_POLICY.get(key) }.copied()
    }
}

struct Lpm;

impl LpmMaps for Lpm {
    #[inline(always)]
    fn lpm(&self, prefix_len: u32, data: &LpmPolicyData) -> Option<PolicyValue> {
        LPM_POLICY.get(Key::new(prefix_len, *data)).copied()
    }
}

struct Cilium;

impl CiliumMaps for Cilium {
    #[inline(always)]
    fn cilium(&self, prefix_len: u32, data: &CiliumData) -> Option<CiliumValue> {
        CIL_POLICY.get(Key::new(prefix_len, *data)).copied()
    }
}

/// Parses the frame and hands (config, identity, packet) to `decide`; PASS if it allows.
#[inline(always)]
fn run(ctx: &XdpContext, decide: impl FnOnce(PolicyRef, u32, &IpPacket) -> bool) -> u32 {
    let frame = XdpFrame::new(ctx);
    let p = match parse(&frame) {
        Ok(Parsed::Ip(p)) => p,
        Ok(Parsed::NotIp { .. }) => return xdp_action::XDP_PASS,
        Err(_) => return xdp_action::XDP_DROP,
    };
    let Some(cfg) = BENCH_CFG.get(0).copied() else {
        return xdp_action::XDP_DROP;
    };
    // The low 24 bits of the IPv4 source address (memory-order word 0).
    let identity = u32::from_be(p.src[0]) & 0x00ff_ffff;
    if decide(cfg, identity, &p) {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// The shared part of every program: parse and read the config, no policy.
#[xdp]
pub fn bench_parse(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        core::hint::black_box((cfg.ruleset, identity, p.dport));
        true
    })
}

/// Nothing at all (XDP): what one run of a program costs the packet by itself (the kernel's
/// call, and its run-time statistics when they are on). With [`bench_tc_pass`], the part of the
/// whole path with real packets that no program's work can remove (`docs/datapath.md` §12).
#[xdp]
pub fn bench_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Nothing at all (TC): [`bench_pass`] for the TC hook.
#[classifier]
pub fn bench_tc_pass(_ctx: TcContext) -> i32 {
    0
}

/// The floor: one hash lookup of the exact (rule set, identity, protocol/port) key in `FLOOR`,
/// else the default.
#[xdp]
pub fn bench_floor(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        let key = PolicyKey {
            ruleset: cfg.ruleset,
            identity,
            prefix: prefix_bits(p.protocol, p.dport, 24),
        };
        // SAFETY: the value is copied out immediately.
        match unsafe { FLOOR.get(key) }.copied() {
            Some(v) => v.verdict == V_ALLOW,
            None => cfg.default == V_ALLOW,
        }
    })
}

/// The enforcing layout: [`policy_lookup`] (cell word, then probes at the lengths in it).
#[xdp]
pub fn bench_ordnet(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        policy_lookup(&Ordnet, cfg, identity, p.protocol, p.dport).allow
    })
}

/// The class layout: [`alt::class_lookup`] over `CLS_CELLS`, `CLS_BLOCKS` and `CLS_POLICY`.
#[xdp]
pub fn bench_classes(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        alt::class_lookup(
            &Classes,
            cfg.ruleset,
            cfg.default,
            identity,
            p.protocol,
            p.dport,
        )
    })
}

/// The probe layout: [`alt::probe_lookup`] over `PRB_META` and `PRB_POLICY`.
#[xdp]
pub fn bench_probes(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        alt::probe_lookup(
            &Probes,
            cfg.ruleset,
            cfg.default,
            identity,
            p.protocol,
            p.dport,
        )
    })
}

/// The LPM layout: [`alt::lpm_lookup`] over `LPM_POLICY`.
#[xdp]
pub fn bench_lpm(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        alt::lpm_lookup(
            &Lpm,
            cfg.ruleset,
            cfg.default,
            identity,
            p.protocol,
            p.dport,
        )
    })
}

/// Cilium's layout: [`alt::cilium_lookup`] over `CIL_POLICY`, as an ingress lookup.
#[xdp]
pub fn bench_cilium(ctx: XdpContext) -> u32 {
    run(&ctx, |cfg, identity, p| {
        alt::cilium_lookup(&Cilium, cfg.default, false, identity, p.protocol, p.dport)
    })
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!(
        "ordnet-xdp-bench holds eBPF benchmark programs built for bpfel-unknown-none by \
         datapath/build.rs; this host binary does nothing"
    );
    std::process::exit(2);
}
