"""Entry point of a tensor-parallel worker process (rank >= 1), chapter 09.

It must live in an importable module: the `spawn` start method pickles the target by reference, and a
function defined in a notebook cell or __main__ cannot be found by the child.
"""


def run_worker(config, rank: int, conn, port: int, parts=None) -> None:
    """Build this rank's ModelRunner (with the same parts as rank 0), then run the commands rank 0 sends
    until "exit"."""
    from nanovllm_ref.engine.model_runner import ModelRunner
    runner = ModelRunner(config, rank, [conn], port, parts)
    runner.loop()
