//! Loading `-f` manifests into an engine, with the error reporting of CLI.md.

use std::process::ExitCode;

use ordnet_crds::Source as ObjectSource;
use ordnet_crds::{ClusterObjects, Loaded, ObjectRef};
use ordnet_engine::Engine;
use ordnet_mapstate::Protocol;

use super::{ProtocolArg, Source};

/// An engine built from `-f` manifests, and the exit code the command ends with once it has
/// printed its answer: 0, or 1 when the manifests have errors that still leave every object
/// usable (rules that the engine enforces fail-closed, or that the API server would refuse
/// but that mean something, e.g. a list over its `maxItems`).
pub struct LoadedEngine {
    pub engine: Engine,
    pub exit: ExitCode,
    /// The staged policies `engine` leaves out (none with `--staged`: it enforces them).
    pub staged: Vec<ordnet_engine::Object>,
}

impl LoadedEngine {
    /// When `engine` left staged policies out: a copy of it that enforces them too (what
    /// `--staged` would build; the agent's staged view is made the same way).
    pub fn staged_view(&self) -> Option<Engine> {
        if self.staged.is_empty() {
            return None;
        }
        let mut view = self.engine.staged_view();
        for o in &self.staged {
            view.apply(ordnet_engine::ObjectChange::Upsert(o.clone()));
        }
        Some(view)
    }
}

/// Loads `-f` manifests, validates them and builds the engine. Every problem is printed to
/// stderr as `FILE: KIND NS/NAME: FIELD: message`. Nothing is computed (exit code 1) when an
/// object cannot be used at all: a load error, an invalid Pod or Namespace, or a policy the
/// engine cannot use (e.g. an invalid subject selector). A policy whose only errors are in
/// rules is used: the rules the engine cannot enforce are enforced fail-closed (an `Allow`
/// matches nothing, a `Deny` denies everything in its direction), exactly as the agent does,
/// and the command exits 1 after its answer (CLI.md: invalid input is exit 1, so CI catches
/// it). (The subcommands answer `--agent ADDR` themselves, before calling this.)
pub fn load_engine(cmd: &str, source: &Source) -> Result<LoadedEngine, ExitCode> {
    load_engine_and_objects(cmd, source).map(|(loaded, _)| loaded)
}

/// [`load_engine`], and the objects the engine was built from (`ordnet lab --cni flannel`
/// builds each node's engine from them; the other commands let them go at once).
pub fn load_engine_and_objects(
    cmd: &str,
    source: &Source,
) -> Result<(LoadedEngine, ClusterObjects), ExitCode> {
    let outcome = ordnet_crds::load_and_validate(&source.files);
    for p in &outcome.problems {
        eprintln!("{p}");
    }
    let errors = outcome.problems.iter().filter(|p| p.is_error()).count();
    let unusable = outcome
        .problems
        .iter()
        .filter(|p| p.is_error() && !outcome.kept(p))
        .count();
    if unusable > 0 {
        eprintln!(
            "ordnet {cmd}: {errors} error{} in the manifests; nothing computed",
            if errors == 1 { "" } else { "s" }
        );
        return Err(ExitCode::from(1));
    }
    let engine = Engine::build_with(
        &outcome.objects,
        &ordnet_engine::BuildOptions {
            staged: source.staged,
            ..Default::default()
        },
    );
    if !engine.errors().is_empty() {
        // What validation reported already (same object and field) is not repeated.
        let printed = |e: &ordnet_engine::EngineError| {
            outcome.problems.iter().any(|p| {
                p.is_error()
                    && p.object.as_ref().is_some_and(|o| o.to_string() == e.object)
                    && p.field.as_deref() == Some(e.field.as_str())
            })
        };
        for e in engine.errors().iter().filter(|e| !printed(e)) {
            match source_file(&outcome.objects, &e.object) {
                Some(file) => eprintln!("{file}: {e}"),
                None => eprintln!("{e}"),
            }
        }
        let n = engine.errors().len();
        eprintln!(
            "ordnet {cmd}: {n} object{} cannot be used; nothing computed",
            if n == 1 { "" } else { "s" }
        );
        return Err(ExitCode::from(1));
    }
    let failed = engine.failed_rules().count();
    if failed > 0 {
        for (policy, rule) in engine.failed_rules() {
            eprintln!("{policy}: {rule}");
        }
        eprintln!(
            "ordnet {cmd}: {failed} rule{} cannot be enforced as written and {} enforced fail-closed (an Allow rule matches nothing, a Deny rule denies everything in its direction)",
            if failed == 1 { "" } else { "s" },
            if failed == 1 { "is" } else { "are" },
        );
    }
    if errors > 0 {
        eprintln!(
            "ordnet {cmd}: {errors} error{} in the manifests; computed with every rule that cannot be enforced failing closed, exit code 1",
            if errors == 1 { "" } else { "s" }
        );
    }
    let o = &outcome.objects;
    let staged: Vec<ordnet_engine::Object> = if source.staged {
        Vec::new()
    } else {
        let ordered = o
            .ordered_policies
            .iter()
            .filter(|p| !p.object.spec.mode.is_enforce());
        let cluster = o
            .cluster_ordered_policies
            .iter()
            .filter(|p| !p.object.spec.mode.is_enforce());
        ordered
            .map(|p| ordnet_engine::Object::OrderedNetworkPolicy(p.object.clone()))
            .chain(
                cluster
                    .map(|p| ordnet_engine::Object::ClusterOrderedNetworkPolicy(p.object.clone())),
            )
            .collect()
    };
    let loaded = LoadedEngine {
        engine,
        staged,
        exit: if errors > 0 {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        },
    };
    Ok((loaded, outcome.objects))
}

/// The file an object (`KIND NS/NAME` or `KIND NAME`) was read from.
fn source_file(objects: &ClusterObjects, object: &str) -> Option<String> {
    use ordnet_crds as m;
    use ordnet_crds::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    fn refs<'a, T>(
        list: &'a [Loaded<T>],
        kind: &'static str,
        meta: impl Fn(&T) -> &ObjectMeta + 'a,
    ) -> impl Iterator<Item = (ObjectRef, Option<&'a ObjectSource>)> + 'a {
        list.iter().map(move |o| {
            let md = meta(&o.object);
            let name = md.name.clone().unwrap_or_default();
            let r = match &md.namespace {
                Some(ns) => ObjectRef::namespaced(kind, ns, &name),
                None => ObjectRef::cluster(kind, &name),
            };
            (r, o.source.as_ref())
        })
    }
    let o = objects;
    refs(&o.namespaces, m::KIND_NAMESPACE, |x| &x.metadata)
        .chain(refs(&o.pods, m::KIND_POD, |x| &x.metadata))
        .chain(refs(&o.network_policies, m::KIND_NETWORK_POLICY, |x| {
            &x.metadata
        }))
        .chain(refs(&o.ordered_policies, m::KIND_ORDERED, |x| &x.metadata))
        .chain(refs(
            &o.cluster_ordered_policies,
            m::KIND_CLUSTER_ORDERED,
            |x| &x.metadata,
        ))
        .find(|(r, _)| r.to_string() == object)
        .and_then(|(_, src)| src.map(|s| s.file.display().to_string()))
}

/// The protocol of a `--protocol` value.
pub fn protocol(p: ProtocolArg) -> Protocol {
    match p {
        ProtocolArg::Tcp => Protocol::Tcp,
        ProtocolArg::Udp => Protocol::Udp,
        ProtocolArg::Sctp => Protocol::Sctp,
    }
}
