//! Types that cross the API boundary: endpoint ids, completions, errors.

use std::io;

use thiserror::Error;

/// Identifies an endpoint (one connection to one peer) within a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EpId(pub u32);

/// Which kind of descriptor completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A `post_send`.
    Send,
    /// A `post_recv`.
    Recv,
}

/// Outcome of an operation, delivered in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done; for a receive, `len` bytes were written.
    Ok,
    /// The message was longer than the receive buffer: only the buffer's length was
    /// written (for a receive), or the receiver reported truncation (for a send).
    /// `Completion::len` is the full message length.
    Truncated,
    /// The peer closed the connection or died before the operation finished.
    PeerGone,
    /// The peer sent something malformed; the connection was torn down.
    Corrupt,
    /// The single-copy read of the sender's buffer failed (on either side).
    RemoteReadFailed,
    /// The endpoint was closed locally before the operation finished.
    Canceled,
}

impl Status {
    /// The closest POSIX errno, for callers that speak errno.
    pub fn errno(self) -> i32 {
        match self {
            Status::Ok => 0,
            Status::Truncated => libc::EMSGSIZE,
            Status::PeerGone => libc::ECONNRESET,
            Status::Corrupt => libc::EPROTO,
            Status::RemoteReadFailed => libc::EFAULT,
            Status::Canceled => libc::ECANCELED,
        }
    }
}

/// A finished operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Endpoint the operation was posted on.
    pub ep: EpId,
    /// Send or receive.
    pub op: OpKind,
    /// The caller's context value from the post.
    pub ctx: u64,
    /// For a receive: the tag of the message matched. For a send: the posted tag.
    pub tag: u64,
    /// Message length in bytes (for a truncated receive, the full length sent).
    pub len: usize,
    /// How it ended.
    pub status: Status,
}

/// Why a descriptor could not be posted (nothing was queued).
#[derive(Debug, Error)]
pub enum PostError {
    /// No endpoint with this id exists in the worker.
    #[error("unknown endpoint {0:?}")]
    UnknownEndpoint(EpId),
    /// The endpoint failed or was closed; its status says why.
    #[error("endpoint {ep:?} is closed ({status:?})")]
    Closed {
        /// The endpoint.
        ep: EpId,
        /// Why it closed.
        status: Status,
    },
    /// The range does not lie inside the memory region.
    #[error("range {start}..{end} is outside the {region_len}-byte memory region")]
    OutOfBounds {
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// Region length.
        region_len: usize,
    },
    /// The message is longer than the protocol can describe.
    #[error("message of {0} bytes is too long")]
    TooLong(usize),
}

/// Why a blocking wait returned without a completion.
#[derive(Debug, Error)]
pub enum WaitError {
    /// The timeout expired.
    #[error("timed out")]
    Timeout,
    /// Nothing is outstanding, so no completion can ever arrive.
    #[error("no operation is outstanding")]
    Idle,
    /// Sleeping failed.
    #[error("wait failed: {0}")]
    Io(#[from] io::Error),
}
