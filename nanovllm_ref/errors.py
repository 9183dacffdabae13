"""The error of a request the engine cannot run: `RequestError`, a ValueError that names the argument at fault.

SamplingParams (its value checks) and `check_request` (engine/request.py: the prompt against the vocabulary,
max_model_len and the KV cache; settings the engine cannot honour) raise it, so a caller that must say which
of *its own* inputs is wrong reads `exc.field` instead of parsing the message: the HTTP server maps it to the
request body's field (`max_tokens` -> `max_completion_tokens`, `prompt` -> `messages`, ...). Offline it reads
as any ValueError: `str(exc)` is the message.
"""


class RequestError(ValueError):
    """A request refused before it changed anything.

    field: str, the argument at fault as the engine's API names it: "prompt", or a SamplingParams field
    ("temperature", "max_tokens", "stop_token_ids", "logprobs", ...). message: str, what is wrong and what
    is allowed; also `str(exc)`.
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message

    def __reduce__(self):                      # pickles with both arguments (args holds only the message)
        return type(self), (self.field, self.message)


class RequestTypeError(RequestError, TypeError):
    """A RequestError for a value of the wrong type; also a TypeError, so `except TypeError` still catches it."""
