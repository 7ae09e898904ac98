"""The evaluation report renders in a real browser with no network, and every image loads.

Uses headless Chromium from Debian's packages (`apt-get install chromium`); skipped with the reason
when /usr/bin/chromium is absent. A copy of the report gets a small script that, on load, writes the
number of images with a decoded size into the DOM, which `--dump-dom` prints.
"""

import subprocess
import tempfile
from pathlib import Path

import pytest

from dwise_predict.evaluation.evaluate import evaluate, write_evaluation
from evaluate_helpers import fixed_config, make_traces, write

CHROMIUM = Path("/usr/bin/chromium")
CHECK = (
    '<script>window.addEventListener("load", function () {'
    " var im = document.images, n = 0;"
    " for (var i = 0; i < im.length; i++) { if (im[i].complete && im[i].naturalWidth > 0) n++; }"
    ' var p = document.createElement("p"); p.id = "img-check";'
    ' p.textContent = "loaded " + n + " of " + im.length; document.body.appendChild(p); });</script>'
)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `apt-get install -y chromium` to run the browser check")
def test_report_renders_and_every_image_loads(tmp_path):
    traces = write(make_traces(), tmp_path / "traces")
    out = tmp_path / "eval"
    written = write_evaluation(evaluate([traces], hold_out="mcq", jobs=1, config=fixed_config()), out)
    html = written["report_html"].read_text()
    assert "<script" not in html  # the report itself is static
    page = tmp_path / "check.html"
    page.write_text(html.replace("</body>", CHECK + "</body>"))
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
             "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120,
        ).stdout
    n_images = html.count("<img ")
    assert n_images == 7  # no survival-curve figure: the fixed config ships ridge, geometric by construction
    assert f'<p id="img-check">loaded {n_images} of {n_images}</p>' in dom
    assert "Leave one category out" in dom and "Baselines" in dom
