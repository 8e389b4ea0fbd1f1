//! Shared helpers of the cross-crate tests (see tests/).
//!
//! | module | what |
//! |---|---|
//! | [`fakeapi`] | an in-process fake Kubernetes API server (real list/watch over HTTP) |
//! | [`reference`](mod@reference) | the reference evaluator of the whole spec on objects (test oracle) |
//! | [`scale`] | a generated cluster at scale (the scale benchmark, the 10k-pod test) |
//! | [`scenario`] | the one reader of the scenario files (objects, externals, expected matrices) |

pub mod fakeapi;
pub mod reference;
pub mod scale;
pub mod scenario;
