"""Single-request admission latency: model only and from raw prompt text (tokenisation after the
chat template included), one thread. Targets: <= 30 µs model-only, <= 0.2 ms from text.

Uses the built-in tiny dLLM's tokenizer (shipped weights if present, else rebuilt from the corpus
vocabulary); prompts are drawn from the tiny model's corpus. LightGBM's own Booster.predict on one
row is timed for reference.

Usage: python benchmarks/admission_latency.py [--repeats 20000] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from targets import Figure, add_options, report

TARGET_MODEL_US, TARGET_TEXT_MS = 30.0, 0.2


def median_us(fn, inputs, repeats: int) -> float:
    from dwise_predict.admission.compare import median_time

    return median_time(fn, inputs, repeats) * 1e6


def tiny_tokenizer():
    import dwise_predict.dllm as dllm
    from dwise_predict.features.prompt import load_tokenizer

    weights = Path(dllm.__file__).parent / "weights"
    tok = load_tokenizer({"name": "dwise-tiny-dllm", "path": str(weights)})
    if tok is not None:
        return tok, f"shipped tokenizer in {weights}"
    from dwise_predict.dllm.corpus import vocabulary
    from dwise_predict.dllm.tokenizer import build_tokenizer

    return build_tokenizer(vocabulary()), "tiny tokenizer rebuilt from the corpus vocabulary"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20000)
    add_options(parser, "200 repeats, a model fitted on 256 requests: a quick check")
    args = parser.parse_args(argv)
    repeats = 200 if args.smoke else args.repeats

    from dwise_predict.admission.model import AdmissionModel
    from dwise_predict.admission.features import prompt_features
    from dwise_predict.features.prompt import PromptFeaturizer
    from dwise_predict.traces.synthetic import make_synthetic_traces

    ds = make_synthetic_traces(256 if args.smoke else 2048, 8, seed=0)
    model = AdmissionModel().fit(prompt_features(ds.requests), ds.requests["total_rounds"])
    tok, note = tiny_tokenizer()
    featurizer = PromptFeaturizer(tok)
    from dwise_predict.dllm.corpus import CATEGORIES, generate_examples

    prompts = [ex.prompt for c in CATEGORIES for ex in generate_examples(c, 25, seed=0)]
    rows = [np.asarray([featurizer(p)]) for p in prompts]

    booster = median_us(lambda r: model.booster_.predict(r, num_threads=1), rows, repeats // 4)
    compiled = median_us(lambda r: model.predict_one(r[0, 0], r[0, 1], r[0, 2]), rows, repeats)
    tokenise = median_us(featurizer, prompts, repeats)
    from_text = median_us(lambda p: model.predict_one(*featurizer(p)), prompts, repeats)
    mean_tokens = np.mean([r[0, 2] for r in rows])
    print(f"tokenizer: {note}; prompts: {len(prompts)}, mean {mean_tokens:.0f} tokens after the chat template")
    print(f"LightGBM Booster.predict, one row:       {booster:7.1f} µs (reference)")
    print(f"compiled trees, model only:             {compiled:7.1f} µs (target <= {TARGET_MODEL_US:g} µs)")
    print(f"features from raw text (tokenisation):  {tokenise:7.1f} µs")
    print(f"admission from raw text, end to end:    {from_text:7.1f} µs = {from_text / 1e3:.3f} ms "
          f"(target <= {TARGET_TEXT_MS:g} ms)")
    report("admission_latency", [
        Figure("admission, one request, model only", compiled, "µs", TARGET_MODEL_US),
        Figure("admission, one request, from raw text", from_text / 1e3, "ms", TARGET_TEXT_MS),
    ], args, repeats=repeats, training_requests=len(ds.requests), prompts=len(prompts))


if __name__ == "__main__":
    main()
