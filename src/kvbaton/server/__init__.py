"""Processes: the router (HTTP API + cluster manager), worker processes, internal RPC and launchers."""
