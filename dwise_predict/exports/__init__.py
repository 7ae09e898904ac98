"""Contract 2: predictor bundles (export, verify, zoo).

- ``refine_export``: the calibrated ensemble as TorchScript, torch.export and ONNX (+ int8);
- ``admission_export``: LightGBM text model -> ONNX in rounds (not log space);
- ``bundle``: ``export`` orchestration; ``model_card``: the bundle's README.md;
- ``verify`` + ``probe_worker``: hashes and the screen, then every artifact in a fresh process against probes;
- ``zoo``: publish / list / show / pull on a directory.

The manifest, the screen and the loader are :mod:`dwise_predict.bundles`, which this package writes
through. The run directory a bundle is exported from is read through :mod:`dwise_predict.runs` (exports
never import the training stack); the commands are in :mod:`dwise_predict.cli.bundles`.
"""
