"""megaflex: distributed language-model pretraining with Flexformer linear attention."""

__version__ = "0.1.0"
