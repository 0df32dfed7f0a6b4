"""The OpenAI-compatible HTTP server over SPD (`spd serve`).

backend.py  what the server needs from a decoder, and the single-process one over engine.stream()
text.py     incremental detokenization with stop strings
worker.py   one worker thread, one request at a time, a bounded queue in front of it
protocol.py request bodies, prompt encoding, response and chunk bodies
app.py      the FastAPI routes, errors, streaming, and `run()` under uvicorn
command.py  the `spd serve` typer command

Nothing here is imported by the rest of spd; fastapi and uvicorn are the `serve` extra.
"""
