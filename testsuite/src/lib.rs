//! Shared helpers of the cross-crate tests (see tests/).

pub mod fakeapi;
pub mod reference;
pub mod scenario;
