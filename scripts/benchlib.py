"""What the benchmark scripts share (imported by scripts/bench-*): the host's CPU
model for every result, and a free loopback port."""

import platform
import socket


def cpu_model():
    """The CPU model of this host, as /proc/cpuinfo names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def free_port():
    """A TCP port on 127.0.0.1 that nothing holds right now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
