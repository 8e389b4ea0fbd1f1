//! Rebuild the eBPF object when the bpf-linker binary changes (e.g. after it was rebuilt
//! against another LLVM): the linker is not a cargo input, so tell cargo about it.
use std::env;

fn main() {
    let Some(path) = env::var_os("PATH") else {
        return;
    };
    if let Some(linker) = env::split_paths(&path)
        .map(|dir| dir.join("bpf-linker"))
        .find(|candidate| candidate.is_file())
    {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
