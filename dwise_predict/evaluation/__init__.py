"""Evaluation: how well the predictors rank work, on seen and unseen categories, against baselines.

- ``metrics`` — every metric as a pure function (ρ, τ, within-category, bootstrap CI, R², C-td, Brier);
- ``evaluate`` — one evaluation (main split, calibration, baselines, LOCO, output vs work) and its files;
- ``loco`` — leave-one-category-out plan and table; ``pool`` — retraining in a process pool;
- ``baselines`` — the comparison rows; ``characterize`` — seed 001's workload measurements and Table 12;
- ``inputs`` — loading several trace directories of one model; ``files`` — atomic result files;
- ``plots`` (matplotlib, Agg), ``document`` (HTML + Markdown rendering), ``report`` (the two reports);
- ``cli`` — the ``evaluate`` and ``characterize`` commands.
"""
