//! Putting the plugin on a node and taking it off again: the binary into the CNI bin directory,
//! and an `ordnet-cni` entry at the end of the plugins of the conflist the runtime uses (the
//! first `*.conflist` of the CNI configuration directory, by name, as the runtimes pick it).
//! Every write is a new file renamed over the old one, so a runtime running the chain at that
//! moment reads either the old or the new file, never half of one.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The plugin's name in a conflist (`type`) and in the bin directory.
pub const PLUGIN: &str = "ordnet-cni";

fn io(path: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", path.display())
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
fn replace(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = path.with_extension(format!("ordnet-tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(path, e)
    })
}

/// Copies the plugin binary `from` into `bin_dir` (as [`PLUGIN`]) unless an identical one is
/// there. Whether it wrote.
pub fn install_binary(from: &Path, bin_dir: &Path) -> Result<bool, String> {
    let bytes = std::fs::read(from).map_err(|e| io(from, e))?;
    let to = bin_dir.join(PLUGIN);
    if std::fs::read(&to).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    std::fs::create_dir_all(bin_dir).map_err(|e| io(bin_dir, e))?;
    replace(&to, &bytes, 0o755)?;
    Ok(true)
}

/// Removes the plugin binary from `bin_dir`. Whether there was one.
pub fn remove_binary(bin_dir: &Path) -> Result<bool, String> {
    let path = bin_dir.join(PLUGIN);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(&path, e)),
    }
}

/// The conflist the runtime uses: the first `*.conflist` of `conf_dir` by name.
pub fn active_conflist(conf_dir: &Path) -> Result<Option<PathBuf>, String> {
    let mut lists: Vec<PathBuf> = std::fs::read_dir(conf_dir)
        .map_err(|e| io(conf_dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "conflist"))
        .collect();
    lists.sort();
    Ok(lists.into_iter().next())
}

fn read_conflist(path: &Path) -> Result<Value, String> {
    let text = std::fs::read(path).map_err(|e| io(path, e))?;
    let v: Value = serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if !v["plugins"].is_array() {
        return Err(format!("{}: no `plugins` list", path.display()));
    }
    Ok(v)
}

/// Adds `{"type": "ordnet-cni", "socket": SOCKET}` at the end of the active conflist's plugins
/// (or updates its socket). The conflist changed, if it did.
pub fn chain(conf_dir: &Path, socket: &Path) -> Result<Option<PathBuf>, String> {
    let Some(path) = active_conflist(conf_dir)? else {
        return Err(format!(
            "{}: no .conflist (is the main CNI plugin installed yet?)",
            conf_dir.display()
        ));
    };
    let mut list = read_conflist(&path)?;
    let entry = json!({"type": PLUGIN, "socket": socket.to_string_lossy()});
    let plugins = list["plugins"].as_array_mut().expect("checked");
    match plugins.iter_mut().find(|p| p["type"] == PLUGIN) {
        Some(p) if *p == entry => return Ok(None),
        Some(p) => *p = entry,
        None => plugins.push(entry),
    }
    let text = serde_json::to_vec_pretty(&list).expect("json");
    replace(&path, &text, 0o644)?;
    Ok(Some(path))
}

/// Takes the `ordnet-cni` entry out of every conflist of `conf_dir`. The conflists changed.
pub fn unchain(conf_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut changed = Vec::new();
    let entries = match std::fs::read_dir(conf_dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(changed),
        Err(e) => return Err(io(conf_dir, e)),
    };
    for e in entries.filter_map(|e| e.ok()) {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "conflist") {
            continue;
        }
        let Ok(mut list) = read_conflist(&path) else {
            continue;
        };
        let plugins = list["plugins"].as_array_mut().expect("checked");
        let before = plugins.len();
        plugins.retain(|p| p["type"] != PLUGIN);
        if plugins.len() != before {
            replace(
                &path,
                &serde_json::to_vec_pretty(&list).expect("json"),
                0o644,
            )?;
            changed.push(path);
        }
    }
    changed.sort();
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory, removed when the test ends (passed or failed).
    struct TempDir(PathBuf);

    impl std::ops::Deref for TempDir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(tag: &str) -> TempDir {
        let d =
            std::env::temp_dir().join(format!("ordnet-cni-install-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    #[test]
    fn chaining_edits_the_first_conflist_once_and_unchaining_restores_it() {
        let d = dir("chain");
        let calico = json!({"cniVersion": "1.0.0", "name": "k8s-pod-network",
            "plugins": [{"type": "calico"}, {"type": "portmap", "capabilities": {"portMappings": true}}]});
        std::fs::write(d.join("10-calico.conflist"), calico.to_string()).unwrap();
        std::fs::write(d.join("99-loopback.conf"), "{}").unwrap();
        std::fs::write(d.join("20-other.conflist"), calico.to_string()).unwrap();
        let socket = Path::new("/run/ordnet/cni.sock");
        assert_eq!(
            chain(&d, socket).unwrap(),
            Some(d.join("10-calico.conflist"))
        );
        assert_eq!(
            chain(&d, socket).unwrap(),
            None,
            "a second run changes nothing"
        );
        let list = read_conflist(&d.join("10-calico.conflist")).unwrap();
        let types: Vec<&str> = list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["calico", "portmap", PLUGIN]);
        assert_eq!(list["plugins"][2]["socket"], "/run/ordnet/cni.sock");
        assert_eq!(read_conflist(&d.join("20-other.conflist")).unwrap(), calico);
        assert_eq!(unchain(&d).unwrap(), vec![d.join("10-calico.conflist")]);
        assert_eq!(
            read_conflist(&d.join("10-calico.conflist")).unwrap(),
            calico
        );
        assert!(chain(&dir("empty"), socket).is_err());
    }

    #[test]
    fn the_binary_is_replaced_only_when_it_differs() {
        let d = dir("bin");
        let src = d.join("src");
        std::fs::write(&src, b"v1").unwrap();
        let bin = d.join("bin");
        assert!(install_binary(&src, &bin).unwrap());
        assert!(!install_binary(&src, &bin).unwrap());
        std::fs::write(&src, b"v2").unwrap();
        assert!(install_binary(&src, &bin).unwrap());
        assert_eq!(std::fs::read(bin.join(PLUGIN)).unwrap(), b"v2");
        assert!(remove_binary(&bin).unwrap());
        assert!(!remove_binary(&bin).unwrap());
    }
}
