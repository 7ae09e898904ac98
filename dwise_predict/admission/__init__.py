"""The admission predictor: LightGBM on prompt features (``model``), the feature matrix of a request
table (``features``), and the regressor comparison of seed 000, Table 9 (``compare``)."""
