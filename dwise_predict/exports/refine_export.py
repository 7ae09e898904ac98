"""The calibrated refinement ensemble as portable graphs: TorchScript, ONNX and a torch.export program.

The exported graph is :class:`FusedRefineGraph`, the same function as
:class:`~dwise_predict.survival.network.RefineGraph` rearranged for speed: the members' first layers
are concatenated into one ``(members * width, 2H + 2 + S)`` GEMM (the first layers are ~97 % of the
FLOPs at H = 2,048, and one large GEMM keeps both cores busier than three small ones) and the
second layers run as one batched matmul, of one column when every round shares its hazard logit
(the closed-form candidates). Everything else — the standardisation, hazards ->
survival in log space, the ensemble mean and the isotonic lookup by comparison count — is the
shared code of ``survival/network.py``, which avoids the ops the ONNX exporters reject
(cumprod, searchsorted, expm1).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dwise_predict.errors import BundleError
from dwise_predict.bundles.manifest import SIGNAL_COUNT
from dwise_predict.names import HIDDEN_STATES
from dwise_predict.survival.network import RefineGraph, isotonic_interp, refine_input

ONNX_OPSET = 18
# int8 weights are kept only while they rank like fp32 (Spearman against the eager outputs)
INT8_MIN_SPEARMAN = 0.999
INPUT_NAMES = (*HIDDEN_STATES, "prompt_tokens", "budget", "early_signals")

OUTPUT_NAME = "remaining_rounds"


class FusedRefineGraph(nn.Module):
    """:class:`RefineGraph` with the members' layers stacked: one GEMM for all first layers.

    Inputs and output are those of :class:`RefineGraph`: ``first_round`` and ``prompt_last`` (B, H)
    raw pooled hidden states, ``prompt_tokens`` (B,), ``budget`` (B,), ``early_signals`` (B, 4) -> (B,)
    calibrated remaining rounds. The members' short units (reading only the last ``short_features``
    input columns) are one more GEMM.
    """

    def __init__(self, graph: RefineGraph):
        super().__init__()
        members = list(graph.members)
        self.num_members = len(members)
        self.width = members[0].fc1.out_features
        short = members[0].fc1_short
        self.short_width = 0 if short is None else short.out_features
        self.short_features = members[0].short_features
        self.register_buffer("input_mean", graph.input_mean.clone())
        self.register_buffer("input_std", graph.input_std.clone())
        self.register_buffer("calib_x", graph.calib_x.clone())
        self.register_buffer("calib_y", graph.calib_y.clone())
        self.prompt_norm = graph.prompt_norm
        self.budget_norm = graph.budget_norm
        with torch.no_grad():  # inference-only weights: buffers, not parameters
            self.register_buffer("w1", torch.cat([m.fc1.weight for m in members], 0).clone())  # (M*W, D)
            self.register_buffer("b1", torch.cat([m.fc1.bias for m in members], 0).clone())  # (M*W,)
            # always present (TorchScript compiles both branches of raw); empty without short units
            self.register_buffer("w1_short", torch.cat([m.fc1_short.weight for m in members], 0).clone()
                                 if self.short_width else torch.zeros(0, self.short_features))  # (M*Ws, Ds)
            self.register_buffer("b1_short", torch.cat([m.fc1_short.bias for m in members], 0).clone()
                                 if self.short_width else torch.zeros(0))  # (M*Ws,)
            w2 = torch.stack([m.fc2.weight.t() for m in members], 0)  # (M, W, K)
            b2 = torch.stack([m.fc2.bias for m in members], 0).unsqueeze(1)  # (M, 1, K)
            # closed-form members (survival/linear.py) give every round the same hazard logit: compute
            # that one column and broadcast it, instead of a K-times larger second layer (with 4,098
            # units at H = 2,048 that layer was most of the work at batch 128)
            if torch.equal(w2, w2[:, :, :1].expand_as(w2)) and torch.equal(b2, b2[:, :, :1].expand_as(b2)):
                w2, b2 = w2[:, :, :1], b2[:, :, :1]
            self.register_buffer("w2", w2.contiguous().clone())  # (M, W, K) or (M, W, 1)
            self.register_buffer("b2", b2.contiguous().clone())  # (M, 1, K) or (M, 1, 1)
        self.num_rounds = members[0].fc2.out_features

    def raw(self, first_round: torch.Tensor, prompt_last: torch.Tensor, prompt_tokens: torch.Tensor,
            budget: torch.Tensor, early_signals: torch.Tensor) -> torch.Tensor:
        """(B,) ensemble mean of expected remaining rounds, before calibration."""
        hidden = torch.cat([first_round, prompt_last], dim=1)
        x = refine_input(hidden, prompt_tokens, budget, early_signals, self.prompt_norm, self.budget_norm)  # (B, D)
        x = (x - self.input_mean) / self.input_std
        h = F.gelu(F.linear(x, self.w1, self.b1)).view(x.shape[0], self.num_members, self.width)  # (B, M, W)
        if self.short_width:
            short = F.linear(x[:, x.shape[1] - self.short_features:], self.w1_short, self.b1_short)  # (B, M*Ws)
            h = torch.cat([h, F.gelu(short).view(x.shape[0], self.num_members, self.short_width)], dim=2)
        h = h.transpose(0, 1)  # (M, B, W + Ws)
        logits = torch.matmul(h, self.w2) + self.b2  # (M, B, K) or (M, B, 1)
        # survival S(j) = prod_{i<=j} sigmoid(-l_i), as a cumulative sum of logs (see network.py)
        log_one_minus_hazard = F.logsigmoid(-logits).expand(-1, -1, self.num_rounds)  # (M, B, K)
        survival = torch.exp(torch.cumsum(log_one_minus_hazard, dim=2))  # (M, B, K)
        return survival.sum(dim=2).mean(dim=0)

    def forward(self, first_round: torch.Tensor, prompt_last: torch.Tensor, prompt_tokens: torch.Tensor,
                budget: torch.Tensor, early_signals: torch.Tensor) -> torch.Tensor:
        raw = self.raw(first_round, prompt_last, prompt_tokens, budget, early_signals)
        return isotonic_interp(raw, self.calib_x, self.calib_y)


def example_inputs(hidden_size: int, batch: int = 4) -> tuple[torch.Tensor, ...]:
    """Placeholder inputs for tracing; batch > 1 so exporters do not specialise the batch axis."""
    return (torch.zeros(batch, hidden_size), torch.zeros(batch, hidden_size), torch.full((batch,), 100.0),
            torch.full((batch,), 256.0),
            torch.full((batch, SIGNAL_COUNT), 0.5))


def export_torchscript(module: nn.Module, path: Path) -> None:
    """Script ``module`` (no tracing: the batch axis stays symbolic) and save it to ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice; torch.export is offered too
        scripted = torch.jit.script(module.eval())
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
    _write(path, buffer)


def _write(path: Path, buffer: io.BytesIO) -> None:
    """Put a serialised graph on disk with Python's own I/O: torch's C++ file writers report a full
    disk as a bare RuntimeError, Python's as ``OSError(ENOSPC)``, which callers turn into one line."""
    path.write_bytes(buffer.getbuffer())


def export_program(module: nn.Module, hidden_size: int, path: Path) -> None:
    """Save a ``torch.export`` program (``.pt2``) with a dynamic batch axis."""
    batch = torch.export.Dim("B")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            module.eval(), example_inputs(hidden_size), dynamic_shapes=({0: batch},) * len(INPUT_NAMES)
        )
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
    _write(path, buffer)


def export_onnx(module: nn.Module, hidden_size: int, path: Path, opset: int = ONNX_OPSET) -> None:
    """Export to one self-contained ONNX file (no external data) with batch axis ``B``.

    Uses the dynamo exporter (torch.export + onnxscript), which handles the graph without
    fallbacks; its progress lines are swallowed so the CLI's stdout stays a result.
    """
    import logging

    batch = torch.export.Dim("B")
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # "torchvision is not installed" notices
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module.eval(),
                example_inputs(hidden_size),
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: batch},) * len(INPUT_NAMES),
                opset_version=opset,
                dynamo=True,
                external_data=False,
                verbose=False,
            )
            proto = program.model_proto.SerializeToString()  # one file, weights inside (bundles are < 2 GB)
    except Exception as err:  # the exporter raises many types; the message is what a user can act on
        raise BundleError(f"ONNX export of the refinement graph failed: {err}") from err
    finally:
        onnx_logger.setLevel(level)
    path.write_bytes(proto)  # outside the exporter's errors: a full disk is an OSError, one line upstream


def quantize_int8(onnx_path: Path, out_path: Path) -> None:
    """Dynamic int8 quantisation of the graph's weights (activations quantised per call).

    About 2x faster than fp32 on AVX-512-VNNI CPUs at every batch size (benchmarks/refine_latency.py);
    callers must check the ranking before keeping it (:data:`INT8_MIN_SPEARMAN`).

    Weights use 7 bits ([-64, 64], ``reduce_range``), as onnxruntime's quantisation guide advises for
    CPUs without VNNI: there its u8 x s8 kernel adds pairs of products in 16 bits, which full-range
    weights overflow (255 * 127 * 2 > 32,767) and 7-bit weights cannot (255 * 64 * 2 < 32,767). The
    integer arithmetic is then exact on every x86 CPU, so a graph that ranks like fp32 where it was
    exported also does on the serving machine that verifies it. With full-range weights the test
    bundle's int8 graph ranked at 0.989 on a 2-core AVX2 machine, where earlier machines kept it
    (>= 0.999): a bundle exported on one would fail `verify` on the other. With 7-bit weights: 0.9994.
    """
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # "consider pre-processing" advice printed on every call
    try:
        quantize_dynamic(str(onnx_path), str(out_path), weight_type=QuantType.QInt8, reduce_range=True)
    finally:
        root.setLevel(level)
