"""The LightGBM admission predictor as ONNX, already mapped back from log space.

The run's ``admission.txt`` predicts ``log1p(total_rounds)``. onnxmltools turns its trees into one
``TreeEnsembleRegressor`` (output ``(B, 1)``); we append ``exp(x) - 1`` (``expm1`` is not an ONNX op)
and a reshape so that the graph reads ``features`` float32 ``(B, 3)`` — words, newlines, prompt
tokens, in that order — and returns ``total_rounds`` float32 ``(B,)``, as contract 2 says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dwise_predict.errors import BundleError
from dwise_predict.features.prompt import FEATURE_NAMES
INPUT_NAME = "features"
OUTPUT_NAME = "total_rounds"
# onnxmltools 1.16 emits the default domain at opset 8 and ai.onnx.ml at 1; we raise the default
# domain to 17 for the appended Exp/Sub/Reshape (all unchanged across 13..21).
ONNX_OPSET = 17


def load_booster(path: Path, text: bytes | None = None):
    """Read a LightGBM text model (``text``: its bytes, already read) once it passes
    :func:`~dwise_predict.admission.model_text.check_model_text`; a corrupt or hostile file becomes a
    :class:`BundleError` naming it."""
    import lightgbm

    from dwise_predict.admission.model_text import check_model_text

    checked = check_model_text(path.read_bytes() if text is None else text, str(path), BundleError)
    try:
        return lightgbm.Booster(model_str=checked)
    except lightgbm.basic.LightGBMError as err:
        raise BundleError(f"{path} is not a readable LightGBM text model ({str(err).splitlines()[0]})") from None


def predict_total_rounds(booster, features: np.ndarray) -> np.ndarray:
    """(B, 3) features -> (B,) predicted total rounds (LightGBM's log1p prediction mapped back)."""
    return np.expm1(booster.predict(np.asarray(features, dtype=np.float64)))


def admission_to_onnx(model_path: Path, out_path: Path) -> None:
    """Convert ``admission.txt`` to ``admission.onnx`` with the contract-2 signature."""
    import onnx
    import onnxmltools
    from onnx import TensorProto, helper
    from onnxmltools.convert.common.data_types import FloatTensorType

    booster = load_booster(model_path)
    if booster.num_feature() != len(FEATURE_NAMES):
        raise BundleError(
            f"{model_path} expects {booster.num_feature()} features, the admission contract has "
            f"{len(FEATURE_NAMES)} ({', '.join(FEATURE_NAMES)}): re-run `dwise-predict train`"
        )
    model = onnxmltools.convert_lightgbm(booster, initial_types=[(INPUT_NAME, FloatTensorType([None, 3]))], target_opset=15)
    graph = model.graph
    log_out = graph.output[0].name  # (B, 1) log1p(total rounds)
    graph.initializer.extend(
        [
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("flat", TensorProto.INT64, [1], [-1]),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Exp", [log_out], ["exp_log"]),
            helper.make_node("Sub", ["exp_log", "one"], ["rounds_2d"]),
            helper.make_node("Reshape", ["rounds_2d", "flat"], [OUTPUT_NAME]),
        ]
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["B"]))
    graph.input[0].type.tensor_type.shape.dim[0].dim_param = "B"
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = ONNX_OPSET
    model.producer_name = "dwise-predict"
    graph.name = "admission"  # onnxmltools draws a random uuid; a fixed name keeps exports byte-identical
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(out_path))
