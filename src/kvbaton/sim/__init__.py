"""Discrete-event cluster simulator that runs the real scheduler, caches, router policies and handoff protocol.

Entry points: `simulate(requests, SimSetup(...))` (run.py) for named setups, `ClusterSim` (cluster.py)
for full control, `create_cost_model` (costs) and `parse_cluster_spec` (spec.py); `kvbaton sim` is
`add_sim_arguments` / `run_sim` in cli.py. No torch, fastapi or zmq anywhere in this package.
"""
