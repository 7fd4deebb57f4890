"""Tests of kvlayer/registry.py: tiers built from entry points, sorted, lazily imported."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from kvlayer import config, registry
from kvlayer.backends.cpu import CpuBackend
from kvlayer.backends.gpu import GpuBackend
from kvlayer.registry import GROUP, BackendLoadError, available_backends, build_backends
from kvlayer.storage import BackendContext
from kvlayer.tier_settings import Setting, TierSettings, installed
from tests.fakes import CHUNK_BYTES, FakeBackend, context


class TapeBackend(FakeBackend):
    """A third-party tier, built whenever it is installed."""

    @classmethod
    def create(cls, ctx: BackendContext) -> TapeBackend:
        return cls(ctx.staging, name="tape", rank=40)


def install(monkeypatch, **eps: str) -> None:
    """Make ``eps`` (name -> "module:attr") the installed backend entry points."""
    listed = [EntryPoint(name, value, GROUP) for name, value in eps.items()]
    monkeypatch.setattr(registry, "entry_points", lambda group: [e for e in listed if e.group == group])


BUILTIN = {"gpu": "kvlayer.backends.gpu:GpuBackend", "cpu": "kvlayer.backends.cpu:CpuBackend"}


def test_the_builtin_tiers_are_installed() -> None:
    assert {"gpu", "cpu", "nvme", "redis"} <= set(available_backends())


def test_enabled_tiers_are_built_top_first() -> None:
    both = build_backends(context(cpu_capacity=4 * CHUNK_BYTES, gpu_capacity=2 * CHUNK_BYTES))
    assert [type(b) for b in both] == [GpuBackend, CpuBackend]
    assert [type(b) for b in build_backends(context(cpu_capacity=CHUNK_BYTES))] == [CpuBackend]
    assert build_backends(context()) == []


def test_a_broken_enabled_tier_is_an_error_naming_it(monkeypatch, tmp_path) -> None:
    install(monkeypatch, **BUILTIN, nvme="kvlayer.backends.no_such_tier:NvmeBackend")
    with pytest.raises(BackendLoadError, match="'nvme'"):
        build_backends(context(cpu_capacity=CHUNK_BYTES, nvme_path=str(tmp_path)))


def test_disabled_builtin_tiers_are_not_imported(monkeypatch) -> None:
    install(monkeypatch, **BUILTIN, redis="no_such_redis_module:RedisBackend",
            nvme="no_such_nvme_module:NvmeBackend")
    assert [b.name for b in build_backends(context(cpu_capacity=CHUNK_BYTES))] == ["cpu"]
    with pytest.raises(BackendLoadError, match="'redis'"):
        build_backends(context(cpu_capacity=CHUNK_BYTES, redis_url="redis://localhost:1"))


def test_third_party_tiers_are_built_and_checked(monkeypatch) -> None:
    install(monkeypatch, **BUILTIN, tape=f"{__name__}:TapeBackend")
    built = build_backends(context(cpu_capacity=CHUNK_BYTES, gpu_capacity=CHUNK_BYTES))
    assert [b.name for b in built] == ["gpu", "cpu", "tape"]
    install(monkeypatch, tape=f"{__name__}:install")
    with pytest.raises(TypeError, match="'tape'.*not a StorageBackend"):
        build_backends(context())
    install(monkeypatch, tape="no_such_tape_module:Tape")
    with pytest.raises(BackendLoadError, match="'tape'"):
        build_backends(context())


class ShelfBackend(FakeBackend):
    """A third-party tier that declares a setting: built with as many slots as its section says."""

    @classmethod
    def create(cls, ctx: BackendContext) -> ShelfBackend:
        backend = cls(ctx.staging, name="shelf", rank=40)
        backend.slots = ctx.tier_settings("shelf")["slots"]
        return backend


SHELF = TierSettings((Setting("slots", "int", 0),), enabled=lambda s: s["slots"] > 0)


def test_a_third_party_tier_gets_its_section_and_is_not_imported_when_it_disables_it(monkeypatch) -> None:
    monkeypatch.setattr(config, "installed", lambda: {**installed(), "shelf": SHELF})
    install(monkeypatch, shelf=f"{__name__}:ShelfBackend")
    (built,) = build_backends(context(tiers={"shelf": {"slots": "3"}}))
    assert built.name == "shelf" and built.slots == 3
    assert [b.slots for b in build_backends(context(shelf_slots=5))] == [5], "the flat spelling"
    install(monkeypatch, shelf="no_such_shelf_module:Shelf")
    assert build_backends(context()) == [], "disabled by its section: not imported"
    with pytest.raises(BackendLoadError, match="'shelf'"):
        build_backends(context(shelf_slots=1))


def test_a_bad_setting_raises_from_create() -> None:
    with pytest.raises(ValueError, match="cpu_capacity"):
        build_backends(context(cpu_capacity=CHUNK_BYTES // 2))


def test_redis_is_not_imported_without_a_redis_url() -> None:
    code = ("import sys; from tests.fakes import context, CHUNK_BYTES; "
            "from kvlayer.registry import build_backends; "
            "build_backends(context(cpu_capacity=CHUNK_BYTES, gpu_capacity=CHUNK_BYTES)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis' or "
            "m.startswith('kvlayer.backends.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    loaded = out.stdout.strip().splitlines()[-1]
    assert loaded == ("['kvlayer.backends.cpu', 'kvlayer.backends.gpu', 'kvlayer.backends.memory_tier', "
                      "'kvlayer.backends.settings']"), "of nvme and redis, only their light settings are loaded"
