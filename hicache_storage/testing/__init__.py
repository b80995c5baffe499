"""Test support shipped with the SDK: real servers on loopback for connector tests and CI."""
