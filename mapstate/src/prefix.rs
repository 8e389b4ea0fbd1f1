//! `L4Prefix`: the (protocol, port-prefix) part of a key, as a 24-bit prefix.
//!
//! Bits 31..24 of the representation hold the IP protocol number, bits 23..8 the port; bits 7..0
//! are always zero. The prefix length counts from the top: 0 = any protocol, 8 = one protocol with
//! any port, `8 + n` = one protocol with the top `n` bits of the port fixed (24 = one port).
//! So within one identity, "any protocol" is an ancestor of every protocol key and a shorter port
//! prefix an ancestor of a longer one, and longest-prefix match gives the most specific key.

use std::fmt;

use prefix_trie::Prefix;
use serde::{Serialize, Serializer};

use crate::types::Protocol;

/// A (protocol, port prefix) block. Host bits are always zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct L4Prefix {
    bits: u32,
    len: u8,
}

/// Maximum prefix length: protocol (8 bits) + port (16 bits).
pub const FULL_LEN: u8 = 24;

fn mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    }
}

impl L4Prefix {
    /// Every protocol and port.
    pub const ANY: L4Prefix = L4Prefix { bits: 0, len: 0 };

    /// Builds a prefix from a protocol number, a port and a length (masked as needed).
    pub fn new(proto: u8, port: u16, len: u8) -> L4Prefix {
        let len = len.min(FULL_LEN);
        let raw = (u32::from(proto) << 24) | (u32::from(port) << 8);
        L4Prefix {
            bits: raw & mask(len),
            len,
        }
    }

    /// One protocol, any port.
    pub fn proto(proto: u8) -> L4Prefix {
        L4Prefix::new(proto, 0, 8)
    }

    /// The fully specified key of a packet (the probe for longest-prefix match).
    pub fn packet(proto: u8, port: u16) -> L4Prefix {
        L4Prefix::new(proto, port, FULL_LEN)
    }

    /// The prefix length in bits (0..=24). A prefix is never "empty": this is not a size.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u8 {
        self.len
    }

    /// Whether this is the zero-length prefix (every protocol and port).
    pub fn is_any(&self) -> bool {
        self.len == 0
    }

    /// The protocol number, if the prefix fixes it.
    pub fn protocol(&self) -> Option<u8> {
        (self.len >= 8).then_some((self.bits >> 24) as u8)
    }

    /// Number of fixed port bits (0..=16).
    pub fn port_bits(&self) -> u8 {
        self.len.saturating_sub(8)
    }

    /// The inclusive port range covered, if the protocol is fixed.
    pub fn port_range(&self) -> Option<(u16, u16)> {
        self.protocol()?;
        let first = ((self.bits >> 8) & 0xffff) as u16;
        let free = 16 - u32::from(self.port_bits());
        let last = if free == 16 {
            u16::MAX
        } else {
            first | (((1u32 << free) - 1) as u16)
        };
        Some((first, last))
    }

    /// Whether `self` contains `other` (equal counts).
    pub fn covers(&self, other: &L4Prefix) -> bool {
        self.len <= other.len && (other.bits & mask(self.len)) == self.bits
    }

    /// Whether a packet of protocol `proto` to `port` falls in this block.
    pub fn matches(&self, proto: u8, port: u16) -> bool {
        self.covers(&L4Prefix::packet(proto, port))
    }

    /// A total order that sorts broader prefixes first (used to make insertion canonical).
    pub fn sort_key(&self) -> (u8, u32) {
        (self.len, self.bits)
    }

    /// Raw representation (protocol << 24 | port << 8), for flattening into datapath keys.
    pub fn raw(&self) -> u32 {
        self.bits
    }
}

impl Prefix for L4Prefix {
    type R = u32;

    fn repr(&self) -> u32 {
        self.bits
    }

    fn prefix_len(&self) -> u8 {
        self.len
    }

    fn from_repr_len(repr: u32, len: u8) -> Self {
        L4Prefix {
            bits: repr & mask(len),
            len,
        }
    }
}

impl PartialOrd for L4Prefix {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Orders by protocol/port bits, then broader first: a parent sorts just before its subtree.
impl Ord for L4Prefix {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.bits, self.len).cmp(&(other.bits, other.len))
    }
}

impl fmt::Display for L4Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(proto) = self.protocol() else {
            return f.write_str("*");
        };
        match Protocol::from_number(proto) {
            Some(p) => write!(f, "{p}")?,
            None => write!(f, "proto{proto}")?,
        }
        let (first, last) = self.port_range().unwrap_or((0, u16::MAX));
        match self.port_bits() {
            0 => f.write_str("/*"),
            16 => write!(f, "/{first}"),
            n => write!(f, "/{first}-{last} (/{n})"),
        }
    }
}

impl fmt::Debug for L4Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for L4Prefix {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("L4Prefix", 4)?;
        match self.protocol() {
            None => {
                st.serialize_field("protocol", &Option::<&str>::None)?;
                st.serialize_field("ports", &Option::<(u16, u16)>::None)?;
            }
            Some(p) => {
                let name = Protocol::from_number(p)
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_else(|| p.to_string());
                st.serialize_field("protocol", &Some(name))?;
                if self.port_bits() == 0 {
                    st.serialize_field("ports", &Option::<(u16, u16)>::None)?;
                } else {
                    st.serialize_field("ports", &self.port_range())?;
                }
            }
        }
        st.serialize_field("portPrefixLen", &self.port_bits())?;
        st.serialize_field("prefixLen", &self.len)?;
        st.end()
    }
}

/// Splits the inclusive port range `first..=last` of protocol `proto` into the minimal list of
/// aligned prefix blocks, in ascending port order.
pub fn range_blocks(proto: u8, first: u16, last: u16) -> Vec<L4Prefix> {
    let mut out = Vec::new();
    let mut lo = u32::from(first);
    let hi = u32::from(last);
    while lo <= hi {
        // Largest aligned block starting at `lo` that does not pass `hi`.
        let mut size_bits = if lo == 0 {
            16
        } else {
            lo.trailing_zeros().min(16)
        };
        while size_bits > 0 && lo + (1u32 << size_bits) - 1 > hi {
            size_bits -= 1;
        }
        out.push(L4Prefix::new(proto, lo as u16, 8 + (16 - size_bits as u8)));
        lo += 1u32 << size_bits;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_blocks_are_minimal_and_exact() {
        let b = range_blocks(6, 80, 90);
        let ranges: Vec<_> = b.iter().map(|p| p.port_range().unwrap()).collect();
        assert_eq!(ranges, vec![(80, 87), (88, 89), (90, 90)]);
        assert_eq!(range_blocks(6, 0, 65535), vec![L4Prefix::proto(6)]);
        assert_eq!(range_blocks(6, 65535, 65535).len(), 1);
        assert_eq!(range_blocks(17, 1, 65535).len(), 16);
        for (lo, hi) in [
            (0u16, 0u16),
            (1, 1),
            (0, 1023),
            (1024, 65535),
            (53, 80),
            (7, 9),
        ] {
            let blocks = range_blocks(6, lo, hi);
            let mut covered = 0u32;
            for p in 0..=65535u16 {
                let n = blocks.iter().filter(|b| b.matches(6, p)).count();
                assert!(n <= 1, "blocks overlap at {p}");
                assert_eq!(n == 1, lo <= p && p <= hi, "port {p} in {lo}-{hi}");
                covered += n as u32;
            }
            assert_eq!(covered, u32::from(hi - lo) + 1);
        }
    }

    #[test]
    fn ancestry() {
        let any = L4Prefix::ANY;
        let tcp = L4Prefix::proto(6);
        let p80 = L4Prefix::packet(6, 80);
        assert!(any.covers(&tcp) && tcp.covers(&p80) && any.covers(&p80));
        assert!(!p80.covers(&tcp));
        assert!(!L4Prefix::proto(17).covers(&p80));
        assert_eq!(format!("{p80}"), "TCP/80");
        assert_eq!(format!("{tcp}"), "TCP/*");
        assert_eq!(format!("{any}"), "*");
        assert_eq!(format!("{}", L4Prefix::new(6, 80, 21)), "TCP/80-87 (/13)");
    }
}
