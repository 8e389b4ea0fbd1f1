//! Shared helpers of the engine tests.
pub mod cluster_gen;
pub mod manifest;
