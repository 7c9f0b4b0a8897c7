//! strait's system helpers: the few system-call wrappers every layer needs, written
//! once. This crate sits below every other strait crate and depends on none of them.
//!
//! It must stay safe to call from inside `libstrait_preload.so`, which interposes
//! libc's socket and descriptor functions: nothing here calls a libc function the
//! preload exports (`fcntl`, `read`, `sendmsg`, ...). Where such a call is needed it
//! is either made as a raw system call, which no interposer can catch, or taken as a
//! parameter (the `_with` forms of [`scm`]) so the preload can pass its `real::` one.

pub mod memfd;
pub mod mmap;
pub mod netns;
pub mod pattern;
pub mod random;
pub mod scm;

pub use memfd::{check_sealed, sealed_memfd, SealError};
pub use mmap::Mapping;
pub use pattern::{pattern, xorshift_bytes};
pub use random::{random_u32, random_u64, unix_nanos};
pub use scm::{recv_fds, recv_fds_with, send_fds, send_fds_with, FdMessage};
