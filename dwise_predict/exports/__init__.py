"""Contract 2: predictor bundles (export, verify, zoo)."""
