"""Shared value types: config, requests, sampling parameters, step plans and results, errors."""
