"""Kernel network limits that cap TCP socket buffers, read (never written) before a job starts.

Low maxima throttle socket transports between nodes (NCCL's socket transport, gloo, the
rendezvous store). Raising them needs root, so mgpu only says what to run.
"""

from __future__ import annotations

from pathlib import Path

#: Recommended minimum of each parameter's maximum buffer size, for multi-node training.
RECOMMENDED_MAX = 16777216
#: Parameters as "max" (one number) or "min default max" (three numbers, the last compared).
PARAMETERS = ("net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")


def check(root: Path = Path("/proc/sys")) -> list[str]:
    """One warning per parameter below the recommendation, each with the command that fixes it."""
    warnings = []
    for name in PARAMETERS:
        path = root / name.replace(".", "/")
        try:
            values = [int(v) for v in path.read_text().split()]
        except (OSError, ValueError) as e:
            warnings.append(f"cannot read {name} ({e}); multi-node transfers may be throttled")
            continue
        if values[-1] < RECOMMENDED_MAX:
            wanted = " ".join(str(v) for v in [*values[:-1], RECOMMENDED_MAX])
            warnings.append(
                f"{name}={' '.join(map(str, values))} is below {RECOMMENDED_MAX} for multi-node "
                f"training; to raise it: sudo sysctl -w {name}=\"{wanted}\""
            )
    return warnings
