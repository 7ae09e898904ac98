"""The scheduling lab: traces replayed round by round under every scheduler (no server, no GPU).

``simulator`` (the replay, load and k sweeps, bootstrap over arrival seeds), ``schedulers`` (each a
configuration of the one policy class the server runs, :mod:`dwise_predict.serving.policy`),
``round_cost`` (the round-time model from a measured profile), ``batch_timeout`` (Amin et al.'s
batch-formation timeout), ``refine_every`` (refinement every N rounds, replayed from per-round
states), ``monitor_replay`` (the live quality monitor fed from traces, as the hook feeds it),
``work_ranking`` (ρ of each scheduler's ranking with the work; output length versus work by subset),
``report`` (table, CSV, JSON, plots). The runtime (:mod:`dwise_predict.serving`) never
imports this package.
"""
