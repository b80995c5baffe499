"""Built-in connectors. Each module imports its client library lazily, inside the connector."""
