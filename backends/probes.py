"""The built-in tiers' probes (``TierSettings.probe``, declared in ``backends/settings.py``): why
an NVMe folder or a Redis URL cannot be used now, in one line, for ``kvlayer config --check``
and ``kvlayer serve``'s start-up (``kvlayer.places``). Imported only when a probe runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def nvme_folder(section: Mapping[str, Any], timeout_ms: int) -> str | None:
    """Why the NVMe tier cannot use folder ``nvme_path`` (None: it can). Makes the folder if
    missing (as the tier would), writes, syncs and removes a probe file in it, and removes the
    folders it made. Local I/O: ``timeout_ms`` does not apply."""
    path = section["path"]
    root = Path(path).expanduser().absolute()
    made = [p for p in (root, *root.parents) if not p.exists()]
    try:
        if root.exists() and not root.is_dir():
            return f"nvme_path {path!r} is not a folder"
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".kvlayer-probe-{os.getpid()}"
        try:
            with probe.open("wb") as f:
                f.write(bytes(4096))
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""
        return f"nvme_path {path!r} is not usable: {e.strerror or e}{where}"
    finally:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None


def redis_ping(section: Mapping[str, Any], timeout_ms: int) -> str | None:
    """Why ``redis_url`` does not answer a PING within ``timeout_ms`` (None: it does)."""
    from redis.exceptions import RedisClusterException, RedisError

    from kvlayer.backends.redis import RedisSettings
    from kvlayer.backends.redis_clients import sync_client

    settings = RedisSettings(section["url"], cluster=section["cluster"], timeout_s=timeout_ms / 1000)
    client = None
    try:
        client = sync_client(settings)  # a cluster client connects here already
        client.ping()
    except (RedisError, RedisClusterException, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        return f"redis_url: PING failed (tier_timeout_ms {timeout_ms}): {reason}"
    finally:
        if client is not None:
            client.close()
    return None
