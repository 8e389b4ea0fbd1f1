//! Empty library target of the eBPF crate.
//!
//! The program itself is the `ordnet-xdp` binary (`src/main.rs`). This library exists so that
//! `ordnet-datapath` can list the crate as a build-dependency: cargo then re-runs datapath's
//! build script (which builds the eBPF object) whenever this crate or one of its dependencies
//! (`ordnet-datapath-common`) changes.
#![no_std]
