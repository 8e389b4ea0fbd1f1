//! The decision: parse result + one map lookup -> PASS or DROP.

use crate::{ACTION_ALLOW, Fragment, ParseError, Parsed, PortKey};

/// What the XDP program returns for a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// `XDP_PASS`.
    Pass,
    /// `XDP_DROP`.
    Drop,
}

/// The verdict for a parsed frame. `lookup` reads the verdict map; it is called at most once.
///
/// The policy (documented in `docs/datapath.md`):
/// * a frame that is positively not IP (ARP, LLDP, ...) passes: the policy governs IP only;
/// * a frame that is, or may be, IP but whose headers are truncated or invalid is dropped
///   (fail closed; the kernel would discard such a packet anyway);
/// * a later IP fragment passes without a lookup: it has no ports, and the first fragment,
///   which has them, was already subject to the policy (dropping it makes the datagram
///   impossible to reassemble);
/// * otherwise the map decides for (IP version, protocol, destination port): no entry or
///   [`ACTION_ALLOW`] passes; [`crate::ACTION_DENY`] drops, and so does any unknown value
///   (fail closed).
#[inline(always)]
pub fn verdict(
    parsed: &Result<Parsed, ParseError>,
    lookup: impl FnOnce(&PortKey) -> Option<u8>,
) -> Verdict {
    match parsed {
        Err(_) => Verdict::Drop,
        Ok(Parsed::NotIp { .. }) => Verdict::Pass,
        Ok(Parsed::Ip(ip)) if ip.fragment == Fragment::Subsequent => Verdict::Pass,
        Ok(Parsed::Ip(ip)) => match lookup(&PortKey::new(ip.ip_version, ip.protocol, ip.dport)) {
            None | Some(ACTION_ALLOW) => Verdict::Pass,
            Some(_) => Verdict::Drop,
        },
    }
}
