"""Whether the memory a configuration asks for fits the machine, checked before anything is allocated.

A configuration asks for host memory (``staging_capacity``, and each tier setting declared with
``memory="host"``: ``cpu_capacity``) and memory on the engine's device (settings declared with
``memory="device"``: ``gpu_capacity``; host memory too when the engine runs on the CPU). The
host's share is compared with the memory available now (``MemAvailable`` in /proc/meminfo, or
``os.sysconf`` where there is none, lowered by a cgroup v2 ``memory.max``); a CUDA device's with
its free memory (``torch.cuda.mem_get_info``). What does not fit is refused in one line naming
the settings, their sizes and the machine's, before a 200 GiB arena fails deep inside torch.

``kvlayer config --check``, ``kvlayer serve`` and ``KVCacheEngine`` run ``check_memory``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlayer.sizes import format_size
from kvlayer.values import ConfigError

if TYPE_CHECKING:
    import torch

    from kvlayer.config import KVLayerConfig

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class Ask:
    """One setting's memory: its flat key, its size in bytes and where (``host`` or ``device``)."""

    setting: str
    size: int
    place: str


@dataclass(frozen=True, slots=True)
class Available:
    """Memory free for new allocations: ``size`` bytes, and where the figure comes from."""

    size: int
    source: str


def asks(config: KVLayerConfig, tiers: bool = True) -> list[Ask]:
    """The non-zero memory sizes ``config`` allocates at start: every enabled tier's settings
    declared with ``memory`` (unless ``tiers`` is False: tiers built elsewhere), then ``staging_capacity``."""
    out = []
    for tier, section in sorted(config.tiers.items()):
        if not (tiers and section.enabled):
            continue
        for setting in section.declaration.settings:
            if setting.memory and section[setting.key]:
                out.append(Ask(f"{tier}_{setting.key}", section[setting.key], setting.memory))
    if config.staging_capacity:
        out.append(Ask("staging_capacity", config.staging_capacity, "host"))
    return out


def host_available() -> Available:
    """The host memory new allocations may take now (see the module docstring)."""
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        found = Available(int(fields["MemAvailable"].split()[0]) * 1024, f"MemAvailable in {MEMINFO}")
    except (OSError, KeyError, ValueError):
        found = Available(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (sysconf)")
    left = _cgroup_left()
    return left if left is not None and left.size < found.size else found


def device_available(device: torch.device) -> Available:
    """The free memory of CUDA ``device`` now."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return Available(int(free), f"free on {device}")


def problems(config: KVLayerConfig, device: str | torch.device | None = "cpu", tiers: bool = True) -> list[str]:
    """One line per memory place whose asks do not fit (none: they fit). ``device``: the engine's;
    None for the one kvlayer would run on here (the first CUDA device if any, else the CPU),
    where only a device ask needs torch to tell. ``tiers``: as ``asks``'. ``ValueError`` for a
    device this machine lacks (asked only when a device ask needs it)."""
    wanted = asks(config, tiers)
    dev = _device(device) if any(a.place == "device" for a in wanted) else None
    cuda = dev is not None and dev.type == "cuda"
    host = [a for a in wanted if a.place == "host" or not cuda]
    out = [_refusal(host, host_available, "this machine's available memory")]
    if cuda:
        out.append(_refusal([a for a in wanted if a.place == "device"], lambda: device_available(dev),
                            f"{dev}'s free memory"))
    return [line for line in out if line]


def check_memory(config: KVLayerConfig, device: str | torch.device | None = "cpu", tiers: bool = True) -> None:
    """``ConfigError`` with ``problems``' first line when the memory ``config`` asks for does not fit."""
    found = problems(config, device, tiers)
    if found:
        raise ConfigError(found[0])


def describe(config: KVLayerConfig) -> str:
    """The host asks and what is available, for a passing check ("cpu_capacity 4.0GiB + ... of 21.9GiB available")."""
    host = [a for a in asks(config) if a.place == "host"]
    free = host_available()
    named = " + ".join(f"{a.setting} {format_size(a.size)}" for a in host) or "no host memory"
    return f"{named} fit in {format_size(free.size)} available ({free.source})"


def _refusal(wanted: list[Ask], available: Callable[[], Available], where: str) -> str | None:
    """The refusal of ``wanted`` when together they exceed ``available()`` (None: they fit)."""
    if not wanted:
        return None
    need = sum(a.size for a in wanted)
    free = available()
    if need <= free.size:
        return None
    biggest = max(wanted, key=lambda a: a.size)
    named = " + ".join(f"{a.setting} {format_size(a.size)}" for a in wanted)
    total = f" = {format_size(need)} do" if len(wanted) > 1 else " does"
    return (f"{named}{total} not fit in {where}, {format_size(free.size)} ({free.source}); "
            f"lower {biggest.setting}")


def _device(device: str | torch.device | None) -> torch.device:
    import torch

    from kvlayer.devices import parse_device

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(device)


def _cgroup_left() -> Available | None:
    """What a cgroup v2 memory limit leaves: ``memory.max`` less ``memory.current``, the page
    cache the kernel can reclaim (``inactive_file`` in ``memory.stat``) not counted as used, as
    the kubelet counts a container's working set. None without a limit."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        used = int((CGROUP / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    try:
        stat = dict(line.split() for line in (CGROUP / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        used -= int(stat.get("inactive_file", 0))
    except (OSError, ValueError):
        pass
    return Available(max(0, int(limit) - max(0, used)), "cgroup memory.max")
