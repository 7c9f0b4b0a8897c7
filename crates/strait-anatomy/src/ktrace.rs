//! Kernel-side stage stamps from tracepoints, for the kernel paths of `strait
//! anatomy`.
//!
//! The kernel's own event tracer records the tracepoints (`syscalls`, `net`, `irq`,
//! `sock`, `skb`, `sched`) into a private tracefs *instance*
//! (`/sys/kernel/tracing/instances/strait-anatomy-<pid>`), restricted to the
//! measuring threads (`set_event_pid`), with the `x86-tsc` trace clock, so that
//! every event carries a raw time-stamp-counter reading on the same time line as
//! the user-space stamps. It needs root (or write access to tracefs) and
//! tracepoints; kprobes and the function tracer are not used. Why not a BPF
//! program: on these tracepoints it would only copy the same timestamp into a map,
//! and `bpf_ktime_get_ns` is not the TSC; the instance is removed when the
//! session ends.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a kernel trace session could not start.
#[derive(Debug, Error)]
pub enum TraceError {
    /// No tracefs mounted where it is looked for.
    #[error("tracefs is not mounted at /sys/kernel/tracing (mount -t tracefs nodev /sys/kernel/tracing)")]
    NoTracefs,
    /// Not allowed to use tracefs (needs root, or write access to tracefs).
    #[error("no permission to use tracefs ({0}): the kernel paths need root")]
    Permission(String),
    /// These tracepoints do not exist on this kernel.
    #[error("tracepoints missing on this kernel: {0}")]
    MissingEvents(String),
    /// This kernel has no `x86-tsc` trace clock (only x86 kernels do).
    #[error("the trace clock x86-tsc is not available (available: {0})")]
    NoTscClock(String),
    /// Any other tracefs failure.
    #[error("tracefs {path}: {source}")]
    Io {
        /// File being accessed.
        path: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
}

const ROOT: &str = "/sys/kernel/tracing";

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KEvent {
    /// TSC ticks.
    pub tsc: u64,
    /// Thread the event happened in (for `sched_switch`, the thread switched to).
    pub tid: i32,
    /// Event name (`sys_enter_sendto`, `net_dev_queue`, ...).
    pub name: String,
    /// Softirq vector for `softirq_entry`/`softirq_exit`.
    pub vec: Option<u32>,
}

/// A tracefs instance recording some tracepoints for some threads.
pub struct TraceSession {
    dir: PathBuf,
}

fn write(path: &Path, text: &str) -> Result<(), TraceError> {
    fs::write(path, text).map_err(|e| {
        if e.kind() == io::ErrorKind::PermissionDenied {
            TraceError::Permission(path.display().to_string())
        } else {
            TraceError::Io { path: path.display().to_string(), source: e }
        }
    })
}

/// Which of `events` (`group/name`) do not exist on this kernel.
pub fn missing_events(events: &[&str]) -> Vec<String> {
    events
        .iter()
        .filter(|e| !Path::new(ROOT).join("events").join(e).is_dir())
        .map(|e| e.to_string())
        .collect()
}

impl TraceSession {
    /// Creates the instance, checks and enables `events` (`group/name`), and sets
    /// the TSC clock; recording starts with [`TraceSession::start`].
    pub fn open(events: &[&str]) -> Result<TraceSession, TraceError> {
        match fs::read_dir(Path::new(ROOT).join("instances")) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(TraceError::Permission(format!("{ROOT}/instances")))
            }
            Err(_) => return Err(TraceError::NoTracefs),
        }
        let missing = missing_events(events);
        if !missing.is_empty() {
            return Err(TraceError::MissingEvents(missing.join(", ")));
        }
        let dir = Path::new(ROOT).join("instances").join(format!("strait-anatomy-{}", std::process::id()));
        if !dir.is_dir() {
            fs::create_dir(&dir).map_err(|e| match e.kind() {
                io::ErrorKind::PermissionDenied => TraceError::Permission(dir.display().to_string()),
                _ => TraceError::Io { path: dir.display().to_string(), source: e },
            })?;
        }
        let s = TraceSession { dir };
        write(&s.dir.join("tracing_on"), "0")?;
        let clocks = fs::read_to_string(s.dir.join("trace_clock")).unwrap_or_default();
        if !clocks.split_whitespace().any(|c| c.trim_matches(|c| c == '[' || c == ']') == "x86-tsc") {
            return Err(TraceError::NoTscClock(clocks.trim().to_owned()));
        }
        write(&s.dir.join("trace_clock"), "x86-tsc")?;
        write(&s.dir.join("buffer_size_kb"), "8192")?;
        for e in events {
            write(&s.dir.join("events").join(e).join("enable"), "1")?;
        }
        Ok(s)
    }

    /// Clears the buffer and records events of threads `tids` from now on.
    pub fn start(&self, tids: &[i32]) -> Result<(), TraceError> {
        write(&self.dir.join("tracing_on"), "0")?;
        write(&self.dir.join("trace"), "")?;
        let list = tids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ");
        write(&self.dir.join("set_event_pid"), &list)?;
        write(&self.dir.join("tracing_on"), "1")
    }

    /// Stops recording and returns the events, in time order.
    pub fn stop(&self) -> Result<Vec<KEvent>, TraceError> {
        write(&self.dir.join("tracing_on"), "0")?;
        let path = self.dir.join("trace");
        let text = fs::read_to_string(&path)
            .map_err(|e| TraceError::Io { path: path.display().to_string(), source: e })?;
        let mut v: Vec<KEvent> = text.lines().filter_map(parse_line).collect();
        v.sort_by_key(|e| e.tsc);
        Ok(v)
    }
}

impl Drop for TraceSession {
    fn drop(&mut self) {
        let _ = fs::write(self.dir.join("tracing_on"), "0");
        // Removing the instance disables its events and frees its buffers.
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Parses one line of the text trace:
/// `  comm-1234  [001] d.s2. 12659482965609: net_dev_queue: dev=lo ...`.
pub fn parse_line(line: &str) -> Option<KEvent> {
    if line.starts_with('#') {
        return None;
    }
    let open = line.find(" [")?;
    let head = &line[..open];
    let tid: i32 = head.trim().rsplit('-').next()?.parse().ok()?;
    let rest = &line[open..];
    // After "[cpu] flags " comes "<tsc>: <event>: <fields>".
    let close = rest.find(']')?;
    let mut it = rest[close + 1..].trim_start().splitn(2, ' ');
    let _flags = it.next()?;
    let rest = it.next()?.trim_start();
    let (ts, rest) = rest.split_once(": ")?;
    let tsc: u64 = ts.trim().parse().ok()?;
    let (name, fields) = rest.split_once(": ").unwrap_or((rest, ""));
    // System call events print as `sys_sendto(fd: 3, ...)` and `sys_recvfrom -> 0x8`.
    let name = if let Some((call, _)) = rest.split_once(" -> ").filter(|(c, _)| c.starts_with("sys_")) {
        format!("sys_exit_{}", &call[4..])
    } else if let Some((call, _)) =
        rest.split_once('(').filter(|(c, _)| c.starts_with("sys_") && !c.contains(' '))
    {
        format!("sys_enter_{}", &call[4..])
    } else {
        name.to_owned()
    };
    let field =
        |k: &str| fields.split_whitespace().find_map(|f| f.strip_prefix(k).and_then(|v| v.strip_prefix('=')));
    let (tid, vec) = match name.as_str() {
        "sched_switch" => (field("next_pid")?.parse().ok()?, None),
        "sched_wakeup" => (field("pid")?.parse().ok()?, None),
        "softirq_entry" | "softirq_exit" => (tid, field("vec").and_then(|v| v.parse().ok())),
        _ => (tid, None),
    };
    Some(KEvent { tsc, tid, name, vec })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_missing_tracepoints() {
        let missing = missing_events(&["no_such_group/no_such_event"]);
        assert_eq!(missing, vec!["no_such_group/no_such_event".to_string()]);
        let err = TraceError::MissingEvents(missing.join(", "));
        assert!(err.to_string().contains("no_such_group/no_such_event"));
    }

    #[test]
    fn parses_trace_lines() {
        let l = "         python3-12299   [001] ..s.. 12659484545761: softirq_entry: vec=3 [action=NET_RX]";
        assert_eq!(
            parse_line(l),
            Some(KEvent { tsc: 12659484545761, tid: 12299, name: "softirq_entry".into(), vec: Some(3) })
        );
        let l = "          <idle>-0       [000] d..2. 12659492405802: sched_switch: prev_comm=swapper/0 \
                 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=bash next_pid=12299 next_prio=120";
        assert_eq!(parse_line(l).map(|e| (e.tid, e.name)), Some((12299, "sched_switch".into())));
        let l = "          strait-14472   [001] ..... 13144488346658: sys_recvfrom -> 0x8";
        assert_eq!(parse_line(l).map(|e| (e.tid, e.name)), Some((14472, "sys_exit_recvfrom".into())));
        let l =
            "          strait-14472   [001] ..... 13144488348765: sys_sendto(fd: 4, buff: 0x7f831c000ea0, \
                 len: 8, flags: 0x4000, addr: 0, addr_len: 0)";
        assert_eq!(parse_line(l).map(|e| e.name), Some("sys_enter_sendto".into()));
        let l = "          <idle>-0       [001] dNh2. 13144488485598: sched_wakeup: comm=strait pid=14472 \
                 prio=120 target_cpu=001";
        assert_eq!(parse_line(l).map(|e| (e.tid, e.name)), Some((14472, "sched_wakeup".into())));
        assert_eq!(parse_line("# tracer: nop"), None);
        assert_eq!(parse_line("garbage"), None);
    }
}
