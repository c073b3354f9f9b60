"""SGLang's HiCache on a CPU device (``vericache_sglang/sglang/cpu/hicache.py``): the direct io
backend's copies in torch, through SGLang's own host pool in both layouts they serve, and the
patches as the CPU engine installs them in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.pool_host.mha", reason="sglang is not installed")

from hicache_pools import device_and_host_pools
from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.pool_host import mha as host_mha

from vericache_sglang.bench.sglang_server import model_dir
from vericache_sglang.sglang.cpu import hicache

LAYERS, HEADS, DIM = 3, 2, 8


def _pools(layout: str, page: int) -> tuple[memory_pool.MHATokenToKVPool, host_mha.MHATokenToKVPoolHost]:
    hicache._patch_mha(host_mha)  # what the CPU engine's import hook does; binds only absent names
    device, host = device_and_host_pools(layout, page, LAYERS, HEADS, DIM, size=64)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        for buf in (device.k_buffer[layer], device.v_buffer[layer]):
            buf.copy_(torch.randn(buf.shape, generator=g))
    return device, host


def _pages(first_tokens: list[int], page: int) -> torch.Tensor:
    return torch.tensor([t + i for t in first_tokens for i in range(page)], dtype=torch.int64)


@pytest.mark.parametrize(("layout", "page"), [("page_first_direct", 4), ("page_first_direct", 1), ("layer_first", 4)])
def test_direct_io_round_trip_through_sglangs_host_pool(layout, page):
    """Device rows backed up to the host (all layers) land where the layout puts them, and loaded
    back layer by layer onto other device rows they are the same bits."""
    device, host = _pools(layout, page)
    src = _pages([8, 24, 4], page) if page > 1 else torch.tensor([9, 3, 17, 30])
    host_idx = _pages([page * 5, page * 2, page * 9], page) if page > 1 else torch.tensor([11, 2, 40, 5])
    host.backup_from_device_all_layer(device, host_idx, src, "direct")
    for layer in range(LAYERS):
        for kind, (dev_buf, host_buf) in enumerate(
            ((device.k_buffer, host.k_buffer), (device.v_buffer, host.v_buffer))
        ):
            if layout == "page_first_direct":
                stored = host_buf[host_idx // page, layer, host_idx % page]
            else:
                stored = host_buf[layer][host_idx]
            assert torch.equal(stored, dev_buf[layer][src]), (layout, layer, kind)
    dst = torch.arange(40, 40 + src.numel())
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, host_idx, dst, layer, "direct")
    for layer in range(LAYERS):
        assert torch.equal(device.k_buffer[layer][dst], device.k_buffer[layer][src])
        assert torch.equal(device.v_buffer[layer][dst], device.v_buffer[layer][src])


def test_direct_ops_refuse_mismatched_or_partial_pages():
    a, b = torch.zeros(8, 2), torch.zeros(8, 2)
    with pytest.raises(ValueError, match="3 source indices for 2"):
        hicache.transfer_kv_direct([a], [b], torch.arange(3), torch.arange(2), 1)
    with pytest.raises(ValueError, match="not whole pages of 4"):
        hicache.transfer_kv_direct([a], [b], torch.arange(6), torch.arange(6), 4)


def test_kernel_io_backend_ops_name_the_fix():
    hicache._patch_mha(host_mha)
    with pytest.raises(RuntimeError, match="--hicache-io-backend direct"):
        host_mha.transfer_kv_per_layer()


def test_cpu_engine_installs_the_hicache_patches_at_import():
    """In a fresh interpreter with SGLANG_USE_CPU_ENGINE=1 (the .pth line's install): SGLang's
    host-pool module has the direct ops, host pools are not pinned, and HiCache's io backend
    resolves to direct (its default, kernel, is CUDA's), and SGLang's 10 GiB host reserve is the one
    VERICACHE_CPU_HICACHE_RESERVE_GIB sets; without the switch nothing is patched."""
    code = textwrap.dedent(
        """
        import json, os, torch
        from sglang.srt.mem_cache.pool_host import base, mha
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.arg_groups.overrides import resolving_view
        out = {"direct": getattr(mha, "transfer_kv_direct", None) is not None,
               "reserve_gib": base.HICACHE_HOST_MEMORY_RESERVE_BYTES / 2**30}
        if out["direct"]:
            dev = MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=1, head_dim=4,
                                   layer_num=1, device="cpu", enable_memory_saver=False)
            host = mha.MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 1,
                                            "layer_first", device_capacity_tokens=dev.size,
                                            start_layer=0, end_layer=0)
            out["pinned"] = host.pin_memory
            args = prepare_server_args(["--model-path", os.environ["MODEL"], "--device", "cpu",
                                        "--enable-hierarchical-cache"])
            args.resolve_once()  # what the launcher does before publishing the arguments
            resolved = resolving_view(args)  # SGLang's decisions over the raw flags
            out["io"] = resolved.hicache_io_backend
            out["layout"] = resolved.hicache_mem_layout
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env["MODEL"] = model_dir()
    env["VERICACHE_CPU_HICACHE_RESERVE_GIB"] = "2.5"
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.strip().splitlines()[-1] == '{"direct": false, "reserve_gib": 10.0}'
    on = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "SGLANG_USE_CPU_ENGINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert on.returncode == 0, on.stderr[-2000:]
    # kernel -> direct (ours), then page_first -> page_first_direct (SGLang's own rule for direct)
    assert on.stdout.strip().splitlines()[-1] == (
        '{"direct": true, "reserve_gib": 2.5, "pinned": false, "io": "direct", "layout": "page_first_direct"}'
    )
