"""The multi-turn benchmark behind ``hicache-storage bench``. Modules:

  :mod:`.command`: the ``bench`` command, added to the SDK's CLI by entry point.
  :mod:`.workload`: the multi-turn workload, shaped like SGLang's ``bench_multiturn``.
  :mod:`.runner`: one workload under several tier configurations, side by side; the presets.
  :mod:`.bound`: the simple bound a run is held to, from its legs measured in the same run (efficiency).
  :mod:`.reachable`: the bound it could reach: each round's dependencies, L1, the shared machine, the best load-or-recompute choice.
  :mod:`.experiments`: the branch-backup and pre-filled-L3 experiments, as bench modes.
  :mod:`.report`: tables (Markdown), JSON and plots of a run.
  :mod:`.vllm_engine`: the same workload on a real vLLM engine, L3 off vs on (``--engine vllm``, in vLLM's environment).
"""
