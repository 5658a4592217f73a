"""Qwen3-Coder XML tool calls and the tools' schemas they are parsed against (the parser's tests and the agent's)."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer"},
                    "limit": {"type": "integer"},
                },
            },
        },
    },
    {
        "name": "register",
        "parameters": {"type": "object", "properties": {"zip_code": {"type": "string"}, "age": {"type": "integer"}}},
    },
]

READ = (
    "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=offset>\n230.0\n"
    "</parameter>\n<parameter=limit>\n140\n</parameter>\n</function>\n</tool_call>"
)

REGISTER = (
    "<tool_call>\n<function=register>\n<parameter=zip_code>\n03106\n</parameter>\n<parameter=age>\n32\n"
    "</parameter>\n</function>\n</tool_call>"
)

BAD_OFFSET = READ.replace("230.0", "2026-01-15")
