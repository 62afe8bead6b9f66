"""megaflex.eval: the shipped evaluation product, ``megaflex-eval`` (``perplexity``) and
``megaflex-generate`` (``generate``), with the exact token scoring, the checkpoint loading and the
evaluation sets they share.

An entry-point layer: it may import the model, checkpoint, data, parallel and training packages;
nothing lower in megaflex imports it (``megaflex.hf``'s export and lm-eval tasks sit beside it)."""
