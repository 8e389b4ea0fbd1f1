//! The enforcing programs' object as the kernel gets it: no calls into library code.
//!
//! The XDP program lives in `xdp.frags`: the loader then declares it multi-buffer aware
//! (`BPF_F_XDP_HAS_FRAGS`), without which the kernel refuses native XDP on a veth whose peer's
//! MTU exceeds a page (jumbo frames; docs/datapath.md §3).
//!
//! A call from the `xdp.frags` or `classifier` section into `.text` is a BPF-to-BPF call: LLVM emits
//! one for a `memset`/`memcpy` it does not expand inline (e.g. a zero-initialised struct whose
//! address is taken), which costs a call and a byte loop on every packet that takes the path
//! (docs/datapath.md §1, note 10). A reference to a function in `.text` that is not a call (a
//! 64-bit immediate load: the `bpf_loop` callback of the policy probes, note 11) is allowed.
//! Needs no privileges.

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionKind};
use ordnet_datapath::EBPF_OBJECT;

#[test]
fn the_programs_call_no_library_code() {
    let file = object::File::parse(EBPF_OBJECT).expect("the eBPF object parses");
    for program in ["xdp.frags", "classifier"] {
        let section = file
            .section_by_name(program)
            .unwrap_or_else(|| panic!("no {program} section"));
        let code = section.data().expect("the program's code");
        let mut relocations = 0;
        for (offset, relocation) in section.relocations() {
            relocations += 1;
            // Byte 0 of a BPF instruction is its opcode: 0x85 is a call.
            if code.get(offset as usize) != Some(&0x85) {
                continue;
            }
            let RelocationTarget::Symbol(index) = relocation.target() else {
                continue;
            };
            let symbol = file.symbol_by_index(index).expect("relocation symbol");
            let target = symbol
                .section_index()
                .and_then(|i| file.section_by_index(i).ok());
            assert!(
                !target.is_some_and(|s| s.kind() == SectionKind::Text),
                "{program}+{offset:#x} calls {:?} (a BPF-to-BPF call into library code)",
                symbol.name()
            );
        }
        // The map references are relocations too: the check saw the program's code.
        assert!(
            relocations > 10,
            "{program}: only {relocations} relocations"
        );
    }
}
