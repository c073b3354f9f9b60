"""SGLang's CPU platform layer: the kernel-package ops in torch (the seeded draw's hash bit for bit
SGLang's Triton kernel), the stand-in ``sgl_kernel`` and how it is loaded (a ``.pth`` line, active
only with ``SGLANG_USE_CPU_ENGINE=1``, never in front of a real ``sgl_kernel``), the opt-in
answer to deterministic inference's batch-invariant set-up on CPU, and the CUDA stand-ins
(``VERICACHE_TORCH_KERNELS=1``) under a faked CUDA device."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vericache_sglang.sglang.cpu import ops as cpu_kernels
from vericache_sglang.sglang.cpu import platform as cpu_platform

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env.update(extra)
    return env


# -- the ops ------------------------------------------------------------------------------------


def _buffers(rows: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, *shape, generator=g).to(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]


def _pointers(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].nbytes for b in buffers], dtype=torch.int64)
    return ptrs, strides


@pytest.mark.parametrize(
    "moves",
    [
        ([3, 4], [0, 1]),  # plain moves
        ([1, 2, 3], [0, 1, 2]),  # overlapping: each row is a source and, later, a target
        ([0, 1, 2], [1, 2, 3]),  # overlapping the other way (a naive in-order copy would smear row 0)
        ([5, 5], [6, 7]),  # one source, two targets
        ([], []),
    ],
)
def test_copy_all_layer_kv_cache_moves_rows_reading_every_source_first(moves):
    tgt, src = moves
    buffers = _buffers(8, [(3, 4), (3, 4), (2, 6)], [torch.float32, torch.float32, torch.bfloat16])
    before = [b.clone() for b in buffers]
    ptrs, strides = _pointers(buffers)
    cpu_kernels.copy_all_layer_kv_cache_cpu(
        ptrs, strides, torch.tensor(tgt, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)
    )
    for b, old in zip(buffers, before, strict=True):
        expected = old.clone()
        for t, s in zip(tgt, src, strict=True):
            expected[t] = old[s]  # every source as it was before the call
        assert torch.equal(b, expected)


def test_copy_all_layer_kv_cache_rejects_mismatched_arguments():
    buffers = _buffers(4, [(2,)], [torch.float32])
    ptrs, strides = _pointers(buffers)
    with pytest.raises(ValueError, match="targets"):
        cpu_kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([0, 1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="negative"):
        cpu_kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([-1]), torch.tensor([2]))


def test_assign_req_to_token_pool_writes_each_requests_slots_in_order():
    req_to_token = torch.full((4, 10), -1, dtype=torch.int32)
    rows, start, end = torch.tensor([2, 0, 3]), torch.tensor([1, 0, 5]), torch.tensor([3, 4, 5])
    out = torch.arange(100, 106, dtype=torch.int64)  # 2 + 4 + 0 slots
    cpu_kernels.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out, 10)
    expected = torch.full((4, 10), -1, dtype=torch.int32)
    expected[2, 1:3] = torch.tensor([100, 101])
    expected[0, 0:4] = torch.tensor([102, 103, 104, 105])
    assert torch.equal(req_to_token, expected)
    with pytest.raises(ValueError, match="positions"):
        cpu_kernels.assign_req_to_token_pool_cpu(
            torch.tensor([0]), req_to_token, torch.tensor([8]), torch.tensor([11]), out, 10
        )


def test_import_only_names_raise_naming_the_op():
    table = cpu_kernels.ops()
    assert set(cpu_kernels.IMPORT_ONLY) < set(table)
    for name in cpu_kernels.IMPORT_ONLY:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} is not available"):
            table[name](torch.zeros(1))


def test_murmur_hash32_is_sglangs_triton_kernel_bit_for_bit():
    """The kernel runs under Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``)."""
    triton = pytest.importorskip("triton")
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel

    seeds = torch.tensor([42, 7, -3, (1 << 62) + 12345, 0, 1 << 40], dtype=torch.int64).to(torch.uint64)
    positions = torch.tensor([0, 5, 2047, 1 << 20, 99, (1 << 33) + 5], dtype=torch.int64)  # the kernel keeps 32 bits
    cols = torch.arange(3000)
    want = torch.empty((6, 3000), dtype=torch.uint32)
    murmur_hash32_kernel[(6, triton.cdiv(3000, 1024))](seeds, positions, cols, want, 6, 3000, BLOCK_SIZE=1024)
    got = cpu_kernels.murmur_hash32_cpu(seeds, positions, cols)
    assert got.dtype == torch.uint32 and torch.equal(got.to(torch.int64), want.to(torch.int64))
    assert len(set(got[0, :100].tolist())) == 100  # a hash, not a constant
    with pytest.raises(ValueError, match="must be one shape"):
        cpu_kernels.murmur_hash32_cpu(seeds, positions[:2], cols)


def test_the_stand_in_registers_the_hash_where_sglangs_seeded_draw_calls_it():
    probe = (
        "import torch, sgl_kernel; from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32;"
        "from sglang.srt.utils.common import cpu_has_amx_support;"
        "h = murmur_hash32(torch.tensor([1, 2]), torch.tensor([3, 4]), torch.arange(5));"
        "print(tuple(h.shape), cpu_has_amx_support())"
    )
    result = _python(probe, _env(SGLANG_USE_CPU_ENGINE="1"))
    assert result.returncode == 0 and "(2, 5)" in result.stdout, (
        result.stdout,
        result.stderr[-2000:],
    )
    assert result.stdout.split()[-1] == "False"  # SGLang stays off its AMX path


def test_batch_invariant_mode_on_cpu_is_answered_only_with_the_switch():
    """Without ``VERICACHE_CPU_DETERMINISTIC=1`` SGLang's own error stands; with it the call returns,
    says so, and leaves torch's CPU kernels (nothing registered for aten)."""
    probe = (
        "import torch; from sglang.srt import batch_invariant_ops as b\n"
        "try:\n b.enable_batch_invariant_mode(); print('answered', b.is_batch_invariant_mode_enabled())\n"
        "except RuntimeError as e: print('refused:', e)"
    )
    stock = _python(probe, _env(SGLANG_USE_CPU_ENGINE="1"))
    assert "refused: No supported accelerator" in stock.stdout, (stock.stdout, stock.stderr[-2000:])
    switched = _python(probe, _env(SGLANG_USE_CPU_ENGINE="1", VERICACHE_CPU_DETERMINISTIC="1"))
    assert "answered False" in switched.stdout, (switched.stdout, switched.stderr[-2000:])
    assert "without batch-invariant kernels" in switched.stderr
    assert "refused" in _python(probe, _env(VERICACHE_CPU_DETERMINISTIC="1")).stdout  # CPU engine off: untouched


def test_sglang_pool_moves_kv_through_the_op():
    """SGLang's own pool code (``MHATokenToKVPool.move_kv_cache``) on the stand-in op."""
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    result = _python(
        textwrap.dedent("""
        import torch
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        pool = MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=3,
                                device="cpu", enable_memory_saver=False, enable_kv_cache_copy=True)
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.copy_(torch.randn_like(buf))
        before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        pool.move_kv_cache(torch.tensor([2, 3, 4]), torch.tensor([1, 2, 3]))
        for buf, old in zip((*pool.k_buffer, *pool.v_buffer), before):
            assert torch.equal(buf[2:5], old[1:4]) and torch.equal(buf[5:], old[5:]) and torch.equal(buf[:2], old[:2])
        import sgl_kernel
        from vericache_sglang.sglang.cpu.platform import is_stand_in
        assert is_stand_in(sgl_kernel)
        print("ok")
        """),
        _env(SGLANG_USE_CPU_ENGINE="1"),
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# -- loading ------------------------------------------------------------------------------------


def test_the_pth_line_is_installed_in_site_packages():
    found = [
        Path(d) / "vericache_sglang_cpu.pth"
        for d in site.getsitepackages()
        if (Path(d) / "vericache_sglang_cpu.pth").exists()
    ]
    assert found, "vericache_sglang_cpu.pth is missing: reinstall the project (scripts/setup.sh)"
    line = found[0].read_text()
    assert line.startswith("import ") and "SGLANG_USE_CPU_ENGINE" in line and "sglang.cpu.platform" in line
    assert "VERICACHE_TORCH_KERNELS" in line, "the .pth line predates the CUDA stand-in: reinstall the project"


def test_the_stand_in_is_active_only_with_sglangs_cpu_switch():
    probe = "import sgl_kernel; print(sgl_kernel.__all__)"
    on = _python(probe, _env(SGLANG_USE_CPU_ENGINE="1"))
    assert on.returncode == 0 and "copy_all_layer_kv_cache_cpu" in on.stdout, on.stderr[-2000:]
    off = _python(probe, _env())
    assert off.returncode != 0 and "No module named 'sgl_kernel'" in off.stderr
    other = _python(probe, _env(SGLANG_USE_CPU_ENGINE="0"))
    assert other.returncode != 0


# SGLang's modules on a CUDA machine, CUDA faked on this CPU (an H200 as torch reports one)
FAKED_CUDA_IMPORTS = textwrap.dedent(
    """
    import torch

    class Props:
        name, major, minor, multi_processor_count, total_memory = "NVIDIA H200 (faked)", 9, 0, 132, 141 << 30

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: Props.name
    torch.cuda.get_device_properties = lambda *a, **k: Props()
    torch.cuda.current_device = lambda: 0
    import sglang.srt.layers.layernorm, sglang.srt.layers.activation, sglang.srt.layers.sampler
    import sglang.srt.layers.attention.triton_backend, sglang.srt.models.llama
    from sglang.srt.utils import is_cuda
    import sgl_kernel
    from sgl_kernel.utils import is_arch_support_pdl
    import sglang.kernels.ops.gemm.cutedsl_dual_gemm as dual
    try:
        sgl_kernel.rmsnorm(None, None)
    except NotImplementedError as e:
        print("rmsnorm raises:", e)
    try:
        import sgl_kernel.allreduce
    except ImportError:
        print("no allreduce")
    print(is_cuda(), sgl_kernel.VERICACHE_STAND_IN, is_arch_support_pdl(),
          dual.VERICACHE_STAND_IN, dual.can_use_dual_gemm(1, 576, 1536, dual.DualGemmQuantMode.UNQUANT))
    """
)


def test_sglangs_cuda_modules_load_through_the_cuda_stand_in():
    """On CUDA, SGLang's layers import sgl_kernel and the CuTe DSL dual GEMM at load; with
    VERICACHE_TORCH_KERNELS=1 (the .pth line) the stand-ins answer: the imports of a Llama server on
    the triton backend succeed, the one op called says no PDL, any other op raises naming itself, and
    allreduce stays unanswered (its importer falls back). Without the switch the same imports fail."""
    on = _python(FAKED_CUDA_IMPORTS, _env(VERICACHE_TORCH_KERNELS="1"))
    assert on.returncode == 0, on.stderr[-3000:]
    lines = on.stdout.strip().splitlines()
    assert lines[-1].split() == ["True", "True", "False", "True", "False"], on.stdout
    assert "rmsnorm raises: sgl_kernel.rmsnorm" in on.stdout and "SGLANG_FORCE_FUSED_OP_BACKEND" in on.stdout
    assert "no allreduce" in on.stdout
    off = _python(FAKED_CUDA_IMPORTS, _env())
    assert off.returncode != 0 and "No module named 'sgl_kernel'" in off.stderr, off.stderr[-2000:]


def test_a_real_sgl_kernel_is_never_shadowed(tmp_path):
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    env = _env(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(tmp_path))
    result = _python(
        "import sgl_kernel; from vericache_sglang.sglang.cpu.platform import is_stand_in;"
        "print(sgl_kernel.REAL, is_stand_in(sgl_kernel))",
        env,
    )
    assert result.returncode == 0 and result.stdout.split() == ["True", "False"], result.stderr[-2000:]


def test_install_is_idempotent_and_a_missing_name_says_what_the_stand_in_provides(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    before = list(sys.meta_path)
    try:
        assert cpu_platform.install() and cpu_platform.install()
        assert sum(isinstance(f, cpu_platform.SglKernelStandIn) for f in sys.meta_path) == 1
        assert isinstance(sys.meta_path[-1], cpu_platform.SglKernelStandIn)
        spec = cpu_platform.SglKernelStandIn().find_spec("sgl_kernel", None)
        module = spec.loader.create_module(spec)
        spec.loader.exec_module(module)
        assert cpu_platform.is_stand_in(module)
        with pytest.raises(AttributeError, match="it provides assign_draft_cache_locs_contiguous_cpu"):
            module.silu_and_mul  # noqa: B018
        assert cpu_platform.SglKernelStandIn().find_spec("sgl_kernel.kvcacheio", None) is None
    finally:
        sys.meta_path[:] = before
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")
    assert not cpu_platform.install()
