"""Evaluation: how well the predictors rank work, on seen and unseen categories, against baselines.

- ``evaluate`` — one evaluation (main split, calibration, baselines, LOCO, output vs work) and its files;
- ``loco`` — leave-one-category-out plan and table; ``pool`` — retraining in a process pool;
- ``baselines`` — the comparison rows; ``characterize`` — Amin et al.'s workload measurements and Table 12;
  ``decodings`` — inputs grouped by decoding (block size, algorithm); ``stability`` — the DWISE paper's Table 11;
- ``inputs`` — loading several trace directories of one model;
- ``plots`` (matplotlib, Agg), ``document`` (HTML + Markdown rendering), ``report`` (the two reports,
  and writing a characterization).

The metrics themselves are :mod:`dwise_predict.metrics` (training reports them too); the commands
are in :mod:`dwise_predict.cli.evaluate`.
"""
