//! strait's libfabric provider (`libstrait-fi.so`): `FI_EP_RDM` endpoints with
//! tagged and untagged messages over strait's devices, so that Open MPI (`mtl ofi`)
//! and any other libfabric program run over strait. See docs/LIBFABRIC.md.
//!
//! The libfabric side (structures, function tables, `fi_getinfo`) is C, in
//! `src/shim.c`, compiled against the installed headers; the state (addresses,
//! connections, matching, completion queues) is here.

pub mod ffi;
pub mod matching;
pub mod proto;
pub mod provider;
