"""Contract 2: predictor bundles (export, verify, zoo).

- ``manifest``: sealed ``bundle.json`` read/write and sha256 checks (standard library only; the
  serving hook imports it);
- ``refine_export``: the calibrated ensemble as TorchScript, torch.export and ONNX (+ int8);
- ``admission_export``: LightGBM text model -> ONNX in rounds (not log space);
- ``bundle``: ``export`` orchestration; ``model_card``: the bundle's README.md;
- ``screen``: what every reader of a bundle runs before deserialising anything (known names, regular
  files, declared shapes, no pickle, code or path beyond what our exporter writes; standard library);
- ``verify`` + ``probe_worker``: hashes and the screen, then every artifact in a fresh process against probes;
- ``zoo``: publish / list / show / pull on a directory.

The run directory a bundle is exported from is read through :mod:`dwise_predict.runs` (exports
never import the training stack); the commands are in :mod:`dwise_predict.cli.bundles`.
"""
