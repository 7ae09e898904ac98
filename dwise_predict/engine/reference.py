"""The SGLang 0.5.23 names our engine semantics mirror, in one list, and a check against the wheel.

Each entry says which SGLang algorithm class, which of its attributes (or ``max_steps`` at a block
size), and the value our rule uses. ``tests/test_engine_conformance.py`` builds each class from the
wheel with an empty algorithm config and calls :func:`mirrored_problems`, so a release that renames
a class or moves a default fails loudly instead of drifting.
"""

from __future__ import annotations

from collections.abc import Callable

from dwise_predict.engine.algorithms import ALGORITHMS, make_rule

# (SGLang class, attribute on the instance, our parameter name or None for max_steps)
ATTRIBUTES = {
    "LowConfidence": {"threshold": "threshold"},
    "JointThreshold": {"threshold": "threshold", "edit_threshold": "edit_threshold",
                       "max_post_edit_steps": "max_post_edit_steps", "penalty_lambda": "penalty_lambda"},
    "JointThresholdInDel": {"threshold": "threshold", "edit_threshold": "edit_threshold",
                            "max_post_edit_steps": "max_post_edit_steps"},
}
BLOCK_SIZES = (4, 8, 32)  # SDAR, the tiny dLLM, LLaDA2.x
MIRRORED: list[tuple[str, str]] = [(cls, attr) for cls, attrs in ATTRIBUTES.items() for attr in attrs] + [
    (cls, f"max_steps({b})") for cls in ATTRIBUTES for b in BLOCK_SIZES]


def mirrored_problems(build: Callable[[str, int], object], mask_id: int = 0) -> list[str]:
    """What differs between SGLang and us; ``build(name, block_size)`` returns SGLang's algorithm
    ``name`` configured with its defaults. Empty when everything matches."""
    problems = []
    for name, attributes in ATTRIBUTES.items():
        if name not in ALGORITHMS:
            problems.append(f"{name} is mirrored but not offered by `algorithm`")
            continue
        ours = make_rule(name, mask_id)
        for block in BLOCK_SIZES:
            try:
                theirs = build(name, block)
            except KeyError:
                problems.append(f"SGLang has no algorithm {name}")
                break
            if theirs.max_steps(block) != ours.max_steps(block):
                problems.append(f"{name}.max_steps({block}): SGLang {theirs.max_steps(block)}, ours {ours.max_steps(block)}")
            for attribute, param in attributes.items():
                if getattr(theirs, attribute, None) != ours.params[param]:
                    problems.append(f"{name}.{attribute}: SGLang {getattr(theirs, attribute, None)!r}, "
                                    f"ours {ours.params[param]!r}")
    return sorted(set(problems))
