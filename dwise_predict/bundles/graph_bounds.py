"""Bound what a bundle's ONNX graph can make onnxruntime compute, before anything runs it.

An ONNX graph is a program: a ``Loop`` of 2^62 iterations never ends, a ``ConstantOfShape`` of
800M floats allocates 3.2 GB, a tensor whose dims claim 300M floats is allocated whatever the file
holds, and broadcasting ``[B, 1]`` against ``[1, B]`` squares the batch. So a graph is run only when:

- every operator is one our exporters emit (:data:`REFINE_OPS` for ``refine.onnx`` and
  ``refine.int8.onnx``, :data:`ADMISSION_OPS` for ``admission.onnx``): no control flow
  (``Loop``, ``If``, ``Scan``), no ``Range`` or ``NonZero``, no custom domain, no local function,
  no subgraph;
- every constant's dims agree with the bytes it holds, and all constants together hold no more
  numbers than the bundle's own weights (``refine.safetensors``; for the admission graph, the
  numbers of ``admission.txt``) and its calibration knots;
- ONNX's own shape inference (which reads the graph and runs nothing) gives every value a shape of
  known sizes but for at most one batch-sized axis, whose other axes hold no more than
  :func:`row_budget` numbers per request (a ``ConstantOfShape`` or ``Expand`` to a constant shape
  is held to the constants' budget, one to a shape computed from the inputs' values is refused):
  every tensor a run allocates is then at most the batch times a size the manifest declares.

The screen (:func:`~dwise_predict.bundles.screen.check_onnx`) calls :func:`check_graph_bounds` with
the parsed model; ``onnx`` is imported by the caller.
"""

from __future__ import annotations

from dwise_predict.errors import BundleError
from dwise_predict.bundles.manifest import FIX, printable

# What torch's dynamo exporter and onnxruntime's dynamic quantisation write for FusedRefineGraph
# (tests/test_hostile_bundles.py exports one and checks that it holds nothing else), with close
# relatives so a refactoring of the graph need not reopen this list. None loops or branches; the
# sizes of what Expand, ConstantOfShape and Tile create are bounded by the shape check.
REFINE_OPS = frozenset("""
    Abs Add And Cast Ceil Clip Concat ConstantOfShape CumSum Div DynamicQuantizeLinear Equal Erf Exp Expand Flatten Floor
    Gather GatherElements GatherND Gemm Greater GreaterOrEqual Identity Less LessOrEqual Log LogSoftmax
    MatMul MatMulInteger Max Mean Min Mul Neg Not Or Pow Reciprocal ReduceLogSumExp ReduceMax ReduceMean
    ReduceMin ReduceSum Relu Reshape Round Shape Sigmoid Sign Slice Softmax Softplus Sqrt Squeeze Sub Tanh
    Tile Transpose Unsqueeze Where
""".split())
# onnxmltools' LightGBM converter, then our exp(x) - 1 and the reshape to [B]
ADMISSION_OPS = frozenset({"TreeEnsembleRegressor", "Identity", "Exp", "Sub", "Add", "Mul", "Reshape", "Cast",
                           "Squeeze", "Flatten"})
ML_DOMAIN = "ai.onnx.ml"
BATCH = "B"
SLACK = 1 << 12  # small constants (axes, shapes, scalars) beside the weights
# numbers of each element type, per byte of raw_data
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


def check_graph_bounds(model, where: str, ops: frozenset, number_budget: int, row_numbers: int) -> None:
    """Refuse ``model`` (a parsed ``onnx.ModelProto``) unless it is bounded (the module docstring):
    operators in ``ops``, constants holding at most ``number_budget`` numbers, every value at most
    one batch axis times ``row_numbers``."""
    _check_operators(model, where, ops)
    _check_constants(model, where, number_budget)
    _check_shapes(model, where, max(number_budget, SLACK), row_numbers)


def _refuse(where: str, problem: str):
    raise BundleError(f"{where}: {problem}, which our exported graphs never do: refusing to run it; {FIX}")


def _check_operators(model, where: str, ops: frozenset) -> None:
    if len(model.functions):
        _refuse(where, f"it defines {len(model.functions)} local functions")
    foreign = {entry.domain for entry in model.opset_import} - {"", "ai.onnx"}
    foreign -= {ML_DOMAIN} if "TreeEnsembleRegressor" in ops else set()
    if foreign:
        _refuse(where, f"it imports the operator set {printable(sorted(foreign)[0])}")
    for node in model.graph.node:
        domain = node.domain or ""
        if node.op_type not in ops or domain not in ("", "ai.onnx", ML_DOMAIN) or (domain == ML_DOMAIN) != (
                node.op_type == "TreeEnsembleRegressor"):
            _refuse(where, f"it calls the operator {printable(':'.join(filter(None, (domain, node.op_type))))}")
        if any(a.HasField("g") or len(a.graphs) for a in node.attribute):
            _refuse(where, f"its {printable(node.op_type)} node holds a subgraph")


def _numbers(dims) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def _check_constants(model, where: str, budget: int) -> None:
    """Every initializer and node-attribute tensor: dims that agree with its data, and all of them
    together at most ``budget`` numbers (the tree ensemble's node lists count too)."""
    tensors = list(model.graph.initializer)
    attribute_numbers = 0
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                tensors.append(attribute.t)
            tensors.extend(attribute.tensors)
            if len(attribute.sparse_tensors) or attribute.HasField("sparse_tensor"):
                _refuse(where, f"its {printable(node.op_type)} node holds a sparse tensor")
            attribute_numbers += len(attribute.ints) + len(attribute.floats) + len(attribute.strings)
    if len(model.graph.sparse_initializer):
        _refuse(where, "it holds sparse initializers")
    total = attribute_numbers
    for tensor in tensors:
        if any(d < 0 for d in tensor.dims):
            _refuse(where, f"tensor {printable(tensor.name)} has a negative dimension")
        numbers = _numbers(tensor.dims)
        total += numbers
        if total > budget:
            raise BundleError(f"{where}: tensor {printable(tensor.name)} {list(tensor.dims)} brings its constants to "
                              f"{total:,} numbers, more than the {budget:,} this bundle's weights hold: refusing "
                              f"to run it; {FIX}")
        _check_data_length(tensor, numbers, where)


def _check_data_length(tensor, numbers: int, where: str) -> None:
    """A tensor's data must be exactly what its dims and type say (onnxruntime allocates by the dims)."""
    item = _ITEM_BYTES.get(tensor.data_type)
    if item is None:
        _refuse(where, f"tensor {printable(tensor.name)} has element type {tensor.data_type}")
    if tensor.raw_data:
        held = len(tensor.raw_data) // item if len(tensor.raw_data) % item == 0 else -1
    else:
        held = sum(len(field) for field in (tensor.float_data, tensor.int32_data, tensor.int64_data,
                                            tensor.double_data, tensor.uint64_data))
    if held != numbers:
        raise BundleError(f"{where}: tensor {printable(tensor.name)} declares {list(tensor.dims)} ({numbers:,} numbers) "
                          f"but holds {max(held, 0):,}: refusing to run it; {FIX}")


def _check_shapes(model, where: str, constant_numbers: int, row_numbers: int) -> None:
    """ONNX shape inference over a copy whose inputs share one batch axis ``B``: every value must
    come out with known sizes but for at most one axis of size ``B``, and hold at most
    ``row_numbers`` numbers per request (``constant_numbers`` for a value with no batch axis).

    Any other unknown size (a ``Range``, or an ``Expand`` to a shape computed from the inputs'
    values) is refused: only the batch is known to be bounded. A ``Reshape`` to ``-1`` keeps its
    input's numbers, so where its input has one ``B`` axis and the other axes of both hold as many
    numbers, its unknown axis is ``B`` too, and inference is run again with that said (our graph
    reshapes ``[B, members x width]`` to ``[-1, members, width]``).
    """
    import onnx
    from onnx import helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.ClearField("value_info")
    for value in copy.graph.input:
        dims = value.type.tensor_type.shape.dim
        if len(dims) and not dims[0].HasField("dim_value"):
            dims[0].dim_param = BATCH  # one batch size feeds every input
    for node in copy.graph.node:  # onnx has no shape inference for ai.onnx.ml's tree ensemble
        if node.op_type == "TreeEnsembleRegressor":
            targets = next((a.i for a in node.attribute if a.name == "n_targets"), 1)
            copy.graph.value_info.append(helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT,
                                                                       [BATCH, targets]))
    reshapes = [node for node in copy.graph.node if node.op_type == "Reshape"]
    for _ in range(len(reshapes) + 1):
        shapes = _inferred_shapes(copy, where)
        batched = [_batched_reshape(node, shapes) for node in reshapes]
        hints = [(node.output[0], dims) for node, dims in zip(reshapes, batched) if dims is not None]
        if not hints:
            break
        for name, dims in hints:
            copy.graph.value_info.append(helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, dims))
    for node in model.graph.node:
        for name in filter(None, node.output):
            _check_value(shapes.get(name), name, where, constant_numbers, row_numbers)


def _inferred_shapes(model, where: str) -> dict[str, list | None]:
    """Every value's inferred dims (an int, a symbol or None for no symbol; the list None: no shape)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BundleError(f"{where}: ONNX shape inference fails on it ({printable(first, 160, quoted=False)}): "
                          f"refusing to run it; {FIX}") from None
    shapes = {}
    for value in (*inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        shapes[value.name] = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                               for d in tensor.shape.dim] if tensor.HasField("shape") else None)
    return shapes


def _batched_reshape(node, shapes: dict) -> list | None:
    """The dims of a Reshape's output with its one unknown axis named ``B``, where it must be (see
    :func:`_check_shapes`); None where it is not, or is already."""
    out, source = shapes.get(node.output[0]), shapes.get(node.input[0])
    if out is None or source is None:
        return None
    unknown = [i for i, d in enumerate(out) if not isinstance(d, int)]
    if len(unknown) != 1 or out[unknown[0]] == BATCH or [d for d in source if not isinstance(d, int)] != [BATCH]:
        return None
    if _numbers(d for d in source if isinstance(d, int)) != _numbers(d for d in out if isinstance(d, int)):
        return None
    return [BATCH if i == unknown[0] else d for i, d in enumerate(out)]


def _check_value(dims: list | None, name: str, where: str, constant_numbers: int, row_numbers: int) -> None:
    if dims is None:
        _refuse(where, f"the shape of {printable(name)} cannot be known before it runs")
    unknown = [d for d in dims if not isinstance(d, int)]
    if any(d != BATCH for d in unknown):
        _refuse(where, f"{printable(name)} has an axis whose size depends on the values it is given")
    if len(unknown) > 1:
        _refuse(where, f"{printable(name)} has {len(unknown)} batch-sized axes (a batch times a batch)")
    numbers = _numbers(d for d in dims if isinstance(d, int))
    limit = row_numbers if unknown else constant_numbers
    if numbers > limit:
        per = " per request" if unknown else ""
        raise BundleError(f"{where}: {printable(name)} would hold {numbers:,} numbers{per}, more than the {limit:,} "
                          f"this bundle's declared sizes allow: refusing to run it; {FIX}")


def row_budget(spec: dict) -> int:
    """How many numbers per request a refinement graph may hold in one value: a few times its
    widest legitimate row (the input, every member's hidden units, every member's round hazards)."""
    sizes = [spec.get(key, 0) for key in ("in_features", "members", "width", "short_width", "num_rounds")]
    if not all(type(s) is int and s >= 0 for s in sizes):
        raise BundleError(f"bundle.json: inputs.refine's sizes are not all counts: {FIX}")
    in_features, members, width, short_width, rounds = sizes
    return 4 * (in_features + members * (width + short_width + rounds)) + SLACK
