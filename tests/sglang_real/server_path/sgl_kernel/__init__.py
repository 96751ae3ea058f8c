"""A pure-torch stand-in for the CPU ops SGLang imports from `sgl_kernel` (test infrastructure).

With SGLANG_USE_CPU_ENGINE=1, sglang 0.5.23 imports CPU kernels from `sgl_kernel` at module level
(srt/mem_cache/allocation.py: `assign_req_to_token_pool_cpu`; kernels/ops/kvcache/cache_move.py:
`copy_all_layer_kv_cache_cpu`; some speculative-decoding modules). PyPI's sglang-kernel is the CUDA
build (its import needs libcuda.so.1) and the CPU build is source-only (sgl-kernel/pyproject_cpu.toml),
so the tests put this folder first on the server's PYTHONPATH. Only the op a plain batch calls is
implemented; any other name imports (the module-level imports must succeed) but raises when called,
naming itself, so a test that reaches one fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+megatron-rl-test-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int, *unused) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th consecutive slice
    of out_cache_loc (its offset is the running sum of the earlier rows' lengths), in place.

    The real kernel (sgl-kernel csrc/cpu, assign_req_to_token_pool_cpu) checks the same things:
    req_to_token 2-D int32 with pool_len columns, out_cache_loc int64, start/end of one dtype and one
    entry per row. A trailing bs_upper argument (its unit test passes one) is ignored, as there.
    """
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token must be 2-D int32 with {pool_len} columns, got "
                         f"{tuple(req_to_token.shape)} {req_to_token.dtype}")
    if out_cache_loc.dtype != torch.int64:
        raise ValueError(f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    if start_offset.dtype != end_offset.dtype:
        raise ValueError(f"start_offset {start_offset.dtype} and end_offset {end_offset.dtype} differ")
    rows = req_pool_indices.shape[0]
    if start_offset.numel() != rows or end_offset.numel() != rows:
        raise ValueError(f"{rows} rows but {start_offset.numel()} start and {end_offset.numel()} end offsets")
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[at:at + end - start].to(torch.int32)
        at += end - start


class _Missing:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.name} was called, but the test stand-in (tests/sglang_real/server_path/"
            "sgl_kernel) implements only assign_req_to_token_pool_cpu: implement it there from "
            "sgl-kernel's csrc/cpu source, or keep the test off the code path that needs it")

    def __getattr__(self, attr: str):
        return _Missing(f"{self.name}.{attr}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
