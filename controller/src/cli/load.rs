//! Loading `-f` manifests into an engine, with the error reporting of CLI.md.

use std::process::ExitCode;

use ordnet_crds::Source as ObjectSource;
use ordnet_crds::{ClusterObjects, Loaded, ObjectRef};
use ordnet_engine::Engine;
use ordnet_mapstate::Protocol;

use super::{ProtocolArg, Source};

/// Loads `-f` manifests, validates them and builds the engine. Warnings go to stderr; on any
/// error every error is printed to stderr as `FILE: KIND NS/NAME: FIELD: message` and the exit
/// code is 1. (The subcommands answer `--agent ADDR` themselves, before calling this.)
pub fn load_engine(cmd: &str, source: &Source) -> Result<Engine, ExitCode> {
    let outcome = ordnet_crds::load_and_validate(&source.files);
    for p in &outcome.problems {
        eprintln!("{p}");
    }
    let errors = outcome.problems.iter().filter(|p| p.is_error()).count();
    if errors > 0 {
        eprintln!(
            "ordnet {cmd}: {errors} error{} in the manifests; nothing computed",
            if errors == 1 { "" } else { "s" }
        );
        return Err(ExitCode::from(1));
    }
    let engine = Engine::build(&outcome.objects);
    if !engine.errors().is_empty() {
        for e in engine.errors() {
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
    Ok(engine)
}

/// The file an object (`KIND NS/NAME` or `KIND NAME`) was read from.
fn source_file(objects: &ClusterObjects, object: &str) -> Option<String> {
    use ordnet_crds::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use ordnet_crds::manifest as m;
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
