//! The watchers: one `kube::runtime::watcher` (default backoff) per kind the engine consumes,
//! each turning its events into [`WatchMsg`]s on one channel.

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use ordnet_crds::{ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};
use ordnet_engine::{Object, ObjectKind};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One watch event, typed.
#[derive(Debug)]
pub(crate) enum WatchMsg {
    Init(ObjectKind),
    InitApply(Object),
    InitDone(ObjectKind),
    Apply(Object),
    Delete(Object),
    Error(ObjectKind, String),
}

/// One watcher per kind of [`ObjectKind::ALL`].
pub(crate) fn spawn_all(
    client: &Client,
    tx: &mpsc::UnboundedSender<WatchMsg>,
) -> Vec<JoinHandle<()>> {
    ObjectKind::ALL
        .into_iter()
        .map(|kind| {
            let (c, t) = (client.clone(), tx.clone());
            match kind {
                ObjectKind::Namespace => spawn_watch::<Namespace>(c, kind, Object::Namespace, t),
                ObjectKind::Pod => spawn_watch::<Pod>(c, kind, |p| Object::Pod(Box::new(p)), t),
                ObjectKind::Service => {
                    spawn_watch::<Service>(c, kind, |s| Object::Service(Box::new(s)), t)
                }
                ObjectKind::NetworkPolicy => {
                    spawn_watch::<NetworkPolicy>(c, kind, Object::NetworkPolicy, t)
                }
                ObjectKind::OrderedNetworkPolicy => {
                    spawn_watch::<OrderedNetworkPolicy>(c, kind, Object::OrderedNetworkPolicy, t)
                }
                ObjectKind::ClusterOrderedNetworkPolicy => {
                    spawn_watch::<ClusterOrderedNetworkPolicy>(
                        c,
                        kind,
                        Object::ClusterOrderedNetworkPolicy,
                        t,
                    )
                }
            }
        })
        .collect()
}

fn spawn_watch<K>(
    client: Client,
    kind: ObjectKind,
    wrap: fn(K) -> Object,
    tx: mpsc::UnboundedSender<WatchMsg>,
) -> JoinHandle<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let api: Api<K> = Api::all(client);
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = stream.next().await {
            let msg = match ev {
                Ok(Event::Init) => WatchMsg::Init(kind),
                // Slimmed at once: what waits in the channel and in the applier until the
                // engine has it is only what the engine reads.
                Ok(Event::InitApply(o)) => WatchMsg::InitApply(wrap(o).slimmed()),
                Ok(Event::InitDone) => WatchMsg::InitDone(kind),
                Ok(Event::Apply(o)) => WatchMsg::Apply(wrap(o).slimmed()),
                Ok(Event::Delete(o)) => WatchMsg::Delete(wrap(o).slimmed()),
                Err(e) => WatchMsg::Error(kind, e.to_string()),
            };
            if tx.send(msg).is_err() {
                return;
            }
        }
    })
}
