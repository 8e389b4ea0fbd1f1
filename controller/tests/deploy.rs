//! `deploy/`: what the manifests ask of the binary is what the binary accepts, and the image
//! they name is the one `scripts/image` builds (same name, the crate's version).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    yaml_serde::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every container (init containers too) of a DaemonSet manifest.
fn containers(ds: &Value) -> Vec<Value> {
    let spec = &ds["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().cloned().unwrap_or_default())
        .collect()
}

#[test]
fn kustomizations_name_the_image_scripts_image_builds() {
    for dir in [deploy(), deploy().join("uninstall")] {
        let k = yaml(&dir.join("kustomization.yaml"));
        let images = k["images"].as_array().expect("images:");
        let ordnet = images
            .iter()
            .find(|i| i["name"] == "ordnet")
            .unwrap_or_else(|| panic!("{}: no image `ordnet`", dir.display()));
        assert_eq!(ordnet["newName"], "localhost/ordnet", "{}", dir.display());
        assert_eq!(
            ordnet["newTag"],
            env!("CARGO_PKG_VERSION"),
            "{}: the image tag is not this version",
            dir.display()
        );
        for r in k["resources"].as_array().unwrap() {
            let r = dir.join(r.as_str().unwrap());
            assert!(r.exists(), "{} is missing", r.display());
            if !r.to_string_lossy().ends_with("daemonset.yaml") {
                continue;
            }
            let doc = yaml(&r);
            assert_eq!(doc["kind"], "DaemonSet");
            for c in containers(&doc) {
                let image = c["image"].as_str().unwrap();
                assert!(
                    image == "ordnet" || image.starts_with("registry.k8s.io/pause:"),
                    "{}: container {} runs {image}, which kustomize does not set",
                    r.display(),
                    c["name"]
                );
            }
        }
    }
}

/// The host paths the manifests mount under `/host/`, moved into a scratch directory.
fn hosted(arg: &str, root: &Path) -> String {
    arg.replace("=/host/", &format!("={}/", root.display()))
}

/// The command lines of the DaemonSets run with the binary: the agent's arguments parse (it
/// gets as far as looking for a cluster, exit 1, not a usage error, exit 2), and the uninstall
/// container's command succeeds on a node with nothing to remove.
#[test]
fn the_daemonsets_command_lines_are_what_the_binary_accepts() {
    let root = std::env::temp_dir().join(format!("ordnet-deploy-{}", std::process::id()));
    let agent = yaml(&deploy().join("daemonset.yaml"));
    let c = &containers(&agent)[0];
    assert_eq!(c["command"][0], "/usr/local/bin/ordnet");
    let args: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| hosted(a.as_str().unwrap(), &root))
        .collect();
    let out = Command::new(env!("CARGO_BIN_EXE_ordnet"))
        .args(&args)
        .args(["--node", "n1", "--kubeconfig", "/nonexistent/kubeconfig"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
    assert!(said.contains("kubeconfig"), "{said}");

    let uninstall = yaml(&deploy().join("uninstall/daemonset.yaml"));
    let c = &containers(&uninstall)[0];
    let cmd: Vec<String> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| hosted(a.as_str().unwrap(), &root))
        .collect();
    assert_eq!(cmd[0], "/usr/local/bin/ordnet");
    let empty = std::env::temp_dir().join(format!("ordnet-no-pins-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_ordnet"))
        .args(&cmd[1..])
        .env("ORDNET_PIN_DIR", &empty)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {said}");
    assert!(said.contains("nothing to uninstall"), "{said}");
    let _ = std::fs::remove_dir_all(&root);
}
