"""Peak resident memory of the calling process, for the peer runners (which run in side venvs
without lmfoundry). VmHWM is this process image's own high-water mark; getrusage's ru_maxrss
also survives fork+exec and so reports the *parent's* resident size when that was larger (the
benchmark parent holds ~2 GB after scoring, which then showed up as every child's peak)."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
