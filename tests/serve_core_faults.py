"""The engine factory of tests/test_serve_faults.py (`serve --engine-factory serve_core_faults:engine`): the real
engine with its core in its own process; with `fail_with_seqs`, its scheduler raises a planted RuntimeError
in the core process at the first schedule() that finds that many sequences running, a few steps in (the
setting travels to the spawned core in the environment, which it inherits)."""
import os

from nanovllm_ref.engine.scheduler import Scheduler

ENV = "NANOVLLM_TEST_FAIL_WITH_SEQS"
STEPS_FIRST = 3                  # decode steps the full batch runs before the fault


class FailingScheduler(Scheduler):
    """The reference scheduler, until `ENV` sequences have run STEPS_FIRST steps together."""
    together = 0

    def schedule(self):
        want = int(os.environ.get(ENV, "0"))
        if want and len(self.running) >= want:
            self.together += 1
            if self.together > STEPS_FIRST:
                raise RuntimeError("planted fault: the scheduler failed mid-step")
        return super().schedule()


def engine(model, engine_core="process", fail_with_seqs=0, **engine_args):
    from nanovllm_ref.engine.llm_engine import LLMEngine
    from nanovllm_ref.entrypoints.openai.serving_engine import LLMEngineAdapter
    from nanovllm_ref.parts import Parts
    parts = Parts()
    if fail_with_seqs:
        os.environ[ENV] = str(fail_with_seqs)
        parts = Parts(scheduler=FailingScheduler)
    return LLMEngineAdapter(LLMEngine(model, parts=parts, engine_core=engine_core, **engine_args))
