"""The DWISE hook inside SGLang's dLLM scheduler, installed at run time (no edits to SGLang's source).

Pinned release: ``sglang==0.5.23``. :func:`install` patches SGLang's classes in the scheduler
process (:mod:`dwise_predict.serving.launcher` calls it in each of SGLang's spawned schedulers),
before the model runner starts, so the pooling copy is captured in SGLang's CUDA graphs. The parts:

- :mod:`~dwise_predict.serving.sglang.surface`: every SGLang name the hook touches (:data:`SURFACE`),
  checked against the pinned source, and the one object that resolves them at install;
- :mod:`~dwise_predict.serving.sglang.hook`: :class:`~dwise_predict.serving.sglang.hook.DwiseHook`,
  one method per patched entry point (admission, batch formation, result processing, the forward
  and the logits), at the four points of the DWISE paper's §5.1;
- :mod:`~dwise_predict.serving.sglang.requests`: the per-request table (register, forget, reconcile,
  abort), the TP ranks' shared estimates and the hook's counters (:class:`HookStats`);
- :mod:`~dwise_predict.serving.sglang.buffers`: the pooling buffers, allocated once at install, and
  the prompt-row cache;
- :mod:`~dwise_predict.serving.sglang.step`: one step's state, made fresh each step;
- :mod:`~dwise_predict.serving.sglang.signals`: the early signals of a first denoising forward;
- :mod:`~dwise_predict.serving.sglang.timeout`: SGLang's waiting timeout as the policy's wait cap;
- :mod:`~dwise_predict.serving.sglang.follow`: hot swap: a thread that follows a zoo name or a bundle
  directory and loads new bundles, and the step-boundary swap and rollback;
- :mod:`~dwise_predict.serving.sglang.metrics`: the live quality monitor's summary
  (:mod:`~dwise_predict.serving.monitor`) on SGLang's ``/metrics`` and in a recording's manifest;
- :mod:`~dwise_predict.serving.sglang.install`: checks the arguments, builds the hook, patches and
  uninstalls.

No function here is longer than 80 lines and none defines another (``tests/test_code_shape.py``).
"""

from dwise_predict.serving.sglang.buffers import UNWRITTEN
from dwise_predict.serving.sglang.install import Installed, install
from dwise_predict.serving.sglang.requests import HookStats
from dwise_predict.serving.sglang.signals import row_signals
from dwise_predict.serving.sglang.surface import SGLANG_VERSION, SURFACE, read_surface, surface_problems

__all__ = ["SGLANG_VERSION", "SURFACE", "UNWRITTEN", "HookStats", "Installed", "install", "read_surface",
           "row_signals", "surface_problems"]
