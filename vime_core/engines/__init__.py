"""The vLLM fleet: servers, engine actors, the release adapter, external engines, the router and its
client, the health monitor, the weight-update sequence and recovery, LoRA serving, teacher engines, the worker
extension and the process guards. It knows nothing of groups, the data buffer or the group runner.
"""
