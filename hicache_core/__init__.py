"""The HiCache core: host KV pool, three-tier radix tree, cache controller, reference engine."""
