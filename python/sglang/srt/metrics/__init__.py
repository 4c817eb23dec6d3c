"""Prometheus text metrics of the server."""
