"""Contract 2, the predictor bundle: what every writer and reader of a bundle shares.

- ``manifest``: the sealed ``bundle.json``, read and written, and the sha256 checks; readers get it
  as a typed :class:`~dwise_predict.bundles.manifest.BundleManifest`, checked once (standard library
  only: the serving hook imports it);
- ``screen``: what every reader runs before deserialising anything (known names, regular files,
  declared shapes, no pickle, code or path beyond what our exporter writes; standard library);
- ``graph_bounds``: the screen's bound on what an ONNX graph can make onnxruntime compute (operators
  our exporters write, constants no larger than the weights, shapes of one batch axis times the
  declared sizes);
- ``load``: ``load_bundle``, the one loader: hashes, the screen, the model/decoding fingerprint, then
  ``admission`` and ``refine`` on numpy + onnxruntime (or the torch backend);
- ``zoo``: a zoo's reading side (its index, an entry, a pull), which the serving hook follows a zoo
  through; publishing is :mod:`dwise_predict.exports.zoo`'s.

:mod:`dwise_predict.exports` writes bundles through this package; :mod:`dwise_predict.serving` and
:mod:`dwise_predict.simulation` read them through it, and neither imports ``exports``.
"""
