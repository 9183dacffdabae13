"""Ways in to the engine besides the offline `LLM` class: an OpenAI-compatible HTTP server
(`entrypoints/openai/`, `python -m nanovllm_ref serve`) and an interactive chat shell (`entrypoints/chat.py`,
`python -m nanovllm_ref chat`). Both drive the same engine through its request API (`add_request`, `step`,
`abort_request`); neither schedules anything of its own."""
