//! # ordnet policy resolution
//!
//! From Kubernetes objects (`NetworkPolicy`, `OrderedNetworkPolicy`,
//! `ClusterOrderedNetworkPolicy`, pods, namespaces and Services) to one MapState per endpoint
//! and direction, and flow verdicts computed only through `MapState::lookup`. `docs/engine.md`
//! explains the design; `docs/contracts/engine-api.md` the API.
//!
//! The stages, one module each (all private; the API is re-exported below):
//!
//! | module | what |
//! |---|---|
//! | `objects` | the objects consumed ([`Object`], [`ObjectKind`], [`ObjectChange`]) |
//! | `model` | the normalized rule model and the translation of every policy kind (all Kubernetes defaulting happens there) |
//! | `store` | what the engine keeps of each object, indexed for the later stages |
//! | `identity` | identities per address signature, and the ipcache rules |
//! | `selector_cache` | every peer selector, the identities it selects, notifications |
//! | `shared` | shared MapStates (one per set of equal inputs) and their compilation |
//! | `build` | the [`Engine`] and its from-scratch build |
//! | `incremental`, `sync`, `update` | [`Engine::apply`]: the object store step, then identities, selectors and MapStates in place ([`EngineDelta`]) |
//! | `parallel` | MapState work on several threads (a change's batches and new states, the build's states) |
//! | `services` | Services: frontends, NodePorts, backends |
//! | `query` | endpoints, identities, ipcache, [`Engine::flow`], [`matrix()`] |
//! | `shadow` | [`Engine::shadowed_rules`]: ordered rules that stronger rules always pre-empt |
//! | `snapshot` | [`Engine::snapshot`]: a comparable dump of everything computed (tests) |

mod build;
mod fast {
    //! The engine's hash maps use the workspace's hasher ([`ordnet_mapstate::FastHash`]).
    pub(crate) use ordnet_mapstate::{FastMap as HashMap, FastSet as HashSet};
}
mod identity;
mod incremental;
mod model;
mod objects;
mod parallel;
mod query;
mod selector_cache;
mod services;
mod shadow;
mod shared;
mod snapshot;
mod store;
mod sync;
mod update;

pub use build::{BuildOptions, Endpoint, EndpointPolicy, Engine, IpFamily};
pub use identity::{IdentityInfo, IdentityKind, PodSig, Signature};
pub use incremental::{EndpointUpdate, EngineDelta, IpcacheChange};
pub use model::{
    EngineError, FailedRule, Labels, PeerSpec, Policy, PolicyKind, PolicyRef, PortSpec, Rule,
    Subject,
};
pub use objects::{Object, ObjectChange, ObjectKind, ReadPod};
pub use query::{
    BackendVerdict, FlowEnd, FlowTrace, Matrix, MatrixEnd, MatrixResult, MatrixVerdict,
    ResolveError, SideDecision, SideTrace, matrix, matrix_by,
};
pub use services::{Backend, ServiceDestination, ServicePort, ServiceRec, TargetPort};
pub use shadow::{ShadowInputs, ShadowedRule};
pub use snapshot::{EndpointSnapshot, PolicySnapshot, SnapEntry, Snapshot};
