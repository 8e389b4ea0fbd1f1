//! # ordnet policy resolution
//!
//! From Kubernetes objects (`NetworkPolicy`, `OrderedNetworkPolicy`,
//! `ClusterOrderedNetworkPolicy`, pods and namespaces) to one MapState per endpoint and
//! direction, and flow verdicts computed only through `MapState::lookup`.
//!
//! * [`model`]: the normalized rule model and the translation of every policy kind (all
//!   Kubernetes defaulting happens there).
//! * [`identity`]: identities per address signature, and the ipcache rules.
//! * [`Engine`]: identities, selector cache, per-endpoint MapStates (shared between endpoints with
//!   equal inputs), the query API (`docs/contracts/engine-api.md`).
//! * [`matrix()`]: the `ordnet matrix` computation.
//! * [`shadow`]: [`Engine::shadowed_rules`], ordered rules that stronger rules always pre-empt.
//!
//! `docs/engine.md` explains the design.

pub mod build;
pub mod identity;
pub mod incremental;
pub mod model;
mod objects;
pub mod query;
mod selector_cache;
pub mod services;
pub mod shadow;
mod shared;
pub mod snapshot;
mod store;
mod sync;
mod update;

pub use build::{BuildOptions, Endpoint, EndpointPolicy, Engine, IpFamily};
pub use identity::{IdentityInfo, IdentityKind, PodSig, Signature};
pub use incremental::{EndpointUpdate, EngineDelta, IpcacheChange};
pub use model::{
    EngineError, FailedRule, PeerSpec, Policy, PolicyKind, PolicyRef, PortSpec, Rule, Subject,
};
pub use objects::{Object, ObjectChange, ObjectKind};
pub use query::{
    BackendVerdict, FlowEnd, FlowTrace, Matrix, MatrixResult, MatrixVerdict, SideDecision,
    SideTrace, matrix,
};
pub use services::{Backend, ServiceDestination, ServicePort, ServiceRec, TargetPort};
pub use shadow::ShadowedRule;
pub use snapshot::{EndpointSnapshot, PolicySnapshot, SnapEntry, Snapshot};
