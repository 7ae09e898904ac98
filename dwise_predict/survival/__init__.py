"""Discrete-time survival refinement: network, label transform, loss, ensemble, calibration."""
