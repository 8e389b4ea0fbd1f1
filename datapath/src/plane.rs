//! The programming operations of a datapath, written once for both datapaths:
//!
//! * [`Datapath`](crate::Datapath): the loaded XDP program; its [`TableWriter`] writes the
//!   BPF maps and mirrors them in a [`MemTables`];
//! * [`MemDatapath`]: no kernel at all, the tables are a [`MemTables`] (the offline CLI, tests).
//!
//! Both implement [`ControlPlane`] by handing out their [`Control`] and their writer; every
//! operation (endpoints, identities, host addresses, change sets) and the userspace decision
//! ([`ControlPlane::decide`]: `ordnet_datapath_common::decide`, the function the XDP program
//! runs, over the tables) is a provided method, so the two cannot drift apart.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use ordnet_datapath_common::{
    Decision, Hook,
    layout::{IFACE_HAS_V4, IFACE_HAS_V6, IfaceInfo, IpKey, SvcKey},
};
use ordnet_mapstate::{Changes, Direction, Verdict};

use crate::{
    ControlError, DatapathConfig, DatapathError,
    classes::Classed,
    control::{Control, EndpointAddresses, EndpointSpec, EndpointState, ip_key, key_ip},
    flat::RuleSetContent,
    store::{SlotInfo, Store, WriteStats},
    sys,
    tables::{MemTables, Mirror, TableWriter, UserCt, Write, WriteError},
};

/// The programming operations of a datapath (see the module documentation). Implementors
/// provide access to their parts; everything else is provided.
pub trait ControlPlane {
    /// The control state and the writer of the tables, borrowed together.
    fn parts(&mut self) -> (&mut Control, &mut dyn TableWriter);

    /// The control state (endpoints, rule sets, ipcache bookkeeping).
    fn control(&self) -> &Control;

    /// An exact copy of what the maps hold (connection tracking excepted): at the identity
    /// level, also where the maps hold classes.
    fn tables(&self) -> &MemTables;

    /// The policy keys the policy map holds (class keys where it holds classes).
    fn policy_map_keys(&self) -> usize {
        self.control().store().policy_keys_held()
    }

    /// How full the maps that grow with the cluster are ([`Control::fill`]; the policy map's
    /// keys as [`ControlPlane::policy_map_keys`] counts them).
    fn fill(&self) -> Vec<crate::MapFill> {
        self.control().fill(self.tables())
    }

    /// Sets this node's own addresses: traffic between them and local endpoints is never
    /// filtered.
    fn set_host_addresses(&mut self, ips: &[IpAddr]) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.set_hosts(w, ips)?)
    }

    /// This node's addresses.
    fn host_addresses(&self) -> Vec<IpAddr> {
        self.control().hosts().collect()
    }

    /// Replaces the Service frontends: (address, IP protocol number, port) of every ClusterIP,
    /// external or load-balancer IP and node address with a NodePort that kube-proxy
    /// translates. A new flow to one is judged at the TC hook, after translation.
    fn set_service_frontends(
        &mut self,
        frontends: &[(IpAddr, u8, u16)],
    ) -> Result<WriteStats, DatapathError> {
        let keys: Vec<SvcKey> = frontends
            .iter()
            .map(|(ip, protocol, port)| {
                let k = ip_key(*ip);
                SvcKey {
                    family: k.family as u8,
                    protocol: *protocol,
                    port: *port,
                    addr: k.addr,
                }
            })
            .collect();
        let (c, w) = self.parts();
        Ok(c.set_services(w, &keys)?)
    }

    /// The Service frontends as (address, IP protocol number, port), sorted.
    fn service_frontends(&self) -> Vec<(IpAddr, u8, u16)> {
        let mut out: Vec<(IpAddr, u8, u16)> = self
            .control()
            .services()
            .iter()
            .map(|k| (key_ip(&IpKey::new(k.family, k.addr)), k.protocol, k.port))
            .collect();
        out.sort();
        out
    }

    /// Records (`Some(addresses)`) or forgets (`None`) the host-side interface `ifindex` of local
    /// endpoint `endpoint`, with the endpoint's addresses (one per family is used): the TC hook
    /// attributes a packet that came in on it to the endpoint even when its source address was
    /// rewritten (kube-proxy's masquerade).
    fn set_interface(
        &mut self,
        ifindex: u32,
        endpoint: u32,
        addresses: Option<&[IpAddr]>,
    ) -> Result<WriteStats, DatapathError> {
        let info = addresses.map(|ips| {
            let mut info = IfaceInfo {
                endpoint,
                ..IfaceInfo::default()
            };
            for ip in ips {
                let k = ip_key(*ip);
                match ip {
                    IpAddr::V4(_) if info.flags & IFACE_HAS_V4 == 0 => {
                        info.flags |= IFACE_HAS_V4;
                        info.addr4 = k.addr[0];
                    }
                    IpAddr::V6(_) if info.flags & IFACE_HAS_V6 == 0 => {
                        info.flags |= IFACE_HAS_V6;
                        info.addr6 = k.addr;
                    }
                    _ => {}
                }
            }
            info
        });
        let (c, w) = self.parts();
        Ok(c.set_interface(w, ifindex, info)?)
    }

    /// Sets the identity of a network: a single address (remote pod, node) or a CIDR.
    fn set_identity(&mut self, net: IpNet, identity: u32) -> Result<WriteStats, DatapathError> {
        self.set_identities(&[(net, Some(identity))])
    }

    /// Removes the identity of a network.
    fn remove_identity(&mut self, net: IpNet) -> Result<WriteStats, DatapathError> {
        self.set_identities(&[(net, None)])
    }

    /// Sets (`Some`) or removes (`None`) identities of networks, in one batch.
    fn set_identities(
        &mut self,
        entries: &[(IpNet, Option<u32>)],
    ) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.set_identities(w, entries)?)
    }

    /// Creates or changes one local endpoint: addresses, identity and both MapStates.
    fn upsert_endpoint(
        &mut self,
        id: u32,
        spec: EndpointSpec<'_>,
    ) -> Result<WriteStats, DatapathError> {
        self.update_endpoints(&[(id, spec)])
    }

    /// Creates or changes several endpoints in one operation. Endpoints with identical
    /// MapStates share one rule set; when every user of a rule set moves to the same new
    /// MapState in one batch, only the changed keys are written (in place, in the safe order).
    fn update_endpoints(
        &mut self,
        batch: &[(u32, EndpointSpec<'_>)],
    ) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.update_endpoints(w, batch)?)
    }

    /// [`ControlPlane::update_endpoints`], except that an endpoint whose rule sets do not fit
    /// the tables gets a deny-all policy in both directions instead of being left as it was
    /// (see [`Control::update_endpoints_or_deny`]); returns the endpoints denied, with why.
    fn update_endpoints_or_deny(
        &mut self,
        batch: &[(u32, EndpointSpec<'_>)],
    ) -> Result<(WriteStats, Vec<(u32, ControlError)>), DatapathError> {
        let (c, w) = self.parts();
        Ok(c.update_endpoints_or_deny(w, batch)?)
    }

    /// Applies MapState change sets (as `MapState::apply` returns them) to endpoints, with the
    /// new isolation defaults. In the common case (every endpoint that uses a rule set gets the
    /// same changes) the cost is the size of the changes, not of the MapState. A change set
    /// that does not fit the datapath's keys (e.g. computed against another state) is an error
    /// (`ControlError::StaleChanges`) and nothing is written: apply the full MapState with
    /// `update_endpoints` then.
    fn apply_changes(
        &mut self,
        batch: &[(u32, Direction, Changes<'_>, Verdict)],
    ) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.apply_changes(w, batch)?)
    }

    /// Changes the addresses and identities of existing endpoints, keeping their rule sets.
    fn set_endpoint_addresses(
        &mut self,
        batch: &[(u32, EndpointAddresses<'_>)],
    ) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.set_endpoint_addresses(w, batch)?)
    }

    /// Removes an endpoint.
    fn remove_endpoint(&mut self, id: u32) -> Result<WriteStats, DatapathError> {
        self.remove_endpoints(&[id])
    }

    /// Removes several endpoints in one operation.
    fn remove_endpoints(&mut self, ids: &[u32]) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.remove_endpoints(w, ids)?)
    }

    /// The endpoints, by id.
    fn endpoints(&self) -> &BTreeMap<u32, EndpointState> {
        self.control().endpoints()
    }

    /// The rule sets in use.
    fn rulesets(&self) -> Vec<SlotInfo> {
        self.control().store().slots_in_use()
    }

    /// The keys of a rule set slot.
    fn ruleset_content(&self, slot: u32) -> Option<&RuleSetContent> {
        self.control().store().content(slot)
    }

    /// Clears released rule sets whose grace period is over (also done by every update).
    fn reclaim(&mut self) -> Result<WriteStats, DatapathError> {
        let (c, w) = self.parts();
        Ok(c.reclaim(w)?)
    }

    /// When [`ControlPlane::reclaim`] next has something to clear ([`Control::reclaim_due`]).
    fn reclaim_due(&self) -> Option<std::time::Instant>;

    /// The global policy revision.
    fn revision(&self) -> u64 {
        self.control().revision()
    }

    /// The XDP program's decision function run in userspace over the tables, for a packet of
    /// a flow that is not tracked (connection-tracking writes are discarded).
    fn decide(&self, frame: &[u8]) -> Decision {
        self.decide_with(frame, &UserCt::default())
    }

    /// The same with a caller-owned connection-tracking table (to follow a packet sequence).
    fn decide_with(&self, frame: &[u8], ct: &UserCt) -> Decision {
        self.decide_at(frame, Hook::Xdp, ct)
    }

    /// The TC program's decision function run in userspace: a forwarded packet that came in on
    /// interface `ingress_ifindex`, seen after netfilter (Service translation, source NAT).
    fn decide_tc(&self, frame: &[u8], ingress_ifindex: u32) -> Decision {
        self.decide_at(
            frame,
            Hook::Tc {
                ingress_ifindex,
                handoff: 0,
            },
            &UserCt::default(),
        )
    }

    /// The decision at `hook` with a caller-owned connection-tracking table.
    fn decide_at(&self, frame: &[u8], hook: Hook, ct: &UserCt) -> Decision {
        ordnet_datapath_common::decide_at(
            &ordnet_datapath_common::parse(frame),
            &Mirror {
                tables: self.tables(),
                ct,
                store: self.control().store(),
            },
            hook,
        )
    }
}

/// A datapath without a kernel: the same control plane writing a [`MemTables`], decided by
/// the same function as the XDP program ([`ControlPlane::decide`]). The offline CLI programs
/// one of these exactly as the agent programs the kernel.
#[derive(Debug)]
pub struct MemDatapath {
    control: Control,
    tables: MemWriter,
}

/// The writer of a [`MemDatapath`]: its tables, or its tables and the class-level tables of
/// the same writes ([`MemDatapath::with_classes`]).
#[derive(Debug)]
enum MemWriter {
    Plain(Box<MemTables>),
    Classed(Box<Classed>),
}

impl TableWriter for MemWriter {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        match self {
            MemWriter::Plain(t) => t.write(writes),
            MemWriter::Classed(c) => c.write(writes),
        }
    }

    fn tables(&self) -> &MemTables {
        match self {
            MemWriter::Plain(t) => t,
            MemWriter::Classed(c) => &c.identity,
        }
    }

    fn reclaim_below(&mut self) -> Result<(), WriteError> {
        match self {
            MemWriter::Plain(t) => t.reclaim_below(),
            MemWriter::Classed(c) => c.reclaim_below(),
        }
    }

    fn reclaim_due_below(&self) -> Option<std::time::Instant> {
        match self {
            MemWriter::Plain(t) => t.reclaim_due_below(),
            MemWriter::Classed(c) => c.reclaim_due_below(),
        }
    }

    fn identity_keys(
        &self,
        slot: u32,
    ) -> Option<crate::leafmap::LeafMap<(u32, u32), ordnet_datapath_common::layout::PolicyValue>>
    {
        match self {
            MemWriter::Classed(c) => c.identity_keys(slot),
            _ => None,
        }
    }
}

impl MemDatapath {
    /// Empty tables of the configuration's sizes (rule sets, blocks, grace period and
    /// connection-tracking lifetimes; the map capacities of the kernel are not enforced). The
    /// clock runs at [`sys::FALLBACK_HZ`] ticks per second.
    pub fn new(config: &DatapathConfig) -> MemDatapath {
        MemDatapath::build(config, false)
    }

    /// [`MemDatapath::new`] that also keeps the class-level tables of every write
    /// ([`crate::classes`]: node-local identity classes, not yet written to the kernel).
    pub fn with_classes(config: &DatapathConfig) -> MemDatapath {
        MemDatapath::build(config, true)
    }

    fn build(config: &DatapathConfig, classes: bool) -> MemDatapath {
        use ordnet_datapath_common::layout::{BLOCK_WORDS, CELLS_PER_RULESET};
        let tables = MemTables::new(
            config.max_rulesets * CELLS_PER_RULESET,
            config.max_blocks * BLOCK_WORDS,
        );
        let mut dp = MemDatapath {
            control: Control::new(
                Store::new(config.max_rulesets, config.max_blocks, config.grace)
                    .with_policy_capacity(config.policy_entries),
                config.clock_state(sys::FALLBACK_HZ),
            ),
            tables: if classes {
                MemWriter::Classed(Box::new(Classed::new(tables, config.grace)))
            } else {
                MemWriter::Plain(Box::new(tables))
            },
        };
        dp.control
            .set_ip_capacities(config.ipcache_entries, config.cidr_entries);
        // Revision 1, as a kernel datapath starts.
        dp.control
            .set_hosts(&mut dp.tables, &[])
            .expect("writing to memory cannot fail");
        dp
    }
}

impl MemDatapath {
    /// Keeps no copy of the policy keys in the tables: the rule set store has them, and the
    /// decisions read them there ([`MemTables::keys_in_store`]). For datapaths that are not
    /// checked write by write (the agent's `none` datapath, the offline CLI).
    pub fn keep_keys_in_store(mut self) -> MemDatapath {
        match &mut self.tables {
            MemWriter::Plain(t) => t.keep_keys_in_store(),
            MemWriter::Classed(c) => c.identity.keep_keys_in_store(),
        }
        self
    }

    /// The class-level state, when kept ([`MemDatapath::with_classes`]).
    pub fn classes(&self) -> Option<&Classed> {
        match &self.tables {
            MemWriter::Plain(_) => None,
            MemWriter::Classed(c) => Some(c),
        }
    }
}

impl Default for MemDatapath {
    fn default() -> Self {
        MemDatapath::new(&DatapathConfig::default())
    }
}

impl ControlPlane for MemDatapath {
    fn parts(&mut self) -> (&mut Control, &mut dyn TableWriter) {
        (&mut self.control, &mut self.tables)
    }

    fn control(&self) -> &Control {
        &self.control
    }

    fn tables(&self) -> &MemTables {
        self.tables.tables()
    }

    fn reclaim_due(&self) -> Option<std::time::Instant> {
        self.control.reclaim_due(&self.tables)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ordnet_datapath_common::{
        Reason, Verdict as Xdp,
        craft::{L4, frame_between},
    };
    use std::sync::Arc;

    use ordnet_mapstate::{
        Direction, EntryId, Key, L4Match, L4Prefix, MapState, OrderKey, Origin, Peer, PolicyEntry,
        Protocol, Selector, Update, Verdict,
    };

    use super::*;
    use crate::ControlError;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn tcp(src: &str, dst: &str, port: u16) -> Vec<u8> {
        frame_between(
            ip(src),
            ip(dst),
            L4::Tcp {
                sport: 40000,
                dport: port,
            },
        )
        .unwrap()
    }

    fn small() -> MemDatapath {
        MemDatapath::new(&DatapathConfig {
            max_rulesets: 8,
            max_blocks: 16,
            grace: Duration::ZERO,
            ..DatapathConfig::default()
        })
    }

    fn entry(id: u64, peer: u32, l4: L4Match) -> Update {
        Update::AddEntry(PolicyEntry {
            id: EntryId(id),
            order: OrderKey::new(0, id as u32),
            action: Verdict::Allow.into(),
            selector: Selector::ids([peer]),
            l4,
            origin: Arc::new(Origin {
                kind: "Test".into(),
                namespace: None,
                name: format!("r{id}"),
                direction: Direction::Ingress,
                rule_index: id as u32,
                rule_name: None,
                priority: 0,
                action: Verdict::Allow.into(),
                tier: ordnet_mapstate::Tier::Ordnet,
                passed_by: None,
            }),
        })
    }

    /// An ingress MapState that denies by default and allows `peer` on TCP `port`.
    fn allow_from(peer: u32, port: u16) -> MapState {
        let mut ms = MapState::new(Direction::Ingress, Verdict::Deny);
        ms.apply([entry(1, peer, L4Match::port(Protocol::Tcp, port))])
            .unwrap();
        ms
    }

    /// Endpoint 1 (identity 99) on `ips`: ingress from identity 7 to port 80, egress open.
    fn web_endpoint(dp: &mut MemDatapath, ips: &[IpAddr]) {
        let open = MapState::new(Direction::Egress, Verdict::Allow);
        let ingress = allow_from(7, 80);
        dp.upsert_endpoint(
            1,
            EndpointSpec {
                ips,
                identity: 99,
                identities: &[],
                ingress: &ingress,
                egress: &open,
            },
        )
        .unwrap();
    }

    /// `Control::identities_version` changes exactly when the identities may have, and two
    /// control planes never share a version.
    #[test]
    fn the_identities_version_and_count_follow_the_identities() {
        let mut dp = small();
        let other = small();
        let v0 = dp.control().identities_version();
        assert_ne!(v0, other.control().identities_version());
        web_endpoint(&mut dp, &[ip("10.0.0.5")]);
        assert_eq!(
            dp.control().identities_version(),
            v0,
            "an endpoint is not one"
        );
        dp.set_identities(&[]).unwrap();
        assert_eq!(dp.control().identities_version(), v0);
        let mut seen = vec![v0];
        for (net, id) in [
            ("10.0.1.7/32", Some(7)),
            ("10.1.0.0/16", Some(8)),
            ("10.0.1.7/32", None),
        ] {
            let before = dp.control().identities();
            dp.set_identities(&[(net.parse().unwrap(), id)]).unwrap();
            assert_ne!(dp.control().identities(), before);
            assert_eq!(
                dp.control().identity_count(),
                dp.control().identities().len(),
                "{net}: counted as listed"
            );
            let v = dp.control().identities_version();
            assert!(!seen.contains(&v), "{net}: a new version");
            seen.push(v);
        }
    }

    #[test]
    fn programs_and_decides_like_the_kernel_program() {
        // With the policy keys copied into the tables and without (decisions read them in
        // the rule set store).
        for keys_in_store in [false, true] {
            let dp = if keys_in_store {
                small().keep_keys_in_store()
            } else {
                small()
            };
            programs_and_decides(dp);
        }
    }

    fn programs_and_decides(mut dp: MemDatapath) {
        assert_eq!(dp.revision(), 1);
        web_endpoint(&mut dp, &[ip("10.0.0.5"), ip("fd00::5")]);
        dp.set_identities(&[
            ("10.0.1.7/32".parse().unwrap(), Some(7)),
            ("fd00:1::7/128".parse().unwrap(), Some(7)),
            ("10.0.1.8/32".parse().unwrap(), Some(8)),
        ])
        .unwrap();
        assert_eq!(
            dp.tables().policy.is_empty(),
            dp.tables().keys_in_store,
            "the tables copy the policy keys unless the store has them"
        );
        let d = dp.decide(&tcp("10.0.1.7", "10.0.0.5", 80));
        assert_eq!((d.verdict, d.reason), (Xdp::Pass, Reason::Allowed));
        let d = dp.decide(&tcp("fd00:1::7", "fd00::5", 80));
        assert_eq!((d.verdict, d.reason), (Xdp::Pass, Reason::Allowed));
        let d = dp.decide(&tcp("10.0.1.7", "10.0.0.5", 81));
        assert_eq!((d.verdict, d.reason), (Xdp::Drop, Reason::IngressDenied));
        let d = dp.decide(&tcp("10.0.1.8", "10.0.0.5", 80));
        assert_eq!(d.verdict, Xdp::Drop);
        // Neither end local: not ours to judge.
        assert_eq!(
            dp.decide(&tcp("10.0.1.8", "10.0.1.7", 80)).reason,
            Reason::NotLocal
        );
        // The node's own address is exempt.
        dp.set_host_addresses(&[ip("10.0.0.254")]).unwrap();
        assert_eq!(dp.host_addresses(), vec![ip("10.0.0.254")]);
        assert_eq!(
            dp.decide(&tcp("10.0.0.254", "10.0.0.5", 81)).reason,
            Reason::Host
        );
        // Removing the endpoint: its address is no longer judged.
        dp.remove_endpoint(1).unwrap();
        assert!(dp.endpoints().is_empty());
        assert_eq!(
            dp.decide(&tcp("10.0.1.7", "10.0.0.5", 81)).reason,
            Reason::NotLocal
        );
        // Its rule set was released and cleared (zero grace).
        assert!(dp.rulesets().is_empty());
    }

    #[test]
    fn per_address_identities_and_readdressing() {
        let mut dp = small();
        let open_in = MapState::new(Direction::Ingress, Verdict::Allow);
        let open_out = MapState::new(Direction::Egress, Verdict::Allow);
        // Endpoint 2 only accepts identity 11 on port 80.
        let ingress = allow_from(11, 80);
        let a = [ip("10.0.0.1"), ip("fd00::1")];
        let b = [ip("10.0.0.2"), ip("fd00::2")];
        // A dual-stack pod whose IPv6 address has another identity (11) than its IPv4 one (10).
        dp.update_endpoints(&[
            (
                1,
                EndpointSpec {
                    ips: &a,
                    identity: 0,
                    identities: &[10, 11],
                    ingress: &open_in,
                    egress: &open_out,
                },
            ),
            (
                2,
                EndpointSpec {
                    ips: &b,
                    identity: 20,
                    identities: &[],
                    ingress: &ingress,
                    egress: &open_out,
                },
            ),
        ])
        .unwrap();
        assert_eq!(dp.endpoints()[&1].identity_of(ip("fd00::1")), Some(11));
        assert_eq!(dp.endpoints()[&2].identity_of(ip("fd00::2")), Some(20));
        assert_eq!(
            dp.decide(&tcp("10.0.0.1", "10.0.0.2", 80)).verdict,
            Xdp::Drop
        );
        assert_eq!(dp.decide(&tcp("fd00::1", "fd00::2", 80)).verdict, Xdp::Pass);
        // A wrong number of identities is an error, and nothing changes.
        let before = dp.tables().canonical();
        let e = dp
            .upsert_endpoint(
                3,
                EndpointSpec {
                    ips: &[ip("10.0.0.3")],
                    identity: 0,
                    identities: &[1, 2],
                    ingress: &open_in,
                    egress: &open_out,
                },
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                DatapathError::Control(ControlError::IdentityCount { endpoint: 3, .. })
            ),
            "{e}"
        );
        assert_eq!(dp.tables().canonical(), before);
        // Endpoint 1 changes identity (IPv4 now 11) and address (IPv6 moves to fd00::3).
        let rulesets = dp.rulesets();
        dp.set_endpoint_addresses(&[(
            1,
            EndpointAddresses {
                ips: &[ip("10.0.0.1"), ip("fd00::3")],
                identity: 11,
                identities: &[],
            },
        )])
        .unwrap();
        assert_eq!(dp.rulesets(), rulesets, "rule sets are kept");
        assert_eq!(
            dp.decide(&tcp("10.0.0.1", "10.0.0.2", 80)).verdict,
            Xdp::Pass
        );
        assert_eq!(dp.decide(&tcp("fd00::3", "fd00::2", 80)).verdict, Xdp::Pass);
        // The old address is no longer an endpoint (no identity either).
        assert!(
            !dp.tables()
                .ipcache
                .contains_key(&crate::ip_key(ip("fd00::1")))
        );
        // An address of another endpoint cannot be taken.
        let e = dp
            .set_endpoint_addresses(&[(
                1,
                EndpointAddresses {
                    ips: &[ip("10.0.0.2")],
                    identity: 11,
                    identities: &[],
                },
            )])
            .unwrap_err();
        assert!(
            matches!(
                e,
                DatapathError::Control(ControlError::AddressInUse { owner: 2, .. })
            ),
            "{e}"
        );
        // Unknown endpoint.
        assert!(
            dp.set_endpoint_addresses(&[(
                9,
                EndpointAddresses {
                    ips: &[],
                    identity: 1,
                    identities: &[],
                },
            )])
            .is_err()
        );
    }

    /// An ingress MapState that denies by default and allows each of `peers` on TCP `port`
    /// (one policy key each).
    fn allow_many(peers: std::ops::RangeInclusive<u32>, port: u16) -> MapState {
        let mut ms = MapState::new(Direction::Ingress, Verdict::Deny);
        ms.apply(
            peers
                .enumerate()
                .map(|(i, p)| entry(i as u64 + 1, p, L4Match::port(Protocol::Tcp, port))),
        )
        .unwrap();
        ms
    }

    /// A datapath whose policy map holds 4 keys, with the identities 7, 8 and 20 of
    /// `10.0.1.7`, `.8` and `.20`.
    fn with_tiny_policy_map() -> MemDatapath {
        let mut dp = MemDatapath::new(&DatapathConfig {
            max_rulesets: 8,
            max_blocks: 16,
            policy_entries: 4,
            grace: Duration::ZERO,
            ..DatapathConfig::default()
        });
        for (net, id) in [("10.0.1.7/32", 7), ("10.0.1.8/32", 8), ("10.0.1.20/32", 20)] {
            dp.set_identity(net.parse().unwrap(), id).unwrap();
        }
        dp
    }

    /// Each (source, destination, TCP port) decided as expected.
    fn expect(dp: &MemDatapath, want: &[(&str, &str, u16, Xdp, Reason)]) {
        for &(src, dst, port, verdict, reason) in want {
            let d = dp.decide(&tcp(src, dst, port));
            assert_eq!(
                (d.verdict, d.reason),
                (verdict, reason),
                "{src} -> {dst}:{port}"
            );
        }
    }

    /// A policy map too small for an endpoint's rule set: the endpoint is denied both ways and
    /// reported, the others are enforced as before, and an operation that does not fit writes
    /// nothing.
    #[test]
    fn an_endpoint_whose_rule_set_does_not_fit_is_denied_both_ways() {
        let mut dp = with_tiny_policy_map();
        let open_out = MapState::new(Direction::Egress, Verdict::Allow);
        let spec = |ips, ingress| EndpointSpec {
            ips,
            identity: 20,
            identities: &[],
            ingress,
            egress: &open_out,
        };
        let big = &allow_many(7..=12, 80); // 6 keys: more than the map holds
        let small_in = &allow_from(7, 80);
        let (a, b) = (&[ip("10.0.0.1")][..], &[ip("10.0.0.2")][..]);

        // All or nothing: the batch does not fit, and nothing is written.
        let before = dp.tables().canonical();
        let e = dp
            .update_endpoints(&[(1, spec(a, big)), (2, spec(b, small_in))])
            .unwrap_err();
        assert!(
            matches!(&e, DatapathError::Control(c) if c.is_capacity()),
            "{e}"
        );
        assert_eq!(dp.tables().canonical(), before, "nothing half-written");

        // Or deny what does not fit: endpoint 1 denied both ways, endpoint 2 enforced.
        let (_, denied) = dp
            .update_endpoints_or_deny(&[(1, spec(a, big)), (2, spec(b, small_in))])
            .unwrap();
        assert_eq!(denied.len(), 1);
        assert_eq!(denied[0].0, 1);
        assert!(
            denied[0].1.to_string().contains("policy map is full"),
            "{}",
            denied[0].1
        );
        expect(
            &dp,
            &[
                ("10.0.1.7", "10.0.0.1", 80, Xdp::Drop, Reason::IngressDenied),
                ("10.0.0.1", "10.0.1.8", 443, Xdp::Drop, Reason::EgressDenied),
                ("10.0.1.7", "10.0.0.2", 80, Xdp::Pass, Reason::Allowed),
                ("10.0.1.8", "10.0.0.2", 80, Xdp::Drop, Reason::IngressDenied),
                ("10.0.0.2", "10.0.1.8", 443, Xdp::Pass, Reason::Allowed),
            ],
        );
        assert_eq!(dp.control().store().policy_keys_held(), 1);

        // A change set that does not fit: refused before any write.
        let mut grown = small_in.clone();
        let cs = grown
            .apply((8..=12).map(|p| entry(u64::from(p), p, L4Match::Any)))
            .unwrap();
        let before = dp.tables().canonical();
        let e = dp
            .apply_changes(&[(2, Direction::Ingress, cs.view(), Verdict::Deny)])
            .unwrap_err();
        assert!(
            matches!(&e, DatapathError::Control(c) if c.is_capacity()),
            "{e}"
        );
        assert_eq!(dp.tables().canonical(), before, "nothing half-written");

        // Once it fits (a smaller policy), endpoint 1 is enforced by its own rules again.
        let fits = &allow_many(7..=9, 80);
        let (_, denied) = dp.update_endpoints_or_deny(&[(1, spec(a, fits))]).unwrap();
        assert!(denied.is_empty());
        expect(
            &dp,
            &[
                ("10.0.1.8", "10.0.0.1", 80, Xdp::Pass, Reason::Allowed),
                ("10.0.0.1", "10.0.1.8", 443, Xdp::Pass, Reason::Allowed),
            ],
        );
        assert_eq!(dp.control().store().policy_keys_held(), 4);

        // Both sides of a flow change in one batch (1's egress, 2's ingress) and 2's new
        // ingress does not fit: the changing endpoints go to deny-all first, then each to its
        // new state; 2 stays denied, 1 gets its new egress.
        let closed_out = {
            let mut ms = MapState::new(Direction::Egress, Verdict::Deny);
            ms.apply([entry(1, 8, L4Match::port(Protocol::Tcp, 443))])
                .unwrap();
            ms
        };
        let too_big = &allow_many(7..=11, 80);
        let (_, denied) = dp
            .update_endpoints_or_deny(&[
                (
                    1,
                    EndpointSpec {
                        egress: &closed_out,
                        ..spec(a, fits)
                    },
                ),
                (2, spec(b, too_big)),
            ])
            .unwrap();
        assert_eq!(denied.iter().map(|d| d.0).collect::<Vec<_>>(), [2]);
        expect(
            &dp,
            &[
                ("10.0.0.1", "10.0.1.8", 443, Xdp::Pass, Reason::Allowed),
                ("10.0.0.1", "10.0.1.7", 443, Xdp::Drop, Reason::EgressDenied),
                ("10.0.1.8", "10.0.0.1", 80, Xdp::Pass, Reason::Allowed),
                ("10.0.1.7", "10.0.0.2", 80, Xdp::Drop, Reason::IngressDenied),
                ("10.0.0.2", "10.0.1.8", 443, Xdp::Drop, Reason::EgressDenied),
            ],
        );
        assert_eq!(
            dp.control().store().policy_keys_held(),
            4,
            "3 + 1 keys, no leftovers"
        );
    }

    #[test]
    fn stale_change_sets_are_refused_without_writes() {
        let mut dp = small();
        let open_out = MapState::new(Direction::Egress, Verdict::Allow);
        let mut ingress = allow_from(7, 80);
        dp.upsert_endpoint(
            1,
            EndpointSpec {
                ips: &[ip("10.0.0.1")],
                identity: 5,
                identities: &[],
                ingress: &ingress,
                egress: &open_out,
            },
        )
        .unwrap();
        // A real change set applies in place.
        let cs = ingress.apply([entry(2, 8, L4Match::Any)]).unwrap();
        let stats = dp
            .apply_changes(&[(1, Direction::Ingress, cs.view(), Verdict::Deny)])
            .unwrap();
        assert_eq!(stats.rulesets_updated, 1, "{stats:?}");
        dp.set_identity("10.0.1.8/32".parse().unwrap(), 8).unwrap();
        assert_eq!(
            dp.decide(&tcp("10.0.1.8", "10.0.0.1", 9)).verdict,
            Xdp::Pass
        );
        // Applying it again does not fit: an error, and nothing is written.
        let before = dp.tables().canonical();
        let e = dp
            .apply_changes(&[(1, Direction::Ingress, cs.view(), Verdict::Deny)])
            .unwrap_err();
        assert!(
            matches!(
                e,
                DatapathError::Control(ControlError::StaleChanges { endpoint: 1, .. })
            ),
            "{e}"
        );
        assert_eq!(dp.tables().canonical(), before);
        let key = Key {
            peer: Peer::Id(8),
            prefix: L4Prefix::ANY,
        };
        assert!(ingress.get(&key).is_some());
    }

    /// A rule set changed in place must not be shared by another change of the same batch
    /// whose result equals its old content (regression: the egress side took the ingress
    /// slot and then received the ingress changes too).
    #[test]
    fn a_rule_set_changed_in_place_is_not_shared_by_its_old_content() {
        use ordnet_mapstate::{ChangeSet, StateEntry};
        let mut dp = small();
        let st = |v: Verdict| StateEntry {
            verdict: v,
            order: OrderKey::new(0, 0),
            entries: Vec::new().into(),
            origins: Vec::new().into(),
            synthesized: false,
        };
        let star = Key {
            peer: Peer::Any,
            prefix: L4Prefix::ANY,
        };
        let id5 = Key {
            peer: Peer::Id(5),
            prefix: L4Prefix::ANY,
        };
        // Ingress: {* allow}; egress: empty.
        let mut ingress = MapState::new(Direction::Ingress, Verdict::Deny);
        ingress
            .apply([Update::AddEntry(PolicyEntry {
                id: EntryId(1),
                order: OrderKey::new(0, 0),
                action: Verdict::Allow.into(),
                selector: Selector::Any,
                l4: L4Match::Any,
                origin: Arc::new(Origin {
                    kind: "Test".into(),
                    namespace: None,
                    name: "any".into(),
                    direction: Direction::Ingress,
                    rule_index: 0,
                    rule_name: None,
                    priority: 0,
                    action: Verdict::Allow.into(),
                    tier: ordnet_mapstate::Tier::Ordnet,
                    passed_by: None,
                }),
            })])
            .unwrap();
        let egress = MapState::new(Direction::Egress, Verdict::Deny);
        dp.upsert_endpoint(
            1,
            EndpointSpec {
                ips: &[ip("10.0.0.1")],
                identity: 9,
                identities: &[],
                ingress: &ingress,
                egress: &egress,
            },
        )
        .unwrap();
        // Ingress gains a key (in place); egress becomes {* allow}, the ingress's old content.
        let in_cs = ChangeSet {
            added: vec![(id5, st(Verdict::Deny))],
            ..ChangeSet::default()
        };
        let out_cs = ChangeSet {
            added: vec![(star, st(Verdict::Allow))],
            ..ChangeSet::default()
        };
        dp.apply_changes(&[
            (1, Direction::Ingress, in_cs.view(), Verdict::Deny),
            (1, Direction::Egress, out_cs.view(), Verdict::Deny),
        ])
        .unwrap();
        let ep = &dp.endpoints()[&1];
        assert_ne!(ep.ingress.ruleset, ep.egress.ruleset);
        let egress_keys = dp.ruleset_content(ep.egress.ruleset).unwrap();
        assert_eq!(egress_keys.len(), 1, "{egress_keys:?}");
        assert_eq!(dp.ruleset_content(ep.ingress.ruleset).unwrap().len(), 2);
        dp.set_identity("10.0.1.5/32".parse().unwrap(), 5).unwrap();
        // Egress of the endpoint towards identity 5: allowed by the * key only.
        assert_eq!(
            dp.decide(&tcp("10.0.0.1", "10.0.1.5", 80)).verdict,
            Xdp::Pass
        );
        assert_eq!(
            dp.decide(&tcp("10.0.1.5", "10.0.0.1", 80)).verdict,
            Xdp::Drop
        );
        assert_eq!(
            dp.control().identities(),
            vec![("10.0.1.5/32".parse().unwrap(), 5)]
        );
    }

    /// The frontend mark of exact ipcache records (`IP_FLAG_FRONTEND`) follows the Service
    /// frontends whoever writes the record (the frontends, an endpoint, an identity, the
    /// node's addresses) and is repaired on adoption; a new flow to a marked address is
    /// deferred, to an unmarked one judged.
    #[test]
    fn the_frontend_mark_follows_the_services() {
        let mut dp = small();
        let marked = |dp: &MemDatapath, addr: &str| {
            dp.tables()
                .ipcache
                .get(&ip_key(ip(addr)))
                .map(|i| i.is_frontend())
        };
        let open = MapState::new(Direction::Egress, Verdict::Allow);
        let ingress = allow_from(7, 80);
        let (ips1, ips2) = ([ip("10.0.0.5")], [ip("10.0.0.6")]);
        let spec = |ips| EndpointSpec {
            ips,
            identity: 99,
            identities: &[],
            ingress: &ingress,
            egress: &open,
        };
        dp.upsert_endpoint(1, spec(&ips1)).unwrap();
        dp.set_identity("10.0.1.7/32".parse().unwrap(), 7).unwrap();
        dp.set_host_addresses(&[ip("10.0.0.254")]).unwrap();
        // An external IP that is the pod's, a NodePort, a ClusterIP (no record), and a
        // frontend on an address an endpoint takes later.
        dp.set_service_frontends(&[
            (ip("10.0.0.5"), 6, 9090),
            (ip("10.0.0.254"), 6, 30080),
            (ip("10.96.0.1"), 6, 443),
            (ip("10.0.0.6"), 6, 9090),
        ])
        .unwrap();
        assert_eq!(marked(&dp, "10.0.0.5"), Some(true));
        assert_eq!(marked(&dp, "10.0.0.254"), Some(true));
        assert_eq!(marked(&dp, "10.0.1.7"), Some(false));
        assert_eq!(marked(&dp, "10.96.0.1"), None);
        dp.upsert_endpoint(2, spec(&ips2)).unwrap();
        assert_eq!(
            marked(&dp, "10.0.0.6"),
            Some(true),
            "a record written later"
        );
        // Rewritten by an identity change, the record keeps the mark.
        dp.set_endpoint_addresses(&[(
            1,
            EndpointAddresses {
                ips: &[ip("10.0.0.5")],
                identity: 98,
                identities: &[],
            },
        )])
        .unwrap();
        assert_eq!(marked(&dp, "10.0.0.5"), Some(true));
        let syn = |dst: &str, port| tcp("10.0.1.7", dst, port);
        assert_eq!(
            dp.decide(&syn("10.0.0.5", 9090)).reason,
            Reason::ServiceFrontend
        );
        assert_eq!(
            dp.decide(&syn("10.0.0.5", 9091)).reason,
            Reason::IngressDenied
        );
        assert_eq!(
            dp.decide(&syn("10.96.0.1", 443)).reason,
            Reason::ServiceFrontend
        );
        // Adoption repairs records whose mark disagrees with the Service map (tables written by
        // a version without the mark, an interrupted change).
        let mut tables = dp.tables().clone();
        let key = ip_key(ip("10.0.0.5"));
        let mut stale = tables.ipcache[&key];
        stale.flags &= !ordnet_datapath_common::layout::IP_FLAG_FRONTEND;
        tables
            .write(&[crate::tables::Write::IpUpsert(key, stale)])
            .unwrap();
        let key = ip_key(ip("10.0.1.7"));
        let mut stale = tables.ipcache[&key];
        stale.flags |= ordnet_datapath_common::layout::IP_FLAG_FRONTEND;
        tables
            .write(&[crate::tables::Write::IpUpsert(key, stale)])
            .unwrap();
        Control::adopt(&mut tables, 8, 16, Duration::ZERO).unwrap();
        assert_eq!(
            tables.ipcache,
            dp.tables().ipcache,
            "adoption repaired the marks"
        );
        // Frontends gone: marks gone, the flows judged.
        dp.set_service_frontends(&[]).unwrap();
        for addr in ["10.0.0.5", "10.0.0.6", "10.0.0.254"] {
            assert_eq!(marked(&dp, addr), Some(false), "{addr}");
        }
        assert_eq!(
            dp.decide(&syn("10.0.0.5", 9090)).reason,
            Reason::IngressDenied
        );
    }

    /// A failed write of the frontend marks leaves the frontends unrecorded, so that the caller
    /// (comparing them with what it wants) tries again, and the next call repairs the marks.
    #[test]
    fn a_failed_mark_write_is_retried_and_repaired() {
        use crate::tables::{MemTables, TableWriter, Write, WriteError};
        struct FailingIpcache {
            tables: MemTables,
            fail: bool,
        }
        impl TableWriter for FailingIpcache {
            fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
                if self.fail && writes.iter().any(|w| matches!(w, Write::IpUpsert(..))) {
                    return Err(WriteError::Full("ORDNET_IP4", 0));
                }
                self.tables.write(writes)
            }
            fn tables(&self) -> &MemTables {
                &self.tables
            }
        }
        let mut dp = small();
        dp.set_host_addresses(&[ip("10.0.0.254")]).unwrap();
        let (control, tables) = (&mut dp.control, dp.tables.tables());
        let mut w = FailingIpcache {
            tables: tables.clone(),
            fail: true,
        };
        let node_port = SvcKey {
            family: ordnet_datapath_common::layout::FAMILY_V4,
            protocol: 6,
            port: 30080,
            addr: ip_key(ip("10.0.0.254")).addr,
        };
        assert!(control.set_services(&mut w, &[node_port]).is_err());
        assert!(
            control.services().is_empty(),
            "not recorded: the caller retries"
        );
        w.fail = false;
        control.set_services(&mut w, &[node_port]).unwrap();
        assert_eq!(control.services().len(), 1);
        assert!(w.tables.ipcache[&ip_key(ip("10.0.0.254"))].is_frontend());
        // And back, failing once more on the way.
        w.fail = true;
        assert!(control.set_services(&mut w, &[]).is_err());
        w.fail = false;
        control.set_services(&mut w, &[]).unwrap();
        assert!(!w.tables.ipcache[&ip_key(ip("10.0.0.254"))].is_frontend());
        assert!(w.tables.services.is_empty());
    }
}
