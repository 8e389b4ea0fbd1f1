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

use aya_ebpf::bindings::xdp_md;
use aya_ebpf::helpers::generated::bpf_xdp_get_buff_len;
use aya_ebpf::programs::{TcContext, XdpContext};
use ordnet_datapath_common::{Frame, MAX_HEADER_BYTES};

/// The packet of an XDP or TC program (direct packet access between `data` and `data_end`) as a
/// [`Frame`] for the shared parser.
///
/// Headers are read from the first buffer only (`data..data_end`: an XDP multi-buffer packet's
/// first fragment, a TC packet's linear part); what lies beyond is not read, so headers that end
/// there make the parser see a truncated packet (dropped). The packet's **length** counts every
/// buffer: an IP packet longer than its first buffer (a jumbo frame in an XDP multi-buffer
/// packet, a GRO-merged packet at TC) is whole, not truncated.
pub struct XdpFrame {
    data: usize,
    data_end: usize,
    rest: Rest,
}

/// Where the length of a packet beyond its first buffer comes from.
enum Rest {
    /// Asked of the kernel (`bpf_xdp_get_buff_len`), only when the first buffer is too short.
    Xdp(*mut xdp_md),
    /// The socket buffer's length (`skb->len`: linear part and fragments).
    Skb(usize),
}

impl XdpFrame {
    /// The XDP packet (single- or multi-buffer).
    #[inline(always)]
    pub fn new(ctx: &XdpContext) -> Self {
        Self {
            data: ctx.data(),
            data_end: ctx.data_end(),
            rest: Rest::Xdp(ctx.ctx),
        }
    }

    /// The linear part of a TC packet (see the TC program for how headers are made linear).
    #[inline(always)]
    pub fn tc(ctx: &TcContext) -> Self {
        Self {
            data: ctx.data(),
            data_end: ctx.data_end(),
            rest: Rest::Skb(ctx.len() as usize),
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
    fn load_words<const K: usize>(&self, offset: usize) -> Option<[u32; K]> {
        // Same pattern as `load`, once for all `K` words.
        let offset = core::hint::black_box(offset);
        if offset > MAX_HEADER_BYTES - 4 * K {
            return None;
        }
        let start = self.data + offset;
        if start + 4 * K > self.data_end {
            return None;
        }
        let mut w = [0u32; K];
        for (i, word) in w.iter_mut().enumerate() {
            *word = read_u32(start + 4 * i);
        }
        Some(w)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        if self.data + len <= self.data_end {
            return true;
        }
        match self.rest {
            // SAFETY: the program's own context pointer, valid for the whole run.
            Rest::Xdp(ctx) => (unsafe { bpf_xdp_get_buff_len(ctx) }) >= len as u64,
            Rest::Skb(total) => total >= len,
        }
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

/// One 64-bit load from packet metadata (one instruction, see [`read_u32`]); the caller has
/// checked `addr..addr + 8` against the packet's bounds.
#[cfg(target_arch = "bpf")]
#[inline(always)]
pub fn read_u64(addr: usize) -> u64 {
    let v: u64;
    // SAFETY: the caller checked the 8 bytes lie inside the packet's metadata.
    unsafe {
        core::arch::asm!(
            "{0} = *(u64 *)({1} + 0)",
            lateout(reg) v,
            in(reg) addr,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    v
}

/// One 64-bit store into packet metadata (one instruction, see [`read_u32`]); the caller has
/// checked `addr..addr + 8` against the packet's bounds.
#[cfg(target_arch = "bpf")]
#[inline(always)]
pub fn write_u64(addr: usize, v: u64) {
    // SAFETY: the caller checked the 8 bytes lie inside the packet's metadata.
    unsafe {
        core::arch::asm!(
            "*(u64 *)({0} + 0) = {1}",
            in(reg) addr,
            in(reg) v,
            options(nostack, preserves_flags)
        );
    }
}

/// Host build (never executed: the host binary does nothing).
#[cfg(not(target_arch = "bpf"))]
pub fn read_u64(addr: usize) -> u64 {
    // SAFETY: see the BPF version; on the host this code is only compiled, never run.
    unsafe { (addr as *const u64).read_unaligned() }
}

/// Host build (never executed: the host binary does nothing).
#[cfg(not(target_arch = "bpf"))]
pub fn write_u64(addr: usize, v: u64) {
    // SAFETY: see the BPF version; on the host this code is only compiled, never run.
    unsafe { (addr as *mut u64).write_unaligned(v) }
}

/// Host build of the crate (never executed: the host binary does nothing).
#[cfg(not(target_arch = "bpf"))]
#[inline(always)]
fn read_u32(addr: usize) -> u32 {
    // SAFETY: see the BPF version; on the host this code is only compiled, never run.
    unsafe { (addr as *const u32).read_unaligned() }
}
