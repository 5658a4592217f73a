"""The built-in generate functions: ``default`` (one engine call), ``multi_turn`` (a tool
loop, with its tools) and ``coding_agent`` (an agent in a sandbox, through the gateway).
"""
