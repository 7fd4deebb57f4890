"""What the vLLM connector derives from vLLM's configuration (connectors/vllm_setup.py), without
vLLM: kvlayer's config from ``kv_connector_extra_config`` (a ``config_file`` there, then the
other keys, then ``KVLAYER_*``), the block-size rule, the model's identity, the cache layout."""

from __future__ import annotations

import pytest
import torch

from kvlayer.config import ConfigError
from kvlayer.connectors import vllm_setup
from kvlayer.engine.presets import init_model
from kvlayer.model_files import model_fingerprint


def test_extra_config_over_its_file_under_the_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "kvlayer.yaml"
    path.write_text("cpu_capacity: 1GiB\nchunk_size: 128\nnvme_capacity: 2GiB\n")
    monkeypatch.setenv("KVLAYER_NVME_CAPACITY", "3GiB")
    cfg = vllm_setup.kvlayer_config({"config_file": str(path), "chunk_size": 256})
    assert (cfg.cpu_capacity, cfg.chunk_size, cfg.nvme_capacity) == (1 << 30, 256, 3 << 30)
    with pytest.raises(ConfigError, match="unknown kvlayer config key 'cpu_cap'"):
        vllm_setup.kvlayer_config({"cpu_cap": 1})
    path.write_text("cpu_capacity: [\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        vllm_setup.kvlayer_config({"config_file": str(path)})
    vllm_setup.check_block_size(cfg, 128)
    with pytest.raises(ConfigError, match="chunk_size 256 must be a multiple of vLLM's block_size 96"):
        vllm_setup.check_block_size(cfg, 96)


def test_a_model_folder_is_named_by_its_weights_and_a_hub_id_by_its_revision(tmp_path) -> None:
    folder = init_model("tiny", tmp_path / "m")
    assert vllm_setup.model_identity(str(folder), None) == ("m", model_fingerprint(folder))
    assert vllm_setup.model_identity("org/model", "v2") == ("org/model", "hub:org/model@v2")


def test_cache_layouts_from_the_tensors_vllm_registers(monkeypatch) -> None:
    flash = vllm_setup.cache_layout(torch.zeros(2, 10, 16, 4, 64), 4, 64, 16, torch.float32, 3)
    assert not flash.opaque_blocks and flash.paged_view(torch.zeros(2, 10, 16, 4, 64)).shape == (2, 10, 16, 4, 64)
    monkeypatch.setattr(vllm_setup, "_cpu_isa", lambda *a: "vec")  # vLLM itself is not imported here
    cpu = vllm_setup.cache_layout(torch.zeros(10, 4, 32, 128), 4, 64, 32, torch.float32, 3)
    assert cpu.opaque_blocks and cpu.cache_layout.startswith("blocks:vllm-cpu-vec-") and cpu.copy_unit == 32
    mla = vllm_setup.cache_layout(torch.zeros(10, 16, 576), 1, 576, 16, torch.bfloat16, 3)  # DeepSeek's
    assert (mla.cache_layout, mla.planes, mla.num_kv_heads, mla.head_dim) == ("latent-block-token-dim", 1, 1, 576)
    assert mla.paged_view(torch.zeros(10, 16, 576, dtype=torch.bfloat16)).shape == (1, 10, 16, 1, 576)
    with pytest.raises(ValueError, match=r"does not know vLLM's KV cache layout \(10, 4, 64\)"):
        vllm_setup.cache_layout(torch.zeros(10, 4, 64), 4, 64, 32, torch.float32, 3)


def test_the_served_name() -> None:
    from types import SimpleNamespace

    cfg = vllm_setup.kvlayer_config({"instance_id": "node-a"})
    served = SimpleNamespace(model_config=SimpleNamespace(served_model_name=["llama-8b", "alias"]))
    assert vllm_setup.with_served_name(cfg, served).served_model_name == "llama-8b", "vLLM's first name"
    own = vllm_setup.kvlayer_config({"served_model_name": "mine"})
    assert vllm_setup.with_served_name(own, served).served_model_name == "mine", "kvlayer's config wins"
    none = SimpleNamespace(model_config=SimpleNamespace(served_model_name=None))
    assert vllm_setup.with_served_name(cfg, none).served_model_name == ""
