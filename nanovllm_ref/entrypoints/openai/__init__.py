"""The OpenAI-compatible server (serving chapter), in six parts, each one concept:

- `protocol.py`: the wire format, pydantic models of OpenAI's request and response bodies, and the error body;
- `serving_engine.py`: what the server needs from an engine (`ServingEngine`), and the adapter to `LLMEngine`;
- `sampling.py`: a request's fields mapped to `SamplingParams`, refusing by name what the engine cannot do;
- `serving.py`: request bodies to engine inputs (prompts, chat template, length rules), outputs to deltas;
- `engine_loop.py`: one background loop that owns the engine (continuous batching across HTTP clients);
- `api_server.py`: the FastAPI app, server-sent events, and `python -m nanovllm_ref serve`.

Follows vLLM's `vllm/entrypoints/openai/` (api_server.py, protocol.py, serving_completion.py, serving_chat.py).
"""
