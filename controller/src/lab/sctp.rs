//! The SCTP packets of the raw-socket probe (RFC 9260): an INIT from the client and the INIT-ACK
//! that the responder in the destination namespace answers with, each a common header with its
//! CRC32c checksum and one chunk. Used when the kernel has no SCTP sockets.

/// SCTP's IP protocol number.
pub const IPPROTO_SCTP: i32 = 132;

const CHUNK_INIT: u8 = 1;
const CHUNK_INIT_ACK: u8 = 2;
const PARAM_STATE_COOKIE: u16 = 7;

/// CRC32c (Castagnoli, reflected polynomial 0x82F63B78), as SCTP uses it.
pub fn crc32c(data: &[u8]) -> u32 {
    const fn table() -> [u32; 256] {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    }
    static TABLE: [u32; 256] = table();
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// A packet: the common header, then `chunk` (padded to 4 bytes), checksum filled in.
fn packet(sport: u16, dport: u16, vtag: u32, chunk: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(12 + chunk.len() + 3);
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(chunk);
    while p.len() % 4 != 0 {
        p.push(0);
    }
    // The CRC is stored in little-endian byte order (RFC 9260 appendix A; Linux: cpu_to_le32).
    let crc = crc32c(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes());
    p
}

/// INIT and INIT-ACK share their fixed part: initiate tag, a_rwnd, outbound and inbound
/// streams, initial TSN.
fn init_chunk(kind: u8, initiate_tag: u32, params: &[u8]) -> Vec<u8> {
    let len = 20 + params.len();
    let mut c = Vec::with_capacity(len);
    c.push(kind);
    c.push(0);
    c.extend_from_slice(&(len as u16).to_be_bytes());
    c.extend_from_slice(&initiate_tag.to_be_bytes());
    c.extend_from_slice(&65_536u32.to_be_bytes()); // a_rwnd
    c.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    c.extend_from_slice(&1u16.to_be_bytes()); // maximum inbound streams
    c.extend_from_slice(&initiate_tag.to_be_bytes()); // initial TSN
    c.extend_from_slice(params);
    c
}

/// The client's INIT (verification tag 0, as RFC 9260 §8.5.1 requires).
pub fn init(sport: u16, dport: u16, initiate_tag: u32) -> Vec<u8> {
    packet(sport, dport, 0, &init_chunk(CHUNK_INIT, initiate_tag, &[]))
}

/// The responder's INIT-ACK to an INIT: verification tag = the INIT's initiate tag, with the
/// mandatory State Cookie parameter.
pub fn init_ack(to: &Parsed, own_tag: u32) -> Vec<u8> {
    let cookie = *b"ordnetlab-cookie";
    let mut param = Vec::new();
    param.extend_from_slice(&PARAM_STATE_COOKIE.to_be_bytes());
    param.extend_from_slice(&((4 + cookie.len()) as u16).to_be_bytes());
    param.extend_from_slice(&cookie);
    packet(
        to.dport,
        to.sport,
        to.initiate_tag,
        &init_chunk(CHUNK_INIT_ACK, own_tag, &param),
    )
}

/// What the probe reads of a received SCTP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    pub sport: u16,
    pub dport: u16,
    pub vtag: u32,
    /// The first chunk's type.
    pub chunk: u8,
    /// The initiate tag, for INIT and INIT-ACK.
    pub initiate_tag: u32,
}

impl Parsed {
    pub fn is_init(&self) -> bool {
        self.chunk == CHUNK_INIT
    }

    pub fn is_init_ack(&self) -> bool {
        self.chunk == CHUNK_INIT_ACK
    }
}

/// Parses an SCTP packet (from its common header); `None` when it is too short, its checksum
/// is wrong or its first chunk is cut.
pub fn parse(p: &[u8]) -> Option<Parsed> {
    if p.len() < 16 {
        return None;
    }
    let mut copy = p.to_vec();
    copy[8..12].fill(0);
    if crc32c(&copy).to_le_bytes() != p[8..12] {
        return None;
    }
    let be16 = |o: usize| u16::from_be_bytes([p[o], p[o + 1]]);
    let be32 = |o: usize| u32::from_be_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]]);
    let chunk = p[12];
    let chunk_len = usize::from(be16(14));
    if chunk_len < 4 || 12 + chunk_len > p.len() {
        return None;
    }
    let initiate_tag = if (chunk == CHUNK_INIT || chunk == CHUNK_INIT_ACK) && chunk_len >= 20 {
        be32(16)
    } else {
        0
    };
    Some(Parsed {
        sport: be16(0),
        dport: be16(2),
        vtag: be32(4),
        chunk,
        initiate_tag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The standard check value of CRC-32C.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn init_and_init_ack_round_trip() {
        let i = init(40_000, 80, 0xdead_beef);
        assert_eq!(i.len(), 32);
        let p = parse(&i).expect("valid INIT");
        assert!(p.is_init());
        assert_eq!(
            (p.sport, p.dport, p.vtag, p.initiate_tag),
            (40_000, 80, 0, 0xdead_beef)
        );
        let a = init_ack(&p, 7);
        let q = parse(&a).expect("valid INIT-ACK");
        assert!(q.is_init_ack());
        assert_eq!(
            (q.sport, q.dport, q.vtag, q.initiate_tag),
            (80, 40_000, 0xdead_beef, 7)
        );
        // A flipped bit fails the checksum.
        let mut bad = a.clone();
        bad[20] ^= 1;
        assert_eq!(parse(&bad), None);
    }
}
