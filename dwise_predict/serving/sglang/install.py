"""Install the DWISE hook in SGLang's dLLM scheduler at run time (no edits to SGLang's source):
check the arguments, allocate the pooling buffers, build the hook, patch SGLang's classes; and
uninstall.

Install it in the scheduler process with :mod:`dwise_predict.serving.launcher`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from numbers import Integral
from types import MethodType

from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.serving.monitor import WINDOW
from dwise_predict.serving.policy import MAX_WAIT
from dwise_predict.serving.sglang.buffers import PoolingBuffers, _PromptRows
from dwise_predict.serving.sglang.follow import Following, HotSwap
from dwise_predict.serving.sglang.hook import DwiseHook
from dwise_predict.serving.sglang.requests import HookStats
from dwise_predict.serving.sglang.surface import ResolvedSglang

# what the hook takes over: (owner on ResolvedSglang, SGLang's name, the hook's method), in patch order
PATCHES = (
    ("mixin", "_fetch_waiting_reqs", "fetch_waiting_reqs"),
    ("mixin", "_process_dllm_batches", "process_dllm_batches"),
    ("mixin", "process_batch_result_dllm", "process_batch_result_dllm"),
    ("algorithm", "run", "run"),
    ("logits", "_get_dllm_logits", "get_dllm_logits"),
    ("scheduler", "abort_request", "abort_request"),
)


@dataclass
class Installed:
    """Handle on an installed patch: the hook (its policy, request table and buffers), its stats and
    ``uninstall()`` (which also stops a bundle follower and the monitor's summary thread)."""

    state: DwiseHook
    originals: list

    @property
    def stats(self) -> HookStats:
        return self.state.stats

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)
        self.originals.clear()
        self.state.stop()


class _Patched:
    """A hook method in an SGLang class's place: read from an SGLang object it is that method bound
    to the object, so the hook's method gets SGLang's ``self`` (the scheduler, the algorithm, the
    logits processor) after its own; read from the class, it is itself, and calling it calls the
    method (what a wrapper installed over it does). No state of its own: the hook holds it."""

    __slots__ = ("method",)

    def __init__(self, method):
        self.method = method

    def __get__(self, obj, owner=None):
        return self if obj is None else MethodType(self.method, obj)

    def __call__(self, *args, **kwargs):
        return self.method(*args, **kwargs)


def install(
    bundle=None,
    slots: int = 128,
    k: float = 8,
    kv_budget_tokens: float | None = None,
    kv_fraction: float = 0.9,
    slack_blocks: int = 2,
    features=None,
    device=None,
    resolve=importlib.import_module,
    *,
    block_size: int | None = None,
    max_batch: int | None = None,
    hidden_size: int | None = None,
    recorder=None,
    prompt_cache: int = 4096,
    aging: float = 0.0,
    max_wait: int | None = MAX_WAIT,
    monitor_window: int = WINDOW,
    follow: Following | None = None,
) -> Installed:
    """Patch SGLang's dLLM scheduler (classes, so every scheduler in the process) with DWISE.

    Call it in the scheduler process before the model runner starts (before CUDA-graph capture):
    :func:`dwise_predict.serving.launcher.serve` does that in SGLang's spawned scheduler processes.
    The pooling buffer is allocated here, once, so the copy into it is captured with the forward
    and every replay writes it.

    Parameters
    ----------
    bundle : a :class:`~dwise_predict.bundles.load.LoadedBundle` (torch backend on the model's
        device) or None for ``r̂ = 0`` (rank by prompt blocks only).
    slots : ``B``, requests per round; match SGLang's batch capacity.
    k : resident-set multiplier; SGLang's ``--max-running-requests`` must be at least ``k * B``.
    kv_budget_tokens : KV tokens available for reservations; default ``kv_fraction`` of the
        scheduler's ``max_total_num_tokens``.
    slack_blocks : extra blocks reserved per resident request.
    features : callable ``req -> (words, newlines, prompt_tokens)`` for admission; SGLang's ``Req``
        keeps token ids, not text, so pass e.g. ``lambda r: featurize(tokenizer.decode(r.origin_input_ids))``.
        Required with a bundle.
    device : torch device of the model (required with a bundle or a recorder).
    block_size : SGLang's dLLM block size (required with a bundle or a recorder; checked against
        the scheduler's config on its first step, and against the bundle's now).
    max_batch : most requests in one forward (the largest captured CUDA-graph batch); the buffer
        has ``max(max_batch, slots)`` rows. A forward with more rows fails loudly.
    hidden_size : the model's hidden size when recording without a bundle.
    recorder : an object with ``decoding`` (what it records SGLang to decode with: checked on the first
        step), ``arrived(req, block_size)``, ``forward(req, prompt, pooled_row, rounds, signals, prompt_row)`` (rows
        as host float32 arrays, or None), its batch forms ``forwards``, ``first_rounds``, and ``finished(req)``
        (:class:`dwise_predict.collectors.live.LiveRecorder`): recording mode.
    prompt_cache : block rows kept for requests that a prefix-cache hit leaves without a prompt
        block of their own (:class:`~dwise_predict.serving.sglang.buffers._PromptRows`; ``prompt_cache`` x H floats on ``device``; 0: none,
        those requests get their leftover prompt rows' mean).
    aging : the policy's starvation guard (:class:`~dwise_predict.serving.policy.DwisePolicy`:
        rounds of remaining work a round in the server is worth; 0: off).
    max_wait : the policy's wait cap in rounds (``DwisePolicy(max_wait=)``; None: off; 0: admission
        in arrival order). Where SGLang's ``SGLANG_REQ_WAITING_TIMEOUT`` is set, the hook lowers it each
        round so a request is admitted before that timeout would abort it
        (:mod:`~dwise_predict.serving.sglang.timeout`), also where it is off.
    monitor_window : finished requests the live quality monitor ranks (:mod:`~dwise_predict.serving.monitor`).
    follow : hot swap: the zoo name or bundle directory whose new versions the hook serves from a step
        boundary on, and its rollback (:class:`~dwise_predict.serving.sglang.follow.Following`), or None.
    resolve : module resolver (tests pass a fake SGLang here).
    """
    _check_arguments(bundle, features, recorder, block_size, device, max_wait, follow)
    prompt_rows = _PromptRows(prompt_cache)
    buffers = None
    if bundle is not None or recorder is not None:
        buffers = _pooling_buffers(bundle, hidden_size, slots, k, max_batch, block_size, device, prompt_rows)
    sglang = ResolvedSglang(resolve)
    hook = DwiseHook(sglang, bundle, features, recorder, slots=slots, k=k, kv_budget_tokens=kv_budget_tokens,
                     kv_fraction=kv_fraction, slack_blocks=slack_blocks, aging=aging, block_size=block_size,
                     prompt_rows=prompt_rows, buffers=buffers, max_wait=max_wait, monitor_window=monitor_window,
                     hot_swap=None if follow is None else HotSwap.of(bundle, follow))
    originals = []
    for owner_name, name, method in PATCHES:
        owner = getattr(sglang, owner_name)
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, _Patched(getattr(hook, method)))
    return Installed(hook, originals)


def _check_arguments(bundle, features, recorder, block_size, device, max_wait=None, follow=None) -> None:
    """What install refuses before it allocates or patches anything."""
    if follow is not None and bundle is None:
        raise ConfigError("following a zoo name or a bundle directory (follow=) needs a bundle to start from: "
                          "pass bundle=")
    whole = isinstance(max_wait, Integral) and not isinstance(max_wait, bool)
    if max_wait is not None and not (whole and max_wait >= 0):
        raise ConfigError(f"max_wait (wait cap) must be a whole number of rounds >= 0 or None (off), got {max_wait!r}")
    if bundle is not None and features is None:
        raise ConfigError("the admission predictor needs prompt features: pass features=callable(req) -> (words, newlines, prompt_tokens)")
    if bundle is not None or recorder is not None:
        missing = [name for name, value in (("block_size", block_size), ("device", device)) if value is None]
        if missing:
            raise ConfigError(f"refinement and recording need {' and '.join(missing)} at install time (the pooling "
                              "buffer is allocated before SGLang captures its CUDA graphs): pass them to install()")
    if bundle is not None and block_size is not None:
        bundle_bs = bundle.manifest.identity.decoding.block_size
        if bundle_bs is not None and int(bundle_bs) != int(block_size):
            raise BundleError(
                f"bundle was trained with block_size {bundle_bs} but SGLang runs {block_size}: "
                "export a bundle for this decoding config"
            )


def _pooling_buffers(bundle, hidden_size, slots, k, max_batch, block_size, device, prompt_rows) -> PoolingBuffers:
    """The pooling buffers of refinement and recording, sized for ``max(max_batch, slots)`` requests a
    forward and ``floor(k * slots)`` resident ones (a row is held from a request's first prompt block
    to its first round)."""
    width = bundle.hidden_size if bundle is not None else hidden_size
    if not width:
        raise ConfigError("recording without a bundle needs hidden_size= (the model's hidden size)")
    return PoolingBuffers(int(width), max(int(max_batch or 0), int(slots)), int(block_size), int(math.floor(k * slots)),
                          prompt_rows, device, bundle.prompt_last_mean if bundle is not None else None)
