"""The conformance suite every connector runs: a pytest plugin and a report."""
