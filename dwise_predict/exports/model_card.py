"""The bundle's ``README.md``: a model card with Hugging Face front matter.

The YAML front matter follows the Hub's model-card metadata (``library_name``, ``tags``,
``base_model``, ``metrics``, ``model-index``); values are written as JSON scalars, which YAML reads
unchanged, so no YAML library is needed. Names from the run (the bundle's, the model's) are escaped
for Markdown (:mod:`dwise_predict.text`): the card never carries raw HTML from them.
"""

from __future__ import annotations

import json

from dwise_predict.bundles.manifest import BundleManifest
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.text import json_for_markdown, markdown_line


def model_card(manifest: BundleManifest) -> str:
    """Markdown model card for a bundle manifest (``files`` may still be empty when it is written)."""
    model, decoding, metrics = manifest.identity.model.fields, manifest.identity.decoding.fields, manifest.metrics
    refine, hidden = manifest.refine, manifest.hidden_size
    base_model = model.get("repo_id") or model.get("name") or "unknown"
    admission_rho = metrics.get("admission", {}).get("spearman")
    refined_rho = metrics.get("refined", {}).get("spearman")
    lines = (_front_matter(manifest, base_model, admission_rho, refined_rho)
             + _description(manifest, model, decoding, metrics, base_model, refine, hidden)
             + _metrics_table(metrics, admission_rho, refined_rho)
             + _inputs_and_loading(hidden)
             + _safety_and_files(manifest))
    return "\n".join(lines)


def _front_matter(manifest: BundleManifest, base_model: str, admission_rho, refined_rho) -> list[str]:
    """The Hub's YAML metadata: library, base model, tags and the model index with both ρ."""
    return [
        "---",
        "library_name: onnx",
        f"base_model: {json_for_markdown(json.dumps(base_model))}",
        "tags:",
        *(f"- {t}" for t in ("dwise-predict", "diffusion-llm", "block-diffusion", "llm-serving", "scheduling",
                             "survival-analysis", "lightgbm", "onnx", "torchscript")),
        "metrics:",
        "- spearmanr",
        "model-index:",
        f"- name: {json_for_markdown(json.dumps(manifest.name))}",
        "  results:",
        "  - task:",
        "      type: tabular-regression",
        "      name: denoising-round prediction",
        "    dataset:",
        f"      name: {json_for_markdown(json.dumps('traces of ' + base_model + ' (eval split)'))}",
        "      type: dwise-predict-traces",
        f"      revision: {json_for_markdown(json.dumps(manifest.training_data.get('fingerprint') or 'unknown'))}",
        "    metrics:",
        "    - type: spearmanr",
        "      name: admission Spearman rho (total rounds)",
        f"      value: {json.dumps(admission_rho)}",
        "    - type: spearmanr",
        "      name: refined Spearman rho (remaining rounds)",
        f"      value: {json.dumps(refined_rho)}",
        "---",
        "",
    ]


def _description(manifest: BundleManifest, model: dict, decoding: dict, metrics: dict, base_model: str, refine,
                 hidden: int) -> list[str]:
    """What the two predictors are, and the model, decoding and traces they were trained for."""
    return [
        f"# {markdown_line(manifest.name)}: workload predictors for {markdown_line(base_model)}",
        "",
        "Two predictors for a block-diffusion LLM scheduler, exported by dwise-predict (after DWISE, §3–§4):",
        "",
        "- **admission** — LightGBM (`admission.txt`, `admission.onnx`) on three prompt features "
        "(`words`, `newlines`, `prompt_tokens` after the chat template) → predicted total denoising rounds;",
        f"- **refinement** — {_refine_words(refine)} "
        f"(K = {manifest.K}) on the pooled hidden states of the first denoising round and of the last "
        f"prompt block (H = {hidden} each), prompt tokens, budget and the first round's early signals, "
        "isotonic-calibrated → remaining denoising "
        "rounds (`refine.onnx`, `refine.pt`, `refine.pt2`, weights in `refine.safetensors`).",
        "",
        *_int8_lines(manifest.int8),
        "## Trained for",
        "",
        "The predictions are only meaningful for this model and decoding configuration; the serving hook "
        "refuses a bundle whose fingerprint or hidden size differs from the model it serves.",
        "",
        "```json",
        json_for_markdown(json.dumps({"model": model, "decoding": decoding}, indent=2, sort_keys=True)),
        "```",
        "",
        f"Training traces: fingerprint `{manifest.training_data.get('fingerprint')}`"
        f" ({metrics.get('n_train', '?')} train / {metrics.get('n_eval', '?')} eval requests).",
        "",
    ]


def _metrics_table(metrics: dict, admission_rho, refined_rho) -> list[str]:
    """Both predictors' ρ on the evaluation split and the median predicted/actual ratios."""
    calibration = metrics.get("calibration", {})
    return [
        "## Metrics (eval split)",
        "",
        "| predictor | Spearman ρ | within-category ρ (mean) |",
        "|---|---|---|",
        f"| admission | {_fmt(admission_rho)} | {_fmt(metrics.get('admission', {}).get('within_category_mean'))} |",
        f"| refined (calibrated) | {_fmt(refined_rho)} | {_fmt(metrics.get('refined', {}).get('within_category_mean'))} |",
        "",
        f"Median predicted/actual ratio: admission {_fmt(calibration.get('median_ratio_admission'))}, "
        f"refined raw {_fmt(calibration.get('median_ratio_raw'))}, "
        f"calibrated {_fmt(calibration.get('median_ratio_calibrated'))}.",
        "",
    ]


def _inputs_and_loading(hidden: int) -> list[str]:
    """The graphs' inputs and outputs, and how to load them."""
    return [
        "## Inputs and outputs",
        "",
        "| graph | inputs (float32) | output (float32) |",
        "|---|---|---|",
        "| `admission.onnx` | `features` [B, 3] = words, newlines, prompt_tokens | `total_rounds` [B] |",
        f"| `refine.onnx` | `first_round` [B, {hidden}], `prompt_last` [B, {hidden}] "
        "(raw pooled rows, standardised inside), "
        f"`prompt_tokens` [B], `budget` [B], `early_signals` [B, {len(EARLY_SIGNALS)}] = {', '.join(EARLY_SIGNALS)} "
        "of the first denoising forward over the block's masked positions "
        "| `remaining_rounds` [B] (calibrated) |",
        "",
        "## Load",
        "",
        "Check the bundle first — every file's sha256 is in the sealed `bundle.json`:",
        "",
        "```bash",
        "dwise-predict verify BUNDLE",
        "```",
        "",
        "With onnxruntime and numpy only:",
        "",
        "```python",
        "import numpy as np, onnxruntime as ort",
        "refine = ort.InferenceSession('BUNDLE/refine.onnx', providers=['CPUExecutionProvider'])",
        "rounds = refine.run(None, {'first_round': h1, 'prompt_last': h_prompt, 'prompt_tokens': tokens,",
        "                           'budget': budget, 'early_signals': signals})[0]",
        "```",
        "",
        "Or rebuild the PyTorch module from the safetensors weights (no pickle):",
        "`dwise_predict.survival.network.build_refine_graph(safetensors.torch.load_file('refine.safetensors'), "
        "bundle['inputs']['refine'], json.load(open('calibration.json')))`.",
        "",
    ]


def _safety_and_files(manifest: BundleManifest) -> list[str]:
    """Which files hold pickles (and how they are screened), and every file's role."""
    return [
        "## Safety",
        "",
        "`refine.pt` (TorchScript) and `refine.pt2` (torch.export) are zip archives of Python pickles and code: "
        "`torch.jit.load` and `torch.export.load` run what a tampered archive holds, and the sealed hashes "
        "prove only that the files are the ones `bundle.json` names, not who wrote it. `dwise-predict verify` "
        "and every dwise-predict loader screen them first (`dwise_predict.bundles.screen`). Outside "
        "dwise-predict, load them only from a source you trust; for bundles from others use ONNX or the "
        "safetensors weights.",
        "",
        "## Files",
        "",
        "| file | role | format | contains pickle |",
        "|---|---|---|---|",
        *(f"| `{f}` | {a['role']} | {a['format']} | {'yes' if a['pickle'] else 'no'} |"
          for f, a in manifest.artifacts.items()),
        "",
    ]


def _int8_lines(int8: dict) -> list[str]:
    if int8.get("kept"):
        return [f"`refine.int8.onnx` has int8 weights (about twice as fast on CPUs with VNNI); its Spearman ρ "
                f"against fp32 on the probe inputs is {_fmt(int8.get('probe_spearman'))} (kept only at >= "
                f"{int8.get('min_spearman')}). `refine.onnx` stays the exact reference.", ""]
    return [f"An int8 version was not kept: its ranking fell short of fp32 (ρ {_fmt(int8.get('probe_spearman'))}"
            f" < {int8.get('min_spearman')}).", ""] if int8 else []


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _refine_words(refine: dict) -> str:
    """The refinement candidate the run chose (refine.json's ``candidate``; older runs: the ensemble)."""
    candidate = refine.get("candidate", "survival")
    if candidate == "survival-pca":
        return (f"a {refine['members']}-seed ensemble of discrete-time survival MLPs (width {refine['width']}) trained on "
                "the top principal components of the standardised input, the projection folded into the first layer "
                "(`candidate: survival-pca`)")
    if candidate == "ridge-within+signals":
        return ("a two-stage ridge head on the standardised input blended, on the log scale, with a ridge over random "
                "GELU features of prompt tokens, budget and the early signals, written as one survival member of width "
                f"{refine['width']} whose hazard logit is minus the blended score (`candidate: ridge-within+signals`)")
    if candidate == "ridge-within":
        return ("a two-stage ridge head (within-category directions first, then the levels between categories with a "
                "penalty chosen by leaving one category out; "
                "log1p target), written as one width-2 survival member whose hazard logit is minus the ridge score "
                "(`candidate: ridge-within`)")
    if candidate == "ridge":
        return ("a ridge head on the standardised input (log1p target, penalty by leave-one-out), written as one "
                "width-2 survival member whose hazard logit is minus the ridge score (`candidate: ridge`)")
    if candidate == "survival+ridge":
        return (f"a seed ensemble of {int(refine['members']) - 1} discrete-time survival MLPs (width {refine['width']}) "
                "plus a ridge head as one more member, estimates averaged (`candidate: survival+ridge`)")
    return f"a {refine['members']}-seed ensemble of discrete-time survival MLPs (width {refine['width']})"
