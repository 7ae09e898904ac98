"""dwise-predict: workload predictors for diffusion-LLM serving schedulers."""

__version__ = "0.1.0"
