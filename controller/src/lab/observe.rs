//! `ordnet lab --observe`: the datapath's verdict events for the lab's probes (the first packet
//! of every new flow, the denied packets aggregated per flow), attributed to the rules that
//! decided them with the lab's engine (`ordnet::observe`, the agent's code), and matched to the
//! probes: `-o json` gives every probed flow its events, the table is followed by them as
//! `ordnet observe` prints them.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use std::collections::{BTreeMap, BTreeSet};

use ordnet::observe::{FlowRecord, attribute_batch};
use ordnet::render::Style;
use ordnet::rule_counters::{CounterFilter, RuleCounterRow, rows, rule_name};
use ordnet_datapath::common::event::FlowEvent;
use ordnet_datapath::{Datapath, DatapathCounters, EventReader, RuleId, RuleTotals};
use ordnet_engine::{Engine, SideDecision};
use ordnet_mapstate::Verdict;

/// The events a lab run saw.
pub(super) struct LabEvents {
    /// Every event, attributed, in the order the programs wrote them.
    pub records: Vec<FlowRecord>,
    /// The programs' event counters (emitted, suppressed, lost).
    pub counters: DatapathCounters,
    /// The per-rule counters after the probes.
    pub rules: Vec<RuleCounterRow>,
    /// Where the per-rule counters and the events disagree (`Err`: they could not be read).
    pub disagreements: Result<Vec<String>, String>,
}

/// How long the events of the last probes may take to reach the ring buffer: they are written
/// before the packet is passed on, so a drain that finds nothing twice in a row is complete.
const SETTLE: Duration = Duration::from_millis(20);

/// One node's datapath, its event reader, and the engine it was programmed from.
pub(super) struct Source<'a> {
    pub datapath: &'a mut Datapath,
    pub reader: &'a mut EventReader,
    pub engine: &'a Engine,
}

/// Takes every event out of each node's reader and attributes them with that node's engine
/// (the state its datapath was programmed from); the counters are the nodes' sums.
pub(super) fn gather(sources: &mut [Source<'_>]) -> LabEvents {
    let mut raw: Vec<Vec<FlowEvent>> = vec![Vec::new(); sources.len()];
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut empty = 0;
    while empty < 2 && Instant::now() < deadline {
        let drained: usize = sources
            .iter_mut()
            .zip(&mut raw)
            .map(|(s, raw)| s.reader.drain(raw))
            .sum();
        if drained == 0 {
            empty += 1;
        } else {
            empty = 0;
        }
        std::thread::sleep(SETTLE);
    }
    let mut records = Vec::new();
    let mut counters = DatapathCounters::default();
    let mut totals = RuleTotals::default();
    let mut unread = None;
    for (s, raw) in sources.iter_mut().zip(&raw) {
        records.extend(attribute_batch(s.engine, s.datapath, raw, 1));
        counters.add(&s.datapath.counters().unwrap_or_default());
        // One read per datapath, all it counted since it was created: the totals' memory of
        // the last read is another datapath's elements, so it is cleared first.
        totals.reloaded();
        if let Err(e) = s.datapath.collect_rule_counts(&mut totals) {
            unread = Some(format!("cannot read the per-rule counters: {e}"));
        }
    }
    let disagreements = match unread {
        Some(e) => Err(e),
        None if counters.events_suppressed + counters.events_lost > 0 => Err(format!(
            "not compared with the events: {} events were suppressed or lost",
            counters.events_suppressed + counters.events_lost
        )),
        None => Ok(counters_against_events(&records, &totals)),
    };
    LabEvents {
        records,
        counters,
        rules: rows(&totals, &CounterFilter::default()),
        disagreements,
    }
}

impl LabEvents {
    /// Judges every event again with the staged view (`ordnet::observe::staged_verdict`).
    pub(super) fn judge_staged(&mut self, view: &Engine) {
        for r in &mut self.records {
            r.staged = ordnet::observe::staged_verdict(view, r);
        }
    }
}

/// Where the per-rule counters differ from what the events say each rule decided: every new
/// flow allowed counts for the rules of both sides the kernel judged; a denied flow counts
/// once (its first denied packet, per hook) for the rules of the side that denied it, and
/// every denied packet too (the events carry the packets they stand for; those of the last
/// report of a flow may still be unreported, so the counters may hold more, never fewer).
fn counters_against_events(records: &[FlowRecord], totals: &RuleTotals) -> Vec<String> {
    // (flows allowed, flows denied, packets denied) per rule.
    let mut want: BTreeMap<RuleId, [u64; 3]> = BTreeMap::new();
    let mut denied_flows = BTreeSet::new();
    for r in records {
        let e = &r.event;
        for side in [&r.egress, &r.ingress].into_iter().flatten() {
            if !e.allowed && side.verdict != Verdict::Deny {
                continue;
            }
            let ids: Vec<RuleId> = match &side.decision {
                SideDecision::Matched { entry, .. } => {
                    entry.origins.iter().map(|o| RuleId::of(o)).collect()
                }
                SideDecision::Default { isolated, .. } => vec![RuleId::Default {
                    direction: side.direction,
                    allow: !isolated,
                }],
            };
            for id in ids {
                let w = want.entry(id.clone()).or_default();
                if e.allowed {
                    w[0] += 1;
                } else {
                    let flow = (e.hook, e.protocol, e.src, e.sport, e.dst, e.dport, id);
                    if denied_flows.insert(flow) {
                        w[1] += 1;
                    }
                    w[2] += u64::from(e.packets);
                }
            }
        }
    }
    let mut out = Vec::new();
    let ids: BTreeSet<&RuleId> = want.keys().chain(totals.totals().keys()).collect();
    for id in ids {
        let w = want.get(id).copied().unwrap_or_default();
        let got = totals.totals().get(id).copied().unwrap_or_default();
        if got.flows_allowed != w[0] || got.flows_denied != w[1] || got.packets_denied < w[2] {
            out.push(format!(
                "{}: counted {} flows allowed, {} flows denied, {} packets denied; the events \
                 say {}, {}, at least {}",
                rule_name(id),
                got.flows_allowed,
                got.flows_denied,
                got.packets_denied,
                w[0],
                w[1],
                w[2]
            ));
        }
    }
    out
}

impl LabEvents {
    /// The events of the flow `protocol` from `src` to `dst` (any source port); through a
    /// Service also those of the end labelled `label` (`Some`) from another address: its source
    /// address may have been rewritten on the way (kube-proxy's masquerade of a hairpin) and
    /// the event attributed to it by the interface it came in on.
    pub fn of_flow(
        &self,
        protocol: u8,
        src: IpAddr,
        label: Option<&str>,
        dst: SocketAddr,
    ) -> Vec<&FlowRecord> {
        self.records
            .iter()
            .filter(|r| {
                r.event.protocol == protocol
                    && (r.event.src == src
                        || label.is_some_and(|l| r.src_pod.as_deref() == Some(l)))
                    && r.event.dst == dst.ip()
                    && r.event.dport == dst.port()
            })
            .collect()
    }

    /// The counters' lines (stderr): the events', and whether the per-rule counters agree
    /// with the events.
    pub fn summary(&self) -> String {
        let c = &self.counters;
        let mut out = format!(
            "ordnet lab: {} verdict events ({} emitted, {} suppressed by the rate limit, {} lost)",
            self.records.len(),
            c.events,
            c.events_suppressed,
            c.events_lost
        );
        let flows: u64 = self
            .rules
            .iter()
            .map(|r| r.flows_allowed + r.flows_denied)
            .sum();
        match &self.disagreements {
            Ok(d) if d.is_empty() => out.push_str(&format!(
                "\nordnet lab: per-rule counters of {} rules ({flows} flows counted) agree with \
                 the verdict events",
                self.rules.len()
            )),
            Ok(d) => {
                out.push_str(&format!(
                    "\nordnet lab: per-rule counters DISAGREE with the verdict events ({} rules):",
                    d.len()
                ));
                for line in d {
                    out.push_str(&format!("\n  {line}"));
                }
            }
            Err(e) => out.push_str(&format!("\nordnet lab: per-rule counters: {e}")),
        }
        out
    }

    /// Whether the per-rule counters disagree with the events.
    pub fn counters_disagree(&self) -> bool {
        self.disagreements.as_ref().is_ok_and(|d| !d.is_empty())
    }

    /// Every event as `ordnet observe` prints it, then the per-rule counters as
    /// `ordnet observe --counters` prints them.
    pub fn text(&self, style: Style) -> String {
        let mut out = format!("\nverdict events ({}):\n", self.records.len());
        for r in &self.records {
            out.push_str(&ordnet::observe::text(r, style));
        }
        out.push_str("\nper-rule counters:\n");
        out.push_str(&ordnet::rule_counters::text(&self.rules, style));
        out
    }
}
