"""Serving benchmarks: real vLLM servers with and without kvtier, driven by
vLLM's own benchmark client (``kvtier bench serve``, ``benchmarks/bench_serve.py``).

``server`` starts and stops one server process cleanly, ``prom`` reads its
``/metrics``, ``traffic`` writes the traces the client replays, ``peer_spec``
is vLLM's own CPU manager behind kvtier's worker (the peer), ``serving`` runs
the configurations and reports.
"""
