"""The HTTP server on the shipped forward, and the traffic it records (``tkcc serve --http``).

    app.py        the OpenAI routes (Starlette): completions, chat, models, health, metrics, admin
    protocol.py   request bodies (pydantic, strict) and OpenAI-format errors
    scheduler.py  the one thread that runs model steps; bounded FIFO queue; swaps between requests
    stops.py      max_tokens, end-of-sequence and stop strings; the text a request streams
    tokenizer.py  HF tokenizers from the model directory; bytes for the random-weight models
    recorder.py   the rolling tkcc trace of served requests (prefix-block hashes)
    routing.py    per-layer MoE expert counts from the captured graph's routers
    metrics.py    Prometheus metrics
    swap.py       building a shipped candidate beside the serving forward, and swapping it in
    watching.py   --watch: re-optimise on drift of the server's own trace
    server.py     Server: all of it for one model; runner.py: uvicorn on a socket

What it serves is built in the API layer and handed in: ``tkcc.commands.http_forwards`` (models,
tkcc.compile and tkcc.load for the server) and ``tkcc.commands.http_cmd`` (the `tkcc serve --http` flags).

See docs/serve.md.
"""
