"""The naive HF peer of benchmarks/serve_peers.py: one request at a time through transformers'
`generate`, behind the same streamed /v1/completions the other servers answer.

serve_peers.py runs it in a process of its own (`serve_peers.py --serve-hf FOLDER --port P`), so it
is measured like every other server; the baseline that says what batching and a KV cache buy.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from serve_peers_launch import SERVED


# ---- the naive HF server ---------------------------------------------------------------------
def serve_hf(folder: str, port: int, threads: int, dtype: str) -> None:
    """One request at a time through `model.generate`, streamed token by token."""
    import threading

    import torch
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    app = FastAPI()
    lock = asyncio.Lock()

    class QueueStreamer(BaseStreamer):
        def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
            self.loop, self.queue, self.prompt_seen = loop, queue, False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() first hands over the prompt
                self.prompt_seen = True
                return
            self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

        def end(self) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": SERVED, "object": "model", "owned_by": "hf"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tok(body["prompt"]).input_ids if isinstance(body["prompt"], str) else body["prompt"]
        max_tokens = int(body.get("max_tokens") or 16)
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False)
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens

        async def tokens():
            async with lock:  # naive: one request at a time
                queue: asyncio.Queue = asyncio.Queue()
                streamer = QueueStreamer(asyncio.get_running_loop(), queue)

                def work() -> None:
                    try:
                        with torch.no_grad():
                            model.generate(torch.tensor([ids]), streamer=streamer, **kwargs)
                    except Exception:  # noqa: BLE001
                        streamer.end()

                threading.Thread(target=work, daemon=True).start()
                while (item := await queue.get()) is not None:
                    for t in item:
                        yield t

        if not body.get("stream"):
            out = [t async for t in tokens()]
            return JSONResponse({"object": "text_completion", "model": SERVED, "choices": [
                {"index": 0, "text": tok.decode(out), "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}})

        async def sse():
            out: list[int] = []
            text = ""
            async for t in tokens():
                out.append(t)
                new = tok.decode(out)
                chunk = {"object": "text_completion", "model": SERVED,
                         "choices": [{"index": 0, "text": new[len(text):], "finish_reason": None}]}
                text = new
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
