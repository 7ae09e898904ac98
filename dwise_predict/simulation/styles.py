"""How each scheduler looks in a plot: one hue family and one line style per scheduler family.

Thirteen schedulers in matplotlib's ten-colour cycle gave SGLang's synchronous mode and calibrated
DWISE the same orange. Here the family (:attr:`.schedulers.SchedulerSpec.family`, the one source) picks
the hue and the line style: DWISE's variants in blues (light to dark as the estimate improves, the
oracle darkest), SGLang's modes in reds with dashed lines, the published baselines each in its own
colour away from both (dash-dotted). A baseline's prefill-first twin (``ssjf-pf``,
:data:`.schedulers.PREFILL_FIRST`) keeps its colour and marker, drawn with a loosely dashed line and
crossed bars, so a pair reads as one scheduler on two batch formers. A scheduler keeps its look in
every plot, whichever others are drawn beside it; a name outside the registry is grey and dotted.
"""

from __future__ import annotations

from dataclasses import dataclass

from dwise_predict.simulation.schedulers import PREFILL_FIRST, PREFILL_FIRST_SUFFIX, SCHEDULERS

# per family, in the registry's order of its members: colours (hex), then the family's line style,
# its bar hatch and its markers
_FAMILY_COLOURS = {
    "dwise": ("#9ecae1", "#6baed6", "#3182bd", "#08519c", "#08306b"),
    "sglang": ("#b2182b", "#f4a582"),
    "baseline": ("#1b9e77", "#e6ab02", "#a6761d", "#e7298a", "#66a61e", "#666666"),
}
_FAMILY_LINE = {"dwise": "-", "sglang": "--", "baseline": "-."}
_FAMILY_HATCH = {"dwise": "", "sglang": "//", "baseline": ".."}
_FAMILY_MARKERS = {"dwise": ("o",), "sglang": ("s",), "baseline": ("^", "v", "D", "P", "X", "<")}
_OTHER = ("#999999", ":", "", "x")
_PREFILL_FIRST_LOOK = ((0, (5, 4)), "xx")  # line style, bar hatch of a baseline on the prefill-first former


@dataclass(frozen=True)
class PolicyStyle:
    """A scheduler's look: ``line`` for :meth:`Axes.plot`, ``bar`` for :meth:`Axes.bar`."""

    colour: str
    linestyle: str | tuple  # a matplotlib line style: a name or (offset, dashes)
    hatch: str
    marker: str

    @property
    def line(self) -> dict:
        return {"color": self.colour, "linestyle": self.linestyle, "marker": self.marker}

    @property
    def bar(self) -> dict:
        return {"color": self.colour, "hatch": self.hatch, "edgecolor": "white", "linewidth": 0.3}


def _registry_styles() -> dict[str, PolicyStyle]:
    styles, seen = {}, {family: 0 for family in _FAMILY_COLOURS}
    for spec in SCHEDULERS.values():
        i = seen[spec.family]
        seen[spec.family] += 1
        colours, markers = _FAMILY_COLOURS[spec.family], _FAMILY_MARKERS[spec.family]
        styles[spec.name] = PolicyStyle(colours[i % len(colours)], _FAMILY_LINE[spec.family],
                                        _FAMILY_HATCH[spec.family], markers[i % len(markers)])
    for name in PREFILL_FIRST:
        twin = styles[name[: -len(PREFILL_FIRST_SUFFIX)]]
        styles[name] = PolicyStyle(twin.colour, *_PREFILL_FIRST_LOOK, twin.marker)
    return styles


STYLES = _registry_styles()


def policy_style(policy: str) -> PolicyStyle:
    """The look of ``policy`` (a scheduler's name) in every simulation plot."""
    return STYLES.get(policy) or PolicyStyle(*_OTHER)
