//! Code shared by the two eBPF binaries of this crate: the enforcing programs (XDP and TC, in
//! `ordnet-xdp`, `src/main.rs`) and the layout benchmark programs (`ordnet-xdp-bench`,
//! `src/bench.rs`).
//!
//! The library also exists so that `ordnet-datapath` can list the crate as a build-dependency:
//! cargo then re-runs datapath's build script (which builds the eBPF objects) whenever this
//! crate or one of its dependencies (`ordnet-datapath-common`) changes.
#![no_std]
// BPF inline assembly (one 32-bit packet load, see `read_u32`) is behind this gate.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

use aya_ebpf::programs::{TcContext, XdpContext};
use ordnet_datapath_common::{Frame, MAX_HEADER_BYTES};

/// The packet of an XDP or TC program (direct packet access between `data` and `data_end`) as a
/// [`Frame`] for the shared parser.
pub struct XdpFrame {
    data: usize,
    data_end: usize,
}

impl XdpFrame {
    /// The XDP packet.
    #[inline(always)]
    pub fn new(ctx: &XdpContext) -> Self {
        Self {
            data: ctx.data(),
            data_end: ctx.data_end(),
        }
    }

    /// The linear part of a TC packet (see the TC program for how headers are made linear).
    #[inline(always)]
    pub fn tc(ctx: &TcContext) -> Self {
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
    fn load_word(&self, offset: usize) -> Option<u32> {
        // Same pattern as `load`.
        let offset = core::hint::black_box(offset);
        if offset > MAX_HEADER_BYTES - 4 {
            return None;
        }
        let start = self.data + offset;
        if start + 4 > self.data_end {
            return None;
        }
        Some(read_u32(start))
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        self.data + len <= self.data_end
    }
}

/// One 32-bit load from the packet. `read_unaligned` would make LLVM emit four byte loads
/// (the BPF backend assumes no misaligned access), and `ptr::read` of a possibly misaligned
/// pointer is undefined behaviour in Rust; the instruction itself is fine: the verifier only
/// enforces packet alignment on architectures without efficient unaligned access, where it
/// would reject the program at load time rather than misbehave.
#[cfg(target_arch = "bpf")]
#[inline(always)]
fn read_u32(addr: usize) -> u32 {
    let v: u64;
    // SAFETY: `addr..addr + 4` lies inside the packet (checked by the caller right before);
    // the asm only reads those 4 bytes.
    unsafe {
        core::arch::asm!(
            "{0} = *(u32 *)({1} + 0)",
            lateout(reg) v,
            in(reg) addr,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    v as u32
}

/// Host build of the crate (never executed: the host binary does nothing).
#[cfg(not(target_arch = "bpf"))]
#[inline(always)]
fn read_u32(addr: usize) -> u32 {
    // SAFETY: see the BPF version; on the host this code is only compiled, never run.
    unsafe { (addr as *const u32).read_unaligned() }
}
