//! Builds the XDP program (`datapath/ebpf`, bin `ordnet-xdp`) for `bpfel-unknown-none` with
//! aya-build and leaves the ELF at `$OUT_DIR/ordnet-xdp`, which `src/lib.rs` embeds.
//!
//! aya-build runs `rustup run <toolchain> cargo build --release -Z build-std=core --target
//! bpfel-unknown-none` for the eBPF crate, so userspace keeps building on stable while the eBPF
//! crate uses nightly (default toolchain `nightly`, override with `ORDNET_EBPF_TOOLCHAIN`,
//! e.g. `nightly-2026-05-19`). `bpf-linker` must be on `PATH`; `scripts/setup` installs it.
use std::env;

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

const EBPF_PACKAGE: &str = "ordnet-datapath-ebpf";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=ORDNET_EBPF_TOOLCHAIN");
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == EBPF_PACKAGE)
        .ok_or_else(|| anyhow!("package {EBPF_PACKAGE} is not in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("{EBPF_PACKAGE} manifest has no parent directory"))?;

    if !on_path("bpf-linker") {
        return Err(anyhow!(
            "bpf-linker is not on PATH; it links the XDP program. Run scripts/setup \
             (LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --no-default-features \
             --features llvm-22)"
        ));
    }

    let toolchain = env::var("ORDNET_EBPF_TOOLCHAIN").ok();
    let toolchain = match toolchain.as_deref() {
        None | Some("") | Some("nightly") => Toolchain::Nightly,
        Some(custom) => Toolchain::Custom(custom),
    };
    aya_build::build_ebpf(
        [Package {
            name: EBPF_PACKAGE,
            root_dir: root_dir.as_str(),
            ..Package::default()
        }],
        toolchain,
    )
    .context(
        "building the eBPF program (see the cargo:warning lines above for the compiler output)",
    )?;
    // A CI run builds once (clippy, tests: three OUT_DIRs): the eBPF crate's own target dir
    // (~290 MB each, core built from source) is only a cache, and CI's disk is shared.
    println!("cargo:rerun-if-env-changed=CI");
    if env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        let out_dir = env::var("OUT_DIR").context("OUT_DIR")?;
        let cache = std::path::Path::new(&out_dir).join("aya-build");
        if cache.is_dir() {
            std::fs::remove_dir_all(&cache)
                .with_context(|| format!("removing {}", cache.display()))?;
        }
    }
    Ok(())
}

fn on_path(program: &str) -> bool {
    env::var_os("PATH")
        .is_some_and(|path| env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
