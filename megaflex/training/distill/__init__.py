"""Distillation of a softmax checkpoint into a linear-attention student (``megaflex-distill``).

``cli``: config and entry point; ``objectives``: the two stages as trainer objectives;
``losses``: the per-layer and logits losses. See docs/distillation.md.
"""
