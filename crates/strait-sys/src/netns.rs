//! Network namespaces and veth pairs, through iproute2's `ip` (needs root): the
//! steps every two-namespace fixture of strait (benchmarks, device tests) shares.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// An `ip` command that failed.
#[derive(Debug, thiserror::Error)]
#[error("`ip {args}` failed: {why}")]
pub struct IpError {
    /// Its arguments, joined by spaces.
    pub args: String,
    /// Its error output, or why it could not be started.
    pub why: String,
}

impl From<IpError> for io::Error {
    fn from(e: IpError) -> io::Error {
        io::Error::other(e)
    }
}

/// Runs `ip args` (no input) and fails with its error output unless it succeeds.
pub fn ip(args: &[&str]) -> Result<(), IpError> {
    let err = |why: String| IpError { args: args.join(" "), why };
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().map_err(|e| err(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(err(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

/// Adds namespaces `ns[0]` and `ns[1]` and a veth pair between them, `dev[0]` in
/// `ns[0]` and `dev[1]` in `ns[1]`, both still down. On an error, what was made so
/// far stays (the caller's drop removes the namespaces, and the pair with them).
pub fn add_veth_namespaces(ns: [&str; 2], dev: [&str; 2]) -> Result<(), IpError> {
    for n in ns {
        ip(&["netns", "add", n])?;
    }
    add_veth(ns, dev)
}

/// Adds a veth pair between existing namespaces: `dev[0]` in `ns[0]`, `dev[1]` in
/// `ns[1]`.
pub fn add_veth(ns: [&str; 2], dev: [&str; 2]) -> Result<(), IpError> {
    ip(&["link", "add", dev[0], "netns", ns[0], "type", "veth", "peer", "name", dev[1], "netns", ns[1]])
}

/// Deletes namespace `ns` (and the interfaces in it), ignoring errors: for drops
/// and for leftovers of a crashed run.
pub fn delete_namespace(ns: &str) {
    let _ = ip(&["netns", "del", ns]);
}

/// Moves the calling thread into namespace `ns` (sockets it creates from then on
/// live there; so do the processes it spawns).
pub fn enter(ns: &str) -> io::Result<()> {
    let f = File::open(format!("/run/netns/{ns}"))?;
    // SAFETY: setns on a namespace fd we hold open; affects this thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` on a new thread that entered namespace `ns` first (`None`: on this
/// thread, where it is), so that the sockets `f` makes live there; they stay there
/// when handed back to any thread.
pub fn within<T: Send>(ns: Option<&str>, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    let Some(ns) = ns else { return f() };
    std::thread::scope(|s| {
        s.spawn(move || {
            enter(ns)?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the thread in the namespace panicked")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root and iproute2 (as every namespace test of strait).
    #[test]
    fn veth_namespaces_made_entered_and_removed() {
        let id = std::process::id();
        let (na, nb) = (format!("sys-test-{id}-a"), format!("sys-test-{id}-b"));
        let (da, db) = (format!("st{id}a"), format!("st{id}b"));
        add_veth_namespaces([&na, &nb], [&da, &db]).unwrap();
        let has_dev = ip(&["-n", &na, "link", "show", &da]).is_ok();
        let entered = std::thread::spawn({
            let na = na.clone();
            move || {
                use std::os::unix::fs::MetadataExt;
                enter(&na).unwrap();
                let here = std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino();
                here == std::fs::metadata(format!("/run/netns/{na}")).unwrap().ino()
            }
        })
        .join()
        .unwrap();
        delete_namespace(&na);
        delete_namespace(&nb);
        assert!(has_dev, "{da} is not in {na}");
        assert!(entered, "the thread is not in {na}");
        assert!(ip(&["netns", "del", &na]).is_err(), "{na} was not removed");
    }
}
