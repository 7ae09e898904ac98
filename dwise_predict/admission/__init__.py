"""The admission predictor: LightGBM on prompt features (``model``), the feature matrix of a request
table (``features``), and the regressor comparison of the DWISE paper, Table 9 (``compare``)."""
