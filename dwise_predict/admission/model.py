"""The admission predictor: LightGBM on three prompt features, target ``log1p(total rounds)``.

Batch prediction goes through LightGBM's own ``Booster.predict``. One request at admission time goes
through :meth:`AdmissionModel.predict_one`: the trees, parsed into flat arrays, are compiled into one
straight-line Python function of nested comparisons (what m2cgen and treelite do in C), which skips
LightGBM's per-call overhead (~15-70 µs) and runs in a few µs. It sums the same float64 leaf values
in the same tree order as LightGBM, so it returns bit-identical results
(``tests/test_train_admission.py`` checks this).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dwise_predict.admission.model_text import check_model_text
from dwise_predict.errors import InputError
from dwise_predict.features.prompt import FEATURE_NAMES
from dwise_predict.files import atomic_write_text, read_json_object

MODEL_FILE = "admission.txt"
SPEC_FILE = "admission.json"
TARGET = "log1p(total_rounds)"
_ZERO = 1e-35  # LightGBM's kZeroThreshold: |x| below it counts as zero for missing_type "Zero"


class AdmissionModel:
    """LightGBM regressor of total denoising rounds on (words, newlines, prompt tokens).

    Parameters
    ----------
    n_estimators : boosting rounds (trees).
    num_leaves : leaves per tree at most.
    learning_rate : shrinkage per tree.
    min_child_samples : fewest training requests in a leaf.
    seed : LightGBM's seed (bagging and feature sampling are off, so it matters only for ties).
    num_threads : LightGBM threads; fixed so results do not depend on the machine.
    """

    def __init__(
        self,
        n_estimators: int = 100,
        num_leaves: int = 15,
        learning_rate: float = 0.1,
        min_child_samples: int = 20,
        seed: int = 0,
        num_threads: int = 1,
    ):
        self.n_estimators = n_estimators
        self.num_leaves = num_leaves
        self.learning_rate = learning_rate
        self.min_child_samples = min_child_samples
        self.seed = seed
        self.num_threads = num_threads

    def params(self) -> dict:
        """LightGBM parameters, deterministic: fixed threads, row-wise histograms, one seed."""
        return {
            "objective": "regression",
            "num_leaves": self.num_leaves,
            "learning_rate": self.learning_rate,
            "min_child_samples": self.min_child_samples,
            "seed": self.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": self.num_threads,
            "verbose": -1,
        }

    def fit(self, features: np.ndarray, total_rounds: np.ndarray) -> "AdmissionModel":
        """Fit on features (N, 3) = words, newlines, prompt tokens and total rounds (N,) >= 0."""
        import lightgbm as lgb

        x = _check_features(features)
        y = np.asarray(total_rounds, dtype=np.float64).ravel()
        if y.shape[0] != x.shape[0]:
            raise InputError(f"{x.shape[0]} feature rows but {y.shape[0]} round counts: pass one per request")
        if not np.isfinite(y).all() or (y < 0).any():
            raise InputError("total rounds must be finite and >= 0")
        if x.shape[0] < 2:
            raise InputError(f"admission model needs at least 2 training requests, got {x.shape[0]}")
        data = lgb.Dataset(x, np.log1p(y), feature_name=list(FEATURE_NAMES), params={"verbose": -1})
        self.booster_ = lgb.train(self.params(), data, num_boost_round=self.n_estimators)
        self._compile()
        return self

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted total rounds, array of shape (N,) float64 (``expm1`` of the model's log output)."""
        x = _check_features(features)
        return np.expm1(self.booster_.predict(x, num_threads=self.num_threads))

    def predict_one(self, words: float, newlines: float, prompt_tokens: float) -> float:
        """Predicted total rounds of one request: the compiled fast path (bit-identical to predict)."""
        # np.expm1, not math.expm1: the two differ in the last bit for some inputs
        return float(np.expm1(self._tree_sum(float(words), float(newlines), float(prompt_tokens))))

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``admission.txt`` (LightGBM text) and ``admission.json`` atomically into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / MODEL_FILE, self.booster_.model_to_string())
        spec = {
            "features": list(FEATURE_NAMES),
            "target": TARGET,
            "params": {"n_estimators": self.n_estimators, **self.params()},
        }
        atomic_write_text(directory / SPEC_FILE, json.dumps(spec, indent=2, sort_keys=True) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "AdmissionModel":
        """Read a model written by :meth:`save` (needs ``admission.txt``; ``admission.json`` if present)."""
        import lightgbm as lgb

        directory = Path(directory)
        if not (directory / MODEL_FILE).is_file():
            raise InputError(f"{directory} has no {MODEL_FILE}: train one with `dwise-predict train`")
        params = {}
        if (directory / SPEC_FILE).is_file():
            spec = read_json_object(directory / SPEC_FILE, InputError, fix="retrain it with `dwise-predict train`")
            if spec.get("features") != list(FEATURE_NAMES) or spec.get("target") != TARGET:
                raise InputError(
                    f"{directory / SPEC_FILE} describes features {spec.get('features')} and target "
                    f"{spec.get('target')!r}; this version reads {list(FEATURE_NAMES)} -> {TARGET}"
                )
            params = spec.get("params", {})
        keys = ("n_estimators", "num_leaves", "learning_rate", "min_child_samples", "seed", "num_threads")
        init = {k: params[k] for k in keys if k in params}
        model = cls(**init)
        # checked first: LightGBM's parser and the tree compiler trust the text (model_text)
        text = check_model_text((directory / MODEL_FILE).read_bytes(), str(directory / MODEL_FILE), InputError)
        model.booster_ = lgb.Booster(model_str=text)
        model._compile()
        return model

    def _compile(self) -> None:
        """Flatten the trees into arrays (``trees_``) and compile them into ``_tree_sum``."""
        self.trees_ = flatten_trees(self.booster_.dump_model())
        self._tree_sum = compile_trees(self.trees_)


def flatten_trees(dump: dict) -> dict[str, np.ndarray]:
    """LightGBM's ``dump_model()`` -> flat node arrays over all trees.

    Returns
    -------
    dict with ``roots`` (T,) node index of each tree's root, and per node (M,): ``feature`` (-1 at a
    leaf), ``threshold``, ``left``, ``right`` (-1 at a leaf), ``default_left`` (bool), ``missing``
    (0 None, 1 Zero, 2 NaN), ``value`` (leaf value, 0 inside).
    """
    cols: dict[str, list] = {k: [] for k in ("feature", "threshold", "left", "right", "default_left", "missing", "value")}
    missing_code = {"None": 0, "Zero": 1, "NaN": 2}

    def add(node: dict) -> int:
        i = len(cols["feature"])
        for k in cols:
            cols[k].append(0)
        if "leaf_value" in node:
            cols["feature"][i], cols["left"][i], cols["right"][i] = -1, -1, -1
            cols["value"][i] = float(node["leaf_value"])
            return i
        if node.get("decision_type", "<=") != "<=":
            raise InputError("admission model has a categorical split; it was not trained by dwise-predict")
        cols["feature"][i] = int(node["split_feature"])
        cols["threshold"][i] = float(node["threshold"])
        cols["default_left"][i] = bool(node.get("default_left", True))
        cols["missing"][i] = missing_code[node.get("missing_type", "None")]
        cols["left"][i] = add(node["left_child"])
        cols["right"][i] = add(node["right_child"])
        return i

    roots = [add(tree["tree_structure"]) for tree in dump["tree_info"]]
    return {
        "roots": np.asarray(roots, dtype=np.int64),
        "feature": np.asarray(cols["feature"], dtype=np.int64),
        "threshold": np.asarray(cols["threshold"], dtype=np.float64),
        "left": np.asarray(cols["left"], dtype=np.int64),
        "right": np.asarray(cols["right"], dtype=np.int64),
        "default_left": np.asarray(cols["default_left"], dtype=bool),
        "missing": np.asarray(cols["missing"], dtype=np.int64),
        "value": np.asarray(cols["value"], dtype=np.float64),
    }


def compile_trees(trees: dict[str, np.ndarray]):
    """Flat tree arrays -> a function ``f(x0, x1, x2) -> float`` summing the trees' leaf values.

    The generated source holds only numeric literals written with ``repr`` (exact float64 round
    trip), nested ``if``/``else`` per tree, and one running sum in tree order, as LightGBM sums.
    """
    feature, threshold = trees["feature"], trees["threshold"]
    left, right, value = trees["left"], trees["right"], trees["value"]
    lines = ["def tree_sum(x0, x1, x2):", "    s = 0.0"]

    def condition(n: int) -> str:
        x, thr = f"x{feature[n]}", repr(float(threshold[n]))
        if trees["missing"][n] == 1:  # Zero: values at zero take the default branch
            go = "True" if trees["default_left"][n] else "False"
            return f"({go} if -{_ZERO!r} <= {x} <= {_ZERO!r} else {x} <= {thr})"
        if trees["missing"][n] == 2:  # NaN: NaN takes the default branch
            go = "True" if trees["default_left"][n] else "False"
            return f"({x} <= {thr} if {x} == {x} else {go})"
        return f"{x} <= {thr}"

    def emit(n: int, depth: int) -> None:
        pad = "    " * depth
        if left[n] < 0:
            lines.append(f"{pad}s += {float(value[n])!r}")
            return
        lines.append(f"{pad}if {condition(n)}:")
        emit(int(left[n]), depth + 1)
        lines.append(f"{pad}else:")
        emit(int(right[n]), depth + 1)

    for root in trees["roots"]:
        emit(int(root), 1)
    lines.append("    return s")
    namespace: dict = {}
    exec(compile("\n".join(lines) + "\n", "<admission-trees>", "exec"), namespace)  # numeric literals only
    return namespace["tree_sum"]


def _check_features(features) -> np.ndarray:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURE_NAMES):
        raise InputError(f"admission features must have shape (N, 3) = {FEATURE_NAMES}, got {x.shape}")
    if not np.isfinite(x).all():
        raise InputError("admission features hold NaN or inf: drop or fix those requests")
    return x
