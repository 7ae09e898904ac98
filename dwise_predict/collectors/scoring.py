"""Whether a decoded answer is right: the ``correct`` column of a trace (a score in [0, 1] or NaN).

One rule per source type, chosen by the workload's source table:

- ``tiny``: the tiny corpus's own checker (:func:`dwise_predict.dllm.corpus.check_answer`; NaN for chat);
- ``multi_needle``: the fraction of hidden facts recalled (:func:`.needles.score_needles`);
- ``human_eval``: NaN — judging code means running it, which collection does not do;
- any other source with a reference: the final answer (the last ``\\boxed{...}`` if there is one,
  else the whole output) equals the reference after case and whitespace normalisation.

NaN means "not checkable", never "wrong"; accuracy summaries skip NaN rows.
"""

from __future__ import annotations

import math

from dwise_predict.collectors.sources import last_boxed


def score_answer(request, text: str, source_type: str | None) -> float:
    """Score ``text`` as an answer to ``request`` (a :class:`WorkloadRequest`); NaN when not checkable."""
    if request.reference is None or source_type == "human_eval":
        return math.nan
    if source_type == "tiny":
        from dwise_predict.dllm.corpus import Example, check_answer

        verdict = check_answer(Example(request.category, request.prompt, request.reference, request.meta), text)
        return math.nan if verdict is None else float(verdict)
    if source_type == "multi_needle":
        from dwise_predict.collectors.needles import score_needles

        return float(score_needles(request.reference, text))
    answer = last_boxed(text)
    return float(_norm(text if answer is None else answer) == _norm(request.reference))


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")
