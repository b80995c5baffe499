"""The multi-turn benchmark behind `hicache-storage bench`: workload, runner, report."""
