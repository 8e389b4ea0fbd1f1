//! Shared helpers of the cross-crate tests (see tests/).
//!
//! | module | what |
//! |---|---|
//! | [`fakeapi`] | an in-process fake Kubernetes API server (real list/watch over HTTP) |
//! | [`reference`](mod@reference) | the reference evaluator of the whole spec on objects (test oracle) |
//! | [`scenario`] | the one reader of the scenario files (objects, externals, expected matrices) |

pub mod fakeapi;
pub mod reference;
pub mod scenario;
