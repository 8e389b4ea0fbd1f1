//! The `ordnet` crate: the node agent as a library (the binary's `ordnet agent`, and the agent
//! integration tests, run it in-process).

pub mod agent;
pub mod offline;
pub mod program;
pub mod render;
