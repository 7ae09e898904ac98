"""Contract 2: predictor bundles (export, verify, zoo).

- ``manifest``: sealed ``bundle.json`` read/write and sha256 checks (standard library only; the
  serving hook imports it);
- ``run_files``: reading a training run directory;
- ``refine_export``: the calibrated ensemble as TorchScript, torch.export and ONNX (+ int8);
- ``admission_export``: LightGBM text model -> ONNX in rounds (not log space);
- ``bundle``: ``export`` orchestration; ``model_card``: the bundle's README.md;
- ``verify`` + ``probe_worker``: hashes, then every artifact in a fresh process against probes;
- ``zoo``: publish / list / show / pull on a directory; ``cli``: the typer commands.
"""
