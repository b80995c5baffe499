"""ACME KV: a stand-in vendor store (a directory of files) with a hicache-storage connector."""
