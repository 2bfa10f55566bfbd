"""Sequence-tiled recompute: a decoder layer run `recompute_tokens` tokens at a time (layer.py: the tile skeleton and
the attention hook; attention.py: one query tile against its keys; mlp.py: the MLP in tiles). No offload, no TRL."""
