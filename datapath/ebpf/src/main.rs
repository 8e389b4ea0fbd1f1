//! The ordnet XDP program.
//!
//! Parses the frame with the parser shared with userspace
//! ([`ordnet_datapath_common::parse`]), looks the (IP version, L4 protocol, destination port)
//! up in the one map `PORT_VERDICTS`, and returns `XDP_PASS` or `XDP_DROP` as
//! [`ordnet_datapath_common::verdict`] decides. It never returns `XDP_ABORTED`.
//!
//! Malformed-packet policy (see `docs/datapath.md`): frames that are positively not IP pass;
//! frames that are, or may be, IP with truncated or invalid headers drop; later IP fragments
//! pass without a lookup; everything else is decided by the map (no entry = pass).
//!
//! Built for `bpfel-unknown-none` by `datapath/build.rs` (aya-build). On the host the crate also
//! compiles (so `cargo clippy --workspace` lints the program code), as an ordinary binary whose
//! `main` only explains that.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::HashMap,
    programs::XdpContext,
};
use ordnet_datapath_common::{
    Frame, MAX_HEADER_BYTES, PORT_VERDICTS_MAX_ENTRIES, PortKey, Verdict, parse, verdict,
};

/// (IP version, L4 protocol, destination port) -> `ACTION_ALLOW` / `ACTION_DENY`.
#[map(name = "PORT_VERDICTS")]
static PORT_VERDICTS: HashMap<PortKey, u8> =
    HashMap::with_max_entries(PORT_VERDICTS_MAX_ENTRIES, 0);

/// The XDP packet as a [`Frame`] for the shared parser.
struct XdpFrame {
    data: usize,
    data_end: usize,
}

impl Frame for XdpFrame {
    #[inline(always)]
    fn load<const N: usize>(&self, offset: usize) -> Option<[u8; N]> {
        // The verifier only accepts a packet read when it has just seen `data + offset + N`
        // compared with `data_end` (on the same pointer) and `offset` bounded. The parser's own
        // length checks logically imply this comparison, so LLVM would delete it as redundant;
        // `black_box` hides `offset` from the optimizer (it costs a stack spill, no branch), so
        // the bound and the comparison below are always emitted.
        const { assert!(N >= 2, "1-byte loads defeat the verifier's range tracking") };
        let offset = core::hint::black_box(offset);
        if offset > MAX_HEADER_BYTES - N {
            return None;
        }
        let start = self.data + offset;
        if start + N > self.data_end {
            return None;
        }
        // SAFETY: `start..start + N` lies inside the packet (checked just above); the read is
        // unaligned-safe.
        Some(unsafe { core::ptr::read_unaligned(start as *const [u8; N]) })
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        self.data + len <= self.data_end
    }
}

#[xdp]
pub fn ordnet_xdp(ctx: XdpContext) -> u32 {
    let frame = XdpFrame {
        data: ctx.data(),
        data_end: ctx.data_end(),
    };
    let parsed = parse(&frame);
    // SAFETY: the map holds plain `u8` values; the reference is copied out immediately and
    // not kept across any other map operation.
    let lookup = |key: &PortKey| unsafe { PORT_VERDICTS.get(key) }.copied();
    match verdict(&parsed, lookup) {
        Verdict::Pass => xdp_action::XDP_PASS,
        Verdict::Drop => xdp_action::XDP_DROP,
    }
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
