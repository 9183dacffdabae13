"""Entry point of a tensor-parallel worker process (rank >= 1), chapter 09.

It must live in an importable module: the `spawn` start method pickles the target by reference, and a
function defined in a notebook cell or __main__ cannot be found by the child.
"""


def run_worker(config, rank: int, conn, port: int) -> None:
    from nanovllm_ref.engine.model_runner import ModelRunner
    ModelRunner(config, rank, [conn], port)     # its __init__ enters the command loop and returns on "exit"
