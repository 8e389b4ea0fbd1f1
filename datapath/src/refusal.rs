//! Why the kernel refuses an XDP attachment, in its own words.
//!
//! `bpf_link_create` reports only an errno: the driver's explanation ("veth: Peer MTU is too
//! large to set XDP", "XDP expects number of rx queues not less than peer tx queues", ...) goes
//! to the netlink extended acknowledgement of the older netlink attach path, which a BPF link
//! does not have. So after a refused link, the same attachment is asked once more over
//! `rtnetlink` (`RTM_SETLINK` with `IFLA_XDP`, `XDP_FLAGS_UPDATE_IF_NOEXIST` so it never replaces
//! anything) with extended acks on, and the kernel's message is read from the answer. The driver
//! runs the same checks on both paths. The acknowledgement is parsed here: netlink-packet-core's
//! `ErrorMessage` keeps the error code and drops the extended-ack attributes. Should the second try succeed (the refusal was specific
//! to links), its attachment is removed at once and no reason is returned.

use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};

const NETLINK_EXT_ACK: libc::c_int = 11;
const SOL_NETLINK: libc::c_int = 270;
const IFLA_XDP: u16 = 43;
const IFLA_XDP_FD: u16 = 1;
const IFLA_XDP_FLAGS: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
const XDP_FLAGS_UPDATE_IF_NOEXIST: u32 = 1;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;
const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;

/// The kernel's message for attaching program `prog` to interface `ifindex` in XDP mode
/// `mode_flags` (`XDP_FLAGS_SKB_MODE`, `XDP_FLAGS_DRV_MODE` or 0), or `None` when the kernel
/// gives none (or the attachment succeeds over netlink: it is undone at once).
pub fn xdp_refusal(ifindex: u32, prog: BorrowedFd<'_>, mode_flags: u32) -> Option<String> {
    let socket = open().ok()?;
    let flags = XDP_FLAGS_UPDATE_IF_NOEXIST | mode_flags;
    match set_xdp(&socket, ifindex, prog.as_raw_fd(), flags) {
        Ok(()) => {
            // Not refused this way: take it off again (fd -1 removes the program of that mode).
            let _ = set_xdp(&socket, ifindex, -1, mode_flags);
            None
        }
        Err(message) => message,
    }
}

fn open() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: an int option of the right size.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            SOL_NETLINK,
            NETLINK_EXT_ACK,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

/// One `RTM_SETLINK` carrying `IFLA_XDP { FD, FLAGS }`, and its acknowledgement: the
/// kernel's message when refused (if it gave one).
fn set_xdp(socket: &OwnedFd, ifindex: u32, fd: i32, flags: u32) -> Result<(), Option<String>> {
    let request = setlink_xdp(ifindex, fd, flags);
    // SAFETY: the buffer is valid for its length; a zeroed sockaddr_nl addresses the kernel.
    let sent = unsafe {
        let mut to: libc::sockaddr_nl = std::mem::zeroed();
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&to as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(None);
    }
    let mut answer = vec![0u8; 8192];
    // SAFETY: the buffer is valid for its length.
    let got = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            answer.as_mut_ptr().cast(),
            answer.len(),
            0,
        )
    };
    if got < 0 {
        return Err(None);
    }
    answer.truncate(got as usize);
    match parse_ack(&answer) {
        Some((0, _)) => Ok(()),
        Some((_, message)) => Err(message),
        None => Err(None),
    }
}

/// The request: `nlmsghdr`, `ifinfomsg`, then the nested `IFLA_XDP` attribute.
fn setlink_xdp(ifindex: u32, fd: i32, flags: u32) -> Vec<u8> {
    let mut nested = Vec::new();
    attr(&mut nested, IFLA_XDP_FD, &fd.to_ne_bytes());
    attr(&mut nested, IFLA_XDP_FLAGS, &flags.to_ne_bytes());
    let mut body = vec![0u8; IFINFOMSG_LEN];
    body[0] = libc::AF_UNSPEC as u8;
    body[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    attr(&mut body, IFLA_XDP | NLA_F_NESTED, &nested);
    let mut msg = Vec::with_capacity(NLMSG_HDRLEN + body.len());
    let len = (NLMSG_HDRLEN + body.len()) as u32;
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&libc::RTM_SETLINK.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel assigns it
    msg.extend_from_slice(&body);
    msg
}

/// Appends a netlink attribute (4-byte header, value, padding to 4 bytes).
fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = (4 + value.len()) as u16;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// An `NLMSG_ERROR` answer: its (positive) errno, 0 for success, and the extended ack's
/// message if there is one. `None` when `answer` is not such a message.
fn parse_ack(answer: &[u8]) -> Option<(i32, Option<String>)> {
    let u16_at = |at: usize| Some(u16::from_ne_bytes(answer.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_ne_bytes(answer.get(at..at + 4)?.try_into().ok()?));
    let len = u32_at(0)? as usize;
    if u16_at(4)? != libc::NLMSG_ERROR as u16 || len > answer.len() {
        return None;
    }
    let flags = u16_at(6)?;
    let error = u32_at(NLMSG_HDRLEN)? as i32;
    let errno = -error;
    if flags & NLM_F_ACK_TLVS == 0 {
        return Some((errno, None));
    }
    // After the error code comes the request's header (and, unless capped, its payload).
    let request_len = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        u32_at(NLMSG_HDRLEN + 4)? as usize
    };
    let mut at = NLMSG_HDRLEN + 4 + request_len.next_multiple_of(4);
    while at + 4 <= len {
        let alen = usize::from(u16_at(at)?);
        let kind = u16_at(at + 2)?;
        if alen < 4 || at + alen > len {
            break;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let text = &answer[at + 4..at + alen];
            let text = text.split(|b| *b == 0).next().unwrap_or(text);
            return Some((errno, Some(String::from_utf8_lossy(text).into_owned())));
        }
        at += alen.next_multiple_of(4);
    }
    Some((errno, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An acknowledgement as the kernel writes it: header, error, the capped request header,
    /// then the message attribute.
    fn ack(error: i32, capped: bool, message: Option<&str>) -> Vec<u8> {
        let request = setlink_xdp(7, 3, 2);
        let mut body = Vec::new();
        body.extend_from_slice(&error.to_ne_bytes());
        if capped {
            body.extend_from_slice(&request[..NLMSG_HDRLEN]);
        } else {
            body.extend_from_slice(&request);
        }
        if let Some(m) = message {
            let mut v = m.as_bytes().to_vec();
            v.push(0);
            attr(&mut body, NLMSGERR_ATTR_MSG, &v);
        }
        let mut flags = if capped { NLM_F_CAPPED } else { 0 };
        if message.is_some() {
            flags |= NLM_F_ACK_TLVS;
        }
        let mut out = Vec::new();
        out.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        out.extend_from_slice(&flags.to_ne_bytes());
        out.extend_from_slice(&[0; 8]);
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn acknowledgements_parse() {
        let msg = "veth: Peer MTU is too large to set XDP";
        assert_eq!(
            parse_ack(&ack(-34, true, Some(msg))),
            Some((34, Some(msg.to_string())))
        );
        assert_eq!(
            parse_ack(&ack(-28, false, Some("rx queues"))),
            Some((28, Some("rx queues".to_string())))
        );
        assert_eq!(parse_ack(&ack(-1, true, None)), Some((1, None)));
        assert_eq!(parse_ack(&ack(0, true, None)), Some((0, None)));
        // Truncated or not an error message: no answer, no panic.
        let full = ack(-34, true, Some(msg));
        for cut in 0..full.len() {
            let _ = parse_ack(&full[..cut]);
        }
        let mut other = full.clone();
        other[4] = 16;
        assert_eq!(parse_ack(&other), None);
    }

    #[test]
    fn the_request_nests_fd_and_flags() {
        let m = setlink_xdp(9, -1, 2);
        assert_eq!(m.len() % 4, 0);
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        // ifinfomsg index
        assert_eq!(i32::from_ne_bytes(m[20..24].try_into().unwrap()), 9);
        // IFLA_XDP | NESTED, holding two 8-byte attributes
        assert_eq!(u16::from_ne_bytes(m[32..34].try_into().unwrap()), 20);
        assert_eq!(
            u16::from_ne_bytes(m[34..36].try_into().unwrap()),
            IFLA_XDP | NLA_F_NESTED
        );
        assert_eq!(i32::from_ne_bytes(m[40..44].try_into().unwrap()), -1);
        assert_eq!(u32::from_ne_bytes(m[48..52].try_into().unwrap()), 2);
    }
}
