"""Check a LightGBM text model before LightGBM's parser or our tree compiler reads it.

``admission.txt`` travels in bundles and run directories that may come from someone else. LightGBM's
C++ parser trusts the file: a child index out of range reads outside its arrays, a cycle of children
loops forever, a split on feature 7 of a 3-feature model reads past the row, a huge ``num_leaves``
allocates that much; its Python wrapper ``json.loads`` the last line; and
:func:`~dwise_predict.admission.model.compile_trees` nests one ``if`` per tree level (Python's
compiler stops near 100 levels). So a model is read only when it is a plain regression model of at
most :data:`MAX_TREES` trees over the three admission features, each a proper binary tree of at most
:data:`MAX_LEAVES` leaves and depth :data:`MAX_DEPTH`, :data:`MAX_TOTAL_LEAVES` leaves in all, with finite numbers, no categorical or linear
leaves, lines of at most :data:`MAX_LINE` characters. Models dwise-predict trains (100 trees of 15
leaves) are far inside. Standard library only.
"""

from __future__ import annotations

import math

from dwise_predict.features.prompt import FEATURE_NAMES

MAX_BYTES = 64 << 20
MAX_LINE = 1 << 20
MAX_TREES = 10_000
MAX_LEAVES = 131_072  # LightGBM's own upper bound of num_leaves
MAX_DEPTH = 64  # compile_trees indents one level per depth; Python refuses past ~100
# leaves over all trees: compile_trees writes a line per node, and 4,000 trees of 256 leaves (inside
# the limits above) took minutes to flatten and compile; `train` refuses admission_trees x
# admission_leaves past this (its default, 100 x 15, is 1,500), so every model it writes loads
MAX_TOTAL_LEAVES = 1 << 16
# tree-block keys whose values are arrays, with how many entries (per num_leaves n) and their type
_ARRAYS = {"split_feature": (-1, int), "threshold": (-1, float), "decision_type": (-1, int),
           "left_child": (-1, int), "right_child": (-1, int), "leaf_value": (0, float)}


def check_model_text(data: bytes | str, where: str, error: type[Exception]) -> str:
    """Return the model text when it is within the limits above; else raise ``error`` (a typed
    error class) naming ``where`` and the first problem."""

    def refuse(problem: str):
        raise error(f"{where}: {problem}: refusing to read it as a LightGBM model; re-export or retrain it, "
                    "or get it again from a source you trust")

    if len(data) > MAX_BYTES:
        refuse(f"{len(data):,} bytes, more than the {MAX_BYTES:,} an admission model may hold")
    try:
        text = data.decode("ascii") if isinstance(data, bytes) else data
        text.encode("ascii")
    except UnicodeError:
        refuse("it is not ASCII text")
    lines = text.split("\n")
    longest = max(lines, key=len)
    if len(longest) > MAX_LINE:
        refuse(f"a line of {len(longest):,} characters (at most {MAX_LINE:,})")
    if lines[0] != "tree":
        refuse("it does not start with LightGBM's 'tree' line")
    header, trees, total_leaves, i = {}, 0, 0, 1
    while i < len(lines) and not lines[i].startswith("Tree="):
        key, _, value = lines[i].partition("=")
        header[key] = value
        i += 1
    expected = {"num_class": "1", "num_tree_per_iteration": "1", "max_feature_idx": str(len(FEATURE_NAMES) - 1)}
    for key, value in expected.items():
        if header.get(key) != value:
            refuse(f"{key} is {header.get(key)!r}, not {value} (a regression on the {len(FEATURE_NAMES)} admission features)")
    while i < len(lines) and lines[i].startswith("Tree="):
        block = {}
        i += 1
        while i < len(lines) and lines[i]:
            key, _, value = lines[i].partition("=")
            block[key] = value
            i += 1
        trees += 1
        if trees > MAX_TREES:
            refuse(f"more than {MAX_TREES:,} trees")
        total_leaves += _check_tree(block, trees - 1, refuse)
        if total_leaves > MAX_TOTAL_LEAVES:
            refuse(f"more than {MAX_TOTAL_LEAVES:,} leaves over its first {trees:,} trees (train writes at most "
                   f"that many: admission_trees x admission_leaves)")
        while i < len(lines) and not lines[i]:
            i += 1
    if trees == 0 or i >= len(lines) or lines[i] != "end of trees":
        refuse("no trees, or no 'end of trees' line after them")
    tail = [line for line in lines[i:] if line.startswith("pandas_categorical:")]
    if any(line != "pandas_categorical:null" for line in tail):
        refuse("it records pandas categories, which admission models never have")
    return text


def _check_tree(block: dict[str, str], index: int, refuse) -> int:
    """Check one tree's block; return its number of leaves."""
    name = f"tree {index}"
    try:
        leaves = int(block.get("num_leaves", ""))
    except ValueError:
        refuse(f"{name} has no integer num_leaves")
    if not 1 <= leaves <= MAX_LEAVES:
        refuse(f"{name} has {leaves:,} leaves (1 to {MAX_LEAVES:,})")
    if block.get("num_cat", "0") != "0" or block.get("is_linear", "0") != "0":
        refuse(f"{name} has categorical splits or linear leaves")
    arrays = {}
    for key, (offset, kind) in _ARRAYS.items():
        if leaves == 1 and key != "leaf_value":
            continue
        try:
            values = [kind(v) for v in block.get(key, "").split()]
        except ValueError:
            refuse(f"{name}: {key} holds something that is not a number")
        if len(values) != leaves + offset:
            refuse(f"{name}: {key} has {len(values)} entries, num_leaves {leaves} needs {leaves + offset}")
        if kind is float and not all(math.isfinite(v) for v in values):
            refuse(f"{name}: {key} holds NaN or infinity")
        arrays[key] = values
    if not math.isfinite(float(block.get("shrinkage", "1") or "nan")):
        refuse(f"{name}: shrinkage is not a finite number")
    if leaves == 1:
        return leaves
    if any(not 0 <= f < len(FEATURE_NAMES) for f in arrays["split_feature"]):
        refuse(f"{name} splits on a feature outside 0..{len(FEATURE_NAMES) - 1}")
    # decision_type bits: 1 categorical (never), 2 default-left, 4-8 missing type (0 none, 1 zero, 2 NaN)
    if any(d < 0 or d > 15 or d & 1 or (d >> 2) & 3 == 3 for d in arrays["decision_type"]):
        refuse(f"{name} has a decision type LightGBM never writes for numeric splits")
    # children: an internal node i >= 0, a leaf ~j (-1 - j); every node but the root reached once,
    # every leaf once, no cycle, depth bounded
    seen_nodes, seen_leaves, stack = {0}, set(), [(0, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            refuse(f"{name} is deeper than {MAX_DEPTH} levels")
        for child in (arrays["left_child"][node], arrays["right_child"][node]):
            if child >= 0:
                if child >= leaves - 1 or child in seen_nodes:
                    refuse(f"{name}: node {node} has child {child}, out of range or reached twice (not a tree)")
                seen_nodes.add(child)
                stack.append((child, depth + 1))
            else:
                leaf = -1 - child
                if leaf >= leaves or leaf in seen_leaves:
                    refuse(f"{name}: node {node} has leaf {leaf}, out of range or reached twice (not a tree)")
                seen_leaves.add(leaf)
    if len(seen_nodes) != leaves - 1 or len(seen_leaves) != leaves:
        refuse(f"{name}: some nodes or leaves are unreachable (not a tree)")
    return leaves
