"""Names that act: trace categories, a model name, a workload's names and a round profile's source
holding terminal escapes, rich markup, mathtext, spreadsheet formulas and HTML, through every
command that shows them. Each medium shows them as written and obeys none (dwise_predict.text).
"""

import csv
import json

import pytest

from dwise_predict.cli import main
from dwise_predict.text import csv_cell, markdown, markdown_line, plot_label, terminal, visible
from evaluate_helpers import fixed_config, make_traces, write

# Each category starts with what a spreadsheet runs and carries what a terminal, rich, matplotlib
# or a Markdown renderer would obey.
CATEGORIES = {
    "=1+1 \x1b]0;title\x07 [/x]": (2.8, 60, 1.0),
    "+cmd \x1b[2J [link=http://x]y[/link]": (3.3, 140, 12.0),
    "@SUM(A1) [bold]b[/bold] $\\frac{$": (3.0, 90, 2.0),
    "-2+3 <img src=x onerror=alert(1)> <script>": (1.2, 120, 6.0),
}
MODEL = "<script>alert(1)</script> \x1b[2J [bold]m[/bold] [/x]"
MARKUP = ("[/x]", "[link=http://x]y[/link]", "[bold]b[/bold]")
ESCAPES_SHOWN = ("\\x1b]0;title\\x07", "\\x1b[2J")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Hostile traces on disk, a run trained on them and its bundle (trained for MODEL)."""
    root = tmp_path_factory.mktemp("hostile")
    traces = make_traces(n_requests=240, categories=CATEGORIES)
    traces.manifest["model"]["name"] = MODEL
    path = write(traces, root / "traces")
    config = root / "config.json"
    config.write_text(json.dumps(fixed_config().to_dict()))
    return {"root": root, "traces": path, "config": config}


def _ran(capsys, argv) -> tuple[str, str]:
    """Run the CLI: exit 0, no traceback, no raw ESC or BEL on either stream."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    for stream in (out, err):
        assert "Traceback" not in stream and "\x1b" not in stream and "\x07" not in stream, stream
    return out, err


def _flat(text: str) -> str:
    """A rich table's text with its cells' line wrapping undone (box characters and spaces dropped)."""
    return "".join(c for c in text if not c.isspace() and c not in "│┃┆┇║─━┏┓┗┛┡┩└┘┌┐├┤┬┴┼╇╈╀╁╂╋")


def _markup_shown(out: str, names=MARKUP) -> None:
    flat = _flat(out)
    for name in names:
        assert _flat(name) in flat, name


@pytest.fixture(scope="module")
def run(world):
    out = world["root"] / "run"
    assert main(["train", str(world["traces"]), "--out", str(out), "--config", str(world["config"])]) == 0
    return out


def test_traces_show(world, capsys):
    out, _ = _ran(capsys, ["traces", "show", str(world["traces"])])
    _markup_shown(out)
    assert all(_flat(s) in _flat(out) for s in ESCAPES_SHOWN)


def test_characterize_writes_its_plots_and_escapes_every_medium(world, capsys):
    char = world["root"] / "char"
    out, _ = _ran(capsys, ["characterize", str(world["traces"]), "--out", str(char)])
    _markup_shown(out)
    assert "[bold]m[/bold]" in out  # the model's name, in the table's title
    assert (char / "plots" / "characterization_round_histograms.png").read_bytes()[:4] == b"\x89PNG"
    html = (char / "characterization.html").read_text()
    assert "<script>" not in html and "<img src=x" not in html and "&lt;script&gt;" in html
    md = (char / "characterization.md").read_text()
    assert "<script>" not in md and "<img" not in md and "\x1b" not in md
    assert "&lt;img src=x onerror=alert(1)> &lt;script>" in md


def test_train_prints_the_categories_as_written(run, world, capsys):
    out, _ = _ran(capsys, ["train", str(world["traces"]), "--out", str(world["root"] / "run2"),
                           "--config", str(world["config"])])
    _markup_shown(out)


def test_evaluate_loco_report_and_tables(run, world, capsys):
    ev = world["root"] / "eval"
    out, _ = _ran(capsys, ["evaluate", str(world["traces"]), "--run", str(run), "--out", str(ev), "--loco",
                           "--jobs", "1", "--min-requests", "5"])
    _markup_shown(out)
    md = (ev / "report.md").read_text()
    assert "<img" not in md and "<script>" not in md and "\x1b" not in md
    assert "&lt;img src=x onerror=alert(1)>" in md
    html = (ev / "report.html").read_text()
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert (ev / "plots" / "loco.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def bundle(run, world):
    out = world["root"] / "bundle"
    assert main(["export", str(run), "--out", str(out), "--probes", "8"]) == 0
    return out


def test_the_model_card_holds_no_raw_html(bundle):
    card = (bundle / "README.md").read_text()
    heading = next(line for line in card.splitlines() if line.startswith("# "))
    assert "<script>" not in card and "&lt;script>alert(1)&lt;/script>" in heading
    assert "\x1b" not in card


def test_simulate_csvs_title_and_compatibility_error(world, tmp_path, capsys):
    profile = tmp_path / "gpu.json"
    source = "=HYPERLINK(\"http://x\") \x1b]0;t\x07 [/x] [bold]p[/bold]"
    profile.write_text(json.dumps({"source": source, "base_ms": 20, "prefill_block_ms": 0.2, "decode_block_ms": 0.5}))
    sim = tmp_path / "sim"
    out, _ = _ran(capsys, ["simulate", str(world["traces"]), "--arrival", "burst", "--requests", "0",
                           "--round-profile", str(profile), "--out", str(sim)])
    _markup_shown(out, ("[/x]", "[bold]p[/bold]"))
    for name in ("simulate.csv", "simulate_categories.csv"):
        with open(sim / name, newline="") as fh:
            cells = [c for row in csv.reader(fh) for c in row]
        assert cells and not [c for c in cells if c[:1] in ("=", "+", "@") or c[:1] == "-" and not _number(c)], name
    with open(sim / "simulate_categories.csv", newline="") as fh:
        categories = {row["category"] for row in csv.DictReader(fh)}
    assert categories == {csv_cell(c) for c in CATEGORIES} and not [c for c in categories if "\x1b" in c]
    assert (sim / "simulate_categories.png").read_bytes()[:4] == b"\x89PNG"
    md = (sim / "report.md").read_text()
    assert "<img" not in md and "<script>" not in md


def test_simulate_refusal_names_the_model_as_written(bundle, tmp_path, capsys):
    other = write(make_traces(n_requests=80, seed=7, categories=CATEGORIES), tmp_path / "other")
    assert main(["simulate", str(other), "--bundle", str(bundle), "--requests", "0"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert "\\x1b[2J [bold]m[/bold]" in err


def test_workload_show(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(8)))
    spec = tmp_path / "spec.toml"
    # source names and categories are refused unless letters, digits, '_', '.', '-': the spec's name is free
    names = [json.dumps(n) for n in ("w " + MODEL, "src", "chat")]
    spec.write_text("name = {}\n[[sources]]\ntype = \"jsonl\"\npath = \"x.jsonl\"\nname = {}\ncategory = {}\n"
                    "train = 4\neval = 4\n".format(*names))
    out, _ = _ran(capsys, ["workload", "show", str(spec), "--head", "2"])
    _markup_shown(out, ("[/x]", "[bold]m[/bold]", "\\x1b[2J"))


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


# --- the escapes themselves ----------------------------------------------------------------------

ORDINARY = ["chat", "multilingual_math", "long-context 2", "ρ über", "Qwen2.5-7B"]


@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_names_pass_every_medium_unchanged(name):
    assert visible(name) == terminal(name) == markdown(name) == markdown_line(name) == plot_label(name) == name
    assert csv_cell(name) == name


def test_visible_shows_what_a_terminal_would_obey():
    assert visible("\x1b]0;title\x07") == "\\x1b]0;title\\x07"
    assert visible("a\nb\u2028c\u202ed") == "a\\nb\\u2028c\\u202ed"
    assert visible("a\nb\tc", keep="\n") == "a\nb\\tc"


def test_terminal_text_renders_as_written():
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    names = ["[/x]", "[link=http://x]y[/link]", "[bold]b[/bold]", "\\[bold]", "a [b] c"]
    for name in names:
        console.print(terminal(name))
    assert console.export_text().splitlines() == names


def test_markdown_carries_no_html_link_or_broken_table():
    assert markdown("<img src=x onerror=alert(1)> & co, r > 0.99") == "&lt;img src=x onerror=alert(1)> &amp; co, r > 0.99"
    assert markdown("[y](javascript:alert(1))") == "[y]\\(javascript:alert(1))"
    assert markdown_line("a|b\nc") == "a\\|b c"
    assert markdown("line\nnext\x1b") == "line\nnext\\x1b"


@pytest.mark.parametrize("cell, written", [
    ("=1+1", "'=1+1"), ("+cmd", "'+cmd"), ("@SUM(A1)", "'@SUM(A1)"), ("-2+3", "'-2+3"), ("\tx", "'\tx"),
    ("\r=x", "'\r=x"), ("-0.25", "-0.25"), ("+3", "+3"), ("-1e-05", "-1e-05"), ("-inf", "-inf"),
    (-0.25, -0.25), (-3, -3), ("a=b", "a=b"), ("", ""), ("a\x1b]0;title\x07", "a\\x1b]0;title\\x07"),
    ("\x1b[2J=x", "\\x1b[2J=x"), ("a\nb", "a\nb"),
])
def test_csv_cells_never_run_and_numbers_stay(cell, written):
    assert csv_cell(cell) == written


def test_write_csv_keeps_negative_numbers(tmp_path):
    from dwise_predict.files import write_csv

    write_csv(tmp_path / "t.csv", [{"category": "=1+1", "gain": -0.25, "text": "-0.5", "n": -3}])
    assert (tmp_path / "t.csv").read_text().splitlines() == ["category,gain,text,n", "'=1+1,-0.25,-0.5,-3"]


def test_plot_label_is_not_mathtext():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(plot_label("$\\frac{$ and $x$"))
    fig.canvas.draw()  # raises on mathtext that does not parse
    assert ax.title.get_text() == "\\$\\frac{\\$ and \\$x\\$"
    plt.close(fig)


# --- the session's new outputs: Table 12, the held-out category, D2F against base -----------------

def _no_html_acting(out_dir, md_payload="&lt;img src=x onerror=alert(1)>"):
    """The report's Markdown and HTML carry the names as text: no tag, no ESC, no BEL."""
    md = (out_dir / "report.md").read_text()
    html = (out_dir / "report.html").read_text()
    for text in (md, html):
        assert "<img src=x" not in text and "<script>" not in text and "\x1b" not in text and "\x07" not in text
    return md, html


def test_simulate_subset_table_and_both_batch_formers(bundle, world, tmp_path, capsys):
    names = [c for c in CATEGORIES if c.startswith(("=", "@"))]  # "[/x]" and "$\frac{$" in the subset's header
    sim = tmp_path / "sim"
    out, _ = _ran(capsys, ["simulate", str(world["traces"]), "--bundle", str(bundle), "--arrival", "burst",
                           "--requests", "0", "--policies", "sglang-default,fcfs-mixed,dwise-refined",
                           "--batch-former", "both", "--subset", ",".join(names), "--out", str(sim)])
    _markup_shown(out, ("[/x]", "[bold]b[/bold]", "$\\frac{$"))
    assert json.loads((sim / "simulate.json").read_text())["subset_table"]["subset"] == names
    md, html = _no_html_acting(sim)
    header = next(line for line in md.splitlines() if line.startswith("|  | =1+1"))
    assert header == "|  | =1+1 \\x1b]0;title\\x07 [/x], @SUM(A1) [bold]b[/bold] $\\frac{$ | other | all |"
    assert "<th>=1+1 \\x1b]0;title\\x07 [/x], @SUM(A1) [bold]b[/bold] $\\frac{$</th>" in html


def test_simulate_drop_category_sections(bundle, world, tmp_path, capsys):
    name = next(c for c in CATEGORIES if c.startswith("-"))
    sim = tmp_path / "sim"
    out, _ = _ran(capsys, ["simulate", str(world["traces"]), "--bundle", str(bundle), "--arrival", "burst",
                           "--requests", "0", "--policies", "sglang-default,dwise-refined",
                           f"--drop-category={name}", "--out", str(sim)])
    assert _flat(name) in _flat(out)
    rows = json.loads((sim / "simulate.json").read_text())["drop_category"]["rows"]
    assert {r["category"] for r in rows} == {name}
    md, html = _no_html_acting(sim)
    assert "| -2+3 &lt;img src=x onerror=alert(1)> &lt;script> |" in md
    assert "<td>-2+3 &lt;img src=x onerror=alert(1)&gt; &lt;script&gt;</td>" in html


def test_simulate_refuses_an_unknown_category_in_one_visible_line(world, capsys):
    assert main(["simulate", str(world["traces"]), "--drop-category="]) != 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err and "unknown category ''" in err
    assert "=1+1 \\x1b]0;title\\x07 [/x]" in err


def test_characterize_d2f_against_a_hostile_base(world, tmp_path, capsys):
    """The D2F table's labels come from the manifests' algorithm and parameters: shown, never obeyed."""
    import shutil

    dirs = {}
    for name, algorithm, config in (("d2f", "D2F", {"add_threshold": 0.5, "decode_threshold": 0.9,
                                                     "confidence_threshold": 1.0}),
                                    ("base", "LowConf \x1b]0;t\x07 <img src=x onerror=alert(1)> =1+1",
                                     {"threshold": "[bold]x[/bold] [/x] $\\frac{$"})):
        dirs[name] = shutil.copytree(world["traces"], tmp_path / name)
        manifest = json.loads((dirs[name] / "manifest.json").read_text())
        manifest["decoding"].update(algorithm=algorithm, algorithm_config=config)
        (dirs[name] / "manifest.json").write_text(json.dumps(manifest))
    char = tmp_path / "char"
    out, _ = _ran(capsys, ["characterize", str(dirs["d2f"]), str(dirs["base"]), "--split-decodings", "--out", str(char)])
    _markup_shown(out, ("[bold]x[/bold]", "[/x]", "\\x1b]0;t\\x07"))
    assert "D2F / base" in out
    md = (char / "characterization.md").read_text()
    html = (char / "characterization.html").read_text()
    for text in (md, html):
        assert "<img src=x" not in text and "\x1b" not in text and "\x07" not in text
    assert "| LowConf \\x1b]0;t\\x07 &lt;img src=x onerror=alert(1)> =1+1 threshold=[bold]x[/bold] [/x]" in md


def test_html_text_writes_control_characters_as_escapes():
    from dwise_predict.text import html_text

    assert html_text("a\x1b]0;t\x07 <b>\r\n\tc") == "a\\x1b]0;t\\x07 &lt;b&gt;\\r\n\tc"
    assert [html_text(n) for n in ORDINARY] == ORDINARY
