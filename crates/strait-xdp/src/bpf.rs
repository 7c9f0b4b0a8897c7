//! The XDP program that steers strait's frames to the AF_XDP socket, assembled here
//! by hand (no compiler or loader library needed), and its maps.
//!
//! The program passes every frame whose EtherType is not strait's to the kernel
//! untouched. Strait frames go to the socket bound to the receive queue (through an
//! XSKMAP); when no socket is bound there, they go to the kernel too (the redirect's
//! fallback action). A one-entry array map holds a drop rate in parts per million,
//! zero unless a test injects loss.
//!
//! The program is attached with a BPF link: the kernel detaches it when the last
//! descriptor of the link closes, including when the process that attached it
//! crashes, so no stale program is ever left on the interface.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::XdpError;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
/// XDP attach flag: the generic (skb) hook, for drivers without native XDP.
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;

const XDP_DROP: i32 = 1;
const XDP_PASS: i32 = 2;

const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
const HELPER_GET_PRANDOM_U32: i32 = 7;
const HELPER_REDIRECT_MAP: i32 = 51;

/// One eBPF instruction.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: (src << 4) | (dst & 0xf), off, imm }
}

// Opcodes (class | size/op | source).
const LDX_W: u8 = 0x61;
const LDX_H: u8 = 0x69;
const ST_W: u8 = 0x62;
const MOV64_X: u8 = 0xbf;
const MOV64_K: u8 = 0xb7;
const ADD64_K: u8 = 0x07;
const MOD64_K: u8 = 0x97;
const JGT_X: u8 = 0x2d;
const JNE_K: u8 = 0x55;
const JEQ_K: u8 = 0x15;
const JLT_X: u8 = 0xad;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const LD_DW_IMM: u8 = 0x18;
const PSEUDO_MAP_FD: u8 = 1;

/// Builds the steering program for `ethertype`.
fn program(ethertype: u16, xsk_map: i32, cfg_map: i32) -> Vec<Insn> {
    // A 16-bit load reads the two wire bytes little-endian.
    let want = i32::from(u16::from_le_bytes(ethertype.to_be_bytes()));
    let ld_map = |fd: i32| [insn(LD_DW_IMM, 1, PSEUDO_MAP_FD, 0, fd), insn(0, 0, 0, 0, 0)];
    let mut p = vec![
        insn(MOV64_X, 6, 1, 0, 0),  // 0: r6 = ctx
        insn(LDX_W, 2, 6, 4, 0),    // 1: r2 = data_end
        insn(LDX_W, 3, 6, 0, 0),    // 2: r3 = data
        insn(MOV64_X, 4, 3, 0, 0),  // 3: r4 = data
        insn(ADD64_K, 4, 0, 0, 14), // 4: r4 += 14 (Ethernet header)
        insn(JGT_X, 4, 2, 0, 0),    // 5: if r4 > data_end goto pass (patched)
        insn(LDX_H, 5, 3, 12, 0),   // 6: r5 = EtherType
        insn(JNE_K, 5, 0, 0, want), // 7: if not strait's goto pass (patched)
        insn(ST_W, 10, 0, -4, 0),   // 8: key = 0 on the stack
        insn(MOV64_X, 2, 10, 0, 0), // 9
        insn(ADD64_K, 2, 0, 0, -4), // 10: r2 = &key
    ];
    p.extend(ld_map(cfg_map)); // 11-12: r1 = cfg map
    p.extend([
        insn(CALL, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM), // 13: r0 = &drop_ppm or null
        insn(JEQ_K, 0, 0, 0, 0),                     // 14: if null goto redirect (patched)
        insn(LDX_W, 7, 0, 0, 0),                     // 15: r7 = drop_ppm
        insn(JEQ_K, 7, 0, 0, 0),                     // 16: if 0 goto redirect (patched)
        insn(CALL, 0, 0, 0, HELPER_GET_PRANDOM_U32), // 17
        insn(MOD64_K, 0, 0, 0, 1_000_000),           // 18
        insn(JLT_X, 0, 7, 0, 0),                     // 19: if r0 < r7 goto drop (patched)
        insn(LDX_W, 2, 6, 16, 0),                    // 20 redirect: r2 = rx_queue_index
    ]);
    p.extend(ld_map(xsk_map)); // 21-22: r1 = xsk map
    p.extend([
        insn(MOV64_K, 3, 0, 0, XDP_PASS),         // 23: fallback when no socket
        insn(CALL, 0, 0, 0, HELPER_REDIRECT_MAP), // 24
        insn(EXIT, 0, 0, 0, 0),                   // 25
        insn(MOV64_K, 0, 0, 0, XDP_PASS),         // 26 pass:
        insn(EXIT, 0, 0, 0, 0),                   // 27
        insn(MOV64_K, 0, 0, 0, XDP_DROP),         // 28 drop:
        insn(EXIT, 0, 0, 0, 0),                   // 29
    ]);
    let jump = |p: &mut Vec<Insn>, at: usize, to: usize| p[at].off = (to as i64 - at as i64 - 1) as i16;
    jump(&mut p, 5, 26);
    jump(&mut p, 7, 26);
    jump(&mut p, 14, 20);
    jump(&mut p, 16, 20);
    jump(&mut p, 19, 28);
    p
}

/// `bpf(2)` with an attribute block of 128 bytes (zero beyond what is set).
fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> io::Result<i64> {
    // SAFETY: `attr` is a live, writable 128-byte block; the kernel reads (and for
    // some commands writes) at most `size` bytes of it.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd_from(r: i64) -> OwnedFd {
    // SAFETY: the kernel just returned this new descriptor; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(r as i32) }
}

fn lo_hi(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
}

fn map_create(kind: u32, key: u32, value: u32, entries: u32) -> io::Result<OwnedFd> {
    let mut attr = [0u64; 16];
    attr[0] = lo_hi(kind, key);
    attr[1] = lo_hi(value, entries);
    bpf(BPF_MAP_CREATE, &mut attr).map(fd_from)
}

fn map_update(map: &OwnedFd, key: u32, value: u32) -> io::Result<()> {
    let mut attr = [0u64; 16];
    attr[0] = map.as_raw_fd() as u64;
    attr[1] = &key as *const u32 as u64;
    attr[2] = &value as *const u32 as u64;
    attr[3] = 0; // BPF_ANY
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

/// The steering program attached to one interface, with its maps. Dropping it
/// detaches the program.
pub struct XdpProgram {
    xsk_map: OwnedFd,
    cfg_map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    /// Attached in generic (skb) mode because the driver refused native mode.
    pub generic: bool,
}

/// Receive queues the XSKMAP can address.
const MAX_QUEUES: u32 = 64;

impl XdpProgram {
    /// Loads the program for `ethertype` and attaches it to interface `ifindex`
    /// (native mode, else generic mode).
    pub fn attach(ifindex: u32, ethertype: u16) -> Result<Self, XdpError> {
        let xsk_map = map_create(BPF_MAP_TYPE_XSKMAP, 4, 4, MAX_QUEUES)
            .map_err(|e| XdpError::privilege("create the XSKMAP (bpf BPF_MAP_CREATE)", e))?;
        let cfg_map = map_create(BPF_MAP_TYPE_ARRAY, 4, 4, 1)
            .map_err(|e| XdpError::privilege("create the config map (bpf BPF_MAP_CREATE)", e))?;
        let insns = program(ethertype, xsk_map.as_raw_fd(), cfg_map.as_raw_fd());
        let license = c"GPL";
        let mut log = vec![0u8; 64 * 1024];
        let mut attr = [0u64; 16];
        attr[0] = lo_hi(BPF_PROG_TYPE_XDP, insns.len() as u32);
        attr[1] = insns.as_ptr() as u64;
        attr[2] = license.as_ptr() as u64;
        attr[3] = lo_hi(1, log.len() as u32); // log_level, log_size
        attr[4] = log.as_mut_ptr() as u64;
        // kern_version (0), prog_flags (0), prog_name[16] at bytes 48..64.
        let name = *b"strait_steer\0\0\0\0";
        attr[6] = u64::from_le_bytes(name[..8].try_into().unwrap_or([0; 8]));
        attr[7] = u64::from_le_bytes(name[8..].try_into().unwrap_or([0; 8]));
        // prog_ifindex (0) at 64, expected_attach_type at 68.
        attr[8] = lo_hi(0, BPF_XDP);
        let prog = bpf(BPF_PROG_LOAD, &mut attr).map(fd_from).map_err(|e| {
            let text = CStr::from_bytes_until_nul(&log)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            if e.raw_os_error() == Some(libc::EPERM) {
                XdpError::privilege("load the XDP program (bpf BPF_PROG_LOAD)", e)
            } else {
                XdpError::Verifier { source: e, log: text }
            }
        })?;
        let link = |flags: u32| {
            let mut attr = [0u64; 16];
            attr[0] = lo_hi(prog.as_raw_fd() as u32, ifindex);
            attr[1] = lo_hi(BPF_XDP, flags);
            bpf(BPF_LINK_CREATE, &mut attr).map(fd_from)
        };
        let (link, generic) = match link(0) {
            Ok(l) => (l, false),
            Err(native) => match link(XDP_FLAGS_SKB_MODE) {
                Ok(l) => (l, true),
                Err(_) => {
                    return Err(XdpError::privilege("attach the XDP program (bpf BPF_LINK_CREATE)", native))
                }
            },
        };
        Ok(XdpProgram { xsk_map, cfg_map, _prog: prog, _link: link, generic })
    }

    /// Steers strait frames arriving on `queue` to the AF_XDP socket `xsk`.
    pub fn bind_socket(&self, queue: u32, xsk: i32) -> Result<(), XdpError> {
        if queue >= MAX_QUEUES {
            return Err(XdpError::Config(format!(
                "queue {queue} beyond the {MAX_QUEUES} the program serves"
            )));
        }
        map_update(&self.xsk_map, queue, xsk as u32)
            .map_err(|source| XdpError::Io { op: "insert the socket into the XSKMAP", source })
    }

    /// Drops this share (parts per million) of strait frames on receive: loss
    /// injection for tests. Other frames are never dropped.
    pub fn set_drop_ppm(&self, ppm: u32) -> Result<(), XdpError> {
        map_update(&self.cfg_map, 0, ppm.min(1_000_000))
            .map_err(|source| XdpError::Io { op: "set the drop rate", source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_land_on_their_labels() {
        let p = program(0x88b5, 3, 4);
        assert_eq!(p.len(), 30);
        let target = |at: usize| (at as i64 + 1 + p[at].off as i64) as usize;
        assert_eq!(target(5), 26);
        assert_eq!(target(7), 26);
        assert_eq!(target(14), 20);
        assert_eq!(target(16), 20);
        assert_eq!(target(19), 28);
        assert_eq!(p[7].imm, 0xb588, "EtherType compared as the little-endian load of its wire bytes");
        assert_eq!(p[11].regs >> 4, PSEUDO_MAP_FD);
        assert_eq!(p[11].imm, 4);
        assert_eq!(p[21].imm, 3);
    }
}
