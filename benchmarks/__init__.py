"""The benchmarks, installed as ``hicache_storage.benchmarks``. Modules:

  :mod:`.multiturn`: multi-turn serving through the tiers, on the core's engine or a real vLLM one (``hicache-storage bench``).
  :mod:`.storage_io`: batch put / get / exists of one store, SDK vs its raw client (``hicache-storage bench-io``).
  :mod:`.stats`: percentiles and Markdown tables, shared by the two above.
  :mod:`.grid`: the multi-turn bench over stores x compute speeds, each store against its real server (a script).
  :mod:`.tree`: the radix tree's cost per round, ours vs SGLang's ``RadixCache`` (a script).
  :mod:`.kernels_cpu`: the CPU transfer path vs ``Tensor.copy_`` and ``numpy.copyto`` of the same bytes (a script).
  :mod:`.kernels_gpu`: the transfer kernels on a CUDA machine, checked and timed (a script; ``--dry-run`` on the CPU).

The scripts run as ``python benchmarks/NAME.py`` or ``python -m hicache_storage.benchmarks.NAME``.
Nothing in the SDK's modules or the core imports this package at module level: the CLI imports
``storage_io`` inside its ``bench-io`` command, and finds ``multiturn``'s ``bench`` command by entry
point (``hicache_storage.commands``), since it runs the core.
"""
