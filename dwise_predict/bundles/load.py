"""Load a predictor bundle (contract 2) for a scheduler: admission and refinement, batched.

Imports only the standard library and NumPy at module level; onnxruntime (``backend="onnx"``) or
torch (``backend="torch"``) is imported when a bundle is loaded. Never imports LightGBM,
scikit-learn or the training code, so a serving process stays lean.

Loading refuses, with a :class:`~dwise_predict.errors.BundleError` that names the problem:

- a bundle whose model fingerprint (``weights_sha256``, ``config_hash``, ``hidden_size``) or
  decoding config (``algorithm``, ``algorithm_config``, ``block_size``, ``engine``) differs from what
  the caller serves;
- any file listed in ``bundle.json`` that is missing or fails its size/sha256 check, and any
  bundle or file that :mod:`dwise_predict.bundles.screen` refuses (a link, a planted name, ONNX
  external data, declared shapes the files do not have, a hostile TorchScript archive). All of this
  runs before anything is deserialised, and each file is loaded from the very bytes that were checked.

The torch backend rebuilds the refinement graph from ``refine.safetensors`` + ``calibration.json``
by default (plain arrays: nothing executable is read); ``torchscript=True`` loads ``refine.pt``
instead, once its pickles and code have passed the screen.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dwise_predict.errors import BundleError, InputError
from dwise_predict.bundles.manifest import FIX, SIGNAL_COUNT, BundleIdentity, BundleManifest
from dwise_predict.bundles.screen import open_bundle, read_calibration, read_checked, screen_bundle
from dwise_predict.names import BUNDLE_DECODING_KEYS, HIDDEN_STATES, MODEL_KEYS

BACKENDS = ("onnx", "torch")
PROBE_ROWS = 64  # probes a load runs through both graphs (every export stores 64)
REFINE_INPUTS = (*HIDDEN_STATES, "prompt_tokens", "budget", "early_signals")  # refine()'s order, as the probes name them


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def check_compatible(identity: BundleIdentity, expect_model: dict | None, expect_decoding: dict | None,
                     where: str) -> None:
    """Refuse a bundle trained for another model or decoding config.

    Only keys the caller gives (non-None) are compared, so a server that knows its config hash but
    not its weights hash can still check what it knows.
    """
    for section, expected, keys in (("model", expect_model, MODEL_KEYS), ("decoding", expect_decoding, BUNDLE_DECODING_KEYS)):
        if not expected:
            continue
        have = getattr(identity, section)  # its attributes are these keys
        for key in keys:
            want = expected.get(key)
            if want is None:
                continue
            if not _same(getattr(have, key), want):
                raise BundleError(
                    f"bundle {where} was built for another {section} ({section}.{key} = {getattr(have, key)!r}, "
                    f"model '{identity.model.name}') but the served one has {key} = {want!r}: export a bundle for this "
                    f"model and decoding config (`dwise-predict export`)"
                )


class LoadedBundle:
    """A bundle ready for the scheduler: ``admission`` on the CPU, ``refine`` on ``device``.

    Attributes
    ----------
    manifest : the checked ``bundle.json`` (:class:`~dwise_predict.bundles.manifest.BundleManifest`).
    hidden_size : H, the width of ``first_round`` and of ``prompt_last`` that :meth:`refine` expects.
    prompt_last_mean : float32 (H,), the training requests' mean ``prompt_last`` (the graph's input
        standardisation, ``refine.safetensors``): what to pass for a request whose prompt rows the
        engine never computed (its standardised input is then zero, the training average).
    """

    def __init__(self, path: Path, manifest: BundleManifest, device: str, backend: str, torchscript: bool):
        self.path = path
        self.manifest = manifest
        self.device = device
        self.backend = backend
        self.hidden_size = manifest.hidden_size
        from safetensors.numpy import load

        weights = load(read_checked(path, manifest, "refine.safetensors"))  # input_mean: [first_round | prompt_last | short]
        self.prompt_last_mean = weights["input_mean"][self.hidden_size:2 * self.hidden_size].astype(np.float32)
        self._admission = _ort_session(path, manifest, "admission.onnx", "cpu")
        if backend == "onnx":
            self._refine = _ort_session(path, manifest, "refine.onnx", device)
        else:
            self._refine = _torch_refine(path, manifest, device, torchscript)
        self._check_probe_estimates()

    def _check_probe_estimates(self) -> None:
        """Run both graphs on the bundle's own probes (at most :data:`PROBE_ROWS` rows): a bundle
        whose estimates are not one finite number per request is refused now, not fed to a scheduler
        (verify compares them with the stored outputs; this only asks that they be estimates)."""
        from safetensors.numpy import load

        probes = load(read_checked(self.path, self.manifest, self.manifest.probes))
        rows = slice(0, PROBE_ROWS)
        inputs = [probes[f"refine.{name}"][rows] for name in REFINE_INPUTS]
        for graph, run, args in (("admission.onnx", self.admission, [probes["admission.features"][rows]]),
                                 ("the refinement graph", self.refine, inputs)):
            try:
                estimates = np.asarray(run(*args))
            except (BundleError, InputError):
                raise
            except Exception as err:  # onnxruntime's and torch's own types: a graph that fails on its probes
                raise BundleError(f"{self.path}: {graph} fails on the bundle's own probes ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}): {FIX}") from None
            if not np.isfinite(estimates).all():
                raise BundleError(f"{self.path}: {graph} gives NaN or infinite estimates for "
                                  f"{int((~np.isfinite(estimates)).sum())} of {len(estimates)} of the bundle's own "
                                  f"probes: refusing to serve them; {FIX}")

    # --- admission -----------------------------------------------------------------------------

    def admission(self, prompts, prompt_tokens=None, tokenizer=None) -> np.ndarray:
        """Estimated total denoising rounds of each request, from its prompt.

        Parameters
        ----------
        prompts : list of prompt strings, or an array (B, 3) of features (words, newlines, prompt
            tokens after the chat template).
        prompt_tokens : array-like (B,), tokens after the chat template of each prompt string.
        tokenizer : callable ``text -> int | list[int]`` giving those tokens, when
            ``prompt_tokens`` is not given.

        Returns
        -------
        float32 array (B,), total denoising rounds.
        """
        if len(prompts) and isinstance(prompts[0], str):
            features = self.prompt_features(list(prompts), prompt_tokens, tokenizer)
        else:
            features = np.asarray(prompts, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != 3:
            raise InputError(f"admission features must have shape (B, 3) (words, newlines, prompt tokens), got {features.shape}")
        if features.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        out = self._admission.run(None, {"features": np.ascontiguousarray(features, dtype=np.float32)})[0]
        return _one_per_request(np.asarray(out, dtype=np.float32), features.shape[0], self.path, "admission.onnx")

    @staticmethod
    def prompt_features(prompts: list[str], prompt_tokens=None, tokenizer=None) -> np.ndarray:
        """(B, 3) float32 admission features of raw prompt strings."""
        from dwise_predict.features.prompt import count_newlines, count_words

        if prompt_tokens is None:
            if tokenizer is None:
                raise InputError(
                    "admission from prompt text needs the prompt token counts after the chat template: "
                    "pass prompt_tokens=[...] or tokenizer=callable"
                )
            counts = []
            for text in prompts:
                n = tokenizer(text)
                counts.append(n if isinstance(n, (int, np.integer)) else len(n))
            prompt_tokens = counts
        tokens = np.asarray(prompt_tokens, dtype=np.float32).reshape(-1)
        if len(tokens) != len(prompts):
            raise InputError(f"got {len(prompts)} prompts but {len(tokens)} prompt token counts")
        words = np.fromiter((count_words(t) for t in prompts), dtype=np.float32, count=len(prompts))
        newlines = np.fromiter((count_newlines(t) for t in prompts), dtype=np.float32, count=len(prompts))
        return np.stack([words, newlines, tokens], axis=1)

    # --- refinement ----------------------------------------------------------------------------

    def refine(self, first_round, prompt_last, prompt_tokens, budget, early_signals):
        """Calibrated remaining denoising rounds after the first denoising round.

        Parameters
        ----------
        first_round : (B, L, H) final-layer hidden rows of the first output block in its first
            denoising round (mean-pooled here), or (B, H) already pooled. A torch tensor stays on
            its device and the result is a tensor there: pure tensor ops on the current stream,
            no host synchronisation (CUDA-graph friendly with the torch backend).
        prompt_last : (B, L, H) or (B, H), the same for the last prompt block's forward (its final-layer
            rows when the engine prefilled it; ``traces`` field ``prompt_last``).
        prompt_tokens : (B,) or scalar, prompt tokens after the chat template.
        budget : (B,) or scalar, output budget in tokens.
        early_signals : (B, 4) the same forward's early signals over the block's masked positions:
            fraction of top-1 probabilities above the algorithm's threshold, mean top-1 probability,
            mean entropy (nats) and the probability that the block holds a stop token, in that order
            (``bundle.json`` ``inputs.refine.early_signal_columns``; ``engine.signals``).

        Returns
        -------
        (B,) float32 remaining rounds: a NumPy array for NumPy input, a tensor for tensor input.
        """
        shape = tuple(first_round.shape)
        for name, state in (("first_round", first_round), ("prompt_last", prompt_last)):
            got = tuple(state.shape) if hasattr(state, "shape") else np.shape(state)
            if len(got) not in (2, 3) or (self.hidden_size and got[-1] != self.hidden_size) or got[0] != shape[0]:
                raise InputError(
                    f"{name} must be (B, H) or (B, L, H) with H = {self.hidden_size} (this bundle's hidden size) "
                    f"and B = {shape[0]}, got shape {got}: is the bundle for this model?"
                )
        signal_shape = tuple(early_signals.shape) if hasattr(early_signals, "shape") else np.shape(early_signals)
        if signal_shape != (shape[0], SIGNAL_COUNT):
            raise InputError(f"early_signals must be (B, {SIGNAL_COUNT}) = ({shape[0]}, {SIGNAL_COUNT}), got {signal_shape}")
        if self.backend == "torch":
            out = self._refine_torch(first_round, prompt_last, prompt_tokens, budget, early_signals)
            return _one_per_request(out, shape[0], self.path, "the refinement graph")
        h, last = _host(first_round), _host(prompt_last)
        h, last = (a.mean(axis=1) if a.ndim == 3 else a for a in (h, last))
        b = h.shape[0]
        feeds = {
            "first_round": np.ascontiguousarray(h),
            "prompt_last": np.ascontiguousarray(last),
            "prompt_tokens": np.broadcast_to(_host(prompt_tokens), (b,)).copy(),
            "budget": np.broadcast_to(_host(budget), (b,)).copy(),
            "early_signals": np.ascontiguousarray(_host(early_signals)),
        }
        out = _one_per_request(np.asarray(self._refine.run(None, feeds)[0], dtype=np.float32), b, self.path,
                               "refine.onnx")
        if hasattr(first_round, "detach"):
            import torch

            return torch.from_numpy(out).to(first_round.device)
        return out

    def refine_raw(self, first_round, prompt_last, prompt_tokens, budget, early_signals) -> np.ndarray:
        """The ensemble's remaining-rounds estimate before the isotonic calibration, (B,) float32.

        For comparing raw and calibrated refinement (the DWISE paper's Table 5) offline, e.g. in the
        simulator; any backend (the torch graph is rebuilt from ``refine.safetensors`` on the CPU).
        NumPy in, NumPy out; ``first_round`` and ``prompt_last`` are (B, H) or (B, L, H).
        """
        import torch

        graph = getattr(self, "_raw_graph", None)
        if graph is None:
            graph = self._raw_graph = _torch_refine(self.path, self.manifest, "cpu", False)
        with torch.inference_mode():
            return graph.raw(*_torch_inputs(first_round, prompt_last, prompt_tokens, budget, early_signals, "cpu")).numpy()

    def _refine_torch(self, first_round, prompt_last, prompt_tokens, budget, early_signals):
        import torch

        as_numpy = not isinstance(first_round, torch.Tensor)
        device = torch.device(self.device) if as_numpy else first_round.device
        with torch.inference_mode():
            out = self._refine(*_torch_inputs(first_round, prompt_last, prompt_tokens, budget, early_signals, device))
        return out.cpu().numpy() if as_numpy else out


def _one_per_request(out, batch: int, path: Path, graph: str):
    """``out`` as (B,): a graph that returns another shape (a hostile one: ``[B]`` declared, ``2B``
    rows returned) is refused, not read as estimates of other requests. A shape check only: no copy,
    no host synchronisation of a tensor."""
    if tuple(out.shape) != (batch,):
        raise BundleError(f"{path}: {graph} returned {tuple(out.shape)} estimates for {batch} requests, not one "
                          f"per request: refusing to use them; {FIX}")
    return out


def _host(x) -> np.ndarray:
    """A NumPy float32 copy of an array, tensor (any device) or scalar."""
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float32)


def _torch_inputs(first_round, prompt_last, prompt_tokens, budget, early_signals, device):
    """The graph's five float32 tensors on ``device``: rows pooled over L, scalars broadcast to B."""
    import torch

    def tensor(x):
        if isinstance(x, np.ndarray) and not x.flags.writeable:  # e.g. a DataFrame column's view
            x = x.copy()  # torch warns on (and must not share) read-only NumPy memory
        return torch.as_tensor(x, dtype=torch.float32, device=device)

    h, last = (tensor(x) for x in (first_round, prompt_last))
    h, last = (x.mean(dim=1) if x.dim() == 3 else x for x in (h, last))  # (B, H): mean over the block's L rows
    b = h.shape[0]
    pt = tensor(prompt_tokens).reshape(-1).expand(b)
    bu = tensor(budget).reshape(-1).expand(b)
    signals = tensor(early_signals).reshape(b, SIGNAL_COUNT)
    return h, last, pt, bu, signals


def _ort_session(bundle: Path, manifest: BundleManifest, name: str, device: str):
    """An onnxruntime session of one of the bundle's graphs, made from its checked bytes (so no path
    inside the graph resolves against the bundle's directory)."""
    path = bundle / name
    model = read_checked(bundle, manifest, name)
    try:
        import onnxruntime as ort
    except ImportError:
        raise BundleError("loading a bundle's ONNX graphs needs onnxruntime: pip install onnxruntime") from None
    options = ort.SessionOptions()
    # A scheduler calls this on its own thread with small batches: one intra-op thread avoids
    # oversubscribing the cores the server needs.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if str(device).startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(model, sess_options=options, providers=providers)
    except Exception as err:  # onnxruntime raises its own exception types for a corrupt graph
        raise BundleError(f"{path} is not a loadable ONNX graph ({err}): re-export the bundle") from None


def _torch_refine(path: Path, manifest: BundleManifest, device: str, torchscript: bool):
    import io

    import torch

    if torchscript:
        module = torch.jit.load(io.BytesIO(read_checked(path, manifest, "refine.pt")), map_location=device)
        return module.eval()
    from safetensors.torch import load

    from dwise_predict.survival.network import build_refine_graph

    calibration = read_calibration(read_checked(path, manifest, "calibration.json"), str(path / "calibration.json"))
    try:
        weights = load(read_checked(path, manifest, "refine.safetensors"))
        graph = build_refine_graph(weights, manifest.refine, calibration)
    except (KeyError, RuntimeError, ValueError) as err:
        raise BundleError(
            f"{path}: refine.safetensors, calibration.json and bundle.json inputs.refine do not fit together "
            f"({type(err).__name__}: {err}): re-export the bundle"
        ) from None
    return graph.to(device)


def load_bundle(
    path,
    device: str = "cpu",
    backend: str = "onnx",
    expect_model: dict | None = None,
    expect_decoding: dict | None = None,
    torchscript: bool = False,
) -> LoadedBundle:
    """Open a bundle directory for serving.

    Parameters
    ----------
    path : bundle directory (``bundle.json`` and the files it lists).
    device : ``"cpu"`` or a torch device string (``"cuda"``, ``"cuda:1"``) for refinement.
    backend : ``"onnx"`` (onnxruntime) or ``"torch"`` (rebuilt from safetensors; GPU path).
    expect_model : the served model's fingerprint (``weights_sha256``, ``config_hash``,
        ``hidden_size``; any subset); a bundle for another model is refused.
    expect_decoding : the served decoding config (``algorithm``, ``algorithm_config``,
        ``block_size``, ``engine``; any subset).
    torchscript : with ``backend="torch"``, load ``refine.pt`` instead of rebuilding.

    Raises
    ------
    BundleError
        Missing/corrupt manifest, a file failing its hash, a fingerprint or decoding mismatch.
    InputError
        Unknown backend.
    """
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    path = Path(path)
    manifest = open_bundle(path)  # the layout and every listed file's hash
    screen_bundle(path, manifest)  # and content, also of the files not loaded here: a hostile bundle is refused whole
    check_compatible(manifest.identity, expect_model, expect_decoding, str(path))
    if backend == "torch" and torchscript and "refine.pt" not in manifest.files:
        raise BundleError(f"{path} holds no refine.pt (TorchScript): load it with torchscript=False")
    return LoadedBundle(path, manifest, device, backend, torchscript)
