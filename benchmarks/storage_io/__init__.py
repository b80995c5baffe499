"""The storage microbenchmark behind ``hicache-storage bench-io``. Modules:

  :mod:`.measure`: one store's put / get / exists throughput and latency, SDK paths vs the raw client, and host layouts.
  :mod:`.raw`: the raw baselines: each connector's own client doing the same I/O, and ``dd`` with O_DIRECT.
"""
