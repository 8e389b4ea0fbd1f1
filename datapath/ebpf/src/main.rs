//! The ordnet XDP and TC programs.
//!
//! The XDP program is attached to each pod's host-side veth (the pod's egress) and to the
//! node's uplink (traffic from other nodes); the TC program (`ordnet_tc`, tcx egress of the same
//! interfaces) decides forwarded packets after netfilter, i.e. after kube-proxy's Service
//! translation. For every frame it runs [`ordnet_datapath_common::decide`] over the maps
//! below: parse (shared parser), ipcache lookups of both addresses, exemptions, connection
//! tracking, and the policy lookups of the flattened rule sets (egress of a local source,
//! ingress of a local destination). It returns `XDP_PASS` or `XDP_DROP`, never `XDP_ABORTED`.
//! See `docs/datapath.md`.
//!
//! Built for `bpfel-unknown-none` by `datapath/build.rs` (aya-build). On the host the crate also
//! compiles (so `cargo clippy --workspace` lints the program code), as an ordinary binary whose
//! `main` only explains that.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    EbpfContext, Global,
    bindings::{
        BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP,
        BPF_RB_NO_WAKEUP, xdp_action,
    },
    helpers::{
        bpf_jiffies64, bpf_ktime_get_ns, bpf_map_lookup_elem, generated::bpf_xdp_adjust_meta,
    },
    macros::{classifier, map, xdp},
    maps::{
        Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, ProgramArray, RingBuf, lpm_trie::Key,
    },
    programs::{TcContext, XdpContext},
};
use ordnet_datapath_common::{
    DatapathMaps, Hook, IpPacket, Parsed, Verdict, decide, decide_at, established,
    event::{
        self, DenyRecord, Due, EVENT_BURST, EventCpu, FlowEvent, HOOK_TC, HOOK_XDP, ObserveArgs,
        Summary, Wanted,
    },
    handoff::{self, HANDOFF_META},
    layout::{
        BLOCK_WORDS, CELLS_PER_RULESET, COUNTER_EVENTS, COUNTER_EVENTS_LOST,
        COUNTER_EVENTS_SUPPRESSED, COUNTERS, Ct4Key, CtEntry, CtKey, DEFAULT_CT4_ENTRIES,
        DEFAULT_CT6_ENTRIES, DEFAULT_DENIED_ENTRIES, DEFAULT_EVENT_RING_BYTES,
        DEFAULT_IFACE_ENTRIES, DEFAULT_IPCACHE_ENTRIES, DEFAULT_IPCIDR_ENTRIES, DEFAULT_MAX_BLOCKS,
        DEFAULT_MAX_RULESETS, DEFAULT_POLICY_ENTRIES, DEFAULT_RULE_COUNTERS, DEFAULT_SVC_ENTRIES,
        FAMILY_V4, IfaceInfo, IpInfo, IpKey, PolicyKey, PolicyValue, RuleCount, State, SvcKey,
        SvcValue, pair_index, pair_word, pairs, prefix_bits,
    },
    lookup::{CounterSite, MAX_PROBES, PolicyMaps, next_length},
    parse, parse_l3, parse_simple,
};
use ordnet_datapath_ebpf::{XdpFrame, read_u64, write_u64};

#[map(name = "ORDNET_IP4")]
static IP4: HashMap<u32, IpInfo> =
    HashMap::with_max_entries(DEFAULT_IPCACHE_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "ORDNET_IP6")]
static IP6: HashMap<[u32; 4], IpInfo> =
    HashMap::with_max_entries(DEFAULT_IPCACHE_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "ORDNET_IPCIDR")]
static IPCIDR: LpmTrie<IpKey, IpInfo> = LpmTrie::with_max_entries(DEFAULT_IPCIDR_ENTRIES, 0);

/// Two words per element (`pair_index`); mmapable: userspace writes the words with plain
/// atomic stores instead of syscalls.
#[map(name = "ORDNET_CELLS")]
static CELLS: Array<u64> = Array::with_max_entries(
    pairs(DEFAULT_MAX_RULESETS * CELLS_PER_RULESET),
    BPF_F_MMAPABLE,
);

#[map(name = "ORDNET_BLOCKS")]
static BLOCKS: Array<u64> =
    Array::with_max_entries(pairs(DEFAULT_MAX_BLOCKS * BLOCK_WORDS), BPF_F_MMAPABLE);

#[map(name = "ORDNET_POLICY")]
static POLICY: HashMap<PolicyKey, PolicyValue> =
    HashMap::with_max_entries(DEFAULT_POLICY_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "ORDNET_CT4")]
static CT4: LruHashMap<Ct4Key, CtEntry> = LruHashMap::with_max_entries(DEFAULT_CT4_ENTRIES, 0);

#[map(name = "ORDNET_CT6")]
static CT6: LruHashMap<CtKey, CtEntry> = LruHashMap::with_max_entries(DEFAULT_CT6_ENTRIES, 0);

#[map(name = "ORDNET_STATE")]
static STATE: Array<State> = Array::with_max_entries(1, 0);

#[map(name = "ORDNET_SVC")]
static SVC: HashMap<SvcKey, SvcValue> =
    HashMap::with_max_entries(DEFAULT_SVC_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "ORDNET_IFACE")]
static IFACE: HashMap<u32, IfaceInfo> =
    HashMap::with_max_entries(DEFAULT_IFACE_ENTRIES, BPF_F_NO_PREALLOC);

/// Event counters (`MAP_COUNTERS`): per CPU, not pinned.
#[map(name = "ORDNET_COUNTERS")]
static COUNTERS_MAP: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS, 0);

/// The key of the XDP-to-TC handoff tags (`ordnet_datapath_common::handoff`): drawn at random
/// by the loader each time the programs are loaded (`EbpfLoader::override_global`); read-only
/// data, so the verifier sees a constant and no map holds it. 0: no handoff.
#[unsafe(no_mangle)]
static ORDNET_HANDOFF_KEY: Global<u64> = Global::new(0);

/// Verdict events (`ordnet_datapath_common::event`): private to one loaded program pair.
#[map(name = "ORDNET_EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(DEFAULT_EVENT_RING_BYTES, 0);

/// Denied flows' unreported packets (`event::DenyRecord`).
#[map(name = "ORDNET_DENIED")]
static DENIED: LruHashMap<u64, DenyRecord> =
    LruHashMap::with_max_entries(DEFAULT_DENIED_ENTRIES, 0);

/// The events' token bucket and scratch record, one per CPU.
#[map(name = "ORDNET_EVENT_BUCKET")]
static EVENT_BUCKET: PerCpuArray<EventCpu> = PerCpuArray::with_max_entries(1, 0);

/// The XDP observer program (`MAP_XDP_OBSERVER`), set by the loader.
#[map(name = "ORDNET_XDP_OBSERVER")]
static XDP_OBSERVER: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The TC observer program (`MAP_TC_OBSERVER`), set by the loader.
#[map(name = "ORDNET_TC_OBSERVER")]
static TC_OBSERVER: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Per-rule counters (`MAP_RULE_COUNTERS`): per CPU, private to one loaded program pair.
#[map(name = "ORDNET_RULE_COUNTERS")]
static RULE_COUNTERS: PerCpuArray<RuleCount> =
    PerCpuArray::with_max_entries(DEFAULT_RULE_COUNTERS, 0);

/// Nanoseconds between two events of one CPU (`event::interval_ns`), set by the loader; 0:
/// no events.
#[unsafe(no_mangle)]
static ORDNET_EVENT_INTERVAL: Global<u64> = Global::new(0);

/// 1: the per-rule counters count (`RULE_COUNTERS`), set by the loader; 0: they do not.
#[unsafe(no_mangle)]
static ORDNET_COUNT_RULES: Global<u64> = Global::new(0);

/// Whether a decision goes to the observer program: it calls for an event or a count
/// (`Summary::wanted`), and events or the rule counters are on.
#[inline(always)]
fn observed(sum: &Summary) -> bool {
    sum.wanted() != Wanted::None && (ORDNET_EVENT_INTERVAL.load() | ORDNET_COUNT_RULES.load()) != 0
}

/// The state of the probes of one policy lookup, run by `bpf_loop` ([`probe_step`]): the
/// kernel verifies the callback once, where the inlined loop of `lookup::policy_lookup` (18
/// iterations, unrolled, walked for every verifier state that reaches it, twice per program)
/// took most of the verifier's budget (docs/datapath.md, verifier note 11).
#[repr(C)]
struct ProbeCtx {
    key: PolicyKey,
    mask: u32,
    len: u32,
    port: u32,
    protocol: u32,
    /// The found value's verdict, with bit 8 set when found.
    found: u32,
}

/// Notes the rule counter of the key a probe found, for the observer program.
#[inline(always)]
fn note_found(v: &PolicyValue) {
    if let Some(cpu) = EVENT_BUCKET.get_ptr_mut(0) {
        // SAFETY: this CPU's element of a per-CPU array, valid for the program run.
        unsafe { (*cpu).found_counter = u32::from(v.counter) };
    }
}

/// One probe: the key of length `len`; stops when found or no length is left.
extern "C" fn probe_step(_index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let c = ctx.cast::<ProbeCtx>();
    // SAFETY: `bpf_loop` passes the caller's context, a `ProbeCtx` on its stack.
    unsafe {
        (*c).key.prefix = prefix_bits((*c).protocol as u8, (*c).port as u16, (*c).len);
        // By reference on purpose: by value, the key would be copied to the callback's own
        // stack, which counts against the call chain's 512 bytes.
        #[allow(clippy::needless_borrows_for_generic_args)]
        let found = POLICY.get(&(*c).key);
        if let Some(v) = found {
            (*c).found = u32::from(v.verdict) | 0x100;
            note_found(v);
            return 1;
        }
        match next_length(&mut (*c).mask) {
            Some(len) => (*c).len = len,
            None => return 1,
        }
    }
    0
}

/// The program's maps as the shared decision code sees them.
struct KernelMaps;

impl PolicyMaps for KernelMaps {
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
        let mut c = ProbeCtx {
            key: PolicyKey {
                ruleset,
                identity,
                prefix: prefix_bits(protocol, port, len),
            },
            mask,
            len,
            port: u32::from(port),
            protocol: u32::from(protocol),
            found: 0,
        };
        // The first probe, at the cell's longest length (nearly always the only one), inline:
        // the `bpf_loop` call around a single lookup costs about as much as the lookup.
        // SAFETY: the value is read at once; no reference outlives the lookup. The key by
        // reference, as in the callback: a copy would take more of the 512-byte stack.
        #[allow(clippy::needless_borrows_for_generic_args)]
        if let Some(v) = unsafe { POLICY.get(&c.key) } {
            note_found(v);
            return Some((PolicyValue::new(v.verdict), c.key.prefix));
        }
        c.len = next_length(&mut c.mask)?;
        // SAFETY: the callback only touches `c`, which outlives the call.
        unsafe {
            aya_ebpf::helpers::generated::bpf_loop(
                MAX_PROBES - 1,
                probe_step as *mut core::ffi::c_void,
                (&raw mut c).cast(),
                0,
            );
        }
        if c.found & 0x100 == 0 {
            return None;
        }
        Some((PolicyValue::new(c.found as u8), c.key.prefix))
    }

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
        // SAFETY: the value is copied out immediately; no reference outlives the lookup.
        unsafe { POLICY.get(key) }.copied()
    }
}

impl DatapathMaps for KernelMaps {
    #[inline(always)]
    fn state(&self) -> Option<&State> {
        STATE.get(0)
    }

    #[inline(always)]
    fn ipcache(&self, key: &IpKey) -> Option<&IpInfo> {
        // SAFETY: a map value stays valid (RCU) for the whole program run, and the program
        // never writes to it.
        unsafe {
            if key.family == u32::from(FAMILY_V4) {
                IP4.get(key.addr[0])
            } else {
                IP6.get(key.addr)
            }
        }
    }

    #[inline(always)]
    fn ipcidr(&self, key: &IpKey) -> Option<[u32; 2]> {
        IPCIDR
            .get(Key::new(IpKey::LPM_FIXED_BITS + 128, *key))
            .map(|i| i.peer())
    }

    #[inline(always)]
    fn ct_lookup(&self, key: &CtKey) -> Option<CtEntry> {
        // SAFETY: the value is copied out immediately.
        unsafe {
            if key.family == FAMILY_V4 {
                CT4.get(Ct4Key::of(key)).copied()
            } else {
                CT6.get(key).copied()
            }
        }
    }

    #[inline(always)]
    fn ct_store(&self, key: &CtKey, entry: &CtEntry) {
        // A full map evicts (LRU); any other error only means the flow is checked again.
        let _ = if key.family == FAMILY_V4 {
            CT4.insert(Ct4Key::of(key), entry, 0)
        } else {
            CT6.insert(key, entry, 0)
        };
    }

    #[inline(always)]
    fn ct_delete(&self, key: &CtKey) {
        let _ = if key.family == FAMILY_V4 {
            CT4.remove(Ct4Key::of(key))
        } else {
            CT6.remove(key)
        };
    }

    #[inline(always)]
    fn count(&self, counter: u32) {
        if let Some(c) = COUNTERS_MAP.get_ptr_mut(counter) {
            // SAFETY: this CPU's slot, valid for the program run; XDP and TC runs on one CPU
            // never interleave (both run with bottom halves disabled).
            unsafe { *c += 1 };
        }
    }

    #[inline(always)]
    fn now(&self) -> u64 {
        // SAFETY: a helper without arguments; the verifier inlines it into a load of
        // `jiffies_64` (`bpf_ktime_get_ns` is a real call: ~30 ns per packet more here).
        unsafe { bpf_jiffies64() }
    }

    #[inline(always)]
    fn service(&self, key: &SvcKey) -> bool {
        // SAFETY: only the presence is read.
        unsafe { SVC.get(key) }.is_some_and(|v| v.flags != 0)
    }

    #[inline(always)]
    fn interface(&self, ifindex: u32) -> Option<IfaceInfo> {
        // SAFETY: the value is copied out immediately.
        unsafe { IFACE.get(ifindex) }.copied()
    }

    #[inline(always)]
    fn judged(&self, egress: bool, ruleset: u32, peer: u32) {
        if let Some(cpu) = EVENT_BUCKET.get_ptr_mut(0) {
            // SAFETY: this CPU's element, valid for the program run.
            unsafe {
                let j = if egress {
                    &raw mut (*cpu).egress
                } else {
                    &raw mut (*cpu).ingress
                };
                (&raw mut (*j).ruleset).write(ruleset);
                (&raw mut (*j).peer).write(peer);
                (&raw mut (*j).found_counter).write((*cpu).found_counter);
            }
        }
    }

    fn handoff_key(&self) -> u64 {
        ORDNET_HANDOFF_KEY.load()
    }
}

/// The XDP program, on every local endpoint's host-side interface and on the uplink: [`decide`]
/// (at [`Hook::Xdp`], before netfilter) over the maps above; `XDP_PASS` or `XDP_DROP`.
/// Multi-buffer aware (`xdp.frags`): it attaches natively to veths and drivers whose MTU exceeds
/// a page (jumbo frames), and judges such packets by the headers in their first buffer.
#[xdp(frags)]
pub fn ordnet_xdp(ctx: XdpContext) -> u32 {
    let frame = XdpFrame::new(&ctx);
    // The packet seen most, an established flow's, decided by its one lookup before anything
    // else is parsed or read (`established`: the decision `decide` would make, a PASS that
    // calls for no event); every other packet takes the full decision below.
    if let Some(p) = parse_simple(&frame)
        && let Some(d) = established(&p, &KernelMaps)
        && d.verdict == Verdict::Pass
    {
        if let Some(tag) = handoff::after_xdp(&p, &d, &KernelMaps) {
            hand_off(&ctx, tag);
        }
        return xdp_action::XDP_PASS;
    }
    let parsed = parse(&frame);
    let d = decide(&parsed, &KernelMaps);
    let Ok(Parsed::Ip(p)) = &parsed else {
        return match d.verdict {
            Verdict::Pass => xdp_action::XDP_PASS,
            Verdict::Drop => xdp_action::XDP_DROP,
        };
    };
    let action = if d.verdict == Verdict::Drop {
        xdp_action::XDP_DROP
    } else {
        if let Some(tag) = handoff::after_xdp(p, &d, &KernelMaps) {
            hand_off(&ctx, tag);
        }
        xdp_action::XDP_PASS
    };
    let sum = Summary::of(&d);
    if observed(&sum) {
        // SAFETY: the program's own context; the observer runs with it and returns `action`.
        unsafe {
            to_observer(
                &ctx,
                &XDP_OBSERVER,
                p,
                sum,
                ctx.ingress_ifindex() as u32,
                action,
            )
        };
    }
    // No observer (not loaded yet, or the tail call failed): the packet's verdict all the same.
    action
}

/// Hands a decision that is counted or reported (`Summary::wanted`) to the observer program in
/// `observer`: writes what it needs (the decision's summary, the packet's tuple) into this
/// CPU's `EventCpu::args` and tail-calls it.
/// Returns only if the call fails (the caller returns `action` itself).
///
/// # Safety
/// `ctx` is the calling program's own context.
#[inline(always)]
unsafe fn to_observer<C: EbpfContext>(
    ctx: &C,
    observer: &ProgramArray,
    p: &IpPacket,
    sum: Summary,
    ifindex: u32,
    action: u32,
) {
    let Some(cpu) = EVENT_BUCKET.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's element, valid for the program run; the observer runs on this CPU
    // right after, before anything else can use it. Field by field: a struct literal would
    // be built on the stack and copied.
    unsafe {
        let a = &raw mut (*cpu).args;
        (&raw mut (*a).reason).write(sum.reason);
        (&raw mut (*a).word).write(sum.word);
        (&raw mut (*a).prefixes).write(sum.prefixes);
        (&raw mut (*a).ifindex).write(ifindex);
        (&raw mut (*a).action).write(action);
        (&raw mut (*a).src).write(p.src);
        (&raw mut (*a).dst).write(p.dst);
        (&raw mut (*a).sport).write(p.sport);
        (&raw mut (*a).dport).write(p.dport);
        (&raw mut (*a).ip_version).write(p.ip_version);
        (&raw mut (*a).protocol).write(p.protocol);
        // Returns only on failure (its `Result` is unit-like off BPF).
        #[allow(clippy::let_unit_value)]
        let _ = observer.tail_call(ctx, 0);
    }
}

/// The args the deciding program left in this CPU's `EventCpu` (`to_observer`).
#[inline(always)]
fn observer_args() -> Option<ObserveArgs> {
    let cpu = EVENT_BUCKET.get_ptr(0)?;
    // SAFETY: this CPU's element, valid for the program run.
    Some(unsafe { (*cpu).args })
}

/// The XDP observer (`XDP_OBSERVER_NAME`), tail-called by [`ordnet_xdp`] for a new flow or a
/// denied packet: counts the rules that decided, emits the verdict event, and returns the
/// verdict [`ordnet_xdp`] decided. It works from what [`to_observer`] handed over (the packet
/// is not parsed again), on its own stack and verifier budget.
#[xdp(frags)]
pub fn ordnet_xdp_observe(_ctx: XdpContext) -> u32 {
    let Some(args) = observer_args() else {
        return xdp_action::XDP_DROP;
    };
    observe(&args.packet(), args.summary(), HOOK_XDP, args.ifindex);
    args.action
}

/// The TC observer (`TC_OBSERVER_NAME`): [`ordnet_xdp_observe`] for both TC programs.
#[classifier]
pub fn ordnet_tc_observe(_ctx: TcContext) -> i32 {
    let Some(args) = observer_args() else {
        return TC_DROP;
    };
    observe(&args.packet(), args.summary(), HOOK_TC, args.ifindex);
    args.action as i32
}

/// Counts a decision in its rules' counters and emits the verdict event it calls for
/// (`event`): a new flow's at once, a denied flow's aggregated in its record; both within the
/// rate limit, every refusal counted. Time is kept in ticks of the inlined clock (the records,
/// the bucket); the nanosecond clock, a helper call, is read only for an event written. The
/// rule counters count with events off too.
#[inline(always)]
fn observe(p: &IpPacket, sum: Summary, hook: u8, ifindex: u32) {
    let wanted = sum.wanted();
    if wanted == Wanted::None {
        return;
    }
    let interval = ORDNET_EVENT_INTERVAL.load();
    let Some(cpu) = EVENT_BUCKET.get_ptr_mut(0) else {
        return;
    };
    let hz = KernelMaps.state().map_or(0, |s| s.hz);
    let now = KernelMaps.now();
    let clock = (now, hz);
    let one = Due {
        packets: 1,
        first: now,
    };
    let counting = ORDNET_COUNT_RULES.load() != 0;
    if counting {
        count_rules(cpu, &sum);
    }
    if wanted == Wanted::NewFlow {
        if interval != 0 {
            emit(p, sum, hook, ifindex, clock, one, interval, cpu);
        }
        return;
    }
    let key = event::flow_key(p, hook);
    match DENIED.get_ptr_mut(key) {
        // SAFETY: the map value stays valid for the program run; a concurrent update of the
        // same flow on another CPU can only lose a count.
        Some(r) => {
            if interval != 0
                && let Some(due) = unsafe { (*r).count(now, hz) }
                && emit(p, sum, hook, ifindex, clock, due, interval, cpu)
            {
                // SAFETY: as above.
                unsafe { (*r).reported(now) };
            }
        }
        None => {
            if counting {
                count_denied_flow(cpu);
            }
            let emitted = interval != 0 && emit(p, sum, hook, ifindex, clock, one, interval, cpu);
            // SAFETY: this CPU's element (see `emit`); the record is built in it and copied
            // by the insert.
            unsafe {
                (*cpu).scratch = DenyRecord::first(now, emitted, hz);
                // By reference on purpose: by value, the record would be copied to the stack.
                #[allow(clippy::needless_borrows_for_generic_args)]
                let _ = DENIED.insert(key, &(*cpu).scratch, 0);
            }
        }
    }
}

/// Counts a decision in the rule counters of the lookups that decided it
/// (`Summary::counter_site`: both for an allowed flow, the denying one for a denied packet):
/// a new flow allowed, or a denied packet. Keeps the elements in `EventCpu::elements` for
/// [`count_denied_flow`]. It runs in the observer program, whose verifier budget is its own:
/// it may branch (to skip the lookups a direction does not need).
#[inline(always)]
fn count_rules(cpu: *mut EventCpu, sum: &Summary) {
    let policy = (&raw const POLICY).cast_mut().cast::<core::ffi::c_void>();
    let counters = (&raw const RULE_COUNTERS)
        .cast_mut()
        .cast::<core::ffi::c_void>();
    let denied = (sum.word >> 1) & 1;
    for (dir, egress) in [(0, true), (1, false)] {
        // SAFETY: `cpu` is this CPU's element, valid for the program run; the lookups read
        // their keys from it; a value found is a map value, valid for the program run (the
        // rule counters': this CPU's element).
        unsafe {
            let judged = if egress {
                (*cpu).egress
            } else {
                (*cpu).ingress
            };
            let element = match sum.counter_site(egress, judged.ruleset, judged.peer) {
                None => NO_ELEMENT,
                // The peer's own key: its counter, as the probe loop found it.
                Some(CounterSite::Key(_)) => judged.found_counter,
                // The `*` key: its counter from its value (0 if it is gone).
                Some(CounterSite::Wildcard(key)) => {
                    (&raw mut (*cpu).count_key).write(key);
                    let v = bpf_map_lookup_elem(policy, (&raw const (*cpu).count_key).cast())
                        .cast::<PolicyValue>();
                    if v.is_null() {
                        0
                    } else {
                        u32::from((*v).counter)
                    }
                }
                Some(CounterSite::Default(element)) => u32::from(element),
            };
            let slot = &raw mut (*cpu).elements[dir];
            slot.write(element);
            if element == NO_ELEMENT {
                continue;
            }
            let c = bpf_map_lookup_elem(counters, slot.cast()).cast::<RuleCount>();
            if !c.is_null() {
                (*c).flows_allowed += 1 - denied;
                (*c).packets_denied += denied;
            }
        }
    }
}

/// An element no rule counter array has: a direction that does not count.
const NO_ELEMENT: u32 = u32::MAX;

/// Counts a denied flow (its first denied packet) in the elements [`count_rules`] just
/// counted its packet in.
#[inline(always)]
fn count_denied_flow(cpu: *mut EventCpu) {
    let counters = (&raw const RULE_COUNTERS)
        .cast_mut()
        .cast::<core::ffi::c_void>();
    for dir in 0..2 {
        // SAFETY: as in `count_rules`.
        unsafe {
            let element = &raw const (*cpu).elements[dir];
            let c = bpf_map_lookup_elem(counters, element.cast()).cast::<RuleCount>();
            if !c.is_null() {
                (*c).flows_denied += 1;
            }
        }
    }
}

/// Writes one event (standing for `due`'s packets) into the ring buffer if the rate limit
/// (this CPU's bucket in `cpu`) and the buffer allow; whether it did. `clock` is (ticks now,
/// ticks a second).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn emit(
    p: &IpPacket,
    sum: Summary,
    hook: u8,
    ifindex: u32,
    clock: (u64, u64),
    due: Due,
    interval: u64,
    cpu: *mut EventCpu,
) -> bool {
    let (now, hz) = clock;
    let per_tick = 1_000_000_000u64.checked_div(hz).unwrap_or(0);
    // The credit grows by whole ticks: the bucket holds at least two ticks' worth of events.
    let burst = if interval.wrapping_mul(EVENT_BURST) < 2 * per_tick {
        2 * per_tick / interval
    } else {
        EVENT_BURST
    };
    // SAFETY: this CPU's element, valid for the program run; runs on one CPU never interleave.
    if !unsafe {
        (*cpu)
            .bucket
            .take(now.wrapping_mul(per_tick), interval, burst)
    } {
        KernelMaps.count(COUNTER_EVENTS_SUPPRESSED);
        return false;
    }
    let Some(mut entry) = EVENTS.reserve::<FlowEvent>(0) else {
        KernelMaps.count(COUNTER_EVENTS_LOST);
        return false;
    };
    // SAFETY: a helper without arguments.
    let now_ns = unsafe { bpf_ktime_get_ns() };
    let agg = due.at(now_ns, now, hz);
    let revision = KernelMaps.state().map_or(0, |s| s.revision);
    // SAFETY: the reserved record, sized and aligned for a `FlowEvent`.
    unsafe {
        event::write(
            entry.as_mut_ptr(),
            p,
            sum,
            hook,
            ifindex,
            revision,
            now_ns,
            agg,
        )
    };
    // No wake-up per event (a wake-up is an interrupt, a VM exit on a virtual machine: 6 µs
    // per event measured): the reader polls on a short timer, and is woken only once a
    // quarter of the ring is waiting.
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    entry.submit(if waiting >= u64::from(DEFAULT_EVENT_RING_BYTES / 4) {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    });
    KernelMaps.count(COUNTER_EVENTS);
    true
}

/// Writes the handoff tag into the packet's metadata, followed by zeros (a driver without
/// metadata support refuses the room: the TC hook then looks the flow up itself).
#[inline(always)]
fn hand_off(ctx: &XdpContext, tag: u64) {
    // SAFETY: the program's own context; the helper only moves `data_meta` within the headroom.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(HANDOFF_META as i32)) } != 0 {
        return;
    }
    // The pointers moved: read them again for the verifier's range check.
    let (meta, data) = (ctx.metadata(), ctx.data());
    if meta + HANDOFF_META > data {
        return;
    }
    // `meta..meta + 32` is the metadata area, checked against `data` just above.
    write_u64(meta, tag);
    write_u64(meta + 8, 0);
    write_u64(meta + 16, 0);
    write_u64(meta + 24, 0);
}

/// Bytes the TC program needs in the linear part of the packet for the parser (Ethernet, VLAN
/// tags, IPv4 with options or IPv6 with a few extension headers, the L4 ports and flags).
const TC_LINEAR: u32 = 256;

/// `TC_ACT_OK` and `TC_ACT_SHOT` (linux/pkt_cls.h) as the classifier returns them (the
/// bindings' constants have a different integer type on different targets).
const TC_PASS: i32 = 0;
const TC_DROP: i32 = 2;

/// The post-translation hook: tcx egress of every local endpoint's host-side interface and of
/// the uplink. Packets the node itself sends (`ingress_ifindex` 0) pass, and their flows to
/// local endpoints are tracked (so only the replies of those are exempt from the endpoint's
/// egress policy); every forwarded packet is decided at [`Hook::Tc`]: after kube-proxy's
/// translation, so a Service flow is judged with its backend as the destination
/// (`docs/datapath.md` §14).
#[classifier]
pub fn ordnet_tc(ctx: TcContext) -> i32 {
    tc_judge(&ctx, false)
}

/// [`ordnet_tc`] for a layer-3 device (an IPIP, GRE, SIT, ip6tnl or WireGuard tunnel between
/// nodes): its packets start at the IP header, whose protocol is `skb->protocol`.
#[classifier]
pub fn ordnet_tc_l3(ctx: TcContext) -> i32 {
    tc_judge(&ctx, true)
}

#[inline(always)]
fn tc_judge(ctx: &TcContext, l3: bool) -> i32 {
    // SAFETY: `skb` is the program's context pointer, valid for the whole run.
    let (ingress_ifindex, protocol) =
        unsafe { ((*ctx.skb.skb).ingress_ifindex, (*ctx.skb.skb).protocol) };
    // The packet seen most here, an established flow's that XDP passed with its tag, read at
    // fixed offsets and passed on XDP's word (`handoff::at_tc`, the first step of `decide_at`:
    // the same decision and count) before anything is pulled or fully parsed; every other
    // packet takes the full decision below (the node's own packets and a layer-3 device's never
    // carry the tag: see there). The tag is read here and again below, and a tag that does not
    // match is checked again by the full decision: carrying the tag, or "not matched", past the
    // pull made the verifier walk 735,000-768,000 instructions instead of 652,000.
    if ingress_ifindex != 0 && !l3 {
        let tag = handed_tag(ctx);
        if tag != 0
            && let Some(p) = parse_simple(&XdpFrame::tc(ctx))
            && handoff::at_tc(&p, &KernelMaps, tag).is_some()
        {
            return TC_PASS;
        }
    }
    // Packets have their headers in the linear part in practice; make sure of it (a failure
    // leaves the packet as it is, and the parser then sees a truncated one: dropped if
    // forwarded; the node's own packets always pass).
    let len = ctx.len();
    let want = if len < TC_LINEAR { len } else { TC_LINEAR };
    if ((ctx.data_end() - ctx.data()) as u32) < want {
        let _ = ctx.pull_data(want);
    }
    // The node's own packets never use the handoff; on a layer-3 device the frame starts at
    // the IP header, 14 bytes past where XDP wrote the tag's metadata, so no tag can match.
    let handoff = if ingress_ifindex == 0 || l3 {
        0
    } else {
        handed_tag(ctx)
    };
    let frame = XdpFrame::tc(ctx);
    let parsed = if l3 {
        // `protocol` is the EtherType in network order in the low 16 bits.
        parse_l3(&frame, u16::from_be(protocol as u16))
    } else {
        parse(&frame)
    };
    let hook = Hook::Tc {
        ingress_ifindex,
        handoff,
    };
    let d = decide_at(&parsed, &KernelMaps, hook);
    let action = match d.verdict {
        Verdict::Pass => TC_PASS,
        Verdict::Drop => TC_DROP,
    };
    if let Ok(Parsed::Ip(p)) = &parsed {
        let sum = Summary::of(&d);
        if observed(&sum) {
            // SAFETY: the program's own context; the observer returns `action`.
            unsafe { to_observer(ctx, &TC_OBSERVER, p, sum, ingress_ifindex, action as u32) };
        }
    }
    action
}

/// The handoff tag XDP may have left in the packet's metadata (0 for none: less metadata than
/// the handoff's).
#[inline(always)]
fn handed_tag(ctx: &TcContext) -> u64 {
    // SAFETY: `skb` is the program's context pointer, valid for the whole run.
    let (meta, data) = unsafe { ((*ctx.skb.skb).data_meta as usize, ctx.data()) };
    if meta + HANDOFF_META > data {
        return 0;
    }
    // `meta..meta + 32` lies in the metadata area, checked against `data` just above.
    read_u64(meta)
}

/// The object's license string; the kernel reads it from the `license` section. It matches the
/// project's license (GPL-only helpers are therefore unavailable; none are used).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // No panic is reachable (the parser has no indexing that can fail, no arithmetic that can
    // overflow on its bounded offsets); if one ever were, this loop would make the verifier
    // reject the program instead of letting it load.
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!(
        "ordnet-xdp is an eBPF program: it is built for bpfel-unknown-none by datapath/build.rs \
         and loaded by the ordnet-datapath crate; this host binary does nothing"
    );
    std::process::exit(2);
}
