"""Test-only stand-in for ``sgl_kernel``, on the live SGLang server's ``PYTHONPATH`` only: each op raises.

Why it exists: in CPU mode (``SGLANG_USE_CPU_ENGINE=1``) SGLang 0.5.23 imports eight CPU ops of
``sgl_kernel`` when its modules load: ``assign_req_to_token_pool_cpu`` (``srt/mem_cache/allocation.py``),
``copy_all_layer_kv_cache_cpu`` (``kernels/ops/kvcache/cache_move.py``) and six of speculative
decoding: ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` (``speculative/spec_tree.py``),
``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu`` (``speculative/cache_locs.py``),
``fill_accept_out_cache_loc_cpu`` and ``fill_bonus_tokens_cpu`` (``speculative/eagle.py``). No
registry ships a CPU build of them (the ``sglang-kernel`` wheel is CUDA-only, with no source release),
and none is called on the dLLM path the live tests serve (read off a server that logged every access
and call: each name was imported, none called, with the hook, DP 2 and prefix-cache hits). So each is
a function that raises if SGLang ever calls it, and any other name is an ``AttributeError``: a new
dependency shows up as SGLang's own import error, never as a silent stand-in.
"""

IMPORTED_AT_START = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


class NotOnThisPath(RuntimeError):
    """SGLang called an ``sgl_kernel`` op the live tests' stand-in only lets it import."""


def _raises(name: str):
    def op(*args, **kwargs):
        raise NotOnThisPath(f"sgl_kernel.{name} was called: the live tests' stand-in has no CPU kernel "
                            "(tests/live/stand_ins/sgl_kernel)")

    op.__name__ = op.__qualname__ = name
    return op


globals().update({name: _raises(name) for name in IMPORTED_AT_START})
