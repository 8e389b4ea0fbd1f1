//! Verdict events: what the programs tell userspace about the packets they judge
//! (`docs/observe.md`).
//!
//! The XDP and TC programs emit a [`FlowEvent`] into a BPF ring buffer ([`MAP_EVENTS`]) for
//!
//! * the **first packet of every new flow** the policy judged, allowed or denied (a packet
//!   decided [`Reason::Allowed`], or [`Reason::Rechecked`]: a tracked flow judged again after a
//!   policy change), and
//! * **denied packets** ([`Reason::EgressDenied`], [`Reason::IngressDenied`],
//!   [`Reason::RecheckDenied`]), **aggregated per flow**: the first denied packet of a flow is
//!   an event at once; the flow's further denied packets are counted in its record
//!   ([`MAP_DENIED`], LRU) and reported by the flow's next event, at most one per
//!   [`DENY_REPORT_NS`] (with the count and the first and last times), so a flood costs one
//!   record update per packet and one event per flow and second.
//!
//! Established and reply packets, exempt packets and Service deferrals emit nothing: their
//! cost is unchanged.
//!
//! Each event carries the 5-tuple, the hook and the interface the packet came in on, the
//! verdict and its reason, the policy revision it was judged with, and **what decided each
//! direction** ([`lookup::Match`](crate::lookup::Match)): the identity key (with its prefix),
//! the rule set's wildcard, or the endpoint's default. Userspace names the rule from that:
//! these are exactly the keys of the endpoint's MapState, which says which rules each came
//! from.
//!
//! **Rate limit**: a token bucket per CPU ([`Bucket`], in [`MAP_EVENT_BUCKET`]) bounds the
//! events per second a node emits (the loader sets the rate: [`interval_ns`]); an event the
//! bucket refuses, or the ring buffer has no room for, is counted ([`COUNTER_EVENTS_SUPPRESSED`],
//! [`COUNTER_EVENTS_LOST`]), never silently lost. For a denied flow the refused event's packets
//! stay in its record and go with its next event.
//!
//! [`MAP_EVENTS`]: crate::layout::MAP_EVENTS
//! [`MAP_DENIED`]: crate::layout::MAP_DENIED
//! [`MAP_EVENT_BUCKET`]: crate::layout::MAP_EVENT_BUCKET
//! [`COUNTER_EVENTS_SUPPRESSED`]: crate::layout::COUNTER_EVENTS_SUPPRESSED
//! [`COUNTER_EVENTS_LOST`]: crate::layout::COUNTER_EVENTS_LOST

use crate::lookup;
use crate::parse::IpPacket;
use crate::verdict::{Decision, Reason, Verdict};

/// [`FlowEvent::hook`]: judged by the XDP program.
pub const HOOK_XDP: u8 = 1;
/// [`FlowEvent::hook`]: judged by the TC program (after netfilter).
pub const HOOK_TC: u8 = 2;

/// [`FlowEvent::egress`] / [`FlowEvent::ingress`]: the direction was not judged (its end is
/// not a local endpoint, or an earlier direction already denied).
pub const BY_NONE: u8 = 0;
/// The peer identity's own key decided (its prefix is in the event).
pub const BY_KEY: u8 = 1;
/// The rule set's wildcard (`*`) key covering the port decided.
pub const BY_WILDCARD: u8 = 2;
/// No key matched: the endpoint's isolation default decided.
pub const BY_DEFAULT: u8 = 3;
/// A map read failed or held an invalid value (denied: fail closed).
pub const BY_INVALID: u8 = 4;
/// Added to a `BY_*` code when that lookup allowed.
pub const BY_ALLOWED: u8 = 0x80;

/// The default rate limit of events per second per node (Antrea's audit log: 5,000/s).
pub const DEFAULT_EVENTS_PER_SEC: u64 = 5_000;
/// Events a CPU may emit at once after an idle period (the bucket's depth).
pub const EVENT_BURST: u64 = 256;

/// One verdict event, as the programs write it into the ring buffer: 88 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FlowEvent {
    /// When the event was emitted (`CLOCK_MONOTONIC`, ns).
    pub time_ns: u64,
    /// The first packet it stands for (= `time_ns` for one packet; earlier for aggregated
    /// denials).
    pub first_ns: u64,
    /// The policy revision the packet was judged with.
    pub revision: u64,
    /// Packets this event stands for: 1, or the denied packets of the flow since its previous
    /// event (aggregation; also those whose own event the rate limit refused).
    pub packets: u32,
    /// The interface the packet came in on (XDP: the interface of the hook; TC: the
    /// `ingress_ifindex`, 0 for the node's own).
    pub ifindex: u32,
    /// [`HOOK_XDP`] or [`HOOK_TC`].
    pub hook: u8,
    /// 1 = allowed (passed), 2 = denied (dropped): `V_ALLOW` / `V_DENY`.
    pub verdict: u8,
    /// [`reason_code`] of the decision.
    pub reason: u8,
    /// IP version: 4 or 6.
    pub family: u8,
    /// IP protocol number.
    pub protocol: u8,
    /// What decided the egress lookup of the flow's sender (`BY_*`, with [`BY_ALLOWED`]).
    pub egress: u8,
    /// What decided the ingress lookup of the flow's receiver (`BY_*`, with [`BY_ALLOWED`]).
    pub ingress: u8,
    /// Padding; always zero.
    pub _pad: u8,
    /// Source port of the packet (ICMP echo: the identifier), host order.
    pub sport: u16,
    /// Destination port of the packet (ICMP echo: the identifier), host order.
    pub dport: u16,
    /// The egress key's prefix (`prefix_bits` form) when [`BY_KEY`] decided, else 0.
    pub egress_prefix: u32,
    /// The ingress key's prefix (`prefix_bits` form) when [`BY_KEY`] decided, else 0.
    pub ingress_prefix: u32,
    /// Padding; always zero.
    pub _pad2: u32,
    /// Source address words (memory order; IPv4 in word 0).
    pub src: [u32; 4],
    /// Destination address words.
    pub dst: [u32; 4],
}

const _: () = assert!(core::mem::size_of::<FlowEvent>() == 88);

/// The code of a decision's reason in [`FlowEvent::reason`] ([`Reason::code`], stable: part
/// of the event format). The reasons that emit events are 1..=5.
#[inline(always)]
pub fn reason_code(r: Reason) -> u8 {
    r.code()
}

/// The name of a [`reason_code`] (as `ordnet observe` and the flow log show it).
pub const fn reason_name(code: u8) -> &'static str {
    match code {
        1 => "allowed",
        2 => "rechecked",
        3 => "egress-denied",
        4 => "ingress-denied",
        5 => "recheck-denied",
        _ => "other",
    }
}

/// What kind of event a decision calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wanted {
    /// Nothing (established, reply, exempt, deferred, malformed: no rule decided).
    None,
    /// A new flow the policy judged and allowed: one event.
    NewFlow,
    /// A denied packet: aggregated per flow.
    Denied,
}

/// What an event needs of a [`Decision`], in three words: the programs compute it right after
/// the decision, so only three registers stay live up to the event code instead of the whole
/// decision (which overflowed the TC program's stack).
///
/// The reason is a word of its own because the event code branches on it: the verifier then
/// tracks that register's exact value, and only it. Were the lookups' codes in the same
/// register, every combination of them would be a separate state from there on (measured: the
/// three programs took 3.2 s to verify).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// [`reason_code`].
    pub reason: u64,
    /// Bits 0..8 verdict (1 allow, 2 deny), 16..24 the egress `BY_*` code, 24..32 the ingress
    /// one: only stored, never branched on.
    pub word: u64,
    /// The egress key's prefix in the low half, the ingress key's in the high half.
    pub prefixes: u64,
}

impl Summary {
    /// The summary of decision `d`.
    ///
    /// Nothing here branches on the decision (its codes were set where it was made), so the
    /// verifier does not tell the decision's paths apart by these values: they are only
    /// stored. Only [`Summary::wanted`] branches, on the reason alone.
    #[inline(always)]
    pub fn of(d: &Decision) -> Summary {
        let verdict: u64 = if d.verdict == Verdict::Pass { 1 } else { 2 };
        Summary {
            reason: u64::from(d.reason.code()),
            word: verdict | (u64::from(d.codes) << 16),
            prefixes: d.prefixes,
        }
    }

    /// Where the decision counts for direction `egress` (else ingress), whose lookup was in
    /// rule set `ruleset` for identity `peer` (`DatapathMaps::judged`): [`lookup::counter_site`].
    #[inline(always)]
    pub fn counter_site(
        &self,
        egress: bool,
        ruleset: u32,
        peer: u32,
    ) -> Option<lookup::CounterSite> {
        let shift = if egress { 0 } else { 32 };
        let code = (self.word >> if egress { 16 } else { 24 }) as u8;
        // The verdict is 1 (pass) or 2 (drop).
        let denied = self.word & 0xffff == 2;
        lookup::counter_site(
            code,
            ruleset,
            peer,
            (self.prefixes >> shift) as u32,
            egress,
            denied,
        )
    }

    /// Which event, if any, the decision calls for.
    #[inline(always)]
    pub fn wanted(&self) -> Wanted {
        let reason = self.reason;
        if reason.wrapping_sub(1) >= 5 {
            Wanted::None
        } else if reason <= 2 {
            Wanted::NewFlow
        } else {
            Wanted::Denied
        }
    }
}

/// Writes the event for packet `p` decided as `sum` says at `hook` into `ev`, field by field
/// (every field, padding included): the programs write straight into the ring buffer's
/// memory, with no copy on their stack, which has no room for one.
///
/// # Safety
/// `ev` must be valid for writes of a [`FlowEvent`] and aligned.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn write(
    ev: *mut FlowEvent,
    p: &IpPacket,
    sum: Summary,
    hook: u8,
    ifindex: u32,
    revision: u64,
    now_ns: u64,
    agg: Aggregate,
) {
    // SAFETY: the caller's contract; every write is to a field of `*ev`.
    unsafe {
        (&raw mut (*ev).time_ns).write(now_ns);
        (&raw mut (*ev).first_ns).write(agg.first_ns);
        (&raw mut (*ev).revision).write(revision);
        (&raw mut (*ev).packets).write(agg.packets);
        (&raw mut (*ev).ifindex).write(ifindex);
        (&raw mut (*ev).hook).write(hook);
        (&raw mut (*ev).verdict).write(sum.word as u8);
        (&raw mut (*ev).reason).write(sum.reason as u8);
        (&raw mut (*ev).family).write(p.ip_version);
        (&raw mut (*ev).protocol).write(p.protocol);
        (&raw mut (*ev).egress).write((sum.word >> 16) as u8);
        (&raw mut (*ev).ingress).write((sum.word >> 24) as u8);
        (&raw mut (*ev)._pad).write(0);
        (&raw mut (*ev).sport).write(p.sport);
        (&raw mut (*ev).dport).write(p.dport);
        (&raw mut (*ev).egress_prefix).write(sum.prefixes as u32);
        (&raw mut (*ev).ingress_prefix).write((sum.prefixes >> 32) as u32);
        (&raw mut (*ev)._pad2).write(0);
        (&raw mut (*ev).src).write(p.src);
        (&raw mut (*ev).dst).write(p.dst);
    }
}

/// The packets an event stands for and the time of the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aggregate {
    /// Packets (≥ 1).
    pub packets: u32,
    /// Time of the first (ns).
    pub first_ns: u64,
}

/// The denied packets of one flow since its last event ([`MAP_DENIED`] value, keyed by
/// [`flow_key`]); times in ticks of the programs' clock (`State::hz` a second).
///
/// [`MAP_DENIED`]: crate::layout::MAP_DENIED
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct DenyRecord {
    /// The first of the unreported packets.
    pub first: u64,
    /// When the flow's last event was emitted.
    pub reported: u64,
    /// Denied packets not reported yet.
    pub packets: u64,
}

/// The unreported packets of a [`DenyRecord`] due for an event: how many, and the tick of the
/// first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Due {
    /// Packets (≥ 1).
    pub packets: u32,
    /// Tick of the first.
    pub first: u64,
}

impl Due {
    /// As an event's [`Aggregate`], the first packet's time converted from ticks: `now_ns` is
    /// the event's time, `now` the same moment in ticks, `hz` ticks a second.
    #[inline(always)]
    pub fn at(self, now_ns: u64, now: u64, hz: u64) -> Aggregate {
        let per_tick = 1_000_000_000u64.checked_div(hz).unwrap_or(0);
        Aggregate {
            packets: self.packets,
            first_ns: now_ns.saturating_sub(now.saturating_sub(self.first).wrapping_mul(per_tick)),
        }
    }
}

impl DenyRecord {
    /// The record of a flow's first denied packet at tick `now`: reported at once
    /// (`reported`), or, when its event was refused, left for the flow's next packet to
    /// report (`period`: ticks between two reports).
    #[inline(always)]
    pub const fn first(now: u64, reported: bool, period: u64) -> DenyRecord {
        DenyRecord {
            first: now,
            reported: if reported {
                now
            } else {
                now.wrapping_sub(period)
            },
            packets: if reported { 0 } else { 1 },
        }
    }

    /// Counts one more denied packet at tick `now`; `Some` when it is time to report (the
    /// flow's last event is `period` ticks old): the packets to report, this one included.
    /// The caller resets the record with [`DenyRecord::reported`] once the event is emitted
    /// (a refused event leaves them for the next).
    #[inline(always)]
    pub fn count(&mut self, now: u64, period: u64) -> Option<Due> {
        if self.packets == 0 {
            self.first = now;
        }
        self.packets += 1;
        if now.wrapping_sub(self.reported) < period {
            return None;
        }
        Some(Due {
            packets: if self.packets > u64::from(u32::MAX) {
                u32::MAX
            } else {
                self.packets as u32
            },
            first: self.first,
        })
    }

    /// The packets counted so far were reported at tick `now`.
    #[inline(always)]
    pub fn reported(&mut self, now: u64) {
        self.packets = 0;
        self.reported = now;
    }
}

/// The key of a flow's [`DenyRecord`]: a hash of the packet's addresses, ports, protocol and
/// the hook (a flow denied at both hooks has two records). Never 0.
#[inline(always)]
pub fn flow_key(p: &IpPacket, hook: u8) -> u64 {
    crate::handoff::tag(0x5bd1_e995_6c62_272e, p, u64::from(hook))
}

/// A per-CPU token bucket ([`MAP_EVENT_BUCKET`] value): `credit` is time in ns, one event costs
/// `interval` of it, and it never holds more than `burst` events' worth. The programs give it
/// their clock's ticks in ns (a tick is 1-10 ms: the credit grows by whole ticks, which the
/// burst absorbs).
///
/// [`MAP_EVENT_BUCKET`]: crate::layout::MAP_EVENT_BUCKET
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Bucket {
    /// Credit in ns.
    pub credit: u64,
    /// When credit was last added (ns).
    pub last_ns: u64,
}

impl Bucket {
    /// Whether an event may be emitted at `now_ns` (and takes its cost), with one event per
    /// `interval` ns and at most `burst` at once. An interval of 0 refuses everything (events
    /// off).
    #[inline(always)]
    pub fn take(&mut self, now_ns: u64, interval: u64, burst: u64) -> bool {
        if interval == 0 {
            return false;
        }
        let cap = interval.wrapping_mul(burst);
        let gained = now_ns.saturating_sub(self.last_ns);
        self.last_ns = now_ns;
        let credit = self.credit.saturating_add(gained);
        self.credit = if credit > cap { cap } else { credit };
        if self.credit < interval {
            return false;
        }
        self.credit -= interval;
        true
    }
}

/// One CPU's event state ([`MAP_EVENT_BUCKET`] value): its token bucket, and room to build a
/// new [`DenyRecord`] in (the programs' stacks have none to spare; a map value serves as the
/// value of a map insert as well as a stack slot does).
///
/// [`MAP_EVENT_BUCKET`]: crate::layout::MAP_EVENT_BUCKET
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct EventCpu {
    /// The token bucket.
    pub bucket: Bucket,
    /// Scratch space for a record about to be inserted.
    pub scratch: DenyRecord,
    /// The rule set and peer identity of this CPU's last egress lookup
    /// (`DatapathMaps::judged`).
    pub egress: Judged,
    /// The same for ingress.
    pub ingress: Judged,
    /// The key of the policy lookup that finds a deciding key's rule counter, and
    /// [`EventCpu::elements`], the keys of the rule counter lookups: in map memory, not on
    /// the stack, so that the verifier does not track their values (it marks a constant key
    /// on the stack precise, and states that differ in a precise value never prune).
    pub count_key: crate::layout::PolicyKey,
    /// The rule counter elements the last counted decision counted in, egress and ingress
    /// (out of range for a direction that did not count).
    pub elements: [u32; 2],
    /// The rule counter of the key the last policy probe found (written by the probe loop,
    /// in map memory: a value carried out of the loop multiplied the verifier's states).
    pub found_counter: u32,
    /// Padding; always zero.
    pub _pad: u32,
    /// What the deciding program hands the observer program it tail-calls.
    pub args: ObserveArgs,
}

/// What a deciding program hands its observer program (`layout::XDP_OBSERVER_NAME`) in this
/// CPU's [`EventCpu`]: the decision's summary, where the packet was seen, the verdict the
/// observer returns, and the packet's tuple (the observer does not parse it again).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ObserveArgs {
    /// [`Summary::reason`].
    pub reason: u64,
    /// [`Summary::word`].
    pub word: u64,
    /// [`Summary::prefixes`].
    pub prefixes: u64,
    /// The interface the packet came in on (XDP: the hook's; TC: `ingress_ifindex`).
    pub ifindex: u32,
    /// The program's return value for the packet (`XDP_PASS`/`XDP_DROP`, `TC_ACT_OK`/`SHOT`).
    pub action: u32,
    /// The packet's source address ([`IpPacket::src`]).
    pub src: [u32; 4],
    /// Its destination address.
    pub dst: [u32; 4],
    /// Its source port.
    pub sport: u16,
    /// Its destination port.
    pub dport: u16,
    /// 4 or 6.
    pub ip_version: u8,
    /// Its protocol.
    pub protocol: u8,
    /// Padding; always zero.
    pub _pad2: u16,
}

impl ObserveArgs {
    /// The packet's tuple handed over, as the parser would give it (what events and flow
    /// keys read of it).
    #[inline(always)]
    pub fn packet(&self) -> IpPacket {
        IpPacket {
            ip_version: self.ip_version,
            src: self.src,
            dst: self.dst,
            protocol: self.protocol,
            sport: self.sport,
            dport: self.dport,
            tcp_flags: 0,
            icmp6_type: 0,
            hop_limit: 0,
            fragment: crate::parse::Fragment::No,
            icmp: crate::parse::Icmp::Other,
            quote_protocol: 0,
            quote_peer: [0; 4],
        }
    }

    /// The summary handed over.
    #[inline(always)]
    pub fn summary(&self) -> Summary {
        Summary {
            reason: self.reason,
            word: self.word,
            prefixes: self.prefixes,
        }
    }
}

/// A policy lookup's rule set and peer identity ([`EventCpu::egress`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Judged {
    /// The rule set.
    pub ruleset: u32,
    /// The peer identity.
    pub peer: u32,
    /// [`EventCpu::found_counter`] after the lookup: the rule counter of the peer's key, when
    /// that key decided (stale otherwise, and then not read).
    pub found_counter: u32,
}

/// The per-CPU interval between events for a node rate of `per_sec` events per second over
/// `cpus` CPUs (0 = events off). Each CPU gets an equal share: the node never emits more
/// than `per_sec` (plus each CPU's burst).
pub const fn interval_ns(per_sec: u64, cpus: u64) -> u64 {
    if per_sec == 0 {
        return 0;
    }
    let cpus = if cpus == 0 { 1 } else { cpus };
    let i = 1_000_000_000u64.saturating_mul(cpus) / per_sec;
    if i == 0 { 1 } else { i }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_the_rate_and_the_burst() {
        let mut b = Bucket::default();
        // Starts empty at time 0; after 10 intervals it holds 10 events (burst 4: capped at 4).
        assert!(!b.take(0, 100, 4));
        let got = (0..10).filter(|_| b.take(1_000, 100, 4)).count();
        assert_eq!(got, 4);
        // Steady state: one event per interval.
        let mut n = 0;
        for t in 0..10_000u64 {
            if b.take(1_000 + t * 10, 100, 4) {
                n += 1;
            }
        }
        assert!((990..=1_001).contains(&n), "{n}");
        assert!(!Bucket::default().take(u64::MAX, 0, 4), "interval 0 = off");
    }

    #[test]
    fn deny_record_reports_once_per_period_with_every_packet() {
        // 1,000 ticks a second, a packet per tick: 10 s of packets.
        let mut r = DenyRecord::first(0, true, 1_000);
        let mut reported = 1u64; // the first packet's own event
        let mut events = 0;
        for t in 1..=10_000 {
            if let Some(d) = r.count(t, 1_000) {
                reported += u64::from(d.packets);
                assert!(d.first <= t);
                assert_eq!(
                    d.at(5_000_000_000, t, 1_000).first_ns,
                    5_000_000_000 - (t - d.first) * 1_000_000
                );
                r.reported(t);
                events += 1;
            }
        }
        assert_eq!(events, 10);
        // Every packet except those of the last (unfinished) period is reported, once.
        let pending = r.packets;
        assert_eq!(reported + pending, 10_001);
        assert!(pending < 1_000, "{pending}");
        // A first packet whose event was refused is reported by the next one.
        let mut r = DenyRecord::first(7, false, 1_000);
        assert_eq!(r.count(8, 1_000).map(|d| d.packets), Some(2));
    }

    #[test]
    fn interval_shares_the_rate_among_cpus() {
        assert_eq!(interval_ns(0, 4), 0);
        assert_eq!(interval_ns(5_000, 1), 200_000);
        assert_eq!(interval_ns(5_000, 4), 800_000);
        assert_eq!(interval_ns(u64::MAX, 1), 1);
    }
}
