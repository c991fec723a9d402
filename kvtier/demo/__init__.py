"""kvtier's demo: a real vLLM engine with kvtier on a tiny local model.

``tiny_model`` builds the model (no downloads), ``engine`` starts vLLM on it
with or without kvtier, and ``chat`` runs the multi-turn chat workload behind
``kvtier demo``. Importing this package imports neither torch nor vLLM.
"""
