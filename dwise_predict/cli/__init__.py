"""The `dwise-predict` command line: one typer app (:mod:`.app`), one module per command group.

=================  =========================================================
module             commands
=================  =========================================================
``collect``        ``collect``, ``traces merge|show``, ``workload show``
``dllm``           ``dllm train-tiny``
``train``          ``train``, ``compare-regressors``
``evaluate``       ``evaluate``, ``characterize``
``bundles``        ``export``, ``verify``, ``publish``, ``zoo list|show|pull``
``simulate``       ``simulate``
``round_profile``  ``profile-rounds``
``batch_timeout``  ``batch-timeout``
``serve``          ``serve``
``quickstart``     ``quickstart``
``refresh``        ``refresh``
``options``        option types and output helpers they share
=================  =========================================================

Commands are thin: they validate options, call one library function, and print. Nothing outside
this package imports it.
"""

from dwise_predict.cli.app import app, main

__all__ = ["app", "main"]
