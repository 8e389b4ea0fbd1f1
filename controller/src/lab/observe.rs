//! `ordnet lab --observe`: the datapath's verdict events for the lab's probes (the first packet
//! of every new flow, the denied packets aggregated per flow), attributed to the rules that
//! decided them with the lab's engine (`ordnet::observe`, the agent's code), and matched to the
//! probes: `-o json` gives every probed flow its events, the table is followed by them as
//! `ordnet observe` prints them.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ordnet::observe::{FlowRecord, attribute_batch};
use ordnet::render::Style;
use ordnet_datapath::common::event::FlowEvent;
use ordnet_datapath::{Datapath, DatapathCounters, EventReader};
use ordnet_engine::Engine;

/// The events a lab run saw.
pub(super) struct LabEvents {
    /// Every event, attributed, in the order the programs wrote them.
    pub records: Vec<FlowRecord>,
    /// The programs' event counters (emitted, suppressed, lost).
    pub counters: DatapathCounters,
}

/// How long the events of the last probes may take to reach the ring buffer: they are written
/// before the packet is passed on, so a drain that finds nothing twice in a row is complete.
const SETTLE: Duration = Duration::from_millis(20);

/// Takes every event out of `reader` and attributes them with `engine`, the state `dp` was
/// programmed from.
pub(super) fn gather(dp: &Datapath, reader: &mut EventReader, engine: &Engine) -> LabEvents {
    let mut raw: Vec<FlowEvent> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut empty = 0;
    while empty < 2 && Instant::now() < deadline {
        if reader.drain(&mut raw) == 0 {
            empty += 1;
        } else {
            empty = 0;
        }
        std::thread::sleep(SETTLE);
    }
    let records = attribute_batch(engine, dp, &raw, 1);
    LabEvents {
        records,
        counters: dp.counters().unwrap_or_default(),
    }
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

    /// The counters' line (stderr).
    pub fn summary(&self) -> String {
        let c = &self.counters;
        format!(
            "ordnet lab: {} verdict events ({} emitted, {} suppressed by the rate limit, {} lost)",
            self.records.len(),
            c.events,
            c.events_suppressed,
            c.events_lost
        )
    }

    /// Every event as `ordnet observe` prints it.
    pub fn text(&self, style: Style) -> String {
        let mut out = format!("\nverdict events ({}):\n", self.records.len());
        for r in &self.records {
            out.push_str(&ordnet::observe::text(r, style));
        }
        out
    }
}
