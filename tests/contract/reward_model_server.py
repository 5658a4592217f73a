"""A reward-model HTTP service for the ``remote`` reward's tests (FastAPI + uvicorn, 127.0.0.1 only).

``POST /score`` scores by a rule: 1.0 if the response equals the label (trimmed, case-insensitive), else 0.0, as
``{"reward": x}``. Fields of the sample's ``metadata`` steer it, so the tests can drive real failure modes:
``delay_s`` (answer after this many seconds), ``fail_first`` (the first N requests with this ``id`` get 503),
``status`` (answer with this HTTP status), ``raw`` (answer this JSON body instead). ``GET /stats`` gives the
requests seen (``id``, arrival time) and the most requests ever in flight at once; ``POST /reset`` clears them;
``GET /last`` returns the last request body.

Run: ``python reward_model_server.py PORT``.
"""

import asyncio
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()
state = {"inflight": 0, "max_inflight": 0, "requests": [], "last": None}


@app.get("/health")
async def health():
    return {"ok": True}


@app.get("/stats")
async def stats():
    return {"max_inflight": state["max_inflight"], "requests": state["requests"]}


@app.get("/last")
async def last():
    return state["last"]


@app.post("/reset")
async def reset():
    state.update(inflight=0, max_inflight=0, requests=[], last=None)
    return {"ok": True}


@app.post("/score")
async def score(request: Request):
    body = await request.json()
    meta = body.get("metadata") or {}
    state["last"] = body
    state["requests"].append({"id": meta.get("id"), "t": time.monotonic()})
    state["inflight"] += 1
    state["max_inflight"] = max(state["max_inflight"], state["inflight"])
    try:
        await asyncio.sleep(float(meta.get("delay_s", 0.0)))
        seen = sum(1 for r in state["requests"] if r["id"] == meta.get("id"))
        if seen <= int(meta.get("fail_first", 0)):
            return JSONResponse({"error": "warming up"}, status_code=503)
        if "status" in meta:
            return JSONResponse({"error": f"status {meta['status']} as asked"}, status_code=int(meta["status"]))
        if "raw" in meta:
            return JSONResponse(meta["raw"])
        same = str(body.get("response", "")).strip().lower() == str(body.get("label", "")).strip().lower()
        return {"reward": 1.0 if same else 0.0}
    finally:
        state["inflight"] -= 1


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
