//! strait's system helpers: the few system-call wrappers every layer needs, written
//! once: shared and anonymous mappings ([`mmap`]), sealed memfds ([`memfd`]),
//! descriptor passing ([`scm`]), random ids ([`random`]), the cached process id
//! ([`pid`]), small files of `/proc` read inside the preload ([`procfs`]), pinning a
//! thread to a CPU ([`cpu`]), the per-host cache of measured settings ([`calcache`]), network namespaces and veth pairs ([`netns`]) and test payloads
//! ([`pattern()`]). This crate sits below every other strait crate and depends on
//! none of them.
//!
//! Parts of it run inside `libstrait_preload.so`, which interposes libc's socket,
//! descriptor and exec functions; a plain libc call to one of those from inside the
//! preload would land in its own interposer. So [`memfd`], [`mmap`], [`random`],
//! [`pid`] and [`procfs`] call no function the preload exports (the seal `fcntl` and the error-path
//! `close` are raw system calls), and [`scm`] has `_with` forms that take the
//! `sendmsg`/`recvmsg` to use, so the preload passes its `real::` ones. [`netns`]
//! (which runs `ip`) is for benchmarks and tests only.

pub mod calcache;
pub mod cpu;
pub mod hash;
pub mod memfd;
pub mod mmap;
pub mod netns;
pub mod pattern;
pub mod pid;
pub mod procfs;
pub mod random;
pub mod scm;

pub use hash::{IntHasher, IntMap};
pub use memfd::{check_sealed, sealed_memfd, SealError};
pub use mmap::Mapping;
pub use pattern::{pattern, xorshift_bytes};
pub use pid::{current_pid, forget_pid};
pub use random::{random_u32, random_u64, unix_nanos};
pub use scm::{recv_fds, recv_fds_with, send_fds, send_fds_with, FdMessage};
