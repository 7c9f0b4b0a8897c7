//! Compiles the C half of the provider (src/shim.c: every libfabric structure and
//! function table, written against Debian's libfabric-dev headers).

fn main() {
    println!("cargo:rerun-if-changed=src/shim.c");
    if !std::path::Path::new("/usr/include/rdma/providers/fi_prov.h").exists() {
        panic!("libfabric's headers are missing: run scripts/install-deps (it installs libfabric-dev)");
    }
    cc::Build::new()
        .file("src/shim.c")
        .flag("-fvisibility=hidden")
        .flag("-Wall")
        .flag("-Wextra")
        .flag("-Wno-unused-parameter")
        .warnings_into_errors(true)
        .compile("strait_fi_shim");
}
