"""`spd data`: self-distilled training data. `prompts` (where prompts come from, what is kept out),
`sample` (batched sampling, the fast path), `run` (rounds, resume, the JSONL file), `command`."""
