"""SGLang's device KV pool and a HiCache host pool bound to it, on CPU (unpinned), for the tests
of the HiCache storage backend and of the CPU HiCache copies."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost


def device_and_host_pools(
    layout: str,
    page: int,
    layers: int,
    heads: int,
    dim: int,
    size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    """A ``size``-token device pool and a host pool of twice its tokens in ``layout``."""
    device = MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=dtype,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )
    return device, host
