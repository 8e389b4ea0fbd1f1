//! Code shared by the two eBPF binaries of this crate: the enforcing program (`ordnet-xdp`,
//! `src/main.rs`) and the layout benchmark programs (`ordnet-xdp-bench`, `src/bench.rs`).
//!
//! The library also exists so that `ordnet-datapath` can list the crate as a build-dependency:
//! cargo then re-runs datapath's build script (which builds the eBPF objects) whenever this
//! crate or one of its dependencies (`ordnet-datapath-common`) changes.
#![no_std]

use aya_ebpf::programs::XdpContext;
use ordnet_datapath_common::{Frame, MAX_HEADER_BYTES};

/// The XDP packet as a [`Frame`] for the shared parser.
pub struct XdpFrame {
    data: usize,
    data_end: usize,
}

impl XdpFrame {
    #[inline(always)]
    pub fn new(ctx: &XdpContext) -> Self {
        Self {
            data: ctx.data(),
            data_end: ctx.data_end(),
        }
    }
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
