//! `ordnet-cni`, the chained CNI plugin: `ordnet_cni::plugin`.

fn main() -> std::process::ExitCode {
    ordnet_cni::plugin::main()
}
